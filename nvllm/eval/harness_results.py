"""lm-eval's results dict (``simple_evaluate(..., log_samples=True)``) as `nvllm eval` keeps a task: its metrics and
standard errors, its subtasks, the per-sample values the regression gate pairs, and a digest of the samples seen."""

from __future__ import annotations

import hashlib
import json


def _num(v):
    try:
        return float(v)
    except (TypeError, ValueError):
        return None  # lm-eval writes "N/A" where no standard error exists


def _metrics(res: dict) -> tuple[dict, dict]:
    metrics, stderr = {}, {}
    for key, v in res.items():
        if "," not in key:
            continue
        metric, filt = key.split(",", 1)
        if metric.endswith("_stderr"):
            stderr[f"{metric[:-len('_stderr')]},{filt}"] = _num(v)
        else:
            metrics[key] = _num(v)
    return metrics, stderr


def _leaves(r: dict, name: str) -> list[str]:
    subs = r.get("group_subtasks", {}).get(name) or []
    return [leaf for s in subs for leaf in _leaves(r, s)] if subs else [name]


def digest(pairs) -> str:
    return hashlib.sha256(json.dumps(sorted(pairs)).encode()).hexdigest()


def harness_entry(r: dict, name: str) -> tuple[dict, dict, str]:
    """(task entry, per-sample metric values {metric: {sample id: value}}, digest of the samples seen)."""
    res = r["results"].get(name) or r.get("groups", {}).get(name) or {}
    metrics, stderr = _metrics(res)
    leaves = _leaves(r, name)
    hib_all = r.get("higher_is_better", {})
    hib = {k: bool(hib_all.get(leaves[0], {}).get(k.split(",")[0], True)) for k in metrics}
    n = res.get("sample_len") or sum(r.get("n-samples", {}).get(x, {}).get("effective", 0) for x in leaves)
    entry = {"metrics": metrics, "stderr": stderr, "higher_is_better": hib, "n_samples": int(n),
             "num_fewshot": r.get("n-shot", {}).get(leaves[0])}
    tree = set(_tree(r, name))
    subs = [k for k in r["results"] if k in tree]
    if subs:
        entry["subtasks"] = {}
        for k in subs:
            m, se = _metrics(r["results"][k])
            entry["subtasks"][k] = {"metrics": m, "stderr": se, "n_samples": r["results"][k].get("sample_len")}
    samples: dict[str, dict[str, float]] = {}
    seen = []
    for leaf in leaves:
        for s in r.get("samples", {}).get(leaf, []):
            sid = f"{leaf}/{s['doc_id']}"
            seen.append((sid, s.get("doc_hash", ""), s.get("prompt_hash", "")))
            for m in s.get("metrics", []):
                if isinstance(s.get(m), (int, float)):
                    samples.setdefault(f"{m},{s['filter']}", {})[sid] = float(s[m])
    return entry, samples, digest(list(set(seen)))


def _tree(r: dict, name: str) -> list[str]:
    subs = r.get("group_subtasks", {}).get(name) or []
    return [x for s in subs for x in (s, *_tree(r, s))]
