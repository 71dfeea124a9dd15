"""LoRALinear: a decoder linear (dense or quantized) plus the LoRA adapters on the device for it, applied per token.

The adapters sit in fixed slots of two stacks per linear, allocated once for ``max_loras`` adapters of
``max_lora_rank`` (each fused projection's ranks side by side): A ``[slots, R, in]`` and B ``[slots, out, R]``, slot
s's first ``ranks[s]`` rows of A (columns of B) holding its adapter, its fused A's and block-diagonal B
(``nvllm.lora.adapter``). y = base(x) + B_s (A_s x) for each token of an adapter in slot s, two ways by the
step's ``LoRAMapping``:

* ``slots`` (decode steps, and the decode CUDA graphs, which capture it as a static buffer): a slot per token,
  −1 for the base model; two kernels a linear whatever adapters run (``nvllm.kernels.lora``).
* ``rows`` (steps with prompt chunks): each adapter's token rows; one pair of matmuls per adapter in the batch.

Tokens of the base model pay nothing in the second form; a step with no adapter token has no mapping at all. The
base keeps its own kernel (its ``gemm`` / ``quant_gemm``); its output is finished here (no split-K partial sums,
no SiLU in its epilogue). With tensor parallelism the slots hold this rank's piece (``nvllm.lora.adapter``), and a
row-parallel linear adds B·(A x) for its slice of the inputs to its partial output before the ranks' sum."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from nvllm.kernels.activation import silu_and_mul
from nvllm.kernels.attention_partials import finished_attention
from nvllm.kernels import report
from nvllm.kernels.lora import lora_apply
from nvllm.layers.linear import sum_over_ranks
from nvllm.lora.adapter import LoRAWeights


@dataclass
class LoRAMapping:
    """The step's tokens by adapter: ``rows`` (slot → row indices, long tensors on the model's device) or ``slots``
    (one slot per token, −1 for the base model; a tensor on the model's device)."""

    rows: dict[int, torch.Tensor] | None = None
    slots: torch.Tensor | None = None


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
    def __init__(self, base: nn.Module, slots: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.base = base
        self.output_sizes = base.output_sizes
        rank = max_rank * len(base.output_sizes)
        self.a = torch.zeros(slots, rank, base.in_features, dtype=dtype, device=device)
        self.b = torch.zeros(slots, base.out_features, rank, dtype=dtype, device=device)
        self.ranks = torch.zeros(slots, dtype=torch.int32, device=device)
        self.slot_ranks = [0] * slots  # the same, on the host

    def shard_slice(self, shard: int | None) -> slice:
        return self.base.shard_slice(shard)

    def load(self, slot: int, w: LoRAWeights | None) -> None:
        """Put an adapter's weights for this linear in ``slot`` (None: the adapter leaves this linear alone)."""
        r = 0 if w is None else w.a.shape[0]
        if r:  # in stream order: after every step already queued, before the next (non-blocking from pinned memory)
            self.a[slot, :r].copy_(w.a, non_blocking=True)
            self.b[slot, :, :r].copy_(w.b, non_blocking=True)
        self.ranks[slot] = r
        self.slot_ranks[slot] = r

    def forward(self, x, out: torch.Tensor | None = None, partial: bool = False) -> torch.Tensor:
        x = finished_attention(x)  # o_proj's input may be a split decode attention's unmerged partials
        split = self.base.tp is not None and self.base.tp.size > 1  # row-parallel: add to this rank's partial
        y = self.base(x, reduce=False) if split else self.base(x)
        mapping = _current
        if mapping is not None and mapping.slots is not None:
            lora_apply(y, x, self.a, self.b, self.ranks, mapping.slots)
        elif mapping is not None:
            report.record("lora", "torch matmuls per adapter (prompt rows)")
            for slot, rows in mapping.rows.items():
                r = self.slot_ranks[slot]
                if r:
                    y.index_add_(0, rows, (x.index_select(0, rows) @ self.a[slot, :r].T) @ self.b[slot, :, :r].T)
        if split:
            return sum_over_ranks(self.base, y, out)
        return y if out is None else out.copy_(y)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(self(x))

    def extra_repr(self) -> str:
        return f"slots={self.a.shape[0]}, max_rank={self.a.shape[1]}"
