"""Reasoning parsers (``--reasoning-parser NAME``): a thinking model's ``<think>…</think>`` block taken out
of the reply into ``reasoning_content``, the rest left as ``content`` (and to the tool-call parser), as vLLM's parsers
of the same names split it.

- ``qwen3``: Qwen3's hybrid models open the block themselves: a reply that starts with ``<think>`` reasons until
  ``</think>``; any other reply is all content (``enable_thinking: false`` in ``chat_template_kwargs``);
- ``deepseek_r1``: DeepSeek-R1, QwQ, Qwen3-Thinking-2507: the template opens the block in the prompt, so the reply
  reasons from its first token (an opening tag written anyway is dropped) until ``</think>``.

A block never closed (cut by max_tokens) is all reasoning. Streamed, a tag's first characters are held until it is
known whether they begin it. The engine applies a request's structured outputs constraint (a JSON schema, a named or
required tool choice) only once the block is closed, as vLLM does (``constraint_waits``, ``reasoning_ended``)."""

from __future__ import annotations

START, END = "<think>", "</think>"


def partial_tail(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (0 when none)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


class ReasoningParser:
    name = ""
    opens_itself = True  # the reply must start with START to reason (qwen3); else it reasons from its start

    def split(self, text: str, finished: bool = True) -> tuple[str | None, str | None]:
        """(reasoning, content) of the reply so far: what may be sent of each, cumulative. While it is not
        ``finished``, text that could still turn out to be part of a tag is held back."""
        head = text.lstrip()
        opened = head.startswith(START)
        if not opened and not finished and START.startswith(head):  # nothing yet, or the opening tag's beginning
            return None, None
        if self.opens_itself and not opened:
            return None, text
        reasoning, closed, content = (head[len(START):] if opened else text).partition(END)
        if not closed and not finished:
            reasoning = reasoning[:len(reasoning) - partial_tail(reasoning, END)]
        return (reasoning or None), (content or None)


    @staticmethod
    def constraint_waits(tokenizer, prompt_ids: list[int]) -> bool:
        """Whether the reply starts inside (or may open) a reasoning block, so that a constraint waits for its end:
        not when the prompt closed one already (Qwen3 with ``enable_thinking: false`` ends its prompt with an empty
        ``<think></think>``; then the whole reply is content). The engine and the chat reply both ask this."""
        return not tokenizer.decode(prompt_ids[-16:]).rstrip().endswith(END)

    @staticmethod
    def reasoning_ended(text: str) -> bool:
        """Whether the reply so far has closed its reasoning block: the constraint applies to what follows."""
        return END in text


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    opens_itself = True


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    opens_itself = False


REASONING_PARSERS = {p.name: p for p in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)}


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose {', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name]()


class ReasoningStream:
    """One streamed choice's split: the reasoning each new piece adds, and the content so far (cumulative, for the
    content or tool-call stream that follows)."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.sent = 0

    def delta(self, text: str, finished: bool) -> tuple[str | None, str | None]:
        """(the reasoning the new text adds, the content so far: None while the block is open or undecided)."""
        reasoning, content = self.parser.split(text, finished)
        reasoning = reasoning or ""
        new, self.sent = reasoning[self.sent:], max(self.sent, len(reasoning))
        return (new or None), content
