"""Diagnostics for gpu_spec_bench.py: where a batch-1 speculative step's time goes.

``step_timeline`` (unprofiled host and GPU offsets of the step's phases), ``host_profile`` (cProfile),
``launch_costs`` (host cost of launching the batch-1 graphs against their GPU time, and their kernels),
``graph_variants`` (the verification and draft graphs under other sizes, GEMM choices and without PDL) and
``profile_spec`` (torch.profiler; it slows graph launches ~40×, so read GPU times from it only). Each takes the
benchmark's LLM (a speculative engine) and its result dict, prints a few lines and records them there.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from gpu_profile import device_us, profiled_steps

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
    eng = llm.engine
    rows = {}
    for name, r in (("target", eng.runner), ("draft", eng.spec.draft_runner)):
        g = _point_nowhere(r.graphs, 1)
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
        plain = _capture(r, 1, 1, pdl_on=False)
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
    return _point_nowhere(g, rows)


def _point_nowhere(g, rows: int):
    """Decode graphs' inputs for timing: the first ``rows`` attend to 200 positions of blocks 0-15 (the others keep
    their lengths: zero in freshly captured graphs) and every row stores nowhere (slot −1), so replays leave the
    caches alone."""
    g.slot_mapping.fill_(-1)
    g.context_lens[:rows] = 200
    g.block_tables[:rows, :16] = torch.arange(16, dtype=torch.int32, device=g.block_tables.device)
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
