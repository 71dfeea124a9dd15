"""Rope scaling against transformers: YaRN's frequencies and attention factor as transformers computes them, the
context each scaling serves (vLLM's rule), and tiny models with YaRN against HF's forward pass past the original
context."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from nvllm.config import ConfigError
from nvllm.layers.rotary import RotaryEmbedding, attention_factor, context_length, inverse_frequencies, rope_parameters
from tests.conftest import build_tiny_model, make_llm
from tests.test_engine_vs_hf import PROMPT, check_against_hf


def _config(max_pos: int, head_dim: int, theta: float, scaling: dict):
    return transformers.Qwen2Config(hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=max_pos,
                                    rope_parameters={"rope_theta": theta, **scaling})


@pytest.mark.parametrize("max_pos, head_dim, theta, scaling", [
    (32768, 128, 1e6, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),  # Qwen2.5
    (40960, 128, 1e6, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}),  # Qwen3
    (4096, 64, 10000.0, {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 16, "beta_slow": 2, "truncate": False}),
    (163840, 64, 10000.0, {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                           "mscale": 1.0, "mscale_all_dim": 0.707}),
    (2048, 32, 10000.0, {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048,
                         "attention_factor": 1.25}),
    (8192, 64, 10000.0, {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 2048}),
])
def test_yarn_is_transformers_yarn(max_pos, head_dim, theta, scaling):
    config = _config(max_pos, head_dim, theta, scaling)
    ref_inv_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    got_theta, got = rope_parameters(config)
    assert got_theta == theta
    torch.testing.assert_close(inverse_frequencies(head_dim, got_theta, got), ref_inv_freq, rtol=1e-6, atol=0)
    assert attention_factor(got) == pytest.approx(ref_factor, rel=1e-12)


def test_yarn_tables_carry_the_attention_factor():
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    _, full = rope_parameters(_config(16, 16, 10000.0, scaling))
    table = RotaryEmbedding(16, 16, 10000.0, full)
    factor = 0.1 * math.log(4.0) + 1
    assert table.cos.shape == (64, 8)  # the stretched context: 16 × 4 positions
    torch.testing.assert_close(table.cos.square() + table.sin.square(), torch.full((64, 8), factor ** 2))


@pytest.mark.parametrize("max_pos, scaling, length", [
    (4096, None, 4096),
    (4096, {"rope_type": "linear", "factor": 4.0}, 16384),
    (32768, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072),
    (163840, {"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096}, 163840),
    (131072, {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}, 131072),
])
def test_context_length_is_vllms(max_pos, scaling, length):
    """vLLM's derived max_model_len: linear stretches max_position_embeddings, YaRN the original length, llama3
    configs already give the stretched length."""
    assert context_length(max_pos, scaling) == length


@pytest.mark.parametrize("scaling, message", [
    ({"rope_type": "dynamic", "factor": 2.0}, "'dynamic' is not supported (supported: default, linear, llama3, yarn)"),
    ({"rope_type": "linear"}, "rope_scaling (linear) factor must be a positive number, got None"),
    ({"rope_type": "yarn", "factor": "4"}, "rope_scaling (yarn) factor must be a positive number, got '4'"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": -1}, "beta_fast must be a positive number"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1.5},
     "original_max_position_embeddings must be a positive integer, got 1.5"),
    ({"rope_type": "yarn", "factor": 2.0, "partial_rotary_factor": 0.5},
     "partial_rotary_factor 0.5 is not supported with rope_scaling 'yarn'"),
])
def test_bad_scaling_is_one_clear_error(scaling, message):
    config = transformers.Qwen2Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=64)
    config.rope_parameters = {"rope_theta": 10000.0, **scaling}
    with pytest.raises(ConfigError, match="^config.json: |is not supported") as e:
        rope_parameters(config)
    assert message in str(e.value)


@pytest.fixture(scope="module")
def yarn_qwen2(tmp_path_factory):
    """A tiny Qwen2 trained (as it were) on 32 positions, stretched 4× by YaRN in its config.json."""
    return build_tiny_model("qwen2", tmp_path_factory.mktemp("yarn") / "qwen2", max_position_embeddings=32,
                            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})


def test_yarn_model_matches_hf_past_its_original_context(yarn_qwen2):
    assert make_llm(str(yarn_qwen2)).engine.max_model_len == 128
    check_against_hf(yarn_qwen2, (PROMPT * 5)[:100], 8)


def test_yarn_through_hf_overrides_as_qwen_documents_it(tmp_path):
    """Qwen3's long-context recipe: rope_scaling set by --hf-overrides on a config without it; the engine then
    serves 4× the positions and equals HF running the config edited the same way."""
    import json
    import shutil

    base = build_tiny_model("qwen3", tmp_path / "base", max_position_embeddings=32)
    edited = tmp_path / "edited"
    shutil.copytree(base, edited)
    cfg = json.loads((edited / "config.json").read_text())
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    cfg["rope_parameters"] = {**cfg["rope_parameters"], **yarn}
    (edited / "config.json").write_text(json.dumps(cfg))
    check_against_hf(base, (PROMPT * 5)[:90], 8, hf_path=edited, hf_overrides={"rope_scaling": yarn})
    assert make_llm(str(base), hf_overrides={"rope_scaling": yarn}).engine.max_model_len == 128


def test_max_model_len_beyond_the_stretched_context_is_refused(yarn_qwen2):
    assert make_llm(str(yarn_qwen2), max_model_len=100).engine.max_model_len == 100
    with pytest.raises(ConfigError, match="max_model_len 129 exceeds the model's context length under its "
                                          "rope_scaling 128"):
        make_llm(str(yarn_qwen2), max_model_len=129)


def test_llama3_scaling_does_not_stretch(tiny_models):
    assert make_llm(str(tiny_models["llama3-rope"])).engine.max_model_len == 1024


def test_quantize_calibrates_within_the_stretched_context(tmp_path):
    """A YaRN config whose stretched context (32 × 2) is shorter than max_position_embeddings (256): calibration
    windows are cut to the 64 positions the rotary tables cover, and the summary says so."""
    from nvllm.quant.quantize import quantize_model
    from nvllm.quant.recipe import build_config

    model = build_tiny_model("llama", tmp_path / "m", max_position_embeddings=256,
                             rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32})
    cfg = build_config(None, method="gptq", group_size=32, calib_dataset="calib", calib_samples=2, calib_seqlen=128,
                       device="cpu")
    summary = quantize_model(str(model), str(tmp_path / "q"), cfg)
    assert "--calib-seqlen 128 exceeds the model's context length 64: windows of 64 tokens used" in summary.notes
    assert summary.tokens == 2 * 64
