"""The control messages of disaggregated serving, as JSON over the workers' internal HTTP endpoints. They carry
only control data — token ids, sampling state, handles, ranks; the KV itself moves over torch.distributed.

  router → prefill worker   POST /internal/prefill     PrefillCall   → PrefillResult
  router → decode worker    POST /internal/decode      DecodeCall    → the OpenAI response (JSON or SSE)
  decode → prefill worker   POST /internal/kv/send     SendCall      → SendAccepted (then the bytes follow)
  router → prefill worker   POST /internal/kv/release  ReleaseCall   (a handoff that will never be fetched)
"""

from __future__ import annotations

import base64
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from nvllm.engine.sequence import PrefilledSample
from nvllm.outputs import Logprob, LogprobsDict

Endpoint = Literal["completions", "chat"]
LogprobEntries = list[tuple[int, float, int, str | None]]  # (token, logprob, rank, decoded text)


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants")  # -inf logprobs survive the trip


class SampleHandoff(Message):
    index: int
    first_token: int
    logprobs: LogprobEntries | None = None
    generator_state: str | None = None  # base64 of the per-request RNG state after the first draw
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    handle: str | None = None  # the held KV; None when the first token finished the sample
    # held KV: hex of its sequence's prefix-cache salt (its LoRA adapter's digest and the request's cache_salt; ""
    # for none). The decode side's must be the same, or the KV was computed under another adapter than it runs
    prefix_salt: str | None = None


class RequestHandoff(Message):
    prompt_ids: list[int]
    arrival_time: float
    prompt_logprobs: list[LogprobEntries | None] | None = None
    samples: list[SampleHandoff]


class PrefillResult(Message):
    kv_rank: int
    url: str | None = None  # where the router reached the prefill worker (it fills this in)
    requests: list[RequestHandoff]

    def handles(self) -> list[str]:
        return [s.handle for r in self.requests for s in r.samples if s.handle is not None]


class PrefillCall(Message):
    endpoint: Endpoint
    request: dict
    # the router's name for this call: the prefill's engine requests are named after it, so the router can release
    # their handles (ReleaseCall.calls) when its client left before the handoff reached it
    call_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_]{1,64}$")


class DecodeCall(Message):
    endpoint: Endpoint
    request: dict
    prefill: PrefillResult


class SendCall(Message):
    handle: str
    dst_rank: int
    tag: int = Field(ge=0, le=2**31 - 1)  # the decode side's (KVReceiver): an int32, as gloo and NCCL take it
    skip_blocks: int = 0


class SendAccepted(Message):
    num_blocks: int
    nbytes: int


class ReleaseCall(Message):
    handles: list[str] = []
    calls: list[str] = []  # every handle of these prefill calls (PrefillCall.call_id)


# ---- conversions --------------------------------------------------------------------------------------------
def logprobs_to_entries(d: LogprobsDict | None) -> LogprobEntries | None:
    if d is None:
        return None
    return [(t, lp.logprob, lp.rank, lp.decoded_token) for t, lp in d.items()]


def entries_to_logprobs(entries: LogprobEntries | None) -> LogprobsDict | None:
    if entries is None:
        return None
    return {t: Logprob(lp, rank, text) for t, lp, rank, text in entries}


def encode_state(state: torch.Tensor | None) -> str | None:
    return None if state is None else base64.b64encode(state.cpu().numpy().tobytes()).decode()


def decode_state(text: str | None) -> torch.Tensor | None:
    if text is None:
        return None
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def to_sample(s: SampleHandoff) -> PrefilledSample:
    return PrefilledSample(first_token=s.first_token, logprobs=entries_to_logprobs(s.logprobs),
                           generator_state=decode_state(s.generator_state), num_cached_tokens=s.num_cached_tokens,
                           first_scheduled_time=s.first_scheduled_time, first_token_time=s.first_token_time,
                           prefix_salt=None if s.prefix_salt is None else bytes.fromhex(s.prefix_salt))
