"""``quantization_config`` (config.json's, or a quantize_config.json): written exactly as AutoAWQ (GEMM) and AutoGPTQ
(v1) write it, and read back — validated, synonyms resolved — into the ``QuantConfig`` the loader and the linear
layers use. The packed tensors themselves: ``nvllm.quant.formats``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nvllm.quant import compressed_tensors
from nvllm.quant.formats import SUPPORTED_BITS
from nvllm.quant.fp8 import Fp8Scheme, fp8_method_scheme


def awq_quantization_config(group_size: int = 128, bits: int = 4, zero_point: bool = True,
                            modules_to_not_convert: list[str] | None = None) -> dict[str, Any]:
    """``quantization_config`` as AutoAWQ writes it into config.json (GEMM version)."""
    return {
        "quant_method": "awq",
        "zero_point": zero_point,
        "group_size": group_size,
        "bits": bits,
        "version": "gemm",
        "modules_to_not_convert": modules_to_not_convert,
    }


def gptq_quantization_config(bits: int = 4, group_size: int = 128, desc_act: bool = False, sym: bool = True,
                             damp_percent: float = 0.01, static_groups: bool = False,
                             true_sequential: bool = True, model_name_or_path: str | None = None,
                             model_file_base_name: str | None = "model") -> dict[str, Any]:
    """``quantization_config`` as AutoGPTQ writes it (same keys, same order, v1 checkpoint format)."""
    return {
        "bits": bits,
        "group_size": group_size,
        "damp_percent": damp_percent,
        "desc_act": desc_act,
        "static_groups": static_groups,
        "sym": sym,
        "true_sequential": true_sequential,
        "model_name_or_path": model_name_or_path,
        "model_file_base_name": model_file_base_name,
        "quant_method": "gptq",
        "checkpoint_format": "gptq",
    }


@dataclass(frozen=True)
class QuantConfig:
    """What the loader and the linear layers need from a ``quantization_config``."""

    method: str        # "awq" | "gptq" | "compressed-tensors" | "fp8"
    bits: int
    group_size: int    # as written: -1 means one group per output channel
    desc_act: bool
    sym: bool
    packing: str       # "awq_gemm" | "gptq_v1" | "gptq_v2" (read translated into v1, as compressed-tensors int) | "fp8"
    fp8: Fp8Scheme | None = None   # FP8 weights (quant_method fp8, compressed-tensors float): nvllm.quant.fp8
    activations: str | None = None   # compressed-tensors int-quantized: its int8 activation scheme, not applied


_SYNONYMS = {"w_bit": "bits", "q_group_size": "group_size"}


def parse_quantization_config(cfg: dict[str, Any]) -> QuantConfig:
    """Validate a ``quantization_config`` dict (config.json or quantize_config.json) → ``QuantConfig``.
    Anything nvllm cannot serve ends in one ``ValueError`` naming the key and the supported values."""
    if not isinstance(cfg, dict):
        raise ValueError(f"quantization_config must be a JSON object, got {type(cfg).__name__}")
    c = {_SYNONYMS.get(k.lower(), k.lower()): v for k, v in cfg.items()}
    method = str(c.get("quant_method", "gptq" if "desc_act" in c else "")).lower()
    if method == compressed_tensors.METHOD:  # int: served through the GPTQ v1 path (its tensors read translated)
        w = compressed_tensors.weight_scheme(cfg)
        if isinstance(w, Fp8Scheme):
            return _fp8_config(method, w)
        return QuantConfig(method, w["bits"], w["group_size"], desc_act=w["actorder"] == "group", sym=w["sym"],
                           packing="gptq_v1", activations=w["activations"])
    if method == "fp8":
        return _fp8_config(method, fp8_method_scheme(cfg))
    if method not in ("awq", "gptq"):
        raise ValueError(f"unsupported quant_method {c.get('quant_method')!r}: nvllm serves 'awq' (GEMM), "
                         f"'gptq' (v1), 'fp8' and 'compressed-tensors' (pack-quantized, FP8) checkpoints")
    bits = c.get("bits")
    if not isinstance(bits, int) or isinstance(bits, bool) or bits not in SUPPORTED_BITS[method]:
        raise ValueError(f"unsupported {method} bits {bits!r}: supported {list(SUPPORTED_BITS[method])}")
    group_size = c.get("group_size", 128 if method == "awq" else -1)
    if not isinstance(group_size, int) or isinstance(group_size, bool) or (group_size != -1 and group_size <= 0):
        raise ValueError(f"unsupported group_size {group_size!r}: a positive integer or -1")

    if method == "awq":
        version = str(c.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"unsupported AWQ version {c.get('version')!r}: only 'gemm' checkpoints are served")
        if c.get("zero_point", True) is not True:
            raise ValueError("unsupported AWQ zero_point=false: only zero-point (asymmetric) AWQ is served")
        return QuantConfig("awq", bits, group_size, desc_act=False, sym=False, packing="awq_gemm")

    if c.get("is_marlin_format"):
        raise ValueError("unsupported GPTQ checkpoint_format 'marlin': only 'gptq' (v1) and 'gptq_v2' are served")
    fmt = str(c.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"unsupported GPTQ checkpoint_format {c.get('checkpoint_format')!r}: only 'gptq' (v1) "
                         f"and 'gptq_v2' are served")
    desc_act = c.get("desc_act", False)
    sym = c.get("sym", True)
    for key, val in (("desc_act", desc_act), ("sym", sym)):
        if not isinstance(val, bool):
            raise ValueError(f"GPTQ {key} must be true or false, got {val!r}")
    return QuantConfig("gptq", bits, group_size, desc_act=desc_act, sym=sym,
                       packing="gptq_v2" if fmt == "gptq_v2" else "gptq_v1")


def _fp8_config(method: str, scheme: Fp8Scheme) -> QuantConfig:
    return QuantConfig(method, 8, scheme.group_size, desc_act=False, sym=True, packing="fp8", fp8=scheme)
