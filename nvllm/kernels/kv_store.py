"""Store the new tokens' keys and values into the paged KV cache by slot mapping.

Cache layout (one tensor each for K and V, per layer): ``[num_blocks, block_size, num_kv_heads, head_dim]``.
Slot ``s`` is block ``s // block_size``, offset ``s % block_size``. A slot of -1 means "do not store"
(padding rows of a CUDA-graph batch).

Quantized cache (``--kv-cache-dtype int8|fp8_e4m3``): the caches hold int8 or float8_e4m3fn elements and each has
a scale tensor beside it, fp32 ``[num_blocks, block_size, num_kv_heads]``, paged by the same slots. Storing a
token quantizes each of its (token, head) vectors symmetrically with its own scale, computed on the fly:
  amax  = max(max_d |x[d]|, AMAX_FLOOR)      scale = amax / QMAX      y = x · (QMAX / amax)
  int8: q = clamp(floor(y + 0.5), -127, 127)        fp8 e4m3: q = clamp(y, -448, 448) rounded to e4m3
and the attention kernels read ``x ≈ q · scale`` (``dequantize_kv_reference``).

This file holds the op's three parts: the torch reference, the Triton kernel and the dispatch.
"""

from __future__ import annotations

import torch

from nvllm.kernels import report
from nvllm.kernels.backend import use_triton
from nvllm.kernels.jit import lazy_jit

tl = None  # triton.language, bound by lazy_jit at the first launch
_jit = lazy_jit


# ---------------------------------------------------------------------------------------------- reference

# quantized cache element type -> largest magnitude it stores
KV_QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
AMAX_FLOOR = 1e-10   # an all-zero vector gets this amax (scale ~1e-12, q = 0) instead of a division by zero


def quantize_kv_reference(x: torch.Tensor, qdtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (q [..., D] of qdtype, scale [...] fp32): one symmetric scale per vector (token, head)."""
    qmax = KV_QMAX[qdtype]
    x = x.float()
    amax = x.abs().amax(-1).clamp_min(AMAX_FLOOR)
    y = x * (qmax / amax)[..., None]
    if qdtype == torch.int8:
        q = torch.floor(y + 0.5).clamp(-qmax, qmax).to(torch.int8)
    else:
        q = y.clamp(-qmax, qmax).to(qdtype)
    return q, amax / qmax


def dequantize_kv_reference(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [..., D] int8/fp8, scale [...] fp32 -> fp32 [..., D]."""
    return q.float() * scale[..., None]


def store_kv_reference(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None) -> None:
    """key/value: [T, num_kv_heads, head_dim]; slot_mapping: [T] int (−1 = skip). With k_scale/v_scale (a
    quantized cache) each vector is quantized by ``quantize_kv_reference`` and its scale stored beside it."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    n_kv, d = k_cache.shape[-2:]
    if k_scale is None:
        k_cache.view(-1, n_kv, d).index_copy_(0, slots, key[valid].to(k_cache.dtype))
        v_cache.view(-1, n_kv, d).index_copy_(0, slots, value[valid].to(v_cache.dtype))
        return
    for x, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        q, s = quantize_kv_reference(x[valid], cache.dtype)
        # one-byte elements copied as uint8: index_copy_ has no float8 kernel on the CPU
        cache.view(torch.uint8).view(-1, n_kv, d).index_copy_(0, slots, q.view(torch.uint8))
        scale.view(-1, n_kv).index_copy_(0, slots, s)


# ------------------------------------------------------------------------------------------------- Triton


# a Triton kernel: launched as _jit(_store_kv_kernel)[grid](...)
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_kd,          # key   [T, H_kv, D]
    stride_vt, stride_vh, stride_vd,          # value [T, H_kv, D]
    stride_cb, stride_co, stride_ch, stride_cd,   # k_cache [num_blocks, block_size, H_kv, D]
    stride_ub, stride_uo, stride_uh, stride_ud,   # v_cache (may differ from k_cache's strides)
    stride_sb, stride_so, stride_sh,          # k_scale / v_scale [num_blocks, block_size, H_kv] (QUANT only)
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr,                 # tokens per cache block
    BLOCK_H: tl.constexpr,                    # next power of two >= num_kv_heads
    BLOCK_D: tl.constexpr,                    # next power of two >= head_dim
    QUANT: tl.constexpr,                      # 0: plain copy + cast; 1: int8; 2: fp8 e4m3 (with scales)
    QMAX: tl.constexpr,                       # 127 (int8) or 448 (fp8 e4m3)
):
    """One program per token: copies that token's [H_kv, D] key and value tile into its cache slot; with QUANT
    it quantizes each head's vector with its own scale (amax over D) and stores the scales beside."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < num_kv_heads) & (d < head_dim)

        k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
        v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
        k_dst = k_cache_ptr + blk * stride_cb + off * stride_co + h * stride_ch + d * stride_cd
        v_dst = v_cache_ptr + blk * stride_ub + off * stride_uo + h * stride_uh + d * stride_ud
        if QUANT == 0:
            tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
        else:
            s_off = blk * stride_sb + off * stride_so + tl.arange(0, BLOCK_H) * stride_sh
            h_mask = tl.arange(0, BLOCK_H) < num_kv_heads
            # key: amax per head, y = x * QMAX / amax, rounded into the cache type
            kf = tl.where(mask, k.to(tl.float32), 0.0)        # masked lanes: 0, not garbage
            k_amax = tl.maximum(tl.max(tl.abs(kf), 1), 1e-10)
            ky = kf * (QMAX / k_amax)[:, None]
            if QUANT == 1:
                ky = tl.floor(ky + 0.5)
            ky = tl.minimum(tl.maximum(ky, -QMAX), QMAX)
            tl.store(k_dst, ky.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(k_scale_ptr + s_off, k_amax / QMAX, mask=h_mask)
            # value: the same
            vf = tl.where(mask, v.to(tl.float32), 0.0)
            v_amax = tl.maximum(tl.max(tl.abs(vf), 1), 1e-10)
            vy = vf * (QMAX / v_amax)[:, None]
            if QUANT == 1:
                vy = tl.floor(vy + 0.5)
            vy = tl.minimum(tl.maximum(vy, -QMAX), QMAX)
            tl.store(v_dst, vy.to(v_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_scale_ptr + s_off, v_amax / QMAX, mask=h_mask)


def store_quant_args(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                     v_scale: torch.Tensor | None) -> tuple[int, float, torch.Tensor, torch.Tensor, tuple]:
    """The kernels' ``QUANT`` (0 plain, 1 int8, 2 fp8 e4m3), ``QMAX``, scale tensors and their strides for a
    cache (an unquantized one passes k_cache twice, never read, and zero strides)."""
    if k_scale is None:
        return 0, 1.0, k_cache, k_cache, (0, 0, 0)
    assert k_scale.shape == v_scale.shape == k_cache.shape[:3] and k_scale.stride() == v_scale.stride()
    assert k_scale.dtype == v_scale.dtype == torch.float32 and v_cache.dtype == k_cache.dtype
    return 1 if k_cache.dtype == torch.int8 else 2, KV_QMAX[k_cache.dtype], k_scale, v_scale, k_scale.stride()


def store_kv_triton(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None) -> None:
    """Same contract as ``store_kv_reference``. Grid: one program per token (T programs); each moves
    2 · H_kv · D elements, loads contiguous along head_dim. Slots of -1 are skipped; values are cast to the
    cache dtype, or quantized with per-(token, head) scales when k_scale/v_scale are given. key/value may be
    strided views (e.g. slices of a fused qkv output)."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    import triton

    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    assert key.shape == value.shape == (num_tokens, num_kv_heads, head_dim), (key.shape, k_cache.shape)
    assert v_cache.shape == k_cache.shape and slot_mapping.shape == (num_tokens,)
    block_h = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    quant, qmax, k_scale, v_scale, scale_strides = store_quant_args(k_cache, v_cache, k_scale, v_scale)
    _jit(_store_kv_kernel)[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale,
        *key.stride(), *value.stride(), *k_cache.stride(), *v_cache.stride(), *scale_strides,
        num_kv_heads, head_dim,
        BLOCK_SIZE=k_cache.shape[1], BLOCK_H=block_h, BLOCK_D=block_d, QUANT=quant, QMAX=qmax,
        num_warps=4 if block_h * block_d >= 1024 else 2,
    )


# ----------------------------------------------------------------------------------------------- dispatch


def store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """k_scale/v_scale: the scale tensors of a quantized cache (None: the cache holds the model dtype)."""
    if use_triton(key):
        report.record("kv_store", "triton store_kv" if k_scale is None else "triton store_kv (quantize)")
        store_kv_triton(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    report.record("kv_store", "torch index_copy" if k_scale is None else "torch quantize + index_copy")
    store_kv_reference(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
