"""presence_penalty, frequency_penalty, repetition_penalty and logit_bias through the real server (asynchronous
scheduling on, as on one GPU) and the official `openai` client: honoured, the same tokens as the offline LLM, and
bad values answered 400 naming the field."""

from __future__ import annotations


import openai
import pytest

from nvllm import SamplingParams
from nvllm.assets import demo_model_path
from tests.conftest import make_llm
from tests.server_utils import start_server, stop_server

MODEL = "stories260K"
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("serve_penalties") / "server.log"
    proc, base = start_server(["--async-scheduling", "--max-model-len", "256", "--device", "cpu",
                               "--log-stats-interval", "0", "--uvicorn-log-level", "warning"], log_path)
    yield openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
    stop_server(proc)


@pytest.fixture(scope="module")
def llm():
    return make_llm(demo_model_path())


def test_penalties_give_the_offline_tokens(client, llm):
    kw = dict(presence_penalty=0.5, frequency_penalty=1.0)
    extra = {"repetition_penalty": 1.3, "ignore_eos": True}
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, extra_body=extra, **kw)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                      extra_body={"ignore_eos": True})
    want = llm.generate([PROMPT], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True,
                                                 repetition_penalty=1.3, **kw), use_tqdm=False)[0].outputs[0].text
    assert r.choices[0].text == want != plain.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=8,
                                          temperature=0, extra_body=extra, **kw)
    assert chat.choices[0].message.content and chat.choices[0].finish_reason == "length"


def test_logit_bias_is_honoured(client, llm):
    tok = llm.get_tokenizer()
    dog = tok.encode(" dog", add_special_tokens=False)[-1]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=0,
                                  logit_bias={str(dog): 100}, frequency_penalty=1.0, extra_body={"ignore_eos": True})
    assert r.choices[0].logprobs.tokens == [tok.decode([dog])] * 5
    first = llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)[0].outputs[0]
    banned = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=0,
                                       logit_bias={str(first.token_ids[0]): -100})
    assert first.text and first.text not in banned.choices[0].logprobs.tokens
    # a bias beyond 100 is clamped, not refused (OpenAI's and vLLM's rule)
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, logit_bias={"5": 1000}).choices


@pytest.mark.parametrize("kw, param", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    (dict(logit_bias={"1.0": 5}), "logit_bias"),
    (dict(logit_bias={"99999": 5}), "logit_bias"),
])
def test_bad_values_answer_400_naming_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, **kw)
    assert e.value.body["param"] == param and e.value.body["message"].startswith(param)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, **kw)
    assert e.value.body["param"] == param
