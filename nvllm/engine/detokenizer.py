"""Incremental detokenization that never splits a multi-byte character.

Each step decodes a short window of tokens twice — up to the last emitted token and up to the newest — and
emits the difference. A window that decodes to a trailing U+FFFD (an incomplete UTF-8 sequence from byte
fallback) emits nothing until the rest of the character arrives. Decoding a window rather than single
tokens keeps tokenizers' leading-space rules right."""

from __future__ import annotations

REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 5      # prompt tokens decoded along with the first outputs, for the leading-space rules
_MAX_PROMPT_CONTEXT = 24


def prompt_context(decode, prompt_ids: list[int]) -> list[int]:
    """The prompt's last tokens to decode the first outputs after: at least five, and (looking back up to 24) none
    beginning inside a character. Byte-fallback decoders turn a whole run of byte tokens into U+FFFD when the run is
    not valid UTF-8, so a window that began in the middle of a prompt's multi-byte character garbled the outputs'
    bytes that carry on the run."""
    for n in range(_PROMPT_CONTEXT, min(len(prompt_ids), _MAX_PROMPT_CONTEXT) + 1):
        context = prompt_ids[-n:]
        if REPLACEMENT not in decode(context):
            return context
    return prompt_ids[-_PROMPT_CONTEXT:]


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        # fast tokenizers: call the Rust decoder directly (transformers' decode() wrapper costs ~5x more per call)
        self.backend = getattr(tokenizer, "backend_tokenizer", None)
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_context(self._decode, prompt_ids))
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
