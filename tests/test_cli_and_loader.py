"""`nvllm generate` as a user runs it, and every bad input ending in one clear line and a non-zero exit."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from nvllm import LLM
from nvllm.assets import demo_model_path
from nvllm.config import ConfigError
from tests.conftest import build_tiny_model


def nvllm(*args: str, timeout: int = 120, columns: int = 200) -> subprocess.CompletedProcess:
    env = dict(os.environ, COLUMNS=str(columns))
    return subprocess.run([sys.executable, "-m", "nvllm.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_generate_demo_model_default():
    r = nvllm("generate", "--max-tokens", "20", "--log-stats-interval", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Once upon a time, there was a little girl named Lily")
    assert "kernel report" in r.stderr and "torch reference" in r.stderr
    assert "finish_reason=length" in r.stderr


def test_commands_that_never_serve_start_without_the_server_libraries():
    """`nvllm generate` (as quantize and eval) loads neither FastAPI nor uvicorn: a machine without them (an
    inference-only image) still runs it, and the CLI starts without their import time."""
    blocker = (
        "import importlib.abc, sys\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in ('fastapi', 'uvicorn', 'starlette', 'prometheus_client'):\n"
        "            raise ImportError('not installed: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "sys.argv[0] = 'nvllm'\n"
        "from nvllm.cli import app\n"
        "app()\n")
    r = subprocess.run([sys.executable, "-c", blocker, "generate", "--max-tokens", "6", "--log-stats-interval", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("Once upon a time, there was")


@pytest.mark.parametrize("args, message", [
    (["--model", "/no/such/dir"], "model directory not found"),
    (["--tokenizer", "/no/such/tok"], "tokenizer directory not found: /no/such/tok"),
    (["--load-format", "pt"], "no weight files (*.bin, *.pt) in"),
    (["--temperature", "-1"], "temperature must be a non-negative finite number"),
    (["--temperature", "nan"], "temperature must be a non-negative finite number, got nan"),
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--kv-cache-memory", "nan"], "kv_cache_memory must be a positive number of GiB, got nan"),
    (["--log-stats-interval", "inf"], "log_stats_interval must be a non-negative number of seconds (0: off), got inf"),
    (["--max-tokens", "0"], "max_tokens must be at least 1"),
    (["--dtype", "int3"], "unknown dtype"),
    (["--max-model-len", "8", "Once upon a time there was a big dog"], "max_model_len is 8"),
    (["--device", "tpu"], "unknown device 'tpu'; use auto, cpu, cuda or cuda:N"),
    (["--device", "cuda:99"], "device cuda:99 requested but"),
    (["--logprobs", "513"], "logprobs must be at most the vocabulary size 512, got 513"),
    (["--repetition-penalty", "0"], "repetition_penalty must be a number greater than 0 within float32's range"),
    (["--presence-penalty", "3"], "presence_penalty must be in [-2, 2], got 3.0"),
    (["--hf-overrides", '{"num_hidden_layers": "abc"}'],   # transformers' reason is on its message's second line
     "--hf-overrides: Validation error for field 'num_hidden_layers': TypeError: Field 'num_hidden_layers' expected "
     "int, got str"),
    (["--hf-overrides", '{"max_position_embeddings": -5}'],
     "config.json: max_position_embeddings must be a positive integer, got -5"),
    (["--num-kv-blocks", "100000000000"], "a KV cache of 100000000000 blocks (1907348.63 GiB) does not fit in cpu's"),
])
def test_generate_bad_input(args, message):
    r = nvllm("generate", *args)
    assert r.returncode == 2
    assert message in " ".join(r.stderr.split())
    assert "Traceback" not in r.stderr


def test_a_prompt_over_the_tokenizers_length_gets_only_nvllms_error():
    """transformers warns when a text encodes past the tokenizer's model_max_length (512 for the demo model, whatever
    length is served): nvllm's own check is the one line a too-long prompt gets."""
    r = nvllm("generate", "Once upon a time " * 300)
    assert r.returncode == 2 and "prompt has 1202 tokens; max_model_len is 512" in r.stderr
    assert "Token indices sequence length" not in r.stderr


def test_generate_penalties():
    """--presence-penalty, --frequency-penalty, --repetition-penalty: what the LLM API gives for the same values."""
    from nvllm import SamplingParams

    kw = dict(presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=1.3)
    r = nvllm("generate", "--max-tokens", "30", "--log-stats-interval", "0",
              *[a for k, v in kw.items() for a in (f"--{k.replace('_', '-')}", str(v))])
    assert r.returncode == 0, r.stderr
    want = LLM(log_stats_interval=0, device="cpu").generate(["Once upon a time"], SamplingParams(
        max_tokens=30, temperature=0, **kw), use_tqdm=False)[0].outputs[0].text
    assert r.stdout == f"Once upon a time{want}\n" and not r.stdout.startswith(
        "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One day")


def test_generate_prints_the_top_logprobs():
    """--logprobs N: each token's logprob, then the N most likely tokens; --log-stats-interval 0: no stats lines."""
    r = nvllm("generate", "--max-tokens", "3", "--logprobs", "2", "--log-stats-interval", "0")
    assert r.returncode == 0, r.stderr
    lines = [line.split("top: ") for line in r.stderr.splitlines() if "top: " in line]
    assert len(lines) == 3, r.stderr
    for chosen, top in lines:
        values = re.findall(r"-?\d+\.\d{4}", top)
        assert len(values) == 2 and float(values[0]) >= float(values[1])
        assert chosen.rstrip().endswith(values[0])  # greedy: the chosen token is the most likely
    assert "running: " not in r.stderr


def test_bad_input_is_one_line_on_a_narrow_console():
    """A log or a pipe reads the error as one line: the console does not break it at its width."""
    r = nvllm("generate", "--top-p", "1.5", columns=30)
    assert r.returncode == 2
    assert [line for line in r.stderr.splitlines() if line.strip()] == ["error: top_p must be in (0, 1], got 1.5"], r.stderr


def test_a_model_without_a_tokenizer_is_one_line(tmp_path):
    src = tmp_path / "m"
    shutil.copytree(demo_model_path(), src)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (src / name).unlink()
    r = nvllm("generate", "--model", str(src))
    assert r.returncode == 2 and r.stderr.strip() == f"error: no tokenizer in {src} (no tokenizer.json, " \
        "tokenizer_config.json, vocab or .model file)", r.stderr


def test_hf_overrides_reach_the_model(model_copy):
    """--hf-overrides replaces config.json fields (here the context length) in the API and the CLI; bad values,
    and a config.json that is not JSON, end in one line naming them."""
    assert load(model_copy, hf_overrides={"max_position_embeddings": 48}).engine.max_model_len == 48
    r = nvllm("generate", "--model", str(model_copy), "--hf-overrides", '{"max_position_embeddings": 40}',
              "--max-tokens", "100", "--log-stats-interval", "0")
    assert r.returncode == 0 and "max_model_len 40" in " ".join(r.stderr.split()), r.stderr
    for value, message in (("[1]", "must be a JSON object"), ("{bad", "hf_overrides is not valid JSON")):
        r = nvllm("generate", "--model", str(model_copy), "--hf-overrides", value)
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    (model_copy / "config.json").write_text("{bad")
    r = nvllm("generate", "--model", str(model_copy))
    assert r.returncode == 2 and f"cannot read {model_copy}/config.json" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_empty_prompt_cli():
    r = nvllm("generate", "")
    assert r.returncode == 2 and "prompt is empty" in r.stderr


@pytest.fixture()
def model_copy(tmp_path):
    return build_tiny_model("llama", tmp_path / "m")


def load(path, **kw):
    return LLM(str(path), device="cpu", log_stats_interval=0, **kw)


def test_unknown_architecture(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unsupported architecture"):
        load(model_copy)


def test_truncated_weights(model_copy):
    f = model_copy / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match="truncated or corrupt"):
        load(model_copy)


def test_missing_weights_file(model_copy):
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="no weight files"):
        load(model_copy)


def test_missing_tensor_and_shape_mismatch(model_copy):
    f = model_copy / "model.safetensors"
    state = load_file(f)
    dropped = dict(state)
    del dropped["model.layers.1.mlp.up_proj.weight"]
    save_file(dropped, f)
    with pytest.raises(ConfigError, match="missing tensors: layers.1.gate_up_proj.weight\\[shard 1\\]"):
        load(model_copy)
    bad = dict(state)
    bad["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(bad, f)
    with pytest.raises(ConfigError, match="shape mismatch for 'model.layers.0.self_attn.k_proj.weight'"):
        load(model_copy)


def test_pickle_refused_unless_allowed(model_copy):
    f = model_copy / "model.safetensors"
    torch.save(load_file(f), model_copy / "pytorch_model.bin")
    f.unlink()
    with pytest.raises(ConfigError, match="--allow-pickle"):
        load(model_copy)
    llm = load(model_copy, allow_pickle=True)
    assert llm.generate([[1, 2, 3]], use_tqdm=False)[0].outputs[0].token_ids


def test_sharded_safetensors(model_copy):
    f = model_copy / "model.safetensors"
    state = load_file(f)
    names = sorted(state)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for shard, keys in shards.items():
        save_file({k: state[k] for k in keys}, model_copy / shard)
    (model_copy / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: s for s, keys in shards.items() for k in keys}}))
    want = load(model_copy).generate([[1, 5, 9]], use_tqdm=False)[0].outputs[0].token_ids
    f.unlink()
    got = load(model_copy).generate([[1, 5, 9]], use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
    os.remove(model_copy / "model-00002-of-00002.safetensors")
    with pytest.raises(ConfigError, match="missing"):
        load(model_copy)


def test_mistrals_consolidated_file_beside_the_hf_weights_is_not_read(model_copy, tmp_path, monkeypatch):
    """Mistral's repositories hold consolidated.safetensors (the same weights under Mistral's names) next to the
    Hugging Face files. As transformers does, the engine and quantize read model.safetensors (or the index's shards)
    only, and the Hub download leaves the consolidated file out."""
    want = load(model_copy).generate([[1, 5, 9]], use_tqdm=False)[0].outputs[0].token_ids
    state = load_file(model_copy / "model.safetensors")
    mistral = {k.replace("model.layers.", "layers.").replace("self_attn.q_proj", "attention.wq"): v
               for k, v in state.items()}
    save_file(mistral, model_copy / "consolidated.safetensors")
    assert load(model_copy).generate([[1, 5, 9]], use_tqdm=False)[0].outputs[0].token_ids == want

    from nvllm.quant.quantize import quantize_model
    from nvllm.quant.recipe import build_config

    cfg = build_config(None, method="rtn", group_size=32, calib_dataset="calib", calib_samples=2, calib_seqlen=32)
    summary = quantize_model(str(model_copy), str(tmp_path / "q"), cfg)
    assert summary.size_before == (model_copy / "model.safetensors").stat().st_size

    import huggingface_hub

    from nvllm.models.hub import resolve_model_path

    asked = {}
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda **kw: asked.update(kw) or str(model_copy))
    assert resolve_model_path("mistralai/Mistral-7B-Instruct-v0.3") == str(model_copy)
    assert "*.safetensors" in asked["allow_patterns"] and asked["ignore_patterns"] == ["consolidated*"]


def test_unindexed_files_are_read_together_but_not_when_they_overlap(model_copy, tmp_path):
    """A directory another tool wrote (several *.safetensors, no index, no model.safetensors) loads as one
    checkpoint; when two of its files hold the same tensor nothing says which is meant, and the engine and quantize
    stop with one line instead of letting one copy win."""
    want = load(model_copy).generate([[1, 5, 9]], use_tqdm=False)[0].outputs[0].token_ids
    f = model_copy / "model.safetensors"
    state = load_file(f)
    names = sorted(state)
    save_file({k: state[k] for k in names[:3]}, model_copy / "part-a.safetensors")
    save_file({k: state[k] for k in names[3:]}, model_copy / "part-b.safetensors")
    f.unlink()
    assert load(model_copy).generate([[1, 5, 9]], use_tqdm=False)[0].outputs[0].token_ids == want

    save_file({names[5]: torch.zeros_like(state[names[5]])}, model_copy / "part-c.safetensors")
    with pytest.raises(ConfigError, match=f"tensor {names[5]} is in both part-b.safetensors and part-c"):
        load(model_copy)
    r = nvllm("quantize", "--model", str(model_copy), "--method", "rtn", "--group-size", "32",
              "--out", str(tmp_path / "q"))
    assert r.returncode != 0 and f"tensor {names[5]} is in both" in r.stderr, r.stderr
    assert not (tmp_path / "q").exists()


def test_dummy_load_format_needs_only_config(tmp_path, model_copy):
    d = tmp_path / "cfg_only"
    d.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_copy / name, d / name)
    out = load(d, load_format="dummy").generate([[1, 2]], use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 16
