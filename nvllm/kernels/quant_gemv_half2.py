"""4-bit GEMV for one row with packed half-precision math (``quant_gemv`` variant ``half2``), GPTQ and AWQ.

The ``row`` variant spends about 4.3 instructions per weight at one row (ncu, PERF run AB: GPTQ gate_up ran 18.3 M
warp instructions, as much issue time as the int4 floor's memory time), so no occupancy reaches the floor. Here a
packed GPTQ word — eight inputs of one column — is dequantized two fields at a time as an f16x2 pair: one ``lop3``
ORs fields f and f + 4 into the bit pattern of 1024.0 (``0x6400``) where they lie (fields 0/4 at bits 0/16 read
1024 + q, fields 1/5 at bits 4/20 read 1024 + 16 q; one shift by 8 brings fields 2, 3, 6, 7 there), one
``sub.f16x2`` of (1024 + z) or (1024 + 16 z) leaves q − z or 16 (q − z) exactly, and one ``fma.rn.f16x2`` multiplies
it into an f16x2 accumulator by the inputs (x_f, x_{f+4}) packed the same way (divided by 16 for the fields read
times 16). The word's two halves are summed in fp32: 17 instructions per word of eight weights. An AWQ word holds one
input's eight columns, in the nibble order that makes the same masks yield column pairs; there the f16x2
accumulators run four inputs long per column pair (``quant_gemv_half2_awq_kernel``).

Precision: per program the inputs of its K range are scaled by a power of two so that |x| < 512 — the products and
the four-term f16 sums stay below 2^15, far from f16's 65504 — and the scale is undone exactly at the end; each
product and four-term sum is rounded to f16 (11 significant bits, the accuracy of an fp16 dot product of 4 terms),
everything after it is fp32. Scales multiply once per group and column, in fp32, as in ``row``.

Under the Triton interpreter (the CPU tests) the same steps run as Triton f16 operations instead of the inline PTX.
The torch reference is ``quant_gemm.quant_gemm_reference``; ``quant_gemv.quant_gemv`` launches this kernel.
"""

from __future__ import annotations

from nvllm.kernels.backend import eager_triton
from nvllm.kernels.quant_gemv import _epilogue as epilogue, _words as words_of  # shared with the other variants

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
    """The interpreter's Σ_f x_f (q_f − z) over the eight fields of each word: f16 products and half sums, fp32 sum."""
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
        return (_pair(_x(x_ptr, kb, sc), _x(x_ptr, kb + 4, sc)), _pair(_x(x_ptr, kb + 1, s16), _x(x_ptr, kb + 5, s16)),
                _pair(_x(x_ptr, kb + 2, sc), _x(x_ptr, kb + 6, sc)), _pair(_x(x_ptr, kb + 3, s16), _x(x_ptr, kb + 7, s16)))


@_jit
def _x(x_ptr, k, sc):
    return tl.load(x_ptr + k + tl.arange(0, 1)).to(tl.float32) * sc


@_jit
def _input_scale(x_ptr, k_begin, k_end, BLOCK_K: tl.constexpr):
    """(2^(8 − E), 2^(E − 8)), E = floor(log2 max |x|) over the program's inputs: the power of two that brings them
    below 512, and its inverse."""
    m = 0.0
    for k0 in range(k_begin, k_end, BLOCK_K):
        m = tl.maximum(m, tl.max(tl.abs(tl.load(x_ptr + k0 + tl.arange(0, BLOCK_K)).to(tl.float32))))
    e = tl.minimum(tl.maximum((m.to(tl.int32, bitcast=True) >> 23) & 255, 8), 253)   # biased exponent of max
    return ((262 - e) << 23).to(tl.float32, bitcast=True), ((e - 8) << 23).to(tl.float32, bitcast=True)


@_jit
def quant_gemv_half2_kernel(
    x_ptr, xw_ptr, qw_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
    N, K,
    stride_qw, stride_qz, stride_s,           # row strides of qweight [K/8, N], qzeros, scales
    k_per_split,                              # K range of one split (a multiple of BLOCK_K)
    GROUP: tl.constexpr,                      # group size, a multiple of BLOCK_K
    HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr, SERIAL: tl.constexpr, STAGES: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INTERPRET: tl.constexpr,                  # Triton f16 operations instead of the inline PTX
    X_WORDS: tl.constexpr,                    # bf16 inputs, also passed as an int32 view (xw_ptr)
    PDL: tl.constexpr,
):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    sc, unscale = _input_scale(x_ptr, k_begin, k_end, BLOCK_K)
    zshift = (offs_n % 8) * 4
    acc = tl.full((BLOCK_N,), 0.0, tl.float32)
    for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=STAGES):
        grp = k0 // GROUP
        s = tl.load(s_ptr + grp * stride_s + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        zw = tl.load(qz_ptr + grp * stride_qz + offs_n // 8, mask=mask_n, other=0)
        z = ((zw >> zshift) & 15) + 1                                                # v1 stores zero − 1
        z1 = (0x6400 + z).to(tl.uint32) * 0x10001                                   # f16 (1024 + z) twice
        z16 = (0x6400 + 16 * z).to(tl.uint32) * 0x10001                             # (1024 + 16 z) twice
        for w in tl.static_range(BLOCK_K // 8):
            words = words_of(qw_ptr + (k0 // 8 + w) * stride_qw + offs_n, mask_n)    # [BLOCK_N]
            kb = k0 + 8 * w
            if INTERPRET:
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


# ---- AWQ: a word holds one input's eight columns, its nibbles in the order 0, 2, 4, 6, 1, 3, 5, 7 — so the same lop3
# masks give column pairs (0, 1), (2, 3) (read times 16) and, after a shift by 8, (4, 5), (6, 7) (times 16). Each
# pair meets the one input (x, x) (or (x, x)/16) in an f16x2 accumulator per column pair, four inputs long; then fp32.
# $4 the word, $5..$8 the pairs' (1024 + z) or (1024 + 16 z), $9 (x, x), $10 (x, x)/16, $11..$14 the accumulators in;
# $0..$3 out
_AWQ_STEP_PTX = """
{
.reg .b32 t, a;
lop3.b32 t, $4, 0x000F000F, 0x64006400, 0xEA;
sub.f16x2 t, t, $5;
fma.rn.f16x2 $0, t, $9, $11;
lop3.b32 t, $4, 0x00F000F0, 0x64006400, 0xEA;
sub.f16x2 t, t, $6;
fma.rn.f16x2 $1, t, $10, $12;
shr.b32 a, $4, 8;
lop3.b32 t, a, 0x000F000F, 0x64006400, 0xEA;
sub.f16x2 t, t, $7;
fma.rn.f16x2 $2, t, $9, $13;
lop3.b32 t, a, 0x00F000F0, 0x64006400, 0xEA;
sub.f16x2 t, t, $8;
fma.rn.f16x2 $3, t, $10, $14;
}
"""
_AWQ_STEP = tl.constexpr(_AWQ_STEP_PTX) if tl is not None else _AWQ_STEP_PTX
_UNPAIR_PTX = "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }"
_UNPAIR = tl.constexpr(_UNPAIR_PTX) if tl is not None else _UNPAIR_PTX


@_jit
def _unpair(h):
    return tl.inline_asm_elementwise(_UNPAIR, "=f,=f,r", [h], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)


@_jit
def _awq_ops(words, zw, xk, c: tl.constexpr):
    """The interpreter's f16 product of column c of each AWQ word with input xk."""
    shift: tl.constexpr = (c % 2) * 16 + (c // 2) * 4
    return (((words >> shift) & 15).to(tl.float16) - ((zw >> shift) & 15).to(tl.float16)) * xk.to(tl.float16)


@_jit
def quant_gemv_half2_awq_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
    N, K,
    stride_qw, stride_qz, stride_s,           # row strides of qweight [K, N/8], qzeros [K/G, N/8], scales [K/G, N]
    k_per_split,
    GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr, SERIAL: tl.constexpr, STAGES: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,   # BLOCK_K a multiple of 4 (inputs per f16 accumulation)
    INTERPRET: tl.constexpr, PDL: tl.constexpr,
):
    """One row of a 4-bit AWQ weight (arguments as ``quant_gemv_half2_kernel``)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    WORDS_N: tl.constexpr = BLOCK_N // 8
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    wn = pid_n * WORDS_N + tl.arange(0, WORDS_N)
    mask_wn = wn < N // 8
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    sc, unscale = _input_scale(x_ptr, k_begin, k_end, BLOCK_K)
    zero = tl.full((WORDS_N,), 0.0, tl.float32)
    a0, a1, a2, a3, a4, a5, a6, a7 = zero, zero, zero, zero, zero, zero, zero, zero
    for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=STAGES):
        grp = k0 // GROUP
        zw = words_of(qz_ptr + grp * stride_qz + wn, mask_wn)
        if not INTERPRET:   # the column pairs' zero points, read as the weights are
            z01 = (zw & 0x000F000F) | 0x64006400
            z23 = (zw & 0x00F000F0) | 0x64006400
            z45 = ((zw >> 8) & 0x000F000F) | 0x64006400
            z67 = ((zw >> 8) & 0x00F000F0) | 0x64006400
        p0, p1, p2, p3, p4, p5, p6, p7 = zero, zero, zero, zero, zero, zero, zero, zero
        for q in tl.static_range(BLOCK_K // 4):
            for j in tl.static_range(4):
                k = k0 + 4 * q + j
                words = words_of(qw_ptr + k * stride_qw + wn, mask_wn)
                xk = tl.load(x_ptr + k + tl.arange(0, 1)).to(tl.float32) * sc
                if INTERPRET:
                    if j == 0:
                        h0, h1, h2, h3 = (_awq_ops(words, zw, xk, 0), _awq_ops(words, zw, xk, 1),
                                          _awq_ops(words, zw, xk, 2), _awq_ops(words, zw, xk, 3))
                        h4, h5, h6, h7 = (_awq_ops(words, zw, xk, 4), _awq_ops(words, zw, xk, 5),
                                          _awq_ops(words, zw, xk, 6), _awq_ops(words, zw, xk, 7))
                    else:
                        h0 += _awq_ops(words, zw, xk, 0)
                        h1 += _awq_ops(words, zw, xk, 1)
                        h2 += _awq_ops(words, zw, xk, 2)
                        h3 += _awq_ops(words, zw, xk, 3)
                        h4 += _awq_ops(words, zw, xk, 4)
                        h5 += _awq_ops(words, zw, xk, 5)
                        h6 += _awq_ops(words, zw, xk, 6)
                        h7 += _awq_ops(words, zw, xk, 7)
                else:
                    if j == 0:
                        h01 = tl.full((WORDS_N,), 0, tl.uint32)
                        h23, h45, h67 = h01, h01, h01
                    h01, h23, h45, h67 = tl.inline_asm_elementwise(
                        _AWQ_STEP, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r,r,r",
                        [words, z01, z23, z45, z67, _pair(xk, xk), _pair(xk * 0.0625, xk * 0.0625), h01, h23, h45, h67],
                        dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=True, pack=1)
            if INTERPRET:
                p0 += h0.to(tl.float32)
                p1 += h1.to(tl.float32)
                p2 += h2.to(tl.float32)
                p3 += h3.to(tl.float32)
                p4 += h4.to(tl.float32)
                p5 += h5.to(tl.float32)
                p6 += h6.to(tl.float32)
                p7 += h7.to(tl.float32)
            else:
                f0, f1 = _unpair(h01)
                f2, f3 = _unpair(h23)
                f4, f5 = _unpair(h45)
                f6, f7 = _unpair(h67)
                p0 += f0
                p1 += f1
                p2 += f2
                p3 += f3
                p4 += f4
                p5 += f5
                p6 += f6
                p7 += f7
        srow = s_ptr + grp * stride_s + 8 * wn
        a0 += tl.load(srow, mask=mask_wn, other=0.0).to(tl.float32) * p0
        a1 += tl.load(srow + 1, mask=mask_wn, other=0.0).to(tl.float32) * p1
        a2 += tl.load(srow + 2, mask=mask_wn, other=0.0).to(tl.float32) * p2
        a3 += tl.load(srow + 3, mask=mask_wn, other=0.0).to(tl.float32) * p3
        a4 += tl.load(srow + 4, mask=mask_wn, other=0.0).to(tl.float32) * p4
        a5 += tl.load(srow + 5, mask=mask_wn, other=0.0).to(tl.float32) * p5
        a6 += tl.load(srow + 6, mask=mask_wn, other=0.0).to(tl.float32) * p6
        a7 += tl.load(srow + 7, mask=mask_wn, other=0.0).to(tl.float32) * p7
    # [w, i, j, l] = a_{4l + 2j + i} → columns 8w + 4l + 2j + i in order
    acc = tl.join(tl.join(tl.join(a0, a1), tl.join(a2, a3)), tl.join(tl.join(a4, a5), tl.join(a6, a7)))
    acc = tl.reshape(tl.permute(acc, (0, 3, 2, 1)), (BLOCK_N,)) * unscale
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, 1)
    epilogue(acc[None, :], out_ptr, 0, offs_m, offs_m < 1, offs_n, offs_n < N, bias_ptr, ws_ptr, cnt_ptr,
             N, HAS_BIAS, ATOMIC, SERIAL, 1, BLOCK_N)
