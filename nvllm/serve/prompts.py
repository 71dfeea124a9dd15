"""From what a client sends to prompt token ids: completion prompts (string, strings, token ids, lists of
token ids) and chat messages rendered through a chat template, checked against the vocabulary and
max_model_len. Uses the server's own tokenizer instances: the engine thread's is never touched from here."""

from __future__ import annotations

import asyncio
import copy
import functools
import threading
from concurrent.futures import ThreadPoolExecutor

from pydantic import BaseModel

from nvllm.chat_template import ChatTemplateError, encode_chat, load_chat_template, render_chat
from nvllm.serve.errors import bad_request
from nvllm.serve.protocol import ChatMessage

LARGE_PROMPT_CHARS = 1 << 16  # requests with more text than this are tokenized in a lane of their own


class PromptProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, chat_template: str | None = None,
                 tokens_as_ids: bool = False, content_format: str = "auto"):
        """tokens_as_ids: logprobs name tokens "token_id:N" unless a request says otherwise (vLLM's
        --return-tokens-as-token-ids). content_format: how the chat template gets a message's content
        (nvllm.chat_template.render_chat)."""
        self._tokenizer = tokenizer
        self.content_format = content_format
        self.tokens_as_ids = tokens_as_ids
        tokenizer.model_max_length = 2**62  # our own length check answers; no tokenizer warning on the side
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.chat_template, self.fallback_template = load_chat_template(tokenizer, chat_template)
        self._token_texts: dict[int, str] = {}
        # A request's tokenization and chat template run off the event loop, one request at a time in each of two
        # lanes: requests of more than LARGE_PROMPT_CHARS characters of text in the second, with a tokenizer of its
        # own (a copy, made on its thread at its first request). A prompt of megabytes takes seconds; the loop keeps
        # every stream going meanwhile, and other requests queue only behind other large ones.
        self._lane = threading.local()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvllm-tokenize")
        self._large_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvllm-tokenize-large",
                                                  initializer=self._own_tokenizer)

    @property
    def tokenizer(self):
        """The tokenizer of the calling thread's lane."""
        return getattr(self._lane, "tokenizer", self._tokenizer)

    def _own_tokenizer(self) -> None:
        self._lane.tokenizer = copy.deepcopy(self._tokenizer)

    async def off_loop(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` on a tokenizer thread, awaited; what it raises (a 400) is raised here. The lane
        is chosen by how much text ``args`` and ``kwargs`` (the request) hold."""
        large = text_size(args) + text_size(kwargs) > LARGE_PROMPT_CHARS
        return await asyncio.get_running_loop().run_in_executor(self._large_executor if large else self._executor,
                                                                functools.partial(fn, *args, **kwargs))

    # ---- completions ---------------------------------------------------------------------------------
    def completion_prompts(self, prompt, truncate: int | None = None, add_special_tokens: bool = True
                           ) -> list[list[int]]:
        """Every prompt of a completion request as token ids (all validated before any is queued); ``truncate``:
        the request's truncate_prompt_tokens."""
        if isinstance(prompt, str):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
            prompts = [prompt]
        elif isinstance(prompt, list) and prompt:
            prompts = prompt
        else:
            raise bad_request("prompt is empty", "prompt")
        return [self.encode(p, add_special_tokens, truncate) for p in prompts]

    def encode(self, prompt: str | list[int], add_special_tokens: bool = True, truncate: int | None = None
               ) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("prompt is empty", "prompt")
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            ids = list(prompt)
            if not ids:
                raise bad_request("prompt is empty", "prompt")
            self.check_ids(ids, "prompt")
        ids = self.truncated(ids, truncate)
        self.check_length(ids)
        return ids

    def truncated(self, ids: list[int], keep: int | None) -> list[int]:
        """The last ``keep`` tokens (truncate_prompt_tokens; -1: all that leave room for one generated token)."""
        if keep is None:
            return ids
        if keep < 1 and keep != -1:
            raise bad_request(f"truncate_prompt_tokens must be at least 1, or -1 (up to max_model_len), got {keep}",
                              "truncate_prompt_tokens")
        return ids[-(self.max_model_len - 1 if keep == -1 else keep):]

    def check_ids(self, ids: list[int], param: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary (size {self.vocab_size})", param)

    def check_length(self, ids: list[int], param: str = "prompt") -> None:
        if len(ids) >= self.max_model_len:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens; the prompt has "
                              f"{len(ids)} tokens and at least one must be left for the completion. Please "
                              "shorten the prompt.", param, code="context_length_exceeded")

    # ---- chat ----------------------------------------------------------------------------------------
    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, template_kwargs: dict | None = None,
                    tools: list[dict] | None = None) -> str:
        try:
            return render_chat(self.tokenizer, self.chat_template, [m.model_dump() for m in messages],
                               add_generation_prompt, continue_final_message, template_kwargs, tools,
                               self.content_format)
        except ChatTemplateError as e:
            raise bad_request(str(e), e.param) from None

    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, template_kwargs: dict | None = None,
                    add_special_tokens: bool | None = None, tools: list[dict] | None = None,
                    truncate: int | None = None) -> list[int]:
        text = self.render_chat(messages, add_generation_prompt, continue_final_message, template_kwargs, tools)
        try:
            ids = encode_chat(self.tokenizer, text, self.fallback_template, add_special_tokens)
        except ChatTemplateError as e:
            raise bad_request(str(e), e.param) from None
        ids = self.truncated(ids, truncate)
        self.check_length(ids, "messages")
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def logprob_token(self, as_ids: bool | None):
        """How a request's logprobs name tokens: ``token_text``, or "token_id:N" (vLLM's return_tokens_as_token_ids:
        a token that is no whole character, a byte of UTF-8, stays exact)."""
        if self.tokens_as_ids if as_ids is None else as_ids:
            return lambda tok: f"token_id:{tok}"
        return self.token_text

    def token_text(self, tok: int) -> str:
        """One token's text as it reads inside a sequence (' time', not 'time'), for logprobs: decoded after
        BOS so that tokenizers which drop a leading space at the start of a text keep it."""
        text = self._token_texts.get(tok)
        if text is None:
            anchor = self.tokenizer.bos_token_id
            text = self.decode([tok])
            if anchor is not None:
                base, both = self.decode([anchor]), self.decode([anchor, tok])
                if both.startswith(base):
                    text = both[len(base):]
            self._token_texts[tok] = text
        return text


def text_size(value) -> int:
    """Characters of text in a request (its prompts, messages, tools; a token id counts one), to choose its lane."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (list, tuple)):
        return len(value) if value and isinstance(value[0], int) else sum(map(text_size, value))
    if isinstance(value, dict):
        return sum(map(text_size, value.values()))
    if isinstance(value, BaseModel):
        return text_size(vars(value)) + text_size(value.__pydantic_extra__ or {})
    return 0
