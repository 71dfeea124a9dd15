"""Decode attention that finishes, rotates and stores the qkv projection's pending sums itself
(``nvllm.kernels.attention_rope``), on the CPU under the Triton interpreter, against what it replaces: ``rope_store``
(finish, rotate, store) then decode attention of the rotated q. The same output and cache (the newest slot holds
NaN before the launch, so a read of it instead of the registers shows), the accumulator and tickets left zero,
with one and with many partitions (the newest token in a partition's first tile or a later one, partitions past
the context), a padding row, a bias or none; then ``Attention.forward`` on either path, with its kernel report."""

from __future__ import annotations

import pytest
import torch

from tests.test_kernels_attention import TOL, _paged_cache, _skip_unsupported  # noqa: I001  (the interpreter)

from nvllm.kernels import attention_rope, report  # noqa: E402
from nvllm.kernels.decode_attention import decode_attention  # noqa: E402
from nvllm.kernels.partial_sum import PartialSum  # noqa: E402
from nvllm.kernels.rope_store import rope_store_triton  # noqa: E402
from nvllm.layers.attention import Attention, AttentionMetadata  # noqa: E402
from nvllm.layers.rotary import RotaryEmbedding  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 32, 16


@pytest.fixture(autouse=True)
def _triton_on_cpu(monkeypatch):
    monkeypatch.setenv("NVLLM_KERNELS", "triton")    # the interpreter's kernels, where tensors on the CPU take torch


def _case(ctx_lens, dtype, bias: bool, seed=0):
    """(pending qkv sum with padding columns, its q/k/v heads, positions, slots, cos/sin, caches, block tables,
    context lens): every sequence's last token is this step's — its cache slot holds NaN."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables = _paged_cache(ctx_lens, KV_HEADS, HEAD_DIM, BLOCK, dtype, gen)
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    acc = 3 * torch.randn(len(ctx_lens), q_size + 2 * kv_size + 8, generator=gen)
    b = torch.randn(q_size + 2 * kv_size, generator=gen).to(dtype) if bias else None
    total = PartialSum(acc[:, :q_size + 2 * kv_size], b, dtype)
    heads = (total.heads(0, HEADS, HEAD_DIM), total.heads(q_size, KV_HEADS, HEAD_DIM),
             total.heads(q_size + kv_size, KV_HEADS, HEAD_DIM))
    lens = torch.tensor(ctx_lens, dtype=torch.int32)
    positions = (lens - 1).clamp(min=0).long()
    slots = torch.stack([tables[i, p // BLOCK].long() * BLOCK + p % BLOCK if c else torch.tensor(-1)
                         for i, (c, p) in enumerate(zip(ctx_lens, positions.tolist()))])
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            k_cache[s // BLOCK, s % BLOCK] = float("nan")
            v_cache[s // BLOCK, s % BLOCK] = float("nan")
    rot = RotaryEmbedding(HEAD_DIM, 1024, 10000.0, None)
    return acc, heads, positions, slots, rot, k_cache, v_cache, tables, lens


def _both(ctx_lens, dtype, bias, partition, seed=0):
    """(fused output, caches, accumulator), (unfused output, caches), tickets after."""
    acc, (q, k, v), pos, slots, rot, kc, vc, tables, lens = _case(ctx_lens, dtype, bias, seed)
    acc0, kc0, vc0 = acc.clone(), kc.clone(), vc.clone()
    scale = HEAD_DIM ** -0.5
    rope = attention_rope.prepare(q, k, v, pos, rot.cos, rot.sin, slots, False, 1, len(ctx_lens))
    assert rope is not None
    fused = decode_attention(q, kc, vc, tables, lens, scale, partition_size=partition, rope=rope)
    # the path it replaces, on the same sums
    total = PartialSum(acc0[:, :acc.shape[1] - 8], q.bias if q.bias is None else torch.cat(
        [q.bias.flatten(), k.bias.flatten(), v.bias.flatten()]), dtype)
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    q_rot, _ = rope_store_triton(total.heads(0, HEADS, HEAD_DIM), total.heads(q_size, KV_HEADS, HEAD_DIM),
                                 total.heads(q_size + kv_size, KV_HEADS, HEAD_DIM), pos, rot.cos, rot.sin, kc0, vc0,
                                 slots)
    plain = decode_attention(q_rot, kc0, vc0, tables, lens, scale, partition_size=partition)
    return (fused, kc, vc, acc), (plain, kc0, vc0), rope.tickets


DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16"),
          pytest.param(torch.bfloat16, id="bf16")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ctx_lens,partition", [
    ([37], None),            # one partition
    ([100], 16),             # seven partitions, the newest token in the last
    ([100, 0], 64),          # the newest token in the second partition's first tile; a padding row
    ([100, 20], 128),        # tiles of 64 in a partition of 128: the newest token in a later tile (and the first)
], ids=["one", "seven", "padding-row", "later-tile"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_rotates_and_stores_as_rope_store(dtype, ctx_lens, partition, bias):
    _skip_unsupported(dtype)
    (fused, kc, vc, acc), (plain, kc0, vc0), tickets = _both(ctx_lens, dtype, bias, partition)
    assert fused.dtype == dtype and fused.shape == plain.shape
    torch.testing.assert_close(fused.float(), plain.float(), atol=TOL[dtype], rtol=TOL[dtype], equal_nan=False)
    live = [i for i, c in enumerate(ctx_lens) if c]
    assert not fused[live].isnan().any()
    torch.testing.assert_close(kc, kc0, atol=0, rtol=0, equal_nan=True)   # the newest slots: rope_store's bits
    torch.testing.assert_close(vc, vc0, atol=0, rtol=0, equal_nan=True)
    assert not acc[:, :-8].any(), "the group's last reader zeroes the sums"
    assert not tickets.any(), "tickets go back to 0"


def test_many_partitions_past_the_context():
    """A CUDA graph's split count follows the block table's capacity: most partitions hold no token, yet every one
    takes its ticket and the sums are zeroed once."""
    gen_lens = [45]
    acc, (q, k, v), pos, slots, rot, kc, vc, tables, lens = _case(gen_lens, torch.float32, True)
    tables = torch.cat([tables, tables[:, -1:].expand(1, 20)], 1)      # capacity far past the context
    rope = attention_rope.prepare(q, k, v, pos, rot.cos, rot.sin, slots, False, 1, 1)
    out = decode_attention(q, kc, vc, tables, lens, HEAD_DIM ** -0.5, partition_size=16, rope=rope)
    assert out.isfinite().all() and not acc[:, :-8].any() and not rope.tickets.any()


def test_prepare_declines(monkeypatch):
    acc, (q, k, v), pos, slots, rot, *_ = _case([10], torch.float32, False)
    args = (q, k, v, pos, rot.cos, rot.sin, slots)
    assert attention_rope.prepare(*args, True, 1, 1) is None            # a quantized cache
    assert attention_rope.prepare(*args, False, 2, 1) is None           # several query tokens
    assert attention_rope.prepare(*args, False, 1, 2) is None           # rows past the sequences
    assert attention_rope.prepare(q.finish(), k, v, *args[3:], False, 1, 1) is None   # not a pending sum
    monkeypatch.setenv("NVLLM_ATTENTION_ROPE", "0")
    assert attention_rope.prepare(*args, False, 1, 1) is None           # switched off
    monkeypatch.setenv("NVLLM_ATTENTION_ROPE", "1")
    monkeypatch.setenv("NVLLM_KERNELS", "torch")
    assert attention_rope.prepare(*args, False, 1, 1) is None           # the torch path
    monkeypatch.setenv("NVLLM_KERNELS", "triton")
    assert attention_rope.prepare(*args, False, 1, 1) is not None


@pytest.mark.parametrize("switch", ["1", "0"])
def test_attention_layer(switch, monkeypatch):
    """``Attention.forward`` with pending q/k/v heads: rotated and stored inside decode attention (its report says
    so), or by rope_store with ``NVLLM_ATTENTION_ROPE=0``; the same output either way."""
    results = {}
    for mode in ("1", switch):
        monkeypatch.setenv("NVLLM_ATTENTION_ROPE", mode)
        acc, (q, k, v), pos, slots, rot, kc, vc, tables, lens = _case([70], torch.float32, True)
        meta = AttentionMetadata(slots, tables, torch.tensor([0, 1], dtype=torch.int32), lens, max_query_len=1,
                                 max_context_len=70, fresh_tokens=1)
        attn = Attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5)
        with report.recording() as made:
            out = attn(q, k, v, (kc, vc), meta, positions=pos, rotary=rot, out=None, defer_merge=False)
        fused = ("rotary", "in triton decode attention (finishes split-K sums)") in made
        assert fused == (mode == "1")
        assert not acc[:, :-8].any()
        results[mode] = out
    torch.testing.assert_close(results["1"], results[switch], atol=TOL[torch.float32], rtol=TOL[torch.float32])
