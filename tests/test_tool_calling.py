"""Tool calling's parts without a server: the hermes and llama3_json parsers on the formats Qwen and Llama write, the
plan a request's tool_choice makes (and the 400s), the schema of ``required``, streaming's hold-back, and tools,
calls and results rendered through Qwen3's own chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from nvllm.assets import demo_model_path
from nvllm.chat_template import ChatTemplateError, render_chat
from nvllm.serve.errors import APIError
from nvllm.serve.protocol import ChatCompletionRequest
from nvllm.serve.tool_parsers import HermesToolParser, Llama3JsonToolParser, get_tool_parser
from nvllm.serve.tools import ToolStream, plan_tools, required_schema

QWEN3_TEMPLATE = (Path(__file__).parent / "data" / "qwen3_chat_template.jinja").read_text()
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


# ---- parsers ---------------------------------------------------------------------------------------------------
def test_hermes_takes_calls_and_the_content_before_them():
    text = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    content, calls = HermesToolParser().extract(text)
    assert content == "Let me look.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Zürich"}),
                                                                  ("get_time", {})]
    assert "Zürich" in calls[0].arguments  # non-ASCII kept, as vLLM writes it
    # the last call may be cut before its closing tag; a call that does not parse leaves the text as content
    _, calls = HermesToolParser().extract('<tool_call>{"name": "get_time", "arguments": "{}"}')
    assert calls[0].name == "get_time" and calls[0].arguments == "{}"
    bad = 'x <tool_call>{"name": "get_time", "arguments": {</tool_call>'
    assert HermesToolParser().extract(bad) == (bad, [])
    # whitespace before the call is content, as the stream sent it and vLLM's parser keeps it (Qwen3: "</think>\n\n")
    content, _ = HermesToolParser().extract('\n\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert content == "\n\n"
    assert HermesToolParser().extract("no calls") == ("no calls", [])


def test_llama3_json_reads_one_or_several_calls():
    p = Llama3JsonToolParser()
    content, calls = p.extract('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
                               '{"name": "get_time", "arguments": {}}')
    assert content is None and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Rome"}
    assert p.extract("The weather is fine.") == ("The weather is fine.", [])
    assert p.extract('{"name": "get_time"} trailing')[1] == []


def test_content_is_streamed_up_to_the_opening_tag():
    h = HermesToolParser()
    assert h.content_end("Sure <tool") == len("Sure ")  # a tail that may open a call is held
    assert h.content_end("Sure <tool_call>{") == len("Sure ")
    assert h.content_end("Sure <b>") == len("Sure <b>")
    assert Llama3JsonToolParser().content_end(' {"na') == 0
    assert Llama3JsonToolParser().content_end("Hello") == 5
    with pytest.raises(ValueError, match="unknown tool call parser 'qwen'"):
        get_tool_parser("qwen")


# ---- plans -----------------------------------------------------------------------------------------------------
def test_plans_follow_vllms_defaults_and_refusals():
    assert plan_tools(request(), None).mode == "none"
    assert plan_tools(request(tools=[WEATHER], tool_choice="none"), None).mode == "none"
    assert plan_tools(request(tools=[WEATHER]), HermesToolParser()).mode == "auto"
    named = plan_tools(request(tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                                    "function": {"name": "get_time"}}), None)
    assert named.mode == "named" and named.constraint().json == {"type": "object", "properties": {}}
    cases = [
        (dict(tools=[WEATHER]), '"auto" tool choice (the default when tools are given) needs'),
        (dict(tool_choice="required"), "tool_choice needs tools"),
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "'nope'"),
        (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "cannot be combined"),
        (dict(tools=[WEATHER], tool_choice="required", guided_regex="a"), "cannot be combined"),
    ]
    for kw, message in cases:
        with pytest.raises(APIError) as e:
            plan_tools(request(**kw), None)
        assert e.value.status == 400 and e.value.param == "tool_choice" and message in e.value.message
    plan = plan_tools(request(tools=[WEATHER], tool_choice="required", response_format={"type": "text"}), None)
    assert plan.mode == "required"


def test_required_schema_lifts_defs_and_limits_parallel_calls():
    params = {"type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}},
              "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}}}}}
    schema = required_schema({"move": params, "get_time": {"type": "object", "properties": {}}}, parallel=False)
    assert schema["$defs"] == params["$defs"] and schema["maxItems"] == 1 and schema["minItems"] == 1
    first = schema["items"]["anyOf"][0]
    assert first["properties"]["name"] == {"type": "string", "enum": ["move"]}
    assert "$defs" not in first["properties"]["parameters"] and "$defs" in params  # the tool's own is untouched


def test_required_refuses_tools_that_define_one_name_differently():
    a = {"type": "function", "function": {"name": "a", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/X"}}, "$defs": {"X": {"type": "integer"}}}}}
    b = json.loads(json.dumps(a).replace('"a"', '"b"').replace('{"type": "integer"}', '{"enum": ["s"]}'))
    with pytest.raises(APIError, match="define \\$defs/X differently"):
        plan_tools(request(tools=[a, b], tool_choice="required"), None).constraint()
    same = json.loads(json.dumps(a).replace('"a"', '"b"'))
    assert plan_tools(request(tools=[a, same], tool_choice="required"), None).constraint().json["$defs"] == {
        "X": {"type": "integer"}}


def test_required_and_auto_replies_become_calls():
    plan = plan_tools(request(tools=[WEATHER, TIME], tool_choice="required"), None)
    content, calls = plan.calls('[{"name": "get_time", "parameters": {}}, {"name": "get_weather", '
                                '"parameters": {"city": "Oslo"}}]')
    assert content is None and [c.function.name for c in calls] == ["get_time", "get_weather"]
    assert plan.finish_reason("stop", True) == "tool_calls" and plan.finish_reason("length", True) == "length"
    assert plan.calls('[{"name": "get_ti') == ('[{"name": "get_ti', [])  # cut by max_tokens: left as text
    single = plan_tools(request(tools=[WEATHER], parallel_tool_calls=False), HermesToolParser())
    _, calls = single.calls('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", '
                            '"arguments": {}}</tool_call>')
    assert [c.function.name for c in calls] == ["a"]


def test_streams_hold_calls_back_and_send_content():
    plan = plan_tools(request(tools=[WEATHER]), HermesToolParser())
    s = ToolStream(plan)
    full = 'Checking.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    sent = []
    for end in (5, 12, 40, len(full)):
        content, calls = s.delta(full[:end], end == len(full))
        sent.append((content, calls))
    assert "".join(c for c, _ in sent if c) == "Checking."
    final = sent[-1][1]
    assert len(final) == 1 and final[0].function.name == "get_weather" and s.called
    named = ToolStream(plan_tools(request(tools=[WEATHER], tool_choice={"type": "function", "function": {
        "name": "get_weather"}}), None))
    first = named.delta('{"ci', False)[1][0]
    assert first.id and first.function.name == "get_weather" and first.function.arguments == '{"ci'
    assert named.delta('{"city": "Oslo"}', True)[1][0].function.arguments == 'ty": "Oslo"}'


# ---- the chat template -----------------------------------------------------------------------------------------
def test_qwen3_template_renders_tools_calls_and_results():
    tok = AutoTokenizer.from_pretrained(demo_model_path())
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    text = render_chat(tok, QWEN3_TEMPLATE, msgs, tools=[WEATHER])
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n")
    bad = [msgs[0], {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "get_weather", "arguments": "{city"}}]}]
    with pytest.raises(ChatTemplateError, match=r"messages\[1\]: tool call arguments must be JSON text"):
        render_chat(tok, QWEN3_TEMPLATE, bad, tools=[WEATHER])
    with pytest.raises(ChatTemplateError, match="chat_template_kwargs cannot set 'messages'") as e:
        render_chat(tok, QWEN3_TEMPLATE, msgs, template_kwargs={"messages": "x", "enable_thinking": False})
    assert e.value.param == "chat_template_kwargs"


def test_llm_chat_gives_the_tools_to_the_template():
    from nvllm import SamplingParams
    from tests.conftest import make_llm

    llm = make_llm(demo_model_path(), max_model_len=2048, hf_overrides={"max_position_embeddings": 2048})
    out = llm.chat([{"role": "user", "content": "Weather?"}], SamplingParams(max_tokens=2), use_tqdm=False,
                   chat_template=QWEN3_TEMPLATE, tools=[WEATHER])[0]
    assert json.dumps(WEATHER) in out.prompt and out.prompt.endswith("<|im_start|>assistant\n")


def test_mistral_reads_both_of_its_formats():
    p = get_tool_parser("mistral")
    content, calls = p.extract('Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                               '{"name": "get_time", "arguments": {}}]')
    assert content == "Sure. " and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)  # Mistral's templates check for 9 characters
    content, calls = p.extract('[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_time[ARGS]{}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Rome"}), ("get_time", {})]
    _, (call,) = p.extract('[TOOL_CALLS]get_weather{"city": "Oslo"}')  # no [ARGS]: the name ends at the brace
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
    _, (call,) = p.extract('[TOOL_CALLS]get_time[CALL_ID]a1b2c3d4e[ARGS]{}')  # the model's own call id kept
    assert call.name == "get_time" and call.id == "a1b2c3d4e"
    for bad in ('[TOOL_CALLS] [{"name": "x", "arguments": {', "[TOOL_CALLS]get_weather", "[TOOL_CALLS] {}"):
        assert p.extract(bad) == (bad, [])
    plan = plan_tools(request(tools=[WEATHER]), p)
    _, (call,) = plan.calls('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}]')
    assert len(call.id) == 9 and plan.finish_reason("stop", True) == "tool_calls"
    # named and required calls under this parser get its 9-character ids too, whole and streamed
    named = plan_tools(request(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                       p)
    required = plan_tools(request(tools=[WEATHER], tool_choice="required"), p)
    ids = [named.calls('{"city": "Oslo"}')[1][0].id,
           required.calls('[{"name": "get_weather", "parameters": {"city": "Oslo"}}]')[1][0].id,
           ToolStream(named).delta('{"city"', False)[1][0].id]
    assert all(len(i) == 9 and i.isalnum() for i in ids), ids
    hermes = plan_tools(request(tools=[WEATHER], tool_choice="required"), HermesToolParser())
    assert hermes.calls('[{"name": "get_weather", "parameters": {}}]')[1][0].id.startswith("chatcmpl-tool-")


def test_arguments_that_cannot_be_json_text_leave_the_reply_as_content():
    """NaN, an overflowing number or a lone surrogate escape in the model's arguments: not JSON the API can return
    (a lone surrogate failed the response's UTF-8 encoding: 500), so the reply stays content."""
    for args in ('{"a": "\\ud800"}', '{"a": NaN}', '{"a": 1e999}'):
        text = f'<tool_call>{{"name": "get_time", "arguments": {args}}}</tool_call>'
        assert HermesToolParser().extract(text) == (text, []), args
        s = ToolStream(plan_tools(request(tools=[TIME]), HermesToolParser()))
        content, calls = s.delta(text, True)
        assert content == text and not calls and not s.called
    plan = plan_tools(request(tools=[WEATHER], tool_choice="required"), None)
    bad = '[{"name": "get_weather", "parameters": {"city": "\\udc00"}}]'
    assert plan.calls(bad) == (bad, [])
