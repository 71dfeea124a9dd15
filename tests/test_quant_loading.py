"""Serving quantized checkpoints: AWQ-GEMM and GPTQ (4/8-bit, act-order) checkpoints laid out as
AutoAWQ / AutoGPTQ write them (separate q/k/v and gate/up projections) load into the fused QuantLinear layers
and compute what HF transformers computes with the dequantized weights; the engine generates from them with
``quant_gemm`` in its kernel report."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from nvllm import SamplingParams
from nvllm.config import ConfigError
from nvllm.kernels import report
from nvllm.layers.quant_linear import QuantLinear
from nvllm.quant import formats as F
from nvllm.quant.replay import model_logits
from tests.conftest import build_tiny_model, make_llm
from tests.quant_utils import PROJ, hf_greedy, hf_logits, load_nvllm_model, write_by_hand

# (id, fmt, bits, group, sym, act_order)
FORMATS = [
    ("awq4-g32", "awq", 4, 32, False, False),
    ("gptq4-g32-sym", "gptq", 4, 32, True, False),
    ("gptq4-g64-asym-actorder", "gptq", 4, 64, False, True),
    ("gptq8-g32-sym", "gptq", 8, 32, True, False),
]


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    # Qwen2: qkv bias; GQA (q 64, k/v 32); intermediate 128 so every linear packs at g32/g64
    return build_tiny_model("qwen2", tmp_path_factory.mktemp("q") / "qwen2", intermediate_size=128)


@pytest.mark.parametrize("case", FORMATS, ids=[c[0] for c in FORMATS])
def test_checkpoint_matches_dequantized_hf(tmp_path, qwen2_dir, case):
    _, fmt, bits, group, sym, act_order = case
    dst = tmp_path / "quant"
    deq = write_by_hand(qwen2_dir, dst, fmt, bits, group, sym, act_order)
    model = load_nvllm_model(dst)
    quant = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(quant) == 4 * 2 and all(m.scheme.fmt == fmt and m.scheme.bits == bits for m in quant)
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    ours = model_logits(model, ids)
    ref = hf_logits(qwen2_dir, ids, deq)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    if act_order:
        assert any(m.quant_weight().g_idx is not None for m in quant)


def test_triton_kernel_through_the_layer(tmp_path, qwen2_dir, monkeypatch):
    """Each loaded QuantLinear through the Triton kernel (CPU interpreter) equals its dequantized matmul."""
    dst = tmp_path / "quant"
    write_by_hand(qwen2_dir, dst, "gptq", 4, 32, sym=False, act_order=True)
    layer = load_nvllm_model(dst).layers[0]
    monkeypatch.setenv("NVLLM_KERNELS", "triton")
    report.reset()
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    for lin in (layer.qkv_proj, layer.gate_up_proj):
        want = x @ lin.quant_weight().dequantize().t() + (0 if lin.bias is None else lin.bias)
        torch.testing.assert_close(lin(x), want, rtol=1e-5, atol=1e-5)
    assert any(impl.startswith("triton") for impl in report.snapshot()["quant_gemm"])


def test_awq_layers_run_in_the_gptq_layout(tmp_path, qwen2_dir, monkeypatch):
    """AWQ layers are repacked in place into the GPTQ v1 layout when loaded (the one-row GEMV reads only that
    layout): same parameter shapes, the same weight, the kernel report names both; reloading is refused."""
    dst = tmp_path / "quant"
    write_by_hand(qwen2_dir, dst, "awq", 4, 32)
    layer = load_nvllm_model(dst).layers[0]
    lin = layer.gate_up_proj
    qw = lin.quant_weight()
    assert (qw.fmt, qw.extra, tuple(lin.qweight.shape)) == ("gptq", {"from": "awq"}, (64, 256 // 8))
    awq = load_file(dst / "model.safetensors")
    gate = awq["model.layers.0.mlp.gate_proj.qweight"]
    deq = F.dequantize_awq(gate, awq["model.layers.0.mlp.gate_proj.qzeros"],
                           awq["model.layers.0.mlp.gate_proj.scales"], 32)
    torch.testing.assert_close(qw.dequantize()[:128], deq)
    monkeypatch.setenv("NVLLM_KERNELS", "triton")
    report.reset()
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(2))
    y = lin(x)
    torch.testing.assert_close(y, x @ qw.dequantize().t(), rtol=2e-3, atol=2e-3 * float(y.abs().max()))
    assert report.snapshot()["quant_gemm"] == {"triton w4a16 awq as gptq gemv": 1}
    with pytest.raises(ConfigError, match="load the checkpoint before running the model"):
        lin.load_tensor("qweight", 0, gate, "model.layers.0.mlp.gate_proj.qweight")


def test_engine_generates_with_quant_gemm(tmp_path, qwen2_dir):
    dst = tmp_path / "quant"
    deq = write_by_hand(qwen2_dir, dst, "awq", 4, 32)
    llm = make_llm(str(dst))
    report.reset()
    prompt = [1, 17, 42, 99, 7]
    got = llm.generate([prompt], _greedy(8), use_tqdm=False)[0].outputs[0].token_ids
    assert "quant_gemm" in report.snapshot()
    assert got == hf_greedy(qwen2_dir, prompt, 8, deq)


def test_hf_overrides_replace_the_quantization_config(tmp_path, qwen2_dir):
    """--hf-overrides of quantization_config is what the loader serves, as vLLM builds its quantization from the
    overridden config: a checkpoint whose config.json misstates its bits loads right with the fix given there."""
    dst = tmp_path / "quant"
    deq = write_by_hand(qwen2_dir, dst, "gptq", 4, 32, True)
    cfg = json.loads((dst / "config.json").read_text())
    right = dict(cfg["quantization_config"])
    cfg["quantization_config"]["bits"] = 8
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError):
        make_llm(str(dst))
    prompt = [1, 17, 42, 99, 7]
    got = make_llm(str(dst), hf_overrides={"quantization_config": right}).generate(
        [prompt], _greedy(8), use_tqdm=False)[0].outputs[0].token_ids
    assert got == hf_greedy(qwen2_dir, prompt, 8, deq)


def _pack_by_definition(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words of ``values`` packed along ``dim`` (0: rows, GPTQ's qweight; 1: columns, its qzeros), the
    lowest field first, written out from the format's definition."""
    per = 32 // bits
    v = values.to(torch.int64)
    v = v if dim == 0 else v.t()
    words = torch.zeros(v.shape[0] // per, v.shape[1], dtype=torch.int64)
    for i in range(per):
        words |= v[i::per] << (bits * i)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words if dim == 0 else words.t().contiguous()


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_v2_checkpoints_are_served_as_defined(tmp_path, qwen2_dir, bits):
    """GPTQModel's checkpoint_format gptq_v2 (vLLM serves it): v1's layout with the zero points stored as they are
    (v1 stores zero − 1). Built here from the definition, zero points of 0 included (each layer's first group of
    up_proj: non-negative weights), and served to HF's own forward with the dequantized weights."""
    group, top = 32, 2**bits - 1
    dst = tmp_path / "v2"
    dst.mkdir()
    state, out, deq = load_file(qwen2_dir / "model.safetensors"), {}, {}
    for name, w in state.items():
        if not PROJ.match(name):
            out[name] = w
            continue
        w = w.clone()
        if "up_proj" in name:
            w[:, :group] = w[:, :group].abs()
        g = w.reshape(w.shape[0], -1, group)
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / top).clamp(min=1e-8).half().float()
        zero = (-lo / scale).round().clamp(0, top)
        q = (g / scale[..., None] + zero[..., None]).round().clamp(0, top).reshape(w.shape)
        base = name.removesuffix(".weight")
        out[f"{base}.qweight"] = _pack_by_definition(q.t(), bits, 0)
        out[f"{base}.qzeros"] = _pack_by_definition(zero.t(), bits, 1)            # [G, out], no offset
        out[f"{base}.scales"] = scale.t().half().contiguous()
        out[f"{base}.g_idx"] = (torch.arange(w.shape[1]) // group).to(torch.int32)
        deq[name] = ((q.reshape(g.shape) - zero[..., None]) * scale[..., None]).reshape(w.shape)
        assert "up_proj" not in name or (zero[:, 0] == 0).all()
    save_file(out, dst / "model.safetensors")
    cfg = json.loads((qwen2_dir / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": False,
                                  "sym": False, "checkpoint_format": "gptq_v2"}
    (dst / "config.json").write_text(json.dumps(cfg))
    model = load_nvllm_model(dst)
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    ref = hf_logits(qwen2_dir, ids, deq)
    torch.testing.assert_close(model_logits(model, ids), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def _greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_modules_kept_dense_load_as_dense(tmp_path, qwen2_dir):
    dst = tmp_path / "quant"
    deq = write_by_hand(qwen2_dir, dst, "awq", 4, 32, skip=("down_proj", "o_proj"))
    model = load_nvllm_model(dst)
    layer = model.layers[1]
    assert isinstance(layer.qkv_proj, QuantLinear) and isinstance(layer.gate_up_proj, QuantLinear)
    assert not isinstance(layer.o_proj, QuantLinear) and not isinstance(layer.down_proj, QuantLinear)
    ids = torch.randint(3, 500, (1, 16), generator=torch.Generator().manual_seed(2))
    ref = hf_logits(qwen2_dir, ids, deq)
    torch.testing.assert_close(model_logits(model, ids), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_dummy_weights_with_quantization_config(tmp_path, qwen2_dir):
    """Config only (load_format=dummy): the config decides what is quantized; random codes still serve."""
    dst = tmp_path / "cfg_only"
    write_by_hand(qwen2_dir, dst, "gptq", 4, 32)
    (dst / "model.safetensors").unlink()
    llm = make_llm(str(dst), load_format="dummy")
    report.reset()
    out = llm.generate([[1, 2, 3]], _greedy(4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4 and "quant_gemm" in report.snapshot()
    n_quant = sum(isinstance(m, QuantLinear) for m in llm.engine.runner.model.modules())
    assert n_quant == 8


def test_bad_quantized_checkpoints(tmp_path, qwen2_dir):
    dst = tmp_path / "quant"
    write_by_hand(qwen2_dir, dst, "gptq", 4, 32)
    state = load_file(dst / "model.safetensors")
    # only q of the fused q/k/v quantized: refused with a clear message
    mixed = dict(state)
    w = torch.randn(32, 64)
    for leaf in ("qweight", "qzeros", "scales", "g_idx"):
        del mixed[f"model.layers.0.self_attn.k_proj.{leaf}"]
    mixed["model.layers.0.self_attn.k_proj.weight"] = w
    save_file(mixed, dst / "model.safetensors")
    with pytest.raises(ConfigError, match="quantizes only some of"):
        load_nvllm_model(dst)
    # g_idx of q/k/v disagree
    bad = dict(state)
    bad["model.layers.0.self_attn.v_proj.g_idx"] = torch.zeros(64, dtype=torch.int32)
    save_file(bad, dst / "model.safetensors")
    with pytest.raises(ConfigError, match="differs from the g_idx"):
        load_nvllm_model(dst)
    # g_idx naming a group the layer does not have (read out of bounds by the kernels)
    bad = dict(state)
    bad["model.layers.0.mlp.down_proj.g_idx"] = bad["model.layers.0.mlp.down_proj.g_idx"] + 1
    save_file(bad, dst / "model.safetensors")
    with pytest.raises(ConfigError, match=r"down_proj.g_idx' holds group 1..4, outside the layer's 4 groups"):
        load_nvllm_model(dst)
    # the config's group size is not the tensors': named as such
    save_file(state, dst / "model.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": {**cfg["quantization_config"],
                                                                              "group_size": 64}}))
    with pytest.raises(ConfigError, match=r"g_idx' holds group 0..\d, outside the layer's \d groups \(the "
                                          r"quantization_config's group_size 64 of its \d+ inputs\)"):
        load_nvllm_model(dst)
    save_file({k: v for k, v in state.items() if not k.endswith("g_idx")}, dst / "model.safetensors")
    with pytest.raises(ConfigError, match=r"(qzeros|scales)': checkpoint \(\d, \d+\), model expects \(\d, \d+\): "
                                          r"one row per group, and the quantization_config's group_size 64 makes"):
        load_nvllm_model(dst)
    # an unsupported quant method
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "bitsandbytes", "bits": 4}
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="unsupported quant_method"):
        load_nvllm_model(dst)


def test_gptq_without_g_idx_has_contiguous_groups(tmp_path, qwen2_dir):
    """Older GPTQ checkpoints (desc_act false) carry no g_idx; as vLLM, each input's group is then k // group."""
    dst = tmp_path / "quant"
    deq = write_by_hand(qwen2_dir, dst, "gptq", 4, 32, False, False)
    state = load_file(dst / "model.safetensors")
    save_file({k: v for k, v in state.items() if not k.endswith(".g_idx")}, dst / "model.safetensors")
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    ref = hf_logits(qwen2_dir, ids, deq)
    torch.testing.assert_close(model_logits(load_nvllm_model(dst), ids), ref, rtol=1e-4,
                               atol=1e-4 * ref.abs().max().item())


def test_awq_layer_state_dict_round_trip(tmp_path, qwen2_dir):
    """state_dict carries the layout: a repacked layer's state loads into a fresh layer as the same weight, and AWQ
    tensors loaded into a repacked layer are repacked again; layers whose inputs fill no whole GPTQ word stay AWQ."""
    dst = tmp_path / "quant"
    write_by_hand(qwen2_dir, dst, "awq", 4, 32)
    lin = load_nvllm_model(dst).layers[0].gate_up_proj
    want = lin.quant_weight().dequantize()
    saved = {k: v.clone() if torch.is_tensor(v) else v for k, v in lin.state_dict().items()}
    assert saved["_extra_state"] == {"layout": "gptq"} and "GPTQ layout" in lin.extra_repr()
    fresh = load_nvllm_model(dst).layers[0].gate_up_proj
    fresh.init_dummy(torch.Generator().manual_seed(0))   # an AWQ-layout layer with other weights
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.quant_weight().dequantize(), want)
    awq = {k: v for k, v in saved.items()}
    awq.update(_extra_state={"layout": "awq"}, qweight=lin.qweight.new_zeros(lin.qweight.shape))
    lin.load_state_dict(awq)                              # AWQ words (all code 0) into a repacked layer
    assert lin.quant_weight().fmt == "gptq" and torch.equal(
        lin.quant_weight().dequantize(), F.QuantWeight.from_awq(awq["qweight"], awq["qzeros"], awq["scales"],
                                                                32).dequantize())


def test_awq_layer_with_inputs_off_whole_words_keeps_its_layout():
    from nvllm.quant.plan import QuantScheme

    scheme = QuantScheme("awq", 4, -1)
    lin = QuantLinear(36, 16, False, None, scheme)
    lin.init_dummy(torch.Generator().manual_seed(0))
    qw = lin.quant_weight()
    assert qw.fmt == "awq" and not qw.extra
    x = torch.randn(2, 36)
    torch.testing.assert_close(lin(x), x @ qw.dequantize().t())


def test_autogptq_zero_biases_on_bias_less_layers_are_skipped(tmp_path, qwen2_dir):
    """AutoGPTQ and optimum write a zero ``.bias`` for every quantized linear, also where the model has none
    (published Llama GPTQ repositories carry them): such a checkpoint loads and generates as without them, as in
    vLLM; a bias that is not zero, where the model has none, is still refused."""
    dst = tmp_path / "quant"
    write_by_hand(qwen2_dir, dst, "gptq", 4, 32)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = make_llm(str(dst)).generate([[1, 5, 9, 13]], params, use_tqdm=False)[0].outputs[0].token_ids
    state = load_file(dst / "model.safetensors")
    for k in [k for k in state if k.endswith(("self_attn.o_proj.qweight", "mlp.down_proj.qweight"))]:
        state[k.replace(".qweight", ".bias")] = torch.zeros(state[k].shape[1], dtype=torch.float16)
    save_file(state, dst / "model.safetensors")
    got = make_llm(str(dst)).generate([[1, 5, 9, 13]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
    state["model.layers.0.mlp.down_proj.bias"][0] = 1.0
    save_file(state, dst / "model.safetensors")
    with pytest.raises(ConfigError, match="unexpected tensor 'model.layers.0.mlp.down_proj.bias'"):
        load_nvllm_model(dst)


def test_autoawq_quant_config_json_and_gptqmodel_dynamic_overrides(tmp_path, qwen2_dir):
    """Older AutoAWQ checkpoints keep their settings in quant_config.json (w_bit, q_group_size, no quant_method):
    read as AWQ, the same tokens as with config.json's quantization_config. A GPTQModel ``dynamic`` entry that
    gives some modules other bits is refused by name instead of failing as a shape mismatch."""
    dst = tmp_path / "awq"
    write_by_hand(qwen2_dir, dst, "awq", 4, 32)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = make_llm(str(dst)).generate([[1, 5, 9, 13]], params, use_tqdm=False)[0].outputs[0].token_ids
    cfg = json.loads((dst / "config.json").read_text())
    cfg.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(cfg))
    (dst / "quant_config.json").write_text(json.dumps({"zero_point": True, "q_group_size": 32, "w_bit": 4,
                                                       "version": "GEMM"}))
    llm = make_llm(str(dst))
    assert llm.generate([[1, 5, 9, 13]], params, use_tqdm=False)[0].outputs[0].token_ids == want
    assert any(isinstance(m, QuantLinear) for m in llm.engine.runner.model.modules())

    gptq = tmp_path / "gptq"
    write_by_hand(qwen2_dir, gptq, "gptq", 4, 32)
    cfg = json.loads((gptq / "config.json").read_text())
    cfg["quantization_config"]["dynamic"] = {r"+:.*\.mlp\..*": {"bits": 8}, r"-:.*lm_head": {}}
    (gptq / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="'dynamic' gives .*mlp.* its own bits: nvllm serves one setting"):
        load_nvllm_model(gptq)
    cfg["quantization_config"]["dynamic"] = {r"+:.*\.mlp\..*": {"bits": 4, "group_size": 32}}  # the same: served
    (gptq / "config.json").write_text(json.dumps(cfg))
    load_nvllm_model(gptq)
