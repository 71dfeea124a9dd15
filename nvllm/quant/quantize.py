"""``nvllm quantize``: a full-precision HF directory in, a quantized one out (AWQ-GEMM, GPTQ v1, compressed-tensors;
FP8 through ``fp8_export``).

Checks every input before the long work starts (output directory, model, settings against the model's
shapes, calibration data, every checkpoint tensor against the model), quantizes it layer by layer
(``sequential.py``) reading each part of the model from the checkpoint only when its turn comes
(``lazy_model.py``), writes each part out as soon as it is final (``writer.py``: one shard in memory at a time)
and returns a ``QuantizeSummary``.

Linears whose shapes the scheme cannot store (a group size that does not divide the input size, an output
size that is not a whole number of packed words) stay in full precision: listed in the checkpoint's config
(AWQ: ``modules_to_not_convert``; GPTQ: ``dynamic`` ``-:`` entries, as GPTQModel writes for vLLM, and the
block's quantized modules in ``modules_in_block_to_quantize``, which transformers and optimum read) and in the
summary. A group size that fits none of the model's linears is an error.

A mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE) is planned per unit as the loader reads it back: attention's
linears, a layer's experts as a whole (every expert's gate, up and down; ``mlp.experts`` in the exclusions), Qwen2-MoE's
shared expert; the routers are never quantized. FP8 of a mixture is refused (FP8 experts are not served).

``quantize_lm_head`` (GPTQ / RTN, GPTQModel's ``lm_head=True``) quantizes the LM head as well, after the last
layer, and writes it like any GPTQ linear (``lm_head.qweight`` / ``qzeros`` / ``scales`` / ``g_idx``) with
``"lm_head": true`` in ``quantization_config``. A model with tied embeddings, or a head the scheme cannot
pack, is an error (the user asked for the head, so it is not silently kept).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field

import torch

from nvllm.config import ConfigError, resolve_device
from nvllm.models.hub import resolve_model_path
from nvllm.quant.awq import AWQOptions
from nvllm.quant.calibration import calibration_windows, load_texts
from nvllm.quant.quant_config import awq_quantization_config, gptq_quantization_config
from nvllm.quant.methods import AWQMethod, GPTQMethod, RTNMethod
from nvllm.quant.compressed_tensors import quantization_config as ct_quantization_config
from nvllm.quant.plan import (LM_HEAD, QuantScheme, head_problem, quantizable_units, read_quantization_config,
                              routers)
from nvllm.quant.recipe import QuantizeConfig
from nvllm.quant.rtn import Grid
from nvllm.quant.lazy_model import LazyModel
from nvllm.quant.sequential import CALIB_BATCH, LayerReport, PartHooks, Progress, quantize_layers
from nvllm.quant.writer import CheckpointOutput, check_not_source, check_out_dir, checkpoint_tensors, weights_bytes


class QuantizeError(ValueError):
    """A user mistake found before or while quantizing (one clear line)."""


@dataclass
class QuantizeSummary:
    config: QuantizeConfig
    out_dir: str
    size_before: int = 0
    size_after: int = 0
    kept: dict[str, str] = field(default_factory=dict)     # "mlp.down_proj" → why it stays in full precision
    layers: list[LayerReport] = field(default_factory=list)
    calibration: str = ""
    tokens: int = 0
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    head_error: float | None = None     # the LM head's relative output error when it was quantized (else None)
    head_size_before: int = 0           # its bytes in the source checkpoint's dtype
    head_size_after: int = 0            # its packed tensors' bytes


def _check_model(model_dir: str):
    from nvllm.models.llama import ModelShape
    from nvllm.models.loader import load_hf_config, safetensors_files
    from nvllm.models.registry import resolve_architecture

    hf_config = load_hf_config(model_dir)
    existing = read_quantization_config(model_dir, hf_config)
    if existing is not None:
        method = existing.get("quant_method", "unknown") if isinstance(existing, dict) else "unknown"
        raise QuantizeError(f"{model_dir} is already quantized ({method}); quantize the full-precision model")
    if not safetensors_files(model_dir):
        raise QuantizeError(f"no safetensors weights in {model_dir} (nvllm quantize reads safetensors checkpoints)")
    arch, _ = resolve_architecture(hf_config)
    shape = ModelShape(hf_config, arch)
    return hf_config, arch, shape


@dataclass(frozen=True)
class KeptUnit:
    """A unit every layer (every sparse layer, for experts) keeps in full precision, as the configs name it."""

    label: str                  # in the summary: "mlp.gate_proj/mlp.up_proj", "mlp.experts"
    names: tuple[str, ...]      # module names inside a layer that designate it (substrings for AWQ)
    pattern: str                # a regex of the module names (configs anchor it after a "." and at the end)
    why: str


def plan_units(shape, scheme: QuantScheme) -> tuple[dict[int, set[str]], list[KeptUnit]]:
    """({layer: its units to quantize}, what stays in full precision): ``plan.quantizable_units`` (units as
    ``layer_linears`` names them), each kept when the scheme cannot pack one of its linears."""
    units: dict[int, set[str]] = {i: set() for i in range(shape.num_layers)}
    kept: dict[str, KeptUnit] = {}
    for key, names, sizes in quantizable_units(shape):
        _, layer, unit = key.split(".", 2)
        problem = next((p for in_f, outs in sizes if (p := scheme.packing_problem(in_f, outs))), None)
        if problem is None:
            units[int(layer)].add(unit)
            continue
        inside = [n.split(".", 3)[3] for n in names]        # "model.layers.{i}.mlp.gate_proj" → "mlp.gate_proj"
        if unit == "experts":
            block = inside[0].split(".experts.")[0]
            k = KeptUnit(f"{block}.experts", (f"{block}.experts",), re.escape(f"{block}.experts") + r"(\.\d+\.\w+)?",
                         problem)
        else:   # the HF shards and, for a fused one, the fused name vLLM uses (mlp.gate_up_proj)
            fused = f"{inside[0].rsplit('.', 1)[0]}.{unit.rsplit('.', 1)[-1]}"
            designators = tuple(inside) + ((fused,) if len(inside) > 1 else ())
            k = KeptUnit("/".join(inside), designators, "|".join(re.escape(n) for n in designators), problem)
        kept.setdefault(k.label, k)
    if not any(units.values()):
        ins = sorted({in_f for _, _, sizes in quantizable_units(shape) for in_f, _ in sizes})
        raise QuantizeError(f"group size {scheme.group_size} fits none of the model's linears (input sizes "
                            f"{', '.join(map(str, ins))}; {next(iter(kept.values())).why}); choose a group size "
                            f"that divides the hidden size {shape.hidden_size}, e.g. --group-size "
                            f"{_suggest_group(shape.hidden_size)}")
    return units, list(kept.values())


def _suggest_group(hidden: int) -> int:
    return next(g for g in (128, 64, 32, 16, 8) if hidden % g == 0) if hidden % 8 == 0 else -1


def build_method(cfg: QuantizeConfig):
    # GPTQ v1 cannot store a zero point of 0 (it stores zero - 1); the other formats can
    grid = Grid(cfg.bits, bool(cfg.sym), zero_min=0 if cfg.writes != "gptq" or cfg.sym else 1)
    if cfg.method == "awq":
        return AWQMethod(grid, cfg.group_size, AWQOptions(cfg.n_grid, cfg.duo_scaling, cfg.clip, cfg.max_shrink))
    if cfg.method == "gptq":
        # static groups matter only with act-order (AutoGPTQ's default without it: groups found as they come)
        return GPTQMethod(grid, cfg.group_size, cfg.damp_percent, cfg.block_size, cfg.desc_act,
                          cfg.desc_act and cfg.static_groups)
    return RTNMethod(grid, cfg.group_size)


def block_modules(shape, units: dict[int, set[str]]) -> list[list[str]]:
    """The quantized modules of the decoder layers by their names within a layer (``self_attn.q_proj``), grouped as
    GPTQModel lists them (a fused linear's shards together; every expert's gate and up, then every expert's down),
    each group once, in model order: ``modules_in_block_to_quantize``."""
    groups: list[list[str]] = []
    for key, names, _ in quantizable_units(shape):
        _, layer, unit = key.split(".", 2)
        if unit not in units[int(layer)]:
            continue
        inside = [n.split(".", 3)[3] for n in names]   # "model.layers.{i}.mlp.gate_proj" → "mlp.gate_proj"
        parts = [[n for j, n in enumerate(inside) if j % 3 != 2], inside[2::3]] if unit == "experts" else [inside]
        groups += [g for g in parts if g not in groups]
    return groups


def awq_not_converted(shape, kept: list[KeptUnit]) -> list[str] | None:
    """AWQ's ``modules_to_not_convert``: what the plan keeps, and a mixture's routers (AutoAWQ and transformers'
    AWQ loader replace every linear of a layer this list does not name, a router included). The list matches
    substrings, so a router is named ``mlp.gate`` only where no quantizable module's name contains that (a dense
    layer's ``mlp.gate_proj`` does): otherwise layer by layer, ``layers.{i}.mlp.gate``."""
    names = [n for k in kept for n in k.names]
    inside = {n.split(".", 3)[3] for _, unit_names, _ in quantizable_units(shape) for n in unit_names}
    full = routers(shape)                                   # "model.layers.{i}.mlp.gate"
    for r in dict.fromkeys(r.split(".", 3)[3] for r in full):
        if not any(r in n for n in inside):
            names.append(r)
        else:
            names += [f.split(".", 1)[1] for f in full if f.endswith(f".{r}")]
    return names or None


def quantization_config(cfg: QuantizeConfig, out_dir: str, units: dict[int, set[str]], kept: list[KeptUnit],
                        shape) -> dict:
    """``quantization_config`` as AutoAWQ / AutoGPTQ / llm-compressor write it, plus what stays in full precision:
    AWQ's ``modules_to_not_convert`` (substrings of module names, a mixture's routers among them), GPTQ's
    ``dynamic`` ``-:REGEX`` exclusions (GPTQModel's per-module override, which vLLM reads) and, when a layer keeps
    something in full precision — a dense model's unpackable linear, a mixture's routers —,
    ``modules_in_block_to_quantize`` (the modules of a decoder layer that are quantized, what transformers /
    optimum convert; without it they convert every linear of the layer), compressed-tensors' ``ignore`` (which
    names a mixture's routers too: that format quantizes every linear it does not ignore)."""
    if cfg.writes == "awq":
        return awq_quantization_config(cfg.group_size, 4, True, awq_not_converted(shape, kept))
    if cfg.writes == "compressed-tensors":  # every layer's kept modules by name, and the head unless quantized
        ignore = [] if cfg.quantize_lm_head else [LM_HEAD]
        ignore += [f"re:.*\\.({k.pattern})$" for k in kept]
        ignore += sorted({f"re:.*\\.{re.escape(r.split('.', 3)[3])}$" for r in routers(shape)})
        return ct_quantization_config(cfg.bits, cfg.group_size, bool(cfg.sym),
                                      "weight" if cfg.desc_act else None, ignore)
    qc = gptq_quantization_config(cfg.bits, cfg.group_size, cfg.desc_act, bool(cfg.sym), cfg.damp_percent,
                                  cfg.static_groups if cfg.desc_act else False, True, out_dir, "model")
    if cfg.quantize_lm_head:
        qc["lm_head"] = True          # GPTQModel's key; vLLM's GPTQ config reads it (lm_head_quantized)
    if kept:
        qc["dynamic"] = {f"-:.*\\.({k.pattern})$": {} for k in kept}
    if kept or shape.moe is not None:
        qc["modules_in_block_to_quantize"] = block_modules(shape, units)
        if cfg.quantize_lm_head:  # vLLM quantizes only the modules this list names once it is given, head too
            qc["modules_in_block_to_quantize"].append([LM_HEAD])
    return qc


def quantize_model(model_dir: str, out_dir: str, cfg: QuantizeConfig, overwrite: bool = False,
                   progress: Progress | None = None, on_start=None, revision: str | None = None) -> QuantizeSummary:
    """Quantize ``model_dir`` (a directory, or a Hub id at ``revision``) into ``out_dir``. ``on_start(summary,
    num_layers)`` is called once every check has passed (before the model loads); ``progress(layer, stage)`` as
    layers advance."""
    from nvllm.engine.tokenizer import load_tokenizer
    from nvllm.models.loader import checkpoint_dtype, model_len_limit

    t0 = time.perf_counter()
    local = os.path.isdir(model_dir)
    check_out_dir(out_dir, overwrite, model_dir if local else None)   # before a Hub id's download
    if not local:
        model_dir = resolve_model_path(model_dir, revision)  # fetched when the network allows
        check_not_source(out_dir, model_dir)
    hf_config, arch, shape = _check_model(model_dir)
    device = torch.device(resolve_device(cfg.device))
    if cfg.method == "fp8":   # no calibration, no layer-by-layer replay: nvllm.quant.fp8_export
        from nvllm.quant.fp8_export import quantize_fp8

        if shape.moe is not None:
            raise QuantizeError(f"{model_dir} is a mixture of experts ({arch}): nvllm serves FP8 dense models only, "
                                "so --method fp8 is refused for it; use gptq, awq or rtn")

        largest = max(shape.hidden_size, shape.intermediate_size, shape.num_heads * shape.head_dim)
        if cfg.group_size > largest:  # every weight would be padded to one block of it (8192² for each linear)
            raise QuantizeError(f"--group-size {cfg.group_size}: FP8 blocks of {cfg.group_size} × {cfg.group_size} "
                                f"are larger than every linear of the model (at most {largest} wide)")
        return quantize_fp8(model_dir, out_dir, cfg, QuantizeSummary(cfg, out_dir), shape.num_layers, overwrite,
                            device, progress, on_start)
    scheme = QuantScheme(cfg.format, cfg.bits, cfg.group_size)
    units, kept = plan_units(shape, scheme)
    if cfg.quantize_lm_head:
        problem = head_problem(shape, scheme)
        if problem:
            raise QuantizeError(f"--quantize-lm-head: {problem}")
    summary = QuantizeSummary(cfg, out_dir, kept={k.label: k.why for k in kept})

    seqlen, limit = cfg.calib_seqlen, model_len_limit(hf_config, warn=False)
    if seqlen > limit:
        what = "max_position_embeddings" if limit == shape.max_position else "context length"
        summary.notes.append(f"--calib-seqlen {seqlen} exceeds the model's {what} {limit}: windows of {limit} "
                             "tokens used")
        seqlen = limit
    check_activation_memory(cfg.calib_samples, seqlen, shape.hidden_size, device)
    tokenizer = load_tokenizer(model_dir)
    texts, summary.calibration = load_texts(cfg.calib_dataset, cfg.calib_split, cfg.calib_column,
                                             cfg.calib_config)
    ids = calibration_windows(tokenizer, texts, cfg.calib_samples, seqlen, cfg.seed, summary.notes)
    summary.tokens = ids.numel()
    if on_start:
        on_start(summary, shape.num_layers)

    dtype = checkpoint_dtype(hf_config) or torch.float32
    model = LazyModel(model_dir, hf_config, dtype)      # a part at a time in memory, read when its turn comes
    if cfg.quantize_lm_head:
        w = model.model.lm_head.weight
        summary.head_size_before = w.numel() * w.element_size()
    qc = quantization_config(cfg, out_dir, units, kept, shape)
    # GPTQModel reads quantize_config.json, its ``dynamic`` exclusions included (they name what stays dense)
    extra = {"quantize_config.json": dict(qc)} if cfg.writes == "gptq" else None
    written: set[str] = set()
    with CheckpointOutput(model_dir, out_dir, overwrite, cfg.max_shard_size) as out:
        def done(part: str, results: dict) -> None:
            """A part is final: its tensors (packed where quantized) go to the output, its memory is freed."""
            tensors = checkpoint_tensors(model.model, model.parts[part], {k: r.quant for k, r in results.items()},
                                         cfg.writes, bool(cfg.sym))
            if LM_HEAD in results:
                summary.head_error = results[LM_HEAD].error
                summary.head_size_after = sum(t.numel() * t.element_size() for t in tensors.values())
            out.add(tensors)
            model.release(part)
            written.add(part)

        _, summary.layers = quantize_layers(model.model, ids, build_method(cfg), units, device, progress=progress,
                                            head=cfg.quantize_lm_head, hooks=PartHooks(model.load, done))
        for part in model.parts:        # the final norm, and the LM head unless it was quantized
            if part not in written:
                model.load(part)
                done(part, {})
        summary.size_after = out.finish(qc, extra)
    unreached = [f"layer {r.index}: {len(r.unreached)} of {shape.moe.num_experts} ({_listed_ids(r.unreached)})"
                 for r in summary.layers if r.unreached]
    if unreached:
        summary.notes.append("experts no calibration token was routed to, rounded to nearest (RTN): "
                             + "; ".join(unreached) + " — more --calib-samples reach more of them")
    summary.size_before = weights_bytes(model_dir)
    summary.seconds = time.perf_counter() - t0
    return summary


def check_activation_memory(n_samples: int, seqlen: int, hidden: int, device: torch.device) -> None:
    """The layer-by-layer pass keeps every window's hidden states (float32) on ``device``, each batch of windows
    replaced by the layer's outputs as it goes: refused before any work when that is more than the device has free,
    rather than running the machine out of memory part way through."""
    need = (n_samples + 2 * CALIB_BATCH) * seqlen * hidden * 4
    free = free_memory(device)
    if free is not None and need > free:
        raise QuantizeError(f"--calib-samples {n_samples} × --calib-seqlen {seqlen} keeps {need / 2**30:.1f} GiB of "
                            f"activations on {device}, which has {free / 2**30:.1f} GiB free: ask for fewer")


def free_memory(device: torch.device) -> int | None:
    """Bytes free on ``device``: the GPU's, or the host's available memory (None where it cannot be read)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return kb * 1024


def _listed_ids(ids: list[int]) -> str:
    return ", ".join(map(str, ids)) if len(ids) <= 8 else f"{', '.join(map(str, ids[:8]))}, …"


USER_ERRORS = (QuantizeError, ConfigError, ValueError, OSError)   # OSError: a full disk, a read-only --out, …
