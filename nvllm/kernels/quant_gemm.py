"""Weight-only quantized GEMM (W4A16 / W8A16): ``y = x @ dequant(W).T (+ bias)`` for AWQ-GEMM and GPTQ v1.

Inputs: ``x [M, K]`` fp16/bf16/fp32 and one layer's packed tensors (see ``nvllm.quant.formats`` for the two
layouts); output ``[M, N]`` in x's dtype. The fused kernel loads each packed int32 word of a
``[BLOCK_K, BLOCK_N]`` tile once, splits it into its fields in registers, applies the group's zero point and
scale, and feeds ``tl.dot`` with fp32 accumulation, so the weight crosses memory once at 4 (or 8) bits per
element: what matters in decode (small M).

Status (one H200 reading, bf16, CUDA graphs, L2-warm weights; not yet in docs/PERF.md): correct on the GPU
for every format, dtype and M tried, but not yet faster than cuBLAS on the bf16 weight — qkv 3584→4608 at
M=1: 13.7–15.9 µs (GPTQ-4) / 15.9–20.4 µs (AWQ) against 8.7 µs; down 18944→3584: 44–50 / 59–70 µs against
40 µs. Beating cuBLAS needs real kernel work (a load-time re-layout of the packed weight, a GEMV-style
FMA path for M < 16, per-shape configs).

Two layouts, one kernel (constexpr ``AWQ``):
  AWQ-GEMM: element (k, n) lives in word ``qweight[k, n // 8]``, nibble ``AWQ_UNPACK_ORDER[n % 8]``
            = ``(n % 2) * 4 + (n % 8) // 2``; zero point as stored.
  GPTQ v1:  element (k, n) lives in word ``qweight[k // P, n]`` at bits ``(k % P) * bits`` (P = 32 / bits);
            zero point = stored field + 1; the group of input k is ``g_idx[k]`` under act-order.
Groups: contiguous groups with ``group_size % BLOCK_K == 0`` load one scale/zero row per tile; act-order
(``g_idx``) or a tile spanning groups gathers a ``[BLOCK_K, BLOCK_N]`` tile of scales and zeros.
(A faster act-order path — permuting K once at load time so groups become contiguous, and x's columns at run
time — is left for when a GPU measurement asks for it.)

Small M: the grid is (N tiles, M tiles, K splits). When the N×M tiles cannot fill the GPU, K is split (to
about two waves) across programs that ``atomic_add`` into an fp32 buffer (cast and bias afterwards).

Large M: the fused kernel does the dequantization work once per M tile; past some M a dense GEMM is faster.
``quant_linear`` then dequantizes the weight with a Triton kernel into x's dtype and calls ``torch.matmul``
(cuBLAS on GPU). The switch point is ``DEQUANT_MATMUL_MIN_M`` (env ``NVLLM_QUANT_DEQUANT_MIN_M``), from a
first reading only, until it is measured (docs/PERF.md).

This file holds the op's three parts: the torch reference, the Triton kernels and the dispatch.
"""

from __future__ import annotations

import os

import torch

from nvllm.env_vars import env_number
from nvllm.kernels import report
from nvllm.kernels.attention_partials import AttentionPartials
from nvllm.kernels.partial_sum import PartialSum, take
from nvllm.kernels.split_k import finish_split_k, plan_split_k, split_k_output, store_tile
from nvllm.kernels.backend import eager_triton, interpreting, use_triton
from nvllm.kernels.quant_gemv import gemv_supported, gemv_tuned, quant_gemv
from nvllm.quant.formats import QuantWeight

triton, tl, _jit = eager_triton()  # jitted at import (the CPU tests reload under the interpreter)


GEMV_MAX_M = env_number("NVLLM_QUANT_GEMV_MAX_M", 2)
"""Up to this many rows (and contiguous groups), ``quant_linear`` runs the GEMV kernel of ``quant_gemv``. H200,
Qwen2.5-7B projections (docs/PERF.md): at M = 1 the GEMV beat the fused kernel, at M = 2 they tied, from M = 4
on the fused kernel won. Row counts with a measured ``half2`` or ``mma`` config (``quant_gemv.gemv_tuned``: 4-bit
GPTQ, and AWQ repacked to it, up to 8 rows) take the GEMV past this; 0 turns the GEMV off."""

DEQUANT_MATMUL_MIN_M = env_number("NVLLM_QUANT_DEQUANT_MIN_M", 128)
"""From this many rows on, ``quant_linear`` dequantizes and calls a dense matmul. A first H200 reading put
the crossing between M=64 (fused faster on the long-K down_proj shape, slower on qkv) and M=256 (fused 2–3×
slower); to be measured properly and recorded in docs/PERF.md."""


def partial_sums() -> bool:
    """Whether ``quant_linear(..., partial=True)`` may leave a GEMV's split-K sum to its consumer
    (``nvllm.kernels.partial_sum``); ``NVLLM_PARTIAL_SUMS=0`` finishes every sum in the GEMV. Read at each call:
    engines built while it is 0 capture their graphs that way (the GPU benchmark compares both)."""
    return os.environ.get("NVLLM_PARTIAL_SUMS", "1") != "0"


# ---------------------------------------------------------------------------------------------- reference


def quant_gemm_reference(x: torch.Tensor, qw: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Dequantize to fp32 (``formats.dequantize_*``), matmul in fp32, add bias, cast to x's dtype."""
    w = qw.dequantize(torch.float32).to(x.device)                     # [N, K]
    y = torch.nn.functional.linear(x.float(), w, None if bias is None else bias.float())
    return y.to(x.dtype)


# ------------------------------------------------------------------------------------------------- Triton


@_jit
def _field_shifts(BITS: tl.constexpr, AWQ: tl.constexpr):
    """Bit offset of the field holding column ``w*P + i`` (i = 0..P-1) inside packed word ``w``.

    Words are loaded once and split into P fields; the split puts column ``w*P + i`` at tile position
    ``w*P + i`` by reading it from the right field: field i for GPTQ (plain order), and for AWQ the nibble
    ``AWQ_UNPACK_ORDER[i] = (i % 2) * 4 + i // 2`` (the inverse of ORDER = 0, 2, 4, 6, 1, 3, 5, 7)."""
    i = tl.arange(0, 32 // BITS)
    if AWQ:
        return ((i % 2) * 4 + i // 2) * 4
    return i * BITS


@_jit
def _tile_columns(pid_n, N, BITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The N tile's output columns and its packed word columns (qzeros; AWQ qweight), with their masks."""
    PER_WORD: tl.constexpr = 32 // BITS
    WORDS_N: tl.constexpr = BLOCK_N // PER_WORD
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    wn = pid_n * WORDS_N + tl.arange(0, WORDS_N)
    return offs_n, offs_n < N, wn, wn < N // PER_WORD


@_jit
def _dequant_tile(qw_ptr, qz_ptr, s_ptr, gidx_ptr, k0, k_end, offs_n, mask_n, wn, mask_wn,
                  stride_qw, stride_qz, stride_s,
                  BITS: tl.constexpr, AWQ: tl.constexpr, GROUP: tl.constexpr, USE_GIDX: tl.constexpr,
                  UNIFORM_GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """fp32 ``(q - z) * s`` for input rows ``k0 .. k0+BLOCK_K`` (rows >= k_end read as 0) and the tile's
    columns (``_tile_columns``)."""
    PER_WORD: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    WORDS_K: tl.constexpr = BLOCK_K // PER_WORD
    n_fields = _field_shifts(BITS, AWQ)        # fields along N: zero points (both), AWQ weights
    k_fields = tl.arange(0, PER_WORD) * BITS   # fields along K: GPTQ weights
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask_k = offs_k < k_end
    if AWQ:   # qweight [K, N/8]: one word row per input, fields along N
        words = tl.load(qw_ptr + offs_k[:, None] * stride_qw + wn[None, :],
                        mask=mask_k[:, None] & mask_wn[None, :], other=0)
        q = tl.reshape((words[:, :, None] >> n_fields[None, None, :]) & MASK, (BLOCK_K, BLOCK_N))
    else:     # qweight [K/P, N]: fields along K
        wk = k0 // PER_WORD + tl.arange(0, WORDS_K)
        words = tl.load(qw_ptr + wk[:, None] * stride_qw + offs_n[None, :],
                        mask=(wk < k_end // PER_WORD)[:, None] & mask_n[None, :], other=0)
        q = tl.reshape((words[:, None, :] >> k_fields[None, :, None]) & MASK, (BLOCK_K, BLOCK_N))

    if UNIFORM_GROUP:   # the whole tile lies in group k0 // GROUP: one row of scales and zeros
        grp = k0 // GROUP
        s = tl.load(s_ptr + grp * stride_s + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        zw = tl.load(qz_ptr + grp * stride_qz + wn, mask=mask_wn, other=0)
        z = tl.reshape((zw[:, None] >> n_fields[None, :]) & MASK, (BLOCK_N,))[None, :]
    else:               # act-order (g_idx) or a tile spanning groups: gather per row
        if USE_GIDX:
            grp = tl.load(gidx_ptr + offs_k, mask=mask_k, other=0)
        else:
            grp = offs_k // GROUP
        s = tl.load(s_ptr + grp[:, None] * stride_s + offs_n[None, :],
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
        zw = tl.load(qz_ptr + grp[:, None] * stride_qz + wn[None, :],
                     mask=mask_k[:, None] & mask_wn[None, :], other=0)
        z = tl.reshape((zw[:, :, None] >> n_fields[None, None, :]) & MASK, (BLOCK_K, BLOCK_N))
    if not AWQ:
        z = z + 1                                                   # GPTQ v1 stores zero - 1
    # q − z as a float without an int-to-float conversion of every code (a quarter-rate instruction): 2^23 + q has q in
    # its mantissa; subtracting 2^23 + z leaves q − z exactly
    qf = (q | 0x4B000000).to(tl.float32, bitcast=True)
    return (qf - (z.to(tl.float32) + 8388608.0)) * s


@_jit
def _quant_gemm_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, gidx_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk,
    stride_om, stride_on,
    stride_qw, stride_qz, stride_s,           # row strides of qweight, qzeros, scales (columns contiguous)
    k_per_split,                              # K range of one split (a multiple of BLOCK_K)
    BITS: tl.constexpr,
    AWQ: tl.constexpr,                        # True: AWQ-GEMM layout; False: GPTQ v1
    GROUP: tl.constexpr,                      # group size (inputs per scale row)
    USE_GIDX: tl.constexpr,                   # act-order: group of input k is g_idx[k]
    UNIFORM_GROUP: tl.constexpr,              # one group per K tile (contiguous groups, GROUP % BLOCK_K == 0)
    HAS_BIAS: tl.constexpr,
    ATOMIC: tl.constexpr,                     # split-K: atomic_add into an fp32 output
    DOT_PRECISION: tl.constexpr,              # "ieee" for fp32 inputs, "tf32" otherwise (unused for 16-bit)
    UPCAST_DOT: tl.constexpr,                 # CPU interpreter + bf16: feed the dot fp32 copies (see below)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    offs_n, mask_n, wn, mask_wn = _tile_columns(pid_n, N, BITS, BLOCK_N)

    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)   # (tl.full, a builtin: see backend.interpreting)
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=mask_m[:, None] & (offs_k < k_end)[None, :], other=0.0)
        w = _dequant_tile(qw_ptr, qz_ptr, s_ptr, gidx_ptr, k0, k_end, offs_n, mask_n, wn, mask_wn,
                          stride_qw, stride_qz, stride_s,
                          BITS, AWQ, GROUP, USE_GIDX, UNIFORM_GROUP, BLOCK_K, BLOCK_N).to(a.dtype)
        if UPCAST_DOT:
            # same bf16-rounded operands, exact products in fp32: numerically what the GPU dot computes
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)

    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    mask_mn = mask_m[:, None] & mask_n[None, :]
    store_tile(out_ptrs, acc, mask_mn, bias_ptr, offs_n, mask_n, HAS_BIAS, ATOMIC)


@_jit
def _dequant_kernel(
    qw_ptr, qz_ptr, s_ptr, gidx_ptr, out_ptr,
    N, K,
    stride_qw, stride_qz, stride_s, stride_ok,
    BITS: tl.constexpr, AWQ: tl.constexpr, GROUP: tl.constexpr, USE_GIDX: tl.constexpr,
    UNIFORM_GROUP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Writes the dequantized weight transposed, ``out [K, N]`` (ready for ``x @ out``)."""
    pid_n = tl.program_id(0)
    k0 = tl.program_id(1) * BLOCK_K
    offs_n, mask_n, wn, mask_wn = _tile_columns(pid_n, N, BITS, BLOCK_N)
    w = _dequant_tile(qw_ptr, qz_ptr, s_ptr, gidx_ptr, k0, K, offs_n, mask_n, wn, mask_wn,
                      stride_qw, stride_qz, stride_s,
                      BITS, AWQ, GROUP, USE_GIDX, UNIFORM_GROUP, BLOCK_K, BLOCK_N)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + offs_k[:, None] * stride_ok + offs_n[None, :], w.to(out_ptr.dtype.element_ty),
             mask=(offs_k < K)[:, None] & mask_n[None, :])


def _pick_config(M: int, K: int, group: int, act_order: bool, dtype: torch.dtype) -> dict[str, int]:
    """Tile sizes. From one H200 sweep (bf16, CUDA graphs, BLOCK_N 32/64/128 × BLOCK_K 64/128 × split-K on/off,
    qkv 3584→4608 and down 18944→3584, M 1/16/64): BLOCK_N 128, BLOCK_K 128 and split-K to ~2 waves were best
    or within 10% everywhere; no split-K was up to 4× slower on the long-K shape. One rule for every shape."""
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    block_n = 128
    block_k = 32
    for cand in ((64,) if dtype == torch.float32 else (128, 64)):
        if cand <= K and (act_order or group % cand == 0):
            block_k = cand
            break
    stages = 2 if dtype == torch.float32 else 3     # fp32 tiles at 3 stages overflow shared memory
    return {"block_m": block_m, "block_n": block_n, "block_k": block_k, "num_warps": 4, "num_stages": stages}


def quant_gemm(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *,
               fmt: str, bits: int, group_size: int, g_idx: torch.Tensor | None = None,
               bias: torch.Tensor | None = None, split_k: int | None = None, **config: int) -> torch.Tensor:
    """Fused W{bits}A16 GEMM: ``x [M, K]`` times the packed layer (``fmt`` "awq" or "gptq") → ``[M, N]`` in
    x's dtype, fp32 accumulation. ``group_size`` is the resolved size (not -1); ``g_idx`` only for act-order.
    ``split_k=None`` splits K until about two waves of programs fill the device; ``config`` overrides the
    heuristic's ``block_m``, ``block_n``, ``block_k``, ``num_warps``, ``num_stages``."""
    if fmt not in ("awq", "gptq"):
        raise ValueError(f"unknown quantized format {fmt!r}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"quant_gemm takes fp16, bf16 or fp32 activations, got {x.dtype}")
    M, K = x.shape
    N = scales.shape[1]
    packed_k = qweight.shape[0] * (1 if fmt == "awq" else 32 // bits)
    if packed_k != K:
        raise ValueError(f"x has {K} input features, the packed {fmt} weight holds {packed_k}")
    act_order = g_idx is not None
    cfg = _pick_config(M, K, group_size, act_order, x.dtype)
    unknown = set(config) - set(cfg)
    if unknown:
        raise TypeError(f"unknown quant_gemm config keys {sorted(unknown)}")
    cfg.update(config)
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    uniform = (not act_order) and group_size % bk == 0

    if M == 0:  # no tiles to split K over
        return x.new_zeros(0, N)
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    split_k, k_per_split = plan_split_k(tiles, K, bk, x.device, split_k)
    atomic = split_k > 1

    out = split_k_output(M, N, x, split_k)
    grid = (triton.cdiv(N, bn), triton.cdiv(M, bm), split_k)
    dummy = qweight  # placeholder pointer for absent optional tensors (never read)
    _quant_gemm_kernel[grid](
        x, qweight, qzeros, scales, g_idx if act_order else dummy,
        bias if (bias is not None and not atomic) else dummy, out,
        M, N, K,
        x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        qweight.stride(0), qzeros.stride(0), scales.stride(0),
        k_per_split,
        BITS=bits, AWQ=fmt == "awq", GROUP=group_size, USE_GIDX=act_order, UNIFORM_GROUP=uniform,
        HAS_BIAS=bias is not None and not atomic, ATOMIC=atomic,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        UPCAST_DOT=x.dtype == torch.bfloat16 and interpreting(),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return finish_split_k(out, bias, x.dtype, split_k)


def dequantize_triton(qw: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """The dequantized weight transposed, ``[K, N]`` in ``dtype`` (for ``x @ w``), written by one kernel."""
    K, N = qw.in_features, qw.out_features
    out = torch.empty((K, N), device=qw.qweight.device, dtype=dtype)
    act_order = qw.g_idx is not None
    bk = 32 if act_order or qw.group_size % 32 else min(qw.group_size, 64)
    bn = 128
    grid = (triton.cdiv(N, bn), triton.cdiv(K, bk))
    _dequant_kernel[grid](
        qw.qweight, qw.qzeros, qw.scales, qw.g_idx if act_order else qw.qweight, out,
        N, K, qw.qweight.stride(0), qw.qzeros.stride(0), qw.scales.stride(0), out.stride(0),
        BITS=qw.bits, AWQ=qw.fmt == "awq", GROUP=qw.group_size, USE_GIDX=act_order,
        UNIFORM_GROUP=not act_order and qw.group_size % bk == 0, BLOCK_K=bk, BLOCK_N=bn,
    )
    return out


def dequant_matmul(x: torch.Tensor, qw: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Large-M path: dequantize once (Triton) into x's dtype, then a dense ``torch.matmul`` (cuBLAS on GPU)."""
    y = torch.matmul(x, dequantize_triton(qw, x.dtype))
    if bias is not None:
        y += bias.to(y.dtype)
    return y


# ----------------------------------------------------------------------------------------------- dispatch


def quant_linear(x: torch.Tensor, qw: QuantWeight, bias: torch.Tensor | None = None,
                 partial: bool = False) -> torch.Tensor | PartialSum:
    """``y = x @ W.T + bias`` for a quantized layer; ``x [..., K]`` → ``[..., N]`` in x's dtype.

    Triton (``use_triton(x)``): the GEMV kernel up to ``GEMV_MAX_M`` rows (contiguous groups), the fused
    kernel below ``DEQUANT_MATMUL_MIN_M`` rows, Triton dequantize + dense matmul from there on. Otherwise the
    torch reference (dequantize + fp32 matmul). ``partial``: a GEMV call on a 2-D ``x`` returns its unfinished
    ``PartialSum`` (its consumer adds the bias, casts and re-zeroes the accumulator), others the output. ``x`` may be
    a split decode attention's unmerged ``AttentionPartials`` (o_proj): the GEMV merges them when it can, else they
    are merged first."""
    merge = x if isinstance(x, AttentionPartials) else None
    x = x.rows if merge is not None else x   # the merge's destination: shape and dtype, written only by a merge
    if x.shape[-1] != qw.in_features:
        raise ValueError(f"input has {x.shape[-1]} features, the quantized layer expects {qw.in_features}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, qw.in_features)
    m = x2.shape[0]
    triton = use_triton(x)
    gemv = triton and (m <= GEMV_MAX_M or (GEMV_MAX_M > 0 and gemv_tuned(m, qw.in_features, qw.group_size, qw.fmt,
                                                                          qw.bits, qw.out_features))) \
        and gemv_supported(m, qw.in_features, qw.group_size, qw.act_order, fmt=qw.fmt, bits=qw.bits)
    if merge is not None and not gemv:   # only the GEMV may merge: the other paths read the merged rows (x2)
        merge.finish()
    fmt = f"{qw.extra['from']} as {qw.fmt}" if qw.extra.get("from") else qw.fmt   # the kernel report's name
    if gemv:
        report.record("quant_gemm", f"triton w{qw.bits}a16 {fmt} gemv")
        gemv_input = merge if merge is not None else x2
        buf = take(x.device, m * qw.out_features) if partial and x.dim() == 2 and partial_sums() else None
        if buf is not None:
            acc = buf[:m * qw.out_features].view(m, qw.out_features)
            quant_gemv(gemv_input, qw.qweight, qw.qzeros, qw.scales, fmt=qw.fmt, bits=qw.bits,
                       group_size=qw.group_size, acc=acc)
            return PartialSum(acc, bias, x.dtype)
        y = quant_gemv(gemv_input, qw.qweight, qw.qzeros, qw.scales, fmt=qw.fmt, bits=qw.bits,
                       group_size=qw.group_size, bias=bias)
    elif triton and m >= DEQUANT_MATMUL_MIN_M:
        report.record("quant_gemm", f"triton dequant {fmt} + torch matmul")
        y = dequant_matmul(x2, qw, bias)
    elif triton:
        report.record("quant_gemm", f"triton w{qw.bits}a16 {fmt}")
        y = quant_gemm(x2, qw.qweight, qw.qzeros, qw.scales, fmt=qw.fmt, bits=qw.bits,
                       group_size=qw.group_size, g_idx=qw.g_idx, bias=bias)
    else:
        report.record("quant_gemm", "torch dequant+matmul")
        y = quant_gemm_reference(x2, qw, bias)
    return y.reshape(*lead, qw.out_features)
