"""Chat messages → prompt text → token ids through a chat template: one implementation for the server's
/v1/chat/completions (nvllm.serve.prompts) and the offline LLM.chat."""

from __future__ import annotations

import codecs
import functools
import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger("nvllm")

# For tokenizers without a chat template (the demo model's): plain "Role: text" turns. BOS comes from
# encoding with special tokens, not from the template text.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] in ('system', 'developer') %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n"
    "{% elif message['role'] == 'assistant' %}Assistant: {{ message['content'] }}"
    "{% if not loop.last %}{{ '\\n' }}{% endif %}"  # a newline right after a block tag is trimmed
    "{% else %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


class ChatTemplateError(ValueError):
    """Messages the template cannot make a prompt of; ``param`` names the request field at fault."""

    def __init__(self, message: str, param: str = "messages"):
        super().__init__(message)
        self.param = param


def load_chat_template(tokenizer, path: str | None) -> tuple[str | dict[str, str], bool]:
    """(template, is_fallback): ``path``'s template (``read_chat_template``), else the tokenizer's (one, or a dict of
    named ones that ``render_chat`` picks from), else the plain fallback."""
    if path is not None:
        template = read_chat_template(path)
        logger.info("chat template: from --chat-template (%d characters)", len(template))
        return template, False
    if getattr(tokenizer, "chat_template", None):
        named = isinstance(tokenizer.chat_template, dict)
        logger.info("chat template: the tokenizer's%s",
                    f" (named: {', '.join(sorted(tokenizer.chat_template))})" if named else "")
        return tokenizer.chat_template, False
    logger.warning("the tokenizer has no chat template; chat prompts use a plain 'User: … / Assistant:' template "
                   "(pass --chat-template FILE, or LLM.chat(chat_template=...), to choose one)")
    return FALLBACK_CHAT_TEMPLATE, True


def read_chat_template(value: str) -> str:
    """--chat-template as vLLM reads it: a file's text, else, when the value holds '{', '}' or a newline, the
    template itself (its backslash escapes decoded, so a shell's "\\n" is a newline). FileNotFoundError otherwise."""
    try:
        path = Path(value).expanduser()
        if path.is_file():
            return path.read_text()
    except OSError:  # a name too long for a file: an inline template
        pass
    if not any(c in value for c in "{}\n"):
        raise FileNotFoundError(f"chat template file {value} does not exist (an inline template is Jinja text, "
                                "with its {{ }} or {% %})")
    return codecs.decode(value, "unicode_escape")


def _pick(template: str | dict[str, str], tools) -> str:
    """A template of a tokenizer's named ones, as transformers picks it: "tool_use" when tools are given and it has
    one, else "default"."""
    if not isinstance(template, dict):
        return template
    name = "tool_use" if tools and "tool_use" in template else "default"
    if name not in template:
        raise ChatTemplateError(f"the tokenizer's chat templates are named {', '.join(sorted(template))}, none "
                                "'default': pass a chat template to choose one")
    return template[name]


CONTENT_FORMATS = ("auto", "string", "openai")


def check_chat_template(template: str) -> None:
    """ValueError (its first line) for a template that does not compile in the environment transformers renders
    with: a server given one would start, then answer every chat request 400."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(template)
    except jinja2.TemplateError as e:
        where = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
        raise ValueError(f"--chat-template does not compile{where}: {e.message or type(e).__name__}") from None


@functools.lru_cache(maxsize=16)
def detect_content_format(template: str) -> str:
    """How a template reads a message's content, as vLLM's "auto" decides it: "openai" (a list of
    {"type": "text", "text": ...} parts) when it loops over some ``x['content']`` / ``x.content``, else "string" (the
    parts joined by newlines). A template jinja cannot parse here (an extension's tag) is taken as "string"."""
    import jinja2
    from jinja2 import nodes

    try:  # the environment transformers renders with (its {% generation %} tag included)
        from transformers.utils.chat_template_utils import _compile_jinja_template

        env = _compile_jinja_template(template).environment
    except Exception:  # noqa: BLE001 - a template transformers cannot compile fails later, where it is applied
        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    try:
        tree = env.parse(template)
    except jinja2.TemplateError:
        return "string"
    for loop in tree.find_all(nodes.For):
        it = loop.iter
        while isinstance(it, (nodes.Filter, nodes.Test)) and it.node is not None:  # content | selectattr(...)
            it = it.node
        if (isinstance(it, nodes.Getitem) and isinstance(it.arg, nodes.Const) and it.arg.value == "content") or \
                (isinstance(it, nodes.Getattr) and it.attr == "content"):
            return "openai"
    return "string"


_RENDER_ARGUMENTS = {"conversation", "messages", "chat_template", "tokenize", "add_generation_prompt",
                     "continue_final_message", "tools"}  # what render_chat passes itself


def render_chat(tokenizer, template: str | dict[str, str], messages: list[dict[str, Any]],
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                template_kwargs: dict | None = None, tools: list[dict[str, Any]] | None = None,
                content_format: str = "auto") -> str:
    """The prompt text of OpenAI-style messages ({"role", "content"}: a string, None, or a list of text parts; an
    assistant turn's ``tool_calls``, a tool turn's ``tool_call_id``), with the ``tools`` (OpenAI's function
    definitions) given to the template as HF templates take them. ``content_format`` (vLLM's
    --chat-template-content-format): each content as one string, as a list of text parts ("openai"), or as the
    template reads it ("auto", ``detect_content_format``). ``template`` may be a tokenizer's named templates
    (``_pick``)."""
    if not messages:
        raise ChatTemplateError("messages must not be empty")
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be true",
                                "continue_final_message")
    taken = sorted(set(template_kwargs or {}) & _RENDER_ARGUMENTS)
    if taken:
        raise ChatTemplateError(f"chat_template_kwargs cannot set {taken[0]!r}: the request gives it",
                                "chat_template_kwargs")
    if content_format not in CONTENT_FORMATS:
        raise ChatTemplateError(f"unknown chat template content format {content_format!r}; choose "
                                f"{', '.join(CONTENT_FORMATS)}", "chat_template_content_format")
    template = _pick(template, tools)
    parts = (detect_content_format(template) if content_format == "auto" else content_format) == "openai" \
        and template != FALLBACK_CHAT_TEMPLATE  # nvllm's own template reads strings
    conversation = [_turn(m, i, parts) for i, m in enumerate(messages)]
    try:
        return tokenizer.apply_chat_template(
            conversation, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tools=tools or None, **(template_kwargs or {}))
    except Exception as e:  # jinja's TemplateError (e.g. roles must alternate) and friends
        raise ChatTemplateError(f"cannot apply the chat template: {e}") from None


def encode_chat(tokenizer, text: str, is_fallback: bool, add_special_tokens: bool | None = None) -> list[int]:
    """A rendered chat prompt's token ids. Real templates write BOS themselves; the fallback leaves it to the
    tokenizer (add_special_tokens None: chosen so)."""
    if add_special_tokens is None:
        add_special_tokens = is_fallback
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if not ids:
        raise ChatTemplateError("the rendered chat prompt is empty")
    return ids


def _turn(message: Any, index: int, parts: bool = False) -> dict[str, Any]:
    """One message as templates read it: its content one string, or (``parts``) a list of text parts. A tool call's
    arguments (JSON text in OpenAI's API) become the object they encode: HF templates (Qwen's, Llama's) write them
    with ``tojson``, as vLLM hands them over; an object is taken as it is (HF's own tool-use format). An assistant
    turn's reasoning (``reasoning`` or ``reasoning_content``, as the server returned it) reaches the template under
    both names, as vLLM gives it, so templates that keep earlier thinking (Qwen3's, in tool loops) see it."""
    role = _role_of(message, index)
    texts = texts_of(message, index)
    turn = {"role": role, "content": [{"type": "text", "text": t} for t in texts] if parts else "\n".join(texts)}
    if message.get("tool_calls"):
        calls = []
        for call in message["tool_calls"]:
            fn = dict(call.get("function") or {})
            arguments = fn.get("arguments")
            if not isinstance(arguments, (dict, list)):
                try:
                    fn["arguments"] = json.loads(arguments or "{}")
                except (TypeError, json.JSONDecodeError):
                    raise ChatTemplateError(f"messages[{index}]: tool call arguments must be JSON text, got "
                                            f"{arguments!r}") from None
            calls.append({**call, "function": fn})
        turn["tool_calls"] = calls
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    if role == "assistant" and reasoning is not None:
        if not isinstance(reasoning, str):
            raise ChatTemplateError(f"messages[{index}]: reasoning must be text, got {reasoning!r}")
        turn["reasoning"] = turn["reasoning_content"] = reasoning
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            turn[key] = message[key]
    return turn


def _role_of(message: Any, index: int) -> str:
    role = message.get("role") if isinstance(message, dict) else None
    if not isinstance(role, str):
        raise ChatTemplateError(f"messages[{index}] must be a dict with a string 'role', got {message!r}")
    return role


def texts_of(message: dict[str, Any], index: int) -> list[str]:
    """The texts of a message's content: one for a string, none for None, one a text part."""
    content = message.get("content")
    if content is None:
        return []
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        raise ChatTemplateError(f"messages[{index}]: content must be a string or a list of content parts")
    texts = []
    for part in content:  # as vLLM reads them: a bare string is text, and so is an assistant's refusal
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "refusal"):
            raise ChatTemplateError(f"messages[{index}]: only text content parts are supported, got {kind!r}")
        if not isinstance(part.get(kind), str):
            raise ChatTemplateError(f"messages[{index}]: a {kind} content part needs its {kind}")
        texts.append(part[kind])
    return texts
