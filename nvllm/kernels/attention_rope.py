"""Rotary embedding and the KV store of a decode step done by decode attention itself.

In a decode step the qkv projection's one-row GEMV leaves its split-K sum unfinished (``partial_sum``) and the
rotary + KV-store kernel (``rope_store``) finishes it, rotates q and k and stores k and v; decode attention then
reads q and the cache. That is one more dependent launch per layer for a few KB. When every sequence has one query
token, decode attention's stage 1 can do it in its own programs (``decode_attention(..., rope=DecodeRope(...))``):

- every program finishes (bias added, rounded to the activations' dtype: the finished GEMV's bits) and rotates the
  q heads of its KV group from the accumulator, instead of reading a rotated q;
- the program whose partition holds the sequence's newest token (position ``context_len − 1``) finishes and
  rotates that token's k, finishes its v, stores both into the cache slot ``slot_mapping`` names, and uses them
  from its registers for that row of its tile (so nothing reads a cache row this launch writes);
- the last program of each (sequence, KV group) to finish reading — a ticket per group, taken after its reads,
  released — zeroes what the group read, leaving the accumulator ready for the next GEMV (the ticket goes back to
  0). One program per group needs no ticket.

Before the PDL wait the program reads the position, cos/sin row and slot (staged before the step), and its first
tile's cached tokens (every one but the newest: the projection before this kernel writes no cache row).

The rotation is ``rope_store``'s (rotate-half, fp32 arithmetic on the rounded inputs, rounded once) and the cache
holds what ``rope_store`` stores; a quantized (int8 / fp8) cache keeps the separate ``rope_store`` launch.
``NVLLM_ATTENTION_ROPE=0`` keeps it always (read at each call, like ``NVLLM_PDL``; the GPU benchmark compares both).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from nvllm.kernels.backend import use_triton
from nvllm.kernels.partial_sum import PartialSum

tl = None  # triton.language, bound by lazy_jit when the attention kernel that calls these helpers is jitted


def enabled() -> bool:
    """Whether decode attention may take over rope_store's work (``NVLLM_ATTENTION_ROPE=0``: never)."""
    return os.environ.get("NVLLM_ATTENTION_ROPE", "1").lower() not in ("0", "off")


@dataclass
class DecodeRope:
    """This step's unfinished k and v (``PartialSum`` heads of the qkv projection, [B, H_kv, D]; q's heads are
    decode attention's q), the rotary tables and each sequence's position and cache slot ([B])."""

    k: PartialSum
    v: PartialSum
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor
    tickets: torch.Tensor   # int32, zero, at least B · H_kv (``tickets``); the kernel leaves it zero

    def kernel_args(self, q: PartialSum) -> tuple:
        """The stage-1 kernel's rotary arguments (see ``_decode_stage1_kernel``)."""
        assert self.k.acc.stride() == self.v.acc.stride() and self.cos.stride() == self.sin.stride()
        bias = (q.bias, self.k.bias, self.v.bias) if q.bias is not None else (q.acc,) * 3
        return (*bias, self.k.acc, self.v.acc, self.positions, self.cos, self.sin, self.slot_mapping, self.tickets,
                *self.k.acc.stride(), *self.cos.stride())


def prepare(q, k, v, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slot_mapping: torch.Tensor,
            quantized_cache: bool, max_query_len: int, num_seqs: int) -> DecodeRope | None:
    """The ``DecodeRope`` for a decode attention that rotates and stores for ``rope_store``, or None where it cannot:
    q/k/v not a pending sum's heads, the torch path, a query of more than one token per sequence, rows past the last sequence (no
    program would zero them), a quantized cache, ``enabled()`` false, or no ticket buffer while a CUDA graph is
    captured."""
    if not (isinstance(q, PartialSum) and isinstance(k, PartialSum) and isinstance(v, PartialSum)):
        return None
    if max_query_len != 1 or q.shape[0] != num_seqs or quantized_cache or not enabled() or not use_triton(q.acc):
        return None
    t = tickets(q.device, num_seqs * k.shape[1])
    return None if t is None else DecodeRope(k, v, positions, cos, sin, slot_mapping, t)


_TICKETS: dict[torch.device, torch.Tensor] = {}


def tickets(device: torch.device, numel: int) -> torch.Tensor | None:
    """A zeroed int32 ticket buffer of at least ``numel`` counters on this device, grown as needed (older ones stay
    allocated: CUDA graphs may hold them); None while a CUDA graph is being captured and none is large enough yet.
    One per device, so decode attentions on concurrent streams must not use it."""
    held = _TICKETS.get(torch.device(device))
    if held is not None and held.numel() >= numel:
        return held
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    _TICKETS[torch.device(device)] = torch.zeros(max(numel, 1024), device=device, dtype=torch.int32)
    return _TICKETS[torch.device(device)]


# --------------------------------------------------------------------------- Triton helpers of stage 1 (jitted with it)


def _rope_inputs(pos_ptr, slot_ptr, cos_ptr, sin_ptr, stride_cosp, stride_cosd, b, dd, d_mask2, head_dim):
    """Sequence ``b``'s cos and sin per column of a ``[1, BLOCK_D]`` tile ``dd`` (column j and j + D/2 share
    one), each column's rotate-half partner and the sequence's cache slot."""
    half = head_dim // 2
    pos = tl.load(pos_ptr + b).to(tl.int64)
    col = tl.where(dd < half, dd, dd - half)
    c = tl.load(cos_ptr + pos * stride_cosp + col * stride_cosd, mask=d_mask2, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_cosp + col * stride_cosd, mask=d_mask2, other=0.0).to(tl.float32)
    partner = tl.where(dd < half, dd + half, dd - half)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    return c, s, partner, slot


def _finished_rows(acc, bias, rows, dd, stride_r, stride_d, head_dim, mask, HAS_BIAS: tl.constexpr, ty):
    """Heads ``rows`` ([R, 1]) of a pending sum at columns ``dd`` as the finished GEMV stores them: fp32 sum plus
    bias, rounded once to ``ty``."""
    x = tl.load(acc + rows * stride_r + dd * stride_d, mask=mask, other=0.0)
    if HAS_BIAS:
        x += tl.load(bias + rows * head_dim + dd, mask=mask, other=0.0).to(tl.float32)
    return x.to(ty)


def _rotated_rows(acc, bias, rows, dd, partner, c, s, stride_r, stride_d, head_dim, mask, HAS_BIAS: tl.constexpr,
                  ty):
    """``_finished_rows`` rotated (rotate-half: ``rope_store``'s arithmetic), in ``ty``."""
    x = _finished_rows(acc, bias, rows, dd, stride_r, stride_d, head_dim, mask, HAS_BIAS, ty).to(tl.float32)
    xp = _finished_rows(acc, bias, rows, partner, stride_r, stride_d, head_dim, mask, HAS_BIAS, ty).to(tl.float32)
    return tl.where(dd < head_dim // 2, x * c - xp * s, x * c + xp * s).to(ty)


_rotated_rows.helpers = ("_finished_rows",)


def _zero_sums(q_ptr, k_ptr, v_ptr, b, kvh, stride_qb, stride_qh, stride_qd, stride_nb, stride_nh, stride_nd,
               head_dim, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """Zeroes sequence ``b``'s sums of KV group ``kvh``: its GROUP q heads and its k and v head (indices made
    here, not kept alive from the kernel's start)."""
    g = tl.arange(0, BLOCK_G)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    q_rows = q_ptr + b.to(tl.int64) * stride_qb + (kvh * GROUP + g) * stride_qh + d * stride_qd
    tl.store(q_rows, tl.zeros([BLOCK_G, BLOCK_D], tl.float32), mask=(g < GROUP) & (d < head_dim))
    kv = b.to(tl.int64) * stride_nb + kvh * stride_nh + d * stride_nd
    tl.store(k_ptr + kv, tl.zeros([1, BLOCK_D], tl.float32), mask=d < head_dim)
    tl.store(v_ptr + kv, tl.zeros([1, BLOCK_D], tl.float32), mask=d < head_dim)
