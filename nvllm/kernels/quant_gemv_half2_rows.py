"""Variant ``half2`` for several rows (``BLOCK_M`` of 2 or 4: batch-2/4 decode, short verification batches).

The one-row kernel (``quant_gemv_half2``) multiplies each packed word by its row in one piece of PTX. Here each word
is dequantized once — its four (q − z) pairs as f16x2, one ``lop3`` and one ``sub.f16x2`` per pair (``_WORD_DEQ``)
— and every row dots them with its own input pairs (``_PAIRS_DOT``: a multiply, three FMAs, the halves summed in
fp32), so the dequantization is shared by the rows: in the sm_90 cubin the loop runs 17.5 instructions per word and
row at two rows against 23.6 at one. Each row has its own power-of-two input scale (rows of very different
magnitudes keep their precision); rows past M read zeros and are not stored. On the H200 (PERF.md, session 9) the
28 layers' GEMVs of a Qwen2.5-7B-shaped model took 2.130 ms at M = 2 and 3.316 ms at M = 4, against 2.917 and
4.346 ms with the ``row`` variant. A separate kernel: written with a row axis, the one-row case measured 8% slower
(batch-1 decode 2.13 against 1.96-2.00 ms).

Under the Triton interpreter the same steps run as Triton f16 operations. The torch reference is
``quant_gemm.quant_gemm_reference``; ``quant_gemv.quant_gemv`` launches this kernel.
"""

from __future__ import annotations

from nvllm.kernels.backend import eager_triton
from nvllm.kernels.prefetch import start_split
from nvllm.kernels.quant_gemv_tile import _epilogue as epilogue, _words as words_of  # shared by the variants
from nvllm.kernels.quant_gemv_half2 import (  # the one-row kernel's pieces
    _PAIRS, _pair, _pow2_scale, _word_dot_ops, _zero_consts)

triton, tl, _jit = eager_triton()  # jitted at import (the CPU tests reload under the interpreter)


def deq_pairs_ptx(word: str, z1: str, z16: str) -> str:
    """PTX lines leaving a packed GPTQ word's four (q − z) pairs as f16x2 in registers t0..t3 (fields (0, 4), (1, 5)
    times 16, (2, 6), (3, 7) times 16), given the operands holding the word and (1024 + z), (1024 + 16 z) twice; the
    enclosing block declares ``.reg .b32 a, t0, t1, t2, t3``. Shared with ``quant_gemv_mma``."""
    return f"""lop3.b32 t0, {word}, 0x000F000F, 0x64006400, 0xEA;
sub.f16x2 t0, t0, {z1};
lop3.b32 t1, {word}, 0x00F000F0, 0x64006400, 0xEA;
sub.f16x2 t1, t1, {z16};
shr.b32 a, {word}, 8;
lop3.b32 t2, a, 0x000F000F, 0x64006400, 0xEA;
sub.f16x2 t2, t2, {z1};
lop3.b32 t3, a, 0x00F000F0, 0x64006400, 0xEA;
sub.f16x2 t3, t3, {z16};
"""


# _WORD_DOT in two parts, for several rows: the word's four (q − z) pairs once ($0..$3 from $4 the word, $5
# (1024 + z) twice, $6 (1024 + 16 z) twice), then per row their dot with its four input pairs ($1..$4 the
# (q − z) pairs, $5..$8 the input pairs; $0 the fp32 sum)
_WORD_DEQ_PTX = """
{
.reg .b32 a, t0, t1, t2, t3;
""" + deq_pairs_ptx("$4", "$5", "$6") + """mov.b32 $0, t0;
mov.b32 $1, t1;
mov.b32 $2, t2;
mov.b32 $3, t3;
}
"""
_WORD_DEQ = tl.constexpr(_WORD_DEQ_PTX) if tl is not None else _WORD_DEQ_PTX
_PAIRS_DOT_PTX = """
{
.reg .b32 acc;
.reg .b16 lo, hi;
.reg .f32 flo, fhi;
mul.rn.f16x2 acc, $1, $5;
fma.rn.f16x2 acc, $2, $6, acc;
fma.rn.f16x2 acc, $3, $7, acc;
fma.rn.f16x2 acc, $4, $8, acc;
mov.b32 {lo, hi}, acc;
cvt.f32.f16 flo, lo;
cvt.f32.f16 fhi, hi;
add.f32 $0, flo, fhi;
}
"""
_PAIRS_DOT = tl.constexpr(_PAIRS_DOT_PTX) if tl is not None else _PAIRS_DOT_PTX


@_jit
def _row_pairs(x_rows, kb, sc, rows_ok, X_WORDS: tl.constexpr):
    """Each row's four f16x2 input pairs of the word row at input kb (``x_rows``: the rows' pointers,
    ``[BLOCK_M, 1]``; rows not ``rows_ok`` read 0): from bf16 inputs read as 32-bit words (``X_WORDS``: the
    pointers are then into an int32 view) or from inputs of any type one by one."""
    if X_WORDS:
        j = kb // 2
        return tl.inline_asm_elementwise(
            _PAIRS, "=r,=r,=r,=r,r,r,r,r,f",
            [tl.load(x_rows + j, mask=rows_ok, other=0), tl.load(x_rows + j + 1, mask=rows_ok, other=0),
             tl.load(x_rows + j + 2, mask=rows_ok, other=0), tl.load(x_rows + j + 3, mask=rows_ok, other=0), sc],
            dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=True, pack=1)
    else:
        s16 = sc * 0.0625
        return (_pair(_row_x(x_rows, kb, sc, rows_ok), _row_x(x_rows, kb + 4, sc, rows_ok)),
                _pair(_row_x(x_rows, kb + 1, s16, rows_ok), _row_x(x_rows, kb + 5, s16, rows_ok)),
                _pair(_row_x(x_rows, kb + 2, sc, rows_ok), _row_x(x_rows, kb + 6, sc, rows_ok)),
                _pair(_row_x(x_rows, kb + 3, s16, rows_ok), _row_x(x_rows, kb + 7, s16, rows_ok)))


@_jit
def _row_x(x_rows, k, sc, rows_ok):
    return tl.load(x_rows + k, mask=rows_ok, other=0.0).to(tl.float32) * sc


@_jit
def quant_gemv_half2_rows_kernel(
    x_ptr, xw_ptr, qw_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K,
    stride_xm, stride_om,                     # row strides of x (elements; even under X_WORDS) and out
    stride_qw, stride_qz, stride_s,           # row strides of qweight [K/8, N], qzeros, scales
    k_per_split,                              # K range of one split (a multiple of BLOCK_K)
    GROUP: tl.constexpr,                      # group size, a multiple of BLOCK_K
    HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr, SERIAL: tl.constexpr, STAGES: tl.constexpr,
    BLOCK_M: tl.constexpr,                    # rows (a power of two ≥ M, ≥ 2): each word dequantized once for all
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    INTERPRET: tl.constexpr,                  # Triton f16 operations instead of the inline PTX
    X_WORDS: tl.constexpr,                    # bf16 inputs, also passed as an int32 view (xw_ptr)
    X_SPAN: tl.constexpr,                     # a power of two ≥ k_per_split: the inputs' max in one load (0: a loop)
    PREFETCH: tl.constexpr,                   # word rows of the split asked of L2 before the PDL wait (prefetch.py)
    PDL: tl.constexpr,
):
    pid_n, pid_k, k_begin, k_end = start_split(qw_ptr, stride_qw, k_per_split, K, N, BLOCK_N, PREFETCH, PDL)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    rows_ok = mask_m[:, None]                                                        # [BLOCK_M, 1]
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    # per row, the power of two that brings this program's inputs below 512: 2^(8 − E), E = floor(log2 max |x|)
    if X_SPAN:   # one load: one memory latency before the weights can be multiplied, not one per K step
        offs_x = k_begin + tl.arange(0, X_SPAN)
        m = tl.max(tl.abs(tl.load(x_rows + offs_x[None, :], mask=rows_ok & (offs_x < k_end)[None, :],
                                  other=0.0).to(tl.float32)), axis=1)
    else:
        m = tl.zeros((BLOCK_M,), tl.float32)
        for k0 in range(k_begin, k_end, BLOCK_K):
            m = tl.maximum(m, tl.max(tl.abs(tl.load(x_rows + k0 + tl.arange(0, BLOCK_K)[None, :], mask=rows_ok,
                                                    other=0.0).to(tl.float32)), axis=1))
    sc, unscale = _pow2_scale(m)
    sc = sc[:, None]                                                                 # [BLOCK_M, 1]
    unscale = unscale[:, None]
    xp_rows = (xw_ptr + offs_m[:, None] * (stride_xm // 2)) if X_WORDS else x_rows
    zshift = (offs_n % 8) * 4
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=STAGES):
        grp = k0 // GROUP
        s = tl.load(s_ptr + grp * stride_s + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        zw = tl.load(qz_ptr + grp * stride_qz + offs_n // 8, mask=mask_n, other=0)
        z, z1, z16 = _zero_consts(zw, zshift)
        for w in tl.static_range(BLOCK_K // 8):
            words = words_of(qw_ptr + (k0 // 8 + w) * stride_qw + offs_n, mask_n)[None, :]   # [1, BLOCK_N]
            kb = k0 + 8 * w
            if INTERPRET:
                d = _word_dot_ops(words, z[None, :], _row_x(x_rows, kb, sc, rows_ok),
                                  _row_x(x_rows, kb + 1, sc, rows_ok), _row_x(x_rows, kb + 2, sc, rows_ok),
                                  _row_x(x_rows, kb + 3, sc, rows_ok),
                                  _row_x(x_rows, kb + 4, sc, rows_ok), _row_x(x_rows, kb + 5, sc, rows_ok),
                                  _row_x(x_rows, kb + 6, sc, rows_ok), _row_x(x_rows, kb + 7, sc, rows_ok))
            else:
                p0, p1, p2, p3 = _row_pairs(xp_rows, kb, sc, rows_ok, X_WORDS)             # [BLOCK_M, 1] each
                t0, t1, t2, t3 = tl.inline_asm_elementwise(                             # once per word
                    _WORD_DEQ, "=r,=r,=r,=r,r,r,r", [words, z1[None, :], z16[None, :]],
                    dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=True, pack=1)
                d = tl.inline_asm_elementwise(_PAIRS_DOT, "=f,r,r,r,r,r,r,r,r", [t0, t1, t2, t3, p0, p1, p2, p3],
                                              dtype=tl.float32, is_pure=True, pack=1)         # [BLOCK_M, BLOCK_N]
            if w == 0:
                part = d
            else:
                part += d
        acc += s[None, :] * part
    epilogue(acc * unscale, out_ptr, stride_om, offs_m, mask_m, offs_n, mask_n, bias_ptr, ws_ptr, cnt_ptr,
             N, HAS_BIAS, ATOMIC, SERIAL, BLOCK_M, BLOCK_N)
