"""``allowed_token_ids`` and ``bad_words``, as vLLM applies them: tokens set to −inf before logit_bias and the
penalties (after the structured outputs mask), so no draw can pick them. Log-probabilities stay the raw
distribution's, as vLLM reports them.

- ``allowed_token_ids``: every token outside the list is masked.
- ``bad_words``: each word is tokenized as it would stand at the start of the text and, when that gives other
  tokens of the same length, after a space (vLLM's rule). The last token of a word's tokens is masked whenever the
  generated tokens end with the ones before it, so the word is never completed. A one-token word is masked always.
  Only generated tokens count, not the prompt.
"""

from __future__ import annotations

import torch


def bad_words_token_ids(words: list[str], tokenizer) -> list[list[int]]:
    """The token sequences ``bad_words`` forbid (vLLM's ``SamplingParams.update_from_tokenizer``)."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if plain:
            out.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    return out


def bad_word_bans(words: list[list[int]], generated: list[int]) -> list[int]:
    """The tokens that would complete one of ``words`` after ``generated``."""
    bans = []
    for ids in words:
        prefix = len(ids) - 1
        if prefix > len(generated):
            continue
        if prefix == 0 or generated[-prefix:] == ids[:-1]:
            bans.append(ids[-1])
    return bans


def apply_allowed_token_ids(logits: torch.Tensor, allowed: list[tuple[int, list[int]]]) -> None:
    """Mask, in place, every token outside each listed row's allowed ids: ``allowed`` holds (row, ids)."""
    if not allowed:
        return
    rows = torch.tensor([i for i, _ in allowed], device=logits.device)
    keep = torch.zeros(len(allowed), logits.shape[-1], dtype=torch.bool)
    for j, (_, ids) in enumerate(allowed):
        keep[j, ids] = True
    logits[rows] = logits[rows].masked_fill(~keep.to(logits.device, non_blocking=True), float("-inf"))
