"""Rotary position embedding (the rotate-half form HF Llama/Qwen/Mistral use), with the `llama3` and `linear`
rope_scaling types. Every scaling acts on the inverse frequencies only, so it is all in the fp32 cos/sin tables:
the kernels (``apply_rotary``, and ``rope_store``, which the decoder's attention step uses to rotate q and k
fused with the KV store) just read those tables by position."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from nvllm.config import ConfigError
from nvllm.kernels.rotary import apply_rotary


def rope_parameters(hf_config) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from either the transformers 5 `rope_parameters` or the older
    `rope_theta` + `rope_scaling` attributes."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        theta = _theta(params.get("rope_theta", getattr(hf_config, "rope_theta", None)))
        rtype = params.get("rope_type", params.get("type", "default"))
        return theta, (None if rtype == "default" else dict(params, rope_type=rtype))
    theta = _theta(getattr(hf_config, "rope_theta", None))
    scaling = getattr(hf_config, "rope_scaling", None)
    if scaling:
        rtype = scaling.get("rope_type", scaling.get("type", "default"))
        return theta, (None if rtype == "default" else dict(scaling, rope_type=rtype))
    return theta, None


def _theta(value) -> float:
    """rope_theta (10000 where a config gives none, as transformers' default)."""
    if value is None:
        return 10000.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"config.json: rope_theta must be a positive number, got {value!r}")
    return float(value)


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    rtype = scaling["rope_type"]
    if rtype == "linear":
        return inv_freq / float(scaling["factor"])
    if rtype == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ConfigError(f"rope_scaling type {rtype!r} is not supported (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None):
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        # cos/sin kept in float32: the same values HF computes, whatever the model dtype
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, H, D], k: [T, H_kv, D] → (q, k) rotated in place (same tensors, same dtype); see
        nvllm/kernels/rotary.py."""
        return apply_rotary(q, k, positions, self.cos, self.sin)
