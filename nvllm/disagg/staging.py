"""A sequence's KV blocks as one contiguous staging tensor, and back.

Every cache tensor of every layer is paged by the same block ids along dim 0 (K and V, and for an int8 / fp8
cache their fp32 scales: see nvllm.layers.attention). Gathering copies the chosen blocks of each tensor, as
raw bytes, into one uint8 buffer — scales of every layer first, then K and V of every layer — and scattering
writes them into other block ids of an identically shaped pool. Working on the bytes makes the copy bit-exact
whatever the element type, and lets one send/recv carry a whole transfer. The copies move the bytes as 8-byte
words (as 4-, 2- or 1-byte words where a block's slice is not a multiple of 8): PyTorch's indexed copies move one
element per thread, so wide words mean 8x fewer of them. (The 9–28 ms a gather took on a busy prefill GPU in PERF
runs AB–AG was not the copy's width: it did not change with it.)

The tensors are taken in *parts* ``[G, num_blocks, bytes per block]``: where consecutive tensors are the slices of
one allocation (``allocate_kv_caches`` keeps K and V of every layer in one, the scales in another) a part holds
all of them and moves in one indexed copy; otherwise a part is one tensor. On a busy GPU every small copy waits
for the engine's running kernels to retire, so 4 · layers copies took tens of milliseconds where 1–2 take one wait."""

from __future__ import annotations

import torch


def _tensors(caches) -> list[torch.Tensor]:
    """Every paged tensor, in transfer order: the scales of every layer (K, V), then K and V of every layer."""
    scales = [t for c in caches if len(c) > 2 for t in (c[2], c[3]) if t is not None]
    return scales + [t for c in caches for t in (c[0], c[1])]


_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _words(t: torch.Tensor) -> torch.Tensor:
    """A ``[G, num_blocks, bytes]`` byte view as ``[G, num_blocks, words]`` of the widest word that divides a block's
    slice (the slices, and so the staging offsets, stay multiples of it; allocations are aligned)."""
    dtype = next(d for d in _WORDS if t.shape[2] % d.itemsize == 0 and t.data_ptr() % d.itemsize == 0)
    return t.view(dtype)


def _parts(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Word views ``[G, num_blocks, words]`` covering ``tensors`` in order: a run of tensors that are consecutive
    slices of one contiguous allocation as one part, any other tensor alone."""
    parts, i = [], 0
    while i < len(tensors):
        t, base = tensors[i], tensors[i]._base
        run = 1
        if base is not None and base.is_contiguous() and t.is_contiguous():
            size = t.numel() * t.element_size()
            while (i + run < len(tensors) and tensors[i + run]._base is base and tensors[i + run].is_contiguous()
                   and tensors[i + run].data_ptr() == t.data_ptr() + run * size):
                run += 1
        if run > 1:
            start = (t.data_ptr() - base.data_ptr()) // t.element_size()
            flat = base.view(-1)[start:start + run * t.numel()]
            parts.append(_words(flat.view(torch.uint8).view(run, t.shape[0], -1)))
        else:
            parts.append(_words(t.view(torch.uint8).reshape(1, t.shape[0], -1)))
        i += run
    return parts


class KVLayout:
    """The staging layout of one worker's KV pool."""

    def __init__(self, caches):
        src = _tensors(caches)
        self.parts = _parts(src)                   # [G, num_blocks, words]: dim 1 is the block
        self.device = src[0].device
        self.num_blocks = src[0].shape[0]
        self.bytes_per_block = sum(p.shape[0] * p.shape[2] * p.element_size() for p in self.parts)
        self.signature = ";".join(f"{str(t.dtype).replace('torch.', '')}{list(t.shape[1:])}" for t in src)

    def nbytes(self, num_blocks: int) -> int:
        return num_blocks * self.bytes_per_block

    def _ids(self, block_ids: list[int]) -> torch.Tensor:
        if not block_ids or min(block_ids) < 0 or max(block_ids) >= self.num_blocks:
            raise ValueError(f"block ids must be in [0, {self.num_blocks}), got {block_ids[:8]}…")
        return torch.tensor(block_ids, dtype=torch.long, device=self.device)

    def gather(self, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
        """The blocks' bytes, every tensor's in turn, as one uint8 tensor on the pool's device."""
        idx = self._ids(block_ids)
        n = len(block_ids)
        if out is None:
            out = torch.empty(self.nbytes(n), dtype=torch.uint8, device=self.device)
        off = 0
        for p in self.parts:
            size = p.shape[0] * n * p.shape[2] * p.element_size()
            torch.index_select(p, 1, idx, out=out[off:off + size].view(p.dtype).view(p.shape[0], n, p.shape[2]))
            off += size
        return out

    def scatter(self, block_ids: list[int], staging: torch.Tensor) -> None:
        """Write a gathered buffer into these blocks (staging on any device; moved to the pool's first)."""
        idx = self._ids(block_ids)
        n = len(block_ids)
        if staging.dtype != torch.uint8 or staging.numel() != self.nbytes(n):
            raise ValueError(f"staging buffer of {staging.numel()} bytes for {n} blocks of "
                             f"{self.bytes_per_block} bytes")
        staging = staging.to(self.device)
        off = 0
        for p in self.parts:
            size = p.shape[0] * n * p.shape[2] * p.element_size()
            p.index_copy_(1, idx, staging[off:off + size].view(p.dtype).view(p.shape[0], n, p.shape[2]))
            off += size
