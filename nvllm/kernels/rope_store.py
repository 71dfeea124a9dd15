"""Rotary embedding of q and k fused with the KV-cache store: one kernel where the decoder ran two
(``apply_rotary`` then ``store_kv``), one launch fewer per layer and step.

``rope_store(q [T, H, D], k [T, H_kv, D], v [T, H_kv, D], positions [T], cos [P, D/2], sin [P, D/2], k_cache,
v_cache, slot_mapping [T], k_scale=None, v_scale=None)`` does exactly what

    apply_rotary(q, k, positions, cos, sin)                                   # nvllm/kernels/rotary.py
    store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)          # nvllm/kernels/kv_store.py

does, with the same results bit for bit (q and k rotated in place and rounded to their dtype; the cache,
and for an int8 / fp8 e4m3 cache the per-(token, head) scales, written from the rounded k and from v; slot
−1 rows store nothing but are still rotated), and returns (q, k). q, k, v may be strided views of the fused
qkv projection's output. The rotate-half (neox) form is the only one the models use; every rope scaling
(linear, llama3) lives in the cos/sin tables (nvllm/layers/rotary.py), so it needs nothing here.

A quantized qkv projection may leave its split-K sum unfinished (``nvllm.kernels.partial_sum``): q, k and v are
then the head views of its fp32 accumulator; the kernel adds the bias and rounds them to the activations' dtype
(the finished GEMV's bits) before rotating, writes the rotated q to a new tensor, and zeroes the accumulator.

Attention reads this step's K/V from the cache only (paged / prefill / decode kernels), so rotating k in
place is for the contract's sake (callers and hooks that look at k see what was stored), not for attention.

This file holds the op's three parts: the torch reference, the Triton kernel and the dispatch.
"""

from __future__ import annotations

import torch

from nvllm.kernels import pdl, report
from nvllm.kernels.backend import use_triton
from nvllm.kernels.jit import lazy_jit
from nvllm.kernels.kv_store import store_kv_reference, store_quant_args
from nvllm.kernels.partial_sum import PartialSum
from nvllm.kernels.rotary import _rotate_halves, apply_rotary_reference

tl = None  # triton.language, bound by lazy_jit at the first launch
_jit = lazy_jit


# ---------------------------------------------------------------------------------------------- reference


def rope_store_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                         v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary (in place), then the KV store: the two torch references one after the other."""
    apply_rotary_reference(q, k, positions, cos, sin)
    store_kv_reference(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q, k


# ------------------------------------------------------------------------------------------------- Triton


def _rope_store_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    q_out_ptr, qb_ptr, kb_ptr, vb_ptr,        # PARTIAL: rotated q's destination [T, H, D]; biases [H, D], [H_kv, D]
    stride_qt, stride_qh, stride_qd,          # q [T, H, D]
    stride_kt, stride_kh, stride_kd,          # k [T, H_kv, D]
    stride_vt, stride_vh, stride_vd,          # v [T, H_kv, D]
    stride_cosp, stride_cosd,                 # cos [P, D/2]
    stride_sinp, stride_sind,                 # sin [P, D/2]
    stride_cb, stride_co, stride_ch, stride_cd,   # k_cache [num_blocks, block_size, H_kv, D]
    stride_ub, stride_uo, stride_uh, stride_ud,   # v_cache (may differ from k_cache's strides)
    stride_sb, stride_so, stride_sh,          # k_scale / v_scale [num_blocks, block_size, H_kv] (QUANT only)
    num_heads, num_kv_heads, half,
    BLOCK_SIZE: tl.constexpr,                 # tokens per cache block
    BLOCK_H: tl.constexpr,                    # next power of two >= num_heads
    BLOCK_HKV: tl.constexpr,                  # next power of two >= num_kv_heads
    BLOCK_HALF: tl.constexpr,                 # next power of two >= D/2
    QUANT: tl.constexpr,                      # 0: plain copy + cast; 1: int8; 2: fp8 e4m3 (with scales)
    QMAX: tl.constexpr,                       # 127 (int8) or 448 (fp8 e4m3)
    PARTIAL: tl.constexpr,                    # q, k, v: a GEMV's fp32 split-K accumulator (module doc)
    HAS_BIAS: tl.constexpr,                   # PARTIAL: its bias (qb_ptr, kb_ptr, vb_ptr)
    PDL: tl.constexpr,                        # programmatic dependent launch (nvllm.kernels.pdl)
    EARLY: tl.constexpr,                      # PDL: position, cos/sin row and cache slot read before the wait
):
    """Two programs per token (grid [T, 2]), both with that position's cos/sin row: program 0 rotates the
    token's k heads in place and stores k and v into its cache slot (quantizing per head with QUANT), program
    1 rotates its q heads in place. Every tile is [heads, D/2]: the two halves of rotate-half are separate
    loads, and the cache rows are written half by half. Each element is read before it is written and no two
    programs touch the same one. The arithmetic is ``_rotary_kernel``'s, then ``_store_kv_kernel``'s on the
    rotated k rounded to k's dtype, so the results are the same bits. ``PARTIAL``: q, k and v are first finished
    (bias added, rounded to q_out's dtype), rotated q goes to q_out, and each program zeroes what it read."""
    if PDL and not EARLY:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # EARLY: the step's positions and slots were staged, and the cos/sin tables built, launches before the q/k/v
    # projection that precedes this kernel (pdl.py: safe to read before the wait); q, k, v only after it
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < half
    c = tl.load(cos_ptr + pos * stride_cosp + d * stride_cosd, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * stride_sinp + d * stride_sind, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    d = d[None, :]
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if PDL and EARLY:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    if tl.program_id(1) == 0:
        h = tl.arange(0, BLOCK_HKV)[:, None]
        mask = (h < num_kv_heads) & d_mask[None, :]
        p1 = k_ptr + t * stride_kt + h * stride_kh + d * stride_kd
        v_src = v_ptr + t * stride_vt + h * stride_vh + d * stride_vd
        if PARTIAL:
            ty = q_out_ptr.dtype.element_ty
            k1, k2 = _rotate_finished(p1, p1 + half * stride_kd, kb_ptr + h * 2 * half + d, half, mask, c, s,
                                      HAS_BIAS, ty)
        else:
            k1, k2 = _rotate_halves(p1, p1 + half * stride_kd, mask, c, s, k_ptr.dtype.element_ty)

        if slot >= 0:
            blk = slot // BLOCK_SIZE
            off = slot % BLOCK_SIZE
            if PARTIAL:
                v1 = _finished(v_src, vb_ptr + h * 2 * half + d, mask, HAS_BIAS, ty)
                v2 = _finished(v_src + half * stride_vd, vb_ptr + h * 2 * half + d + half, mask, HAS_BIAS, ty)
            else:
                v1 = tl.load(v_src, mask=mask)
                v2 = tl.load(v_src + half * stride_vd, mask=mask)
            k_dst = k_cache_ptr + blk * stride_cb + off * stride_co + h * stride_ch + d * stride_cd
            v_dst = v_cache_ptr + blk * stride_ub + off * stride_uo + h * stride_uh + d * stride_ud
            if QUANT == 0:
                tl.store(k_dst, k1.to(k_cache_ptr.dtype.element_ty), mask=mask)
                tl.store(k_dst + half * stride_cd, k2.to(k_cache_ptr.dtype.element_ty), mask=mask)
                tl.store(v_dst, v1.to(v_cache_ptr.dtype.element_ty), mask=mask)
                tl.store(v_dst + half * stride_ud, v2.to(v_cache_ptr.dtype.element_ty), mask=mask)
            else:
                hh = tl.arange(0, BLOCK_HKV)
                s_off = blk * stride_sb + off * stride_so + hh * stride_sh
                h_mask = hh < num_kv_heads
                k1y, k2y, k_amax = _quantize_halves(k1, k2, mask, QMAX, QUANT)
                tl.store(k_dst, k1y.to(k_cache_ptr.dtype.element_ty), mask=mask)
                tl.store(k_dst + half * stride_cd, k2y.to(k_cache_ptr.dtype.element_ty), mask=mask)
                tl.store(k_scale_ptr + s_off, k_amax / QMAX, mask=h_mask)
                v1y, v2y, v_amax = _quantize_halves(v1, v2, mask, QMAX, QUANT)
                tl.store(v_dst, v1y.to(v_cache_ptr.dtype.element_ty), mask=mask)
                tl.store(v_dst + half * stride_ud, v2y.to(v_cache_ptr.dtype.element_ty), mask=mask)
                tl.store(v_scale_ptr + s_off, v_amax / QMAX, mask=h_mask)
        if PARTIAL:   # every thread's reads done before any zero lands (layouts differ between the reads)
            tl.debug_barrier()
            zero = tl.zeros((BLOCK_HKV, BLOCK_HALF), tl.float32)
            tl.store(p1, zero, mask=mask)
            tl.store(p1 + half * stride_kd, zero, mask=mask)
            tl.store(v_src, zero, mask=mask)
            tl.store(v_src + half * stride_vd, zero, mask=mask)
    else:  # names of their own: Triton checks names bound in both branches for one type
        hq = tl.arange(0, BLOCK_H)[:, None]
        q_mask = (hq < num_heads) & d_mask[None, :]
        q1 = q_ptr + t * stride_qt + hq * stride_qh + d * stride_qd
        if PARTIAL:   # q_out: contiguous [T, H, D]
            r1, r2 = _rotate_finished(q1, q1 + half * stride_qd, qb_ptr + hq * 2 * half + d, half, q_mask, c, s,
                                      HAS_BIAS, q_out_ptr.dtype.element_ty)
            dst = q_out_ptr + (t * num_heads + hq) * 2 * half + d
            tl.store(dst, r1, mask=q_mask)
            tl.store(dst + half, r2, mask=q_mask)
            tl.debug_barrier()
            zero_q = tl.zeros((BLOCK_H, BLOCK_HALF), tl.float32)
            tl.store(q1, zero_q, mask=q_mask)
            tl.store(q1 + half * stride_qd, zero_q, mask=q_mask)
        else:
            _rotate_halves(q1, q1 + half * stride_qd, q_mask, c, s, q_ptr.dtype.element_ty)


def _finished(p, b, mask, HAS_BIAS: tl.constexpr, ty):
    """A split-K sum as the finished GEMV stores it: fp32 sum plus bias, rounded once to ``ty``."""
    x = tl.load(p, mask=mask, other=0.0)
    if HAS_BIAS:
        x += tl.load(b, mask=mask, other=0.0).to(tl.float32)
    return x.to(ty)


def _rotate_finished(p1, p2, b1, half, mask, c, s, HAS_BIAS: tl.constexpr, ty):
    """``_rotate_halves`` of finished split-K sums (``_finished``; ``b1``: the first half's bias), not stored."""
    x1 = _finished(p1, b1, mask, HAS_BIAS, ty).to(tl.float32)
    x2 = _finished(p2, b1 + half, mask, HAS_BIAS, ty).to(tl.float32)
    return (x1 * c - x2 * s).to(ty), (x2 * c + x1 * s).to(ty)


def _quantize_halves(x1, x2, mask, QMAX: tl.constexpr, QUANT: tl.constexpr):
    """One cache row per head from its two ``[heads, D/2]`` halves: amax per head over both, y = x · QMAX /
    amax rounded (int8) and clamped; returns (y1, y2, amax). Masked lanes count as 0, not garbage."""
    f1 = tl.where(mask, x1.to(tl.float32), 0.0)
    f2 = tl.where(mask, x2.to(tl.float32), 0.0)
    amax = tl.maximum(tl.maximum(tl.max(tl.abs(f1), 1), tl.max(tl.abs(f2), 1)), 1e-10)
    mul = (QMAX / amax)[:, None]
    y1 = f1 * mul
    y2 = f2 * mul
    if QUANT == 1:
        y1 = tl.floor(y1 + 0.5)
        y2 = tl.floor(y2 + 0.5)
    return tl.minimum(tl.maximum(y1, -QMAX), QMAX), tl.minimum(tl.maximum(y2, -QMAX), QMAX), amax


_rope_store_kernel.helpers = ("_rotate_halves", "_quantize_halves", "_finished", "_rotate_finished")


def rope_store_triton(q: torch.Tensor | PartialSum, k: torch.Tensor | PartialSum, v: torch.Tensor | PartialSum,
                      positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as ``rope_store_reference``. Grid [T, 2]: per token one program for k (rotate, store k
    and v) and one for q (rotate); q/k/v/cos/sin/caches may be strided. q, k, v may instead be the head views of
    one ``PartialSum`` (``PartialSum.heads``): then the rotated q is a new tensor and k is not returned (None)."""
    partial = q if isinstance(q, PartialSum) else None
    q_out = None
    if partial is not None:
        assert isinstance(k, PartialSum) and isinstance(v, PartialSum), "q, k and v: one PartialSum's heads"
        biases = (q.bias, k.bias, v.bias)
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        q, k, v = q.acc, k.acc, v.acc
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim), (q.shape, k.shape, v.shape, k_cache.shape)
    assert positions.shape == slot_mapping.shape == (num_tokens,), (positions.shape, slot_mapping.shape)
    assert head_dim % 2 == 0 and cos.shape[-1] == sin.shape[-1] == head_dim // 2, (head_dim, cos.shape)
    assert v_cache.shape == k_cache.shape and k_cache.shape[3] == head_dim, (k_cache.shape, v_cache.shape)
    if num_tokens == 0:
        if partial is not None:
            partial.release()
        return (q, k) if partial is None else (q_out, None)
    import triton

    quant, qmax, k_scale, v_scale, scale_strides = store_quant_args(k_cache, v_cache, k_scale, v_scale)
    block_h = triton.next_power_of_2(num_heads)
    block_hkv = triton.next_power_of_2(num_kv_heads)
    block_half = triton.next_power_of_2(head_dim // 2)
    tile = max(block_h, 2 * block_hkv) * block_half
    has_bias = partial is not None and biases[0] is not None
    extra = (q_out, *biases) if has_bias else (q_out if partial is not None else q,) * 4
    pdl_args = pdl.launch_args(q)
    _jit(_rope_store_kernel)[(num_tokens, 2)](
        q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale, *extra,
        *q.stride(), *k.stride(), *v.stride(), *cos.stride(), *sin.stride(),
        *k_cache.stride(), *v_cache.stride(), *scale_strides,
        num_heads, num_kv_heads, head_dim // 2,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_H=block_h, BLOCK_HKV=block_hkv, BLOCK_HALF=block_half,
        QUANT=quant, QMAX=qmax, PARTIAL=partial is not None, HAS_BIAS=has_bias,
        num_warps=4 if tile >= 1024 else (2 if tile >= 256 else 1), **pdl_args,
        EARLY=pdl_args["PDL"] and pdl.early_params(),
    )
    if partial is not None:
        partial.release()
        return q_out, None
    return q, k


# ----------------------------------------------------------------------------------------------- dispatch


def rope_store(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    """Rotates q and k in place, stores k and v into the paged cache (see the module docstring); returns
    (q, k). The report keeps the ``kv_store`` entries the separate store records (the same store, the same
    bits) and says under ``rotary`` that it ran fused. q, k, v may be the head views of a quantized qkv GEMV's
    ``PartialSum``: then the kernel finishes them (or, off the Triton path, ``PartialSum.finish``) and the
    rotated q it returns is a new tensor (k: None on the Triton path)."""
    quant = k_scale is not None
    if isinstance(q, PartialSum):
        if use_triton(q.acc):
            report.record("rotary", "triton rope_store (fused with kv_store, finishes split-K sums)")
            report.record("kv_store", "triton store_kv (quantize)" if quant else "triton store_kv")
            return rope_store_triton(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, k_scale,
                                     v_scale)
        q, k, v = q.finish(), k.finish(), v.finish()
    if use_triton(q):
        report.record("rotary", "triton rope_store (fused with kv_store)")
        report.record("kv_store", "triton store_kv (quantize)" if quant else "triton store_kv")
        return rope_store_triton(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    report.record("rotary", "torch reference (in place)")
    report.record("kv_store", "torch quantize + index_copy" if quant else "torch index_copy")
    return rope_store_reference(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale)
