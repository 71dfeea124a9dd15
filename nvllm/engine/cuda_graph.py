"""CUDA graphs for decode steps.

One graph per batch size of a ladder (1, 2, 4, 8, then every 16 up to max_num_seqs), captured once at
start-up over static input buffers; a decode batch of B sequences replays the graph of the smallest captured
size ≥ B, its padding rows writing nowhere (slot −1) and attending to nothing (context length 0). Larger
batches, prefills and `--enforce-eager` run eagerly. All graphs share one memory pool.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from nvllm.kernels import report
from nvllm.layers.attention import AttentionMetadata

logger = logging.getLogger("nvllm")


def batch_size_ladder(max_batch: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    def __init__(self, model, kv_caches, max_batch: int, max_blocks_per_seq: int, device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = batch_size_ladder(max_batch)
        n = self.sizes[-1]
        i32, i64 = dict(dtype=torch.int32, device=device), dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slot_mapping = torch.full((n,), -1, **i64)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, **i32)
        self.context_lens = torch.zeros(n, **i32)
        self.query_start_loc = torch.arange(n + 1, **i32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _meta(self, bs: int) -> AttentionMetadata:
        # max_context_len=None: the decode kernel sizes its split grid from the block-table capacity, a
        # number fixed at capture time
        return AttentionMetadata(self.slot_mapping[:bs], self.block_tables[:bs], self.query_start_loc[:bs + 1],
                                 self.context_lens[:bs], max_query_len=1, max_context_len=None)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = None
        for bs in reversed(self.sizes):  # largest first: the pool is sized once
            args = (self.input_ids[:bs], self.positions[:bs], self.kv_caches, self._meta(bs))
            self.model(*args)  # warm-up: compiles kernels, settles the allocator
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bs] = self.model(*args)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs for decode batch sizes %s in %.1f s", len(self.sizes),
                    self.sizes, time.perf_counter() - start)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            block_tables: torch.Tensor, context_lens: torch.Tensor) -> torch.Tensor:
        """Replay the graph for len(input_ids) sequences; returns their final hidden states."""
        b = input_ids.shape[0]
        bs = self.sizes[bisect.bisect_left(self.sizes, b)]
        self.input_ids[:b].copy_(input_ids, non_blocking=True)
        self.positions[:b].copy_(positions, non_blocking=True)
        self.slot_mapping[:b].copy_(slot_mapping, non_blocking=True)
        self.slot_mapping[b:bs].fill_(-1)
        self.context_lens[:b].copy_(context_lens, non_blocking=True)
        self.context_lens[b:bs].fill_(0)
        self.block_tables[:b, :block_tables.shape[1]].copy_(block_tables, non_blocking=True)
        self.graphs[bs].replay()
        report.record("decode step", f"cuda graph (batch {bs})")
        return self.outputs[bs][:b]
