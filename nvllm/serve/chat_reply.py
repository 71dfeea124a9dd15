"""One chat reply's message: its text split into reasoning (``--reasoning-parser``), content and tool calls (the
request's tool plan), whole or piece by piece as it streams. The reasoning block comes first (the engine applies a
constraint, structured outputs or a named/required tool choice, after it); the tool calls are taken from what
follows it."""

from __future__ import annotations

from nvllm.serve.protocol import AssistantMessage, ChatCompletionRequest, DeltaMessage, ToolCall
from nvllm.reasoning_parsers import ReasoningParser, ReasoningStream
from nvllm.serve.tools import ToolPlan, ToolStream


class ChatReply:
    def __init__(self, req: ChatCompletionRequest, plan: ToolPlan, reasoning: ReasoningParser | None):
        self.plan, self.reasoning = plan, reasoning

    def message(self, text: str, finish_reason: str | None) -> tuple[AssistantMessage, str | None]:
        """The whole reply's message and its finish reason (``tool_calls`` where vLLM gives it)."""
        reasoning, content = self.reasoning.split(text) if self.reasoning else (None, text)
        calls: list[ToolCall] = []
        if self.plan.mode != "none" and content is not None:
            content, calls = self.plan.calls(content)
        return (AssistantMessage(reasoning_content=reasoning, content=content, tool_calls=calls),
                self.plan.finish_reason(finish_reason, bool(calls)))

    def stream(self) -> "ReplyStream":
        return ReplyStream(self)


class ReplyStream:
    """What each new piece of one streamed choice adds: reasoning, content, tool call deltas."""

    def __init__(self, reply: ChatReply):
        self.reasoning = ReasoningStream(reply.reasoning) if reply.reasoning else None
        self.tools = ToolStream(reply.plan) if reply.plan.mode != "none" else None
        self.sent = 0  # content characters sent (without tools)

    @property
    def called(self) -> bool:
        return self.tools is not None and self.tools.called

    def delta(self, text: str, finished: bool) -> DeltaMessage | None:
        """The delta for the reply ``text`` so far (cumulative); None when there is nothing new to send."""
        reasoning, content = self.reasoning.delta(text, finished) if self.reasoning else (None, text)
        calls = None
        if content is None:  # still inside the reasoning block: no content yet, and no call announced (as whole)
            pass
        elif self.tools is not None:
            content, calls = self.tools.delta(content, finished)
        else:
            content, self.sent = content[self.sent:] or None, max(self.sent, len(content))
        if reasoning is None and content is None and calls is None:
            return None
        return DeltaMessage(reasoning_content=reasoning, content=content, tool_calls=calls)
