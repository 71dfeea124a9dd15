"""FP8-weight GEMM (W8A16): ``y = x @ (q · s)ᵀ (+ bias)`` for a ``float8_e4m3fn`` weight ``q [N, K]`` with one
fp32 scale per output row and block of ``BK_S`` inputs, ``s [N, ceil(K / BK_S)]`` (``nvllm.quant.fp8``'s memory
layout: per-tensor and per-channel scales have ``BK_S = K``).

Each program owns a ``[BLOCK_M, BLOCK_N]`` output tile and walks K in ``BLOCK_K`` steps, every step lying in one
scale block (``BK_S % BLOCK_K == 0``, or one block for the whole row): it loads the weight tile once at one byte
an element, converts it to x's dtype (exact: every e4m3 value is an fp16 and a bf16) and feeds ``tl.dot``; the
step's fp32 sums are multiplied by the ``BLOCK_N`` scales of that K block (one scale a row: once, at the end).
GPUs before compute capability 8.9 have no e4m3 type in Triton: the kernels then decode the bytes by bits. When
the output tiles cannot fill the GPU (decode: M is the batch), K is split over programs that add into an fp32
buffer (``nvllm.kernels.split_k``). ``fp8_gemv`` does the same for a few rows on the CUDA cores (``GEMV_MAX_M``).

vLLM runs these checkpoints as W8A8 on GPUs with FP8 tensor cores (activations quantized per token); this keeps
the activations in their dtype: the same weight bytes, no activation rounding. From ``W8A8_MIN_M`` rows on,
``fp8_linear`` hands the product to ``nvllm.kernels.fp8_w8a8`` where that runs (``w8a8_path``).

This file holds the op's three parts: the torch reference, the Triton kernel and the dispatch.
"""

from __future__ import annotations

import functools
import os

import torch

from nvllm.env_vars import env_number
from nvllm.kernels import report
from nvllm.kernels.backend import eager_triton, interpreting, use_triton
from nvllm.kernels.fp8_w8a8 import w8a8_block_linear, w8a8_block_supported, w8a8_linear, w8a8_supported
from nvllm.kernels.split_k import finish_split_k, plan_split_k, split_k_output, store_tile
from nvllm.quant.fp8 import dequantize_rows

triton, tl, _jit = eager_triton()  # jitted at import (the CPU tests reload under the interpreter)

NVLLM_FP8_DECODE_BITS = os.environ.get("NVLLM_FP8_DECODE_BITS", "0") == "1"
"""Under the interpreter: decode e4m3 by bits as a GPU before compute capability 8.9 does (tests)."""

DEQUANT_MATMUL_MIN_M = env_number("NVLLM_FP8_DEQUANT_MIN_M", 256)
"""From this many rows on, ``fp8_linear`` writes the weight out in x's dtype and calls a dense matmul (cuBLAS).
H100, a 7B layer's four projections (docs/PERF.md run EJ): at 128 rows the fused kernel took 443 µs against 525
for dequantize + cuBLAS (128×128 blocks) and 270 against 447 (per-row scales); at 256 rows 764 against 554 and 470
against 469; at 2048 rows the dequantize path is 1.9–3.2× faster."""

W8A8_MIN_M = env_number("NVLLM_FP8_W8A8_MIN_M", 16)
"""From this many rows on, FP8 weights run as W8A8 (``nvllm.kernels.fp8_w8a8``: the tokens quantized to FP8, the
product on the FP8 tensor cores) where torch's block-wise scaled products run (Hopper, cuBLAS 12.9 on; 0: never),
below ``W8A8_LARGE_M`` rows with activations per token and 128 inputs against 1×128 weight scales. H100, a
Qwen2.5-7B layer's four projections (docs/PERF.md run EO), µs for W8A16 against 1×128 W8A8: 128×128 blocks 118.9 /
114.3 at 8 rows, 124.2 / 115.1 at 16, 222.4 / 118.7 at 64, 439.4 / 136.8 at 128; one scale a row 108.3 / 111.3 at
8, 111.3 / 115.4 at 16, 152.2 / 118.8 at 32, 267.7 / 136.4 at 128."""

W8A8_LARGE_M = env_number("NVLLM_FP8_W8A8_LARGE_M", 256)
"""From this many rows on, W8A8 takes 128×128 weight blocks where the checkpoint has them, and activations per
token against row scales where the weight has one scale a row of at most ``MAX_ROW`` inputs. Run EO, µs for a
layer: 128×128 blocks, 1×128 against 128×128 weight scales, 136.8 / 160.2 at 128 rows, 189.5 / 178.1 at 256,
1238.1 / 975.3 at 2048 (bf16 cuBLAS 1207.4, dequantize + cuBLAS 1622.0); one scale a row, q/k/v + o + gate_up,
1×128 against per token, 95.8 / 106.3 at 128 rows, 128.1 / 117.1 at 256, 785.5 / 630.3 at 2048."""

GEMV_ROWS = 8
"""The most rows ``fp8_gemv`` takes (its products are ``[rows, BLOCK_N, BLOCK_K]`` tiles in registers)."""

GEMV_MAX_M = min(env_number("NVLLM_FP8_GEMV_MAX_M", 0), GEMV_ROWS)
"""Up to this many rows ``fp8_linear`` runs ``fp8_gemv`` (CUDA cores) instead of the tensor-core tiles of
``fp8_gemm``. 0: on an H100 (docs/PERF.md, run EH) the GEMV took 1.3–3.3× the tensor-core kernel's time at M = 1
and more at M = 4 on the 7B shapes."""


# ---------------------------------------------------------------------------------------------- reference


def fp8_gemm_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize to fp32, matmul in fp32, add bias, cast to x's dtype."""
    w = dequantize_rows(weight, scale, block_k).to(x.device)
    y = torch.nn.functional.linear(x.float(), w, None if bias is None else bias.float())
    return y.to(x.dtype)


# ------------------------------------------------------------------------------------------------- kernel


@_jit
def _e4m3(b, NATIVE: tl.constexpr):
    """e4m3fn bytes (uint8) → fp32. ``NATIVE`` (compute capability ≥ 8.9, the interpreter): the hardware's
    conversion. Otherwise by bits: the 7 magnitude bits placed as an fp16's exponent and top mantissa give the value
    2^-8 times (subnormals too), and the sign moves to fp16's sign bit; every e4m3 value is exact in fp16."""
    if NATIVE:
        return b.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    bi = b.to(tl.int16)
    return (((bi & 0x7F) << 7) | ((bi & 0x80) << 8)).to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@_jit
def _fp8_gemm_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_sn, stride_om, stride_on,
    k_per_split,                              # K range of one split (a multiple of BLOCK_K)
    BK_S: tl.constexpr,                       # inputs per scale column (K: one scale a row, in the epilogue)
    HAS_BIAS: tl.constexpr,
    ATOMIC: tl.constexpr,                     # split-K: atomic_add into an fp32 output
    NATIVE: tl.constexpr,                     # the GPU converts e4m3 itself (see _e4m3)
    DOT_PRECISION: tl.constexpr,              # "ieee" for fp32 inputs, "tf32" otherwise (unused for 16-bit)
    UPCAST_DOT: tl.constexpr,                 # CPU interpreter + bf16: feed the dot fp32 copies (quant_gemm's note)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N

    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        q = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None],
                    mask=mask_k[:, None] & mask_n[None, :], other=0)              # [BLOCK_K, BLOCK_N] bytes
        w = _e4m3(q, NATIVE).to(a.dtype)                                          # exact in fp16 / bf16 / fp32
        if UPCAST_DOT:
            part = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, w, input_precision=DOT_PRECISION)
        if BK_S >= K:
            acc += part
        else:   # this K step's scale block: its scales multiply the step's sums
            acc += part * tl.load(s_ptr + offs_n * stride_sn + k0 // BK_S, mask=mask_n, other=0.0)[None, :]
    if BK_S >= K:
        acc = acc * tl.load(s_ptr + offs_n * stride_sn, mask=mask_n, other=0.0)[None, :]

    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    store_tile(out_ptrs, acc, mask_m[:, None] & mask_n[None, :], bias_ptr, offs_n, mask_n, HAS_BIAS, ATOMIC)


@_jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_om,
    k_per_split,
    BK_S: tl.constexpr, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr, NATIVE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Few rows (decode): each program streams ``BLOCK_N`` weight rows along K (contiguous bytes), multiplies them
    with every x row on the CUDA cores and sums along K; no tensor-core tile to pad the rows to."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        q = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :],
                    mask=mask_n[:, None] & mask_k[None, :], other=0)               # [BLOCK_N, BLOCK_K] bytes
        s = tl.load(s_ptr + offs_n * stride_sn + k0 // BK_S, mask=mask_n, other=0.0)
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)   # [BLOCK_M, BLOCK_K]
        prod = a[:, None, :] * _e4m3(q, NATIVE)[None, :, :]
        acc += tl.sum(prod, axis=2) * s[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    store_tile(out_ptrs, acc, mask_m[:, None] & mask_n[None, :], bias_ptr, offs_n, mask_n, HAS_BIAS, ATOMIC)


@_jit
def _fp8_dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on,
                        BK_S: tl.constexpr, NATIVE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``out [N, K]`` in out's dtype = the weight's codes times their scales (for the dense matmul of many rows)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    q = tl.load(w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :], mask=mask, other=0)
    s = tl.load(s_ptr + offs_n[:, None] * stride_sn + (offs_k // BK_S)[None, :], mask=mask, other=0.0)
    tl.store(out_ptr + offs_n[:, None] * stride_on + offs_k[None, :],
             (_e4m3(q, NATIVE) * s).to(out_ptr.dtype.element_ty), mask=mask)


def fp8_dequantize(weight: torch.Tensor, scale: torch.Tensor, block_k: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight ``[N, K]`` in ``dtype``, written by one kernel (each element rounded once from its fp32 value)."""
    N, K = weight.shape
    out = torch.empty((N, K), device=weight.device, dtype=dtype)
    _fp8_dequant_kernel[(triton.cdiv(N, 32), triton.cdiv(K, 128))](
        weight.view(torch.uint8), scale, out, N, K, weight.stride(0), scale.stride(0), out.stride(0),
        BK_S=block_k if block_k < K else K, NATIVE=native_fp8(weight.device), BLOCK_N=32, BLOCK_K=128)
    return out


def _pick_config(M: int, K: int, block_k: int, dtype: torch.dtype) -> dict[str, int]:
    """Tile sizes (a first choice, not yet measured per shape): small M takes 16-row tiles and split-K, larger M
    wider tiles. BLOCK_K is the largest of 128 / 64 / 32 / 16 inside one scale block."""
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64 if M <= 64 else 128
    block_n = 64 if M > 64 else 128
    limit = 64 if dtype == torch.float32 or M > 64 else 128
    bk = 16
    for cand in (128, 64, 32):
        if cand <= limit and (block_k >= K or block_k % cand == 0):
            bk = cand
            break
    return {"block_m": block_m, "block_n": block_n, "block_k": bk, "num_warps": 8 if M > 64 else 4,
            "num_stages": 2 if dtype == torch.float32 else 3}


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int,
             bias: torch.Tensor | None = None, split_k: int | None = None, block_n: int = 16, block_k_tile: int = 256,
             num_warps: int = 4) -> torch.Tensor:
    """``fp8_gemm`` for up to ``GEMV_ROWS`` rows on the CUDA cores (``_fp8_gemv_kernel``); x rows contiguous.
    ``block_k_tile`` is the kernel's K step (it must lie in one scale block: smaller ones are taken for smaller
    blocks)."""
    M, K = x.shape
    N = weight.shape[0]
    if M > GEMV_ROWS:
        raise ValueError(f"fp8_gemv takes at most {GEMV_ROWS} rows, got {M}")
    _check(x, weight, scale, block_k)
    bk = block_k_tile
    while block_k < K and block_k % bk:
        bk //= 2
    if bk < 16:
        raise ValueError(f"no K step of 16 or more divides the scale block {block_k}")
    if M == 0:
        return x.new_zeros(0, N)
    x = x.contiguous()
    split_k, k_per_split = plan_split_k(triton.cdiv(N, block_n), K, bk, x.device, split_k)
    atomic = split_k > 1
    out = split_k_output(M, N, x, split_k)
    has_bias = bias is not None and not atomic
    _fp8_gemv_kernel[(triton.cdiv(N, block_n), split_k)](
        x, weight.view(torch.uint8), scale, bias if has_bias else scale, out, M, N, K,
        x.stride(0), weight.stride(0), scale.stride(0), out.stride(0), k_per_split,
        BK_S=block_k if block_k < K else K, HAS_BIAS=has_bias, ATOMIC=atomic, NATIVE=native_fp8(x.device),
        BLOCK_M=triton.next_power_of_2(M), BLOCK_N=block_n, BLOCK_K=bk, num_warps=num_warps,
    )
    return finish_split_k(out, bias, x.dtype, split_k)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def native_fp8(device: torch.device) -> bool:
    """Whether the kernels may let the GPU convert e4m3 (compute capability 8.9 and later; Triton refuses the type
    before); elsewhere they decode the bits themselves, so Ampere serves FP8 checkpoints too."""
    if device.type != "cuda":
        return not NVLLM_FP8_DECODE_BITS
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (8, 9)


def _check(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int) -> None:
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"fp8_gemm takes fp16, bf16 or fp32 activations, got {x.dtype}")
    if weight.dtype != torch.float8_e4m3fn or weight.stride(1) != 1 or scale.stride(1) != 1:
        raise ValueError("fp8_gemm takes a float8_e4m3fn weight and fp32 scales with contiguous rows")
    M, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K:
        raise ValueError(f"x has {K} input features, the FP8 weight holds {weight.shape[1]}")
    if tuple(scale.shape) != (N, -(-K // block_k)):
        raise ValueError(f"scale has shape {tuple(scale.shape)}, expected [{N}, {-(-K // block_k)}]")


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int,
             bias: torch.Tensor | None = None, split_k: int | None = None, **config: int) -> torch.Tensor:
    """``x [M, K]`` (fp16 / bf16 / fp32) times the FP8 weight → ``[M, N]`` in x's dtype, fp32 accumulation.
    ``block_k``: inputs per scale column (K for per-tensor and per-channel scales). ``split_k=None`` splits K
    until about two waves fill the device; ``config`` overrides ``block_m``, ``block_n``, ``block_k``,
    ``num_warps``, ``num_stages``."""
    _check(x, weight, scale, block_k)
    M, K = x.shape
    N = weight.shape[0]
    cfg = _pick_config(M, K, block_k, x.dtype)
    unknown = set(config) - set(cfg)
    if unknown:
        raise TypeError(f"unknown fp8_gemm config keys {sorted(unknown)}")
    cfg.update(config)
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    if block_k < K and block_k % bk:
        raise ValueError(f"BLOCK_K {bk} does not divide the scale block {block_k}")
    if M == 0:
        return x.new_zeros(0, N)
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    split_k, k_per_split = plan_split_k(tiles, K, bk, x.device, split_k)
    atomic = split_k > 1
    out = split_k_output(M, N, x, split_k)
    has_bias = bias is not None and not atomic
    _fp8_gemm_kernel[(triton.cdiv(N, bn), triton.cdiv(M, bm), split_k)](
        x, weight.view(torch.uint8), scale, bias if has_bias else scale, out,
        M, N, K,
        x.stride(0), x.stride(1), weight.stride(0), scale.stride(0), out.stride(0), out.stride(1),
        k_per_split,
        BK_S=block_k if block_k < K else K, HAS_BIAS=has_bias, ATOMIC=atomic, NATIVE=native_fp8(x.device),
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        UPCAST_DOT=x.dtype == torch.bfloat16 and interpreting(),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return finish_split_k(out, bias, x.dtype, split_k)


# ----------------------------------------------------------------------------------------------- dispatch


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_k: int,
               bias: torch.Tensor | None = None, w8a8_scales: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """``y = x @ (q · s)ᵀ + bias``; ``x [..., K]`` → ``[..., N]`` in x's dtype: the Triton kernel where Triton runs
    (``use_triton``), else the torch reference. From ``W8A8_MIN_M`` rows, W8A8 (``w8a8_path``); ``w8a8_scales``
    are the weight's scales as the block-wise products take them (``w8a8_weight_scales``)."""
    K = weight.shape[1]
    if x.shape[-1] != K:
        raise ValueError(f"input has {x.shape[-1]} features, the FP8 layer expects {K}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    triton_runs = use_triton(x)
    w8a8 = w8a8_path(x2, weight, block_k, w8a8_scales) if triton_runs else None
    if w8a8 == "row":
        report.record("fp8_gemm", "fp8 w8a8 (per-token activations) torch._scaled_mm")
        y = w8a8_linear(x2, weight, scale, bias)
    elif w8a8 is not None:
        report.record("fp8_gemm", f"fp8 w8a8 (activations per token and 128 inputs, {w8a8} weight scales) "
                                  "torch._scaled_mm")
        y = w8a8_block_linear(x2, weight, w8a8_scales[w8a8], bias)
    elif triton_runs and x2.shape[0] >= DEQUANT_MATMUL_MIN_M:
        report.record("fp8_gemm", "triton fp8 dequant + torch matmul")
        y = torch.nn.functional.linear(x2, fp8_dequantize(weight, scale, block_k, x.dtype), bias)
    elif triton_runs and x2.shape[0] <= GEMV_MAX_M:
        report.record("fp8_gemm", "triton w8a16 fp8 gemv")
        y = fp8_gemv(x2, weight, scale, block_k, bias)
    elif triton_runs:
        report.record("fp8_gemm", "triton w8a16 fp8")
        y = fp8_gemm(x2, weight, scale, block_k, bias)
    else:
        report.record("fp8_gemm", "torch dequant+matmul")
        y = fp8_gemm_reference(x2, weight, scale, block_k, bias)
    return y.reshape(*lead, weight.shape[0])


def w8a8_path(x: torch.Tensor, weight: torch.Tensor, block_k: int,
              w8a8_scales: dict[str, torch.Tensor] | None) -> str | None:
    """Which W8A8 product ``fp8_linear`` runs for ``x [M, K]``, None for none: below ``W8A8_MIN_M`` rows none; from
    ``W8A8_LARGE_M`` rows "row" (per-token, ``w8a8_supported``) or "128x128" where the weight allows; else "1x128"
    where ``w8a8_scales`` has it and the block-wise product runs (``w8a8_block_supported``). Where only row-wise
    products run (torch built before cuBLAS 12.9), weights with one scale a row take the per-token product from
    ``W8A8_LARGE_M`` rows only: below that it was slower than W8A16 (run EO: 19.6 against 11.7 µs for q/k/v at 16
    rows)."""
    M = x.shape[0]
    if not W8A8_MIN_M or M < W8A8_MIN_M:
        return None
    large = M >= W8A8_LARGE_M
    if large and w8a8_supported(x, weight, block_k):
        return "row"
    if not w8a8_scales or not w8a8_block_supported(x, weight, block_k):
        return None
    return "128x128" if large and "128x128" in w8a8_scales else "1x128"   # w8a8_weight_scales: "1x128" always
