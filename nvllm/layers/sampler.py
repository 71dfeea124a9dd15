"""Turn logits into tokens: structured outputs' grammar masks (nvllm.engine.structured_output), allowed_token_ids and
bad words (nvllm.layers.token_masks), min_tokens' bans, logit_bias and the presence / frequency / repetition
penalties (nvllm.layers.penalties), greedy, temperature, top-k, top-p, min-p, per-request seeds, and the
log-probabilities users ask for (computed on the raw distribution after the grammar mask, as vLLM reports them:
before any mask of its own, bias, penalty, temperature or filter)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nvllm.engine.structured_output import apply_grammar_masks
from nvllm.kernels import report
from nvllm.kernels.argmax import argmax_kernel_fits, greedy_argmax, gumbel_argmax
from nvllm.layers.penalties import apply_logit_bias, apply_penalties, needs_processing
from nvllm.layers.token_masks import apply_allowed_token_ids
from nvllm.sampling_params import SamplingParams


@dataclass
class SampleRow:
    params: SamplingParams
    generator: torch.Generator | None
    banned: list[int]  # token ids masked for this row (EOS/stop ids before min_tokens)
    # penalized rows only (params.penalized; None otherwise): the sequence's tokens, prompt then output, read during
    # the sampler's call; −1 − r stands for row r of the ``pending`` tokens still on the device
    token_ids: list[int] | None = None
    num_prompt_tokens: int = 0
    grammar: object = None  # structured outputs: the sequence's xgrammar matcher, which masks the row
    allowed: list[int] | None = None  # allowed_token_ids: every other token is masked


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[tuple[float, int, list[tuple[int, float]]] | None]  # (chosen lp, rank, top-N) per row


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                            min_p: torch.Tensor) -> torch.Tensor:
    """Mask (to −inf) every token outside each row's min-p / top-k / nucleus set, in vLLM's order: min-p on the
    whole distribution, then top-k (every token tied with the k-th logit stays), then top-p on what is left,
    renormalised. top_k ≤ 0 means off."""
    vocab = logits.shape[-1]
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mask = probs < (min_p[:, None] * probs[:, :1])
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
    mask |= sorted_logits < sorted_logits.gather(-1, (k - 1)[:, None])
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    cum_before = probs.cumsum(dim=-1) - probs  # mass of the more likely tokens left
    mask = cum_before >= top_p[:, None]  # the token that crosses top_p is kept; the first always is
    mask[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, idx, sorted_logits)


class Sampler:
    def __init__(self, seed: int = 0):
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _engine_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow], pending: torch.Tensor | None = None
                 ) -> SamplerOutput:
        """logits: [N, V] float32, one row per sequence that samples this step. The tokens are read back (a wait
        for the device); ``sample`` leaves them on the device."""
        raw_logprobs = None
        apply_grammar_masks(logits, rows)  # constrained rows' logprobs are those of the tokens they may draw
        if any(r.params.logprobs is not None for r in rows):  # before ``sample`` biases and penalizes logits
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        token_ids = self.sample(logits, rows, pending, masked=True).tolist()
        logprobs: list = [None] * len(rows)
        if raw_logprobs is not None:
            want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
            infos = batch_token_logprobs(raw_logprobs[want], [token_ids[i] for i in want],
                                         [rows[i].params.logprobs for i in want])
            for i, info in zip(want, infos):
                logprobs[i] = info
        return SamplerOutput(token_ids, logprobs)

    def sample(self, logits: torch.Tensor, rows: list[SampleRow], pending: torch.Tensor | None = None,
               masked: bool = False) -> torch.Tensor:
        """The chosen token of every row, as an int64 device tensor; nothing waits for the device (logits is
        modified in place: the tokens a row's grammar refuses and its banned tokens are masked, then logit_bias
        added and the penalties applied, vLLM's order). ``pending``: the tokens of the step still in flight, for
        penalized rows' placeholders; ``masked``: the grammar masks are applied already."""
        device = logits.device
        if not masked:
            apply_grammar_masks(logits, rows)
        apply_allowed_token_ids(logits, [(i, r.allowed) for i, r in enumerate(rows) if r.allowed])
        apply_banned(logits, [(i, t) for i, r in enumerate(rows) for t in r.banned],
                     any(r.grammar is not None or r.allowed for r in rows))
        if needs_processing(rows):
            apply_logit_bias(logits, rows)
            apply_penalties(logits, rows, pending)

        greedy = [r.params.greedy for r in rows]
        if argmax_kernel_fits(logits):
            if all(greedy):
                report.record("sampler", "triton greedy argmax")
                return greedy_argmax(logits)
            report.record("sampler", "triton gumbel argmax")
            return self._sample_triton(logits, rows, greedy)
        report.record("sampler", "torch")
        if all(greedy):
            return logits.argmax(dim=-1)
        ps = [r.params for r in rows]
        temps = host_tensor([1.0 if g else p.temperature for g, p in zip(greedy, ps)], torch.float32, device)
        probs = self._filtered(logits / temps[:, None], ps).softmax(dim=-1)
        chosen = (probs / self._noise(probs, rows, greedy)).argmax(dim=-1)
        if any(greedy):
            chosen = torch.where(host_tensor(greedy, torch.bool, device), logits.argmax(dim=-1), chosen)
        return chosen

    def _sample_triton(self, logits: torch.Tensor, rows: list[SampleRow], greedy: list[bool]) -> torch.Tensor:
        """The draws of ``sample`` by ``gumbel_argmax``: one kernel after the noise, no copy of the temperatures
        when the batch shares one (greedy rows: noise 1 and scale 1, their plain argmax)."""
        ps = [r.params for r in rows]
        temps = [1.0 if g else p.temperature for g, p in zip(greedy, ps)]
        noise = self._noise(logits, rows, greedy)
        for i, g in enumerate(greedy):
            if g:
                noise[i].fill_(1.0)
        same = all(t == temps[0] for t in temps)
        if self._filters(ps):
            scaled = logits / (temps[0] if same else host_tensor(temps, torch.float32, logits.device)[:, None])
            return gumbel_argmax(self._filtered(scaled, ps), noise, 1.0)
        scale = 1.0 / temps[0] if same else host_tensor([1.0 / t for t in temps], torch.float32, logits.device)
        return gumbel_argmax(logits, noise, scale)

    @staticmethod
    def _filters(ps: list[SamplingParams]) -> bool:
        return any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0 for p in ps)

    def _filtered(self, x: torch.Tensor, ps: list[SamplingParams]) -> torch.Tensor:
        """x with each row's top-k / top-p / min-p mask applied (x itself when no row asks for one)."""
        if not self._filters(ps):
            return x
        device = x.device
        return apply_top_k_top_p_min_p(x, host_tensor([p.top_k for p in ps], torch.long, device),
                                       host_tensor([p.top_p for p in ps], torch.float32, device),
                                       host_tensor([p.min_p for p in ps], torch.float32, device))

    def _noise(self, like: torch.Tensor, rows: list[SampleRow], greedy: list[bool]) -> torch.Tensor:
        """Exp(1) draws of ``like``'s shape, one per row and token; rows with their own seed draw from their own
        generator, so a seeded request ignores its batch (Gumbel-max in its exponential form: argmax(p / E))."""
        noise = torch.empty_like(like, dtype=torch.float32).exponential_(generator=self._engine_generator(like.device))
        for i, r in enumerate(rows):
            if r.generator is not None and not greedy[i]:
                noise[i].exponential_(generator=r.generator)
        return noise


def apply_banned(logits: torch.Tensor, banned: list[tuple[int, int]], constrained: bool) -> None:
    """Set the (row, token) pairs to −inf in place (EOS and stop ids before min_tokens, bad words). ``constrained``:
    some rows went through a mask (a grammar, allowed_token_ids) that may leave only banned tokens, as a complete
    constraint leaves only EOS: there the bans yield, rather than leave nothing to draw."""
    if not banned:
        return
    bi, bt = zip(*banned)
    bi, bt = host_tensor(list(bi), torch.long, logits.device), host_tensor(list(bt), torch.long, logits.device)
    if constrained:
        kept = logits[bi, bt]
        logits[bi, bt] = float("-inf")
        empty = (logits == float("-inf")).all(dim=-1)
        logits[bi, bt] = torch.where(empty[bi], kept, float("-inf"))
    else:
        logits[bi, bt] = float("-inf")


def host_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small per-row parameter vector on the device: through pinned memory and an async copy on GPU."""
    t = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return t.to(device, non_blocking=True)


def token_logprobs(row_logprobs: torch.Tensor, token: int, top_n: int) -> tuple[float, int, list[tuple[int, float]]]:
    """(log p(token), its rank (1 = best), the top_n (token, log p) pairs) for one row."""
    return batch_token_logprobs(row_logprobs[None], [token], [top_n])[0]


def batch_token_logprobs(logprobs: torch.Tensor, tokens: list[int], top_ns: list[int]) -> list[tuple]:
    """token_logprobs for many rows at once: a handful of device ops and one host copy per quantity, whatever
    the number of rows (prompt log-probabilities ask for thousands). A token's rank counts the tokens at least as
    likely, itself included, as vLLM's: a token tied with others takes the tie's last place."""
    idx = torch.tensor(tokens, device=logprobs.device)[:, None]
    chosen = logprobs.gather(1, idx)
    ranks = (logprobs >= chosen).sum(dim=-1).tolist()
    chosen = chosen[:, 0].tolist()
    k = max(top_ns, default=0)
    tops: list[list[tuple[int, float]]] = [[] for _ in tokens]
    if k > 0:
        vals, ids = logprobs.topk(k, dim=-1)
        vals, ids = vals.tolist(), ids.tolist()
        tops = [list(zip(i[:n], v[:n])) for i, v, n in zip(ids, vals, top_ns)]
    return list(zip(chosen, ranks, tops))
