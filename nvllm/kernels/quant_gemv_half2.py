"""GPTQ 4-bit GEMV for one row with packed half-precision math (``quant_gemv`` variant ``half2``).

The ``row`` variant spends about 4.3 instructions per weight at one row (ncu, PERF run AB: GPTQ gate_up ran 18.3 M
warp instructions, as much issue time as the int4 floor's memory time), so no occupancy reaches the floor. Here a
packed GPTQ word — eight inputs of one column — is dequantized two fields at a time as an f16x2 pair: one ``lop3``
ORs fields f and f + 4 into the bit pattern of 1024.0 (``0x6400``) where they lie (fields 0/4 at bits 0/16 read
1024 + q, fields 1/5 at bits 4/20 read 1024 + 16 q; one shift by 8 brings fields 2, 3, 6, 7 there), one
``sub.f16x2`` of (1024 + z) or (1024 + 16 z) leaves q − z or 16 (q − z) exactly, and one ``fma.rn.f16x2`` multiplies
it into an f16x2 accumulator by the inputs (x_f, x_{f+4}) packed the same way (divided by 16 for the fields read
times 16). The word's two halves are summed in fp32: 17 instructions per word of eight weights. bf16 inputs are read
two to a 32-bit word (an int32 view of x) and packed into the pairs by a second piece of PTX. Counted in the sm_90
cubin, the loop runs 3.3–4.0 instructions per weight; on the H200 (PERF run AE) the 28 layers' GEMVs of a
Qwen2.5-7B-shaped model took 1.44 ms against 1.97 ms with ``row``.

Input pairs: packing a word row's eight inputs into the four pairs takes about 20 instructions, and every lane did
it for every word row, for its eight columns. With ``X_PAIRS`` each program packs its K range once — each lane its
own rows — into a scratch of its own, and the loop reads four words per word row back: 1385 instead of 1571 SASS
instructions per K step of 64, 28 layers' GEMVs 1.288 instead of 1.314 ms (PERF run BK).

Splits of one K step (q/k/v and o_proj: K = 3584 in 56 splits of 64): with ``EARLY`` the step's eight word rows,
scales and zeros go straight into registers, and with ``EARLY == 2`` before the PDL wait — while the previous kernel
still runs — instead of being asked of L2; after the wait only the inputs are read. Same summation order, same bits.
On the H200 q/k/v took 4.20–4.25 instead of 4.63–5.05 µs and batch-1 TPOT moved 1.699–1.703 → 1.695–1.699 ms
(PERF runs CS, CT); loading them after the wait (``EARLY == 1``) was slower than the prefetch.

Precision: per program the inputs of its K range are scaled by a power of two so that |x| < 512 — the products and
the four-term half sums stay below 2^15, far from f16's 65504 — and the scale is undone exactly at the end; each
product and half sum is rounded to f16 (11 significant bits, the accuracy of an fp16 dot product of 4 terms), each
word's sum and everything after it is fp32. Scales multiply once per group and column, in fp32, as in ``row``.

Under the Triton interpreter (the CPU tests) the same steps run as Triton f16 operations instead of the inline PTX.
The torch reference is ``quant_gemm.quant_gemm_reference``; ``quant_gemv.quant_gemv`` launches this kernel.
"""

from __future__ import annotations

from nvllm.kernels.backend import eager_triton
from nvllm.kernels.prefetch import start_split
from nvllm.kernels.quant_gemv_tile import _epilogue as epilogue, _words as words_of  # shared by the variants

triton, tl, _jit = eager_triton()  # jitted at import (the CPU tests reload under the interpreter)

# one packed word (fields 0..7 = inputs 8w + 0..7) · its eight inputs, as f16x2 pairs: fields (0, 4) sit at bits 0
# and 16, (1, 5) at bits 4 and 20 — read in place as 1024 + 16 q, against inputs pre-scaled by 1/16 — and after one
# shift by 8, (2, 6) and (3, 7) likewise. $1 the word, $2 (1024 + z) twice, $3 (1024 + 16 z) twice, $4..$7 the input
# pairs (0, 4), (1, 5)/16, (2, 6), (3, 7)/16; $0 the fp32 sum
_WORD_DOT_PTX = """
{
.reg .b32 t, a, acc;
.reg .b16 lo, hi;
.reg .f32 flo, fhi;
lop3.b32 t, $1, 0x000F000F, 0x64006400, 0xEA;
sub.f16x2 t, t, $2;
mul.rn.f16x2 acc, t, $4;
lop3.b32 t, $1, 0x00F000F0, 0x64006400, 0xEA;
sub.f16x2 t, t, $3;
fma.rn.f16x2 acc, t, $5, acc;
shr.b32 a, $1, 8;
lop3.b32 t, a, 0x000F000F, 0x64006400, 0xEA;
sub.f16x2 t, t, $2;
fma.rn.f16x2 acc, t, $6, acc;
lop3.b32 t, a, 0x00F000F0, 0x64006400, 0xEA;
sub.f16x2 t, t, $3;
fma.rn.f16x2 acc, t, $7, acc;
mov.b32 {lo, hi}, acc;
cvt.f32.f16 flo, lo;
cvt.f32.f16 fhi, hi;
add.f32 $0, flo, fhi;
}
"""
_WORD_DOT = tl.constexpr(_WORD_DOT_PTX) if tl is not None else _WORD_DOT_PTX  # a global a kernel may read

# the four input pairs of a word row from eight bf16 inputs read as four 32-bit words ($4..$7: (x0, x1), (x2, x3),
# (x4, x5), (x6, x7)), times the program's scale $8 (and 1/16 for the odd pairs): a bf16 is the top half of its fp32
_PAIRS_PTX = """
{
.reg .b32 t0, t1;
.reg .f32 f0, f1, s16;
mul.f32 s16, $8, 0f3D800000;
shl.b32 t0, $4, 16;
shl.b32 t1, $6, 16;
mul.f32 f0, t0, $8;
mul.f32 f1, t1, $8;
cvt.rn.f16x2.f32 $0, f1, f0;
and.b32 t0, $4, 0xFFFF0000;
and.b32 t1, $6, 0xFFFF0000;
mul.f32 f0, t0, s16;
mul.f32 f1, t1, s16;
cvt.rn.f16x2.f32 $1, f1, f0;
shl.b32 t0, $5, 16;
shl.b32 t1, $7, 16;
mul.f32 f0, t0, $8;
mul.f32 f1, t1, $8;
cvt.rn.f16x2.f32 $2, f1, f0;
and.b32 t0, $5, 0xFFFF0000;
and.b32 t1, $7, 0xFFFF0000;
mul.f32 f0, t0, s16;
mul.f32 f1, t1, s16;
cvt.rn.f16x2.f32 $3, f1, f0;
}
"""
_PAIRS = tl.constexpr(_PAIRS_PTX) if tl is not None else _PAIRS_PTX


@_jit
def _pair(lo, hi):
    """Two fp32 values as one f16x2 word (``lo`` in the low half)."""
    return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.uint32,
                                     is_pure=True, pack=1)


@_jit
def _word_dot_ops(words, z, x0, x1, x2, x3, x4, x5, x6, x7):
    """The interpreter's Σ_f x_f (q_f − z) over the eight fields of each word: f16 products and half sums, then
    fp32."""
    zh = z.to(tl.float16)
    acc_lo = ((words & 15).to(tl.float16) - zh) * x0.to(tl.float16)
    acc_hi = (((words >> 16) & 15).to(tl.float16) - zh) * x4.to(tl.float16)
    acc_lo += (((words >> 4) & 15).to(tl.float16) - zh) * x1.to(tl.float16)
    acc_hi += (((words >> 20) & 15).to(tl.float16) - zh) * x5.to(tl.float16)
    acc_lo += (((words >> 8) & 15).to(tl.float16) - zh) * x2.to(tl.float16)
    acc_hi += (((words >> 24) & 15).to(tl.float16) - zh) * x6.to(tl.float16)
    acc_lo += (((words >> 12) & 15).to(tl.float16) - zh) * x3.to(tl.float16)
    acc_hi += (((words >> 28) & 15).to(tl.float16) - zh) * x7.to(tl.float16)
    return acc_lo.to(tl.float32) + acc_hi.to(tl.float32)


@_jit
def _pairs(x_ptr, kb, sc, X_WORDS: tl.constexpr):
    """The four f16x2 input pairs of the word row at input kb: from bf16 inputs read as 32-bit words (``X_WORDS``:
    ``x_ptr`` is then an int32 view) or from inputs of any type one by one."""
    if X_WORDS:
        j = kb // 2 + tl.arange(0, 1)
        return tl.inline_asm_elementwise(
            _PAIRS, "=r,=r,=r,=r,r,r,r,r,f",
            [tl.load(x_ptr + j), tl.load(x_ptr + j + 1), tl.load(x_ptr + j + 2), tl.load(x_ptr + j + 3), sc],
            dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=True, pack=1)
    else:
        s16 = sc * 0.0625
        return (_pair(_x(x_ptr, kb, sc), _x(x_ptr, kb + 4, sc)),
                _pair(_x(x_ptr, kb + 1, s16), _x(x_ptr, kb + 5, s16)),
                _pair(_x(x_ptr, kb + 2, sc), _x(x_ptr, kb + 6, sc)),
                _pair(_x(x_ptr, kb + 3, s16), _x(x_ptr, kb + 7, s16)))


@_jit
def _pair_ops(lo, hi):
    """The interpreter's ``_pair``: the f16 bits of two fp32 values in one 32-bit word."""
    bits_lo = lo.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
    return (hi.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32) << 16) | bits_lo


@_jit
def _half(p, shift: tl.constexpr):
    return ((p >> shift) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@_jit
def _word_dot_pairs_ops(words, z, p0, p1, p2, p3):
    """The interpreter's ``_WORD_DOT`` from the four input pairs (the odd ones hold x / 16, exactly)."""
    return _word_dot_ops(words, z, _half(p0, 0), _half(p1, 0) * 16.0, _half(p2, 0), _half(p3, 0) * 16.0,
                         _half(p0, 16), _half(p1, 16) * 16.0, _half(p2, 16), _half(p3, 16) * 16.0)


@_jit
def _zero_consts(zw, zshift):
    """Each column's zero point from its packed GPTQ zeros word (v1 stores zero − 1), and the two f16x2 constants
    ``_WORD_DOT`` subtracts: (1024 + z) twice and (1024 + 16 z) twice."""
    z = ((zw >> zshift) & 15) + 1
    return z, (0x6400 + z).to(tl.uint32) * 0x10001, (0x6400 + 16 * z).to(tl.uint32) * 0x10001


@_jit
def _row_dot(words, xp, j, z, z1, z16, INTERPRET: tl.constexpr):
    """One word row's dot with its input pairs, the four words at ``xp + j`` of the program's scratch."""
    pj = xp + j + tl.arange(0, 1)
    p0, p1, p2, p3 = tl.load(pj), tl.load(pj + 1), tl.load(pj + 2), tl.load(pj + 3)
    if INTERPRET:
        return _word_dot_pairs_ops(words, z, p0, p1, p2, p3)
    return tl.inline_asm_elementwise(_WORD_DOT, "=f,r,r,r,r,r,r,r", [words, z1, z16, p0, p1, p2, p3],
                                     dtype=tl.float32, is_pure=True, pack=1)


@_jit
def _merged_pairs(x_ptr, xp, lse_ptr, po_ptr, n_live, num_splits, k_begin, k_end, X_SPAN: tl.constexpr,
                  HEAD_DIM: tl.constexpr, PO_D: tl.constexpr, MERGE_S: tl.constexpr, MERGE_C: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """``_scratch_pairs`` of a split decode attention's unmerged output (``attention_partials``). The split's inputs
    lie in one head h; each is Σ_s w_s o_s / Σ_s w_s over the ``n_live`` partitions that hold tokens, w_s =
    exp2(lse_s − max lse), rounded to x's dtype: stage 2's formula (``decode_attention``). The log-sum-exps and the
    first ``MERGE_C`` partitions' outputs (rows of X_SPAN contiguous floats) are loaded together: one trip to
    memory up to ``MERGE_C`` partitions, one more per ``MERGE_C`` after that."""
    k = tl.arange(0, X_SPAN)
    ok = k < k_end - k_begin
    h = k_begin // HEAD_DIM
    d = k_begin - h * HEAD_DIM + k
    lse_row = lse_ptr + h * num_splits
    po_row = po_ptr + (h * num_splits).to(tl.int64) * PO_D
    s = tl.arange(0, MERGE_S)
    lse = tl.load(lse_row + s, mask=s < n_live, other=float("-inf"))
    c = tl.arange(0, MERGE_C)
    live = c < n_live
    o = tl.load(po_row + c[:, None] * PO_D + d[None, :], mask=live[:, None] & ok[None, :], other=0.0)
    lse_c = tl.load(lse_row + c, mask=live, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)           # no tokens: weights 0, inputs 0
    w_sum = tl.sum(tl.exp2(lse - lse_max), 0)
    x = tl.sum(o * tl.exp2(lse_c - lse_max)[:, None], 0)
    for c0 in range(MERGE_C, n_live, MERGE_C):                            # longer contexts: a chunk at a time
        live = c0 + c < n_live
        o = tl.load(po_row + (c0 + c)[:, None] * PO_D + d[None, :], mask=live[:, None] & ok[None, :], other=0.0)
        w = tl.exp2(tl.load(lse_row + c0 + c, mask=live, other=float("-inf")) - lse_max)
        x += tl.sum(o * w[:, None], 0)
    x = (x / tl.where(w_sum > 0, w_sum, 1.0)).to(x_ptr.dtype.element_ty).to(tl.float32)
    # the scratch's four words of word row r: (x[8r + j], x[8r + j + 4]) for j < 4, times the scale (j odd: / 16)
    sc, unscale = _pow2_scale(tl.max(tl.abs(x), 0))
    lo, hi = tl.split(tl.permute(tl.reshape(x, (X_SPAN // 8, 2, 4)), (0, 2, 1)))
    j = tl.arange(0, 4)[None, :]
    f = tl.where(j % 2 == 0, sc, sc * 0.0625)
    r = tl.arange(0, X_SPAN // 8)[:, None]
    if INTERPRET:
        tl.store(xp + 4 * r + j, _pair_ops(lo * f, hi * f))
    else:
        tl.store(xp + 4 * r + j, _pair(lo * f, hi * f))
    return unscale


@_jit
def _scratch_pairs(x_ptr, xp, k_begin, k_end, X_SPAN: tl.constexpr, INTERPRET: tl.constexpr):
    """The split's inputs as f16x2 pairs, written once to the program's scratch ``xp`` (four words per word row:
    the ``_pairs`` of that row): each lane packs its own rows instead of every lane packing every row. Returns
    the power-of-two scale's inverse; the caller's barrier makes the pairs visible to every lane."""
    r = tl.arange(0, X_SPAN // 8)
    xr = x_ptr + k_begin + 8 * r
    ok = 8 * r < k_end - k_begin
    x0 = tl.load(xr, mask=ok, other=0.0).to(tl.float32)
    x1 = tl.load(xr + 1, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(xr + 2, mask=ok, other=0.0).to(tl.float32)
    x3 = tl.load(xr + 3, mask=ok, other=0.0).to(tl.float32)
    x4 = tl.load(xr + 4, mask=ok, other=0.0).to(tl.float32)
    x5 = tl.load(xr + 5, mask=ok, other=0.0).to(tl.float32)
    x6 = tl.load(xr + 6, mask=ok, other=0.0).to(tl.float32)
    x7 = tl.load(xr + 7, mask=ok, other=0.0).to(tl.float32)
    m = tl.maximum(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)), tl.maximum(tl.abs(x2), tl.abs(x3))),
                   tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)), tl.maximum(tl.abs(x6), tl.abs(x7))))
    sc, unscale = _pow2_scale(tl.max(m))
    s16 = sc * 0.0625
    if INTERPRET:
        tl.store(xp + 4 * r, _pair_ops(x0 * sc, x4 * sc))
        tl.store(xp + 4 * r + 1, _pair_ops(x1 * s16, x5 * s16))
        tl.store(xp + 4 * r + 2, _pair_ops(x2 * sc, x6 * sc))
        tl.store(xp + 4 * r + 3, _pair_ops(x3 * s16, x7 * s16))
    else:
        tl.store(xp + 4 * r, _pair(x0 * sc, x4 * sc))
        tl.store(xp + 4 * r + 1, _pair(x1 * s16, x5 * s16))
        tl.store(xp + 4 * r + 2, _pair(x2 * sc, x6 * sc))
        tl.store(xp + 4 * r + 3, _pair(x3 * s16, x7 * s16))
    return unscale


@_jit
def _x(x_ptr, k, sc):
    return tl.load(x_ptr + k + tl.arange(0, 1)).to(tl.float32) * sc


@_jit
def _pow2_scale(m):
    """For inputs whose largest magnitude is ``m``: the power of two that brings them below 512, 2^(8 − E) with
    E = floor(log2 m) (clamped to keep both powers normal), and its inverse."""
    e = tl.minimum(tl.maximum((m.to(tl.int32, bitcast=True) >> 23) & 255, 8), 253)   # biased exponent of m
    return ((262 - e) << 23).to(tl.float32, bitcast=True), ((e - 8) << 23).to(tl.float32, bitcast=True)


@_jit
def quant_gemv_half2_kernel(
    x_ptr, xw_ptr, qw_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr, xp_ptr,
    lse_ptr, po_ptr, ctx_ptr, merge_splits, merge_partition,   # MERGE: attention partials [1, H, S] / [1, H, S, PO_D]
    N, K,
    stride_qw, stride_qz, stride_s,           # row strides of qweight [K/8, N], qzeros, scales
    k_per_split,                              # K range of one split (a multiple of BLOCK_K)
    GROUP: tl.constexpr,                      # group size, a multiple of BLOCK_K
    HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr, SERIAL: tl.constexpr, STAGES: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INTERPRET: tl.constexpr,                  # Triton f16 operations instead of the inline PTX
    X_WORDS: tl.constexpr,                    # bf16 inputs, also passed as an int32 view (xw_ptr)
    X_SPAN: tl.constexpr,                     # a power of two ≥ k_per_split: the inputs' max in one load (0: a loop)
    X_PAIRS: tl.constexpr,                    # with X_SPAN: the split's input pairs built once into the program's
                                              # scratch (xp_ptr, X_SPAN / 2 words) and read back per word row
    PREFETCH: tl.constexpr,                   # word rows of the split asked of L2 before the PDL wait (prefetch.py)
    EARLY: tl.constexpr,                      # with X_PAIRS, a split of one K step of 64: its words, scales and
                                              # zeros loaded before its inputs (1: after the PDL wait, 2: before)
    MERGE: tl.constexpr,                      # with X_PAIRS: the inputs are a split decode attention's unmerged
                                              # partials (``_merged_pairs``), x_ptr only gives their dtype
    HEAD_DIM: tl.constexpr, PO_D: tl.constexpr, MERGE_S: tl.constexpr, MERGE_C: tl.constexpr,
    PDL: tl.constexpr,
):
    if MERGE:   # the context length is staged before the step: read before the PDL wait
        tl.static_assert(X_PAIRS, "MERGE: the merged inputs go to the pairs' scratch")
        ctx = tl.load(ctx_ptr)
        n_live = (ctx + merge_partition - 1) // merge_partition
    pid_n, pid_k, k_begin, k_end = start_split(qw_ptr, stride_qw, k_per_split, K, N, BLOCK_N,
                                               0 if EARLY == 2 else PREFETCH, PDL and EARLY != 2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    if EARLY:
        tl.static_assert(BLOCK_K == 64 and X_PAIRS, "EARLY: one K step of eight word rows, pairs in the scratch")
        grp0 = k_begin // GROUP
        s0 = tl.load(s_ptr + grp0 * stride_s + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        zw0 = tl.load(qz_ptr + grp0 * stride_qz + offs_n // 8, mask=mask_n, other=0)
        row = qw_ptr + (k_begin // 8) * stride_qw + offs_n
        w0 = words_of(row, mask_n)
        w1 = words_of(row + stride_qw, mask_n)
        w2 = words_of(row + 2 * stride_qw, mask_n)
        w3 = words_of(row + 3 * stride_qw, mask_n)
        w4 = words_of(row + 4 * stride_qw, mask_n)
        w5 = words_of(row + 5 * stride_qw, mask_n)
        w6 = words_of(row + 6 * stride_qw, mask_n)
        w7 = words_of(row + 7 * stride_qw, mask_n)
        if EARLY == 2 and PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
    # the power of two that brings this program's inputs below 512: 2^(8 − E), E = floor(log2 max |x|)
    if X_PAIRS:
        xp = xp_ptr + (pid_k * tl.num_programs(0) + pid_n).to(tl.int64) * (X_SPAN // 2)
        if MERGE:
            unscale = _merged_pairs(x_ptr, xp, lse_ptr, po_ptr, n_live, merge_splits, k_begin, k_end, X_SPAN,
                                    HEAD_DIM, PO_D, MERGE_S, MERGE_C, INTERPRET)
        else:
            unscale = _scratch_pairs(x_ptr, xp, k_begin, k_end, X_SPAN, INTERPRET)
        sc = 1.0
        tl.debug_barrier()                                   # every lane's pairs written before any is read
    elif X_SPAN:   # one load: one memory latency before the weights can be multiplied, not one per K step
        offs_x = k_begin + tl.arange(0, X_SPAN)
        m = tl.max(tl.abs(tl.load(x_ptr + offs_x, mask=offs_x < k_end, other=0.0).to(tl.float32)))
    else:
        m = 0.0
        for k0 in range(k_begin, k_end, BLOCK_K):
            m = tl.maximum(m, tl.max(tl.abs(tl.load(x_ptr + k0 + tl.arange(0, BLOCK_K)).to(tl.float32))))
    if not X_PAIRS:
        sc, unscale = _pow2_scale(m)
    zshift = (offs_n % 8) * 4
    acc = tl.full((BLOCK_N,), 0.0, tl.float32)
    if EARLY:
        z, z1, z16 = _zero_consts(zw0, zshift)
        part = _row_dot(w0, xp, 0, z, z1, z16, INTERPRET)           # summed in the loop's order: the same bits
        part += _row_dot(w1, xp, 4, z, z1, z16, INTERPRET)
        part += _row_dot(w2, xp, 8, z, z1, z16, INTERPRET)
        part += _row_dot(w3, xp, 12, z, z1, z16, INTERPRET)
        part += _row_dot(w4, xp, 16, z, z1, z16, INTERPRET)
        part += _row_dot(w5, xp, 20, z, z1, z16, INTERPRET)
        part += _row_dot(w6, xp, 24, z, z1, z16, INTERPRET)
        part += _row_dot(w7, xp, 28, z, z1, z16, INTERPRET)
        acc += s0 * part
    else:
        for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=STAGES):
            grp = k0 // GROUP
            s = tl.load(s_ptr + grp * stride_s + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            zw = tl.load(qz_ptr + grp * stride_qz + offs_n // 8, mask=mask_n, other=0)
            z, z1, z16 = _zero_consts(zw, zshift)
            for w in tl.static_range(BLOCK_K // 8):
                words = words_of(qw_ptr + (k0 // 8 + w) * stride_qw + offs_n, mask_n)    # [BLOCK_N]
                kb = k0 + 8 * w
                if X_PAIRS:
                    d = _row_dot(words, xp, (kb - k_begin) // 2, z, z1, z16, INTERPRET)
                elif INTERPRET:
                    d = _word_dot_ops(words, z, _x(x_ptr, kb, sc), _x(x_ptr, kb + 1, sc), _x(x_ptr, kb + 2, sc),
                                      _x(x_ptr, kb + 3, sc), _x(x_ptr, kb + 4, sc), _x(x_ptr, kb + 5, sc),
                                      _x(x_ptr, kb + 6, sc), _x(x_ptr, kb + 7, sc))
                else:
                    p0, p1, p2, p3 = _pairs(xw_ptr if X_WORDS else x_ptr, kb, sc, X_WORDS)
                    d = tl.inline_asm_elementwise(_WORD_DOT, "=f,r,r,r,r,r,r,r", [words, z1, z16, p0, p1, p2, p3],
                                                  dtype=tl.float32, is_pure=True, pack=1)
                if w == 0:
                    part = d
                else:
                    part += d
            acc += s * part
    offs_m = tl.arange(0, 1)
    epilogue((acc * unscale)[None, :], out_ptr, 0, offs_m, offs_m < 1, offs_n, mask_n, bias_ptr, ws_ptr, cnt_ptr,
             N, HAS_BIAS, ATOMIC, SERIAL, 1, BLOCK_N)
