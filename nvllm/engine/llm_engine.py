"""LLMEngine: requests in, RequestOutputs out, one `step()` at a time. Owns the tokenizer, the scheduler,
the block manager and the model runner; everything above it (LLM, the server, bench, eval) drives it."""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence as Seq


from nvllm.config import EngineConfig
from nvllm.engine import generation_defaults
from nvllm.engine.admission import Admission
from nvllm.engine.block_manager import BlockManager
from nvllm.engine.kv_budget import fit_max_model_len
from nvllm.engine.kv_handoff import KVHandoff, KVTarget
from nvllm.engine.metrics import EngineStats, StatLogger
from nvllm.engine.inflight import InflightStep
from nvllm.engine.lora_adapters import LoraAdapters
from nvllm.reasoning_parsers import get_reasoning_parser
from nvllm.lora.request import LoRARequest
from nvllm.engine.structured_output import StructuredOutputs
from nvllm.engine.structured_output import advance as advance_grammar
from nvllm.engine.think_or_constraint import ThinkOrConstraint
from nvllm.engine.model_runner import ModelRunner
from nvllm.engine.output_builder import OutputBuilder
from nvllm.engine.scheduler import Scheduler
from nvllm.engine.sequence import PrefilledSample, Sequence, Status
from nvllm.engine.step_profile import StepProfile, step_kind
from nvllm.engine.warmup import warm_up
from nvllm.engine.stop_checker import check_stop, min_tokens_banned
from nvllm.engine.tokenizer import eos_token_ids, load_tokenizer
from nvllm.models.hub import resolve_model_path
from nvllm.models.loader import load_hf_config
from nvllm.layers.sampler import SampleRow
from nvllm.layers.token_masks import bad_word_bans
from nvllm.outputs import LogprobsDict, RequestMetrics, RequestOutput
from nvllm.prompt_inputs import cache_salt_of, prompt_of
from nvllm.sampling_params import SamplingParams
from nvllm.spec.metrics import SpecStats

logger = logging.getLogger("nvllm")


class LLMEngine:
    def __init__(self, config: EngineConfig, warmup: bool = True):
        same = config.tokenizer_follows_model
        config.model = resolve_model_path(config.model, config.revision)
        config.tokenizer = config.model if same else resolve_model_path(config.tokenizer, config.tokenizer_revision,
                                                                        what="tokenizer")
        self.config = config
        load_hf_config(config.model)  # a bad config.json is named as such, not as the tokenizer's failure
        # sampling defaults for requests that leave fields unset (LLM.generate without params, the server); read
        # before the weights, so a bad generation_config.json fails at once
        self.generation_defaults = generation_defaults.load(config.generation_config, config.model)
        self.tokenizer = load_tokenizer(config.tokenizer)
        self.runner = ModelRunner(config)
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = self.runner.model.shape.vocab_size
        self.eos_token_ids = eos_token_ids(config.model, self.tokenizer)
        self.reasoning = get_reasoning_parser(config.reasoning_parser) if config.reasoning_parser else None
        self.structured = StructuredOutputs(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                            config.structured_outputs_config["disable_any_whitespace"])
        self.admission = Admission(self.tokenizer, self.vocab_size, self.structured, self.reasoning,
                                   self.runner.device, config.max_logprobs)
        self.spec = None  # speculative decoding (nvllm.spec.decoder.SpecDecoder) when config.speculative is set
        if config.speculative is not None:
            from nvllm.spec.decoder import SpecDecoder

            self.spec = SpecDecoder(config, self.runner, self.tokenizer, self.eos_token_ids)
        self._fit_max_model_len_to_cache()
        self.block_manager = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   lookahead=self.spec.lookahead if self.spec is not None else None,
                                   policy=config.scheduling_policy)
        if self.runner.lora is not None:
            self.scheduler.activate_lora = self.runner.lora.activate
        # (nothing here holds the engine itself: dropping the last reference frees the engine, the weights and the
        # cache at once, with no wait for the garbage collector)
        self.requests: dict[str, list[Sequence]] = {}
        requests = self.requests
        self.loras = LoraAdapters(self.runner.lora, lambda: {
            s.lora_id for seqs in requests.values() for s in seqs if s.lora_id and not s.finished})
        self.prompts: dict[str, str | None] = {}
        self.outputs = OutputBuilder(self.tokenizer)
        self.stats = self._new_stats()
        self.stat_logger = StatLogger(config.log_stats_interval)
        self.step_profile = StepProfile()
        self.handoff = KVHandoff(weakref.proxy(self))  # disaggregated prefill / decode: held and arriving KV
        # asynchronous scheduling: the launched step whose sampled tokens are not read yet
        self.async_scheduling = bool(config.async_scheduling) and self.spec is None and self.runner.tp.size == 1
        self._inflight: InflightStep | None = None
        self._next_id = 0
        logger.info("engine ready: model %s, dtype %s, device %s, max_model_len %d, block_size %d, "
                    "max_num_seqs %d, max_num_batched_tokens %d, prefix caching %s",
                    config.model, str(self.runner.dtype).replace("torch.", ""), config.device,
                    self.max_model_len, config.block_size, config.max_num_seqs, config.max_num_batched_tokens,
                    "on" if config.enable_prefix_caching else "off")
        logger.info("asynchronous scheduling %s", "on: step N + 1 is launched before step N's tokens are read"
                    if self.async_scheduling else "off")
        if warmup:
            self._warmup()

    def _fit_max_model_len_to_cache(self) -> None:
        self.max_model_len = fit_max_model_len(self.max_model_len, self.runner.num_blocks * self.config.block_size,
                                               explicit=self.config.max_model_len is not None)

    def _warmup(self) -> None:
        warm_up(self)
        self.stats = self._new_stats()
        self.stat_logger = StatLogger(self.stat_logger.interval)  # its next line counts from zero, as the stats do
        self.step_profile = StepProfile()

    def _new_stats(self) -> EngineStats:
        return EngineStats(spec=SpecStats() if self.spec is not None else None)

    # ---- requests ------------------------------------------------------------------------------------
    def new_request_id(self) -> str:
        self._next_id += 1
        return f"req-{self._next_id}"

    def get_tokenizer(self):
        """The tokenizer (vLLM's LLMEngine method)."""
        return self.tokenizer

    def tokenize(self, prompt: str | Seq[int]) -> list[int]:
        return self.admission.tokenize(prompt)

    def validate(self, prompt: str | Seq[int], params: SamplingParams) -> list[int]:
        """The prompt's token ids, or ValueError naming what makes this request unservable."""
        return self.admission.validate(prompt, params, self.max_model_len)

    def add_request(self, request_id: str | None, prompt: str | Seq[int] | dict, params: SamplingParams | None = None,
                    arrival_time: float | None = None, prefill_only: bool = False,
                    prompt_text: str | None = None, lora_request: LoRARequest | None = None,
                    cache_salt: str | None = None, priority: int = 0) -> str:
        """Validate and queue a request (n sequences); raises ValueError on bad input, changing nothing.
        prefill_only (disaggregated prefill): each sequence stops after its first token and, unless that token
        finished it, keeps its blocks under a KV handle (`handoff`) for a decode worker to fetch. prompt_text:
        the outputs' prompt for token ids encoded elsewhere (a rendered chat prompt). lora_request: the adapter
        to run with (read now; needs enable_lora). cache_salt: its blocks are shared only with requests of the same
        salt (vLLM's). priority: with scheduling_policy "priority", lower values are admitted first (and preempted
        last); with "fcfs" it must be 0. The prompt may be one of vLLM's dict prompts (``nvllm.prompt_inputs``)."""
        if isinstance(prompt, dict):
            cache_salt = cache_salt or cache_salt_of(prompt)
            prompt = prompt_of(prompt)
        params = params or SamplingParams()
        self.scheduler.check_priority(priority)
        request_id = request_id or self.new_request_id()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.validate(prompt, params)
        seqs = self._new_request(request_id, ids, params, RequestMetrics(arrival_time=arrival_time or time.time()),
                                 lora_request, cache_salt)
        self.prompts[request_id] = prompt if isinstance(prompt, str) else prompt_text
        self.scheduler.place_in_line(seqs, priority)
        for seq in seqs:
            seq.prefill_only = prefill_only
            self.scheduler.add(seq)
        return request_id

    def load_lora(self, lora_request: LoRARequest | None) -> bytes | None:
        """Read and check the adapter (``LoraAdapters.load``): ValueError if LoRA is off or the checkpoint bad."""
        return self.loras.load(lora_request)

    def unload_lora(self, lora_id: int) -> bool:
        """Forget an adapter (``LoraAdapters.unload``): False while sequences still run with it."""
        return self.loras.unload(lora_id)

    def _new_request(self, request_id: str, ids: list[int], params: SamplingParams,
                     metrics: RequestMetrics, lora_request: LoRARequest | None = None,
                     cache_salt: str | None = None) -> list[Sequence]:
        digest = self.load_lora(lora_request)  # first: a bad adapter is a ValueError with nothing registered
        lora_id = lora_request.lora_int_id if lora_request is not None else 0
        seqs = self.admission.sequences(request_id, ids, params, metrics, digest, lora_id, cache_salt)
        self.requests[request_id] = seqs
        return seqs

    def abort_request(self, request_id: str | Seq[str]) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output (finish_reason "abort"). Several ids
        (vLLM's list) abort each; None is returned then."""
        if not isinstance(request_id, str):
            for one in request_id:
                self.abort_request(one)
            return None
        seqs = self.requests.get(request_id)
        if seqs is None:
            return None
        for seq in seqs:
            if not seq.finished:
                seq.finish_reason = "abort"
                self._finish(seq)
        if self._inflight is not None and all(seq.finished for seq in self._inflight.pending.owners):
            self._inflight = None  # no one left to read it for (a failed generate aborts all): nothing is unfinished
        return self._pop_output(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or self._inflight is not None

    def close(self) -> None:
        """Stop the workers and free the device memory of the target's and the draft's runner (idempotent)."""
        self.runner.shutdown()
        if self.spec is not None and self.spec.draft_runner is not None:
            self.spec.draft_runner.shutdown()

    # ---- the step ------------------------------------------------------------------------------------
    def step(self, partial: bool = True) -> list[RequestOutput]:
        """One scheduling + model step. Returns an output for every request that progressed, or with
        partial=False only for the requests that finished (offline callers skip building the rest).

        With asynchronous scheduling a step's sampled tokens stay on the device: the next call schedules and
        launches the following step (its inputs take those tokens on the device) and only then reads them and
        does their bookkeeping, while the GPU runs. A sequence that turns out to have finished on the token
        read late had one more position computed for nothing; one certain to finish (its length limit) is held
        out of the step. A step with a constrained sequence reads the step before once its own forward is queued,
        before sampling: the grammar mask needs that token."""
        self.loras.unload_idle()
        if self.spec is not None:
            self.spec.begin_step(len(self.scheduler.running))
            sched = self.scheduler.schedule()
            self.stats.num_preemptions = self.scheduler.num_preemptions
            return self._step_speculative(sched.scheduled, partial) if sched.scheduled else []
        prev = self._inflight
        sched = self.scheduler.schedule(self._finishes_pending if prev is not None else None)
        self.stats.num_preemptions = self.scheduler.num_preemptions
        touched: dict[str, None] = {}
        if not sched.scheduled:
            if prev is None:
                return []
            self._read_inflight(touched)
            return self._finish_step(touched, partial)
        t0 = time.perf_counter()
        scheduled = sched.scheduled
        prompt_chunks = [n for seq, n in scheduled if seq.num_computed_tokens < seq.num_prompt_tokens]
        self._mark_scheduled(scheduled)

        # a constrained sequence's mask (a bad word's too) needs its token still in flight: that step is read once
        # this one's forward is queued (the device runs it meanwhile), and the rows are made after
        late = prev is not None and any(seq.grammar is not None or seq.bad_words for seq, _ in scheduled)
        sampling = [seq for seq, n in scheduled if ModelRunner.needs_sample(seq, n)]

        def sample_rows() -> list[SampleRow]:
            if late:
                self._read_inflight(touched)
            return [self._sample_row(seq) for seq in sampling]

        defer = self.async_scheduling and not any(
            seq.params.logprobs is not None or seq.wants_prompt_logprobs or seq.prefill_only for seq, _ in scheduled)
        result = self.runner.execute(scheduled, sample_rows if late else sample_rows(),
                                     prev_tokens=prev.tokens if prev is not None else None, defer=defer)
        now = time.time()
        for seq, n in scheduled:
            if not seq.finished:  # (one can be: by the step before, read late)
                seq.num_computed_tokens += n  # in the cache, or on their way (launched asynchronously)
        # this step's placeholders go in before the previous step's tokens are read (unless read already): a
        # sequence those finish drops both at once
        launched = InflightStep(scheduled, result.pending) if result.pending is not None else None
        if self._inflight is not None:
            self._read_inflight(touched)
        self._inflight = launched
        if launched is None:
            for seq, n in scheduled:
                if not seq.finished:
                    touched[seq.request_id] = None
                    self._advance(seq, result, now)
        self.step_profile.record(step_kind(len(prompt_chunks), len(scheduled) - len(prompt_chunks)),
                                 time.perf_counter() - t0, sum(prompt_chunks))
        return self._finish_step(touched, partial)

    def _finishes_pending(self, seq: Sequence) -> bool:
        """A sequence whose pending token ends it whatever its value: not scheduled again (nothing past its end
        may be computed: the position could be past the model's and the cache's length)."""
        if not seq.pending:
            return False
        p = seq.params
        return (seq.prefill_only or seq.num_tokens >= self.max_model_len
                or (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens))

    def _read_inflight(self, touched: dict[str, None]) -> None:
        """Wait for the launched step's tokens and do what step() does for a step's results."""
        inflight, self._inflight = self._inflight, None
        filled = inflight.read()
        now = time.time()
        for seq, _ in inflight.scheduled:
            if not seq.finished:
                touched[seq.request_id] = None
                self.block_manager.register_full_blocks(seq)
        for seq, length, tok in filled:
            if not seq.finished:
                self._on_token(seq, tok, None, now, length)

    def _advance(self, seq: Sequence, result, now: float) -> None:
        """Bookkeeping for one computed chunk (its cache count already advanced): prefix-cache hashes, prompt
        logprobs, and the sampled token when the chunk reached the sequence's end."""
        self.block_manager.register_full_blocks(seq)
        for pos, tok, (lp, rank, top) in result.prompt_logprobs.get(id(seq), []):
            if pos == len(seq.prompt_logprobs):
                seq.prompt_logprobs.append(self.outputs.logprob_dict(tok, lp, rank, top))
        if id(seq) in result.sampled:
            tok, lp_info = result.sampled[id(seq)]
            self._append_token(seq, tok, lp_info, now)

    def _step_speculative(self, scheduled: list[tuple[Sequence, int]], partial: bool) -> list[RequestOutput]:
        """step() with speculative decoding: draft, verify every drafted chunk in the one target pass, then
        append the emitted tokens one by one through the usual bookkeeping (a stop inside an accepted run
        ends it there) and roll back what was not kept: the computed count, the draft's count, the blocks.
        A draft model's tokens reach the target's inputs on the device; the host reads them once the target's
        forward is queued."""
        self._mark_scheduled(scheduled)
        scheduled, drafts = self.spec.propose(scheduled)
        rows = [self._sample_row(seq) for seq, n in scheduled if ModelRunner.needs_sample(seq, n)]
        result = self.runner.execute(scheduled, rows, drafts.ids(), prev_tokens=drafts.tokens)
        proposals = drafts.proposals
        verified = {}
        if proposals:
            drafts.read()
            entries = [(seq, proposals[id(seq)]) for seq, _ in scheduled if id(seq) in proposals]
            for (seq, _), v in zip(entries, self.spec.verify(result.verify_logits, entries)):
                verified[id(seq)] = v
        now = time.time()
        touched: dict[str, None] = {}
        bm = self.block_manager
        for seq, n in scheduled:
            touched[seq.request_id] = None
            v = verified.get(id(seq))
            if v is None:
                seq.num_computed_tokens += n
                self._advance(seq, result, now)
            else:
                drafted, accepted = len(proposals[id(seq)].ids), v.accepted
                for kept, (tok, lp_info) in enumerate(zip(v.token_ids, v.logprobs), 1):
                    seq.num_computed_tokens = seq.num_tokens  # the K/V of every token before it are verified
                    waited = seq.grammar_waits
                    self._append_token(seq, tok, lp_info, now)
                    if seq.finished:
                        break
                    if waited != seq.grammar_waits:  # a constraint begins: the rest is drawn again, not accepted
                        accepted = min(accepted, kept)
                        break
                self.stats.spec.record(drafted, accepted)
                if not seq.finished:
                    bm.register_full_blocks(seq)
                    self.spec.after_verify(seq, drafted, accepted)
            if not seq.finished:
                bm.trim(seq)
        return self._finish_step(touched, partial)

    def _finish_step(self, touched: dict[str, None], partial: bool) -> list[RequestOutput]:
        outputs = [self.output(rid) for rid in touched
                   if partial or all(s.finished for s in self.requests[rid])]
        s = self.stats
        s.num_steps += 1
        s.num_running, s.num_waiting = len(self.scheduler.running), self.scheduler.num_waiting
        s.kv_cache_usage = self.block_manager.usage
        s.prefix_queries, s.prefix_hits = self.block_manager.prefix_queries, self.block_manager.prefix_hits
        self.stat_logger.maybe_log(s)
        return outputs

    @staticmethod
    def _mark_scheduled(scheduled: list[tuple[Sequence, int]]) -> None:
        """A sequence's first scheduling time, taken before its step runs: its queue time ends there (as vLLM
        stamps it), and its prefill's compute counts after it."""
        now = time.time()
        for seq, _ in scheduled:
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now

    def _sample_row(self, seq: Sequence) -> SampleRow:
        """What the sampler needs of the sequence; a penalized one's tokens as they are now, the newest maybe still
        a placeholder of the step in flight (the sampler takes it from that step's tokens on the device)."""
        p = seq.params
        banned = self._banned(seq) + (bad_word_bans(seq.bad_words, seq.output_token_ids) if seq.bad_words else [])
        return SampleRow(p, seq.generator, banned, seq.token_ids if p.penalized else None, seq.num_prompt_tokens,
                         None if seq.grammar_waits or seq.finished else seq.grammar, p.allowed_token_ids)

    def _banned(self, seq: Sequence) -> list[int]:
        """The end tokens and the stop ids while min_tokens is not reached."""
        if seq.num_output_tokens >= seq.params.min_tokens:
            return []
        return min_tokens_banned(seq, self.eos_token_ids)

    def _append_token(self, seq: Sequence, tok: int, lp_info, now: float) -> None:
        """lp_info: the sampler's (logprob, rank, top-N), or a ready logprobs dict (a prefill worker's)."""
        seq.token_ids.append(tok)
        self._on_token(seq, tok, lp_info, now, seq.num_tokens - seq.pending)

    def _on_token(self, seq: Sequence, tok: int, lp_info, now: float, length: int) -> None:
        """A new token is known; ``length``: the sequence's tokens up to and including it. Metrics, logprobs,
        text, and the finish checks."""
        self.stats.generation_tokens += 1
        # the prompt counts at the first token; a decode worker counts it once the prompt's KV is placed (kv_handoff)
        if length == seq.num_prompt_tokens + 1 and seq.status is not Status.RECEIVING:
            self.stats.count_prompt(seq.num_prompt_tokens, seq.num_cached_tokens)
        if seq.metrics.first_token_time is None:
            seq.metrics.first_token_time = now
        seq.metrics.last_token_time = now
        if lp_info is not None and seq.logprobs is not None:
            d = lp_info if isinstance(lp_info, dict) else self.outputs.logprob_dict(tok, *lp_info)
            seq.cumulative_logprob += d[tok].logprob
            seq.logprobs.append(d)
        fits = seq.grammar is None or seq.grammar_waits or advance_grammar(seq.grammar, tok)
        if isinstance(seq.grammar, ThinkOrConstraint):  # the reply's first token: a reasoning block, or not
            seq.grammar_waits, seq.grammar = seq.grammar.opened, seq.grammar.inner
        check_stop(seq, tok, length, self.eos_token_ids, self.max_model_len, self.tokenizer.eos_token_id)
        if seq.grammar_waits and self.reasoning.reasoning_ended(seq.text):
            seq.grammar_waits = False  # the constraint applies from the next token on
        if seq.finish_reason is None and not fits:  # the constraint is complete (or broken): nothing may follow
            seq.finish_reason = "stop"
        if seq.finish_reason is not None:
            self._finish(seq)
        elif seq.prefill_only:  # disaggregated prefill: done here; a decode worker fetches the KV
            self.handoff.hold(seq)

    def _finish(self, seq: Sequence) -> None:
        """Out of the scheduler, blocks freed (a step still running that wrote to them comes first on the
        stream), placeholders of tokens that will not be read dropped."""
        seq.drop_pending()
        self.scheduler.finish(seq)

    # ---- disaggregated prefill / decode (nvllm.disagg calls these on the engine thread) ---------------
    def export_kv(self, handle: str) -> list[int]:
        """Prefill side: the blocks of a held sequence's prompt, for a transfer that then releases them."""
        return self.handoff.export(handle)

    def release_kv(self, handle: str) -> bool:
        return self.handoff.release(handle)

    def add_prefilled_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                              arrival_time: float, samples: list[PrefilledSample],
                              prompt_logprobs: list[LogprobsDict | None] | None = None,
                              lora_request: LoRARequest | None = None,
                              cache_salt: str | None = None, priority: int = 0) -> list[KVTarget]:
        """Decode side: a request whose prompt a prefill worker computed (see KVHandoff.add_prefilled)."""
        self.scheduler.check_priority(priority)
        return self.handoff.add_prefilled(request_id, prompt_ids, params, arrival_time, samples, prompt_logprobs,
                                          lora_request, cache_salt, priority)

    # ---- outputs -------------------------------------------------------------------------------------
    def output(self, request_id: str) -> RequestOutput:
        """The request's output now (popped when every sequence has finished)."""
        seqs = self.requests[request_id]
        if all(s.finished for s in seqs):
            return self._pop_output(request_id)
        return self.outputs.build(request_id, seqs, self.prompts.get(request_id))

    def _pop_output(self, request_id: str) -> RequestOutput:
        seqs = self.requests.pop(request_id)
        out = self.outputs.build(request_id, seqs, self.prompts.pop(request_id, None))
        out.metrics.finished_time = time.time()
        return out
