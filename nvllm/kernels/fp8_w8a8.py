"""FP8 activations for FP8-weight linears (W8A8, as vLLM runs FP8 checkpoints on GPUs with FP8 tensor cores; here on
Hopper, where it was timed):
``y = (qx · sx) @ (qw · sw)ᵀ (+ bias)`` with ``qx`` each token's row of x rounded to ``float8_e4m3fn`` under its own
scale ``sx = max|x_row| / 448`` (dynamic, per token) and ``sw`` one scale per weight row. The product runs on the
FP8 tensor cores through ``torch._scaled_mm`` (cuBLAS), row-wise scaled, bf16 out.

Only weights with one scale a row (per-tensor or per-channel checkpoints, ``--quantization fp8``) qualify: 128×128
block scales (Qwen3-FP8, DeepSeek-V3) change along K, which row-wise scaling cannot express.

``quantize_tokens`` is one Triton program per row: the row is read once, its largest magnitude taken, and every
element encoded to e4m3's byte with integer arithmetic: round to nearest, ties to even, subnormals kept, as
``Tensor.to(torch.float8_e4m3fn)`` rounds. Integer arithmetic gives the same bytes on the GPU and under the
interpreter, whose own float8 conversion rounds ties away from zero and drops subnormals.

This file holds the op's three parts: the torch reference, the Triton kernel and the entry points.
"""

from __future__ import annotations

import torch

from nvllm.kernels.backend import eager_triton
from nvllm.quant.fp8 import FP8_DTYPE, FP8_MAX

triton, tl, _jit = eager_triton()

MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
"""The smallest token scale (an all-zero row still divides by something), as vLLM's dynamic per-token quantizer."""

MAX_ROW = 4096
"""The longest row ``quantize_tokens`` takes: one program holds the row. Wider rows spilled (docs/PERF.md run EL:
down_proj's 18944 inputs in 32768-wide programs made W8A8 slower than dequantize + cuBLAS); they keep W8A16."""


# ---------------------------------------------------------------------------------------------- reference


def quantize_tokens_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` → (``float8_e4m3fn [M, K]``, fp32 scales ``[M, 1]``): each row divided by its scale
    ``max(max|x_row| · (1/448), MIN_SCALE)`` in fp32, clamped to ±448, rounded by torch's conversion."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) * (1.0 / FP8_MAX)).clamp(min=MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def w8a8_reference(x: torch.Tensor, weight: torch.Tensor, row_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Both operands quantized and dequantized, the product in fp32, cast to x's dtype."""
    qx, sx = quantize_tokens_reference(x)
    xd = qx.float() * sx
    wd = weight.float() * row_scale.float().reshape(-1, 1)
    y = torch.nn.functional.linear(xd, wd, None if bias is None else bias.float())
    return y.to(x.dtype)


# ------------------------------------------------------------------------------------------------- kernel


@_jit
def _e4m3_bytes(v):
    """fp32 values with |v| ≤ 448 → their e4m3fn codes (uint8), ties to even, subnormals kept. The magnitude's fp32
    significand (implicit bit included) is shifted right to e4m3's 3 fraction bits at the value's exponent, never
    below e4m3's smallest normal exponent (-6: subnormals share its step 2^-9), rounding half to even on the bits
    shifted out; ``(exponent + 6) · 8 + significand`` is then the code, a carry into the next binade included.
    A NaN is 0x7F, e4m3fn's NaN (its sign dropped: GPUs and CPUs make NaNs of different signs)."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    exp = ((bits >> 23) & 0xFF) - 127
    sig = (bits & 0x7FFFFF) | tl.where(exp > -127, 0x800000, 0)   # fp32 subnormals: no implicit bit
    exp_c = tl.maximum(exp, -6)
    shift = tl.minimum(20 + exp_c - exp, 31)
    kept = sig >> shift
    rest = sig - (kept << shift)
    half = 1 << (shift - 1)
    up = (rest > half) | ((rest == half) & ((kept & 1) == 1))
    kept = kept + up.to(tl.int32)
    code = tl.where(sig == 0, 0, (exp_c + 6) * 8 + kept) | sign
    return tl.where(_is_nan(v), 0x7F, code).to(tl.uint8)


@_jit
def _is_nan(v):
    """By the bits: a comparison could be folded away by a compiler that assumes no NaNs."""
    return (v.to(tl.int32, bitcast=True) & 0x7FFFFFFF) > 0x7F800000


@_jit
def _quantize_tokens_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, MIN_S: tl.constexpr,
                            BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    # NaNs as torch's amax and clamp keep them (Triton's max and min drop them): a NaN anywhere makes the scale,
    # and so every byte of the row, NaN; an infinity makes the scale infinite (the row's finite values 0)
    nan = _is_nan(x)
    scale = tl.maximum(tl.max(tl.where(nan, 0.0, tl.abs(x)), axis=0) * (1.0 / 448.0), MIN_S)  # torch's reciprocal
    scale = tl.where(tl.max(nan.to(tl.int32), axis=0) > 0, float("nan"), scale)
    # an IEEE division, as torch's tensor division (the GPU's default fp32 division may miss by an ulp)
    q = tl.math.div_rn(x, scale)
    v = tl.where(_is_nan(q), q, tl.minimum(tl.maximum(q, -448.0), 448.0))
    tl.store(q_ptr + row * stride_qm + offs, _e4m3_bytes(v), mask=mask)
    tl.store(s_ptr + row, scale)


# ------------------------------------------------------------------------------------------- entry points


def quantize_tokens(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_tokens_reference``'s result from one Triton program a row (rows of at most ``MAX_ROW``)."""
    M, K = x.shape
    if K > MAX_ROW:
        raise ValueError(f"quantize_tokens takes rows of at most {MAX_ROW} elements, got {K}")
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(M, K, dtype=torch.uint8, device=x.device)
    scale = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if M:
        _quantize_tokens_kernel[(M,)](x, q, scale, K, x.stride(0), q.stride(0), MIN_S=MIN_SCALE,
                                      BLOCK=triton.next_power_of_2(K), num_warps=4)
    return q.view(FP8_DTYPE), scale


def w8a8_supported(x: torch.Tensor, weight: torch.Tensor, block_k: int) -> bool:
    """Whether ``w8a8_linear`` can run this product: bf16 activations (row-wise scaled FP8 GEMMs write bf16), one
    weight scale a row, both sides multiples of 16, inputs of at most ``MAX_ROW``, and a Hopper GPU whose torch
    runs row-wise scaled FP8 products (``_rowwise_scaled_mm_runs``), or the CPU."""
    N, K = weight.shape
    if x.dtype != torch.bfloat16 or block_k < K or N % 16 or K % 16 or K > MAX_ROW:
        return False
    if x.device.type == "cuda":
        index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        return _rowwise_scaled_mm_runs(index)
    return x.device.type == "cpu"


_PROBED: dict[int, bool] = {}


def _rowwise_scaled_mm_runs(index: int) -> bool:
    """Hopper (the GPUs it was timed on), and this torch's row-wise scaled ``_scaled_mm`` runs there: tried once a
    device on 16×16 operands. Other GPUs with FP8 tensor cores are left out: torch's row-wise kernels needed sm_90
    before 2.7, and cuBLASLt refuses them on sm_120. Never tried inside a CUDA graph capture (an error would end it):
    until a call outside one has tried, the answer is no (the engine's warm-up runs before its captures)."""
    if index not in _PROBED:
        if torch.cuda.is_current_stream_capturing():
            return False
        _PROBED[index] = _probe(index)
    return _PROBED[index]


def _probe(index: int) -> bool:
    if torch.cuda.get_device_capability(index)[0] != 9:
        return False
    try:
        a = torch.zeros(16, 16, device=f"cuda:{index}").to(FP8_DTYPE)
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1, device=a.device),
                         scale_b=torch.ones(1, 16, device=a.device), out_dtype=torch.bfloat16)
        return True
    except (RuntimeError, TypeError):
        return False


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, row_scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K]`` (bf16) times the FP8 weight ``[N, K]`` with scales ``[N]`` (or ``[N, 1]``) → ``[M, N]`` bf16:
    the tokens quantized (``quantize_tokens``), the product on ``torch._scaled_mm``."""
    qx, sx = quantize_tokens(x)
    fused = bias is not None and bias.dtype == x.dtype   # added in fp32 before the one rounding
    y = torch._scaled_mm(qx, weight.t(), scale_a=sx, scale_b=row_scale.float().reshape(1, -1).contiguous(),
                         bias=bias if fused else None, out_dtype=x.dtype)
    return y if bias is None or fused else y + bias
