"""Proposers: where the drafted tokens come from.

NgramProposer (prompt lookup): find the last n tokens of prompt + output earlier in the same sequence
(n from prompt_lookup_max down to prompt_lookup_min) and propose the tokens that followed. No model, no
distribution: verification treats the proposal as certain (q = one-hot).

DraftModelProposer: a second, smaller model with its own paged KV cache of the same number of blocks and
block size as the target's, so every sequence's block table serves both caches (the draft's K/V land in the
same block ids of its own tensors). `seq.num_draft_computed` counts the tokens whose draft K/V are in place.
Each step the draft mirrors the target's prefill chunks, catches up on the 1–2 tokens the last verification
added, then proposes k tokens autoregressively, batched across sequences. With a fixed k on the GPU the catch-up and
the k steps replay as one ``DraftChain`` graph (greedy or sampled); otherwise step by step, each step replaying the
draft runner's decode graphs. After verification the count keeps only the accepted drafts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from nvllm.engine.inflight import PendingTokens
from nvllm.engine.sequence import Sequence
from nvllm.engine.step_inputs import StepInputs
from nvllm.layers.sampler import host_tensor
from nvllm.spec.draft_chain import CATCH_UP, DraftChain
from nvllm.spec.rejection_sampler import draw, shaped_probs


@dataclass
class Proposal:
    """One sequence's drafted tokens: their ids — a draft model's are placeholders −1 − r (row r of the step's
    ``Drafts.pending``) until ``Drafts.read()`` — and the shaped draft distributions they were drawn from [k, V]
    (None: greedy, or an n-gram proposal, certain of itself)."""

    ids: list[int]
    probs: torch.Tensor | None = None


@dataclass
class Drafts:
    """A step's proposals by id(seq), and the drafted tokens still on the device that their placeholders stand
    for (a draft model's; None for n-gram proposals, known on the host)."""

    proposals: dict[int, Proposal] = field(default_factory=dict)
    pending: PendingTokens | None = None

    @property
    def tokens(self) -> torch.Tensor | None:
        """The drafted tokens on the device (one row per placeholder), for the target's step inputs."""
        return self.pending.device if self.pending is not None else None

    def ids(self) -> dict[int, list[int]]:
        return {i: p.ids for i, p in self.proposals.items()}

    def read(self) -> None:
        """Replace the placeholders by the drafted ids: waits for the draft's last step (queued before the target's
        forward), so call it once the target's step is launched."""
        if self.pending is not None:
            host = self.pending.wait()
            for p in self.proposals.values():
                p.ids = [host[-1 - t] if t < 0 else t for t in p.ids]
            self.pending = None


class NgramProposer:
    def __init__(self, n_min: int = 1, n_max: int = 3):
        self.n_min, self.n_max = n_min, n_max

    def propose_one(self, token_ids: list[int], k: int) -> list[int]:
        """The tokens that followed the latest earlier occurrence of the longest matching suffix (the latest
        with k tokens after it, else the earliest)."""
        size = len(token_ids)
        if k <= 0 or size < 2:
            return []
        arr = np.asarray(token_ids)
        for n in range(min(self.n_max, size - 1), self.n_min - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(arr[:size - 1], n)  # starts 0 .. size-1-n
            hits = np.flatnonzero((windows == arr[size - n:]).all(axis=1))
            if hits.size:
                full = hits[hits + n + k <= size]
                i = int(full[-1]) if full.size else int(hits[0])
                return arr[i + n:i + n + k].tolist()
        return []


class DraftModelProposer:
    def __init__(self, runner, vocab_size: int, banned: Callable[[Sequence], tuple[int, list[int]]],
                 chain_k: int = 0, paused: Callable[[Sequence], bool] = lambda seq: False):
        """runner: the draft's ModelRunner (its model, KV cache and CUDA graphs are used, not its sampler);
        vocab_size: the target's (draft logits are cut or padded to it); banned(seq) → (rows, token ids);
        chain_k: the fixed k, if any — drafts then run their catch-up and their k steps as one ``DraftChain`` (with
        the runner's CUDA graphs only); paused(seq): whether k=auto paused the sequence's drafting — its decoded
        tokens then wait for its next draft's catch-up instead of being mirrored step by step."""
        self.runner = runner
        self.paused = paused
        self.block_size = runner.block_size
        self.vocab_size = vocab_size
        self.banned = banned
        self.chain = None
        if chain_k > 0 and runner.graphs is not None:
            self.chain = DraftChain(runner, chain_k, vocab_size)

    # ---- one forward of the draft ----------------------------------------------------------------------
    def _forward(self, items: list[tuple[Sequence, int, list[int]]], want: list[int],
                 device_ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """items: (sequence, first position, token ids). Returns logits [len(want), V] of the last row of
        items[i] for i in want, cut or padded to the target's vocabulary (None when none is wanted).
        device_ids: the step's token ids as a device tensor (then the items' ids only give the lengths)."""
        bs = self.block_size
        step = StepInputs([], [], [], [0], [], [])
        last = []
        for seq, start, ids in items:
            end = start + len(ids)
            step.input_ids.extend(ids)
            step.positions.extend(range(start, end))
            table = seq.block_table
            step.slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            step.query_start_loc.append(step.query_start_loc[-1] + len(ids))
            step.context_lens.append(end)
            last.append(step.query_start_loc[-1] - 1)
        # the blocks of the draft's positions only (a sequence the target holds longer has more)
        width = min(max(len(seq.block_table) for seq, _, _ in items), -(-self.runner.max_model_len // bs))
        step.block_tables = [seq.block_table[:width] + [0] * (width - len(seq.block_table)) for seq, _, _ in items]
        step.max_query_len = max(len(ids) for _, _, ids in items)
        step.max_context_len = max(step.context_lens)
        step.logit_rows = [last[i] for i in want]
        if device_ids is not None:
            step.input_ids = device_ids
        # the runner's own path: decode graphs for single tokens and short catch-up chunks, eager otherwise
        _, logits = self.runner.run_model(step)
        if logits is None:
            return None
        v = logits.shape[-1]
        if v > self.vocab_size:
            logits = logits[:, :self.vocab_size].contiguous()
        elif v < self.vocab_size:
            logits = torch.cat([logits, logits.new_full((logits.shape[0], self.vocab_size - v), float("-inf"))], 1)
        return logits

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], j: int,
                gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft token j (0-based) of each sequence, on the device, and the shaped distributions it was drawn
        from (None when every sequence is greedy)."""
        logits = self._masked(logits, seqs, j)
        params = [s.params for s in seqs]
        greedy = [p.greedy for p in params]
        argmax = logits.argmax(dim=-1)
        if all(greedy):
            return argmax, None
        probs = shaped_probs(logits, params)
        tok = draw(probs, [None if g else s.generator for g, s in zip(greedy, seqs)], gen)
        if any(greedy):
            tok = torch.where(host_tensor(greedy, torch.bool, logits.device), argmax, tok)
        return tok, probs

    # ---- a step ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, scheduled: list[tuple[Sequence, int]], plan: dict[int, int],
                gen: torch.Generator) -> Drafts:
        """plan: id(seq) → k for the sequences that speculate this step (their last real token is the only
        one the target has yet to compute). Every scheduled chunk is mirrored into the draft's cache."""
        items, spec_seqs, want = [], [], []
        limit = self.runner.max_model_len   # the draft's positions: past them a sequence is not mirrored (and never
        for seq, n in scheduled:            # drafts: SpecDecoder.lookahead)
            k = plan.get(id(seq), 0)
            if not k and seq.num_computed_tokens >= seq.num_prompt_tokens and self.paused(seq):
                continue
            end = seq.num_tokens if k else min(seq.num_computed_tokens + n, limit)
            start = min(seq.num_draft_computed, end - 1) if k else seq.num_draft_computed
            if end > start:
                if k:
                    want.append(len(items))
                    spec_seqs.append(seq)
                items.append((seq, start, seq.token_ids[start:end]))
                seq.num_draft_computed = end
        items, want = self._within_budget(items, want)
        if not items:
            return Drafts()
        catch_up = [items[i] for i in want]
        if self._chains(spec_seqs, plan, catch_up):
            mirror = [it for it in items if plan.get(id(it[0]), 0) == 0]
            if mirror:  # other sequences' prompt chunks: into the draft's cache, no logits
                self._forward(mirror, [])
            k, used = self.chain.k, [plan[id(s)] for s in spec_seqs]
            drafted, q = self.chain.run([ids for _, _, ids in catch_up], [s.num_tokens for s in spec_seqs],
                                        [s.block_table for s in spec_seqs], [s.params for s in spec_seqs],
                                        [s.generator for s in spec_seqs], gen, used)
            pending = PendingTokens([s for s in spec_seqs for _ in range(k)], drafted.reshape(-1))
            return Drafts({id(s): Proposal([-1 - (i * k + j) for j in range(n)],
                                           None if s.params.greedy else q[i, :n])
                           for i, (s, n) in enumerate(zip(spec_seqs, used))}, pending)
        logits = self._forward(items, want)
        if logits is None:
            return Drafts()
        return self._draft(logits, spec_seqs, plan, gen)

    def _within_budget(self, items: list[tuple[Sequence, int, list[int]]],
                       want: list[int]) -> tuple[list[tuple[Sequence, int, list[int]]], list[int]]:
        """A step's draft forward no larger than the scheduler's token budget (what the runner's memory profile ran):
        a catch-up after a pause (k=auto, disable_by_batch_size) or a preemption may be far longer. Its leading
        tokens are mirrored first, in forwards of at most the budget; the step's own forward keeps the last token of
        each item that drafts (``want``: their indices, returned renumbered)."""
        budget = self.runner.config.max_num_batched_tokens
        if sum(len(ids) for _, _, ids in items) <= budget:
            return items, want
        ahead, left, drafting = [], [], set(want)
        for i, (seq, start, ids) in enumerate(items):
            cut = len(ids) - 1 if i in drafting else len(ids)
            if cut:
                ahead.append((seq, start, ids[:cut]))
            if i in drafting:
                left.append((seq, start + cut, ids[cut:]))
        batch, room = [], budget
        for seq, start, ids in ahead:
            while ids:
                piece, ids = ids[:room], ids[room:]
                batch.append((seq, start, piece))
                start, room = start + len(piece), room - len(piece)
                if not room:
                    self._forward(batch, [])
                    batch, room = [], budget
        if batch:
            self._forward(batch, [])
        return left, list(range(len(left)))

    def _draft(self, logits: torch.Tensor, seqs: list[Sequence], plan: dict[int, int],
               gen: torch.Generator) -> Drafts:
        """The k drafts of each sequence without a host round trip: each step's tokens stay on the device and feed
        the next step's inputs (positions, slots and block tables are known on the host beforehand), so the steps
        queue back to back. The tokens are left on the device too, behind placeholders (draft j of sequence i:
        row i·k_max + j); how many each sequence drafted is its plan."""
        dev = logits.device
        k_max = max(plan[id(s)] for s in seqs)
        drafted = torch.zeros((len(seqs), k_max), dtype=torch.long, device=dev)
        dists: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        for j in range(k_max):
            everyone = True  # every sequence still drafts: whole columns, no row gather and scatter
            if j:
                active = [i for i in active if plan[id(seqs[i])] > j]
                everyone = len(active) == len(seqs)
                rows = None if everyone else host_tensor(active, torch.long, dev)
                items = [(seqs[i], seqs[i].num_tokens - 1 + j, [0]) for i in active]
                prev = drafted[:, j - 1]
                logits = self._forward(items, list(range(len(items))),
                                       device_ids=prev if everyone else prev.index_select(0, rows))
            tok, probs = self._sample(logits, [seqs[i] for i in active], j, gen)
            if everyone:
                drafted[:, j] = tok
            else:
                drafted[:, j].index_copy_(0, rows, tok)
            if probs is not None:
                for r, i in enumerate(active):
                    dists[i].append(probs[r])
        pending = PendingTokens([s for s in seqs for _ in range(k_max)], drafted.view(-1))
        return Drafts({id(s): Proposal([-1 - (i * k_max + j) for j in range(plan[id(s)])],
                                       torch.stack(dists[i]) if not s.params.greedy and dists[i] else None)
                       for i, s in enumerate(seqs)}, pending)

    def _chains(self, seqs: list[Sequence], plan: dict[int, int],
                catch_up: list[tuple[Sequence, int, list[int]]]) -> bool:
        """Whether this step's drafts run as the chain: sequences that draft at most the chain's k (those nearing their
        end may use fewer) with one or two tokens to catch up, nothing banned, few enough for its graphs (greedy or
        sampled)."""
        c = self.chain
        return (c is not None and bool(seqs) and len(seqs) <= c.max_batch_for([s.params for s in seqs])
                and all(1 <= len(ids) <= CATCH_UP for _, _, ids in catch_up)
                and all(plan[id(s)] <= c.k and self.banned(s)[0] == 0 for s in seqs))

    def _masked(self, logits: torch.Tensor, seqs: list[Sequence], j: int) -> torch.Tensor:
        """logits with the tokens banned at draft position j (min_tokens: EOS and stop ids) set to -inf."""
        for i, seq in enumerate(seqs):
            rows, ids = self.banned(seq)
            if ids and j < rows:
                logits[i, ids] = float("-inf")
        return logits

    @staticmethod
    def after_verify(seq: Sequence, drafted: int, accepted: int) -> None:
        """Keep the accepted drafts that the draft itself consumed (the k-th was proposed, never fed)."""
        seq.num_draft_computed += min(accepted, drafted - 1)
