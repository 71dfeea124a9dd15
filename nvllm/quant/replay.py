"""Full-sequence forward passes of the engine's own decoder layers, without the paged KV cache.

The quantizer replays calibration windows ``[batch, seq, hidden]`` through one ``DecoderLayer`` at a time:
the layer's own norms, linears (dense or quantized), q/k norms and rotary embedding, with plain causal
attention (``scaled_dot_product_attention``) over the whole window. ``tap(name, x)`` sees the input of each
linear (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``) as ``[tokens, in]``; ``stop_after`` (a stage of
``ORDER``) ends the pass once that stage's inputs have been tapped (the later stages are not needed yet).

In a mixture of experts the two MLP stages are every expert's and the shared expert's: ``moe.experts.{e}.gate_up_proj``
sees the tokens routed to expert e (HF transformers' loop: an expert sees only its own tokens, each once), and
``moe.experts.{e}.down_proj`` their SiLU·mul; ``moe.shared_expert.gate_up_proj`` / ``.down_proj`` see every token.
A linear's name ends with its stage (``stage_of``).

The residual stream is carried as one tensor (the layer's input plus its two branch outputs), which is what
the engine's fused add-and-norm computes. Sliding-window attention is not applied: windows longer than the
model's sliding window would see further back than the model does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from nvllm.kernels.activation import silu_and_mul
from nvllm.kernels.fused_moe import fused_experts_reference
from nvllm.kernels.moe_routing import route

Tap = Callable[[str, torch.Tensor], None]
ORDER = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def stage_of(name: str) -> str:
    """The stage of a linear named as the taps name it (``moe.experts.3.down_proj`` → ``down_proj``)."""
    return name.rsplit(".", 1)[-1]


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int, scale: float) -> torch.Tensor:
    """q [B·S, H, D], k/v [B·S, H_kv, D] → [B·S, H·D], causal within each window."""
    tokens, heads, dim = q.shape
    seq = tokens // batch
    kv_heads = k.shape[1]

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(batch, seq, t.shape[1], dim).transpose(1, 2)

    qb, kb, vb = split(q), split(k), split(v)
    if kv_heads != heads:
        kb = kb.repeat_interleave(heads // kv_heads, dim=1)
        vb = vb.repeat_interleave(heads // kv_heads, dim=1)
    out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
    return out.transpose(1, 2).reshape(tokens, heads * dim)


def layer_forward(layer, x: torch.Tensor, positions: torch.Tensor, tap: Tap | None = None,
                  stop_after: str | None = None) -> torch.Tensor | None:
    """One decoder layer over full windows: ``x [B, S, hidden]`` → ``[B, S, hidden]`` (None when stopped)."""
    batch, seq, hidden = x.shape
    flat = x.reshape(batch * seq, hidden)

    def emit(name: str, inp: torch.Tensor) -> bool:
        if tap is not None:
            tap(name, inp)
        return stage_of(name) == stop_after

    h = layer.input_layernorm(flat)
    if emit("qkv_proj", h):
        return None
    q, k, v = layer.split_qkv(layer.qkv_proj(h), positions.repeat(batch))
    attn = _causal_attention(q, k, v, batch, layer.attn.scale)
    if emit("o_proj", attn):
        return None
    flat = flat + layer.o_proj(attn)
    h = layer.post_attention_layernorm(flat)
    if layer.moe is not None:
        if not hasattr(layer.moe.experts, "w13"):   # packed experts (a served checkpoint): the engine's block
            return (flat + layer.moe(h)).reshape(batch, seq, hidden)
        # dense experts one by one in torch: the engine's grouped kernels are tuned for bf16 decode, not fp32 windows
        out = moe_forward(layer.moe, h, tap, stop_after)
        return None if out is None else (flat + out).reshape(batch, seq, hidden)
    if emit("gate_up_proj", h):
        return None
    act = silu_and_mul(layer.gate_up_proj(h), getattr(layer.gate_up_proj, "interleave", 0))
    if emit("down_proj", act):
        return None
    flat = flat + layer.down_proj(act)
    return flat.reshape(batch, seq, hidden)


def moe_forward(moe, h: torch.Tensor, tap: Tap | None = None, stop_after: str | None = None) -> torch.Tensor | None:
    """A ``SparseMoeBlock`` (dense experts) over ``h [tokens, hidden]``, expert by expert as
    ``fused_moe.experts_reference`` computes it, tapping each expert's and the shared expert's inputs (module doc);
    None when ``stop_after`` ends the pass."""
    m, experts = moe.m, moe.experts
    weights, ids = route(moe.gate(h), m.top_k, m.renormalize, m.weights_in_dtype)
    shared = moe.shared_expert
    if tap is not None:
        flat = ids.reshape(-1)
        routed = [(e, (flat == e).nonzero().squeeze(1) // m.top_k) for e in range(m.num_experts)]
        for stage in ("gate_up_proj", "down_proj"):
            for e, tok in routed:
                if tok.numel():
                    x = h[tok]
                    act = x if stage == "gate_up_proj" else silu_and_mul(F.linear(x, experts.w13[e]))
                    tap(f"moe.experts.{e}.{stage}", act)
            if shared is not None:
                tap(f"moe.shared_expert.{stage}", h if stage == "gate_up_proj" else shared.gate_up_proj.silu_and_mul(h))
            if stage == stop_after:
                return None
    out = fused_experts_reference(h, experts.w13, experts.w2, weights, ids)
    if shared is not None:
        out = out + torch.sigmoid(moe.shared_expert_gate(h)) * shared(h)
    return out


@torch.no_grad()
def model_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Float32 logits ``[B, S, vocab]`` of a whole ``LlamaForCausalLM`` over ``input_ids [B, S]``."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    x = model.embed_tokens(input_ids)
    for layer in model.layers:
        x = layer_forward(layer, x, positions)
    b, s, h = x.shape
    return model.compute_logits(model.norm(x.reshape(b * s, h))).reshape(b, s, -1)
