"""Which linear layer a checkpoint's scheme takes: dense, packed 4/8-bit (``QuantLinear``) or FP8 (``Fp8Linear``)."""

from __future__ import annotations

import torch

from nvllm.distributed.group import TPGroup
from nvllm.distributed.partition import LinearShard
from nvllm.layers.fp8_linear import Fp8Linear
from nvllm.layers.linear import Linear
from nvllm.layers.quant_linear import QuantLinear
from nvllm.quant.fp8 import Fp8Scheme
from nvllm.quant.plan import QuantScheme


def make_linear(in_features: int, out_features: int, bias: bool, output_sizes: list[int] | None,
                dtype: torch.dtype, scheme: QuantScheme | Fp8Scheme | None, shard: LinearShard | None = None,
                tp: TPGroup | None = None) -> Linear | QuantLinear | Fp8Linear:
    """A dense ``Linear``, or a ``QuantLinear`` (``Fp8Linear``) when the checkpoint stores this layer quantized
    (in FP8). Sizes are this rank's; ``shard`` places them in the checkpoint's tensors (None: the whole layer)."""
    if scheme is None:
        return Linear(in_features, out_features, bias, output_sizes, dtype, shard, tp)
    if isinstance(scheme, Fp8Scheme):
        return Fp8Linear(in_features, out_features, bias, output_sizes, scheme, dtype, shard, tp)
    return QuantLinear(in_features, out_features, bias, output_sizes, scheme, dtype, shard, tp)
