"""The regression gate: a candidate (e.g. a quantized model) against its baseline on identical samples.

Both models see the same documents, few-shot examples and prompts (checked sample by sample through
lm-eval's document and prompt hashes), so the difference of each task's metric is a paired difference: its
standard error comes from the per-sample differences, much tighter than the two standard errors combined.

A task fails when a gated metric drops by more than `max_drop` points (accuracy in percentage points,
perplexity in its own units) or by more than `max_drop_rel` percent of the baseline's value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nvllm.config import ConfigError


@dataclass
class Row:
    task: str
    metric: str
    n: int
    baseline: float
    candidate: float
    baseline_se: float | None
    candidate_se: float | None
    delta: float  # candidate - baseline, in points (x100 for accuracy-like metrics)
    delta_se: float | None
    drop: float  # how much worse the candidate is, in points (negative: better)
    drop_rel: float  # drop as a percentage of the baseline
    higher_is_better: bool
    failed: bool

    def to_dict(self) -> dict:  # JSON has no infinity: a drop from a zero baseline is written as null
        return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in self.__dict__.items()}


def check_same_tokenizer(baseline_dir: str, candidate_dir: str, chat_template: bool = False) -> None:
    """Refuse to compare models whose tokenizers differ (with ``chat_template``, their chat templates too): their
    samples would not be the same token sequences."""
    from nvllm.engine.tokenizer import load_tokenizer

    a, b = load_tokenizer(baseline_dir), load_tokenizer(candidate_dir)
    probe = "Question: 12 + 30 = ?\nAnswer: 42 ✓ déjà vu"
    why = ("vocabularies" if a.get_vocab() != b.get_vocab() else
           "special tokens" if (a.bos_token_id, a.eos_token_id) != (b.bos_token_id, b.eos_token_id) else
           "encodings" if a.encode(probe) != b.encode(probe) else
           "chat templates" if chat_template and a.chat_template != b.chat_template else None)
    if why:
        raise ConfigError(f"baseline {baseline_dir} and candidate {candidate_dir} use different tokenizers "
                          f"({why} differ); a regression gate needs identical tokenization")


def gated_metrics(task: dict) -> list[str]:
    """Accuracy-like tasks: every reported metric; perplexity: token perplexity (the others follow from it)."""
    metrics = task["metrics"]
    return ["token_perplexity"] if "token_perplexity" in metrics else list(metrics)


def _scale(higher_is_better: bool) -> float:
    return 100.0 if higher_is_better else 1.0


def _paired_se(base: dict, cand: dict, name: str, key: str) -> float | None:
    b, c = base.get("samples", {}).get(name, {}).get(key), cand.get("samples", {}).get(name, {}).get(key)
    if not b or not c:
        return None
    if b.keys() != c.keys():
        raise ConfigError(f"{name}: baseline and candidate were not evaluated on the same samples")
    d = [c[k] - b[k] for k in b]
    if len(d) < 2:
        return None
    mean = sum(d) / len(d)
    return math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1) / len(d))


def check_same_samples(base: dict, cand: dict) -> None:
    for name in base["tasks"]:
        hb, hc = base.get("hashes", {}).get(name), cand.get("hashes", {}).get(name)
        if hb is not None and hc is not None and hb != hc:
            raise ConfigError(f"{name}: baseline and candidate were not evaluated on the same samples")


def check_thresholds(max_drop: float | None, max_drop_rel: float | None) -> None:
    """The gate's limits must be finite and not negative (NaN would pass everything, a negative one nothing)."""
    for flag, value in (("--max-drop", max_drop), ("--max-drop-rel", max_drop_rel)):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{flag} must be a finite number of at least 0, got {value}")


def compare(base: dict, cand: dict, max_drop: float | None, max_drop_rel: float | None) -> list[Row]:
    """One row per gated metric of every task both results hold. A drop that is not a number (a NaN or infinite
    score) fails the gate: a broken model must not pass as unchanged."""
    check_same_samples(base, cand)
    rows = []
    for name, bt in base["tasks"].items():
        ct = cand["tasks"].get(name)
        if ct is None:
            continue
        for key in gated_metrics(bt):
            if key not in ct["metrics"]:
                continue
            hib = bt.get("higher_is_better", {}).get(key, True)
            s = _scale(hib)
            b, c = bt["metrics"][key], ct["metrics"][key]
            bse, cse = bt.get("stderr", {}).get(key), ct.get("stderr", {}).get(key)
            dse = _paired_se(base, cand, name, key)
            if dse is None and bse is not None and cse is not None:
                dse = math.hypot(bse, cse)
            drop = (b - c) * s if hib else (c - b) * s
            rel = 100.0 * drop / abs(b * s) if b else (math.inf if drop > 0 else 0.0)
            failed = (not math.isfinite(drop) or (max_drop is not None and _over(drop, max_drop)) or
                      (max_drop_rel is not None and _over(rel, max_drop_rel)))
            rows.append(Row(name, key, bt.get("n_samples", 0), b * s, c * s,
                            None if bse is None else bse * s, None if cse is None else cse * s,
                            (c - b) * s, None if dse is None else dse * s, drop, rel, hib, failed))
    return rows


def _over(drop: float, limit: float) -> bool:
    """drop > limit, where a drop equal to the limit up to rounding (25 − 24 points computed as 1.0000000000000009
    from 0.25 − 0.24) is within it."""
    return drop > limit and not math.isclose(drop, limit, rel_tol=1e-9, abs_tol=1e-9)


def _pm(value: float, se: float | None, signed: bool = False) -> str:
    v = f"{value:+.2f}" if signed else f"{value:.2f}"
    return v if se is None else f"{v} ± {se:.2f}"


def gate_table(rows: list[Row], max_drop: float | None, max_drop_rel: float | None):
    from rich.table import Table

    limits = [f"max drop {max_drop:g} points" if max_drop is not None else "",
              f"max drop {max_drop_rel:g}%" if max_drop_rel is not None else ""]
    table = Table(title="regression gate: " + ", ".join(x for x in limits if x),
                  caption="accuracy in points (x100); perplexity in its own units; Δ ± paired standard error")
    relative = max_drop_rel is not None  # the drop the relative limit judges, beside the one in points
    for col, just in (("task", "left"), ("metric", "left"), ("n", "right"), ("baseline", "right"),
                      ("candidate", "right"), ("Δ", "right"), *((("drop %", "right"),) if relative else ()),
                      ("result", "left")):
        table.add_column(col, justify=just)
    for r in rows:
        verdict = "[bold red]FAIL[/]" if r.failed else "[green]ok[/]"
        rel = (("n/a" if r.drop_rel is None or not math.isfinite(r.drop_rel) else f"{r.drop_rel:.2f}"),) \
            if relative else ()
        table.add_row(r.task, r.metric, str(r.n), _pm(r.baseline, r.baseline_se), _pm(r.candidate, r.candidate_se),
                      _pm(r.delta, r.delta_se, signed=True), *rel, verdict)
    return table
