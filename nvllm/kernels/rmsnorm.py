"""RMSNorm, alone or with the residual add fused in (HF Llama order of operations).

``rms_norm(x, weight, eps)`` normalises each row of ``x`` (the last dimension):
``weight * (x.float() * rsqrt(mean(x.float()²) + eps)).to(x.dtype)``.
``fused_add_rms_norm(x, residual, weight, eps)`` first forms ``new_residual = x + residual`` in the input
dtype, then returns ``(rms_norm(new_residual), new_residual)``. Neither call modifies its inputs.

``x`` may be 2-D ``[T, N]`` or 3-D ``[T, H, N]`` with any leading strides (e.g. the per-head q/k views of a
fused qkv output that Qwen3's q_norm/k_norm normalise); outputs are fresh contiguous tensors. The fused add also
takes a quantized GEMV's unfinished output (``nvllm.kernels.partial_sum``): the kernel adds its bias, rounds it
to the residual's dtype — the finished GEMV's bits — and zeroes its accumulator.

This file holds the op's three parts: the torch reference, the Triton kernel and the dispatch.
"""

from __future__ import annotations

import torch

from nvllm.kernels import report
from nvllm.kernels.backend import use_triton
from nvllm.kernels import pdl
from nvllm.kernels.jit import lazy_jit
from nvllm.kernels.partial_sum import PartialSum

tl = None  # triton.language, bound by lazy_jit at the first launch

MAX_BLOCK = 65536  # widest row one program normalises (the whole row lives in registers)


_jit = lazy_jit


# ---------------------------------------------------------------------------------------------- reference


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def fused_add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual
    return rms_norm_reference(residual, weight, eps), residual


# ------------------------------------------------------------------------------------------------- Triton


def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, bias_ptr,
    n_inner, n_cols, eps,
    stride_xo, stride_xi,                     # x        [outer, inner, N] (last stride 1)
    stride_ro, stride_ri,                     # residual [outer, inner, N]
    stride_oo, stride_oi,                     # out      [outer, inner, N]
    stride_so, stride_si,                     # new residual [outer, inner, N]
    HAS_RESIDUAL: tl.constexpr,
    PARTIAL: tl.constexpr,                    # x is a PartialSum's fp32 accumulator (needs HAS_RESIDUAL)
    HAS_BIAS: tl.constexpr,                   # its bias (bias_ptr)
    BLOCK: tl.constexpr,                      # next power of two >= n_cols
    PDL: tl.constexpr,                        # programmatic dependent launch (nvllm.kernels.pdl)
    EARLY_W: tl.constexpr,                    # PDL: the weight (a parameter) loaded before the wait
):
    """One program per row: (optionally) adds the residual row in the input dtype and stores it, then
    normalises in fp32 and stores ``weight * normed.to(input dtype)`` in the output dtype. ``PARTIAL``: x is
    first finished (its bias added, rounded to the residual's dtype) and its accumulator row zeroed."""
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if EARLY_W:   # no kernel writes a norm's weight: read while the previous kernel finishes
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    o = row // n_inner
    i = row % n_inner

    # Products and sums of two 16-bit values are formed in fp32 and rounded once to the 16-bit type: the same
    # bits as a native 16-bit op (fp32 holds the exact product, and has >= 2p+2 bits for the sum).
    x_ptrs = x_ptr + o * stride_xo + i * stride_xi + cols
    xf = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    if PARTIAL:
        in_ty = res_ptr.dtype.element_ty
        if HAS_BIAS:
            xf += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        xf = xf.to(in_ty).to(tl.float32)
    else:
        in_ty = x_ptr.dtype.element_ty
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + o * stride_ro + i * stride_ri + cols, mask=mask, other=0.0).to(tl.float32)
        x = (xf + r).to(in_ty)
        tl.store(res_out_ptr + o * stride_so + i * stride_si + cols, x, mask=mask)
        xf = x.to(tl.float32)

    var = tl.sum(xf * xf, axis=0) / n_cols
    normed = (xf * tl.rsqrt(var + eps)).to(in_ty).to(tl.float32)
    if not EARLY_W:
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + o * stride_oo + i * stride_oi + cols, (w * normed).to(out_ptr.dtype.element_ty),
             mask=mask)
    if PARTIAL:   # the accumulator re-zeroed once every thread has read it (layouts differ between the reads)
        tl.debug_barrier()
        tl.store(x_ptrs, tl.zeros_like(xf), mask=mask)


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    """[N] / [T, N] / [T, H, N] / [..., H, N] as a [outer, inner, N] view (a copy only where the leading
    dimensions cannot be merged, or the last dimension is strided)."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.dim() == 1:
        return t.view(1, 1, -1)
    if t.dim() == 2:
        return t.unsqueeze(1)
    if t.dim() == 3:
        return t
    return t.flatten(0, -3)


def _launch(x: torch.Tensor | PartialSum, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            out: torch.Tensor | None, residual_out: torch.Tensor | None):
    import triton

    partial = x if isinstance(x, PartialSum) else None
    if partial is not None:
        assert residual is not None and partial.acc.dim() == 2, "a PartialSum is normed with its residual add"
        x, dtype = partial.acc, partial.dtype
    else:
        dtype = x.dtype
    n_cols = x.shape[-1]
    assert weight.shape == (n_cols,), (weight.shape, x.shape)
    out_dtype = torch.promote_types(weight.dtype, dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    assert out.shape == x.shape and out.dtype == out_dtype and out.is_contiguous(), (out.shape, out.dtype)
    new_res = None
    if residual is not None:
        new_res = torch.empty(x.shape, dtype=dtype, device=x.device) if residual_out is None else residual_out
        assert new_res.shape == x.shape and new_res.dtype == dtype and new_res.is_contiguous()
    if x.numel() == 0:
        if partial is not None:
            partial.release()
        return out, new_res
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    x3 = _as_3d(x)
    o3 = out.view(x3.shape)
    r3 = _as_3d(residual) if residual is not None else x3
    s3 = new_res.view(x3.shape) if residual is not None else o3
    n_rows = x3.shape[0] * x3.shape[1]
    block = triton.next_power_of_2(n_cols)
    # Triton layer-norm tutorial heuristic: about 256 bytes of a row per warp, 1 to 8 warps
    num_warps = min(max(block * dtype.itemsize // 256, 1), 8)
    bias = partial.bias if partial is not None else None
    pdl_args = pdl.launch_args(x)
    _jit(_rms_norm_kernel)[(n_rows,)](
        x3, r3, weight, o3, s3, bias if bias is not None else weight,
        x3.shape[1], n_cols, eps,
        x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1),
        o3.stride(0), o3.stride(1), s3.stride(0), s3.stride(1),
        HAS_RESIDUAL=residual is not None, PARTIAL=partial is not None, HAS_BIAS=bias is not None,
        BLOCK=block, num_warps=num_warps, **pdl_args, EARLY_W=pdl_args["PDL"] and pdl.early_params(),
    )
    if partial is not None:
        partial.release()
    return out, new_res


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as ``rms_norm_reference``. Grid: one program per row (T, or T·H for 3-D input); BLOCK =
    next power of two >= N with a mask; 1–8 warps by row bytes. ``out``: an optional contiguous
    destination (x's shape, the promoted dtype)."""
    return _launch(x, None, weight, eps, out, None)[0]


def fused_add_rms_norm_triton(x: torch.Tensor | PartialSum, residual: torch.Tensor, weight: torch.Tensor,
                              eps: float, out: torch.Tensor | None = None,
                              residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``fused_add_rms_norm_reference``; one pass over each row: reads x, residual and
    weight, writes the new residual and the normed row (into ``out`` / ``residual_out`` when given). ``x`` may
    be a 2-D ``PartialSum``, finished here (module doc)."""
    dtype = x.dtype
    assert residual.shape == x.shape and residual.dtype == dtype, (x.shape, dtype, residual.shape, residual.dtype)
    return _launch(x, residual, weight, eps, out, residual_out)


# ----------------------------------------------------------------------------------------------- dispatch


def _triton_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return use_triton(x) and x.dim() >= 1 and x.shape[-1] <= MAX_BLOCK and weight.device == x.device


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _triton_fits(x, weight):
        report.record("rms_norm", "triton rms_norm")
        return rms_norm_triton(x, weight, eps)
    report.record("rms_norm", "torch reference")
    return rms_norm_reference(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor | PartialSum, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual_out``: where the new residual goes (a contiguous tensor of x's shape and dtype). ``x``: a
    tensor, or a GEMV's ``PartialSum``, finished in the same kernel when it can be."""
    fits = residual.shape == x.shape and residual.dtype == x.dtype
    if isinstance(x, PartialSum):
        if fits and _triton_fits(x.acc, weight) and x.acc.dim() == 2:
            report.record("fused_add_rms_norm", "triton fused_add_rms_norm (finishes split-K sums)")
            return fused_add_rms_norm_triton(x, residual, weight, eps, residual_out=residual_out)
        x = x.finish()
    if _triton_fits(x, weight) and fits:
        report.record("fused_add_rms_norm", "triton fused_add_rms_norm")
        return fused_add_rms_norm_triton(x, residual, weight, eps, residual_out=residual_out)
    report.record("fused_add_rms_norm", "torch reference")
    out, new_res = fused_add_rms_norm_reference(x, residual, weight, eps)
    return out, new_res if residual_out is None else residual_out.copy_(new_res)
