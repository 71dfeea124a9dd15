"""cache_salt (vLLM's): prefix-cache blocks are shared only among requests with the same salt — offline through
dict prompts, and on the server's two endpoints (usage.prompt_tokens_details.cached_tokens)."""

from __future__ import annotations

import openai
import pytest

from nvllm import BeamSearchParams, SamplingParams
from nvllm.assets import demo_model_path
from tests.conftest import make_llm
from tests.server_utils import start_server, stop_server

PROMPT = "Once upon a time there was a little girl named Lily who loved to play in the park with her big red ball"


def test_offline_salts_keep_blocks_apart():
    llm = make_llm(demo_model_path(), block_size=4)
    params = SamplingParams(max_tokens=2, temperature=0)

    def cached(prompt) -> int:
        return llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens

    assert cached({"prompt": PROMPT, "cache_salt": "tenant-a"}) == 0
    assert cached({"prompt": PROMPT, "cache_salt": "tenant-a"}) > 0  # the same salt shares
    assert cached({"prompt": PROMPT, "cache_salt": "tenant-b"}) == 0
    assert cached(PROMPT) == 0  # no salt shares nothing with salted blocks
    assert cached(PROMPT) > 0
    for bad in ("", 5):  # checked before anything is queued
        with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
            llm.generate([{"prompt": PROMPT, "cache_salt": "x"}, {"prompt": PROMPT, "cache_salt": bad}], params,
                         use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()
    beams = BeamSearchParams(beam_width=2, max_tokens=2)
    other = "The dog ran to the park and found a big stick near the tall tree by the lake with his friend"
    llm.beam_search([{"prompt": other, "cache_salt": "tenant-c"}], beams)
    assert cached(other) == 0  # the search's blocks carry its salt
    assert cached({"prompt": other, "cache_salt": "tenant-c"}) > 0


def test_server_salts_keep_blocks_apart(tmp_path):
    proc, url = start_server(["--device", "cpu", "--max-model-len", "256", "--block-size", "4", "--log-stats-interval",
                              "0", "--uvicorn-log-level", "warning"], tmp_path / "log")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)

        def cached(salt=None, chat=False) -> int:
            extra = {} if salt is None else {"cache_salt": salt}
            if chat:
                r = client.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": PROMPT}],
                                                   max_tokens=2, extra_body=extra)
            else:
                r = client.completions.create(model="stories260K", prompt=PROMPT, max_tokens=2, extra_body=extra)
            return r.usage.prompt_tokens_details.cached_tokens

        first, again, other, unsalted = cached("a"), cached("a"), cached("b"), cached()
        assert first == other == unsalted == 0 and again > 0
        assert cached("c", chat=True) == 0 and cached("c", chat=True) > 0
        r = client.responses.create(model="stories260K", input=PROMPT, max_output_tokens=2,
                                    extra_body={"cache_salt": "d"})
        again = client.responses.create(model="stories260K", input=PROMPT, max_output_tokens=2,
                                        extra_body={"cache_salt": "d"})
        assert r.usage.input_tokens_details.cached_tokens == 0 < again.usage.input_tokens_details.cached_tokens
        try:
            cached("")
        except openai.BadRequestError as e:
            assert e.body["param"] == "cache_salt"
        else:
            raise AssertionError("an empty salt was accepted")
    finally:
        stop_server(proc)
