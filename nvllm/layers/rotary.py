"""Rotary position embedding (the rotate-half form HF Llama/Qwen/Mistral use), with the `linear`, `llama3` and
`yarn` rope_scaling types. Every scaling acts on the inverse frequencies, and YaRN's attention factor on cos and
sin alike, so it is all in the fp32 cos/sin tables: the kernels (``apply_rotary``, and ``rope_store``, which the
decoder's attention step uses to rotate q and k fused with the KV store) just read those tables by position.

``context_length`` is how far a scaling stretches the model's positions, by vLLM's rule: `linear` to
max_position_embeddings × factor, `yarn` to original_max_position_embeddings × factor, `llama3` not at all (its
config already gives the stretched length)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from nvllm.config import ConfigError
from nvllm.kernels.rotary import apply_rotary


SCALING_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(hf_config) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from either the transformers 5 `rope_parameters` or the older
    `rope_theta` + `rope_scaling` attributes; the scaling checked (ConfigError) and completed as transformers
    completes it (original_max_position_embeddings from the config where the scaling gives none)."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        theta = _theta(params.get("rope_theta", getattr(hf_config, "rope_theta", None)))
        scaling = params
    else:
        theta = _theta(getattr(hf_config, "rope_theta", None))
        scaling = getattr(hf_config, "rope_scaling", None) or {}
    rtype = scaling.get("rope_type", scaling.get("type", "default"))
    if rtype == "default":  # transformers' default rotary of these architectures ignores partial_rotary_factor too
        return theta, None
    # a scaled type's frequencies would cover part of each head, which these architectures' HF code cannot run either
    partial = scaling.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", None))
    if partial is not None and partial != 1:
        raise ConfigError(f"config.json: partial_rotary_factor {partial!r} is not supported with rope_scaling "
                          f"{rtype!r} (whole heads only)")
    if rtype not in SCALING_TYPES:
        raise ConfigError(f"rope_scaling type {rtype!r} is not supported (supported: {', '.join(SCALING_TYPES)})")
    scaling = dict(scaling, rope_type=rtype)
    if rtype in ("llama3", "yarn"):
        original = getattr(hf_config, "original_max_position_embeddings", None)  # a field of its own (Phi-3's way)
        if original is not None:
            scaling["original_max_position_embeddings"] = original
        scaling.setdefault("original_max_position_embeddings", hf_config.max_position_embeddings)
        original = scaling["original_max_position_embeddings"]
        if isinstance(original, float) and original.is_integer():  # 32768.0, as transformers takes it
            scaling["original_max_position_embeddings"] = int(original)
        _positive(scaling, "original_max_position_embeddings", integer=True)
    if rtype == "yarn" and scaling.get("factor") is None:  # transformers: the stretch the config's lengths imply
        scaling["factor"] = hf_config.max_position_embeddings / scaling["original_max_position_embeddings"]
    _positive(scaling, "factor")
    for key in ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "low_freq_factor",
                "high_freq_factor"):
        if scaling.get(key) is not None:
            _positive(scaling, key)
    return theta, scaling


def _positive(scaling: dict[str, Any], key: str, integer: bool = False) -> None:
    v = scaling.get(key)
    kind = int if integer else (int, float)
    if isinstance(v, bool) or not isinstance(v, kind) or not math.isfinite(v) or v <= 0:
        what = "a positive integer" if integer else "a positive number"
        raise ConfigError(f"config.json: rope_scaling ({scaling['rope_type']}) {key} must be {what}, got {v!r}")


def context_length(max_position_embeddings: int, scaling: dict[str, Any] | None) -> int:
    """The positions the model serves under its rope scaling (vLLM's rule, see the module docstring)."""
    if scaling is None or scaling["rope_type"] == "llama3":
        return max_position_embeddings
    base = scaling["original_max_position_embeddings"] if scaling["rope_type"] == "yarn" else max_position_embeddings
    return int(base * float(scaling["factor"]))


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: YaRN's attention factor (0.1·ln(factor) + 1 unless the config gives it,
    or the ratio of its mscale terms, as transformers computes it); 1 for every other type."""
    if scaling is None or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(float(scaling["mscale"])) / mscale(float(scaling["mscale_all_dim"]))
    return mscale(1.0)


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
    if rtype == "yarn":
        return _yarn_inverse_frequencies(inv_freq, head_dim, theta, scaling)
    raise ConfigError(f"rope_scaling type {rtype!r} is not supported (supported: {', '.join(SCALING_TYPES)})")


def _yarn_inverse_frequencies(inv_freq: torch.Tensor, head_dim: int, theta: float,
                              scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): dimensions that turn fewer than beta_slow times over the original context are
    interpolated (divided by the factor), those that turn more than beta_fast times kept, a linear ramp between."""
    factor = float(scaling["factor"])
    original = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dimension that turns ``rotations`` times over the original context
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    kept = 1 - ramp  # 1: the original frequency, 0: interpolated
    return inv_freq / factor * (1 - kept) + inv_freq * kept


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None):
        """``max_position``: the config's max_position_embeddings; the tables cover ``context_length`` of it."""
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        t = torch.arange(context_length(max_position, scaling), dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        # cos/sin kept in float32: the same values HF computes, whatever the model dtype
        factor = attention_factor(scaling)
        self.register_buffer("cos", freqs.cos() * factor, persistent=False)
        self.register_buffer("sin", freqs.sin() * factor, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, H, D], k: [T, H_kv, D] → (q, k) rotated in place (same tensors, same dtype); see
        nvllm/kernels/rotary.py."""
        return apply_rotary(q, k, positions, self.cos, self.sin)
