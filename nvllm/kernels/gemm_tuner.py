"""Measuring the small-batch GEMM dispatch: candidate Triton configs per shape, each timed against cuBLAS inside
a CUDA graph with the weight rotated past L2, the winner written into the dispatch table (gemm_table.py).

`tune_gemm` is what the engine calls (NVLLM_TUNE_GEMM=1) and scripts/gpu_gemm_bench.py drives; shipped tables
(nvllm/kernels/configs/) come from that script."""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from nvllm.config import first_line
from nvllm.kernels.backend import use_triton
from nvllm.kernels.gemm import _geometry, skinny_gemm
from nvllm.kernels.gemm_table import (CUBLAS, FMA_MAX_M, SkinnyConfig, _cdiv, _dtype_name, _next_pow2, gemm_bucket,
                                      set_gemm_choice)

# ---------------------------------------------------------------------------------------------- candidates

# (block_n, block_k, num_warps, num_stages) — fma: M ≤ 4, CUDA cores; stages 1 = plain loads, latency hidden
# by many resident programs; stages > 1 = the K loop pipelined through shared memory (cp.async)
FMA_TILES: tuple[tuple[int, int, int, int], ...] = (
    (4, 512, 4, 1),
    (8, 512, 4, 1),
    (4, 512, 4, 4),
    (8, 512, 4, 4),
    (8, 256, 2, 4),
    (16, 256, 4, 4),
    (16, 512, 4, 3),
    (32, 256, 8, 3),
)
# mma: any M (x padded to 16 rows), tensor cores, W tiles pipelined through shared memory
# (shared memory per program ≈ stages · (BLOCK_N + 16) · BLOCK_K · 2 bytes, at most 120 KiB here)
MMA_TILES: tuple[tuple[int, int, int, int], ...] = (
    (16, 256, 4, 6),
    (16, 512, 4, 4),
    (32, 128, 4, 6),
    (32, 256, 4, 4),
    (64, 128, 4, 4),
    (64, 256, 4, 3),
    (128, 128, 8, 3),
)


def split_choices(tiles: int, k_blocks: int, num_sms: int) -> list[int]:
    """K splits worth timing for ``tiles`` output tiles: 1, then doublings while the previous count left
    fewer than four programs per SM, keeping at least two K blocks per split."""
    out = [1]
    s = 2
    while s <= 32 and s <= k_blocks // 2 and tiles * (s // 2) < 4 * num_sms:
        out.append(s)
        s *= 2
    return out


def candidate_configs(n: int, k: int, m: int, num_sms: int,
                      fma_tiles: Iterable = FMA_TILES, mma_tiles: Iterable = MMA_TILES) -> list[SkinnyConfig]:
    """The configs the tuner times for weight [n, k] and m rows."""
    out = []
    variants = ([("fma", t) for t in fma_tiles] if m <= FMA_MAX_M else []) + [("mma", t) for t in mma_tiles]
    for kernel, (bn, bk, warps, stages) in variants:
        probe = SkinnyConfig(kernel, bn, bk, 1, warps, stages)
        bm, bk_eff, k_blocks, _, _, n_tiles, m_tiles = _geometry(m, n, k, probe)
        if bn > 2 * _next_pow2(n) or (bk > bk_eff and bk > 16):
            continue  # tile far larger than the problem
        for s in split_choices(n_tiles * m_tiles, k_blocks, num_sms):
            out.append(SkinnyConfig(kernel, bn, bk, s, warps, stages))
    return out


# --------------------------------------------------------------------------------------------------- tuner

Timer = Callable[[Callable[[int], object], int, float, object], float]
"""timer(call, n_copies, estimate_s, choice) → seconds per call; ``call(i)`` runs one GEMM on weight copy i;
``choice`` is what is timed (CUBLAS or a SkinnyConfig), for timers that log or fake."""


def cuda_graph_timer(call: Callable[[int], object], n_copies: int, estimate_s: float, choice: object = None,
                     target_s: float = 3e-4, reps: int = 9) -> float:
    """Seconds per call: ``iters`` calls cycling over the weight copies, captured in one CUDA graph (no
    launch overhead, as in decode), replayed ``reps`` times; the median replay divided by ``iters``. Falls
    back to an eager loop timed with events if capture fails."""
    iters = n_copies * max(1, math.ceil(target_s / max(estimate_s, 1e-7) / n_copies))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream: compiles, allocates
        for i in range(n_copies):
            call(i)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(iters):
                call(i % n_copies)
        graph.replay()
        torch.cuda.synchronize()
        for _ in range(reps):
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3 / iters)
        del graph
    except Exception:  # capture unsupported here: time eagerly (includes launch gaps)
        torch.cuda.synchronize()
        for _ in range(reps):
            start.record()
            for i in range(iters):
                call(i % n_copies)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3 / iters)
    return statistics.median(times)


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.float()
    return float((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


class GemmTuner:
    """Times cuBLAS and the candidate skinny configs per (N, K, M-bucket, dtype) and fills the dispatch
    table with the faster. Weights are rotated over enough copies that they do not fit in L2.

    ``timer``: see ``Timer`` (default ``cuda_graph_timer``); ``margin``: Triton must beat cuBLAS by this
    fraction to be chosen; ``max_err``: candidates whose relative error against F.linear exceeds it are
    dropped (default 1e-2 for 16-bit, 1e-4 for fp32); ``budget_s``: stop timing new candidates after this
    long (untimed shapes keep cuBLAS); ``rotate_bytes``: total bytes of weight copies (default 4× L2, at
    least 256 MiB); ``log``: a print-like callable for progress."""

    def __init__(self, timer: Timer | None = None, margin: float = 0.03, max_err: float | None = None,
                 budget_s: float | None = None, rotate_bytes: int | None = None,
                 fma_tiles: Iterable = FMA_TILES, mma_tiles: Iterable = MMA_TILES, log=None):
        self.timer = timer or cuda_graph_timer
        self.margin = margin
        self.max_err = max_err
        self.budget_s = budget_s
        self.rotate_bytes = rotate_bytes
        self.fma_tiles = tuple(fma_tiles)
        self.mma_tiles = tuple(mma_tiles)
        self.log = log or (lambda *a, **k: None)
        self.results: list[dict] = []

    def _copies(self, w_bytes: int, device: torch.device) -> int:
        rotate = self.rotate_bytes
        if rotate is None:
            l2 = 64 << 20
            if device.type == "cuda":
                l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", l2) or l2
            rotate = max(4 * l2, 256 << 20)
        return max(2, min(64, _cdiv(rotate, max(1, w_bytes))))

    def tune(self, shapes: Iterable[tuple[int, int]], batch_sizes: Iterable[int], dtype: torch.dtype,
             device: torch.device | str) -> list[dict]:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" \
            else 132
        buckets = sorted({gemm_bucket(b) for b in batch_sizes if gemm_bucket(b) is not None})
        max_err = self.max_err if self.max_err is not None else (1e-4 if dtype == torch.float32 else 1e-2)
        t0 = time.perf_counter()
        gen = torch.Generator(device=device).manual_seed(0)
        for n, k in dict.fromkeys((int(s[0]), int(s[1])) for s in shapes):
            w_bytes = n * k * torch.finfo(dtype).bits // 8
            n_copies = self._copies(w_bytes, device)
            weights = [torch.randn((n, k), generator=gen, device=device, dtype=torch.float32).to(dtype) * 0.05
                       for _ in range(n_copies)]
            for m in buckets:
                self.results.append(self._tune_one(n, k, m, dtype, device, weights, num_sms, max_err, t0))
            del weights
            if device.type == "cuda":
                torch.cuda.empty_cache()
        return self.results

    def _tune_one(self, n, k, m, dtype, device, weights, num_sms, max_err, t0) -> dict:
        el = torch.finfo(dtype).bits // 8
        nbytes = (n * k + m * k + m * n) * el
        estimate = nbytes / 3e12
        x = torch.randn((m, k), device=device, dtype=torch.float32).to(dtype)
        ref = F.linear(x, weights[0])
        rec = {"n": n, "k": k, "m": m, "dtype": _dtype_name(dtype), "bytes": nbytes, "copies": len(weights),
               "candidates": []}
        rec["cublas_s"] = self.timer(lambda i: F.linear(x, weights[i]), len(weights), estimate, CUBLAS)
        best, best_t = None, math.inf
        for cfg in candidate_configs(n, k, m, num_sms, self.fma_tiles, self.mma_tiles):
            if self.budget_s is not None and time.perf_counter() - t0 > self.budget_s:
                rec["budget_exhausted"] = True
                break
            cand = {"config": cfg.to_dict()}
            try:
                err = _rel_err(skinny_gemm(x, weights[0], None, cfg), ref)
                cand["rel_err"] = err
                if not err <= max_err:  # also catches NaN
                    cand["error"] = f"relative error {err:.3g} > {max_err:g}"
                else:
                    t = self.timer(lambda i, cfg=cfg: skinny_gemm(x, weights[i], None, cfg), len(weights),
                                   estimate, cfg)
                    cand["time_s"] = t
                    if t < best_t:
                        best, best_t = cfg, t
            except Exception as e:  # a config this device cannot run (shared memory, registers, ...)
                cand["error"] = f"{type(e).__name__}: {first_line(e)[:200]}"
            rec["candidates"].append(cand)
        choose_triton = best is not None and best_t < rec["cublas_s"] * (1 - self.margin)
        choice = best if choose_triton else CUBLAS
        set_gemm_choice(n, k, m, dtype, choice)
        rec.update(best_config=best.to_dict() if best else None, best_triton_s=best_t if best else None,
                   choice=choice.describe() if choose_triton else CUBLAS)
        self.log(f"gemm tune N={n} K={k} M={m}: cuBLAS {rec['cublas_s'] * 1e6:.1f} us, best Triton "
                 f"{best_t * 1e6:.1f} us -> {rec['choice']}" if best else
                 f"gemm tune N={n} K={k} M={m}: cuBLAS {rec['cublas_s'] * 1e6:.1f} us, no Triton candidate")
        return rec


def tune_gemm(shapes: list[tuple[int, int]], batch_sizes: list[int], dtype: torch.dtype,
              device: torch.device | str, **tuner_kwargs) -> list[dict]:
    """Measure cuBLAS against the skinny kernel for every weight shape ``(N, K)`` and every M-bucket of
    ``batch_sizes`` (those ≤ MAX_TUNED_M) and fill the dispatch table ``gemm()`` reads. Call once at engine
    start, after the weights are loaded and before CUDA graphs are captured. Does nothing (returns []) unless
    ``device`` is a CUDA device with Triton enabled for it. Returns the measurements (one dict per shape and
    bucket). ``tuner_kwargs`` go to ``GemmTuner``."""
    device = torch.device(device)
    if device.type != "cuda" or not use_triton(torch.empty(0, device=device)):
        return []
    return GemmTuner(**tuner_kwargs).tune(shapes, batch_sizes, dtype, device)
