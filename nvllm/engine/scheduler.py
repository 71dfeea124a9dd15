"""Continuous batching with chunked prefill.

Every step has a token budget (max_num_batched_tokens). Running sequences go first, in arrival order: a
decode costs one token, an unfinished prompt as many tokens as the budget leaves (a chunk). Then waiting
sequences are admitted while the budget, max_num_seqs and the free blocks allow. When a running sequence
needs a block and none is free, the most recently admitted running sequence is preempted by recomputation:
its blocks are freed and it goes back to the front of the waiting queue with every token it has, so no
request is ever dropped. With speculative decoding a decoding sequence also reserves positions for its drafted
tokens (the engine's lookahead) when the budget and the free blocks allow, never at the cost of a preemption.

With ``policy="priority"`` (vLLM's priority scheduling) the waiting queue is kept in (priority, arrival) order: a
lower priority value is admitted first. Running sequences keep their admission order (a long high-priority prompt
does not starve the decodes already running), and preemption takes the running sequence of the highest value (the
latest among equals) — unscheduling it if it was already scheduled this step — which then waits at its place in
that order.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from nvllm.engine.block_manager import BlockManager, prefix_salt
from nvllm.engine.sequence import Sequence, Status


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens to compute)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 lookahead: Callable[[Sequence], int] | None = None, policy: str = "fcfs"):
        """lookahead (speculative decoding): drafted positions to reserve for a decoding sequence; they count
        in the token budget and in the blocks allocated, and are only taken when they fit without preempting."""
        self.bm = block_manager
        self.lookahead = lookahead
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.by_priority = policy == "priority"
        self._arrivals = itertools.count()  # requests' arrival order (the priority policy's tie-break)
        # the waiting queue may still hold finished sequences (aborted while waiting): dropped when the queue is
        # read or swept (``finish``), not one by one, which cost a scan of the queue each (a disconnect of a
        # request of 100k sequences froze the engine for minutes); ``num_waiting`` / ``waiting_seqs`` skip them
        self.waiting: deque[Sequence] = deque()
        self._departed = 0
        # waiting sequences that hold blocks (a decode worker's prompts whose KV was received), by arrival: their
        # blocks are only a copy of a prompt they can recompute, so they give them up to whoever needs blocks and
        # cannot otherwise get them (a running sequence, before it preempts one; see also _holders_first)
        self._holders: dict[int, Sequence] = {}
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # LoRA: put a waiting sequence's adapter on the device, given the adapters running sequences use; its digest,
        # or None when no slot is free (nvllm.lora.manager.LoRAManager.activate)
        self.activate_lora: Callable[[int, set[int]], bytes | None] = lambda lora_id, in_use: b""

    def check_priority(self, priority: int) -> None:
        """ValueError for a non-zero priority unless the scheduling policy is "priority"."""
        if priority and not self.by_priority:
            raise ValueError(f"priority {priority} given, but priority scheduling is not enabled: requests are served "
                             f"first come, first served (scheduling_policy 'priority' / --scheduling-policy priority)")

    def place_in_line(self, seqs: list[Sequence], priority: int) -> None:
        """Give a new request's sequences their priority and the next place in arrival order."""
        order = next(self._arrivals)
        for seq in seqs:
            seq.priority, seq.order = priority, order

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self._queue(self.waiting, seq, front=False)
        if seq.block_table:
            self._holders[id(seq)] = seq

    def _release_holder(self) -> bool:
        """Free the blocks of the latest waiting sequence that holds some (it recomputes its prompt); False when
        none does."""
        if not self._holders:
            return False
        self.bm.free_sequence(self._holders.popitem()[1])
        return True

    def _queue(self, queue, seq: Sequence, front: bool) -> None:
        """Put ``seq`` in ``queue``: at its (priority, arrival) place under the priority policy (looked for from
        the back, where new arrivals go), else at the back (or the front: a preempted sequence)."""
        seq.queued = True
        if self.by_priority:
            key, at = (seq.priority, seq.order), len(queue)
            while at and (queue[at - 1].priority, queue[at - 1].order) > key:
                at -= 1
            queue.insert(at, seq)
        elif front:
            queue.appendleft(seq)
        else:
            queue.append(seq)

    def _victim(self, i: int, scheduled: list[tuple[Sequence, int]]) -> int:
        """Index of the running sequence to preempt while sequence ``i`` needs blocks: the latest admitted, or under
        the priority policy the one of the highest (priority, arrival) among ``i``, those after it and those
        scheduled already this step (not one held out of it)."""
        if not self.by_priority:
            return len(self.running) - 1
        done = {id(s) for s, _ in scheduled}
        candidates = [j for j in range(len(self.running)) if j >= i or id(self.running[j]) in done]
        return max(candidates, key=lambda j: (self.running[j].priority, self.running[j].order))

    @property
    def has_unfinished(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) - self._departed

    def waiting_seqs(self) -> list[Sequence]:
        """The sequences waiting; safe from another thread (/metrics): the queue is copied in one step first."""
        return [s for s in list(self.waiting) if s.status is not Status.FINISHED]

    def schedule(self, hold: Callable[[Sequence], bool] | None = None) -> SchedulerOutput:
        """``hold`` (asynchronous scheduling): running sequences to leave out of this step — those certain to
        finish on a token the host has not read yet."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # speculative lookahead may only use blocks the running sequences after it don't need for one token
        need_one = [self.bm.blocks_needed(s, 1) for s in self.running] if self.lookahead is not None else []
        reserve = sum(need_one)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if hold is not None and hold(seq):
                i += 1
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if self.lookahead is not None and n == seq.num_tokens - seq.num_computed_tokens == 1 and budget > 1:
                reserve -= need_one[i]
                k = min(self.lookahead(seq), budget - 1)
                if (k > 0 and self.bm.blocks_needed(seq, 1 + k) + reserve <= self.bm.num_free_blocks
                        and self.bm.allocate_slots(seq, 1 + k)):
                    out.scheduled.append((seq, 1 + k))
                    budget -= 1 + k
                    i += 1
                    continue
            while not self.bm.allocate_slots(seq, n):
                if self._release_holder():
                    continue
                j = self._victim(i, out.scheduled)
                victim = self.running.pop(j)
                if j < i:   # priority policy: scheduled already this step; its tokens go back to the budget
                    at = next(k for k, (s, _) in enumerate(out.scheduled) if s is victim)
                    budget += out.scheduled.pop(at)[1]
                    if need_one:
                        need_one.pop(j)
                    i -= 1
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append((seq, n))
                budget -= n
                i += 1
        if out.preempted:
            return out
        self._admit(out, budget)
        if not out.scheduled and not self.running and self._holders_first():
            self._admit(out, budget)
        return out

    def _holders_first(self) -> bool:
        """Nothing runs and nothing was admitted, so the blocks that are not free are pinned by waiting sequences
        that hold KV (a decode worker's received prompts, queued behind one waiting to be recomputed): no finish
        will ever free them. Those sequences go to the front of the queue, where admission runs them or, when one
        does not fit, lets its blocks go (it recomputes its prompt): progress either way. False when none holds
        blocks."""
        if not self._holders:
            return False
        holds = [id(s) in self._holders for s in self.waiting]
        self.waiting = deque([s for s, h in zip(self.waiting, holds) if h] +
                             [s for s, h in zip(self.waiting, holds) if not h])
        return True

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting sequences, first come first served (or by priority), while the token budget, the sequence
        limit and the blocks allow."""
        loras = {s.lora_id for s in self.running if s.lora_id}
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[i]
            if seq.status is Status.FINISHED:
                self._drop_waiting(i)
                continue
            if seq.lora_id:
                digest = self.activate_lora(seq.lora_id, loras)
                if digest is None:
                    i += 1  # every adapter slot is busy: requests behind it may go first (as vLLM skips them)
                    continue
                if not seq.block_table:  # its KV is computed from here on, with the weights of this digest
                    seq.cache_salt = prefix_salt(digest, seq.request_cache_salt)
            hit = self.bm.allocate_cached_prefix(seq) if not seq.block_table else 0
            n = min(seq.num_tokens - seq.num_computed_tokens, budget, self.bm.tokens_that_fit(seq))
            if n <= 0 or not self.bm.allocate_slots(seq, n):
                self.bm.free_sequence(seq)  # don't pin cached blocks while waiting
                self._holders.pop(id(seq), None)
                break
            self._drop_waiting(i)
            loras.add(seq.lora_id)
            if self.bm.looks_up(seq) and seq.admitted:  # back after preemption: counted apart, as vLLM does
                self.bm.preempted_queries += seq.num_tokens
                self.bm.preempted_hits += hit
            elif self.bm.looks_up(seq):
                self.bm.prefix_queries += seq.num_tokens
                self.bm.prefix_hits += hit
            if not seq.admitted:  # what usage reports: the prompt tokens the first admission found cached
                seq.admitted = True
                seq.num_cached_tokens = min(hit, seq.num_prompt_tokens)
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n

    def _drop_waiting(self, i: int) -> None:
        seq = self.waiting[i]
        del self.waiting[i]
        seq.queued = False
        self._holders.pop(id(seq), None)
        if seq.status is Status.FINISHED:
            self._departed -= 1

    def _preempt(self, seq: Sequence) -> None:
        self.bm.free_sequence(seq)
        seq.status = Status.WAITING
        self._queue(self.waiting, seq, front=True)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, free: bool = True) -> None:
        """Remove a finished (or aborted) sequence and free its blocks. free=False keeps them (a prefill
        worker's sequence waiting for a decode worker to fetch its KV); so does a sequence whose KV is still
        arriving (RECEIVING): the transfer writes into its blocks, which are freed when it ends."""
        self._holders.pop(id(seq), None)
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq.queued:
            self._departed += 1   # left in the queue as finished (see __init__)
        receiving = seq.status is Status.RECEIVING
        seq.status = Status.FINISHED
        if self._departed > 16 and 2 * self._departed > len(self.waiting):  # at most half the queue: O(1) a finish
            self.waiting = deque(s for s in self.waiting if s.status is not Status.FINISHED)
            self._departed = 0
        if free and not receiving:
            self.bm.free_sequence(seq)
