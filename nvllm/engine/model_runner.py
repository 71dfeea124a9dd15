"""The model runner owns the model, the paged KV cache tensors and the sampler. Each step it flattens the
scheduled sequences into one batch (token ids, positions, slot mapping, block tables, context lengths), runs
the model once, computes logits only for the rows that need them, and samples."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from nvllm.config import ConfigError, EngineConfig
from nvllm.engine.sequence import Sequence
from nvllm.engine.cuda_graph import DecodeGraphs
from nvllm.kernels import report
from nvllm.kernels.backend import use_triton
from nvllm.layers.attention import (AttentionMetadata, allocate_kv_caches, kv_cache_bytes_per_token,
                                    kv_cache_element_dtype)
from nvllm.layers.sampler import Sampler, SampleRow, batch_token_logprobs, host_tensor
from nvllm.models.loader import checkpoint_dtype, load_hf_config, load_model

logger = logging.getLogger("nvllm")
_GiB = 1 << 30
_PROMPT_LOGPROB_ROWS = 512  # prompt positions scored per log_softmax


@dataclass
class StepResult:
    """Per scheduled sequence: the sampled token (or None mid-prompt), its logprob info, and prompt
    logprobs computed this step as (position, token, (lp, rank, top-N))."""

    sampled: dict[int, tuple[int, tuple | None]]  # id(seq) → (token, logprob info)
    prompt_logprobs: dict[int, list[tuple[int, int, tuple]]]
    verify_logits: torch.Tensor | None = None  # speculative: every row of the verified chunks, in order


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        self.hf_config = load_hf_config(config.model)
        self.dtype = config.torch_dtype(checkpoint_dtype(self.hf_config))
        torch.manual_seed(config.seed)
        self.model = load_model(config, self.hf_config, self.dtype, self.device)
        self.max_model_len = self._max_model_len()
        self.block_size = config.block_size
        self.num_blocks = self._num_kv_blocks()
        self.kv_caches = self._allocate_kv_caches(self.num_blocks)
        self.sampler = Sampler(config.seed)
        if self.device.type == "cuda":
            self._gemm_choices()
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not config.enforce_eager and use_triton(self.kv_caches[0][0]):
            self.graphs = DecodeGraphs(self.model, self.kv_caches, min(config.max_num_seqs, 512),
                                       -(-self.max_model_len // self.block_size), self.device)
            self.graphs.capture()
        kv_dtype = str(kv_cache_element_dtype(self.dtype, config.kv_cache_dtype)).replace("torch.", "")
        if config.kv_cache_dtype != "auto":
            kv_dtype += " + fp32 scale per token and KV head"
        logger.info("KV cache: %d blocks x %d tokens = %d tokens, %s, %d bytes (%.1f KiB) per token, %.2f GiB",
                    self.num_blocks, self.block_size, self.num_blocks * self.block_size, kv_dtype,
                    self.kv_bytes_per_token, self.kv_bytes_per_token / 1024,
                    self.num_blocks * self.block_size * self.kv_bytes_per_token / _GiB)

    def _gemm_choices(self) -> None:
        """Small-batch GEMMs: load the measured cuBLAS-vs-Triton table shipped for this GPU (or the file named
        by NVLLM_GEMM_TABLE); NVLLM_TUNE_GEMM=1 measures the model's own shapes now instead."""
        import os

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
        return kv_cache_bytes_per_token(s.num_layers, s.num_kv_heads, s.head_dim, self.dtype,
                                        self.config.kv_cache_dtype)

    def _allocate_kv_caches(self, num_blocks: int):
        s = self.model.shape
        return allocate_kv_caches(s.num_layers, num_blocks, self.block_size, s.num_kv_heads, s.head_dim,
                                  self.dtype, self.config.kv_cache_dtype, self.device)

    def _max_model_len(self) -> int:
        s, c = self.model.shape, self.hf_config
        limit = s.max_position
        window = getattr(c, "sliding_window", None)
        layer_types = getattr(c, "layer_types", None) or []
        uses_window = window and (getattr(c, "use_sliding_window", True) is not False
                                  or "sliding_attention" in layer_types)
        if self.config.max_model_len is not None:
            if self.config.max_model_len > limit:
                raise ConfigError(f"max_model_len {self.config.max_model_len} exceeds the model's "
                                  f"max_position_embeddings {limit}")
            limit = self.config.max_model_len
        if uses_window and window < limit:
            logger.warning("the model uses sliding-window attention (%d); max_model_len capped to %d, within "
                           "which it equals full attention", window, window)
            limit = window
        return limit

    def _num_kv_blocks(self) -> int:
        c = self.config
        per_block = self.kv_bytes_per_token * c.block_size
        if c.num_kv_blocks is not None:
            n = c.num_kv_blocks
        elif c.kv_cache_memory is not None:
            n = int(c.kv_cache_memory * _GiB // per_block)
        elif self.device.type == "cuda":
            draft_weights, draft_per_token = self._draft_footprint()
            n = (self._profile_free_memory() - draft_weights) // (per_block + draft_per_token * c.block_size)
        else:
            # CPU default: room for max_num_seqs full-length sequences, at most 4 GiB
            want = c.max_num_seqs * math.ceil(self.max_model_len / c.block_size)
            n = min(want, int(4 * _GiB // per_block))
        if n < 1:
            raise ConfigError("no memory left for the KV cache; lower the model size or raise "
                              "gpu_memory_utilization / kv_cache_memory")
        return int(n)

    def _draft_footprint(self) -> tuple[int, int]:
        """(weight bytes, KV bytes per token) of the speculative draft model that will share this GPU and this
        block count; (0, 0) without one. Estimated from its config.json, in this runner's dtypes."""
        spec = self.config.speculative
        if spec is None or getattr(spec, "method", None) != "draft":
            return 0, 0
        from nvllm.models.hub import resolve_model_path

        hf = load_hf_config(resolve_model_path(spec.draft_model))
        h, inter, layers, vocab = hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers, hf.vocab_size
        heads = hf.num_attention_heads
        kv_heads = getattr(hf, "num_key_value_heads", None) or heads
        head_dim = getattr(hf, "head_dim", None) or h // heads
        params = layers * (h * head_dim * (heads + 2 * kv_heads) + heads * head_dim * h + 3 * h * inter) \
            + vocab * h * (1 if getattr(hf, "tie_word_embeddings", False) else 2)
        return params * self.dtype.itemsize, kv_cache_bytes_per_token(layers, kv_heads, head_dim, self.dtype,
                                                                      self.config.kv_cache_dtype)

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
    def execute(self, scheduled: list[tuple[Sequence, int]], sample_rows: list[SampleRow],
                drafts: dict[int, tuple[list[int], object]] | None = None) -> StepResult:
        """Run the model on the scheduled chunks; sample for the sequences whose chunk reaches their end
        (in `scheduled` order, one SampleRow each, given by the engine).

        drafts (speculative decoding): id(seq) → (drafted token ids, …). A chunk that runs past a sequence's
        tokens is its last real token followed by its drafts; the logits of all its rows are returned, in
        order, as `verify_logits` (the engine verifies them) instead of being sampled."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        ctx_lens: list[int] = []
        logit_rows: list[int] = []  # rows of the flattened batch whose logits are needed
        sample_owner: list[Sequence] = []
        plp_rows: list[tuple[Sequence, int, int]] = []  # (seq, flattened row, position)
        verify_rows: list[int] = []
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            end = start + n
            if drafts is not None and end > seq.num_tokens:
                verify_rows.extend(range(qsl[-1], qsl[-1] + n))
                input_ids.extend(seq.token_ids[start:])
                input_ids.extend(drafts[id(seq)][0])
            else:
                input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            base = qsl[-1]
            qsl.append(base + n)
            ctx_lens.append(end)
            if seq.wants_prompt_logprobs:
                done = len(seq.prompt_logprobs or [None])  # positions 1.. already recorded
                for p in range(max(start, done - 1), min(end, seq.num_prompt_tokens - 1)):
                    plp_rows.append((seq, base + p - start, p))
            if end == seq.num_tokens:
                logit_rows.append(base + n - 1)
                sample_owner.append(seq)
        max_blocks = max(len(seq.block_table) for seq, _ in scheduled)
        tables = [seq.block_table + [0] * (max_blocks - len(seq.block_table)) for seq, _ in scheduled]
        max_query_len = max(n for _, n in scheduled)
        dev = self.device
        if (self.graphs is not None and max_query_len == 1 and not plp_rows
                and len(scheduled) <= self.graphs.max_batch):
            hidden = self.graphs.run(input_ids, positions, slots, tables, ctx_lens)
        else:
            meta = AttentionMetadata(
                slot_mapping=host_tensor(slots, torch.long, dev), block_tables=host_tensor(tables, torch.int32, dev),
                query_start_loc=host_tensor(qsl, torch.int32, dev), context_lens=host_tensor(ctx_lens, torch.int32, dev),
                max_query_len=max_query_len, max_context_len=max(ctx_lens))
            hidden = self.model(host_tensor(input_ids, torch.long, dev), host_tensor(positions, torch.long, dev),
                                self.kv_caches, meta)

        result = StepResult({}, {})
        if verify_rows:
            result.verify_logits = self.model.compute_logits(hidden[host_tensor(verify_rows, torch.long, dev)])
        for c in range(0, len(plp_rows), _PROMPT_LOGPROB_ROWS):  # bounded [rows, vocab] float32 temporaries
            chunk = plp_rows[c:c + _PROMPT_LOGPROB_ROWS]
            rows = host_tensor([r for _, r, _ in chunk], torch.long, dev)
            lps = torch.log_softmax(self.model.compute_logits(hidden[rows]), dim=-1)
            toks = [seq.token_ids[p + 1] for seq, _, p in chunk]
            infos = batch_token_logprobs(lps, toks, [seq.params.prompt_logprobs for seq, _, _ in chunk])
            for (seq, _, p), tok, info in zip(chunk, toks, infos):
                result.prompt_logprobs.setdefault(id(seq), []).append((p + 1, tok, info))
        if logit_rows:
            if len(logit_rows) < hidden.shape[0]:
                hidden = hidden[host_tensor(logit_rows, torch.long, dev)]
            logits = self.model.compute_logits(hidden)
            out = self.sampler(logits, sample_rows)
            for seq, tok, lp in zip(sample_owner, out.token_ids, out.logprobs):
                result.sampled[id(seq)] = (tok, lp)
        return result

    @staticmethod
    def needs_sample(seq: Sequence, n: int) -> bool:
        return seq.num_computed_tokens + n == seq.num_tokens

