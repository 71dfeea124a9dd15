"""Which decoder linears are quantized, and in what scheme: shared by the quantizer (which decides) and the
loader (which reads the decision back from a checkpoint).

The decoder fuses q/k/v and gate/up into one linear each; a checkpoint stores them as separate HF modules.
A fused module is quantized as a whole or not at all. A module stays in full precision when its shapes cannot
be packed in the scheme (a group size that does not divide its input dimension, an output size that is not a
whole number of packed words) or when the checkpoint's ``quantization_config`` excludes it
(``modules_to_not_convert``, AutoAWQ / transformers; ``ignored_layers``, FP8; ``dynamic`` with ``-:`` regexes,
GPTQModel / vLLM; ``ignore``, compressed-tensors; a decoder module ``modules_in_block_to_quantize`` leaves out,
optimum / vLLM).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from typing import Any

from nvllm.quant import compressed_tensors
from nvllm.quant.fp8 import Fp8Scheme
from nvllm.quant.quant_config import QuantConfig, parse_quantization_config

# our fused module → (HF parent module, HF modules it stands for)
FUSED_MODULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "o_proj": ("self_attn", ("o_proj",)),
    "gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
    "down_proj": ("mlp", ("down_proj",)),
}
LINEARS = tuple(FUSED_MODULES)
# the plan's key (and the HF module name) of a quantized LM head (GPTQModel's ``lm_head=True``: config key
# ``"lm_head": true``, tensors ``lm_head.qweight`` / ``qzeros`` / ``scales`` / ``g_idx``)
LM_HEAD = "lm_head"


@dataclass(frozen=True)
class QuantScheme:
    """How one linear is stored: ``fmt`` "awq" (AWQ-GEMM) or "gptq" (v1), ``bits``, ``group_size`` as written in
    the config (-1: one group spanning the whole input)."""

    fmt: str
    bits: int
    group_size: int

    def group_for(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size

    def packing_problem(self, in_features: int, output_sizes: list[int]) -> str | None:
        """Why a linear of these shapes cannot be stored in this scheme, or None when it can."""
        g = self.group_for(in_features)
        if in_features % g:
            return f"group size {g} does not divide its input size {in_features}"
        per_word = 32 // self.bits
        if self.fmt == "gptq" and in_features % per_word:
            return f"input size {in_features} is not a multiple of {per_word} ({self.bits}-bit packing)"
        pack_out = 8 if self.fmt == "awq" else per_word
        bad = [n for n in output_sizes if n % pack_out]
        if bad:
            return f"output size {bad[0]} is not a multiple of {pack_out} ({self.fmt} {self.bits}-bit packing)"
        return None


def scheme_of(cfg: QuantConfig) -> QuantScheme | Fp8Scheme:
    if cfg.fp8 is not None:
        return cfg.fp8
    return QuantScheme("awq" if cfg.packing == "awq_gemm" else "gptq", cfg.bits, cfg.group_size)


FP8_SCALE_NAMES = ("weight_scale_inv", "weight_scale")


def _stored_quantized(scheme, name: str, keys: set[str]) -> bool:
    """Whether the checkpoint stores HF module ``name`` quantized: its ``qweight`` (packed schemes) or an FP8
    weight's scale."""
    if isinstance(scheme, Fp8Scheme):
        return any(f"{name}.{leaf}" in keys for leaf in FP8_SCALE_NAMES)
    return f"{name}.qweight" in keys


def _fp8_as_stored(scheme: Fp8Scheme, names: list[str], keys: set[str]) -> Fp8Scheme:
    """The scheme with the scale name these modules' tensors use and ``static_inputs`` when they carry an
    ``input_scale``; both must be the same for every module fused together."""
    found = {leaf for n in names for leaf in FP8_SCALE_NAMES if f"{n}.{leaf}" in keys}
    if len(found) != 1:
        raise ValueError(f"{', '.join(names)} store {' and '.join(sorted(found))}: one scale name for a fused "
                         f"linear")
    inputs = {f"{n}.input_scale" in keys for n in names}
    if len(inputs) != 1:
        raise ValueError(f"only some of {', '.join(names)} store an input_scale")
    return dataclasses.replace(scheme, scale_name=found.pop(), static_inputs=inputs.pop())


def hf_module_names(layer: int, fused: str) -> list[str]:
    """The HF module names (``model.layers.{i}.mlp.gate_proj``, …) one of our fused linears stands for."""
    parent, names = FUSED_MODULES[fused]
    return [f"model.layers.{layer}.{parent}.{n}" for n in names]


def read_quantization_config(model_dir: str, hf_config=None) -> dict[str, Any] | None:
    """The raw ``quantization_config`` of a model directory: ``hf_config``'s when given (config.json's, or what
    ``--hf-overrides`` replaced it with), else config.json's, else quantize_config.json's (older AutoGPTQ
    checkpoints), else quant_config.json's (older AutoAWQ checkpoints: ``w_bit``, ``q_group_size``,
    ``zero_point``, ``version``, no ``quant_method``); None for a full-precision model."""
    raw = None
    if hf_config is not None:
        raw = getattr(hf_config, "quantization_config", None)
        if raw is not None and not isinstance(raw, dict):
            raw = raw.to_dict() if hasattr(raw, "to_dict") else None
    path = os.path.join(model_dir, "config.json")
    if raw is None and os.path.isfile(path):
        with open(path) as f:
            raw = json.load(f).get("quantization_config")
    legacy = os.path.join(model_dir, "quantize_config.json")
    if raw is None and os.path.isfile(legacy):
        with open(legacy) as f:
            raw = json.load(f)
    awq = os.path.join(model_dir, "quant_config.json")
    if raw is None and os.path.isfile(awq):
        with open(awq) as f:
            raw = json.load(f)
        if isinstance(raw, dict) and "quant_method" not in raw:
            raw = {"quant_method": "awq", **raw}
    return raw


def excluded_by_config(raw: dict[str, Any], hf_names: list[str]) -> bool:
    """True when the config keeps these modules in full precision. ``modules_to_not_convert`` (and FP8's
    ``ignored_layers``) entries match as substrings of the module name (AutoAWQ / vLLM); ``dynamic`` keys
    ``-:REGEX`` exclude what the regex matches from the start of the name (GPTQModel / vLLM); ``ignore`` entries
    are names or ``re:`` patterns (compressed-tensors); once ``modules_in_block_to_quantize`` is given, a decoder
    layer's module none of its entries names (as a substring, as vLLM reads it) stays dense. All shards of a fused
    module must agree."""
    skip = [str(m) for m in (raw.get("modules_to_not_convert") or []) + (raw.get("ignored_layers") or [])]
    negative = [k[2:] for k in (raw.get("dynamic") or {}) if str(k).startswith("-:")]
    in_block = [str(m) for g in (raw.get("modules_in_block_to_quantize") or [])
                for m in (g if isinstance(g, list) else [g])]

    def excluded(name: str) -> bool:
        return (any(m in name for m in skip) or any(re.match(p, name) for p in negative)
                or compressed_tensors.ignored(raw, name)
                or bool(in_block) and name.startswith("model.layers.") and not any(m in name for m in in_block))

    flags = {excluded(n) for n in hf_names}
    if len(flags) > 1:
        raise ValueError(f"quantization_config excludes only some of {', '.join(hf_names)}: nvllm fuses them "
                         f"into one linear, which is quantized as a whole or not at all")
    return flags.pop()


def check_dynamic_overrides(raw: dict[str, Any]) -> None:
    """GPTQModel's ``dynamic`` may give matching modules their own bits, group size, sym or desc_act (a ``+:``
    or unprefixed key). nvllm serves one setting for every quantized module: an override that changes one is
    refused by name (its tensors would otherwise fail as a shape mismatch); ``-:`` exclusions are served."""
    base = {"bits": raw.get("bits"), "group_size": raw.get("group_size"), "sym": raw.get("sym"),
            "desc_act": raw.get("desc_act")}
    for key, values in (raw.get("dynamic") or {}).items():
        if str(key).startswith("-:") or not isinstance(values, dict):
            continue
        changed = sorted(k for k, v in values.items() if k in base and v != base[k])
        if changed:
            raise ValueError(f"quantization_config 'dynamic' gives {key!r} its own {', '.join(changed)}: nvllm "
                             f"serves one setting for every quantized module (only '-:' exclusions)")


def quantizable_units(shape) -> list[tuple[str, list[str], list[tuple[int, list[int]]]]]:
    """Every unit the plan decides on, in order: (plan key, the HF modules it stands for — quantized as a whole or
    not at all —, the (in_features, output sizes) of each of its linears). A dense layer has our four fused linears;
    a sparse layer (a mixture of experts) its attention's two, ``experts`` (every expert's gate, up and down) and
    Qwen2-MoE's ``shared_expert.gate_up_proj`` / ``shared_expert.down_proj``."""
    units = []
    m = shape.moe
    for i in range(shape.num_layers):
        sparse = m is not None and i in m.sparse_layers
        for fused in LINEARS[:2] if sparse else LINEARS:
            units.append((f"layers.{i}.{fused}", hf_module_names(i, fused), [output_sizes(shape, fused)]))
        if not sparse:
            continue
        block, (gate, up, down) = m.hf_names
        h, inter = shape.hidden_size, m.intermediate_size
        units.append((f"layers.{i}.experts", [f"model.layers.{i}.{block}.experts.{e}.{p}" for e in range(m.num_experts)
                                              for p in (gate, up, down)], [(h, [inter, inter]), (inter, [h])]))
        if m.shared_part is not None:
            s, base = m.shared_intermediate_size, f"model.layers.{i}.{block}.shared_expert"
            units.append((f"layers.{i}.shared_expert.gate_up_proj", [f"{base}.gate_proj", f"{base}.up_proj"],
                          [(h, [s, s])]))
            units.append((f"layers.{i}.shared_expert.down_proj", [f"{base}.down_proj"], [(s, [h])]))
    return units


def routers(shape) -> list[str]:
    """The HF modules of the routers (and Qwen2-MoE's shared-expert gates), which stay in full precision."""
    if shape.moe is None:
        return []
    block = shape.moe.hf_names[0]
    return [f"model.layers.{i}.{block}.{g}" for i in sorted(shape.moe.sparse_layers)
            for g in (("gate", "shared_expert_gate") if shape.moe.shared_part is not None else ("gate",))]


def output_sizes(shape, fused: str) -> tuple[int, list[int]]:
    """(in_features, output shard sizes) of one of our fused linears for a ``ModelShape``."""
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    return {
        "qkv_proj": (shape.hidden_size, [q, kv, kv]),
        "o_proj": (q, [shape.hidden_size]),
        "gate_up_proj": (shape.hidden_size, [shape.intermediate_size, shape.intermediate_size]),
        "down_proj": (shape.intermediate_size, [shape.hidden_size]),
    }[fused]


def head_sizes(shape) -> tuple[int, list[int]]:
    """(in_features, [out_features]) of the LM head: hidden size in, the whole vocabulary out."""
    return shape.hidden_size, [shape.vocab_size]


def head_problem(shape, scheme: QuantScheme) -> str | None:
    """Why the LM head of this model cannot be stored quantized in ``scheme``, or None when it can."""
    if shape.tie_word_embeddings:
        return ("the model ties its word embeddings (tie_word_embeddings: true): the lm_head is the embedding "
                "matrix, which is looked up as well as multiplied and stays in full precision")
    problem = scheme.packing_problem(*head_sizes(shape))
    return None if problem is None else problem.replace("output size", "vocabulary size")


def _listed(names: list[str]) -> str:
    return ", ".join(names) if len(names) <= 4 else f"{', '.join(names[:3])}, … ({len(names)} modules)"


def serving_plan(model_dir: str, hf_config, shape, checkpoint_keys: set[str] | None
                 ) -> tuple[QuantConfig, dict[str, QuantScheme | Fp8Scheme]] | None:
    """For a quantized checkpoint: its parsed config and ``{"layers.{i}.{fused}": scheme}`` for every linear it
    stores quantized (the others load as dense), plus ``{"lm_head": scheme}`` when the LM head is quantized.
    With ``checkpoint_keys`` the tensor names decide (a module is quantized when its ``.qweight``, or for FP8 its
    scale, is there);
    without (dummy weights) the config and the packing rules do.
    None for a full-precision model. Raises ValueError for configs or checkpoints nvllm cannot serve."""
    raw = read_quantization_config(model_dir, hf_config)
    if raw is None:
        return None
    cfg = parse_quantization_config(raw)
    check_dynamic_overrides(raw)
    scheme = scheme_of(cfg)
    plan: dict[str, QuantScheme] = {}
    for key, names, sizes in quantizable_units(shape):
        layer_scheme = scheme
        problems = [p for in_f, outs in sizes if (p := scheme.packing_problem(in_f, outs))]
        if checkpoint_keys is not None:
            present = [_stored_quantized(scheme, n, checkpoint_keys) for n in names]
            if any(present) and not all(present):
                how = "stacks a layer's experts, which are" if key.endswith(".experts") else \
                    "fuses them into one linear, which is"
                raise ValueError(f"the checkpoint quantizes only some of {_listed(names)}: nvllm {how} quantized as "
                                 f"a whole or not at all")
            quantized = all(present)
            if quantized and isinstance(scheme, Fp8Scheme):
                layer_scheme = _fp8_as_stored(scheme, names, checkpoint_keys)
        else:
            quantized = not excluded_by_config(raw, names) and not problems
        if quantized:
            if problems:
                raise ValueError(f"{names[0]} cannot be served as {scheme.fmt} {scheme.bits}-bit: {problems[0]}")
            plan[key] = layer_scheme
    if checkpoint_keys is not None:
        for name in routers(shape):
            if _stored_quantized(scheme, name, checkpoint_keys):
                raise ValueError(f"the checkpoint stores the router {name} quantized: nvllm keeps routers in full "
                                 f"precision (GPTQModel, AutoAWQ and llm-compressor leave them unquantized)")
    fp8 = isinstance(scheme, Fp8Scheme)
    if checkpoint_keys is not None:
        head = _stored_quantized(scheme, LM_HEAD, checkpoint_keys)
        if raw.get("lm_head") is True and not head:
            raise ValueError("quantization_config says lm_head: true but the checkpoint has no lm_head.qweight")
        if head and fp8:
            raise ValueError("the checkpoint stores its lm_head in FP8: nvllm serves FP8 decoder linears with a "
                             "16/32-bit LM head")
    else:  # compressed-tensors quantizes every Linear its ignore list leaves, the head included (FP8: not served)
        head = raw.get("lm_head") is True or (compressed_tensors.is_compressed_tensors(raw) and not fp8 and not
                                              shape.tie_word_embeddings and not excluded_by_config(raw, [LM_HEAD]))
    if head:
        problem = head_problem(shape, scheme)
        if problem:
            raise ValueError(f"the quantized lm_head cannot be served as {scheme.fmt} {scheme.bits}-bit: {problem}")
        plan[LM_HEAD] = scheme
    return cfg, plan
