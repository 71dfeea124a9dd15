"""Dense GEMM for the linear layers: ``y = x Wᵀ (+ b)``, W ``[N, K]`` (nn.Linear layout), x ``[..., K]``.

Two implementations, chosen per shape by measurement:

* ``torch F.linear`` — cuBLAS on the GPU, the CPU kernel on the host. Always the default.
* a Triton **skinny GEMM** for small M (decode: M = batch size), written for memory bandwidth. cuBLAS leaves
  bandwidth unused on the small projections at batch 1 (on the H200: qkv 3584→4608 at 67%, o_proj
  3584→3584 at 52%), because a 25-33 MB weight is too few tiles for its kernels to fill 132 SMs.

The skinny kernel
-----------------
Each program owns ``BLOCK_N`` output columns, i.e. ``BLOCK_N`` rows of W, and streams them once along K in
``[BLOCK_N, BLOCK_K]`` tiles; W is row-major ``[N, K]``, so every tile row is ``BLOCK_K`` contiguous elements
(16-byte vector loads, coalesced) and W tiles are loaded with ``evict_first`` (streamed, so they do not push
x out of L2). All M rows of x are reused from registers / L1 against each W tile; accumulation is fp32. Two
inner loops (constexpr ``USE_DOT``), both measured:

  ``fma``  M ≤ 4: W tile × each x row on the CUDA cores (up to 4 unrolled rows). When the accumulators fit
           (``BLOCK_M·BLOCK_N·BLOCK_K`` ≤ 32 fp32 per thread) the products accumulate in a full
           ``[BLOCK_N, BLOCK_K]`` fp32 tile and are reduced along K once after the loop (no shuffles in the
           loop); otherwise each iteration reduces along K. ``num_stages`` > 1 software-pipelines the K loop
           (cp.async through shared memory); 1 leaves latency hiding to the many resident programs.
  ``mma``  any M: "swap AB" — ``tl.dot(W tile [BLOCK_N, BLOCK_K], xᵀ tile [BLOCK_K, BLOCK_M])`` on the tensor
           cores (W takes the large MMA dimension, x is padded to 16 rows: free, the kernel is bound by
           bytes), with ``num_stages`` software pipelining of the W loads (cp.async into shared memory).

Out-of-range W rows are clamped to the last row (loaded, computed, never stored), so the W loads carry no
mask when ``K % BLOCK_K == 0`` (constexpr ``EVEN_K``); only a ragged K tail is masked.

Split-K (for shapes with few output tiles, e.g. o_proj N=3584, so all SMs get work): grid axis 1 splits K into
``SPLIT_K`` contiguous ranges of whole K blocks. Reduction is **deterministic and inside the one launch**:
every program writes its fp32 partial ``[BLOCK_M, BLOCK_N]`` to a workspace, then bumps the tile's arrival
counter (``atomic_add``, acq_rel, gpu scope, after a CTA barrier); the program that arrives last sums the
partials in split order 0..S-1 — so the result never depends on arrival order —, adds the bias, writes y
and re-arms the counter to 0 for the next launch. Rejected alternatives: fp32 ``atomic_add`` into y needs a
zeroed fp32 buffer (a memset launch) and a cast launch, and rounds in arrival order (non-deterministic); a
second reduce kernel costs one more launch (≈1-2 µs inside a CUDA graph, 15-30% of a 6 µs o_proj). The
workspace and counters are allocated once per (device, shape, split) — outside CUDA-graph capture, so a
captured graph keeps valid pointers — and shared by same-shape calls, which is safe because launches on one
stream are ordered (two streams running the same shape at once would need separate workspaces).

SiLU·mul epilogue (``SILU_B``): for a gate_up weight whose rows the engine interleaved in blocks of B = 4
(``activation.interleave_rows``: 4 gate rows, then the 4 up rows of the same outputs), a tile of BLOCK_N rows
holds both halves of BLOCK_N / 2 outputs, so the kernel stores ``SiLU(gate) · up`` itself — one launch fewer
per layer at decode (``gemm_silu_and_mul``). Larger batches (cuBLAS) run ``silu_and_mul(…, interleave=4)``.

Dispatch
--------
``gemm()`` looks ``(N, K, M-bucket, dtype)`` up in a table (one dict lookup; M-bucket = next power of two,
up to ``MAX_TUNED_M``): a ``SkinnyConfig`` runs the Triton kernel, anything else (``"cublas"``, untuned,
M too large, CPU under the default backend, ``NVLLM_KERNELS=torch``) runs ``F.linear``. The table is filled
on the GPU by ``tune_gemm(shapes, batch_sizes, dtype, device)`` — cuBLAS and every candidate config timed
inside a CUDA graph over several copies of the weight (so L2 holds none of them), candidates checked
against F.linear first — or by hand (``set_gemm_choice``), or from a saved JSON (``load_gemm_table``).
The kernel report names what ran: ``gemm: triton skinny (BLOCK_N=.. ...)`` or ``gemm: torch F.linear (cuBLAS)``.

This file holds the op's parts: the torch reference, the Triton kernel, its launcher and the dispatch; the
table itself and ``SkinnyConfig`` are in gemm_table.py (gemm_tuner.py fills it by measurement). Triton is
imported lazily (the package imports without it).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from nvllm.kernels import pdl, report
from nvllm.kernels.activation import silu_and_mul, silu_and_mul_reference
from nvllm.kernels.backend import interpreting, use_triton
from nvllm.kernels.gemm_table import (  # noqa: F401 - the table's API, re-exported beside gemm
    _BUCKETS, _TABLE, CUBLAS, FMA_MAX_M, MAX_TUNED_M, SkinnyConfig, _cdiv, _next_pow2, clear_gemm_table, gemm_bucket,
    gemm_choice, gemm_table, gemm_table_path, load_gemm_table, merge_gemm_table, save_gemm_table, set_gemm_choice)
from nvllm.kernels.jit import lazy_jit

__all__ = ["gemm", "gemm_reference", "gemm_silu_and_mul", "skinny_gemm", "CUBLAS", "FMA_MAX_M", "MAX_TUNED_M",
           "SkinnyConfig", "clear_gemm_table", "gemm_bucket", "gemm_choice", "gemm_table", "gemm_table_path",
           "load_gemm_table", "save_gemm_table", "set_gemm_choice"]

tl = None  # triton.language, bound by lazy_jit at the first launch

_DEFER_MAX_PER_THREAD = 32  # fma: accumulate full tiles when ≤ this many fp32 accumulators per thread


_jit = lazy_jit


# ---------------------------------------------------------------------------------------------- reference


def gemm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


# ------------------------------------------------------------------------------------------------- Triton


def _fma_row(w, x_row, offs_k, stride_xk, K, acc, ACC_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The ``fma`` loop body for one x row: the fp32 W tile ``[BLOCK_N, BLOCK_K]`` times the row's K range
    ``offs_k``, added into its ``[BLOCK_N, ACC_K]`` accumulator."""
    if EVEN_K:
        xr = tl.load(x_row + offs_k * stride_xk, eviction_policy="evict_last").to(tl.float32)
    else:
        xr = tl.load(x_row + offs_k * stride_xk, mask=offs_k < K, other=0.0,
                     eviction_policy="evict_last").to(tl.float32)
    p = w * xr[None, :]
    if ACC_K == 1:
        p = tl.reduce(p, 1, tl.standard._sum_combine, keep_dims=True)
    return acc + p


def _fma_rows(w, x_r0, x_r1, x_r2, x_r3, offs_k, stride_xk, K, a0, a1, a2, a3,
              BLOCK_M: tl.constexpr, ACC_K: tl.constexpr, EVEN_K: tl.constexpr):
    """``_fma_row`` for each of the tile's (up to four) x rows."""
    a0 = _fma_row(w, x_r0, offs_k, stride_xk, K, a0, ACC_K, EVEN_K)
    if BLOCK_M > 1:
        a1 = _fma_row(w, x_r1, offs_k, stride_xk, K, a1, ACC_K, EVEN_K)
    if BLOCK_M > 2:
        a2 = _fma_row(w, x_r2, offs_k, stride_xk, K, a2, ACC_K, EVEN_K)
        a3 = _fma_row(w, x_r3, offs_k, stride_xk, K, a3, ACC_K, EVEN_K)
    return a0, a1, a2, a3


def _w_tile(w_rows, offs_k, K, EVEN_K: tl.constexpr):
    """A ``[BLOCK_N, BLOCK_K]`` W tile in fp32, streamed (evict_first)."""
    if EVEN_K:
        return tl.load(w_rows + offs_k[None, :], eviction_policy="evict_first").to(tl.float32)
    return tl.load(w_rows + offs_k[None, :], mask=(offs_k < K)[None, :], other=0.0,
                   eviction_policy="evict_first").to(tl.float32)


def _skinny_gemm_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, ws_ptr, lock_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_ym,
    k_blocks,                     # cdiv(K, BLOCK_K)
    blocks_per_split,             # K blocks per split (the last split may hold fewer)
    split_k,                      # programs along K (grid axis 1)
    ws_stride_s,                  # workspace elements between two splits' partials (= M_pad * N)
    HAS_BIAS: tl.constexpr,
    SPLIT: tl.constexpr,          # split_k > 1: partials + last-arriver reduction
    USE_DOT: tl.constexpr,        # True: "mma" (tl.dot, swap AB); False: "fma"
    ACC_K: tl.constexpr,          # fma: BLOCK_K = accumulate full tiles, reduce after the loop; 1 = per step
    EVEN_K: tl.constexpr,         # K % BLOCK_K == 0: no K masks
    UPCAST: tl.constexpr,         # interpreter + 16-bit: feed tl.dot fp32 copies (see skinny_gemm)
    DOT_PRECISION: tl.constexpr,
    FMA_STAGES: tl.constexpr,     # fma: software-pipeline depth of the K loop (1 = none)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,            # programmatic dependent launch (nvllm.kernels.pdl)
    EARLY_W: tl.constexpr,        # fma: load the first W tile before waiting for the previous kernel
    SILU_B: tl.constexpr,         # 0; or B: the rows are an interleaved gate_up (blocks of B), y gets SiLU·mul
):
    """Grid (cdiv(N, BLOCK_N), split_k, cdiv(M, BLOCK_M)). Program (n, s, m) computes the partial
    ``y[m-tile, n-tile]`` over K blocks [s·blocks_per_split, (s+1)·blocks_per_split) and, unsplit or last to
    arrive, the final tile. Tiles are held transposed, ``[BLOCK_N, BLOCK_M]``.

    PDL: the wait comes first, except that with ``EARLY_W`` the first W tile is loaded before it — weights
    are never written by a kernel, so that load may overlap the previous kernel's tail."""
    if PDL and not EARLY_W:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < M
    rk = tl.arange(0, BLOCK_K)
    # rows past N / M are clamped to the last one: loaded and computed, never stored (no load masks)
    w_rows = w_ptr + tl.minimum(offs_n, N - 1).to(tl.int64)[:, None] * stride_wn        # [BLOCK_N, 1]
    kb_begin = pid_k * blocks_per_split
    kb_end = tl.minimum(kb_begin + blocks_per_split, k_blocks)

    if USE_DOT:
        x_cols = x_ptr + tl.minimum(offs_m, M - 1).to(tl.int64)[None, :] * stride_xm       # [1, BLOCK_M]
        acc = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)
        for kb in range(kb_begin, kb_end):
            offs_k = kb * BLOCK_K + rk
            if EVEN_K:
                w = tl.load(w_rows + offs_k[None, :], eviction_policy="evict_first")
                xt = tl.load(x_cols + offs_k[:, None] * stride_xk, eviction_policy="evict_last")
            else:
                mk = offs_k < K
                w = tl.load(w_rows + offs_k[None, :], mask=mk[None, :], other=0.0,
                            eviction_policy="evict_first")
                xt = tl.load(x_cols + offs_k[:, None] * stride_xk, mask=mk[:, None], other=0.0,
                             eviction_policy="evict_last")
            if UPCAST:
                acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, xt, acc, input_precision=DOT_PRECISION)
    else:
        # up to four rows of x, each its own accumulator ([BLOCK_N, ACC_K] fp32; unused ones stay empty)
        x_r0 = x_ptr + tl.minimum(pid_m * BLOCK_M, M - 1).to(tl.int64) * stride_xm
        x_r1 = x_ptr + tl.minimum(pid_m * BLOCK_M + 1, M - 1).to(tl.int64) * stride_xm
        x_r2 = x_ptr + tl.minimum(pid_m * BLOCK_M + 2, M - 1).to(tl.int64) * stride_xm
        x_r3 = x_ptr + tl.minimum(pid_m * BLOCK_M + 3, M - 1).to(tl.int64) * stride_xm
        a0 = tl.full((BLOCK_N, ACC_K), 0.0, tl.float32)
        a1 = tl.full((BLOCK_N, ACC_K), 0.0, tl.float32)
        a2 = tl.full((BLOCK_N, ACC_K), 0.0, tl.float32)
        a3 = tl.full((BLOCK_N, ACC_K), 0.0, tl.float32)
        kb_first = kb_begin
        if EARLY_W:   # the first tile, peeled: loaded before the wait (the splits are never empty)
            offs_k = kb_begin * BLOCK_K + rk
            w = _w_tile(w_rows, offs_k, K, EVEN_K)
            if PDL:
                tl.extra.cuda.gdc_wait()
                tl.extra.cuda.gdc_launch_dependents()
            a0, a1, a2, a3 = _fma_rows(w, x_r0, x_r1, x_r2, x_r3, offs_k, stride_xk, K, a0, a1, a2, a3,
                                       BLOCK_M, ACC_K, EVEN_K)
            kb_first = kb_begin + 1
        # the loads feed no tl.dot, so the software pipeliner runs only when asked per loop (cp.async)
        for kb in tl.range(kb_first, kb_end, num_stages=FMA_STAGES):
            offs_k = kb * BLOCK_K + rk
            w = _w_tile(w_rows, offs_k, K, EVEN_K)
            a0, a1, a2, a3 = _fma_rows(w, x_r0, x_r1, x_r2, x_r3, offs_k, stride_xk, K, a0, a1, a2, a3,
                                       BLOCK_M, ACC_K, EVEN_K)
        # gather the row sums into the [BLOCK_N, BLOCK_M] tile
        cols = tl.arange(0, BLOCK_M)[None, :]
        acc = tl.where(cols == 0, tl.reduce(a0, 1, tl.standard._sum_combine, keep_dims=True), 0.0)
        if BLOCK_M > 1:
            acc = tl.where(cols == 1, tl.reduce(a1, 1, tl.standard._sum_combine, keep_dims=True), acc)
        if BLOCK_M > 2:
            acc = tl.where(cols == 2, tl.reduce(a2, 1, tl.standard._sum_combine, keep_dims=True), acc)
            acc = tl.where(cols == 3, tl.reduce(a3, 1, tl.standard._sum_combine, keep_dims=True), acc)

    mask_out = mask_n[:, None] & mask_m[None, :]
    if SPLIT:
        tile_off = offs_m[None, :] * N + offs_n[:, None]
        tl.store(ws_ptr + pid_k * ws_stride_s + tile_off, acc, mask=mask_out)
        tl.debug_barrier()  # every thread's partial is written before the arrival is published
        lock = lock_ptr + pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(lock, 1, sem="acq_rel", scope="gpu")
        last = arrived == split_k - 1
        if last:
            # the last program of this tile: sum the partials in split order (deterministic)
            acc = tl.full((BLOCK_N, BLOCK_M), 0.0, tl.float32)
            for s in range(0, split_k):
                acc += tl.load(ws_ptr + s * ws_stride_s + tile_off, mask=mask_out, other=0.0,
                               cache_modifier=".cg")
            tl.store(lock, 0)  # re-armed for the next launch (stream-ordered)
    else:
        last = True
    if last:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        if SILU_B:
            _store_silu_and_mul(acc, y_ptr, stride_ym, offs_m, mask_m, pid_n, N, SILU_B, BLOCK_N, BLOCK_M)
        else:
            # rounded to x's dtype first: a wider y (fp32 logits) holds the bits the x-dtype result would
            tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None],
                     acc.to(x_ptr.dtype.element_ty).to(y_ptr.dtype.element_ty), mask=mask_out)


def _store_silu_and_mul(acc, y_ptr, stride_ym, offs_m, mask_m, pid_n, N, B: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """The tile's rows are BLOCK_N / 2B blocks of (B gate rows, B up rows) of an interleaved gate_up weight:
    store ``SiLU(gate) · up`` for its BLOCK_N / 2 outputs (columns pid_n · BLOCK_N/2 … of y ``[M, N/2]``), with
    the rounding steps of the unfused path (the GEMM's output in y's dtype, then ``silu_and_mul``)."""
    out_ty = y_ptr.dtype.element_ty
    v = tl.reshape(acc.to(out_ty).to(tl.float32), (BLOCK_N // (2 * B), 2, B * BLOCK_M))
    gate, up = tl.split(tl.permute(v, (0, 2, 1)))                     # [BLOCK_N / 2B, B · BLOCK_M] each
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
    res = tl.reshape(act * up, (BLOCK_N // 2, BLOCK_M))                # row blk·B + t: output blk·B + t
    offs_o = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_o[:, None], res.to(out_ty),
             mask=(offs_o < N // 2)[:, None] & mask_m[None, :])


_skinny_gemm_kernel.helpers = ("_fma_row", "_fma_rows", "_w_tile", "_store_silu_and_mul")


# ----------------------------------------------------------------------------------------------- launcher

_workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, split: int, m_pad: int, n: int, tiles: int, allocate: bool = True):
    """(fp32 partials [split, m_pad, n], int32 arrival counters [tiles]) for one shape; created once (zeroed
    counters) and kept, so CUDA graphs captured over it stay valid. None when missing and not ``allocate``."""
    key = (device, split, m_pad, n, tiles)
    ws = _workspaces.get(key)
    if ws is None and allocate:
        ws = (torch.empty((split, m_pad, n), dtype=torch.float32, device=device),
              torch.zeros((tiles,), dtype=torch.int32, device=device))
        _workspaces[key] = ws
    return ws


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


@functools.lru_cache(maxsize=4096)
def _geometry(M: int, N: int, K: int, config: SkinnyConfig):
    """(block_m, block_k, k_blocks, blocks_per_split, splits, n_tiles, m_tiles) for this shape."""
    bm = config.block_m(M)
    bk = min(config.block_k, max(16, _next_pow2(K)))  # small K (tests): a block no wider than K needs
    k_blocks = _cdiv(K, bk)
    per_split = _cdiv(k_blocks, min(config.split_k, k_blocks))
    splits = _cdiv(k_blocks, per_split)               # no empty splits
    return bm, bk, k_blocks, per_split, splits, _cdiv(N, config.block_n), _cdiv(M, bm)


# the row count changes with the batch: not specialized (see nvllm.kernels.jit); run G compiled a new variant
# under live requests without this
_skinny_gemm_kernel.do_not_specialize = ("M", "ws_stride_s")


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: SkinnyConfig,
                out: torch.Tensor | None = None, early_w: bool | None = None, silu_block: int = 0) -> torch.Tensor:
    """The Triton path: ``x [M, K]`` (any strides) times ``weight [N, K]`` (rows contiguous) (+ bias) →
    ``[M, N]`` in x's dtype (or into ``out``, a contiguous-rows [M, N] tensor; a wider dtype than x's, e.g. fp32
    logits, holds the values rounded to x's dtype, as a cast of the x-dtype result would). ``early_w``: the ``fma``
    kernel's first W tile loaded before waiting on the previous kernel (default: with PDL; tests force it).
    ``silu_block`` B: ``weight`` is a gate_up interleaved in blocks of B (``activation.interleave_rows``; needs
    ``config.block_n % 2B == 0``) and the result is ``SiLU(gate) · up``, ``[M, N/2]``. Raises RuntimeError
    when a split-K workspace would have to be allocated during CUDA-graph capture (warm up before capturing)."""
    M, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K:
        raise ValueError(f"x has {K} features, the weight {tuple(weight.shape)} expects {weight.shape[1]}")
    if weight.stride(1) != 1:
        raise ValueError("the skinny GEMM needs the weight's rows contiguous (stride(1) == 1)")
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"dtypes differ: x {x.dtype}, weight {weight.dtype}, bias "
                         f"{None if bias is None else bias.dtype}")
    if bias is not None:
        bias = bias.contiguous()
    if silu_block and (config.block_n % (2 * silu_block) or N % (2 * silu_block)):
        raise ValueError(f"skinny_gemm: SiLU·mul needs block_n ({config.block_n}) and N ({N}) multiples of "
                         f"2 x {silu_block}")
    if out is None:
        out = torch.empty((M, N // 2 if silu_block else N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out
    if K == 0:
        full = bias.expand(M, N) if bias is not None else torch.zeros((M, N), dtype=x.dtype, device=x.device)
        return out.copy_(silu_and_mul_reference(full, silu_block) if silu_block else full)
    bm, bk, k_blocks, per_split, splits, n_tiles, m_tiles = _geometry(M, N, K, config)
    if splits > 1:
        ws = _workspace(x.device, splits, m_tiles * bm, N, n_tiles * m_tiles, allocate=not _capturing(x.device))
        if ws is None:
            raise RuntimeError("skinny_gemm: split-K workspace not allocated before CUDA-graph capture")
        partials, locks = ws
    else:
        partials = locks = out  # never touched
    acc_k = 1
    if config.kernel == "fma" and bm * config.block_n * bk <= _DEFER_MAX_PER_THREAD * 32 * config.num_warps:
        acc_k = bk
    sixteen_bit = x.dtype in (torch.float16, torch.bfloat16)
    _jit(_skinny_gemm_kernel)[(n_tiles, splits, m_tiles)](
        x, weight, bias if bias is not None else out, out, partials, locks,
        M, N, K,
        x.stride(0), x.stride(1), weight.stride(0), out.stride(0),
        k_blocks, per_split, splits, m_tiles * bm * N,
        HAS_BIAS=bias is not None, SPLIT=splits > 1, USE_DOT=config.kernel == "mma", ACC_K=acc_k,
        EVEN_K=K % bk == 0,
        # Triton 3.9's CPU interpreter multiplies 16-bit tl.dot operands as raw bits: give it fp32 copies
        # (exact: a product of two bf16/fp16 values fits fp32), numerically what the GPU computes
        UPCAST=sixteen_bit and interpreting(),
        DOT_PRECISION="tf32" if sixteen_bit else "ieee",
        FMA_STAGES=config.num_stages,
        BLOCK_M=bm, BLOCK_N=config.block_n, BLOCK_K=bk,
        EARLY_W=config.kernel == "fma" and (early_w if early_w is not None else pdl.enabled(x)),
        SILU_B=silu_block,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl.launch_args(x),
    )
    return out


# ----------------------------------------------------------------------------------------------- dispatch


def _skinny_choice(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> SkinnyConfig | None:
    """The table's Triton config for this call when it can run now (else None: F.linear)."""
    if not (_TABLE and use_triton(x)):
        return None
    K = x.shape[-1]
    M = x.numel() // K if K else 0
    if not 0 < M <= MAX_TUNED_M:
        return None
    choice = _TABLE.get((weight.shape[0], K, _BUCKETS[M], x.dtype))
    if not (isinstance(choice, SkinnyConfig) and weight.dtype == x.dtype and weight.stride(-1) == 1
            and weight.dim() == 2 and (bias is None or bias.dtype == x.dtype)):
        return None
    bm, _, _, _, splits, n_tiles, m_tiles = _geometry(M, weight.shape[0], K, choice)
    if splits > 1 and _capturing(x.device) and not _workspace(
            x.device, splits, m_tiles * bm, weight.shape[0], n_tiles * m_tiles, allocate=False):
        return None
    return choice


def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``y = x Wᵀ (+ b)`` through the measured choice for this shape; F.linear unless the table says Triton.
    ``out``: a destination of y's shape and dtype with contiguous rows (a static buffer: no copy). ``out_dtype``
    (without ``out``): y computed in x's dtype, returned in this one (the skinny kernel stores it so, no cast
    kernel after it: the LM head's fp32 logits)."""
    choice = _skinny_choice(x, weight, bias)
    if choice is not None:
        report.record("gemm", choice.describe())
        M, N = x.numel() // x.shape[-1], weight.shape[0]
        if out is None and out_dtype is not None:
            out = torch.empty((M, N), dtype=out_dtype, device=x.device)
        y = skinny_gemm(x.reshape(M, -1), weight, bias, choice, out=None if out is None else out.view(M, N))
        return y.view(*x.shape[:-1], N)
    report.record("gemm", "torch F.linear (cuBLAS)" if x.is_cuda else "torch F.linear (cpu)")
    if out is None:
        y = F.linear(x, weight, bias)
        return y if out_dtype is None else y.to(out_dtype)
    x2, o2 = x.reshape(-1, x.shape[-1]), out.view(-1, weight.shape[0])
    if bias is None:
        torch.mm(x2, weight.t(), out=o2)
    else:
        torch.addmm(bias, x2, weight.t(), out=o2)
    return out


def gemm_silu_and_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, block: int) -> torch.Tensor:
    """``SiLU(gate) · up`` of ``x Wᵀ (+ b)`` for a gate_up weight interleaved in blocks of ``block``
    (``activation.interleave_rows``): in the skinny kernel's epilogue when the table picks it for this shape and
    its tile holds whole blocks (one launch), else the GEMM then ``silu_and_mul(…, interleave=block)``."""
    choice = _skinny_choice(x, weight, bias)
    if choice is not None and choice.block_n % (2 * block) == 0:
        report.record("gemm", choice.describe() + " + SiLU·mul epilogue")
        report.record("silu_and_mul", "in the gate_up GEMM's epilogue")
        M, N = x.numel() // x.shape[-1], weight.shape[0]
        y = skinny_gemm(x.reshape(M, -1), weight, bias, choice, silu_block=block)
        return y.view(*x.shape[:-1], N // 2)
    return silu_and_mul(gemm(x, weight, bias), interleave=block)
