"""A mixture-of-experts MLP whose experts are stored 4- or 8-bit: ``nvllm.kernels.fused_moe``'s op with each
expert's weight dequantized inside the kernels (W4A16 / W8A16).

    x [T, H], w13: ExpertWeights of [E, 2I, H] (gate rows, then up rows), w2: ExpertWeights of [E, H, I],
    topk_weights [T, k] (fp32), topk_ids [T, k] (int) → out [T, H] in x's dtype

``ExpertWeights`` stacks every expert's GPTQ v1 tensors (``nvllm.quant.formats``): ``qweight`` int32 [E, K/P, N]
(P = 32 / bits fields a word, packed along the input), ``qzeros`` int32 [E, G, N/P] (zero − 1), ``scales``
[E, G, N] and, under act-order, ``g_idx`` int32 [E, K]; AWQ experts are repacked into this layout when they load
(``formats.awq_to_gptq``, exact).

Rounding: as fused_moe's, with each expert's weight ``(q − z)·s``. The reference dequantizes in fp32 and multiplies
in fp32 (``quant_gemm_reference``'s rounding); the GEMV does the same (fp32 products, summed in another order); the
grouped GEMM rounds the dequantized tile to x's dtype for ``tl.dot``, as ``quant_gemm`` does.

This file holds the op's three parts: the torch reference, the Triton kernels and the dispatch. The Triton part has
fused_moe's two paths, chosen the same way from T·k: up to E (token, slot) pairs a GEMV per pair and column tile
(one kernel for both projections: gate/up reads x's row of the pair's token, down the pair's SiLU·mul row and
multiplies by the routing weight), the k weighted terms of a token summed after; larger batches sort the pairs by
expert (``align_tokens``) and run a grouped GEMM with the dequantized tile twice, then weight and sum each token's
terms (``moe_sum``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nvllm.kernels import fused_moe, partial_sum, pdl, report
from nvllm.kernels.activation import silu_and_mul
from nvllm.kernels.partial_sum import PartialSum
from nvllm.kernels.backend import interpreting, use_triton
from nvllm.kernels.fused_moe import _block_rows, experts_reference  # noqa: F401
from nvllm.kernels.jit import lazy_jit
from nvllm.kernels.moe_align import align_tokens
from nvllm.kernels.moe_sum import sum_slots
from nvllm.kernels.quant_gemm import _dequant_tile, _tile_columns  # noqa: F401 (the kernels' helpers)
from nvllm.quant.formats import default_g_idx, dequantize_gptq

tl = None  # triton.language, bound by lazy_jit at the first launch

# The decode GEMV's settings: column tiles of GEMV_BLOCK_N outputs, K steps of up to GEMV_BLOCK_K inputs (a divisor
# of the group size, so that a step reads one row of scales and zeros), GEMV_NUM_WARPS warps, GEMV_NUM_STAGES
# software-pipeline stages, GEMV_STEP_SUM (sum each step, then scale). From an H100 sweep of 48 settings (PERF.md,
# run FD), Qwen3-30B-A3B's 4-bit experts: up to 8 (token, slot) pairs 16 columns, 1 warp, scaled codes (T = 1: 27.3
# µs, against 40.4 for 32 columns, 4 warps) — 32 columns once K is split (below); more pairs 64 columns, 2 warps,
# step sums (T = 4: 59.2 against 138.6 µs). None: chosen by the pairs as just said; a number: that setting always
# (the sweep sets them).
GEMV_BLOCK_N: int | None = None
GEMV_BLOCK_K = 128
GEMV_NUM_WARPS: int | None = None
GEMV_NUM_STAGES = 1
GEMV_STEP_SUM: bool | None = None
# Split K: GEMV_SPLIT_K programs share each (pair, column tile), each adding its partial sum into a zeroed fp32
# accumulator (``partial_sum``) that SiLU·mul (gate/up) or the final cast (down, every slot of a token into its row)
# finishes; at most one K step a split; 1: no split. From an H100 sweep (PERF.md, run FM): up to 8 pairs, 32 columns
# a program and 4 splits (T = 1: Qwen3-30B-A3B 21.7 µs, Mixtral 149.6, against 27.3 and 211.6 unsplit with 16
# columns); more pairs, 4 splits at the settings above (T = 4: 54.5 against 59.9).
GEMV_SPLIT_K = 4
# The grouped GEMM's tiles (``gemm_config``): a dict of any of its keys overrides its choice (the sweep of
# ``scripts/gpu_moe_bench.py --gemm-sweep`` and the tests set it). Read at each call.
GEMM_TILES: dict | None = None

_jit = lazy_jit


@dataclass
class ExpertWeights:
    """Every expert's packed weight of one projection, stacked (module doc); ``group_size`` resolved (not -1)."""

    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor | None
    bits: int
    group_size: int

    @property
    def num_experts(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * (32 // self.bits)

    @property
    def out_features(self) -> int:
        return self.qweight.shape[2]

    def dequantize(self, e: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Expert ``e``'s weight [N, K]."""
        g_idx = self.g_idx[e] if self.g_idx is not None else default_g_idx(self.in_features, self.group_size,
                                                                            self.qweight.device)
        return dequantize_gptq(self.qweight[e], self.qzeros[e], self.scales[e], g_idx, self.bits, dtype)


# ---------------------------------------------------------------------------------------------- reference


def quant_experts_reference(x: torch.Tensor, w13: ExpertWeights, w2: ExpertWeights, topk_weights: torch.Tensor,
                            topk_ids: torch.Tensor) -> torch.Tensor:
    """fused_moe's reference loop over the experts' fp32 dequantized weights."""
    return experts_reference(x, lambda e: (w13.dequantize(e), w2.dequantize(e)), topk_weights, topk_ids)


# ------------------------------------------------------------------------------------------------- Triton


def _quant_moe_gemv_kernel(
    a_ptr, qw_ptr, qz_ptr, s_ptr, gidx_ptr, out_ptr, ids_ptr, weights_ptr,
    N, K, K_SPLIT,                            # the projection's outputs and inputs; inputs a K split
    stride_am, stride_om,                     # a [*, K], out [T·k, N] (last strides 1)
    stride_qe, stride_qw, stride_ze, stride_qz, stride_se, stride_s, stride_ge,  # expert and row strides
    A_ROW_DIV: tl.constexpr,                  # a's row of pair p: p // A_ROW_DIV (k: x's token rows; 1)
    MUL_WEIGHT: tl.constexpr,                 # out = product rounded to a's dtype · weights[p], in fp32
    BITS: tl.constexpr, GROUP: tl.constexpr, USE_GIDX: tl.constexpr,
    BLOCK_N: tl.constexpr, WORDS_K: tl.constexpr,   # columns a program; packed word rows a K step
    STEP_SUM: tl.constexpr,                   # contiguous groups: sum each step, then scale (else scale each code)
    ATOMIC: tl.constexpr,                     # K split: add the fp32 partial into out's row pair // OUT_ROW_DIV
    OUT_ROW_DIV: tl.constexpr,
    PDL: tl.constexpr,                        # programmatic dependent launch (nvllm.kernels.pdl)
):
    """Program (p, n): out[p, n·BLOCK_N : (n+1)·BLOCK_N] = a[p // A_ROW_DIV] @ W[e]ᵀ for those columns,
    e = ids.flat[p]. A K step reads WORDS_K word rows of the tile's columns and splits them into a
    [WORDS_K, P, BLOCK_N] block of codes (P = 32 / BITS) without reshaping; each element's ``(q − z)·s·a`` is added
    in fp32 to an accumulator of that shape, summed once after the loop (``STEP_SUM``: ``(q − z)·a`` summed over the
    step, then times the scales). Without ``USE_GIDX`` a step lies in one group (WORDS_K·P divides GROUP): one row of
    scales and zeros. Stored rounded to a's dtype (``MUL_WEIGHT``: then times the routing weight, in fp32). With
    ``ATOMIC`` program (p, n, z) covers inputs [z·K_SPLIT, (z+1)·K_SPLIT) (a multiple of the step) and adds its fp32
    sum (times the routing weight) into out's row p // OUT_ROW_DIV, unrounded."""
    P: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    z_shift = (offs_n % P) * BITS                                            # a column's field in its qzeros word
    wk = tl.arange(0, WORDS_K)
    fields = tl.arange(0, P)
    k_in = wk[:, None] * P + fields[None, :]                                 # [WORDS_K, P]: a step's inputs
    a_row = a_ptr + (pair // A_ROW_DIV).to(tl.int64) * stride_am
    qw = qw_ptr + expert * stride_qe + wk[:, None] * stride_qw + offs_n[None, :]
    qz = qz_ptr + expert * stride_ze
    sc = s_ptr + expert * stride_se
    acc = tl.full((WORDS_K, P, BLOCK_N), 0.0, tl.float32)
    acc_n = tl.full((BLOCK_N,), 0.0, tl.float32)
    k_lo = tl.program_id(2) * K_SPLIT
    for k0 in range(k_lo, tl.minimum(k_lo + K_SPLIT, K), WORDS_K * P):
        mask_k = k0 + k_in < K
        words = tl.load(qw + (k0 // P) * stride_qw, mask=(k0 // P + wk < K // P)[:, None] & mask_n[None, :], other=0)
        a = tl.load(a_row + k0 + k_in, mask=mask_k, other=0.0).to(tl.float32)
        if USE_GIDX:   # act-order: each input's own group
            grp = tl.load(gidx_ptr + expert * stride_ge + k0 + k_in, mask=mask_k, other=0)[:, :, None]
            s = tl.load(sc + grp * stride_s + offs_n[None, None, :], mask=mask_n[None, None, :], other=0.0)
            zw = tl.load(qz + grp * stride_qz + (offs_n // P)[None, None, :], mask=mask_n[None, None, :], other=0)
            z = ((zw >> z_shift[None, None, :]) & MASK).to(tl.float32)
        else:
            grp = k0 // GROUP
            s = tl.load(sc + grp * stride_s + offs_n, mask=mask_n, other=0.0)[None, None, :]
            zw = tl.load(qz + grp * stride_qz + offs_n // P, mask=mask_n, other=0)
            z = ((zw >> z_shift) & MASK).to(tl.float32)[None, None, :]
        # the codes as floats without an int-to-float conversion (a quarter-rate instruction): 2^23 + q has q in its
        # mantissa, so subtracting 2^23 + z + 1 (GPTQ v1 stores zero − 1) leaves q − z exactly
        q = ((words[:, None, :] >> (fields * BITS)[None, :, None]) & MASK) | 0x4B000000   # [WORDS_K, P, BLOCK_N]
        w = q.to(tl.float32, bitcast=True) - (z + 8388609.0)
        if STEP_SUM and not USE_GIDX:   # one group a step: its sums over the step's inputs, times the scales
            acc_n += tl.sum(tl.sum(w * a[:, :, None], axis=1), axis=0) * tl.reshape(s.to(tl.float32), (BLOCK_N,))
        else:
            acc += w * (s.to(tl.float32) * a[:, :, None])
    total = tl.sum(tl.sum(acc, axis=1), axis=0) + acc_n
    if ATOMIC:
        if MUL_WEIGHT:
            total = total * tl.load(weights_ptr + pair).to(tl.float32)
        tl.atomic_add(out_ptr + (pair // OUT_ROW_DIV).to(tl.int64) * stride_om + offs_n, total, mask=mask_n,
                      sem="relaxed")
    else:
        out = total.to(a_ptr.dtype.element_ty)                                            # F.linear's rounding
        if MUL_WEIGHT:
            out = out.to(tl.float32) * tl.load(weights_ptr + pair).to(tl.float32)
        tl.store(out_ptr + pair.to(tl.int64) * stride_om + offs_n, out.to(out_ptr.dtype.element_ty), mask=mask_n)


def _quant_moe_gemm_kernel(
    a_ptr, qw_ptr, qz_ptr, s_ptr, gidx_ptr, c_ptr, sorted_ids_ptr, block_experts_ptr, num_padded_ptr,
    N, K,                                     # C's columns, the reduction length
    num_valid,                                # T·k: the sentinel, and the rows of C
    stride_am, stride_cm,                     # A [*, K], C [T·k, N] (last strides 1)
    stride_qe, stride_qw, stride_ze, stride_qz, stride_se, stride_s, stride_ge,  # expert and row strides
    TOP_K: tl.constexpr,                      # A's row of sorted row r: r // TOP_K (1: A has C's rows)
    BITS: tl.constexpr, GROUP: tl.constexpr, USE_GIDX: tl.constexpr, UNIFORM_GROUP: tl.constexpr,
    UPCAST: tl.constexpr,                     # interpreter + 16-bit: feed tl.dot fp32 copies (backend.interpreting)
    DOT_PRECISION: tl.constexpr,              # "ieee" for fp32 inputs
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,                        # programmatic dependent launch (nvllm.kernels.pdl)
):
    """fused_moe's grouped GEMM (program (b, n) over sorted block b's rows, sentinels skipped, blocks at or past
    num_padded[0] returning at once) with expert e's [BLOCK_K, BLOCK_N] weight tile dequantized and rounded to A's
    dtype before ``tl.dot``."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid_b = tl.program_id(0)
    if pid_b * BLOCK_M >= tl.load(num_padded_ptr):
        return
    rows, mask_m, expert = _block_rows(sorted_ids_ptr, block_experts_ptr, pid_b, num_valid, BLOCK_M)
    offs_n, mask_n, wn, mask_wn = _tile_columns(tl.program_id(1), N, BITS, BLOCK_N)
    qw = qw_ptr + expert * stride_qe
    qz = qz_ptr + expert * stride_ze
    sc = s_ptr + expert * stride_se
    gi = gidx_ptr + expert * stride_ge
    a_rows = a_ptr + (rows // TOP_K)[:, None] * stride_am
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(a_rows + offs_k[None, :], mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0)
        w = _dequant_tile(qw, qz, sc, gi, k0, K, offs_n, mask_n, wn, mask_wn, stride_qw, stride_qz, stride_s,
                          BITS, False, GROUP, USE_GIDX, UNIFORM_GROUP, BLOCK_K, BLOCK_N).to(a.dtype)
        if UPCAST:
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    out = acc.to(c_ptr.dtype.element_ty)    # F.linear's rounding
    tl.store(c_ptr + rows[:, None] * stride_cm + offs_n[None, :], out, mask=mask_m[:, None] & mask_n[None, :])


_quant_moe_gemm_kernel.helpers = ("_dequant_tile", "_tile_columns", "_block_rows")
_quant_moe_gemm_kernel.do_not_specialize = ("num_valid",)   # varies with the batch (see nvllm.kernels.jit)


def _block_k(w: ExpertWeights, most: int) -> int:
    """K step: at most ``most`` and a divisor of the group size (one row of scales and zeros a step) when the groups
    are contiguous; at least 16 (``tl.dot``) and a whole number of packed words."""
    import triton

    k = max(16, min(most, triton.next_power_of_2(w.in_features)))
    if w.g_idx is None:
        while k > 16 and w.group_size % k:
            k //= 2
    return k


def gemm_config(rows: int, num_experts: int) -> dict:
    """The grouped GEMM's launch for ``rows`` (token, slot) pairs over ``num_experts`` experts: rows a block
    (BLOCK_M, which ``align_tokens`` pads to), columns and inputs a program step (BLOCK_N, BLOCK_K; cut to the
    projection's size and the group), warps and stages. GEMM_TILES overrides any of them.

    From an H100 sweep of the whole op (PERF.md, run FU; Qwen3-30B-A3B's 128 experts and Mixtral's 8, 4-bit g128):
    128 columns throughout; up to 16 pairs an expert blocks of 16 rows and K steps of 128 (Qwen3-30B-A3B at 32
    tokens 248 µs against 279 with the bf16 GEMM's tiles of then, Mixtral 708 against 792); up to 64 blocks of 64
    rows — half of them padding at 32 pairs an expert, yet fewer blocks each reading the expert's weight — and K
    steps of 128 (512 tokens: 388 against 574 µs); beyond, blocks of 128 rows and K steps of 64, which nothing
    swept beat (on an H100, run GA, 14–53% faster than the blocks of 64 rows before from 65 to 127 pairs an
    expert: Qwen3-30B-A3B at 1536 tokens 568.3 µs against 814.3, Mixtral at 384 tokens 1112.0 against 1700.7).
    8-bit and act-order experts take the same tiles; the sweep timed neither."""
    per_expert = rows / num_experts
    block_m = 16 if per_expert <= 16 else 64 if per_expert <= 64 else 128
    config = dict(BLOCK_M=block_m, BLOCK_N=128, BLOCK_K=128 if per_expert <= 64 else 64, num_warps=4, num_stages=3)
    config.update(GEMM_TILES or {})
    return config


def _weight_args(w: ExpertWeights) -> tuple[list, list, dict]:
    """The packed tensors (g_idx's place taken by qweight without act-order), their expert and row strides, and
    the constexprs both kernels take."""
    act_order = w.g_idx is not None
    tensors = [w.qweight, w.qzeros, w.scales, w.g_idx if act_order else w.qweight]
    strides = [w.qweight.stride(0), w.qweight.stride(1), w.qzeros.stride(0), w.qzeros.stride(1), w.scales.stride(0),
               w.scales.stride(1), w.g_idx.stride(0) if act_order else 0]
    return tensors, strides, dict(BITS=w.bits, GROUP=w.group_size, USE_GIDX=act_order)


def _gemv_words(w: ExpertWeights) -> int:
    """Word rows a GEMV K step: at most GEMV_BLOCK_K inputs, a divisor of the group size's words (contiguous
    groups), a power of two."""
    per = 32 // w.bits
    words = max(1, GEMV_BLOCK_K // per)
    while words > 1 and (words * per > w.in_features or (w.g_idx is None and w.group_size % (words * per))):
        words //= 2
    return words


def _gemv_settings(pairs: int) -> tuple[int, int, bool]:
    few = pairs <= 8
    block_n = GEMV_BLOCK_N or ((32 if GEMV_SPLIT_K > 1 else 16) if few else 64)
    return block_n, GEMV_NUM_WARPS or (1 if few else 2), (not few) if GEMV_STEP_SUM is None else GEMV_STEP_SUM


def _gemv_steps(w: ExpertWeights) -> tuple[int, int]:
    """(word rows a K step, K steps over the projection's inputs)."""
    words = _gemv_words(w)
    return words, -(-w.in_features // (words * 32 // w.bits))


def gemv_splits(w: ExpertWeights) -> int:
    """K splits of the GEMV: GEMV_SPLIT_K, at most one K step a split."""
    return max(1, min(GEMV_SPLIT_K, _gemv_steps(w)[1]))


def _gemv(a: torch.Tensor, w: ExpertWeights, out: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor | None,
          a_row_div: int, splits: int = 1, out_row_div: int = 1) -> None:
    """out[p] = a[p // a_row_div] @ W[ids.flat[p]]ᵀ (× weights.flat[p]); with ``splits`` > 1 added (fp32) into
    out[p // out_row_div] instead, which must be zeroed; see ``_quant_moe_gemv_kernel``."""
    import triton

    n, k = w.out_features, w.in_features
    tensors, strides, consts = _weight_args(w)
    pairs = ids.numel()
    block_n, warps, step_sum = _gemv_settings(pairs)
    words, steps = _gemv_steps(w)
    k_split = -(-steps // splits) * (words * 32 // w.bits)     # whole steps a split
    grid = (pairs, triton.cdiv(n, block_n), triton.cdiv(k, k_split))
    _jit(_quant_moe_gemv_kernel)[grid](
        a, *tensors, out, ids, weights if weights is not None else out,
        n, k, k_split, a.stride(0), out.stride(0), *strides,
        A_ROW_DIV=a_row_div, MUL_WEIGHT=weights is not None, **consts, BLOCK_N=block_n, WORDS_K=words,
        STEP_SUM=step_sum, ATOMIC=splits > 1, OUT_ROW_DIV=out_row_div, num_warps=warps, num_stages=GEMV_NUM_STAGES,
        **pdl.launch_args(a),
    )


def _gemm(a: torch.Tensor, w: ExpertWeights, c: torch.Tensor, sorted_ids: torch.Tensor,
          block_experts: torch.Tensor, num_padded: torch.Tensor, top_k: int, config: dict) -> None:
    """C[r] = A[r // top_k] @ W[e]ᵀ (C in A's dtype) over the sorted rows; see ``_quant_moe_gemm_kernel``."""
    import triton

    n, k = w.out_features, w.in_features
    block_n = max(16, min(config["BLOCK_N"], triton.next_power_of_2(n)))
    block_k = _block_k(w, config["BLOCK_K"])
    tensors, strides, consts = _weight_args(w)
    sixteen_bit = a.dtype in (torch.float16, torch.bfloat16)
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _jit(_quant_moe_gemm_kernel)[grid](
        a, *tensors, c, sorted_ids, block_experts, num_padded,
        n, k, c.shape[0], a.stride(0), c.stride(0), *strides,
        TOP_K=top_k, **consts,
        UNIFORM_GROUP=w.g_idx is None and w.group_size % block_k == 0,
        UPCAST=sixteen_bit and interpreting(), DOT_PRECISION="tf32" if sixteen_bit else "ieee",
        BLOCK_M=config["BLOCK_M"], BLOCK_N=block_n, BLOCK_K=block_k, num_warps=config["num_warps"],
        num_stages=config["num_stages"], **pdl.launch_args(a),
    )


def _gemvs(x: torch.Tensor, w13: ExpertWeights, w2: ExpertWeights, weights: torch.Tensor, ids: torch.Tensor
           ) -> torch.Tensor:
    """The GEMV path. Each projection splits K when ``gemv_splits`` says and a zeroed accumulator can be had (not
    during a graph capture before any exists): gate/up's sums are then finished (and the accumulator zeroed) by
    ``silu_and_mul``, down's weighted sums of every slot of a token go into its row, cast once. Unsplit: gate/up
    into [T·k, 2I] in x's dtype, down times the routing weights into fp32 [T·k, H], the k terms summed after."""
    t, top_k = ids.shape
    rows, hidden, inter = ids.numel(), w2.out_features, w2.in_features
    split13, split2 = gemv_splits(w13), gemv_splits(w2)
    acc13 = partial_sum.take(x.device, rows * 2 * inter) if split13 > 1 else None
    split = acc13 is not None
    if split:
        h = acc13[:rows * 2 * inter].view(rows, 2 * inter)
        _gemv(x, w13, h, ids, None, top_k, split13)
        act = silu_and_mul(PartialSum(h, None, x.dtype))
    else:
        h = torch.empty(rows, 2 * inter, dtype=x.dtype, device=x.device)
        _gemv(x, w13, h, ids, None, top_k)
        act = silu_and_mul(h)
    acc2 = partial_sum.take(x.device, t * hidden) if split2 > 1 else None
    report.record("quant_moe", f"triton w{w13.bits}a16 gptq gemv" + (" (split k)" if split or acc2 is not None
                                                                      else ""))
    if acc2 is not None:
        out = acc2[:t * hidden].view(t, hidden)
        _gemv(act, w2, out, ids, weights, 1, split2, top_k)
        return PartialSum(out, None, x.dtype).finish()
    y = torch.empty(rows, hidden, dtype=torch.float32, device=x.device)
    _gemv(act, w2, y, ids, weights, 1)
    return y.view(t, top_k, hidden).sum(1).to(x.dtype)


def quant_experts_triton(x: torch.Tensor, w13: ExpertWeights, w2: ExpertWeights, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor) -> torch.Tensor:
    """Same contract as ``quant_experts_reference``; no host synchronisation (CUDA-graph capturable). T·k ≤ E
    (``fused_moe.SMALL_ROWS`` when set): the GEMVs (``_gemvs``); larger: ``align_tokens``, the grouped GEMM into
    [T·k, 2I], ``silu_and_mul``, the grouped GEMM into [T·k, H], ``moe_sum.sum_slots``. Either way the k terms of a
    token are weighted and summed in fp32 and rounded once."""
    t, top_k = topk_ids.shape
    hidden, inter = w2.out_features, w2.in_features
    assert x.shape == (t, hidden) and x.stride(-1) == 1, (x.shape, hidden)
    assert (w13.out_features, w13.in_features) == (2 * inter, hidden), (w13.qweight.shape, w2.qweight.shape)
    if t == 0:
        return x.new_empty(0, hidden)
    rows = t * top_k
    weights = topk_weights.reshape(-1).contiguous()   # the kernels read it in its dtype
    num_experts = w13.num_experts
    if rows <= (num_experts if fused_moe.SMALL_ROWS is None else fused_moe.SMALL_ROWS):
        return _gemvs(x, w13, w2, weights, topk_ids.contiguous())
    report.record("quant_moe", f"triton w{w13.bits}a16 gptq grouped gemm")
    h = torch.empty(rows, 2 * inter, dtype=x.dtype, device=x.device)
    y = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    config = gemm_config(rows, num_experts)
    sorted_ids, block_experts, num_padded = align_tokens(topk_ids, num_experts, config["BLOCK_M"])
    _gemm(x, w13, h, sorted_ids, block_experts, num_padded, top_k, config)
    _gemm(silu_and_mul(h), w2, y, sorted_ids, block_experts, num_padded, 1, config)
    return sum_slots(y, weights, top_k)


# ----------------------------------------------------------------------------------------------- dispatch


def quant_experts(x: torch.Tensor, w13: ExpertWeights, w2: ExpertWeights, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """The module doc's op. x [T, H] with unit last stride."""
    if use_triton(x):
        return quant_experts_triton(x, w13, w2, topk_weights, topk_ids)
    report.record("quant_moe", "torch dequant reference")
    return quant_experts_reference(x, w13, w2, topk_weights, topk_ids)
