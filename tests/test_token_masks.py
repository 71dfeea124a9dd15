"""allowed_token_ids, bad_words and truncate_prompt_tokens (vLLM's SamplingParams fields) on the demo model: greedy
outputs equal HF transformers' generate() with its own logits processors for the same rule
(PrefixConstrainedLogitsProcessor, NoBadWordsLogitsProcessor), the same under asynchronous scheduling and
speculative decoding, and through the server with the openai client; bad values are one clear error."""

from __future__ import annotations

import openai
import pytest
import torch
import transformers

from nvllm import SamplingParams
from nvllm.layers.token_masks import bad_word_bans, bad_words_token_ids
from tests.conftest import make_llm
from tests.server_utils import start_server, stop_server

PROMPT = "Once upon a time"
N = 40


@pytest.fixture(scope="module")
def llm(demo_dir):
    return make_llm(demo_dir)


@pytest.fixture(scope="module")
def hf(demo_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(demo_dir, dtype=torch.float32).eval()


def hf_greedy(hf, ids: list[int], processor) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=N, min_new_tokens=N,
                          logits_processor=transformers.LogitsProcessorList([processor]), pad_token_id=0)
    return out[0, len(ids):].tolist()


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": N, "ignore_eos": True, **kw})


def tokens(llm, prompt, params) -> list[int]:
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


def test_bad_words_tokenized_as_vllm_does(llm):
    tok = llm.get_tokenizer()
    plain, spaced = (tok.encode(w, add_special_tokens=False) for w in ("Lily", " Lily"))
    assert bad_words_token_ids(["Lily"], tok) == [plain] + ([spaced] if spaced[0] != plain[0]
                                                             and len(spaced) == len(plain) else [])
    assert bad_words_token_ids(["  Lily"], tok) == bad_words_token_ids(["Lily"], tok)  # leading spaces dropped
    assert bad_word_bans([[5, 6, 7], [9]], [1, 5, 6]) == [7, 9]
    assert bad_word_bans([[5, 6, 7]], [6]) == [] and bad_word_bans([[5, 6, 7]], [6, 5]) == []


def test_bad_words_as_hf_bans_them(llm, hf):
    plain = tokens(llm, PROMPT, greedy())
    text = llm.get_tokenizer().decode(plain)
    words = [w for w in ("Lily", "park", "happy", "ball") if w in text][:2]
    assert words, text
    ids = llm.get_tokenizer().encode(PROMPT)
    got = tokens(llm, PROMPT, greedy(bad_words=words))
    banned = bad_words_token_ids(words, llm.get_tokenizer())
    assert got == hf_greedy(hf, ids, transformers.NoBadWordsLogitsProcessor(banned, eos_token_id=None))
    assert got != plain and all(w not in llm.get_tokenizer().decode(got) for w in words)


def test_allowed_token_ids_as_hf_restricts_them(llm, hf):
    plain = tokens(llm, PROMPT, greedy())
    allowed = sorted(set(plain[::2]) | {13, 29})
    ids = llm.get_tokenizer().encode(PROMPT)
    got = tokens(llm, PROMPT, greedy(allowed_token_ids=allowed))
    assert got == hf_greedy(hf, ids, transformers.PrefixConstrainedLogitsProcessor(lambda b, s: allowed, 1))
    assert set(got) <= set(allowed) and got != plain
    # logprobs stay the raw distribution's: a token outside the list can be the most likely one there
    out = llm.generate(PROMPT, greedy(allowed_token_ids=allowed, logprobs=1, max_tokens=8), use_tqdm=False)[0]
    assert any(max(d.values(), key=lambda lp: lp.logprob).rank == 1 for d in out.outputs[0].logprobs)


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    ids = llm.get_tokenizer().encode("Tom and Lily went to the park. They played with a big red ball all day")
    got = llm.generate({"prompt_token_ids": ids}, greedy(truncate_prompt_tokens=6), use_tqdm=False)[0]
    assert got.prompt_token_ids == ids[-6:]
    assert got.outputs[0].token_ids == tokens(llm, {"prompt_token_ids": ids[-6:]}, greedy())
    # -1: as much of the prompt as max_model_len leaves room for
    long = ids * 40
    out = llm.generate({"prompt_token_ids": long}, greedy(truncate_prompt_tokens=-1, max_tokens=1), use_tqdm=False)
    assert len(out[0].prompt_token_ids) == llm.engine.max_model_len - 1


@pytest.mark.parametrize("kw, message", [
    (dict(allowed_token_ids=[]), "allowed_token_ids must be a non-empty list"),
    (dict(allowed_token_ids=[-1]), "allowed_token_ids must be a non-empty list"),
    (dict(bad_words=[""]), "bad_words must be a list of non-empty strings"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens must be at least 1, or -1"),
])
def test_bad_values(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)


def test_out_of_vocabulary_allowed_ids_refused(llm):
    with pytest.raises(ValueError, match="allowed_token_ids token id 100000 is outside the vocabulary"):
        llm.generate(PROMPT, greedy(allowed_token_ids=[5, 100000]), use_tqdm=False)


def test_bad_words_beyond_the_models_vocabulary_refused(tmp_path):
    """A tokenizer may know more tokens than the model scores: a bad word made of such tokens is refused when the
    request is added, and the engine goes on serving."""
    from tests.conftest import build_tiny_model

    small = make_llm(str(build_tiny_model("llama", tmp_path / "m", vocab_size=300)))
    word = next(w for w in ("Lily", "happy", "park", "ball", "dog")
                if max(small.get_tokenizer().encode(w, add_special_tokens=False)) >= 300)
    with pytest.raises(ValueError, match="bad_words tokenize to token id .* outside the model's vocabulary"):
        small.generate({"prompt_token_ids": [1, 5, 9]}, greedy(bad_words=[word]), use_tqdm=False)
    assert small.generate({"prompt_token_ids": [1, 5, 9]}, greedy(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("engine", ["async", "ngram", "self draft"])
def test_async_scheduling_and_speculation_give_the_same_tokens(engine, llm, demo_dir):
    """Bad words count the tokens generated so far: under asynchronous scheduling the step in flight is read
    first; under speculative decoding each verified position counts the drafts before it (the model drafting
    for itself proposes the banned words' tokens, whose prefixes are drafts of the same run)."""
    prompts = [PROMPT, "Lily had a ball. She loved the ball. She", PROMPT]
    params = [greedy(bad_words=["she saw", "play outside"]), greedy(allowed_token_ids=list(range(300))),
              greedy(bad_words=["little girl", "the"])]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    other = make_llm(demo_dir, **{"async": dict(async_scheduling=True), "ngram": dict(speculative="k=3,method=ngram"),
                                  "self draft": dict(speculative=f"k=3,draft={demo_dir}")}[engine])
    assert [o.outputs[0].token_ids for o in other.generate(prompts, params, use_tqdm=False)] == want
    if engine != "async":
        assert other.engine.stats.spec.num_accepted_tokens > 0


def test_through_the_server(llm, tmp_path):
    proc, base = start_server(["--max-model-len", "256", "--device", "cpu", "--log-stats-interval", "0",
                               "--uvicorn-log-level", "warning"], tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
        ids = llm.get_tokenizer().encode("Tom and Lily went to the park. They played with a big red ball")
        extra = {"truncate_prompt_tokens": 5, "bad_words": ["the"], "allowed_token_ids": list(range(400)),
                 "ignore_eos": True}
        r = client.completions.create(model="stories260K", prompt=ids, max_tokens=20, temperature=0, extra_body=extra)
        want = llm.generate({"prompt_token_ids": ids}, greedy(max_tokens=20, truncate_prompt_tokens=5,
                                                              bad_words=["the"], allowed_token_ids=list(range(400))),
                            use_tqdm=False)[0].outputs[0]
        assert r.choices[0].text == want.text and r.usage.prompt_tokens == 5
        chat = client.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": "Hi " * 50}],
                                              max_tokens=4, extra_body={"truncate_prompt_tokens": 7})
        assert chat.usage.prompt_tokens == 7
        for body, param in (({"use_beam_search": True, "n": 2, "bad_words": ["the"]}, "bad_words"),
                            ({"allowed_token_ids": []}, "allowed_token_ids"),
                            ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
                            ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                            ({"bad_words": [""]}, "bad_words")):
            with pytest.raises(openai.BadRequestError) as e:
                client.completions.create(model="stories260K", prompt="Hi", max_tokens=2, extra_body=body)
            assert param in str(e.value)
    finally:
        stop_server(proc)
