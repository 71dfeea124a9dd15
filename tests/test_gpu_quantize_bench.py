"""scripts/gpu_quantize_bench.py end to end on the CPU with a tiny Qwen2-shaped config: random weights written,
``quantize_model`` run through its phases, the checkpoint checked, timings in the JSON; and a failing run
still leaves a JSON that says why, with its temporary directories removed."""

from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from tests.conftest import REPO

TINY = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 512,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "initializer_range": 0.02, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
        "hidden_act": "silu"}


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gpu_quantize_bench", REPO / "scripts" / "gpu_quantize_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _args(tmp_path, *extra):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    return ["--config", str(cfg), "--tokenizer", "demo", "--device", "cpu", "--calib", "calib", "--samples", "2",
            "--seqlen", "32", "--layers", "1", "--out", str(tmp_path / "out"), "--workdir", str(tmp_path / "work"),
            *extra]


def test_cpu_end_to_end(bench, tmp_path, capsys):
    res = bench.main(_args(tmp_path, "--keep"))
    printed = capsys.readouterr().out
    saved = json.loads((tmp_path / "out" / "gpu_quantize_bench.json").read_text())
    assert res["status"] == saved["status"] == "done", saved["status"]
    assert saved["num_layers"] == 1 and saved["layers_done"] == 1     # --layers 1 truncated the 2-layer config
    assert "layer 1/1 outputs" in printed and "ETA 0s" in printed and "quantize end to end" in printed
    assert saved["calibration"]["tokens"] == 2 * 32
    assert "shipped" in saved["calib_text"] and "shipped" in saved["calibration"]["source"]

    phases = saved["phases"]
    for key in ("tokenizer_s", "calib_windows_s", "load_s", "layers_s", "pack_s", "write_s", "finish_s"):
        assert phases[key] >= 0, key
    assert 0 < phases["layers_s"] <= saved["quantize_s"] <= saved["script_s"]
    assert saved["build"]["seconds"] > 0 and saved["build"]["dtype"] == "bfloat16" and saved["peak_host_gib"] > 0
    layer = saved["layers"][0]
    assert list(layer["stages"]) == ["qkv", "o", "gate_up", "down", "outputs"]
    assert layer["gptq_s"] > 0 and layer["collect_s"] > 0 and layer["hessian_s"] > 0
    assert 0 < layer["layer_error"] < 1 and set(layer["errors"]) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}

    q_dir = tmp_path / "work" / saved["workdir"].rsplit("/", 1)[1] / "quantized"
    assert saved["check"]["ok"] and saved["check"]["qweight_tensors"] == 7
    wrong = bench.check_output(q_dir, SimpleNamespace(method="gptq", bits=8, group_size=128), 2, {})
    assert not wrong["ok"] and len(wrong["problems"]) == 2      # bits differ; layer 1 has no qweight
    qc = json.loads((q_dir / "config.json").read_text())["quantization_config"]
    assert (qc["quant_method"], qc["bits"], qc["group_size"], qc["sym"]) == ("gptq", 4, 128, True)
    with safe_open(str(q_dir / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        qweight = f.get_tensor("model.layers.0.mlp.down_proj.qweight")
    assert "model.layers.0.mlp.down_proj.weight" not in keys and "model.layers.1.mlp.down_proj.qweight" not in keys
    assert qweight.dtype == torch.int32 and tuple(qweight.shape) == (256 // 8, 128)
    # the random source checkpoint: HF names, bf16, HF-like init (norms 1, matrices ~N(0, 0.02))
    src = next(p for p in (tmp_path / "work").glob("*/*") if p.name != "quantized")
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        w = f.get_tensor("model.layers.0.mlp.gate_proj.weight").float()
        assert torch.equal(f.get_tensor("model.norm.weight").float(), torch.ones(128))
    assert 0.015 < w.std().item() < 0.025


def test_failure_is_recorded_and_cleaned_up(bench, tmp_path):
    with pytest.raises(ValueError, match="group size 96 fits none"):
        bench.main(_args(tmp_path, "--group-size", "96"))
    saved = json.loads((tmp_path / "out" / "gpu_quantize_bench.json").read_text())
    assert saved["status"].startswith("failed: QuantizeError") and saved["workdir_deleted"]
    assert not any((tmp_path / "work").iterdir())


def test_cpu_mixture_of_experts(bench, tmp_path):
    """A Qwen3-MoE config: the random checkpoint has a tensor per expert and projection (transformers 5 stacks them
    in memory), every expert is quantized and checked, and the layer's errors are its stages' (experts' mean)."""
    moe = {**TINY, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "head_dim": 64,
           "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128, "norm_topk_prob": True}
    cfg = tmp_path / "moe.json"
    cfg.write_text(json.dumps(moe))
    args = _args(tmp_path, "--keep")
    args[args.index("--config") + 1] = str(cfg)
    saved = bench.main(args)
    assert saved["status"] == "done", saved["status"]
    assert saved["check"]["ok"] and saved["check"]["qweight_tensors"] == 4 + 4 * 3
    layer = saved["layers"][0]
    assert 0 < layer["errors"]["gate_up_proj"] < 1 and 0 < layer["errors"]["down_proj"] < 1
    src = next(p for p in (tmp_path / "work").glob("*/*") if p.name != "quantized")
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        assert tuple(f.get_tensor("model.layers.0.mlp.experts.3.up_proj.weight").shape) == (128, 128)
        assert "model.layers.0.mlp.experts.gate_up_proj" not in set(f.keys())
