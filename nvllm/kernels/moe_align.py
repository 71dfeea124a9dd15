"""A mixture of experts' (token, slot) pairs grouped by expert, each group padded to whole blocks of rows.

    topk_ids [T, k] → sorted_ids int32 [max_padded], block_experts int32 [max_padded / block_m], num_padded int32 [1]

The T·k pairs, as flat ids ``t·k + j``, grouped by expert (experts in order, pairs in flat order within one) and each
group padded with the sentinel ``T·k`` to a multiple of ``block_m``; ``block_experts[b]`` is the expert of rows
``[b·block_m, (b+1)·block_m)``, -1 for blocks at or past ``num_padded``; ``max_padded = T·k + E·(block_m − 1)``
rounded up to ``block_m``. Every output size follows from (T·k, E, block_m) alone, so nothing is read back to the
host and the op runs inside CUDA graph capture. The grouped GEMMs (``fused_moe``, ``quant_moe``) read it.

In torch this is a sort, two scatters, two cumulative sums, a search and a dozen element-wise kernels: about 30
launches, 79–133 µs of a call in a CUDA graph at 512–2048 tokens on an H100 (PERF.md, run EY), on every layer of a
prefill and of every decode step past E/k tokens. The Triton kernel is one launch after the sentinel fill.
Program c owns pairs [c·CHUNK, (c+1)·CHUNK): it counts every expert's pairs (``tl.histogram``), in all chunks and in
the chunks before its own, forms the padded groups' starts by a cumulative sum, and places its pairs in order:
a pair's row is its expert's group start, plus the pairs of that expert in earlier chunks, plus its rank among the
same expert's pairs earlier in its chunk (a cumulative sum of one-hot rows, SUB pairs at a time). The rows are those
of the stable sort, so both implementations give the same bits. The programs share out the ``block_experts``
entries; program 0 writes ``num_padded``.

This file holds the op's three parts: the torch reference, the Triton kernel and the dispatch.
"""

from __future__ import annotations

import torch

from nvllm.kernels import pdl
from nvllm.kernels.backend import use_triton
from nvllm.kernels.jit import lazy_jit

tl = None  # triton.language, bound by lazy_jit at the first launch

CHUNK = 1024          # pairs a program places (and counts at a time)
ONE_HOT = 8192        # most elements of a one-hot tile: SUB = ONE_HOT / (experts, a power of two), 16 to CHUNK
BLOCKS = 64           # block_experts entries a program writes at a time


def padded_size(pairs: int, num_experts: int, block_m: int) -> int:
    """``max_padded``: the rows the groups can need whatever the routing, a multiple of ``block_m``."""
    return -(-(pairs + num_experts * (block_m - 1)) // block_m) * block_m


# ---------------------------------------------------------------------------------------------- reference


def align_tokens_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The module doc's op in torch (a stable sort by expert)."""
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    dev = flat.device
    max_padded = padded_size(n, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    pad_start = pad_end - padded
    count_start = counts.cumsum(0) - counts
    experts, order = torch.sort(flat, stable=True)
    dest = pad_start[experts] + torch.arange(n, device=dev) - count_start[experts]  # group start + rank in it
    sorted_ids = torch.full((max_padded,), n, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    starts = torch.arange(0, max_padded, block_m, device=dev)
    block_experts = torch.searchsorted(pad_end, starts, right=True)  # experts whose group ends at or before
    block_experts = block_experts.masked_fill_(starts >= pad_end[-1], -1).to(torch.int32)
    return sorted_ids, block_experts, pad_end[-1:].to(torch.int32)


# ------------------------------------------------------------------------------------------------- Triton


def _align_kernel(
    ids_ptr, sorted_ptr, block_experts_ptr, num_padded_ptr,
    n, num_experts, block_m, num_blocks,
    E_PAD: tl.constexpr,                      # next power of two ≥ num_experts
    CHUNK: tl.constexpr, SUB: tl.constexpr, BLOCKS: tl.constexpr,
    PDL: tl.constexpr,                        # programmatic dependent launch (nvllm.kernels.pdl)
):
    """Program c: the module doc's steps for its chunk of pairs, then its share of ``block_experts``. Sentinels are
    already in ``sorted_ptr``; only the rows of real pairs are written."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    c = tl.program_id(0)
    start = c * CHUNK
    e = tl.arange(0, E_PAD)
    total = tl.zeros((E_PAD,), tl.int32)
    before = tl.zeros((E_PAD,), tl.int32)
    for p0 in range(0, n, CHUNK):             # every pair counted; pairs past n read as expert 0, taken off below
        offs = p0 + tl.arange(0, CHUNK)
        h = tl.histogram(tl.load(ids_ptr + offs, mask=offs < n, other=0).to(tl.int32), E_PAD)
        h -= tl.where(e == 0, tl.maximum(p0 + CHUNK - n, 0), 0)
        total += h
        before += tl.where(p0 < start, h, 0)
    padded = (total + block_m - 1) // block_m * block_m
    pad_end = tl.cumsum(padded, 0)
    base = pad_end - padded + before          # where this chunk's first pair of each expert goes
    for s0 in range(start, tl.minimum(start + CHUNK, n), SUB):
        offs = s0 + tl.arange(0, SUB)
        ok = offs < n
        x = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
        hot = (x[:, None] == e[None, :]).to(tl.int32)                      # [SUB, E_PAD]
        rank = tl.sum(tl.cumsum(hot, 0) * hot, 1) - 1                      # earlier pairs of its expert in the tile
        tl.store(sorted_ptr + tl.sum(hot * base[None, :], 1) + rank, offs, mask=ok)
        base += tl.sum(hot, 0)
    used = tl.sum(padded, 0)
    live = e < num_experts
    for b0 in range(c * BLOCKS, num_blocks, tl.num_programs(0) * BLOCKS):
        b = b0 + tl.arange(0, BLOCKS)
        row = b * block_m
        ended = tl.sum(((pad_end[None, :] <= row[:, None]) & live[None, :]).to(tl.int32), 1)   # groups before it
        tl.store(block_experts_ptr + b, tl.where(row >= used, -1, ended), mask=b < num_blocks)
    if c == 0:
        tl.store(num_padded_ptr + tl.arange(0, 1), tl.full((1,), 0, tl.int32) + used)


_align_kernel.do_not_specialize = ("n", "num_blocks")   # vary with the batch (see nvllm.kernels.jit)


def align_tokens_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as ``align_tokens_reference``: a fill of the sentinels, then one launch of ``max(1, T·k /
    CHUNK)`` programs."""
    import triton

    flat = topk_ids.reshape(-1)
    flat = flat if flat.is_contiguous() else flat.contiguous()
    n = flat.numel()
    dev = flat.device
    max_padded = padded_size(n, num_experts, block_m)
    sorted_ids = torch.full((max_padded,), n, dtype=torch.int32, device=dev)
    block_experts = torch.empty(max_padded // block_m, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    e_pad = triton.next_power_of_2(num_experts)
    lazy_jit(_align_kernel)[(max(1, triton.cdiv(n, CHUNK)),)](
        flat, sorted_ids, block_experts, num_padded, n, num_experts, block_m, block_experts.numel(),
        E_PAD=e_pad, CHUNK=CHUNK, SUB=min(CHUNK, max(16, ONE_HOT // e_pad)), BLOCKS=BLOCKS,
        num_warps=4, **pdl.launch_args(flat),
    )
    return sorted_ids, block_experts, num_padded


# ----------------------------------------------------------------------------------------------- dispatch


def align_tokens(topk_ids: torch.Tensor, num_experts: int, block_m: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The module doc's op (``topk_ids`` int32 or int64)."""
    if use_triton(topk_ids):
        return align_tokens_triton(topk_ids, num_experts, block_m)
    return align_tokens_reference(topk_ids, num_experts, block_m)
