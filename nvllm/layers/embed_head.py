"""Token embedding and the LM head (tied to the embedding or not).

Tensor parallelism splits the vocabulary: the rows are padded up to a multiple of the rank count (padding
rows are zeros) and each rank holds one equal slice. The embedding looks up the ids in its slice, zeroes the
others and sums over the ranks; the LM head computes its slice's logits and gathers them on rank 0, which drops
the padding.

``QuantLMHead``: an LM head stored as a GPTQ (or AWQ) weight-only quantized linear (a checkpoint written with
``"lm_head": true``, GPTQModel's ``lm_head=True``), its logits computed through ``quant_linear``. It is served
on one rank only (the loader refuses ``tensor_parallel_size`` > 1 at start-up)."""

from __future__ import annotations

import torch
from torch import nn

from nvllm.distributed.group import TPGroup
from nvllm.distributed.partition import take_shard, vocab_part
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
        logits = gemm(hidden, self.weight)
        if self.tp.size == 1:
            return logits.float()
        parts = self.tp.gather_first(logits)
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[:, :self.vocab_size].float()


class QuantLMHead(QuantLinear):
    """logits = h Wᵀ with W [vocab, hidden] stored packed (``lm_head.qweight`` / ``qzeros`` / ``scales`` /
    ``g_idx``), computed in the model dtype by ``quant_linear`` and returned as float32, as ``LMHead`` does."""

    def __init__(self, vocab_size: int, hidden_size: int, scheme: QuantScheme, dtype: torch.dtype | None = None):
        super().__init__(hidden_size, vocab_size, False, None, scheme, dtype)
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return quant_linear(hidden, self.quant_weight()).float()


def load_vocab_rows(dst: torch.Tensor, part, tensor: torch.Tensor, ckpt_name: str) -> None:
    """Rows [start, start + size) of a [vocab, hidden] checkpoint table into ``dst``; the rows past the
    vocabulary's end (the padding of the last ranks) are zeroed."""
    real = max(0, min(part.size, part.total - part.start))
    full = take_shard(tensor, (part.total, dst.shape[1]), {}, ckpt_name)
    dst[:real].copy_(full[part.start:part.start + real])
    dst[real:].zero_()
