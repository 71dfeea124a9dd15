"""SiLU(gate) · up on the fused gate_up projection's output: ``x [..., 2I] → [..., I]``.

The gate half is the first I columns, the up half the last I — or, with ``interleave=B``, the layout of a
gate_up weight whose rows were interleaved in blocks of B (``interleave_rows``): B gate columns, then the B up
columns of the same outputs, and so on (the layout the skinny GEMM's fused SiLU·mul epilogue reads, so that one
program holds both halves of its outputs). SiLU is computed in fp32 and cast to the input dtype, then
multiplied by up in the input dtype — the rounding steps of ``F.silu(gate) * up``. The op also takes a quantized
GEMV's unfinished output (``nvllm.kernels.partial_sum``): the kernel adds its bias, rounds gate and up to the
activations' dtype — the finished GEMV's bits — and zeroes its accumulator.

This file holds the op's three parts: the torch reference, the Triton kernel and the dispatch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nvllm.kernels import pdl, report
from nvllm.kernels.backend import use_triton
from nvllm.kernels.jit import lazy_jit
from nvllm.kernels.partial_sum import PartialSum

tl = None  # triton.language, bound by lazy_jit at the first launch

BLOCK_I = 1024  # columns of the output per program
NUM_WARPS = 4   # 8 elements per thread: one 16-byte load of gate and one of up in bf16/fp16


_jit = lazy_jit


# ---------------------------------------------------------------------------------------------- reference


def interleave_rows(t: torch.Tensor, block: int) -> torch.Tensor:
    """A gate_up tensor ``[2I, ...]`` (gate rows, then up rows) → rows interleaved in blocks of ``block``:
    gate 0..B-1, up 0..B-1, gate B..2B-1, up B..2B-1, … (a new tensor)."""
    two_i = t.shape[0]
    return t.reshape(2, two_i // (2 * block), block, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()


def deinterleave_columns(x: torch.Tensor, block: int) -> torch.Tensor:
    """The inverse on an output's last dimension: ``[..., 2I]`` interleaved → ``[gate | up]``."""
    two_i = x.shape[-1]
    return x.reshape(*x.shape[:-1], two_i // (2 * block), 2, block).transpose(-3, -2).reshape(x.shape)


def silu_and_mul_reference(x: torch.Tensor, interleave: int = 0) -> torch.Tensor:
    if interleave:
        x = deinterleave_columns(x, interleave)
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


# ------------------------------------------------------------------------------------------------- Triton


def _silu_and_mul_kernel(
    x_ptr, out_ptr, bias_ptr,
    stride_xt, stride_ot,                     # x [T, 2I], out [T, I] (last strides 1)
    inter,                                    # I
    BLOCK: tl.constexpr,
    INTERLEAVE: tl.constexpr,                 # 0: [gate | up]; B: interleaved in blocks of B (module doc)
    PARTIAL: tl.constexpr,                    # x is a PartialSum's fp32 accumulator ([gate | up])
    HAS_BIAS: tl.constexpr,                   # its bias (bias_ptr, [2I])
    PDL: tl.constexpr,                        # programmatic dependent launch (nvllm.kernels.pdl)
):
    """Program (t, j): output columns [j·BLOCK, (j+1)·BLOCK) of row t. ``PARTIAL``: gate and up are first
    finished (bias added, rounded to the output dtype) and their accumulator entries zeroed."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    row = x_ptr + t * stride_xt
    if INTERLEAVE:  # whole blocks (I % B == 0): each block's 2B contiguous inputs in one load, split in registers
        NB: tl.constexpr = BLOCK // INTERLEAVE
        blk = tl.program_id(1) * NB + tl.arange(0, NB)
        both = tl.load(row + blk[:, None] * (2 * INTERLEAVE) + tl.arange(0, 2 * INTERLEAVE)[None, :],
                       mask=(blk < inter // INTERLEAVE)[:, None], other=0.0).to(tl.float32)
        gate, up = tl.split(tl.permute(tl.reshape(both, (NB, 2, INTERLEAVE)), (0, 2, 1)))
        gate = tl.reshape(gate, (BLOCK,))
        up = tl.reshape(up, (BLOCK,))
    else:
        gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    out_ty = out_ptr.dtype.element_ty
    if PARTIAL:
        if HAS_BIAS:
            gate += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            up += tl.load(bias_ptr + inter + cols, mask=mask, other=0.0).to(tl.float32)
        gate = gate.to(out_ty).to(tl.float32)
        up = up.to(out_ty).to(tl.float32)
    # silu rounded to the input dtype, then the product formed in fp32 (exact for two 16-bit values) and
    # rounded once: the bits of F.silu(gate) * up
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + cols, (act * up).to(out_ty), mask=mask)
    if PARTIAL:   # the accumulator re-zeroed once every thread has read it (a thread may hold another's bias)
        tl.debug_barrier()
        tl.store(row + cols, tl.zeros_like(gate), mask=mask)
        tl.store(row + inter + cols, tl.zeros_like(up), mask=mask)


def silu_and_mul_triton(x: torch.Tensor | PartialSum, out: torch.Tensor | None = None,
                        interleave: int = 0) -> torch.Tensor:
    """Same contract as ``silu_and_mul_reference``. Grid: (T, cdiv(I, BLOCK_I)); BLOCK_I = 1024 output
    columns per program (fewer for a smaller I), 4 warps. ``out``: an optional contiguous destination. ``x`` may
    be a 2-D ``PartialSum`` ([gate | up]), finished here (module doc)."""
    import triton

    partial = x if isinstance(x, PartialSum) else None
    dtype = x.dtype
    if partial is not None:
        x = partial.acc
        assert x.dim() == 2 and not interleave, "a PartialSum holds [gate | up] rows"
    inter = x.shape[-1] // 2
    assert x.shape[-1] == 2 * inter and (not interleave or inter % interleave == 0), (x.shape, interleave)
    if out is None:
        out = torch.empty(*x.shape[:-1], inter, dtype=dtype, device=x.device)
    assert out.shape == (*x.shape[:-1], inter) and out.dtype == dtype and out.is_contiguous(), out.shape
    if out.numel() == 0:
        if partial is not None:
            partial.release()
        return out
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    o2 = out.view(-1, inter)
    block = min(BLOCK_I, triton.next_power_of_2(inter))
    bias = partial.bias if partial is not None else None
    _jit(_silu_and_mul_kernel)[(x2.shape[0], triton.cdiv(inter, block))](
        x2, o2, bias if bias is not None else o2, x2.stride(0), o2.stride(0), inter,
        BLOCK=block, INTERLEAVE=interleave, PARTIAL=partial is not None, HAS_BIAS=bias is not None,
        num_warps=NUM_WARPS if block >= 1024 else max(block // 256, 1), **pdl.launch_args(x),
    )
    if partial is not None:
        partial.release()
    return out


# ----------------------------------------------------------------------------------------------- dispatch


def silu_and_mul(x: torch.Tensor | PartialSum, interleave: int = 0) -> torch.Tensor:
    """``interleave``: 0 for ``[gate | up]``, else the block of an interleaved layout (module doc). ``x``: a
    tensor, or a GEMV's ``PartialSum``, finished in the same kernel when it can be."""
    if isinstance(x, PartialSum):
        if use_triton(x.acc) and x.acc.dim() == 2 and not interleave:
            report.record("silu_and_mul", "triton silu_and_mul (finishes split-K sums)")
            return silu_and_mul_triton(x)
        x = x.finish()
    if use_triton(x):
        report.record("silu_and_mul", "triton silu_and_mul")
        return silu_and_mul_triton(x, interleave=interleave)
    report.record("silu_and_mul", "torch reference")
    return silu_and_mul_reference(x, interleave)
