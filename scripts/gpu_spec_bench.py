"""Speculative-decoding speed on one GPU (issue 8), in one call: Qwen2.5-7B-shaped target (random bf16 weights),
k=4, against plain decoding in the same run.

    python scripts/gpu_spec_bench.py [--tokenizer-dir .carry/qwen2.5] [--acceptance 0.5,0.7,0.8,0.9]

Drafts (``--drafts``): a Qwen2.5-0.5B-shaped model (scripts/models/qwen2.5-0.5b), its widths with 4 layers (an
EAGLE-sized draft: a forward reads 1/39 of what the target's does), and an INT4 (GPTQ g128) copy of the target's
shapes. Random weights accept nothing, so the runs use the BENCHMARK MODE ``synthetic_acceptance``: each
drafted token is accepted with a fixed probability, whatever the models say — the drafts and the target still
run in full, so the speed at a given acceptance is real; the outputs are not the target's. τ is the mean
number of tokens one target step emits (accepted drafts + 1).

Per draft and acceptance: batch-1 TPOT (128 in / 256 out) and its speedup over plain decoding, greedy and (beside
it) at temperature 1 (``--temperatures``); at 0.8 also batch 32 (request throughput against plain decoding, since
speculation can lose at large batch).
``--profile``: torch.profiler over 24 batch-1 speculative steps of the first draft at the first acceptance (after
the measurements) —
wall time per step against the GPU's kernel time, and the host time of each phase (draft, target, verify).
Prints a table; writes $OUT/spec_bench.json (and $OUT/spec_profile.txt, $OUT/spec_trace.json.gz).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import torch  # noqa: E402

from gpu_bench import QUANT_CONFIGS, build_model_dir  # noqa: E402
from gpu_profile import device_us, profiled_steps  # noqa: E402


def model_copy(src: Path, config_from: Path | None = None, quant: dict | None = None,
               layers: int | None = None) -> Path:
    d = Path(tempfile.mkdtemp(prefix="spec-"))
    for f in src.iterdir():
        shutil.copy(f, d / f.name)
    cfg = json.loads(((config_from or src) / "config.json").read_text())
    if quant:
        cfg["quantization_config"] = quant
    if layers:
        cfg["num_hidden_layers"] = cfg["max_window_layers"] = layers
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def measure(llm, config, batch: int, temperature: float = 0.0) -> dict:
    from nvllm.bench.offline import run_latency

    r = run_latency(config, batch_size=batch, input_len=128, output_len=256, num_iters_warmup=1,
                    num_iters=5 if batch == 1 else 2, progress=False, llm=llm, temperature=temperature)
    out = {"tpot_ms": r["median_tpot_ms"], "latency_s": r["avg_latency"],
           "output_tok_s": batch * 256 / r["avg_latency"]}
    if "spec_decode_acceptance_length" in r:
        out["tau"] = r["spec_decode_acceptance_length"]
        out["acceptance_pct"] = r["spec_decode_acceptance_rate"]
    return out


PHASES = (("draft", "spec", "propose"), ("target", "runner", "execute"), ("verify", "spec", "verify"))


def profile_spec(llm, res: dict, steps: int = 24) -> None:
    """torch.profiler over ``steps`` batch-1 speculative steps: where a step's wall time goes. Each phase is
    wrapped in a record_function label for the profile only (the engine is not changed)."""
    import gzip

    from torch.autograd import DeviceType
    from torch.profiler import record_function

    from nvllm.bench.offline import random_token_prompts
    from nvllm.sampling_params import SamplingParams

    out = Path(os.environ.get("OUT", "."))
    eng = llm.engine
    owners = {"spec": eng.spec, "runner": eng.runner}
    saved = []
    for label, owner, attr in PHASES:
        obj = owners[owner]
        fn = getattr(obj, attr)
        saved.append((obj, attr, fn))

        def wrapped(*a, _fn=fn, _label=label, **kw):
            with record_function("phase:" + _label):
                return _fn(*a, **kw)
        setattr(obj, attr, wrapped)
    try:
        prompt = random_token_prompts(llm.get_tokenizer(), 1, 128, seed=7)[0]
        eng.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=4 * steps + 64, ignore_eos=True))
        for _ in range(4):
            eng.step(partial=False)  # the prefill and the first steps, outside the profile
        prof, wall = profiled_steps(eng, steps)
    finally:
        for obj, attr, fn in saved:
            setattr(obj, attr, fn)
    events = prof.key_averages()
    gpu_us = device_us(prof, "phase:") / steps
    # from the host-side spans: the averaged rows also hold the labels' device spans, and read 0 on the GPU (run V)
    phases = {label: sum(e.time_range.elapsed_us() for e in prof.events()
                         if e.name == "phase:" + label and e.device_type == DeviceType.CPU) / steps / 1000
              for label, _, _ in PHASES}
    graphs = {e.key: (e.count // steps, e.cpu_time_total / steps / 1000) for e in events if "graph" in e.key.lower()}
    table = events.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=70)
    cpu_table = events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=70)
    (out / "spec_profile.txt").write_text(table + "\n\n" + cpu_table)
    trace = out / "spec_trace.json"
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as f, gzip.open(str(trace) + ".gz", "wb") as g:
        g.write(f.read())
    trace.unlink()
    res["profile"] = {"wall_ms_per_step": wall * 1000, "gpu_kernel_ms_per_step": gpu_us / 1000,
                      "phase_host_ms_per_step": phases, "graph_ops": graphs}
    print(f"[profile] wall {wall * 1000:.2f} ms/step, GPU kernels {gpu_us / 1000:.2f} ms/step; host ms/step: "
          + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()), flush=True)
    for k, (c, ms) in graphs.items():
        print(f"   {k[:60]:60s} x{c:<3d} {ms:.2f} ms host", flush=True)


def _replay_times(replay, reps: int) -> dict:
    """Host µs of one launch with the GPU idle (synchronized before each) and queued back to back, and the GPU ms of
    one replay (events around the queued ones)."""
    idle, queued = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        replay()
        idle.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        t = time.perf_counter()
        replay()
        queued.append(time.perf_counter() - t)
    end.record()
    torch.cuda.synchronize()
    med = lambda xs: sorted(xs)[len(xs) // 2] * 1e6  # noqa: E731
    return {"launch_idle_us": med(idle), "launch_queued_us": med(queued), "gpu_ms": start.elapsed_time(end) / reps}


def graph_kernels(graph, reps: int = 10) -> dict:
    """GPU µs per replay of a graph, by kernel name (torch.profiler: the launches it slows do not matter here, only
    the kernels' own durations; with PDL a kernel's duration includes its wait for the one before)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
    by_name: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            by_name[e.name[:40]] = by_name.get(e.name[:40], 0.0) + e.device_time_total / reps
    return dict(sorted(by_name.items(), key=lambda kv: -kv[1]))


def launch_costs(llm, res: dict, reps: int = 30) -> None:
    """What a batch-1 graph costs the host to launch against what it costs the GPU to run, for the target and the
    draft: the engine's graphs (PDL as configured), the same forward captured without PDL, and two forwards in one
    graph. The graphs' inputs point nowhere (slot −1), so the caches are not touched."""
    from nvllm.engine.cuda_graph import DecodeGraphs

    eng = llm.engine
    rows = {}
    for name, r in (("target", eng.runner), ("draft", eng.spec.draft_runner)):
        g = r.graphs
        g.slot_mapping.fill_(-1)
        g.context_lens[:1] = 200
        g.block_tables[:1, :16] = torch.arange(16, dtype=torch.int32, device=r.device)
        rows[f"{name} pdl"] = _replay_times(g.graphs[1].replay, reps)
        tables = [list(range(16))]
        rows[f"{name} pdl, DecodeGraphs.run (staging + copies + replay)"] = _replay_times(
            lambda: g.run([0], [200], [-1], tables, [201]), reps)

        def copy_then_replay(g=g):
            g.meta.copy_(g.host_meta, non_blocking=True)
            g.graphs[1].replay()
        rows[f"{name} pdl, one pinned copy then replay"] = _replay_times(copy_then_replay, reps)
        args = (g.input_ids[:1], g.positions[:1], r.kv_caches, g._meta(1))
        two = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(two, pool=g.pool):
            r.model(*args)
            r.model(*args)
        rows[f"{name} pdl, two forwards in one graph"] = _replay_times(two.replay, reps)
        old = os.environ.get("NVLLM_PDL")
        os.environ["NVLLM_PDL"] = "0"
        try:
            plain = DecodeGraphs(r.model, r.kv_caches, 1, g.block_tables.shape[1], r.device)
            plain.capture()
        finally:
            if old is None:
                del os.environ["NVLLM_PDL"]
            else:
                os.environ["NVLLM_PDL"] = old
        plain.slot_mapping.fill_(-1)
        plain.context_lens[:1] = 200
        plain.block_tables[:1, :16] = torch.arange(16, dtype=torch.int32, device=r.device)
        rows[f"{name} no pdl"] = _replay_times(plain.graphs[1].replay, reps)
        del plain, two
    res["launch"] = rows
    kernels = {}
    for name, r, sizes in (("target", eng.runner, (1, 8)), ("draft", eng.spec.draft_runner, (1, 2))):
        for bs in sizes:
            k = kernels[f"{name} batch {bs}"] = graph_kernels(r.graphs.graphs[bs])
            print(f"[kernels] {name} graph batch {bs}: {sum(k.values()):.0f} us of kernels; "
                  + ", ".join(f"{n} {us:.0f}" for n, us in list(k.items())[:8]), flush=True)
    res["graph_kernels"] = kernels
    for k, v in rows.items():
        print(f"[launch] {k:62s} host {v['launch_idle_us']:7.1f} us idle, {v['launch_queued_us']:7.1f} us queued; "
              f"GPU {v['gpu_ms']:.3f} ms", flush=True)


def step_timeline(llm, res: dict, name: str, steps: int = 40) -> None:
    """Unprofiled timeline of a batch-1 speculative step: host timestamps (perf_counter) at the entry and exit of
    the step's phases, and a CUDA event at each, whose time is when the GPU got there (its queue drained up to it).
    The mean over ``steps`` steps of each mark's offset from the step's start, on the host and on the GPU: a GPU
    offset that equals the host's means the GPU was waiting for the host there."""
    from nvllm.bench.offline import random_token_prompts
    from nvllm.sampling_params import SamplingParams
    from nvllm.spec.proposer import Drafts

    eng = llm.engine
    marks: list[tuple[str, float, torch.cuda.Event]] = []

    def wrap(obj, attr, label):
        fn = getattr(obj, attr)

        def w(*a, **kw):
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            marks.append((label + " <", time.perf_counter(), ev))
            r = fn(*a, **kw)
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            marks.append((label + " >", time.perf_counter(), ev))
            return r
        setattr(obj, attr, w)
        return obj, attr, fn

    d = eng.spec.draft_runner
    saved = [wrap(eng, "step", "step"), wrap(eng.scheduler, "schedule", "schedule"),
             wrap(eng.spec, "propose", "propose"), wrap(d.graphs, "run", "draft graph"),
             wrap(d.model, "compute_logits", "draft lm_head"), wrap(eng.runner, "execute", "execute"),
             wrap(eng.runner.graphs, "run", "target graph"), wrap(eng.runner.model, "compute_logits", "target lm_head"),
             wrap(Drafts, "read", "drafts.read"), wrap(eng.spec, "verify", "verify")]
    if eng.spec.proposer.chain is not None:
        saved.append(wrap(eng.spec.proposer.chain, "run", "draft chain"))
    try:
        prompt = random_token_prompts(llm.get_tokenizer(), 1, 128, seed=11)[0]
        eng.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=6 * steps + 64, ignore_eos=True))
        for _ in range(4):
            eng.step(partial=False)
        torch.cuda.synchronize()
        marks.clear()
        for _ in range(steps):
            eng.step(partial=False)
        torch.cuda.synchronize()
        while eng.has_unfinished_requests():
            eng.step(partial=False)
    finally:
        for obj, attr, fn in saved:
            setattr(obj, attr, fn)
    per_step, cur = [], []
    for m in marks:
        if m[0] == "step <" and cur:
            per_step.append(cur)
            cur = []
        cur.append(m)
    per_step.append(cur)
    shape = [m[0] for m in per_step[0]]
    same = [s for s in per_step if [m[0] for m in s] == shape]
    rows = []
    for i, label in enumerate(shape):
        host = sum((s[i][1] - s[0][1]) * 1e3 for s in same) / len(same)
        gpu = sum(s[0][2].elapsed_time(s[i][2]) for s in same) / len(same)
        rows.append((label, host, gpu))
    step_ms = sum((s[-1][1] - s[0][1]) * 1e3 for s in same) / len(same)
    res.setdefault("timeline", {})[name] = {"steps": len(same), "of": len(per_step), "rows": rows}
    print(f"[timeline] {name}: {len(same)} of {len(per_step)} steps with the same phases; host ms from step start, GPU ms "
          f"from the GPU reaching the step (step host {step_ms:.2f} ms)", flush=True)
    for label, host, gpu in rows:
        print(f"[timeline] {label:18s} host {host:7.3f}  gpu {gpu:7.3f}", flush=True)


def _graph_ms(graph, reps: int = 30) -> float:
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _capture(runner, bs: int, rows: int, pdl_on: bool = True):
    """The runner's model captured as decode graphs up to ``bs`` rows, the first ``rows`` attending to 200 positions,
    storing nowhere (slot −1)."""
    from nvllm.engine.cuda_graph import DecodeGraphs

    old = os.environ.get("NVLLM_PDL")
    os.environ["NVLLM_PDL"] = "1" if pdl_on else "0"
    try:
        g = DecodeGraphs(runner.model, runner.kv_caches, bs, runner.graphs.block_tables.shape[1], runner.device)
        g.capture()
    finally:
        if old is None:
            del os.environ["NVLLM_PDL"]
        else:
            os.environ["NVLLM_PDL"] = old
    g.slot_mapping.fill_(-1)
    g.context_lens.zero_()
    g.context_lens[:rows] = 200
    g.block_tables[:rows, :16] = torch.arange(16, dtype=torch.int32, device=runner.device)
    return g


def graph_variants(llm, res: dict) -> None:
    """GPU ms of one replay for the verification (5 rows) and the draft's steps under variants of graph size, GEMM
    choice and PDL, plus the kernels of the PDL-free graphs (clean durations)."""
    from nvllm.kernels.gemm import SkinnyConfig, gemm_choice, set_gemm_choice

    eng = llm.engine
    t, d = eng.runner, eng.spec.draft_runner
    bf = torch.bfloat16
    out = {}

    def with_choice(n, k, m, choice, fn):
        old = gemm_choice(n, k, m, bf)
        set_gemm_choice(n, k, m, bf, choice)
        try:
            return fn()
        finally:
            set_gemm_choice(n, k, m, bf, old)

    out["target 1 row, batch-1 graph"] = _graph_ms(_capture(t, 1, 1).graphs[1])
    out["target 5 rows, batch-8 graph"] = _graph_ms(_capture(t, 8, 5).graphs[8])
    out["target 5 rows, batch-5 graph"] = _graph_ms(_capture(t, 5, 5).graphs[5])
    mma = SkinnyConfig("mma", 64, 128, 1, 4, 4)
    out["target 5 rows, batch-5 graph, qkv triton mma"] = with_choice(
        4608, 3584, 8, mma, lambda: _graph_ms(_capture(t, 5, 5).graphs[5]))
    out["target 5 rows, batch-5 graph, qkv mma split 2"] = with_choice(
        4608, 3584, 8, SkinnyConfig("mma", 64, 128, 2, 4, 4), lambda: _graph_ms(_capture(t, 5, 5).graphs[5]))
    out["draft 1 row, batch-1 graph"] = _graph_ms(_capture(d, 1, 1).graphs[1])
    out["draft 2 rows, batch-2 graph"] = _graph_ms(_capture(d, 2, 2).graphs[2])
    fma = SkinnyConfig("fma", 8, 256, 1, 2, 4)
    out["draft 2 rows, batch-2 graph, gate_up fma"] = with_choice(
        9728, 896, 2, fma, lambda: _graph_ms(_capture(d, 2, 2).graphs[2]))
    for k, v in out.items():
        print(f"[variants] {k:48s} {v:.3f} ms", flush=True)
    kernels = {}
    for name, r, bs in (("target", t, 5), ("draft", d, 1)):
        g = _capture(r, bs, bs, pdl_on=False)
        k = kernels[f"{name} batch {bs} no pdl"] = graph_kernels(g.graphs[bs])
        out[f"{name} batch {bs} no pdl"] = _graph_ms(g.graphs[bs])
        print(f"[variants] {name} batch {bs} without PDL: {out[f'{name} batch {bs} no pdl']:.3f} ms, kernels "
              f"{sum(k.values()):.0f} us: " + ", ".join(f"{n} {us:.0f}" for n, us in list(k.items())[:10]), flush=True)
    res["graph_variants"] = {"ms": out, "kernels": kernels}


def chain_check(llm, config, plain_tpot: float) -> dict | None:
    """The draft chain (nvllm.spec.draft_chain) against the step-by-step loop on the same engine: greedy outputs of 4
    prompts at once, then greedy batch-1 TPOT — the benchmark mode's generator reset before each, so both draw the
    same acceptances (same τ) and the same drafts give the same tokens."""
    from nvllm.bench.offline import random_token_prompts
    from nvllm.sampling_params import SamplingParams

    spec = llm.engine.spec
    chain = spec.proposer.chain
    if chain is None:
        return None
    prompts = random_token_prompts(llm.get_tokenizer(), 4, 64, seed=5)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    outs = []
    try:
        for c in (chain, None):
            spec.proposer.chain = c
            spec.sampler._generators.clear()
            llm.engine.block_manager.reset_prefix_cache()  # both runs compute their prompts the same way
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        timed = []
        for c in (chain, None):
            spec.proposer.chain = c
            spec.sampler._generators.clear()
            timed.append(measure(llm, config, 1))
    finally:
        spec.proposer.chain = chain
    return {"same_outputs": outs[0] == outs[1], "tau": [t.get("tau") for t in timed],
            "chain_tpot_ms": timed[0]["tpot_ms"], "loop_tpot_ms": timed[1]["tpot_ms"],
            "chain_speedup_b1": plain_tpot / timed[0]["tpot_ms"], "loop_speedup_b1": plain_tpot / timed[1]["tpot_ms"]}


def host_profile(llm, res: dict, name: str, steps: int = 40) -> None:
    """cProfile over ``steps`` greedy batch-1 speculative steps: where the host's time goes (the GPU does not wait on
    cProfile, the host only runs slower); the top functions by own time to $OUT/spec_cprofile_<draft>.txt."""
    import cProfile
    import io
    import pstats

    from nvllm.bench.offline import random_token_prompts
    from nvllm.sampling_params import SamplingParams

    eng = llm.engine
    prompt = random_token_prompts(llm.get_tokenizer(), 1, 128, seed=13)[0]
    eng.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=6 * steps + 64, ignore_eos=True))
    for _ in range(4):
        eng.step(partial=False)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        eng.step(partial=False)
    prof.disable()
    while eng.has_unfinished_requests():
        eng.step(partial=False)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(45)
    slug = name.split()[0].replace(".", "")
    (Path(os.environ.get("OUT", ".")) / f"spec_cprofile_{slug}.txt").write_text(buf.getvalue())
    res.setdefault("host_profile", {})[name] = f"spec_cprofile_{slug}.txt"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer-dir", default=str(REPO / ".carry/qwen2.5"))
    ap.add_argument("--acceptance", default="0.5,0.7,0.8,0.9")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--temperatures", default="0,1",
                    help="sampling temperatures of the batch-1 rows: the first for every row (and batch 32), the others "
                         "beside it")
    ap.add_argument("--drafts", default="0.5b,int4", help="which drafts: 0.5b (the small model), 0.5b-4l (its first 4 layers: an "
                    "EAGLE-sized draft), int4 (self-draft)")
    ap.add_argument("--profile", action="store_true", help="profile batch-1 steps of the first draft (see above)")
    ap.add_argument("--variants", action="store_true", help="graph variants for the verification and the draft")
    ap.add_argument("--host-profile", action="store_true", help="cProfile of batch-1 greedy steps, every draft")
    ap.add_argument("--timeline", action="store_true", help="unprofiled host/GPU timeline of batch-1 steps (first draft)")
    ap.add_argument("--launch", action="store_true",
                    help="host cost of launching the batch-1 graphs against their GPU time, first draft (see launch_costs)")
    args = ap.parse_args()
    from nvllm.config import EngineConfig
    from nvllm.llm import LLM

    out = Path(os.environ.get("OUT", "."))
    res: dict = {"card": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                 "commit": os.environ.get("NVLLM_COMMIT", "unknown"), "command": " ".join(sys.argv), "runs": []}

    def save():
        (out / "spec_bench.json").write_text(json.dumps(res, indent=1, default=str))

    target = build_model_dir(Path(args.tokenizer_dir))
    chosen = args.drafts.split(",")
    drafts = {}
    if "0.5b" in chosen:
        drafts["0.5B-shaped"] = model_copy(target, REPO / "scripts/models/qwen2.5-0.5b")
    if "0.5b-4l" in chosen:  # EAGLE-sized: a forward reads ~0.39 GB, 1/39 of the target's (EAGLE-3's head ~1/20)
        drafts["0.5B widths, 4 layers"] = model_copy(target, REPO / "scripts/models/qwen2.5-0.5b", layers=4)
    if "int4" in chosen:
        drafts["INT4 GPTQ self-draft"] = model_copy(target, quant=QUANT_CONFIGS["gptq"])
    base = dict(model=str(target), load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=64,
                log_stats_interval=0)
    config = EngineConfig(**base)
    llm = LLM.from_config(config)
    temps = [float(t) for t in args.temperatures.split(",")]
    plain = {1: measure(llm, config, 1, temps[0]), 32: measure(llm, config, 32, temps[0]),
             **{f"1 at T={t:g}": measure(llm, config, 1, t) for t in temps[1:]}}
    res["plain"] = plain
    save()
    print(f"plain: batch 1 TPOT {plain[1]['tpot_ms']:.2f} ms; batch 32 {plain[32]['output_tok_s']:.0f} tok/s"
          + "".join(f"; batch 1 at T={t:g} {plain[f'1 at T={t:g}']['tpot_ms']:.2f} ms" for t in temps[1:]), flush=True)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    accs = [float(a) for a in args.acceptance.split(",")]
    for name, ddir in drafts.items():
        spec = f"k={args.k},draft={ddir},synthetic_acceptance={accs[0]}"
        config = EngineConfig(**base, speculative=spec)
        try:
            llm = LLM.from_config(config)
        except Exception as e:  # keep the other draft's results
            res["runs"].append({"draft": name, "error": repr(e)})
            print(f"{name}: {e!r}", flush=True)
            continue
        for acc in accs:
            llm.engine.spec.sampler.synthetic_acceptance = acc   # the same engine at another fixed acceptance
            row = {"draft": name, "k": args.k, "synthetic_acceptance": acc, "temperature": temps[0],
                   **measure(llm, config, 1, temps[0])}
            row["speedup_b1"] = plain[1]["tpot_ms"] / row["tpot_ms"]
            for t in temps[1:]:
                other = row[f"at T={t:g}"] = measure(llm, config, 1, t)
                other["speedup_b1"] = plain[f"1 at T={t:g}"]["tpot_ms"] / other["tpot_ms"]
            if acc == 0.8:
                b32 = measure(llm, config, 32, temps[0])
                row["b32_output_tok_s"] = b32["output_tok_s"]
                row["speedup_b32"] = b32["output_tok_s"] / plain[32]["output_tok_s"]
            res["runs"].append(row)
            save()
            print(f"{name:22s} acc {acc:.2f}  tau {row.get('tau', 0):.2f}  TPOT {row['tpot_ms']:.2f} ms  "
                  f"x{row['speedup_b1']:.2f}" + (f"  b32 x{row['speedup_b32']:.2f}" if "speedup_b32" in row else "")
                  + "".join(f"  | T={t:g}: tau {row[f'at T={t:g}'].get('tau', 0):.2f} TPOT "
                            f"{row[f'at T={t:g}']['tpot_ms']:.2f} ms x{row[f'at T={t:g}']['speedup_b1']:.2f}"
                            for t in temps[1:]), flush=True)
        llm.engine.spec.sampler.synthetic_acceptance = 0.8 if 0.8 in accs else accs[0]
        check = chain_check(llm, config, plain[1]["tpot_ms"])
        if check is not None:
            res["runs"].append({"draft": name, "chain_check": check,
                                "synthetic_acceptance": llm.engine.spec.sampler.synthetic_acceptance})
            save()
            print(f"{name:22s} chain: same outputs as step by step: {check['same_outputs']}; tau {check['tau']}: "
                  f"chain TPOT {check['chain_tpot_ms']:.2f} ms x{check['chain_speedup_b1']:.2f}, step by step "
                  f"{check['loop_tpot_ms']:.2f} ms x{check['loop_speedup_b1']:.2f}", flush=True)
        if args.variants and name == next(iter(drafts)):
            graph_variants(llm, res)
        if args.host_profile:
            llm.engine.spec.sampler.synthetic_acceptance = 0.8 if 0.8 in accs else accs[0]
            host_profile(llm, res, name)
        if args.timeline:
            llm.engine.spec.sampler.synthetic_acceptance = 0.8 if 0.8 in accs else accs[0]
            step_timeline(llm, res, name)
        if args.launch and name == next(iter(drafts)):
            launch_costs(llm, res)
        if args.profile and name == next(iter(drafts)):  # last: a profiler session slows later launches
            llm.engine.spec.sampler.synthetic_acceptance = accs[0]
            profile_spec(llm, res)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    save()


if __name__ == "__main__":
    main()
