"""Weight-only quantized linear layer (AWQ-GEMM or GPTQ v1 tensors) running through ``quant_linear``.

The layer holds the checkpoint's packed tensors as they are stored (``qweight``, ``qzeros``, ``scales`` and,
for GPTQ, ``g_idx``), so a fused projection (q/k/v, gate/up) is filled shard by shard exactly as the dense
``Linear`` is: each shard's columns of the output dimension. AWQ packs 8 output columns per int32 word and
GPTQ's ``qzeros`` ``32 / bits`` of them, so a shard of ``n`` outputs covers ``n / 8`` (resp. ``n·bits / 32``)
word columns — the plan only quantizes layers whose shard sizes are whole words. ``g_idx`` (one entry per
input) is the same for every shard of a fused layer; the loader checks that they agree.
"""

from __future__ import annotations

import torch
from torch import nn

from nvllm.config import ConfigError
from nvllm.kernels.quant_gemm import quant_linear
from nvllm.quant.formats import QuantWeight, default_g_idx
from nvllm.quant.plan import QuantScheme


class QuantLinear(nn.Module):
    """y = x Wᵀ + b with W stored packed. Same construction arguments as ``Linear`` plus the scheme."""

    def __init__(self, in_features: int, out_features: int, bias: bool, output_sizes: list[int] | None,
                 scheme: QuantScheme, dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.output_sizes = output_sizes or [out_features]
        assert sum(self.output_sizes) == out_features
        problem = scheme.packing_problem(in_features, self.output_sizes)
        if problem:
            raise ConfigError(f"cannot build a {scheme.fmt} {scheme.bits}-bit layer: {problem}")
        self.scheme = scheme
        self.group_size = scheme.group_for(in_features)
        groups = in_features // self.group_size
        per_word = 32 // scheme.bits

        def buf(*shape, dt=torch.int32):
            return nn.Parameter(torch.zeros(*shape, dtype=dt), requires_grad=False)

        if scheme.fmt == "awq":
            self.qweight = buf(in_features, out_features // 8)
            self.qzeros = buf(groups, out_features // 8)
        else:
            self.qweight = buf(in_features // per_word, out_features)
            self.qzeros = buf(groups, out_features // per_word)
            self.g_idx = buf(in_features)
        self.scales = buf(groups, out_features, dt=torch.float16)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        self._qw: QuantWeight | None = None
        self._g_idx_loaded = False

    # ---- loading -------------------------------------------------------------------------------------------
    def shard_slice(self, shard: int | None) -> slice:
        if shard is None:
            return slice(0, self.out_features)
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])

    def _packed_cols(self, leaf: str) -> int:
        """Output columns per stored column of tensor ``leaf`` (1, or the fields per int32 word)."""
        if leaf in ("scales", "bias"):
            return 1
        if leaf == "qweight":
            return 8 if self.scheme.fmt == "awq" else 1
        return 8 if self.scheme.fmt == "awq" else 32 // self.scheme.bits      # qzeros

    def load_tensor(self, leaf: str, shard: int | None, tensor: torch.Tensor, ckpt_name: str) -> None:
        """Copy one checkpoint tensor (a whole layer, or shard ``shard`` of a fused one) into place."""
        self._qw = None
        dst = getattr(self, leaf).data
        if leaf == "g_idx":
            if tuple(tensor.shape) != tuple(dst.shape):
                raise ConfigError(f"shape mismatch for {ckpt_name!r}: checkpoint {tuple(tensor.shape)}, "
                                  f"model expects {tuple(dst.shape)}")
            if shard is not None and self._g_idx_loaded and not torch.equal(dst, tensor.to(dst)):
                raise ConfigError(f"{ckpt_name!r} differs from the g_idx of the other projections fused with it")
            dst.copy_(tensor)
            self._g_idx_loaded = True
            return
        if shard is not None:
            sl = self.shard_slice(shard)
            per = self._packed_cols(leaf)
            cols = slice(sl.start // per, sl.stop // per)
            dst = dst[cols] if dst.dim() == 1 else dst[:, cols]
        if tuple(tensor.shape) != tuple(dst.shape):
            raise ConfigError(f"shape mismatch for {ckpt_name!r}: checkpoint {tuple(tensor.shape)}, "
                              f"model expects {tuple(dst.shape)}")
        if leaf in ("qweight", "qzeros") and tensor.dtype != torch.int32:
            raise ConfigError(f"{ckpt_name!r} must be int32, got {tensor.dtype}")
        dst.copy_(tensor)

    @torch.no_grad()
    def init_dummy(self, generator: torch.Generator) -> None:
        """Random packed codes, small scales (|w| ≲ 0.01), contiguous groups: for ``load_format=dummy``."""
        self._qw = None
        for t in (self.qweight, self.qzeros):
            t.data.copy_(torch.randint(-2**31, 2**31 - 1, t.shape, generator=generator, dtype=torch.int64,
                                       device=t.device).to(torch.int32))
        self.scales.data.uniform_(5e-4, 1.5e-3, generator=generator)
        if self.scheme.fmt == "gptq":
            self.g_idx.data.copy_(default_g_idx(self.in_features, self.group_size, self.g_idx.device))
        if self.bias is not None:
            self.bias.data.uniform_(-1e-2, 1e-2, generator=generator)

    def _apply(self, fn, recurse=True):
        self._qw = None
        return super()._apply(fn, recurse)

    # ---- forward -------------------------------------------------------------------------------------------
    def quant_weight(self) -> QuantWeight:
        """The packed weight as a ``QuantWeight`` (validated once, then cached)."""
        if self._qw is None:
            if self.scheme.fmt == "awq":
                self._qw = QuantWeight.from_awq(self.qweight, self.qzeros, self.scales, self.group_size)
            else:
                self._qw = QuantWeight.from_gptq(self.qweight, self.qzeros, self.scales, self.g_idx,
                                                 self.scheme.bits, self.group_size)
        return self._qw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quant_linear(x, self.quant_weight(), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme.fmt} "
                f"{self.scheme.bits}-bit g{self.group_size}")
