"""Paged decode attention: one query token per sequence against its whole cached context.

Inputs:
  q               [B, H, D]                                        (one query row per sequence)
  k_cache/v_cache [num_blocks, block_size, H_kv, D]                (this step's K/V already stored)
  block_tables    [B, max_blocks] int32
  context_lens    [B] int32                                        (0 = padding row: its output is 0)
  k_scale/v_scale [num_blocks, block_size, H_kv] fp32 or None      (a quantized int8 / fp8 e4m3 cache)
GQA: head h reads KV head h // (H / H_kv).

Kernel (flash-decoding):
  stage 1  grid (B, H_kv, num_splits). One program takes ALL H/H_kv query heads of one KV head, so every K/V
           byte is read once per group, and one partition of ``partition_size`` consecutive context tokens.
           It walks the partition in tiles of BLOCK_N tokens (token n lives in block
           block_tables[b, n // block_size] at offset n % block_size; tiles need not align with blocks),
           keeps a running max / sum / accumulator in fp32 (online softmax), and writes either the final
           row (num_splits == 1) or a partial: the normalised partial output and its log-sum-exp.
           Under PDL with ``fresh_tokens`` (a decode step's promise that the kernel before this one, the rotary +
           KV store, wrote only each sequence's newest tokens) the context length and the first tile's other
           rows — earlier steps' keys and values, block tables staged before the step — are read before the wait,
           while that kernel still runs; the newest rows are read after it, over them. H200, Qwen2.5-7B GPTQ:
           the batch-8 decode step 3.59 → 3.39 ms (PERF.md run BY).
  stage 2  grid (B, H), only when num_splits > 1: merges the partials of one (sequence, head) with weights
           exp(lse_i - max lse). (A merge inside stage 1 by the last program of each group, on a ticket
           counter, saved the launch but measured 3x slower at batch 1 and slower on every shape of
           gpu_attention_bench, run Q: one program reads all the group's partials serially.) With
           ``defer_merge`` the partials are returned instead (``attention_partials``): a one-row o_proj GEMV
           merges each program's inputs as it reads them, one launch fewer per layer.
  The query heads of a group form the M side of tl.dot, padded to 16 rows (the smallest tensor-core tile);
  head_dim is padded to a power of two with masks.
  Quantized cache (KV_QUANT): the kernel dequantizes as it reads, never in a pass over the cache. A K tile
  is converted exactly to q's dtype (|int8| <= 127 and e4m3 values are exact in fp16/bf16/fp32) and its
  per-token scales multiply the fp32 scores (QK^T of x·s is s·(QK^T of x)); a V tile is converted the same
  way and its per-token scales multiply the probabilities before the PV dot (Σ p·(v·s) = Σ (p·s)·v): one
  multiply per key instead of one per element.

Split policy (``decode_split_policy``): enough programs to fill the GPU, but never a partition shorter than
MIN_PARTITION tokens (below that the partial write and the merge cost more than the extra parallelism
gives). Wanted splits = ceil(PROGRAMS_PER_SM · num_SMs / (B · H_kv)), capped by ceil(max_len / MIN_PARTITION)
and by MAX_SPLITS; the partition is then rounded up to a whole number of BLOCK_N tiles. ``max_len`` is the
longest context of the batch when the caller knows it on the host (``max_context_len``), else the block
table's capacity (block_tables.shape[1] · block_size) — no device sync either way, so the launch can be
captured in a CUDA graph; splits past a sequence's end do no work and merge in with weight 0.
"""

from __future__ import annotations

import functools

import torch

from nvllm.kernels import pdl, report
from nvllm.kernels.attention_partials import AttentionPartials
from nvllm.kernels.jit import lazy_jit

tl = None  # triton.language, bound by lazy_jit at the first launch
_jit = lazy_jit


MIN_PARTITION = 64       # tokens: shortest partition worth a split of its own (run K, H200, in a CUDA graph with
                         # a 4096-token block table: batch 1 at 384-4000 tokens 5.96-7.57 µs against 7.21-8.80 µs
                         # at 128; batch 4 and up keep the split count PROGRAMS_PER_SM gives)
MAX_SPLITS = 64          # the merge kernel holds all partials of a row at once
PROGRAMS_PER_SM = 4      # stage-1 programs per SM the split count aims for (4 warps each)
DEFAULT_NUM_SMS = 132    # H200; used when the tensors are not on a CUDA device (interpreter tests)


# ---------------------------------------------------------------------------------------------- reference


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float, k_scale: torch.Tensor | None = None,
                               v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference: ``paged_attention_reference`` with one query row per sequence (it dequantizes a
    quantized cache explicitly)."""
    from nvllm.kernels.paged_attention import paged_attention_reference

    batch = q.shape[0]
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    return paged_attention_reference(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
                                     k_scale=k_scale, v_scale=v_scale)


# ------------------------------------------------------------------------------------------------- Triton


# Triton helpers of stage 1 (jitted with it)
def _kv_tile(k_head, v_head, ks_head, vs_head, bt_row, n, mask, d, d_mask, stride_kb, stride_ko, stride_kd,
             stride_vb, stride_vo, stride_vd, stride_sb, stride_so, BLOCK_SIZE: tl.constexpr,
             KV_QUANT: tl.constexpr, k_other, v_other, ks_other, vs_other):
    """The K and V rows of context tokens ``n`` (a quantized cache: and their scales; 1.0 otherwise) where
    ``mask``, ``*_other`` elsewhere."""
    blk = tl.load(bt_row + n // BLOCK_SIZE, mask=mask, other=0).to(tl.int64)
    off = (n % BLOCK_SIZE).to(tl.int64)
    return _kv_rows(k_head, v_head, ks_head, vs_head, blk, off, mask, d, d_mask, stride_kb, stride_ko, stride_kd,
                    stride_vb, stride_vo, stride_vd, stride_sb, stride_so, KV_QUANT, k_other, v_other, ks_other,
                    vs_other)


def _kv_rows(k_head, v_head, ks_head, vs_head, blk, off, mask, d, d_mask, stride_kb, stride_ko, stride_kd,
             stride_vb, stride_vo, stride_vd, stride_sb, stride_so, KV_QUANT: tl.constexpr, k_other, v_other,
             ks_other, vs_other):
    """``_kv_tile`` with each token's cache block ``blk`` and offset ``off`` already known."""
    kv_mask = mask[:, None] & d_mask[None, :]
    k = tl.load(k_head + blk[:, None] * stride_kb + off[:, None] * stride_ko + d[None, :] * stride_kd,
                mask=kv_mask, other=k_other)
    v = tl.load(v_head + blk[:, None] * stride_vb + off[:, None] * stride_vo + d[None, :] * stride_vd,
                mask=kv_mask, other=v_other)
    if KV_QUANT:
        k_s = tl.load(ks_head + blk * stride_sb + off * stride_so, mask=mask, other=ks_other)
        v_s = tl.load(vs_head + blk * stride_sb + off * stride_so, mask=mask, other=vs_other)
    else:
        k_s = 1.0
        v_s = 1.0
    return k, v, k_s, v_s


def _tile_update(q, k, v, k_s, v_s, n_mask, m_i, l_i, acc, sm_scale_log2, IEEE_DOT: tl.constexpr,
                 KV_QUANT: tl.constexpr):
    """One tile of the online softmax: (running max, sum, accumulator) after the tile's keys and values."""
    if KV_QUANT:
        k = k.to(q.dtype)     # int8 and e4m3 values are exact in fp16 / bf16
        v = v.to(q.dtype)
    if IEEE_DOT:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if KV_QUANT:
        s = s * k_s[None, :]
    s = tl.where(n_mask[None, :], s * sm_scale_log2, float("-inf"))     # [BLOCK_G, BLOCK_N]

    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if KV_QUANT:
        p = p * v_s[None, :]  # Σ p·(v·s) = Σ (p·s)·v: the V scales weigh the probabilities, not the tile
    if IEEE_DOT:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


# a Triton kernel: launched as _jit(_decode_stage1_kernel)[grid](...)
def _decode_stage1_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_o_ptr, part_lse_ptr, k_scale_ptr, v_scale_ptr,
    sm_scale_log2,                                   # softmax scale · log2(e): scores are kept in base 2
    stride_qb, stride_qh, stride_qd,                 # q [B, H, D]
    stride_kb, stride_ko, stride_kh, stride_kd,      # k_cache [num_blocks, block_size, H_kv, D]
    stride_vb, stride_vo, stride_vh, stride_vd,      # v_cache
    stride_bt,                                       # block_tables row stride
    stride_ob, stride_oh, stride_od,                 # out [B, H, D]
    stride_pb, stride_ph, stride_ps,                 # partials: lse [B, H, S]; o [B, H, S, BLOCK_D] contiguous
    stride_sb, stride_so, stride_sh,                 # k_scale / v_scale [num_blocks, block_size, H_kv]
    head_dim, partition_size,
    GROUP: tl.constexpr,                             # H / H_kv
    BLOCK_SIZE: tl.constexpr,                        # tokens per cache block
    BLOCK_G: tl.constexpr,                           # GROUP padded to >= 16
    BLOCK_D: tl.constexpr,                           # head_dim padded to a power of two
    BLOCK_N: tl.constexpr,                           # context tokens per tile
    SPLIT: tl.constexpr,                             # True: write partials; False: write the output rows
    IEEE_DOT: tl.constexpr,                          # fp32 inputs: exact fp32 dot instead of tf32
    KV_QUANT: tl.constexpr,                          # int8 / fp8 cache with per-(token, head) scales
    FRESH: tl.constexpr,                             # > 0: the kernel before this one stored (at most) each
                                                     # sequence's last FRESH tokens; the first tile's others are
                                                     # read before the PDL wait
    PDL: tl.constexpr,                               # programmatic dependent launch (nvllm.kernels.pdl)
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    start = split * partition_size
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + g
    g_mask = g < GROUP
    d_mask = d < head_dim

    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kvh.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kvh.to(tl.int64) * stride_vh
    ks_head = k_scale_ptr + kvh.to(tl.int64) * stride_sh
    vs_head = v_scale_ptr + kvh.to(tl.int64) * stride_sh
    if FRESH:   # the first tile's tokens from earlier steps, read while the previous kernel stores this step's
        ctx = tl.load(context_lens_ptr + b)          # (the caller's promise: it wrote nothing else this reads)
        end = tl.minimum(start + partition_size, ctx)
        n = start + tl.arange(0, BLOCK_N)
        n_mask = n < end
        old = n_mask & (n < ctx - FRESH)
        # every token's block id too (block tables are staged before the step): the newest rows' loads after the
        # wait then need no trip to the block table first
        blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        off = (n % BLOCK_SIZE).to(tl.int64)
        k_old, v_old, ks_old, vs_old = _kv_rows(k_head, v_head, ks_head, vs_head, blk, off, old, d, d_mask,
                                                stride_kb, stride_ko, stride_kd, stride_vb, stride_vo, stride_vd,
                                                stride_sb, stride_so, KV_QUANT, 0.0, 0.0, 0.0, 0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if not FRESH:
        ctx = tl.load(context_lens_ptr + b)
        end = tl.minimum(start + partition_size, ctx)

    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    first = start
    if FRESH:
        if start < end:   # the newest tokens over the ones read before the wait
            k, v, k_s, v_s = _kv_rows(k_head, v_head, ks_head, vs_head, blk, off, n_mask & ~old, d, d_mask,
                                      stride_kb, stride_ko, stride_kd, stride_vb, stride_vo, stride_vd,
                                      stride_sb, stride_so, KV_QUANT, k_old, v_old, ks_old, vs_old)
            m_i, l_i, acc = _tile_update(q, k, v, k_s, v_s, n_mask, m_i, l_i, acc, sm_scale_log2, IEEE_DOT,
                                         KV_QUANT)
        first = start + BLOCK_N
    for n0 in range(first, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        k, v, k_s, v_s = _kv_tile(k_head, v_head, ks_head, vs_head, bt_row, n, n_mask, d, d_mask,
                                  stride_kb, stride_ko, stride_kd, stride_vb, stride_vo, stride_vd,
                                  stride_sb, stride_so, BLOCK_SIZE, KV_QUANT, 0.0, 0.0, 0.0, 0.0)
        m_i, l_i, acc = _tile_update(q, k, v, k_s, v_s, n_mask, m_i, l_i, acc, sm_scale_log2, IEEE_DOT, KV_QUANT)

    # empty partition (or padding row with ctx 0): l = 0, acc = 0 -> output 0, lse = -inf
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SPLIT:
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        part = b.to(tl.int64) * stride_pb + heads * stride_ph + split * stride_ps
        tl.store(part_lse_ptr + part, lse, mask=g_mask)
        tl.store(part_o_ptr + part[:, None] * BLOCK_D + d[None, :], o, mask=g_mask[:, None] & d_mask[None, :])
    else:
        dst = out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :] * stride_od
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


# a Triton kernel: launched as _jit(_decode_stage2_kernel)[grid](...)
def _decode_stage2_kernel(
    part_o_ptr, part_lse_ptr, out_ptr,
    stride_pb, stride_ph, stride_ps,                 # lse [B, H, S]; o [B, H, S, BLOCK_D] contiguous
    stride_ob, stride_oh, stride_od,
    head_dim, num_splits,
    BLOCK_S: tl.constexpr,                           # num_splits padded to a power of two
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,                               # programmatic dependent launch (nvllm.kernels.pdl)
):
    """One program per (sequence, query head): merges the partials of that row."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    base = b.to(tl.int64) * stride_pb + h * stride_ph + s * stride_ps

    lse = tl.load(part_lse_ptr + base, mask=s_mask, other=float("-inf"))    # base-2 log-sum-exp
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)               # all empty: weights 0
    w = tl.exp2(lse - lse_max)
    live = s_mask & (lse > float("-inf"))
    o = tl.load(part_o_ptr + base[:, None] * BLOCK_D + d[None, :], mask=live[:, None] & (d < head_dim)[None, :],
                other=0.0)
    w_sum = tl.sum(w, 0)
    acc = tl.sum(o * w[:, None], 0) / tl.where(w_sum > 0, w_sum, 1.0)
    dst = out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + d * stride_od
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=d < head_dim)


# arguments that vary with the batch (block-table width, split count): not specialized (see nvllm.kernels.jit)
_decode_stage1_kernel.do_not_specialize = ("stride_bt", "stride_pb", "stride_ph", "partition_size")
_decode_stage1_kernel.helpers = ("_kv_tile", "_kv_rows", "_tile_update")
_decode_stage2_kernel.do_not_specialize = ("stride_pb", "stride_ph", "num_splits")


def kv_scale_args(k_cache, v_cache, k_scale, v_scale):
    """(k_scale, v_scale, their strides) as the attention kernels take them: a quantized cache's scale tensors,
    or for an unquantized cache k_cache itself twice (never read) and zero strides."""
    if k_scale is None:
        return k_cache, k_cache, (0, 0, 0)
    assert k_cache.dtype in (torch.int8, torch.float8_e4m3fn) and v_cache.dtype == k_cache.dtype, k_cache.dtype
    assert k_scale.shape == v_scale.shape == k_cache.shape[:3] and k_scale.stride() == v_scale.stride()
    assert k_scale.dtype == v_scale.dtype == torch.float32
    return k_scale, v_scale, k_scale.stride()


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _decode_block_n(head_dim_padded: int) -> int:
    return 64 if head_dim_padded <= 128 else 32


def decode_split_policy(batch: int, num_kv_heads: int, max_len: int, block_n: int,
                        num_sms: int = DEFAULT_NUM_SMS) -> tuple[int, int]:
    """(num_splits, partition_size) for a batch whose longest context is at most ``max_len`` tokens."""
    max_len = max(int(max_len), 1)
    base = max(batch * num_kv_heads, 1)
    wanted = -(-PROGRAMS_PER_SM * num_sms // base)
    splits = max(1, min(wanted, -(-max_len // MIN_PARTITION), MAX_SPLITS))
    partition = -(-max_len // splits)
    partition = -(-partition // block_n) * block_n
    return -(-max_len // partition), partition


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None, *,
                     max_context_len: int | None = None, partition_size: int | None = None,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                     fresh_tokens: int = 0, defer_merge: bool = False) -> torch.Tensor | AttentionPartials:
    """Triton paged decode attention (flash-decoding). Same result as ``decode_attention_reference``.
    ``k_scale``/``v_scale``: the per-(token, head) scales of an int8 / fp8 cache (None: unquantized).

    ``max_context_len``: the batch's longest context if the caller knows it on the host (sizes the split
    grid); ``partition_size``: force a partition length in tokens (a multiple of 16; tests use it to make
    short contexts split). Row b of q is sequence b's query; rows past len(context_lens) are not written
    (the reference leaves rows that no sequence owns untouched too). ``fresh_tokens`` > 0: the launch just before
    this one stored at most each sequence's last ``fresh_tokens`` tokens in the cache (a decode step: 1), so under
    PDL the first tile's other tokens are read before the wait; 0: nothing is read before it. ``defer_merge``: a
    split launch returns its ``AttentionPartials`` unmerged, for its consumer to merge (``attention_partials``)."""
    import triton

    num_rows, num_heads, head_dim = q.shape
    batch = min(num_rows, context_lens.shape[0])     # rows past the last sequence are left as they are
    _, block_size, num_kv_heads, kd = k_cache.shape
    assert kd == head_dim and v_cache.shape == k_cache.shape, (q.shape, k_cache.shape, v_cache.shape)
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert block_size >= 8 and block_size & (block_size - 1) == 0, "block_size must be a power of two >= 8"
    assert head_dim <= 256, "head_dim above 256 is not supported"
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out

    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16 on the GPU
    block_g = max(16, triton.next_power_of_2(group))
    block_n = _decode_block_n(block_d)
    max_len = max_context_len if max_context_len is not None else block_tables.shape[1] * block_size
    if partition_size is not None:
        assert partition_size % 16 == 0, "partition_size must be a multiple of 16"
        block_n = next(bn for bn in (block_n, 32, 16) if partition_size % bn == 0)
        partition, num_splits = partition_size, max(1, -(-max_len // partition_size))
    else:
        num_sms = _num_sms(q.device.index or 0) if q.is_cuda else DEFAULT_NUM_SMS
        num_splits, partition = decode_split_policy(batch, num_kv_heads, max_len, block_n, num_sms)

    split = num_splits > 1
    if split:
        part_o = torch.empty(batch, num_heads, num_splits, block_d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:  # unused by the kernel; any fp32 tensors with the right rank
        part_o = torch.empty(1, 1, 1, 1, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(1, 1, 1, dtype=torch.float32, device=q.device)

    ieee = q.dtype == torch.float32 or k_cache.dtype == torch.float32
    kv_quant = k_scale is not None
    k_scale, v_scale, scale_strides = kv_scale_args(k_cache, v_cache, k_scale, v_scale)
    _jit(_decode_stage1_kernel)[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens,
        out, part_o, part_lse, k_scale, v_scale,
        scale * 1.4426950408889634,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), block_tables.stride(0), *out.stride(),
        *part_lse.stride(), *scale_strides,
        head_dim, partition,
        GROUP=group, BLOCK_SIZE=block_size, BLOCK_G=block_g, BLOCK_D=block_d, BLOCK_N=block_n,
        SPLIT=split, IEEE_DOT=ieee, KV_QUANT=kv_quant, FRESH=max(0, int(fresh_tokens)),
        num_warps=4, num_stages=2, **pdl.launch_args(q),
    )
    if split and defer_merge and batch == num_rows:
        return AttentionPartials(out, part_o, part_lse, context_lens, partition)
    if split:
        merge_partials(part_o, part_lse, out)
    return out


def merge_partials(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor) -> None:
    """Stage 2: the partials of ``part_o.shape[0]`` sequences merged into ``out`` [B, H, D] (later rows untouched)."""
    import triton

    batch, num_heads, num_splits, block_d = part_o.shape
    report.record("attention.merge", "triton decode merge")
    _jit(_decode_stage2_kernel)[(batch, num_heads)](
        part_o, part_lse, out,
        *part_lse.stride(), *out.stride(),
        out.shape[2], num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d,
        num_warps=4 if block_d >= 128 else 2, **pdl.launch_args(out),
    )
