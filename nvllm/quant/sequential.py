"""Layer-by-layer quantization over the engine's own model classes.

1. The calibration windows are embedded: the inputs of decoder layer 0 for every sample.
2. For each layer in turn, a float32 working copy goes to the compute device (only this layer is there), and
   for each of the method's stages (e.g. q/k/v → o → gate/up → down) the windows are replayed through it
   (``replay.layer_forward``) to collect the inputs of that stage's linears, which the method then quantizes
   in place — later stages see the already-quantized earlier ones. In a mixture of experts a stage's linears are
   every expert's (each calibrated on the tokens routed to it) and the shared expert's (``layer_linears``); an
   expert that no calibration token reaches is rounded to nearest, and the summary says which.
3. The quantized layer is replayed once more: its outputs are the next layer's inputs, and comparing them
   with a full-precision copy of the layer gives the layer's relative output error (on the first
   ``ERROR_WINDOWS`` windows: the diagnostic does not need a second full replay of every window). A method
   whose ``calibrates_on_quantized`` is false (AWQ, as AutoAWQ does it) takes the full-precision copy's outputs
   as the next layer's inputs instead: every layer is then calibrated on the full-precision model's activations.
4. The working copy (quantized weights dequantized, plus whatever the method folded into norms or dense
   linears) is written back into the CPU layer, which then holds the layer as it will be served, and the layer
   is handed over with its linears' integer forms (``PartHooks.done``: ``nvllm quantize`` writes it out and frees
   it, having read it from the checkpoint only when its turn came).
5. With ``head``, the LM head is quantized last: its inputs are the last layer's outputs (those of the
   quantized model, or of the full-precision one as in 3.) through the model's final norm, and the method
   quantizes it as one more linear (for GPTQ its Hessian comes from these inputs; groups split the hidden size,
   its input).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from nvllm.quant.formats import GroupQuant
from nvllm.quant.layer_linears import linear_at, stage_linears
from nvllm.quant.methods import InputStats, LinearResult
from nvllm.quant.plan import LM_HEAD
from nvllm.quant.replay import ORDER, layer_forward, stage_of


@dataclass
class LayerReport:
    index: int
    errors: dict[str, float | None] = field(default_factory=dict)  # per linear; None: kept in full precision
    layer_error: float = 0.0        # ‖y_q − y‖² / ‖y‖² of the layer's output, same inputs
    seconds: float = 0.0
    unreached: list[int] = field(default_factory=list)  # experts no calibration token was routed to

    def stage_error(self, stage: str) -> float | None:
        """The error of a stage's linear, or the mean over a mixture's experts (and shared expert) that calibration
        tokens reached; None when the stage stays in full precision."""
        values = [v for n, v in self.errors.items() if stage_of(n) == stage and v is not None]
        reached = [v for v in values if v == v]     # NaN: a linear no calibration token reached
        if not values:
            return None
        return sum(reached) / len(reached) if reached else float("nan")


Progress = Callable[[int, str], None]
CALIB_BATCH = 8  # calibration windows a layer replays at once
ERROR_WINDOWS = 16
"""Calibration windows the per-layer output error is measured on (at least: whole batches of windows). A
full-precision replay of all 128 windows of a 7B layer cost ~3 s of its ~19 s on an H200 (run Q)."""


def _to_host(gq: GroupQuant) -> GroupQuant:
    """The integer form kept until the writer packs it: on the CPU, codes as uint8 (a quarter of int32)."""
    return GroupQuant(q=gq.q.to(torch.uint8).cpu(), scales=gq.scales.cpu(), zeros=gq.zeros.cpu(),
                      g_idx=gq.g_idx.cpu(), bits=gq.bits, group_size=gq.group_size)


def _collect(layer, xs: list[torch.Tensor], positions: torch.Tensor, names: list[str],
             device: torch.device) -> dict[str, InputStats]:
    """Replay every window up to the last stage of ``names`` and accumulate those linears' input statistics."""
    stats = {n: InputStats(linear_at(layer, n).in_features, device) for n in names}

    def tap(name: str, inp: torch.Tensor) -> None:
        if name in stats:
            stats[name].add(inp)

    last = max((stage_of(n) for n in names), key=ORDER.index)
    for x in xs:
        layer_forward(layer, x, positions, tap=tap, stop_after=last)
    return stats


def _chunks(ids: torch.Tensor, batch: int) -> list[torch.Tensor]:
    return [ids[i:i + batch] for i in range(0, ids.shape[0], batch)]


@dataclass
class PartHooks:
    """What ``quantize_layers`` calls around each part of the model it reads: "embed_tokens", "layers.{i}" in turn,
    then "norm" and "lm_head" when the head is quantized. ``load(part)`` before the part is read; ``done(part,
    results)`` once it is final, with its quantized linears' results (``{"layers.{i}.{linear}": LinearResult}``;
    the part is not read again). ``nvllm quantize`` reads each part from the checkpoint and writes it out as soon as
    it is done (``lazy_model``, ``writer.CheckpointOutput``)."""

    load: Callable[[str], None]
    done: Callable[[str, dict[str, LinearResult]], None]


@torch.no_grad()
def quantize_layers(model, calib_ids: torch.Tensor, method, quantized: dict[int, set[str]], device: torch.device,
                    batch: int = CALIB_BATCH, progress: Progress | None = None, head: bool = False,
                    hooks: PartHooks | None = None) -> tuple[dict[str, LinearResult], list[LayerReport]]:
    """Quantize ``model`` (a CPU ``LlamaForCausalLM``) in place, layer by layer. ``quantized[i]`` names the units
    of layer i to quantize (``layer_linears``; the others stay in full precision); ``head``: the LM head too.
    Returns ``{"layers.{i}.{linear}": LinearResult}`` (and ``{"lm_head": …}``) — those not handed to
    ``hooks.done`` (without hooks the model is whole in memory and every result is returned) — and one report per
    layer."""
    results: dict[str, LinearResult] = {}
    hooks = hooks or PartHooks(lambda part: None, lambda part, res: results.update(res))
    positions = torch.arange(calib_ids.shape[1], device=device)
    hooks.load("embed_tokens")
    embed = model.embed_tokens.weight
    xs = [embed[ids.to(embed.device)].to(device, torch.float32) for ids in _chunks(calib_ids, batch)]
    del embed
    hooks.done("embed_tokens", {})
    reports = []
    for i, layer in enumerate(model.layers):
        t0 = time.perf_counter()
        hooks.load(f"layers.{i}")
        work = copy.deepcopy(layer).to(device=device, dtype=torch.float32)
        ref = copy.deepcopy(work)
        targets = quantized.get(i, set())
        rep = LayerReport(i, {name: None for name in (ORDER if layer.moe is None else ORDER[:2])})
        layer_results: dict[str, LinearResult] = {}
        for stage in method.stages:
            names = [n for st in stage for n in stage_linears(work, st, targets)]
            if not names:
                continue
            if progress:
                progress(i, "+".join(dict.fromkeys(stage_of(n).removesuffix("_proj") for n in names)))
            stats = _collect(work, xs, positions, names, device)
            for name, res in method.quantize_stage(work, names, stats).items():
                layer_results[f"layers.{i}.{name}"] = LinearResult(_to_host(res.quant), res.error, res.tokens)
                rep.errors[name] = res.error
                if res.tokens == 0 and name.startswith("moe.experts.") and stage_of(name) == "gate_up_proj":
                    rep.unreached.append(int(name.split(".")[2]))
        if progress:
            progress(i, "outputs")
        num = den = 0.0
        seen = 0
        on_quantized = method.calibrates_on_quantized
        for k, x in enumerate(xs):
            measure = seen < ERROR_WINDOWS
            y = layer_forward(work, x, positions) if measure or on_quantized else None
            y_ref = layer_forward(ref, x, positions) if measure or not on_quantized else None
            if measure:
                num += float((y - y_ref).pow(2).sum())
                den += float(y_ref.pow(2).sum())
                seen += x.shape[0]
            xs[k] = y if on_quantized else y_ref
        rep.layer_error = num / max(den, 1e-30)
        layer.load_state_dict(work.state_dict())     # copied back in the model's dtype, on the CPU
        del work, ref
        hooks.done(f"layers.{i}", layer_results)
        rep.seconds = time.perf_counter() - t0
        reports.append(rep)
    if head:
        if progress:
            progress(len(model.layers), LM_HEAD)
        hooks.load("norm")
        hooks.load(LM_HEAD)
        res = _quantize_head(model, xs, method, device)
        hooks.done("norm", {})
        hooks.done(LM_HEAD, {LM_HEAD: res})
    return results, reports


def _quantize_head(model, xs: list[torch.Tensor], method, device: torch.device) -> LinearResult:
    """The LM head, quantized as one more linear on the final-norm outputs of the (quantized) last layer; its
    dequantized weight is written back into the model."""
    norm = copy.deepcopy(model.norm).to(device=device, dtype=torch.float32)
    w = model.lm_head.weight
    work = SimpleNamespace(**{LM_HEAD: SimpleNamespace(weight=w.detach().to(device, torch.float32).clone())})
    stats = InputStats(w.shape[1], device)
    for x in xs:
        stats.add(norm(x.reshape(-1, x.shape[-1])))
    res = method.quantize_stage(work, [LM_HEAD], {LM_HEAD: stats})[LM_HEAD]
    w.data.copy_(getattr(work, LM_HEAD).weight.to(w.device, w.dtype))
    return LinearResult(_to_host(res.quant), res.error, res.tokens)
