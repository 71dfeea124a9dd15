"""Token embedding and the LM head (tied to the embedding or not).

Tensor parallelism splits the vocabulary: the rows are padded up to a multiple of the rank count (padding
rows are zeros) and each rank holds one equal slice. The embedding looks up the ids in its slice, zeroes the
others and sums over the ranks; the LM head computes its slice's logits and gathers them on rank 0, which drops
the padding.

``QuantLMHead``: an LM head stored as a GPTQ (or AWQ) weight-only quantized linear (a checkpoint written with
``"lm_head": true``, GPTQModel's ``lm_head=True``), its logits computed through ``quant_linear``. Under tensor
parallelism it is a column-parallel quantized linear: each rank keeps an equal slice of the vocabulary in whole
8-column packed words (no padding: a vocabulary that does not split so is a ConfigError) and rank 0 gathers the
logits, as ``LMHead`` does."""

from __future__ import annotations

import torch
from torch import nn

from nvllm.distributed.group import TPGroup
from nvllm.distributed.partition import LinearShard, quant_head_part, take_shard, vocab_part
from nvllm.kernels.gemm import gemm
from nvllm.kernels.quant_gemm import quant_linear
from nvllm.layers.quant_linear import QuantLinear
from nvllm.quant.plan import QuantScheme


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None,
                 tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp or TPGroup.single()
        self.vocab_size = vocab_size
        self.part = vocab_part(vocab_size, self.tp.size, self.tp.rank)
        self.weight = nn.Parameter(torch.empty(self.part.size, hidden_size, dtype=dtype), requires_grad=False)

    def load_tensor(self, leaf: str, shard: int | None, tensor: torch.Tensor, ckpt_name: str) -> None:
        """Copy this rank's rows of the full checkpoint table; rows past the vocabulary (padding) are zeros."""
        load_vocab_rows(self.weight.data, self.part, tensor, ckpt_name)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self.weight[input_ids]
        local = input_ids - self.part.start
        outside = (local < 0) | (local >= self.part.size)
        out = self.weight[local.masked_fill(outside, 0)]
        out.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(out)


class LMHead(nn.Module):
    """logits = h Eᵀ, computed in the model dtype and returned as float32 for the sampler (on rank 0 only
    under tensor parallelism: None on the other ranks)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype | None = None,
                 tied_to: VocabEmbedding | None = None, tp: TPGroup | None = None):
        super().__init__()
        self.tp = tp or TPGroup.single()
        self.vocab_size = vocab_size
        self.part = vocab_part(vocab_size, self.tp.size, self.tp.rank)
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(self.part.size, hidden_size, dtype=dtype), requires_grad=False)

    def load_tensor(self, leaf: str, shard: int | None, tensor: torch.Tensor, ckpt_name: str) -> None:
        load_vocab_rows(self.weight.data, self.part, tensor, ckpt_name)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        # one rank: fp32 straight from the GEMM (no cast kernel); ranks gather their slices in the model dtype
        wide = torch.float32 if self.tp.size == 1 else None
        return gather_logits(gemm(hidden, self.weight, out_dtype=wide), self.tp, self.vocab_size)


class QuantLMHead(QuantLinear):
    """logits = h Wᵀ with W [vocab, hidden] stored packed (``lm_head.qweight`` / ``qzeros`` / ``scales`` /
    ``g_idx``), computed in the model dtype by ``quant_linear`` and returned as float32, as ``LMHead`` does."""

    def __init__(self, vocab_size: int, hidden_size: int, scheme: QuantScheme, dtype: torch.dtype | None = None,
                 tp: TPGroup | None = None):
        tp = tp or TPGroup.single()
        shard = LinearShard(outputs=(quant_head_part(vocab_size, tp.size, tp.rank),)) if tp.size > 1 else None
        super().__init__(hidden_size, vocab_size // tp.size, False, None, scheme, dtype, shard=shard)
        self.vocab_size = vocab_size
        self.head_tp = tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return gather_logits(quant_linear(hidden, self.quant_weight()), self.head_tp, self.vocab_size)


def gather_logits(logits: torch.Tensor, tp: TPGroup, vocab_size: int) -> torch.Tensor | None:
    """One rank's logits → the whole vocabulary's, float32, on rank 0 (None on the others); the padding
    columns past ``vocab_size`` dropped."""
    if tp.size == 1:
        return logits.float()
    parts = tp.gather_first(logits)
    if parts is None:
        return None
    return torch.cat(parts, dim=-1)[:, :vocab_size].float()


def load_vocab_rows(dst: torch.Tensor, part, tensor: torch.Tensor, ckpt_name: str) -> None:
    """Rows [start, start + size) of a [vocab, hidden] checkpoint table into ``dst``; the rows past the
    vocabulary's end (the padding of the last ranks) are zeroed."""
    real = max(0, min(part.size, part.total - part.start))
    full = take_shard(tensor, (part.total, dst.shape[1]), {}, ckpt_name)
    dst[:real].copy_(full[part.start:part.start + real])
    dst[real:].zero_()
