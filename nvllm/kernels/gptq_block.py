"""GPTQ's column-by-column step over one lazy block (or one segment of it), in place.

For each column ``i`` in ``[start, stop)`` of the block ``w1 [out, nb]``, with the group parameters of that
column (``scale = scales[groups[i]]``, ``zero = zeros[groups[i]]``)::

    q = clamp(round(w1[:, i] / scale) + zero, 0, maxq)          # round half to even, as torch.round
    codes[:, i] = q
    e = (w1[:, i] - (q - zero) * scale) / u1[i, i]
    w1[:, i:] -= e ⊗ u1[i, i:]
    err1[:, i] = e

``u1`` is the block's ``[nb, nb]`` part of the upper Cholesky factor of ``H⁻¹``; ``codes`` and ``err1`` are
``[out, nb]`` (``codes`` may be a column slice of the full code matrix). Output rows are independent, so the
Triton kernel gives each program ``BLOCK_R`` rows and walks the columns sequentially, the rows' block held in
fp32 registers. The caller splits a block at group starts when the group parameters depend on the updated
weights (``nvllm.quant.gptq``).

This file holds the op's three parts: the torch reference, the Triton kernel and the dispatch.
"""

from __future__ import annotations

import torch

from nvllm.kernels import report
from nvllm.kernels.backend import use_triton
from nvllm.kernels.jit import lazy_jit
from nvllm.quant.rtn import round_to_grid

tl = None  # triton.language, bound by lazy_jit at the first launch

BLOCK_R = 16     # output rows per program
NUM_WARPS = 4
MAX_COLS = 256   # widest block one program holds in registers


_jit = lazy_jit


# ---------------------------------------------------------------------------------------------- reference


def gptq_block_reference(w1: torch.Tensor, u1: torch.Tensor, codes: torch.Tensor, err1: torch.Tensor,
                         scales: torch.Tensor, zeros: torch.Tensor, groups: torch.Tensor,
                         start: int, stop: int, maxq: int) -> None:
    sc, zs = scales[groups[start:stop]], zeros[groups[start:stop]]
    for i in range(start, stop):
        scale, zero = sc[i - start], zs[i - start]
        wi = w1[:, i]
        q = round_to_grid(wi, scale, zero, maxq)
        codes[:, i] = q
        e = (wi - (q - zero) * scale) / u1[i, i]
        w1[:, i:] -= e.unsqueeze(1) * u1[i, i:].unsqueeze(0)
        err1[:, i] = e


# ------------------------------------------------------------------------------------------------- Triton


def _gptq_block_kernel(
    w_ptr, u_ptr, q_ptr, err_ptr, scale_ptr, zero_ptr, grp_ptr,
    n_rows, n_cols, start, stop, maxq,
    stride_wr, stride_qr, stride_er, stride_sg,   # rows of w1 / codes / err1, groups of the tables
    stride_ur, stride_uc,                         # u1 (any layout: cholesky(upper=True) is column-major)
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,                    # next power of two >= n_cols
):
    """Program r: rows [r·BLOCK_R, (r+1)·BLOCK_R) of the block, columns start..stop-1 in order; the rows'
    updated block is written back to w1 at the end."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    rmask = rows < n_rows
    cmask = cols < n_cols
    rows64 = rows.to(tl.int64)
    tile_ptrs = w_ptr + rows64[:, None] * stride_wr + cols[None, :]
    tile_mask = rmask[:, None] & cmask[None, :]
    w = tl.load(tile_ptrs, mask=tile_mask, other=0.0).to(tl.float32)
    for j in range(start, stop):
        wi = tl.sum(tl.where(cols[None, :] == j, w, 0.0), axis=1)      # column j (one nonzero term per row)
        grp = tl.load(grp_ptr + j).to(tl.int64)
        scale = tl.load(scale_ptr + grp * stride_sg + rows, mask=rmask, other=1.0)
        zero = tl.load(zero_ptr + grp * stride_sg + rows, mask=rmask, other=0.0)
        x = tl.math.div_rn(wi, scale)
        # round half to even (torch.round): adding and removing 1.5·2²³ rounds |x| < 2²² to an integer in the
        # default round-to-nearest-even mode; larger |x| are integers already
        r = tl.where(tl.abs(x) < 4194304.0, (x + 12582912.0) - 12582912.0, x)
        q = tl.minimum(tl.maximum(r + zero, 0.0), maxq)
        tl.store(q_ptr + rows64 * stride_qr + j, q, mask=rmask)
        d = tl.load(u_ptr + j * stride_ur + j * stride_uc)
        e = tl.math.div_rn(wi - (q - zero) * scale, d)
        urow = tl.load(u_ptr + j * stride_ur + cols * stride_uc, mask=cmask & (cols >= j), other=0.0)
        w = w - e[:, None] * urow[None, :]
        tl.store(err_ptr + rows64 * stride_er + j, e, mask=rmask)
    tl.store(tile_ptrs, w, mask=tile_mask)


def gptq_block_triton(w1: torch.Tensor, u1: torch.Tensor, codes: torch.Tensor, err1: torch.Tensor,
                      scales: torch.Tensor, zeros: torch.Tensor, groups: torch.Tensor,
                      start: int, stop: int, maxq: int) -> None:
    """Same contract as ``gptq_block_reference`` (float32 tensors, last strides 1 but ``u1``'s; ``groups`` an
    integer tensor). Grid: cdiv(out, BLOCK_R) programs, each holding its rows of the whole block."""
    import triton

    n_rows, n_cols = w1.shape
    if n_rows == 0 or stop <= start:
        return
    assert n_cols <= MAX_COLS, n_cols
    assert u1.dtype == torch.float32, u1.dtype
    for t in (w1, codes, err1, scales, zeros):
        assert t.dtype == torch.float32 and t.stride(-1) == 1, (t.dtype, t.stride())
    assert scales.stride() == zeros.stride() and groups.is_contiguous()
    _jit(_gptq_block_kernel)[(triton.cdiv(n_rows, BLOCK_R),)](
        w1, u1, codes, err1, scales, zeros, groups,
        n_rows, n_cols, start, stop, float(maxq),
        w1.stride(0), codes.stride(0), err1.stride(0), scales.stride(0), u1.stride(0), u1.stride(1),
        BLOCK_R=BLOCK_R, BLOCK_C=triton.next_power_of_2(n_cols), num_warps=NUM_WARPS,
        enable_fp_fusion=False,   # separate multiply and subtract, as the torch ops round them
    )


# ----------------------------------------------------------------------------------------------- dispatch


def gptq_block(w1: torch.Tensor, u1: torch.Tensor, codes: torch.Tensor, err1: torch.Tensor,
               scales: torch.Tensor, zeros: torch.Tensor, groups: torch.Tensor,
               start: int, stop: int, maxq: int) -> None:
    """Columns ``[start, stop)`` of one GPTQ block, in place on ``w1``, ``codes`` and ``err1`` (module doc).
    ``scales``/``zeros``: ``[G, out]`` tables; ``groups``: the table row of each of the block's columns."""
    if use_triton(w1) and w1.shape[1] <= MAX_COLS:
        report.record("gptq_block", "triton gptq_block")
        gptq_block_triton(w1, u1, codes, err1, scales, zeros, groups, start, stop, maxq)
        return
    report.record("gptq_block", "torch reference")
    gptq_block_reference(w1, u1, codes, err1, scales, zeros, groups, start, stop, maxq)
