"""One decoder for the Llama family: Llama (incl. llama3 RoPE scaling), Mistral, Qwen2/2.5 (qkv bias) and
Qwen3 (per-head q/k RMSNorm), and their mixture-of-experts kin Mixtral, Qwen2-MoE and Qwen3-MoE, whose sparse
layers take a ``SparseMoeBlock`` (nvllm.layers.moe) for the MLP. GQA, tied or untied embeddings. Parameter names
follow the HF checkpoints except for the fused q/k/v and gate/up projections, which the loader fills shard by
shard, and the stacked experts.

Tensor parallelism (``tp``, a TPGroup): each rank builds the same modules at its own sizes — its query and KV
heads, its slice of the intermediate size and of the (padded) vocabulary — and every layer narrows the
checkpoint tensors it is given to its piece (nvllm.distributed.partition says which). q/k norms act per head,
so they are the same on every rank."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from nvllm.config import ConfigError
from nvllm.distributed.group import TPGroup
from nvllm.distributed.partition import even_part, head_parts, layer_shards
from nvllm.kernels.attention_partials import AttentionPartials
from nvllm.kernels.partial_sum import PartialSum
from nvllm.layers.attention import Attention, AttentionMetadata
from nvllm.layers.embed_head import LMHead, VocabEmbedding
from nvllm.layers.linear import Linear
from nvllm.layers.linear_factory import make_linear
from nvllm.layers.moe import SparseMoeBlock, moe_param_for, moe_shape
from nvllm.layers.norm import RMSNorm
from nvllm.layers.fp8_linear import Fp8Linear
from nvllm.layers.quant_linear import QuantLinear
from nvllm.layers.rotary import RotaryEmbedding, rope_parameters
from nvllm.quant.plan import QuantScheme

# checkpoint name fragment → (fused parameter fragment, shard index)
STACKED = {
    ".q_proj.": (".qkv_proj.", 0), ".k_proj.": (".qkv_proj.", 1), ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1),
}


logger = logging.getLogger("nvllm")

_ATTENTION_BIAS = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")  # whose HF code reads attention_bias
_MLP_BIAS = ("LlamaForCausalLM",)                                                   # and mlp_bias
_QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")

_HF_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
             "num_kv_heads": "num_key_value_heads", "max_position": "max_position_embeddings"}


class ModelShape:
    """The numbers the decoder needs, read once from the HF config: the checkpoint's (``num_heads``, …) and,
    for a rank of ``tp_size``, its own (``num_local_heads``, ``num_local_kv_heads``, ``local_intermediate_size``).
    A model that cannot be split over ``tp_size`` ranks is a ConfigError."""

    def __init__(self, hf_config, architecture: str, tp_size: int = 1, tp_rank: int = 0):
        c = hf_config
        self.vocab_size = c.vocab_size
        self.hidden_size = c.hidden_size
        self.intermediate_size = c.intermediate_size
        self.num_layers = c.num_hidden_layers
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.rms_norm_eps = c.rms_norm_eps
        self.max_position = c.max_position_embeddings
        self.rope_theta, self.rope_scaling = rope_parameters(c)
        self.tie_word_embeddings = bool(getattr(c, "tie_word_embeddings", False))
        # the biases as HF's modeling code builds them: attention_bias counts for Llama, Qwen3 and Qwen3-MoE (q/k/v
        # and o), mlp_bias for Llama only; Qwen2 always has q/k/v biases, Qwen2-MoE unless qkv_bias is false;
        # Mistral and Mixtral have none, whatever their config says
        attention_bias = architecture in _ATTENTION_BIAS and bool(getattr(c, "attention_bias", False))
        self.qkv_bias = architecture == "Qwen2ForCausalLM" or attention_bias or (
            architecture == "Qwen2MoeForCausalLM" and bool(getattr(c, "qkv_bias", True)))
        self.o_bias = attention_bias
        self.qk_norm = architecture in _QK_NORM
        self.mlp_bias = architecture in _MLP_BIAS and bool(getattr(c, "mlp_bias", False))
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"config.json: {_HF_NAMES.get(name, name)} must be a positive integer, got {v!r}")
        act = getattr(c, "hidden_act", "silu")
        if act not in ("silu", "swish"):  # transformers' names for the same function
            raise ConfigError(f"hidden_act {act!r} is not supported (only silu)")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads {self.num_heads} is not a multiple of "
                              f"num_key_value_heads {self.num_kv_heads}")
        self.tp_size, self.tp_rank = tp_size, tp_rank
        q, kv = head_parts(self.num_heads, self.num_kv_heads, self.head_dim, tp_size, tp_rank)
        self.num_local_heads, self.num_local_kv_heads = q.size // self.head_dim, kv.size // self.head_dim
        self.moe = moe_shape(c, architecture, tp_size, tp_rank)   # None: every layer's MLP is dense
        dense = self.moe is None or len(self.moe.sparse_layers) < self.num_layers
        self.local_intermediate_size = \
            even_part(self.intermediate_size, tp_size, tp_rank, "intermediate_size").size if dense else 0

    def sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` takes the mixture of experts for its MLP."""
        return self.moe is not None and layer in self.moe.sparse_layers

    def mlp_parameters(self) -> int:
        """Parameters of all the layers' MLPs (experts and routers included), the whole model's."""
        h, dense = self.hidden_size, 3 * self.hidden_size * self.intermediate_size
        if self.moe is None:
            return self.num_layers * dense
        m, n = self.moe, len(self.moe.sparse_layers)
        sparse = m.num_experts * (3 * h * m.intermediate_size + h) + (3 * h * m.shared_intermediate_size + h
                                                                     if m.shared_part is not None else 0)
        return n * sparse + (self.num_layers - n) * dense


class DecoderLayer(nn.Module):
    def __init__(self, s: ModelShape, dtype: torch.dtype, quant: dict[str, QuantScheme] | None = None,
                 tp: TPGroup | None = None, rotary: RotaryEmbedding | None = None, index: int = 0):
        """``quant``: scheme of each of this layer's quantized linears ("qkv_proj", …, a sparse layer's "experts" and
        "shared_expert.gate_up_proj", …); the others are dense.
        ``rotary``: the cos/sin tables every layer shares (built here if not given). ``index``: the layer's place
        in the model (which decides whether its MLP is a mixture of experts)."""
        super().__init__()
        self.s = s
        quant = quant or {}
        shards = layer_shards(s, s.tp_size, s.tp_rank)
        q, kv = s.num_local_heads * s.head_dim, s.num_local_kv_heads * s.head_dim
        inter = s.local_intermediate_size
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps, dtype)
        self.qkv_proj = make_linear(s.hidden_size, q + 2 * kv, s.qkv_bias, [q, kv, kv], dtype, quant.get("qkv_proj"),
                                    shards["qkv_proj"], tp)
        self.o_proj = make_linear(q, s.hidden_size, s.o_bias, None, dtype, quant.get("o_proj"), shards["o_proj"],
                                  tp)
        if s.qk_norm:
            self.q_norm = RMSNorm(s.head_dim, s.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps, dtype)
        self.rotary = rotary or RotaryEmbedding(s.head_dim, s.max_position, s.rope_theta, s.rope_scaling)
        self.attn = Attention(s.num_local_heads, s.num_local_kv_heads, s.head_dim, s.head_dim ** -0.5)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps, dtype)
        self.moe = SparseMoeBlock(s.hidden_size, s.moe, dtype, tp, quant) if s.sparse(index) else None
        if self.moe is not None:
            return
        self.gate_up_proj = make_linear(s.hidden_size, 2 * inter, s.mlp_bias, [inter, inter], dtype,
                                        quant.get("gate_up_proj"), shards["gate_up_proj"], tp)
        self.down_proj = make_linear(inter, s.hidden_size, s.mlp_bias, None, dtype, quant.get("down_proj"),
                                     shards["down_proj"], tp)

    def split_qkv(self, qkv: torch.Tensor | PartialSum, positions: torch.Tensor, rotate: bool = True):
        """The fused projection's output → per-head q, k (normed for Qwen3, rotated in place unless ``rotate``
        is False: then the attention step rotates them, fused with the KV store) and v. A ``PartialSum``
        (a quantized GEMV's unfinished split-K sum) stays one with ``rotate=False`` and no q/k norms — the
        attention step's ``rope_store`` finishes it — and is finished here otherwise."""
        s = self.s
        q_size, kv_size = s.num_local_heads * s.head_dim, s.num_local_kv_heads * s.head_dim
        if isinstance(qkv, PartialSum):
            if not rotate and not s.qk_norm:
                return (qkv.heads(0, s.num_local_heads, s.head_dim),
                        qkv.heads(q_size, s.num_local_kv_heads, s.head_dim),
                        qkv.heads(q_size + kv_size, s.num_local_kv_heads, s.head_dim))
            qkv = qkv.finish()
        q = qkv[:, :q_size].view(-1, s.num_local_heads, s.head_dim)
        k = qkv[:, q_size:q_size + kv_size].view(-1, s.num_local_kv_heads, s.head_dim)
        v = qkv[:, q_size + kv_size:].view(-1, s.num_local_kv_heads, s.head_dim)
        if s.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if rotate:
            q, k = self.rotary(positions, q, k)
        return q, k, v

    # forward = pre_attention → attention → post_attention. The two halves hold no attention and no cache
    # access: every op in them acts on each token row alone (with tensor parallelism, o_proj / down_proj
    # all-reduce row by row), so nvllm.engine.piecewise_graphs captures them, padded rows included, as CUDA
    # graphs. The attention step (``attention``) rotates q and k and stores k and v in one kernel.
    def pre_attention(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                      rotate: bool = True, qkv_out: torch.Tensor | None = None,
                      residual_out: torch.Tensor | None = None):
        """Input norm (with the residual add, except at the first layer: ``residual`` None), the fused q/k/v
        projection, q/k norms (Qwen3) and, unless ``rotate`` is False, rotary → (q [T, H, D], k [T, H_kv, D],
        v [T, H_kv, D], residual). ``rotate=False`` leaves the rotation to ``attention`` (and q, k, v may then
        be a quantized projection's unfinished ``PartialSum`` heads, which ``attention`` finishes). ``qkv_out`` /
        ``residual_out``: destinations for the projection's output and the residual (static buffers of a
        CUDA-graph piece, written in place instead of copied)."""
        if residual is None:
            residual = hidden if residual_out is None else residual_out.copy_(hidden)
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual, residual_out=residual_out)
        qkv = self.qkv_proj(hidden, out=qkv_out, partial=not rotate and not self.s.qk_norm)
        q, k, v = self.split_qkv(qkv, positions, rotate)
        return q, k, v, residual

    def attention(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache,
                  meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rotary of the unrotated q, k (``pre_attention(..., rotate=False)``) fused with the KV store, then
        paged attention → [T, H·D] (into ``out`` [T, H, D] when given; without it a split decode's partials may
        come back unmerged, for o_proj to merge: ``nvllm.kernels.attention_partials``)."""
        return self.attn(q, k, v, kv_cache, meta, positions=positions, rotary=self.rotary, out=out,
                         defer_merge=out is None)

    def post_attention(self, attn_out: torch.Tensor | AttentionPartials, residual: torch.Tensor):
        """o_proj, post-attention norm (with the residual add) and the MLP → (hidden, residual). ``hidden`` may
        be down_proj's unfinished ``PartialSum`` (a quantized GEMV's split-K sum, nvllm.kernels.partial_sum):
        the next RMSNorm's residual add finishes it, as the post-attention norm does o_proj's."""
        hidden = self.o_proj(attn_out, partial=True)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        if self.moe is not None:
            return self.moe(hidden), residual
        hidden = self.down_proj(self.gate_up_proj.silu_and_mul(hidden), partial=True)
        return hidden, residual

    def forward(self, positions, hidden, residual, kv_cache, meta: AttentionMetadata):
        q, k, v, residual = self.pre_attention(positions, hidden, residual, rotate=False)
        return self.post_attention(self.attention(positions, q, k, v, kv_cache, meta), residual)


class LlamaForCausalLM(nn.Module):
    """forward() returns the final hidden states of every token; compute_logits() the LM head on chosen rows.
    ``quant_plan`` (``{"layers.{i}.{linear}": scheme}``, from ``nvllm.quant.plan``) makes those linears
    ``QuantLinear``; embeddings and norms stay in full precision (the loader swaps in a ``QuantLMHead`` when the
    checkpoint's head is quantized). ``tp``: this rank's tensor-parallel group (None: the whole model on one
    device)."""

    def __init__(self, hf_config, architecture: str, dtype: torch.dtype,
                 quant_plan: dict[str, QuantScheme] | None = None, tp: TPGroup | None = None):
        super().__init__()
        tp = tp or TPGroup.single()
        s = self.shape = ModelShape(hf_config, architecture, tp.size, tp.rank)
        self.embed_tokens = VocabEmbedding(s.vocab_size, s.hidden_size, dtype, tp)
        plan = quant_plan or {}
        # one pair of fp32 cos/sin tables for all layers: a pair per layer took 16 MiB a layer at Qwen2.5-7B's 32768
        # positions (448 MiB in all), 64 MiB a layer at Llama 3.1's 131072
        rotary = RotaryEmbedding(s.head_dim, s.max_position, s.rope_theta, s.rope_scaling)
        self.layers = nn.ModuleList(
            DecoderLayer(s, dtype, {k.removeprefix(f"layers.{i}."): v for k, v in plan.items()
                                    if k.startswith(f"layers.{i}.")}, tp, rotary, i)
            for i in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps, dtype)
        self.lm_head = LMHead(s.vocab_size, s.hidden_size, dtype,
                              tied_to=self.embed_tokens if s.tie_word_embeddings else None, tp=tp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata):
        hidden = self.embed_tokens(input_ids)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(positions, hidden, residual, kv_cache, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits [rows, vocab_size]; with tensor parallelism on rank 0 only (None on the others, which
        must still call it: the vocabulary slices are gathered)."""
        return self.lm_head(hidden)

    # ---- checkpoint names ---------------------------------------------------------------------------------
    def param_for(self, name: str) -> tuple[str, int | None] | None:
        """Map an HF checkpoint tensor name to (our parameter name, shard index); None for tensors we skip."""
        if "rotary_emb.inv_freq" in name:
            return None
        if name == "lm_head.weight" and self.shape.tie_word_embeddings:
            return None
        name = name.replace("model.", "", 1) if name.startswith("model.") else name
        if self.shape.moe is not None and (moe := moe_param_for(name, self.shape.moe.sparse_layers)) is not None:
            return moe
        name = name.replace(".self_attn.", ".").replace(".mlp.", ".")
        for frag, (fused, shard) in STACKED.items():
            if frag in name:
                return name.replace(frag, fused), shard
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], prefix: str = "") -> None:
        """Copy checkpoint tensors into the parameters; every parameter (under ``prefix``, for a part of the model
        loaded on its own: "layers.3.") must be filled, shapes must agree."""
        params = dict(self.named_parameters())
        expected = {(n, sh) for n, p in params.items() if n.startswith(prefix) for sh in self._shards_of(n)}
        filled: set[tuple[str, int | None]] = set()
        tied_head = None  # a few rows of an lm_head.weight the tied head does not use
        for ckpt_name, tensor in weights:
            if ckpt_name == "lm_head.weight" and self.shape.tie_word_embeddings:
                tied_head = tensor[:8].clone()
            target = self.param_for(ckpt_name)
            if target is None:
                continue
            pname, shard = target
            if pname not in params:
                if ckpt_name.endswith(".bias") and not tensor.any():
                    continue  # AutoGPTQ / optimum give every quantized linear a zero bias, bias-less models too
                raise ConfigError(f"unexpected tensor {ckpt_name!r} in the checkpoint (no such parameter)")
            owner_name, leaf = pname.rsplit(".", 1) if "." in pname else ("", pname)
            owner = self.get_submodule(owner_name)
            if hasattr(owner, "load_tensor"):  # linears and vocabulary layers take their own piece
                owner.load_tensor(leaf, shard, tensor, ckpt_name)
                filled.add((pname, shard))
                continue
            dst = params[pname].data
            if tuple(tensor.shape) != tuple(dst.shape):
                raise ConfigError(f"shape mismatch for {ckpt_name!r}: checkpoint {tuple(tensor.shape)}, "
                                  f"model expects {tuple(dst.shape)}")
            dst.copy_(tensor)
            filled.add((pname, shard))
        missing = sorted(f"{n}" + ("" if sh is None else f"[shard {sh}]") for n, sh in expected - filled)
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ConfigError(f"checkpoint is missing tensors: {', '.join(missing[:5])}{more}")
        if tied_head is not None:
            self._check_tied_head(tied_head)

    def _check_tied_head(self, rows: torch.Tensor) -> None:
        """config.json ties the LM head to the embeddings, and the checkpoint has an lm_head.weight too: unused, as
        vLLM and transformers 4 leave it. Say so if it is not the embeddings (transformers 5 uses it then)."""
        emb = self.embed_tokens
        if emb.part.start != 0:  # the rows compared are rank 0's
            return
        n = min(len(rows), emb.part.size)
        if not torch.equal(emb.weight[:n].float().cpu(), rows[:n].float()):
            logger.warning("config.json ties the LM head to the embeddings (tie_word_embeddings), but the checkpoint's "
                           "lm_head.weight differs from them: it is not used (as in vLLM and transformers 4; "
                           "transformers 5 uses it). --hf-overrides '{\"tie_word_embeddings\": false}' uses it.")

    def _shards_of(self, pname: str) -> list:
        owner_name, leaf = pname.rsplit(".", 1)
        owner = self.get_submodule(owner_name)
        if hasattr(owner, "shards"):    # the stacked experts: a checkpoint tensor per expert and projection
            return owner.shards(leaf)
        if isinstance(owner, QuantLinear) and leaf == "g_idx":
            return []                   # optional: a GPTQ checkpoint without g_idx has contiguous groups (as vLLM)
        if isinstance(owner, (Linear, QuantLinear, Fp8Linear)) and len(owner.output_sizes) > 1:
            return list(range(len(owner.output_sizes)))
        return [None]
