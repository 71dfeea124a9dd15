"""Our engine against HF transformers' forward pass and greedy generate(), for tiny random models of every
supported architecture and for the real demo model (fp32)."""

from __future__ import annotations

import pytest
import torch
import transformers

from nvllm import SamplingParams
from tests.conftest import ARCHS, make_llm

PROMPT = [1, 45, 300, 12, 99, 7, 250, 31, 400, 18, 77, 5, 301, 130, 64, 9, 200, 11, 17, 310]


def hf_model(path):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def check_against_hf(path, prompt, n_new: int):
    llm = make_llm(str(path))
    vocab = llm.engine.vocab_size
    ref = hf_model(path)
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


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_attention_bias_matches_hf(tmp_path, kind):
    """``attention_bias``: HF gives q/k/v and o_proj biases (random here, as every tiny model's biases)."""
    from tests.conftest import build_tiny_model

    check_against_hf(build_tiny_model(kind, tmp_path / kind, attention_bias=True), PROMPT, 16)


def test_demo_model_matches_hf(demo_dir):
    tok = transformers.AutoTokenizer.from_pretrained(demo_dir)
    check_against_hf(demo_dir, tok.encode("Once upon a time, there was a little dog named Max."), 64)


def test_rope_scaling_really_scales(tiny_models):
    """The llama3 fixture has original_max_position_embeddings 64, so scaling matters past 64 tokens."""
    prompt = (PROMPT * 5)[:90]
    check_against_hf(tiny_models["llama3-rope"], prompt, 8)
