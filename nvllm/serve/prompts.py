"""From what a client sends to prompt token ids: completion prompts (string, strings, token ids, lists of
token ids) and chat messages rendered through a chat template, checked against the vocabulary and
max_model_len. Uses the server's own tokenizer instance: the engine thread's is never touched from here."""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor

from nvllm.chat_template import ChatTemplateError, encode_chat, load_chat_template, render_chat
from nvllm.serve.errors import bad_request
from nvllm.serve.protocol import ChatMessage


class PromptProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, chat_template: str | None = None,
                 tokens_as_ids: bool = False, content_format: str = "auto"):
        """tokens_as_ids: logprobs name tokens "token_id:N" unless a request says otherwise (vLLM's
        --return-tokens-as-token-ids). content_format: how the chat template gets a message's content
        (nvllm.chat_template.render_chat)."""
        self.tokenizer = tokenizer
        self.content_format = content_format
        self.tokens_as_ids = tokens_as_ids
        tokenizer.model_max_length = 2**62  # our own length check answers; no tokenizer warning on the side
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.chat_template, self.fallback_template = load_chat_template(tokenizer, chat_template)
        self._token_texts: dict[int, str] = {}
        # a request's tokenization and chat template run here, one at a time (as vLLM's single tokenizer thread):
        # a prompt of megabytes takes seconds, during which the event loop keeps every other request and stream going
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nvllm-tokenize")

    async def off_loop(self, fn, *args, **kwargs):
        """``fn(*args, **kwargs)`` on the tokenizer thread, awaited; what it raises (a 400) is raised here."""
        return await asyncio.get_running_loop().run_in_executor(self._executor,
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

