"""LoRALinear: a decoder linear (dense or quantized) plus the LoRA adapters loaded for it, applied per token.

y = base(x) + Σ_adapters (x[rows] Aᵀ) Bᵀ on the rows of the tokens whose sequence runs that adapter (the step's
``LoRAMapping``, set by the model runner around each forward): one pair of small matmuls per adapter present in the
batch, however many sequences share it; tokens of the base model pay nothing. The base keeps its own kernel (its
``gemm`` / ``quant_gemm``); its output is finished here (no split-K partial sums, no SiLU in its epilogue)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from nvllm.kernels.activation import silu_and_mul
from nvllm.kernels.attention_partials import finished_attention
from nvllm.lora.adapter import LoRAWeights


@dataclass
class LoRAMapping:
    """The step's tokens by adapter: adapter id → row indices (a long tensor on the model's device)."""

    rows: dict[int, torch.Tensor]


_current: LoRAMapping | None = None


@contextmanager
def lora_mapping(mapping: LoRAMapping | None):
    """The mapping the LoRA linears read during one forward."""
    global _current
    previous, _current = _current, mapping
    try:
        yield
    finally:
        _current = previous


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Module):
        super().__init__()
        self.base = base
        self.output_sizes = base.output_sizes
        self.adapters: dict[int, LoRAWeights] = {}

    def shard_slice(self, shard: int | None) -> slice:
        return self.base.shard_slice(shard)

    def forward(self, x, out: torch.Tensor | None = None, partial: bool = False) -> torch.Tensor:
        x = finished_attention(x)  # o_proj's input may be a split decode attention's unmerged partials
        y = self.base(x)
        mapping = _current
        if mapping is not None and self.adapters:
            for lora_id, rows in mapping.rows.items():
                w = self.adapters.get(lora_id)
                if w is not None:
                    y.index_add_(0, rows, (x.index_select(0, rows) @ w.a.T) @ w.b.T)
        return y if out is None else out.copy_(y)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(self(x))

    def extra_repr(self) -> str:
        return f"adapters={sorted(self.adapters)}"
