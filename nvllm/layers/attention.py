"""Attention over the paged KV cache. The model runner builds one AttentionMetadata per step; every layer
stores its new K/V by slot mapping and attends through the block tables."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from nvllm.kernels.kv_store import store_kv
from nvllm.kernels.paged_attention import paged_attention


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, −1 = padding
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    context_lens: torch.Tensor  # [B] int32, tokens in the cache after this step
    max_query_len: int
    max_context_len: int | None  # None: unknown on the host (CUDA graphs)


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, H_kv, D] → [T, H·D]."""
        k_cache, v_cache = kv_cache
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens,
                              self.scale, meta.max_query_len, max_context_len=meta.max_context_len)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
