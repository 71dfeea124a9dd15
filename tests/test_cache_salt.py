"""cache_salt (vLLM's): prefix-cache blocks are shared only among requests with the same salt — offline through
dict prompts, and on the server's two endpoints (usage.prompt_tokens_details.cached_tokens)."""

from __future__ import annotations

import openai

from nvllm import SamplingParams
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
        try:
            cached("")
        except openai.BadRequestError as e:
            assert e.body["param"] == "cache_salt"
        else:
            raise AssertionError("an empty salt was accepted")
    finally:
        stop_server(proc)
