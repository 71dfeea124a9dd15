"""Inputs left unfinished for the GEMV that reads them: a split decode attention's partials (o_proj,
``attention_partials``) and a gate_up sum's SiLU·mul (down_proj, ``activation.PendingSiluMul``). Each has ``rows``
(the ``[M, K]`` tensor ``finish`` writes: shape and dtype), ``fits(rows, k_per_split)`` (whether a one-row ``half2``
GEMV with those K splits can finish it in its prologue) and ``finish()`` (its own kernel, for every other reader)."""

from __future__ import annotations

import torch

from nvllm.kernels.activation import PendingSiluMul
from nvllm.kernels.attention_partials import AttentionPartials

DEFERRED = (AttentionPartials, PendingSiluMul)


def finished_input(x) -> torch.Tensor:
    """``x`` itself, or the finished rows of a deferred input."""
    return x.finish() if isinstance(x, DEFERRED) else x
