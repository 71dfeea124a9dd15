"""The mixture-of-experts MLP of Qwen2-MoE, Qwen3-MoE and Mixtral: a router picks each token's top-k experts, each
a SwiGLU MLP of its own, and their outputs are summed under the routing weights (``nvllm.kernels.fused_moe``).
Qwen2-MoE adds a shared expert, a dense SwiGLU every token takes, scaled by a sigmoid gate.

Routing as HF transformers computes it: softmax over the router's logits in fp32, top-k, renormalised over the k
when the config says so (``norm_topk_prob``; Mixtral always), then rounded to the activations' dtype (the Qwen
families; Mixtral keeps fp32).

Checkpoint tensors (published layout, which transformers writes too): ``mlp.gate`` (router) and
``mlp.experts.{e}.{gate,up,down}_proj`` (Qwen), ``block_sparse_moe.gate`` and
``block_sparse_moe.experts.{e}.{w1,w3,w2}`` (Mixtral), ``mlp.shared_expert.*`` and ``mlp.shared_expert_gate``
(Qwen2-MoE). The experts are stacked into ``w13`` [E, 2I, H] (gate rows, then up rows) and ``w2`` [E, H, I].

Tensor parallelism: every rank holds every expert's slice of the intermediate size (``part``), as a column-parallel
gate/up and a row-parallel down would; the router is replicated; the block's partial outputs — experts and shared
expert together — are summed over the ranks in one all-reduce."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from nvllm.config import ConfigError
from nvllm.distributed.group import TPGroup
from nvllm.distributed.partition import LinearShard, Part, even_part, take_shard
from nvllm.kernels.fused_moe import fused_experts
from nvllm.kernels.moe_routing import route
from nvllm.layers.linear import Linear
from nvllm.layers.linear_factory import make_linear
from nvllm.layers.quant_experts import QuantExperts

ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")


@dataclass(frozen=True)
class MoeShape:
    """The mixture of one sparse layer: ``num_experts`` experts of ``intermediate_size`` (``part``: this rank's
    slice), ``top_k`` a token; ``shared_intermediate_size`` 0 without a shared expert."""

    num_experts: int
    top_k: int
    intermediate_size: int
    part: Part
    shared_part: Part | None
    renormalize: bool
    weights_in_dtype: bool
    sparse_layers: frozenset[int]
    hf_names: tuple[str, tuple[str, str, str]] = ("mlp", ("gate_proj", "up_proj", "down_proj"))
    """the checkpoint's block module and its experts' (gate, up, down) modules"""

    @property
    def shared_intermediate_size(self) -> int:
        return 0 if self.shared_part is None else self.shared_part.total


def moe_shape(hf_config, architecture: str, tp_size: int = 1, tp_rank: int = 0) -> MoeShape | None:
    """The config's mixture of experts, None for a dense model (or a Qwen MoE config with no experts)."""
    if architecture not in ARCHITECTURES:
        return None
    c = hf_config
    n = getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None) or 0
    k = getattr(c, "num_experts_per_tok", None)
    inter = c.intermediate_size if architecture == "MixtralForCausalLM" else getattr(c, "moe_intermediate_size", None)
    for name, v in (("num_experts", n), ("num_experts_per_tok", k), ("moe_intermediate_size", inter)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ConfigError(f"config.json: {name} must be a non-negative integer, got {v!r}")
    if n == 0:
        return None
    if inter == 0:
        raise ConfigError(f"config.json: moe_intermediate_size must be positive with {n} experts")
    if not 1 <= k <= n:
        raise ConfigError(f"config.json: num_experts_per_tok {k} must be between 1 and num_experts {n}")
    if architecture == "MixtralForCausalLM":
        sparse = frozenset(range(c.num_hidden_layers))
    else:   # HF's rule: layers not listed as dense, every decoder_sparse_step-th
        step = getattr(c, "decoder_sparse_step", 1) or 1
        dense = set(getattr(c, "mlp_only_layers", None) or [])
        sparse = frozenset(i for i in range(c.num_hidden_layers) if i not in dense and (i + 1) % step == 0)
    shared = 0
    if architecture == "Qwen2MoeForCausalLM":   # transformers always builds Qwen2-MoE's shared expert
        shared = getattr(c, "shared_expert_intermediate_size", None)
        if isinstance(shared, bool) or not isinstance(shared, int) or shared < 1:
            raise ConfigError(f"config.json: shared_expert_intermediate_size must be a positive integer, got "
                              f"{shared!r}")
    return MoeShape(
        num_experts=n, top_k=k, intermediate_size=inter,
        part=even_part(inter, tp_size, tp_rank, "moe_intermediate_size"),
        shared_part=even_part(shared, tp_size, tp_rank, "shared_expert_intermediate_size") if shared else None,
        renormalize=architecture == "MixtralForCausalLM" or bool(getattr(c, "norm_topk_prob", False)),
        weights_in_dtype=architecture != "MixtralForCausalLM", sparse_layers=sparse,
        hf_names=("block_sparse_moe", ("w1", "w3", "w2")) if architecture == "MixtralForCausalLM" else
        ("mlp", ("gate_proj", "up_proj", "down_proj")))


# a sparse layer's checkpoint tensors → (our parameter below ``layers.{i}.moe``, shard)
_EXPERT = re.compile(r"^layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)"
                     r"\.(weight|qweight|qzeros|scales|g_idx|bias)$")
_EXPERT_SHARD = {"gate_proj": ("w13", 0), "w1": ("w13", 0), "up_proj": ("w13", 1), "w3": ("w13", 1),
                 "down_proj": ("w2", 2), "w2": ("w2", 2)}
_BLOCK = re.compile(r"^layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(gate|shared_expert_gate|shared_expert\.\w+)"
                    r"\.(weight|qweight|qzeros|scales|g_idx|bias)$")
_SHARED = {"shared_expert.gate_proj": ("shared_expert.gate_up_proj", 0),
           "shared_expert.up_proj": ("shared_expert.gate_up_proj", 1),
           "shared_expert.down_proj": ("shared_expert.down_proj", None)}


def moe_param_for(name: str, sparse_layers: frozenset[int]) -> tuple[str, object] | None:
    """(our parameter name, shard) of a sparse layer's checkpoint tensor (``name`` without ``model.``); None
    for any other tensor."""
    m = _EXPERT.match(name)
    if m and int(m.group(1)) in sparse_layers:
        leaf, j = _EXPERT_SHARD[m.group(3)]
        kind = m.group(4)   # quantized experts' tensors: w13_qweight, …; a bias has no parameter (zero ones skip)
        leaf += "" if kind == "weight" else f"_{kind}"
        return f"layers.{m.group(1)}.moe.experts.{leaf}", (int(m.group(2)), j)
    m = _BLOCK.match(name)
    if m and int(m.group(1)) in sparse_layers:
        module, shard = _SHARED.get(m.group(2), (m.group(2), None))
        return f"layers.{m.group(1)}.moe.{module}.{m.group(3)}", shard
    return None


class Experts(nn.Module):
    """Every expert's gate/up and down weights, stacked: ``w13`` [E, 2I, H], ``w2`` [E, H, I] (this rank's I)."""

    def __init__(self, hidden_size: int, m: MoeShape, dtype: torch.dtype):
        super().__init__()
        self.m = m
        i = m.part.size
        self.w13 = nn.Parameter(torch.empty(m.num_experts, 2 * i, hidden_size, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(m.num_experts, hidden_size, i, dtype=dtype), requires_grad=False)

    def shards(self, leaf: str) -> list[tuple[int, int]]:
        """The checkpoint tensors that fill ``leaf``: (expert, 0 gate / 1 up / 2 down)."""
        return [(e, j) for e in range(self.m.num_experts) for j in ((0, 1) if leaf == "w13" else (2,))]

    def load_tensor(self, leaf: str, shard: tuple[int, int], tensor: torch.Tensor, ckpt_name: str) -> None:
        e, j = shard
        if e >= self.m.num_experts:
            raise ConfigError(f"unexpected tensor {ckpt_name!r}: the config has {self.m.num_experts} experts")
        i = self.m.part.size
        if leaf == "w13":
            dst = self.w13.data[e, j * i:(j + 1) * i]
            dst.copy_(take_shard(tensor, tuple(dst.shape), {0: self.m.part}, ckpt_name))
        else:
            dst = self.w2.data[e]
            dst.copy_(take_shard(tensor, tuple(dst.shape), {1: self.m.part}, ckpt_name))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_experts(x, self.w13, self.w2, topk_weights, topk_ids)


class SparseMoeBlock(nn.Module):
    """``quant``: the schemes of what the checkpoint stores quantized — ``"experts"`` (``QuantExperts``),
    ``"shared_expert.gate_up_proj"`` / ``"shared_expert.down_proj"``; the routers stay in full precision."""

    def __init__(self, hidden_size: int, m: MoeShape, dtype: torch.dtype, tp: TPGroup | None = None,
                 quant: dict | None = None):
        super().__init__()
        quant = quant or {}
        self.m = m
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.gate = Linear(hidden_size, m.num_experts, False, None, dtype)
        self.experts = QuantExperts(hidden_size, m, quant["experts"]) if "experts" in quant \
            else Experts(hidden_size, m, dtype)
        self.shared_expert = None
        if m.shared_part is not None:
            self.shared_expert = SharedExpert(hidden_size, m.shared_part, dtype, self.tp, quant)
            self.shared_expert_gate = Linear(hidden_size, 1, False, None, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.m.top_k, self.m.renormalize, self.m.weights_in_dtype)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out if self.tp is None else self.tp.all_reduce(out)


class SharedExpert(nn.Module):
    """A dense SwiGLU every token takes (this rank's slice; its output left unsummed over the ranks)."""

    def __init__(self, hidden_size: int, part: Part, dtype: torch.dtype, tp: TPGroup | None, quant: dict):
        super().__init__()
        i = part.size
        self.gate_up_proj = make_linear(hidden_size, 2 * i, False, [i, i], dtype,
                                        quant.get("shared_expert.gate_up_proj"), LinearShard(outputs=(part, part)), tp)
        self.down_proj = make_linear(i, hidden_size, False, None, dtype, quant.get("shared_expert.down_proj"),
                                     LinearShard(inputs=part), tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_and_mul(x), reduce=False)
