"""Checkpoint tensors read a module at a time, for the views that translate a checkpoint's layout into the one the
layers load (``nvllm.quant.compressed_tensors``, ``nvllm.quant.gptq_v2``): a module's tensors are held until all of
them have arrived (shards may split a module), then replaced by the module's translation."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

Weights = Iterator[tuple[str, torch.Tensor]]


def translated_by_module(weights: Weights, ours: Callable[[str, str, torch.Tensor], bool],
                         stored: dict[str, set[str]],
                         translate: Callable[[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> Weights:
    """``weights`` with the tensors ``ours(module, leaf, tensor)`` claims replaced by ``translate(module, parts)``
    (leaf → tensor both ways): once the leaves ``stored[module]`` lists have all come, or at the end for a module
    ``stored`` does not know (a pickle checkpoint, whose names are not read beforehand)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        module, _, leaf = name.rpartition(".")
        if not ours(module, leaf, tensor):
            yield name, tensor
            continue
        parts = pending.setdefault(module, {})
        parts[leaf] = tensor
        if parts.keys() == stored.get(module):
            yield from ((f"{module}.{k}", v) for k, v in translate(module, pending.pop(module)).items())
    for module, parts in pending.items():
        yield from ((f"{module}.{k}", v) for k, v in translate(module, parts).items())
