"""Which piece of each weight a tensor-parallel rank holds, and the start-up check that a model splits.

Column-parallel linears (qkv_proj, gate_up_proj) split their output, each fused shard separately, so rank r
holds [q_r, k_r, v_r] and [gate_r, up_r]. Row-parallel linears (o_proj, down_proj) split their input; their
partial outputs are summed over the ranks. Query heads are split evenly; KV heads are split when there are at
least as many as ranks, and replicated otherwise (rank r holds KV head r·kv/tp, the one its query heads use).
The vocabulary (embedding and LM head) is padded up to a multiple of the rank count and split in equal slices.

Every position is in checkpoint coordinates: a ``Part`` is the rows [start, start + size) of a dimension the
checkpoint stores with ``total`` rows, so the loader narrows each checkpoint tensor as it reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nvllm.config import ConfigError


@dataclass(frozen=True)
class Part:
    """Rows [start, start + size) of a checkpoint dimension of ``total`` rows."""

    start: int
    size: int
    total: int

    def per(self, n: int) -> "Part":
        """The same rows counted in units of ``n`` (packed words, groups): every bound divided by n."""
        return Part(self.start // n, self.size // n, self.total // n)

    def times(self, n: int) -> "Part":
        """The same rows counted in units n times smaller (heads → features)."""
        return Part(self.start * n, self.size * n, self.total * n)


@dataclass(frozen=True)
class LinearShard:
    """A rank's piece of one linear layer: ``outputs`` (column-parallel) is one Part per fused output shard,
    ``inputs`` (row-parallel) the Part of the input features. Exactly one of them is set."""

    outputs: tuple[Part, ...] | None = None
    inputs: Part | None = None

    @property
    def row_parallel(self) -> bool:
        return self.inputs is not None


def take_shard(tensor: torch.Tensor, local_shape: tuple[int, ...], cuts: dict[int, Part], name: str) -> torch.Tensor:
    """The piece of the full checkpoint ``tensor`` that fills a local tensor of ``local_shape``: dimension d
    narrowed to ``cuts[d]``. A checkpoint tensor of any other full shape is a ConfigError naming it."""
    full = list(local_shape)
    for dim, part in cuts.items():
        full[dim] = part.total
    if tuple(tensor.shape) != tuple(full):
        raise ConfigError(f"shape mismatch for {name!r}: checkpoint {tuple(tensor.shape)}, model expects "
                          f"{tuple(full)}")
    for dim, part in cuts.items():
        if part.size != part.total:
            tensor = tensor.narrow(dim, part.start, part.size)
    return tensor


def even_part(total: int, tp_size: int, rank: int, what: str) -> Part:
    """Rank ``rank``'s equal slice of ``total`` rows; ``what`` names the dimension in the error."""
    if total % tp_size:
        raise ConfigError(f"{what} {total} is not divisible by tensor_parallel_size {tp_size}")
    size = total // tp_size
    return Part(rank * size, size, total)


def head_parts(num_heads: int, num_kv_heads: int, head_dim: int, tp_size: int, rank: int) -> tuple[Part, Part]:
    """(query features, K or V features) of rank ``rank`` in the q / k / v projections' outputs."""
    q = even_part(num_heads, tp_size, rank, "num_attention_heads")
    if num_kv_heads >= tp_size:
        kv = even_part(num_kv_heads, tp_size, rank, "num_key_value_heads")
    elif tp_size % num_kv_heads:
        raise ConfigError(f"num_key_value_heads {num_kv_heads} is fewer than tensor_parallel_size {tp_size} and "
                          f"does not divide it, so the KV heads cannot be replicated evenly")
    else:
        kv = Part(rank * num_kv_heads // tp_size, 1, num_kv_heads)
    return q.times(head_dim), kv.times(head_dim)


def padded_vocab_size(vocab_size: int, tp_size: int) -> int:
    """The vocabulary rounded up to a multiple of the rank count (the padding rows are zeros, never chosen)."""
    return -(-vocab_size // tp_size) * tp_size


def vocab_part(vocab_size: int, tp_size: int, rank: int) -> Part:
    """Rank ``rank``'s slice of the padded vocabulary (its end may run past the checkpoint's rows)."""
    per = padded_vocab_size(vocab_size, tp_size) // tp_size
    return Part(rank * per, per, vocab_size)


WORD_COLUMNS = 8
"""Output columns per packed word (AWQ ``qweight``, 4-bit ``qzeros``)."""


def quant_head_part(vocab_size: int, tp_size: int, rank: int) -> Part:
    """Rank ``rank``'s equal slice of a quantized LM head's vocabulary, in whole packed words (no padding)."""
    if vocab_size % (WORD_COLUMNS * tp_size):
        raise ConfigError(f"the quantized lm_head's vocabulary of {vocab_size} cannot be split over "
                          f"tensor_parallel_size {tp_size} in whole {WORD_COLUMNS}-column packed words; use another "
                          f"tensor_parallel_size, or a checkpoint quantized without --quantize-lm-head")
    return even_part(vocab_size, tp_size, rank, "vocab_size")


def layer_shards(shape, tp_size: int, rank: int) -> dict[str, LinearShard | None]:
    """The LinearShard of each decoder linear for a ModelShape (all None for a single rank)."""
    if tp_size == 1:
        return dict.fromkeys(("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    q, kv = head_parts(shape.num_heads, shape.num_kv_heads, shape.head_dim, tp_size, rank)
    shards = {"qkv_proj": LinearShard(outputs=(q, kv, kv)), "o_proj": LinearShard(inputs=q),
              "gate_up_proj": None, "down_proj": None}
    if shape.local_intermediate_size:   # a model whose every MLP is a mixture of experts has no dense one to split
        inter = even_part(shape.intermediate_size, tp_size, rank, "intermediate_size")
        shards.update(gate_up_proj=LinearShard(outputs=(inter, inter)), down_proj=LinearShard(inputs=inter))
    return shards


def _rank_pieces(shape, shards: dict, unit: str) -> list[tuple[int, list[int], Part | None]]:
    """(inputs, output sizes, the row-parallel Part of the inputs or None) of each linear of quantization-plan unit
    ``unit`` (``qkv_proj``, …, ``experts``, ``shared_expert.down_proj``) on rank 0."""
    h = shape.hidden_size
    if unit == "experts" or unit.startswith("shared_expert."):
        part = shape.moe.part if unit == "experts" else shape.moe.shared_part
        gate_up, down = (h, [part.size, part.size], None), (part.size, [h], part)
        return [gate_up, down] if unit == "experts" else [gate_up] if unit.endswith("gate_up_proj") else [down]
    shard = shards[unit]
    if shard.row_parallel:
        return [(shard.inputs.size, [h], shard.inputs)]
    return [(h, [p.size for p in shard.outputs], None)]


def check_tensor_parallel(shape, tp_size: int, quant_plan: dict | None) -> None:
    """Raise one ConfigError when the model cannot be split over ``tp_size`` ranks: heads or intermediate size
    not divisible, or a quantized linear (or expert stack) whose rank pieces are not whole packed words / whole
    groups."""
    if tp_size == 1:
        return
    shards = layer_shards(shape, tp_size, 0)
    for name, scheme in sorted((quant_plan or {}).items()):
        if name == "lm_head":   # split by vocabulary (nvllm.layers.embed_head.QuantLMHead)
            quant_head_part(shape.vocab_size, tp_size, 0)
            continue
        for local_in, outs, rows in _rank_pieces(shape, shards, name.split(".", 2)[2]):
            problem = None
            if rows is not None:
                group = scheme.group_for(rows.total)
                if scheme.group_size != -1 and local_in % group:
                    problem = f"each rank's {local_in} inputs are not a whole number of groups of {group}"
            problem = problem or scheme.packing_problem(local_in, outs)
            if problem:
                raise ConfigError(f"cannot split the {scheme.fmt} {scheme.bits}-bit {name} over "
                                  f"tensor_parallel_size {tp_size}: {problem}")
