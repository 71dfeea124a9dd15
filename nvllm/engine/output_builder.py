"""What the engine hands out: a RequestOutput built from a request's sequences, and the logprob dicts reported
at every position (each token's text decoded once per token id)."""

from __future__ import annotations

import dataclasses

from nvllm.engine.sequence import Sequence
from nvllm.outputs import CompletionOutput, Logprob, RequestOutput


class OutputBuilder:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._token_texts: dict[int, str] = {}

    def logprob_dict(self, tok: int, lp: float, rank: int, top: list[tuple[int, float]]) -> dict[int, Logprob]:
        """The chosen token's logprob and rank with the top-N (token, logprob) pairs, as Logprob entries."""
        d = {t: Logprob(v, r + 1, self.token_text(t)) for r, (t, v) in enumerate(top)}
        d[tok] = Logprob(lp, rank, self.token_text(tok))
        return d

    def token_text(self, tok: int) -> str:
        """One token decoded alone, cached (bounded by the vocabulary): logprobs ask for it at every position."""
        text = self._token_texts.get(tok)
        if text is None:
            text = self._token_texts[tok] = self.tokenizer.decode([tok])
        return text

    @staticmethod
    def build(request_id: str, seqs: list[Sequence], prompt: str | None) -> RequestOutput:
        """The request's output now: copies, so an output handed out does not change under its holder as the
        engine goes on; an unfinished sequence's text holds back what may be the start of a stop string."""
        completions = []
        for s in seqs:
            text = s.text
            if not s.finished and s.params.stop:
                hold = max(len(x) for x in s.params.stop) - 1
                text = text[:max(0, len(text) - hold)]
            completions.append(CompletionOutput(
                index=s.index, text=text, token_ids=list(s.output_token_ids),
                cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                logprobs=None if s.logprobs is None else list(s.logprobs),
                finish_reason=s.finish_reason, stop_reason=s.stop_reason))
        first = seqs[0]
        return RequestOutput(
            request_id=request_id, prompt=prompt,
            prompt_token_ids=first.token_ids[:first.num_prompt_tokens], outputs=completions,
            finished=all(s.finished for s in seqs), metrics=dataclasses.replace(first.metrics),
            prompt_logprobs=None if first.prompt_logprobs is None else list(first.prompt_logprobs),
            num_cached_tokens=first.num_cached_tokens)
