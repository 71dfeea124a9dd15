"""Triton KV-store, paged decode and paged prefill kernels against their torch references, on the CPU under
the Triton interpreter.

Every case builds a paged cache whose unused slots, spare blocks and block-table padding hold NaN, so a kernel
that reads past a context (or through a padding entry of the block table) shows up as NaN; outputs are
poisoned with NaN before the kernel runs, so an unwritten row shows up too. Block tables are a random
permutation of block ids (never contiguous) and contexts end mid-block.

Tolerances (max |kernel - reference|, reference in fp32 then cast to the output dtype):
  fp32 atol 2e-5 / rtol 2e-5, fp16 atol 3e-3 / rtol 3e-3, bf16 atol 2e-2 / rtol 2e-2.
The KV store is a copy with a cast and must match exactly (fp32 -> bf16: within one ulp, see the test).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel module is imported

import functools  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from nvllm.kernels import report  # noqa: E402
from nvllm.kernels.decode_attention import (  # noqa: E402
    MAX_SPLITS, MIN_PARTITION, decode_attention, decode_attention_reference, decode_split_policy)
from nvllm.kernels.kv_store import store_kv, store_kv_reference, store_kv_triton  # noqa: E402
from nvllm.kernels.paged_attention import paged_attention, paged_attention_reference  # noqa: E402
from nvllm.kernels.prefill_attention import prefill_attention, prefill_attention_reference  # noqa: E402

TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@functools.lru_cache(maxsize=None)
def _interpreter_bf16_dot_ok() -> bool:
    """Whether this Triton's interpreter multiplies bf16 operands of tl.dot correctly (3.9 multiplies their
    raw uint16 bits); the attention kernels' bf16 cases run only where it does."""
    import triton.language as tl

    @triton.jit
    def _probe(a_ptr, b_ptr, c_ptr):
        r = tl.arange(0, 16)
        idx = r[:, None] * 16 + r[None, :]
        tl.store(c_ptr + idx, tl.dot(tl.load(a_ptr + idx), tl.load(b_ptr + idx)))

    a = torch.randn(16, 16).bfloat16()
    b = torch.randn(16, 16).bfloat16()
    c = torch.empty(16, 16)
    _probe[(1,)](a, b, c)
    return torch.allclose(c, a.float() @ b.float(), atol=1e-2, rtol=1e-2)


def _dtype_param(dtype):
    return pytest.param(dtype, id=str(dtype).removeprefix("torch."))


ATTN_DTYPES = [_dtype_param(torch.float32), _dtype_param(torch.float16), _dtype_param(torch.bfloat16)]


def _skip_unsupported(dtype):
    if dtype == torch.bfloat16 and not _interpreter_bf16_dot_ok():
        pytest.skip("Triton interpreter computes tl.dot on bf16 operands wrongly (raw bits); bf16 attention "
                    "is checked on the GPU")


def _paged_cache(ctx_lens, num_kv_heads, head_dim, block_size, dtype, gen):
    """(k_cache, v_cache, block_tables) holding random K/V for each context; everything a kernel must not
    read (tail of a sequence's last block, spare blocks, block-table padding) is NaN."""
    need = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(need) + 3                      # spares; the last id of the permutation stays unused
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    poison_block = int(perm[-1])
    max_blocks = max(need) + 2                      # padding columns
    block_tables = torch.full((len(ctx_lens), max_blocks), poison_block, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    used = 0
    for b, (c, n) in enumerate(zip(ctx_lens, need)):
        block_tables[b, :n] = perm[used:used + n]
        used += n
        if c == 0:
            continue
        pos = torch.arange(c)
        slots = block_tables[b, pos // block_size].long() * block_size + pos % block_size
        key = torch.randn(c, num_kv_heads, head_dim, generator=gen)
        value = torch.randn(c, num_kv_heads, head_dim, generator=gen)
        store_kv_reference(key, value, k_cache, v_cache, slots)
    return k_cache, v_cache, block_tables


def _assert_close(out, ref, dtype):
    assert out.dtype == ref.dtype
    assert torch.isfinite(out).all(), "kernel left unwritten (NaN) or non-finite rows"
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


# ------------------------------------------------------------------------------------------------ KV store


@pytest.mark.parametrize("src,dst", [
    (torch.float32, torch.float32), (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float16), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
])
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(2, 16, 8), (3, 24, 16)])
def test_store_kv_matches_reference(src, dst, num_kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(1)
    num_blocks, tokens = 7, 21
    # key and value as slices of one fused qkv output: strided views, as the model hands them over
    qkv = torch.randn(tokens, 4 * num_kv_heads * head_dim, generator=gen).to(src)
    kv_size = num_kv_heads * head_dim
    key = qkv[:, 2 * kv_size:3 * kv_size].view(tokens, num_kv_heads, head_dim)
    value = qkv[:, 3 * kv_size:].view(tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[torch.tensor([0, 5, 6, 20])] = -1                     # padding rows: never stored
    slots = slots.to(torch.int32)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dst)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dst)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    store_kv_reference(key, value, k_ref, v_ref, slots)
    store_kv_triton(key, value, k_cache, v_cache, slots)
    if src == torch.float32 and dst == torch.bfloat16:
        # the interpreter rounds fp32 -> bf16 toward zero (the GPU and torch round to nearest even): one ulp
        torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=2 ** -7)
        torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=2 ** -7)
    else:
        assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


# ------------------------------------------------------------------------------------------ decode attention

# (group = H / H_kv, H_kv, block_size): every GQA ratio, both small block sizes
GQA_CASES = [(1, 2, 8), (2, 2, 16), (4, 1, 8), (8, 1, 16)]


@pytest.mark.parametrize("dtype", ATTN_DTYPES)
@pytest.mark.parametrize("group,num_kv_heads,block_size", GQA_CASES)
def test_decode_attention_matches_reference(dtype, group, num_kv_heads, block_size):
    _skip_unsupported(dtype)
    gen = torch.Generator().manual_seed(2)
    head_dim = 32
    ctx_lens = [1, 13, 64, 100]          # length 1, mid-block, block-aligned, long
    k_cache, v_cache, block_tables = _paged_cache(ctx_lens, num_kv_heads, head_dim, block_size, dtype, gen)
    q = torch.randn(len(ctx_lens), group * num_kv_heads, head_dim, generator=gen).to(dtype)
    context_lens = torch.tensor(ctx_lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    ref = decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale)

    # the default policy (contexts this short: one split, output written directly), then split-KV with
    # partitions of 16 and 32 tokens: the 100-token context spans 7 and 4 partitions, merged by stage 2; each
    # also with the first tile read in two parts (``fresh_tokens``: the newest one or three tokens after the rest)
    for partition_size in (None, 16, 32):
        for fresh in (0, 1, 3):
            out = torch.full_like(q, float("nan"))
            got = decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, out=out,
                                   partition_size=partition_size, fresh_tokens=fresh)
            assert got is out
            _assert_close(out, ref, dtype)


def test_decode_attention_odd_head_dim_padding_row_and_max_len():
    """head_dim 24 (padded to 32 with masks), a padding row with context 0 (its output is 0, as the
    reference's), the host-known ``max_context_len`` sizing the split grid, and a strided output."""
    gen = torch.Generator().manual_seed(3)
    dtype, head_dim, num_kv_heads, group, block_size = torch.float32, 24, 2, 2, 8
    ctx_lens = [37, 0, 5, 90]
    k_cache, v_cache, block_tables = _paged_cache(ctx_lens, num_kv_heads, head_dim, block_size, dtype, gen)
    q = torch.randn(len(ctx_lens), group * num_kv_heads, head_dim, generator=gen)
    context_lens = torch.tensor(ctx_lens, dtype=torch.int32)
    ref = decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, 0.2)
    assert torch.equal(ref[1], torch.zeros_like(ref[1]))

    for partition_size in (None, 16):
        buf = torch.full((len(ctx_lens), group * num_kv_heads, head_dim + 8), float("nan"))
        out = buf[:, :, :head_dim]                          # strided: rows of head_dim + 8
        decode_attention(q, k_cache, v_cache, block_tables, context_lens, 0.2, out=out,
                         max_context_len=max(ctx_lens), partition_size=partition_size, fresh_tokens=1)
        _assert_close(out, ref, dtype)
        assert torch.isnan(buf[:, :, head_dim:]).all()       # nothing written past the row


def test_decode_split_policy():
    # long context, batch 1, 4 KV heads (Qwen2.5-7B): splits until MIN_PARTITION tokens per split
    splits, part = decode_split_policy(1, 4, 4096, 64, num_sms=132)
    assert (splits, part) == (4096 // MIN_PARTITION, MIN_PARTITION)
    # large batch already fills the GPU: few splits
    splits, part = decode_split_policy(64, 8, 4096, 64, num_sms=132)
    assert splits == 2 and part == 2048
    # short context: never split below MIN_PARTITION
    assert decode_split_policy(1, 1, MIN_PARTITION, 64)[0] == 1
    # very long context, batch 1: capped at MAX_SPLITS
    assert decode_split_policy(1, 1, 1 << 20, 64)[0] == MAX_SPLITS
    for batch, kv, max_len, bn in [(1, 4, 4096, 64), (3, 2, 1000, 32), (256, 8, 32768, 64), (1, 8, 1, 64)]:
        splits, part = decode_split_policy(batch, kv, max_len, bn)
        assert part % bn == 0 and 1 <= splits <= MAX_SPLITS
        assert splits * part >= max_len > (splits - 1) * part


# ----------------------------------------------------------------------------------------- prefill attention

PREFILL_CASES = {
    # (context_len, query_len) per sequence
    "plain": [(1, 1), (13, 13), (48, 48)],                   # context_len == query_len
    "extend": [(37, 5), (100, 30), (9, 1), (64, 20), (20, 0)],         # cached prefix (+ an idle sequence)
}


@pytest.mark.parametrize("dtype", ATTN_DTYPES)
@pytest.mark.parametrize("group,num_kv_heads,block_size", GQA_CASES)
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_prefill_attention_matches_reference(dtype, group, num_kv_heads, block_size, case):
    _skip_unsupported(dtype)
    gen = torch.Generator().manual_seed(4)
    head_dim = 32
    ctx_lens = [c for c, _ in PREFILL_CASES[case]]
    q_lens = [n for _, n in PREFILL_CASES[case]]
    k_cache, v_cache, block_tables = _paged_cache(ctx_lens, num_kv_heads, head_dim, block_size, dtype, gen)
    num_heads = group * num_kv_heads
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(q_lens).cumsum(0)
    context_lens = torch.tensor(ctx_lens, dtype=torch.int32)
    scale = head_dim ** -0.5
    ref = prefill_attention_reference(q, k_cache, v_cache, block_tables, qsl, context_lens, scale)

    # default tiles, then 16x16 tiles: several query tiles per sequence and causal skipping of key tiles
    for block_m, block_n in ((None, None), (16, 16)):
        out = torch.full_like(q, float("nan"))
        got = prefill_attention(q, k_cache, v_cache, block_tables, qsl, context_lens, scale, max(q_lens),
                                out=out, block_m=block_m, block_n=block_n)
        assert got is out
        _assert_close(out, ref, dtype)


def test_prefill_attention_odd_head_dim_and_strided_q():
    """head_dim 24 (padded with masks) and q as a strided slice of a fused qkv output."""
    gen = torch.Generator().manual_seed(5)
    dtype, head_dim, num_kv_heads, group, block_size = torch.float16, 24, 2, 2, 8
    ctx_lens, q_lens = [30, 17, 50], [30, 4, 33]
    k_cache, v_cache, block_tables = _paged_cache(ctx_lens, num_kv_heads, head_dim, block_size, dtype, gen)
    num_heads = group * num_kv_heads
    qkv = torch.randn(sum(q_lens), (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    q = qkv[:, :num_heads * head_dim].view(sum(q_lens), num_heads, head_dim)
    qsl = torch.tensor([0, 30, 34, 67], dtype=torch.int32)
    context_lens = torch.tensor(ctx_lens, dtype=torch.int32)
    ref = prefill_attention_reference(q, k_cache, v_cache, block_tables, qsl, context_lens, 0.3)
    out = torch.full_like(ref, float("nan"))
    prefill_attention(q, k_cache, v_cache, block_tables, qsl, context_lens, 0.3, max(q_lens), out=out,
                      block_m=16, block_n=32)
    _assert_close(out, ref, dtype)


# ---------------------------------------------------------------------------------------------- dispatch


def test_dispatch_runs_triton_when_forced(monkeypatch):
    monkeypatch.setenv("NVLLM_KERNELS", "triton")
    report.reset()
    gen = torch.Generator().manual_seed(6)
    dtype, head_dim, num_kv_heads, num_heads, block_size = torch.float16, 16, 2, 4, 8

    # decode step: store this step's K/V, then attend (max_query_len == 1)
    ctx_lens = [9, 25]
    k_cache, v_cache, block_tables = _paged_cache(ctx_lens, num_kv_heads, head_dim, block_size, dtype, gen)
    new_k = torch.randn(2, num_kv_heads, head_dim, generator=gen).to(dtype)
    new_v = torch.randn(2, num_kv_heads, head_dim, generator=gen).to(dtype)
    pos = torch.tensor(ctx_lens)                              # the slots right after each context
    slots = (block_tables[[0, 1], pos // block_size].long() * block_size + pos % block_size).to(torch.int32)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_reference(new_k, new_v, k_ref, v_ref, slots)
    store_kv(new_k, new_v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.nan_to_num(), k_ref.nan_to_num())
    assert torch.equal(v_cache.nan_to_num(), v_ref.nan_to_num())

    context_lens = torch.tensor([c + 1 for c in ctx_lens], dtype=torch.int32)
    q = torch.randn(2, num_heads, head_dim, generator=gen).to(dtype)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    ref = paged_attention_reference(q, k_cache, v_cache, block_tables, qsl, context_lens, 0.25)
    _assert_close(paged_attention(q, k_cache, v_cache, block_tables, qsl, context_lens, 0.25, 1), ref, dtype)

    # mixed step: a prefill chunk with a cached prefix next to a decode (max_query_len > 1)
    qsl = torch.tensor([0, 6, 7], dtype=torch.int32)
    q = torch.randn(7, num_heads, head_dim, generator=gen).to(dtype)
    ref = paged_attention_reference(q, k_cache, v_cache, block_tables, qsl, context_lens, 0.25)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, k_cache, v_cache, block_tables, qsl, context_lens, 0.25, 6, out=out)
    _assert_close(out, ref, dtype)

    assert report.snapshot() == {
        "attention.decode": {"triton paged decode": 1},
        "attention.prefill": {"triton paged prefill": 1},
        "kv_store": {"triton store_kv": 1},
    }
    report.reset()
