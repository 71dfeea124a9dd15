"""logit_bias and the presence / frequency / repetition penalties, as vLLM applies them, on a batch's logits in place.

The order is vLLM's sampler's: the bias is added first (one of its logits processors), then the penalties
(``apply_penalties``), both on the raw logits, before temperature, top-k, top-p and min-p:

- repetition_penalty r, on every token seen in the prompt or the output: a positive logit is divided by r, a
  negative one multiplied by it;
- frequency_penalty f and presence_penalty p, on the output only (c: the token's count there):
  logit -= f * c + p * (c > 0), OpenAI's documented formula.

Only the rows that ask for them are touched; every step counts the tokens anew, vectorised over the rows (one
scatter for the counts, one for the prompt's seen mask), no loop over the vocabulary. A row's tokens may end with
placeholders −1 − r of tokens sampled by the step still in flight (asynchronous scheduling): they are taken from
``pending`` on the device, so the newest token counts without waiting for it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from nvllm.layers.sampler import SampleRow


def needs_processing(rows: list[SampleRow]) -> bool:
    """Whether any row asks for a bias or a penalty (otherwise the sampler builds nothing for them)."""
    return any(r.token_ids is not None or r.params.logit_bias for r in rows)


def apply_logit_bias(logits: torch.Tensor, rows: list[SampleRow]) -> None:
    entries = [(i, t, b) for i, r in enumerate(rows) if r.params.logit_bias for t, b in r.params.logit_bias.items()]
    if not entries:
        return
    ri, ti, bi = (list(x) for x in zip(*entries))
    dev = logits.device
    logits.index_put_((_tensor(ri, torch.long, dev), _tensor(ti, torch.long, dev)), _tensor(bi, logits.dtype, dev),
                      accumulate=True)


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow], pending: torch.Tensor | None = None) -> None:
    """The penalties of every row whose ``token_ids`` are given (prompt + output, the first ``num_prompt_tokens``
    the prompt's). ``pending``: the device tensor the placeholders among them stand for."""
    want = [i for i, r in enumerate(rows) if r.token_ids is not None and r.params.penalized]
    if not want:
        return
    dev, vocab = logits.device, logits.shape[-1]
    output: list[int] = []
    for i in want:
        output += rows[i].token_ids[rows[i].num_prompt_tokens:]
    out_ids = _tensor(output, torch.long, dev)
    if output and min(output) < 0:
        if pending is None:
            raise RuntimeError("penalized rows hold placeholders of tokens still on the device, but no pending tokens "
                               "were given")
        out_ids = torch.where(out_ids < 0, pending[(-1 - out_ids).clamp(min=0)], out_ids)
    counts = token_counts(out_ids, [len(rows[i].token_ids) - rows[i].num_prompt_tokens for i in want], vocab)
    ps = [rows[i].params for i in want]
    in_prompt = _prompt_counts(rows, want, vocab, dev) if any(p.repetition_penalty != 1.0 for p in ps) else None
    _penalize(logits, want, counts, in_prompt, ps)


def apply_penalties_along_drafts(logits: torch.Tensor, rows: list[SampleRow], drafts: list[list[int]]) -> None:
    """Speculative verification: ``rows`` holds one row per request (its sequence's tokens), and request b owns
    ``len(drafts[b]) + 1`` consecutive rows of ``logits``, its row j penalized as if ``drafts[b][:j]`` had been
    generated. Each sequence's tokens are counted once; the drafts are added per row."""
    want = [b for b, r in enumerate(rows) if r.token_ids is not None and r.params.penalized]
    if not want:
        return
    dev, vocab = logits.device, logits.shape[-1]
    starts = [0]
    for d in drafts:
        starts.append(starts[-1] + len(d) + 1)
    output: list[int] = []
    for b in want:
        output += rows[b].token_ids[rows[b].num_prompt_tokens:]
    base = token_counts(_tensor(output, torch.long, dev),
                        [len(rows[b].token_ids) - rows[b].num_prompt_tokens for b in want], vocab)
    spans = [len(drafts[b]) + 1 for b in want]
    of_row = torch.repeat_interleave(torch.arange(len(want), device=dev), _tensor(spans, torch.long, dev),
                                     output_size=sum(spans))
    counts = base[of_row]
    extra = [(sum(spans[:i]) + j, t) for i, b in enumerate(want) for j in range(1, spans[i])
             for t in drafts[b][:j]]
    if extra:
        r_idx, t_idx = (_tensor(list(x), torch.long, dev) for x in zip(*extra))
        counts.index_put_((r_idx, t_idx), torch.ones(len(extra), dtype=counts.dtype, device=dev), accumulate=True)
    ps = [rows[b].params for b, n in zip(want, spans) for _ in range(n)]
    in_prompt = None
    if any(p.repetition_penalty != 1.0 for p in ps):
        in_prompt = _prompt_counts(rows, want, vocab, dev)[of_row]
    _penalize(logits, [starts[b] + j for b, n in zip(want, spans) for j in range(n)], counts, in_prompt, ps)


def _prompt_counts(rows: list[SampleRow], want: list[int], vocab: int, dev: torch.device) -> torch.Tensor:
    prompt: list[int] = []
    for i in want:
        prompt += rows[i].token_ids[:rows[i].num_prompt_tokens]
    return token_counts(_tensor(prompt, torch.long, dev), [rows[i].num_prompt_tokens for i in want], vocab)


def _penalize(logits: torch.Tensor, idx: list[int], counts: torch.Tensor, in_prompt: torch.Tensor | None,
              ps: list) -> None:
    """The penalties of rows ``idx`` of ``logits`` (in place): ``counts`` [len(idx), vocab] of their output tokens,
    ``in_prompt`` of their prompts' (needed for a repetition penalty), ``ps`` their SamplingParams."""
    dev = logits.device
    whole = len(idx) == logits.shape[0]
    rows = None if whole else _tensor(idx, torch.long, dev)
    x = logits if whole else logits[rows]
    if in_prompt is not None:
        seen = (counts > 0) | (in_prompt > 0)
        rep = torch.where(seen, _tensor([p.repetition_penalty for p in ps], x.dtype, dev)[:, None], 1.0)
        # a penalty far from 1 may take a finite logit past the dtype's range: keep it at the largest finite value
        # (an infinite logit would make the softmax NaN and every mask moot); banned tokens' −inf stay as they are
        big = torch.finfo(x.dtype).max
        x = torch.where(x.isfinite(), torch.where(x > 0, x / rep, x * rep).clamp(-big, big), x)
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in ps):
        freq = _tensor([p.frequency_penalty for p in ps], x.dtype, dev)[:, None]
        pres = _tensor([p.presence_penalty for p in ps], x.dtype, dev)[:, None]
        x = x - freq * counts - pres * (counts > 0)
    if whole:
        logits.copy_(x)
    else:
        logits[rows] = x


def token_counts(ids: torch.Tensor, lens: list[int], vocab: int) -> torch.Tensor:
    """[len(lens), vocab] int32: how many times each token occurs in each row's run of ``ids`` (the rows' runs one
    after another, ``lens`` long)."""
    counts = torch.zeros(len(lens), vocab, dtype=torch.int32, device=ids.device)
    total = ids.shape[0]
    if total:
        row = torch.repeat_interleave(torch.arange(len(lens), device=ids.device), _tensor(lens, torch.long, ids.device),
                                      output_size=total)
        counts.view(-1).scatter_add_(0, row * vocab + ids, torch.ones(total, dtype=torch.int32, device=ids.device))
    return counts


def _tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    from nvllm.layers.sampler import host_tensor  # here: the sampler imports this module

    return host_tensor(values, dtype, device)
