"""The model's generation_config.json as the default sampling parameters (vLLM's --generation-config): what
LLM.generate uses without sampling params, what a server request that leaves a field unset gets, and bad
settings or files ending in one clear line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import openai
import pytest

from nvllm import SamplingParams
from nvllm.assets import demo_model_path
from nvllm.config import ConfigError, EngineConfig
from nvllm.engine import generation_defaults
from nvllm.serve.params import resolve_max_tokens, sampling_params
from nvllm.serve.protocol import ChatCompletionRequest, CompletionRequest
from tests.conftest import make_llm
from tests.server_utils import start_server, stop_server

PROMPT = "Once upon a time"
# do_sample false as well: vLLM ignores it, and so must we. top_k 1 makes sampling greedy; a repetition penalty of 2
# changes the demo model's greedy text within 12 tokens
RECOMMENDED = {"do_sample": False, "top_k": 1, "repetition_penalty": 2.0, "max_new_tokens": 12}
WANT = SamplingParams(top_k=1, repetition_penalty=2.0, max_tokens=12)
QWEN25 = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
          "repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "transformers_version": "4.37.0"}


def model_with(folder, generation_config) -> str:
    """The demo model (real weights: its text shows what sampling did) with another generation_config.json."""
    shutil.copytree(demo_model_path(), folder)
    text = generation_config if isinstance(generation_config, str) else json.dumps(
        {"bos_token_id": 1, "eos_token_id": [2, 1], **generation_config})
    (folder / "generation_config.json").write_text(text)
    return str(folder)


@pytest.fixture(scope="module")
def recommending(tmp_path_factory) -> str:
    return model_with(tmp_path_factory.mktemp("genconf") / "m", RECOMMENDED)


@pytest.fixture(scope="module")
def llm(recommending):
    return make_llm(recommending)


def tokens(llm, params=None) -> list[int]:
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids


# ---- reading the file ------------------------------------------------------------------------------------
def test_the_fields_vllm_takes_and_nothing_else(tmp_path):
    qwen = tmp_path / "qwen"
    qwen.mkdir()
    (qwen / "generation_config.json").write_text(json.dumps(QWEN25))
    want = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    assert generation_defaults.load("auto", str(qwen)) == want
    assert generation_defaults.load(str(qwen), demo_model_path()) == want  # a folder: its file, not the model's
    assert generation_defaults.load("vllm", str(qwen)) == {}
    # the demo model's file holds only token ids: its defaults stay SamplingParams' own
    assert generation_defaults.load("auto", demo_model_path()) == {}
    assert generation_defaults.load("auto", str(tmp_path)) == {}  # no file: nothing recommended


def test_bad_settings_and_files_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="'/no/such/dir' is not a folder; use auto"):
        EngineConfig(device="cpu", generation_config="/no/such/dir")
    with pytest.raises(ConfigError, match=f"no generation_config.json in {tmp_path}"):
        EngineConfig(device="cpu", generation_config=str(tmp_path))
    path = tmp_path / "generation_config.json"
    for text, message in (("{not json", f"cannot read {path}: "), ('{"top_p": 0}', f"{path}: top_p must be in (0, 1]"),
                          ('{"top_k": "20"}', f"{path}: top_k must be an integer, got '20'"),
                          ('{"temperature": true}', f"{path}: temperature must be a number")):
        path.write_text(text)
        with pytest.raises(ConfigError) as e:
            generation_defaults.load(str(tmp_path), "/the/model")  # a folder given: its file must be right
        assert str(e.value).startswith(message)
        # the model's own file under auto: a warning and no defaults, as vLLM ignores what it cannot read
        assert generation_defaults.load("auto", str(tmp_path)) == {}


def test_cli_bad_setting_and_malformed_file_are_one_line(tmp_path):
    env = dict(os.environ, COLUMNS="200")

    def nvllm(*args):
        return subprocess.run([sys.executable, "-m", "nvllm.cli", "generate", "--device", "cpu", *args],
                              capture_output=True, text=True, timeout=120, env=env)

    r = nvllm("--generation-config", "/no/such/dir")
    assert r.returncode == 2 and r.stderr.strip() == ("error: generation_config '/no/such/dir' is not a folder; use "
                                                      "auto (the model's generation_config.json), vllm (ignore it) "
                                                      "or a folder holding one"), r.stderr
    model = model_with(tmp_path / "m", "{not json")
    r = nvllm("--model", model, "--generation-config", model, "--max-tokens", "4")
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(
        f"error: cannot read {model}/generation_config.json"), r.stderr
    assert "Traceback" not in r.stderr
    r = nvllm("--model", model, "--max-tokens", "4")  # auto: the model still runs, and says what it ignored
    assert r.returncode == 0 and "cannot read" in r.stdout + r.stderr and "not used" in r.stdout + r.stderr, r.stderr


# ---- offline -------------------------------------------------------------------------------------------
def test_generate_without_params_uses_the_model_defaults(llm, recommending):
    assert llm.get_default_sampling_params() == WANT
    got = tokens(llm)
    assert got == tokens(llm, WANT) and len(got) == 12
    greedy = tokens(llm, SamplingParams(temperature=0, max_tokens=12))  # explicit params win: no penalty
    assert greedy != got
    plain = make_llm(recommending, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
    assert tokens(plain) != got


def test_generate_cli_takes_the_model_defaults_unless_flags_say_otherwise(llm, recommending):
    def cli(*args):
        r = subprocess.run([sys.executable, "-m", "nvllm.cli", "generate", PROMPT, "--model", recommending,
                            "--device", "cpu", "--log-stats-interval", "0", *args],
                           capture_output=True, text=True, timeout=120, env=dict(os.environ, COLUMNS="200"))
        assert r.returncode == 0, r.stderr
        return r.stdout, " ".join(r.stderr.split())

    out, err = cli()  # its own default is greedy: with the model's top_k 1, the same tokens
    assert out == PROMPT + llm.generate(PROMPT, WANT, use_tqdm=False)[0].outputs[0].text + "\n"
    assert "overridden by the model's Hugging Face generation config" in err
    out, _ = cli("--repetition-penalty", "1", "--max-tokens", "12")
    assert out == PROMPT + llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12),
                                        use_tqdm=False)[0].outputs[0].text + "\n"


# ---- the server's request mapping ----------------------------------------------------------------------
def test_request_fields_left_unset_take_the_model_defaults():
    defaults = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 64}
    p = sampling_params(CompletionRequest(prompt="x"), 16, None, defaults=defaults)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.7, 0.8, 20, 0.0, 1.05)
    p = sampling_params(ChatCompletionRequest(messages=[], temperature=0, top_k=-1, repetition_penalty=1.0,
                                              top_p=None), 16, None, defaults=defaults)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.0, 0.8, -1, 1.0)
    p = sampling_params(CompletionRequest(prompt="x"), 16, None)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (1.0, 1.0, -1, 0.0, 1.0)
    # max_new_tokens is the default for an unset max_tokens (never past the context); a request's own wins
    assert resolve_max_tokens(None, 10, 100, "max_tokens", 64) == 64
    assert resolve_max_tokens(None, 50, 100, "max_tokens", 64) == 50
    assert resolve_max_tokens(80, 10, 100, "max_tokens", 64) == 80


@pytest.fixture(scope="module")
def client(recommending, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("serve_genconf") / "server.log"
    proc, base = start_server(["--model", recommending, "--served-model-name", "m", "--max-model-len", "256",
                               "--device", "cpu", "--log-stats-interval", "0", "--uvicorn-log-level", "warning"],
                              log_path)
    yield openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120), log_path
    stop_server(proc)


def test_server_requests_take_the_model_defaults_and_explicit_values_win(client, llm):
    c, log_path = client
    want = llm.generate(PROMPT, WANT, use_tqdm=False)[0].outputs[0].text
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0].text
    assert c.completions.create(model="m", prompt=PROMPT, max_tokens=12).choices[0].text == want != greedy
    explicit = c.completions.create(model="m", prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body={"top_k": -1, "repetition_penalty": 1.0})
    assert explicit.choices[0].text == greedy
    # chat without max_tokens: the model's max_new_tokens (12), not all of the context
    chat = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                     extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 12 and chat.choices[0].finish_reason == "length"
    # a completion without max_tokens: its 16 within the model's 12 (as vLLM); an explicit one wins
    plain = c.completions.create(model="m", prompt=PROMPT, extra_body={"ignore_eos": True})
    longer = c.completions.create(model="m", prompt=PROMPT, max_tokens=20, extra_body={"ignore_eos": True})
    assert (plain.usage.completion_tokens, longer.usage.completion_tokens) == (12, 20)
    log = " ".join(log_path.read_text().split())
    assert "overridden by the model's Hugging Face generation config" in log and "'top_k': 1" in log
