"""Sampling's argmax over the vocabulary in one launch: greedy (``greedy_argmax``) and Gumbel-max
(``gumbel_argmax``: ``argmax(x / T − log E)``, E ~ Exp(1), a draw from ``softmax(x / T)``).

torch's argmax of a ``[rows, 152064]`` fp32 row set is a memset and a reduction kernel: 11.8–12.2 µs of a batch-1
decode step's critical path on the H200 (PERF.md, runs CA and CC). Here each program takes the max of one block of
a row and its first index, writes both to a workspace and takes a ticket; the row's last program reduces the
blocks' maxima (the first block holding the row's max gives the index) and re-arms the ticket for the next
launch: 5.6–6.2 µs (run CJ). Sampling at a temperature ran a pinned copy of the temperatures, a division, a
softmax, the noise, a second division and that argmax; with one temperature for the batch it is now the noise and
this kernel, which scales x and subtracts log E as it loads them.

Ties go to the lowest index and a NaN counts as the largest value, as in ``torch.argmax`` (the reference,
``greedy_argmax_reference``). The workspace is one per device, like ``quant_gemv``'s: calls on concurrent
streams must not share a device.
"""

from __future__ import annotations

import torch

from nvllm.kernels.backend import eager_triton, use_triton

triton, tl, _jit = eager_triton()  # jitted at import (the CPU tests reload under the interpreter)

BLOCK = 4096
MAX_BLOCKS = 1024   # a row of up to 4M entries


@_jit
def _first_max(vals, pos, valid, END: tl.constexpr):
    """(max, lowest ``pos`` holding it) over the ``valid`` entries of ``vals``; a NaN beats every number."""
    isnan = (vals != vals) & valid
    any_nan = tl.max(isnan.to(tl.int32), axis=0) > 0
    top = tl.max(tl.where(isnan | ~valid, float("-inf"), vals), axis=0)
    pick = tl.where(any_nan, isnan, (vals == top) & valid)
    return tl.where(any_nan, float("nan"), top), tl.min(tl.where(pick, pos, END), axis=0)


@_jit
def _argmax_kernel(x_ptr, noise_ptr, scale_ptr, out_ptr, val_ptr, idx_ptr, cnt_ptr, V, stride_x, stride_noise,
                   scale, NOISE: tl.constexpr, ROW_SCALES: tl.constexpr, BLOCK: tl.constexpr,
                   BLOCKS: tl.constexpr):
    """argmax of each row of x, or with ``NOISE`` of ``scale · x − log(noise)`` (Gumbel-max sampling; the row's
    own scale from ``scale_ptr`` with ``ROW_SCALES``)."""
    row = tl.program_id(0)
    blk = tl.program_id(1)
    nblk = tl.num_programs(1)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    if NOISE:
        e = tl.load(noise_ptr + row.to(tl.int64) * stride_noise + offs, mask=offs < V, other=1.0).to(tl.float32)
        if ROW_SCALES:
            scale = tl.load(scale_ptr + row)
        x = x * scale - tl.log(e)
    best, first = _first_max(x, offs, offs < V, V)
    slot = row * nblk + blk
    tl.store(val_ptr + slot, best)
    tl.store(idx_ptr + slot, first)
    ticket = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel")   # the stores above before the ticket
    if ticket == nblk - 1:                                   # the row's last block: reduce every block's
        b = tl.arange(0, BLOCKS)
        ok = b < nblk
        vals = tl.load(val_ptr + row * nblk + b, mask=ok, other=float("-inf"), cache_modifier=".cg")
        idxs = tl.load(idx_ptr + row * nblk + b, mask=ok, other=0, cache_modifier=".cg")
        _, top_blk = _first_max(vals, b, ok, BLOCKS)           # blocks in index order: the first one wins
        tl.store(out_ptr + row, tl.sum(tl.where(b == top_blk, idxs, 0), axis=0).to(tl.int64))
        tl.atomic_xchg(cnt_ptr + row, 0)                     # re-armed for the next launch


_WORKSPACES: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device, slots: int, rows: int):
    held = _WORKSPACES.get(device)
    if held is None or held[0].numel() < slots or held[2].numel() < rows:
        n, r = max(slots, 1 << 16), max(rows, 1024)
        held = (torch.empty(n, device=device, dtype=torch.float32), torch.empty(n, device=device, dtype=torch.int32),
                torch.zeros(r, device=device, dtype=torch.int32))
        _WORKSPACES[device] = held
    return held


def greedy_argmax_reference(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def argmax_kernel_fits(logits: torch.Tensor) -> bool:
    """Whether ``greedy_argmax`` runs the kernel for these logits (``use_triton``, a 2-D tensor with contiguous
    rows of at most ``MAX_BLOCKS`` blocks)."""
    return (use_triton(logits) and logits.dim() == 2 and logits.shape[0] > 0 and logits.stride(-1) == 1
            and 0 < logits.shape[1] <= BLOCK * MAX_BLOCKS)


def _launch(x: torch.Tensor, noise: torch.Tensor | None, scale: float | torch.Tensor) -> torch.Tensor:
    rows, V = x.shape
    nblk = triton.cdiv(V, BLOCK)
    out = torch.empty(rows, device=x.device, dtype=torch.int64)
    vals, idxs, cnt = _workspace(x.device, rows * nblk, rows)
    row_scales = isinstance(scale, torch.Tensor)
    _argmax_kernel[(rows, nblk)](x, x if noise is None else noise, scale if row_scales else x, out, vals, idxs, cnt,
                                 V, x.stride(0), 0 if noise is None else noise.stride(0),
                                 1.0 if row_scales else float(scale), NOISE=noise is not None,
                                 ROW_SCALES=row_scales, BLOCK=BLOCK, BLOCKS=triton.next_power_of_2(nblk),
                                 num_warps=8)
    return out


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` (int64): the kernel where ``argmax_kernel_fits``, else torch's."""
    if not argmax_kernel_fits(logits):
        return greedy_argmax_reference(logits)
    return _launch(logits, None, 1.0)


def gumbel_argmax_reference(x: torch.Tensor, noise: torch.Tensor, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """A draw from ``softmax(scale · x)`` per row given ``noise`` ~ Exp(1) of x's shape: ``argmax(p / noise)``,
    which orders tokens as ``scale · x − log(noise)`` does (Gumbel-max). ``scale``: one for every row or one per
    row (a float32 tensor)."""
    s = scale[:, None] if isinstance(scale, torch.Tensor) else scale
    return ((x * s).softmax(dim=-1) / noise).argmax(dim=-1)


def gumbel_argmax(x: torch.Tensor, noise: torch.Tensor, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """``argmax(scale · x − log(noise))`` per row in one launch (no softmax pass): the token the reference draws,
    up to the rounding of the two forms. The reference where the kernel does not fit."""
    if not (argmax_kernel_fits(x) and noise.shape == x.shape and noise.stride(-1) == 1):
        return gumbel_argmax_reference(x, noise, scale)
    if isinstance(scale, torch.Tensor):
        scale = scale.to(torch.float32).contiguous()
    return _launch(x, noise, scale)
