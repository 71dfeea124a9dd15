"""The small-batch GEMM dispatch table: which implementation ``nvllm.kernels.gemm.gemm`` runs per shape.

Keys ``(N, K, M-bucket, dtype)`` (M-bucket: the next power of two of the row count, up to ``MAX_TUNED_M``);
values a ``SkinnyConfig`` (the Triton skinny kernel with that launch configuration) or ``CUBLAS`` (F.linear).
Filled by measurement (``gemm_tuner.tune_gemm``, ``scripts/gpu_gemm_bench.py``), by hand (``set_gemm_choice``)
or from a saved JSON (``load_gemm_table``; the shipped tables live in ``configs/``, one per GPU model).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

import torch

from nvllm import output_file

CUBLAS = "cublas"
"""Table value meaning "run F.linear" (cuBLAS measured faster)."""

MAX_TUNED_M = 64
"""Largest M the table is consulted for; larger M always runs F.linear."""

FMA_MAX_M = 4
"""The ``fma`` variant unrolls at most this many rows of x per program."""

def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()



@dataclass(frozen=True)
class SkinnyConfig:
    """One launch configuration of the skinny kernel. ``kernel``: "fma" (CUDA cores, M ≤ 4) or "mma"
    (tensor cores, swap-AB). ``split_k``: requested K splits (the launcher trims splits that would be empty)."""

    kernel: str
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 1

    def __post_init__(self):
        if self.kernel not in ("fma", "mma"):
            raise ValueError(f"unknown skinny kernel {self.kernel!r} (fma or mma)")
        for name in ("block_n", "block_k"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two, got {v}")
        if self.kernel == "mma" and (self.block_n < 16 or self.block_k < 16):
            raise ValueError("mma tiles need block_n and block_k >= 16")
        if self.split_k < 1 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"bad skinny config {self}")

    def block_m(self, m: int) -> int:
        if self.kernel == "fma":
            return min(FMA_MAX_M, _next_pow2(m))
        return min(64, max(16, _next_pow2(m)))

    def describe(self) -> str:
        return (f"triton skinny (BLOCK_N={self.block_n} BLOCK_K={self.block_k} SPLIT_K={self.split_k} "
                f"{self.kernel} warps={self.num_warps} stages={self.num_stages})")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SkinnyConfig":
        return cls(**d)


_BUCKETS = [0] + [_next_pow2(m) for m in range(1, MAX_TUNED_M + 1)]
_TABLE: dict[tuple[int, int, int, torch.dtype], SkinnyConfig | str] = {}


def gemm_bucket(m: int) -> int | None:
    """The table's M bucket for a batch of m rows (next power of two), None past MAX_TUNED_M."""
    return _BUCKETS[m] if 0 < m <= MAX_TUNED_M else None


def set_gemm_choice(n: int, k: int, m: int, dtype: torch.dtype, choice: SkinnyConfig | str) -> None:
    """Route GEMMs with weight [n, k], ``m`` rows (its bucket) and ``dtype`` to ``choice`` (a SkinnyConfig
    or CUBLAS)."""
    if not (isinstance(choice, SkinnyConfig) or choice == CUBLAS):
        raise ValueError(f"a gemm choice is a SkinnyConfig or {CUBLAS!r}, got {choice!r}")
    bucket = gemm_bucket(m)
    if bucket is None:
        raise ValueError(f"m={m} is past MAX_TUNED_M={MAX_TUNED_M}: such GEMMs always run F.linear")
    _TABLE[(int(n), int(k), bucket, dtype)] = choice


def gemm_choice(n: int, k: int, m: int, dtype: torch.dtype) -> SkinnyConfig | str:
    """What ``gemm`` runs for this shape on a Triton-enabled device: a SkinnyConfig or CUBLAS."""
    bucket = gemm_bucket(m)
    return _TABLE.get((n, k, bucket, dtype), CUBLAS) if bucket is not None else CUBLAS


def gemm_table() -> dict[tuple[int, int, int, torch.dtype], SkinnyConfig | str]:
    """The live dispatch table {(N, K, M-bucket, dtype): SkinnyConfig | "cublas"}."""
    return _TABLE


def clear_gemm_table() -> None:
    _TABLE.clear()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _entries() -> list[dict]:
    return [{"n": n, "k": k, "m": m, "dtype": _dtype_name(dt),
             "choice": c.to_dict() if isinstance(c, SkinnyConfig) else c}
            for (n, k, m, dt), c in sorted(_TABLE.items(), key=lambda kv: (kv[0][:3], str(kv[0][3])))]


def _write_json(path: str, data: dict) -> None:
    """Whole or not at all (``output_file.write_text``: a temporary file renamed into place)."""
    output_file.write_text(path, json.dumps(data, indent=1))


def save_gemm_table(path: str, meta: dict | None = None) -> None:
    """Write the table as JSON."""
    _write_json(path, {"meta": meta or {}, "entries": _entries()})


def merge_gemm_table(path: str, label: str, meta: dict) -> int:
    """Add the live table to the table file ``path`` (created if missing), ``meta`` under ``label``: one file a GPU
    model holds the runs of several models' shapes, as the shipped ones do; an entry of the same (N, K, M, dtype) is
    replaced. A file whose runs name another device is refused (ValueError). Returns the entries the file holds."""
    data = {"meta": {}, "entries": []}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    devices = {m.get("device") for m in data["meta"].values()}
    if devices - {meta.get("device")}:
        raise ValueError(f"{path} holds tables of {sorted(map(str, devices))}, not of {meta.get('device')!r}: "
                         "a table file is for one GPU model")
    entries = {(e["n"], e["k"], e["m"], e["dtype"]): e for e in data["entries"]}
    entries.update({(e["n"], e["k"], e["m"], e["dtype"]): e for e in _entries()})
    data["meta"][label] = meta
    data["entries"] = [entries[key] for key in sorted(entries)]
    _write_json(path, data)
    return len(entries)


def gemm_table_path(device_name: str) -> str:
    """Where the measured table for a GPU model is shipped: nvllm/kernels/configs/gemm_<device name>.json."""
    slug = "".join(c if c.isalnum() else "_" for c in device_name)
    return os.path.join(os.path.dirname(__file__), "configs", f"gemm_{slug}.json")


def load_gemm_table(path: str) -> int:
    """Merge a table saved by ``save_gemm_table`` (scripts/gpu_gemm_bench.py writes one, gemm_table.json, and
    the same entries as ``table_entries`` in gemm_bench.json); returns the number of entries read."""
    with open(path) as f:
        data = json.load(f)
    entries = data.get("entries") or data.get("table_entries") or []
    for e in entries:
        choice = e["choice"]
        choice = SkinnyConfig.from_dict(choice) if isinstance(choice, dict) else choice
        set_gemm_choice(e["n"], e["k"], e["m"], getattr(torch, e["dtype"]), choice)
    return len(entries)
