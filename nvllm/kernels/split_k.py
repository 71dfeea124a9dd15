"""Split-K by atomics, shared by the weight-only quantized kernels (``quant_gemm``, ``quant_gemv``).

When a layer's output tiles cannot fill the GPU, K is split across programs: each adds its partial tile into
an fp32 buffer with ``atomic_add``; the bias and the cast to the activations' dtype follow. Unsplit, a program
adds the bias and stores its tile directly. ``store_tile`` is the kernels' epilogue; ``plan_split_k``,
``split_k_output`` and ``finish_split_k`` the host side around the launch."""

from __future__ import annotations

import torch

from nvllm.kernels.backend import eager_triton

triton, tl, _jit = eager_triton()  # jitted at import (the CPU tests reload under the interpreter)


@_jit
def store_tile(out_ptrs, acc, mask_mn, bias_ptr, offs_n, mask_n, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr):
    """Write one fp32 ``[BLOCK_M, BLOCK_N]`` tile: added atomically (split-K), or with its bias and cast."""
    if ATOMIC:   # relaxed: the reader is a later kernel, which the launch boundary orders after every add
        tl.atomic_add(out_ptrs, acc, mask=mask_mn, sem="relaxed")
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=mask_mn)


def plan_split_k(tiles: int, K: int, block_k: int, device: torch.device, split_k: int | None) -> tuple[int, int]:
    """(splits, K range of one split, a multiple of block_k). ``split_k=None``: split K until about two waves of
    programs fill the GPU (at most 32 splits, at least two K tiles each)."""
    k_tiles = -(-K // block_k)
    if split_k is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        split_k = max(1, min(-(-2 * sms // tiles), k_tiles // 2, 32))
    k_per_split = -(-k_tiles // max(1, split_k)) * block_k
    return -(-K // k_per_split), k_per_split


def split_k_output(M: int, N: int, x: torch.Tensor, split_k: int) -> torch.Tensor:
    """The launch's output: a zeroed fp32 buffer for split-K, else ``[M, N]`` in x's dtype."""
    if split_k > 1:
        return torch.zeros((M, N), device=x.device, dtype=torch.float32)
    return torch.empty((M, N), device=x.device, dtype=x.dtype)


def finish_split_k(out: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype, split_k: int) -> torch.Tensor:
    """After a split-K launch: add the bias and cast; unsplit outputs are final already."""
    if split_k <= 1:
        return out
    if bias is not None:
        out += bias.float()
    return out.to(dtype)
