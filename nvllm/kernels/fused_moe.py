"""A mixture-of-experts MLP: every token through its ``k`` routed experts' SwiGLU, weighted and summed.

    x [T, H], w13 [E, 2I, H] (each expert's gate rows, then its up rows), w2 [E, H, I],
    topk_weights [T, k] (fp32), topk_ids [T, k] (int) → out [T, H] in x's dtype:

    out[t] = Σ_j topk_weights[t, j] · w2[e] · (SiLU(w13[e, :I] x[t]) ⊙ w13[e, I:] x[t]),   e = topk_ids[t, j]

Rounding: each expert's gate/up product, SiLU·mul and down product are rounded to x's dtype as
``F.linear`` / ``silu_and_mul`` round them; the routing weight multiplies the rounded down product in fp32 and
the k terms of a token are summed in fp32 in slot order, rounded once.

This file holds the op's three parts: the torch reference, the Triton kernels and the dispatch. The Triton part
has two paths, chosen from T·k (a host int, so no synchronisation): up to E (token, slot) pairs (decode) two
GEMV kernels read each pair's expert straight from ``topk_ids``, the down one summing a token's k
terms in place; larger batches sort the pairs by expert (``moe_align``), run a grouped GEMM twice and weight and sum
each token's k terms (``moe_sum``).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from nvllm.kernels import pdl, report
from nvllm.kernels.activation import silu_and_mul
from nvllm.kernels.backend import interpreting, use_triton
from nvllm.kernels.jit import lazy_jit
from nvllm.kernels.moe_align import align_tokens
from nvllm.kernels.moe_sum import sum_slots

tl = None  # triton.language, bound by lazy_jit at the first launch

# The small-batch (decode) path runs while the (token, slot) pairs are no more than the experts (T·k ≤ E: at most
# one pair an expert on average); beyond that the sorted grouped GEMM, which reads each expert's weights once for all
# its rows, was faster on an H100 (PERF.md, run ES: Qwen3-30B-A3B's 128 experts crossed between 128 and 256 pairs,
# Mixtral's 8 between 8 and 16). ``SMALL_ROWS``, when set, replaces the rule (tests force either path with it). Read
# at each call.
SMALL_ROWS: int | None = None

# The grouped GEMM's launch (``gemm_config``): a dict of any of its keys overrides its choice (the sweep of
# ``scripts/gpu_moe_bench.py --gemm-sweep`` and the tests set it). Read at each call.
GEMM_TILES: dict | None = None

# Block sizes of the decode GEMVs, bound by weight bandwidth, swept on an H100 over Qwen3-30B-A3B's and Mixtral's
# experts at T = 1 and 4 (run ES; 72 settings): 16 rows of w13 a program for the up GEMV, 4 columns of w2 for the
# down one (its grid is only T × H/BLOCK_N: H = 2048 at T = 1 gives 512 programs), K steps of 256, 8 warps — 9 %
# below the first guess (32, 8, 128, 4 warps) on average, 33.1 against 40.5 µs at Qwen3-30B-A3B's T = 1. The down
# kernel loads up to GEMV_DOWN_SLOTS slots' tiles at once rather than one slot after the other.
GEMV_UP_BLOCK_N = 16
GEMV_DOWN_BLOCK_N = 4
GEMV_DOWN_SLOTS = 8    # most slots loaded at once (a power of two)
GEMV_NUM_WARPS = 8
GEMV_BLOCK_K = 256     # K step of both (next_pow2(K) if smaller, at least 16)


_jit = lazy_jit


# ---------------------------------------------------------------------------------------------- reference


def experts_reference(x: torch.Tensor, expert, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """Expert by expert, over the tokens routed to it (the loop HF transformers runs); ``expert(e)`` gives expert
    e's (w13 [2I, H], w2 [H, I]), multiplied in their dtype's precision (x's, or fp32 for a dequantized expert),
    each product rounded to x's dtype."""
    t, k = topk_ids.shape
    terms = torch.zeros(t, k, x.shape[1], dtype=torch.float32, device=x.device)
    flat = topk_ids.reshape(-1)
    for e in flat.unique().tolist():
        rows = (flat == e).nonzero().squeeze(1)
        tok, slot = rows // k, rows % k
        w13, w2 = expert(e)
        inter = w2.shape[1]
        h = F.linear(x[tok].to(w13.dtype), w13).to(x.dtype)
        act = F.silu(h[:, :inter]) * h[:, inter:]
        y = F.linear(act.to(w2.dtype), w2).to(x.dtype)
        terms[tok, slot] = y.float() * topk_weights[tok, slot].float()[:, None]
    return terms.sum(1).to(x.dtype)


def fused_experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                            topk_ids: torch.Tensor) -> torch.Tensor:
    return experts_reference(x, lambda e: (w13[e], w2[e]), topk_weights, topk_ids)


# ------------------------------------------------------------------------------------------------- Triton


def _block_rows(sorted_ids_ptr, block_experts_ptr, pid_b, num_valid, BLOCK_M: tl.constexpr):
    """Sorted block ``pid_b``'s rows (sentinels read as row 0, masked), their mask and the block's expert."""
    rows = tl.load(sorted_ids_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M))
    mask_m = rows < num_valid
    return tl.where(mask_m, rows, 0).to(tl.int64), mask_m, tl.load(block_experts_ptr + pid_b).to(tl.int64)


def _moe_gemm_kernel(
    a_ptr, w_ptr, c_ptr, sorted_ids_ptr, block_experts_ptr, num_padded_ptr,
    N, K,                                     # C's columns, the reduction length
    num_valid,                                # T·k: the sentinel, and the rows of C
    stride_am, stride_we, stride_wn, stride_cm,   # A [*, K], W [E, N, K], C [T·k, N] (last strides 1)
    TOP_K: tl.constexpr,                      # A's row of sorted row r: r // TOP_K (1: A has C's rows)
    UPCAST: tl.constexpr,                     # interpreter + 16-bit: feed tl.dot fp32 copies (gemm's note)
    DOT_PRECISION: tl.constexpr,              # "ieee" for fp32 inputs
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,                        # programmatic dependent launch (nvllm.kernels.pdl)
):
    """Program (b, n): C[r, n·BLOCK_N : (n+1)·BLOCK_N] = A[r // TOP_K] @ W[e]ᵀ for the rows r of sorted block
    b (sentinels skipped), e = block_experts[b]; fp32 accumulation, stored rounded to A's dtype (F.linear's
    rounding). Blocks at or past num_padded[0] return at once."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_b * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows, mask_m, expert = _block_rows(sorted_ids_ptr, block_experts_ptr, pid_b, num_valid, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (rows // TOP_K)[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)     # [BLOCK_K, BLOCK_N]
        if UPCAST:
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    tl.store(c_ptr + rows[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


_moe_gemm_kernel.do_not_specialize = ("num_valid",)   # varies with the batch (see nvllm.kernels.jit)
_moe_gemm_kernel.helpers = ("_block_rows",)


def gemm_config(rows: int, num_experts: int) -> dict:
    """The grouped GEMM's launch for ``rows`` (token, slot) pairs over ``num_experts`` experts: rows a block
    (BLOCK_M, which ``align_tokens`` pads to), columns and inputs a program step (BLOCK_N, BLOCK_K; cut to the
    projection's size), warps and stages (fewer stages, then columns, where the device's shared memory is smaller:
    ``_fit_shared``). GEMM_TILES overrides any of them.

    From an H200 sweep of the whole op (PERF.md, run FX; Qwen3-30B-A3B's 128 experts and Mixtral's 8, bf16): up to
    16 pairs an expert blocks of 16 rows, 128 columns and K steps of 128 (Qwen3-30B-A3B at 128 tokens 309.5 µs
    against 321.7 with the tiles before); up to 64, blocks of 64 rows — fewer blocks each reading its expert's
    weight once — 64 columns and K steps of 64 (Qwen3-30B-A3B at 512 tokens 347.7 against 382.1, Mixtral at 128
    tokens 697.5 against 869.8); past 64, blocks of 128 rows, 256 columns, 8 warps and 4 stages (2048 tokens:
    Qwen3-30B-A3B 562.4 against 610.7, Mixtral 3226.8 against 3509.8; at 96 pairs an expert on an H100, runs FZ
    and GA: Qwen3-30B-A3B at 1536 tokens 615.9 against 644.3 for the 64 × 128 blocks before, Mixtral at 384 tokens
    1103.8 against 1220.8; at 65 pairs the same within 1.4%)."""
    per_expert = rows / num_experts
    if per_expert <= 16:
        config = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3)
    elif per_expert <= 64:
        config = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4, num_stages=3)
    else:
        config = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=4)
    config.update(GEMM_TILES or {})
    return config


def _fit_shared(stages: int, block_m: int, block_n: int, block_k: int, elem_bytes: int,
                shared_bytes: int) -> tuple[int, int]:
    """Stages and columns whose pipeline fits ``shared_bytes`` of shared memory (a stage holds one [block_m,
    block_k] tile of A and one [block_k, block_n] of W): first fewer stages, down to 2, then fewer columns, down to
    16; 0 bytes: no limit known, both kept."""
    def need(st, bn):
        return st * (block_m + bn) * block_k * elem_bytes

    while shared_bytes and stages > 2 and need(stages, block_n) > shared_bytes:
        stages -= 1
    while shared_bytes and block_n > 16 and need(stages, block_n) > shared_bytes:
        block_n //= 2
    return stages, block_n


@functools.lru_cache(maxsize=None)
def _shared_bytes(device_index: int) -> int:
    """Shared memory a block of the device may take (0 where torch does not say)."""
    return getattr(torch.cuda.get_device_properties(device_index), "shared_memory_per_block_optin", 0)


def _moe_gemm(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, sorted_ids: torch.Tensor,
              block_experts: torch.Tensor, num_padded: torch.Tensor, top_k: int, config: dict) -> None:
    """C[r] = A[r // top_k] @ W[e]ᵀ (C in A's dtype) over the sorted rows; see ``_moe_gemm_kernel``."""
    import triton

    n, k = w.shape[1], w.shape[2]
    block_n = max(16, min(config["BLOCK_N"], triton.next_power_of_2(n)))
    block_k = max(16, min(config["BLOCK_K"], triton.next_power_of_2(k)))
    shared = 0 if interpreting() else _shared_bytes(a.device.index)
    stages, block_n = _fit_shared(config["num_stages"], config["BLOCK_M"], block_n, block_k, a.element_size(), shared)
    sixteen_bit = a.dtype in (torch.float16, torch.bfloat16)
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _jit(_moe_gemm_kernel)[grid](
        a, w, c, sorted_ids, block_experts, num_padded,
        n, k, c.shape[0],
        a.stride(0), w.stride(0), w.stride(1), c.stride(0),
        TOP_K=top_k,
        UPCAST=sixteen_bit and interpreting(), DOT_PRECISION="tf32" if sixteen_bit else "ieee",
        BLOCK_M=config["BLOCK_M"], BLOCK_N=block_n, BLOCK_K=block_k, num_warps=config["num_warps"],
        num_stages=stages, **pdl.launch_args(a),
    )


def _moe_gemv_up_kernel(
    x_ptr, w_ptr, h_ptr, ids_ptr,
    N, K,                                     # 2I, H
    stride_xm, stride_we, stride_wn, stride_hm,   # x [T, H], w13 [E, 2I, H], h [T·k, 2I] (last strides 1)
    TOP_K: tl.constexpr,                      # k: pair p is token p // k's slot p % k
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,                        # programmatic dependent launch (nvllm.kernels.pdl)
):
    """Program (p, n): h[p, n·BLOCK_N : (n+1)·BLOCK_N] = x[p // k] @ w13[e]ᵀ for those rows, e = topk_ids.flat[p]:
    a GEMV without tl.dot (fp32 products summed over K in fp32), stored rounded to h's dtype (x's)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + (pair // TOP_K).to(tl.int64) * stride_xm + offs_k
    w_ptrs = w_ptr + expert * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]  # K fast
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        a = tl.load(a_ptrs, mask=mask_k, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_K]
        acc += tl.sum(w * a[None, :], axis=1)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    tl.store(h_ptr + pair.to(tl.int64) * stride_hm + offs_n, acc.to(h_ptr.dtype.element_ty), mask=mask_n)


# Nothing here varies with the batch (T shows only in the grid): no do_not_specialize (nvllm.kernels.jit).


def _moe_gemv_down_kernel(
    act_ptr, w_ptr, out_ptr, ids_ptr, weights_ptr,
    N, K,                                     # H, I
    stride_am, stride_we, stride_wn, stride_om,   # act [T·k, I], w2 [E, H, I], out [T, H] (last strides 1)
    TOP_K: tl.constexpr,                      # k; ids [T, k] and weights [T, k] (fp32) contiguous
    SLOTS: tl.constexpr,                      # slots whose tiles are loaded at once (a power of two)
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,                        # programmatic dependent launch (nvllm.kernels.pdl)
):
    """Program (t, n): out[t, n·BLOCK_N : (n+1)·BLOCK_N] = Σ_j weights[t, j] · y_j, y_j = act[t·k + j] @ w2[e_j]ᵀ
    for those rows (fp32 accumulation, rounded to out's dtype and back), e_j = ids[t, j]; the terms summed in fp32
    in slot order and rounded once. The slots go in groups of SLOTS, each group's weight tiles in one load
    ([SLOTS, BLOCK_N, BLOCK_K]) so that a program has SLOTS times the bytes in flight of one slot's GEMV."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    tok = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_s = tl.arange(0, SLOTS)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for j0 in tl.static_range(0, TOP_K, SLOTS):
        mask_s = offs_s < TOP_K - j0
        pairs = tok * TOP_K + j0 + offs_s                                             # act's rows: t·k + j
        experts = tl.load(ids_ptr + pairs, mask=mask_s, other=0).to(tl.int64)
        a_ptrs = act_ptr + pairs[:, None] * stride_am + offs_k[None, :]                  # [SLOTS, BLOCK_K]
        w_ptrs = (w_ptr + experts[:, None, None] * stride_we + offs_n.to(tl.int64)[None, :, None] * stride_wn
                  + offs_k[None, None, :])                                               # [SLOTS, BLOCK_N, BLOCK_K]
        mask_sn = mask_s[:, None, None] & mask_n[None, :, None]
        part = tl.zeros((SLOTS, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask_k = offs_k < K - k0
            a = tl.load(a_ptrs, mask=mask_s[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
            w = tl.load(w_ptrs, mask=mask_sn & mask_k[None, None, :], other=0.0).to(tl.float32)
            part += tl.sum(w * a[:, None, :], axis=2)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        weight = tl.load(weights_ptr + pairs, mask=mask_s, other=0.0)
        terms = part.to(out_ptr.dtype.element_ty).to(tl.float32) * weight[:, None]    # F.linear's rounding, · w
        for s in tl.static_range(SLOTS):        # slot order; row s of terms taken exactly (the others add zeros)
            if j0 + s < TOP_K:
                acc += tl.sum(tl.where(offs_s[:, None] == s, terms, 0.0), axis=0)
    tl.store(out_ptr + tok * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


def _gemv_block_k(k: int) -> int:
    import triton

    return max(16, min(GEMV_BLOCK_K, triton.next_power_of_2(k)))


def _moe_gemv_up(x: torch.Tensor, w13: torch.Tensor, h: torch.Tensor, topk_ids: torch.Tensor) -> None:
    """h[p] = x[p // k] @ w13[topk_ids.flat[p]]ᵀ, rounded to x's dtype; see ``_moe_gemv_up_kernel``."""
    import triton

    n, k = w13.shape[1], w13.shape[2]
    grid = (h.shape[0], triton.cdiv(n, GEMV_UP_BLOCK_N))
    _jit(_moe_gemv_up_kernel)[grid](
        x, w13, h, topk_ids,
        n, k,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        TOP_K=topk_ids.shape[1], BLOCK_N=GEMV_UP_BLOCK_N, BLOCK_K=_gemv_block_k(k),
        num_warps=GEMV_NUM_WARPS, **pdl.launch_args(x),
    )


def _moe_gemv_down(act: torch.Tensor, w2: torch.Tensor, out: torch.Tensor, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor) -> None:
    """out[t] = Σ_j topk_weights[t, j] · act[t·k + j] @ w2[topk_ids[t, j]]ᵀ (module doc's rounding); see
    ``_moe_gemv_down_kernel``."""
    import triton

    n, k = w2.shape[1], w2.shape[2]
    top_k = topk_ids.shape[1]
    grid = (out.shape[0], triton.cdiv(n, GEMV_DOWN_BLOCK_N))
    _jit(_moe_gemv_down_kernel)[grid](
        act, w2, out, topk_ids, topk_weights,
        n, k,
        act.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        TOP_K=top_k, SLOTS=min(GEMV_DOWN_SLOTS, triton.next_power_of_2(top_k)),
        BLOCK_N=GEMV_DOWN_BLOCK_N, BLOCK_K=_gemv_block_k(k),
        num_warps=GEMV_NUM_WARPS, **pdl.launch_args(act),
    )


def fused_experts_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor) -> torch.Tensor:
    """Same contract as ``fused_experts_reference``. No host synchronisation (CUDA-graph capturable); the path
    follows from T·k alone:

    - T·k ≤ E (decode; ``SMALL_ROWS`` when set): ``_moe_gemv_up`` into [T·k, 2I] (x's dtype), ``silu_and_mul``, then
      ``_moe_gemv_down`` straight into [T, H], the weighted sum of each token's k terms done in the kernel. Three
      launches, no sort.
    - larger: ``align_tokens``, the grouped GEMM over w13 into [T·k, 2I] (x's dtype), ``silu_and_mul``, the
      grouped GEMM over w2 into [T·k, H] (x's dtype), then ``moe_sum.sum_slots``: each token's k terms weighted and
      summed."""
    t, top_k = topk_ids.shape
    num_experts, hidden, inter = w2.shape
    assert x.shape == (t, hidden) and w13.shape == (num_experts, 2 * inter, hidden), (x.shape, w13.shape, w2.shape)
    assert x.stride(-1) == 1 and w13.is_contiguous() and w2.is_contiguous()
    assert w13.dtype == x.dtype and w2.dtype == x.dtype, (x.dtype, w13.dtype, w2.dtype)
    if t == 0:
        return x.new_empty(0, hidden)
    rows = t * top_k
    if rows <= (num_experts if SMALL_ROWS is None else SMALL_ROWS):
        report.record("fused_moe", "triton gemv (a row per token and expert)")
        ids = topk_ids.contiguous()
        h = torch.empty(rows, 2 * inter, dtype=x.dtype, device=x.device)
        _moe_gemv_up(x, w13, h, ids)
        act = silu_and_mul(h)
        out = torch.empty(t, hidden, dtype=x.dtype, device=x.device)
        _moe_gemv_down(act, w2, out, ids, topk_weights.to(torch.float32).contiguous())
        return out
    report.record("fused_moe", "triton grouped gemm (moe_align, moe_sum)")
    config = gemm_config(rows, num_experts)
    sorted_ids, block_experts, num_padded = align_tokens(topk_ids, num_experts, config["BLOCK_M"])
    h = torch.empty(rows, 2 * inter, dtype=x.dtype, device=x.device)
    _moe_gemm(x, w13, h, sorted_ids, block_experts, num_padded, top_k, config)
    act = silu_and_mul(h)
    y = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    _moe_gemm(act, w2, y, sorted_ids, block_experts, num_padded, 1, config)
    return sum_slots(y, topk_weights, top_k)


# ----------------------------------------------------------------------------------------------- dispatch


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """The module doc's op. x [T, H] contiguous; w13, w2 contiguous, x's dtype."""
    if use_triton(x):
        return fused_experts_triton(x, w13, w2, topk_weights, topk_ids)
    report.record("fused_moe", "torch reference")
    return fused_experts_reference(x, w13, w2, topk_weights, topk_ids)
