"""What a vLLM script passes to LLM(...) and its helpers, taken as vLLM takes it: its engine arguments (no-ops,
mapped names, a checked quantization method), SamplingParams.clone, llm.llm_engine, LLM.chat with an adapter, and
`nvllm serve MODEL`."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from nvllm import LLM, LoRARequest, SamplingParams
from nvllm.config import ConfigError
from tests.conftest import build_tiny_model

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def test_vllm_engine_arguments(demo_dir):
    plain = LLM(demo_dir, device="cpu", log_stats_interval=0)
    vllm_style = LLM(model=demo_dir, device="cpu", dtype=torch.float32, seed=None, trust_remote_code=True,
                     tokenizer_mode="auto", disable_log_stats=True, swap_space=4, task="generate",
                     quantization=None)
    assert vllm_style.config.dtype == "float32" and 0 <= vllm_style.config.seed < 2**31  # unseeded: its own seed
    assert vllm_style.config.log_stats_interval == 0
    assert vllm_style.llm_engine is vllm_style.engine
    assert vllm_style.llm_engine.get_tokenizer() is vllm_style.get_tokenizer()
    prompt = "Once upon a time"
    assert vllm_style.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == \
        plain.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_vllm_engine_level_calls_and_outputs(demo_dir):
    """llm.llm_engine as vLLM scripts drive it: dict prompts (text, token ids, a cache_salt), abort_request with a
    list of ids; and CompletionOutput.finished() a method, as vLLM's."""
    llm = LLM(demo_dir, device="cpu", log_stats_interval=0)
    engine = llm.llm_engine
    ids = llm.get_tokenizer().encode("Once upon a time")
    engine.add_request("text", {"prompt": "Once upon a time"}, GREEDY)
    engine.add_request("ids", {"prompt_token_ids": ids, "cache_salt": "tenant"}, GREEDY)
    engine.add_request("gone-1", "The dog", GREEDY)
    engine.add_request("gone-2", "The cat", GREEDY)
    assert engine.requests["ids"][0].request_cache_salt == "tenant"
    engine.abort_request(["gone-1", "gone-2"])
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(done) == ["ids", "text"]
    assert done["text"].outputs[0].token_ids == done["ids"].outputs[0].token_ids
    assert done["text"].outputs[0].finished() is True
    with pytest.raises(ValueError, match="exactly one of 'prompt' and 'prompt_token_ids'"):
        engine.add_request("bad", {"text": "x"}, GREEDY)


@pytest.mark.parametrize("kwargs, message", [
    ({"tokenizer_mode": "mistral"}, "tokenizer_mode 'mistral' is not supported"),
    ({"task": "embed"}, "task 'embed' is not supported"),
    ({"quantization": "bitsandbytes"}, "quantization 'bitsandbytes' is not supported"),
    ({"quantization": "awq"}, "quantization 'awq' was asked for, but .* is not quantized"),
])
def test_vllm_arguments_nvllm_cannot_honour_are_one_clear_error(demo_dir, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LLM(demo_dir, device="cpu", log_stats_interval=0, **kwargs)


def test_quantization_names_the_checkpoints_method(tmp_path):
    from nvllm.quant.quantize import quantize_model
    from nvllm.quant.recipe import build_config

    base = build_tiny_model("llama", tmp_path / "base")
    out = tmp_path / "gptq"
    quantize_model(str(base), str(out), build_config(None, method="rtn", group_size=32, device="cpu"))
    for name in ("gptq", "gptq_marlin", "GPTQ"):  # vLLM's kernel-specific names mean the same checkpoint
        assert LLM(str(out), device="cpu", log_stats_interval=0, quantization=name).config.quantization == "gptq"
    drafted = LLM(str(out), device="cpu", log_stats_interval=0, quantization="gptq", speculative=f"k=2,draft={base}")
    assert drafted.engine.spec is not None  # the method names the target's checkpoint, not the draft's
    with pytest.raises(ConfigError, match="quantization 'awq' was asked for, but .* is a gptq checkpoint"):
        LLM(str(out), device="cpu", log_stats_interval=0, quantization="awq")


def test_max_logprobs_caps_requests(demo_dir):
    llm = LLM(demo_dir, device="cpu", log_stats_interval=0, max_logprobs=2)
    assert len(llm.generate("Hi", SamplingParams(max_tokens=1, logprobs=2), use_tqdm=False)[0].outputs[0]
               .logprobs[0]) >= 2
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"{field} must be at most max_logprobs 2, got 3"):
            llm.generate("Hi", SamplingParams(max_tokens=1, **{field: 3}), use_tqdm=False)
    with pytest.raises(ValueError, match=r"logprobs must be at most max_logprobs 2, got -1 \(the whole vocabulary, "
                                         r"512\)"):
        llm.generate("Hi", SamplingParams(max_tokens=1, logprobs=-1), use_tqdm=False)
    with pytest.raises(ConfigError, match="max_logprobs must be -1"):
        LLM(demo_dir, device="cpu", max_logprobs=-2)


def test_logprobs_minus_one_is_the_whole_vocabulary(demo_dir):
    """vLLM's -1: every token's log-probability, for each generated token and each prompt token after the first."""
    llm = LLM(demo_dir, device="cpu", log_stats_interval=0)
    out = llm.generate("Once upon a time", SamplingParams(max_tokens=2, logprobs=-1, prompt_logprobs=-1),
                       use_tqdm=False)[0]
    assert [len(d) for d in out.outputs[0].logprobs] == [512, 512]
    assert out.prompt_logprobs[0] is None and {len(d) for d in out.prompt_logprobs[1:]} == {512}
    assert sorted(x.rank for x in out.outputs[0].logprobs[0].values()) == list(range(1, 513))
    with pytest.raises(ValueError, match=r"logprobs must be non-negative or -1 \(the whole vocabulary\), got -2"):
        SamplingParams(logprobs=-2)


def test_sampling_params_clone_is_deep():
    a = SamplingParams(stop=["x"], logit_bias={3: 1.0})
    b = a.clone()
    b.stop.append("y")
    b.logit_bias[4] = 2.0
    assert a.stop == ["x"] and a.logit_bias == {3: 1.0} and b == SamplingParams(stop=["x", "y"],
                                                                              logit_bias={3: 1.0, 4: 2.0})


def test_clone_after_a_constrained_run_shares_the_compiled_grammar(demo_dir):
    from nvllm.sampling_params import StructuredOutputsParams

    llm = LLM(demo_dir, device="cpu", log_stats_interval=0)
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    first = llm.generate("Answer:", params, use_tqdm=False)[0].outputs[0].text
    copy = params.clone()
    assert copy == params and copy.structured_outputs is not params.structured_outputs
    assert llm.generate("Answer:", copy, use_tqdm=False)[0].outputs[0].text in ("yes", "no") and first in ("yes", "no")


def test_serve_model_keeps_the_tokenizer_revision():
    from nvllm.cli import _with_model
    from nvllm.config import EngineConfig

    assert _with_model(EngineConfig(tokenizer_revision="t2", revision="r1"), "a/b").tokenizer_revision == "t2"
    plain = _with_model(EngineConfig(revision="r1"), "a/b")
    assert (plain.model, plain.tokenizer, plain.tokenizer_revision) == ("a/b", "a/b", "r1")


def test_chat_with_a_lora_adapter(tmp_path):
    from tests.lora_utils import make_adapter

    base = build_tiny_model("qwen2", tmp_path / "base")
    adapter = make_adapter(base, tmp_path / "adapter", seed=3)
    llm = LLM(str(base), device="cpu", log_stats_interval=0, enable_lora=True, max_lora_rank=8)
    conversation = [{"role": "user", "content": "Tell me a story"}]
    lora = LoRARequest("story", 1, str(adapter))
    chatted = llm.chat(conversation, GREEDY, False, lora)[0]  # vLLM's order: lora_request fourth
    generated = llm.generate({"prompt_token_ids": chatted.prompt_token_ids}, GREEDY, use_tqdm=False,
                             lora_request=lora)[0]
    base_reply = llm.chat(conversation, GREEDY, use_tqdm=False)[0]
    assert chatted.outputs[0].token_ids == generated.outputs[0].token_ids != base_reply.outputs[0].token_ids


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nvllm.cli", "serve", *args], capture_output=True, text=True,
                          timeout=120)


def test_serve_takes_the_model_as_its_argument(tmp_path):
    """`nvllm serve MODEL`, as `vllm serve MODEL`: the argument is --model (a missing one fails as --model's
    would); both at once must agree."""
    r = _serve(str(tmp_path / "nope"))
    assert r.returncode == 2 and f"model directory not found: {tmp_path / 'nope'}" in r.stderr
    r = _serve("a/b", "--model", "c/d")
    assert r.returncode == 2 and "the model is given twice: a/b and --model c/d" in r.stderr
    r = _serve("--chat-template-content-format", "html")
    assert r.returncode == 2 and "unknown --chat-template-content-format 'html'" in r.stderr
    r = _serve("--chat-template", "missing.jinja")
    assert r.returncode == 2 and "chat template file missing.jinja does not exist" in r.stderr
    r = _serve("--uvicorn-log-level", "bogus")  # refused before the model loads (uvicorn raised once serving)
    assert r.returncode == 2 and "--uvicorn-log-level must be one of critical" in r.stderr
    from nvllm.disagg.router_config import RouterConfig

    with pytest.raises(ConfigError, match="--uvicorn-log-level must be one of"):
        RouterConfig(["http://a:1"], ["http://b:2"], log_level="bogus")
    assert RouterConfig(["http://a:1"], ["http://b:2"], log_level="WARNING").log_level == "warning"
    r = _serve("--help")
    assert "[MODEL]" in r.stdout and "-tp" in r.stdout and "--trust-remote-code" in r.stdout
    assert "--disable-log-stats" in r.stdout


def test_serve_model_argument_serves_it(tmp_path):
    import httpx

    from tests.server_utils import start_server, stop_server

    model = build_tiny_model("llama", tmp_path / "tiny")
    proc, base = start_server([str(model), "--device", "cpu", "--log-stats-interval", "0", "-tp", "1",
                               "--trust-remote-code", "--max-logprobs", "5"], tmp_path / "serve.log")
    try:
        assert httpx.get(f"{base}/v1/models").json()["data"][0]["id"] == str(model)
        body = {"model": str(model), "prompt": [1, 2, 3], "max_tokens": 1}
        assert httpx.post(f"{base}/v1/completions", json={**body, "logprobs": 5}).status_code == 200
        r = httpx.post(f"{base}/v1/completions", json={**body, "logprobs": 6})
        assert r.status_code == 400 and "logprobs must be in [0, 5], got 6" in r.json()["error"]["message"]
        r = httpx.post(f"{base}/v1/completions", json={**body, "prompt_logprobs": -1})
        assert r.status_code == 400 and "prompt_logprobs -1 asks for the whole vocabulary (512), more than the " \
            "server's limit 5" in r.json()["error"]["message"]
    finally:
        stop_server(proc)


def test_logprobs_minus_one_on_the_server(tmp_path):
    """-1 where vLLM's server takes it (chat's top_logprobs, prompt_logprobs), under --max-logprobs -1: the whole
    vocabulary; completions' logprobs stays non-negative, as vLLM's."""
    import httpx

    from tests.server_utils import start_server, stop_server

    model = build_tiny_model("llama", tmp_path / "tiny")
    proc, base = start_server([str(model), "--device", "cpu", "--log-stats-interval", "0", "--max-logprobs", "-1"],
                              tmp_path / "serve.log")
    try:
        chat = httpx.post(f"{base}/v1/chat/completions", json={
            "model": str(model), "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "logprobs": True,
            "top_logprobs": -1, "prompt_logprobs": -1}).json()
        assert len(chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 512
        assert {len(d) for d in chat["prompt_logprobs"][1:]} == {512}
        r = httpx.post(f"{base}/v1/completions", json={"model": str(model), "prompt": [1, 2], "max_tokens": 1,
                                                       "logprobs": -1})
        assert r.status_code == 400 and "logprobs must be in [0, 512], got -1" in r.json()["error"]["message"]
    finally:
        stop_server(proc)


def test_a_prompt_that_tokenizes_to_nothing_is_refused(tmp_path):
    """A tokenizer that drops the text (here: its normalizer keeps only a and b) gives no token to start from: one
    ValueError, instead of a sequence the scheduler could never run."""
    import tokenizers
    import transformers

    model = build_tiny_model("llama", tmp_path / "m")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (model / name).unlink()
    raw = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "?": 2}, unk_token="?"))
    raw.normalizer = tokenizers.normalizers.Replace(tokenizers.Regex("[^ab ]"), "")
    raw.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=raw).save_pretrained(model)
    llm = LLM(str(model), device="cpu", log_stats_interval=0)
    assert llm.get_tokenizer().encode("Hello") == []
    with pytest.raises(ValueError, match="the prompt 'Hello' tokenizes to no tokens"):
        llm.generate("Hello", GREEDY, use_tqdm=False)
    assert llm.generate("a b", GREEDY, use_tqdm=False)[0].prompt_token_ids == [0, 1]


def test_the_api_key_from_vllms_environment_variable(tmp_path, monkeypatch):
    """VLLM_API_KEY (vLLM's) guards the server as NVLLM_API_KEY and --api-key do: a deployment moved over from vLLM
    keeps its key (it served without one)."""
    import httpx

    from tests.server_utils import start_server, stop_server

    monkeypatch.delenv("NVLLM_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "secret")
    proc, base = start_server(["--device", "cpu", "--log-stats-interval", "0"], tmp_path / "serve.log")
    try:
        body = {"model": "stories260K", "prompt": "Once", "max_tokens": 1}
        assert httpx.post(f"{base}/v1/completions", json=body).status_code == 401
        assert httpx.post(f"{base}/v1/completions", json=body,
                          headers={"Authorization": "Bearer secret"}).status_code == 200
    finally:
        stop_server(proc)


def test_speculative_config_as_vllms_flag():
    """vLLM's --speculative-config JSON works as nvllm's --speculative (the same option)."""
    r = subprocess.run([sys.executable, "-m", "nvllm.cli", "generate", "--speculative-config",
                        '{"method": "ngram", "num_speculative_tokens": 3}', "--max-tokens", "8", "Once"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0 and "speculative decoding: k=3, n-gram lookup" in r.stderr, r.stderr[-2000:]


def test_several_served_model_names(tmp_path):
    """--served-model-name given more than once: every name is served and listed, and responses carry the first, as
    vLLM answers (the flag kept only its last value)."""
    import httpx

    from tests.server_utils import start_server, stop_server

    proc, base = start_server(["--device", "cpu", "--log-stats-interval", "0", "--served-model-name", "gpt-4-0613",
                               "--served-model-name", "gpt-4"], tmp_path / "serve.log")
    try:
        assert [m["id"] for m in httpx.get(f"{base}/v1/models").json()["data"]] == ["gpt-4-0613", "gpt-4"]
        for name in ("gpt-4-0613", "gpt-4"):
            r = httpx.post(f"{base}/v1/completions", json={"model": name, "prompt": "Once", "max_tokens": 1})
            assert r.status_code == 200 and r.json()["model"] == "gpt-4-0613"
        r = httpx.post(f"{base}/v1/completions", json={"model": "stories260K", "prompt": "Once", "max_tokens": 1})
        assert r.status_code == 404
    finally:
        stop_server(proc)
