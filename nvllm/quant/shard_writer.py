"""Safetensors shards written as the tensors come, so a checkpoint never has to be whole in memory.

``nvllm quantize`` produces its output a decoder layer at a time. ``ShardWriter`` writes each tensor's bytes to disk
as it arrives and keeps only its name, dtype, shape and place, so the host holds no more than the part being
handed over. The files and index are those ``save_pretrained`` writes (huggingface_hub's
``split_torch_state_dict_into_shards`` given the same tensors in the same order): a shard is closed when the next
tensor does not fit, a tensor larger than ``max_shard_size`` gets a shard of its own at once, shards are numbered in
the order they are closed, and a checkpoint of one shard is ``model.safetensors`` without an index. No two tensors
written here share storage (``checkpoint_tensors`` copies the pieces of fused parameters), so the planner's grouping
of tensors that share storage does not arise.

The safetensors library writes a file from tensors all in memory, so the shard's data goes to a scratch file and,
once the shard is closed and its header known, into the shard behind the header (``os.sendfile``: in the kernel, no
copy through this process): the format's 8-byte little-endian header length, the JSON header padded with spaces to
a multiple of 8 bytes, then the data, here in the order the tensors came (the format allows any order; the library
sorts by dtype and name). Shards are written under temporary names and renamed to ``model-0000i-of-0000N.safetensors``
by ``finish``, once N is known.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

INDEX = "model.safetensors.index.json"


def parse_size(size: str | int) -> int:
    """``"5GB"`` → bytes, by huggingface_hub's own parser of ``max_shard_size`` (there since its shard planner); a
    plain integer is bytes, as ``save_pretrained`` takes it."""
    from huggingface_hub.serialization._base import parse_size_to_int

    if isinstance(size, str) and size.strip().isdigit():
        return int(size)
    return size if isinstance(size, int) else parse_size_to_int(size)


# the format's dtype names (https://github.com/huggingface/safetensors, "Format")
DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
          torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
          torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}
METADATA = {"format": "pt"}


def write_shard(path: Path, entries: list[tuple[str, torch.dtype, tuple, int, int]], data: Path) -> None:
    """The safetensors file ``path``: a header for ``entries`` (name, dtype, shape, start, end in ``data``), then
    ``data``'s bytes."""
    header = {"__metadata__": METADATA}
    header.update({name: {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [start, end]}
                   for name, dtype, shape, start, end in entries})
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    size = data.stat().st_size
    with open(path, "wb") as out, open(data, "rb") as src:
        out.write(struct.pack("<Q", len(text)) + text)
        out.flush()
        done = 0
        while done < size:
            sent = os.sendfile(out.fileno(), src.fileno(), done, size - done)
            if sent == 0:
                raise OSError(f"{data} ended after {done} of {size} bytes")
            done += sent


class _OpenShard:
    """A shard being filled: its tensors' bytes in a scratch file, their names, dtypes, shapes and places."""

    def __init__(self, scratch: Path):
        self.scratch = scratch
        self.file = open(scratch, "wb")
        self.entries: list[tuple[str, torch.dtype, tuple, int, int]] = []
        self.bytes = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        self.file.write(memoryview(raw))
        self.entries.append((name, tensor.dtype, tuple(tensor.shape), self.bytes, self.bytes + raw.nbytes))
        self.bytes += raw.nbytes

    def close(self, path: Path) -> list[str]:
        self.file.close()
        write_shard(path, self.entries, self.scratch)
        self.scratch.unlink()
        return [e[0] for e in self.entries]


class ShardWriter:
    def __init__(self, directory: Path, max_shard_size: str | int):
        self.directory = Path(directory)
        self.max_bytes = parse_size(max_shard_size)
        self.current: _OpenShard | None = None
        self.scratch_files = 0
        self.closed: list[tuple[Path, list[str]]] = []      # (temporary file, its tensors' names) in shard order
        self.total_size = 0
        self.names: set[str] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.names:
            raise ValueError(f"tensor {name!r} written twice")
        if tensor.dtype not in DTYPES:
            raise ValueError(f"tensor {name!r}: safetensors has no dtype for {tensor.dtype}")
        self.names.add(name)
        size = tensor.numel() * tensor.element_size()
        self.total_size += size
        if size > self.max_bytes:          # a shard of its own, closed at once; the one being filled goes on
            alone = self._open()
            alone.write(name, tensor)
            self._close(alone)
            return
        if self.current is not None and self.current.bytes + size > self.max_bytes:
            self._close(self.current)
            self.current = None
        if self.current is None:
            self.current = self._open()
        self.current.write(name, tensor)

    def _open(self) -> _OpenShard:
        self.scratch_files += 1
        return _OpenShard(self.directory / f"data-{self.scratch_files:05d}.partial")

    def _close(self, shard: _OpenShard) -> None:
        path = self.directory / f"shard-{len(self.closed):05d}.partial"
        self.closed.append((path, shard.close(path)))

    def finish(self) -> int:
        """Write the last shard, give the shards their final names (and the index, past one shard); returns the
        weight files' size in bytes."""
        if self.current is not None or not self.closed:     # no tensor at all: one empty model.safetensors
            self._close(self.current or self._open())
            self.current = None
        n = len(self.closed)
        names = ["model.safetensors"] if n == 1 else [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
        weight_map = {}
        for (path, tensors), name in zip(self.closed, names):
            path.rename(self.directory / name)
            weight_map.update(dict.fromkeys(tensors, name))
        if n > 1:
            with open(self.directory / INDEX, "w") as f:
                json.dump({"metadata": {"total_size": self.total_size}, "weight_map": weight_map}, f, indent=2)
                f.write("\n")
        return sum((self.directory / name).stat().st_size for name in names)
