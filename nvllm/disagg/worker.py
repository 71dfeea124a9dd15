"""A prefill or decode worker: an ordinary OpenAI server plus the internal routes the router and the other
workers call (control data only; the KV travels over the transfer group).

Prefill worker
  POST /internal/prefill     run the prompts of an OpenAI request (validated exactly as /v1 would: a 4xx
                             comes back as is), each sample to its first token, and answer the handoff: prompt
                             ids, first tokens (+ logprobs, RNG state) and a KV handle per unfinished sample.
  POST /internal/kv/send     a decode worker asks for a handle's blocks: they are queued for the send thread.
  POST /internal/kv/release  handles that will never be fetched (the router gave up on the request).
Decode worker
  POST /internal/decode      the OpenAI request plus the prefill worker's handoff: the first tokens go out at
                             once, the KV is fetched in the background, and the answer (JSON or SSE) is the one
                             /v1 gives — usage, finish reasons, stop strings, logprobs included.
Both
  GET  /internal/info        role, rank, queue lengths, KV usage and transfer counters (the router polls it).
"""

from __future__ import annotations

import asyncio
import os

import torch.distributed as dist
from fastapi import APIRouter, Request
from fastapi.responses import Response

from nvllm.config import ConfigError
from nvllm.disagg.config import DisaggConfig
from nvllm.disagg.handoff import (DecodeCall, PrefillCall, PrefillResult, ReleaseCall, RequestHandoff, SampleHandoff,
                                  SendAccepted, SendCall, encode_state, entries_to_logprobs, logprobs_to_entries,
                                  to_sample)
from nvllm.disagg.kv_receiver import KVReceiver, ReceiveJob
from nvllm.disagg.kv_sender import KVSender, SendJob
from nvllm.disagg.metrics import TransferCollector, TransferStats
from nvllm.disagg.staging import KVLayout
from nvllm.disagg.transfer_group import TransferGroup
from nvllm.disagg.weights_fingerprint import weights_fingerprint
from nvllm.engine.async_engine import AsyncLLMEngine
from nvllm.engine.kv_handoff import KVHandoffMismatch, kv_handle_id
from nvllm.engine.output_stream import EngineDeadError
from nvllm.outputs import RequestOutput
from nvllm.serve.errors import APIError, bad_request, from_value_error
from nvllm.serve.http import ClientGone, parse_body, parse_model, until_disconnect
from nvllm.serve.params import constraint_param, request_error


# The router's prefill and decode calls: the client's request (held to --max-request-bytes by the router) in an
# envelope, and a decode call the prefill worker's handoff too — prompt ids and logprobs, which a short request can
# make large (prompt_logprobs, n samples of top logprobs): a 366-byte request's decode call took 81 kB.
HANDOFF_BYTES = 256 << 20


def _backend(choice: str, device) -> str:
    if choice == "auto":
        return "nccl" if device.type == "cuda" and dist.is_nccl_available() else "gloo"
    if choice == "nccl" and device.type != "cuda":
        raise ConfigError("--kv-backend nccl needs the KV cache on a GPU")
    return choice


def _mismatch(message: str) -> APIError:
    """The workers disagree (a deployment fault, not the client's): 500."""
    return APIError(500, message, code="handoff_mismatch")


def _json(model) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")  # -inf logprobs as -Infinity


class DisaggWorker:
    def __init__(self, engine: AsyncLLMEngine, cfg: DisaggConfig, server_config, url: str):
        """Join the KV transfer group (blocks until every worker has) and start this role's transfer thread."""
        core = engine.engine
        if core.spec is not None:
            raise ConfigError("speculative decoding is not supported on prefill / decode workers")
        if core.config.tensor_parallel_size > 1:
            raise ConfigError("prefill / decode workers run on one GPU each (tensor_parallel_size 1)")
        self.engine, self.cfg, self.role = engine, cfg, cfg.role
        self.layout = KVLayout(core.runner.kv_caches)
        backend = _backend(cfg.kv_backend, self.layout.device)
        self.group = TransferGroup(cfg.kv_rank, cfg.kv_world_size, cfg.master, backend, self.layout.device,
                                   {"role": cfg.role, "layout": self.layout.signature, "url": url,
                                    "weights": weights_fingerprint(
                                        core.config.model, core.config.load_format, core.config.seed,
                                        {"quantization": core.config.quantization,
                                         "hf_overrides": core.config.hf_overrides})},
                                   cfg.kv_transfer_timeout, store_external=cfg.kv_store_external)
        if not self.group.ranks("prefill") or not self.group.ranks("decode"):
            raise ConfigError("the KV transfer group needs at least one prefill and one decode worker")
        self.stats = TransferStats()
        interval = core.config.log_stats_interval
        self.sender = self.receiver = None
        if self.role == "prefill":
            self.sender = KVSender(engine, self.group, self.layout, self.stats, cfg.kv_handle_timeout, interval)
        else:
            self.receiver = KVReceiver(engine, self.group, self.layout, self.stats, server_config.api_key,
                                       cfg.kv_transfer_timeout, interval)
            engine.output_hooks.append(self.stats.observe)

    def stop(self) -> None:
        for t in (self.sender, self.receiver):
            if t is not None:
                t.stop()

    # ---- routes ------------------------------------------------------------------------------------------
    def routes(self, ctx) -> APIRouter:
        """The internal routes (behind the server's API key, like /v1); ctx: nvllm.serve.api_server.ServingContext."""
        engine, core, limit = self.engine, self.engine.engine, ctx.config.max_request_bytes
        gauges = [("kv_handles_held", "Prefilled sequences whose KV waits for a decode worker.",
                   lambda: len(core.handoff.held))] if self.role == "prefill" else [
            ("kv_transfers_queued", "Requests waiting for their KV transfer to start.", lambda: self.receiver.queued)]
        ctx.metrics.registry.register(TransferCollector(self.stats, self.role, ctx.model_name, gauges))
        r = APIRouter()

        @r.get("/internal/info")
        async def info() -> dict:
            sched, bm = core.scheduler, core.block_manager
            return {"role": self.role, "kv_rank": self.group.rank, "pid": os.getpid(), "model": ctx.model_name,
                    "engine_running": engine.is_running, "running": len(sched.running),
                    "waiting": sched.num_waiting + (self.receiver.queued if self.receiver else 0),
                    "held": len(core.handoff.held), "kv_cache_usage": bm.usage, "num_blocks": bm.num_blocks,
                    "num_free_blocks": bm.num_free_blocks, "transfer": self.stats.snapshot()}

        if self.role == "prefill":
            @r.post("/internal/prefill")
            async def prefill(request: Request) -> Response:
                return await self._prefill(ctx, request, await parse_body(request, PrefillCall, limit + HANDOFF_BYTES))

            @r.post("/internal/kv/send")
            async def kv_send(request: Request) -> Response:
                return await self._send(await parse_body(request, SendCall, limit))

            @r.post("/internal/kv/release")
            async def kv_release(request: Request) -> dict:
                call = await parse_body(request, ReleaseCall, limit)
                return {"released": await self._release(call.handles, exported=False, calls=call.calls)}
        else:
            @r.post("/internal/decode")
            async def decode(request: Request) -> Response:
                return await self._decode(ctx, request, await parse_body(request, DecodeCall, limit + HANDOFF_BYTES))
        return r

    # ---- prefill side ------------------------------------------------------------------------------------
    async def _prefill(self, ctx, request: Request, call: PrefillCall) -> Response:
        handler = ctx.handlers[call.endpoint]
        req = parse_model(call.request, handler.schema)
        ctx.check_model(req.model)
        if not self.engine.is_running:
            raise APIError(503, "the engine is not running", code="engine_unavailable")
        _, requests, _ = await handler.prompts.off_loop(handler.prepare, req)
        if call.call_id is not None:  # named after the router's call: it can release them unread (ReleaseCall.calls)
            requests = [r._replace(request_id=f"{call.call_id}-{k}") for k, r in enumerate(requests)]
        limit = self.cfg.max_prefill_length
        for r in requests:
            if limit is not None and len(r.prompt_ids) > limit:
                raise bad_request(f"the prompt has {len(r.prompt_ids)} tokens; this deployment's prefill workers take "
                                  f"prompts of at most {limit} tokens (--max-prefill-length). Shorten the prompt, or "
                                  "send it to a deployment with a higher limit.",
                                  "messages" if call.endpoint == "chat" else "prompt", code="prompt_too_long")
        handles = [kv_handle_id(r.request_id, i) for r in requests for i in range(r.params.n)]
        stream = self.engine.open_stream()
        try:
            await stream.add_many(requests, prefill_only=True)
            finals = await until_disconnect(request, _collect(stream))
        except ValueError as e:
            stream.close()  # the abort first: a step between a release and the abort could hold a sample again
            await self._release(handles)
            raise request_error(e, constraint_param(req)) from None
        except ClientGone:
            stream.close()
            await self._release(handles)
            return Response(status_code=499)
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_unavailable") from None
        finally:
            stream.close()
        if any(c.finish_reason == "abort" for out in finals.values() for c in out.outputs):
            await self._release(handles)
            raise APIError(503, "the prefill worker is shutting down", code="engine_unavailable")
        return _json(PrefillResult(kv_rank=self.group.rank, requests=[
            self._handoff(finals[r.request_id], r.prompt_ids) for r in requests]))

    def _handoff(self, out: RequestOutput, ids: list[int]) -> RequestHandoff:
        samples = []
        for c in out.outputs:
            handle = kv_handle_id(out.request_id, c.index) if c.finish_reason is None else None
            held = self.engine.engine.handoff.held.get(handle) if handle else None
            samples.append(SampleHandoff(
                index=c.index, first_token=c.token_ids[0],
                logprobs=logprobs_to_entries(c.logprobs[0]) if c.logprobs else None,
                generator_state=encode_state(held.generator_state) if held else None,
                num_cached_tokens=out.num_cached_tokens, first_scheduled_time=out.metrics.first_scheduled_time,
                first_token_time=out.metrics.first_token_time, handle=handle,
                prefix_salt=(held.seq.cache_salt or b"").hex() if held else None))
        plp = None if out.prompt_logprobs is None else [logprobs_to_entries(d) for d in out.prompt_logprobs]
        return RequestHandoff(prompt_ids=ids, arrival_time=out.metrics.arrival_time, prompt_logprobs=plp,
                              samples=samples)

    async def _send(self, call: SendCall) -> Response:
        if call.dst_rank not in self.group.ranks("decode"):
            raise bad_request(f"rank {call.dst_rank} is not a decode worker of the KV transfer group", "dst_rank")
        if call.skip_blocks < 0:
            raise bad_request("skip_blocks must be non-negative", "skip_blocks")
        try:  # straight from the held table (its own lock): no wait for the engine's current step
            blocks = self.engine.engine.export_kv(call.handle)
        except KeyError:
            raise APIError(404, f"KV handle {call.handle!r} is unknown, expired or already sent",
                           "handle", "kv_handle_not_found") from None
        blocks = blocks[call.skip_blocks:]
        if not blocks:
            await self._release([call.handle])
            raise bad_request("skip_blocks leaves no block to send", "skip_blocks")
        self.sender.submit(SendJob(call.handle, blocks, call.dst_rank, call.tag))
        return _json(SendAccepted(num_blocks=len(blocks), nbytes=self.layout.nbytes(len(blocks))))

    async def _release(self, handles: list[str], exported: bool = True, calls: list[str] = ()) -> int:
        """Free the handles (and every handle of the router's ``calls``); exported=False leaves those a transfer
        has taken."""
        def release(e) -> int:
            mine = [h for h in list(e.handoff.held) if h.split("-", 1)[0] in calls] if calls else []
            return sum(e.handoff.release(h, exported) for h in [*handles, *mine])

        try:
            return await asyncio.wrap_future(self.engine.call(release))
        except EngineDeadError:
            return 0

    # ---- decode side -------------------------------------------------------------------------------------
    async def _decode(self, ctx, request: Request, call: DecodeCall) -> Response:
        handler = ctx.handlers[call.endpoint]
        req = parse_model(call.request, handler.schema)
        prefill = call.prefill
        if prefill.url is None or prefill.kv_rank not in self.group.ranks("prefill"):
            raise bad_request(f"rank {prefill.kv_rank} (at {prefill.url}) is not a prefill worker of the KV transfer "
                              "group", "prefill")

        async def start(req):
            request_id, requests, prompt_ids = await handler.prompts.off_loop(handler.prepare, req)
            if len(requests) != len(prefill.requests):
                raise _mismatch(f"the handoff has {len(prefill.requests)} prompts; the request {len(requests)}")
            stream = self.engine.open_stream()
            try:
                for r, h in zip(requests, prefill.requests):
                    rid, ids, params = r.request_id, r.prompt_ids, r.params
                    if h.prompt_ids != ids:
                        raise _mismatch("the prefill worker's prompt tokens differ from this worker's: the workers "
                                        "must serve the same model, tokenizer and chat template")
                    by_index = {s.index: s for s in h.samples}
                    if sorted(by_index) != list(range(params.n)):
                        raise _mismatch(f"the handoff's samples do not match n={params.n}")
                    samples = [to_sample(by_index[i]) for i in range(params.n)]
                    plp = None if h.prompt_logprobs is None else [entries_to_logprobs(e) for e in h.prompt_logprobs]
                    def receive(t, handles={i: s.handle for i, s in by_index.items()}):  # on the engine thread
                        self.receiver.submit(ReceiveJob(t, prefill.url, prefill.kv_rank, handles[t.seq.index]))

                    await stream.add_prefilled(rid, ids, params, h.arrival_time, samples, plp, r.lora, r.cache_salt,
                                               r.priority, receive=receive)
            except KVHandoffMismatch as e:
                stream.close()
                raise _mismatch(str(e)) from None
            except ValueError as e:  # bad ids, a bad RNG state: nothing half-registered stays
                stream.close()
                raise from_value_error(e) from None
            except BaseException:
                stream.close()
                raise
            return request_id, stream, prompt_ids

        return await ctx.answer(handler, req, request, start)


async def _collect(stream) -> dict[str, RequestOutput]:
    finals: dict[str, RequestOutput] = {}
    async for out in stream:
        if out.finished:
            finals[out.request_id] = out
    return finals
