"""Weight-only quantized GEMV for decode (a handful of rows): ``y = x @ dequant(W).T`` without ``tl.dot``.

The fused GEMM in ``quant_gemm`` dequantizes a ``[BLOCK_K, BLOCK_N]`` tile, converts it to the dot-operand
layout (a trip through shared memory) and feeds tensor cores a 16-row tile of which decode uses one row; at
4 bits per weight it is ALU- and shuffle-bound, not memory-bound. This kernel keeps everything in registers
and does less per weight:

* multiply-and-sum on the CUDA cores (``tl.sum`` of ``x[:, :, None] * q[None, :, :]`` over each K tile), the
  K loop software-pipelined (``STAGES``). (A variant that kept a per-word accumulator for GPTQ and reduced
  once after the loop measured 10–30% slower on the H200.)
* the zero point and scale leave the inner loop: within one group ``Σ_k x_k (q_kn − z_n) s_n =
  s_n (Σ_k x_k q_kn − z_n Σ_k x_k)``, so per weight there remain a shift, a mask, the integer → float
  conversion and one FMA; the scale multiply is once per group and column;
* optionally (``MAGIC``) the conversion without a conversion instruction: ``q | 0x4B000000`` read as a
  float32 is ``2^23 + q`` exactly, an OR and a subtraction; on the H200 the plain conversion measured a
  few percent faster, so it is off by default.

It needs every K tile inside one group (contiguous groups, ``group_size % BLOCK_K == 0``); act-order and
large M stay with ``quant_gemm``. K is split across programs (fp32 ``atomic_add``) until about two waves of
programs fill the GPU. The torch reference is ``quant_gemm.quant_gemm_reference``; which rows go here is
decided by ``quant_gemm.quant_linear`` (``GEMV_MAX_M``).
"""

from __future__ import annotations

import torch

from nvllm.kernels.split_k import finish_split_k, plan_split_k, split_k_output, store_tile
from nvllm.kernels.backend import eager_triton

triton, tl, _jit = eager_triton()  # jitted at import (the CPU tests reload under the interpreter)


@_jit
def _quant_gemv_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_om,
    stride_qw, stride_qz, stride_s,           # row strides of qweight, qzeros, scales (columns contiguous)
    k_per_split,                              # K range of one split (a multiple of BLOCK_K)
    BITS: tl.constexpr,
    AWQ: tl.constexpr,                        # True: AWQ-GEMM layout (fields along N); False: GPTQ v1 (along K)
    GROUP: tl.constexpr,                      # group size, a multiple of BLOCK_K
    MAGIC: tl.constexpr,                      # integer → float through the 2^23 bit pattern
    HAS_BIAS: tl.constexpr,
    ATOMIC: tl.constexpr,                     # split-K: atomic_add into an fp32 output
    STAGES: tl.constexpr,                     # software-pipeline depth of the K loop (1 = none)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    PER_WORD: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    WORDS_N: tl.constexpr = BLOCK_N // PER_WORD
    wn = pid_n * WORDS_N + tl.arange(0, WORDS_N)                 # packed word columns (qzeros; AWQ qweight)
    mask_wn = wn < N // PER_WORD
    field = tl.arange(0, PER_WORD)
    if AWQ:
        n_shift = ((field % 2) * 4 + field // 2) * 4              # AWQ nibble order 0, 2, 4, 6, 1, 3, 5, 7
    else:
        n_shift = field * BITS

    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        if AWQ:   # qweight [K, N/8]
            words = tl.load(qw_ptr + offs_k[:, None] * stride_qw + wn[None, :],
                            mask=mask_k[:, None] & mask_wn[None, :], other=0, eviction_policy="evict_first")
            q = tl.reshape((words[:, :, None] >> n_shift[None, None, :]) & MASK, (BLOCK_K, BLOCK_N))
        else:     # qweight [K/P, N]
            WORDS_K: tl.constexpr = BLOCK_K // PER_WORD
            wk = k0 // PER_WORD + tl.arange(0, WORDS_K)
            words = tl.load(qw_ptr + wk[:, None] * stride_qw + offs_n[None, :],
                            mask=(wk < k_end // PER_WORD)[:, None] & mask_n[None, :], other=0,
                            eviction_policy="evict_first")
            q = tl.reshape((words[:, None, :] >> (field * BITS)[None, :, None]) & MASK, (BLOCK_K, BLOCK_N))
        if MAGIC:
            qf = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        else:
            qf = q.to(tl.float32)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        part = tl.sum(x[:, :, None] * qf[None, :, :], axis=1)      # [BLOCK_M, BLOCK_N]: Σ_k x q
        xsum = tl.sum(x, axis=1)                                    # [BLOCK_M]: Σ_k x
        grp = k0 // GROUP
        s = tl.load(s_ptr + grp * stride_s + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        zw = tl.load(qz_ptr + grp * stride_qz + wn, mask=mask_wn, other=0)
        z = tl.reshape((zw[:, None] >> n_shift[None, :]) & MASK, (BLOCK_N,)).to(tl.float32)
        if not AWQ:
            z = z + 1.0                                              # GPTQ v1 stores zero − 1
        acc += s[None, :] * (part - xsum[:, None] * z[None, :])

    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    mask_mn = mask_m[:, None] & mask_n[None, :]
    store_tile(out_ptrs, acc, mask_mn, bias_ptr, offs_n, mask_n, HAS_BIAS, ATOMIC)


def gemv_supported(M: int, K: int, group_size: int, act_order: bool, block_k: int | None = None) -> bool:
    """Whether ``quant_gemv`` can take this call: few rows, contiguous groups that whole K tiles fit in."""
    bk = block_k or pick_gemv_config(M, K, group_size)["block_k"]
    return M <= 16 and not act_order and group_size % bk == 0 and K % bk == 0


def pick_gemv_config(M: int, K: int, group_size: int) -> dict[str, int]:
    """Tile sizes: BLOCK_M covers the rows, BLOCK_K shrinks as rows grow (the [M, K, N] products live in
    registers), the largest of 128/64/32 that divides the group. H200 sweep (scripts/gpu_quant_bench.py, the
    Qwen2.5-7B projections, M 1–2): 128 × 128 tiles, 4 warps, a 3-stage K loop were best or within 10% on
    every shape but GPTQ down (M = 1), for both layouts."""
    block_m = 1 << max(0, (M - 1).bit_length())
    want_k = 128 if block_m <= 2 else 64 if block_m <= 4 else 32
    block_k = next((c for c in (want_k, 64, 32, 16) if c <= want_k and group_size % c == 0 and K % c == 0), 16)
    block_n = 128 if block_m <= 2 else 64
    return {"block_m": block_m, "block_n": block_n, "block_k": block_k, "num_warps": 4, "magic": 0, "stages": 3}


def quant_gemv(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *,
               fmt: str, bits: int, group_size: int, bias: torch.Tensor | None = None,
               split_k: int | None = None, **config: int) -> torch.Tensor:
    """``x [M, K]`` (M ≤ 16, contiguous rows) times the packed layer → ``[M, N]`` in x's dtype, fp32 math.
    ``config`` overrides ``block_m``, ``block_n``, ``block_k``, ``num_warps``, ``magic`` (0/1), ``stages``."""
    M, K = x.shape
    N = scales.shape[1]
    cfg = pick_gemv_config(M, K, group_size)
    unknown = set(config) - set(cfg)
    if unknown:
        raise TypeError(f"unknown quant_gemv config keys {sorted(unknown)}")
    cfg.update(config)
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    if bm < M or not gemv_supported(M, K, group_size, False, bk):
        raise ValueError(f"quant_gemv cannot take M={M}, K={K}, group {group_size} with block_m {bm}, "
                         f"block_k {bk}")
    if x.stride(1) != 1:
        x = x.contiguous()
    n_tiles = triton.cdiv(N, bn)
    split_k, k_per_split = plan_split_k(n_tiles, K, bk, x.device, split_k)
    atomic = split_k > 1
    out = split_k_output(M, N, x, split_k)
    if M == 0:
        return out.to(x.dtype)
    _quant_gemv_kernel[(n_tiles, split_k)](
        x, qweight, qzeros, scales, bias if (bias is not None and not atomic) else qweight, out,
        M, N, K, x.stride(0), out.stride(0),
        qweight.stride(0), qzeros.stride(0), scales.stride(0), k_per_split,
        BITS=bits, AWQ=fmt == "awq", GROUP=group_size, MAGIC=bool(cfg["magic"]),
        HAS_BIAS=bias is not None and not atomic, ATOMIC=atomic,
        STAGES=cfg["stages"], BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=cfg["num_warps"],
    )
    return finish_split_k(out, bias, x.dtype, split_k)
