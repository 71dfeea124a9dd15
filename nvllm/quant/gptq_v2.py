"""GPTQ v2 checkpoints (GPTQModel's ``checkpoint_format: gptq_v2``, which vLLM serves): the layout of v1 but with
the zero points stored as they are, where v1 stores zero − 1. Their tensors are read translated into v1's, the
layout nvllm's kernels take (``nvllm.quant.formats.gptq_v1_tensors``: a group whose zero is 0 is mirrored), so a
v2 checkpoint computes exactly what its own definition says.

A module's tensors are translated once its ``qweight``, ``qzeros``, ``scales`` (and ``g_idx`` when the checkpoint
has one) have all arrived (``nvllm.quant.module_tensors``)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from nvllm.quant.formats import default_g_idx, gptq_v1_tensors
from nvllm.quant.module_tensors import translated_by_module
from nvllm.quant.packing import unpack_cols

_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_NEEDED = {"qweight", "qzeros", "scales"}


class GPTQv2View:
    def __init__(self, bits: int, keys: set[str]):
        """``keys``: the checkpoint's tensor names (empty for a pickle checkpoint: modules then complete at the
        end of the weights)."""
        self.bits = bits
        stored: dict[str, set[str]] = {}
        for k in keys:
            module, _, leaf = k.rpartition(".")
            if leaf in _PARTS:
                stored.setdefault(module, set()).add(leaf)
        self.stored = {m: parts for m, parts in stored.items() if "qzeros" in parts}

    def __call__(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        return translated_by_module(weights, self._ours, self.stored, self.translate)

    def _ours(self, module: str, leaf: str, tensor: torch.Tensor) -> bool:
        return leaf in _PARTS and (not self.stored or module in self.stored)

    def translate(self, module: str, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One module's tensors → GPTQ v1 (see the module doc)."""
        if not _NEEDED <= parts.keys():  # not a quantized module (a pickle's stray g_idx): left to the loader
            if "qzeros" in parts:
                raise ValueError(f"GPTQ v2 module {module!r} lacks {', '.join(sorted(_NEEDED - parts.keys()))}")
            return parts
        qweight, qzeros, scales = parts["qweight"], parts["qzeros"], parts["scales"]
        if qzeros.dtype != torch.int32 or qzeros.dim() != 2 or qweight.dim() != 2:
            raise ValueError(f"{module}.qzeros must be a 2-D int32 tensor, got {qzeros.dtype} {tuple(qzeros.shape)}")
        out_f, in_f, groups = qweight.shape[1], qweight.shape[0] * 32 // self.bits, qzeros.shape[0]
        zeros = unpack_cols(qzeros, self.bits)[:, :out_f].to(torch.int64)    # [G, out], stored as they are
        g_idx = parts.get("g_idx")
        if g_idx is None:
            g_idx = default_g_idx(in_f, -(-in_f // groups))
        elif g_idx.numel() != in_f or (in_f and (int(g_idx.min()) < 0 or int(g_idx.max()) >= groups)):
            raise ValueError(f"{module}.g_idx must give each of the {in_f} inputs a group in [0, {groups})")
        v1 = gptq_v1_tensors(qweight, zeros, scales, g_idx, self.bits)
        if "g_idx" in parts:
            v1["g_idx"] = parts["g_idx"]   # as stored: the loader checks it against the layer
        else:
            del v1["g_idx"]
        return v1
