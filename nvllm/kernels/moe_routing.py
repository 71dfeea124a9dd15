"""A mixture of experts' routing: router logits [T, E] → each token's top-k experts and their weights.

    probs = softmax(logits) in fp32; weights, ids = top-k of probs (largest first); weights /= their sum when
    ``renormalize``; weights rounded to the logits' dtype when ``in_dtype`` (returned as fp32 either way)

— what HF transformers' routers compute (``nvllm.layers.moe``). In torch that is five or six kernels a layer (softmax,
top-k, sum, division, two casts), a few µs each on a decode step's critical path; the Triton kernel does it in one
launch, a program a token, the k picks taken one at a time (the largest, the lowest expert id among equals). A row
with a NaN or an infinite logit gets NaN weights, as in torch, and valid expert ids.

This file holds the op's three parts: the torch reference, the Triton kernel and the dispatch.
"""

from __future__ import annotations

import torch

from nvllm.kernels import pdl, report
from nvllm.kernels.backend import use_triton
from nvllm.kernels.jit import lazy_jit

tl = None  # triton.language, bound by lazy_jit at the first launch


# ---------------------------------------------------------------------------------------------- reference


def route_reference(logits: torch.Tensor, top_k: int, renormalize: bool, in_dtype: bool
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if in_dtype:
        weights = weights.to(logits.dtype).float()
    return weights, ids


# ------------------------------------------------------------------------------------------------- Triton


def _route_kernel(
    logits_ptr, weights_ptr, ids_ptr,
    E, stride_l,                              # experts; logits [T, E] row stride (last stride 1)
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_E: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ROUND: tl.constexpr,                      # round the weights to the logits' dtype
    PDL: tl.constexpr,                        # programmatic dependent launch (nvllm.kernels.pdl)
):
    """Program t: row t's softmax, its TOP_K largest probabilities (weights [T, TOP_K] fp32, ids [T, TOP_K] int32),
    renormalised and rounded as the module doc says."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < E
    x = tl.load(logits_ptr + t * stride_l + offs, mask=valid, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, axis=0))
    p = tl.where(valid, p, 0.0)
    p = p / tl.sum(p, axis=0)
    nan_row = tl.max(tl.where(valid & (p != p), 1, 0), axis=0) > 0   # an infinite or NaN logit
    left = tl.where(valid, p, -1.0)           # probabilities not yet taken (taken and padding: −1)
    slots = tl.arange(0, K_PAD)
    weights = tl.zeros((K_PAD,), tl.float32)
    ids = tl.zeros((K_PAD,), tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(left, axis=0)
        pick = tl.minimum(tl.min(tl.where(left == best, offs, BLOCK_E), axis=0), E - 1)   # NaN rows: in range
        weights = tl.where(slots == j, best, weights)
        ids = tl.where(slots == j, pick, ids)
        left = tl.where(offs == pick, -1.0, left)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)
    if ROUND:
        weights = weights.to(logits_ptr.dtype.element_ty).to(tl.float32)
    weights = tl.where(nan_row, float("nan"), weights)
    keep = slots < TOP_K
    tl.store(weights_ptr + t * TOP_K + slots, weights, mask=keep)
    tl.store(ids_ptr + t * TOP_K + slots, ids, mask=keep)


def route_triton(logits: torch.Tensor, top_k: int, renormalize: bool, in_dtype: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``route_reference`` (ids int32). Grid (T,); the whole row of experts in one block."""
    import triton

    t, e = logits.shape
    assert logits.stride(-1) == 1 and 1 <= top_k <= e, (logits.shape, logits.stride(), top_k)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    if t == 0:
        return weights, ids
    block_e = triton.next_power_of_2(e)
    lazy_jit(_route_kernel)[(t,)](
        logits, weights, ids, e, logits.stride(0),
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), BLOCK_E=block_e, RENORMALIZE=renormalize,
        ROUND=in_dtype and logits.dtype != torch.float32,
        num_warps=1 if block_e <= 256 else 4, **pdl.launch_args(logits),
    )
    return weights, ids


# ----------------------------------------------------------------------------------------------- dispatch


def route(logits: torch.Tensor, top_k: int, renormalize: bool, in_dtype: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] → (weights [T, k] fp32, expert ids [T, k]) as the module doc says."""
    if use_triton(logits):
        report.record("moe_routing", "triton top-k routing")
        return route_triton(logits, top_k, renormalize, in_dtype)
    report.record("moe_routing", "torch reference")
    return route_reference(logits, top_k, renormalize, in_dtype)
