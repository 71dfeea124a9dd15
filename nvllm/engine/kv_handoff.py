"""The engine's side of disaggregated prefill / decode: sequences whose KV leaves this engine, or arrives in it.

Prefill side: a request added with ``prefill_only`` stops after its first token. Unless that token finished it,
each sequence is *held*: it leaves the scheduler but keeps its blocks under a handle (``kv_handle_id``) until a
transfer exports them (``export``, then ``release``) or nobody asks for them in time (``expire``).

Decode side: ``add_prefilled`` registers a request whose prompt another worker computed: the first token is
appended at once and each unfinished sequence gets blocks for its prompt (sharing what the prefix cache holds)
and waits, RECEIVING, outside the scheduler while a transfer fills them; ``arrived`` then hands it to the
scheduler as if its prompt had been computed here — or, when the KV did not come, to recompute it here.

Everything here runs on the engine thread (the caller makes sure of it), like the rest of the engine — except
``export``, which a prefill worker's request handler calls directly: the held table has its own lock, and a
held sequence's block table does not change until it is released (on the engine thread).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from nvllm.engine.sequence import PrefilledSample, Sequence, Status
from nvllm.outputs import LogprobsDict, RequestMetrics
from nvllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nvllm.engine.llm_engine import LLMEngine


class KVHandoffMismatch(ValueError):
    """The prefill worker's KV is not this engine's to use (computed under another LoRA adapter): a deployment
    fault, not the request's."""


def kv_handle_id(request_id: str, index: int) -> str:
    return f"{request_id}/{index}"


@dataclass
class HeldKV:
    seq: Sequence
    since: float  # time.monotonic() of its first token
    generator_state: torch.Tensor | None  # the per-request RNG after the first draw (seeded requests)
    exported: bool = False  # a transfer took the block ids; it releases them


@dataclass
class KVTarget:
    """Where a RECEIVING sequence's prompt KV goes."""

    seq: Sequence
    skip_blocks: int  # leading prompt blocks found in this engine's prefix cache: not fetched
    block_ids: list[int] | None  # the blocks the transfer fills; None: no room, the prompt is recomputed here


class KVHandoff:
    def __init__(self, engine: "LLMEngine"):
        self.engine = engine
        self.held: dict[str, HeldKV] = {}
        self._lock = threading.Lock()  # `held` is read by export on a request handler's thread

    # ---- prefill side ----------------------------------------------------------------------------------
    def hold(self, seq: Sequence) -> None:
        self.engine.scheduler.finish(seq, free=False)
        state = seq.generator.get_state() if seq.generator is not None else None
        with self._lock:
            self.held[kv_handle_id(seq.request_id, seq.index)] = HeldKV(seq, time.monotonic(), state)

    def export(self, handle: str) -> list[int]:
        """The blocks holding the prompt's KV (any thread). KeyError when the handle is unknown: never held,
        expired, or already taken by another transfer."""
        with self._lock:
            held = self.held.get(handle)
            if held is None or held.exported:
                raise KeyError(handle)
            held.exported = True
        return list(held.seq.block_table[:-(-held.seq.num_prompt_tokens // self.engine.config.block_size)])

    def release(self, handle: str, exported: bool = True) -> bool:
        """Free a handle's blocks. exported=False leaves a handle a transfer has taken (that transfer releases
        it once its copy is made)."""
        with self._lock:
            held = self.held.get(handle)
            if held is None or (held.exported and not exported):
                return False
            del self.held[handle]
        self.engine.block_manager.free_sequence(held.seq)
        return True

    def expire(self, max_age: float) -> int:
        """Free the blocks no transfer took within max_age seconds (the router or the decode side went away)."""
        now = time.monotonic()
        with self._lock:
            stale = [h for h, held in self.held.items() if not held.exported and now - held.since > max_age]
        return sum(self.release(h, exported=False) for h in stale)

    # ---- decode side -----------------------------------------------------------------------------------
    def add_prefilled(self, request_id: str, prompt_ids: list[int], params: SamplingParams, arrival_time: float,
                      samples: list[PrefilledSample],
                      prompt_logprobs: list[LogprobsDict | None] | None = None, lora_request=None,
                      cache_salt: str | None = None, priority: int = 0) -> list[KVTarget]:
        """Register the request, append each sample's first token, and give the samples still to decode blocks
        for their prompt's KV; returns where it goes. ValueError on bad input, changing nothing."""
        e = self.engine
        if request_id in e.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = e.validate(prompt_ids, params)
        if len(samples) != params.n:
            raise ValueError(f"{len(samples)} prefilled samples for a request of n={params.n}")
        bad = [s.first_token for s in samples if not 0 <= s.first_token < e.vocab_size]
        if bad:
            raise ValueError(f"first token id {bad[0]} is outside the vocabulary (size {e.vocab_size})")
        for s in samples:  # a state the sequences' generators would refuse, refused before anything is registered
            if s.generator_state is not None and params.seed is not None:
                try:
                    torch.Generator(device=e.runner.device).set_state(s.generator_state)
                except (RuntimeError, TypeError) as err:
                    raise ValueError(f"the prefilled sample's generator state is not one this engine's generators "
                                     f"take: {str(err).splitlines()[0]}") from None
        metrics = RequestMetrics(arrival_time=arrival_time)
        metrics.first_scheduled_time = min((s.first_scheduled_time for s in samples if s.first_scheduled_time),
                                           default=None)
        seqs = e._new_request(request_id, ids, params, metrics, lora_request, cache_salt)
        if any(s.prefix_salt is not None and s.prefix_salt != (seq.cache_salt or b"") for seq, s in zip(seqs, samples)):
            del e.requests[request_id]
            name = f"LoRA adapter {lora_request.lora_name!r}" if lora_request is not None else "the base model"
            raise KVHandoffMismatch(f"the prefill worker computed this prompt's KV with other weights than this "
                                    f"worker's {name}: the workers must load the same adapter files under each name")
        e.scheduler.place_in_line(seqs, priority)
        e.prompts[request_id] = None
        now, receiving = time.time(), []
        for seq, s in zip(seqs, samples):
            seq.admitted, seq.num_cached_tokens, seq.status = True, s.num_cached_tokens, Status.RECEIVING
            if seq.generator is not None and s.generator_state is not None:
                seq.generator.set_state(s.generator_state)
            if seq.prompt_logprobs is not None and prompt_logprobs is not None:
                seq.prompt_logprobs = list(prompt_logprobs)
            e._append_token(seq, s.first_token, s.logprobs, s.first_token_time or now)  # its prompt is counted
            if not seq.finished:                                                         # once its KV is placed
                receiving.append(self._allocate(seq))
        return receiving

    def _allocate(self, seq: Sequence) -> KVTarget:
        """Blocks for the prompt, the leading ones shared from the prefix cache; with no room, the sequence is
        queued to recompute its prompt here instead."""
        bm = self.engine.block_manager
        hit = bm.allocate_cached_prefix(seq)
        if not bm.allocate_slots(seq, seq.num_prompt_tokens - hit):
            bm.free_sequence(seq)
            self.engine.stats.count_prompt(seq.num_prompt_tokens, 0)  # recomputed here
            self.engine.scheduler.add(seq)
            return KVTarget(seq, 0, None)
        seq.local_prefix_hit = hit
        return KVTarget(seq, hit // bm.block_size, seq.block_table[hit // bm.block_size:])

    def arrived(self, seq: Sequence, ok: bool) -> None:
        """After the transfer: the prompt's KV is in the sequence's blocks (ok), so it is scheduled as if
        prefilled here; or it did not come, and the prompt is recomputed here. An aborted one frees its blocks."""
        bm = self.engine.block_manager
        if seq.finished:
            bm.free_sequence(seq)
            return
        if ok:  # the prompt's KV: this worker's prefix-cache hits, the rest received
            seq.num_computed_tokens = seq.num_prompt_tokens
            bm.register_full_blocks(seq)
            hit = seq.local_prefix_hit
            self.engine.stats.count_prompt(seq.num_prompt_tokens, hit, received=seq.num_prompt_tokens - hit)
        else:
            bm.free_sequence(seq)
            self.engine.stats.count_prompt(seq.num_prompt_tokens, 0)  # recomputed here
        self.engine.scheduler.add(seq)
