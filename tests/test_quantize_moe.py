"""``nvllm quantize`` on mixtures of experts (Qwen3-MoE with a dense first layer, Qwen2-MoE with its shared expert,
Mixtral): every expert calibrated on the tokens routed to it, written per expert as GPTQModel / AutoAWQ /
llm-compressor write them (``mlp.experts.{e}.gate_proj.qweight`` …, routers dense), and served.

What checks it from outside the quantizer: HF transformers holding the checkpoint's weights dequantized by the
formats' definitions (or by the compressed-tensors library itself) gives the logits nvllm gives when it loads the
checkpoint; per-layer output errors on held-out text with the full-precision model's inputs (GPTQ and AWQ below
RTN at the same zero-point scheme); an expert no calibration token reaches is plain RTN, byte for byte.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from nvllm.engine.llm_engine import load_tokenizer
from nvllm.layers.quant_experts import QuantExperts
from nvllm.quant import formats as F
from nvllm.quant.quantize import QuantizeError, quantize_model
from nvllm.quant.recipe import build_config
from nvllm.quant.replay import layer_forward, model_logits, moe_forward
from tests.conftest import build_tiny_model
from tests.quant_utils import held_out_windows, hf_logits, layer_errors, load_nvllm_model
from tests.test_quant_moe import dense_copy

SIZES = {"qwen3-moe": dict(moe_intermediate_size=64),
         "qwen2-moe": dict(moe_intermediate_size=64, shared_expert_intermediate_size=64),
         "mixtral": {}}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe_src")
    return {kind: build_tiny_model(kind, root / kind, **kw) for kind, kw in SIZES.items()}


def quantize(src: Path, out: Path, **kw):
    cfg = build_config(None, calib_dataset="calib", calib_samples=8, calib_seqlen=64, **{"group_size": 32, **kw})
    return quantize_model(str(src), str(out), cfg)


@pytest.mark.parametrize("kind", list(SIZES))
def test_replay_taps_every_routed_token(sources, kind):
    """The replay through a sparse layer equals the engine's block, and its taps see each token once per expert it
    is routed to (top-k experts a token) and every token at the shared expert."""
    model = load_nvllm_model(sources[kind])
    i, layer = next((i, layer) for i, layer in enumerate(model.layers) if layer.moe is not None)
    x, pos = torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(i)), torch.arange(10)
    seen: dict[str, int] = {}

    def tap(name, inp):
        seen[name] = seen.get(name, 0) + inp.shape[0]

    assert layer_forward(layer, x, pos, tap=tap, stop_after="down_proj") is None
    m = layer.moe.m
    experts = {n: c for n, c in seen.items() if n.startswith("moe.experts.")}
    assert sum(c for n, c in experts.items() if n.endswith("gate_up_proj")) == 20 * m.top_k
    assert all(experts[n.replace("gate_up", "down")] == c for n, c in experts.items() if n.endswith("gate_up_proj"))
    assert (seen.get("moe.shared_expert.gate_up_proj"), seen.get("moe.shared_expert.down_proj")) == \
        ((20, 20) if kind == "qwen2-moe" else (None, None))
    h = torch.randn(20, 64, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(moe_forward(layer.moe, h), layer.moe(h))     # the engine's block


def dequantized(path: Path, fmt: str, bits: int) -> dict[str, torch.Tensor]:
    """Every packed module of a GPTQ v1 / AWQ-GEMM checkpoint as its float weight, by the formats' definitions."""
    tensors = load_file(path / "model.safetensors")
    group = json.loads((path / "config.json").read_text())["quantization_config"]["group_size"]
    out = {}
    for name in (k.removesuffix(".qweight") for k in tensors if k.endswith(".qweight")):
        t = {leaf: tensors[f"{name}.{leaf}"] for leaf in ("qweight", "qzeros", "scales")}
        out[f"{name}.weight"] = F.dequantize_awq(**t, group_size=group) if fmt == "awq" else \
            F.dequantize_gptq(**t, g_idx=tensors[f"{name}.g_idx"], bits=bits)
    return out


CASES = {  # name: (arch, quantize settings, format written)
    "qwen3-moe-gptq": ("qwen3-moe", dict(method="gptq"), "gptq"),
    "qwen2-moe-awq": ("qwen2-moe", dict(method="awq"), "awq"),
    "mixtral-gptq8-act-order": ("mixtral", dict(method="gptq", bits=8, desc_act=True), "gptq"),
    "qwen3-moe-rtn-ct": ("qwen3-moe", dict(method="rtn", sym=False, checkpoint_format="compressed-tensors"),
                         "compressed-tensors"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_experts_serve_what_hf_computes(tmp_path, sources, case):
    kind, settings, fmt = CASES[case]
    src, out = sources[kind], tmp_path / "q"
    summary = quantize(src, out, **settings)
    assert summary.kept == {} and not summary.notes
    sparse = [r for r in summary.layers if any(n.startswith("moe.experts.") for n in r.errors)]
    assert len(sparse) == (1 if kind == "qwen3-moe" else 2)
    assert all(0 < r.stage_error("gate_up_proj") < 0.1 and 0 < r.stage_error("down_proj") < 0.1 for r in sparse)
    tensors = load_file(out / "model.safetensors")
    block, (gate, up, down) = ("block_sparse_moe", ("w1", "w3", "w2")) if kind == "mixtral" else \
        ("mlp", ("gate_proj", "up_proj", "down_proj"))
    leaf = "weight_packed" if fmt == "compressed-tensors" else "qweight"
    layer = "model.layers.1"
    for e in range(3):
        assert all(f"{layer}.{block}.experts.{e}.{p}.{leaf}" in tensors for p in (gate, up, down))
    assert f"{layer}.{block}.gate.weight" in tensors and not any(".gate." in k and leaf in k for k in tensors)
    if kind == "qwen2-moe":
        assert f"{layer}.mlp.shared_expert.gate_proj.{leaf}" in tensors and f"{layer}.mlp.shared_expert_gate.weight" \
            in tensors
    model = load_nvllm_model(out)
    assert all(isinstance(lay.moe.experts, QuantExperts) for lay in model.layers if lay.moe is not None)
    if fmt == "compressed-tensors":   # the library's own decompression; its matcher ignores the routers
        pytest.importorskip("compressed_tensors")
        from compressed_tensors.utils.match import match_name

        from tests.test_quantize_compressed_tensors import library_weights

        ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
        assert any(match_name(f"{layer}.mlp.gate", t) for t in ignore)
        assert not any(match_name(f"{layer}.mlp.experts.0.gate_proj", t) for t in ignore)
        weights = {k: v for k, v in library_weights(out).items() if k.endswith("_proj.weight")}
    else:
        weights = dequantized(out, fmt, settings.get("bits", 4))
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    # AWQ folded its scales into the norms and routers: HF gets those tensors from the checkpoint too
    dense = {k: v.float() for k, v in tensors.items() if k.endswith(("norm.weight", "gate.weight"))}
    ref = hf_logits(dense_copy(src, tmp_path / "deq", {**dense, **weights}), ids)
    torch.testing.assert_close(model_logits(model, ids), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("kind", ["qwen2-moe", "mixtral"])
def test_gptq_and_awq_layer_errors_below_rtn(tmp_path, sources, kind):
    """Held-out text, the full-precision model's layer inputs: GPTQ below symmetric RTN, AWQ below RTN with a zero
    point, in every layer (attention and experts quantized)."""
    src = sources[kind]
    dirs = {}
    for name, kw in {"rtn": dict(method="rtn"), "rtn-asym": dict(method="rtn", sym=False),
                     "gptq": dict(method="gptq"), "awq": dict(method="awq")}.items():
        quantize(src, tmp_path / name, **kw)
        dirs[name] = tmp_path / name
    ids = torch.tensor(held_out_windows(load_tokenizer(str(src)), n=4, width=127))
    errs = layer_errors(src, dirs, ids)
    for i in range(2):
        assert errs["gptq"][i] < errs["rtn"][i] and errs["awq"][i] < errs["rtn-asym"][i], (i, errs)
        assert max(e[i] for e in errs.values()) < 0.15, (i, errs)   # each checkpoint close to the model


def test_unreached_experts_are_rounded_to_nearest(tmp_path, sources):
    """Three calibration tokens reach at most six of Qwen3-MoE's eight experts (top 2): the others are RTN, exactly
    the tensors an RTN run writes for them, and the summary names them."""
    src = sources["qwen3-moe"]
    kw = dict(calib_dataset="calib", calib_samples=1, calib_seqlen=3, group_size=32)
    gptq = quantize_model(str(src), str(tmp_path / "gptq"), build_config(None, method="gptq", **kw))
    quantize_model(str(src), str(tmp_path / "rtn"), build_config(None, method="rtn", **kw))
    unreached = gptq.layers[1].unreached
    assert len(unreached) >= 2 and len(gptq.notes) == 1
    assert gptq.notes[0].startswith("experts no calibration token was routed to") and "layer 1: " in gptq.notes[0]
    assert gptq.layers[1].stage_error("gate_up_proj") > 0
    assert all(gptq.layers[1].errors[f"moe.experts.{e}.down_proj"] != gptq.layers[1].errors[
        f"moe.experts.{e}.down_proj"] for e in unreached)       # NaN: nothing measured
    g, r = load_file(tmp_path / "gptq" / "model.safetensors"), load_file(tmp_path / "rtn" / "model.safetensors")
    reached = next(e for e in range(8) if e not in unreached)
    for p in ("gate_proj", "up_proj", "down_proj"):
        for e in unreached:
            assert torch.equal(g[f"model.layers.1.mlp.experts.{e}.{p}.qweight"],
                               r[f"model.layers.1.mlp.experts.{e}.{p}.qweight"])
        assert not torch.equal(g[f"model.layers.1.mlp.experts.{reached}.{p}.qweight"],
                               r[f"model.layers.1.mlp.experts.{reached}.{p}.qweight"])


@pytest.mark.parametrize("fmt", ["gptq", "awq", "compressed-tensors"])
def test_experts_the_scheme_cannot_pack_stay_dense(tmp_path, fmt):
    """Experts of 40 (no group of 32 divides down's input) stay in full precision, attention is quantized; the
    config excludes them by the rule its readers use (compressed-tensors: the library's own matcher), so the
    checkpoint serves from its weights and from dummy ones."""
    src = build_tiny_model("qwen3-moe", tmp_path / "src")
    summary = quantize(src, tmp_path / "q", method="awq" if fmt == "awq" else "gptq",
                       **({"checkpoint_format": fmt} if fmt == "compressed-tensors" else {}))
    assert summary.kept == {"mlp.experts": "group size 32 does not divide its input size 40"}
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    tensors = load_file(tmp_path / "q" / "model.safetensors")
    if fmt == "compressed-tensors":
        pytest.importorskip("compressed_tensors")
        from compressed_tensors.utils.match import match_name

        modules = {k.rsplit(".", 1)[0] for k in tensors if k.endswith("weight") and ".layers.1." in k}
        ignored = {m for m in modules if any(match_name(m, t) for t in qc["ignore"])}
        assert ignored == {m for m in modules if ".mlp." in m}     # every expert and the router
    else:
        # the router is named layer by layer: "mlp.gate" would also name layer 0's dense mlp.gate_proj
        assert (qc["modules_to_not_convert"] == ["mlp.experts", "layers.1.mlp.gate"]) if fmt == "awq" else (
            list(qc["dynamic"]) == [r"-:.*\.(mlp\.experts(\.\d+\.\w+)?)$"] and qc["modules_in_block_to_quantize"]
            == [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"],
                ["mlp.gate_proj", "mlp.up_proj"], ["mlp.down_proj"]])
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in tensors
    assert any(k.startswith("model.layers.1.self_attn.q_proj.") and k.endswith(("qweight", "weight_packed"))
               for k in tensors)
    model = load_nvllm_model(tmp_path / "q")
    assert type(model.layers[1].moe.experts).__name__ == "Experts"
    assert type(model.layers[1].qkv_proj).__name__ == "QuantLinear"
    from nvllm.config import EngineConfig
    from nvllm.models.loader import load_hf_config, load_model

    dummy = load_model(EngineConfig(model=str(tmp_path / "q"), device="cpu", load_format="dummy"),
                       load_hf_config(str(tmp_path / "q")), torch.float32, torch.device("cpu"))
    assert type(dummy.layers[1].moe.experts).__name__ == "Experts"


@pytest.mark.parametrize("kind", list(SIZES))
@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_other_loaders_convert_exactly_the_quantized_modules(tmp_path, sources, kind, fmt):
    """Loaders built on transformers 4 replace a layer's linears by quantized ones unless the config says otherwise:
    AutoAWQ / transformers' AWQ every linear no ``modules_to_not_convert`` entry is a substring of; optimum's GPTQ
    every linear whose name ends with a ``modules_in_block_to_quantize`` entry (all of them without the list); vLLM
    a linear some entry of that list is a substring of. Each rule must pick exactly the modules stored quantized —
    a router among them would be built quantized with no qweight to load."""
    quantize(sources[kind], tmp_path / "q", method=fmt)
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    tensors = load_file(tmp_path / "q" / "model.safetensors")
    linears = {k.rsplit(".", 1)[0] for k, t in tensors.items() if k.startswith("model.layers.") and (
        k.endswith(".qweight") or k.endswith(".weight") and t.dim() == 2)}
    quantized = {k.rsplit(".", 1)[0] for k in tensors if k.endswith(".qweight")}
    routers = {m for m in linears if m.endswith((".gate", ".shared_expert_gate"))}
    assert routers and not routers & quantized and quantized
    if fmt == "awq":
        skip = qc["modules_to_not_convert"] or []
        assert {m for m in linears if not any(s in m for s in skip)} == quantized
    else:
        listed = [n for group in qc["modules_in_block_to_quantize"] for n in group]
        assert {m for m in linears if any(m.endswith(n) for n in listed)} == quantized
        assert {m for m in linears if ".experts." not in m and any(n in m for n in listed)} == \
            {m for m in quantized if ".experts." not in m}   # vLLM asks its linears; the experts go by `dynamic`


def test_dummy_weights_follow_modules_in_block_to_quantize(tmp_path, sources):
    """Without weights (load_format dummy) the config decides: a module of a decoder layer that
    ``modules_in_block_to_quantize`` does not name is built dense, as vLLM and optimum read the list."""
    from nvllm.config import EngineConfig
    from nvllm.models.loader import load_hf_config, load_model

    quantize(sources["qwen3-moe"], tmp_path / "q", method="rtn")
    path = tmp_path / "q" / "config.json"
    cfg = json.loads(path.read_text())
    cfg["quantization_config"]["modules_in_block_to_quantize"] = [
        ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["self_attn.o_proj"]]
    path.write_text(json.dumps(cfg))
    model = load_model(EngineConfig(model=str(tmp_path / "q"), device="cpu", load_format="dummy"),
                       load_hf_config(str(tmp_path / "q")), torch.float32, torch.device("cpu"))
    assert type(model.layers[1].moe.experts).__name__ == "Experts"
    assert type(model.layers[0].gate_up_proj).__name__ != "QuantLinear"
    assert type(model.layers[0].qkv_proj).__name__ == type(model.layers[1].o_proj).__name__ == "QuantLinear"


def test_cli_and_refusals(tmp_path, sources):
    """The CLI on a mixture: its table gives the experts' mean errors; FP8 (not served for experts) is refused."""
    from nvllm.cli import app

    shutil.copytree(sources["mixtral"], tmp_path / "m")
    result = CliRunner().invoke(app, ["quantize", "--model", str(tmp_path / "m"), "--method", "gptq", "--group-size",
                                      "32", "--out", str(tmp_path / "q"), "--calib-dataset", "calib",
                                      "--calib-samples", "4", "--calib-seqlen", "64", "--no-progress"],
                                env={"COLUMNS": "200"})
    out = " ".join(result.output.split())
    assert result.exit_code == 0, out
    assert "mean over its experts" in out and "written to" in out
    with pytest.raises(QuantizeError, match="mixture of experts .*--method fp8 is refused"):
        quantize_model(str(tmp_path / "m"), str(tmp_path / "fp8"), build_config(None, method="fp8"))
    assert not (tmp_path / "fp8").exists()


FOLDING = {  # (arch, the layer's units AWQ scales)
    "mixtral": ("mixtral", {"qkv_proj", "o_proj", "experts"}),
    "qwen2-moe": ("qwen2-moe", {"qkv_proj", "o_proj", "experts", "shared_expert.gate_up_proj",
                                "shared_expert.down_proj"}),
    "qwen2-moe-experts-kept": ("qwen2-moe", {"shared_expert.gate_up_proj", "shared_expert.down_proj"}),
    "qwen2-moe-shared-kept": ("qwen2-moe", {"experts"}),
}


@pytest.mark.parametrize("case", list(FOLDING))
def test_awq_folding_in_a_mixture_keeps_the_function(sources, case):
    """Scales on every quantized gate/up of a mixture folded into the post-attention norm, the columns of every other
    reader of that norm (routers, experts or shared expert kept in full precision) scaled with them, each down's
    scales folded into its own up rows: the layer computes what it did."""
    import copy

    from nvllm.quant.awq import apply_scales, scale_groups
    from nvllm.quant.layer_linears import linear_at, stage_linears

    kind, units = FOLDING[case]
    layer = load_nvllm_model(sources[kind]).layers[1]
    names = [n for st in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") for n in stage_linears(layer, st, units)]
    groups = scale_groups(layer, names)
    first = next(g for g in groups if g.prev == "post_attention_layernorm")
    readers = len(first.linears) + len(first.passive)    # every expert, the shared expert and its gate, the router
    assert readers == layer.moe.m.num_experts + (3 if kind == "qwen2-moe" else 1) and "moe.gate" in first.passive
    downs = [g for g in groups if g.linear.endswith("down_proj")]
    assert len(downs) == len(first.linears) and all(g.prev == g.linear.replace("down", "gate_up") for g in downs)
    x, pos = torch.randn(2, 10, 64, generator=torch.Generator().manual_seed(0)), torch.arange(10)
    want = layer_forward(layer, x, pos)
    scaled, gen = copy.deepcopy(layer), torch.Generator().manual_seed(1)
    for g in groups:
        apply_scales(scaled, g, torch.rand(linear_at(scaled, g.linear).in_features, generator=gen) + 0.5)
    torch.testing.assert_close(layer_forward(scaled, x, pos), want, rtol=1e-4, atol=1e-5)
