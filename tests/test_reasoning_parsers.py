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


NAMED = dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})


@pytest.mark.parametrize("text, call", [
    ('Need the weather.</think>{"city": "Oslo"}', '{"city": "Oslo"}'),
    ("Still thinking about which city", None),  # cut by max_tokens inside the block: no call, whole or streamed
])
def test_a_named_call_is_announced_only_after_the_block(text, call):
    req = request(**NAMED)
    reply = ChatReply(req, plan_tools(req, None), get_reasoning_parser("deepseek_r1"))
    whole, _ = reply.message(text, "stop" if call else "length")
    assert [c.function.arguments for c in whole.tool_calls] == ([call] if call else [])
    for size in (1, 3, len(text)):
        stream, names, args = reply.stream(), [], ""
        for end in list(range(size, len(text), size)) + [len(text)]:
            d = stream.delta(text[:end], end == len(text))
            for c in (d.tool_calls or []) if d is not None else []:
                names += [c.function.name] if c.function.name else []
                args += c.function.arguments or ""
        assert names == ([whole.tool_calls[0].function.name] if call else []) and args == (call or "")


def test_a_prompt_that_closed_the_block_has_a_reply_of_content():
    """deepseek_r1 with enable_thinking false: the template closed the block in the prompt, the engine constrained
    the reply from its first token, and the reply is content (a named call's arguments), not reasoning."""
    from nvllm.assets import demo_model_path
    from nvllm.engine.tokenizer import load_tokenizer
    from nvllm.serve.chat import ChatHandler
    from nvllm.serve.models import ServedModels
    from nvllm.serve.prompts import PromptProcessor

    tok = load_tokenizer(demo_model_path())
    chat = ChatHandler(None, PromptProcessor(tok, 512, 256), ServedModels("m", "", 256), {}, None,
                       get_reasoning_parser("deepseek_r1"))
    closed, opened = tok.encode("Hi<think>\n\n</think>\n\n"), tok.encode("Hi<think>\n")
    message, _ = chat._reply(request(), closed).message('{"a": 1}', "stop")
    assert (message.reasoning_content, message.content) == (None, '{"a": 1}')
    message, _ = chat._reply(request(), opened).message('{"a": 1}', "stop")
    assert (message.reasoning_content, message.content) == ('{"a": 1}', None)
    call, _ = chat._reply(request(**NAMED), closed).message('{"city": "Oslo"}', "stop")
    assert call.content is None and call.tool_calls[0].function.arguments == '{"city": "Oslo"}'


def test_qwen3s_first_token_opens_the_block_or_starts_the_constrained_reply(monkeypatch):
    """qwen3 (the model opens its own block): a reply that does not open one is constrained from its first token,
    where the block's opening token is allowed beside the constraint's; once it opened one, the constraint waits
    for the block's end. The story model has no single <think> token: its opening token is set here to the one
    it prefers after the prompt (" time", so it 'opens'), or to one it never picks."""
    from nvllm import SamplingParams, StructuredOutputsParams
    from nvllm.assets import demo_model_path
    from nvllm.engine.admission import Admission
    from tests.conftest import make_llm

    params = SamplingParams(max_tokens=12, temperature=0, structured_outputs=StructuredOutputsParams(
        regex="[0-9]{3}"))
    qwen3 = make_llm(demo_model_path(), reasoning_parser="qwen3")
    assert qwen3.engine.admission._think_open_id is None  # several tokens: constrained from the start
    assert re.fullmatch("[0-9]{3}", qwen3.generate(["Once upon a"], params, use_tqdm=False)[0].outputs[0].text)
    preferred = qwen3.generate(["Once upon a"], SamplingParams(max_tokens=1, temperature=0),
                               use_tqdm=False)[0].outputs[0].token_ids[0]
    for open_id, opens in ((preferred, True), (3, False)):
        monkeypatch.setattr(Admission, "_think_open_id", property(lambda self, i=open_id: i))
        out = qwen3.generate(["Once upon a"], params, use_tqdm=False)[0].outputs[0]
        if opens:  # the 'block' never closes: the reply stays unconstrained, as a thought cut by max_tokens
            assert out.token_ids[0] == preferred and out.finish_reason == "length"
            assert not re.fullmatch("[0-9]{3}", out.text)
        else:
            assert re.fullmatch("[0-9]{3}", out.text)


def test_think_or_constraint_masks_and_rolls_back():
    import torch

    from nvllm.engine.think_or_constraint import ThinkOrConstraint

    class Digits:  # a matcher that allows tokens 0-9 and counts what it took
        def __init__(self):
            self.taken = []

        def fill_next_token_bitmask(self, bitmask, row):
            bitmask[row] = 0
            bitmask[row, 0] = (1 << 10) - 1

        def accept_token(self, t):
            if t < 10:
                self.taken.append(t)
            return t < 10

        def rollback(self, n):
            del self.taken[len(self.taken) - n:]

        def is_terminated(self):
            return False

    for open_id in (40, 63):  # bit 31 of a word: the int32's sign bit
        inner = Digits()
        m = ThinkOrConstraint(inner, open_id)
        mask = torch.zeros(1, 4, dtype=torch.int32)
        m.fill_next_token_bitmask(mask, 0)
        allowed = [t for t in range(128) if (int(mask[0, t // 32]) >> (t % 32)) & 1]
        assert allowed == list(range(10)) + [open_id]
        assert m.accept_token(open_id) and m.opened and m.accept_token(99) and inner.taken == []
        m.fill_next_token_bitmask(mask, 0)
        assert (mask == -1).all()  # inside the block nothing is masked
        m.rollback(2)
        assert not m.opened and m.accept_token(5) and not m.accept_token(open_id) and inner.taken == [5]
        m.rollback(1)
        assert inner.taken == [] and m.history == []


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
