"""A mixture of experts' last step: each token's k expert outputs, weighted by its routing weights and summed.

    y [T·k, H] (the down products, rounded to the activations' dtype), weights [T·k] → out [T, H] in y's dtype:

    out[t] = Σ_j weights[t·k + j] · y[t·k + j]      in fp32, in slot order j = 0 … k − 1, rounded once

— the rounding ``fused_moe`` promises. The grouped GEMMs of larger batches (``fused_moe``, ``quant_moe``) store y in
the activations' dtype and leave the weights to this kernel: half the bytes of fp32 weighted terms, written once and
read once, and one launch where torch took a sum and a cast.

This file holds the op's three parts: the torch reference, the Triton kernel and the dispatch.
"""

from __future__ import annotations

import torch

from nvllm.kernels import pdl
from nvllm.kernels.backend import use_triton
from nvllm.kernels.jit import lazy_jit

tl = None  # triton.language, bound by lazy_jit at the first launch

BLOCK_H = 1024   # columns a program sums


# ---------------------------------------------------------------------------------------------- reference


def sum_slots_reference(y: torch.Tensor, weights: torch.Tensor, top_k: int) -> torch.Tensor:
    terms = y.float().view(-1, top_k, y.shape[1]) * weights.float().reshape(-1, top_k, 1)
    out = terms[:, 0]
    for j in range(1, top_k):   # slot order
        out = out + terms[:, j]
    return out.to(y.dtype)


# ------------------------------------------------------------------------------------------------- Triton


def _sum_slots_kernel(
    y_ptr, w_ptr, out_ptr, H, stride_y, stride_out,
    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,                        # programmatic dependent launch (nvllm.kernels.pdl)
):
    """Program (t, h): columns [h·BLOCK_H, (h+1)·BLOCK_H) of token t's weighted sum."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.full((BLOCK_H,), 0.0, tl.float32)
    for j in tl.static_range(TOP_K):
        row = t * TOP_K + j
        term = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
        acc += term * tl.load(w_ptr + row).to(tl.float32)
    tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_slots_triton(y: torch.Tensor, weights: torch.Tensor, top_k: int) -> torch.Tensor:
    """Same contract as ``sum_slots_reference``; grid (T, H / BLOCK_H)."""
    import triton

    rows, hidden = y.shape
    assert y.stride(-1) == 1 and rows % top_k == 0 and weights.numel() == rows, (y.shape, weights.shape, top_k)
    weights = weights.reshape(-1).contiguous()
    out = torch.empty(rows // top_k, hidden, dtype=y.dtype, device=y.device)
    if rows == 0:
        return out
    block = min(BLOCK_H, triton.next_power_of_2(hidden))
    lazy_jit(_sum_slots_kernel)[(rows // top_k, triton.cdiv(hidden, block))](
        y, weights, out, hidden, y.stride(0), out.stride(0), TOP_K=top_k, BLOCK_H=block,
        num_warps=4, **pdl.launch_args(y),
    )
    return out


# ----------------------------------------------------------------------------------------------- dispatch


def sum_slots(y: torch.Tensor, weights: torch.Tensor, top_k: int) -> torch.Tensor:
    """The module doc's op: y [T·k, H], weights [T, k] or [T·k] (any float dtype) → [T, H] in y's dtype."""
    if use_triton(y):
        return sum_slots_triton(y, weights, top_k)
    return sum_slots_reference(y, weights, top_k)
