"""Attention over the paged KV cache. The model runner builds one AttentionMetadata per step; every layer
stores its new K/V by slot mapping (in the decoder fused with the rotary embedding of q and k: ``rope_store``)
and attends through the block tables.

Each layer's cache is a ``KVCache``: K and V blocks ``[num_blocks, block_size, num_kv_heads, head_dim]`` and, for
a quantized cache (``kv_cache_dtype`` int8 / fp8_e4m3), their fp32 scales ``[num_blocks, block_size,
num_kv_heads]`` (one per token and KV head, computed when the token is stored), paged by the same block ids —
so prefix caching, chunked prefill and preemption, which only move block ids, need nothing more."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from nvllm.config import ConfigError
from nvllm.kernels import attention_partials
from nvllm.kernels.attention_partials import AttentionPartials
from nvllm.kernels.kv_store import store_kv
from nvllm.kernels.paged_attention import paged_attention
from nvllm.kernels.rope_store import rope_store

# --kv-cache-dtype -> element type of the cache (None: the model's dtype, no scales)
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "int8": torch.int8,
                                                  "fp8_e4m3": torch.float8_e4m3fn}
SCALE_DTYPE = torch.float32


class KVCache(NamedTuple):
    """One layer's paged KV cache; ``kv[0]`` / ``kv[1]`` are K and V as in a plain (k, v) tuple."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # [num_blocks, block_size, num_kv_heads] fp32 (quantized cache only)
    v_scale: torch.Tensor | None = None


def kv_cache_element_dtype(model_dtype: torch.dtype, kv_cache_dtype: str) -> torch.dtype:
    return KV_CACHE_DTYPES[kv_cache_dtype] or model_dtype


def kv_cache_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, model_dtype: torch.dtype,
                             kv_cache_dtype: str = "auto") -> int:
    """Real bytes one token occupies in the pool: K and V elements of every layer plus, when quantized, one
    fp32 scale per (layer, K/V, KV head)."""
    elem = kv_cache_element_dtype(model_dtype, kv_cache_dtype)
    per_head = head_dim * elem.itemsize
    if KV_CACHE_DTYPES[kv_cache_dtype] is not None:
        per_head += SCALE_DTYPE.itemsize
    return 2 * num_layers * num_kv_heads * per_head


class KVCacheTooLarge(ConfigError):
    """The KV cache asked for does not fit in the device's memory (a draft model's callers say more)."""


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       model_dtype: torch.dtype, kv_cache_dtype: str, device) -> list[KVCache]:
    """Zeroed caches for every layer (zeros dequantize to zeros: a scale of 0 and elements of 0). K and V of all
    layers are slices of one allocation ``[num_layers, 2, num_blocks, ...]`` (the scales of another), so that a
    sequence's blocks of every layer move in one copy (nvllm.disagg.staging)."""
    elem = kv_cache_element_dtype(model_dtype, kv_cache_dtype)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    try:
        kv = torch.zeros((num_layers, 2, *shape), dtype=elem, device=device)
        if KV_CACHE_DTYPES[kv_cache_dtype] is None:
            return [KVCache(kv[i, 0], kv[i, 1]) for i in range(num_layers)]
        scales = torch.zeros((num_layers, 2, *shape[:3]), dtype=SCALE_DTYPE, device=device)
    except RuntimeError as e:  # torch.OutOfMemoryError on a GPU, the CPU allocator's "can't allocate memory"
        if not isinstance(e, torch.OutOfMemoryError) and "allocate" not in str(e):
            raise
        size = num_blocks * block_size * kv_cache_bytes_per_token(num_layers, num_kv_heads, head_dim, model_dtype,
                                                                  kv_cache_dtype)
        raise KVCacheTooLarge(f"a KV cache of {num_blocks} blocks ({size / 2**30:.2f} GiB) does not fit in {device}'s "
                          "memory: ask for less (--kv-cache-memory, --num-kv-blocks, --gpu-memory-utilization)") \
            from None
    return [KVCache(kv[i, 0], kv[i, 1], scales[i, 0], scales[i, 1]) for i in range(num_layers)]


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, −1 = padding
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    context_lens: torch.Tensor  # [B] int32, tokens in the cache after this step
    max_query_len: int
    max_context_len: int | None  # None: unknown on the host (CUDA graphs)
    # > 0: a decode step in which each sequence stores (at most) its last ``fresh_tokens`` tokens and nothing else
    # the attention reads changes: its kernel may read the others before the PDL wait (0: no such promise)
    fresh_tokens: int = 0


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        """Head counts are this rank's under tensor parallelism (its KV cache holds only its KV heads)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache | tuple,
                meta: AttentionMetadata, positions: torch.Tensor | None = None, rotary=None,
                out: torch.Tensor | None = None, defer_merge: bool = False) -> torch.Tensor | AttentionPartials:
        """q: [T, H, D], k/v: [T, H_kv, D] → [T, H·D]. ``kv_cache``: a KVCache (or a plain (k, v) tuple).

        With ``positions`` [T] and ``rotary`` (a RotaryEmbedding: its cos/sin tables) q and k come unrotated:
        one fused kernel rotates both in place and stores k and v into the cache (``rope_store``, the same
        bits as rotary then store). Without them q and k are already rotated and only the store runs. With them
        q, k, v may also be a quantized qkv projection's unfinished ``PartialSum`` heads (``rope_store`` finishes
        them).
        ``out``: a [T, H, D] buffer (e.g. a view of a static one) the attention writes into; the result is
        then a view of it. ``defer_merge``: a split decode may return its partials unmerged
        (``nvllm.kernels.attention_partials``; its consumer merges them)."""
        if len(kv_cache) == 2:
            (k_cache, v_cache), k_scale, v_scale = kv_cache, None, None
        else:
            k_cache, v_cache, k_scale, v_scale = kv_cache
        if rotary is None:
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        else:
            assert positions is not None, "the fused rotary + KV store needs the positions"
            q, _ = rope_store(q, k, v, positions, rotary.cos, rotary.sin, k_cache, v_cache, meta.slot_mapping,
                              k_scale, v_scale)
        out = paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.context_lens,
                              self.scale, meta.max_query_len, out=out, max_context_len=meta.max_context_len,
                              k_scale=k_scale, v_scale=v_scale, fresh_tokens=meta.fresh_tokens,
                              defer_merge=defer_merge and out is None and attention_partials.enabled())
        if isinstance(out, AttentionPartials):
            return out
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
