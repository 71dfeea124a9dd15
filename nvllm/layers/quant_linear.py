"""Weight-only quantized linear layer (AWQ-GEMM or GPTQ v1 tensors) running through ``quant_linear``.

The layer holds the checkpoint's packed tensors as they are stored (``qweight``, ``qzeros``, ``scales`` and,
for GPTQ, ``g_idx``), so a fused projection (q/k/v, gate/up) is filled shard by shard exactly as the dense
``Linear`` is: each shard's columns of the output dimension. AWQ packs 8 output columns per int32 word and
GPTQ's ``qzeros`` ``32 / bits`` of them, so a shard of ``n`` outputs covers ``n / 8`` (resp. ``n·bits / 32``)
word columns — the plan only quantizes layers whose shard sizes are whole words. ``g_idx`` (one entry per
input) is the same for every shard of a fused layer; the loader checks that they agree.

AWQ tensors are repacked in place into the GPTQ v1 layout at the layer's first use (``formats.awq_to_gptq``:
exact, the same element counts, so the parameters keep their checkpoint shapes and hold the GPTQ words): the
``half2`` GEMV, the fastest decode kernel, reads only that layout (PERF.md, session 9). Layers whose inputs do not
fill whole GPTQ words (``in_features % 8``) stay in the AWQ layout. Loading a checkpoint tensor into a repacked
layer is refused (weights are loaded before the model runs); ``state_dict`` carries the layout as the module's
extra state, so a state dict loads back into a fresh layer as it was saved.

Tensor parallelism splits along whole packed words and whole groups. Column-parallel: each rank keeps its
output columns of every tensor (whole int32 words). Row-parallel: each rank keeps its rows of ``qweight`` (and
of ``g_idx``) and, for AWQ, its groups' rows of ``scales`` / ``qzeros``. GPTQ may be act-order (a ``g_idx``
that sends a rank's inputs to any group), so a row-parallel GPTQ layer reads every group's scales and zeros,
and once loaded keeps only its own groups' when its ``g_idx`` turns out contiguous — all of them otherwise.
"""

from __future__ import annotations

import torch
from torch import nn

from nvllm.config import ConfigError
from nvllm.distributed.group import TPGroup
from nvllm.distributed.partition import LinearShard, Part, take_shard
from nvllm.kernels.activation import silu_and_mul
from nvllm.kernels.partial_sum import PartialSum
from nvllm.kernels.quant_gemm import quant_linear
from nvllm.layers.linear import Linear, sum_over_ranks
from nvllm.quant.dummy_codes import fill_dummy
from nvllm.quant.formats import QuantWeight, awq_to_gptq, default_g_idx
from nvllm.quant.plan import QuantScheme


class QuantLinear(nn.Module):
    """y = x Wᵀ + b with W stored packed. Same construction arguments as ``Linear`` plus the scheme."""

    def __init__(self, in_features: int, out_features: int, bias: bool, output_sizes: list[int] | None,
                 scheme: QuantScheme, dtype: torch.dtype | None = None, shard: LinearShard | None = None,
                 tp: TPGroup | None = None):
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
        self.shard = shard
        row = shard is not None and shard.row_parallel
        self.tp = tp if row else None
        # row-parallel: the group rows of this rank's inputs (a group of -1 spans all inputs: its single row)
        self._group_part = (Part(0, 1, 1) if scheme.group_size == -1 else shard.inputs.per(self.group_size)) \
            if row else None
        self._all_groups = row and scheme.fmt == "gptq"  # every group's scales/zeros until g_idx is known
        self._act_order_all_groups = False

        def buf(*shape, dt=torch.int32):
            return nn.Parameter(torch.zeros(*shape, dtype=dt), requires_grad=False)

        if scheme.fmt == "awq":
            self.qweight = buf(in_features, out_features // 8)
            self.qzeros = buf(groups, out_features // 8)
        else:
            if self._all_groups:
                groups = self._group_part.total
            self.qweight = buf(in_features // per_word, out_features)
            self.qzeros = buf(groups, out_features // per_word)
            self.g_idx = buf(in_features)
            self.g_idx.data.copy_(self._contiguous_g_idx())  # what a checkpoint without g_idx means (vLLM's too)
        self.scales = buf(groups, out_features, dt=torch.float16)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        self._qw: QuantWeight | None = None
        self._g_idx_loaded = False
        self._repacked = False   # AWQ: qweight / qzeros / scales hold the GPTQ v1 layout (see the module doc)

    # ---- loading -------------------------------------------------------------------------------------------
    shard_slice = Linear.shard_slice   # the rows (output columns) of output shard ``shard`` in the fused layer

    def _packed_cols(self, leaf: str) -> int:
        """Output columns per stored column of tensor ``leaf`` (1, or the fields per int32 word)."""
        if leaf in ("scales", "bias"):
            return 1
        if leaf == "qweight":
            return 8 if self.scheme.fmt == "awq" else 1
        return 8 if self.scheme.fmt == "awq" else 32 // self.scheme.bits      # qzeros

    def _cuts(self, leaf: str, shard: int | None, ndim: int) -> dict[int, Part]:
        """Which rows of each dimension of checkpoint tensor ``leaf`` this rank keeps (see the module doc)."""
        if self.shard is None:
            return {}
        if self.shard.outputs is not None:  # column-parallel: the output columns (the last dimension)
            return {} if leaf == "g_idx" else {ndim - 1: self.shard.outputs[shard or 0].per(self._packed_cols(leaf))}
        inputs = self.shard.inputs
        if leaf == "qweight":
            return {0: inputs.per(1 if self.scheme.fmt == "awq" else 32 // self.scheme.bits)}
        if leaf == "g_idx":
            return {0: inputs}
        if leaf in ("qzeros", "scales") and not self._all_groups:
            return {0: self._group_part}
        return {}

    def load_tensor(self, leaf: str, shard: int | None, tensor: torch.Tensor, ckpt_name: str) -> None:
        """Copy this rank's piece of one checkpoint tensor (a whole layer, or shard ``shard`` of a fused one)."""
        if self._repacked:
            raise ConfigError(f"cannot load {ckpt_name!r}: its layer has run already and holds its AWQ weight in "
                              f"the GPTQ layout; load the checkpoint before running the model")
        self._qw = None
        dst = getattr(self, leaf).data
        if leaf == "g_idx":
            tensor = take_shard(tensor, tuple(dst.shape), self._cuts(leaf, shard, 1), ckpt_name)
            groups = self.scales.shape[0]    # every group's rows while g_idx is unknown (see _all_groups)
            if tensor.numel() and (int(tensor.min()) < 0 or int(tensor.max()) >= groups):
                raise ConfigError(f"{ckpt_name!r} holds group {int(tensor.min())}..{int(tensor.max())}, outside "
                                  f"the layer's {groups} groups (the quantization_config's group_size "
                                  f"{self.scheme.group_size} of its {self.in_features} inputs)")
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
        try:
            piece = take_shard(tensor, tuple(dst.shape), self._cuts(leaf, shard, dst.dim()), ckpt_name)
        except ConfigError as e:
            if leaf not in ("qzeros", "scales") or tensor.dim() != 2 or tensor.shape[0] == dst.shape[0]:
                raise
            raise ConfigError(f"{e}: one row per group, and the quantization_config's group_size "
                              f"{self.scheme.group_size} makes {dst.shape[0]} group(s) of the layer's "
                              f"{self.in_features} inputs (the checkpoint and its config disagree)") from None
        if leaf in ("qweight", "qzeros") and tensor.dtype != torch.int32:
            raise ConfigError(f"{ckpt_name!r} must be int32, got {tensor.dtype}")
        dst.copy_(piece)

    @torch.no_grad()
    def init_dummy(self, generator: torch.Generator) -> None:
        """Random codes centred on their zero points, small scales, contiguous groups (``quant.dummy_codes``)."""
        self._qw = None
        self._repacked = False
        fill_dummy(self.qweight, self.qzeros, self.scales, self.scheme.bits, self.scheme.fmt, generator)
        if self.scheme.fmt == "gptq":
            self.g_idx.data.copy_(self._contiguous_g_idx())
        if self.bias is not None:
            self.bias.data.uniform_(-1e-2, 1e-2, generator=generator)

    def _contiguous_g_idx(self) -> torch.Tensor:
        """g_idx of contiguous groups (into every group's rows while a row-parallel layer keeps them all)."""
        first = self._group_part.start if self._all_groups else 0
        return default_g_idx(self.in_features, self.group_size, self.g_idx.device) + first

    def _apply(self, fn, recurse=True):
        self._qw = None
        return super()._apply(fn, recurse)

    @torch.no_grad()
    def _settle_groups(self) -> None:
        """Row-parallel GPTQ, once loaded: contiguous groups → keep only this rank's groups' scales / zeros (and
        renumber g_idx from 0); act-order → keep every group, g_idx pointing into all of them."""
        if not self._all_groups:
            return
        self._all_groups = False
        part = self._group_part
        contiguous = default_g_idx(self.in_features, self.group_size, self.g_idx.device) + part.start
        if not torch.equal(self.g_idx.data, contiguous):
            self._act_order_all_groups = True
            return
        rows = slice(part.start, part.start + part.size)
        self.scales.data = self.scales.data[rows].clone()
        self.qzeros.data = self.qzeros.data[rows].clone()
        self.g_idx.data -= part.start

    def _act_order_weight(self) -> QuantWeight:
        """A row-parallel act-order GPTQ piece: this rank's inputs, every group's scales and zeros."""
        g = self.g_idx.data      # within the groups: load_tensor refused any other
        return QuantWeight("gptq", self.scheme.bits, self.group_size, self.in_features, self.out_features,
                           self.qweight.data.contiguous(), self.qzeros.data.contiguous(),
                           self.scales.data.contiguous(), g.to(torch.int32).contiguous())

    # ---- forward -------------------------------------------------------------------------------------------
    def quant_weight(self) -> QuantWeight:
        """The packed weight as a ``QuantWeight`` (validated once, then cached)."""
        if self._qw is None:
            self._settle_groups()
            if self.scheme.fmt == "awq" and (self._repacked or self.in_features % 8 == 0):
                if not self._repacked:
                    self._repack_awq()
                self._qw = QuantWeight.from_gptq(self.qweight.view(self.in_features // 8, self.out_features),
                                                 self.qzeros, self.scales, None, 4, self.group_size)
                self._qw.extra["from"] = "awq"
            elif self.scheme.fmt == "awq":
                self._qw = QuantWeight.from_awq(self.qweight, self.qzeros, self.scales, self.group_size)
            elif self._act_order_all_groups:
                self._qw = self._act_order_weight()
            else:
                self._qw = QuantWeight.from_gptq(self.qweight, self.qzeros, self.scales, self.g_idx,
                                                 self.scheme.bits, self.group_size)
        return self._qw

    @torch.no_grad()
    def _repack_awq(self) -> None:
        """The loaded AWQ tensors, rewritten in place in the GPTQ v1 layout ([in, out/8] words hold the
        [in/8, out] GPTQ rows; qzeros and scales keep their shapes)."""
        gq = awq_to_gptq(QuantWeight.from_awq(self.qweight.data, self.qzeros.data, self.scales.data, self.group_size))
        self.qweight.data.copy_(gq.qweight.view(self.qweight.shape))
        self.qzeros.data.copy_(gq.qzeros)
        self.scales.data.copy_(gq.scales)
        self._repacked = True

    def get_extra_state(self) -> dict:
        """The packed tensors' layout, saved with them by ``state_dict``."""
        return {"layout": "gptq" if self._repacked or self.scheme.fmt == "gptq" else "awq"}

    def set_extra_state(self, state: dict) -> None:
        self._qw = None
        self._repacked = self.scheme.fmt == "awq" and state.get("layout") == "gptq"

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``SiLU(gate) · up`` of this gate/up layer's output (a GEMV's split-K sum finished by SiLU·mul)."""
        return silu_and_mul(self(x, partial=True))

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None, partial: bool = False,
                reduce: bool = True) -> torch.Tensor | PartialSum:
        """``out``: an optional destination (copied into: the quantized kernels write fresh tensors).
        ``partial``: a GEMV call may return its unfinished ``PartialSum`` for the consumer to finish (not with
        ``out`` or tensor parallelism). ``reduce=False``: a row-parallel layer returns this rank's partial output,
        for ``sum_over_ranks`` to finish."""
        if self.tp is None or self.tp.size == 1:
            y = quant_linear(x, self.quant_weight(), self.bias, partial=partial and out is None)
            return y if out is None else out.copy_(y)
        y = quant_linear(x, self.quant_weight())  # partial sums of this rank's inputs
        return sum_over_ranks(self, y, out) if reduce else y

    def extra_repr(self) -> str:
        layout = " (in the GPTQ layout)" if self._repacked else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme.fmt} "
                f"{self.scheme.bits}-bit g{self.group_size}{layout}")
