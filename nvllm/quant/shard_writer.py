"""Safetensors shards written as the tensors come, so a checkpoint never has to be whole in memory.

``nvllm quantize`` produces its output a decoder layer at a time; ``ShardWriter`` keeps only the shard being filled
and writes it out once the next tensor would take it past ``max_shard_size``. The files and index are those
``save_pretrained`` writes (huggingface_hub's ``split_torch_state_dict_into_shards`` given the same tensors in the
same order): a shard is closed when the next tensor does not fit, a tensor larger than ``max_shard_size`` gets a
shard of its own at once, shards are numbered in the order they are closed, and a checkpoint of one shard is
``model.safetensors`` without an index. No two tensors written here share storage (``checkpoint_tensors`` copies the
pieces of fused parameters), so the planner's grouping of tensors that share storage does not arise.

Shards are written under temporary names and renamed to ``model-0000i-of-0000N.safetensors`` by ``finish``, once N
is known.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

INDEX = "model.safetensors.index.json"


def parse_size(size: str | int) -> int:
    """``"5GB"`` → bytes, by huggingface_hub's own parser of ``max_shard_size`` (there since its shard planner)."""
    from huggingface_hub.serialization._base import parse_size_to_int

    return size if isinstance(size, int) else parse_size_to_int(size)


class ShardWriter:
    def __init__(self, directory: Path, max_shard_size: str | int):
        self.directory = Path(directory)
        self.max_bytes = parse_size(max_shard_size)
        self.current: dict[str, torch.Tensor] = {}
        self.current_bytes = 0
        self.closed: list[tuple[Path, list[str]]] = []      # (temporary file, its tensors' names) in shard order
        self.total_size = 0
        self.names: set[str] = set()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self.names:
            raise ValueError(f"tensor {name!r} written twice")
        self.names.add(name)
        size = tensor.numel() * tensor.element_size()
        self.total_size += size
        if size > self.max_bytes:
            self._save({name: tensor})
            return
        if self.current_bytes + size > self.max_bytes:
            self._save(self.current)
            self.current, self.current_bytes = {}, 0
        self.current[name] = tensor
        self.current_bytes += size

    def _save(self, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        path = self.directory / f"shard-{len(self.closed):05d}.partial"
        save_file({k: t.contiguous() for k, t in tensors.items()}, str(path), metadata={"format": "pt"})
        self.closed.append((path, list(tensors)))

    def finish(self) -> int:
        """Write the last shard, give the shards their final names (and the index, past one shard); returns the
        weight files' size in bytes."""
        if self.current or not self.closed:
            self._save(self.current)
            self.current, self.current_bytes = {}, 0
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
