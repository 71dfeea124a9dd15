"""Checkpoints written by llm-compressor (``quant_method: compressed-tensors``): ``format: pack-quantized``, weight-only
INT4 and INT8 (W4A16, W8A16), group or channel scales, symmetric or with zero points, act-order groups; and
``format: int-quantized``, INT8 weights stored a byte each, as llm-compressor's W8A8 (SmoothQuant / GPTQ ``W8A8``
schemes) writes them with int8 activations (dynamic per token, or a static per-tensor ``input_scale``).

A quantized module's tensors, as compressed-tensors' ``PackedQuantizationCompressor`` writes them:
  ``weight_packed`` int32 ``[out, in*bits/32]``: packed along *in*, element ``i`` of a word in bits ``i*bits ..``
  (lowest first), each code stored with an offset of ``2^(bits-1)`` (the codes are signed);
  ``weight_scale`` ``[out, G]``; ``weight_shape`` int ``[2]``;
  ``weight_zero_point`` (asymmetric only) int32 ``[out*bits/32, G]``: packed along *out*, the same offset;
  ``weight_g_idx`` int ``[in]`` (``actorder: group``). ``w = (q - z) * s``.
``int-quantized`` (compressed-tensors' ``IntQuantizationCompressor``): ``weight`` int8 ``[out, in]`` (signed codes),
``weight_scale`` ``[out, G]``, ``weight_zero_point`` int8 ``[out, G]`` (asymmetric only), ``input_scale`` /
``input_zero_point`` for static activations.

nvllm serves them through its GPTQ v1 path: the loader reads each module translated (``GPTQView``). The words of
``weight_packed`` transposed are GPTQ's ``qweight`` (the same fields along the input, the offset code being
GPTQ's unsigned code); the scales are transposed; the zero points are repacked along *out* as v1 stores them
(``zero - 1``, a symmetric layer's being ``2^(bits-1)``). v1 cannot hold a zero point of 0: such a (group,
column) is stored mirrored, as AWQ's are (codes ``2^bits - 1 - q``, zero ``2^bits - 1``, scale ``-s``).
``int-quantized`` weights are packed into the same words. Their activations are not quantized: nvllm serves them
W8A16 (the same weights; no activation rounding) and drops static ``input_scale`` tensors, saying so.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch

from nvllm.quant import fp8
from nvllm.quant.formats import default_g_idx, gptq_v1_tensors
from nvllm.quant.fp8 import Fp8Scheme
from nvllm.quant.module_tensors import translated_by_module
from nvllm.quant.packing import pack_cols, pack_rows, unpack_rows

# config.json's weights scheme as llm-compressor writes it (compressed-tensors' QuantizationArgs fields)
_ARGS = {"type": "int", "dynamic": False, "observer": "minmax", "observer_kwargs": {}, "block_structure": None}

METHOD = "compressed-tensors"
FORMAT = "pack-quantized"
INT_FORMAT = "int-quantized"                              # INT8 weights a byte each (llm-compressor's W8A8)
FLOAT_FORMATS = ("float-quantized", "naive-quantized")   # FP8 weights stored as they are (nvllm.quant.fp8)
_PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx")
_INT_PARTS = ("weight", "weight_scale", "weight_zero_point", "input_scale", "input_zero_point")
_MARKS = set(_PARTS + _INT_PARTS) - {"weight"}   # a module with one of these is quantized (``weight``: any module)


def _quantized_modules(keys: set[str]) -> set[str]:
    return {module for module, _, leaf in (k.rpartition(".") for k in keys) if leaf in _MARKS}


def is_compressed_tensors(raw: dict[str, Any] | None) -> bool:
    return isinstance(raw, dict) and str(raw.get("quant_method", "")).lower() == METHOD


def weight_scheme(raw: dict[str, Any]) -> dict[str, Any] | Fp8Scheme:
    """The one weight scheme of a ``compressed-tensors`` config, checked: ``{"bits", "group_size" (-1 for channel),
    "sym", "actorder", "format", "activations"}`` for int weights (``activations``: the int8 activation scheme of an
    ``int-quantized`` checkpoint, not applied, else None), an ``Fp8Scheme`` for FP8 weights. Anything else (packed
    weights with activation quantization, another format, sparsity, transforms, a quantized KV cache, groups with
    different schemes) is one ValueError naming it."""
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    schemes = []
    for name, g in groups.items():
        if not isinstance(g, dict):
            raise ValueError(f"compressed-tensors config group {name!r} must be an object")
        fmt = g.get("format") or raw.get("format")
        w = g.get("weights")
        if isinstance(w, dict) and str(w.get("type", "int")).lower() == "float":
            schemes.append(_float_weights(name, fmt, w, g.get("input_activations"), g.get("output_activations")))
            continue
        if fmt not in (FORMAT, INT_FORMAT):
            raise ValueError(f"unsupported compressed-tensors format {fmt!r}: nvllm serves {FORMAT!r} (weight-only "
                             f"INT4/INT8: W4A16, W8A16) and {INT_FORMAT!r} (INT8 weights: W8A8 checkpoints)")
        if g.get("output_activations") is not None or (fmt == FORMAT and g.get("input_activations") is not None):
            raise ValueError(f"compressed-tensors config group {name!r} quantizes activations (W4A8 and the like): "
                             f"nvllm serves packed weight-only checkpoints (W4A16, W8A16) and {INT_FORMAT!r} W8A8")
        scheme = _weights(name, g.get("weights"))
        if fmt == INT_FORMAT and (scheme["bits"] != 8 or scheme["actorder"] is not None):
            raise ValueError(f"compressed-tensors {INT_FORMAT!r} config group {name!r}: nvllm serves 8-bit weights "
                             f"without act-order groups there")
        schemes.append(scheme | {"format": fmt, "activations": _int_activations(name, g.get("input_activations"))})
    if any(s != schemes[0] for s in schemes):
        raise ValueError("compressed-tensors config groups give different weight schemes: nvllm serves one "
                         "scheme for every quantized module")
    for key, what in (("sparsity_config", "sparsity"), ("transform_config", "transforms (rotations)")):
        value = raw.get(key) or {}
        if value and not (key == "sparsity_config" and str(value.get("format", "dense")) == "dense"):
            raise ValueError(f"compressed-tensors {key} is set: nvllm does not serve {what}")
    if raw.get("kv_cache_scheme") is not None:
        raise ValueError("compressed-tensors kv_cache_scheme is set: nvllm quantizes its KV cache itself "
                         "(--kv-cache-dtype) and does not read a checkpoint's KV scales")
    return schemes[0]


def _float_weights(group: str, fmt: Any, w: dict[str, Any], inputs: Any, outputs: Any) -> Fp8Scheme:
    """An FP8-weight config group (``nvllm.quant.fp8``)."""
    if fmt not in FLOAT_FORMATS:
        raise ValueError(f"unsupported compressed-tensors format {fmt!r} for float weights: nvllm serves "
                         f"{' and '.join(map(repr, FLOAT_FORMATS))}")
    if w.get("num_bits") != 8:
        raise ValueError(f"unsupported compressed-tensors float num_bits {w.get('num_bits')!r}: nvllm serves 8-bit "
                         f"(FP8) float weights")
    if outputs is not None:
        raise ValueError(f"compressed-tensors config group {group!r} quantizes output activations: not served")
    return fp8.compressed_tensors_scheme(w, inputs)


def _int_activations(group: str, a: Any) -> str | None:
    """An ``int-quantized`` group's input activation scheme as the log names it ("dynamic token", "static tensor"),
    None for none; what is not int8 per token or per tensor is a ValueError."""
    if a is None:
        return None
    if not isinstance(a, dict) or str(a.get("type", "int")).lower() != "int" or a.get("num_bits") != 8:
        raise ValueError(f"compressed-tensors config group {group!r}: input activations other than 8-bit int are "
                         f"not served")
    strategy = str(a.get("strategy") or "tensor").lower()
    if strategy not in ("token", "tensor"):
        raise ValueError(f"compressed-tensors config group {group!r}: input activation strategy {strategy!r} is not "
                         f"served (token, tensor)")
    return f"{'dynamic' if a.get('dynamic') else 'static'} {strategy}"


def _weights(group: str, w: Any) -> dict[str, Any]:
    if not isinstance(w, dict):
        raise ValueError(f"compressed-tensors config group {group!r} has no weights scheme")
    # normalised as compressed-tensors' QuantizationArgs does: enum values in any case, the strategy inferred
    # from the group size when left out, actorder true / false for group / none
    bits, kind = w.get("num_bits"), str(w.get("type", "int")).lower()
    strategy = str(w.get("strategy") or "").lower()
    if not strategy and isinstance(w.get("group_size"), int):
        strategy = "channel" if w["group_size"] == -1 else "group"
    if kind != "int":
        raise ValueError(f"unsupported compressed-tensors weight type {kind!r}: nvllm serves int weights")
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in (4, 8):
        raise ValueError(f"unsupported compressed-tensors num_bits {bits!r}: supported [4, 8]")
    if strategy == "group":
        group_size = w.get("group_size")
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
            raise ValueError(f"compressed-tensors group strategy needs a positive group_size, got {group_size!r}")
    elif strategy == "channel":
        group_size = -1
    else:
        raise ValueError(f"unsupported compressed-tensors weight strategy {strategy!r}: nvllm serves 'group' and "
                         f"'channel'")
    if w.get("dynamic"):
        raise ValueError("compressed-tensors dynamic weight quantization is not served")
    actorder = w.get("actorder")
    if isinstance(actorder, bool):
        actorder = "group" if actorder else None
    actorder = None if actorder is None else str(actorder).lower()
    actorder = {"static": "weight", "dynamic": "group"}.get(actorder, actorder)
    if actorder not in (None, "weight", "group"):
        raise ValueError(f"unsupported compressed-tensors actorder {w.get('actorder')!r}")
    sym = w.get("symmetric", True)
    if not isinstance(sym, bool):
        raise ValueError(f"compressed-tensors symmetric must be true or false, got {sym!r}")
    return {"bits": bits, "group_size": group_size, "sym": sym, "actorder": actorder}


def ignored(raw: dict[str, Any], name: str) -> bool:
    """Whether the config's ``ignore`` list keeps module ``name`` in full precision: an entry is the module's
    name, or ``re:PATTERN`` matched from the start of it (compressed-tensors' rule)."""
    for entry in raw.get("ignore") or []:
        entry = str(entry)
        if entry.startswith("re:") and re.match(entry[3:], name) or entry == name:
            return True
    return False


def gptq_keys(keys: set[str]) -> set[str]:
    """Tensor names as the GPTQ path knows them: a quantized module (one with a ``weight_packed``, a
    ``weight_scale``, …) stands for its ``qweight``, ``qzeros``, ``scales`` and ``g_idx``."""
    quantized = _quantized_modules(keys)
    out = set()
    for k in keys:
        module, _, leaf = k.rpartition(".")
        if module in quantized and leaf in _PARTS + _INT_PARTS:
            out.update(f"{module}.{t}" for t in ("qweight", "qzeros", "scales", "g_idx"))
        else:
            out.add(k)
    return out


class GPTQView:
    """Checkpoint tensors with every compressed-tensors module translated into GPTQ v1's ``qweight``, ``qzeros``,
    ``scales`` and ``g_idx``. ``keys``: the checkpoint's tensor names; a module's tensors are held until all of
    them have arrived (shards may split a module). ``int-quantized``: a module is quantized when it has a
    ``weight_scale`` or other parts besides ``weight`` (which is then int8); its static ``input_scale`` /
    ``input_zero_point`` are dropped."""

    def __init__(self, scheme: dict[str, Any], keys: set[str]):
        self.bits, self.sym, self.group_size = scheme["bits"], scheme["sym"], scheme["group_size"]
        self.int_format = scheme.get("format") == INT_FORMAT
        self.parts = _INT_PARTS if self.int_format else _PARTS
        weight = "weight" if self.int_format else "weight_packed"
        self.needs = {weight, "weight_scale"} | ({"weight_g_idx"} if scheme["actorder"] == "group" else
                                                 set()) | (set() if self.sym else {"weight_zero_point"})
        self.stored: dict[str, set[str]] = {}  # module → its compressed-tensors tensors in the checkpoint
        quantized = _quantized_modules(keys)
        for k in keys:
            module, _, leaf = k.rpartition(".")
            if leaf in self.parts and module in quantized:
                self.stored.setdefault(module, set()).add(leaf)
        for module, leaves in sorted(self.stored.items()):
            if not self.needs <= leaves:
                raise ValueError(f"compressed-tensors module {module!r} lacks "
                                 f"{', '.join(sorted(self.needs - leaves))}")
        self.dropped = 0   # static activation tensors left out

    def _ours(self, module: str, leaf: str, tensor: torch.Tensor) -> bool:
        """Whether the tensor belongs to a quantized module: known from the names, else (a pickle checkpoint) an
        ``int-quantized`` module's int8 ``weight`` or any other of its parts."""
        if leaf not in self.parts:
            return False
        if module in self.stored:
            return True
        return not self.stored and (not self.int_format or leaf != "weight" or tensor.dtype == torch.int8)

    def __call__(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        return translated_by_module(weights, self._ours, self.stored, self._complete)

    def _complete(self, module: str, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``translate``, once a module whose names were not known beforehand (a pickle checkpoint) is checked
        for every part its scheme needs (the known ones were, in ``__init__``)."""
        if module not in self.stored and not self.needs <= parts.keys():
            raise ValueError(f"compressed-tensors module {module!r} lacks "
                             f"{', '.join(sorted(self.needs - parts.keys()))}")
        return self.translate(module, parts)

    def translate(self, module: str, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One module's tensors → GPTQ v1 (see the module doc)."""
        bits, per_word = self.bits, 32 // self.bits
        packed, scale = self._packed(module, parts), parts["weight_scale"]
        out_f, in_f = packed.shape[0], packed.shape[1] * per_word
        shape = parts.get("weight_shape")
        if shape is not None and [int(x) for x in shape.flatten()] != [out_f, in_f]:
            raise ValueError(f"{module}: weight_shape {shape.tolist()} does not match weight_packed "
                             f"{tuple(packed.shape)} ({bits}-bit: inputs in whole words)")
        groups = scale.shape[-1] if scale.dim() == 2 else 0
        if scale.dim() != 2 or scale.shape[0] != out_f or groups == 0 or in_f % groups:
            raise ValueError(f"{module}.weight_scale has shape {tuple(scale.shape)}, expected [{out_f}, groups]")
        want = 1 if self.group_size == -1 else -(-in_f // self.group_size)
        if groups != want:   # named here: past this point the tensors carry GPTQ's names, not the checkpoint's
            raise ValueError(f"{module}.weight_scale holds {groups} group(s) of its {in_f} inputs, but the "
                             f"quantization_config's group_size {self.group_size} makes {want}: the checkpoint and "
                             "its config disagree")
        qweight = packed.t().contiguous()
        scales = scale.t().to(torch.float16).contiguous()
        if self.sym:
            zp = parts.get("weight_zero_point")
            if zp is not None and zp.any():   # zeros are a symmetric scheme's (some writers store them)
                raise ValueError(f"{module}.weight_zero_point is not zero, but the config's scheme is symmetric: "
                                 "the checkpoint and its quantization_config disagree")
            zeros = torch.full((groups, out_f), 1 << (bits - 1), dtype=torch.int64)
        elif self.int_format:
            zp = parts["weight_zero_point"]
            if zp.dtype != torch.int8 or tuple(zp.shape) != (out_f, groups):
                raise ValueError(f"{module}.weight_zero_point must be int8 [{out_f}, {groups}], got {zp.dtype} "
                                 f"{tuple(zp.shape)}")
            zeros = zp.t().to(torch.int64) + (1 << (bits - 1))      # [G, out], unsigned
        else:
            zp = parts["weight_zero_point"]
            rows = -(-out_f // per_word)
            if zp.dtype != torch.int32 or tuple(zp.shape) != (rows, groups):
                raise ValueError(f"{module}.weight_zero_point must be int32 [{rows}, {groups}] (packed along the "
                                 f"outputs), got {zp.dtype} {tuple(zp.shape)}")
            zeros = unpack_rows(zp, bits)[:out_f].t().to(torch.int64)  # [G, out], unsigned
        g_idx = parts.get("weight_g_idx")
        if g_idx is None:
            g_idx = default_g_idx(in_f, in_f // groups)
        elif g_idx.numel() != in_f or int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise ValueError(f"{module}.weight_g_idx must give each of the {in_f} inputs a group in [0, {groups})")
        else:
            g_idx = g_idx.to(torch.int32)
        self.dropped += sum(k in parts for k in ("input_scale", "input_zero_point"))
        return gptq_v1_tensors(qweight, zeros, scales, g_idx, bits)

    def _packed(self, module: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """The module's codes as ``weight_packed``'s words ``[out, in*bits/32]`` (``int-quantized``: its int8
        ``weight`` offset to unsigned codes and packed)."""
        if not self.int_format:
            packed = parts["weight_packed"]
            if packed.dtype != torch.int32 or packed.dim() != 2:
                raise ValueError(f"{module}.weight_packed must be a 2-D int32 tensor, got {packed.dtype} "
                                 f"{tuple(packed.shape)}")
            return packed
        w = parts["weight"]
        if w.dtype != torch.int8 or w.dim() != 2 or w.shape[1] % 4:
            raise ValueError(f"{module}.weight must be a 2-D int8 tensor with inputs in whole words of 4, got "
                             f"{w.dtype} {tuple(w.shape)}")
        return pack_cols(w.to(torch.int64) + 128, 8)


def pack_compressed_tensors(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bits: int,
                            sym: bool) -> dict[str, torch.Tensor]:
    """``q [out, in]`` (unsigned codes), ``zeros [G, out]``, ``scales [G, out]`` → a module's compressed-tensors
    tensors (the module doc's layout: an unsigned code is the signed code plus the offset). Contiguous groups only
    (compressed-tensors no longer stores act-order groups). Symmetric: the zero point is the offset itself."""
    offset = 1 << (bits - 1)
    if sym and zeros.numel() and not bool((zeros == offset).all()):
        raise ValueError(f"a symmetric compressed-tensors weight has zero points of {offset}")
    out = {"weight_packed": pack_cols(q, bits), "weight_scale": scales.t().contiguous(),
           "weight_shape": torch.tensor(list(q.shape), dtype=torch.int64)}
    if not sym:
        out["weight_zero_point"] = pack_rows(zeros.t().contiguous(), bits)
    return out


def quantization_config(bits: int, group_size: int, sym: bool, actorder: str | None, ignore: list[str]
                        ) -> dict[str, Any]:
    """``quantization_config`` as llm-compressor writes it for a weight-only scheme (one config group for every
    Linear, ``ignore`` naming the modules kept dense)."""
    weights = {**_ARGS, "num_bits": bits, "symmetric": sym, "actorder": actorder,
               "strategy": "channel" if group_size == -1 else "group",
               "group_size": None if group_size == -1 else group_size}
    return {"quant_method": METHOD, "format": FORMAT, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": FORMAT}},
            "ignore": ignore, "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {}}


def fp8_quantization_config(block: int | None, ignore: list[str]) -> dict[str, Any]:
    """``quantization_config`` as llm-compressor writes its FP8_DYNAMIC scheme (a scale per output channel; ``block``
    None) or FP8_BLOCK (``block`` × ``block`` weight blocks): e4m3 weights, activations quantized per token (per
    group of ``block`` inputs with blocks) at run time by engines that do W8A8 (nvllm runs W8A16: nvllm.quant.fp8)."""
    weights = {**_ARGS, "type": "float", "num_bits": 8, "symmetric": True, "actorder": None,
               "strategy": "channel" if block is None else "block", "group_size": None,
               "block_structure": None if block is None else [block, block]}
    inputs = {"type": "float", "num_bits": 8, "symmetric": True, "dynamic": True, "observer": None,
              "strategy": "token" if block is None else "group", "group_size": block}
    return {"quant_method": METHOD, "format": FLOAT_FORMATS[0], "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                                          "output_activations": None, "format": FLOAT_FORMATS[0]}},
            "ignore": ignore, "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {}}
