"""POST /v1/responses through the real server and the official `openai` client's ``responses`` API: the same text as
the chat endpoint for the same conversation, conversations continued by ``previous_response_id``, the streamed
events adding up to the response, structured output and function calls as output items, and bad input as 400/404."""

from __future__ import annotations

import json

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
    answer = client.responses.create(model=MODEL, previous_response_id=call.id, max_output_tokens=6, temperature=0,
                                     input=[{"type": "function_call_output", "call_id": item.call_id,
                                             "output": "Sunny"}])
    assert answer.output_text and answer.output[0].type == "message"


def test_bad_input_is_a_clear_error(client):
    for kw, param in ((dict(input="x", tools=[{"type": "web_search"}]), "tools"),
                      (dict(input=[]), "input"),
                      (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), "input")):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, max_output_tokens=2, **kw)
        assert e.value.body["param"] == param
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_nope", max_output_tokens=2)
    unstored = client.responses.create(model=MODEL, input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
