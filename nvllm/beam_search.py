"""Beam search, as vLLM runs it: on top of the engine, one token at a time. Each step asks the engine for one token
of every live beam with its top 2·beam_width log-probabilities (the prefix cache spares all but the last block of
each beam's recomputation); every (beam, token) pair is a candidate scored by its cumulative log-probability
(length-normalized: ``cum_logprob / len**length_penalty``, the tokens counted with the prompt, EOS not counted); the
best beam_width candidates live on. A candidate ending in EOS (unless ignore_eos) is complete and stops there (the
EOS among its tokens, not in its text unless include_stop_str_in_output). At the end the complete and live beams
are ranked together and the best beam_width returned.

``BeamSearch`` holds the state; the offline ``LLM.beam_search`` and the server drive it, each with its own way of
running a step."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from nvllm.engine.detokenizer import prompt_context
from nvllm.sampling_params import SamplingParams


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0  # accepted as vLLM's is; the ranking uses the raw log-probabilities
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty}")


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # the prompt's, then the generated ones
    num_prompt_tokens: int
    cum_logprob: float = 0.0
    logprobs: list[float] = field(default_factory=list)  # each generated token's
    finish_reason: str | None = None
    stop_reason: int | None = None
    text: str | None = None  # the generated text, set at the end

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]  # best first


class BeamSearch:
    """One prompt's search. ``live`` beams each need a step (``step_params``) until ``done``."""

    def __init__(self, prompt: list[int], params: BeamSearchParams, eos_token_ids: set[int], max_model_len: int):
        self.params, self.eos = params, eos_token_ids
        self.limit = min(params.max_tokens, max_model_len - len(prompt))  # the beams may grow to max_model_len
        if self.limit < 1:
            raise ValueError(f"prompt has {len(prompt)} tokens; max_model_len is {max_model_len} (room for at least "
                             "one generated token is needed)")
        self.live = [BeamSearchSequence(list(prompt), len(prompt))]
        self.complete: list[BeamSearchSequence] = []
        self.steps = 0
        self.aborted = False

    @property
    def done(self) -> bool:
        return self.aborted or not self.live or self.steps >= self.limit

    def abort(self) -> None:
        """End the search now (its step was aborted: the server shutting down): the beams so far are the result,
        the live ones finishing with "abort", as an aborted request's output does."""
        self.aborted = True

    def step_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * self.params.beam_width, ignore_eos=True)

    def advance(self, top_logprobs: list[dict[int, float]]) -> None:
        """``top_logprobs``: for each live beam (in order), its next token's candidates → log-probability."""
        candidates = []
        for beam, top in zip(self.live, top_logprobs, strict=True):
            for tok, lp in top.items():
                new = BeamSearchSequence(beam.tokens + [tok], beam.num_prompt_tokens, beam.cum_logprob + lp,
                                         beam.logprobs + [lp])
                if tok in self.eos and not self.params.ignore_eos:
                    new.finish_reason = "stop"  # its tokens keep the EOS (counted in usage); its text does not
                    self.complete.append(new)
                else:
                    candidates.append(new)
        self.live = sorted(candidates, key=self._score, reverse=True)[:self.params.beam_width]
        self.steps += 1

    def result(self, decode) -> BeamSearchOutput:
        """The best beam_width beams, their text decoded (``decode(token ids)``) as what follows the prompt."""
        for beam in self.live:
            beam.finish_reason = "abort" if self.aborted else "length"
        best = sorted(self.complete + self.live, key=self._score, reverse=True)[:self.params.beam_width]
        for beam in best:
            out = beam.output_token_ids
            if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output:
                out = out[:-1]
            beam.text = _continuation(decode, prompt_context(decode, beam.tokens[:beam.num_prompt_tokens]), out)
        return BeamSearchOutput(best)

    def _score(self, beam: BeamSearchSequence) -> float:
        """A key that orders beams as ``cum_logprob / n**length_penalty`` does, taken in log space so that no length
        penalty overflows or divides by zero: −(log(−cum_logprob) − length_penalty·log n), +inf for a sure beam."""
        n = len(beam.tokens) - (1 if beam.tokens[-1] in self.eos else 0)
        if beam.cum_logprob >= 0.0:
            return math.inf
        return self.params.length_penalty * math.log(n) - math.log(-beam.cum_logprob)


def _continuation(decode, context: list[int], out: list[int]) -> str:
    """The text ``out`` adds after the prompt's last tokens (``context``): a SentencePiece word's leading space
    included, as sampling's incremental detokenizer gives it; the tokens alone where the two do not line up."""
    head, full = decode(context), decode(context + out)
    return full[len(head):] if full.startswith(head) else decode(out)
