"""POST /v1/chat/completions: messages through the chat template into one engine request with n samples,
answered whole or streamed (a role chunk per choice, then one content chunk per choice per engine step)."""

from __future__ import annotations

import functools

from collections.abc import AsyncIterator

from nvllm.chat_template import texts_of
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
from nvllm.serve.tool_parsers import ToolParser
from nvllm.serve.tools import plan_tools
from nvllm.serve.chat_reply import ChatReply
from nvllm.reasoning_parsers import ReasoningParser
from nvllm.serve.protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                  ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs, ChatLogprobToken,
                                  DeltaMessage, TopLogprob, random_id, response_id)


def chat_logprobs(token_ids: list[int], dicts: list, num_top: int, token_text) -> ChatLogprobs:
    content = []
    for tok, d in zip(token_ids, dicts):
        chosen = d[tok]
        token = token_text(tok)
        top = [TopLogprob(token=token_text(t), logprob=max(lp.logprob, -9999.0), bytes=list(token_text(t).encode()))
               for t, lp in sorted(d.items(), key=lambda kv: kv[1].rank) if lp.rank <= num_top]
        content.append(ChatLogprobToken(token=token, logprob=max(chosen.logprob, -9999.0),
                                        bytes=list(token.encode()), top_logprobs=top[:num_top]))
    return ChatLogprobs(content=content)


class ChatHandler:
    def __init__(self, engine: AsyncLLMEngine, prompts: PromptProcessor, models: ServedModels, defaults: dict,
                 tool_parser: ToolParser | None = None, reasoning_parser: ReasoningParser | None = None,
                 max_logprobs: int = MAX_LOGPROBS):
        self.engine, self.prompts, self.models = engine, prompts, models
        self.defaults = defaults  # the model's sampling defaults (nvllm.engine.generation_defaults)
        self.max_logprobs = max_logprobs  # the most logprobs a request may ask (nvllm.serve.params.logprobs_limit)
        self.tool_parser = tool_parser  # --enable-auto-tool-choice's parser
        self.reasoning_parser = reasoning_parser  # --reasoning-parser's

    def _reply(self, req: ChatCompletionRequest, prompt_ids: list[int]) -> ChatReply:
        """How the reply splits: a prompt that closed the reasoning block itself (``enable_thinking: false``) has a
        reply of content only, which is also where the engine applied the request's constraint from the start."""
        parser = self.reasoning_parser
        if parser is not None and not parser.constraint_waits(self.prompts.tokenizer, prompt_ids):
            parser = None
        return ChatReply(req, plan_tools(req, self.tool_parser), parser)

    @staticmethod
    def _echoed(req: ChatCompletionRequest) -> str:
        """vLLM's echo: the last message's text when the reply continues it (an assistant message, or any message
        without add_generation_prompt)."""
        last = req.messages[-1]
        if not req.echo or (req.add_generation_prompt and last.role != "assistant"):
            return ""
        return "\n".join(texts_of(last.model_dump(), len(req.messages) - 1))

    def _num_top(self, req: ChatCompletionRequest) -> int | None:
        """The engine's logprobs count: None unless logprobs is true; then top_logprobs (default 0)."""
        if req.top_logprobs and not req.logprobs:  # 0 asks for nothing (vLLM takes it)
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        req.top_logprobs = check_logprobs(req.top_logprobs, "top_logprobs", self.max_logprobs, self.prompts.vocab_size)
        return (req.top_logprobs or 0) if req.logprobs else None

    schema = ChatCompletionRequest

    async def start(self, req: ChatCompletionRequest) -> tuple[str, OutputStream, list[int]]:
        request_id, requests, ids = await self.prompts.off_loop(self.prepare, req)
        return request_id, await submit(self.engine, requests, constraint_param(req)), ids

    def prepare(self, req: ChatCompletionRequest, beam: bool = False) -> tuple[str, list[EngineRequest], list[int]]:
        """Validate everything: the response id, the one engine request (id, prompt ids, params, LoRA adapter), the
        prompt. ``beam``: for ``beam`` (a worker of a disaggregated deployment refuses use_beam_search)."""
        if req.use_beam_search and not beam:
            raise bad_request("use_beam_search is not supported by disaggregated workers", "use_beam_search")
        if req.chat_template is not None:
            raise bad_request("a chat_template in the request is not accepted: this server renders every chat with "
                              "its own template (--chat-template), as vLLM does unless told to trust requests' ones",
                              "chat_template")
        plan = plan_tools(req, self.tool_parser)
        self.prompts.check_ids(req.stop_token_ids or [], "stop_token_ids")
        num_top = self._num_top(req)
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        ids = self.prompts.chat_prompt(req.messages, req.add_generation_prompt, req.continue_final_message,
                                       req.chat_template_kwargs, req.add_special_tokens, tools,
                                       req.truncate_prompt_tokens)
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = resolve_max_tokens(requested, len(ids), self.prompts.max_model_len, param,
                                        self.defaults.get("max_tokens"))
        prompt_logprobs = requested_prompt_logprobs(req, self.max_logprobs, self.prompts.vocab_size)
        params = sampling_params(req, max_tokens, num_top, prompt_logprobs, defaults=self.defaults)
        params.structured_outputs = plan.constraint() or params.structured_outputs
        if plan.mode == "auto" and plan.parser.keep_special_tokens:
            params.skip_special_tokens = False
        engine_request = EngineRequest(random_id("chatcmpl"), ids, params, self.models.lora(req.model), req.cache_salt,
                                       req.priority)
        return response_id("chatcmpl", req), [engine_request], ids

    async def beam(self, req: ChatCompletionRequest) -> ChatCompletionResponse:
        """use_beam_search: the best n beams (nvllm.serve.beam), each a choice."""
        check_beam_request(req)
        request_id, requests, ids = await self.prompts.off_loop(self.prepare, req, beam=True)
        params, lora = requests[0].params, requests[0].lora
        decode = functools.partial(self.prompts.tokenizer.decode, skip_special_tokens=req.skip_special_tokens)
        (out,) = await search_all(self.engine, [ids], [beam_params(req, params)], lora, decode, req.cache_salt,
                                  req.priority)
        reply = self._reply(req, ids)
        choices = []
        for j, s in enumerate(out.sequences):
            message, finish = reply.message(s.text, s.finish_reason)
            choices.append(ChatChoice(index=j, message=message, finish_reason=finish))
        return ChatCompletionResponse(id=request_id, model=self.models.response_name(req.model), choices=choices,
                                      usage=beam_usage([ids], [out]))

    async def full(self, req: ChatCompletionRequest, request_id: str, stream: OutputStream,
                   prompt_ids: list[int]) -> ChatCompletionResponse:
        final: RequestOutput | None = None
        try:
            async for out in stream:
                final = out
        finally:
            stream.close()
        # off the event loop: n samples with top logprobs make a response of tens of megabytes, built for seconds
        return await on_response_thread(self._response, req, request_id, final, prompt_ids)

    def _response(self, req: ChatCompletionRequest, request_id: str, final: RequestOutput,
                  prompt_ids: list[int]) -> ChatCompletionResponse:
        num_top = self._num_top(req)
        reply = self._reply(req, prompt_ids)
        choices = []
        echoed = self._echoed(req)
        for c in final.outputs:
            message, finish = reply.message(c.text, c.finish_reason)
            if echoed:
                message.content = echoed + (message.content or "")
            choices.append(ChatChoice(index=c.index, message=message, finish_reason=finish, stop_reason=c.stop_reason,
                                      logprobs=None if num_top is None else chat_logprobs(
                                          c.token_ids, c.logprobs or [], num_top,
                                          self.prompts.logprob_token(req.return_tokens_as_token_ids)),
                                      token_ids=list(c.token_ids) if req.return_token_ids else None))
        plp = None
        if req.prompt_logprobs is not None and final.prompt_logprobs is not None:
            plp = prompt_logprobs_json(prompt_ids, final.prompt_logprobs, req.prompt_logprobs, self.prompts.token_text)
        return ChatCompletionResponse(id=request_id, model=self.models.response_name(req.model), choices=choices,
                                      usage=usage([final], [len(prompt_ids)]), prompt_logprobs=plp,
                                      prompt_token_ids=prompt_ids if req.return_token_ids else None)

    async def chunks(self, req: ChatCompletionRequest, request_id: str, stream: OutputStream,
                     prompt_ids: list[int]) -> AsyncIterator[str]:
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage)
        continuous = include_usage and bool(opts.continuous_usage_stats)
        num_top = self._num_top(req)
        reply = self._reply(req, prompt_ids)
        progress = [ChoiceProgress() for _ in range(req.n)]
        replies = [reply.stream() for _ in range(req.n)]
        new_ids: list[list[int]] = [[] for _ in range(req.n)]  # return_token_ids: not yet sent to each choice
        latest: RequestOutput | None = None
        try:
            for i in range(req.n):  # OpenAI opens every choice with the role (and vLLM's echo, the echoed text)
                opening = self._chunk(request_id, req, [ChatChunkChoice(
                    index=i, delta=DeltaMessage(role="assistant", content=self._echoed(req)))])
                if req.return_token_ids and i == 0:  # the prompt's ids in the first chunk, as vLLM sends them
                    opening.prompt_token_ids = prompt_ids
                if continuous:
                    opening.usage = choice_usage(len(prompt_ids), 0)
                yield sse(opening)
            async for out in stream:
                latest = out
                for c in out.outputs:
                    d = progress[c.index].advance(c, num_top is not None)
                    if d is None:
                        continue
                    lps = None if num_top is None else chat_logprobs(
                        d.token_ids, d.logprobs or [], num_top,
                        self.prompts.logprob_token(req.return_tokens_as_token_ids))
                    rs = replies[c.index]
                    delta = rs.delta(c.text, d.finish_reason is not None)
                    finish = reply.plan.finish_reason(d.finish_reason, rs.called)
                    new_ids[c.index] += d.token_ids if req.return_token_ids else []
                    if delta is None and finish is None and lps is None:
                        continue  # held back: a tag's first characters, a tool call being written
                    delta = delta or DeltaMessage()
                    if delta.tool_calls and finish is not None:  # the calls first, then the finish on its own (as
                        # OpenAI sends it): the client's stream helper ends its current call when it sees the finish,
                        # so calls in the finishing chunk never got their arguments.done event
                        yield sse(self._chunk(request_id, req, [ChatChunkChoice(index=c.index, delta=delta,
                                                                                logprobs=lps)],
                                              choice_usage(len(prompt_ids), len(c.token_ids)) if continuous else None))
                        delta, lps = DeltaMessage(), None
                    choice = ChatChunkChoice(index=c.index, delta=delta, logprobs=lps, finish_reason=finish,
                                             stop_reason=d.stop_reason)
                    if req.return_token_ids:  # the ids since the choice's last chunk (held-back text's too)
                        choice.token_ids, new_ids[c.index] = new_ids[c.index], []
                    chunk = self._chunk(request_id, req, [choice])
                    if continuous:
                        chunk.usage = choice_usage(len(prompt_ids), len(c.token_ids))
                    yield sse(chunk)
            if include_usage:
                yield sse(self._chunk(request_id, req, [], usage([latest], [len(prompt_ids)])))
        finally:
            stream.close()

    def _chunk(self, request_id: str, req, choices: list[ChatChunkChoice], usage_info=None
               ) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=request_id, model=self.models.response_name(req.model), choices=choices,
                                   usage=usage_info)
