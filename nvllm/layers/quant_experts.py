"""A sparse layer's experts stored 4- or 8-bit (GPTQ v1 or AWQ-GEMM checkpoints, as GPTQModel, AutoGPTQ and AutoAWQ
write mixtures of experts: one set of packed tensors per expert and projection, ``mlp.experts.{e}.gate_proj.qweight``
/ ``qzeros`` / ``scales`` / ``g_idx``, Mixtral's ``block_sparse_moe.experts.{e}.w1.*``), running through
``nvllm.kernels.quant_moe``.

The tensors are stacked as the dense ``Experts`` stacks its weights: ``w13_*`` hold every expert's gate columns then
up columns (the packed output dimension), ``w2_*`` the down projections. GPTQ's act-order ``g_idx`` is kept per expert
(gate and up read the same inputs, so theirs must agree, as a fused ``QuantLinear``'s shards must); AWQ experts are
repacked into the GPTQ v1 layout once loaded (``formats.awq_to_gptq``, exact), the kernels' one layout.

Tensor parallelism splits every expert's intermediate size, along whole packed words and whole groups: gate/up keep
this rank's output columns (column-parallel), down its input rows and their groups' scales and zeros (row-parallel).
An act-order down projection, whose inputs may point to any group, is refused over several ranks."""

from __future__ import annotations

import torch
from torch import nn

from nvllm.config import ConfigError
from nvllm.distributed.partition import Part, take_shard
from nvllm.kernels.quant_moe import ExpertWeights, quant_experts
from nvllm.quant.dummy_codes import fill_dummy
from nvllm.quant.formats import QuantWeight, awq_to_gptq, default_g_idx
from nvllm.quant.plan import QuantScheme

class QuantExperts(nn.Module):
    """``Experts`` with packed weights (module doc). ``m``: the MoeShape (this rank's ``part`` of the intermediate
    size); ``scheme``: the checkpoint's format, bits and group size."""

    def __init__(self, hidden_size: int, m, scheme: QuantScheme):
        super().__init__()
        self.m, self.scheme, self.hidden_size = m, scheme, hidden_size
        i, e, h = m.part.size, m.num_experts, hidden_size
        for what, in_f, outs in (("gate/up", h, [i, i]), ("down", i, [h])):
            problem = scheme.packing_problem(in_f, outs)
            if problem:
                split = f" (this rank's {i} of moe_intermediate_size {m.part.total})" if m.part.size < m.part.total \
                    else ""
                raise ConfigError(f"cannot build {scheme.fmt} {scheme.bits}-bit experts{split}: {what} {problem}")
        self._g13 = scheme.group_for(h)
        self._g2 = scheme.group_for(m.part.total)   # -1: one group over every rank's inputs
        self._down_groups = Part(0, 1, 1) if scheme.group_size == -1 else m.part.per(self._g2)
        per = 32 // scheme.bits

        def buf(*shape, dt=torch.int32):
            return nn.Parameter(torch.zeros(*shape, dtype=dt), requires_grad=False)

        g13, g2 = h // self._g13, self._down_groups.size
        if scheme.fmt == "awq":
            self.w13_qweight, self.w13_qzeros = buf(e, h, 2 * i // 8), buf(e, g13, 2 * i // 8)
            self.w2_qweight, self.w2_qzeros = buf(e, i, h // 8), buf(e, g2, h // 8)
        else:
            self.w13_qweight, self.w13_qzeros = buf(e, h // per, 2 * i), buf(e, g13, 2 * i // per)
            self.w2_qweight, self.w2_qzeros = buf(e, i // per, h), buf(e, g2, h // per)
            self.w13_g_idx, self.w2_g_idx = buf(e, h), buf(e, i)
        self.w13_scales = buf(e, g13, 2 * i, dt=torch.float16)
        self.w2_scales = buf(e, g2, h, dt=torch.float16)
        self._g_idx_loaded: set[int] = set()
        self._weights: tuple[ExpertWeights, ExpertWeights] | None = None
        self._repacked = False

    # ---- loading -------------------------------------------------------------------------------------------
    def shards(self, leaf: str) -> list[tuple[int, int]]:
        """The checkpoint tensors that fill ``leaf``: (expert, 0 gate / 1 up / 2 down)."""
        return [(e, j) for e in range(self.m.num_experts) for j in ((0, 1) if leaf.startswith("w13") else (2,))]

    def _packed_cols(self, kind: str) -> int:
        """Output columns per stored column of a tensor of ``kind``."""
        if kind == "scales":
            return 1
        if self.scheme.fmt == "awq":
            return 8
        return 1 if kind == "qweight" else 32 // self.scheme.bits

    def load_tensor(self, leaf: str, shard: tuple[int, int], tensor: torch.Tensor, ckpt_name: str) -> None:
        e, j = shard
        if e >= self.m.num_experts:
            raise ConfigError(f"unexpected tensor {ckpt_name!r}: the config has {self.m.num_experts} experts")
        if self._repacked:
            raise ConfigError(f"cannot load {ckpt_name!r}: its AWQ experts have run already and hold the GPTQ "
                              f"layout; load the checkpoint before running the model")
        self._weights = None
        proj, kind = leaf.split("_", 1)
        if kind in ("qweight", "qzeros") and tensor.dtype != torch.int32:
            raise ConfigError(f"{ckpt_name!r} must be int32, got {tensor.dtype}")
        part, dst = self.m.part, getattr(self, leaf).data[e]
        if proj == "w13":   # column-parallel: this rank's output columns, gate's then up's
            if kind == "g_idx":
                piece = take_shard(tensor, tuple(dst.shape), {}, ckpt_name)
                if e in self._g_idx_loaded and not torch.equal(dst, piece.to(dst)):
                    raise ConfigError(f"{ckpt_name!r} differs from the g_idx of the same expert's other projection "
                                      f"(gate and up read the same inputs)")
                self._g_idx_loaded.add(e)
                dst.copy_(piece)
                return
            per = self._packed_cols(kind)
            width = part.size // per
            dst = dst[:, j * width:(j + 1) * width]
            dst.copy_(take_shard(tensor, tuple(dst.shape), {1: part.per(per)}, ckpt_name))
            return
        # row-parallel down projection: this rank's input rows (packed words) and their groups
        if kind == "g_idx":
            cut = part
        elif kind == "qweight":
            cut = part if self.scheme.fmt == "awq" else part.per(32 // self.scheme.bits)
        else:
            cut = self._down_groups
        dst.copy_(take_shard(tensor, tuple(dst.shape), {0: cut}, ckpt_name))

    @torch.no_grad()
    def init_dummy(self, generator: torch.Generator) -> None:
        """Random codes centred on their zero points, small scales, contiguous groups (``quant.dummy_codes``)."""
        self._weights = None
        for proj in ("w13", "w2"):
            fill_dummy(*(getattr(self, f"{proj}_{k}") for k in ("qweight", "qzeros", "scales")), self.scheme.bits,
                       self.scheme.fmt, generator)
        if self.scheme.fmt == "gptq":
            self.w13_g_idx.data.copy_(default_g_idx(self.hidden_size, self._g13, self.w13_g_idx.device))
            self.w2_g_idx.data.copy_(self._contiguous_down_g_idx())

    def _apply(self, fn, recurse=True):
        self._weights = None
        return super()._apply(fn, recurse)

    def _contiguous_down_g_idx(self) -> torch.Tensor:
        """The down projection's g_idx when its groups are contiguous (this rank's rows, global group numbers)."""
        part = self.m.part
        return default_g_idx(part.total, self._g2, self.w2_g_idx.device)[part.start:part.start + part.size]

    # ---- forward -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _repack_awq(self) -> None:
        """The AWQ tensors rewritten, expert by expert, in the GPTQ v1 layout (new shapes; the kernels' layout)."""
        for proj, group in (("w13", self._g13), ("w2", self._g2)):
            qweight, qzeros, scales = (getattr(self, f"{proj}_{k}") for k in ("qweight", "qzeros", "scales"))
            experts = [awq_to_gptq(QuantWeight.from_awq(qweight.data[e], qzeros.data[e], scales.data[e],
                                                        min(group, qweight.shape[1])))
                       for e in range(self.m.num_experts)]
            qweight.data = torch.stack([w.qweight for w in experts])
            qzeros.data = torch.stack([w.qzeros for w in experts])
            scales.data = torch.stack([w.scales for w in experts])
        self.scheme = QuantScheme("gptq", 4, self.scheme.group_size)
        self._repacked = True

    def expert_weights(self) -> tuple[ExpertWeights, ExpertWeights]:
        """(gate/up, down) as the kernels take them: validated, AWQ repacked, act-order kept only where it is."""
        if self._weights is None:
            if self.scheme.fmt == "awq":
                self._repack_awq()
            bits = self.scheme.bits
            g13 = g2 = None
            if hasattr(self, "w13_g_idx"):
                if not torch.equal(self.w13_g_idx.data, default_g_idx(self.hidden_size, self._g13,
                                                                      self.w13_g_idx.device).expand_as(self.w13_g_idx)):
                    g13 = self.w13_g_idx.data
                if not torch.equal(self.w2_g_idx.data, self._contiguous_down_g_idx().expand_as(self.w2_g_idx)):
                    if self.m.part.size < self.m.part.total:
                        raise ConfigError("act-order (desc_act) experts cannot be split over tensor-parallel ranks: "
                                          "their down projections' inputs point to every rank's groups")
                    g2 = self.w2_g_idx.data
            for g, n in ((g13, self.w13_scales.shape[1]), (g2, self.w2_scales.shape[1])):
                if g is not None and (int(g.min()) < 0 or int(g.max()) >= n):
                    raise ConfigError(f"an expert's g_idx points outside its {n} groups")
            self._weights = (
                ExpertWeights(self.w13_qweight.data, self.w13_qzeros.data, self.w13_scales.data, g13, bits, self._g13),
                ExpertWeights(self.w2_qweight.data, self.w2_qzeros.data, self.w2_scales.data, g2, bits, self._g2))
        return self._weights

    def quant_weight(self):
        """Validated and cached when the model loads (the loader calls every layer's ``quant_weight``)."""
        return self.expert_weights()

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        w13, w2 = self.expert_weights()
        return quant_experts(x, w13, w2, topk_weights, topk_ids)

    def extra_repr(self) -> str:
        return (f"experts={self.m.num_experts}, hidden={self.hidden_size}, intermediate={self.m.part.size}, "
                f"{self.scheme.fmt} {self.scheme.bits}-bit g{self.scheme.group_size}")
