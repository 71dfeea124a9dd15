"""Tensor parallelism on the CPU: real worker processes joined by gloo.

Two ranks give what one rank gives — greedy tokens, seeded samples, logprobs and prompt logprobs — for the demo
model (with chunked prefill, prefix caching and an int8 KV cache), tiny Llama / Qwen2 (one KV head, so it is
replicated) / Qwen3 models, Qwen2-MoE, Qwen3-MoE and Mixtral mixtures of experts, and AWQ, act-order GPTQ and FP8
(block scales) copies; speculative decoding keeps a split target's greedy output. The shards of every weight put
back together are the full weights. A worker killed mid-run ends the engine with an error within seconds (a server
then exits 1), a worker's start-up error reaches rank 0 as itself, a model that does not split is one ConfigError
before any process starts, and `nvllm generate --tensor-parallel-size 2` works.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from nvllm import SamplingParams
from nvllm.config import ConfigError
from nvllm.distributed.group import TPGroup
from nvllm.distributed.worker_pool import WorkerFailure
from nvllm.engine.model_runner import ModelRunner
from nvllm.engine.step_inputs import SHUTDOWN, StepInputs
from nvllm.kernels.quant_gemm import quant_linear
from nvllm.layers.fp8_linear import Fp8Linear
from nvllm.layers.quant_linear import QuantLinear
from nvllm.models.llama import LlamaForCausalLM
from nvllm.models.loader import iterate_weights, load_hf_config, quantization_plan
from nvllm.quant.fp8 import dequantize_rows
from tests.conftest import build_tiny_model, make_llm
from tests.quant_utils import fp8_blocks, write_by_hand, write_fp8
from tests.test_spec_decode import prompts, truncated_copy

TOKEN_PROMPTS = [[1, 45, 300, 12, 99, 7, 250, 31, 400, 18, 77, 5, 301, 130, 64, 9, 200, 11, 17, 310], [1, 5, 6, 7]]
STORY = "Once upon a time, there was a little dog named Max. He liked to play in the park with his red ball"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """Tiny checkpoints whose linears split in two (intermediate 128 = two groups of 32 per rank). The Llama has
    MLP biases, so a row-parallel layer (down_proj) adds its bias after the sum."""
    root = tmp_path_factory.mktemp("tp")
    llama = build_tiny_model("llama", root / "llama", intermediate_size=128, mlp_bias=True)
    qwen2 = build_tiny_model("qwen2", root / "qwen2", intermediate_size=128, num_key_value_heads=1)
    qwen3 = build_tiny_model("qwen3", root / "qwen3", intermediate_size=128)
    qwen2_moe = build_tiny_model("qwen2-moe", root / "qwen2-moe")   # experts of 24 and a shared expert of 48
    qwen3_moe = build_tiny_model("qwen3-moe", root / "qwen3-moe")   # a dense layer 0, then experts of 40
    mixtral = build_tiny_model("mixtral", root / "mixtral")         # w1 / w3 / w2 experts of 96
    write_by_hand(qwen2, root / "awq", "awq", group=32)
    write_by_hand(llama, root / "gptq", "gptq", group=32, sym=False, act_order=True)
    write_fp8(llama, root / "fp8", {"quant_method": "fp8", "weight_block_size": [32, 32]}, fp8_blocks((32, 32)))
    # quantized experts split in two: Qwen3-MoE's of 128 (two groups of 32 a rank; its dense layer 0 too), Mixtral's of
    # 96 (three groups of 16 a rank)
    qwen3_moe_128 = build_tiny_model("qwen3-moe", root / "qwen3-moe-128", moe_intermediate_size=128,
                                     intermediate_size=128)
    write_by_hand(qwen3_moe_128, root / "qwen3-moe-gptq", "gptq", group=32, sym=False)
    write_by_hand(mixtral, root / "mixtral-awq", "awq", group=16)
    return {"llama": str(llama), "qwen2-kv1": str(qwen2), "qwen3": str(qwen3), "awq": str(root / "awq"),
            "gptq-actorder": str(root / "gptq"), "fp8-blocks": str(root / "fp8"), "qwen2-moe": str(qwen2_moe),
            "qwen3-moe": str(qwen3_moe), "mixtral": str(mixtral), "qwen3-moe-gptq": str(root / "qwen3-moe-gptq"),
            "mixtral-awq": str(root / "mixtral-awq")}


def assert_workers_gone(llm) -> None:
    procs = llm.engine.runner.workers.procs
    assert procs and not any(p.is_alive() for p in procs)


# ---- the shards ------------------------------------------------------------------------------------------
def rank_models(path: str, tp: int = 2) -> tuple[LlamaForCausalLM, list[LlamaForCausalLM]]:
    """The whole model and each rank's shard, loaded in this process (no collectives are run)."""
    from nvllm.config import EngineConfig
    from nvllm.models.registry import resolve_architecture

    cfg = EngineConfig(model=path, device="cpu")
    hf = load_hf_config(path)
    arch, _ = resolve_architecture(hf)
    plan = quantization_plan(cfg, hf, arch, log=False)
    out = []
    for group in [TPGroup.single()] + [TPGroup(rank, tp) for rank in range(tp)]:
        m = LlamaForCausalLM(hf, arch, torch.float32, quant_plan=plan, tp=group)
        with torch.no_grad():
            m.load_weights(iterate_weights(path, "auto", False))
        out.append(m)
    return out[0], out[1:]


def weight(linear) -> torch.Tensor:
    if isinstance(linear, Fp8Linear):
        return dequantize_rows(linear.weight, linear.scale, linear.block_k)
    return linear.quant_weight().dequantize() if isinstance(linear, QuantLinear) else linear.weight


@pytest.mark.parametrize("name", ["qwen2-kv1", "awq", "gptq-actorder", "fp8-blocks"])
def test_shards_put_together_are_the_full_weights(models, name, monkeypatch):
    full, ranks = rank_models(models[name])
    s = full.shape
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    for i, layer in enumerate(full.layers):
        pieces = [r.layers[i] for r in ranks]
        qkv = [weight(p.qkv_proj) for p in pieces]
        q_r, kv_r = q // 2, pieces[0].s.num_local_kv_heads * s.head_dim
        torch.testing.assert_close(torch.cat([w[:q_r] for w in qkv]), weight(layer.qkv_proj)[:q])
        k_full, v_full = weight(layer.qkv_proj)[q:q + kv], weight(layer.qkv_proj)[q + kv:]
        if s.num_kv_heads == 1:  # replicated: every rank holds the single KV head
            for w in qkv:
                torch.testing.assert_close(w[q_r:q_r + kv_r], k_full)
                torch.testing.assert_close(w[q_r + kv_r:], v_full)
        else:
            torch.testing.assert_close(torch.cat([w[q_r:q_r + kv_r] for w in qkv]), k_full)
        inter = s.intermediate_size // 2
        gu = [weight(p.gate_up_proj) for p in pieces]
        torch.testing.assert_close(torch.cat([w[:inter] for w in gu] + [w[inter:] for w in gu]),
                                   weight(layer.gate_up_proj))
        for lin in ("o_proj", "down_proj"):
            torch.testing.assert_close(torch.cat([weight(getattr(p, lin)) for p in pieces], dim=1),
                                       weight(getattr(layer, lin)))
        if name == "gptq-actorder":  # act-order: a rank's inputs use any group, so every group stays
            assert pieces[0].down_proj.scales.shape == layer.down_proj.scales.shape
            monkeypatch.setenv("NVLLM_KERNELS", "triton")  # the fused kernel on such a piece (interpreted)
            x = torch.randn(3, s.intermediate_size, generator=torch.Generator().manual_seed(i))
            half = s.intermediate_size // 2
            partial = [quant_linear(x[:, r * half:(r + 1) * half], p.down_proj.quant_weight())
                       for r, p in enumerate(pieces)]
            ref = x @ weight(layer.down_proj).T
            torch.testing.assert_close(partial[0] + partial[1], ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
            monkeypatch.delenv("NVLLM_KERNELS")
        if name == "awq":
            assert pieces[0].down_proj.scales.shape[0] * 2 == layer.down_proj.scales.shape[0]
    vocab = s.vocab_size
    torch.testing.assert_close(torch.cat([r.embed_tokens.weight for r in ranks])[:vocab], full.embed_tokens.weight)


def test_step_message_round_trip():
    step = StepInputs([5, 6, 7], [0, 1, 9], [16, 17, 40], [0, 2, 3], [2, 10], [[1, 0, 0], [2, 3, 4]],
                      logit_rows=[1, 2], verify_rows=[], prompt_rows=[0], max_query_len=2, max_context_len=10)
    assert StepInputs.unpack(step.pack()) == step
    assert StepInputs.unpack(SHUTDOWN) is None


def test_small_all_reduces_go_one_shot_and_the_rest_to_the_compute_group():
    """The one-shot path (symmetric memory, GPU only: checked on the device by scripts/gpu_allreduce_bench.py)
    takes a tensor by its dtype and size alone — what every rank decides alike — and anything else goes to the
    compute group; a gloo group never enables it."""
    from nvllm.distributed.one_shot import MAX_BYTES, OneShotAllReduce
    from nvllm.kernels import report

    class HostOneShot(OneShotAllReduce):  # the real routing and size rule; the sum is faked on the host
        def __init__(self):
            self.buffer = torch.empty(MAX_BYTES // 2, dtype=torch.bfloat16)

        def __call__(self, t):
            calls.append(t.shape)
            return t * 2

    calls = []
    one = HostOneShot()

    class Compute:
        reduced = []

        def allreduce(self, ts):
            self.reduced.append(ts[0].shape)
            ts[0].mul_(3)
            return type("Work", (), {"wait": lambda self: None})()

    group = TPGroup(0, 2, compute=Compute(), backend="nccl")
    group.one_shot = one
    small, wide = torch.ones(4, 3584, dtype=torch.bfloat16), torch.ones(2048, 3584, dtype=torch.bfloat16)
    odd, fp32 = torch.ones(3, 7, dtype=torch.bfloat16), torch.ones(4, 3584)
    with report.recording() as made:
        assert torch.equal(group.all_reduce(small), torch.full_like(small, 2))
        for t in (wide, odd, fp32):
            assert torch.equal(group.all_reduce(t), torch.full_like(t, 3))  # in place, on the compute group
    assert calls == [small.shape] and Compute.reduced == [wide.shape, odd.shape, fp32.shape]
    assert made == {("all_reduce", "symm_mem one-shot"): 1, ("all_reduce", "nccl all_reduce"): 3}
    assert one.takes(torch.empty(MAX_BYTES // 2, dtype=torch.bfloat16))
    assert not one.takes(torch.empty(MAX_BYTES // 2 + 8, dtype=torch.bfloat16))
    gloo = TPGroup(0, 2, backend="gloo")
    gloo.enable_one_shot(torch.bfloat16, torch.device("cpu"))
    assert gloo.one_shot is None


# ---- outputs: two ranks against one ------------------------------------------------------------------------
def request_mix() -> tuple[list, list[SamplingParams]]:
    """Greedy with logprobs, prompt logprobs, and seeded sampling (n = 2), over prompts that share a prefix;
    two long prompts make the first step's message longer than one control broadcast carries."""
    long = [[3 + (7 * i + k) % 500 for i in range(200)] for k in range(2)]
    ps = [TOKEN_PROMPTS[0], TOKEN_PROMPTS[1], TOKEN_PROMPTS[0] + [3, 4, 5], TOKEN_PROMPTS[0][:12]] + long
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(temperature=0.9, top_p=0.9, seed=7, n=2, max_tokens=24, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=1.0, top_k=20, seed=11, max_tokens=24, ignore_eos=True)] + \
        [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 2
    return ps, params


def test_expert_shards_put_together_are_the_full_experts(models):
    """Qwen2-MoE over two ranks: each expert's gate and up rows and down columns split in halves, the shared expert
    likewise, the router whole on each rank."""
    full, ranks = rank_models(models["qwen2-moe"])
    for i, layer in enumerate(full.layers):
        whole, pieces = layer.moe, [r.layers[i].moe for r in ranks]
        inter = whole.experts.w2.shape[2] // 2
        w13 = [p.experts.w13 for p in pieces]
        torch.testing.assert_close(torch.cat([w[:, :inter] for w in w13] + [w[:, inter:] for w in w13], dim=1),
                                   whole.experts.w13)
        torch.testing.assert_close(torch.cat([p.experts.w2 for p in pieces], dim=2), whole.experts.w2)
        s = whole.shared_expert.down_proj.weight.shape[1] // 2
        gu = [p.shared_expert.gate_up_proj.weight for p in pieces]
        torch.testing.assert_close(torch.cat([w[:s] for w in gu] + [w[s:] for w in gu]),
                                   whole.shared_expert.gate_up_proj.weight)
        torch.testing.assert_close(torch.cat([p.shared_expert.down_proj.weight for p in pieces], dim=1),
                                   whole.shared_expert.down_proj.weight)
        for p in pieces:
            assert torch.equal(p.gate.weight, whole.gate.weight)
            assert torch.equal(p.shared_expert_gate.weight, whole.shared_expert_gate.weight)


@pytest.mark.parametrize("name", ["qwen3-moe-gptq", "mixtral-awq"])
def test_quantized_expert_shards_put_together_are_the_full_experts(models, name):
    """Packed experts over two ranks: each rank's dequantized gate/up columns and down rows are the whole model's."""
    full, ranks = rank_models(models[name])
    for i, layer in enumerate(full.layers):
        if layer.moe is None:
            continue
        whole = layer.moe.experts.expert_weights()
        pieces = [r.layers[i].moe.experts.expert_weights() for r in ranks]
        inter = whole[1].in_features // 2
        for e in range(whole[0].num_experts):
            w13 = [p[0].dequantize(e) for p in pieces]
            torch.testing.assert_close(torch.cat([w[:inter] for w in w13] + [w[inter:] for w in w13]),
                                       whole[0].dequantize(e))
            torch.testing.assert_close(torch.cat([p[1].dequantize(e) for p in pieces], dim=1), whole[1].dequantize(e))


def compare(one, two) -> None:
    for a, b in zip(one, two):
        assert a.prompt_logprobs is None or len(a.prompt_logprobs) == len(b.prompt_logprobs)
        for pa, pb in zip(a.prompt_logprobs or [], b.prompt_logprobs or []):
            assert (pa is None) == (pb is None)
            for tok, lp in (pa or {}).items():
                assert abs(lp.logprob - pb[tok].logprob) < 1e-4
        for ca, cb in zip(a.outputs, b.outputs):
            assert ca.token_ids == cb.token_ids
            for la, lb, tok in zip(ca.logprobs or [], cb.logprobs or [], ca.token_ids):
                assert abs(la[tok].logprob - lb[tok].logprob) < 1e-4
                assert list(la) == list(lb)  # the same top tokens, in the same order


CASES = {  # case → (model, ranks, engine options)
    "demo": ("demo", 2, dict(max_num_batched_tokens=16, kv_cache_dtype="int8")),  # chunked prefill, int8 cache
    "llama": ("llama", 2, {}),
    "llama-4-ranks": ("llama", 4, {}),  # 2 KV heads over 4 ranks: ranks 0, 1 hold head 0; ranks 2, 3 head 1
    "qwen2-kv1": ("qwen2-kv1", 2, {}), "qwen3": ("qwen3", 2, {}), "awq": ("awq", 2, {}),
    "gptq-actorder": ("gptq-actorder", 2, {}), "fp8-blocks": ("fp8-blocks", 2, {}),
    "qwen2-moe": ("qwen2-moe", 2, {}), "qwen3-moe": ("qwen3-moe", 2, {}), "mixtral": ("mixtral", 2, {}),
    "qwen3-moe-gptq": ("qwen3-moe-gptq", 2, {}), "mixtral-awq": ("mixtral-awq", 2, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_split_model_matches_one_rank(models, demo_dir, case):
    name, ranks, options = CASES[case]
    path = demo_dir if name == "demo" else models[name]
    ps, params = request_mix()
    if name == "demo":
        tok = AutoTokenizer.from_pretrained(path)
        ps = [tok.encode(STORY), tok.encode(STORY[:40]), tok.encode(STORY) + [3, 4], tok.encode(STORY[:20])] + ps[4:]
    one = make_llm(path, **options).generate(ps, params, use_tqdm=False)
    with make_llm(path, tensor_parallel_size=ranks, **options) as llm:
        two = llm.generate(ps, params, use_tqdm=False)
        if name == "demo":
            assert llm.engine.block_manager.prefix_hits > 0
            assert llm.engine.runner.kv_caches[0].k.shape[2] == 2  # 4 KV heads: two on each rank
    assert_workers_gone(llm)
    compare(one, two)


def test_speculative_decoding_with_a_split_target(demo_dir, tmp_path):
    """A 4-layer draft on rank 0 (whole), the target split in two, with batching, prefix caching and
    preemption: greedy outputs equal plain single-rank decoding."""
    greedy = SamplingParams(temperature=0, max_tokens=24)
    ps = prompts(10)
    want = [o.outputs[0].token_ids for o in make_llm(demo_dir).generate(ps, greedy, use_tqdm=False)]
    draft = truncated_copy(tmp_path / "t4", 4)
    with make_llm(demo_dir, tensor_parallel_size=2, block_size=8, num_kv_blocks=10, max_num_batched_tokens=16,
                  max_num_seqs=6, max_model_len=64, speculative=f"k=3,draft={draft}") as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(ps, greedy, use_tqdm=False)]
        e = llm.engine
        assert e.spec.draft_runner.workers is None and e.spec.draft_runner.tp.size == 1
        assert e.stats.spec.num_drafts > 0 and e.scheduler.num_preemptions > 0
    assert got == want


# ---- failures ----------------------------------------------------------------------------------------------
def test_killed_worker_ends_the_engine_within_seconds(demo_dir):
    llm = make_llm(demo_dir, tensor_parallel_size=2)
    pid = llm.engine.runner.workers.procs[0].pid
    killed_at = []

    def kill():
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    timer = threading.Timer(0.5, kill)
    timer.start()
    with pytest.raises(WorkerFailure, match="rank 1 .* was killed by SIGKILL"):
        llm.generate(["Once upon a time"] * 8, SamplingParams(temperature=0, max_tokens=480, ignore_eos=True),
                     use_tqdm=False)
    assert time.monotonic() - killed_at[0] < 5
    start = time.monotonic()
    with pytest.raises(WorkerFailure):  # the engine stays down, and says so at once
        llm.generate(["Once upon a time"], SamplingParams(max_tokens=4), use_tqdm=False)
    llm.close()
    assert time.monotonic() - start < 5
    assert_workers_gone(llm)


def test_ctrl_c_in_a_step_stops_the_workers_at_once(demo_dir, monkeypatch):
    """Ctrl-C while a split step runs: the KeyboardInterrupt reaches the caller within seconds and the workers are
    gone — no shutdown message waits on workers caught mid-collective (that waited out NVLLM_TP_TIMEOUT)."""
    llm = make_llm(demo_dir, tensor_parallel_size=2)
    timer = threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT))
    start = time.monotonic()
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["Once upon a time"] * 8, SamplingParams(temperature=0, max_tokens=480, ignore_eos=True),
                     use_tqdm=False)
    assert time.monotonic() - start < 20
    llm.close()
    assert_workers_gone(llm)


def test_killed_worker_stops_the_serving_loop(demo_dir):
    """Under the server's loop a dead rank fails the requests in flight and stops the loop (so /health answers
    503), instead of leaving a loop whose every request fails."""
    import asyncio

    from nvllm.engine.async_engine import AsyncLLMEngine
    from nvllm.engine.output_stream import EngineDeadError

    llm = make_llm(demo_dir, tensor_parallel_size=2)
    engine = AsyncLLMEngine(llm.engine)
    os.kill(llm.engine.runner.workers.procs[0].pid, signal.SIGKILL)

    async def run() -> None:
        with pytest.raises(EngineDeadError, match="rank 1 .* was killed by SIGKILL"):
            async for _ in engine.generate("Once upon a time", SamplingParams(max_tokens=8, ignore_eos=True)):
                pass

    asyncio.run(run())
    deadline = time.monotonic() + 10
    while engine.is_running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not engine.is_running and isinstance(engine.error, WorkerFailure)
    llm.close()
    assert_workers_gone(llm)


def test_server_exits_when_a_worker_dies(tmp_path):
    """`nvllm serve --tensor-parallel-size 2` whose worker is killed while it is idle: the server shuts down with
    exit status 1 (a supervisor restarts it) at once — no request has to find the worker gone first, and /health
    never says 200 meanwhile."""
    import httpx

    from tests.server_utils import start_server

    log_path = tmp_path / "server.log"
    proc, base = start_server(["--tensor-parallel-size", "2", "--device", "cpu", "--log-stats-interval", "0",
                               "--uvicorn-log-level", "warning", "--max-model-len", "128"], log_path)
    try:
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            children = [int(c) for c in f.read().split()]
        assert children, "the server started no worker process"
        for pid in children:
            os.kill(pid, signal.SIGKILL)
        time.sleep(1)
        with contextlib.suppress(httpx.HTTPError):  # down already, or going
            assert httpx.get(f"{base}/health", timeout=5).status_code == 503
        assert proc.wait(timeout=30) == 1
        log = log_path.read_text()
        assert "the engine stopped" in log and "was killed by SIGKILL" in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_to_the_whole_group_lets_requests_finish(tmp_path):
    """A service manager's SIGTERM reaches every process of the group (systemd's control-group kill; a terminal's
    Ctrl-C too): the workers stay up, so rank 0's graceful shutdown lets the streams in flight run to their end,
    then the server exits 0 and its workers with it."""
    import httpx

    from tests.server_utils import start_server

    log_path = tmp_path / "server.log"
    proc, base = start_server(["--tensor-parallel-size", "2", "--device", "cpu", "--log-stats-interval", "0",
                               "--uvicorn-log-level", "warning", "--shutdown-timeout", "300"], log_path,
                              new_session=True)  # (a loaded CI machine: the streams' time to run to their end)
    try:
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            children = [int(c) for c in f.read().split()]
        with httpx.stream("POST", f"{base}/v1/completions", timeout=60,
                          json={"model": "stories260K", "prompt": "Once upon a time", "max_tokens": 60, "n": 4,
                                "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            os.killpg(proc.pid, signal.SIGTERM)
            rest = list(lines)
        finishes = [json.loads(line[6:])["choices"][0]["finish_reason"] for line in rest
                    if line.startswith("data: {")]
        assert sorted(f for f in finishes if f) == ["length"] * 4 and rest[-2:] == ["data: [DONE]", ""], rest[-4:]
        assert proc.wait(timeout=60) == 0, log_path.read_text()
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z"
                  for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
                   for pid in children)
        assert "Traceback" not in log_path.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_the_workers_store_listens_on_loopback_only():
    """The TCPStore rank 0 (and the --disaggregate launcher) serves its workers from: on 127.0.0.1 alone — its own
    bind listened on every interface, an unauthenticated control port open to the network."""
    import datetime

    from nvllm.distributed.group import local_store

    store = local_store(1, datetime.timedelta(seconds=5))
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, port = local.split(":")
                if state == "0A" and int(port, 16) == store.port:
                    listening.append(address)
    assert listening == ["0100007F"], listening  # 127.0.0.1, and nothing on tcp6's any-address
    del store


def test_keep_alive_on_engine_death_keeps_the_server_up(monkeypatch):
    """NVLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1: the server notices the dead engine but stays up (answering 503)."""
    import asyncio
    from types import SimpleNamespace

    import uvicorn

    from nvllm.serve.graceful import GracefulServer

    engine = SimpleNamespace(error=WorkerFailure("rank 1 was killed by SIGKILL"))
    for value, exits in (("1", False), ("0", True)):
        monkeypatch.setenv("NVLLM_KEEP_ALIVE_ON_ENGINE_DEATH", value)
        server = GracefulServer(uvicorn.Config(app=None), engine, grace=1)
        asyncio.run(server.on_tick(1))
        assert server.should_exit is exits and server.engine_died is exits


def test_worker_startup_error_reaches_rank0_as_itself(models, tmp_path, monkeypatch):
    """A checkpoint missing a tensor: the worker's ConfigError is what rank 0 raises (its own is the cause).
    Both ranks fail to load; rank 0 loads only once the worker has ended, so that the worker's error is there to
    be found (on a loaded machine rank 0 could otherwise fail more than the grace period before it)."""
    build = ModelRunner._build

    def build_after_the_workers(self):
        if self.workers is not None:  # rank 0
            for p in self.workers.procs:
                p.join(60)
        build(self)

    monkeypatch.setattr(ModelRunner, "_build", build_after_the_workers)
    src = models["llama"]
    for f in os.listdir(src):
        if f != "model.safetensors":
            (tmp_path / f).write_bytes(open(os.path.join(src, f), "rb").read())
    w = load_file(os.path.join(src, "model.safetensors"))
    del w["model.layers.1.mlp.up_proj.weight"]
    save_file(w, tmp_path / "model.safetensors")
    with pytest.raises(ConfigError, match="missing tensors: layers.1.gate_up_proj.weight") as err:
        make_llm(str(tmp_path), tensor_parallel_size=2)
    assert isinstance(err.value.__cause__, ConfigError)
    assert not multiprocessing.active_children()


def test_shapes_that_do_not_split_are_one_config_error(models, tmp_path):
    with pytest.raises(ConfigError, match="num_attention_heads 4 is not divisible by tensor_parallel_size 3"):
        make_llm(models["llama"], tensor_parallel_size=3)
    small = build_tiny_model("qwen2", tmp_path / "q", intermediate_size=96)  # 48 inputs a rank: not 2 groups of 32
    write_by_hand(small, tmp_path / "awq", "awq", group=32)
    with pytest.raises(ConfigError, match="cannot split the awq 4-bit layers.0.down_proj over tensor_parallel_size 2: "
                                          "each rank's 48 inputs are not a whole number of groups of 32"):
        make_llm(str(tmp_path / "awq"), tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="tensor_parallel_size must be a positive integer"):
        make_llm(models["llama"], tensor_parallel_size=0)
    # Mixtral's AWQ experts of 96 in groups of 16 over 4 ranks: 24 inputs a rank
    with pytest.raises(ConfigError, match="cannot split the awq 4-bit layers.0.experts over tensor_parallel_size 4: "
                                          "each rank's 24 inputs are not a whole number of groups of 16"):
        make_llm(models["mixtral-awq"], tensor_parallel_size=4)
    assert not multiprocessing.active_children()  # refused before any process started


def test_act_order_experts_do_not_split(tmp_path):
    """An act-order down projection's inputs may point to any group: refused over two ranks, with its reason — by
    the engine from the config before any rank starts, and by the layer itself."""
    src = build_tiny_model("qwen3-moe", tmp_path / "m", moe_intermediate_size=128, intermediate_size=128)
    write_by_hand(src, tmp_path / "q", "gptq", group=32, act_order=True)
    with pytest.raises(ConfigError, match="act-order \\(desc_act\\) experts cannot be split over tensor-parallel"):
        make_llm(str(tmp_path / "q"), tensor_parallel_size=2)
    assert not multiprocessing.active_children()
    full, ranks = rank_models(str(tmp_path / "q"))
    assert full.layers[1].moe.experts.expert_weights()[1].g_idx is not None
    with pytest.raises(ConfigError, match="act-order \\(desc_act\\) experts cannot be split over tensor-parallel"):
        ranks[0].layers[1].moe.experts.expert_weights()


def test_cli_generate_with_two_ranks():
    r = subprocess.run([sys.executable, "-m", "nvllm.cli", "generate", "--tensor-parallel-size", "2",
                        "--device", "cpu", "--max-tokens", "20", "--log-stats-interval", "0"],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, COLUMNS="200"))
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Once upon a time, there was a little girl named Lily")
    assert "tensor parallel: 2 ranks (gloo)" in r.stderr
