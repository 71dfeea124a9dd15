"""A PEFT LoRA checkpoint read for the engine's linears: ``adapter_config.json`` and ``adapter_model.safetensors``
(tensors ``base_model.model.<module>.lora_A.weight`` [r, in] and ``.lora_B.weight`` [out, r]), as PEFT writes them.

The model fuses q/k/v and gate/up into one linear each; their adapters are fused the same way: the A matrices
stacked ([Σr, in]) and the B matrices placed block-diagonally ([out, Σr], each at its projection's output rows), so
one pair of matmuls serves the fused layer. The scale (``lora_alpha / r``, or ``/ √r`` with rsLoRA) is folded into
B. Adapters of the embeddings or the LM head, DoRA and trained biases are refused by name, as is a rank above
``max_lora_rank``."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from nvllm.config import ConfigError

_PREFIX = "base_model.model."
# <module>.lora_A.weight, or <module>.lora_A.<adapter name>.weight
_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<kind>[AB])(?:\.[^.]+)?\.weight")


@dataclass
class LoRAWeights:
    a: torch.Tensor  # [Σr, in]
    b: torch.Tensor  # [out, Σr], scaled


def read_adapter_config(path: str) -> dict:
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isdir(path):
        raise ConfigError(f"LoRA adapter {path} is not a directory")
    if not os.path.isfile(cfg_path):
        raise ConfigError(f"LoRA adapter {path} has no adapter_config.json")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read {cfg_path}: {e}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{cfg_path} must hold a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise ConfigError(f"{cfg_path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, why in (("use_dora", "DoRA adapters"), ("modules_to_save", "adapters that retrain whole modules"),
                     ("rank_pattern", "per-module ranks (rank_pattern)"),
                     ("alpha_pattern", "per-module alphas (alpha_pattern)")):
        if cfg.get(key):
            raise ConfigError(f"{cfg_path}: {why} are not supported")
    if cfg.get("bias", "none") != "none":
        raise ConfigError(f"{cfg_path}: adapters with trained biases (bias={cfg['bias']!r}) are not supported")
    if not isinstance(cfg.get("r"), int) or isinstance(cfg["r"], bool) or cfg["r"] < 1:
        raise ConfigError(f"{cfg_path}: r must be a positive integer")
    alpha = cfg.setdefault("lora_alpha", 8)  # PEFT's default
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ConfigError(f"{cfg_path}: lora_alpha must be a number, got {alpha!r}")
    return cfg


def load_adapter(path: str, model, dtype: torch.dtype, device: torch.device, max_rank: int,
                 allow_pickle: bool = False) -> dict[str, LoRAWeights]:
    """The adapter's fused weights for each linear it touches: module name (``layers.3.qkv_proj``) → weights."""
    cfg = read_adapter_config(path)
    r = cfg["r"]
    if r > max_rank:
        raise ConfigError(f"LoRA adapter {path} has rank {r}, above max_lora_rank {max_rank} (raise "
                          "--max-lora-rank)")
    scale = cfg["lora_alpha"] / (math.sqrt(r) if cfg.get("use_rslora") else r)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _tensors(path, allow_pickle).items():
        if "lm_head" in key or "embed_tokens" in key:
            raise ConfigError(f"LoRA adapter {path}: {key} — LoRA on embeddings and the LM head is not supported")
        m = _KEY.fullmatch(key.removeprefix(_PREFIX))
        if m is None:
            raise ConfigError(f"LoRA adapter {path}: unexpected tensor {key!r}")
        if tensor.dim() != 2 or tensor.shape[0 if m["kind"] == "A" else 1] != r:
            raise ConfigError(f"LoRA adapter {path}: {key} has shape {tuple(tensor.shape)}, not of rank r={r}")
        pairs.setdefault(m["module"], {})[m["kind"]] = tensor
    parts: dict[str, list[tuple[int | None, torch.Tensor, torch.Tensor]]] = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ConfigError(f"LoRA adapter {path}: {module} lacks its lora_{'B' if 'A' in ab else 'A'} tensor")
        target = model.param_for(module + ".weight")
        if target is None or not _is_layer_linear(target[0], len(model.layers)):
            layer = re.search(r"layers\.(\d+)\.", module)
            if layer is not None and int(layer[1]) >= len(model.layers):
                raise ConfigError(f"LoRA adapter {path}: {module} is in layer {layer[1]}, and the model has "
                                  f"{len(model.layers)} layers (an adapter of another model?)")
            raise ConfigError(f"LoRA adapter {path}: {module} is not a decoder linear (LoRA on embeddings and the "
                              "LM head is not supported)")
        name, shard = target
        parts.setdefault(name.removesuffix(".weight"), []).append((shard, ab["A"], ab["B"]))
    if not parts:
        raise ConfigError(f"LoRA adapter {path} holds no LoRA tensors")
    return {name: _fuse(model.get_submodule(name), shards, scale, dtype, device, path)
            for name, shards in parts.items()}


def _is_layer_linear(pname: str, num_layers: int) -> bool:
    parts = pname.split(".")
    return (len(parts) == 4 and parts[0] == "layers" and parts[1].isdigit() and int(parts[1]) < num_layers
            and parts[2] in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))


def _tensors(path: str, allow_pickle: bool) -> dict[str, torch.Tensor]:
    st, pt = os.path.join(path, "adapter_model.safetensors"), os.path.join(path, "adapter_model.bin")
    if os.path.isfile(st):
        from safetensors.torch import load_file

        return load_file(st)
    if os.path.isfile(pt):
        if not allow_pickle:
            raise ConfigError(f"LoRA adapter {path} has only adapter_model.bin, a pickle that can run code: "
                              "pass --allow-pickle to load it")
        return torch.load(pt, map_location="cpu", weights_only=True)
    raise ConfigError(f"LoRA adapter {path} has no adapter_model.safetensors")


def _fuse(linear, shards, scale: float, dtype, device, path: str) -> LoRAWeights:
    """Stack the A's and place the B's of one fused linear's projections (shard None: an unfused linear). With tensor
    parallelism each rank keeps its piece: a column-parallel linear's B rows of its outputs, a row-parallel linear's
    A columns of its inputs (its partial B·A·x joins the ranks' sum of the base output)."""
    base = getattr(linear, "base", linear)
    split = base.shard  # this rank's piece of the linear; None: it is whole
    ranks = sum(a.shape[0] for _, a, _ in shards)
    a_cat = torch.zeros(ranks, base.in_features, dtype=torch.float32)
    b_cat = torch.zeros(base.out_features, ranks, dtype=torch.float32)
    col = 0
    for shard, a, b in sorted(shards, key=lambda s: -1 if s[0] is None else s[0]):
        rows = base.shard_slice(shard)
        cols = split.inputs if split is not None and split.row_parallel else None
        outs = split.outputs[shard or 0] if split is not None and not split.row_parallel else None
        want_in = cols.total if cols else base.in_features
        want_b = (outs.total if outs else rows.stop - rows.start, a.shape[0])
        if a.shape[1] != want_in or tuple(b.shape) != want_b:
            raise ConfigError(f"LoRA adapter {path}: shapes A {tuple(a.shape)}, B {tuple(b.shape)} do not fit a "
                              f"linear of {want_in} inputs and {want_b[0]} outputs")
        if cols:
            a = a.narrow(1, cols.start, cols.size)
        if outs:
            b = b.narrow(0, outs.start, outs.size)
        a_cat[col:col + a.shape[0]] = a.float()
        b_cat[rows, col:col + a.shape[0]] = b.float() * scale
        col += a.shape[0]
    return LoRAWeights(a_cat.to(device=device, dtype=dtype), b_cat.to(device=device, dtype=dtype))
