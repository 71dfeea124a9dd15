"""Incremental detokenization that never splits a multi-byte character.

Each step decodes a short window of tokens twice — up to the last emitted token and up to the newest — and
emits the difference. A window that decodes to a trailing U+FFFD (an incomplete UTF-8 sequence from byte
fallback) emits nothing until the rest of the character arrives. Decoding a window rather than single
tokens keeps tokenizers' leading-space rules right."""

from __future__ import annotations

REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5  # prompt tokens decoded along with the first outputs, for the leading-space rules


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        # fast tokenizers: call the Rust decoder directly (transformers' decode() wrapper costs ~5x more per call)
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def step(self, new_ids: list[int]) -> str:
        """Feed newly generated ids; return the text they complete (maybe empty)."""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return ""
        # keep the window short: slide it so it starts at the last emitted token
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return full[len(prefix):]
