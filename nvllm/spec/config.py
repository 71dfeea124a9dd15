"""SpeculativeConfig and its one parser.

Accepted forms (CLI `--speculative`, `LLM(speculative=...)`, `EngineConfig(speculative=...)`):
  "k=4,draft=DIR"            a draft model proposes 4 tokens per step
  "k=3,method=ngram"         prompt lookup: no draft model
  "k=auto,draft=DIR"         k tuned per request from its recent acceptance (1..8)
  '{"draft_model": "DIR", "num_speculative_tokens": 4}'   JSON (also "method", "prompt_lookup_min/max" — one
                                                          given, the other takes its value, as in vLLM —,
                                                          "draft_tensor_parallel_size": 1; null leaves an option
                                                          at its default)
  a dict of the JSON keys, or a SpeculativeConfig.
  "...,disable_by_batch_size=16"   no drafting while 16 or more sequences run (large batches are compute-bound:
                                   verifying k + 1 positions per sequence costs more than it saves)
  "...,synthetic_acceptance=0.7"   BENCHMARK MODE: each drafted token is accepted with this fixed probability,
                                   whatever the models say, so speed can be read against a chosen acceptance
                                   rate; outputs then do NOT follow the target's distribution.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from nvllm.config import ConfigError

MAX_K = 8  # the most tokens one step proposes (k=auto's ceiling, and the largest fixed k accepted)
METHODS = ("draft", "ngram")

# every spelling a key may take → the field it sets
_KEYS = {"k": "num_speculative_tokens", "num_speculative_tokens": "num_speculative_tokens",
         "draft": "draft_model", "draft_model": "draft_model", "model": "draft_model",
         "method": "method",
         "ngram_min": "prompt_lookup_min", "prompt_lookup_min": "prompt_lookup_min",
         "ngram_max": "prompt_lookup_max", "prompt_lookup_max": "prompt_lookup_max",
         "synthetic_acceptance": "synthetic_acceptance", "disable_by_batch_size": "disable_by_batch_size",
         "draft_tensor_parallel_size": "draft_tensor_parallel_size"}


@dataclass
class SpeculativeConfig:
    method: str = "draft"  # draft | ngram
    draft_model: str | None = None
    num_speculative_tokens: int = 4  # k; with auto, the starting k of every request
    auto: bool = False  # k=auto: raise/lower k per request from a moving window of its acceptance
    prompt_lookup_min: int = 1  # ngram: shortest suffix matched
    prompt_lookup_max: int = 3  # ngram: longest suffix matched (tried first)
    synthetic_acceptance: float | None = None  # benchmark mode: fixed per-token acceptance probability
    disable_by_batch_size: int | None = None  # no drafting in a step that starts with this many running sequences

    def __post_init__(self) -> None:
        if self.method == "draft_model":  # vLLM's name for it
            self.method = "draft"
        if self.method not in METHODS:
            raise ConfigError(f"speculative method {self.method!r} is unknown; choose draft or ngram")
        if self.method == "draft" and not self.draft_model:
            raise ConfigError("speculative decoding needs a draft model (draft=DIR) or method=ngram")
        if self.method == "ngram" and self.draft_model:
            raise ConfigError("speculative method ngram takes no draft model; drop draft= or method=ngram")
        if self.method == "draft" and (self.prompt_lookup_min, self.prompt_lookup_max) != (1, 3):
            raise ConfigError("ngram_min / ngram_max (prompt_lookup_min/max) apply to method=ngram, not to a draft "
                              "model; drop them or the draft")
        if not 1 <= self.num_speculative_tokens <= MAX_K:
            raise ConfigError(f"speculative k must be between 1 and {MAX_K} (or auto), "
                              f"got {self.num_speculative_tokens}")
        if self.synthetic_acceptance is not None and not 0.0 <= self.synthetic_acceptance <= 1.0:
            raise ConfigError(f"synthetic_acceptance must be in [0, 1], got {self.synthetic_acceptance}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 2:
            raise ConfigError(f"disable_by_batch_size must be at least 2, got {self.disable_by_batch_size}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("ngram sizes need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                              f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")

    @property
    def max_k(self) -> int:
        """The most tokens one step may draft for a sequence: k, or k=auto's ceiling."""
        return MAX_K if self.auto else self.num_speculative_tokens

    def describe(self) -> str:
        k = f"auto (from {self.num_speculative_tokens}, 1..{MAX_K})" if self.auto else str(self.num_speculative_tokens)
        src = (f"draft model {self.draft_model}" if self.method == "draft"
               else f"n-gram lookup (n {self.prompt_lookup_max}..{self.prompt_lookup_min})")
        mode = ("" if self.synthetic_acceptance is None else
                f", BENCHMARK MODE: synthetic acceptance {self.synthetic_acceptance:g} per token")
        off = ("" if self.disable_by_batch_size is None else
               f", off from {self.disable_by_batch_size} running sequences")
        return f"k={k}, {src}{off}{mode}"


def _int(key: str, value: Any) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ConfigError(f"speculative {key} must be an integer, got {value!r}")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"speculative {key} must be an integer, got {value!r}") from None


def _from_mapping(items: dict[str, Any]) -> SpeculativeConfig:
    fields: dict[str, Any] = {}
    for key, value in items.items():
        name = _KEYS.get(str(key).strip().lower())
        if name is None:
            raise ConfigError(f"unknown speculative option {key!r}; use k, draft, method, ngram_min, ngram_max, "
                              "disable_by_batch_size (JSON: num_speculative_tokens, draft_model, method, "
                              "prompt_lookup_min/max, disable_by_batch_size, draft_tensor_parallel_size)")
        if name in fields:
            raise ConfigError(f"speculative option {key!r} given twice")
        if value is not None:   # JSON null (as config dumps write unset options): the default
            fields[name] = value
    k = fields.get("num_speculative_tokens")
    if isinstance(k, str) and k.strip().lower() == "auto":
        fields["num_speculative_tokens"], fields["auto"] = 4, True
    elif k is not None:
        fields["num_speculative_tokens"] = _int("k", k)
    for name in ("prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size", "draft_tensor_parallel_size"):
        if name in fields and fields[name] is not None:
            fields[name] = _int(name, fields[name])
    if fields.pop("draft_tensor_parallel_size", 1) != 1:   # vLLM's examples pass 1: what nvllm always does
        raise ConfigError("speculative draft_tensor_parallel_size: the draft runs whole on one GPU (1)")
    # one n-gram size given: the other takes its value, as vLLM reads them (neither: 1..3)
    for given, other in (("prompt_lookup_min", "prompt_lookup_max"), ("prompt_lookup_max", "prompt_lookup_min")):
        if given in fields and other not in fields:
            fields[other] = fields[given]
    if "method" in fields:
        fields["method"] = str(fields["method"]).strip().lower()
    elif not fields.get("draft_model") and "prompt_lookup_max" in fields:
        fields["method"] = "ngram"
    if fields.get("draft_model") is not None:
        fields["draft_model"] = str(fields["draft_model"])
    if fields.get("synthetic_acceptance") is not None:
        try:
            fields["synthetic_acceptance"] = float(fields["synthetic_acceptance"])
        except (TypeError, ValueError):
            raise ConfigError("synthetic_acceptance must be a number, got "
                              f"{fields['synthetic_acceptance']!r}") from None
    return SpeculativeConfig(**fields)


def parse_speculative(value: Any) -> SpeculativeConfig | None:
    """Any accepted form → SpeculativeConfig (None/"" → None); ConfigError with one clear line otherwise."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, dict):
        return _from_mapping(value)
    if not isinstance(value, str):
        raise ConfigError(f"speculative must be a string like 'k=4,draft=DIR' or a dict, got {type(value).__name__}")
    text = value.strip()
    if not text:
        return None
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"speculative JSON is malformed: {e}") from None
        if not isinstance(obj, dict):
            raise ConfigError("speculative JSON must be an object")
        return _from_mapping(obj)
    items: dict[str, str] = {}
    for part in text.split(","):
        key, sep, val = part.partition("=")
        if not sep or not key.strip() or not val.strip():
            raise ConfigError(f"speculative option {part.strip()!r} is not key=value; "
                              "expected e.g. 'k=4,draft=DIR' or 'k=3,method=ngram'")
        if key.strip() in items:
            raise ConfigError(f"speculative option {key.strip()!r} given twice")
        items[key.strip()] = val.strip()
    return _from_mapping(items)
