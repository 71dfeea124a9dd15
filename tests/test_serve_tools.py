"""Tool calling through the real server and the official `openai` client: the demo model served with Qwen3's chat
template, ``--enable-auto-tool-choice --tool-call-parser hermes``. Named and required choices give calls whose
arguments validate (pydantic) against the tool's schema; ``auto`` takes hermes calls out of the text (the reply is
forced into that format with a regex, as the story model would not write one), whole and streamed; a conversation
with calls and results renders; bad choices answer 400; the flags are checked at start."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pydantic
import pytest
from typer.testing import CliRunner

from nvllm.cli import app
from tests.server_utils import start_server, stop_server

MODEL = "stories260K"
TEMPLATE = Path(__file__).parent / "data" / "qwen3_chat_template.jinja"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


class Weather(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(pattern="^(Paris|Rome)$")
    days: int = pydantic.Field(ge=1, le=7)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Forecast of a city",
                                            "parameters": {"type": "object", "additionalProperties": False,
                                                           "required": ["city", "days"], "properties": {
                                                               "city": {"enum": ["Paris", "Rome"]},
                                                               "days": {"type": "integer", "minimum": 1,
                                                                        "maximum": 7}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
HERMES_CALL = (r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
               r'"days": [1-7]\}\}\n</tool_call>')


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("serve_tools") / "server.log"
    # the demo model's 512-token vocabulary spells the tool definitions out in ~700 tokens: more room than its 512
    proc, base = start_server(["--async-scheduling", "--max-model-len", "2048", "--device", "cpu",
                               "--hf-overrides", '{"max_position_embeddings": 2048}',
                               "--chat-template", str(TEMPLATE), "--enable-auto-tool-choice",
                               "--tool-call-parser", "hermes",
                               "--structured-outputs-config", '{"disable_any_whitespace": true}',
                               "--log-stats-interval", "0", "--uvicorn-log-level", "warning"], log_path)
    yield openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
    stop_server(proc)


def chat(client, **kw):
    kw.setdefault("messages", MESSAGES)
    kw.setdefault("max_tokens", 150)  # the demo model spells JSON out nearly a character a token
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, tools=[WEATHER, TIME], **kw)


def test_named_choice_calls_that_function(client):
    r = chat(client, tool_choice={"type": "function", "function": {"name": "get_weather"}}, n=2, temperature=1.0,
             seed=5)
    for choice in r.choices:
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
        Weather.model_validate_json(call.function.arguments)
        assert choice.message.content is None and choice.finish_reason == "stop"


def test_required_choice_gives_valid_calls(client):
    r = chat(client, tool_choice="required", parallel_tool_calls=False, n=3, temperature=1.0, seed=2)
    for choice in r.choices:
        (call,) = choice.message.tool_calls
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        args = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            Weather.model_validate(args)
        else:
            assert call.function.name == "get_time" and args["zone"] in ("UTC", "CET")
    # the story model repeats calls greedily: a list cut by max_tokens is no calls, its text the content
    cut = chat(client, tool_choice="required", max_tokens=30).choices[0]
    assert cut.finish_reason == "length" and cut.message.content.startswith('[{"name": "get_') and \
        not cut.message.tool_calls


def test_auto_takes_hermes_calls_out_of_the_text(client):
    r = chat(client, extra_body={"guided_regex": HERMES_CALL})
    msg = r.choices[0].message
    assert msg.content == "Let me check.\n" and r.choices[0].finish_reason == "tool_calls"
    (call,) = msg.tool_calls
    assert call.function.name == "get_weather"
    Weather.model_validate_json(call.function.arguments)
    plain = chat(client, max_tokens=10)  # no call written: the text is the content
    assert plain.choices[0].message.content and not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "length"


def test_streamed_calls_match_the_whole_reply(client):
    for kw in (dict(extra_body={"guided_regex": HERMES_CALL}),
               dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}),
               dict(tool_choice="required", parallel_tool_calls=False)):
        whole = chat(client, **kw).choices[0]
        content, calls, finish = "", {}, None
        for chunk in chat(client, stream=True, **kw):
            for c in chunk.choices:
                content += c.delta.content or ""
                for d in c.delta.tool_calls or []:
                    call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
                    call["arguments"] += d.function.arguments or ""
                finish = c.finish_reason or finish
        assert "<tool" not in content and content == (whole.message.content or "")
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (t.function.name, t.function.arguments) for t in whole.message.tool_calls]
        assert all(c["id"] for c in calls.values()) and finish == whole.finish_reason


TWO_CALLS = (r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}\n'
             r'</tool_call>\n<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}\n</tool_call>')


def test_the_clients_stream_helper_finishes_every_call(client):
    """client.chat.completions.stream() fires tool_calls.function.arguments.done for each call: the calls come in a
    chunk of their own and the finish after them (as OpenAI sends it), since the helper reads a chunk's
    finish_reason before its calls."""
    for kw, names in ((dict(extra_body={"guided_regex": TWO_CALLS}), ["get_weather", "get_time"]),
                      (dict(tool_choice="required", parallel_tool_calls=False), None),
                      (dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}), ["get_weather"])):
        with client.chat.completions.stream(model=MODEL, messages=MESSAGES, tools=[WEATHER, TIME], max_tokens=300,
                                            temperature=0, **kw) as stream:
            done = [e.name for e in stream if e.type == "tool_calls.function.arguments.done"]
            final = stream.get_final_completion().choices[0]
        assert done == [c.function.name for c in final.message.tool_calls] == (names or done) and done
        assert final.finish_reason == ("stop" if "tool_choice" in kw and kw["tool_choice"] != "required"
                                       else "tool_calls")


def test_a_conversation_with_calls_and_results(client):
    messages = [*MESSAGES,
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]
    r = chat(client, messages=messages, tool_choice="none", max_tokens=8)
    assert r.choices[0].message.content and r.usage.prompt_tokens > 700  # the tools and the result are in the prompt
    import httpx

    base = str(client.base_url).removesuffix("/v1/")
    tokens = httpx.post(f"{base}/tokenize", json={"messages": messages, "tools": [WEATHER]}).json()["tokens"]
    detok = httpx.post(f"{base}/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in detok and '"name": "get_weather"' in detok


@pytest.mark.parametrize("kw, message", [
    (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "'nope', which is not among the tools"),
    (dict(tool_choice="required", response_format={"type": "json_object"}), "cannot be combined"),
    (dict(tool_choice="sometimes"), "tool_choice"),
    (dict(tool_choice={"type": "function"}), "tool_choice must be 'none', 'auto', 'required' or {\"type\": "
                                             "\"function\", \"function\": {\"name\": ...}}"),
    (dict(messages=[*MESSAGES, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_weather", "arguments": "{oops"}}]}]), "tool call arguments must be JSON text"),
])
def test_bad_tool_requests_answer_400(client, kw, message):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, **kw)
    assert message in e.value.body["message"]


def test_a_tool_whose_schema_does_not_compile_is_named(client):
    """A named or required tool_choice constrains the reply to the tools' parameter schemas: one that does not
    compile is a 400 naming tools."""
    broken = {"type": "function", "function": {"name": "broken", "parameters": {"type": 5}}}
    for choice in ("required", {"type": "function", "function": {"name": "broken"}}):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[broken], tool_choice=choice,
                                           max_tokens=5)
        assert e.value.body["param"] == "tools" and "invalid structured outputs" in e.value.body["message"]


@pytest.mark.parametrize("args, message", [
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    (["--enable-auto-tool-choice", "--tool-call-parser", "qwen"], "unknown tool call parser 'qwen'"),
])
def test_serve_checks_the_tool_flags(args, message):
    res = CliRunner().invoke(app, ["serve", "--device", "cpu", *args], env={"COLUMNS": "200"})
    assert res.exit_code == 2 and message in res.output
