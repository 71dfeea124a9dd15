"""Structured outputs through the real server (asynchronous scheduling on, whitespace in JSON limited server-wide) and
the official `openai` client: its ``parse`` helper validates the reply against the pydantic model it sent as
``response_format``; vLLM's ``structured_outputs`` and ``guided_*`` fields work on both endpoints, streamed too; bad
constraints answer 400."""

from __future__ import annotations

import json
import re

import openai
import pydantic
import pytest

from tests.server_utils import start_server, stop_server

MODEL = "stories260K"
PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": PROMPT}]


class Pet(pydantic.BaseModel):
    kind: str = pydantic.Field(pattern="^(cat|dog)$")
    age: int = pydantic.Field(ge=0, le=9)
    happy: bool


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("serve_structured") / "server.log"
    # the story model would loop in JSON's optional whitespace: the engine-wide setting (vLLM's) keeps it out
    proc, base = start_server(["--async-scheduling", "--max-model-len", "256", "--device", "cpu",
                               "--structured-outputs-config", '{"disable_any_whitespace": true}',
                               "--log-stats-interval", "0", "--uvicorn-log-level", "warning"], log_path)
    yield openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
    stop_server(proc)


def test_openai_parse_gets_a_valid_model(client):
    r = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Pet, max_tokens=60,
                                      temperature=0)
    msg = r.choices[0].message
    assert isinstance(msg.parsed, Pet) and r.choices[0].finish_reason == "stop"
    assert Pet.model_validate_json(msg.content) == msg.parsed


def test_json_object_and_schema_streamed(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0.8, seed=3, n=2, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "num", "schema": schema, "strict": True}})
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    for t in texts:
        assert set(json.loads(t)) == {"n"} and 0 <= json.loads(t)["n"] <= 99


def test_vllm_fields_on_completions(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=1.0, seed=1, n=3,
                                  extra_body={"guided_choice": ["red", "green", "blue"]})
    assert {c.text for c in r.choices} <= {"red", "green", "blue"}
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0,
                                  extra_body={"guided_regex": r"\d{3}-[a-z]{2}"})
    assert re.fullmatch(r"\d{3}-[a-z]{2}", r.choices[0].text)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                  extra_body={"structured_outputs": {"json": Pet.model_json_schema(),
                                                                     "disable_any_whitespace": True}})
    Pet.model_validate_json(r.choices[0].text)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20, temperature=0,
                                       extra_body={"structured_outputs": {"grammar": 'root ::= "A" | "B"'}})
    assert r.choices[0].message.content in ("A", "B")


@pytest.mark.parametrize("body, param, message", [
    ({"guided_regex": "[a-"}, "guided_regex", "invalid structured outputs regex: Regex parsing error"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format", "invalid structured outputs json"),
    ({"structured_outputs": {"json": {"type": "nonsense"}}}, "structured_outputs", "invalid structured outputs json"),
    ({"guided_json": {"type": "nonsense"}, "structured_outputs": {"disable_any_whitespace": True}}, "guided_json",
     "invalid structured outputs json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "response_format of type json_schema needs json_schema.schema"),
    ({"response_format": {"type": "structural_tag"}}, "response_format", "response_format type must be"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "give one output constraint, not response_format and guided_regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs",
     "structured outputs take exactly one of"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs", "unknown structured_outputs field 'regexp'"),
    ({"structured_outputs": {}}, "structured_outputs", "structured outputs take exactly one of"),  # an empty
    # one was taken as no constraint (200 with free text), and still counted as one against tools and beam search
    ({"guided_choice": []}, "guided_choice", "structured outputs' choice must be a non-empty"),
])
def test_bad_constraints_answer_400(client, body, param, message):
    for call in (lambda: client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, extra_body=body),
                 lambda: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, extra_body=body)):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["param"] == param and e.value.body["message"].startswith(message)
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).choices  # the server is still up


def test_structured_outputs_options_go_with_another_fields_constraint(client):
    """A structured_outputs object with options only (disable_any_whitespace) applies them to the constraint
    response_format or a guided_* field gives, as vLLM fills its structured_outputs from response_format."""
    from nvllm.serve.errors import APIError
    from nvllm.serve.params import structured_outputs
    from nvllm.serve.protocol import ChatCompletionRequest

    schema = Pet.model_json_schema()
    options = {"structured_outputs": {"disable_any_whitespace": True}}
    for field in ({"response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}}},
                  {"guided_json": schema}):
        got = structured_outputs(ChatCompletionRequest(model=MODEL, messages=MESSAGES, **field, **options))
        assert got.json == schema and got.disable_any_whitespace
    got = structured_outputs(ChatCompletionRequest(model=MODEL, messages=MESSAGES, guided_regex="a+"))
    assert got.regex == "a+" and not got.disable_any_whitespace
    with pytest.raises(APIError, match="structured outputs take exactly one of"):
        structured_outputs(ChatCompletionRequest(model=MODEL, messages=MESSAGES, **options))
    r = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=Pet, max_tokens=60,
                                      temperature=0, extra_body=options)
    assert isinstance(r.choices[0].message.parsed, Pet)
