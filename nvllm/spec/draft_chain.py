"""DraftChain: a greedy draft model's single-token steps after its catch-up, as one CUDA graph per batch size.

After the catch-up forward gives each sequence its first drafted token, the k − 1 steps that follow are known in
advance except for their tokens: step j feeds token j and reads position ``start + j``, whose slot, block table and
context length the host can compute beforehand. So the whole chain — each step's forward, its LM head and the
argmax that becomes the next step's input — is captured once per batch size over static buffers, and a step
costs one copy of the host-built inputs and one replay. Step by step (a graph replay, an LM-head launch, an
argmax per token) the host needed ~0.4 ms per drafted token (PERF run AH): more than a small draft's GPU time,
so the GPU waited on the host.

Greedy only (the draft's argmax; what sampled requests draw is drawn outside, step by step), every sequence with
the same k, and no banned tokens past the first draft (``min_tokens``); the proposer falls back otherwise.
Batch sizes follow the draft's decode graphs up to ``MAX_CHAIN_BATCH``. Padding rows store nowhere (slot −1) and
attend to nothing. On the CPU (tests) the same chain runs eagerly over the same buffers.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from nvllm.kernels import report
from nvllm.layers.attention import AttentionMetadata

logger = logging.getLogger("nvllm")
MAX_CHAIN_BATCH = 32
"""Largest batch captured as a chain (its graph keeps [batch, vocab] float32 logits per step in the graphs' pool:
19.5 MB per step at 32 rows of a 152k vocabulary); larger batches draft step by step."""


class DraftChain:
    def __init__(self, runner, steps: int, vocab_size: int, capture: bool = True):
        """runner: the draft's ModelRunner; steps: k − 1; vocab_size: the target's (draft logits past it are never
        chosen). ``capture=False`` runs the chain eagerly (CPU)."""
        self.model, self.kv_caches = runner.model, runner.kv_caches
        self.block_size = runner.block_size
        self.steps, self.vocab_size = steps, vocab_size
        dev = runner.device
        ladder = runner.graphs.sizes if runner.graphs is not None else [1, 2, 4, 8, 16, 32]
        self.sizes = [b for b in ladder if b <= MAX_CHAIN_BATCH] or [1]
        n = self.sizes[-1]
        width = -(-runner.max_model_len // self.block_size)
        # device inputs: one copy fills positions, slots (int64) and, separately, context lengths and block tables
        self.meta = torch.zeros(2, steps, n, dtype=torch.int64, device=dev)
        self.context_lens = torch.zeros(steps, n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, width, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.first = torch.zeros(n, dtype=torch.int64, device=dev)  # each row's first drafted token
        self.drafted = torch.zeros(n, steps, dtype=torch.int64, device=dev)
        pin = dev.type == "cuda"
        self.host_meta = torch.zeros(2, steps, n, dtype=torch.int64, pin_memory=pin)
        self.host_ctx = torch.zeros(steps, n, dtype=torch.int32, pin_memory=pin)
        self.host_tables = torch.zeros(n, width, dtype=torch.int32, pin_memory=pin)
        self._meta_np, self._ctx_np = self.host_meta.numpy(), self.host_ctx.numpy()  # written like DecodeGraphs'
        self._tables_np = self.host_tables.numpy()
        self.meta[1].fill_(-1)
        self.copied = torch.cuda.Event() if pin else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.recorded: dict[int, object] = {}
        self.runs = 0
        if capture:
            self._capture(runner.graphs.pool if runner.graphs is not None else None)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _chain(self, bs: int, max_start: int | None = None) -> None:
        """The k − 1 steps for ``bs`` rows, over the static buffers (what the graphs capture; their attention sizes
        its grid from the block-table width, so the longest context, from ``max_start``, is only given eagerly)."""
        tokens = self.first[:bs]
        for j in range(self.steps):
            meta = AttentionMetadata(self.meta[1, j, :bs], self.block_tables[:bs], self.query_start_loc[:bs + 1],
                                     self.context_lens[j, :bs], max_query_len=1,
                                     max_context_len=None if max_start is None else max_start + j + 1)
            hidden = self.model(tokens, self.meta[0, j, :bs], self.kv_caches, meta)
            logits = self.model.compute_logits(hidden)
            tokens = logits[:, :self.vocab_size].argmax(dim=-1)
            self.drafted[:bs, j] = tokens

    @torch.inference_mode()
    def _capture(self, pool) -> None:
        start = time.perf_counter()
        for bs in reversed(self.sizes):  # largest first: the pool is sized once
            self._chain(bs)  # warm-up: compiles the LM head's kernels, allocates split-K workspaces
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with report.recording() as self.recorded[bs], torch.cuda.graph(graph, pool=pool):
                self._chain(bs)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured the draft's %d-step chain for batch sizes %s in %.1f s", self.steps, self.sizes,
                    time.perf_counter() - start)

    @torch.inference_mode()
    def run(self, first: torch.Tensor, starts: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        """first: [b] each row's first drafted token (on the device); starts[i]: the position it takes. Returns the
        next k − 1 drafted tokens [b, k − 1] — a view of a static buffer, valid until the next run."""
        b, bs_ = len(starts), self.block_size
        bs = self.sizes[bisect.bisect_left(self.sizes, b)] if self.graphs else b
        width = max(len(t) for t in block_tables)
        if self.copied is not None:
            self.copied.synchronize()  # the previous run's copies out of the staging buffers are done
        pos = [[s + j for s in starts] for j in range(self.steps)]
        meta, ctx = self._meta_np, self._ctx_np
        meta[0, :, :b] = pos
        meta[1, :, :b] = [[t[p // bs_] * bs_ + p % bs_ for t, p in zip(block_tables, row)] for row in pos]
        meta[0, :, b:bs] = 0  # padding rows: position 0, stored nowhere, attending to nothing
        meta[1, :, b:bs] = -1
        ctx[:, :b] = meta[0, :, :b] + 1
        ctx[:, b:bs] = 0
        self._tables_np[:b, :width] = [t + [0] * (width - len(t)) for t in block_tables]
        self.meta.copy_(self.host_meta, non_blocking=True)
        self.context_lens.copy_(self.host_ctx, non_blocking=True)
        self.block_tables[:b].copy_(self.host_tables[:b], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        self.first[:b].copy_(first)
        self.runs += 1
        if self.graphs:
            self.graphs[bs].replay()
            report.record("draft chain", f"cuda graph (batch {bs}, {self.steps} steps)")
            report.replay(self.recorded[bs])
        else:
            self._chain(bs, max(starts))
        return self.drafted[:b]
