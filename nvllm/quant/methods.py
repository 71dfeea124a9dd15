"""The per-layer step of each method: RTN, GPTQ and AWQ, driven by ``sequential.py``.

A method names its ``stages`` (which linears' inputs are collected together, in forward order) and quantizes
one stage given the input statistics of its linears (named as ``layer_linears`` names them). Quantizing replaces
each linear's weight by its dequantized value (so the rest of the layer and the next layers see the quantized model)
and returns the integer form the writer packs, with the linear's relative output error on its calibration inputs.
``group_size`` is the scheme's (-1: one group over a linear's whole input).

A linear no calibration token reached (an expert the router never picked) is rounded to nearest by every method
(under AWQ after the scales its group shares, with no clipping), and its error is NaN (nothing was measured).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from nvllm.quant.awq import AWQOptions, apply_scales, scale_groups, search_clip, search_scales
from nvllm.quant.formats import GroupQuant
from nvllm.quant.gptq import gptq_quantize
from nvllm.quant.layer_linears import linear_at
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

    def pop_hessian(self) -> torch.Tensor:
        """``hessian`` made in place of ``Σ x xᵀ`` (no second [in, in] copy); the stats take no more inputs."""
        self.xtx.mul_(2.0 / max(self.count, 1))
        h, self.xtx = self.xtx, None
        return h

    @property
    def mean_abs(self) -> torch.Tensor:
        return self.abs_sum / max(self.count, 1)


@dataclass
class LinearResult:
    quant: GroupQuant
    error: float          # relative output error on the calibration inputs (NaN: no calibration token)
    tokens: int = 0       # calibration tokens the linear saw


def group_for(group_size: int, in_features: int) -> int:
    return in_features if group_size == -1 else group_size


def quantize_linear(linear, stats: InputStats, quantize: Callable[[torch.Tensor], GroupQuant],
                    h: torch.Tensor | None = None) -> LinearResult:
    """Quantize one linear's float32 weight with `quantize`, put the dequantized weight back in place (the rest
    of the layer then sees the quantized model) and measure the output error under the input statistics H
    (``h``, else the stats' own)."""
    before = linear.weight.float().clone()
    gq = quantize(before)
    deq = gq.dequantize().to(before.device)
    err = relative_error(before, deq, stats.hessian if h is None else h) if stats.count else float("nan")
    linear.weight.copy_(deq.to(linear.weight.dtype))
    return LinearResult(gq, err, stats.count)


class RTNMethod:
    stages = (("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),)   # inputs only measure the error
    calibrates_on_quantized = True

    def __init__(self, grid: Grid, group_size: int):
        self.grid, self.group_size = grid, group_size

    def rtn(self, w: torch.Tensor) -> GroupQuant:
        return rtn_quantize(w, self.grid, group_for(self.group_size, w.shape[1]))

    @torch.no_grad()
    def quantize_stage(self, layer, names, stats: dict[str, InputStats]) -> dict[str, LinearResult]:
        return {n: quantize_linear(linear_at(layer, n), stats[n], self.rtn) for n in names}


class GPTQMethod(RTNMethod):
    # true-sequential: each stage's inputs come from the layer with the earlier stages already quantized
    stages = (("qkv_proj",), ("o_proj",), ("gate_up_proj",), ("down_proj",))
    calibrates_on_quantized = True   # the next layer's inputs too come from the quantized layers (GPTQ's order)

    def __init__(self, grid: Grid, group_size: int, damp: float = 0.01, block_size: int = 128,
                 act_order: bool = False, static_groups: bool = True):
        super().__init__(grid, group_size)
        self.kw = dict(damp=damp, block_size=block_size, act_order=act_order, static_groups=static_groups)

    @torch.no_grad()
    def quantize_stage(self, layer, names, stats: dict[str, InputStats]) -> dict[str, LinearResult]:
        out = {}
        for n in names:
            h = stats[n].hessian

            def gptq(w, h=h):
                return gptq_quantize(w, h, self.grid, group_for(self.group_size, w.shape[1]), **self.kw)

            out[n] = quantize_linear(linear_at(layer, n), stats[n], gptq if stats[n].count else self.rtn)
        return out


class AWQMethod:
    """All four linears' inputs come from one pass of the full-precision layer; scales are searched for every
    group first, then folded, then each linear is clipped and rounded (the order AutoAWQ uses). The next layer's
    inputs are the full-precision layer's outputs, as in AutoAWQ: the whole model is calibrated on full-precision
    activations."""

    stages = (("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),)
    calibrates_on_quantized = False

    def __init__(self, grid: Grid, group_size: int, opts: AWQOptions = AWQOptions()):
        if grid.bits != 4 or grid.sym:
            raise ValueError("AWQ quantizes to asymmetric 4-bit (AWQ-GEMM)")
        self.grid, self.group_size, self.opts = grid, group_size, opts

    @torch.no_grad()
    def quantize_stage(self, layer, names, stats: dict[str, InputStats]) -> dict[str, LinearResult]:
        hess = {n: stats[n].pop_hessian() for n in names}
        groups = scale_groups(layer, names)
        found = []
        for g in groups:
            ws = [linear_at(layer, n).weight.float() for n in g.linears]
            # several linears (a mixture's experts): each loss weighted by its tokens, as the sum of every token's
            # error; the mean |x| of all their tokens (each token counted once per expert it reaches)
            counts = [float(stats[n].count) for n in g.linears]
            x_mean = sum(stats[n].abs_sum for n in g.linears) / max(sum(counts), 1)
            found.append(search_scales(ws, [hess[n] for n in g.linears], x_mean,
                                       group_for(self.group_size, ws[0].shape[1]), self.opts, counts))
        for g, s in zip(groups, found):
            apply_scales(layer, g, s.to(linear_at(layer, g.linear).weight.dtype))
            for n in g.linears:
                hess[n] = hess[n] / (s.unsqueeze(0) * s.unsqueeze(1))     # H of x / s
        out = {}
        s_ = layer.s
        for name in names:
            rows = slice(None)
            if name == "qkv_proj":   # clip only the v rows
                rows = slice((s_.num_heads + s_.num_kv_heads) * s_.head_dim, None)

            def clip_and_round(w, name=name, rows=rows):
                g = group_for(self.group_size, w.shape[1])
                clipped = search_clip(w, hess[name], g, self.opts, rows) if self.opts.clip else w
                return rtn_quantize(clipped, self.grid, g)

            out[name] = quantize_linear(linear_at(layer, name), stats[name], clip_and_round, hess[name])
        return out
