"""Rotary position embedding, rotate-half form (HF Llama/Qwen/Mistral), applied to q and k together.

``apply_rotary(q [T, H, D], k [T, H_kv, D], positions [T] int, cos [P, D/2] fp32, sin [P, D/2] fp32)``:
with ``x1, x2 = x[..., :D/2], x[..., D/2:]`` (in fp32) and ``c, s = cos[positions], sin[positions]``,
the result is ``cat(x1·c − x2·s, x2·c + x1·s)`` cast back to the input dtype.

In place: q and k are overwritten with their rotated values and returned (the same tensor objects). In the
decoder they are views of the fused qkv projection's output, which nothing reads afterwards except through
q, k and v, so rotating in place saves an allocation and a second [T, H+H_kv, D] buffer per layer; the
views may be strided (row stride = qkv width). A caller that still needs the unrotated values must pass
copies. The torch reference rotates in place too, so both paths have the same contract.

This file holds the op's three parts: the torch reference, the Triton kernel and the dispatch.
"""

from __future__ import annotations

import torch

from nvllm.kernels import report
from nvllm.kernels.backend import use_triton
from nvllm.kernels.jit import lazy_jit

tl = None  # triton.language, bound by lazy_jit at the first launch
_jit = lazy_jit


# ---------------------------------------------------------------------------------------------- reference


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


def apply_rotary_reference(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                           sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, H, D] and k [T, H_kv, D] in place; returns (q, k)."""
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)
    q.copy_(_rotate(q, c, s))
    k.copy_(_rotate(k, c, s))
    return q, k


# ------------------------------------------------------------------------------------------------- Triton


def _rotate_halves(p1, p2, mask, c, s, out_ty):
    """Rotate-half in place on the two halves ``p1`` / ``p2`` of a ``[heads, D/2]`` tile: loads, rotates in
    fp32 with the position's cos / sin rows, stores in ``out_ty``; returns the stored halves."""
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    r1 = (x1 * c - x2 * s).to(out_ty)
    r2 = (x2 * c + x1 * s).to(out_ty)
    tl.store(p1, r1, mask=mask)
    tl.store(p2, r2, mask=mask)
    return r1, r2


def _rotary_kernel(
    q_ptr, k_ptr, pos_ptr, cos_ptr, sin_ptr,
    stride_qt, stride_qh, stride_qd,          # q [T, H, D]
    stride_kt, stride_kh, stride_kd,          # k [T, H_kv, D]
    stride_cp, stride_cd,                     # cos [P, D/2]
    stride_sp, stride_sd,                     # sin [P, D/2]
    num_heads, num_kv_heads, half,
    BLOCK_H: tl.constexpr,                    # next power of two >= num_heads
    BLOCK_HKV: tl.constexpr,                  # next power of two >= num_kv_heads
    BLOCK_HALF: tl.constexpr,                 # next power of two >= D/2
):
    """One program per token: loads that position's cos/sin row once and rotates all of the token's q and k
    heads in place (each element is read before any is written, and no two programs touch the same one)."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    d_mask = d < half
    c = tl.load(cos_ptr + pos * stride_cp + d * stride_cd, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + pos * stride_sp + d * stride_sd, mask=d_mask, other=0.0).to(tl.float32)[None, :]

    h = tl.arange(0, BLOCK_H)[:, None]
    mask = (h < num_heads) & d_mask[None, :]
    p1 = q_ptr + t * stride_qt + h * stride_qh + d[None, :] * stride_qd
    _rotate_halves(p1, p1 + half * stride_qd, mask, c, s, q_ptr.dtype.element_ty)

    h = tl.arange(0, BLOCK_HKV)[:, None]
    mask = (h < num_kv_heads) & d_mask[None, :]
    p1 = k_ptr + t * stride_kt + h * stride_kh + d[None, :] * stride_kd
    _rotate_halves(p1, p1 + half * stride_kd, mask, c, s, k_ptr.dtype.element_ty)


_rotary_kernel.helpers = ("_rotate_halves",)


def apply_rotary_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``apply_rotary_reference`` (in place). Grid: one program per token (T programs), each
    rotating a [H, D] and a [H_kv, D] tile with one cos/sin row; q/k/cos/sin may be strided."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == (num_tokens, num_kv_heads, head_dim) and positions.shape == (num_tokens,), (
        q.shape, k.shape, positions.shape)
    assert head_dim % 2 == 0 and cos.shape[-1] == sin.shape[-1] == head_dim // 2, (head_dim, cos.shape)
    if num_tokens == 0:
        return q, k
    import triton

    block_h = triton.next_power_of_2(num_heads)
    block_hkv = triton.next_power_of_2(num_kv_heads)
    block_half = triton.next_power_of_2(head_dim // 2)
    _jit(_rotary_kernel)[(num_tokens,)](
        q, k, positions, cos, sin,
        *q.stride(), *k.stride(), *cos.stride(), *sin.stride(),
        num_heads, num_kv_heads, head_dim // 2,
        BLOCK_H=block_h, BLOCK_HKV=block_hkv, BLOCK_HALF=block_half,
        num_warps=4 if block_h * block_half >= 1024 else (2 if block_h * block_half >= 256 else 1),
    )
    return q, k


# ----------------------------------------------------------------------------------------------- dispatch


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q and k in place and returns them (see the module docstring)."""
    if use_triton(q):
        report.record("rotary", "triton rotary (in place)")
        return apply_rotary_triton(q, k, positions, cos, sin)
    report.record("rotary", "torch reference (in place)")
    return apply_rotary_reference(q, k, positions, cos, sin)
