"""Full-sequence forward passes of the engine's own decoder layers, without the paged KV cache.

The quantizer replays calibration windows ``[batch, seq, hidden]`` through one ``DecoderLayer`` at a time:
the layer's own norms, linears (dense or quantized), q/k norms and rotary embedding, with plain causal
attention (``scaled_dot_product_attention``) over the whole window. ``tap(name, x)`` sees the input of each
linear (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``) as ``[tokens, in]``; ``stop_after`` ends
the pass after that linear's input has been tapped (the later stages are not needed yet).

The residual stream is carried as one tensor (the layer's input plus its two branch outputs), which is what
the engine's fused add-and-norm computes. Sliding-window attention is not applied: windows longer than the
model's sliding window would see further back than the model does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from nvllm.kernels.activation import silu_and_mul

Tap = Callable[[str, torch.Tensor], None]
ORDER = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


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
        return name == stop_after

    h = layer.input_layernorm(flat)
    if emit("qkv_proj", h):
        return None
    q, k, v = layer.split_qkv(layer.qkv_proj(h), positions.repeat(batch))
    attn = _causal_attention(q, k, v, batch, layer.attn.scale)
    if emit("o_proj", attn):
        return None
    flat = flat + layer.o_proj(attn)
    h = layer.post_attention_layernorm(flat)
    if layer.moe is not None:   # a mixture of experts: served, not quantized by nvllm (no taps inside)
        return (flat + layer.moe(h)).reshape(batch, seq, hidden)
    if emit("gate_up_proj", h):
        return None
    act = silu_and_mul(layer.gate_up_proj(h), getattr(layer.gate_up_proj, "interleave", 0))
    if emit("down_proj", act):
        return None
    flat = flat + layer.down_proj(act)
    return flat.reshape(batch, seq, hidden)


@torch.no_grad()
def model_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Float32 logits ``[B, S, vocab]`` of a whole ``LlamaForCausalLM`` over ``input_ids [B, S]``."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    x = model.embed_tokens(input_ids)
    for layer in model.layers:
        x = layer_forward(layer, x, positions)
    b, s, h = x.shape
    return model.compute_logits(model.norm(x.reshape(b * s, h))).reshape(b, s, -1)
