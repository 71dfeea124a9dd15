"""``nvllm quantize --method fp8``: a 16/32-bit checkpoint's decoder linears rounded to FP8 (e4m3) and written as the
checkpoints vLLM, transformers and nvllm read (``nvllm.quant.fp8``). No calibration data: each weight takes the
nearest e4m3 code of its block's scale, ``amax / 448``.

Formats (``--format``):
  ``fp8`` (the default): ``quant_method: fp8``. Blocks of ``group_size`` × ``group_size`` (default 128, as
      Qwen3-*-FP8 and DeepSeek-V3) with ``weight_scale_inv``, which vLLM, transformers and nvllm read; vLLM needs
      every linear's sizes (per tensor-parallel rank) to be whole blocks, and the summary says when they are not.
      ``--group-size -1``: one scale per tensor, ``weight_scale`` — vLLM's own FP8 export, which vLLM and nvllm
      read; transformers reads per-tensor scales only as ``weight_scale_inv`` (for a checkpoint transformers also
      reads, write compressed-tensors).
  ``compressed-tensors``: llm-compressor's FP8_BLOCK (blocks) or, with ``--group-size -1``, FP8_DYNAMIC (a scale per
      output channel), ``float-quantized``.
Embeddings, norms and the LM head keep the checkpoint's dtype. The summary's table gives each linear's relative
weight error ``‖Ŵ − W‖² / ‖W‖²`` (there are no calibration tokens to measure outputs on).
"""

from __future__ import annotations

import re
import time

import torch

from nvllm.quant.compressed_tensors import fp8_quantization_config as ct_fp8_config
from nvllm.quant.fp8 import Fp8Scheme, dequantize_rows, quantize_blocks, quantize_rows, scale_rows
from nvllm.quant.plan import FUSED_MODULES, LM_HEAD
from nvllm.quant.sequential import LayerReport

PROJ = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight$")
FUSED_OF = {shard: fused for fused, (_, shards) in FUSED_MODULES.items() for shard in shards}


def quantization_config(fmt: str, block: int | None) -> dict:
    if fmt == "compressed-tensors":
        return ct_fp8_config(block, [LM_HEAD])
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
            "weight_block_size": None if block is None else [block, block],
            "ignored_layers": [LM_HEAD], "modules_to_not_convert": [LM_HEAD]}


def quantize_weight(w: torch.Tensor, fmt: str, block: int | None) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One linear's checkpoint tensors in ``fmt`` and its dequantized weight (for the error)."""
    out_f, in_f = w.shape
    if block is not None:
        q, s = quantize_blocks(w, (block, block))
        rows = scale_rows(s, Fp8Scheme("block", (block, block)), out_f, in_f, "scale")
        back = dequantize_rows(q, rows, block)
        return {"weight": q, "weight_scale" if fmt == "compressed-tensors" else "weight_scale_inv": s}, back
    if fmt == "compressed-tensors":      # a scale per output channel
        q, s = quantize_rows(w)
        return {"weight": q, "weight_scale": s}, dequantize_rows(q, s, in_f)
    q, s = quantize_rows(w.reshape(1, -1))   # one scale for the tensor
    return {"weight": q.reshape(out_f, in_f), "weight_scale": s.reshape(())}, q.float().reshape(out_f, in_f) * s


def quantize_fp8(model_dir: str, out_dir: str, cfg, summary, num_layers: int, overwrite: bool, device: torch.device,
                 progress=None, on_start=None):
    """Write ``model_dir`` with FP8 decoder linears into ``out_dir``; fills and returns ``summary``
    (a ``QuantizeSummary``)."""
    from nvllm.models.loader import iterate_weights
    from nvllm.quant.writer import CheckpointOutput, weights_bytes

    t0 = time.perf_counter()
    block = None if cfg.group_size == -1 else cfg.group_size
    fmt = cfg.writes
    summary.calibration = "none (FP8 needs no calibration data)"
    if on_start:
        on_start(summary, num_layers)
    reports = {i: LayerReport(i) for i in range(num_layers)}
    sums: dict[tuple[int, str], list[float]] = {}
    shapes: dict[str, tuple[int, int]] = {}   # q, k, …: the [out, in] of each kind of linear
    # the output is written as the tensors come: one shard in memory at a time
    with CheckpointOutput(model_dir, out_dir, overwrite, cfg.max_shard_size) as out:
        for name, w in iterate_weights(model_dir, "safetensors", False):
            m = PROJ.match(name)
            if m is None:
                out.add({name: w})
                continue
            layer, fused = int(m.group(1)), FUSED_OF[f"{m.group(3)}_proj"]
            shapes[m.group(3)] = tuple(w.shape)
            if progress:
                progress(layer, fused.removesuffix("_proj"))
            start = time.perf_counter()
            wd = w.to(device, torch.float32)
            parts, back = quantize_weight(wd, fmt, block)
            stem = name.removesuffix(".weight")
            out.add({f"{stem}.{leaf}": t.cpu() for leaf, t in parts.items()})
            err, norm = sums.setdefault((layer, fused), [0.0, 0.0])
            sums[(layer, fused)] = [err + float((back - wd).pow(2).sum()), norm + float(wd.pow(2).sum())]
            reports[layer].seconds += time.perf_counter() - start
        if progress:
            progress(num_layers, "writing")
        summary.size_after = out.finish(quantization_config(fmt, block))
    for (layer, fused), (err, norm) in sums.items():
        reports[layer].errors[fused] = err / max(norm, 1e-30)
    for rep in reports.values():
        err = sum(sums[(rep.index, f)][0] for f in rep.errors)
        rep.layer_error = err / max(sum(sums[(rep.index, f)][1] for f in rep.errors), 1e-30)
    summary.layers = [reports[i] for i in range(num_layers)]
    if block is not None:
        ragged = sorted({f"{m}_proj {tuple(shape)}" for m, shape in shapes.items() if any(d % block for d in shape)})
        if ragged:
            summary.notes.append(f"vLLM loads FP8 blocks only where a linear's sizes are whole {block}-blocks "
                                 f"(per tensor-parallel rank); not so for {', '.join(ragged)}: nvllm serves this "
                                 f"checkpoint, vLLM will refuse it (--group-size -1 or a smaller block would do)")
    summary.size_before = weights_bytes(model_dir)
    summary.seconds = time.perf_counter() - t0
    return summary
