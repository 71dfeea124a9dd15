"""A mixture of experts' (token, slot) pairs grouped by expert, each group padded to whole blocks of rows.

    topk_ids [T, k] → sorted_ids int32 [max_padded], block_experts int32 [max_padded / block_m], num_padded int32 [1]

The T·k pairs, as flat ids ``t·k + j``, grouped by expert (experts in order, pairs in flat order within one) and each
group padded with the sentinel ``T·k`` to a multiple of ``block_m``; ``block_experts[b]`` is the expert of rows
``[b·block_m, (b+1)·block_m)``, -1 for blocks at or past ``num_padded``; ``max_padded = T·k + E·(block_m − 1)``
rounded up to ``block_m``. Every output size follows from (T·k, E, block_m) alone, so nothing is read back to the
host and the op runs inside CUDA graph capture. The grouped GEMMs (``fused_moe``, ``quant_moe``) read it.

In torch this is a sort, two scatters, two cumulative sums, a search and a dozen element-wise kernels: about 30
launches, 50–138 µs a call in a CUDA graph at 32–8192 tokens on an H100 (PERF.md, session 39), on every layer of a
prefill and of every decode step past E/k tokens. The Triton kernel is one launch. Program c owns pairs
[c·CHUNK, (c+1)·CHUNK): it counts every expert's pairs (``tl.histogram``), in all chunks and in the chunks before its
own, forms the padded groups' starts by a cumulative sum, and places its pairs in order: a pair's row is its
expert's group start, plus the pairs of that expert in earlier chunks and earlier tiles of its chunk, plus its rank
among the same expert's pairs earlier in its tile (SUB pairs compared with each other). The rows are those of the
stable sort, so both implementations give the same bits. The programs share out the blocks: each block's expert,
and the sentinels in the rows its group's pairs leave free; program 0 writes ``num_padded``. (A one-hot cumulative
sum for the ranks and a separate sentinel fill were 1.6–3.3× slower at 128 experts, runs FP and FQ.)

This file holds the op's three parts: the torch reference, the Triton kernel and the dispatch.
"""

from __future__ import annotations

import torch

from nvllm.kernels import pdl
from nvllm.kernels.backend import use_triton
from nvllm.kernels.jit import lazy_jit

tl = None  # triton.language, bound by lazy_jit at the first launch

CHUNK = 1024          # pairs a program places (and counts at a time)
SUB = 32              # pairs ranked at a time (a [SUB, SUB] comparison)
BLOCKS = 16           # blocks of rows a program finishes at a time


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
    BM: tl.constexpr,                         # next power of two ≥ block_m
    CHUNK: tl.constexpr, SUB: tl.constexpr, BLOCKS: tl.constexpr,
    PDL: tl.constexpr,                        # programmatic dependent launch (nvllm.kernels.pdl)
):
    """Program c: the module doc's steps for its chunk of pairs (none past the last chunk), then its share of the
    blocks: their experts, and the sentinels of their rows that no pair takes."""
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
    pad_start = pad_end - padded
    base = pad_start + before                 # where this chunk's next pair of each expert goes
    i = tl.arange(0, SUB)
    for s0 in range(start, tl.minimum(start + CHUNK, n), SUB):
        offs = s0 + i
        ok = offs < n
        x = tl.load(ids_ptr + offs, mask=ok, other=0).to(tl.int32)
        rank = tl.sum(((x[:, None] == x[None, :]) & (i[None, :] < i[:, None])).to(tl.int32), 1)   # same expert,
        tl.store(sorted_ptr + tl.gather(base, x, 0) + rank, offs, mask=ok)                          # earlier in tile
        base += tl.histogram(x, E_PAD)      # pairs past n (as expert 0) only in the last tile: never read
    used = tl.sum(padded, 0)
    live = e < num_experts
    r = tl.arange(0, BM)
    for b0 in range(c * BLOCKS, num_blocks, tl.num_programs(0) * BLOCKS):
        b = b0 + tl.arange(0, BLOCKS)
        row = b * block_m
        ended = tl.sum(((pad_end[None, :] <= row[:, None]) & live[None, :]).to(tl.int32), 1)   # groups before it
        tl.store(block_experts_ptr + b, tl.where(row >= used, -1, ended), mask=b < num_blocks)
        expert = tl.minimum(ended, num_experts - 1)
        pos = row[:, None] + r[None, :]
        sentinel = (row[:, None] >= used) | (pos - tl.gather(pad_start, expert, 0)[:, None]
                                             >= tl.gather(total, expert, 0)[:, None])   # past its group's pairs
        tl.store(sorted_ptr + pos, tl.full((BLOCKS, BM), 0, tl.int32) + n,
                 mask=sentinel & (r < block_m)[None, :] & (b < num_blocks)[:, None])
    if c == 0:
        tl.store(num_padded_ptr + tl.arange(0, 1), tl.full((1,), 0, tl.int32) + used)


_align_kernel.do_not_specialize = ("n", "num_blocks")   # vary with the batch (see nvllm.kernels.jit)


def align_tokens_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as ``align_tokens_reference``: one launch of enough programs for the chunks of pairs and for the
    blocks, ``BLOCKS`` a program."""
    import triton

    flat = topk_ids.reshape(-1).contiguous()
    n = flat.numel()
    dev = flat.device
    max_padded = padded_size(n, num_experts, block_m)
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
    block_experts = torch.empty(max_padded // block_m, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    grid = max(1, triton.cdiv(n, CHUNK), triton.cdiv(block_experts.numel(), BLOCKS))
    lazy_jit(_align_kernel)[(grid,)](
        flat, sorted_ids, block_experts, num_padded, n, num_experts, block_m, block_experts.numel(),
        E_PAD=triton.next_power_of_2(num_experts), BM=triton.next_power_of_2(block_m), CHUNK=CHUNK, SUB=SUB,
        BLOCKS=BLOCKS, num_warps=4, **pdl.launch_args(flat),
    )
    return sorted_ids, block_experts, num_padded


# ----------------------------------------------------------------------------------------------- dispatch


def align_tokens(topk_ids: torch.Tensor, num_experts: int, block_m: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The module doc's op (``topk_ids`` int32 or int64)."""
    if use_triton(topk_ids):
        return align_tokens_triton(topk_ids, num_experts, block_m)
    return align_tokens_reference(topk_ids, num_experts, block_m)
