"""Attention over the paged KV cache, for any mix of prefill chunks and decodes.

Inputs (one flattened batch of B sequences, T query tokens in all):
  q              [T, num_heads, head_dim]
  k_cache/v_cache[num_blocks, block_size, num_kv_heads, head_dim]   (this step's K/V already stored)
  block_tables   [B, max_blocks] int32   (block ids of each sequence, padded with anything)
  query_start_loc[B + 1] int32           (sequence b owns q rows query_start_loc[b]:query_start_loc[b+1])
  context_lens   [B] int32               (tokens in the cache for b after this step's store)
  k_scale/v_scale[num_blocks, block_size, num_kv_heads] fp32, or None  (scales of an int8 / fp8 e4m3 cache:
                                         element x of the cache stands for x · scale of its token and head)
The query rows of sequence b are the last ``query_len`` positions of its context, so row j attends to cache
positions ``0 .. context_len - query_len + j`` (causal). Decode is the case query_len == 1; chunked prefill
and prefix-cache hits are the case context_len > query_len. GQA: head h reads KV head h // (H / H_kv).
"""

from __future__ import annotations

import torch

from nvllm.kernels import report
from nvllm.kernels.backend import use_triton
from nvllm.kernels.kv_store import dequantize_kv_reference


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                              context_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
                              v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 attention per sequence; a quantized cache is dequantized explicitly (``dequantize_kv_reference``)
    on the blocks each sequence reads."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    block_size = k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    ctx_lens = context_lens.tolist()
    for b, ctx in enumerate(ctx_lens):
        s, e = starts[b], starts[b + 1]
        n = e - s
        if n == 0:
            continue
        nblocks = (ctx + block_size - 1) // block_size
        blocks = block_tables[b, :nblocks].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx]
        if k_scale is None:
            k, v = k.float(), v.float()
        else:
            k = dequantize_kv_reference(k, k_scale[blocks].reshape(-1, num_kv_heads)[:ctx])
            v = dequantize_kv_reference(v, v_scale[blocks].reshape(-1, num_kv_heads)[:ctx])
        k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, ctx, D]
        v = v.repeat_interleave(group, dim=1).transpose(0, 1)
        qb = q[s:e].float().transpose(0, 1)  # [H, n, D]
        scores = torch.matmul(qb, k.transpose(1, 2)) * scale  # [H, n, ctx]
        q_pos = torch.arange(ctx - n, ctx, device=q.device)
        k_pos = torch.arange(ctx, device=q.device)
        scores.masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[s:e] = torch.matmul(probs, v).transpose(0, 1).to(q.dtype)
    return out


def paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale: float,
                    max_query_len: int, out: torch.Tensor | None = None,
                    max_context_len: int | None = None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, fresh_tokens: int = 0,
                    defer_merge: bool = False):
    """Dispatch: the Triton decode kernel when every sequence has one query token, the Triton prefill/extend
    kernel otherwise; the torch reference on CPU. ``max_context_len`` (None: unknown on the host, as under
    CUDA graphs) sizes the decode kernel's split grid. ``k_scale``/``v_scale``: a quantized cache's scales
    (the kernels dequantize as they read). ``fresh_tokens``, ``defer_merge`` (the decode kernel may then return
    its ``AttentionPartials``): see ``decode_attention``."""
    quant = "" if k_scale is None else f" ({str(k_cache.dtype).removeprefix('torch.')} KV)"
    if use_triton(q):
        if max_query_len == 1:
            from nvllm.kernels.decode_attention import decode_attention

            report.record("attention.decode", "triton paged decode" + quant)
            return decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, out=out,
                                    max_context_len=max_context_len, k_scale=k_scale, v_scale=v_scale,
                                    fresh_tokens=fresh_tokens, defer_merge=defer_merge)
        from nvllm.kernels.prefill_attention import prefill_attention

        report.record("attention.prefill", "triton paged prefill" + quant)
        return prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
                                 max_query_len, out=out, k_scale=k_scale, v_scale=v_scale)
    report.record("attention.decode" if max_query_len == 1 else "attention.prefill", "torch reference" + quant)
    result = paged_attention_reference(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
                                       k_scale=k_scale, v_scale=v_scale)
    if out is not None:
        out.copy_(result)
        return out
    return result
