"""FP8-weight linear layer (``nvllm.quant.fp8``'s checkpoints, or a 16/32-bit one quantized while it loads),
running through ``fp8_gemm``.

The layer holds ``weight`` (``float8_e4m3fn [out, in]``) and one fp32 scale per output row and input block,
under the checkpoint's scale name (``weight_scale`` or ``weight_scale_inv``). A fused projection (q/k/v,
gate/up) is filled shard by shard as the dense ``Linear`` is: each checkpoint scale — one per tensor, per row or
per block — is spread over its shard's rows, so shards need not align with the checkpoint's blocks.
``input_scale`` (static activation schemes) is kept per shard and not applied (``nvllm.kernels.fp8_gemm`` runs
W8A16, or W8A8 with scales it computes from the activations). Once loaded, the layer also keeps its scales as the
W8A8 products take them (``prepare_w8a8``).

Tensor parallelism: column-parallel ranks keep their rows of the weight and of the scales; row-parallel ranks
their inputs and the scale columns of those inputs (the split must fall on whole input blocks:
``check_tensor_parallel``). A layer quantized at load quantizes the rank's own piece.
"""

from __future__ import annotations

import torch
from torch import nn

from nvllm.config import ConfigError
from nvllm.distributed.group import TPGroup
from nvllm.distributed.partition import LinearShard, Part, take_shard
from nvllm.kernels.activation import silu_and_mul
from nvllm.kernels.attention_partials import finished_attention
from nvllm.kernels import fp8_gemm
from nvllm.kernels.fp8_gemm import fp8_linear
from nvllm.kernels.fp8_w8a8 import block_scaled_mm_runs, scaled_mm_runs, w8a8_weight_scales
from nvllm.layers.linear import Linear, sum_over_ranks
from nvllm.quant.fp8 import FP8_DTYPE, FP8_MAX, Fp8Scheme, quantize_rows, scale_rows

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Fp8Linear(nn.Module):
    """y = x Wᵀ + b with W stored in FP8. Same construction arguments as ``Linear`` plus the scheme."""

    def __init__(self, in_features: int, out_features: int, bias: bool, output_sizes: list[int] | None,
                 scheme: Fp8Scheme, dtype: torch.dtype | None = None, shard: LinearShard | None = None,
                 tp: TPGroup | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.output_sizes = output_sizes or [out_features]
        assert sum(self.output_sizes) == out_features
        self.scheme = scheme
        self.shard = shard
        self.tp = tp if shard is not None and shard.row_parallel else None
        self.block_k = scheme.group_for(in_features)
        kb = -(-in_features // self.block_k)
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        self.scale_name = scheme.scale_name
        scale = torch.ones(out_features, kb, dtype=torch.float32)
        if scheme.online:   # made with the weight, not read: a buffer, which the loader does not ask for
            self.register_buffer(scheme.scale_name, scale)
        else:
            self.register_parameter(scheme.scale_name, nn.Parameter(scale, requires_grad=False))
        if scheme.static_inputs:   # one per checkpoint module (shard), kept with the weights, not applied
            self.input_scale = nn.Parameter(torch.ones(len(self.output_sizes), dtype=torch.float32),
                                            requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.dtype = dtype                                         # the activations' (the model's)
        self.w8a8_scales: dict[str, torch.Tensor] | None = None   # see prepare_w8a8

    @property
    def scale(self) -> torch.Tensor:
        return getattr(self, self.scale_name)

    # ---- loading -------------------------------------------------------------------------------------------
    shard_slice = Linear.shard_slice   # the rows of output shard ``shard`` in the fused layer

    def _rows(self, shard: int | None) -> Part | None:
        """This rank's output rows of checkpoint shard ``shard`` (None: all of them)."""
        if self.shard is None or self.shard.outputs is None:
            return None
        return self.shard.outputs[shard or 0]

    def _full_in(self) -> int:
        return self.shard.inputs.total if self.shard is not None and self.shard.row_parallel else self.in_features

    def load_tensor(self, leaf: str, shard: int | None, tensor: torch.Tensor, ckpt_name: str) -> None:
        """Copy this rank's piece of one checkpoint tensor (a whole layer, or shard ``shard`` of a fused one)."""
        rows = self._rows(shard)
        sl = self.shard_slice(shard)
        inputs = self.shard.inputs if self.shard is not None and self.shard.row_parallel else None
        if leaf == "input_scale":
            if tensor.numel() != 1:
                raise ConfigError(f"{ckpt_name!r} must hold one per-tensor scale, got shape {tuple(tensor.shape)}")
            self.input_scale.data[shard or 0] = tensor.float().reshape(())
            return
        if leaf == "bias":
            cuts = {0: rows} if rows is not None else {}
            self.bias.data[sl].copy_(take_shard(tensor, (sl.stop - sl.start,), cuts, ckpt_name))
            return
        full_rows = rows.total if rows is not None else sl.stop - sl.start
        if leaf == self.scale_name:   # (online: a buffer, never a checkpoint tensor)
            try:
                per_row = scale_rows(tensor, self.scheme, full_rows, self._full_in(), ckpt_name)
            except ValueError as e:
                raise ConfigError(str(e)) from None
            cuts = {} if rows is None else {0: rows}
            if inputs is not None and per_row.shape[1] > 1:
                cuts[1] = inputs.per(self.block_k)
            dst = self.scale.data[sl]
            dst.copy_(take_shard(per_row, tuple(dst.shape), cuts, ckpt_name))
            return
        if leaf != "weight":
            raise ConfigError(f"unexpected tensor {ckpt_name!r} for an FP8 layer")
        cuts = {} if rows is None else {0: rows}
        if inputs is not None:
            cuts[1] = inputs
        dst = self.weight.data[sl]
        piece = take_shard(tensor, tuple(dst.shape), cuts, ckpt_name)
        if self.scheme.online:
            if tensor.dtype not in FLOAT_DTYPES:
                raise ConfigError(f"{ckpt_name!r} is {tensor.dtype}: --quantization fp8 quantizes 16/32-bit "
                                  f"weights; a quantized checkpoint is served with its own quantization_config")
            q, s = quantize_rows(piece.to(dst.device))
            dst.copy_(q)
            self.scale.data[sl].copy_(s)
            return
        if tensor.dtype != FP8_DTYPE:
            raise ConfigError(f"{ckpt_name!r} must be float8_e4m3fn, got {tensor.dtype}")
        dst.copy_(piece)

    @torch.no_grad()
    def init_dummy(self, generator: torch.Generator) -> None:
        """Random codes over the whole FP8 range with scales that keep |w| ≲ 0.01: for ``load_format=dummy``."""
        w = torch.rand(self.weight.shape, generator=generator, device=self.weight.device) * 2 - 1
        self.weight.data.copy_((w * FP8_MAX).to(FP8_DTYPE))
        self.scale.data.fill_(1e-2 / FP8_MAX)
        if self.scheme.static_inputs:
            self.input_scale.data.fill_(1.0)
        if self.bias is not None:
            self.bias.data.uniform_(-1e-2, 1e-2, generator=generator)

    def prepare_w8a8(self) -> None:
        """After loading (the loader calls it, before any CUDA graph capture): the weight's scales as the block-wise
        W8A8 products take them (``w8a8_weight_scales``), where they run on this GPU (``fp8_linear`` picks among
        them by the number of rows): bf16 activations, both sides multiples of 16. None elsewhere. Both products are
        tried on the GPU now, outside any capture (``scaled_mm_runs``), so a prefill graph captured before any eager
        product of many rows still takes them."""
        self.w8a8_scales = None
        if not fp8_gemm.W8A8_MIN_M or self.dtype != torch.bfloat16 or self.out_features % 16 or self.in_features % 16:
            return
        if self.weight.device.type == "cuda":
            scaled_mm_runs(self.weight.device, "row")
        if block_scaled_mm_runs(self.weight.device):
            self.w8a8_scales = w8a8_weight_scales(self.scale, self.block_k, self.in_features) or None

    # ---- forward -------------------------------------------------------------------------------------------
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``SiLU(gate) · up`` of this gate/up layer's output."""
        return silu_and_mul(self(x))

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None, partial: bool = False,
                reduce: bool = True) -> torch.Tensor:
        """As ``Linear.forward``: ``out`` an optional destination, ``partial`` unused (outputs are finished),
        ``x`` may be a split decode attention's unmerged partials; ``reduce=False`` leaves a row-parallel
        layer's partial output to ``sum_over_ranks``."""
        x = finished_attention(x)
        if self.tp is None or self.tp.size == 1:
            y = fp8_linear(x, self.weight, self.scale, self.block_k, self.bias, self.w8a8_scales)
            return y if out is None else out.copy_(y)
        y = fp8_linear(x, self.weight, self.scale, self.block_k, w8a8_scales=self.w8a8_scales)
        return sum_over_ranks(self, y, out) if reduce else y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme.describe()}"
