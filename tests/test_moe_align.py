"""``align_tokens`` (a mixture of experts' pairs grouped by expert, padded to blocks): the torch reference and the
Triton kernel, on the CPU under the Triton interpreter, each checked against the layout the grouped GEMMs read
(walked group by group from the routing, below), and the two against each other bit for bit."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel module is imported

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from nvllm.kernels import moe_align  # noqa: E402
from nvllm.kernels.moe_align import align_tokens_reference, align_tokens_triton  # noqa: E402

IMPLS = [pytest.param(align_tokens_reference, id="torch"), pytest.param(align_tokens_triton, id="triton")]


def _check_align(align, topk_ids, num_experts, block_m):
    sorted_ids, block_experts, num_padded = align(topk_ids, num_experts, block_m)
    t, k = topk_ids.shape
    n = t * k
    max_padded = -(-(n + num_experts * (block_m - 1)) // block_m) * block_m
    assert sorted_ids.dtype == block_experts.dtype == num_padded.dtype == torch.int32
    assert sorted_ids.shape == (max_padded,) and block_experts.shape == (max_padded // block_m,)
    assert num_padded.shape == (1,)
    flat = topk_ids.reshape(-1).tolist()
    ids = sorted_ids.tolist()
    total = int(num_padded[0])
    assert total % block_m == 0 and all(i == n for i in ids[total:])
    real = [i for i in ids[:total] if i != n]
    assert sorted(real) == list(range(n))  # every (t, j) exactly once
    # walk the groups: per expert in order, its pairs in flat order, then sentinels up to a block boundary
    pos = 0
    for e in range(num_experts):
        mine = [i for i in range(n) if flat[i] == e]
        padded = -(-len(mine) // block_m) * block_m
        assert ids[pos:pos + len(mine)] == mine
        assert all(i == n for i in ids[pos + len(mine):pos + padded])
        assert block_experts[pos // block_m:(pos + padded) // block_m].tolist() == [e] * (padded // block_m)
        pos += padded
    assert pos == total
    assert all(b == -1 for b in block_experts[total // block_m:].tolist())
    return sorted_ids, block_experts, num_padded


def _routing(t, e, k, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k)


@pytest.mark.parametrize("align", IMPLS)
@pytest.mark.parametrize("t, e, k, block_m", [(5, 4, 2, 16), (1, 8, 1, 16), (7, 3, 3, 4), (0, 2, 1, 16)])
def test_align_tokens(align, t, e, k, block_m):
    _check_align(align, _routing(t, e, k, t + e).long(), e, block_m)


@pytest.mark.parametrize("align", IMPLS)
def test_align_tokens_idle_and_full_experts(align):
    """Experts 0, 2 and 5 get nothing; 1 gets every token (a group of several blocks), 3 and 4 some."""
    ids = torch.tensor([[1, 3], [1, 4], [4, 1], [1, 3], [3, 1]] * 4, dtype=torch.int32)
    _check_align(align, ids, 6, 4)
    _check_align(align, ids, 6, 16)
    _check_align(align, torch.ones(9, 1, dtype=torch.int64), 3, 4)  # exactly whole blocks, for one expert


@pytest.mark.parametrize("align", IMPLS)
def test_align_tokens_sizes_depend_only_on_shape(align):
    """Output sizes follow from (T·k, E, block_m), never from the routing: nothing to read back to the host."""
    a = align(torch.zeros(6, 2, dtype=torch.int32), 5, 16)
    b = align(torch.arange(12, dtype=torch.int32).reshape(6, 2) % 5, 5, 16)
    c = align(torch.zeros(3, 4, dtype=torch.int32), 5, 16)
    assert [x.shape for x in a] == [x.shape for x in b] == [x.shape for x in c]


@pytest.mark.parametrize("t, e, k, block_m, chunk, sub, blocks", [
    pytest.param(37, 6, 2, 4, 16, 8, 16, id="5-programs"),        # chunks of 16 pairs, the last one partial
    pytest.param(50, 60, 4, 16, 32, 16, 16, id="Qwen2-MoE-experts"),  # 60 experts: a padded histogram, 7 programs
    pytest.param(40, 8, 2, 8, 64, 4, 2, id="blocks-shared"),      # one chunk; 2 blocks a program, 10 programs
])
def test_triton_chunks_equal_the_reference(monkeypatch, t, e, k, block_m, chunk, sub, blocks):
    """Several programs (small chunks, tiles and block shares forced): each counts the chunks before its own and
    writes the sentinels of its blocks; the bits equal the stable sort's, with skewed routing so that groups cross
    chunk, tile and block boundaries."""
    monkeypatch.setattr(moe_align, "CHUNK", chunk)
    monkeypatch.setattr(moe_align, "SUB", sub)
    monkeypatch.setattr(moe_align, "BLOCKS", blocks)
    ids = _routing(t, e, k, 7)
    ids[::3, 0] = 1                                  # expert 1 in a third of the tokens
    out = _check_align(align_tokens_triton, ids.to(torch.int32), e, block_m)
    ref = align_tokens_reference(ids, e, block_m)
    for a, b in zip(out, ref):
        assert torch.equal(a, b)


def test_dispatch_follows_the_device(monkeypatch):
    """CPU tensors take the reference unless the Triton kernels are forced; both give the same bits."""
    ids = _routing(9, 5, 2, 3)
    monkeypatch.setenv("NVLLM_KERNELS", "torch")
    ref = moe_align.align_tokens(ids, 5, 4)
    monkeypatch.setenv("NVLLM_KERNELS", "triton")
    calls = []
    real = moe_align.align_tokens_triton
    monkeypatch.setattr(moe_align, "align_tokens_triton", lambda *a: calls.append(1) or real(*a))
    out = moe_align.align_tokens(ids, 5, 4)
    assert calls and all(torch.equal(a, b) for a, b in zip(out, ref))
