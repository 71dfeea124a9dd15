"""Store the new tokens' keys and values into the paged KV cache by slot mapping.

Cache layout (one tensor each for K and V, per layer): ``[num_blocks, block_size, num_kv_heads, head_dim]``.
Slot ``s`` is block ``s // block_size``, offset ``s % block_size``. A slot of -1 means "do not store"
(padding rows of a CUDA-graph batch).

This file holds the op's three parts: the torch reference, the Triton kernel and the dispatch.
"""

from __future__ import annotations

import functools

import torch

from nvllm.kernels import report
from nvllm.kernels.backend import use_triton

tl = None  # triton.language, bound by _jit at the first launch


@functools.lru_cache(maxsize=None)
def _jit(kernel):
    """``triton.jit(kernel)``, applied at the first launch instead of at import: the package imports without
    Triton, and Triton must be imported only after TRITON_INTERPRET is set (the interpreter tests set it after
    the package has been imported)."""
    global tl
    import triton
    import triton.language

    tl = triton.language
    return triton.jit(kernel)


# ---------------------------------------------------------------------------------------------- reference


def store_kv_reference(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """key/value: [T, num_kv_heads, head_dim]; slot_mapping: [T] int (−1 = skip)."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    n_kv, d = k_cache.shape[-2:]
    k_cache.view(-1, n_kv, d).index_copy_(0, slots, key[valid].to(k_cache.dtype))
    v_cache.view(-1, n_kv, d).index_copy_(0, slots, value[valid].to(v_cache.dtype))


# ------------------------------------------------------------------------------------------------- Triton


# a Triton kernel: launched as _jit(_store_kv_kernel)[grid](...)
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_kd,          # key   [T, H_kv, D]
    stride_vt, stride_vh, stride_vd,          # value [T, H_kv, D]
    stride_cb, stride_co, stride_ch, stride_cd,   # k_cache [num_blocks, block_size, H_kv, D]
    stride_ub, stride_uo, stride_uh, stride_ud,   # v_cache (may differ from k_cache's strides)
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr,                 # tokens per cache block
    BLOCK_H: tl.constexpr,                    # next power of two >= num_kv_heads
    BLOCK_D: tl.constexpr,                    # next power of two >= head_dim
):
    """One program per token: copies that token's [H_kv, D] key and value tile into its cache slot."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < num_kv_heads) & (d < head_dim)

        k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
        dst = k_cache_ptr + blk * stride_cb + off * stride_co + h * stride_ch + d * stride_cd
        tl.store(dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)

        v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
        dst = v_cache_ptr + blk * stride_ub + off * stride_uo + h * stride_uh + d * stride_ud
        tl.store(dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Same contract as ``store_kv_reference``. Grid: one program per token (T programs); each moves
    2 · H_kv · D elements, loads contiguous along head_dim. Slots of -1 are skipped; values are cast to the
    cache dtype. key/value may be strided views (e.g. slices of a fused qkv output)."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    import triton

    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    assert key.shape == value.shape == (num_tokens, num_kv_heads, head_dim), (key.shape, k_cache.shape)
    assert v_cache.shape == k_cache.shape and slot_mapping.shape == (num_tokens,)
    block_h = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    _jit(_store_kv_kernel)[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(),
        num_kv_heads, head_dim,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=4 if block_h * block_d >= 1024 else 2,
    )


# ----------------------------------------------------------------------------------------------- dispatch


def store_kv(key, value, k_cache, v_cache, slot_mapping) -> None:
    if use_triton(key):
        report.record("kv_store", "triton store_kv")
        store_kv_triton(key, value, k_cache, v_cache, slot_mapping)
        return
    report.record("kv_store", "torch index_copy")
    store_kv_reference(key, value, k_cache, v_cache, slot_mapping)
