"""How many KV-cache blocks a rank holds: the count asked for (``num_kv_blocks``), the bytes asked for
(``kv_cache_memory``), or on a GPU what ``gpu_memory_utilization`` leaves after the model's profiled peak, less what
a speculative draft model and the LoRA slots will take; on the CPU room for max_num_seqs full-length sequences, at
most 4 GiB. And the max_model_len those blocks can hold."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

from nvllm.config import ConfigError, EngineConfig
from nvllm.layers.attention import kv_cache_bytes_per_token
from nvllm.lora.manager import layer_linears
from nvllm.models.llama import ModelShape
from nvllm.models.loader import load_hf_config
from nvllm.models.registry import resolve_architecture

GiB = 1 << 30
logger = logging.getLogger("nvllm")


def num_kv_blocks(config: EngineConfig, model: torch.nn.Module, dtype: torch.dtype, kv_bytes_per_token: int,
                  max_model_len: int, profile_free_memory: Callable[[], int] | None) -> int:
    """The blocks this rank's memory holds. ``profile_free_memory`` (GPU only): the bytes left for the KV cache
    after a profiling forward pass."""
    c = config
    per_block = kv_bytes_per_token * c.block_size
    if c.num_kv_blocks is not None:
        n = c.num_kv_blocks
    elif c.kv_cache_memory is not None:
        n = int(c.kv_cache_memory * GiB // per_block)
    elif profile_free_memory is not None:
        draft_weights, draft_per_token = draft_footprint(config, dtype)
        free = profile_free_memory() - draft_weights - lora_footprint(config, model, dtype)
        n = free // (per_block + draft_per_token * c.block_size)
    else:
        want = c.max_num_seqs * math.ceil(max_model_len / c.block_size)
        n = min(want, int(4 * GiB // per_block))
    return int(n)


def lora_footprint(config: EngineConfig, model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Device bytes that max_loras adapters of max_lora_rank may take (0 without LoRA): A and B of every decoder
    linear, a fused one's ranks per projection. Set aside before the KV cache takes the rest."""
    c = config
    if not c.enable_lora:
        return 0
    total = 0
    for layer in model.layers:
        for name in layer_linears(layer):
            lin = getattr(layer, name)
            lin = getattr(lin, "base", lin)
            total += c.max_lora_rank * len(lin.output_sizes) * (lin.in_features + lin.out_features)
    return total * c.max_loras * dtype.itemsize


def draft_footprint(config: EngineConfig, dtype: torch.dtype) -> tuple[int, int]:
    """(weight bytes, KV bytes per token) of the speculative draft model that will share this GPU and this block
    count; (0, 0) without one. Estimated from its config.json, in the target's dtypes."""
    spec = config.speculative
    if spec is None or getattr(spec, "method", None) != "draft":
        return 0, 0
    from nvllm.models.hub import resolve_model_path

    hf = load_hf_config(resolve_model_path(spec.draft_model))
    s = ModelShape(hf, resolve_architecture(hf)[0])
    h, layers, heads, kv_heads, head_dim = s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim
    params = layers * (h * head_dim * (heads + 2 * kv_heads) + heads * head_dim * h) + s.mlp_parameters() \
        + s.vocab_size * h * (1 if s.tie_word_embeddings else 2)
    return params * dtype.itemsize, kv_cache_bytes_per_token(layers, kv_heads, head_dim, dtype, config.kv_cache_dtype)


def fit_max_model_len(max_model_len: int, capacity: int, explicit: bool) -> int:
    """max_model_len within the KV cache's ``capacity`` (tokens). A sequence may grow to max_model_len tokens, so the
    pool must hold that many: otherwise a lone long sequence would preempt itself forever. An ``explicit``
    max_model_len over the capacity is an error; the model's own limit is lowered to the capacity, and the log says
    so."""
    if max_model_len <= capacity:
        return max_model_len
    if explicit:
        raise ConfigError(f"max_model_len {max_model_len} exceeds the KV cache's {capacity} tokens; "
                          "lower --max-model-len or give the cache more memory (--gpu-memory-utilization, "
                          "--kv-cache-memory, --num-kv-blocks)")
    logger.warning("max_model_len lowered from %d to %d, the tokens the KV cache holds", max_model_len, capacity)
    return capacity
