"""GPTQ: quantize a linear column by column, each rounding error compensated on the not-yet-quantized columns
through the inverse Hessian of the layer's reconstruction loss.

For one linear ``W [out, in]`` with calibration inputs ``x``: ``H = 2/n Σ x xᵀ`` (``[in, in]``). Dead inputs
(``H_ii = 0``) get ``H_ii = 1`` and zero weights; ``H += damp · mean(diag H) · I``; the upper Cholesky factor
``U`` of ``H⁻¹`` gives, for column ``i`` with rounding error ``e = (w_i − q_i) / U_ii``, the update
``W[:, j] −= e · U_ij`` for the columns ``j > i``. Updates stay inside a block of ``block_size`` columns and are
applied to the rest of the matrix once per block (lazy batch updates). Scales and zero points are found for
each group of ``group_size`` columns when its first column comes up, from the weights as updated by the blocks
before (the updates within the current block are not seen), as AutoGPTQ and GPTQModel find them.

Act-order (``desc_act``) processes the columns by decreasing ``H_ii``. With static groups the group
parameters are computed once, up front, on the original column order, so groups stay contiguous (``g_idx`` is
the plain ``k // group_size``); without, groups follow the processing order and ``g_idx`` records it.
"""

from __future__ import annotations

import logging

import torch

from nvllm.kernels.gptq_block import gptq_block
from nvllm.quant.formats import GroupQuant, act_order_g_idx, default_g_idx
from nvllm.quant.rtn import Grid, find_params

logger = logging.getLogger("nvllm")


def inverse_hessian_factor(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + λI)⁻¹``, ``λ = damp · mean(diag H)``; λ grows tenfold (up to 4 times)
    when ``H + λI`` is not positive definite in float32."""
    lam = damp * torch.mean(torch.diag(h))
    eye = torch.eye(h.shape[0], device=h.device, dtype=h.dtype)
    for attempt in range(5):
        try:
            low = torch.linalg.cholesky(h + lam * eye)
            return torch.linalg.cholesky(torch.cholesky_inverse(low), upper=True)
        except torch.linalg.LinAlgError:
            if attempt == 4:
                raise
            lam = lam * 10 if lam > 0 else torch.tensor(1e-6, device=h.device)
            logger.warning("GPTQ: Hessian not positive definite; dampening raised to %.3g", float(lam))
    raise AssertionError("unreachable")


@torch.no_grad()
def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, grid: Grid, group_size: int, *,
                  damp: float = 0.01, block_size: int = 128, act_order: bool = False,
                  static_groups: bool = True) -> GroupQuant:
    """GPTQ of ``weight [out, in]`` given ``hessian [in, in]`` → its integer form (codes, scales, zeros, g_idx)."""
    w = weight.detach().float().clone()
    h = hessian.detach().float().clone()
    out_f, in_f = w.shape
    g = group_size
    n_groups = in_f // g
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0

    static = None
    if static_groups:   # parameters of each contiguous group, from the original weights
        static = find_params(w.reshape(out_f, n_groups, g), grid)          # ([out, G], [out, G])

    perm = None
    if act_order:
        perm = torch.argsort(torch.diag(h), descending=True)
        w, h = w[:, perm], h[perm][:, perm]
    u = inverse_hessian_factor(h, damp)

    codes = torch.zeros_like(w)
    scales = torch.zeros(n_groups, out_f, device=w.device)
    zeros = torch.zeros(n_groups, out_f, device=w.device)
    if static is not None:
        scales, zeros = static[0].t().contiguous(), static[1].t().contiguous()
    # row of the scales/zeros tables for each processed column: its original group with static groups, else
    # the processing order's group
    col_groups = perm // g if (static is not None and perm is not None) else \
        torch.arange(in_f, device=w.device) // g
    for b0 in range(0, in_f, block_size):
        b1 = min(b0 + block_size, in_f)
        w1 = w[:, b0:b1].clone()
        err1 = torch.zeros_like(w1)
        u1 = u[b0:b1, b0:b1]
        # without static groups the block is split at each group start, whose parameters come from the weights
        # as the block found them (columns past the block: as the blocks before left them), as AutoGPTQ's
        # find_params(W[:, i:i + g]) takes them: the in-block updates reach w only at the block's end
        cuts = {0, b1 - b0} if static is not None else \
            {0, b1 - b0, *(i for i in range(b1 - b0) if (b0 + i) % g == 0)}
        bounds = sorted(cuts)
        for s0, s1 in zip(bounds[:-1], bounds[1:]):
            col = b0 + s0
            if static is None and col % g == 0:
                scales[col // g], zeros[col // g] = find_params(w[:, col:col + g], grid)
            gptq_block(w1, u1, codes[:, b0:b1], err1, scales, zeros, col_groups[b0:b1], s0, s1, grid.maxq)
        w[:, b1:] -= err1 @ u[b0:b1, b1:]

    if perm is not None:
        inv = torch.argsort(perm)
        codes = codes[:, inv]
        g_idx = default_g_idx(in_f, g, w.device) if static_groups else act_order_g_idx(perm, g)
    else:
        g_idx = default_g_idx(in_f, g, w.device)
    return GroupQuant(q=codes.to(torch.int32), scales=scales.to(torch.float16), zeros=zeros.to(torch.int32),
                      g_idx=g_idx, bits=grid.bits, group_size=g)
