"""A Sequence is one sample of one request: its tokens, how many of them are in the KV cache, its block
table, and the state the sampler and detokenizer keep for it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from nvllm.outputs import LogprobsDict, RequestMetrics
from nvllm.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    RECEIVING = "receiving"  # decode side of disaggregation: its prompt's KV is on its way from a prefill worker
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int  # sample index within the request (n > 1)
    token_ids: list[int]  # prompt + generated
    num_prompt_tokens: int
    params: SamplingParams
    metrics: RequestMetrics
    generator: torch.Generator | None = None  # per-request RNG when a seed is given
    status: Status = Status.WAITING
    queued: bool = False  # in the scheduler's waiting queue
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens that came from the prefix cache at the first admission
    admitted: bool = False  # scheduled at least once (a preempted sequence coming back is not new)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chain hashes of the full blocks in block_table
    # the first block's hash input besides its tokens (block_manager.prefix_salt): the LoRA adapter's digest (KV
    # computed under one adapter is not another's) and the request's cache_salt; None for the base model unsalted
    cache_salt: bytes | None = None
    request_cache_salt: str | None = None  # the request's own cache_salt
    lora_id: int = 0  # the LoRA adapter this sequence runs with (0: the base model)
    priority: int = 0  # the request's (scheduling_policy priority: lower runs first)
    order: int = 0  # its place in arrival order (the engine numbers requests as they come)
    # outputs
    text: str = ""
    stop_floor: int = 0  # a stop string must end after here: the text of the first min_tokens tokens is not
    logprobs: list[LogprobsDict] | None = None
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[LogprobsDict | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    detokenizer: object = None  # IncrementalDetokenizer, set by the engine
    grammar: object = None  # structured outputs: the xgrammar matcher following the generated tokens
    grammar_waits: bool = False  # the reply is in its reasoning block (reasoning_parser): the constraint waits
    bad_words: list[list[int]] | None = None  # params.bad_words as token ids (nvllm.layers.token_masks)
    # speculative decoding
    num_draft_computed: int = 0  # tokens whose K/V are in the draft model's cache (same block table)
    spec_state: object = None  # k=auto: this request's k and acceptance window (nvllm.spec.adaptive.KState)
    # disaggregated prefill: stop after the first token and keep the blocks for a decode worker to fetch
    prefill_only: bool = False
    local_prefix_hit: int = 0  # decode side: prompt tokens this worker's prefix cache held (the rest is received)
    # asynchronous scheduling: tokens sampled on the device and not read yet, at the end of token_ids as
    # placeholders −1 − (their row in that step's sampled tokens), which the next step's inputs resolve on the
    # device
    pending: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens the host knows (pending placeholders excluded)."""
        return self.token_ids[self.num_prompt_tokens:len(self.token_ids) - self.pending]

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens, pending ones included: what the sampler's next draw counts from."""
        return len(self.token_ids) - self.num_prompt_tokens

    def drop_pending(self) -> None:
        """Forget placeholders whose tokens will never be read (the sequence finished before them)."""
        if self.pending:
            del self.token_ids[len(self.token_ids) - self.pending:]
            self.pending = 0

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and (
            self.prompt_logprobs is None or len(self.prompt_logprobs) < self.num_prompt_tokens)


@dataclass
class PrefilledSample:
    """One sample of a request whose prompt a prefill worker computed: what the decode side needs to carry on
    exactly where the prefill side stopped (the first token, its logprobs, the RNG state after drawing it)."""

    first_token: int
    logprobs: LogprobsDict | None = None  # the first token's logprobs (when the request asked for them)
    generator_state: torch.Tensor | None = None  # the per-request RNG (seeded requests) after the first draw
    num_cached_tokens: int = 0  # prompt tokens the prefill worker found in its prefix cache
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    prefix_salt: bytes | None = None  # held KV: the prefill side's Sequence.cache_salt (b"" for none); None: unchecked
