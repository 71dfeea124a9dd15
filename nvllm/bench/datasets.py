"""Benchmark prompts: random token sequences, ShareGPT conversations, a JSON-lines file of prompts, GSM8K
questions as chat prompts. Every sampler is seeded; a file that does not parse raises DatasetError naming
the file and the line.

Offline runs pass the engine's max_model_len: a prompt that does not fit with its output is skipped while
sampling (as vLLM's samplers skip theirs) and the count is filled from those that fit.

Prompt lengths are counted with the benchmark's tokenizer, special tokens included, GSM8K's chat prompts as
rendered; the serve benchmark keeps these counts (vLLM's benchmark sums its datasets' counts too), whatever usage
the server reports.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nvllm.config import missing

logger = logging.getLogger("nvllm")

DATASETS = ("random", "sharegpt", "jsonl", "gsm8k")
RANDOM_INPUT_LEN = RANDOM_OUTPUT_LEN = 128  # the random dataset's lengths when no flag gives them
GSM8K_INSTRUCTION = ("Solve the following math problem step by step. "
                     "Write the final answer as a number after '####'.\n\n")


class DatasetError(ValueError):
    """A dataset that cannot be used (missing, does not parse, wrong schema): one clear line."""


@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int
    expected_output_len: int
    messages: list[dict[str, str]] | None = None  # the chat form of the same prompt (chat endpoints)
    prompt_token_ids: list[int] | None = None  # exact ids, for offline runs (random dataset)


def random_lengths(input_len: int | None, output_len: int | None) -> tuple[int, int]:
    """The random dataset's (input, output) lengths: the flags', else the defaults (what a result records)."""
    return (RANDOM_INPUT_LEN if input_len is None else input_len,
            RANDOM_OUTPUT_LEN if output_len is None else output_len)


def load_requests(name: str, tokenizer, num_prompts: int, path: str | None = None, input_len: int | None = None,
                  output_len: int | None = None, range_ratio: float = 0.0, seed: int = 0,
                  max_model_len: int | None = None) -> list[SampleRequest]:
    """`num_prompts` requests from dataset `name`. `output_len` None: from the data (sharegpt, gsm8k, jsonl).
    `max_model_len`: the engine's limit (offline runs), checked while sampling, as vLLM's samplers check theirs: a
    prompt whose prompt + output tokens exceed it is skipped and the count filled from those that fit."""
    if num_prompts < 1:
        raise DatasetError("--num-prompts must be at least 1")
    if output_len is not None and output_len < 1:
        raise DatasetError("--output-len must be at least 1")
    if name == "random":
        if path:
            raise DatasetError("the random dataset takes no --dataset-path")
        return random_requests(tokenizer, num_prompts, *random_lengths(input_len, output_len), range_ratio, seed,
                               max_model_len)
    if name not in DATASETS:
        raise DatasetError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")
    if not path:
        raise DatasetError(f"the {name} dataset needs --dataset-path")
    p = Path(path).expanduser()
    if not p.is_file():
        raise DatasetError(f"dataset file {path} {missing(path)}")
    if name == "sharegpt":
        pairs = _sharegpt_pairs(p)
    elif name == "gsm8k":
        pairs = [(_chat(q), a, None) for q, a in _gsm8k_pairs(p)]
    else:
        pairs = _jsonl_prompts(p)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(pairs)) if name != "jsonl" else np.arange(len(pairs))  # jsonl: file order
    out: list[SampleRequest] = []
    too_long = 0  # prompt + output over max_model_len
    for i in order:
        prompt, completion, own_len = pairs[i]
        messages = prompt if isinstance(prompt, list) else None
        text = _render(tokenizer, messages) if messages else prompt
        prompt_len = len(tokenizer.encode(text))
        n_out = output_len or own_len or (len(tokenizer.encode(completion)) if completion else None)
        if n_out is None:
            if name == "sharegpt":  # a conversation without a reply: vLLM's loader skips it too
                continue
            raise DatasetError(f"{path} holds no replies to take output lengths from; give --output-len")
        if name == "sharegpt" and not _sharegpt_valid(prompt_len, n_out, fixed=output_len is not None):
            continue
        if max_model_len is not None and prompt_len + n_out > max_model_len:
            too_long += 1
            continue
        out.append(SampleRequest(text, prompt_len, n_out, messages))
        if len(out) == num_prompts:
            break
    if not out and too_long:
        raise DatasetError(f"no prompt of {path} fits max_model_len {max_model_len} with its output "
                           f"({too_long} longer than that in prompt + output tokens)")
    if not out:
        why = "too long, too short, or without a reply to take an output length from (--output-len)" \
            if name == "sharegpt" and not output_len else "too long or too short"
        raise DatasetError(f"no usable prompt in {path} (all {why})")
    fit = f" within max_model_len {max_model_len}" if too_long else ""
    if len(out) < num_prompts:
        logger.warning("%s gives %d usable prompts%s; repeating them to reach %d", path, len(out), fit, num_prompts)
        out = [out[i % len(out)] for i in range(num_prompts)]
    return out


# ---- random -------------------------------------------------------------------------------------------
def random_requests(tokenizer, n: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    seed: int = 0, max_model_len: int | None = None) -> list[SampleRequest]:
    """Token lengths uniform in [L·(1−r), L·(1+r)] (special tokens included in the input length); the
    tokens are consecutive ids from a random offset, decoded to text and re-encoded so that the text has
    the length it claims. Lengths that could exceed ``max_model_len`` are refused: every request must fit."""
    if not 0.0 <= range_ratio < 1.0:
        raise DatasetError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    special = tokenizer.num_special_tokens_to_add()
    real = max(0, input_len - special)
    in_lo, in_hi = math.floor(real * (1 - range_ratio)), math.ceil(real * (1 + range_ratio))
    out_lo = max(1, math.floor(output_len * (1 - range_ratio)))
    out_hi = max(1, math.ceil(output_len * (1 + range_ratio)))
    if in_lo < 1:
        raise DatasetError(f"--input-len {input_len} leaves no room for prompt tokens "
                           f"({special} special tokens, range ratio {range_ratio})")
    if max_model_len is not None and in_hi + special + out_hi > max_model_len:
        reach = f" (up to {in_hi + special} + {out_hi} with --random-range-ratio {range_ratio})" if range_ratio else ""
        raise DatasetError(f"--input-len + --output-len = {input_len + output_len}{reach} exceeds max_model_len "
                           f"{max_model_len}")
    in_lens = rng.integers(in_lo, in_hi + 1, size=n)
    out_lens = rng.integers(out_lo, out_hi + 1, size=n)
    offsets = rng.integers(0, tokenizer.vocab_size, size=n)
    allowed = plain_token_ids(tokenizer)
    out = []
    for i in range(n):
        ids = allowed[(offsets[i] + i + np.arange(in_lens[i])) % len(allowed)].tolist()
        text = _fit_text(tokenizer, ids, int(in_lens[i]), rng, allowed)
        full = tokenizer.encode(text)
        out.append(SampleRequest(text, len(full), int(out_lens[i]), None, full))
    return out


def plain_token_ids(tokenizer) -> np.ndarray:
    """Token ids that are neither special nor byte-fallback pieces (`<0x41>`), which decode to fragments
    that do not survive a text round trip."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(tokenizer.vocab_size)))
    special = set(tokenizer.all_special_ids)
    return np.array([i for i, p in enumerate(pieces)
                     if i not in special and p is not None and not (p.startswith("<0x") and p.endswith(">"))])


def _fit_text(tokenizer, ids: list[int], target: int, rng, allowed) -> str:
    """Decode ids to text whose re-encoding has `target` tokens (a few rounds of trim/extend; the last
    text is kept if they do not converge, its true length is what gets reported)."""
    text = tokenizer.decode(ids)
    for _ in range(10):
        again = tokenizer.encode(text, add_special_tokens=False)
        if len(again) == target:
            break
        again = again[:target] if len(again) > target else again + allowed[
            rng.integers(0, len(allowed), size=target - len(again))].tolist()
        text = tokenizer.decode(again)
    return text


# ---- files --------------------------------------------------------------------------------------------
def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except UnicodeDecodeError:
        raise DatasetError(f"{path}: not UTF-8 text") from None


def _read_jsonl(path: Path) -> list[tuple[int, Any]]:
    rows = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise DatasetError(f"{path}: not UTF-8 text") from None
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append((n, json.loads(line)))
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{n}: not valid JSON ({e.msg})") from None
    if not rows:
        raise DatasetError(f"{path} is empty")
    return rows


def _sharegpt_pairs(path: Path) -> list[tuple[str, str | None, None]]:
    """(first human turn, the reply after it or None) for each conversation."""
    data = _load_json(path)
    if not isinstance(data, list):
        raise DatasetError(f"{path}: a ShareGPT file is a JSON list of {{'conversations': [...]}} objects")
    pairs = []
    for i, entry in enumerate(data):
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or not all(isinstance(t, dict) and "value" in t for t in turns):
            raise DatasetError(f"{path}: entry {i} has no 'conversations' list of {{'from', 'value'}} turns")
        first = next((k for k, t in enumerate(turns) if t.get("from") in ("human", "user")), None)
        if first is None or not turns[first]["value"]:
            continue
        reply = turns[first + 1]["value"] if first + 1 < len(turns) else None
        pairs.append((turns[first]["value"], reply, None))
    return pairs


def _sharegpt_valid(prompt_len: int, output_len: int, fixed: bool) -> bool:
    """vLLM's ShareGPT filter: prompts of 4..1024 tokens, prompt + output ≤ 2048, outputs ≥ 4 from data."""
    return 4 <= prompt_len <= 1024 and prompt_len + output_len <= 2048 and (fixed or output_len >= 4)


def _jsonl_prompts(path: Path) -> list[tuple[str, None, int | None]]:
    """Each line: a JSON string, or an object with "prompt" (or "text") and optionally "output_len"."""
    out = []
    for n, row in _read_jsonl(path):
        if isinstance(row, str):
            row = {"prompt": row}
        prompt = row.get("prompt", row.get("text")) if isinstance(row, dict) else None
        if not isinstance(prompt, str) or not prompt:
            raise DatasetError(f"{path}:{n}: expected a string or an object with a \"prompt\" string")
        own = row.get("output_len", row.get("max_tokens"))
        if own is not None and (not isinstance(own, int) or own < 1):
            raise DatasetError(f"{path}:{n}: output_len must be a positive integer")
        out.append((prompt, None, own))
    return out


def _gsm8k_pairs(path: Path) -> list[tuple[str, str]]:
    out = []
    for n, row in _read_jsonl(path):
        if not isinstance(row, dict) or not isinstance(row.get("question"), str):
            raise DatasetError(f"{path}:{n}: expected a GSM8K object with \"question\" and \"answer\"")
        out.append((row["question"], row.get("answer")))
    return out


def _chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": GSM8K_INSTRUCTION + question}]


def _render(tokenizer, messages: list[dict[str, str]]) -> str:
    """The chat prompt as text for a completions endpoint: the tokenizer's chat template when it has one,
    else a plain "User: … / Assistant:" transcript."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages) + "Assistant:"
