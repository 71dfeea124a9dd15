"""RMSNorm, with the residual add fused into the same call (HF order: residual += x, then normalise).
The math lives in nvllm/kernels/rmsnorm.py (Triton kernel + torch reference)."""

from __future__ import annotations

import torch
from torch import nn

from nvllm.kernels.partial_sum import PartialSum, finished
from nvllm.kernels.rmsnorm import fused_add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor | PartialSum, residual: torch.Tensor | None = None,
                residual_out: torch.Tensor | None = None):
        """Without residual: returns norm(x). With residual: returns (norm(x + residual), x + residual), the sum
        written into ``residual_out`` when given (a contiguous tensor of x's shape; not ``residual`` itself).
        ``x`` may be a quantized GEMV's unfinished ``PartialSum``, which the fused add finishes."""
        if residual is None:
            return rms_norm(finished(x), self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps, residual_out=residual_out)
