"""Linear layers. Dense weights run through `gemm`; merged projections (q/k/v, gate/up) are one parameter
filled shard by shard by the loader.

Tensor parallelism: a column-parallel layer holds its rank's slice of each output shard; a row-parallel layer
holds its rank's slice of the inputs, sums the ranks' partial outputs (one all-reduce) and adds its bias once,
after the sum. ``load_tensor`` takes a full checkpoint tensor and keeps this rank's piece."""

from __future__ import annotations

import torch
from torch import nn

from nvllm.config import ConfigError
from nvllm.distributed.group import TPGroup
from nvllm.distributed.partition import LinearShard, take_shard
from nvllm.kernels.activation import interleave_rows, silu_and_mul
from nvllm.kernels.attention_partials import finished_attention
from nvllm.kernels.gemm import SkinnyConfig, gemm, gemm_choice, gemm_silu_and_mul


class Linear(nn.Module):
    """y = x Wᵀ + b with W [out, in]. ``output_sizes`` splits the output into shards the checkpoint stores as
    separate tensors (e.g. q, k, v), loaded into one fused parameter. Sizes are this rank's; ``shard`` places
    them in the checkpoint's tensors (None: the layer is whole), ``tp`` sums a row-parallel layer's outputs."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 output_sizes: list[int] | None = None, dtype: torch.dtype | None = None,
                 shard: LinearShard | None = None, tp: TPGroup | None = None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.output_sizes = output_sizes or [out_features]
        assert sum(self.output_sizes) == out_features
        self.shard = shard
        self.tp = tp if shard is not None and shard.row_parallel else None
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.interleave = 0  # a gate_up layer whose rows were interleaved (``interleave_gate_up``): the block

    def shard_slice(self, shard: int | None) -> slice:
        if shard is None:
            return slice(0, self.out_features)
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])

    def load_tensor(self, leaf: str, shard: int | None, tensor: torch.Tensor, ckpt_name: str) -> None:
        """Copy this rank's piece of checkpoint tensor ``leaf`` ("weight" / "bias"; output shard ``shard`` of a
        fused layer) into place."""
        dst = getattr(self, leaf).data
        if not tensor.dtype.is_floating_point or tensor.element_size() == 1:
            raise ConfigError(f"{ckpt_name!r} is {str(tensor.dtype).removeprefix('torch.')}, a quantized weight, in a "
                              "layer the checkpoint's quantization config leaves in full precision (is its scale "
                              "missing?)")
        if shard is not None:
            dst = dst[self.shard_slice(shard)]
        cuts = {}
        if self.shard is not None and self.shard.outputs is not None:
            cuts[0] = self.shard.outputs[shard or 0]
        if self.shard is not None and self.shard.row_parallel and leaf == "weight":
            cuts[1] = self.shard.inputs
        dst.copy_(take_shard(tensor, tuple(dst.shape), cuts, ckpt_name))

    def interleave_gate_up(self, block: int) -> None:
        """Reorder a loaded gate/up layer's rows (and bias) in blocks of ``block`` (gate rows, then the up rows
        of the same outputs) so that ``silu_and_mul`` can run in the GEMM's epilogue. Its output is then in the
        interleaved layout; ``silu_and_mul`` is the way to consume it."""
        assert self.output_sizes[0] * 2 == self.out_features and not self.interleave and self.tp is None
        assert self.out_features % (2 * block) == 0, (self.out_features, block)
        self.weight.data = interleave_rows(self.weight.data, block)
        if self.bias is not None:
            self.bias.data = interleave_rows(self.bias.data, block)
        self.interleave = block

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``SiLU(gate) · up`` of this gate/up layer's output (in its GEMM's epilogue when interleaved)."""
        if self.interleave:
            return gemm_silu_and_mul(x, self.weight, self.bias, self.interleave)
        return silu_and_mul(self(x))

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None, partial: bool = False,
                reduce: bool = True) -> torch.Tensor:
        """``out``: an optional destination (contiguous rows), e.g. a CUDA-graph piece's static buffer.
        ``partial`` is ``QuantLinear``'s (dense GEMMs finish their outputs: always a tensor). ``x`` may be a split
        decode attention's unmerged partials (o_proj), merged first. ``reduce=False``: a row-parallel layer returns
        this rank's partial output, for ``sum_over_ranks`` to finish (LoRA adds to it first)."""
        x = finished_attention(x)
        if self.tp is None or self.tp.size == 1:
            return gemm(x, self.weight, self.bias, out=out)
        y = gemm(x, self.weight)
        return sum_over_ranks(self, y, out) if reduce else y


def sum_over_ranks(layer: nn.Module, y: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A row-parallel layer's output from this rank's partial ``y``: the sum over the ranks, then the bias once."""
    y = layer.tp.all_reduce(y)
    y = y if layer.bias is None else y + layer.bias
    return y if out is None else out.copy_(y)


GATE_UP_BLOCK = 4
"""Rows per block of an interleaved gate_up weight: the small-batch skinny configs hold 8 rows a program."""


def interleave_gate_ups(model, block: int = GATE_UP_BLOCK) -> int:
    """Interleave every dense gate/up layer of ``model`` whose batch-1 GEMM the dispatch table sends to a
    skinny config that can fuse (tiles of whole block pairs) — ``Linear.interleave_gate_up``; returns how many.
    Quantized layers, and shapes cuBLAS runs, keep their layout (their SiLU·mul stays a kernel of its own)."""
    done = 0
    for layer in model.layers:
        gate_up = getattr(layer, "gate_up_proj", None)   # none in a mixture-of-experts layer
        if not (isinstance(gate_up, Linear) and gate_up.tp is None and gate_up.out_features % (2 * block) == 0):
            continue
        n, k = gate_up.weight.shape
        choice = gemm_choice(n, k, 1, gate_up.weight.dtype)
        if isinstance(choice, SkinnyConfig) and choice.block_n % (2 * block) == 0:
            gate_up.interleave_gate_up(block)
            done += 1
    return done
