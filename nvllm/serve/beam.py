"""``use_beam_search`` on /v1/completions and /v1/chat/completions (vLLM's extension): ``n`` beams per prompt, the
search of nvllm.beam_search driven on the served engine, each step's beams queued together as one batch. Answered
whole: a stream of partial beams would show text that later loses."""

from __future__ import annotations

import asyncio
import uuid

from nvllm.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from nvllm.engine.output_stream import EngineDeadError
from nvllm.serve.errors import bad_request
from nvllm.serve.params import EngineRequest, constrains_reply, submit
from nvllm.serve.protocol import UsageInfo


def check_beam_request(req) -> None:
    """The 400s for what beam search does not combine with."""
    if req.stop:
        raise bad_request("stop strings are not supported with use_beam_search", "stop")
    if req.stream:
        raise bad_request("streaming is not supported with use_beam_search", "stream")
    if req.logprobs is not None and req.logprobs is not False:  # completions' 0 asks for the chosen tokens' too
        raise bad_request("logprobs are not supported with use_beam_search", "logprobs")
    if req.prompt_logprobs is not None:
        raise bad_request("prompt_logprobs are not supported with use_beam_search", "prompt_logprobs")
    if getattr(req, "tools", None) or constrains_reply(req):
        raise bad_request("use_beam_search does not combine with tools or structured outputs", "use_beam_search")
    for name in ("allowed_token_ids", "bad_words"):  # beams are ranked by the raw logprobs, which no mask changes
        if getattr(req, name):
            raise bad_request(f"{name} is not supported with use_beam_search", name)


def beam_params(req, params) -> BeamSearchParams:
    """The search's settings: n beams, and the request's checked limits (its SamplingParams)."""
    return BeamSearchParams(beam_width=req.n, max_tokens=params.max_tokens, ignore_eos=params.ignore_eos,
                            temperature=params.temperature, length_penalty=req.length_penalty,
                            include_stop_str_in_output=params.include_stop_str_in_output)


def beam_usage(prompts: list[list[int]], outs: list[BeamSearchOutput]) -> UsageInfo:
    completion = sum(len(s.output_token_ids) for o in outs for s in o.sequences)
    prompt = sum(len(p) for p in prompts)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


async def beam_search(engine, prompt_ids: list[int], params: BeamSearchParams, lora, decode,
                      cache_salt: str | None = None, priority: int = 0) -> BeamSearchOutput:
    core = engine.engine
    search = BeamSearch(prompt_ids, params, core.eos_token_ids, core.max_model_len)
    while not search.done:
        step = search.step_params()
        base = f"beam-{uuid.uuid4().hex}"
        requests = [EngineRequest(f"{base}-{i}", beam.tokens, step, lora, cache_salt, priority)
                    for i, beam in enumerate(search.live)]
        try:
            stream = await submit(engine, requests)
        except EngineDeadError:   # the server is shutting down: the beams so far are the answer (if any: a 503)
            if not search.steps:
                raise
            search.abort()
            break
        finals = {}
        try:
            async for out in stream:
                if out.finished:
                    finals[out.request_id] = out
        finally:
            stream.close()
        steps = [finals.get(r.request_id) for r in requests]
        if any(o is None or o.outputs[0].finish_reason == "abort" or not o.outputs[0].logprobs for o in steps):
            search.abort()   # the engine aborted the step (shutdown): no next step is queued
            break
        search.advance([{t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in steps])
    return search.result(decode)


async def search_all(engine, prompts: list[list[int]], params: list[BeamSearchParams], lora, decode,
                     cache_salt: str | None = None, priority: int = 0) -> list[BeamSearchOutput]:
    """Every prompt's search at once (their steps share the engine's batches); one failing cancels the others."""
    tasks = [asyncio.ensure_future(beam_search(engine, ids, p, lora, decode, cache_salt, priority))
             for ids, p in zip(prompts, params)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
