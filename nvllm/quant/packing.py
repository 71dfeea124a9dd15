"""Bit fields in int32 words: ``pack_cols`` / ``pack_rows`` and their inverses, the packing both checkpoint
formats (``formats``: AWQ-GEMM, GPTQ) and compressed-tensors' ``pack_quantized`` build on. Pure torch, on any
device; values are checked to fit their field before they are packed."""

from __future__ import annotations

import torch


def _check_range(values: torch.Tensor, bits: int, what: str) -> None:
    if values.numel() and (int(values.min()) < 0 or int(values.max()) >= 2**bits):
        raise ValueError(f"{what} must lie in [0, {2**bits - 1}] for {bits}-bit packing, "
                         f"got [{int(values.min())}, {int(values.max())}]")


def _or_fields(fields, bits: int) -> torch.Tensor:
    """int32 words of the fields (int tensors of the words' shape, field ``i`` into bits ``i*bits ..``). torch's
    int32 left shift wraps (it shifts the unsigned value), so the top field sets the sign bit, as the formats store
    it."""
    words = torch.zeros(fields[0].shape, dtype=torch.int32, device=fields[0].device)
    for i, f in enumerate(fields):
        words |= f.to(torch.int32) << (bits * i)
    return words


def pack_cols(values: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Pack ``values [R, C]`` (ints in ``[0, 2^bits)``) along columns into int32 ``[R, C*bits/32]``.

    Field ``i`` of word column ``c`` holds column ``c*P + order[i]`` (``P = 32/bits``; ``order`` defaults to
    the identity)."""
    per_word = 32 // bits
    rows, cols = values.shape
    if cols % per_word:
        raise ValueError(f"{cols} columns do not pack into 32-bit words of {per_word} fields")
    _check_range(values, bits, "packed values")
    v = values.reshape(rows, cols // per_word, per_word)
    return _or_fields([v[:, :, col] for col in order or range(per_word)], bits)


def unpack_cols(words: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Inverse of ``pack_cols``: int32 ``[R, W]`` → int32 ``[R, W*32/bits]``."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    fields = (words.to(torch.int32).unsqueeze(-1) >> shifts) & (2**bits - 1)  # [R, W, P], field i at [.., i]
    if order is not None:
        inverse = [0] * per_word
        for i, col in enumerate(order):
            inverse[col] = i
        fields = fields[:, :, inverse]
    return fields.reshape(words.shape[0], -1)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack ``values [R, C]`` along rows into int32 ``[R*bits/32, C]``; word row ``r`` holds rows
    ``r*P .. r*P+P-1``, row ``r*P+i`` in bits ``i*bits ..``."""
    per_word = 32 // bits
    rows, cols = values.shape
    if rows % per_word:
        raise ValueError(f"{rows} rows do not pack into 32-bit words of {per_word} fields")
    _check_range(values, bits, "packed values")
    return _or_fields(values.reshape(rows // per_word, per_word, cols).unbind(1), bits)


def unpack_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``pack_rows``: int32 ``[W, C]`` → int32 ``[W*32/bits, C]``."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    fields = (words.to(torch.int32).unsqueeze(1) >> shifts[:, None]) & (2**bits - 1)  # [W, P, C]
    return fields.reshape(-1, words.shape[1])
