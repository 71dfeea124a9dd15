"""Our engine against HF transformers' forward pass and greedy generate(), for tiny random models of every
supported architecture and for the real demo model (fp32)."""

from __future__ import annotations

import pytest
import torch
import transformers

from nvllm import SamplingParams
from nvllm.config import ConfigError
from tests.conftest import ARCHS, make_llm

PROMPT = [1, 45, 300, 12, 99, 7, 250, 31, 400, 18, 77, 5, 301, 130, 64, 9, 200, 11, 17, 310]


def hf_model(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def check_against_hf(path, prompt, n_new: int, hf_path=None, **llm_kw):
    """hf_path: the model HF runs, when it is not ``path`` (``path`` with overrides in llm_kw)."""
    llm = make_llm(str(path), **llm_kw)
    vocab = llm.engine.vocab_size
    ref = hf_model(hf_path or path)
    with torch.no_grad():
        ref_logits = ref(torch.tensor([prompt])).logits[0]
    ref_lp = torch.log_softmax(ref_logits.double(), -1)

    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=vocab),
                       use_tqdm=False)[0]
    ours = torch.full((len(prompt) - 1, vocab), float("nan"), dtype=torch.float64)
    for pos in range(1, len(prompt)):
        for tok, lp in out.prompt_logprobs[pos].items():
            ours[pos - 1, tok] = lp.logprob
    assert not ours.isnan().any()
    assert rel_err(ours, ref_lp[:-1]) <= 1e-4

    greedy = llm.generate([prompt], SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    with torch.no_grad():
        hf_tokens = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n_new,
                                 min_new_tokens=n_new)[0, len(prompt):].tolist()
    assert greedy == hf_tokens


@pytest.mark.parametrize("kind", list(ARCHS))
def test_tiny_models_match_hf(tiny_models, kind):
    check_against_hf(tiny_models[kind], PROMPT, 32)


def test_layers_share_one_pair_of_rotary_tables(tiny_models):
    model = make_llm(str(tiny_models["llama3-rope"])).engine.runner.model
    assert len({(layer.rotary.cos.data_ptr(), layer.rotary.sin.data_ptr()) for layer in model.layers}) == 1


@pytest.mark.parametrize("kind, flags", [("llama", {"attention_bias": True}), ("qwen3", {"attention_bias": True}),
                                          ("llama", {"mlp_bias": True}), ("mistral", {"attention_bias": True,
                                                                                     "mlp_bias": True}),
                                          ("qwen2", {"mlp_bias": True}), ("llama", {"hidden_act": "swish"}),
                                          ("qwen3-moe", {"attention_bias": True}), ("qwen2-moe", {"qkv_bias": False}),
                                          ("qwen2-moe", {"mlp_only_layers": [1], "norm_topk_prob": True})])
def test_config_flags_as_hf_reads_them(tmp_path, kind, flags):
    """``attention_bias``: HF gives q/k/v and o_proj biases to Llama, Qwen3 and Qwen3-MoE (random here, as every tiny
    model's biases), ``mlp_bias`` the MLP's to Llama; Mistral and Qwen2 ignore both flags. "swish" is SiLU. Qwen2-MoE
    reads ``qkv_bias``; with ``mlp_only_layers`` it mixes a dense layer with sparse ones."""
    from tests.conftest import build_tiny_model

    check_against_hf(build_tiny_model(kind, tmp_path / kind, **flags), PROMPT, 16)


def _edited_copy(src, dst, **fields):
    """The model at ``src`` with config.json's rope_parameters given ``fields`` (a copy at ``dst``)."""
    import json
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["rope_parameters"] = {**cfg["rope_parameters"], **fields}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("overrides, fields", [
    ({"rope_theta": 50.0}, {"rope_theta": 50.0}),
    ({"rope_scaling": {"type": "linear", "factor": 4.0}}, {"rope_type": "linear", "factor": 4.0}),
    ({"rope_parameters": {"rope_type": "linear", "factor": 4.0}}, {"rope_type": "linear", "factor": 4.0}),
])
def test_rope_overrides_act_as_an_edited_config(tmp_path, overrides, fields):
    """--hf-overrides of rope_theta, rope_scaling or part of rope_parameters: the model HF runs from a config.json
    edited the same way (transformers 5 reads theta and scaling from rope_parameters alone)."""
    from tests.conftest import build_tiny_model

    base = build_tiny_model("llama", tmp_path / "base", rope_theta=1e6)
    if "rope_parameters" not in (base / "config.json").read_text():
        pytest.skip("transformers before 5 keeps rope_theta and rope_scaling as fields of their own")
    check_against_hf(base, PROMPT * 3, 8, hf_path=_edited_copy(base, tmp_path / "edited", **fields),
                     hf_overrides=overrides)


def test_demo_model_matches_hf(demo_dir):
    tok = transformers.AutoTokenizer.from_pretrained(demo_dir)
    check_against_hf(demo_dir, tok.encode("Once upon a time, there was a little dog named Max."), 64)


def test_rope_scaling_really_scales(tiny_models):
    """The llama3 fixture has original_max_position_embeddings 64, so scaling matters past 64 tokens."""
    prompt = (PROMPT * 5)[:90]
    check_against_hf(tiny_models["llama3-rope"], prompt, 8)


@pytest.mark.parametrize("kind, flags, limit", [
    ("mistral", {"sliding_window": 16}, 16),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}, 16),   # layer 1 slides
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2}, 256),  # no layer does
    ("qwen2", {"use_sliding_window": False, "sliding_window": 16}, 256),
    ("mistral", {"sliding_window": 16, "use_sliding_window": False}, 16),  # a Qwen field Mistral does not read
])
def test_sliding_window_caps_the_length_only_where_a_layer_slides(tmp_path, kind, flags, limit):
    """Within the window sliding attention equals full attention: max_model_len is capped to it when some layer
    slides (as transformers decides from the config), and long prompts then match HF where none does."""
    from tests.conftest import build_tiny_model

    path = build_tiny_model(kind, tmp_path / kind, **flags)
    assert make_llm(str(path)).engine.max_model_len == limit
    if limit > 16:
        check_against_hf(path, (PROMPT * 3)[:40], 8)
    else:  # asked for more than the window: refused, as past the model's other limits (it was lowered with a warning)
        assert make_llm(str(path), max_model_len=16).engine.max_model_len == 16
        with pytest.raises(ConfigError, match="max_model_len 100 exceeds the model's sliding window 16"):
            make_llm(str(path), max_model_len=100)


@pytest.mark.parametrize("written, overrides", [
    ({"use_sliding_window": False, "max_window_layers": 0}, {"use_sliding_window": True}),
    ({"use_sliding_window": True, "max_window_layers": 2}, {"max_window_layers": 0}),
    ({"use_sliding_window": True, "max_window_layers": 0}, {"use_sliding_window": False}),
])
def test_sliding_window_overrides_act_as_an_edited_config(tmp_path, written, overrides):
    """transformers derives Qwen2's window and its layers' kinds when it reads a config: --hf-overrides of the fields
    they come from give the model an edited config.json gives (before, the window stayed as the file had it)."""
    import json

    from tests.conftest import build_tiny_model

    def config_json(path, **fields):  # as transformers 4 wrote it: no layer_types, derived from the rest
        cfg = json.loads((path / "config.json").read_text())
        cfg.pop("layer_types", None)
        (path / "config.json").write_text(json.dumps({**cfg, "sliding_window": 16, **fields}))
        return path

    base = config_json(build_tiny_model("qwen2", tmp_path / "base"), **written)
    edited = config_json(build_tiny_model("qwen2", tmp_path / "edited"), **{**written, **overrides})
    expected = make_llm(str(edited)).engine.max_model_len
    assert expected != make_llm(str(base)).engine.max_model_len
    assert make_llm(str(base), hf_overrides=overrides).engine.max_model_len == expected


def test_a_tied_config_with_its_own_lm_head_says_it_is_unused(tmp_path, caplog):
    """config.json ties the head, the checkpoint has a different lm_head.weight: tied, as vLLM does, with a warning
    that names the override which uses it instead — and with that override the output is HF 5's (which uses it)."""
    import json
    import logging

    from tests.conftest import build_tiny_model

    path = build_tiny_model("llama", tmp_path / "m")   # its own random head
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    log = logging.getLogger("nvllm")
    log.addHandler(caplog.handler)
    try:
        make_llm(str(path))
    finally:
        log.removeHandler(caplog.handler)
    assert any("lm_head.weight differs" in r.getMessage() for r in caplog.records)
    if int(transformers.__version__.split(".")[0]) >= 5:
        check_against_hf(path, PROMPT, 8, hf_overrides={"tie_word_embeddings": False})
