"""``nvllm quantize --format compressed-tensors``: llm-compressor's pack-quantized checkpoints written by nvllm's
quantizer (GPTQ, AWQ, RTN; 4 and 8 bits; groups and channels; zero points; the LM head). The compressed-tensors
library itself reads them: its pydantic model validates the config, its compressor decompresses every module,
and HF transformers holding those weights gives the prompt logprobs nvllm gives when serving the checkpoint.
Written as GPTQ v1 instead, the same quantization serves the same tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from nvllm import SamplingParams
from nvllm.quant.quantize import quantize_model
from nvllm.quant.recipe import RecipeError, build_config
from tests.conftest import build_tiny_model, make_llm
from tests.quant_utils import hf_model

pytest.importorskip("compressed_tensors")
IDS = [1, 5, 9, 33, 100, 7, 42, 250, 3, 77, 18]


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return build_tiny_model("qwen2", tmp_path_factory.mktemp("ct_src") / "qwen2", intermediate_size=128)


def quantize(src: Path, out: Path, **kw):
    cfg = build_config(None, calib_dataset="calib", calib_samples=8, calib_seqlen=128, **{"group_size": 32, **kw})
    return quantize_model(str(src), str(out), cfg)


def library_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every quantized module's weight as compressed-tensors decompresses it, from our config and tensors (plus the
    checkpoint's dense tensors: AWQ folds its scales into the norms before them)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig.model_validate(json.loads((path / "config.json").read_text())["quantization_config"])
    scheme = config.config_groups["group_0"]
    tensors = load_file(path / "model.safetensors")
    modules = {k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight_packed")}
    out = {k: v.float() for k, v in tensors.items() if k.rsplit(".", 1)[0] not in modules}
    for m in modules:
        parts = {k.rsplit(".", 1)[1]: v for k, v in tensors.items() if k.rsplit(".", 1)[0] == m}
        parts["weight_scale"] = parts["weight_scale"].float()  # the same scales; dequantized in float32, not fp16
        out[f"{m}.weight"] = PackedQuantizationCompressor.decompress(parts, scheme)["weight"].float()
    return out


def prompt_logprobs(path: Path) -> tuple[list[dict], list[int]]:
    llm = make_llm(str(path), enable_prefix_caching=False)
    out = llm.generate({"prompt_token_ids": IDS}, SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=20,
                                                                  ignore_eos=True), use_tqdm=False)[0]
    return out.prompt_logprobs, out.outputs[0].token_ids


CASES = {
    "gptq w4 g32": dict(method="gptq"),
    "gptq w4 act-order (static groups)": dict(method="gptq", desc_act=True),
    "awq w4 zero points": dict(method="awq"),
    "rtn w8 zero points": dict(method="rtn", bits=8, sym=False),
    "rtn w8 channel": dict(method="rtn", bits=8, group_size=-1),
    "gptq w4 with the lm_head": dict(method="gptq", quantize_lm_head=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_library_reads_what_nvllm_writes(case, src, tmp_path):
    kw = CASES[case]
    quantize(src, tmp_path / "ct", checkpoint_format="compressed-tensors", **kw)
    config = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"
    assert ("lm_head" in config["ignore"]) != kw.get("quantize_lm_head", False)
    dense = library_weights(tmp_path / "ct")
    packed = {k for k in load_file(tmp_path / "ct" / "model.safetensors") if k.endswith(".weight_packed")}
    assert len(packed) == 2 * 7 + kw.get("quantize_lm_head", False)  # every projection of both layers (+ head)
    with torch.no_grad():
        want = torch.log_softmax(hf_model(src, dense)(torch.tensor([IDS])).logits[0].float(), dim=-1)
    got, _ = prompt_logprobs(tmp_path / "ct")
    errors = [abs(lp.logprob - float(want[pos - 1, tok])) for pos in range(1, len(IDS))
              for tok, lp in got[pos].items()]
    assert max(errors) < 1e-4, max(errors)


def test_same_quantization_as_gptq_v1(src, tmp_path):
    """Symmetric GPTQ writes the same codes and scales either way: the engine serves the same distribution."""
    quantize(src, tmp_path / "ct", method="gptq", checkpoint_format="compressed-tensors")
    quantize(src, tmp_path / "v1", method="gptq")
    (ct_lps, ct_tokens), (v1_lps, v1_tokens) = prompt_logprobs(tmp_path / "ct"), prompt_logprobs(tmp_path / "v1")
    assert ct_tokens == v1_tokens
    for a, b in zip(ct_lps[1:], v1_lps[1:]):
        assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)


@pytest.mark.parametrize("kw, message", [
    (dict(method="awq", checkpoint_format="gptq"), "AWQ's zero points of 0 have no GPTQ v1 encoding"),
    (dict(method="gptq", checkpoint_format="awq"), "the AWQ-GEMM format holds AWQ's zero-point weights"),
    (dict(method="gptq", checkpoint_format="marlin"), "unknown format 'marlin'"),
    (dict(method="gptq", desc_act=True, static_groups=False, checkpoint_format="compressed-tensors"),
     "compressed-tensors no longer stores act-order group indices"),
])
def test_format_choices_checked(kw, message):
    with pytest.raises(RecipeError, match=message):
        build_config(None, **kw)


def test_kept_modules_are_ignored_by_the_librarys_own_matcher(tmp_path):
    """The demo model's MLP cannot be packed (172 outputs, 172 inputs): it stays dense, and the config's ignore
    list names exactly those modules by compressed-tensors' rule (names, or ``re:`` patterns)."""
    from compressed_tensors.utils.match import match_name

    from nvllm.assets import demo_model_path

    summary = quantize(Path(demo_model_path()), tmp_path / "ct", method="gptq", checkpoint_format="compressed-tensors")
    assert set(summary.kept) == {"mlp.gate_proj/mlp.up_proj", "mlp.down_proj"}
    ignore = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]["ignore"]
    tensors = load_file(tmp_path / "ct" / "model.safetensors")
    linears = {k.rsplit(".", 1)[0] for k in tensors if "_proj." in k}
    ignored = {m for m in linears if any(match_name(m, target) for target in ignore)}
    assert ignored == {m for m in linears if ".mlp." in m} and all(f"{m}.weight" in tensors for m in ignored)
    assert match_name("lm_head", ignore[0])
    llm = make_llm(str(tmp_path / "ct"))
    assert type(llm.engine.runner.model.layers[0].qkv_proj).__name__ == "QuantLinear"
    assert llm.generate("Once upon a time", SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids
