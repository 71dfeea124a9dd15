"""Request arrivals: gamma-distributed gaps between sends, as vLLM's serving benchmark draws them.

A gap ~ Gamma(shape = burstiness, scale = 1 / (rate · burstiness)), so its mean is 1/rate whatever the
burstiness and its coefficient of variation is 1/sqrt(burstiness): burstiness 1 is a Poisson process,
below 1 burstier, above 1 more regular (infinite: a fixed 1/rate). `rate = inf` sends everything at once.
With `normalize` (the default, as vLLM does) the offsets are rescaled so that the last send falls exactly
at n / rate: the shape of the process is kept, and runs with different seeds offer the same mean load.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_gaps(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """n gaps in seconds; gap i is the wait before request i (the first one waits too, as in vLLM)."""
    if n < 0:
        raise ValueError("the number of requests must be non-negative")
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be positive (or inf), got {request_rate}")
    if not burstiness > 0:
        raise ValueError(f"--burstiness must be positive, got {burstiness}")
    if math.isinf(request_rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        return np.full(n, 1.0 / request_rate)
    rng = np.random.default_rng(seed)
    return rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)


def arrival_offsets(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0,
                    normalize: bool = True) -> np.ndarray:
    """Send time of each request, in seconds from the start of the run (non-decreasing)."""
    offsets = np.cumsum(arrival_gaps(n, request_rate, burstiness, seed))
    if normalize and n and offsets[-1] > 0:
        offsets *= (n / request_rate) / offsets[-1]
    return offsets


def describe(request_rate: float, burstiness: float) -> str:
    if math.isinf(request_rate):
        return "all requests at once (rate inf)"
    kind = "Poisson process" if burstiness == 1.0 else "gamma gaps"
    return f"{request_rate:g} req/s, burstiness {burstiness:g} ({kind})"
