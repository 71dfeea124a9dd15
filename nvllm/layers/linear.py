"""Linear layers. Dense weights run through `gemm`; merged projections (q/k/v, gate/up) are one parameter
filled shard by shard by the loader."""

from __future__ import annotations

import torch
from torch import nn

from nvllm.kernels.gemm import gemm


class Linear(nn.Module):
    """y = x Wᵀ + b with W [out, in]. ``output_sizes`` splits the output into shards the checkpoint stores as
    separate tensors (e.g. q, k, v), loaded into one fused parameter."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 output_sizes: list[int] | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.output_sizes = output_sizes or [out_features]
        assert sum(self.output_sizes) == out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None

    def shard_slice(self, shard: int | None) -> slice:
        if shard is None:
            return slice(0, self.out_features)
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gemm(x, self.weight, self.bias)
