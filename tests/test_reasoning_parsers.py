"""Reasoning parsers (``--reasoning-parser``): the splits vLLM's qwen3 and deepseek_r1 parsers make, the same reply
streamed in pieces of every size adding up to the whole message (reasoning, content, tool calls), constrained
replies left whole; and the server putting the block in ``reasoning_content`` for the official client."""

from __future__ import annotations

import re

import openai
import pytest

from nvllm.serve.chat_reply import ChatReply
from nvllm.serve.protocol import ChatCompletionRequest
from nvllm.reasoning_parsers import get_reasoning_parser
from nvllm.serve.tool_parsers import HermesToolParser
from nvllm.serve.tools import plan_tools
from tests.server_utils import start_server, stop_server

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.mark.parametrize("text, qwen3, deepseek_r1", [
    ("<think>\nAdd them.\n</think>\n\n4", ("\nAdd them.\n", "\n\n4"), ("\nAdd them.\n", "\n\n4")),
    ("4", (None, "4"), ("4", None)),  # qwen3 without thinking (enable_thinking false); R1 cut mid-thought
    ("Add them.</think>4", (None, "Add them.</think>4"), ("Add them.", "4")),  # R1: the prompt opened the block
    ("<think>cut by max_tokens", ("cut by max_tokens", None), ("cut by max_tokens", None)),
    ("<think>x</think>", ("x", None), ("x", None)),
])
def test_splits_as_vllm(text, qwen3, deepseek_r1):
    assert get_reasoning_parser("qwen3").split(text) == qwen3
    assert get_reasoning_parser("deepseek_r1").split(text) == deepseek_r1
    with pytest.raises(ValueError, match="unknown reasoning parser 'o1'"):
        get_reasoning_parser("o1")
    from nvllm.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="unknown reasoning parser 'o1'; choose deepseek_r1, qwen3"):
        EngineConfig(reasoning_parser="o1", device="cpu")


def request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **kw)


REPLIES = [
    ("qwen3", {}, "<think>\nThe user greets.\n</think>\n\nHello <b>there</b>"),
    ("deepseek_r1", {}, "Greeting; answer.</think>Hi"),
    ("qwen3", dict(tools=[WEATHER]), '<think>Need the weather.</think>\n\nChecking.\n<tool_call>\n{"name": '
                                     '"get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'),
    ("qwen3", dict(tools=[WEATHER]), "<think>No tool needed.</think>It is <tool_ sunny"),  # not a call after all
]


@pytest.mark.parametrize("parser, kw, text", REPLIES)
def test_streamed_pieces_add_up_to_the_whole_message(parser, kw, text):
    req = request(**kw)
    reply = ChatReply(req, plan_tools(req, HermesToolParser()), get_reasoning_parser(parser))
    whole, finish = reply.message(text, "stop")
    for size in range(1, len(text) + 1):
        stream = reply.stream()
        reasoning, content, calls = "", "", []
        for end in list(range(size, len(text), size)) + [len(text)]:
            d = stream.delta(text[:end], end == len(text))
            if d is not None:
                reasoning += d.reasoning_content or ""
                content += d.content or ""
                calls += [(c.function.name, c.function.arguments) for c in d.tool_calls or []]
        assert reasoning == (whole.reasoning_content or ""), size
        assert content == (whole.content or ""), size
        assert calls == [(c.function.name, c.function.arguments) for c in whole.tool_calls]
        assert "<think" not in content and "</think" not in reasoning
    if kw:
        assert finish == ("tool_calls" if whole.tool_calls else "stop")


def test_the_constraint_waits_for_the_end_of_the_block():
    from nvllm import SamplingParams, StructuredOutputsParams
    from nvllm.assets import demo_model_path
    from tests.conftest import make_llm

    regex = StructuredOutputsParams(regex="[0-9]{3}")
    params = SamplingParams(max_tokens=30, temperature=0, structured_outputs=regex)
    llm = make_llm(demo_model_path(), reasoning_parser="deepseek_r1")
    engine, tok = llm.engine, llm.get_tokenizer()
    # the story model never closes a block: its reply stays unconstrained reasoning
    thinking = llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0]
    assert thinking.finish_reason == "length" and not any(ch.isdigit() for ch in thinking.text)
    # a reply that closes it (written here as a decode worker receives a prefill worker's tokens) is constrained after
    rid = engine.add_request(None, "Once upon a time", params)
    seq = engine.requests[rid][0]
    assert seq.grammar_waits
    for t in tok.encode(" Let me see.</think>", add_special_tokens=False):
        engine._append_token(seq, t, None, 0.0)
    assert not seq.grammar_waits
    while engine.has_unfinished_requests():
        outs = [o for o in engine.step() if o.finished]
    text = outs[0].outputs[0].text
    reasoning, content = get_reasoning_parser("deepseek_r1").split(text)
    assert reasoning.strip() == "Let me see." and re.fullmatch("[0-9]{3}", content)
    # Qwen3 with thinking off: the prompt closed the block, the constraint holds from the first token
    qwen3 = make_llm(demo_model_path(), reasoning_parser="qwen3")
    out = qwen3.generate(["Once upon a time<think>\n\n</think>\n\n"], params, use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("[0-9]{3}", out.text)


def test_server_puts_the_block_in_reasoning_content(tmp_path):
    proc, base = start_server(["--device", "cpu", "--max-model-len", "256", "--reasoning-parser", "deepseek_r1",
                               "--log-stats-interval", "0", "--uvicorn-log-level", "warning"], tmp_path / "log")
    try:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
        kw = dict(model="stories260K", messages=[{"role": "user", "content": "Once upon a time"}], max_tokens=12,
                  temperature=0)
        r = client.chat.completions.create(**kw)
        message = r.choices[0].message
        # the story model never closes the block: all of it is reasoning, as with a thought cut by max_tokens
        assert message.reasoning_content and message.content is None and r.choices[0].finish_reason == "length"
        streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                           for c in client.chat.completions.create(stream=True, **kw) if c.choices)
        assert streamed == message.reasoning_content
    finally:
        stop_server(proc)
