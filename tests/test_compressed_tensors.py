"""llm-compressor checkpoints (compressed-tensors, pack-quantized W4A16 / W8A16, int-quantized W8A8): written here by
the compressed-tensors library itself from a tiny random Qwen2 (its own packing, its own config.json), served by
nvllm, and checked against the same library's decompressed weights run through HF transformers: every prompt logprob
equal (W8A8 checkpoints run W8A16: their activations are not quantized). Group and channel scales, symmetric and
zero-point weights (a zero point of 0 included) and a quantized LM head. Act-order groups (``weight_g_idx``, which
the library no longer writes) are checked on the library's packing against the format's formula. Configs nvllm
cannot serve are one clear error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nvllm import SamplingParams
from nvllm.config import ConfigError
from nvllm.kernels import report
from tests.conftest import build_tiny_model, make_llm
from tests.quant_utils import IDS, engine_errors, save_compressed

ct = pytest.importorskip("compressed_tensors")


def write_checkpoint(out: Path, bits: int, sym: bool, strategy: str, group_size: int = 32,
                     ignore: tuple[str, ...] = ("lm_head",)):
    """Quantize a tiny Qwen2 with compressed-tensors (min-max scales, rounded to fp16 as nvllm keeps them), save it
    as llm-compressor does, and return the HF model holding the library's decompressed weights (the reference)."""
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    src = build_tiny_model("qwen2", out.parent / f"{out.name}-base")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": strategy}
    if strategy == "group":
        weights["group_size"] = group_size
    config = QuantizationConfig.model_validate({"config_groups": {"group_0": {"targets": ["Linear"],
                                                                              "weights": weights}},
                                                "ignore": list(ignore), "format": "pack-quantized"})
    apply_quantization_config(model, config)
    for name, m in model.named_modules():
        if not hasattr(m, "weight_scale"):
            continue
        w = m.weight.data
        if not sym and name.endswith("layers.0.mlp.up_proj"):
            w[:, :group_size].abs_()  # a group of non-negative weights: its zero point is the lowest code, 0
        per_group = w.reshape(w.shape[0], -1, group_size if strategy == "group" else w.shape[1])
        scale, zero = calculate_qparams(per_group.amin(-1), per_group.amax(-1), m.quantization_scheme.weights)
        m.weight_scale.data.copy_(scale.half().float().reshape(m.weight_scale.shape))
        if hasattr(m, "weight_zero_point"):
            m.weight_zero_point.data.copy_(zero.reshape(m.weight_zero_point.shape))
    save_compressed(model, out, src, "pack-quantized")
    return model


CASES = {
    "w4a16 g32 symmetric": dict(bits=4, sym=True, strategy="group"),
    "w4a16 g32 zero points": dict(bits=4, sym=False, strategy="group"),
    "w8a16 channel": dict(bits=8, sym=True, strategy="channel"),
    "w8a16 g32 zero points": dict(bits=8, sym=False, strategy="group"),
    "w4a16 quantized lm_head": dict(bits=4, sym=True, strategy="group", ignore=()),
}


@pytest.mark.parametrize("case", list(CASES))
def test_served_as_the_library_decompresses_them(case, tmp_path):
    ref = write_checkpoint(tmp_path / "ckpt", **CASES[case])
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"
    with torch.no_grad():
        want = torch.log_softmax(ref(torch.tensor([IDS])).logits[0].float(), dim=-1)
    report.reset()
    err, llm = engine_errors(tmp_path / "ckpt", want)
    assert err < 1e-4, err
    model = llm.engine.runner.model
    assert type(model.layers[0].qkv_proj).__name__ == "QuantLinear"
    assert (type(model.lm_head).__name__ == "QuantLMHead") == (case == "w4a16 quantized lm_head")
    assert "quant_gemm" in report.snapshot()  # the kernel report names the quantized GEMM


def _config(tmp_path: Path, **changes) -> Path:
    """A dummy-weight model whose config.json carries a compressed-tensors config with ``changes``."""
    path = build_tiny_model("qwen2", tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
    group = {"targets": ["Linear"], "weights": {**weights, **changes.pop("weights", {})},
             "input_activations": changes.pop("input_activations", None)}
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                  "config_groups": {"group_0": group}, "ignore": ["lm_head"], **changes}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.mark.parametrize("changes, message", [
    (dict(input_activations={"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}),
     "quantizes activations"),
    (dict(format="float-quantized"), "format 'float-quantized'"),   # int weights stored as floats
    (dict(format="marlin-24"), "format 'marlin-24'"),
    (dict(weights={"num_bits": 3}), "num_bits 3"),
    (dict(weights={"strategy": "tensor"}), "strategy 'tensor'"),
    (dict(kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
    (dict(transform_config={"config_groups": {"u": {}}}), "transforms"),
    (dict(format="int-quantized", weights={"num_bits": 4}), "8-bit weights"),
    (dict(format="int-quantized", weights={"num_bits": 8}, input_activations={"num_bits": 8, "type": "float"}),
     "input activations other than 8-bit int"),
    (dict(format="int-quantized", weights={"num_bits": 8},
          input_activations={"num_bits": 8, "type": "int", "strategy": "group", "group_size": 32}),
     "input activation strategy 'group'"),
])
def test_configs_it_cannot_serve_are_one_clear_error(changes, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        make_llm(str(_config(tmp_path, **changes)), load_format="dummy")


def test_ignore_patterns_keep_modules_in_full_precision(tmp_path):
    """With dummy weights the config decides: ``ignore`` names and ``re:`` patterns stay dense."""
    path = _config(tmp_path, ignore=["lm_head", "re:.*layers\\.1\\.mlp\\..*"])
    model = make_llm(str(path), load_format="dummy").engine.runner.model
    assert type(model.layers[0].gate_up_proj).__name__ == "QuantLinear"
    assert type(model.layers[1].gate_up_proj).__name__ == "Linear"
    assert type(model.layers[1].qkv_proj).__name__ == "QuantLinear"


@pytest.mark.parametrize("bits, sym", [(4, False), (8, True)])
def test_act_order_groups_of_older_checkpoints(bits, sym):
    """``actorder: group`` (older llm-compressor releases) stores ``weight_g_idx``, the group of each input: the
    words packed by the library's own ``pack_to_int32``, read back through the GPTQ path, dequantize to
    ``(q - z[g_idx]) * s[g_idx]`` — zero points of 0 included."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from nvllm.quant.compressed_tensors import GPTQView
    from nvllm.quant.formats import QuantWeight

    out_f, in_f, group = 16, 64, 16
    gen = torch.Generator().manual_seed(1)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = torch.randint(lo, hi + 1, (out_f, in_f), generator=gen, dtype=torch.int8)
    g_idx = (torch.arange(in_f) // group)[torch.randperm(in_f, generator=gen)]
    scale = torch.rand(out_f, in_f // group, generator=gen) / 100 + 1e-3
    zero = torch.zeros(out_f, in_f // group, dtype=torch.int8) if sym else \
        torch.randint(lo, hi + 1, (out_f, in_f // group), generator=gen, dtype=torch.int8)
    if not sym:
        zero[0, 0] = lo  # the lowest code: stored 0
    parts = {"weight_packed": pack_to_int32(q, bits), "weight_scale": scale.half(),
             "weight_shape": torch.tensor([out_f, in_f]), "weight_g_idx": g_idx}
    if not sym:
        parts["weight_zero_point"] = pack_to_int32(zero, bits, packed_dim=0)
    scheme = {"bits": bits, "group_size": group, "sym": sym, "actorder": "group"}
    view = GPTQView(scheme, {f"m.{k}" for k in parts})
    got = dict(view(iter((f"m.{k}", v) for k, v in parts.items())))
    assert set(got) == {"m.qweight", "m.qzeros", "m.scales", "m.g_idx"}
    qw = QuantWeight.from_gptq(got["m.qweight"], got["m.qzeros"], got["m.scales"], got["m.g_idx"], bits, group)
    want = (q.float() - zero.float()[:, g_idx]) * scale.half().float()[:, g_idx]
    assert torch.equal(qw.dequantize(), want)


@pytest.mark.parametrize("spelling", [dict(actorder=False), dict(strategy=None), dict(type="INT", strategy="GROUP")])
def test_config_spellings_the_library_accepts(spelling):
    """Spellings compressed-tensors' own QuantizationArgs normalises (a boolean actorder, the strategy inferred from
    the group size, enum values in upper case) mean the same scheme here."""
    from compressed_tensors.quantization import QuantizationArgs

    from nvllm.quant.compressed_tensors import weight_scheme

    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32, **spelling}
    weights = {k: v for k, v in weights.items() if v is not None}
    QuantizationArgs.model_validate(weights)  # the library takes it
    raw = {"config_groups": {"g": {"targets": ["Linear"], "weights": weights}}, "format": "pack-quantized"}
    assert weight_scheme(raw) == {"bits": 4, "group_size": 32, "sym": True, "actorder": None,
                                  "format": "pack-quantized", "activations": None}


def test_malformed_tensors_are_refused():
    """Zero points not packed as the format packs them, or a g_idx of another length, are errors rather than
    silently wrong weights."""
    from nvllm.quant.compressed_tensors import GPTQView

    packed = torch.zeros(16, 8, dtype=torch.int32)
    scale = torch.ones(16, 2)
    view = GPTQView({"bits": 4, "group_size": 32, "sym": False, "actorder": None}, set())
    for zp in (torch.zeros(16, 2, dtype=torch.int8), torch.zeros(16, 2, dtype=torch.int32)):  # unpacked
        with pytest.raises(ValueError, match="weight_zero_point must be int32 \\[2, 2\\]"):
            view.translate("m", {"weight_packed": packed, "weight_scale": scale, "weight_zero_point": zp})
    sym = GPTQView({"bits": 4, "group_size": 32, "sym": True, "actorder": "group"}, set())
    with pytest.raises(ValueError, match="weight_zero_point is not zero, but the config's scheme is symmetric"):
        sym.translate("m", {"weight_packed": packed, "weight_scale": scale,
                            "weight_zero_point": torch.ones(2, 2, dtype=torch.int32)})
    zero = torch.zeros(2, 2, dtype=torch.int32)    # written beside a symmetric scheme by some versions: no offset
    with_zero = sym.translate("m", {"weight_packed": packed, "weight_scale": scale, "weight_zero_point": zero})
    without = sym.translate("m", {"weight_packed": packed, "weight_scale": scale})
    assert with_zero.keys() == without.keys() and all(torch.equal(with_zero[k], without[k]) for k in without)
    for group_size, want in ((64, 1), (-1, 1), (16, 4)):  # a config of another group size: named in its terms
        other = GPTQView({"bits": 4, "group_size": group_size, "sym": True, "actorder": None}, set())
        with pytest.raises(ValueError, match=f"m.weight_scale holds 2 group\\(s\\) of its 64 inputs, but the "
                                             f"quantization_config's group_size {group_size} makes {want}"):
            other.translate("m", {"weight_packed": packed, "weight_scale": scale})
    with pytest.raises(ValueError, match="weight_g_idx must give each of the 64 inputs a group"):
        sym.translate("m", {"weight_packed": packed, "weight_scale": scale, "weight_g_idx": torch.zeros(60)})
    w8a8 = {"bits": 8, "group_size": -1, "sym": True, "actorder": None, "format": "int-quantized"}
    with pytest.raises(ValueError, match="'m' lacks weight_scale"):              # a static input scale, no scale
        GPTQView(w8a8, {"m.weight", "m.input_scale", "dense.weight"})
    with pytest.raises(ValueError, match="2-D int8 tensor with inputs in whole words of 4"):
        GPTQView(w8a8, set()).translate("m", {"weight": torch.zeros(16, 6, dtype=torch.int8),
                                              "weight_scale": torch.ones(16, 1)})


@pytest.mark.parametrize("fmt", ["pack-quantized", "int-quantized"])
def test_a_pickle_checkpoint_loads_the_same(fmt, tmp_path):
    """Saved as pytorch_model.bin (tensor names unknown until read), with --allow-pickle: the same logprobs (an
    int-quantized module's weight told from a dense one's by its int8 dtype)."""
    from safetensors.torch import load_file

    if fmt == "pack-quantized":
        write_checkpoint(tmp_path / "ckpt", bits=4, sym=False, strategy="group")
    else:
        write_w8a8(tmp_path / "ckpt", static=True)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5)
    want = make_llm(str(tmp_path / "ckpt")).generate({"prompt_token_ids": IDS}, params, use_tqdm=False)[0]
    torch.save(load_file(tmp_path / "ckpt" / "model.safetensors"), tmp_path / "ckpt" / "pytorch_model.bin")
    (tmp_path / "ckpt" / "model.safetensors").unlink()
    got = make_llm(str(tmp_path / "ckpt"), allow_pickle=True).generate({"prompt_token_ids": IDS}, params,
                                                                       use_tqdm=False)[0]
    assert [{t: round(lp.logprob, 5) for t, lp in d.items()} for d in got.prompt_logprobs[1:]] == \
        [{t: round(lp.logprob, 5) for t, lp in d.items()} for d in want.prompt_logprobs[1:]]


def write_w8a8(out: Path, sym: bool = True, strategy: str = "channel", static: bool = False) -> dict:
    """A W8A8 checkpoint as llm-compressor writes it (``int-quantized``: int8 weights a byte each, min-max scales
    rounded to fp16; int8 input activations per token, dynamic, or ``static`` per tensor with an ``input_scale``),
    by the library's own compressor; returns the library's decompressed weights of the quantized modules."""
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    src = build_tiny_model("qwen2", out.parent / f"{out.name}-base")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    weights = {"num_bits": 8, "type": "int", "symmetric": sym, "strategy": strategy}
    if strategy == "group":
        weights["group_size"] = 32
    acts = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "tensor" if static else "token",
            "dynamic": not static}
    config = QuantizationConfig.model_validate({"config_groups": {"group_0": {
        "targets": ["Linear"], "weights": weights, "input_activations": acts}}, "ignore": ["lm_head"],
        "format": "int-quantized"})
    apply_quantization_config(model, config)
    for name, m in model.named_modules():
        if not hasattr(m, "weight_scale"):
            continue
        w = m.weight.data
        per_group = w.reshape(w.shape[0], -1, 32 if strategy == "group" else w.shape[1])
        scale, zero = calculate_qparams(per_group.amin(-1), per_group.amax(-1), m.quantization_scheme.weights)
        m.weight_scale.data.copy_(scale.half().float().reshape(m.weight_scale.shape))
        if hasattr(m, "weight_zero_point"):
            m.weight_zero_point.data.copy_(zero.reshape(m.weight_zero_point.shape))
        if static:
            m.input_scale.data.fill_(0.02)
    save_compressed(model, out, src, "int-quantized")
    return {f"{name}.weight": m.weight.detach().clone() for name, m in model.named_modules()
            if hasattr(m, "weight_scale")}


W8A8_CASES = {
    "channel, dynamic tokens": dict(),
    "channel, static tensor scale": dict(static=True),
    "g32 zero points": dict(sym=False, strategy="group"),
}


@pytest.mark.parametrize("case", list(W8A8_CASES))
def test_w8a8_checkpoints_served_w8a16_as_the_library_decompresses_them(case, tmp_path, caplog):
    """llm-compressor's W8A8 (``int-quantized``): the library's own int8 tensors read into the GPTQ 8-bit path give
    every prompt logprob of its decompressed weights in transformers (activations unquantized on both sides); the
    log says the activations are not quantized, and that static input scales are left out."""
    from tests.quant_utils import hf_model

    weights = write_w8a8(tmp_path / "ckpt", **W8A8_CASES[case])
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]
    assert config["format"] == "int-quantized"
    with torch.no_grad():
        want = torch.log_softmax(hf_model(tmp_path / "ckpt-base", weights)(torch.tensor([IDS])).logits[0], dim=-1)
    report.reset()
    with caplog.at_level("INFO", logger="nvllm"):
        err, llm = engine_errors(tmp_path / "ckpt", want)
    assert err < 1e-4, err
    model = llm.engine.runner.model
    assert type(model.layers[0].qkv_proj).__name__ == "QuantLinear" and type(model.lm_head).__name__ != "QuantLMHead"
    assert "quant_gemm" in report.snapshot()
    static = W8A8_CASES[case].get("static", False)
    assert f"int8 activations ({'static tensor' if static else 'dynamic token'}) are not quantized" in caplog.text
    assert ("static activation tensors (input_scale, input_zero_point) are not used" in caplog.text) == static
