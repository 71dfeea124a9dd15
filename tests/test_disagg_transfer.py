"""KV transfer for disaggregated serving, below HTTP: the staging layout, a real two-process gloo transfer (bit-exact
for float32, bfloat16 and int8 + scale caches), and the engine hooks that hand a prefilled sequence from one
engine to another (its continuation must equal an engine that did everything itself)."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from nvllm.disagg.staging import KVLayout
from nvllm.layers.attention import allocate_kv_caches
from tests.server_utils import free_port

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 3, 12, 4, 2, 8
SRC_BLOCKS, DST_BLOCKS = [7, 2, 9, 4], [0, 11, 5, 3]


def _filled_caches(dtype: torch.dtype, kv_dtype: str, seed: int):
    """Caches whose every byte is random (so a byte out of place shows), the same for the same seed."""
    caches = allocate_kv_caches(LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM, dtype, kv_dtype, "cpu")
    g = torch.Generator().manual_seed(seed)
    for c in caches:
        for t in c:
            if t is not None:
                raw = t.view(torch.uint8)
                raw.copy_(torch.randint(0, 256, raw.shape, generator=g, dtype=torch.uint8))
    return caches


def _same_blocks(src, src_ids, dst, dst_ids) -> bool:
    return all(torch.equal(a.view(torch.uint8)[src_ids], b.view(torch.uint8)[dst_ids])
               for ca, cb in zip(src, dst) for a, b in zip(ca, cb) if a is not None)


CASES = [(torch.float32, "auto"), (torch.bfloat16, "auto"), (torch.float32, "int8")]


def test_staging_round_trip_in_process():
    for dtype, kv_dtype in CASES:
        src, dst = _filled_caches(dtype, kv_dtype, 1), _filled_caches(dtype, kv_dtype, 2)
        before = [t.clone() for c in dst for t in c if t is not None]
        layout = KVLayout(src)
        staging = layout.gather(SRC_BLOCKS)
        assert staging.dtype == torch.uint8 and staging.numel() == layout.nbytes(len(SRC_BLOCKS))
        KVLayout(dst).scatter(DST_BLOCKS, staging)
        assert _same_blocks(src, SRC_BLOCKS, dst, DST_BLOCKS)
        untouched = [i for i in range(BLOCKS) if i not in DST_BLOCKS]  # nothing else was written
        after = [t for c in dst for t in c if t is not None]
        assert all(torch.equal(a.view(torch.uint8)[untouched], b.view(torch.uint8)[untouched])
                   for a, b in zip(before, after))
    int8 = KVLayout(_filled_caches(torch.float32, "int8", 0))
    assert len(int8.parts) == 2 and len(KVLayout(_filled_caches(torch.float32, "auto", 0)).parts) == 1
    assert "int8" in int8.signature and "float32" in int8.signature  # the scales are part of the layout
    assert all(p.dtype == torch.int64 for p in int8.parts)  # moved as 8-byte words
    assert int8.bytes_per_block == LAYERS * 2 * BLOCK_SIZE * HEADS * (HEAD_DIM + 4)
    with pytest.raises(ValueError, match="block ids"):
        int8.gather([BLOCKS])
    with pytest.raises(ValueError, match="staging buffer"):
        int8.scatter([1], torch.zeros(3, dtype=torch.uint8))


def test_message_buffer_is_reused_and_grows():
    from nvllm.disagg.transfer_group import HEADER_BYTES, MessageBuffer

    buf = MessageBuffer(torch.device("cpu"))
    a = buf.get(1000)
    assert a.numel() == HEADER_BYTES + 1000 and a[HEADER_BYTES:].data_ptr() % 8 == 0
    assert buf.get(10).data_ptr() == a.data_ptr()  # no allocation per transfer
    big = buf.get(3 << 20)
    assert big.numel() == HEADER_BYTES + (3 << 20) and buf.get(5).data_ptr() == big.data_ptr()


def test_staging_words_narrow_where_a_block_slice_is_odd():
    """A block slice that is not a multiple of 8 bytes moves as the widest word dividing it, bit-exact."""
    from nvllm.layers.attention import KVCache

    for width, word in ((6, torch.int16), (12, torch.int32), (3, torch.uint8)):
        src = [KVCache(torch.randint(0, 256, (BLOCKS, width), dtype=torch.uint8),
                       torch.randint(0, 256, (BLOCKS, width), dtype=torch.uint8))]
        dst = [KVCache(torch.zeros(BLOCKS, width, dtype=torch.uint8), torch.zeros(BLOCKS, width, dtype=torch.uint8))]
        layout = KVLayout(src)
        assert {p.dtype for p in layout.parts} == {word} and layout.bytes_per_block == 2 * width
        KVLayout(dst).scatter(DST_BLOCKS, layout.gather(SRC_BLOCKS))
        assert all(torch.equal(dst[0][i][DST_BLOCKS], src[0][i][SRC_BLOCKS]) for i in (0, 1))


def test_one_copy_layout_and_per_tensor_layout_agree():
    """allocate_kv_caches' caches (one allocation: one indexed copy for K and V of every layer, one for the
    scales) and caches allocated tensor by tensor (a copy per tensor) stage the same bytes in the same order."""
    from nvllm.layers.attention import KVCache

    for dtype, kv_dtype in CASES:
        stacked = _filled_caches(dtype, kv_dtype, 3)
        separate = [KVCache(*(t.clone() if t is not None else None for t in c)) for c in stacked]
        one, per = KVLayout(stacked), KVLayout(separate)
        assert len(per.parts) == len(separate) * (4 if kv_dtype == "int8" else 2) > len(one.parts)
        assert one.signature == per.signature and one.bytes_per_block == per.bytes_per_block
        assert torch.equal(one.gather(SRC_BLOCKS), per.gather(SRC_BLOCKS))
        target = _filled_caches(dtype, kv_dtype, 4)
        KVLayout(target).scatter(DST_BLOCKS, per.gather(SRC_BLOCKS))
        assert _same_blocks(separate, SRC_BLOCKS, target, DST_BLOCKS)


def _transfer_proc(rank: int, port: int, results) -> None:
    """rank 0 sends every case's blocks (and one failed transfer); rank 1 receives and checks them."""
    from nvllm.disagg.transfer_group import HEADER_BYTES, MessageBuffer, TransferError, TransferGroup

    try:
        layouts = {}
        for dtype, kv_dtype in CASES:
            caches = _filled_caches(dtype, kv_dtype, 1) if rank == 0 else _filled_caches(dtype, kv_dtype, 2)
            layouts[(dtype, kv_dtype)] = (caches, KVLayout(caches))
        sig = ",".join(layout.signature for _, layout in layouts.values())
        group = TransferGroup(rank, 2, ("127.0.0.1", port), "gloo", torch.device("cpu"),
                              {"role": "prefill" if rank == 0 else "decode", "layout": sig, "url": "", "weights": "w"},
                              30.0, 60.0, store_external=True)
        buffer = MessageBuffer(torch.device("cpu"))  # one reused buffer for every transfer, as a transfer thread
        for tag, (caches, layout) in enumerate(layouts.values(), start=1):
            message = buffer.get(layout.nbytes(len(SRC_BLOCKS)))
            if rank == 0:
                layout.gather(SRC_BLOCKS, out=message[HEADER_BYTES:])
                group.send(1, tag, message)
            else:
                layout.scatter(DST_BLOCKS, group.recv(0, tag, message))
                expected = _filled_caches(*list(layouts)[tag - 1], 1)
                results.put(("exact", tag, _same_blocks(expected, SRC_BLOCKS, caches, DST_BLOCKS)))
        if rank == 0:
            group.send(1, 99, buffer.get(16), ok=False)  # the sender could not gather: the receiver is told
        else:
            try:
                group.recv(0, 99, buffer.get(16))
                results.put(("failed transfer", 99, False))
            except TransferError as e:
                results.put(("failed transfer", 99, "could not send" in str(e)))
    except Exception as e:  # noqa: BLE001 - reported to the test
        results.put(("error", rank, repr(e)))


def test_two_process_gloo_transfer_is_bit_exact():
    """Two worker processes in one group; the store is this process's (as `--disaggregate` serves it), bound before
    they start, and both only connect (a rank 0 that listened on its port would fail)."""
    import datetime

    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    procs = [ctx.Process(target=_transfer_proc, args=(r, store.port, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0, f"rank exited with {p.exitcode}"
    got = [results.get(timeout=5) for _ in range(len(CASES) + 1)]
    assert all(r[0] != "error" for r in got), got
    assert all(r[2] is True for r in got), got


@pytest.mark.parametrize("differs", ["layout", "weights"])
def test_layout_or_weights_mismatch_is_refused(differs):
    """Workers whose pools differ, or that serve other weights of the same shapes, stop at the rendezvous with one
    clear error (here: both in one process, rank 1 on a thread; the store's keys are all a rank needs to see the
    mismatch). Rank 0 serves the store here, as in a deployment started by hand (`--kv-rank 0 --kv-master
    HOST:PORT`): the one test of that path."""
    import threading

    from nvllm.config import ConfigError
    from nvllm.disagg.transfer_group import TransferGroup

    port, errors = free_port(), []

    def join(rank: int) -> None:
        info = {"role": ("prefill", "decode")[rank], "layout": "float32[2]", "url": "", "weights": "ab"}
        info[differs] += str(rank)
        try:
            TransferGroup(rank, 2, ("127.0.0.1", port), "gloo", torch.device("cpu"), info, 10.0, 30.0)
        except ConfigError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    want = "layout differs" if differs == "layout" else "serves other weights than this worker"
    assert len(errors) == 2 and all(want in e for e in errors), errors


def test_the_weights_fingerprint_tells_checkpoints_apart(tmp_path):
    """Copies of a checkpoint agree, re-sharded too; another checkpoint of the same shapes differs (here one tensor's
    first value changed; a fine-tune changes all of a tensor's values); so do online quantization and dummy weights
    of another seed."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from nvllm.disagg.weights_fingerprint import weights_fingerprint
    from tests.conftest import build_tiny_model

    a = build_tiny_model("llama", tmp_path / "a")
    shutil.copytree(a, tmp_path / "copy")
    b = tmp_path / "b"
    shutil.copytree(a, b)
    sd = load_file(b / "model.safetensors")
    name = "model.layers.1.self_attn.v_proj.weight"
    sd[name] = sd[name].clone()
    sd[name][0, 0] += 1.0
    save_file(sd, b / "model.safetensors")
    # re-saved in two shards with an index: the same weights, another layout
    sd = load_file(a / "model.safetensors")
    resharded = tmp_path / "resharded"
    shutil.copytree(a, resharded)
    (resharded / "model.safetensors").unlink()
    names = sorted(sd)
    save_file({k: sd[k] for k in names[::2]}, resharded / "model-00001-of-00002.safetensors")
    save_file({k: sd[k] for k in names[1::2]}, resharded / "model-00002-of-00002.safetensors")
    (resharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        k: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, k in enumerate(names)}}))
    fp = {p.name: weights_fingerprint(str(p), "auto", 0, {}) for p in (a, tmp_path / "copy", b, resharded)}
    assert fp["a"] == fp["copy"] == fp["resharded"] != fp["b"]
    assert weights_fingerprint(str(a), "auto", 0, {"quantization": "fp8"}) != fp["a"]   # quantized while loading
    assert weights_fingerprint(str(a), "dummy", 0, {}) == weights_fingerprint(str(b), "dummy", 0, {}) != \
        weights_fingerprint(str(a), "dummy", 1, {})


def test_a_rank_that_joined_before_is_refused_at_once():
    """A worker restarted after its death would wait at a rendezvous the others finished long ago: it is refused
    with one clear error instead."""
    import datetime
    import threading

    import torch.distributed as dist

    from nvllm.config import ConfigError
    from nvllm.disagg.transfer_group import TransferGroup

    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    groups, errors = {}, []

    def join(rank: int) -> None:
        try:
            groups[rank] = TransferGroup(rank, 2, ("127.0.0.1", store.port), "gloo", torch.device("cpu"),
                                         {"role": ("prefill", "decode")[rank], "layout": "x", "url": "",
                                          "weights": "w"}, 10.0, 30.0, store_external=True)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(groups) == [0, 1] and not errors, errors
    start = time.monotonic()
    with pytest.raises(ConfigError, match="rank 1 joined it before"):
        TransferGroup(1, 2, ("127.0.0.1", store.port), "gloo", torch.device("cpu"),
                      {"role": "decode", "layout": "x", "url": "", "weights": "w"}, 10.0, 30.0, store_external=True)
    assert time.monotonic() - start < 5


# ---- the engine hooks, two engines in one process ---------------------------------------------------------------
def _engine(**kw):
    from nvllm.config import EngineConfig
    from nvllm.engine.llm_engine import LLMEngine

    kw.setdefault("max_model_len", 256)
    return LLMEngine(EngineConfig(device="cpu", log_stats_interval=0, **kw), warmup=False)


def _run(engine) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_prefilled_request_continues_exactly(kv_dtype):
    from nvllm.disagg.handoff import decode_state, encode_state
    from nvllm.engine.kv_handoff import kv_handle_id
    from nvllm.engine.sequence import PrefilledSample
    from nvllm.sampling_params import SamplingParams

    prefill, decode, mixed = (_engine(kv_cache_dtype=kv_dtype) for _ in range(3))
    prompt = prefill.tokenize("Once upon a time there was a little girl who liked to play in the park")
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(n=2, max_tokens=24, temperature=0.9, seed=7, ignore_eos=True)]
    for i, p in enumerate(params):
        mixed.add_request(f"r{i}", prompt, p)
        prefill.add_request(f"r{i}", prompt, p, prefill_only=True)
    want, got = _run(mixed), _run(prefill)
    for i, p in enumerate(params):
        out = got[f"r{i}"]
        assert [len(c.token_ids) for c in out.outputs] == [1] * p.n
        assert all(c.finish_reason is None for c in out.outputs)  # held, not finished
        samples = []
        for c in out.outputs:
            held = prefill.handoff.held[kv_handle_id(f"r{i}", c.index)]
            samples.append(PrefilledSample(c.token_ids[0], c.logprobs[0] if c.logprobs else None,
                                           decode_state(encode_state(held.generator_state)), out.num_cached_tokens))
        for t in decode.add_prefilled_request(f"r{i}", prompt, p, out.metrics.arrival_time, samples):
            handle = kv_handle_id(f"r{i}", t.seq.index)
            src = prefill.export_kv(handle)[t.skip_blocks:]
            with pytest.raises(KeyError):  # one transfer per handle
                prefill.export_kv(handle)
            assert not prefill.handoff.release(handle, exported=False)  # the transfer owns it now
            KVLayout(decode.runner.kv_caches).scatter(t.block_ids, KVLayout(prefill.runner.kv_caches).gather(src))
            assert prefill.release_kv(handle) and not prefill.release_kv(handle)
            decode.handoff.arrived(t.seq, True)
    assert prefill.block_manager.num_free_blocks == prefill.block_manager.num_blocks  # all released
    done = _run(decode)
    for rid, w in want.items():
        assert [c.token_ids for c in done[rid].outputs] == [c.token_ids for c in w.outputs]
        assert [c.text for c in done[rid].outputs] == [c.text for c in w.outputs]
    assert done["r0"].outputs[0].cumulative_logprob == pytest.approx(want["r0"].outputs[0].cumulative_logprob)
    assert decode.block_manager.num_free_blocks == decode.block_manager.num_blocks


def test_decode_side_recomputes_and_aborts_cleanly():
    from nvllm.engine.sequence import PrefilledSample
    from nvllm.sampling_params import SamplingParams

    decode, mixed = _engine(), _engine()
    prompt = decode.tokenize("The little dog ran to the park")
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    mixed.add_request("m", prompt, p)
    want = _run(mixed)["m"].outputs[0]
    # the KV never comes: the prompt is recomputed here and the answer is the same
    (t,) = decode.add_prefilled_request("a", prompt, p, 0.0, [PrefilledSample(want.token_ids[0])])
    assert t.block_ids and t.skip_blocks == 0
    decode.handoff.arrived(t.seq, False)
    assert _run(decode)["a"].outputs[0].token_ids == want.token_ids
    # the prompt's full blocks are in the prefix cache now: only its last, partial block is fetched
    (t,) = decode.add_prefilled_request("c", prompt, p, 0.0, [PrefilledSample(want.token_ids[0])])
    assert t.skip_blocks == len(prompt) // 16 and len(t.block_ids) == 1
    decode.abort_request("c")
    decode.handoff.arrived(t.seq, False)
    # aborted while its KV is on the way: its blocks stay until the transfer ends, then are freed
    (t,) = decode.add_prefilled_request("b", prompt, p, 0.0, [PrefilledSample(want.token_ids[0])])
    assert decode.abort_request("b").outputs[0].finish_reason == "abort"
    assert decode.block_manager.num_free_blocks < decode.block_manager.num_blocks
    decode.handoff.arrived(t.seq, True)
    assert decode.block_manager.num_free_blocks == decode.block_manager.num_blocks
    # prompt tokens by source: "a" was recomputed here; the aborted ones are not counted
    by = decode.stats.prompt_tokens_by_source
    assert decode.stats.prompt_tokens == len(prompt) and by == {
        "local_compute": len(prompt), "local_cache_hit": 0, "external_kv_transfer": 0}
    # received: only the partial block the prefix cache does not hold is fetched (marked arrived here, unfilled)
    (t,) = decode.add_prefilled_request("e", prompt, p, 0.0, [PrefilledSample(want.token_ids[0])])
    decode.handoff.arrived(t.seq, True)
    _run(decode)
    hit = t.skip_blocks * 16
    assert decode.stats.prompt_tokens == 2 * len(prompt) and by == {
        "local_compute": len(prompt), "local_cache_hit": hit, "external_kv_transfer": len(prompt) - hit}
    with pytest.raises(ValueError, match="outside the vocabulary"):
        decode.add_prefilled_request("d", prompt, p, 0.0, [PrefilledSample(10**6)])
    assert "d" not in decode.requests
    seeded = SamplingParams(max_tokens=4, temperature=0.8, seed=1)
    with pytest.raises(ValueError, match="generator state"):  # a foreign handoff: nothing stays registered
        decode.add_prefilled_request("d", prompt, seeded, 0.0, [PrefilledSample(5, generator_state=torch.zeros(
            7, dtype=torch.uint8))])
    assert "d" not in decode.requests and not decode.has_unfinished_requests()
    assert decode.block_manager.num_free_blocks == decode.block_manager.num_blocks


@pytest.mark.parametrize("max_tokens", [8, 14])
def test_received_prompts_never_pin_a_full_pool(max_tokens):
    """A decode pool with no room for a prompt when it was registered queues it to be recomputed; prompts whose KV
    arrives later wait behind it holding their blocks. Nothing may stall on them: with nothing running they go
    first (8 tokens: admission had stopped at the head forever), and a running sequence needing a block takes one
    of theirs before it preempts itself (40 tokens: it preempted itself again and again). Every answer equals the
    one a mixed engine gives."""
    from nvllm.engine.kv_handoff import kv_handle_id
    from nvllm.engine.sequence import PrefilledSample
    from nvllm.sampling_params import SamplingParams

    prefill, mixed = _engine(num_kv_blocks=32, block_size=16), _engine(num_kv_blocks=32, block_size=16)
    decode = _engine(num_kv_blocks=5, block_size=16, max_model_len=64)   # 80 tokens
    p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = {"x": list(range(10, 60)), "y": list(range(100, 117)), "z": list(range(200, 210))}
    for rid, ids in prompts.items():
        prefill.add_request(rid, ids, p, prefill_only=True)
        mixed.add_request(rid, ids, p)
    firsts, want = _run(prefill), _run(mixed)
    targets = []
    for rid, ids in prompts.items():
        held = prefill.handoff.held[kv_handle_id(rid, 0)]
        (t,) = decode.add_prefilled_request(rid, ids, p, 0.0, [PrefilledSample(
            firsts[rid].outputs[0].token_ids[0], generator_state=held.generator_state)])
        targets.append((rid, t))
    assert [t.block_ids is None for _, t in targets] == [False, True, False]  # y: no room, recomputed here
    for rid, t in targets:   # the transfers end after y was queued
        handle = kv_handle_id(rid, 0)
        if t.block_ids is None:
            prefill.handoff.release(handle, exported=False)
            continue
        src = prefill.export_kv(handle)[t.skip_blocks:]
        KVLayout(decode.runner.kv_caches).scatter(t.block_ids, KVLayout(prefill.runner.kv_caches).gather(src))
        prefill.release_kv(handle)
        decode.handoff.arrived(t.seq, True)
    done = {}
    for _ in range(2000):
        done.update({o.request_id: o for o in decode.step() if o.finished})
        if not decode.has_unfinished_requests():
            break
    assert not decode.has_unfinished_requests(), "the decode engine stalled"
    assert {rid: o.outputs[0].token_ids for rid, o in done.items()} == \
        {rid: o.outputs[0].token_ids for rid, o in want.items()}
    assert decode.block_manager.num_free_blocks == decode.block_manager.num_blocks


def test_transfer_thread_runs_its_periodic_work_under_a_steady_stream_of_jobs():
    """The prefill side expires unfetched KV handles from ``periodic``: a queue that is never empty for a whole
    interval must not hold it off."""
    from nvllm.disagg.metrics import TransferLogger, TransferStats
    from nvllm.disagg.transfer_thread import TransferThread

    class Ticking(TransferThread):
        interval = 0.05

        def __init__(self):
            self.ticks, self.jobs = 0, 0
            layout = KVLayout(_filled_caches(torch.float32, "auto", 0))
            super().__init__(layout, TransferLogger(TransferStats(), "prefill", 0), "test-ticking")

        def handle(self, job, stream) -> None:
            self.jobs += 1

        def periodic(self) -> None:
            self.ticks += 1

    t = Ticking()
    end = time.monotonic() + 0.6
    while time.monotonic() < end:  # a job every 10 ms: the queue is never idle for an interval
        t.submit(object())
        time.sleep(0.01)
    t.stop()
    t._thread.join(5)
    assert t.jobs > 20 and t.ticks >= 5, (t.jobs, t.ticks)


def test_a_failing_job_never_ends_the_transfer_thread():
    """A job that raises what the transfer code does not expect (an HTTP caller's tag past int64 did): the thread
    logs it and goes on with the next jobs and its periodic expiry of held KV. Such a tag is refused at the door."""
    from pydantic import ValidationError

    from nvllm.disagg.handoff import SendCall
    from nvllm.disagg.metrics import TransferLogger, TransferStats
    from nvllm.disagg.transfer_thread import TransferThread

    class Flaky(TransferThread):
        interval = 0.05

        def __init__(self):
            self.done, self.ticks = [], 0
            layout = KVLayout(_filled_caches(torch.float32, "auto", 0))
            super().__init__(layout, TransferLogger(TransferStats(), "prefill", 0), "test-flaky")

        def handle(self, job, stream) -> None:
            if job == "bad":
                raise ValueError("Overflow when unpacking long long")
            self.done.append(job)

        def periodic(self) -> None:
            self.ticks += 1

    t = Flaky()
    for job in ("a", "bad", "b"):
        t.submit(job)
    time.sleep(0.3)
    t.stop()
    t._thread.join(5)
    assert t.done == ["a", "b"] and t.ticks >= 2
    for tag in (-1, 2**31, 2**70):
        with pytest.raises(ValidationError):
            SendCall(handle="h", dst_rank=1, tag=tag)
