"""Lossless verification of drafted tokens.

For a request with k drafted tokens x_1..x_k the target scores k+1 positions in one pass, giving the
distributions p_1..p_{k+1}, each shaped exactly as the plain sampler would shape it had x_1..x_{i-1} been drawn
already: the structured outputs mask (the matcher advanced through them), allowed_token_ids, min_tokens' bans, the
bad words' bans and the penalties (both counting x_1..x_{i-1} as generated), logit_bias, then temperature / top-k /
top-p / min-p. Draft token x_i was drawn from q_i: the draft model's distribution under the request's
temperature, top-k, top-p, min-p and min_tokens' bans, not its masks, bias or penalties (any q keeps the method
lossless; a closer one is accepted more often), or a one-hot for n-gram proposals. Then, left to right:
  accept x_i with probability min(1, p_i(x_i) / q_i(x_i));
  at the first rejection emit a token drawn from max(0, p_i − q_i) normalised, and stop;
  when all k are accepted emit a bonus token drawn from p_{k+1}.
Every emitted token is then distributed exactly as the target alone would have sampled it (Leviathan et al.
2023; Chen et al. 2023). Greedy requests reduce to exact matching: accept x_i iff it is the argmax of the
target's logits, and emit the target's argmax at the first mismatch (or as the bonus).

Randomness: a request with a seed draws its uniforms and its resampling noise from its own generator, as
the plain sampler does; the others share the engine's generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nvllm.engine.structured_output import apply_draft_grammar_masks
from nvllm.kernels import report
from nvllm.layers.penalties import apply_logit_bias, apply_penalties_along_drafts, needs_processing
from nvllm.layers.sampler import SampleRow, apply_banned, apply_top_k_top_p_min_p, host_tensor, token_logprobs
from nvllm.layers.token_masks import apply_allowed_token_ids, bad_word_bans
from nvllm.sampling_params import SamplingParams


def shaped_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """softmax of each row's logits under its temperature, top-k, top-p and min-p (greedy rows: T = 1).
    Banned tokens must already be −inf in `logits`."""
    dev = logits.device
    temps = host_tensor([1.0 if p.greedy else p.temperature for p in params], torch.float32, dev)
    x = logits / temps[:, None]
    if any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0 for p in params):
        x = apply_top_k_top_p_min_p(x, host_tensor([p.top_k for p in params], torch.long, dev),
                                    host_tensor([p.top_p for p in params], torch.float32, dev),
                                    host_tensor([p.min_p for p in params], torch.float32, dev))
    return x.softmax(dim=-1)


def draw(weights: torch.Tensor, gens: list[torch.Generator | None], engine_gen: torch.Generator) -> torch.Tensor:
    """One index per row with probability ∝ weights (argmax of w / E, E ~ Exp(1)); rows with a generator
    draw their noise from it."""
    noise = torch.empty_like(weights).exponential_(generator=engine_gen)
    for i, g in enumerate(gens):
        if g is not None:
            noise[i].exponential_(generator=g)
    return (weights / noise).argmax(dim=-1)


def uniforms(n_rows: list[int], gens: list[torch.Generator | None], engine_gen: torch.Generator,
             device: torch.device) -> torch.Tensor:
    u = torch.rand(sum(n_rows), generator=engine_gen, device=device)
    start = 0
    for n, g in zip(n_rows, gens):
        if g is not None:
            u[start:start + n] = torch.rand(n, generator=g, device=device)
        start += n
    return u


def accepted_runs(flags: list[bool], counts: list[int]) -> tuple[list[int], list[int]]:
    """Per request (k drafted rows + 1 bonus row each): drafts accepted before the first failed flag, and the
    row whose distribution gives the token emitted after them."""
    accepted, final_rows, start = [], [], 0
    for k in counts:
        a = 0
        while a < k and flags[start + a]:
            a += 1
        accepted.append(a)
        final_rows.append(start + a)
        start += k + 1
    return accepted, final_rows


def rejection_sample(p: torch.Tensor | None, q: torch.Tensor | None, draft: torch.Tensor, target_argmax: torch.Tensor,
                     counts: list[int], greedy: list[bool], gens: list[torch.Generator | None],
                     engine_gen: torch.Generator) -> tuple[list[int], list[int]]:
    """The core on probabilities. Rows are grouped per request: request b owns counts[b] + 1 consecutive rows
    (its k drafted positions, then the bonus position).
    p: [R, V] target probabilities; q: [R, V] draft probabilities (zero on bonus rows); draft: [R] drafted
    token ids (anything on bonus rows); target_argmax: [R] (greedy requests only). p and q may be None
    when every request is greedy.
    Returns (accepted drafts per request, the token emitted after them per request)."""
    dev = draft.device
    rows = [k + 1 for k in counts]
    if all(greedy):  # exact matching, decided on the host from one read of both rows
        drafted, argmax = torch.stack([draft, target_argmax]).tolist()
        accepted, final_rows = accepted_runs([d == a for d, a in zip(drafted, argmax)], counts)
        return accepted, [argmax[r] for r in final_rows]
    px = p.gather(1, draft[:, None]).squeeze(1)
    qx = q.gather(1, draft[:, None]).squeeze(1)
    accept = uniforms(rows, gens, engine_gen, dev) * qx < px  # u < p/q without dividing; q(x) > 0
    if any(greedy):
        row_greedy = host_tensor([g for g, n in zip(greedy, rows) for _ in range(n)], torch.bool, dev)
        accept = torch.where(row_greedy, draft == target_argmax, accept)
    accepted, final_rows = accepted_runs(accept.tolist(), counts)
    idx = host_tensor(final_rows, torch.long, dev)
    pf = p[idx]
    residual = (pf - q[idx]).clamp_min_(0.0)
    empty = residual.sum(dim=-1, keepdim=True) <= 0  # p == q up to rounding: any residual is p itself
    residual = torch.where(empty, pf, residual)
    tokens = draw(residual, [None if g_ else g for g_, g in zip(greedy, gens)], engine_gen)
    if any(greedy):
        tokens = torch.where(host_tensor(greedy, torch.bool, dev), target_argmax[idx], tokens)
    return accepted, tokens.tolist()


@dataclass
class VerifyRequest:
    """One request's drafts for verification."""

    params: SamplingParams
    generator: torch.Generator | None
    draft_ids: list[int]
    draft_probs: torch.Tensor | None  # [k, V] shaped draft distributions; None: one-hot (n-gram) or greedy
    banned_rows: int  # leading rows (of k + 1) where `banned` applies (min_tokens not yet reached)
    banned: list[int]
    token_ids: list[int] | None = None  # penalized requests: the sequence's tokens, prompt then output
    num_prompt_tokens: int = 0
    grammar: object = None  # structured outputs: the sequence's xgrammar matcher (None while the constraint waits)
    allowed: list[int] | None = None  # allowed_token_ids
    bad_words: list[list[int]] | None = None  # bad words' token ids, and the tokens generated before the drafts
    generated: list[int] | None = None


@dataclass
class VerifyResult:
    accepted: int  # drafted tokens accepted
    token_ids: list[int]  # accepted drafts + the resampled / bonus token
    logprobs: list[tuple | None]  # per emitted token: (lp, rank, top-N) of the raw target distribution


class RejectionSampler:
    def __init__(self, seed: int = 0, synthetic_acceptance: float | None = None):
        """synthetic_acceptance (benchmark mode): accept each drafted token with this probability instead of
        min(1, p/q), and emit the target's own choice after the accepted run; not lossless."""
        self.seed = seed
        self.synthetic_acceptance = synthetic_acceptance
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, reqs: list[VerifyRequest]) -> list[VerifyResult]:
        """logits: [Σ(k_b + 1), V] float32 target logits, request after request."""
        report.record("rejection sampler", "torch")
        dev = logits.device
        counts = [len(r.draft_ids) for r in reqs]
        starts = [sum(counts[:b]) + b for b in range(len(reqs))]
        runs = [(s, r.grammar, r.draft_ids) for s, r in zip(starts, reqs) if r.grammar is not None]
        apply_draft_grammar_masks(logits, runs)
        raw = None
        if any(r.params.logprobs is not None for r in reqs):
            raw = torch.log_softmax(logits, dim=-1)
        apply_allowed_token_ids(logits, [(s + j, r.allowed) for s, r, k in zip(starts, reqs, counts) if r.allowed
                                         for j in range(k + 1)])
        apply_banned(logits, self.banned_pairs(reqs, starts), bool(runs) or any(r.allowed for r in reqs))
        rows = [SampleRow(r.params, None, [], r.token_ids, r.num_prompt_tokens) for r in reqs]  # one a request
        if needs_processing(rows):
            apply_logit_bias(logits, [row for row, k in zip(rows, counts) for _ in range(k + 1)])
            apply_penalties_along_drafts(logits, rows, [r.draft_ids for r in reqs])
        greedy = [r.params.greedy for r in reqs]
        draft = host_tensor([t for r in reqs for t in (*r.draft_ids, 0)], torch.long, dev)
        target_argmax = logits.argmax(dim=-1)
        p = q = None
        if not all(greedy):
            p = shaped_probs(logits, [r.params for r, k in zip(reqs, counts) for _ in range(k + 1)])
            q = torch.zeros_like(p)
            start = 0
            for r, k in zip(reqs, counts):
                if not r.params.greedy:
                    if r.draft_probs is not None:
                        q[start:start + k] = r.draft_probs
                    else:  # an n-gram proposal: the draft "distribution" is certain of its token
                        q[torch.arange(start, start + k, device=dev), draft[start:start + k]] = 1.0
                start += k + 1
        if self.synthetic_acceptance is not None:
            drawable = torch.isfinite(logits.gather(1, draft[:, None]).squeeze(1))  # what no mask refuses
            accepted, final = self._synthetic(p, target_argmax, counts, greedy, dev, drawable)
        else:
            accepted, final = rejection_sample(p, q, draft, target_argmax, counts, greedy,
                                               [r.generator for r in reqs], self.generator(dev))
        out, start = [], 0
        for r, k, a, tok in zip(reqs, counts, accepted, final):
            toks = [*r.draft_ids[:a], tok]
            lps: list[tuple | None] = [None] * len(toks)
            if raw is not None and r.params.logprobs is not None:
                lps = [token_logprobs(raw[start + j], t, r.params.logprobs) for j, t in enumerate(toks)]
            out.append(VerifyResult(a, toks, lps))
            start += k + 1
        return out

    @staticmethod
    def banned_pairs(reqs: list[VerifyRequest], starts: list[int]) -> list[tuple[int, int]]:
        """(row, token) masked at each verified position: min_tokens' bans on its leading rows, and the tokens
        that would complete a bad word after the generated tokens and the drafts before that position."""
        pairs = []
        for s, r in zip(starts, reqs):
            k = len(r.draft_ids)
            pairs += [(s + j, t) for j in range(min(r.banned_rows, k + 1)) for t in r.banned]
            if r.bad_words:
                pairs += [(s + j, t) for j in range(k + 1)
                          for t in bad_word_bans(r.bad_words, [*r.generated, *r.draft_ids[:j]])]
        return pairs

    def _synthetic(self, p, target_argmax, counts, greedy, dev, drawable) -> tuple[list[int], list[int]]:
        """Benchmark mode: accepted drafts per request from independent Bernoulli(rate) trials (stopping at
        the first failure, and at a draft a mask refuses: a constraint, a bad word, min_tokens); the token after
        them is the target's argmax (greedy) or a draw from its p."""
        gen = self.generator(dev)
        flags = torch.rand(sum(counts) + len(counts), generator=gen, device=dev) < self.synthetic_acceptance
        flags &= drawable
        if all(greedy):  # one read: the flags and the target's choices
            flags, argmax = torch.stack([flags.long(), target_argmax]).tolist()
            accepted, final_rows = accepted_runs([bool(f) for f in flags], counts)
            return accepted, [argmax[r] for r in final_rows]
        accepted, final_rows = accepted_runs(flags.tolist(), counts)
        idx = host_tensor(final_rows, torch.long, dev)
        drawn = draw(p[idx], [None] * len(counts), gen)
        tokens = torch.where(host_tensor(greedy, torch.bool, dev), target_argmax[idx], drawn)
        return accepted, tokens.tolist()
