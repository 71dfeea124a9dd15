"""FP8 activations for FP8-weight linears (W8A8, as vLLM runs FP8 checkpoints on GPUs with FP8 tensor cores; here on
Hopper, where it was timed): ``y = (qx · sx) @ (qw · sw)ᵀ (+ bias)``, the product on the FP8 tensor cores through
``torch._scaled_mm`` (cuBLAS), bf16 out. Two ways to scale the activations, as vLLM's two FP8 paths:

- **per token** (``w8a8_linear``): each row of x under one scale ``sx = max|x_row| / 448`` (dynamic), for weights
  with one scale a row (per-tensor or per-channel checkpoints, ``--quantization fp8``) of at most ``MAX_ROW``
  inputs; row-wise scaled product.
- **per token and 128 inputs** (``w8a8_block_linear``): each row's groups of ``GROUP`` inputs under their own scale,
  for weights with one scale a row or scales that change along K in blocks of a multiple of 128 inputs (Qwen3-FP8,
  DeepSeek-V3's 128×128 blocks); block-wise scaled product (cuBLAS's 1×128 activation scales against the weight's
  128×128 blocks, or 1×128 weight scales, each weight row's scales repeated over its groups).

Which one runs at how many rows is ``nvllm.kernels.fp8_gemm.w8a8_path``'s choice (measured).

Both quantizers are Triton kernels that read x once, take the largest magnitude of the row (or group) and encode
every element to e4m3's byte with integer arithmetic: round to nearest, ties to even, subnormals kept, as
``Tensor.to(torch.float8_e4m3fn)`` rounds. Integer arithmetic gives the same bytes on the GPU and under the
interpreter, whose own float8 conversion rounds ties away from zero and drops subnormals.

This file holds the op's three parts: the torch references, the Triton kernels and the entry points.
"""

from __future__ import annotations

import torch

from nvllm.kernels.backend import eager_triton
from nvllm.quant.fp8 import FP8_DTYPE, FP8_MAX

triton, tl, _jit = eager_triton()

MIN_SCALE = 1.0 / (FP8_MAX * 512.0)
"""The smallest token scale (an all-zero row still divides by something), as vLLM's dynamic per-token quantizer."""

GROUP = 128
"""Inputs per activation scale of the block-wise product (cuBLAS's 1×128 block scaling)."""

GROUPS_PER_PROGRAM = 8
"""Groups one program of ``quantize_token_groups`` quantizes (1024 inputs)."""

MAX_ROW = 4096
"""The longest row ``quantize_tokens`` takes: one program holds the row. Wider rows spilled (docs/PERF.md run EL:
down_proj's 18944 inputs in 32768-wide programs made W8A8 slower than dequantize + cuBLAS); they take the block-wise
product."""


# ---------------------------------------------------------------------------------------------- reference


def quantize_tokens_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` → (``float8_e4m3fn [M, K]``, fp32 scales ``[M, 1]``): each row divided by its scale
    ``max(max|x_row| · (1/448), MIN_SCALE)`` in fp32, clamped to ±448, rounded by torch's conversion."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) * (1.0 / FP8_MAX)).clamp(min=MIN_SCALE)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_token_groups_reference(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` → (``float8_e4m3fn [M, K]``, fp32 scales ``[M, ceil(K / group)]``): as
    ``quantize_tokens_reference`` for each group of ``group`` inputs of a row (the last one may be shorter)."""
    M, K = x.shape
    G = -(-K // group)
    xf = torch.nn.functional.pad(x.float(), (0, G * group - K)).view(M, G, group)
    scale = (xf.abs().amax(dim=-1) * (1.0 / FP8_MAX)).clamp(min=MIN_SCALE)
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(M, G * group)[:, :K].contiguous(), scale


def w8a8_reference(x: torch.Tensor, weight: torch.Tensor, row_scale: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """Both operands quantized and dequantized, the product in fp32, cast to x's dtype."""
    qx, sx = quantize_tokens_reference(x)
    xd = qx.float() * sx
    wd = weight.float() * row_scale.float().reshape(-1, 1)
    y = torch.nn.functional.linear(xd, wd, None if bias is None else bias.float())
    return y.to(x.dtype)


def w8a8_block_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """As ``w8a8_reference`` with the activations scaled per token and ``GROUP`` inputs, and the weight's scales
    ``[N, ceil(K / block_k)]`` (``nvllm.quant.fp8``'s layout: one per row and block of ``block_k`` inputs)."""
    qx, sx = quantize_token_groups_reference(x)
    K = x.shape[1]
    xd = qx.float() * sx.repeat_interleave(GROUP, dim=1)[:, :K]
    wd = weight.float() * scale.float().repeat_interleave(block_k, dim=1)[:, :K]
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
def _scale_of(x, MIN_S: tl.constexpr, AXIS: tl.constexpr):
    """The scale of ``x``'s values along AXIS, ``max(max|x| · (1/448), MIN_S)``, as torch's: NaNs kept as torch's
    amax and clamp keep them (Triton's max and min drop them): a NaN makes the scale, and so every byte under it,
    NaN; an infinity makes the scale infinite (the finite values 0)."""
    nan = _is_nan(x)
    scale = tl.maximum(tl.max(tl.where(nan, 0.0, tl.abs(x)), axis=AXIS) * (1.0 / 448.0), MIN_S)  # torch's reciprocal
    return tl.where(tl.max(nan.to(tl.int32), axis=AXIS) > 0, float("nan"), scale)


@_jit
def _encode(x, scale):
    """``x / scale`` clamped to ±448, as e4m3 bytes. An IEEE division, as torch's tensor division (the GPU's default
    fp32 division may miss by an ulp)."""
    q = tl.math.div_rn(x, scale)
    return _e4m3_bytes(tl.where(_is_nan(q), q, tl.minimum(tl.maximum(q, -448.0), 448.0)))


@_jit
def _quantize_tokens_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, MIN_S: tl.constexpr,
                            BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0).to(tl.float32)
    scale = _scale_of(x, MIN_S, 0)
    tl.store(q_ptr + row * stride_qm + offs, _encode(x, scale), mask=mask)
    tl.store(s_ptr + row, scale)


@_jit
def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, K, G, stride_xm, stride_qm, stride_sm, stride_sg,
                            MIN_S: tl.constexpr, GROUP: tl.constexpr, GROUPS: tl.constexpr):
    """One row's groups ``[pid1 · GROUPS, (pid1 + 1) · GROUPS)`` of GROUP inputs: a scale each."""
    row = tl.program_id(0).to(tl.int64)
    gs = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = gs[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    scale = _scale_of(x, MIN_S, 1)
    tl.store(q_ptr + row * stride_qm + cols, _encode(x, scale[:, None]), mask=mask)
    tl.store(s_ptr + row * stride_sm + gs * stride_sg, scale, mask=gs < G)


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


def quantize_token_groups(x: torch.Tensor, pad_rows_to: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_token_groups_reference``'s result (any row width): ``GROUPS_PER_PROGRAM`` groups a Triton program.
    The scales ``[M, ceil(K / GROUP)]`` are stored column by column (strides ``(1, M)``), the layout cuBLAS's 1×128
    activation scales take. ``pad_rows_to``: return that many rows (at least M); those past M are left unset."""
    M, K = x.shape
    G = -(-K // GROUP)
    if x.stride(1) != 1:
        x = x.contiguous()
    rows = M if pad_rows_to is None else pad_rows_to
    q = torch.empty(rows, K, dtype=torch.uint8, device=x.device)
    scale = torch.empty(G, rows, dtype=torch.float32, device=x.device).t()
    if M:
        _quantize_groups_kernel[(M, triton.cdiv(G, GROUPS_PER_PROGRAM))](
            x, q, scale, K, G, x.stride(0), q.stride(0), scale.stride(0), scale.stride(1), MIN_S=MIN_SCALE,
            GROUP=GROUP, GROUPS=GROUPS_PER_PROGRAM, num_warps=4)
    return q.view(FP8_DTYPE), scale


def w8a8_supported(x: torch.Tensor, weight: torch.Tensor, block_k: int) -> bool:
    """Whether ``w8a8_linear`` can run this product: bf16 activations (row-wise scaled FP8 GEMMs write bf16), one
    weight scale a row, both sides multiples of 16, inputs of at most ``MAX_ROW``, and a Hopper GPU whose torch
    runs row-wise scaled FP8 products (``scaled_mm_runs``), or the CPU."""
    N, K = weight.shape
    if x.dtype != torch.bfloat16 or block_k < K or N % 16 or K % 16 or K > MAX_ROW:
        return False
    return x.device.type == "cpu" or (x.device.type == "cuda" and scaled_mm_runs(x.device, "row"))


def w8a8_block_supported(x: torch.Tensor, weight: torch.Tensor, block_k: int) -> bool:
    """Whether ``w8a8_block_linear`` can run this product: bf16 activations, weight scales along K in blocks of a
    multiple of ``GROUP`` inputs (or one a row), both sides multiples of 16, and a Hopper GPU whose torch runs
    block-wise scaled FP8 products (``scaled_mm_runs``: cuBLAS 12.9 on; no CPU build has them)."""
    N, K = weight.shape
    if x.dtype != torch.bfloat16 or N % 16 or K % 16 or (block_k < K and block_k % GROUP):
        return False
    return block_scaled_mm_runs(x.device)


def block_scaled_mm_runs(device: torch.device) -> bool:
    """Whether block-wise scaled products run on ``device``: a Hopper GPU (``scaled_mm_runs``)."""
    return device.type == "cuda" and scaled_mm_runs(device, "block")


_PROBED: dict[tuple[int, str], bool] = {}


def scaled_mm_runs(device: torch.device, kind: str) -> bool:
    """Hopper (the GPUs it was timed on), and this torch's ``_scaled_mm`` runs there with ``kind`` scales ("row":
    row-wise, "block": 1×128 activations against 1×128 and 128×128 weight blocks, a bf16 bias fused): tried once a
    device on small operands. Other GPUs with FP8 tensor cores are left out: torch's row-wise kernels needed sm_90
    before 2.7, cuBLASLt refuses them on sm_120, and its block-wise scaling is Hopper's. Never tried inside a CUDA
    graph capture (an error would end it): until a call outside one has tried, the answer is no (the engine's
    warm-up runs before its captures)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if (index, kind) not in _PROBED:
        if torch.cuda.is_current_stream_capturing():
            return False
        _PROBED[(index, kind)] = _probe(index, kind)
    return _PROBED[(index, kind)]


def _probe(index: int, kind: str) -> bool:
    """Small products of random operands against their torch reference: a torch that takes the layouts but reads
    them otherwise answers no. The block-wise one has 18 rows (padded to 20), 144 outputs (a short last block) and
    a bias, in both weight-scale layouts."""
    if torch.cuda.get_device_capability(index)[0] != 9:
        return False
    dev = torch.device("cuda", index)
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(18, 4 * GROUP, device=dev, generator=gen).to(torch.bfloat16)
    w = (torch.randn(144, 4 * GROUP, device=dev, generator=gen) * 100).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    bias = torch.randn(144, device=dev, generator=gen).to(torch.bfloat16)
    try:
        if kind == "row":
            s = torch.rand(144, 1, device=dev, generator=gen) + 0.5
            return _close(w8a8_linear(x, w, s, bias), w8a8_reference(x, w, s, bias))
        s = (torch.rand(2, 4, device=dev, generator=gen) + 0.5).repeat_interleave(GROUP, dim=0)[:144]
        ref = w8a8_block_reference(x, w, s, GROUP, bias)
        return all(_close(w8a8_block_linear(x, w, block_weight_scales(s, GROUP, 4 * GROUP, layout), bias), ref)
                   for layout in ("1x128", "128x128"))
    except (RuntimeError, TypeError, ValueError):
        return False


def _close(y: torch.Tensor, ref: torch.Tensor) -> bool:
    return bool((y.float() - ref.float()).abs().max() <= 2e-2 * ref.float().abs().max())


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, row_scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K]`` (bf16) times the FP8 weight ``[N, K]`` with scales ``[N]`` (or ``[N, 1]``) → ``[M, N]`` bf16:
    the tokens quantized (``quantize_tokens``), the product on ``torch._scaled_mm``."""
    qx, sx = quantize_tokens(x)
    fused = bias is not None and bias.dtype == x.dtype   # added in fp32 before the one rounding
    y = torch._scaled_mm(qx, weight.t(), scale_a=sx, scale_b=row_scale.float().reshape(1, -1).contiguous(),
                         bias=bias if fused else None, out_dtype=x.dtype)
    return y if bias is None or fused else y + bias.to(y.dtype)


def block_weight_scales(scale: torch.Tensor, block_k: int, in_features: int, layout: str) -> torch.Tensor | None:
    """A weight's scales ``[N, ceil(K / block_k)]`` (``nvllm.quant.fp8``'s layout, ``K = in_features``) as
    ``w8a8_block_linear``'s ``torch._scaled_mm`` takes them, or None where it cannot (blocks along K not a multiple
    of ``GROUP``):

    - "128x128": 128×128 blocks, ``[ceil(K/128), ceil(N/128)]`` whose transpose is contiguous; only where every 128
      rows share their scales and a row of block scales is 16 bytes a multiple (cuBLAS);
    - "1x128": one scale a row and 128 inputs, ``[ceil(K/128), N]`` contiguous (each row's block or row scale
      repeated over its groups).

    Made once a layer (``w8a8_weight_scales``): the 1×128 copy holds 4 bytes a weight row and 128 inputs (3 % of
    the FP8 weight's bytes)."""
    N, kb = scale.shape
    groups = -(-in_features // GROUP)
    if block_k < in_features and block_k % GROUP:
        return None
    if layout == "128x128":
        compact = scale[::GROUP]
        if block_k != GROUP or groups % 4 or not torch.equal(compact.repeat_interleave(GROUP, dim=0)[:N], scale):
            return None
        return compact.float().contiguous().t()
    if block_k >= in_features:   # one scale a row
        per_group = scale[:, :1].expand(N, groups)
    else:
        per_group = scale.repeat_interleave(block_k // GROUP, dim=1)[:, :groups]
    return per_group.float().t().contiguous()


def w8a8_weight_scales(scale: torch.Tensor, block_k: int, in_features: int) -> dict[str, torch.Tensor]:
    """The layouts of ``block_weight_scales`` a layer keeps for ``w8a8_block_linear``: "1x128" wherever the
    block-wise product can run (empty dict elsewhere), and "128x128" where that applies too (128×128 blocks)."""
    per_group = block_weight_scales(scale, block_k, in_features, "1x128")
    if per_group is None:
        return {}
    compact = block_weight_scales(scale, block_k, in_features, "128x128")
    return {"1x128": per_group} | ({} if compact is None else {"128x128": compact})


def w8a8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scales: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K]`` (bf16) times the FP8 weight ``[N, K]`` → ``[M, N]`` bf16: the tokens quantized per ``GROUP``
    inputs (``quantize_token_groups``), the product on ``torch._scaled_mm`` with block-wise scales
    (``weight_scales`` from ``block_weight_scales``). cuBLAS takes the activation scales' columns at 16-byte
    boundaries only (an H100 refused 257 rows): the rows are rounded up to a multiple of 4 for the product, the
    extra rows' outputs (of unset inputs) dropped."""
    M = x.shape[0]
    qx, sx = quantize_token_groups(x, -(-M // 4) * 4)
    fused = bias is not None and bias.dtype == x.dtype
    y = torch._scaled_mm(qx, weight.t(), scale_a=sx, scale_b=weight_scales, bias=bias if fused else None,
                         out_dtype=x.dtype)[:M]
    return y if bias is None or fused else y + bias.to(y.dtype)
