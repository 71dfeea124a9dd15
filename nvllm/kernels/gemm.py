"""Dense GEMM for the linear layers: y = x Wᵀ (+ b). torch.nn.functional.linear (cuBLAS on GPU) for now;
the kernel report names it so a quantized layer (`quant_gemm`) is told apart in the logs."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nvllm.kernels import report


def gemm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    report.record("gemm", "torch F.linear (cuBLAS)" if x.is_cuda else "torch F.linear (cpu)")
    return F.linear(x, weight, bias)
