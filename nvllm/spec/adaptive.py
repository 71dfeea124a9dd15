"""k=auto: each request tunes its own k from a moving window of its acceptance.

After every `window` verification steps of a request, its acceptance over those steps (accepted / drafted
tokens) decides: above `raise_above` k grows by one (up to k_max), below `lower_below` it shrinks by one
(down to k_min); then the window starts afresh at the new k. Per request rather than per batch, so a request's
k (and with it the random numbers a seeded request draws) does not depend on what else is running.

A window at k_min whose acceptance stays below `off_below` pauses the request's drafting: it decodes plainly
for `pause` steps, then probes again at k_min; each probe that fails doubles the pause (up to `max_pause`), one
that succeeds resets it. A draft that never agrees with the target then costs a probe window every few hundred
tokens instead of a drafted token on every step.
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
    paused: int = 0     # decode steps left without drafts
    pause: int = 0      # the next pause's length (0: none failed yet)


@dataclass
class AdaptiveK:
    start: int = 4
    k_min: int = 1
    k_max: int = MAX_K
    window: int = 4  # verification steps per decision
    raise_above: float = 0.7
    lower_below: float = 0.4
    off_below: float = 0.1
    min_pause: int = 16
    max_pause: int = 256

    def new_state(self) -> KState:
        return KState(max(self.k_min, min(self.start, self.k_max)))

    def k_now(self, state: KState) -> int:
        """This step's k for the request (0 while paused; each call counts one paused step)."""
        if state.paused:
            state.paused -= 1
            return 0
        return state.k

    def update(self, state: KState, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        state.steps += 1
        state.drafted += drafted
        state.accepted += accepted
        if state.steps < self.window:
            return
        rate = state.accepted / state.drafted
        if state.k == self.k_min and rate < self.off_below:
            state.pause = min(max(2 * state.pause, self.min_pause), self.max_pause)
            state.paused = state.pause
        elif rate > self.raise_above:
            state.k = min(state.k + 1, self.k_max)
        elif rate < self.lower_below:
            state.k = max(state.k - 1, self.k_min)
        if rate >= self.off_below:
            state.pause = 0
        state.steps = state.drafted = state.accepted = 0
