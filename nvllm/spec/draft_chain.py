"""DraftChain: a draft model's whole proposal — its catch-up and its k single-token steps — as one CUDA graph
per batch size.

Once a verification is read, everything the draft does next is known in advance except the tokens it draws: the
catch-up feeds the one or two tokens the verification added (the last accepted one, plus the bonus token when every
draft was accepted) and its LM head's argmax is draft 1; draft j then goes in at position ``start + j − 1``, whose
slot, block table and context length the host computes beforehand. So the catch-up forward, each step's forward,
every LM head and every argmax are captured once per batch size over static buffers, and a whole proposal costs
two copies of the host-built inputs and one replay. Step by step, the host needed ~0.4 ms per drafted token (PERF
run AH) and the catch-up's LM head left the GPU waiting ~0.15 ms for its launch (run AJ): more than a small draft's
GPU time.

Each batch size has two graphs: one catch-up row per sequence (every sequence has one token to catch up: the last
verification rejected a draft) and two (a sequence that has one pads its first row: stored nowhere, attending to
nothing, as are the rows of the batch's padding sequences). At batch 1 the chain's forwards have exactly the loop's
shapes, so on the GPU too it drafts exactly the loop's tokens.

Sampled requests draft through graphs of their own (``SAMPLED``, or ``FILTERED`` when a request sets top-k, top-p
or min-p): each step shapes the logits by the rows' temperatures (and filters), keeps the softmax — the draft
distribution q that verification needs — and draws by the exponential race (argmax of q / E) over noise E drawn
outside the graph before each replay, from the engine's generator or, one step at a time as the loop draws it, a
seeded request's own; greedy rows of the batch take the argmax.

Every sequence drafts k tokens; one that may use fewer (its ``max_tokens`` or the model length cut its k) has the
first ones, its steps after its last used draft being padding rows. Nothing may be banned (``min_tokens``) and
catch-ups are of one or two tokens; the proposer falls back to the step-by-step loop otherwise. Batch sizes follow the
draft's decode graphs up to ``MAX_CHAIN_BATCH`` (greedy) and ``MAX_SAMPLED_BATCH`` (sampled). On the CPU (tests) the
same chain runs eagerly over the same buffers.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from nvllm.kernels import report
from nvllm.layers.attention import AttentionMetadata
from nvllm.layers.sampler import apply_top_k_top_p_min_p
from nvllm.sampling_params import SamplingParams

logger = logging.getLogger("nvllm")
MAX_CHAIN_BATCH = 32
"""Largest batch captured as a chain (its graph keeps [batch, vocab] float32 logits per step in the graphs' pool:
19.5 MB per step at 32 rows of a 152k vocabulary); larger batches draft step by step."""
MAX_SAMPLED_BATCH = 8
"""Largest batch of the sampled graphs: their noise and draft distributions are [batch, k, vocab] float32 buffers
(19.5 MB each at 8 rows, k = 4, a 152k vocabulary)."""
GREEDY, SAMPLED, FILTERED = "greedy", "sampled", "filtered"
CATCH_UP = 2
"""Most catch-up rows per sequence: the tokens a verification adds to the draft's backlog (1, or 2 after a full
accept)."""


class DraftChain:
    def __init__(self, runner, k: int, vocab_size: int, capture: bool = True):
        """runner: the draft's ModelRunner; k: tokens drafted per sequence; vocab_size: the target's (draft logits past
        it are never chosen). ``capture=False`` runs the chain eagerly (CPU)."""
        self.model, self.kv_caches = runner.model, runner.kv_caches
        self.block_size = runner.block_size
        self.k, self.vocab_size = k, vocab_size
        dev = runner.device
        ladder = runner.graphs.sizes if runner.graphs is not None else [1, 2, 4, 8, 16, 32]
        self.sizes = [b for b in ladder if b <= MAX_CHAIN_BATCH] or [1]
        n, c, s = self.sizes[-1], CATCH_UP, k - 1
        self.width = width = -(-runner.max_model_len // self.block_size)
        # all int64 inputs in one buffer, all int32 ones in another: one copy each
        #   int64: catch-up ids, positions, slots [3, c·n] | steps' positions, slots [2, s, n]
        #   int32: catch-up context lengths [c·n] | steps' context lengths [s, n] | block tables [n, width]
        pin = dev.type == "cuda"
        self.host64 = torch.zeros(3 * c * n + 2 * s * n, dtype=torch.int64, pin_memory=pin)
        self.host32 = torch.zeros(c * n + s * n + n * width, dtype=torch.int32, pin_memory=pin)
        self.dev64 = torch.zeros_like(self.host64, device=dev)
        self.dev32 = torch.zeros_like(self.host32, device=dev)
        self._views = [self._split(b64, b32, n, c, s, width) for b64, b32 in
                       ((self.host64.numpy(), self.host32.numpy()), (self.dev64, self.dev32))]
        self._views[1]["cu_slots"].fill_(-1)  # the capture's warm-up runs store nowhere
        self._views[1]["slots"].fill_(-1)
        self._tables_end = c * n + s * n  # where the block tables start in the int32 buffer
        self.query_start_loc = torch.arange(c * n + 1, dtype=torch.int32, device=dev)
        self.drafted = torch.zeros(n, k, dtype=torch.int64, device=dev)
        # sampled graphs: per row temperature, top-p, min-p, top-k, greedy (1.0) in one float32 buffer; the noise E
        # of each draw and the draft distributions q
        self.sampled_sizes = [b for b in self.sizes if b <= MAX_SAMPLED_BATCH]
        ns = self.sampled_sizes[-1]
        self.host_params = torch.zeros(5, ns, dtype=torch.float32, pin_memory=pin)
        self.params = torch.zeros_like(self.host_params, device=dev)
        self._params_np = self.host_params.numpy()
        self.noise = torch.ones(ns, k, vocab_size, dtype=torch.float32, device=dev)
        self.q = torch.zeros(ns, k, vocab_size, dtype=torch.float32, device=dev)
        self.copied = torch.cuda.Event() if pin else None
        self.graphs: dict[tuple[int, int, str], torch.cuda.CUDAGraph] = {}  # (batch size, catch-up rows, mode)
        self.recorded: dict[tuple[int, int, str], object] = {}
        self.runs = 0
        if capture:
            self._capture(runner.graphs.pool if runner.graphs is not None else None)

    @staticmethod
    def _split(b64, b32, n: int, c: int, s: int, width: int) -> dict:
        """Named views of one pair of flat buffers (host numpy arrays or device tensors)."""
        cu = b64[:3 * c * n].reshape(3, c * n)
        steps = b64[3 * c * n:].reshape(2, s, n)
        return dict(cu_ids=cu[0], cu_pos=cu[1], cu_slots=cu[2], pos=steps[0], slots=steps[1],
                    cu_ctx=b32[:c * n], ctx=b32[c * n:c * n + s * n].reshape(s, n),
                    tables=b32[c * n + s * n:].reshape(n, width))

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def max_batch_for(self, params: list[SamplingParams]) -> int:
        return self.max_batch if all(p.greedy for p in params) else self.sampled_sizes[-1]

    def _draw(self, logits: torch.Tensor, bs: int, j: int, mode: str) -> torch.Tensor:
        """Draft j of ``bs`` rows from their logits: the argmax (greedy), or a draw from the shaped softmax, kept in
        ``q`` (the rows' greedy flags still take the argmax)."""
        v = self.vocab_size
        w = logits.shape[1]
        logits = logits[:, :v] if w >= v else torch.nn.functional.pad(logits, (0, v - w), value=float("-inf"))
        argmax = logits.argmax(dim=-1)
        if mode == GREEDY:
            return argmax
        temp, top_p, min_p, top_k, greedy = self.params[:, :bs]
        x = logits / temp[:, None]
        if mode == FILTERED:
            x = apply_top_k_top_p_min_p(x, top_k.long(), top_p, min_p)
        q = x.softmax(dim=-1)
        self.q[:bs, j] = q
        return torch.where(greedy > 0, argmax, (q / self.noise[:bs, j]).argmax(dim=-1))

    def _chain(self, bs: int, c: int, mode: str = GREEDY, max_start: int | None = None) -> None:
        """The catch-up (``c`` rows per sequence) and the k − 1 steps after it for ``bs`` sequences, over the static
        buffers (what the graphs capture; their attention sizes its grid from the block-table width, so the longest
        context, from ``max_start``, is only given eagerly)."""
        v = self._views[1]
        tables = v["tables"][:bs]
        meta = AttentionMetadata(v["cu_slots"][:c * bs], tables.repeat_interleave(c, dim=0),
                                 self.query_start_loc[:c * bs + 1], v["cu_ctx"][:c * bs], max_query_len=1,
                                 max_context_len=max_start)
        hidden = self.model(v["cu_ids"][:c * bs], v["cu_pos"][:c * bs], self.kv_caches, meta)
        for j in range(self.k):
            logits = self.model.compute_logits(hidden[c - 1::c].contiguous() if j == 0 else hidden)
            tokens = self._draw(logits, bs, j, mode)
            self.drafted[:bs, j] = tokens
            if j == self.k - 1:
                break
            meta = AttentionMetadata(v["slots"][j, :bs], tables, self.query_start_loc[:bs + 1], v["ctx"][j, :bs],
                                     max_query_len=1, max_context_len=None if max_start is None else max_start + j + 1)
            hidden = self.model(tokens, v["pos"][j, :bs], self.kv_caches, meta)

    @torch.inference_mode()
    def _capture(self, pool) -> None:
        start = time.perf_counter()
        keys = [(bs, c, GREEDY) for bs in reversed(self.sizes) for c in (CATCH_UP, 1)]
        keys += [(bs, c, m) for bs in reversed(self.sampled_sizes) for c in (CATCH_UP, 1) for m in (SAMPLED, FILTERED)]
        self.params[0].fill_(1.0)  # warm-up draws at temperature 1
        for key in sorted(keys, key=lambda x: -x[0]):  # largest first: the pool is sized once
            self._chain(*key)  # warm-up: compiles the LM head's kernels, allocates split-K workspaces
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with report.recording() as self.recorded[key], torch.cuda.graph(graph, pool=pool):
                self._chain(*key)
            pool = graph.pool()
            self.graphs[key] = graph
        torch.cuda.synchronize()
        logger.info("captured the draft's catch-up and %d-token chain for batch sizes %s (sampled up to %d) in %.1f s",
                    self.k, self.sizes, self.sampled_sizes[-1], time.perf_counter() - start)

    def stage(self, catch_up: list[list[int]], starts: list[int], block_tables: list[list[int]],
              params: list[SamplingParams] | None = None, used: list[int] | None = None) -> tuple[int, int, str]:
        """Fill the input buffers for len(starts) sequences; returns the graph's (batch size, catch-up rows per
        sequence, mode). catch_up[i]: the one or two tokens sequence i's draft cache lacks, ending at position
        starts[i] − 1; params: the sequences' sampling parameters (None: all greedy); used[i]: how many drafts
        sequence i will use (k by default; the steps after its last one are padding rows)."""
        b, bs_, s = len(starts), self.block_size, self.k - 1
        mode = GREEDY
        if params is not None and not all(p.greedy for p in params):
            mode = FILTERED if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0 for p in params) else SAMPLED
        sizes = self.sizes if mode == GREEDY else self.sampled_sizes
        bs = sizes[bisect.bisect_left(sizes, b)] if self.graphs else b
        c = max(len(ids) for ids in catch_up)
        if self.copied is not None:
            self.copied.synchronize()  # the previous run's copies out of the staging buffers are done
        h = self._views[0]
        cu_pos = [start - c + r for start in starts for r in range(c)]
        real = [r >= c - len(ids) for ids in catch_up for r in range(c)]
        h["cu_ids"][:c * b] = [ids[r - c + len(ids)] if r >= c - len(ids) else 0 for ids in catch_up for r in range(c)]
        h["cu_pos"][:c * b] = [p if ok else 0 for p, ok in zip(cu_pos, real)]
        h["cu_slots"][:c * b] = [t[p // bs_] * bs_ + p % bs_ if ok else -1
                                 for t, p, ok in zip((t for t in block_tables for _ in range(c)), cu_pos, real)]
        h["cu_ctx"][:c * b] = [p + 1 if ok else 0 for p, ok in zip(cu_pos, real)]
        h["cu_ids"][c * b:c * bs] = h["cu_pos"][c * b:c * bs] = 0  # padding sequences: stored nowhere, attending
        h["cu_slots"][c * b:c * bs] = -1  # to nothing
        h["cu_ctx"][c * b:c * bs] = 0
        if s:
            # step j feeds draft j + 1 at position start + j; it is needed while draft j + 2 is used, and otherwise a
            # padding row (its position may lie past the sequence's blocks and the model's length)
            need = [[used is None or j + 2 <= used[i] for i in range(b)] for j in range(s)]
            pos = [[st + j if ok else 0 for st, ok in zip(starts, row)] for j, row in enumerate(need)]
            h["pos"][:, :b] = pos
            h["slots"][:, :b] = [[t[p // bs_] * bs_ + p % bs_ if ok else -1
                                  for t, p, ok in zip(block_tables, prow, row)] for prow, row in zip(pos, need)]
            h["ctx"][:, :b] = [[p + 1 if ok else 0 for p, ok in zip(prow, row)] for prow, row in zip(pos, need)]
            h["pos"][:, b:bs] = 0
            h["slots"][:, b:bs] = -1
            h["ctx"][:, b:bs] = 0
        width = max(len(t) for t in block_tables)
        h["tables"][:b, :width] = [t + [0] * (width - len(t)) for t in block_tables]
        self.dev64.copy_(self.host64, non_blocking=True)
        end = self._tables_end + b * self.width
        self.dev32[:end].copy_(self.host32[:end], non_blocking=True)
        if mode != GREEDY:
            self._params_np[:, :b] = [[1.0 if p.greedy else p.temperature for p in params], [p.top_p for p in params],
                                      [p.min_p for p in params], [p.top_k for p in params],
                                      [float(p.greedy) for p in params]]
            self._params_np[:, b:bs] = [[1.0], [1.0], [0.0], [0.0], [1.0]]  # padding rows: greedy
            self.params.copy_(self.host_params, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        return bs, c, mode

    @torch.inference_mode()
    def run(self, catch_up: list[list[int]], starts: list[int], block_tables: list[list[int]],
            params: list[SamplingParams] | None = None, generators: list[torch.Generator | None] | None = None,
            engine_generator: torch.Generator | None = None,
            used: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft k tokens for each of len(starts) sequences (see ``stage``; sampled rows draw their noise from their
        ``generators`` entry, else from ``engine_generator``; ``used[i]``: how many of its drafts sequence i will use,
        k by default). Returns the tokens [b, k] and, when any row samples, the draft distributions [b, k, vocab] —
        views of static buffers, valid until the next run."""
        key = self.stage(catch_up, starts, block_tables, params, used)
        if key[2] != GREEDY:
            self.noise[:key[0]].exponential_(generator=engine_generator)
            for i, g in enumerate(generators or []):
                if g is not None and not params[i].greedy:  # a draw per used step, as step by step: a seeded
                    for j in range(used[i] if used else self.k):  # request drafts the same either way
                        self.noise[i, j].exponential_(generator=g)
        self.runs += 1
        if self.graphs:
            self.graphs[key].replay()
            report.record("draft chain", f"cuda graph (batch {key[0]}, catch-up of {key[1]} and {self.k} tokens, "
                                         f"{key[2]})")
            report.replay(self.recorded[key])
        else:
            self._chain(*key, max(starts))
        b = len(starts)
        return self.drafted[:b], None if key[2] == GREEDY else self.q[:b]
