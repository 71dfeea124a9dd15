"""POST /v1/responses (OpenAI's Responses API, as vLLM serves it) and GET /v1/responses/{id}.

A request becomes the chat request it amounts to — ``instructions`` the system message, ``input`` the turns
(text, earlier function calls and their outputs), ``previous_response_id`` the stored conversation before them,
``text.format`` the response_format, flat function ``tools`` the chat's — and runs through the chat handler:
the same template, sampling, constraints, tool parser and reasoning parser. Its reply comes back as output items:
``reasoning`` (with --reasoning-parser), ``message`` (``output_text``) and ``function_call``; streamed as the
Responses events (``response.created`` … ``response.output_text.delta`` … ``response.completed``). Responses are
kept in memory (the latest ``STORE_SIZE``) for ``previous_response_id`` and GET, unless ``store`` is false."""

from __future__ import annotations

import json
import re
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from pydantic import Field, ValidationError

from nvllm.serve.chat import ChatHandler
from nvllm.serve.errors import APIError, bad_request, validation_message
from nvllm.serve.protocol import AssistantMessage, ChatCompletionRequest, OpenAIModel, random_id

STORE_SIZE = 1024  # responses kept
STORE_BYTES = 256 * 1024 * 1024  # and their JSON's size at most
# what each API parameter of the chat request it becomes is called here, for the 400s
_RENAMED = (("response_format.json_schema", "text.format"), ("json_schema.schema", "text.format.schema"),
            ("response_format", "text.format"),
            ("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"), ("messages", "input"))
_PARAMS = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens", "response_format": "text",
           "messages": "input"}


def _id(prefix: str) -> str:
    """OpenAI's ids of this API: resp_…, msg_…, fc_…, rs_…, call_…"""
    return random_id(prefix, "_")


def _renamed(message: str) -> str:
    """A chat request's error message in this API's parameter names."""
    for chat, ours in _RENAMED:
        message = re.sub(rf"\b{re.escape(chat)}\b", ours, message)
    return message


class ResponsesRequest(OpenAIModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    background: bool | None = None
    # vLLM's extensions, as on chat
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    cache_salt: str | None = Field(None, min_length=1)
    priority: int = 0   # --scheduling-policy priority


class ResponseStore:
    """The latest responses, for ``previous_response_id`` and GET: id → (the conversation through it, the body);
    at most ``size`` of them and ``max_bytes`` of their JSON, the oldest dropped first. Each is kept as its JSON
    text, so that ``max_bytes`` is the memory they take: as parsed objects a client's nested fields (``reasoning``,
    ``text``) took about 18 times their JSON's size."""

    def __init__(self, size: int = STORE_SIZE, max_bytes: int = STORE_BYTES):
        self.size, self.max_bytes, self.bytes = size, max_bytes, 0
        self.items: OrderedDict[str, tuple[bytes, bytes]] = OrderedDict()

    def put(self, response_id: str, messages: list[dict], body: dict) -> None:
        item = (json.dumps(messages).encode(), json.dumps(body).encode())
        self.items[response_id] = item
        self.bytes += sum(map(len, item))
        while self.items and (len(self.items) > self.size or self.bytes > self.max_bytes):
            self.bytes -= sum(map(len, self.items.popitem(last=False)[1]))

    def get(self, response_id: str, param: str = "previous_response_id") -> tuple[list[dict], dict]:
        """The conversation and the body, fresh objects of their own on every call."""
        if response_id not in self.items:
            raise APIError(404, f"Response with id '{response_id}' not found.", param)
        messages, body = self.items[response_id]
        return json.loads(messages), json.loads(body)


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text"):
                raise bad_request("only text content (input_text, output_text) is supported", "input")
            if not isinstance(p.get("text"), str):
                raise bad_request("a text part needs its text", "input")
            parts.append(p["text"])
        return "".join(parts)
    raise bad_request("a message's content must be a string or a list of text parts", "input")


def input_messages(req: ResponsesRequest) -> list[dict]:
    """The request's own turns as chat messages (without instructions and history)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    messages: list[dict] = []
    for item in req.input:
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"unknown input role {role!r}", "input")
            content = _text_of(item.get("content"))
            last = messages[-1] if messages else {}
            if role == "assistant" and last.get("role") == "assistant" and last.get("content") is None \
                    and "tool_calls" not in last:  # the text of the turn a reasoning item began
                last["content"] = content
            else:
                messages.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) and item[k] for k in ("call_id", "name")) \
                    or not isinstance(item.get("arguments"), str):
                raise bad_request("a function_call item needs its call_id, name and arguments (a JSON string)",
                                  "input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant":  # one turn: its reasoning, text and calls (an
                # earlier response's output replayed as input), as vLLM merges them
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if output is None or not isinstance(item.get("call_id"), str) or not item["call_id"]:
                raise bad_request("a function_call_output item needs its call_id and output", "input")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text_of(output)})
        elif kind == "reasoning":  # the thinking that began an assistant turn: templates that keep it (Qwen3's,
            # in a tool loop) see it as the chat endpoint gives it, reasoning_content
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list) or not all(
                    isinstance(p, dict) and isinstance(p.get("text", ""), str) for p in parts):
                raise bad_request("a reasoning item's content (or summary) must be a list of parts with their text "
                                  "as a string", "input")
            text = "".join(p.get("text") or "" for p in parts)
            if text:
                messages.append({"role": "assistant", "content": None, "reasoning_content": text})
        else:
            raise bad_request(f"input items of type {kind!r} are not supported", "input")
    if not messages:
        raise bad_request("input is empty", "input")
    return messages


def to_chat(req: ResponsesRequest, history: list[dict]) -> ChatCompletionRequest:
    """The chat request a Responses request amounts to (``history``: the stored conversation before it)."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
    messages += input_messages(req)
    tools = None
    if req.tools:
        tools = []
        for t in req.tools:
            if t.get("type") != "function":
                raise bad_request(f"tools of type {t.get('type')!r} are not supported (only function)", "tools")
            tools.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters",
                                                                             "strict") if k in t}})
    choice = req.tool_choice
    if choice is not None and choice not in ("none", "auto", "required") and not (
            isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str)
            and choice["name"]):
        raise bad_request("tool_choice must be none, auto, required or {type: function, name}", "tool_choice")
    if isinstance(choice, dict):
        choice = {"type": "function", "function": {"name": choice["name"]}}
    fmt = (req.text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise bad_request("text.format must be an object: {type: text}, {type: json_object} or {type: json_schema, "
                          "name, schema}", "text")
    response_format = None
    if fmt and fmt.get("type") == "json_schema":
        response_format = {"type": "json_schema", "json_schema": {"name": fmt.get("name", "response"),
                                                                  "schema": fmt.get("schema"),
                                                                  "strict": fmt.get("strict")}}
    elif fmt:
        response_format = fmt
    fields = dict(model=req.model, messages=messages, max_completion_tokens=req.max_output_tokens,
                  temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                  repetition_penalty=req.repetition_penalty, seed=req.seed, tools=tools, tool_choice=choice,
                  parallel_tool_calls=req.parallel_tool_calls, response_format=response_format,
                  cache_salt=req.cache_salt, priority=req.priority)
    try:
        return ChatCompletionRequest(**{k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        message, param = validation_message(e)
        raise bad_request(_renamed(message), _PARAMS.get(param, param)) from None


def check_request(req: ResponsesRequest) -> None:
    """The 400s of what is refused before anything runs: OpenAI's metadata limits, background mode."""
    if req.background:
        raise bad_request("background responses are not supported", "background")
    meta = req.metadata or {}
    if len(meta) > 16 or any(len(k) > 64 or not isinstance(v, str) or len(v) > 512 for k, v in meta.items()):
        raise bad_request("metadata takes at most 16 pairs, keys of at most 64 characters and string values of at "
                          "most 512", "metadata")


def output_items(message: AssistantMessage, status: str = "completed") -> list[dict]:
    """status: the message's and calls' ("incomplete" where max_output_tokens cut the reply)."""
    items: list[dict] = []
    if message.reasoning_content:
        items.append({"type": "reasoning", "id": _id("rs"), "summary": [], "status": "completed",
                      "content": [{"type": "reasoning_text", "text": message.reasoning_content}]})
    if message.content:
        items.append(_message_item(message.content, status))
    for call in message.tool_calls:
        items.append({"type": "function_call", "id": _id("fc"), "call_id": call.id,
                      "name": call.function.name, "arguments": call.function.arguments, "status": status})
    return items


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _message_item(text: str, status: str, item_id: str | None = None) -> dict:
    return {"type": "message", "id": item_id or _id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


class ResponsesHandler:
    def __init__(self, chat: ChatHandler):
        self.chat, self.store = chat, ResponseStore()

    def _history(self, req: ResponsesRequest) -> list[dict]:
        return list(self.store.get(req.previous_response_id)[0]) if req.previous_response_id else []

    def _body(self, req: ResponsesRequest, response_id: str, created: int, status: str, output: list[dict],
              usage: dict | None, finish: str | None = None) -> dict:
        incomplete = status == "incomplete"
        return {"id": response_id, "object": "response", "created_at": created, "status": status,
                "model": self.chat.models.response_name(req.model), "output": output, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
                "previous_response_id": req.previous_response_id, "temperature": req.temperature,
                "top_p": req.top_p, "parallel_tool_calls": req.parallel_tool_calls is not False,
                "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "store": req.store,
                "text": req.text or {"format": {"type": "text"}}, "truncation": "disabled",
                "reasoning": req.reasoning, "metadata": req.metadata or {}, "usage": usage}

    def _usage(self, final, prompt_len: int, message: AssistantMessage) -> dict:
        out = len(final.outputs[0].token_ids)
        thought = message.reasoning_content
        reasoning = len(self.chat.prompts.tokenizer.encode(thought, add_special_tokens=False)) if thought else 0
        return {"input_tokens": prompt_len, "output_tokens": out, "total_tokens": prompt_len + out,
                "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
                "output_tokens_details": {"reasoning_tokens": min(reasoning, out)}}

    async def start(self, req: ResponsesRequest):
        check_request(req)
        history = self._history(req)
        chat_req = to_chat(req, history)
        try:
            request_id, stream, prompt_ids = await self.chat.start(chat_req)
        except APIError as e:  # named as this API names its parameters
            e.param, e.message = _PARAMS.get(e.param, e.param), _renamed(e.message)
            raise
        return (_id("resp"), chat_req, history), stream, prompt_ids

    def _remember(self, req: ResponsesRequest, chat_req: ChatCompletionRequest, message: AssistantMessage,
                  response_id: str, body: dict) -> None:
        if not req.store:
            return
        turns = [m.model_dump(exclude_none=True) for m in chat_req.messages[1 if req.instructions else 0:]]
        # a call cut short by max_output_tokens (arguments not JSON) is kept as the text it is: as a call it would
        # fail every follow-up's history
        calls = [c for c in message.tool_calls if _is_json(c.function.arguments)]
        cut = [c.function.arguments for c in message.tool_calls if c not in calls]
        reply = {"role": "assistant", "content": "".join([message.content or "", *cut]) or None}
        if calls:
            reply["tool_calls"] = [c.model_dump() for c in calls]
        if message.reasoning_content:  # for templates that keep the thinking of a tool loop's turns
            reply["reasoning_content"] = message.reasoning_content
        self.store.put(response_id, turns + [reply], body)

    async def full(self, req: ResponsesRequest, ids, stream, prompt_ids) -> dict:
        response_id, chat_req, _ = ids
        created, final = int(time.time()), None
        try:
            async for out in stream:
                final = out
        finally:
            stream.close()
        c = final.outputs[0]
        message, _ = self.chat._reply(chat_req, prompt_ids).message(c.text, c.finish_reason)
        status = "incomplete" if c.finish_reason == "length" else "completed"
        body = self._body(req, response_id, created, status, output_items(message, status),
                          self._usage(final, len(prompt_ids), message))
        self._remember(req, chat_req, message, response_id, body)
        return body

    async def events(self, req: ResponsesRequest, ids, stream, prompt_ids) -> AsyncIterator[str]:
        """The Responses streaming events, each with its sequence number. Reasoning and text go out as they come
        (the reasoning item closed before the message opens, as vLLM orders them); function calls whole at the
        end. The message item holds exactly the text its deltas carried."""
        response_id, chat_req, _ = ids
        created, seq = int(time.time()), 0
        reply = self.chat._reply(chat_req, prompt_ids)
        deltas = reply.stream()

        def event(kind: str, **data) -> str:
            nonlocal seq
            seq += 1
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **data})}\n\n"

        def close_reasoning():
            item = {"type": "reasoning", "id": reasoning_id, "summary": [], "status": "completed",
                    "content": [{"type": "reasoning_text", "text": reasoning}]}
            yield event("response.reasoning_text.done", item_id=reasoning_id, output_index=0, content_index=0,
                        text=reasoning)
            yield event("response.output_item.done", output_index=0, item=item)

        yield event("response.created", response=self._body(req, response_id, created, "in_progress", [], None))
        yield event("response.in_progress", response=self._body(req, response_id, created, "in_progress", [], None))
        msg_id, text, final = None, "", None
        reasoning_id, reasoning, reasoning_open = None, "", False
        try:
            async for out in stream:
                final = out
                c = out.outputs[0]
                d = deltas.delta(c.text, c.finish_reason is not None)
                if d is None:
                    continue
                if d.reasoning_content:
                    if reasoning_id is None:
                        reasoning_id, reasoning_open = _id("rs"), True
                        yield event("response.output_item.added", output_index=0, item={
                            "type": "reasoning", "id": reasoning_id, "summary": [], "status": "in_progress",
                            "content": []})
                    reasoning += d.reasoning_content
                    yield event("response.reasoning_text.delta", item_id=reasoning_id, output_index=0,
                                content_index=0, delta=d.reasoning_content)
                if d.content:
                    if msg_id is None:
                        if reasoning_open:
                            for e in close_reasoning():
                                yield e
                            reasoning_open = False
                        msg_id = _id("msg")
                        yield event("response.output_item.added", output_index=self._msg_index(reasoning_id),
                                    item={**_message_item("", "in_progress", msg_id), "content": []})
                        yield event("response.content_part.added", item_id=msg_id,
                                    output_index=self._msg_index(reasoning_id), content_index=0,
                                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                    text += d.content
                    yield event("response.output_text.delta", item_id=msg_id, content_index=0, delta=d.content,
                                output_index=self._msg_index(reasoning_id), logprobs=[])
        finally:
            stream.close()
        c = final.outputs[0]
        message, _ = reply.message(c.text, c.finish_reason)
        status = "incomplete" if c.finish_reason == "length" else "completed"
        calls = [i for i in output_items(message, status) if i["type"] == "function_call"]
        items: list[dict] = []
        if reasoning_id is not None:
            if reasoning_open:
                for e in close_reasoning():
                    yield e
            items.append({"type": "reasoning", "id": reasoning_id, "summary": [], "status": "completed",
                          "content": [{"type": "reasoning_text", "text": reasoning}]})
        if msg_id is not None:  # what the deltas said
            item = _message_item(text, status, msg_id)
            index = len(items)
            yield event("response.output_text.done", item_id=msg_id, output_index=index, content_index=0, text=text,
                        logprobs=[])
            yield event("response.content_part.done", item_id=msg_id, output_index=index, content_index=0,
                        part=item["content"][0])
            yield event("response.output_item.done", output_index=index, item=item)
            items.append(item)
        for item in calls:  # once the reply is complete: OpenAI's sequence, the arguments in one delta
            index = len(items)
            yield event("response.output_item.added", output_index=index,
                        item={**item, "arguments": "", "status": "in_progress"})
            yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                        delta=item["arguments"])
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        arguments=item["arguments"])
            yield event("response.output_item.done", output_index=index, item=item)
            items.append(item)
        body = self._body(req, response_id, created, status, items, self._usage(final, len(prompt_ids), message))
        self._remember(req, chat_req, message, response_id, body)
        yield event("response.completed" if status == "completed" else "response.incomplete", response=body)

    @staticmethod
    def _msg_index(reasoning_id: str | None) -> int:
        return 0 if reasoning_id is None else 1
