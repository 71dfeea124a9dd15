"""RMSNorm, with the residual add fused into the same call (HF order: residual += x, then normalise)."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: returns norm(x). With residual: returns (norm(x + residual), x + residual)."""
        if residual is None:
            return rms_norm_reference(x, self.weight, self.eps)
        residual = x + residual
        return rms_norm_reference(residual, self.weight, self.eps), residual
