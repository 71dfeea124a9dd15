"""When a sequence stops, as vLLM decides it: EOS (unless ignore_eos) or a stop token id; a stop string, looked for
only once more than min_tokens tokens are out, and ending after the first min_tokens tokens' text; max_tokens;
the model's length. Sets ``finish_reason`` / ``stop_reason`` and the text each token adds. ``stop_reason`` is the
stop string or the stop token id, as vLLM reports them: None for the tokenizer's own EOS, the id for the other end
tokens generation_config.json names (vLLM makes those stop token ids)."""

from __future__ import annotations

from nvllm.engine.sequence import Sequence


def min_tokens_banned(seq: Sequence, eos_token_ids: set[int]) -> list[int]:
    """The ids no output may be while min_tokens is not reached: the stop ids and every end token, ignore_eos or
    not (as vLLM's min-tokens processor bans them)."""
    return sorted(set(seq.params.stop_token_ids) | eos_token_ids)


def check_stop(seq: Sequence, tok: int, length: int, eos_token_ids: set[int], max_model_len: int,
               eos_token_id: int | None = None) -> None:
    """``tok`` is the sequence's newest token; ``length``: its tokens up to and including it. Appends the token's
    text (a stop token's only with include_stop_str_in_output, as vLLM gives it) and sets the finish.
    ``eos_token_ids``: every end token; ``eos_token_id``: the tokenizer's own."""
    p = seq.params
    detokenize = seq.detokenizer.step if seq.detokenizer is not None else _no_text  # detokenize=False: ids only
    eos = tok in eos_token_ids and not p.ignore_eos
    if eos or tok in p.stop_token_ids:
        seq.finish_reason, seq.stop_reason = "stop", None if eos and tok == eos_token_id else tok
        if p.include_stop_str_in_output:  # EOS's text is special: empty unless skip_special_tokens is off
            seq.text += detokenize([tok])
        return
    new_text = detokenize([tok])
    seq.text += new_text
    n_out = length - seq.num_prompt_tokens
    if n_out == p.min_tokens:
        seq.stop_floor = len(seq.text)
    checked = p.stop and new_text and n_out > p.min_tokens
    hit = find_stop(seq.text, len(new_text), p.stop, seq.stop_floor) if checked else None
    if hit is not None:
        i, s = hit
        seq.text = seq.text[:i + len(s)] if p.include_stop_str_in_output else seq.text[:i]
        seq.finish_reason, seq.stop_reason = "stop", s
    elif p.max_tokens is not None and n_out >= p.max_tokens:
        seq.finish_reason = "length"
    elif length >= max_model_len:
        seq.finish_reason = "length"


def _no_text(ids: list[int]) -> str:
    return ""


def find_stop(text: str, new_len: int, stops: list[str], floor: int = 0) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last new_len characters and after ``floor`` (vLLM's: a stop may
    begin in the min_tokens tokens' text, not end there): (start index, the string)."""
    best = None
    for s in stops:
        start = max(0, floor - len(s) + 1, len(text) - new_len - len(s) + 1)  # (a negative start counts from the end)
        i = text.find(s, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best
