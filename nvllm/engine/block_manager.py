"""Paged KV cache bookkeeping: fixed-size blocks, a free list, reference counts, per-sequence block tables,
and prefix caching.

Prefix caching: a block that is full of computed tokens gets a hash chained from the previous block's hash
and its own token ids (SHA-256; the first block's chain starts from the sequence's ``cache_salt``: its LoRA
adapter's digest and its request's cache_salt, ``prefix_salt``); a new sequence whose leading blocks hash the same
(and whose token ids match the stored ones) shares those blocks instead of recomputing them. Freed blocks keep their
contents and hash in the free list until they are reused, least recently freed first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from nvllm.engine.sequence import Sequence


class Block:
    __slots__ = ("id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.token_ids: tuple[int, ...] = ()


def prefix_salt(lora_digest: bytes | None, cache_salt: str | None) -> bytes | None:
    """Where a sequence's chain of block hashes starts: its LoRA adapter's digest (``nvllm.lora.manager``;
    None for the base model) and its request's cache_salt (vLLM's: blocks shared only among requests that give the
    same); None for neither."""
    if cache_salt:
        return hashlib.sha256((lora_digest or b"") + b"\0salt\0" + cache_salt.encode()).digest()
    return lora_digest


def chain_hash(prev: bytes | None, token_ids: tuple[int, ...]) -> bytes:
    """SHA-256 of the previous block's hash and this block's token ids (int64, native order). Python's hash() of
    ints can be made to collide on purpose: a prompt built so that its first block's hash equals another
    request's would then be handed the KV of that request's later blocks, computed on its text (vLLM moved to
    SHA-256 for the same reason). Token ids are compared on a hit; the context before them is only hashed."""
    h = hashlib.sha256(prev or b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}  # hash → block id
        self.prefix_queries = 0  # prompt tokens of new sequences looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found
        # a preempted sequence's lookup when it comes back (mostly its own blocks), kept apart as vLLM keeps it: the
        # hit rate above is the prompts' alone
        self.preempted_queries = 0
        self.preempted_hits = 0

    # ---- capacity -------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences (cached-but-free blocks count as free)."""
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def tokens_that_fit(self, seq: Sequence) -> int:
        """How many more tokens seq could compute with the blocks it holds plus every free block."""
        return (len(seq.block_table) + len(self.free)) * self.block_size - seq.num_computed_tokens

    # ---- allocation -----------------------------------------------------------------------------------
    def looks_up(self, seq: Sequence) -> bool:
        """Whether seq's admission consults the prefix cache (a request for prompt logprobs computes every token)."""
        return self.enable_prefix_caching and seq.params.prompt_logprobs is None

    def allocate_cached_prefix(self, seq: Sequence) -> int:
        """On admission: share the longest run of cached full blocks of seq's tokens. At least one token is
        always left to compute (its logits give the next token). Returns the tokens found."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.looks_up(seq):
            return 0
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        h = seq.cache_salt
        for i in range(max_blocks):
            ids = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(h, ids)
            bid = self.cached.get(h)
            if bid is None or self.blocks[bid].token_ids != ids:
                break
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self.free[bid]
            block.ref_count += 1
            seq.block_table.append(bid)
            seq.block_hashes.append(h)
        hit = len(seq.block_table) * bs
        seq.num_computed_tokens = hit
        return hit

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow seq's block table to hold num_new_tokens more tokens; False (and no change) if it can't."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > len(self.free):
            return False
        for _ in range(need):
            bid, _ = self.free.popitem(last=False)
            block = self.blocks[bid]
            if block.hash is not None:  # evict its cached contents
                if self.cached.get(block.hash) == bid:
                    del self.cached[block.hash]
                block.hash, block.token_ids = None, ()
            block.ref_count = 1
            seq.block_table.append(bid)
        return True

    def register_full_blocks(self, seq: Sequence) -> None:
        """After a step: hash the blocks that are now full of computed tokens whose ids are known (not pending
        placeholders: asynchronous scheduling), so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(min(seq.num_computed_tokens, seq.num_tokens - seq.pending) // bs, len(seq.block_table))
        for i in range(len(seq.block_hashes), full):
            ids = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = chain_hash(seq.block_hashes[-1] if seq.block_hashes else seq.cache_salt, ids)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.cached:
                block.hash, block.token_ids = h, ids
                self.cached[h] = block.id

    def free_sequence(self, seq: Sequence) -> None:
        """Release seq's blocks, last block first, so a prefix outlives its tail in the cache."""
        for bid in reversed(seq.block_table):
            self._release(bid)
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.num_computed_tokens = 0
        seq.num_draft_computed = 0

    def trim(self, seq: Sequence) -> None:
        """Speculative rollback: release the trailing blocks seq no longer needs (those reserved for drafted
        tokens that were rejected), keeping room for its tokens. Only the sequence's own reference is dropped,
        so a block shared with another sequence is never freed from under it; only blocks full of verified
        tokens are ever hashed (register_full_blocks counts computed tokens), so none of these carries one."""
        keep = -(-seq.num_tokens // self.block_size)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())
        del seq.block_hashes[len(seq.block_table):]

    def _release(self, bid: int) -> None:
        """Drop one reference to block ``bid``; unreferenced, it is free (first in line when it holds nothing worth
        keeping in the prefix cache, else last)."""
        block = self.blocks[bid]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free[bid] = None
            if block.hash is None:
                self.free.move_to_end(bid, last=False)

    def reset_prefix_cache(self) -> None:
        for bid in self.free:
            block = self.blocks[bid]
            block.hash, block.token_ids = None, ()
        self.cached = {h: b for h, b in self.cached.items() if self.blocks[b].ref_count > 0}
