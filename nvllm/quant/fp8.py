"""FP8 (E4M3) weights: the checkpoint layouts nvllm serves, their scheme, and the quantizer behind
``--quantization fp8``.

Checkpoints (each quantized Linear stores ``weight`` as ``float8_e4m3fn [out, in]`` and a float32 scale; the
weight is ``w = q · scale``):
  ``quant_method: fp8`` — transformers' fine-grained FP8 (DeepSeek-V3, Qwen3-*-FP8) and vLLM's own FP8 export.
      ``weight_block_size [bn, bk]``: ``weight_scale_inv [ceil(out/bn), ceil(in/bk)]`` (the name is historical:
      it multiplies). Without a block size one scale per tensor, ``weight_scale_inv`` (transformers) or
      ``weight_scale`` (vLLM). ``activation_scheme: static`` adds a per-tensor ``input_scale``.
  compressed-tensors with 8-bit float weights (llm-compressor's FP8, FP8_DYNAMIC and FP8_BLOCK schemes;
      ``float-quantized`` or ``naive-quantized`` format): ``weight_scale`` ``[1]`` (tensor), ``[out, 1]``
      (channel), ``[out, in/g]`` (group) or ``[ceil(out/bn), ceil(in/bk)]`` (block); ``input_scale`` for static
      activations.

nvllm runs them as W8A16 (``nvllm.kernels.fp8_gemm``): the weights are dequantized inside the GEMM and the
activations stay in the model's dtype. A checkpoint's activation scales are read and kept but not applied (vLLM
also quantizes the activations to FP8 on GPUs with FP8 tensor cores; the weights, and so the memory, are the same).

``--quantization fp8`` on a 16/32-bit checkpoint quantizes every decoder linear while it loads: one scale per
output row (vLLM takes one per tensor; a row's own scale is never coarser).

In memory a layer keeps one scale per output row and input block, ``[out, ceil(in/bk)]`` (bk = the input size
for tensor and channel scales): a fused layer's shards and a tensor-parallel rank's rows then need no alignment
with the checkpoint's blocks. For 128-wide blocks that is 4 bytes per 128 weight bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)   # 448
MIN_BLOCK_K = 16   # the GEMM's K tiles (16 … 128) must each lie in one scale block


@dataclass(frozen=True)
class Fp8Scheme:
    """How an FP8 linear is stored. ``granularity``: one scale per tensor, per output channel, per group of
    ``block[1]`` inputs of a row, or per ``block`` (rows × inputs); ``scale_name``: the checkpoint's scale tensor
    (``weight_scale`` or ``weight_scale_inv``); ``static_inputs``: the checkpoint carries ``input_scale``;
    ``online``: the checkpoint is 16/32-bit and quantized while it loads."""

    granularity: str
    block: tuple[int, int] | None = None
    scale_name: str = "weight_scale"
    static_inputs: bool = False
    online: bool = False
    fmt: str = "fp8"
    bits: int = 8

    @property
    def group_size(self) -> int:
        """Inputs per scale (-1: the whole row), as the packed schemes name it."""
        return self.block[1] if self.block is not None else -1

    def group_for(self, in_features: int) -> int:
        """Inputs per scale column in memory (the whole row for tensor and channel scales)."""
        return in_features if self.block is None else self.block[1]

    def packing_problem(self, in_features: int, output_sizes: list[int]) -> str | None:
        return None   # any shape: scales are kept per row, the last input block may be partial

    def describe(self) -> str:
        kind = {"tensor": "per-tensor", "channel": "per-channel", "group": f"group {self.group_size}",
                "block": f"block {self.block[0]}x{self.block[1]}" if self.block else ""}[self.granularity]
        return f"fp8 e4m3 {kind}" + (" (quantized at load)" if self.online else "")


ONLINE = Fp8Scheme("channel", online=True)


def _block(value: Any, what: str) -> tuple[int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)):
        raise ValueError(f"{what} must be two positive integers, got {value!r}")
    if value[1] % MIN_BLOCK_K:
        raise ValueError(f"{what} {list(value)}: nvllm needs the input block ({value[1]}) to be a multiple of "
                         f"{MIN_BLOCK_K}")
    return int(value[0]), int(value[1])


def fp8_method_scheme(raw: dict[str, Any]) -> Fp8Scheme:
    """The scheme of a ``quant_method: fp8`` config (checked); ``scale_name`` is settled from the tensors."""
    act = str(raw.get("activation_scheme", "dynamic")).lower()
    if act not in ("dynamic", "static"):
        raise ValueError(f"unsupported fp8 activation_scheme {raw.get('activation_scheme')!r}: 'dynamic' or "
                         f"'static'")
    fmt = str(raw.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise ValueError(f"unsupported fp8 fmt {raw.get('fmt')!r}: nvllm serves e4m3 weights")
    if str(raw.get("scale_fmt", "float")).lower() != "float":
        raise ValueError(f"unsupported fp8 scale_fmt {raw.get('scale_fmt')!r}: nvllm serves float32 scales")
    block = raw.get("weight_block_size")
    if block is None:
        return Fp8Scheme("tensor", static_inputs=act == "static")
    return Fp8Scheme("block", _block(block, "weight_block_size"), "weight_scale_inv", static_inputs=act == "static")


def compressed_tensors_scheme(weights: dict[str, Any], inputs: dict[str, Any] | None) -> Fp8Scheme:
    """The scheme of a compressed-tensors config group with 8-bit float weights (checked)."""
    strategy = str(weights.get("strategy") or "tensor").lower()
    if weights.get("dynamic"):
        raise ValueError("compressed-tensors dynamic weight quantization is not served")
    if inputs is not None:
        if not isinstance(inputs, dict) or str(inputs.get("type", "float")).lower() != "float" \
                or inputs.get("num_bits") != 8:
            raise ValueError(f"compressed-tensors FP8 weights with input activations {inputs!r}: nvllm serves FP8 "
                             f"weights with FP8 or unquantized activations")
    static = inputs is not None and not inputs.get("dynamic", False)
    if strategy == "tensor":
        return Fp8Scheme("tensor", static_inputs=static)
    if strategy == "channel":
        return Fp8Scheme("channel", static_inputs=static)
    if strategy == "group":
        g = weights.get("group_size")
        return Fp8Scheme("group", _block([1, g], "compressed-tensors group_size"), static_inputs=static)
    if strategy == "block":
        return Fp8Scheme("block", _block(weights.get("block_structure"), "compressed-tensors block_structure"),
                         static_inputs=static)
    raise ValueError(f"unsupported compressed-tensors FP8 weight strategy {strategy!r}: tensor, channel, group or "
                     f"block")


# ---------------------------------------------------------------------------------------- scales per row


def scale_rows(scale: torch.Tensor, scheme: Fp8Scheme, out_features: int, in_features: int,
               name: str) -> torch.Tensor:
    """A checkpoint's scale tensor for a ``[out_features, in_features]`` weight → ``[out, ceil(in/bk)]`` fp32,
    one scale per row and input block (the memory layout, see the module doc). A wrong shape is a ValueError."""
    kb = -(-in_features // scheme.group_for(in_features))
    s = scale.to(torch.float32)
    if scheme.granularity == "tensor":
        if s.numel() != 1:
            raise ValueError(f"{name} must hold one per-tensor scale, got shape {tuple(scale.shape)}")
        return s.reshape(1, 1).expand(out_features, 1).contiguous()
    if scheme.granularity == "channel":
        if s.numel() != out_features or (s.dim() == 2 and s.shape[1] != 1) or s.dim() > 2:
            raise ValueError(f"{name} has shape {tuple(scale.shape)}, expected [{out_features}, 1]")
        return s.reshape(out_features, 1).contiguous()
    bn = scheme.block[0]
    rows = -(-out_features // bn)
    if s.dim() != 2 or tuple(s.shape) != (rows, kb):
        raise ValueError(f"{name} has shape {tuple(scale.shape)}, expected [{rows}, {kb}] for a "
                         f"[{out_features}, {in_features}] weight in blocks of {list(scheme.block)}")
    return s.repeat_interleave(bn, dim=0)[:out_features].contiguous()


def quantize_rows(w: torch.Tensor, block_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [out, in]`` → (``q`` float8_e4m3fn, ``scale [out, ceil(in/block_k)]`` fp32) with one scale per row and
    input block (``block_k`` None: the whole row), ``scale = amax / 448``: ``q · scale`` ≈ w."""
    out_f, in_f = w.shape
    bk = in_f if block_k is None else block_k
    kb = -(-in_f // bk)
    wf = w.float()
    pad = kb * bk - in_f
    blocks = torch.nn.functional.pad(wf, (0, pad)).view(out_f, kb, bk)
    scale = (blocks.abs().amax(dim=2) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (blocks / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).view(out_f, kb * bk)[:, :in_f].to(FP8_DTYPE)
    return q, scale


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [out, in]`` → (``q``, ``scale [ceil(out/bn), ceil(in/bk)]``): one scale per block, as DeepSeek-V3's and
    Qwen3's FP8 checkpoints store it (``weight_scale_inv``)."""
    bn, bk = block
    out_f, in_f = w.shape
    rows, cols = -(-out_f // bn), -(-in_f // bk)
    wf = torch.nn.functional.pad(w.float(), (0, cols * bk - in_f, 0, rows * bn - out_f))
    blocks = wf.view(rows, bn, cols, bk)
    scale = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(rows * bn, cols * bk)
    return q[:out_f, :in_f].to(FP8_DTYPE), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, block_k: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q [out, in]`` and its scales per row and block of ``block_k`` inputs ``[out, kb]`` → the weight in
    ``dtype``."""
    in_f = q.shape[1]
    s = scale.float().repeat_interleave(block_k, dim=1)[:, :in_f]
    return (q.float() * s).to(dtype)
