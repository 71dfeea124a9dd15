"""SamplingParams: what a request asks of the sampler, validated at construction."""

from __future__ import annotations

import logging
import math
import numbers
from dataclasses import InitVar, dataclass, field
from typing import Any


MAX_STOP_STRINGS = 64
MIN_TEMPERATURE = 0.01  # vLLM's: a positive temperature below it is raised to it
MAX_STOP_LEN = 1024
_F32_TINY, _F32_MAX = 2.0 ** -126, (2.0 - 2.0 ** -23) * 2.0 ** 127  # float32's smallest normal and largest
MAX_LOGIT_BIAS = 100.0  # a bias is clamped to [-100, 100], as vLLM and OpenAI do


@dataclass
class StructuredOutputsParams:
    """Constrain the generated text (vLLM's StructuredOutputsParams): exactly one of a JSON schema (a dict or its
    JSON text), any JSON object, a regular expression, one of fixed strings, or a grammar: EBNF (xgrammar's
    dialect, GBNF-like: ``root ::= ...``) or Lark (``start: ...``, with ``%import common.…`` and
    ``%ignore``). The tokens that would break the constraint are masked before every draw
    (nvllm.engine.structured_output); the sequence ends once the constraint is complete."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON: no whitespace beyond one space after ':' and ','
    # (the engine's grammar compiler, content_key() when compiled, the constraint compiled by it):
    # nvllm.engine.structured_output
    compiled: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [name for name in CONSTRAINT_KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured outputs take exactly one of json, json_object, regex, choice or grammar"
                             + (f"; got {', '.join(given)}" if given else ""))
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured outputs' json must be a JSON schema (an object or its text), got "
                             f"{type(self.json).__name__}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured outputs' {name} must be a non-empty string")
        if self.choice is not None:
            if isinstance(self.choice, str) or not self.choice or not all(
                    isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured outputs' choice must be a non-empty list of non-empty strings")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        """Which constraint: json, json_object, regex, choice or grammar."""
        return next(name for name in CONSTRAINT_KINDS if getattr(self, name) not in (None, False))

    def content_key(self) -> tuple:
        """What the constraint says, to tell whether a grammar compiled earlier still is its grammar (a field
        changed since, as after ``SamplingParams.clone()``, needs a new one)."""
        import json

        # in the schema's own order, as it is compiled: the grammar writes properties in that order
        schema = self.json if not isinstance(self.json, dict) else json.dumps(self.json, default=str)
        return (schema, self.regex, tuple(self.choice) if self.choice else self.choice, self.grammar,
                self.json_object, self.disable_any_whitespace)


GuidedDecodingParams = StructuredOutputsParams  # vLLM's former name

CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar")  # what StructuredOutputsParams constrains by


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-N log-probabilities of each generated token (plus the chosen one); -1: all
    prompt_logprobs: int | None = None  # same for every prompt token after the first
    skip_special_tokens: bool = True
    # vLLM's field, taken so that code written for it runs: nvllm reads the model's fast tokenizer, whose decoder
    # joins special tokens as it does with either value, as in vLLM's detokenizer for fast tokenizers
    spaces_between_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only, text "" (vLLM's; no stop strings then)
    # vLLM's semantics (nvllm.layers.penalties): presence and frequency count the generated tokens only,
    # repetition_penalty every token of the prompt and the output; logit_bias (token id -> bias) comes first
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's (nvllm.layers.token_masks): draw only these token ids / never complete these words
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: as many as max_model_len allows)
    # vLLM's name for structured_outputs before 0.11 (GuidedDecodingParams, the same fields): taken as it
    guided_decoding: InitVar[StructuredOutputsParams | dict | None] = None

    def __post_init__(self, guided_decoding=None) -> None:
        if guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("give structured_outputs or guided_decoding (its former name), not both")
            self.structured_outputs = guided_decoding
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or [])]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.seed == -1:          # vLLM's spelling of "no seed"
            self.seed = None
        for name in ("logprobs", "prompt_logprobs"):
            if isinstance(getattr(self, name), bool):     # True: the chosen token's and the best one's, as vLLM
                setattr(self, name, 1 if getattr(self, name) else None)
        for name in ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, numbers.Integral) or isinstance(v, bool)):
                raise ValueError(f"{name} must be an integer, got {v!r}")
        if self.seed is not None and not (-2 ** 63 <= self.seed and self.seed + max(self.n, 1) <= 2 ** 64):
            raise ValueError(f"seed must fit in 64 bits (sample i draws from seed + i), got {self.seed}")
        if not all(map(_is_token_id, self.stop_token_ids)):
            raise ValueError(f"stop_token_ids must be non-negative token ids, got {self.stop_token_ids!r}")
        if self.top_k == 0:
            self.top_k = -1
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if not 0.0 <= self.temperature < math.inf:  # NaN too: it passed "< 0" and sampled garbage
            raise ValueError(f"temperature must be a non-negative finite number, got {self.temperature}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:  # vLLM's: scaling by 1/T this small overflows to inf or nan
            logging.getLogger("nvllm").warning("temperature %s is below %s, which overflows the scaled logits; "
                                               "raised to %s (0 is greedy)", self.temperature, MIN_TEMPERATURE,
                                               MIN_TEMPERATURE)
            self.temperature = MIN_TEMPERATURE
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or at least 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        # every stop string is searched after every token, and the longest one holds back streamed text
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LEN for s in self.stop):
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LEN} characters")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (without text there is nothing to search)")
        if len(self.stop_token_ids) > MAX_STOP_STRINGS:
            raise ValueError(f"stop_token_ids takes at most {MAX_STOP_STRINGS} ids")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and v < -1:
                raise ValueError(f"{name} must be non-negative or -1 (the whole vocabulary), got {v}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        if not _F32_TINY <= self.repetition_penalty <= _F32_MAX:  # the penalties run in float32 (or narrower)
            raise ValueError(f"repetition_penalty must be a number greater than 0 within float32's range "
                             f"[{_F32_TINY:.3g}, {_F32_MAX:.3g}], got {self.repetition_penalty}")
        self.logit_bias = _checked_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            ids = list(self.allowed_token_ids)
            if not ids or not all(map(_is_token_id, ids)):
                raise ValueError("allowed_token_ids must be a non-empty list of non-negative token ids")
            self.allowed_token_ids = sorted({int(t) for t in ids})
        if self.bad_words is not None:
            words = [self.bad_words] if isinstance(self.bad_words, str) else list(self.bad_words)
            if not all(isinstance(w, str) and w.strip() for w in words):
                raise ValueError("bad_words must be a list of non-empty strings")
            self.bad_words = words or None
        t = self.truncate_prompt_tokens
        if t is not None and (not isinstance(t, numbers.Integral) or isinstance(t, bool) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens must be at least 1, or -1 (up to max_model_len), got {t!r}")
        if isinstance(self.structured_outputs, dict):
            fields = {n for n, f in StructuredOutputsParams.__dataclass_fields__.items() if f.init}
            unknown = sorted(set(self.structured_outputs) - fields)
            if unknown:
                raise ValueError(f"unknown structured_outputs field {unknown[0]!r}")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")

    def clone(self) -> "SamplingParams":
        """A deep copy (vLLM's), to change one request's settings without touching another's; a constraint's
        compiled grammar (immutable, and not copyable) is shared."""
        import copy

        compiled = getattr(self.structured_outputs, "compiled", None)
        return copy.deepcopy(self, {} if compiled is None else {id(compiled): compiled})

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def penalized(self) -> bool:
        """Presence, frequency or repetition penalty asked for: sampling needs the sequence's tokens."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _is_token_id(t) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0


def _checked_logit_bias(bias) -> dict[int, float] | None:
    """Integer token ids (non-negative; the engine checks them against the vocabulary) to finite biases, each
    clamped to [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]; None when empty."""
    if not bias:
        return None
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id to bias, got {type(bias).__name__}")
    out = {}
    for tok, b in bias.items():
        if not isinstance(tok, numbers.Integral) or isinstance(tok, bool) or tok < 0:
            raise ValueError(f"logit_bias keys must be non-negative integer token ids, got {tok!r}")
        if not isinstance(b, numbers.Real) or isinstance(b, bool) or math.isnan(b):
            raise ValueError(f"logit_bias values must be numbers, got {b!r} for token {tok}")
        out[int(tok)] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, float(b)))
    return out
