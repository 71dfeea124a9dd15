"""A mixture-of-experts MLP: every token through its ``k`` routed experts' SwiGLU, weighted and summed.

    x [T, H], w13 [E, 2I, H] (each expert's gate rows, then its up rows), w2 [E, H, I],
    topk_weights [T, k] (fp32), topk_ids [T, k] (int) → out [T, H] in x's dtype:

    out[t] = Σ_j topk_weights[t, j] · w2[e] · (SiLU(w13[e, :I] x[t]) ⊙ w13[e, I:] x[t]),   e = topk_ids[t, j]

Rounding: each expert's gate/up product, SiLU·mul and down product are rounded to x's dtype as
``F.linear`` / ``silu_and_mul`` round them; the routing weight multiplies the rounded down product in fp32 and
the k terms of a token are summed in fp32 in slot order, rounded once.

This file holds the op's three parts: the torch reference, the Triton kernels and the dispatch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nvllm.kernels import report
from nvllm.kernels.backend import use_triton

tl = None  # triton.language, bound by lazy_jit at the first launch


# ---------------------------------------------------------------------------------------------- reference


def fused_experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                            topk_ids: torch.Tensor) -> torch.Tensor:
    """Expert by expert, over the tokens routed to it (the loop HF transformers runs)."""
    t, k = topk_ids.shape
    inter = w2.shape[2]
    terms = torch.zeros(t, k, w2.shape[1], dtype=torch.float32, device=x.device)
    flat = topk_ids.reshape(-1)
    for e in flat.unique().tolist():
        rows = (flat == e).nonzero().squeeze(1)
        tok, slot = rows // k, rows % k
        h = F.linear(x[tok], w13[e])
        act = F.silu(h[:, :inter]) * h[:, inter:]
        y = F.linear(act, w2[e])
        terms[tok, slot] = y.float() * topk_weights[tok, slot].float()[:, None]
    return terms.sum(1).to(x.dtype)


# ----------------------------------------------------------------------------------------------- dispatch


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """The module doc's op. x [T, H] contiguous; w13, w2 contiguous, x's dtype."""
    report.record("fused_moe", "torch reference")
    return fused_experts_reference(x, w13, w2, topk_weights, topk_ids)
