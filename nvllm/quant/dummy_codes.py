"""Random packed weights for ``load_format=dummy``: codes centred on their zero point.

Benchmarks of published shapes build quantized layers from config.json alone. Their dequantized weights should
behave like the dense layers' small uniform ones: no mean, so that activations keep their spread through many
layers and a router sends different tokens to different experts. Codes drawn over the whole range (0 .. 2^b − 1)
with random zero points give every (group, column) a bias ``(2^b − 1)/2 − z`` as large as the codes' spread;
deep stacks of such layers collapse the hidden states onto a few directions. Here every code is drawn uniformly
from ``1 .. 2^b − 1`` and every zero point is the middle code ``2^(b−1)``, so ``q − z`` is uniform on
``−(2^(b−1) − 1) .. 2^(b−1) − 1``: zero mean in every group. Scales are uniform in [5e-4, 1.5e-3] · 7 / (2^(b−1) − 1),
so ``|w| ≤ 0.0105`` at 4 and 8 bits, as the dense dummy weights' 0.01.

Which field of a word holds which column does not matter: every code is drawn independently, so the AWQ and
GPTQ layouts differ only in how the zero point is stored (GPTQ v1 stores ``z − 1``).
"""

from __future__ import annotations

import torch

from nvllm.quant.packing import pack_cols

_CHUNK_WORDS = 1 << 22   # words drawn at a time: their int64 fields take 256 MiB at 4 bits (8 fields a word)


@torch.no_grad()
def fill_codes(words: torch.Tensor, bits: int, generator: torch.Generator) -> None:
    """Fill int32 ``words`` in place with fields drawn uniformly from ``1 .. 2^bits − 1``."""
    flat = words.view(-1)
    per = 32 // bits
    for start in range(0, flat.numel(), _CHUNK_WORDS):
        n = min(_CHUNK_WORDS, flat.numel() - start)
        fields = torch.randint(1, 2**bits, (n, per), generator=generator, dtype=torch.int64, device=words.device)
        flat[start:start + n] = pack_cols(fields, bits).view(-1)


def zero_word(bits: int, fmt: str) -> int:
    """The int32 word whose every field stores the middle zero point ``2^(bits−1)`` in format ``fmt``."""
    stored = 2 ** (bits - 1) - (1 if fmt == "gptq" else 0)   # GPTQ v1 stores z − 1
    fields = torch.full((1, 32 // bits), stored, dtype=torch.int64)
    return int(pack_cols(fields, bits)[0, 0])


@torch.no_grad()
def fill_dummy(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, bits: int, fmt: str,
               generator: torch.Generator) -> None:
    """One quantized weight's packed tensors (any leading dimensions, e.g. experts) filled in place."""
    fill_codes(qweight.data, bits, generator)
    qzeros.data.fill_(zero_word(bits, fmt))
    widest = 7 / (2 ** (bits - 1) - 1)   # scales shrink with the codes: the largest |q − z|·s is 7 · 1.5e-3
    scales.data.uniform_(5e-4 * widest, 1.5e-3 * widest, generator=generator)
