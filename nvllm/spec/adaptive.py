"""k=auto: each request tunes its own k from a moving window of its acceptance.

After every `window` verification steps of a request, its acceptance over those steps (accepted / drafted
tokens) decides: above `raise_above` k grows by one (up to k_max), below `lower_below` it shrinks by one
(down to k_min); then the window starts afresh at the new k. Per request rather than per batch, so a request's
k (and with it the random numbers a seeded request draws) does not depend on what else is running.
"""

from __future__ import annotations

from dataclasses import dataclass

from nvllm.spec.config import MAX_K


@dataclass
class KState:
    k: int
    steps: int = 0
    drafted: int = 0
    accepted: int = 0


@dataclass
class AdaptiveK:
    start: int = 4
    k_min: int = 1
    k_max: int = MAX_K
    window: int = 4  # verification steps per decision
    raise_above: float = 0.7
    lower_below: float = 0.4

    def new_state(self) -> KState:
        return KState(max(self.k_min, min(self.start, self.k_max)))

    def update(self, state: KState, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        state.steps += 1
        state.drafted += drafted
        state.accepted += accepted
        if state.steps < self.window:
            return
        rate = state.accepted / state.drafted
        if rate > self.raise_above:
            state.k = min(state.k + 1, self.k_max)
        elif rate < self.lower_below:
            state.k = max(state.k - 1, self.k_min)
        state.steps = state.drafted = state.accepted = 0
