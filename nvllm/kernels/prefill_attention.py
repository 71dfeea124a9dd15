"""Paged prefill / extend attention: causal, variable-length query chunks against the paged KV cache.

Inputs (B sequences, T query tokens in all; the same contract as ``paged_attention``):
  q               [T, H, D]
  k_cache/v_cache [num_blocks, block_size, H_kv, D]      (this step's K/V already stored)
  block_tables    [B, max_blocks] int32
  query_start_loc [B + 1] int32                          (sequence b owns q rows qsl[b]:qsl[b+1])
  context_lens    [B] int32                              (cache tokens of b after this step's store)
  k_scale/v_scale [num_blocks, block_size, H_kv] fp32 or None   (a quantized int8 / fp8 e4m3 cache)
The rows of sequence b are its last query_len positions: row j sits at position context_len - query_len + j
and attends to cache positions 0 .. that position. Every key (cached prefix and this step's chunk) is read
from the cache through the block table, so plain prefill, chunked prefill and prefix-cache hits are one path.

Kernel (flash-attention forward over a paged cache):
  grid (ceil(max_query_len / BLOCK_M), H, B): one program per (query tile of BLOCK_M rows, query head,
  sequence), the last query tiles (the most keys) first so that the short ones fill the tail. Each program
  walks key tiles of BLOCK_N tokens from position 0 up to the last position its tile can see (causal skipping:
  key tiles past the query tile's last row are never loaded), gathering token n from block
  block_tables[b, n // block_size] at offset n % block_size; only the tiles that cross the diagonal (or the
  end of the keys) are masked.
  Online softmax in base 2 with fp32 max / sum / accumulator; QK^T and PV on tl.dot. Tiles of a sequence
  past its query_len do no work; head_dim is padded to a power of two with masks.
  Quantized cache (KV_QUANT): dequantized as the tiles are read, as in the decode kernel — K converted exactly
  to q's dtype with its per-token scales applied to the fp32 scores, V converted alike with its scales
  applied to the probabilities before the PV dot.
"""

from __future__ import annotations

import torch

from nvllm.kernels.jit import lazy_jit

tl = None  # triton.language, bound by lazy_jit at the first launch
_jit = lazy_jit


# ---------------------------------------------------------------------------------------------- reference


def prefill_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                                context_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
                                v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The torch reference: ``paged_attention_reference`` (it covers every query length and dequantizes a
    quantized cache explicitly)."""
    from nvllm.kernels.paged_attention import paged_attention_reference

    return paged_attention_reference(q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
                                     k_scale=k_scale, v_scale=v_scale)


# ------------------------------------------------------------------------------------------------- Triton


# a Triton helper of _prefill_kernel
def _attend(q, m_i, l_i, acc, n0, hi, q_pos, bt_row, k_head, v_head, ks_head, vs_head, d, d_mask, sm_scale_log2,
            stride_kb, stride_ko, stride_kd, stride_vb, stride_vo, stride_vd, stride_sb, stride_so,
            BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE_DOT: tl.constexpr, KV_QUANT: tl.constexpr,
            MASKED: tl.constexpr):
    """One key tile (tokens n0 .. n0 + BLOCK_N) into the online softmax. ``MASKED``: the tile crosses the causal
    diagonal or the end of the keys (``hi``); without it every row sees every key of the tile."""
    n = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        n_mask = n < hi
        blk = tl.load(bt_row + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
    else:
        blk = tl.load(bt_row + n // BLOCK_SIZE).to(tl.int64)
        kv_mask = d_mask[None, :]
    off = (n % BLOCK_SIZE).to(tl.int64)
    k = tl.load(k_head + blk[:, None] * stride_kb + off[:, None] * stride_ko + d[None, :] * stride_kd,
                mask=kv_mask, other=0.0)
    v = tl.load(v_head + blk[:, None] * stride_vb + off[:, None] * stride_vo + d[None, :] * stride_vd,
                mask=kv_mask, other=0.0)
    if KV_QUANT:
        k_s = tl.load(ks_head + blk * stride_sb + off * stride_so, mask=n < hi, other=0.0)
        v_s = tl.load(vs_head + blk * stride_sb + off * stride_so, mask=n < hi, other=0.0)
        k = k.to(q.dtype)     # int8 and e4m3 values are exact in fp16 / bf16
        v = v.to(q.dtype)

    if IEEE_DOT:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if KV_QUANT:
        s = s * k_s[None, :]
    if MASKED:
        visible = (n[None, :] <= q_pos[:, None]) & (n < hi)[None, :]
        s = tl.where(visible, s * sm_scale_log2, float("-inf"))         # [BLOCK_M, BLOCK_N]
    else:
        s = s * sm_scale_log2

    # a row's first key tile always holds position 0, so m_new is finite for every row that has keys
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)                # rows past q_len / empty tiles
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if KV_QUANT:
        p = p * v_s[None, :]  # Σ p·(v·s) = Σ (p·s)·v: the V scales weigh the probabilities, not the tile
    if IEEE_DOT:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


# a Triton kernel: launched as _jit(_prefill_kernel)[grid](...)
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, context_lens_ptr, out_ptr,
    k_scale_ptr, v_scale_ptr,
    sm_scale_log2,                                   # softmax scale · log2(e): scores are kept in base 2
    stride_qt, stride_qh, stride_qd,                 # q [T, H, D]
    stride_kb, stride_ko, stride_kh, stride_kd,      # k_cache [num_blocks, block_size, H_kv, D]
    stride_vb, stride_vo, stride_vh, stride_vd,      # v_cache
    stride_bt,                                       # block_tables row stride
    stride_ot, stride_oh, stride_od,                 # out [T, H, D]
    stride_sb, stride_so, stride_sh,                 # k_scale / v_scale [num_blocks, block_size, H_kv]
    head_dim,
    GROUP: tl.constexpr,                             # H / H_kv
    BLOCK_SIZE: tl.constexpr,                        # tokens per cache block
    BLOCK_M: tl.constexpr,                           # query rows per program
    BLOCK_N: tl.constexpr,                           # key tokens per tile
    BLOCK_D: tl.constexpr,                           # head_dim padded to a power of two
    IEEE_DOT: tl.constexpr,                          # fp32 inputs: exact fp32 dot instead of tf32
    KV_QUANT: tl.constexpr,                          # int8 / fp8 cache with per-(token, head) scales
):
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # the longest (last) query tiles start first
    h = tl.program_id(1)
    b = tl.program_id(2)
    kvh = h // GROUP

    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    ctx = tl.load(context_lens_ptr + b)
    prefix = ctx - q_len                             # position of query row 0

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)    # query row within the sequence
    d = tl.arange(0, BLOCK_D)
    row_mask = rows < q_len
    d_mask = d < head_dim
    q_pos = prefix + rows

    q_rows = (q_start + rows).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + d[None, :] * stride_qd,
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # causal skipping: the tile's last row sees keys up to position prefix + tile_end - 1; a tile with no
    # rows (past this sequence's query_len) walks no keys at all. Key tiles wholly at or before the first
    # row's position are seen by every row: no mask there (``full``), the mask on the rest.
    tile_end = tl.minimum((tile + 1) * BLOCK_M, q_len)
    has_rows = tile * BLOCK_M < q_len
    hi = tl.where(has_rows, prefix + tile_end, 0)
    full = tl.where(has_rows, (prefix + tile * BLOCK_M + 1) // BLOCK_N * BLOCK_N, 0)

    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    k_head = k_cache_ptr + kvh.to(tl.int64) * stride_kh
    v_head = v_cache_ptr + kvh.to(tl.int64) * stride_vh
    ks_head = k_scale_ptr + kvh.to(tl.int64) * stride_sh
    vs_head = v_scale_ptr + kvh.to(tl.int64) * stride_sh
    for n0 in range(0, full, BLOCK_N):
        m_i, l_i, acc = _attend(q, m_i, l_i, acc, n0, hi, q_pos, bt_row, k_head, v_head, ks_head, vs_head, d,
                                d_mask, sm_scale_log2, stride_kb, stride_ko, stride_kd, stride_vb, stride_vo,
                                stride_vd, stride_sb, stride_so, BLOCK_SIZE, BLOCK_N, IEEE_DOT, KV_QUANT, False)
    for n0 in range(full, hi, BLOCK_N):
        m_i, l_i, acc = _attend(q, m_i, l_i, acc, n0, hi, q_pos, bt_row, k_head, v_head, ks_head, vs_head, d,
                                d_mask, sm_scale_log2, stride_kb, stride_ko, stride_kd, stride_vb, stride_vo,
                                stride_vd, stride_sb, stride_so, BLOCK_SIZE, BLOCK_N, IEEE_DOT, KV_QUANT, True)

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    dst = out_ptr + q_rows[:, None] * stride_ot + h * stride_oh + d[None, :] * stride_od
    tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


_prefill_kernel.helpers = ("_attend",)


def _prefill_config(head_dim_padded: int, max_query_len: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): 128 × 128 tiles for long prompts, down to 16-row query tiles
    for the short chunks of a mixed batch; 32-wide key tiles at head_dim 256 to keep K/V tiles in shared memory."""
    import triton

    block_m = 128 if max_query_len >= 128 and head_dim_padded <= 128 else 64
    block_m = min(block_m, max(16, triton.next_power_of_2(max_query_len)))
    # 128-wide key tiles under 128-row query tiles: 122 µs against 133 µs at 64 for a 2048-token Qwen2.5-7B
    # prompt on the H200 (gpu_attention_bench.py --prefill, PERF run X)
    block_n = (128 if block_m >= 128 else 64) if head_dim_padded <= 128 else 32
    num_warps = 8 if block_m >= 128 or head_dim_padded >= 256 else 4
    num_stages = 3 if head_dim_padded <= 128 else 2
    return block_m, block_n, num_warps, num_stages


_prefill_kernel.do_not_specialize = ("stride_bt",)   # varies with the batch (see nvllm.kernels.jit)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      query_start_loc: torch.Tensor, context_lens: torch.Tensor, scale: float,
                      max_query_len: int, out: torch.Tensor | None = None, *,
                      block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                      num_stages: int | None = None, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Triton paged prefill / extend attention. Same result as ``prefill_attention_reference``.
    ``k_scale``/``v_scale``: the per-(token, head) scales of an int8 / fp8 cache (None: unquantized).

    ``max_query_len`` (host int, >= every sequence's query_len) sizes the grid; ``block_m`` / ``block_n``
    override the tile sizes (powers of two >= 16), ``num_warps`` / ``num_stages`` the launch (benchmarks)."""
    import triton

    from nvllm.kernels.decode_attention import kv_scale_args

    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, kd = k_cache.shape
    assert kd == head_dim and v_cache.shape == k_cache.shape, (q.shape, k_cache.shape, v_cache.shape)
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert block_size >= 8 and block_size & (block_size - 1) == 0, "block_size must be a power of two >= 8"
    assert head_dim <= 256, "head_dim above 256 is not supported"
    if out is None:
        out = torch.empty_like(q)
    batch = query_start_loc.shape[0] - 1
    if num_tokens == 0 or batch == 0 or max_query_len <= 0:
        return out

    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16 on the GPU
    bm, bn, num_warps_default, num_stages_default = _prefill_config(block_d, max_query_len)
    bm, bn = block_m or bm, block_n or bn
    num_warps, num_stages = num_warps or num_warps_default, num_stages or num_stages_default
    ieee = q.dtype == torch.float32 or k_cache.dtype == torch.float32
    kv_quant = k_scale is not None
    k_scale, v_scale, scale_strides = kv_scale_args(k_cache, v_cache, k_scale, v_scale)
    grid = (triton.cdiv(max_query_len, bm), num_heads, batch)
    _jit(_prefill_kernel)[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, out, k_scale, v_scale,
        scale * 1.4426950408889634,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), block_tables.stride(0), *out.stride(),
        *scale_strides,
        head_dim,
        GROUP=num_heads // num_kv_heads, BLOCK_SIZE=block_size, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d,
        IEEE_DOT=ieee, KV_QUANT=kv_quant,
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
