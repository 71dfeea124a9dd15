"""Tool calling on /v1/chat/completions, as vLLM answers it.

The tools go to the chat template (HF templates write them into the prompt). Then, by ``tool_choice``:
- ``"none"``: plain text;
- a named function: the reply is constrained (structured outputs) to that function's parameter schema and returned as
  its one call (finish_reason as generated);
- ``"required"``: constrained to a JSON array of ``{"name", "parameters"}`` objects, one per call, each naming one of
  the tools; returned as calls, finish_reason ``tool_calls``;
- ``"auto"`` (the default when tools are given): the model decides, and the server's ``--tool-call-parser`` takes its
  calls out of the text (nvllm.serve.tool_parsers); needs ``--enable-auto-tool-choice``, else 400, as in vLLM.

``parallel_tool_calls=false`` keeps one call. Streamed, a named call's arguments go out as they are generated; the
calls of ``required`` and ``auto`` go out whole once the reply is complete, and ``auto``'s content before them as it
comes."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from nvllm.sampling_params import StructuredOutputsParams
from nvllm.serve.errors import bad_request
from nvllm.serve.params import constrains_reply
from nvllm.serve.protocol import (ChatCompletionRequest, DeltaFunctionCall, DeltaToolCall, FunctionCall,
                                  NamedToolChoice, ToolCall)
from nvllm.serve.tool_parsers import ToolParser, arguments_json

_NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    mode: str  # none | named | required | auto
    name: str | None = None  # the named function
    parser: ToolParser | None = None  # auto
    parallel: bool = True
    schemas: dict[str, dict] = field(default_factory=dict)  # function name → its parameters' schema
    new_id: Callable[[], str] = ToolParser.new_call_id  # the server's parser's ids (Mistral's 9 characters)

    def constraint(self) -> StructuredOutputsParams | None:
        if self.mode == "named":
            return StructuredOutputsParams(json=self.schemas[self.name])
        if self.mode == "required":
            return StructuredOutputsParams(json=required_schema(self.schemas, self.parallel))
        return None

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A finished reply as (content, calls). A reply that does not parse (cut by max_tokens) stays content."""
        if self.mode == "named":
            return None, [ToolCall(id=self.new_id(), function=FunctionCall(name=self.name, arguments=text))]
        if self.mode == "required":
            try:
                items = json.loads(text)
                calls = [ToolCall(id=self.new_id(), function=FunctionCall(name=it["name"], arguments=arguments_json(
                    it["parameters"]))) for it in items]
            except (ValueError, TypeError, KeyError):
                return text, []
            return None, calls[:None if self.parallel else 1]
        if self.mode == "auto":
            content, parsed = self.parser.extract(text)
            calls = [ToolCall(function=FunctionCall(name=c.name, arguments=c.arguments),
                              **({"id": c.id} if c.id else {})) for c in parsed]
            return content, calls[:None if self.parallel else 1]
        return text, []

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """``tool_calls`` where vLLM gives it: auto calls taken out of the text, or required calls that stopped."""
        if called and (self.mode == "auto" or (self.mode == "required" and reason == "stop")):
            return "tool_calls"
        return reason


def plan_tools(req: ChatCompletionRequest, auto_parser: ToolParser | None) -> ToolPlan:
    """The request's tool plan, or the 400 for a choice that cannot be honoured."""
    tools = req.tools or []
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if choice == "none":
        return ToolPlan("none")
    if not tools:
        raise bad_request("tool_choice needs tools", "tool_choice")
    schemas = {t.function.name: t.function.parameters or _NO_PARAMETERS for t in tools}
    parallel = req.parallel_tool_calls is not False
    ids = {"new_id": auto_parser.new_call_id} if auto_parser is not None else {}
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in schemas:
            raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not among the "
                              "tools", "tool_choice")
        plan = ToolPlan("named", choice.function.name, parallel=parallel, schemas=schemas, **ids)
    elif choice == "required":
        plan = ToolPlan("required", parallel=parallel, schemas=schemas, **ids)
    else:
        if auto_parser is None:
            raise bad_request('"auto" tool choice (the default when tools are given) needs the server started with '
                              "--enable-auto-tool-choice and --tool-call-parser", "tool_choice")
        return ToolPlan("auto", parser=auto_parser, parallel=parallel, schemas=schemas, **ids)
    if constrains_reply(req):
        raise bad_request("a named or required tool_choice constrains the reply itself; it cannot be combined with "
                          "response_format or structured outputs", "tool_choice")
    return plan


def required_schema(schemas: dict[str, dict], parallel: bool) -> dict:
    """A JSON array of one or more calls, each ``{"name": one of the tools, "parameters": its schema}``; the
    parameter schemas' ``$defs`` lifted to the top, where their references point (two tools defining one name
    differently are a 400, as in vLLM)."""
    defs: dict = {}
    variants = []
    for name, params in schemas.items():
        params = dict(params)
        tool_defs = params.pop("$defs", {})
        if not isinstance(tool_defs, dict):
            raise bad_request(f"the parameters of tool {name!r} have a $defs that is not an object", "tools")
        for key, d in tool_defs.items():
            if defs.setdefault(key, d) != d:
                raise bad_request(f"the tools define $defs/{key} differently; with tool_choice \"required\" their "
                                  "definitions share one namespace", "tools")
        variants.append({"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                          "parameters": params},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


class ToolStream:
    """One streamed choice's tool calling: what each new piece of the reply adds to the stream."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.sent = 0  # characters of the reply sent as content (auto) or arguments (named)
        self.call_id: str | None = None
        self.called = plan.mode == "named"  # calls were sent

    def delta(self, text: str, finished: bool) -> tuple[str | None, list[DeltaToolCall] | None]:
        """(content, tool call deltas) to send for the reply ``text`` so far; ``finished``: it is whole."""
        mode = self.plan.mode
        if mode == "named":
            new, self.sent = text[self.sent:], len(text)
            if self.call_id is None:
                self.call_id = self.plan.new_id()
                return None, [DeltaToolCall(index=0, id=self.call_id, type="function",
                                            function=DeltaFunctionCall(name=self.plan.name, arguments=new))]
            return None, ([DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=new))] if new else None)
        if not finished:
            if mode != "auto":
                return None, None
            end = max(self.sent, self.plan.parser.content_end(text))
            new, self.sent = text[self.sent:end], end
            return (new or None), None
        content, calls = self.plan.calls(text)
        self.called = bool(calls)
        rest = (content or "")[self.sent:] if calls else text[self.sent:]
        self.sent = len(text)
        deltas = [DeltaToolCall(index=i, id=c.id, type="function",
                                function=DeltaFunctionCall(name=c.function.name, arguments=c.function.arguments))
                  for i, c in enumerate(calls)]
        return (rest or None), (deltas or None)
