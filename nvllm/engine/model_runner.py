"""The model runner owns the model, the paged KV cache tensors and the sampler. Each step it flattens the
scheduled sequences into one batch (token ids, positions, slot mapping, block tables, context lengths), runs
the model once, computes logits only for the rows that need them, and samples.

A step is two halves: ``execute`` (the engine's call) builds the host-side ``StepInputs`` and keeps the
bookkeeping (which sequence owns which row), and ``run_model`` runs the forward and the LM-head calls. With
tensor parallelism (``tensor_parallel_size`` N > 1) rank 0's runner starts N − 1 worker processes
(nvllm.distributed), each with its shard of the weights, its KV heads and its own CUDA graphs; ``execute``
broadcasts the StepInputs, every rank runs ``run_model`` in lockstep, and rank 0 alone gets logits and samples.
Start-up is the same code on every rank, collective for collective; the KV block count is the minimum over the
ranks, so the block ids the scheduler hands out are valid everywhere."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nvllm.config import ConfigError, EngineConfig
from nvllm.distributed.group import TPGroup
from nvllm.distributed.partition import check_tensor_parallel
from nvllm.engine.cuda_graph import DecodeGraphs, fresh_tokens_promise, graph_query_len
from nvllm.engine.inflight import PendingTokens, resolve_placeholders
from nvllm.engine.kv_budget import GiB, num_kv_blocks
from nvllm.engine.piecewise_graphs import PiecewiseGraphs
from nvllm.engine.sequence import Sequence
from nvllm.engine.step_inputs import StepInputs
from nvllm.kernels import report
from nvllm.kernels.backend import use_triton
from nvllm.layers.attention import (AttentionMetadata, allocate_kv_caches, kv_cache_bytes_per_token,
                                    kv_cache_element_dtype)
from nvllm.layers.linear import interleave_gate_ups
from nvllm.layers.sampler import Sampler, SampleRow, batch_token_logprobs, host_tensor
from nvllm.lora.layers import lora_mapping
from nvllm.lora.manager import MOE_REFUSAL, LoRAManager, loads_message
from nvllm.models.llama import ModelShape
from nvllm.models.loader import checkpoint_dtype, load_hf_config, load_model, model_len_limit, quantization_plan
from nvllm.models.registry import resolve_architecture

logger = logging.getLogger("nvllm")
_PROMPT_LOGPROB_ROWS = 512  # prompt positions scored per log_softmax
PIECEWISE_MAX_TOKENS = 2048
"""Largest step (in tokens) replayed as piecewise CUDA graphs (nvllm.engine.piecewise_graphs); above it a step's
GPU work hides its launches and it runs eagerly."""


@dataclass
class StepResult:
    """Per scheduled sequence: the sampled token (or None mid-prompt), its logprob info, and prompt
    logprobs computed this step as (position, token, (lp, rank, top-N))."""

    sampled: dict[int, tuple[int, tuple | None]]  # id(seq) → (token, logprob info)
    prompt_logprobs: dict[int, list[tuple[int, int, tuple]]]
    verify_logits: torch.Tensor | None = None  # speculative: every row of the verified chunks, in order
    pending: PendingTokens | None = None  # execute(defer=True): the sampled tokens, still on the device


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TPGroup | None = None, draft: bool = False):
        """``tp``: a tensor-parallel worker's group. Rank 0 passes None and, when ``tensor_parallel_size`` > 1,
        starts the workers itself (stopped by ``shutdown()``, or when the runner is collected or the
        interpreter exits). ``draft``: a speculative draft's runner, whose decode graphs replay its catch-up chunks
        of several tokens too (so they make no ``fresh_tokens`` promise)."""
        self.config = config
        self.fresh_tokens = fresh_tokens_promise(config.speculative, draft)  # what its decode graphs promise
        self.device = torch.device(config.device)
        self.hf_config = load_hf_config(config.model, config.hf_overrides)
        self.dtype = config.torch_dtype(checkpoint_dtype(self.hf_config))
        self.tp = tp or TPGroup.single()
        self.workers = None
        if config.enable_lora and ModelShape(self.hf_config, resolve_architecture(self.hf_config)[0]).moe is not None:
            raise ConfigError(MOE_REFUSAL)   # before any weight loads
        if tp is None and config.tensor_parallel_size > 1:
            self._start_workers()
            try:
                with self.workers.guard():
                    self._build()
            except BaseException:
                self.shutdown()
                raise
        else:
            self._build()

    def _start_workers(self) -> None:
        """Check that the model splits (one ConfigError before any process starts), then start the workers."""
        import weakref

        from nvllm.distributed.worker_pool import WorkerPool

        arch, _ = resolve_architecture(self.hf_config)
        n = self.config.tensor_parallel_size
        check_tensor_parallel(ModelShape(self.hf_config, arch, n), n,
                              quantization_plan(self.config, self.hf_config, arch, log=False))
        self.workers = WorkerPool(self.config, self.device)
        self.tp = self.workers.group
        weakref.finalize(self, self.workers.stop)

    def _build(self) -> None:
        """Weights, KV cache and CUDA graphs: the same sequence of collectives on every rank."""
        config = self.config
        torch.manual_seed(config.seed)
        self.model = load_model(config, self.hf_config, self.dtype, self.device, self.tp)
        self.max_model_len = self._max_model_len()
        self.block_size = config.block_size
        self.num_blocks = self._agree_num_blocks(self._num_kv_blocks())
        self.kv_caches = self._allocate_kv_caches(self.num_blocks)
        self.sampler = Sampler(config.seed)
        self.lora = LoRAManager(self.model, self.dtype, self.device, config.max_loras, config.max_lora_rank,
                                config.allow_pickle, config.max_cpu_loras, mirrored=self.tp.size > 1
                                ) if config.enable_lora else None
        if self.device.type == "cuda":
            self.tp.enable_one_shot(self.dtype, self.device)  # before any graph captures an all-reduce
            self._gemm_choices()
            if use_triton(self.kv_caches[0][0]) and os.environ.get("NVLLM_FUSED_SILU") == "1":
                # SiLU·mul in the gate_up GEMM's epilogue (small batches): opt-in, it measured slower (PERF run V)
                interleave_gate_ups(self.model)
        self.graphs: DecodeGraphs | None = None
        self.piecewise: PiecewiseGraphs | None = None
        if self.device.type == "cuda" and not config.enforce_eager and use_triton(self.kv_caches[0][0]):
            spec = config.speculative
            verify_rows = (spec.num_speculative_tokens + 1,) if spec is not None and not spec.auto else ()
            self.graphs = DecodeGraphs(self.model, self.kv_caches, min(config.max_num_seqs, 512),
                                       -(-self.max_model_len // self.block_size), self.device, verify_rows,
                                       fresh_tokens=self.fresh_tokens, lora=self.lora is not None)
            self.graphs.capture()
            self.piecewise = PiecewiseGraphs(self.model, self.kv_caches,
                                             min(config.max_num_batched_tokens, PIECEWISE_MAX_TOKENS), self.device,
                                             pool=self.graphs.pool)
            self.piecewise.capture()
        if self.device.type == "cuda":
            self._build_lm_head_variants()
        kv_dtype = str(kv_cache_element_dtype(self.dtype, config.kv_cache_dtype)).replace("torch.", "")
        if config.kv_cache_dtype != "auto":
            kv_dtype += " + fp32 scale per token and KV head"
        logger.info("KV cache%s: %d blocks x %d tokens = %d tokens, %s, %d bytes (%.1f KiB) per token, %.2f GiB",
                    " on each rank" if self.tp.size > 1 else "", self.num_blocks, self.block_size,
                    self.num_blocks * self.block_size, kv_dtype, self.kv_bytes_per_token,
                    self.kv_bytes_per_token / 1024, self.num_blocks * self.block_size * self.kv_bytes_per_token / GiB)

    @torch.inference_mode()
    def _build_lm_head_variants(self) -> None:
        """The LM head runs outside the decode graphs, on as many rows as sequences sample in a step; its
        small-batch GEMM has one kernel variant per row bucket. Build them now: otherwise the first steps
        that sample 2, 3, … sequences compile them under live requests (run G/I: 120–270 ms TTFT stalls)."""
        h = self.model.shape.hidden_size
        for m in (1, 2, 4, 8, 16):
            if m <= self.config.max_num_seqs:
                self.model.compute_logits(torch.zeros(m, h, dtype=self.dtype, device=self.device))
        torch.cuda.synchronize(self.device)

    def _agree_num_blocks(self, n: int) -> int:
        """Every rank pages the same block ids: the smallest count any rank holds."""
        if self.tp.size > 1:
            counts = self.tp.all_gather_int(n)
            n = min(counts)
            logger.info("tensor parallel: KV blocks per rank %s; every rank uses %d", counts, n)
        if n < 1:
            raise ConfigError("no memory left for the KV cache; lower the model size or raise "
                              "gpu_memory_utilization / kv_cache_memory")
        return n

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and give the device back the KV cache and the CUDA graphs, so that a
        next engine in this process can have the memory. Idempotent; no step runs afterwards. The CUDA graphs go
        first: they hold collectives captured on the NCCL communicator that stopping aborts (an abort with them
        alive did not return within 5 s on the H200 pair, PERF runs O, S, X)."""
        self.graphs = self.piecewise = None  # an in-flight graph is freed when it completes: no wait here
        if self.workers is not None:
            self.workers.stop()
        getattr(self, "kv_caches", []).clear()  # in place: a graph still referenced elsewhere shares the list
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _gemm_choices(self) -> None:
        """Small-batch GEMMs: load the measured cuBLAS-vs-Triton table shipped for this GPU (or the file named
        by NVLLM_GEMM_TABLE); NVLLM_TUNE_GEMM=1 measures the model's own shapes now instead."""
        from nvllm.kernels.gemm import gemm_table_path, load_gemm_table
        from nvllm.kernels.gemm_tuner import tune_gemm
        from nvllm.layers.embed_head import LMHead
        from nvllm.layers.linear import Linear

        if os.environ.get("NVLLM_TUNE_GEMM") == "1":
            shapes = sorted({tuple(m.weight.shape) for m in self.model.modules() if isinstance(m, (Linear, LMHead))})
            tune_gemm(shapes, [1, 2, 4, 8, 16], self.dtype, self.device, log=logger.info)
            return
        path = os.environ.get("NVLLM_GEMM_TABLE") or gemm_table_path(torch.cuda.get_device_name(self.device))
        if os.path.isfile(path):
            logger.info("small-batch GEMM choices: %d entries from %s", load_gemm_table(path), path)

    # ---- sizing --------------------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        """K + V elements of every layer, plus their scales for an int8 / fp8 cache: the real bytes."""
        s = self.model.shape
        return kv_cache_bytes_per_token(s.num_layers, s.num_local_kv_heads, s.head_dim, self.dtype,
                                        self.config.kv_cache_dtype)

    def _allocate_kv_caches(self, num_blocks: int):
        s = self.model.shape
        return allocate_kv_caches(s.num_layers, num_blocks, self.block_size, s.num_local_kv_heads, s.head_dim,
                                  self.dtype, self.config.kv_cache_dtype, self.device)

    def _max_model_len(self) -> int:
        return model_len_limit(self.hf_config, self.config.max_model_len)

    def _num_kv_blocks(self) -> int:
        """The blocks this rank's memory holds (``kv_budget.num_kv_blocks``; the ranks then agree on the fewest)."""
        profile = self._profile_free_memory if self.device.type == "cuda" else None
        return num_kv_blocks(self.config, self.model, self.dtype, self.kv_bytes_per_token, self.max_model_len,
                             profile)

    def _profile_free_memory(self) -> int:
        """Run one prompt of max_num_batched_tokens dummy tokens (a cache just big enough), measure the peak, give
        the KV cache what gpu_memory_utilization leaves."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        nb = -(-n // self.block_size)
        dummy_cache = self._allocate_kv_caches(nb)
        i32 = dict(dtype=torch.int32, device=self.device)
        meta = AttentionMetadata(  # one prompt of n tokens, the largest step the scheduler can make
            slot_mapping=torch.arange(n, dtype=torch.long, device=self.device),
            block_tables=torch.arange(nb, **i32)[None], query_start_loc=torch.tensor([0, n], **i32),
            context_lens=torch.tensor([n], **i32), max_query_len=n, max_context_len=n)
        with torch.inference_mode():
            hidden = self.model(torch.zeros(n, dtype=torch.long, device=self.device),
                                torch.arange(n, device=self.device), dummy_cache, meta)
            self.model.compute_logits(hidden[-min(n, self.config.max_num_seqs):])
        torch.cuda.synchronize()
        del dummy_cache, hidden
        peak = torch.cuda.max_memory_allocated()
        total = torch.cuda.get_device_properties(self.device).total_memory
        free = int(total * self.config.gpu_memory_utilization) - peak
        report.reset()
        return max(free, 0)

    # ---- one step ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Sequence, int]],
                sample_rows: list[SampleRow] | Callable[[], list[SampleRow]],
                drafts: dict[int, list[int]] | None = None,
                prev_tokens: torch.Tensor | None = None, defer: bool = False) -> StepResult:
        """Run the model on the scheduled chunks; sample for the sequences whose chunk reaches their end
        (in `scheduled` order, one SampleRow each, given by the engine, or by a function called once the forward is
        queued: the engine reads the step in flight there, whose tokens structured outputs' masks need).

        drafts (speculative decoding): id(seq) → drafted token ids. A chunk that runs past a sequence's tokens is
        its last real token followed by its drafts; the logits of all its rows are returned, in order, as
        `verify_logits` (the engine verifies them) instead of being sampled.

        ``prev_tokens``: tokens on the device that placeholders −1 − r among the step's ids stand for (row r) —
        the previous step's samples among the sequences' tokens (asynchronous scheduling, one rank), or a draft
        model's tokens among the drafts; they are taken on the device, unread (with tensor parallelism read here:
        the workers get host ids), and the sampler counts the previous step's for penalized rows. ``defer`` leaves
        this step's samples on the device (``result.pending``) instead of reading them back (no logprobs then)."""
        step, sample_owner, plp = self._build_step(scheduled, drafts)
        if prev_tokens is not None and step.has_placeholders:
            ids = resolve_placeholders(step.input_ids, prev_tokens, self.device)
            step.input_ids = ids if self.workers is None else ids.tolist()
        result = StepResult({}, {})

        def record_prompt_logprobs(first: int, logits: torch.Tensor) -> None:
            chunk = plp[first:first + _PROMPT_LOGPROB_ROWS]
            lps = torch.log_softmax(logits, dim=-1)
            toks = [seq.token_ids[p + 1] for seq, p in chunk]
            infos = batch_token_logprobs(lps, toks, [seq.params.prompt_logprobs for seq, _ in chunk])
            for (seq, p), tok, info in zip(chunk, toks, infos):
                result.prompt_logprobs.setdefault(id(seq), []).append((p + 1, tok, info))

        if self.lora is not None:
            step.lora_slots = self.lora.slots([seq.lora_id for seq, n in scheduled for _ in range(n)])
        if self.workers is None:
            result.verify_logits, logits = self.run_model(step, record_prompt_logprobs)
        else:
            with self.workers.guard():
                if self.lora is not None and self.lora.pending:  # adapters put in slots since the last step
                    self.tp.broadcast_message(loads_message(self.lora.pending))
                    self.lora.pending.clear()
                self.tp.broadcast_message(step.pack())
                result.verify_logits, logits = self.run_model(step, record_prompt_logprobs)
        pending = prev_tokens if drafts is None else None  # what penalized rows' placeholders stand for
        if callable(sample_rows):
            sample_rows = sample_rows()
        if logits is not None and defer:
            result.pending = PendingTokens(sample_owner, self.sampler.sample(logits, sample_rows, pending))
        elif logits is not None:
            out = self.sampler(logits, sample_rows, pending)
            for seq, tok, lp in zip(sample_owner, out.token_ids, out.logprobs):
                result.sampled[id(seq)] = (tok, lp)
        if self.workers is not None:
            self.workers.check()  # a worker that died during the step (e.g. an aborted NCCL op) voids its output
        return result

    def _build_step(self, scheduled: list[tuple[Sequence, int]], drafts: dict | None
                    ) -> tuple[StepInputs, list[Sequence], list[tuple[Sequence, int]]]:
        """The flattened batch, the sequences that sample (in row order) and the (sequence, position) of each
        prompt-logprob row."""
        bs = self.block_size
        step = StepInputs([], [], [], [0], [], [])
        sample_owner: list[Sequence] = []
        plp: list[tuple[Sequence, int]] = []
        qsl = step.query_start_loc
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            end = start + n
            if drafts is not None and end > seq.num_tokens:
                step.verify_rows.extend(range(qsl[-1], qsl[-1] + n))
                step.input_ids.extend(seq.token_ids[start:])
                step.input_ids.extend(drafts[id(seq)])
                step.has_placeholders |= min(drafts[id(seq)]) < 0  # a draft model's, still on the device
            else:
                step.input_ids.extend(seq.token_ids[start:end])
            step.has_placeholders |= seq.pending > 0
            step.positions.extend(range(start, end))
            table = seq.block_table
            step.slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            base = qsl[-1]
            qsl.append(base + n)
            step.context_lens.append(end)
            if seq.wants_prompt_logprobs:
                done = len(seq.prompt_logprobs or [None])  # positions 1.. already recorded
                for p in range(max(start, done - 1), min(end, seq.num_prompt_tokens - 1)):
                    step.prompt_rows.append(base + p - start)
                    plp.append((seq, p))
            if end == seq.num_tokens:
                step.logit_rows.append(base + n - 1)
                sample_owner.append(seq)
        width = max(len(seq.block_table) for seq, _ in scheduled)
        step.block_tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq, _ in scheduled]
        step.max_query_len = max(n for _, n in scheduled)
        step.max_context_len = max(step.context_lens)
        return step, sample_owner, plp

    @torch.inference_mode()
    def run_model(self, step: StepInputs, on_prompt_logits: Callable[[int, torch.Tensor], None] | None = None
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The forward of one step and its LM-head calls, on every rank. Returns (verify logits, logits of the
        rows to sample) — on rank 0; None, None elsewhere. Prompt-logprob rows go through the LM head in chunks
        of bounded size, each handed to ``on_prompt_logits(first row index, logits)`` on rank 0. With LoRA the step
        names each token's slot (``step.lora_slots``)."""
        dev = self.device
        promise = self.graphs.fresh_tokens if self.graphs is not None else self.fresh_tokens
        short = step.max_query_len <= graph_query_len(promise) and not step.prompt_rows
        if self.graphs is not None and short and len(step.input_ids) <= self.graphs.max_batch:
            tables, ctx = step.block_tables, step.context_lens
            if step.max_query_len > 1:  # one graph row per token, attending to the positions up to its own
                qsl = step.query_start_loc
                tables = [t for t, a, b in zip(step.block_tables, qsl, qsl[1:]) for _ in range(b - a)]
                ctx = [p + 1 for p in step.positions]
            hidden = self.graphs.run(step.input_ids, step.positions, step.slots, tables, ctx, step.lora_slots)
        else:
            # short steps apply adapters per token, as the decode graphs do; steps with prompt chunks per adapter
            mapping = self.lora.mapping(step.lora_slots, per_token=short) if self.lora is not None else None
            piecewise = mapping is None and self.piecewise is not None and self.piecewise.fits(len(step.positions))
            meta = AttentionMetadata(
                slot_mapping=step.slots if piecewise else host_tensor(step.slots, torch.long, dev),
                block_tables=host_tensor(step.block_tables, torch.int32, dev),
                query_start_loc=host_tensor(step.query_start_loc, torch.int32, dev),
                context_lens=host_tensor(step.context_lens, torch.int32, dev),
                max_query_len=step.max_query_len, max_context_len=step.max_context_len)
            ids = step.input_ids
            if piecewise:
                hidden = self.piecewise.run(ids, step.positions, meta)
            else:
                with lora_mapping(mapping):
                    hidden = self.model(ids if isinstance(ids, torch.Tensor) else host_tensor(ids, torch.long, dev),
                                        host_tensor(step.positions, torch.long, dev), self.kv_caches, meta)

        verify = self._logits(hidden, step.verify_rows) if step.verify_rows else None
        for c in range(0, len(step.prompt_rows), _PROMPT_LOGPROB_ROWS):  # bounded [rows, vocab] temporaries
            logits = self._logits(hidden, step.prompt_rows[c:c + _PROMPT_LOGPROB_ROWS])
            if logits is not None and on_prompt_logits is not None:
                on_prompt_logits(c, logits)
        logits = self._logits(hidden, step.logit_rows) if step.logit_rows else None
        return verify, logits

    def _logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
        if len(rows) < hidden.shape[0]:
            hidden = hidden[host_tensor(rows, torch.long, self.device)]
        return self.model.compute_logits(hidden)

    @staticmethod
    def needs_sample(seq: Sequence, n: int) -> bool:
        return seq.num_computed_tokens + n == seq.num_tokens
