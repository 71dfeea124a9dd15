"""Tool-call parsers for ``tool_choice="auto"`` (``nvllm serve --enable-auto-tool-choice --tool-call-parser NAME``):
the calls a model wrote in its own format, taken out of its text, as vLLM's parsers of the same names read them.

- ``hermes``: Qwen2.5, Qwen3, QwQ and Hermes models: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number of them, after optional text (the content);
- ``llama3_json``: Llama 3.1 / 3.2 / 3.3 JSON tool calling: the reply is ``{"name": ..., "parameters": {...}}`` (or
  ``"arguments"``), optionally after ``<|python_tag|>``, several separated by ``;``;
- ``mistral``: Mistral's ``[TOOL_CALLS]`` token, then a JSON list of ``{"name", "arguments"}`` (Mistral 7B v0.3,
  Nemo) or ``name[ARGS]{...}`` per call (newer tokenizers); the calls get the 9-character ids Mistral's chat
  templates require.

A reply whose calls do not parse is returned as content, with no calls (as vLLM does)."""

from __future__ import annotations

import json
import re
import secrets
import string
from abc import ABC, abstractmethod
from dataclasses import dataclass

from nvllm.reasoning_parsers import partial_tail
from nvllm.serve.protocol import random_id


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object
    id: str | None = None  # the call's id when the model's format fixes one (else the server makes one)


class ToolParser(ABC):
    name = ""
    start = ""  # the text that opens the calls: content is streamed only up to it
    keep_special_tokens = False  # its tags may be special tokens: the reply is decoded with them (vLLM's hermes)

    @abstractmethod
    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls); no calls when the text holds none or they do not parse (the content is then the
        whole text)."""

    def content_end(self, text: str) -> int:
        """How much of a reply still being generated may be streamed as content: up to the opening text, and short
        of a tail that could be its beginning."""
        i = text.find(self.start)
        return i if i != -1 else len(text) - partial_tail(text, self.start)

    @staticmethod
    def new_call_id() -> str:
        """An id for a call the model's text does not fix (named and required choices' calls too)."""
        return random_id("chatcmpl-tool")


def _call(obj, args_keys: tuple[str, ...]) -> ParsedCall:
    """One call object's name and arguments (re-serialized, non-ASCII kept); ValueError when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ValueError("not a tool call")
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as JSON text
        args = json.loads(args)
    if not isinstance(args, dict):
        raise ValueError("tool call arguments are not an object")
    return ParsedCall(obj["name"], arguments_json(args))


def arguments_json(args: dict) -> str:
    """A call's arguments as the JSON text the API returns (non-ASCII kept). ValueError where they cannot be valid
    JSON in UTF-8: NaN or infinite numbers (``1e999``), a lone surrogate escape (``"\\ud800"``); the reply then
    stays content."""
    text = json.dumps(args, ensure_ascii=False, allow_nan=False)
    text.encode("utf-8")  # UnicodeEncodeError (a ValueError) on a lone surrogate
    return text


class HermesToolParser(ToolParser):
    name = "hermes"
    start = "<tool_call>"
    keep_special_tokens = True  # Hermes 2 Pro's <tool_call> is a special token (Qwen's is not)
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        if self.start not in text:
            return text, []
        try:
            calls = [_call(json.loads((closed or unclosed).strip()), ("arguments", "parameters"))
                     for closed, unclosed in self._CALL.findall(text)]
        except ValueError:
            return text, []
        content = text[:text.index(self.start)]
        return (content or None), calls   # whitespace too, as the stream sent it (vLLM keeps it)


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    start = "<|python_tag|>"

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        body = text.strip()
        if body.startswith(self.start):
            body = body[len(self.start):].lstrip()
        if not body.startswith("{"):
            return text, []
        try:
            decoder, calls, i = json.JSONDecoder(), [], 0
            while i < len(body):
                obj, i = decoder.raw_decode(body, i)
                calls.append(_call(obj, ("parameters", "arguments")))
                rest = body[i:].lstrip()
                if rest and not rest.startswith(";"):
                    raise ValueError("text after a tool call")
                i = len(body) - len(rest[1:].lstrip()) if rest else len(body)
        except ValueError:
            return text, []
        return None, calls

    def content_end(self, text: str) -> int:
        """A reply that starts as a call (``{`` or the tag) is held whole; any other is content."""
        head = text.lstrip()
        if not head or head.startswith("{") or self.start.startswith(head[:len(self.start)]):
            return 0
        return len(text)


class MistralToolParser(ToolParser):
    name = "mistral"
    start = "[TOOL_CALLS]"
    keep_special_tokens = True  # [TOOL_CALLS] is a special token

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        if self.start not in text:
            return text, []
        content, _, rest = text.partition(self.start)
        decoder = json.JSONDecoder()
        try:
            if rest.lstrip().startswith("["):  # [TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]
                objs, _ = decoder.raw_decode(rest.lstrip())
                if not isinstance(objs, list):
                    raise ValueError("not a list of calls")
                calls = [_call(o, ("arguments", "parameters")) for o in objs]
            else:  # [TOOL_CALLS]name[ARGS]{...} (or name{...}; name[CALL_ID]id[ARGS]{...}), once per call
                calls = []
                for segment in text.split(self.start)[1:]:
                    head, sep, args = segment.partition("[ARGS]")
                    if not sep:
                        cut = segment.find("{")
                        head, args = (segment[:cut], segment[cut:]) if cut > 0 else ("", "")
                    name, _, call_id = head.partition("[CALL_ID]")
                    if not name.strip():
                        raise ValueError("not name[ARGS]{...}")
                    obj, _ = decoder.raw_decode(args.strip())
                    call = _call({"name": name.strip(), "arguments": obj}, ("arguments",))
                    call.id = call_id.strip() or None
                    calls.append(call)
        except ValueError:
            return text, []
        for c in calls:  # the model's own id when it wrote one, else a fresh one of the length templates check
            if not (c.id and len(c.id) == 9 and c.id.isalnum()):
                c.id = self.new_call_id()
        return (content or None), calls   # whitespace too, as the stream sent it (vLLM keeps it)

    @staticmethod
    def new_call_id() -> str:
        """Nine letters and digits: Mistral's chat templates refuse a conversation whose call ids are not."""
        return "".join(secrets.choice(_ALNUM) for _ in range(9))


_ALNUM = string.ascii_letters + string.digits

TOOL_PARSERS = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()
