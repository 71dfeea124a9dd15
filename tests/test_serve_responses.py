"""POST /v1/responses through the real server and the official `openai` client's ``responses`` API: the same text as
the chat endpoint for the same conversation, conversations continued by ``previous_response_id``, the streamed
events adding up to the response, structured output and function calls as output items, and bad input as 400/404."""

from __future__ import annotations

import json
import re

import openai
import pytest

from tests.server_utils import start_server, stop_server

MODEL = "stories260K"
WEATHER = {"type": "function", "name": "get_weather", "description": "Forecast",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
                          "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("serve_responses") / "server.log"
    proc, base = start_server(["--max-model-len", "256", "--device", "cpu", "--log-stats-interval", "0",
                               "--structured-outputs-config", '{"disable_any_whitespace": true}',
                               "--uvicorn-log-level", "warning"], log_path)
    yield openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
    stop_server(proc)


def chat_text(client, messages, n_tokens):
    return client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=n_tokens,
                                          temperature=0).choices[0].message.content


def test_text_and_a_continued_conversation_match_the_chat_endpoint(client):
    r = client.responses.create(model=MODEL, instructions="A story.", input="Once upon a time", max_output_tokens=12,
                                temperature=0)
    first = [{"role": "system", "content": "A story."}, {"role": "user", "content": "Once upon a time"}]
    assert r.output_text == chat_text(client, first, 12) and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 12
    again = client.responses.create(model=MODEL, input="And then?", previous_response_id=r.id, max_output_tokens=8,
                                    temperature=0)
    history = [first[1], {"role": "assistant", "content": r.output_text}, {"role": "user", "content": "And then?"}]
    assert again.output_text == chat_text(client, history, 8)  # the instructions are not carried over, as OpenAI's
    assert client.responses.retrieve(r.id).output_text == r.output_text
    assert r.id.startswith("resp_") and r.output[0].id.startswith("msg_")  # OpenAI's id shapes


def test_streamed_events_add_up_to_the_response(client):
    kw = dict(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "The dog"}]}],
              max_output_tokens=16, temperature=0)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    assert [e.type for e in events[:4]] == ["response.created", "response.in_progress", "response.output_item.added",
                                            "response.content_part.added"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text


def test_structured_output_and_function_calls_are_output_items(client):
    r = client.responses.create(model=MODEL, input="A pet:", max_output_tokens=60, temperature=0, text={"format": {
        "type": "json_schema", "name": "pet", "schema": {"type": "object", "properties": {"happy": {"type": "boolean"}},
                                                        "required": ["happy"], "additionalProperties": False}}})
    assert set(json.loads(r.output_text)) == {"happy"}
    call = client.responses.create(model=MODEL, input="Weather?", tools=[WEATHER], max_output_tokens=40,
                                   tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    (item,) = call.output
    assert item.type == "function_call" and item.name == "get_weather"
    assert json.loads(item.arguments)["city"] in ("Paris", "Rome")
    # streamed: OpenAI's sequence (added with empty arguments, deltas, done); a client builds them from the deltas
    events = list(client.responses.create(model=MODEL, input="Weather?", tools=[WEATHER], max_output_tokens=40,
                                          tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                                          stream=True))
    added = next(e for e in events if e.type == "response.output_item.added")
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert added.item.arguments == "" and deltas == item.arguments == events[-1].response.output[0].arguments
    answer = client.responses.create(model=MODEL, previous_response_id=call.id, max_output_tokens=6, temperature=0,
                                     input=[{"type": "function_call_output", "call_id": item.call_id,
                                             "output": "Sunny"}])
    assert answer.output_text and answer.output[0].type == "message"


def test_a_call_cut_by_max_output_tokens_is_incomplete_and_the_conversation_goes_on(client):
    kw = dict(model=MODEL, input="Weather?", tools=[WEATHER], max_output_tokens=3, temperature=0,
              tool_choice={"type": "function", "name": "get_weather"})
    for r in (client.responses.create(**kw), list(client.responses.create(stream=True, **kw))[-1].response):
        (item,) = r.output
        assert r.status == "incomplete" and item.type == "function_call" and item.status == "incomplete"
        with pytest.raises(ValueError):
            json.loads(item.arguments)
        # the cut call is history as the text it is: a follow-up is answered, not refused
        again = client.responses.create(model=MODEL, previous_response_id=r.id, input="Go on", max_output_tokens=4)
        assert again.status == "incomplete" and again.output_text


def test_bad_input_is_a_clear_error(client):
    for kw, param in ((dict(input="x", tools=[{"type": "web_search"}]), "tools"),
                      (dict(input=[]), "input"),
                      (dict(input="x", max_output_tokens=0), "max_output_tokens"),
                      (dict(input="x", metadata={f"k{i}": "v" for i in range(17)}), "metadata"),
                      (dict(input="x", background=True), "background"),
                      (dict(input=[{"type": "function_call_output", "call_id": "c"}]), "input"),
                      (dict(input=[{"type": "function_call", "name": "f", "arguments": "{}"}]), "input"),
                      (dict(input=[{"type": "function_call", "call_id": "c", "name": "f"}]), "input"),
                      (dict(input="x", text={"format": {"type": "json_schema", "name": "n"}}), "text"),
                      (dict(input="x", text={"format": {"type": "json_schema", "name": "n", "schema": {"type": 5}}}),
                       "text"),
                      (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
                       "input"),
                      (dict(input=[{"type": "reasoning", "content": 5}]), "input"),
                      (dict(input=[{"type": "function_call_output", "call_id": 5, "output": "x"}]), "input"),
                      (dict(input="x", tools=[WEATHER], tool_choice={"type": "function", "name": 5}),
                       "tool_choice"),
                      (dict(input="x", tools=[WEATHER], tool_choice="sometimes"), "tool_choice"),
                      (dict(input=[{"type": "reasoning", "summary": True}]), "input"),
                      (dict(input=[{"type": "reasoning", "content": [{"type": "reasoning_text", "text": 5}]}]),
                       "input")):
        kw.setdefault("max_output_tokens", 2)
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, **kw)
        assert e.value.body["param"] == param
        assert not re.search(r"max_completion_tokens|response_format|\bjson_schema\.|\"function\": \{",
                             e.value.body["message"])
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope", max_output_tokens=2)
    unstored = client.responses.create(model=MODEL, input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def scripted_handler():
    """The real Responses handler (Qwen3's reasoning parser, hermes calls) over no engine: ``ScriptedStream``s feed
    it what the story model cannot write."""
    from nvllm.assets import demo_model_path
    from nvllm.engine.tokenizer import load_tokenizer
    from nvllm.reasoning_parsers import get_reasoning_parser
    from nvllm.serve.chat import ChatHandler
    from nvllm.serve.models import ServedModels
    from nvllm.serve.prompts import PromptProcessor
    from nvllm.serve.responses import ResponsesHandler
    from nvllm.serve.tool_parsers import HermesToolParser

    prompts = PromptProcessor(load_tokenizer(demo_model_path()), 512, 256)
    chat = ChatHandler(None, prompts, ServedModels(MODEL, "", 256), {}, HermesToolParser(),
                       get_reasoning_parser("qwen3"))
    return ResponsesHandler(chat)


class ScriptedStream:
    """An engine's outputs for one reply, a few characters at a time; ``fail_after``: raise after that many."""

    def __init__(self, reply: str, fail_after: int | None = None):
        self.reply, self.fail_after = reply, fail_after
        self.cuts = list(range(3, len(reply), 7)) + [len(reply)]

    def __aiter__(self):
        return self

    async def __anext__(self):
        from types import SimpleNamespace

        if not self.cuts:
            raise StopAsyncIteration
        if self.fail_after is not None and self.cuts[0] > self.fail_after:
            raise RuntimeError("the engine failed")
        end = self.cuts.pop(0)
        done = not self.cuts
        return SimpleNamespace(num_cached_tokens=0, outputs=[SimpleNamespace(
            text=self.reply[:end], finish_reason="stop" if done else None, token_ids=list(range(end)))])

    def close(self):
        pass


def scripted_events(handler, req, stream) -> list[dict]:
    import asyncio

    from nvllm.serve.response_events import response_events
    from nvllm.serve.responses import to_chat

    async def run():
        ids = ("resp_x", to_chat(req, []), [])
        return [chunk async for chunk in response_events(handler.events(req, ids, stream, [1, 2]))]

    return [json.loads(c.split("data: ", 1)[1]) for c in asyncio.run(run())]


def test_streamed_reasoning_text_and_a_call_after_whitespace():
    """The events of a reply the story model cannot write — thinking, then whitespace, then a hermes call — through
    the real handler over a scripted engine stream: the reasoning item closes before the message opens, the message
    holds exactly its deltas, the call follows, and nothing ends the stream but response.completed."""
    from nvllm.serve.responses import ResponsesRequest

    reply = '<think>Need it.</think>\n\n<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    req = ResponsesRequest(model=MODEL, input="Weather?", tools=[WEATHER], stream=True)
    events = scripted_events(scripted_handler(), req, ScriptedStream(reply))
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "response.completed" and "error" not in kinds
    assert kinds.index("response.output_item.done") < kinds.index("response.output_text.delta")  # reasoning first
    final = events[-1]["response"]["output"]
    assert [i["type"] for i in final] == ["reasoning", "message", "function_call"]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert final[1]["content"][0]["text"] == deltas == "\n\n" and final[2]["name"] == "get_weather"
    assert all("logprobs" in e for e in events if e["type"] in ("response.output_text.delta",
                                                                 "response.output_text.done"))
    assert events[-1]["response"]["usage"]["output_tokens_details"]["reasoning_tokens"] > 0


def test_a_failure_mid_stream_ends_it_as_openai_does():
    """An engine failure after some text: an ``error`` event, then ``response.failed`` with the response as it stood,
    numbered on from the events before (the client's types validate both; its stream state ends on the second)."""
    import pydantic
    from openai.types.responses import ResponseStreamEvent

    from nvllm.serve.responses import ResponsesRequest

    req = ResponsesRequest(model=MODEL, input="hi", stream=True)
    events = scripted_events(scripted_handler(), req, ScriptedStream("Once upon a time there was", fail_after=12))
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-2]["code"] == "server_error" and "the engine failed" in events[-2]["message"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["id"] == events[0]["response"]["id"]
    assert failed["error"]["message"] == events[-2]["message"]
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    assert [type(adapter.validate_python(e)).__name__ for e in events[-2:]] == ["ResponseErrorEvent",
                                                                              "ResponseFailedEvent"]


def test_replayed_output_and_reasoning_make_one_assistant_turn():
    """``input += response.output`` (OpenAI's function-calling guide): the reasoning, text and call items of one
    response are one assistant turn, as vLLM merges them and as ``previous_response_id`` stores it; the reasoning
    reaches the template as the chat endpoint gives it (reasoning_content)."""
    import asyncio

    from nvllm.serve.responses import ResponsesRequest, input_messages, to_chat

    handler = scripted_handler()
    reply = ('<think>Need the weather.</think>\n\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Rome"}}\n</tool_call>')
    req = ResponsesRequest(model=MODEL, input="Weather?", tools=[WEATHER])
    chat_req = to_chat(req, [])
    body = asyncio.run(handler.full(req, ("resp_a", chat_req, []), ScriptedStream(reply), [1, 2]))
    assert [i["type"] for i in body["output"]] == ["reasoning", "message", "function_call"]
    call = body["output"][2]
    result = {"type": "function_call_output", "call_id": call["call_id"], "output": "Sunny"}
    replayed = input_messages(ResponsesRequest(model=MODEL, input=[{"role": "user", "content": "Weather?"},
                                                                    *body["output"], result]))
    assert [m["role"] for m in replayed] == ["user", "assistant", "tool"]
    turn = replayed[1]
    assert (turn["reasoning_content"], turn["content"]) == ("Need the weather.",
                                                            body["output"][1]["content"][0]["text"])
    assert [c["function"]["name"] for c in turn["tool_calls"]] == ["get_weather"]
    stored = handler._history(ResponsesRequest(model=MODEL, input=[result], previous_response_id="resp_a"))
    assert [(m["role"], m.get("reasoning_content")) for m in stored] == [("user", None),
                                                                       ("assistant", "Need the weather.")]
    assert stored[1]["content"] == turn["content"]


def test_the_store_counts_the_memory_it_keeps_and_drops_the_oldest():
    from nvllm.serve.responses import ResponseStore

    store = ResponseStore(size=3, max_bytes=2000)
    body = {"id": "r0", "reasoning": {"pad": [{}] * 100}}   # a client's free-form field, nested
    store.put("r0", [{"role": "user", "content": "hi"}], body)
    assert store.bytes == len(json.dumps([{"role": "user", "content": "hi"}])) + len(json.dumps(body))
    body["reasoning"]["pad"].clear()   # what is stored is a copy, and so is what comes back
    assert len(store.get("r0")[1]["reasoning"]["pad"]) == 100
    store.get("r0")[0].append("x")
    assert store.get("r0")[0] == [{"role": "user", "content": "hi"}]
    for i in range(1, 4):
        store.put(f"r{i}", [], {"id": f"r{i}"})
    assert list(store.items) == ["r1", "r2", "r3"]   # size: the oldest dropped first
    store.put("big", [], {"text": "x" * 1980})
    assert list(store.items) == ["big"] and store.bytes == len(json.dumps([])) + len(json.dumps({"text": "x" * 1980}))
    with pytest.raises(Exception, match="not found"):
        store.get("r1")
