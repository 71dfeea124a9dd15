"""Speculative-decoding counters, defined as vLLM reports them.

A draft is one verification of one request that had at least one drafted token; draft tokens are the tokens
verified; accepted tokens are those the rejection sampler kept (before any stop condition cut the run short).
acceptance rate = accepted / draft tokens; mean acceptance length = 1 + accepted / drafts (the tokens one
target step emits per request, the resampled or bonus token included); per-position acceptance counts how
often the i-th drafted token was accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from nvllm.spec.config import MAX_K


@dataclass
class SpecStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=lambda: [0] * MAX_K)

    def record(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    def copy(self) -> "SpecStats":
        return SpecStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                         list(self.accepted_per_pos))

    def since(self, before: "SpecStats | None") -> "SpecStats":
        if before is None or before.num_drafts > self.num_drafts:  # nothing before, or the counters were reset
            return self.copy()
        return SpecStats(self.num_drafts - before.num_drafts, self.num_draft_tokens - before.num_draft_tokens,
                         self.num_accepted_tokens - before.num_accepted_tokens,
                         [a - b for a, b in zip(self.accepted_per_pos, before.accepted_per_pos)])

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def per_position_rate(self) -> list[float]:
        """Fraction of drafts whose i-th token was accepted (positions that were ever reached)."""
        if not self.num_drafts:
            return []
        last = max((i for i, n in enumerate(self.accepted_per_pos) if n), default=-1)
        return [n / self.num_drafts for n in self.accepted_per_pos[:last + 1]]

    def as_result(self) -> dict:
        """The keys bench results carry (the same names bench serve derives from /metrics)."""
        if not self.num_drafts:
            return {}
        return {"spec_decode_acceptance_rate": 100.0 * self.acceptance_rate,
                "spec_decode_acceptance_length": self.mean_acceptance_length,
                "spec_decode_num_drafts": self.num_drafts, "spec_decode_draft_tokens": self.num_draft_tokens,
                "spec_decode_accepted_tokens": self.num_accepted_tokens,
                "spec_decode_per_position_acceptance": self.per_position_rate()}
