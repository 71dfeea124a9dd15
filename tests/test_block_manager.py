"""Block manager unit tests: allocation, reference counts, the hash chain, verification on collision, LRU."""

from __future__ import annotations

from nvllm.engine import block_manager as bm_mod
from nvllm.engine.block_manager import BlockManager
from nvllm.engine.sequence import Sequence
from nvllm.outputs import RequestMetrics
from nvllm.sampling_params import SamplingParams


def seq(tokens, rid="r"):
    return Sequence(rid, 0, list(tokens), len(tokens), SamplingParams(), RequestMetrics(0.0))


def run_prompt(bm: BlockManager, s: Sequence) -> None:
    bm.allocate_cached_prefix(s)
    assert bm.allocate_slots(s, s.num_tokens - s.num_computed_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.register_full_blocks(s)


def test_allocate_and_free_refcounts():
    bm = BlockManager(8, 4)
    a = seq(range(10))
    run_prompt(bm, a)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 5
    assert not bm.allocate_slots(seq(range(100)), 100)  # needs 25 blocks: refused, nothing changed
    assert bm.num_free_blocks == 5
    bm.free_sequence(a)
    assert bm.num_free_blocks == 8 and not a.block_table


def test_prefix_sharing_and_chain():
    bm = BlockManager(16, 4)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    run_prompt(bm, a)
    b = seq([1, 2, 3, 4, 5, 6, 7, 8, 99, 100, 101])
    assert bm.allocate_cached_prefix(b) == 8
    assert b.block_table == a.block_table[:2]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    # same second block, different first block: the chain hash differs, no hit
    c = seq([9, 9, 9, 9, 5, 6, 7, 8, 0])
    assert bm.allocate_cached_prefix(c) == 0


def test_last_token_always_computed():
    bm = BlockManager(16, 4)
    a = seq(range(8))
    run_prompt(bm, a)
    b = seq(range(8))  # identical, block-aligned: only the first block may be reused
    assert bm.allocate_cached_prefix(b) == 4


def test_hash_collision_is_verified(monkeypatch):
    monkeypatch.setattr(bm_mod, "chain_hash", lambda prev, ids: 42)
    bm = BlockManager(16, 4)
    run_prompt(bm, seq([1, 2, 3, 4, 5]))
    other = seq([7, 7, 7, 7, 5])
    assert bm.allocate_cached_prefix(other) == 0


def test_chain_hash_is_sha256_of_the_chain():
    """The documented formula (checked with hashlib and struct, not the module's own packing): a block's hash
    covers every token before it, so equal later blocks after different first blocks are not shared."""
    import hashlib
    import struct

    first = hashlib.sha256(struct.pack("=4q", 1, 2, 3, 4)).digest()
    assert bm_mod.chain_hash(None, (1, 2, 3, 4)) == first
    assert bm_mod.chain_hash(first, (5, 6, 7, 8)) == hashlib.sha256(first + struct.pack("=4q", 5, 6, 7, 8)).digest()
    bm = BlockManager(16, 4)
    run_prompt(bm, seq([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert bm.allocate_cached_prefix(seq([0, 2, 3, 4, 5, 6, 7, 8, 9])) == 0
    assert bm.allocate_cached_prefix(seq([1, 2, 3, 4, 5, 6, 7, 8, 0])) == 8


def test_freed_cached_blocks_evicted_lru():
    bm = BlockManager(4, 2)
    a = seq([1, 2, 3, 4, 5])  # 3 blocks, 2 full
    run_prompt(bm, a)
    bm.free_sequence(a)
    assert bm.num_free_blocks == 4
    # the partial block is reused first, then the tail before the head of a's prefix
    b = seq([8, 8, 8])
    assert bm.allocate_slots(b, 3)
    c = seq([1, 2, 3, 4, 6])
    assert bm.allocate_cached_prefix(c) == 4  # a's two full blocks survive
    bm.free_sequence(b)
    bm.free_sequence(c)
    d = seq(range(100, 108))
    assert bm.allocate_slots(d, 8)  # takes every block: all cached contents evicted
    assert bm.cached == {}
