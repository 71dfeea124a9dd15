"""4-bit GPTQ GEMV for 1-8 rows on the tensor cores (``quant_gemv`` variant ``mma``).

``half2`` multiplies on the CUDA cores: 23.6 SASS instructions per packed word at one row, as many issue slots as
the int4 weights take to stream in (PERF.md run AT: gate_up's weights alone load in 17.1 µs, the kernel takes 21.8).
Here each word is only dequantized — its four (q − z) pairs as f16x2 (``lop3`` into the bit pattern of 1024, one
``sub.f16x2``; nine instructions) — and the products and sums run on the tensor cores: two ``mma.sync
m16n8k16`` (f16 × f16 → fp32) per word and lane. A warp's ``mma`` takes a 16 × 16 A and a 16 × 8 B; only the
fragments' roles matter, so K is permuted to fit the packing. Lane ``4 g + t`` of the warp:

* **B** (the weights): the word of column ``8 e + g`` of subtile ``e`` at word row ``4 s + t`` of K step ``s``
  (inputs ``32 s + 8 t + 0..7``). Its pairs (fields 0, 4), (1, 5)·16 are the B registers of the first ``mma``,
  (2, 6), (3, 7)·16 of the second: ``mma`` K indices (2t, 2t+1, 2t+8, 2t+9) are those fields.
* **A** (the inputs): row ``g`` (rows 8-15 zero), the same word row ``4 s + t``: inputs (0, 4), (1, 5)/16 and (2, 6),
  (3, 7)/16 of that word row, packed by ``quant_gemv_half2._PAIRS``. Each lane packs one row's pairs for one word
  row, shared by every subtile, where ``half2`` repeats every row's packing in each lane.
* **C**: row ``g``, columns ``8 e + 2 t`` and ``8 e + 2 t + 1``, fp32 over one group; times the two columns' scales
  into the running sums once per K step.

A program is one warp and 64 columns: eight subtiles, each a separate ``[32]`` tensor (``a0``..``a7``,
``c0``..``c7``, ...). The fragments are right only if element i of every operand sits on lane i. A ``[32]`` tensor in a
one-warp program has one layout without replication, and that is the one Triton gives it. A ``[subtiles, 32]`` tensor
did not keep it: Triton 3.6 laid it out 8 × 4 threads, following the zero-point load that runs along the subtiles,
and every result came out wrong on the H200 (PERF.md, session 10). ``tests/test_quant_gemv_kernel.py`` compiles the
kernel for sm_90 and checks every mma operand's layout in the TTGIR.

Rows cost the same up to eight (the tensor core multiplies 16 of them). Products are exact and sums fp32 (``half2``
rounds products and four-term sums to f16). The inputs are rounded to f16 after the same per-row power-of-two scale
as ``half2``'s (|x| < 512 for the ×16 pairs' sake; undone exactly at the end).

Measured on the H200, 28 layers of Qwen2.5-7B-shaped GEMVs (PERF.md runs BD and BG):
- at 4 rows 2.942 ms, against 3.049 ms for ``half2``;
- at 8 rows 3.694 ms; no GEMV took 5-8 rows before.
- Fewer rows are slower than ``half2``. At one row, 2.31 ms against 1.28 ms (run BD, this loop with the zero
  points read every mma step). At two rows, 2.62 against 1.95 ms (run BF, the words of two steps loaded first).

The loop has about as many instructions per word as ``half2``'s (21-24 in the sm_90 cubin, with the K step, against
23.6). The input packing and the scale and zero-point work per subtile outweigh the multiplies that moved to the
tensor cores. So ``TUNED`` uses it for 3-8 rows only.

Under the Triton interpreter (the CPU tests) the ``mma`` is emulated from the same fragments (``_mma_ops``). The
torch reference is ``quant_gemm.quant_gemm_reference``; ``quant_gemv.quant_gemv`` launches this kernel.
"""

from __future__ import annotations

from nvllm.kernels.backend import eager_triton
from nvllm.kernels.prefetch import start_split
from nvllm.kernels.quant_gemv_half2 import _PAIRS, _pair, _pow2_scale  # the input packing of half2
from nvllm.kernels.quant_gemv_half2_rows import deq_pairs_ptx  # its dequantization, as PTX text

triton, tl, _jit = eager_triton()  # jitted at import (the CPU tests reload under the interpreter)

# one lane's word ($2) dequantized into two mma B fragments and multiplied: $3 (1024 + z) twice, $4 (1024 + 16 z)
# twice, $5..$8 the A registers (pairs (0, 4), (1, 5)/16, (2, 6), (3, 7)/16 of the lane's row), $9, $10 the fp32 C
# in, $0, $1 out; rows 8-15 of A and C are zero (the C registers of those rows stay inside)
_WORD_MMA_PTX = """
{
.reg .b32 a, z, t0, t1, t2, t3;
.reg .f32 d2, d3, fz;
mov.b32 z, 0;
mov.f32 fz, 0f00000000;
""" + deq_pairs_ptx("$2", "$3", "$4") + """mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, d2, d3}, {$5, z, $6, z}, {t0, t1}, {$9, $10, fz, fz};
mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, d2, d3}, {$7, z, $8, z}, {t2, t3}, {$0, $1, d2, d3};
}
"""
_WORD_MMA = tl.constexpr(_WORD_MMA_PTX) if tl is not None else _WORD_MMA_PTX


@_jit
def _halves(p):
    """The two f16 of f16x2 words, as fp32 (low, high)."""
    lo = (p & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (p >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@_jit
def _frag_dot(a, b):
    """One f16x2 register of A (lane 4g + t) times the matching one of B (lane 4n + t), summed over t and the two
    halves: [8 (g), 8 (n)]."""
    alo, ahi = _halves(a)
    blo, bhi = _halves(b)
    return tl.sum(tl.reshape(alo, (8, 1, 4)) * tl.reshape(blo, (1, 8, 4))
                  + tl.reshape(ahi, (8, 1, 4)) * tl.reshape(bhi, (1, 8, 4)), axis=2)


@_jit
def _field(words, f: tl.constexpr, z, mult: tl.constexpr):
    """(q_f − z) · mult of each word as f16 bits (uint32), exact."""
    q = (((words >> (4 * f)) & 15).to(tl.int32) - z).to(tl.float32) * mult
    return q.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)


@_jit
def _mma_ops(words, z, p0, p1, p2, p3, c0, c1):
    """The interpreter's ``_WORD_MMA``: the same fragments (every argument [32], one per lane) through Triton
    operations: D[g][n] = C + Σ_t A(lane 4g + t) · B(lane 4n + t), and lane 4g + t keeps columns
    2t and 2t + 1. Rows 8-15 (C registers 2 and 3) are zero and left out."""
    b0 = _field(words, 0, z, 1) | (_field(words, 4, z, 1) << 16)        # the B registers as f16x2 words
    b1 = _field(words, 1, z, 16) | (_field(words, 5, z, 16) << 16)
    b2 = _field(words, 2, z, 1) | (_field(words, 6, z, 1) << 16)
    b3 = _field(words, 3, z, 16) | (_field(words, 7, z, 16) << 16)
    d = _frag_dot(p0, b0) + _frag_dot(p1, b1) + _frag_dot(p2, b2) + _frag_dot(p3, b3)
    even, odd = tl.split(tl.reshape(d, (8, 4, 2)))                       # [g, t, h]: column 2t + h
    return c0 + tl.reshape(even, (32,)), c1 + tl.reshape(odd, (32,))


@_jit
def _lane_pairs(x_ptr, xw_ptr, row_off, kb, sc, INTERPRET: tl.constexpr, X_WORDS: tl.constexpr):
    """The A registers of each element: its lane's row's four input pairs of the word row at input ``kb``, times the
    row's scale ``sc`` (and 1/16 for pairs 1 and 3; rows past M have a scale of 0)."""
    if X_WORDS:     # bf16 inputs as int32 words (two inputs each); row_off in inputs, even
        j = (row_off + kb) // 2
        return tl.inline_asm_elementwise(
            _PAIRS, "=r,=r,=r,=r,r,r,r,r,f",
            [tl.load(xw_ptr + j), tl.load(xw_ptr + j + 1),
             tl.load(xw_ptr + j + 2), tl.load(xw_ptr + j + 3), sc],
            dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32), is_pure=True, pack=1)
    else:
        xs = x_ptr + row_off + kb
        s16 = sc * 0.0625
        return (_pack(tl.load(xs).to(tl.float32) * sc, tl.load(xs + 4).to(tl.float32) * sc, INTERPRET),
                _pack(tl.load(xs + 1).to(tl.float32) * s16, tl.load(xs + 5).to(tl.float32) * s16, INTERPRET),
                _pack(tl.load(xs + 2).to(tl.float32) * sc, tl.load(xs + 6).to(tl.float32) * sc, INTERPRET),
                _pack(tl.load(xs + 3).to(tl.float32) * s16, tl.load(xs + 7).to(tl.float32) * s16, INTERPRET))


@_jit
def _pack(lo, hi, INTERPRET: tl.constexpr):
    """Two fp32 values as one f16x2 word: ``_pair``'s PTX, or under the interpreter the same through Triton
    operations."""
    if INTERPRET:
        flo = lo.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
        fhi = hi.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
        return flo | (fhi << 16)
    else:
        return _pair(lo, hi)


@_jit
def quant_gemv_mma_kernel(
    x_ptr, xw_ptr, qw_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K,
    stride_xm, stride_om,
    stride_qw, stride_qz, stride_s,           # row strides of qweight [K/8, N], qzeros, scales
    k_per_split,                              # K range of one split (a multiple of BLOCK_K)
    GROUP: tl.constexpr,                      # group size, a multiple of BLOCK_K
    HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr, SERIAL: tl.constexpr, STAGES: tl.constexpr,
    BLOCK_K: tl.constexpr,                    # a multiple of 32: mma steps (four word rows each) per K step
    ROWS: tl.constexpr,                       # a power of two ≥ M, ≤ 8
    X_CHUNK: tl.constexpr,                    # inputs per row per load of the input-scale pass
    INTERPRET: tl.constexpr,                  # Triton operations instead of the inline PTX
    X_WORDS: tl.constexpr,                    # bf16 inputs, also passed as an int32 view (xw_ptr)
    PREFETCH: tl.constexpr,                   # word rows of the split asked of L2 before the PDL wait (prefetch.py)
    PDL: tl.constexpr,
):
    pid_n, pid_k, k_begin, k_end = start_split(qw_ptr, stride_qw, k_per_split, K, N, 64, PREFETCH, PDL)
    lane = tl.arange(0, 32)
    g = lane // 4                                                        # A/C row, B column within a subtile
    t = lane % 4                                                         # word row within an mma step
    n0 = pid_n * 64
    row_ok = g < M

    # each row's power-of-two input scale over this split's inputs, per lane (row g; 0 past M, whose lanes read
    # row M − 1 unmasked)
    m = tl.full((32,), 0.0, tl.float32)
    for r in tl.static_range(ROWS):
        if r < M:
            mr = 0.0
            for kx in range(k_begin, k_end, X_CHUNK):
                offs_x = kx + tl.arange(0, X_CHUNK)
                xv = tl.load(x_ptr + r * stride_xm + offs_x, mask=offs_x < k_end, other=0.0)
                mr = tl.maximum(mr, tl.max(tl.abs(xv.to(tl.float32))))
            m = tl.where(g == r, mr, m)
    sc, unscale = _pow2_scale(m)
    sc = tl.where(row_ok, sc, 0.0)
    row_off = tl.minimum(g, M - 1) * stride_xm

    qw_lane = qw_ptr + t * stride_qw + n0 + g                            # subtile 0, word row t of each step
    zshift = 4 * g
    a0 = tl.full((32,), 0.0, tl.float32)   # running sums of subtile e: a{e} its column 2t, b{e} its column 2t + 1
    a1 = a0
    a2 = a0
    a3 = a0
    a4 = a0
    a5 = a0
    a6 = a0
    a7 = a0
    b0 = a0
    b1 = a0
    b2 = a0
    b3 = a0
    b4 = a0
    b5 = a0
    b6 = a0
    b7 = a0
    for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=STAGES):
        grp = k0 // GROUP
        zrow = qz_ptr + grp * stride_qz + n0 // 8                      # subtile e's eight zeros: word zrow[e]
        srow = s_ptr + grp * stride_s + n0 + 2 * t
        y0, v0 = _zeros(zrow, zshift, 0)                                 # (1024 + z), (1024 + 16 z) as f16x2
        y1, v1 = _zeros(zrow, zshift, 1)
        y2, v2 = _zeros(zrow, zshift, 2)
        y3, v3 = _zeros(zrow, zshift, 3)
        y4, v4 = _zeros(zrow, zshift, 4)
        y5, v5 = _zeros(zrow, zshift, 5)
        y6, v6 = _zeros(zrow, zshift, 6)
        y7, v7 = _zeros(zrow, zshift, 7)
        c0 = tl.full((32,), 0.0, tl.float32)
        c1 = c0
        c2 = c0
        c3 = c0
        c4 = c0
        c5 = c0
        c6 = c0
        c7 = c0
        d0 = c0
        d1 = c0
        d2 = c0
        d3 = c0
        d4 = c0
        d5 = c0
        d6 = c0
        d7 = c0
        for ks in tl.static_range(BLOCK_K // 32):
            w0, w1, w2, w3, w4, w5, w6, w7 = _words8(qw_lane + (k0 // 8 + 4 * ks) * stride_qw)
            p0, p1, p2, p3 = _lane_pairs(x_ptr, xw_ptr, row_off, 8 * (k0 // 8 + 4 * ks + t), sc, INTERPRET, X_WORDS)
            c0, c1, c2, c3, c4, c5, c6, c7, d0, d1, d2, d3, d4, d5, d6, d7 = _mma8(
                c0, c1, c2, c3, c4, c5, c6, c7, d0, d1, d2, d3, d4, d5, d6, d7, w0, w1, w2, w3, w4, w5, w6, w7,
                y0, y1, y2, y3, y4, y5, y6, y7, v0, v1, v2, v3, v4, v5, v6, v7, p0, p1, p2, p3, INTERPRET)
        a0, b0 = _scaled(a0, b0, c0, d0, srow, 0)
        a1, b1 = _scaled(a1, b1, c1, d1, srow, 1)
        a2, b2 = _scaled(a2, b2, c2, d2, srow, 2)
        a3, b3 = _scaled(a3, b3, c3, d3, srow, 3)
        a4, b4 = _scaled(a4, b4, c4, d4, srow, 4)
        a5, b5 = _scaled(a5, b5, c5, d5, srow, 5)
        a6, b6 = _scaled(a6, b6, c6, d6, srow, 6)
        a7, b7 = _scaled(a7, b7, c7, d7, srow, 7)

    n_c = n0 + 2 * t
    _finish(a0, b0, unscale, n_c, 0, g, row_ok, out_ptr, stride_om, bias_ptr, ws_ptr, N, HAS_BIAS, ATOMIC, SERIAL)
    _finish(a1, b1, unscale, n_c, 1, g, row_ok, out_ptr, stride_om, bias_ptr, ws_ptr, N, HAS_BIAS, ATOMIC, SERIAL)
    _finish(a2, b2, unscale, n_c, 2, g, row_ok, out_ptr, stride_om, bias_ptr, ws_ptr, N, HAS_BIAS, ATOMIC, SERIAL)
    _finish(a3, b3, unscale, n_c, 3, g, row_ok, out_ptr, stride_om, bias_ptr, ws_ptr, N, HAS_BIAS, ATOMIC, SERIAL)
    _finish(a4, b4, unscale, n_c, 4, g, row_ok, out_ptr, stride_om, bias_ptr, ws_ptr, N, HAS_BIAS, ATOMIC, SERIAL)
    _finish(a5, b5, unscale, n_c, 5, g, row_ok, out_ptr, stride_om, bias_ptr, ws_ptr, N, HAS_BIAS, ATOMIC, SERIAL)
    _finish(a6, b6, unscale, n_c, 6, g, row_ok, out_ptr, stride_om, bias_ptr, ws_ptr, N, HAS_BIAS, ATOMIC, SERIAL)
    _finish(a7, b7, unscale, n_c, 7, g, row_ok, out_ptr, stride_om, bias_ptr, ws_ptr, N, HAS_BIAS, ATOMIC, SERIAL)
    if SERIAL:    # as quant_gemv_tile._epilogue: every split added into the zeroed workspace; the last one finishes
        tl.debug_barrier()
        ticket = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel")
        if ticket == tl.num_programs(1) - 1:
            tl.debug_barrier()
            for e in tl.static_range(8):
                ws0 = ws_ptr + g * N + n_c + 8 * e
                out0 = tl.load(ws0, mask=row_ok, other=0.0, cache_modifier=".cg")
                out1 = tl.load(ws0 + 1, mask=row_ok, other=0.0, cache_modifier=".cg")
                _store(out_ptr, stride_om, g, n_c + 8 * e, out0, out1, row_ok, bias_ptr, HAS_BIAS, False)
                tl.store(ws0, tl.zeros_like(out0), mask=row_ok)
                tl.store(ws0 + 1, tl.zeros_like(out1), mask=row_ok)
            tl.atomic_xchg(cnt_ptr + pid_n, 0)


@_jit
def _zeros(zrow, zshift, e: tl.constexpr):
    """Subtile e's zero point of each lane's column as the f16x2 constants ``_WORD_MMA`` subtracts: (1024 + z)
    and (1024 + 16 z), each twice."""
    z = ((tl.load(zrow + e) >> zshift) & 15) + 1                         # v1 stores zero − 1
    return (0x6400 + z).to(tl.uint32) * 0x10001, (0x6400 + 16 * z).to(tl.uint32) * 0x10001


@_jit
def _words8(wrow):
    """The lane's word of each subtile (column n0 + 8e + g) in one word row."""
    return (_word(wrow, 0), _word(wrow, 1), _word(wrow, 2), _word(wrow, 3), _word(wrow, 4), _word(wrow, 5),
            _word(wrow, 6), _word(wrow, 7))


@_jit
def _word(wrow, e: tl.constexpr):
    return tl.load(wrow + 8 * e, eviction_policy="evict_first").to(tl.uint32, bitcast=True)


@_jit
def _mma8(c0, c1, c2, c3, c4, c5, c6, c7, d0, d1, d2, d3, d4, d5, d6, d7, w0, w1, w2, w3, w4, w5, w6, w7,
          y0, y1, y2, y3, y4, y5, y6, y7, v0, v1, v2, v3, v4, v5, v6, v7, p0, p1, p2, p3, INTERPRET: tl.constexpr):
    """One mma step of the eight subtiles: C (c, d: columns 2t, 2t + 1) += A (the input pairs p) · B (the words w,
    zeros y, v)."""
    c0, d0 = _mma(c0, d0, w0, y0, v0, p0, p1, p2, p3, INTERPRET)
    c1, d1 = _mma(c1, d1, w1, y1, v1, p0, p1, p2, p3, INTERPRET)
    c2, d2 = _mma(c2, d2, w2, y2, v2, p0, p1, p2, p3, INTERPRET)
    c3, d3 = _mma(c3, d3, w3, y3, v3, p0, p1, p2, p3, INTERPRET)
    c4, d4 = _mma(c4, d4, w4, y4, v4, p0, p1, p2, p3, INTERPRET)
    c5, d5 = _mma(c5, d5, w5, y5, v5, p0, p1, p2, p3, INTERPRET)
    c6, d6 = _mma(c6, d6, w6, y6, v6, p0, p1, p2, p3, INTERPRET)
    c7, d7 = _mma(c7, d7, w7, y7, v7, p0, p1, p2, p3, INTERPRET)
    return c0, c1, c2, c3, c4, c5, c6, c7, d0, d1, d2, d3, d4, d5, d6, d7


@_jit
def _mma(c, d, words, z1, z16, p0, p1, p2, p3, INTERPRET: tl.constexpr):
    if INTERPRET:
        return _mma_ops(words, (z1 & 0xFFFF).to(tl.int32) - 0x6400, p0, p1, p2, p3, c, d)
    else:
        return tl.inline_asm_elementwise(_WORD_MMA, "=f,=f,r,r,r,r,r,r,r,f,f", [words, z1, z16, p0, p1, p2, p3, c, d],
                                         dtype=(tl.float32, tl.float32), is_pure=True, pack=1)


@_jit
def _scaled(a, b, c, d, srow, e: tl.constexpr):
    """The running sums of subtile e plus one group's sums times the two columns' scales."""
    return (a + tl.load(srow + 8 * e).to(tl.float32) * c, b + tl.load(srow + 8 * e + 1).to(tl.float32) * d)


@_jit
def _finish(a, b, unscale, n_c, e: tl.constexpr, g, row_ok, out_ptr, stride_om, bias_ptr, ws_ptr, N,
            HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr, SERIAL: tl.constexpr):
    """Subtile e's sums, unscaled: into the split-K workspace (``SERIAL``) or the output."""
    if SERIAL:
        ws0 = ws_ptr + g * N + n_c + 8 * e
        tl.atomic_add(ws0, a * unscale, mask=row_ok, sem="relaxed")
        tl.atomic_add(ws0 + 1, b * unscale, mask=row_ok, sem="relaxed")
    else:
        _store(out_ptr, stride_om, g, n_c + 8 * e, a * unscale, b * unscale, row_ok, bias_ptr, HAS_BIAS, ATOMIC)

@_jit
def _store(out_ptr, stride_om, g, n_c, out0, out1, ok, bias_ptr, HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr):
    """Each lane's two columns: added atomically into the fp32 output (split-K), or with the bias and cast."""
    ptrs = out_ptr + g * stride_om + n_c
    if ATOMIC:
        tl.atomic_add(ptrs, out0, mask=ok, sem="relaxed")
        tl.atomic_add(ptrs + 1, out1, mask=ok, sem="relaxed")
    else:
        if HAS_BIAS:
            out0 += tl.load(bias_ptr + n_c).to(tl.float32)
            out1 += tl.load(bias_ptr + n_c + 1).to(tl.float32)
        tl.store(ptrs, out0.to(ptrs.dtype.element_ty), mask=ok)
        tl.store(ptrs + 1, out1.to(ptrs.dtype.element_ty), mask=ok)
