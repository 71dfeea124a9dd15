"""CUDA graphs for decode steps.

One graph per batch size of a ladder (1, 2, 4, 8, then every 16 up to max_num_seqs, plus k + 1 under speculative
decoding with a fixed k), captured once at
start-up over static input buffers; a decode batch of B sequences replays the graph of the smallest captured
size ≥ B, its padding rows writing nowhere (slot −1) and attending to nothing (context length 0). Larger
batches, prefills and `--enforce-eager` run eagerly. All graphs share one memory pool.

With LoRA adapters enabled each size is captured twice: as above, for steps of the base model alone, and with the
adapters applied per token from a staged slot per row (``nvllm.lora.layers``; padding rows −1), for steps where
any sequence runs an adapter.

Tensor parallelism: every rank captures the same ladder in the same order (the graphs hold the row-parallel
layers' NCCL all-reduces), and every step replays the same graph on every rank, chosen from the same StepInputs.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from nvllm.kernels import pdl, report
from nvllm.kernels.staging_copy import staging_copy
from nvllm.layers.attention import AttentionMetadata
from nvllm.lora.layers import LoRAMapping, lora_mapping

logger = logging.getLogger("nvllm")


def batch_size_ladder(max_batch: int, extra: tuple[int, ...] = ()) -> list[int]:
    """The batch sizes captured: 1, 2, 4, 8, every 16, max_batch, and the ``extra`` sizes up to max_batch."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_batch]
    sizes += list(range(16, max_batch + 1, 16))
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sorted(set(sizes) | {b for b in extra if 0 < b <= max_batch})


def staging_bytes(n: int, max_blocks: int, rows: int | None = None) -> int:
    """Bytes of the staging buffer of ``staging_views`` up to the end of block-table row ``rows`` (all n)."""
    return 36 * n + 4 * max_blocks * (n if rows is None else rows)


def staging_views(buf: torch.Tensor, n: int, max_blocks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A uint8 buffer of ``staging_bytes(n, max_blocks)`` as (meta int64 [4, n], context lengths int32 [n], block
    tables int32 [n, max_blocks]), back to back in that order (each offset a multiple of its element size)."""
    meta = buf[:32 * n].view(torch.int64).view(4, n)
    ctx = buf[32 * n:36 * n].view(torch.int32)
    tables = buf[36 * n:staging_bytes(n, max_blocks)].view(torch.int32).view(n, max_blocks)
    return meta, ctx, tables


GRAPH_MAX_QUERY_LEN = 16
"""Steps whose chunks are all this short replay the decode CUDA graphs with one row per token: each row's
context ends at its own position, and every row's K/V is stored before any row attends, so a chunk of n
tokens is exactly its causal attention. Speculative verification (k + 1 tokens a sequence) and the draft's
catch-up then run without hundreds of eager launches (``graph_query_len``: the graphs read earlier steps' keys
before the PDL wait, so a chunk longer than their promise, ``fresh_tokens_promise``, such as a short prompt's, runs
piecewise)."""


def graph_query_len(fresh_tokens: int) -> int:
    """The longest chunk (tokens of one sequence in one step) the decode graphs may replay. Graphs whose attention
    was promised that a row's context holds at most ``fresh_tokens`` tokens stored in the same step read the others
    before the PDL wait, while the rotary + KV store kernel may still be writing (decode attention's
    ``fresh_tokens``); a chunk's last row reads every token of its chunk, so no chunk may be longer than the promise.
    Without one (0): ``GRAPH_MAX_QUERY_LEN``."""
    return min(GRAPH_MAX_QUERY_LEN, fresh_tokens) if fresh_tokens > 0 else GRAPH_MAX_QUERY_LEN


def fresh_tokens_promise(speculative, draft: bool) -> int:
    """The ``fresh_tokens`` a runner's decode graphs promise their attention: without speculation one token a
    sequence; a speculative target's verification stores at most k + 1 (k drafted tokens after the last one, k=auto:
    its ceiling); a draft's runner none, so that its catch-up chunks, which can be longer, still replay in graphs."""
    if draft:
        return 0
    return 1 if speculative is None else speculative.max_k + 1


class DecodeGraphs:
    def __init__(self, model, kv_caches, max_batch: int, max_blocks_per_seq: int, device: torch.device,
                 extra_sizes: tuple[int, ...] = (), fresh_tokens: int = 0, lora: bool = False):
        """``extra_sizes``: batch sizes captured besides the ladder (speculative verification: k + 1 rows; padded to
        the next rung, 5 rows of the 7B ran 1.4% slower, PERF run AH). ``fresh_tokens``: the graphs' attention
        metadata's (``fresh_tokens_promise``; the runner replays no chunk longer than it, ``graph_query_len``).
        ``lora``: also capture each size with the model's LoRA linears reading a slot per row."""
        self.model = model
        self.fresh_tokens = fresh_tokens
        self.kv_caches = kv_caches
        self.sizes = batch_size_ladder(max_batch, extra_sizes)
        n = self.sizes[-1]
        # device inputs, views of one byte buffer (``staging_views``) so that one copy a step fills them: rows 0..3
        # of `meta` are token ids, positions, KV slots and LoRA slots, then the context lengths and the block tables
        self.staged = torch.zeros(staging_bytes(n, max_blocks_per_seq), dtype=torch.uint8, device=device)
        self.meta, self.context_lens, self.block_tables = staging_views(self.staged, n, max_blocks_per_seq)
        self.input_ids, self.positions, self.slot_mapping = self.meta[0], self.meta[1], self.meta[2]
        self.lora_slots = self.meta[3] if lora else None
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        # pinned host staging, laid out the same: each step writes here, then one asynchronous copy; the next write
        # waits for it (a step of mid-prompt chunks samples nothing, so nothing else would wait). The writes go
        # through numpy views: as torch ops they took 57 us of the H200 host's time per step (PERF run AK); the same
        # writes in numpy took 1.8 us against 18.6 us as torch ops on the CI host
        pin = torch.device(device).type == "cuda"
        self.host_staged = torch.zeros(self.staged.numel(), dtype=torch.uint8, pin_memory=pin)
        self.host_meta, self.host_ctx, self.host_tables = staging_views(self.host_staged, n, max_blocks_per_seq)
        self._meta_np, self._ctx_np = self.host_meta.numpy(), self.host_ctx.numpy()
        self._tables_np = self.host_tables.numpy()
        self.meta[2:].fill_(-1)
        self.host_meta[3].fill_(-1)
        self.copied = torch.cuda.Event() if pin else None
        # on the GPU the host's copy lands in `landing` on a side stream as soon as it is staged, and a kernel in
        # stream order moves it (and the sampled tokens) into the graph's buffers (nvllm.kernels.staging_copy)
        self.landing = torch.zeros_like(self.staged) if pin else None
        self.copy_stream = torch.cuda.Stream(device) if pin else None
        self.landing_read = torch.cuda.Event() if pin else None  # the last staging kernel has read `landing`
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.recorded: dict[int, object] = {}  # batch size → the kernel-report records its capture made
        # the same for the graphs that apply LoRA adapters (``lora``)
        self.lora_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.lora_outputs: dict[int, torch.Tensor] = {}
        self.lora_recorded: dict[int, object] = {}

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    @property
    def pool(self):
        """The graphs' memory pool (after capture), for other graphs replayed on the same stream to share."""
        return self.graphs[self.sizes[-1]].pool() if self.graphs else None

    def _meta(self, bs: int) -> AttentionMetadata:
        # max_context_len=None: the decode kernel sizes its split grid from the block-table capacity, a
        # number fixed at capture time
        return AttentionMetadata(self.slot_mapping[:bs], self.block_tables[:bs], self.query_start_loc[:bs + 1],
                                 self.context_lens[:bs], max_query_len=1, max_context_len=None,
                                 fresh_tokens=self.fresh_tokens)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        pool = None
        variants = (False, True) if self.lora_slots is not None else (False,)
        for bs in reversed(self.sizes):  # largest first: the pool is sized once
            args = (self.input_ids[:bs], self.positions[:bs], self.kv_caches, self._meta(bs))
            for lora in variants:
                graphs, outputs, recorded = self._variant(lora)
                with lora_mapping(LoRAMapping(slots=self.lora_slots[:bs]) if lora else None):
                    self.model(*args)  # warm-up: compiles kernels, settles the allocator
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with report.recording() as recorded[bs], torch.cuda.graph(graph, pool=pool):
                        outputs[bs] = self.model(*args)
                pool = graph.pool()
                graphs[bs] = graph
        torch.cuda.synchronize()
        logger.info("captured %d CUDA graphs for decode batch sizes %s%s in %.1f s (programmatic dependent launch "
                    "%s)", len(self.sizes) * len(variants), self.sizes,
                    ", with and without LoRA" if len(variants) > 1 else "",
                    time.perf_counter() - start, "on" if pdl.enabled(self.input_ids) else "off")

    def _variant(self, lora: bool) -> tuple[dict, dict, dict]:
        """The graphs, outputs and kernel-report records by batch size, with LoRA or without."""
        if lora:
            return self.lora_graphs, self.lora_outputs, self.lora_recorded
        return self.graphs, self.outputs, self.recorded

    def stage(self, input_ids: list[int] | torch.Tensor, positions: list[int], slots: list[int],
              block_tables: list[list[int]], context_lens: list[int], lora_slots: list[int] | None = None) -> int:
        """Fill the graphs' input buffers for len(positions) rows (padding rows up to the graph's size store nowhere
        and attend to nothing; ``lora_slots``: each row's LoRA slot, −1 for none); returns the graph's batch
        size."""
        b = len(positions)
        bs = self.sizes[bisect.bisect_left(self.sizes, b)]
        on_device = isinstance(input_ids, torch.Tensor)
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copies out of the staging buffers are done
        meta, ctx = self._meta_np, self._ctx_np
        meta[0, :b] = 0 if on_device else input_ids
        meta[1, :b] = positions
        meta[2, :b] = slots
        meta[:2, b:bs] = 0  # padding rows: token 0 at position 0, stored nowhere (slot -1) ...
        meta[2, b:bs] = -1
        if lora_slots is not None:
            meta[3, :b] = lora_slots
            meta[3, b:bs] = -1
        ctx[:b] = context_lens
        ctx[b:bs] = 0  # ... attending to nothing
        self._tables_np[:b, :len(block_tables[0])] = block_tables
        # one contiguous prefix (meta, context lengths, the first b rows of the tables): each copy is a few µs of
        # the device's time between two steps, whatever its size
        end = staging_bytes(self.meta.shape[1], self.block_tables.shape[1], b)
        if self.copy_stream is None:
            self.staged[:end].copy_(self.host_staged[:end])
            if on_device:
                self.input_ids[:b].copy_(input_ids)
            return bs
        main = torch.cuda.current_stream()
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.landing_read)
            self.landing[:end].copy_(self.host_staged[:end], non_blocking=True)
            self.copied.record()
        main.wait_event(self.copied)
        staging_copy(self.landing, self.staged, end, input_ids if on_device else None)
        self.landing_read.record(main)
        return bs

    def run(self, input_ids: list[int] | torch.Tensor, positions: list[int], slots: list[int],
            block_tables: list[list[int]], context_lens: list[int], lora_slots: list[int] | None = None
            ) -> torch.Tensor:
        """Replay the graph for len(positions) rows (one token each); returns their final hidden states.
        ``input_ids`` may be a device tensor (tokens the host has not seen, e.g. the draft's previous step): it
        is copied on the device, so nothing waits for it. ``lora_slots``: each row's LoRA slot (−1: none), or None
        when no row runs an adapter."""
        if lora_slots is not None and self.lora_slots is None:
            raise ValueError("these decode graphs were captured without LoRA adapters")
        bs = self.stage(input_ids, positions, slots, block_tables, context_lens, lora_slots)
        graphs, outputs, recorded = self._variant(lora_slots is not None)
        graphs[bs].replay()
        report.record("decode step", f"cuda graph (batch {bs}{', LoRA' if lora_slots is not None else ''})")
        report.replay(recorded[bs])
        return outputs[bs][:len(positions)]
