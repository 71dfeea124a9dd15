"""When a sequence stops, as vLLM decides it: EOS (unless ignore_eos) or a stop token id; a stop string, looked for
only once more than min_tokens tokens are out and never inside the first min_tokens tokens' text; max_tokens;
the model's length. Sets ``finish_reason`` / ``stop_reason`` and the text each token adds."""

from __future__ import annotations

from nvllm.engine.sequence import Sequence


def check_stop(seq: Sequence, tok: int, length: int, eos_token_ids: set[int], max_model_len: int) -> None:
    """``tok`` is the sequence's newest token; ``length``: its tokens up to and including it. Appends the token's
    text (a stop token's only with include_stop_str_in_output, as vLLM gives it) and sets the finish."""
    p = seq.params
    detokenize = seq.detokenizer.step if seq.detokenizer is not None else _no_text  # detokenize=False: ids only
    eos = tok in eos_token_ids and not p.ignore_eos
    if eos or tok in p.stop_token_ids:
        seq.finish_reason, seq.stop_reason = "stop", None if eos else tok
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
    """Earliest stop string that ends inside the last new_len characters and starts at ``floor`` or later:
    (start index, the string)."""
    best = None
    for s in stops:
        start = max(floor, len(text) - new_len - len(s) + 1)
        i = text.find(s, start)
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best
