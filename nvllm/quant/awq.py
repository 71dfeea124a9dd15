"""AWQ: activation-aware per-input-channel scaling, folded into the previous op, then a clipping search and
group-wise asymmetric INT4.

For a linear ``y = W x`` and per-input-channel scales ``s``: ``y = (W·diag(s)) (x / s)``; the ``x / s`` is
folded into whatever produces ``x`` (an RMSNorm's weight, or the output rows of the previous linear), so the
model computes the same function in full precision while the rounding of ``W·diag(s)`` protects the channels
that carry large activations. The standard groups for this decoder:

    qkv_proj  ← input_layernorm            gate_up_proj ← post_attention_layernorm
    o_proj    ← v rows of qkv_proj (only when o's input size equals v's output size, i.e. no GQA)
    down_proj ← up rows of gate_up_proj

In a mixture of experts one scale vector serves every expert's gate/up and the shared expert's (they all read the
post-attention norm), searched on their summed losses; the router and Qwen2-MoE's shared-expert gate read that norm
too and stay in full precision, so their input columns are multiplied by the same scales (the function is unchanged),
as are those of experts or a shared expert the plan keeps in full precision.
Each expert's down projection (and the shared expert's) is scaled against the up rows of its own gate/up.

Scale search: ``x̄`` = per-channel mean |x|, ``w̄`` = per-input-channel mean of |w| / (its group's max |w|);
for α on a 20-point grid (0, 0.05, …, 0.95) ``s = x̄^α / w̄^(1−α)`` (duo scaling; ``x̄^α`` without), normalised
by ``sqrt(max s · min s)``; the loss of a candidate is the linear's output error on the calibration inputs,
``tr(ΔW H ΔWᵀ)`` with ``ΔW = Q(W·s)/s − W`` and ``H = Σ x xᵀ / n`` — exactly the mean squared output error
over every calibration token, without storing them. ``s = 1`` (no scaling) is a candidate too, so the
search never does worse than plain rounding on this loss. (AutoAWQ measures the q/k/v and gate/up candidates
at the attention / MLP block output instead, which needs the stored activations and a block forward per
candidate; the linear's own output is what this implementation minimises.)
With several linears (a mixture's experts) the loss is their sum, each weighted by its token count, and ``w̄`` is
taken over all their rows (AutoAWQ concatenates them).

Clip search (after scaling): for each output row and group, the group's range is shrunk to ``(1 − i/20)·max|w|``
for i < 10 and the shrink with the least ``Δwᵀ H_gg Δw`` (the group's block of H) is kept. The q and k rows
of qkv are not clipped (attention scores are sensitive to them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nvllm.quant.layer_linears import linear_at
from nvllm.quant.rtn import Grid, fake_quantize, find_params, round_to_grid

GRID4 = Grid(bits=4, sym=False, zero_min=0)


@dataclass(frozen=True)
class AWQOptions:
    n_grid: int = 20
    duo_scaling: bool = True
    clip: bool = True
    max_shrink: float = 0.5


def _output_loss(w: torch.Tensor, approx: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    d = approx - w
    return ((d @ h) * d).sum()


@torch.no_grad()
def search_scales(w: torch.Tensor | list[torch.Tensor], h: torch.Tensor | list[torch.Tensor], x_mean: torch.Tensor,
                  group_size: int, opts: AWQOptions, weights: list[float] | None = None) -> torch.Tensor:
    """Best per-input-channel scales ``s [in]`` for ``w [out, in]`` (float32), or for several linears reading the
    same input (lists of weights and of their H, the losses summed under ``weights``: their token counts). One
    linear's temporaries at a time (a mixture's experts are not copied together)."""
    ws, hs = (w, h) if isinstance(w, list) else ([w], [h])
    weights = weights or [1.0] * len(ws)
    in_f = ws[0].shape[1]
    w_mean = sum(_relative_magnitude(wi, group_size) for wi in ws) / sum(wi.shape[0] for wi in ws)

    def loss(s: torch.Tensor | None) -> torch.Tensor:
        total = torch.zeros((), device=ws[0].device)
        for wi, hi, c in zip(ws, hs, weights):
            if c:
                approx = fake_quantize(wi, GRID4, group_size) if s is None else \
                    fake_quantize(wi * s, GRID4, group_size) / s
                total += c * _output_loss(wi, approx, hi)
        return total

    best_loss = loss(None)
    best = torch.ones(in_f, device=ws[0].device)
    for i in range(opts.n_grid):
        ratio = i / opts.n_grid
        if opts.duo_scaling:
            s = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
        else:
            s = x_mean.pow(ratio).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        s = torch.where(torch.isfinite(s), s, torch.ones_like(s))
        candidate = loss(s)
        if candidate < best_loss:
            best_loss, best = candidate, s
    return best


def _relative_magnitude(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """Σ over rows of ``|w|`` / its group's max ``|w|``, per input channel (``[in]``)."""
    out_f, in_f = w.shape
    wg = w.abs().reshape(out_f, in_f // group_size, group_size)
    return (wg / (wg.amax(dim=-1, keepdim=True) + 1e-6)).reshape(out_f, in_f).sum(0)


@torch.no_grad()
def search_clip(w: torch.Tensor, h: torch.Tensor, group_size: int, opts: AWQOptions,
                rows: slice = slice(None), row_chunk: int = 4096) -> torch.Tensor:
    """``w [out, in]`` with each (row, group) clipped to its best shrunk range; only ``rows`` are searched."""
    out_f, in_f = w.shape
    n_groups = in_f // group_size
    blocks = torch.stack([h[k * group_size:(k + 1) * group_size, k * group_size:(k + 1) * group_size]
                          for k in range(n_groups)])                                  # [G, g, g]
    result = w.clone()
    start, stop, _ = rows.indices(out_f)
    for r0 in range(start, stop, row_chunk):
        r1 = min(r0 + row_chunk, stop)
        wg = w[r0:r1].reshape(r1 - r0, n_groups, group_size)
        org_max = wg.abs().amax(dim=-1, keepdim=True)
        best_max = org_max.clone()
        best_err = torch.full(wg.shape[:2], float("inf"), device=w.device)
        for i in range(int(opts.max_shrink * opts.n_grid)):
            mx = org_max * (1 - i / opts.n_grid)
            cw = torch.maximum(torch.minimum(wg, mx), -mx)
            scale, zero = find_params(cw, GRID4)
            q = round_to_grid(cw, scale.unsqueeze(-1), zero.unsqueeze(-1), GRID4.maxq)
            d = (q - zero.unsqueeze(-1)) * scale.unsqueeze(-1) - wg                      # [R, G, g]
            err = (torch.einsum("rgi,gij->rgj", d, blocks) * d).sum(-1)                 # [R, G]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_max = torch.where(better.unsqueeze(-1), mx, best_max)
        result[r0:r1] = torch.maximum(torch.minimum(wg, best_max), -best_max).reshape(r1 - r0, in_f)
    return result


@dataclass
class ScaleGroup:
    """One AWQ group: the linears whose inputs are scaled and where the inverse scale is folded (names as
    ``layer_linears`` gives them)."""

    linears: tuple[str, ...]          # "qkv_proj" | … | every expert's "moe.experts.{e}.gate_up_proj" …
    prev: str                         # the norm or linear producing their input
    prev_rows: slice | None = None    # output rows of ``prev`` (a linear) that produce the input
    passive: tuple[str, ...] = ()     # full-precision readers of the same input (a mixture's routers)

    @property
    def linear(self) -> str:
        return self.linears[0]


def scale_groups(layer, quantized: list[str] | set[str]) -> list[ScaleGroup]:
    """The standard groups of this decoder layer whose linears are quantized (see the module docstring)."""
    s = layer.s
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    out = []
    if "qkv_proj" in quantized:
        out.append(ScaleGroup(("qkv_proj",), "input_layernorm"))
    if "o_proj" in quantized and kv == q:
        out.append(ScaleGroup(("o_proj",), "qkv_proj", slice(q + kv, q + 2 * kv)))
    if layer.moe is None:
        if "gate_up_proj" in quantized:
            out.append(ScaleGroup(("gate_up_proj",), "post_attention_layernorm"))
        if "down_proj" in quantized:
            i = s.intermediate_size
            out.append(ScaleGroup(("down_proj",), "gate_up_proj", slice(i, 2 * i)))
        return out
    gate_up = tuple(n for n in quantized if n.endswith(".gate_up_proj"))
    if gate_up:   # every other reader of the norm keeps its function: routers, a unit kept in full precision
        readers = [f"moe.experts.{e}.gate_up_proj" for e in range(layer.moe.m.num_experts)] + \
            (["moe.shared_expert_gate", "moe.shared_expert.gate_up_proj"] if layer.moe.shared_expert is not None
             else [])
        passive = ("moe.gate",) + tuple(n for n in readers if n not in gate_up)
        out.append(ScaleGroup(gate_up, "post_attention_layernorm", passive=passive))
    for down in (n for n in quantized if n.endswith(".down_proj")):
        prev = down.removesuffix("down_proj") + "gate_up_proj"
        i = linear_at(layer, down).in_features
        out.append(ScaleGroup((down,), prev, slice(i, 2 * i)))
    return out


@torch.no_grad()
def apply_scales(layer, group: ScaleGroup, s: torch.Tensor) -> None:
    """``linear.weight *= s`` (input columns) for the group's linears and passive readers; the producer of their
    input divided by ``s``."""
    for name in group.linears + group.passive:
        linear_at(layer, name).weight.mul_(s.unsqueeze(0))
    prev = linear_at(layer, group.prev)
    if group.prev_rows is None:              # an RMSNorm
        prev.weight.div_(s)
    else:                                    # a linear's output rows (and bias)
        prev.weight[group.prev_rows].div_(s.unsqueeze(1))
        if getattr(prev, "bias", None) is not None:
            prev.bias[group.prev_rows].div_(s)
