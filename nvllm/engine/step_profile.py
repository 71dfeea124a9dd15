"""Engine step wall times by what a step computed: only decodes, only prompt tokens, or both ("mixed").

A decode that shares its step with a prompt chunk waits for that chunk: the ratio of a mixed step's mean time to
a decode-only step's is how much prefills stretch the time per output token of the requests decoding beside
them, and the time spent on prompt chunks is the prefill share of the engine's time. Both feed the
disaggregation advisor (`nvllm bench advise`) through the server's /metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

KINDS = ("decode", "prefill", "mixed")


def step_kind(num_prompt_chunks: int, num_decodes: int) -> str:
    if num_prompt_chunks == 0:
        return "decode"
    return "prefill" if num_decodes == 0 else "mixed"


@dataclass
class StepProfile:
    steps: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    prompt_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))

    def record(self, kind: str, seconds: float, prompt_tokens: int) -> None:
        self.steps[kind] += 1
        self.seconds[kind] += seconds
        self.prompt_tokens[kind] += prompt_tokens
