"""A split-K GEMV's output left unfinished for the kernel that consumes it.

A one-row GEMV splits K over many programs (``quant_gemv``). Finishing the sum inside the GEMV (``serial``: a
ticket per column tile, the last split reads the workspace back, adds the bias, casts and re-zeroes it) costs
two dependent trips to L2 at the end of every call: 1.4–1.8 µs per Qwen2.5-7B projection on the H200, against
atomic adds alone (PERF.md session 11, ``gpu_gemv_anatomy.py`` ``base`` against ``red_only``). The kernel that
reads the projection's output next — rope_store after qkv, the residual add and RMSNorm after o_proj and
down_proj, SiLU·mul after gate_up — reads every element once anyway, so it can finish the sum instead: the GEMV
adds its splits into a zeroed fp32 accumulator and returns a ``PartialSum``; the consumer reads ``acc + bias``,
rounds it to the activations' dtype (the bits the finished GEMV would have stored) and writes zeros back, leaving
the accumulator ready for the next GEMV.

Accumulators are persistent zeroed fp32 buffers per device (``take``), each held by at most one pending sum: a
consumer ``release``\\ s it after launching its kernel (the next GEMV's launch comes later on the same stream).
While a CUDA graph is being captured no buffer is allocated — the GEMV then finishes its sum itself — so the
captured graph only holds buffers that stay allocated. Like ``quant_gemv``'s serial workspace, a device's
buffers assume one stream of GEMVs.

``finish`` (bias, cast and zeroing as torch ops) serves a consumer that cannot fuse it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_NUMEL = 1 << 20   # 4 MiB of fp32: eight rows of a 128k-wide projection

_BUFFERS: dict[torch.device, list[torch.Tensor]] = {}
_HELD: set[int] = set()   # storage data_ptr of the buffers a pending sum holds


def take(device: torch.device, numel: int) -> torch.Tensor | None:
    """A zeroed fp32 buffer of at least ``numel`` elements that no pending sum holds, now held; None while a
    CUDA graph is being captured and no such buffer exists yet."""
    held = _BUFFERS.setdefault(torch.device(device), [])
    for buf in held:
        if buf.numel() >= numel and buf.untyped_storage().data_ptr() not in _HELD:
            _HELD.add(buf.untyped_storage().data_ptr())
            return buf
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    with torch.inference_mode(False):   # a normal tensor: ``finish`` zeroes it in place, in inference mode or not
        buf = torch.zeros(max(numel, MIN_NUMEL), device=device, dtype=torch.float32)
    held.append(buf)
    _HELD.add(buf.untyped_storage().data_ptr())
    return buf


@dataclass
class PartialSum:
    """``acc`` ([M, N] fp32, a view of a ``take`` buffer) holds x Wᵀ summed over the K splits; the output is
    ``(acc + bias).to(dtype)``. Consume it once: a fused consumer, or ``finish``."""

    acc: torch.Tensor
    bias: torch.Tensor | None
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.acc.shape

    @property
    def device(self) -> torch.device:
        return self.acc.device

    def heads(self, start: int, num_heads: int, head_dim: int) -> PartialSum:
        """Columns ``[start, start + num_heads·head_dim)`` as ``[M, num_heads, head_dim]`` (q, k or v of a fused
        qkv projection), sharing the accumulator."""
        cols = slice(start, start + num_heads * head_dim)
        bias = None if self.bias is None else self.bias[cols].view(num_heads, head_dim)
        return PartialSum(self.acc[:, cols].view(-1, num_heads, head_dim), bias, self.dtype)

    def release(self) -> None:
        """After the consumer's launch: the buffer may serve the next GEMV."""
        _HELD.discard(self.acc.untyped_storage().data_ptr())

    def finish(self) -> torch.Tensor:
        """The output as the finished GEMV returns it (fp32 sum plus bias, cast once); the accumulator zeroed."""
        if self.bias is not None:
            y = (self.acc + self.bias.float()).to(self.dtype)
        else:   # one copy: the cast, or a clone where the output stays fp32 (the zeroing must not reach it)
            y = self.acc.clone() if self.dtype == torch.float32 else self.acc.to(self.dtype)
        self.acc.zero_()
        self.release()
        return y


def finished(x: torch.Tensor | PartialSum) -> torch.Tensor:
    """``x`` itself, or the finished output of a pending sum."""
    return x.finish() if isinstance(x, PartialSum) else x
