"""The per-layer step of each method: RTN, GPTQ and AWQ, driven by ``sequential.py``.

A method names its ``stages`` (which linears' inputs are collected together, in forward order) and quantizes
one stage given the input statistics of its linears. Quantizing replaces each linear's weight by its
dequantized value (so the rest of the layer and the next layers see the quantized model) and returns the
integer form the writer packs, with the linear's relative output error on its calibration inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from nvllm.quant.awq import AWQOptions, apply_scales, scale_groups, search_clip, search_scales
from nvllm.quant.formats import GroupQuant
from nvllm.quant.gptq import gptq_quantize
from nvllm.quant.rtn import Grid, relative_error, rtn_quantize


class InputStats:
    """Running statistics of one linear's calibration inputs: ``Σ x xᵀ``, ``Σ |x|`` and the token count."""

    def __init__(self, in_features: int, device: torch.device):
        self.xtx = torch.zeros(in_features, in_features, device=device)
        self.abs_sum = torch.zeros(in_features, device=device)
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        self.xtx.addmm_(x.t(), x)
        self.abs_sum += x.abs().sum(0)
        self.count += x.shape[0]

    @property
    def hessian(self) -> torch.Tensor:
        """``H = 2/n Σ x xᵀ`` (GPTQ's convention; every use here is invariant to the constant)."""
        return self.xtx * (2.0 / max(self.count, 1))

    @property
    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / max(self.count, 1)


@dataclass
class LinearResult:
    quant: GroupQuant
    error: float          # relative output error on the calibration inputs


def quantize_linear(linear, h: torch.Tensor, quantize: Callable[[torch.Tensor], GroupQuant]) -> LinearResult:
    """Quantize one linear's float32 weight with `quantize`, put the dequantized weight back in place (the rest
    of the layer then sees the quantized model) and measure the output error under the input statistics H."""
    before = linear.weight.float().clone()
    gq = quantize(before)
    deq = gq.dequantize().to(before.device)
    err = relative_error(before, deq, h)
    linear.weight.copy_(deq.to(linear.weight.dtype))
    return LinearResult(gq, err)


class RTNMethod:
    stages = (("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),)   # inputs only measure the error
    calibrates_on_quantized = True

    def __init__(self, grid: Grid, group_sizes: dict[str, int]):
        self.grid, self.group_sizes = grid, group_sizes

    @torch.no_grad()
    def quantize_stage(self, layer, names, stats: dict[str, InputStats]) -> dict[str, LinearResult]:
        return {n: quantize_linear(getattr(layer, n), stats[n].hessian,
                                   lambda w, n=n: rtn_quantize(w, self.grid, self.group_sizes[n])) for n in names}


class GPTQMethod:
    # true-sequential: each stage's inputs come from the layer with the earlier stages already quantized
    stages = (("qkv_proj",), ("o_proj",), ("gate_up_proj",), ("down_proj",))
    calibrates_on_quantized = True   # the next layer's inputs too come from the quantized layers (GPTQ's order)

    def __init__(self, grid: Grid, group_sizes: dict[str, int], damp: float = 0.01, block_size: int = 128,
                 act_order: bool = False, static_groups: bool = True):
        self.grid, self.group_sizes = grid, group_sizes
        self.kw = dict(damp=damp, block_size=block_size, act_order=act_order, static_groups=static_groups)

    @torch.no_grad()
    def quantize_stage(self, layer, names, stats: dict[str, InputStats]) -> dict[str, LinearResult]:
        out = {}
        for n in names:
            h = stats[n].hessian
            out[n] = quantize_linear(getattr(layer, n), h,
                                     lambda w, n=n, h=h: gptq_quantize(w, h, self.grid, self.group_sizes[n], **self.kw))
        return out


class AWQMethod:
    """All four linears' inputs come from one pass of the full-precision layer; scales are searched for every
    group first, then folded, then each linear is clipped and rounded (the order AutoAWQ uses). The next layer's
    inputs are the full-precision layer's outputs, as in AutoAWQ: the whole model is calibrated on full-precision
    activations."""

    stages = (("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),)
    calibrates_on_quantized = False

    def __init__(self, grid: Grid, group_sizes: dict[str, int], opts: AWQOptions = AWQOptions()):
        if grid.bits != 4 or grid.sym:
            raise ValueError("AWQ quantizes to asymmetric 4-bit (AWQ-GEMM)")
        self.grid, self.group_sizes, self.opts = grid, group_sizes, opts

    @torch.no_grad()
    def quantize_stage(self, layer, names, stats: dict[str, InputStats]) -> dict[str, LinearResult]:
        hess = {n: stats[n].hessian for n in names}
        groups = scale_groups(layer, set(names))
        found = {g.linear: search_scales(getattr(layer, g.linear).weight.float(), hess[g.linear],
                                         stats[g.linear].mean_abs, self.group_sizes[g.linear], self.opts)
                 for g in groups}
        for g in groups:
            s = found[g.linear]
            apply_scales(layer, g, s.to(getattr(layer, g.linear).weight.dtype))
            hess[g.linear] = hess[g.linear] / (s.unsqueeze(0) * s.unsqueeze(1))     # H of x / s
        out = {}
        s_ = layer.s
        for name in names:
            g = self.group_sizes[name]
            rows = slice(None)
            if name == "qkv_proj":   # clip only the v rows
                rows = slice((s_.num_heads + s_.num_kv_heads) * s_.head_dim, None)

            def clip_and_round(w, name=name, g=g, rows=rows):
                clipped = search_clip(w, hess[name], g, self.opts, rows) if self.opts.clip else w
                return rtn_quantize(clipped, self.grid, g)

            out[name] = quantize_linear(getattr(layer, name), hess[name], clip_and_round)
        return out
