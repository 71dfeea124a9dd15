"""POST /v1/completions: one engine request per prompt (each with n samples), answered whole or streamed as
one SSE chunk per choice per engine step. Choice index = prompt index · n + sample index, as OpenAI does."""

from __future__ import annotations

import dataclasses
import functools

from collections.abc import AsyncIterator

from nvllm.engine.async_engine import AsyncLLMEngine
from nvllm.engine.output_stream import OutputStream
from nvllm.outputs import RequestOutput
from nvllm.serve.errors import bad_request
from nvllm.serve.http import on_response_thread, sse
from nvllm.serve.params import (MAX_LOGPROBS, EngineRequest, ChoiceProgress, check_logprobs, constraint_param,
                                prompt_logprobs_json, requested_prompt_logprobs, resolve_max_tokens, submit,
                                sampling_params, usage, choice_usage)
from nvllm.serve.beam import beam_params, beam_usage, check_beam_request, search_all
from nvllm.serve.models import ServedModels
from nvllm.serve.prompts import PromptProcessor
from nvllm.serve.protocol import (CompletionChoice, CompletionLogProbs, CompletionRequest, CompletionResponse,
                                  random_id, response_id)


def _lp(x: float) -> float:
    return max(x, -9999.0)  # JSON has no -inf


def completion_logprobs(token_ids: list[int], dicts: list, num_top: int, offset: int,
                        token_text) -> CompletionLogProbs:
    """OpenAI's legacy logprobs object; a None dict (the first prompt token under echo) has no logprob."""
    out = CompletionLogProbs()
    for tok, d in zip(token_ids, dicts):
        chosen = d.get(tok) if d else None
        token = token_text(tok)
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(token)
        if chosen is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(_lp(chosen.logprob))
        top = {token_text(t): _lp(lp.logprob)
               for t, lp in sorted(d.items(), key=lambda kv: kv[1].rank) if lp.rank <= num_top or t == tok}
        out.top_logprobs.append(top)
    return out


class CompletionHandler:
    def __init__(self, engine: AsyncLLMEngine, prompts: PromptProcessor, models: ServedModels, defaults: dict,
                 max_logprobs: int = MAX_LOGPROBS):
        self.engine, self.prompts, self.models = engine, prompts, models
        self.defaults = defaults  # the model's sampling defaults (nvllm.engine.generation_defaults)
        self.max_logprobs = max_logprobs  # the most logprobs a request may ask (nvllm.serve.params.logprobs_limit)

    schema = CompletionRequest

    async def start(self, req: CompletionRequest) -> tuple[str, OutputStream, list[list[int]]]:
        """Validate everything, then queue one engine request per prompt (all or none)."""
        request_id, requests, prompt_ids = await self.prompts.off_loop(self.prepare, req)
        return request_id, await submit(self.engine, requests, constraint_param(req)), prompt_ids

    def prepare(self, req: CompletionRequest, beam: bool = False) -> tuple[str, list[EngineRequest], list[list[int]]]:
        """Validate everything: the response id, the engine requests (id, prompt ids, params, LoRA adapter), the
        prompts. ``beam``: for ``beam`` (a worker of a disaggregated deployment refuses use_beam_search)."""
        if req.use_beam_search and not beam:
            raise bad_request("use_beam_search is not supported by disaggregated workers", "use_beam_search")
        if req.suffix:
            raise bad_request("suffix is not supported by this server", "suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of must equal n (no server-side ranking of samples)", "best_of")
        self.prompts.check_ids(req.stop_token_ids or [], "stop_token_ids")
        check_logprobs(req.logprobs, "logprobs", self.max_logprobs)
        if req.max_tokens == 0 and (not req.echo or req.use_beam_search or req.min_tokens):
            raise bad_request("max_tokens must be at least 1 (0 only with echo: the prompt back, with its logprobs "
                              "if asked, and nothing generated)", "max_tokens")
        asked = requested_prompt_logprobs(req, self.max_logprobs, self.prompts.vocab_size)
        prompt_ids = self.prompts.completion_prompts(req.prompt, req.truncate_prompt_tokens, req.add_special_tokens)
        max_len = self.prompts.max_model_len
        echoed = req.logprobs if req.echo and req.logprobs is not None else None
        prompt_logprobs = max((k for k in (echoed, asked) if k is not None), default=None)
        default_max = self.defaults.get("max_tokens")
        requested = 1 if _prompt_only(req) else req.max_tokens  # the one token generated is dropped (_without_tokens)
        if "max_tokens" not in req.model_fields_set and default_max is not None and not _prompt_only(req):
            requested = min(requested, default_max)  # left unset: the field's 16, within the model's max_new_tokens
        params = [sampling_params(req, resolve_max_tokens(requested, len(ids), max_len, "max_tokens", default_max),
                                  req.logprobs, prompt_logprobs, self.defaults)
                  for ids in prompt_ids]
        request_id, engine_id, lora = response_id("cmpl", req), random_id("cmpl"), self.models.lora(req.model)
        requests = [EngineRequest(f"{engine_id}-{i}", ids, p, lora, req.cache_salt, req.priority)
                    for i, (ids, p) in enumerate(zip(prompt_ids, params))]
        return request_id, requests, prompt_ids

    @staticmethod
    def _prompt_index(out: RequestOutput) -> int:
        return int(out.request_id.rsplit("-", 1)[1])

    def _echo(self, req: CompletionRequest, index: int, prompt_ids: list[int], out: RequestOutput | None
              ) -> tuple[str, CompletionLogProbs | None]:
        """The prompt's text (as sent, when it was text) and, with logprobs, its prompt logprobs."""
        if isinstance(req.prompt, str):
            text = req.prompt
        elif isinstance(req.prompt[index], str):
            text = req.prompt[index]
        else:
            text = self.prompts.tokenizer.decode(prompt_ids, skip_special_tokens=True)
        lps = None
        if req.logprobs is not None and out is not None and out.prompt_logprobs is not None:
            lps = completion_logprobs(prompt_ids, out.prompt_logprobs, req.logprobs, 0,
                                      self.prompts.logprob_token(req.return_tokens_as_token_ids))
        return text, lps

    async def beam(self, req: CompletionRequest) -> CompletionResponse:
        """use_beam_search: the best n beams of each prompt (nvllm.serve.beam)."""
        check_beam_request(req)
        request_id, requests, prompt_ids = await self.prompts.off_loop(self.prepare, req, beam=True)
        decode = functools.partial(self.prompts.tokenizer.decode, skip_special_tokens=req.skip_special_tokens)
        outs = await search_all(self.engine, prompt_ids, [beam_params(req, r.params) for r in requests],
                                requests[0].lora, decode, req.cache_salt, req.priority)
        choices = [CompletionChoice(index=i * req.n + j, text=(self._echo(req, i, ids, None)[0] if req.echo else "")
                                    + s.text, finish_reason=s.finish_reason)
                   for i, (ids, o) in enumerate(zip(prompt_ids, outs)) for j, s in enumerate(o.sequences)]
        return CompletionResponse(id=request_id, model=self.models.response_name(req.model), choices=choices,
                                  usage=beam_usage(prompt_ids, outs))

    async def full(self, req: CompletionRequest, request_id: str, stream: OutputStream,
                   prompt_ids: list[list[int]]) -> CompletionResponse:
        final: list[RequestOutput | None] = [None] * len(prompt_ids)
        try:
            async for out in stream:
                final[self._prompt_index(out)] = _without_tokens(out) if _prompt_only(req) else out
        finally:
            stream.close()
        # off the event loop: many samples with logprobs make a response of megabytes, built for seconds
        return await on_response_thread(self._response, req, request_id, final, prompt_ids)

    def _response(self, req: CompletionRequest, request_id: str, final: list[RequestOutput],
                  prompt_ids: list[list[int]]) -> CompletionResponse:
        choices = []
        for i, out in enumerate(final):
            echo_text, echo_lps = self._echo(req, i, prompt_ids[i], out) if req.echo else ("", None)
            for c in out.outputs:
                lps = None
                if req.logprobs is not None:
                    lps = completion_logprobs(c.token_ids, c.logprobs or [], req.logprobs,
                                              _end(echo_lps, echo_text),
                                              self.prompts.logprob_token(req.return_tokens_as_token_ids))
                    if echo_lps is not None:
                        lps = _join(echo_lps, lps)
                plp = None
                if req.prompt_logprobs is not None and out.prompt_logprobs is not None:
                    plp = prompt_logprobs_json(prompt_ids[i], out.prompt_logprobs, req.prompt_logprobs,
                                               self.prompts.token_text)
                ids = dict(prompt_token_ids=prompt_ids[i], token_ids=list(c.token_ids)) if req.return_token_ids \
                    else {}
                choices.append(CompletionChoice(index=i * req.n + c.index, text=echo_text + c.text, logprobs=lps,
                                                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                                prompt_logprobs=plp, **ids))
        return CompletionResponse(id=request_id, model=self.models.response_name(req.model), choices=choices,
                                  usage=usage(final, [len(p) for p in prompt_ids]))

    async def chunks(self, req: CompletionRequest, request_id: str, stream: OutputStream,
                     prompt_ids: list[list[int]]) -> AsyncIterator[str]:
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts.continuous_usage_stats)
        want_lps = req.logprobs is not None
        progress = [[ChoiceProgress() for _ in range(req.n)] for _ in prompt_ids]
        offsets = [[0] * req.n for _ in prompt_ids]
        sent_ids = [[False] * req.n for _ in prompt_ids]  # return_token_ids: the prompt's ids sent to a choice
        echoed = [not req.echo] * len(prompt_ids)
        latest: list[RequestOutput | None] = [None] * len(prompt_ids)
        prompt_lens = [len(p) for p in prompt_ids]

        def echo(i: int, out: RequestOutput | None) -> list[str]:
            """The prompt as its own chunk per choice, with its logprobs when asked; later offsets follow on."""
            echoed[i] = True
            text, lps = self._echo(req, i, prompt_ids[i], out)
            offsets[i] = [_end(lps, text)] * req.n
            return [sse(self._chunk(request_id, req, [CompletionChoice(index=i * req.n + j, text=text, logprobs=lps)]))
                    for j in range(req.n)]

        try:
            if req.echo and not want_lps:  # the prompt goes out first
                for i in range(len(prompt_ids)):
                    for chunk in echo(i, None):
                        yield chunk
            async for out in stream:
                p = self._prompt_index(out)
                out = _without_tokens(out) if _prompt_only(req) else out
                if not echoed[p] and (out.finished or len(out.prompt_logprobs or []) >= len(prompt_ids[p])):
                    for chunk in echo(p, out):  # once all its logprobs are known (a long prompt: several steps)
                        yield chunk
                latest[p] = out
                for c in out.outputs:
                    d = progress[p][c.index].advance(c, want_lps)
                    if d is None:
                        continue
                    lps = None
                    if want_lps:
                        lps = completion_logprobs(d.token_ids, d.logprobs or [], req.logprobs, offsets[p][c.index],
                                                  self.prompts.logprob_token(req.return_tokens_as_token_ids))
                        offsets[p][c.index] += sum(len(t) for t in lps.tokens)
                    ids = {}
                    if req.return_token_ids:  # the prompt's ids in the choice's first chunk, then the new ones
                        ids = dict(token_ids=list(d.token_ids), prompt_token_ids=None if sent_ids[p][c.index]
                                   else prompt_ids[p])
                        sent_ids[p][c.index] = True
                    choice = CompletionChoice(index=p * req.n + c.index, text=d.text, logprobs=lps,
                                              finish_reason=d.finish_reason, stop_reason=d.stop_reason, **ids)
                    chunk = self._chunk(request_id, req, [choice])
                    if continuous:
                        chunk.usage = choice_usage(prompt_lens[p], len(c.token_ids))
                    yield sse(chunk)
            if include_usage:
                yield sse(self._chunk(request_id, req, [], usage(latest, prompt_lens)))
        finally:
            stream.close()

    def _chunk(self, request_id: str, req, choices: list[CompletionChoice], usage_info=None
               ) -> CompletionResponse:
        return CompletionResponse(id=request_id, model=self.models.response_name(req.model), choices=choices,
                                  usage=usage_info)


def _prompt_only(req: CompletionRequest) -> bool:
    """echo with max_tokens 0 (vLLM's): the prompt is scored, nothing is generated."""
    return req.echo and req.max_tokens == 0


def _without_tokens(out: RequestOutput) -> RequestOutput:
    """An output of a prompt-only request: the engine's one generated token taken away, "length" once finished."""
    outputs = [dataclasses.replace(c, text="", token_ids=[], cumulative_logprob=None,
                                   logprobs=None if c.logprobs is None else [], stop_reason=None,
                                   finish_reason="length" if c.finished() else None) for c in out.outputs]
    return dataclasses.replace(out, outputs=outputs)


def _end(lps: CompletionLogProbs | None, text: str) -> int:
    """Where the text offsets after an echoed prompt start: past its last token (the offsets run on through the
    prompt's tokens and the completion's, as vLLM counts them), or past its text when it has no logprobs."""
    if lps is None:
        return len(text)
    return lps.text_offset[-1] + len(lps.tokens[-1]) if lps.tokens else 0


def _join(a: CompletionLogProbs, b: CompletionLogProbs) -> CompletionLogProbs:
    return CompletionLogProbs(text_offset=a.text_offset + b.text_offset,
                              token_logprobs=a.token_logprobs + b.token_logprobs, tokens=a.tokens + b.tokens,
                              top_logprobs=a.top_logprobs + b.top_logprobs)
