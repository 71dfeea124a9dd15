"""A split decode attention's output left unmerged for the kernel that consumes it.

Decode attention splits each sequence's context into partitions (``decode_attention``, stage 1) and merges the
partials with a second kernel (stage 2: per query head, the partial outputs weighted by exp2 of their log-sum-exp).
At batch 1 the merge is one more dependent launch per layer — 2.9 µs of a Qwen2.5-7B GPTQ decode step's advance per
layer on the H200 (PERF.md run CX) — for a few hundred bytes per head. Its only reader is o_proj, and a one-row
``half2`` GEMV program reads its inputs once into its scratch anyway (``quant_gemv_half2``): it can merge them there.
So ``decode_attention(..., defer_merge=True)`` returns an ``AttentionPartials`` instead of launching stage 2, and
``quant_gemv`` either merges in the prologue of its kernel (one row, ``half2`` with the inputs' pairs, each K split
inside one head) or calls ``finish`` — stage 2, as before — for every other consumer.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


def enabled() -> bool:
    """Whether decode attention may leave its merge to o_proj; ``NVLLM_ATTENTION_PARTIALS=0`` always merges with
    stage 2. Read at each call: engines built while it is 0 capture their graphs that way (the GPU benchmark
    compares both)."""
    return os.environ.get("NVLLM_ATTENTION_PARTIALS", "1") != "0"


@dataclass
class AttentionPartials:
    """Stage 1's partials of ``B`` sequences: ``part_o [B, H, S, PO_D]`` fp32 (normalised per split), ``part_lse
    [B, H, S]`` fp32 (base 2), ``context_lens [B]`` int32 and the partition length; ``out [B, H, D]`` is where the
    merge goes (the output dtype's tensor, written by ``finish``). Consume it once."""

    out: torch.Tensor
    part_o: torch.Tensor
    part_lse: torch.Tensor
    context_lens: torch.Tensor
    partition: int

    @property
    def num_splits(self) -> int:
        return self.part_lse.shape[2]

    @property
    def head_dim(self) -> int:
        return self.out.shape[2]

    @property
    def rows(self) -> torch.Tensor:
        """``out`` as the ``[B, H·D]`` rows o_proj multiplies (not yet written)."""
        return self.out.view(self.out.shape[0], -1)

    def fits(self, rows: int, k_per_split: int) -> bool:
        """Whether a GEMV whose programs take ``k_per_split`` consecutive inputs of one row can merge them: one
        sequence, every program's inputs inside one head."""
        return self.out.shape[0] == rows == 1 and self.head_dim % k_per_split == 0

    def finish(self) -> torch.Tensor:
        """The merged ``[B, H·D]`` rows (stage 2)."""
        from nvllm.kernels.decode_attention import merge_partials

        merge_partials(self.part_o, self.part_lse, self.out)
        return self.rows


def finished_attention(x: torch.Tensor | AttentionPartials) -> torch.Tensor:
    """``x`` itself, or the merged rows of unmerged partials."""
    return x.finish() if isinstance(x, AttentionPartials) else x
