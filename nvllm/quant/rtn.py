"""Round-to-nearest group quantization: the baseline method, and the grid every other method rounds onto.

``find_params`` computes a group's scale and zero point with ``formats.group_scale_zero``, as ``quantize_rtn``
does (asym: the range widened to include 0, zero points optionally kept ≥ ``zero_min`` as GPTQ v1 needs; sym:
``2·max|w| / maxq`` around ``2^(bits-1)``; scales rounded to fp16 first, as the checkpoint stores them), so GPTQ's
column by column rounding and AWQ's searches land on the values the writer packs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nvllm.quant.formats import GroupQuant, group_scale_zero, quantize_rtn


@dataclass(frozen=True)
class Grid:
    """The integer grid of one scheme: bits, symmetric or not, and the smallest storable zero point."""

    bits: int
    sym: bool
    zero_min: int = 0

    @property
    def maxq(self) -> int:
        return 2**self.bits - 1


def find_params(w: torch.Tensor, grid: Grid, scale_dtype: torch.dtype = torch.float16
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of each group, the groups along ``w``'s last dimension: ``w [..., g]`` →
    ``(scale [...], zero [...])`` in float32 (the scale already rounded to ``scale_dtype``)."""
    scale, zero = group_scale_zero(w, grid.bits, grid.sym, grid.zero_min)
    return scale.to(scale_dtype).float(), zero


def round_to_grid(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    """Integer codes ``clamp(round(w / scale) + zero, 0, maxq)`` (float tensor of whole numbers)."""
    return torch.clamp(torch.round(w / scale) + zero, 0, maxq)


def fake_quantize(w: torch.Tensor, grid: Grid, group_size: int) -> torch.Tensor:
    """``w [out, in]`` rounded onto its group grid and dequantized (contiguous groups), in float32."""
    out_f, in_f = w.shape
    wg = w.float().reshape(out_f, in_f // group_size, group_size)
    scale, zero = find_params(wg, grid)
    q = round_to_grid(wg, scale.unsqueeze(-1), zero.unsqueeze(-1), grid.maxq)
    return ((q - zero.unsqueeze(-1)) * scale.unsqueeze(-1)).reshape(out_f, in_f)


def rtn_quantize(weight: torch.Tensor, grid: Grid, group_size: int) -> GroupQuant:
    """RTN of a float ``weight [out, in]`` into its integer form (what the writer packs)."""
    return quantize_rtn(weight, grid.bits, group_size, sym=grid.sym, zero_min=grid.zero_min)


def relative_error(weight: torch.Tensor, approx: torch.Tensor, hessian: torch.Tensor) -> float:
    """``‖(W' − W) X‖² / ‖W X‖²`` over the calibration inputs, from ``H ∝ Σ x xᵀ``: the relative error of the
    layer's output that replacing ``weight`` by ``approx`` causes."""
    d = approx.float() - weight.float()
    num = ((d @ hessian) * d).sum()
    den = ((weight.float() @ hessian) * weight.float()).sum().clamp(min=1e-30)
    return float(num / den)
