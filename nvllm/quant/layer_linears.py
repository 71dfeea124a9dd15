"""The linears of one decoder layer as the quantizer names and reaches them.

A layer's quantized *units* are what the plan decides on (``plan.quantizable_units``, without the ``layers.{i}.``
prefix): ``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj`` in a dense layer; in a mixture of experts
``experts`` (every expert's gate/up and down) and Qwen2-MoE's ``shared_expert.gate_up_proj`` / ``.down_proj``.
A method works stage by stage (``replay.ORDER``) on the *linears* of a stage: the dense layer's own, or every
expert's ``moe.experts.{e}.gate_up_proj`` / ``.down_proj`` and the shared expert's — the names the replay's taps use.

An expert's linear is a view into the stacked weights (``w13[e]`` [2I, H], ``w2[e]`` [H, I]): writing its
``weight`` writes the expert.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

MLP_STAGES = ("gate_up_proj", "down_proj")


@dataclass
class ExpertLinear:
    """One expert's gate/up or down projection as a linear (``weight`` [out, in], a view into the stack)."""

    weight: torch.Tensor
    bias: None = None

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]


def stage_linears(layer, stage: str, units: set[str]) -> list[str]:
    """The linears of ``stage`` that ``units`` quantize in ``layer`` (in order: experts by index, then the shared
    expert)."""
    if layer.moe is None or stage not in MLP_STAGES:
        return [stage] if stage in units else []
    names = [f"moe.experts.{e}.{stage}" for e in range(layer.moe.m.num_experts)] if "experts" in units else []
    return names + ([f"moe.shared_expert.{stage}"] if f"shared_expert.{stage}" in units else [])


def linear_at(layer, name: str):
    """The linear a name designates: a module of the layer, or an expert's ``ExpertLinear``."""
    parts = name.split(".")
    if parts[:2] == ["moe", "experts"]:
        experts, e = layer.moe.experts, int(parts[2])
        return ExpertLinear(experts.w13[e] if parts[3] == "gate_up_proj" else experts.w2[e])
    return functools.reduce(getattr, parts, layer)
