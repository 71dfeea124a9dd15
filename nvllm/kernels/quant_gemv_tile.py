"""The general decode GEMV kernels of ``quant_gemv`` (any format, 4 or 8 bits) and what every variant shares.

Variants (``quant_gemv``'s config key ``variant``):

* ``tile`` (default until the sweep has chosen): unpack to a ``[BLOCK_K, BLOCK_N]`` tile (``tl.reshape`` of
  ``[words, fields, ...]``, a layout conversion through shared memory), ``tl.sum`` over K of ``x · q`` (a
  cross-thread reduction per K step); the zero as ``− z_n Σ_k x_k``; integer → float by conversion or
  (``magic``) through the 2^23 bit pattern.
* ``field``: no reshape. GPTQ: the ``[BLOCK_K/P, BLOCK_N]`` word tile field by field (P = 32/bits, a static
  loop; field f meets x at ``k0 + P·w + f``, a strided load), products summed elementwise over the fields,
  then over the words once per K step. AWQ: the ``[BLOCK_K, BLOCK_N/8]`` word tile broadcast to ``[BLOCK_K,
  8, BLOCK_N/8]`` (index i is column ``8w + i``), summed over K into an accumulator of that shape; one permute
  and reshape after the loop put the columns in order.
* ``row``: one word row at a time (a static loop over the K step's BLOCK_K/P GPTQ or BLOCK_K AWQ word rows,
  each a 1-D load), FMAs straight into the ``[BLOCK_M, BLOCK_N]`` (AWQ ``[BLOCK_M, 8, BLOCK_N/8]``)
  accumulator: no reduction and no layout change in the loop, few registers.

(A gemlite-style ``l1`` variant — the tile loaded with word offsets ``k // P``, each word fetched P times —
measured slowest on every shape in run M, 1.4–3.8× ``row``, and was removed.)

``field`` and ``row`` unpack a field in place (``_in_place``): masked inside its 16-bit half-word and
OR'ed into the float 2^23 bit pattern it reads as ``2^23 + q·2^pos`` exactly, and one FFMA, ``· 2^-pos −
(2^(23−pos) + z)``, yields ``q − z`` exactly: per weight a LOP3 and an FFMA before the FMA with x, no shift,
no conversion, no ``Σ x`` term. The high half-word is shifted by 12 (4-bit) so that none of its fields sits
at bit 0 (a shift-and-mask to bit 0 compiles to a three-instruction bit-field extract); 2^23 is passed at
run time (as an immediate each LOP3 would need a MOV). In these variants the threads run along N (a column,
or an AWQ word, per thread and repeat): the K sums stay within a thread, and the x loads are shared by
``BLOCK_N / (32 · num_warps)`` columns (AWQ: words).

Shared with ``quant_gemv_half2`` / ``_rows`` and ``quant_gemv_mma``: ``_words`` (a packed word row, evicted first) and
``_epilogue`` (the fp32 tile stored directly, atomically into split-K's zeroed output, or through the ``serial``
workspace). The torch reference is ``quant_gemm.quant_gemm_reference``; ``quant_gemv.quant_gemv`` launches these.
"""

from __future__ import annotations

from nvllm.kernels.backend import eager_triton
from nvllm.kernels.split_k import store_tile

triton, tl, _jit = eager_triton()  # jitted at import (the CPU tests reload under the interpreter)


@_jit
def _words(ptrs, mask):
    """Packed words, read once (evicted first), as uint32 so that shifts are logical."""
    return tl.load(ptrs, mask=mask, other=0, eviction_policy="evict_first").to(tl.uint32, bitcast=True)


@_jit
def _in_place(src, pos, inv, zc, MASK: tl.constexpr, magic):
    """``q − z`` in float32 for the field at bit ``pos`` of ``src`` (``pos + bits ≤ 23``), given ``inv =
    2^-pos``, ``zc = 2^(23 − pos) + z`` and ``magic = 0x4B000000``: the masked field OR'ed into the 2^23 bit
    pattern reads as ``2^23 + q·2^pos`` exactly; times 2^-pos minus zc is one FFMA with an exact result."""
    return ((src & (MASK << pos)) | magic).to(tl.float32, bitcast=True) * inv - zc


@_jit
def _gptq_field(words, hi, f: tl.constexpr, z, BITS: tl.constexpr, HS: tl.constexpr, magic):
    """``q − z`` of field f of GPTQ words (``hi = words >> HS``), z the true zero point."""
    HALF: tl.constexpr = 16 // BITS
    P: tl.constexpr = BITS * (f % HALF) + (f // HALF) * (16 - HS)
    if f < HALF:
        src = words
    else:
        src = hi
    return _in_place(src, P, 1.0 / (1 << P), 8388608.0 / (1 << P) + z, (1 << BITS) - 1, magic)


@_jit
def _epilogue(acc, out_ptr, stride_om, offs_m, mask_m, offs_n, mask_n, bias_ptr, ws_ptr, cnt_ptr, N,
              HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr, SERIAL: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Write the ``[BLOCK_M, BLOCK_N]`` fp32 tile: ``store_tile`` (direct, or atomically into the zeroed fp32
    output of split-K), or with ``SERIAL`` split-K in one kernel: every split adds into a persistent zeroed
    fp32 workspace and takes a ticket; the last split of the column tile reads the sum back (through L2),
    adds the bias, stores the output in its dtype and zeroes the workspace and its ticket counter again."""
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    mask_mn = mask_m[:, None] & mask_n[None, :]
    if SERIAL:
        ws_ptrs = ws_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.atomic_add(ws_ptrs, acc, mask=mask_mn, sem="relaxed")
        tl.debug_barrier()                                   # every thread's adds before the ticket
        ticket = tl.atomic_add(cnt_ptr + tl.program_id(0), 1, sem="acq_rel")
        if ticket == tl.num_programs(1) - 1:
            tl.debug_barrier()
            total = tl.load(ws_ptrs, mask=mask_mn, other=0.0, cache_modifier=".cg")
            store_tile(out_ptrs, total, mask_mn, bias_ptr, offs_n, mask_n, HAS_BIAS, False)
            tl.store(ws_ptrs, tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32), mask=mask_mn)
            tl.atomic_xchg(cnt_ptr + tl.program_id(0), 0)
    else:
        store_tile(out_ptrs, acc, mask_mn, bias_ptr, offs_n, mask_n, HAS_BIAS, ATOMIC)


@_jit
def _quant_gemv_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
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
    SERIAL: tl.constexpr,                     # split-K finished in the kernel (see _epilogue)
    STAGES: tl.constexpr,                     # software-pipeline depth of the K loop (1 = none)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,                        # programmatic dependent launch (nvllm.kernels.pdl)
):
    """Variant ``tile``: a ``[BLOCK_K, BLOCK_N]`` float tile per K step, summed over K."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
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
    r = tl.arange(0, BLOCK_K)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=STAGES):
        offs_k = k0 + r
        mask_k = offs_k < k_end
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        grp = k0 // GROUP
        s = tl.load(s_ptr + grp * stride_s + offs_n, mask=mask_n, other=0.0).to(tl.float32)
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
        part = tl.sum(x[:, :, None] * qf[None, :, :], axis=1)      # [BLOCK_M, BLOCK_N]: Σ_k x q
        xsum = tl.sum(x, axis=1)                                    # [BLOCK_M]: Σ_k x
        zw = tl.load(qz_ptr + grp * stride_qz + wn, mask=mask_wn, other=0)
        z = tl.reshape((zw[:, None] >> n_shift[None, :]) & MASK, (BLOCK_N,)).to(tl.float32)
        if not AWQ:
            z = z + 1.0                                              # GPTQ v1 stores zero − 1
        acc += s[None, :] * (part - xsum[:, None] * z[None, :])

    _epilogue(acc, out_ptr, stride_om, offs_m, mask_m, offs_n, mask_n, bias_ptr, ws_ptr, cnt_ptr, N,
              HAS_BIAS, ATOMIC, SERIAL, BLOCK_M, BLOCK_N)


@_jit
def _quant_gemv_field_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, bias_ptr, out_ptr, ws_ptr, cnt_ptr,
    M, N, K,
    stride_xm, stride_om,
    stride_qw, stride_qz, stride_s,
    k_per_split, magic,                       # magic: 0x4B000000, a runtime value (an immediate costs a MOV)
    BITS: tl.constexpr, AWQ: tl.constexpr, GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr, SERIAL: tl.constexpr, STAGES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ROWS: tl.constexpr,                       # variant "row" (else "field")
    PDL: tl.constexpr,                        # programmatic dependent launch (nvllm.kernels.pdl)
):
    """Variants ``field`` and ``row``: the packed words as loaded, field by field, in place (arguments as
    ``_quant_gemv_kernel``)."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    PER_WORD: tl.constexpr = 32 // BITS
    HS: tl.constexpr = 12 if BITS == 4 else 16   # high-half shift (see _in_place)
    MASK: tl.constexpr = (1 << BITS) - 1
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    x_rows = x_ptr + offs_m * stride_xm       # (K tiles are whole: gemv_supported wants K % BLOCK_K == 0)
    if AWQ:   # qweight [K, N/8]: one word row per input, its 8 fields are 8 columns
        WORDS_N: tl.constexpr = BLOCK_N // 8
        wn = pid_n * WORDS_N + tl.arange(0, WORDS_N)
        mask_wn = wn < N // 8
        i = tl.arange(0, 8)                   # index i: column 8w + i, in nibble (i % 2) * 4 + i // 2
        hs = ((i % 2) * HS)[:, None]          # odd columns in the high half-word
        pos = ((i // 2) * 4 + (i % 2) * (16 - HS))[:, None]
        inv = 1.0 / (1 << pos).to(tl.float32)
        cols = 8 * wn[None, :] + i[:, None]   # [8, WORDS_N]
        mask_c = mask_wn[None, :] & (i < 8)[:, None]
        acc3 = tl.full((BLOCK_M, 8, WORDS_N), 0.0, tl.float32)
        for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=STAGES):
            grp = k0 // GROUP
            s = tl.load(s_ptr + grp * stride_s + cols, mask=mask_c, other=0.0).to(tl.float32)
            zw = tl.load(qz_ptr + grp * stride_qz + wn, mask=mask_wn, other=0)
            zc = 8388608.0 * inv + ((zw[None, :] >> (hs + pos)) & MASK).to(tl.float32)   # [8, WORDS_N]
            if ROWS:   # one word row at a time, FMAs straight into the accumulator
                for kk in tl.static_range(BLOCK_K):
                    words = _words(qw_ptr + (k0 + kk) * stride_qw + wn, mask_wn)                 # [WORDS_N]
                    q = _in_place(words[None, :] >> hs, pos, inv, zc, MASK, magic)        # [8, WORDS_N]
                    x = tl.load(x_rows + k0 + kk, mask=mask_m, other=0.0).to(tl.float32)  # [BLOCK_M]
                    if kk == 0:
                        part = x[:, None, None] * q[None, :, :]
                    else:
                        part += x[:, None, None] * q[None, :, :]
            else:      # the [BLOCK_K, 8, WORDS_N] tile, summed over K
                offs_k = k0 + tl.arange(0, BLOCK_K)
                words = _words(qw_ptr + offs_k[:, None] * stride_qw + wn[None, :], mask_wn[None, :])  # [BK, WN]
                q = _in_place(words[:, None, :] >> hs[None, :, :], pos[None, :, :], inv[None, :, :],
                              zc[None, :, :], MASK, magic)
                x = tl.load(x_rows[:, None] + offs_k[None, :], mask=mask_m[:, None], other=0.0).to(tl.float32)
                part = tl.sum(x[:, :, None, None] * q[None, :, :, :], axis=1)              # [BLOCK_M, 8, WN]
            acc3 += s[None, :, :] * part
        acc = tl.reshape(tl.permute(acc3, (0, 2, 1)), (BLOCK_M, BLOCK_N))   # columns in order, once
    else:     # qweight [K/P, N]: word row w holds inputs P·w .. P·w + P-1 of each column
        WORDS_K: tl.constexpr = BLOCK_K // PER_WORD
        r = tl.arange(0, WORDS_K)
        zshift = (offs_n % PER_WORD) * BITS
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=STAGES):
            grp = k0 // GROUP
            s = tl.load(s_ptr + grp * stride_s + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            zw = tl.load(qz_ptr + grp * stride_qz + offs_n // PER_WORD, mask=mask_n, other=0)
            z = ((zw >> zshift) & MASK).to(tl.float32) + 1.0                               # v1 stores zero − 1
            if ROWS:   # one word row at a time: [BLOCK_N] words, P inputs, FMAs into [BLOCK_M, BLOCK_N]
                for w in tl.static_range(WORDS_K):
                    words = _words(qw_ptr + (k0 // PER_WORD + w) * stride_qw + offs_n, mask_n)    # [BLOCK_N]
                    hi = words >> HS
                    for f in tl.static_range(PER_WORD):
                        q = _gptq_field(words, hi, f, z, BITS, HS, magic)
                        x = tl.load(x_rows + k0 + PER_WORD * w + f, mask=mask_m, other=0.0).to(tl.float32)
                        if w + f == 0:
                            part = x[:, None] * q[None, :]
                        else:
                            part += x[:, None] * q[None, :]
            else:      # the [WORDS_K, BLOCK_N] tile, field f times x at k0 + P·w + f (strided)
                wk = k0 // PER_WORD + r
                words = _words(qw_ptr + wk[:, None] * stride_qw + offs_n[None, :], mask_n[None, :])   # [WK, BN]
                hi = words >> HS
                for f in tl.static_range(PER_WORD):
                    q = _gptq_field(words, hi, f, z[None, :], BITS, HS, magic)
                    x = tl.load(x_rows[:, None] + (k0 + r * PER_WORD + f)[None, :], mask=mask_m[:, None],
                                other=0.0).to(tl.float32)                                 # [BLOCK_M, WORDS_K]
                    if f == 0:
                        part3 = x[:, :, None] * q[None, :, :]
                    else:
                        part3 += x[:, :, None] * q[None, :, :]
                part = tl.sum(part3, axis=1)                  # one reduction over the words per tile
            acc += s[None, :] * part

    _epilogue(acc, out_ptr, stride_om, offs_m, mask_m, offs_n, mask_n, bias_ptr, ws_ptr, cnt_ptr, N,
              HAS_BIAS, ATOMIC, SERIAL, BLOCK_M, BLOCK_N)
