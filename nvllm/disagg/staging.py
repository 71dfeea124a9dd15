"""A sequence's KV blocks as one contiguous staging tensor, and back.

Every cache tensor of every layer is paged by the same block ids along dim 0 (K and V, and for an int8 / fp8
cache their fp32 scales: see nvllm.layers.attention). Gathering copies the chosen blocks of each tensor, as
raw bytes, into one uint8 buffer — scales of every layer first, then K and V of every layer — and scattering
writes them into other block ids of an identically shaped pool. Working on the bytes (``view(torch.uint8)``)
makes the copy bit-exact whatever the element type, and lets one send/recv carry a whole transfer."""

from __future__ import annotations

import torch


def _tensors(caches) -> list[torch.Tensor]:
    """Every paged tensor, in transfer order: the scales of every layer (K, V), then K and V of every layer."""
    scales = [t for c in caches if len(c) > 2 for t in (c[2], c[3]) if t is not None]
    return scales + [t for c in caches for t in (c[0], c[1])]


class KVLayout:
    """The staging layout of one worker's KV pool."""

    def __init__(self, caches):
        self.tensors = [t.view(torch.uint8) for t in _tensors(caches)]  # byte views: dim 0 is still the block
        self.device = self.tensors[0].device
        self.num_blocks = self.tensors[0].shape[0]
        self.bytes_per_block = sum(t[0].numel() for t in self.tensors)
        src = _tensors(caches)
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
        for t in self.tensors:
            size = n * t[0].numel()
            torch.index_select(t, 0, idx, out=out[off:off + size].view(n, *t.shape[1:]))
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
        for t in self.tensors:
            size = n * t[0].numel()
            t.index_copy_(0, idx, staging[off:off + size].view(n, *t.shape[1:]))
            off += size
