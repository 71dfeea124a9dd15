"""Where a decode step's time goes on the critical path, from a torch.profiler trace of the engine (PDL as shipped).

    python scripts/gpu_step_timeline.py [--quant gptq|awq|bf16] [--steps 8] [--boundary]

A Qwen2.5-7B-shaped engine (random weights, as gpu_bench.py builds it) decodes one 256-token prompt; ``--steps``
decode steps are profiled. Under programmatic dependent launch kernels overlap, so a kernel's duration says little
about what it costs the step: each kernel is charged its *advance* — how far its end moved the latest end of all
kernels before it (its start order). Per kernel name: calls, duration and advance per step. The gaps no kernel
covers (copies, the host) are charged to the kernel after them. Results: a table on stdout, the per-kernel list of
the profiled steps in $OUT/step_timeline_<quant>.txt (start after the first kernel, duration, advance, name).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import torch  # noqa: E402


def trace_events(prof, path: Path) -> list[dict]:
    """The profile's events with a duration, in start order (ts, dur in µs)."""
    prof.export_chrome_trace(str(path))
    events = [e for e in json.loads(path.read_text())["traceEvents"] if "dur" in e]
    path.unlink()
    return sorted(events, key=lambda e: e["ts"])


def boundary_events(events: list[dict]) -> list[str]:
    """Every GPU kernel, copy and memset and every CUDA runtime call of the host, in time order (µs from the LM head
    of the profile's second step), up to ten events past the third LM head: where the time between two decode steps
    goes."""
    events = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset", "cuda_runtime",
                                                     "cuda_driver")]
    heads = [i for i, e in enumerate(events) if e["cat"] == "kernel" and "skinny" in e["name"]]
    if len(heads) < 3:
        return []
    first, last = heads[1], heads[2]
    t0 = events[first]["ts"]
    return [f"{e['ts'] - t0:10.2f} {e['dur']:8.2f}  {'host' if e['cat'].startswith('cuda_') else 'gpu '}"
            f"  {e['name'][:90]}" for e in events[first - 40:last + 10]]


def host_split(eng, steps: int) -> dict[str, float]:
    """µs of host time per ``eng.step(partial=False)`` over ``steps`` steps, unprofiled: the whole step, and inside
    it scheduling, the runner's launch (staging, graph replay, LM head, sampling), the wait for the previous step's
    tokens and the rest of their bookkeeping. A wait near zero means the host, not the GPU, sets the pace."""
    import time

    from nvllm.engine.inflight import PendingTokens

    spent = collections.defaultdict(float)

    def timed(owner, name, key):
        fn = getattr(owner, name)

        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t
        setattr(owner, name, wrapper)
        return fn

    saved = [(eng.scheduler, "schedule", timed(eng.scheduler, "schedule", "schedule")),
             (eng.runner, "execute", timed(eng.runner, "execute", "execute (launch)")),
             (eng, "_read_inflight", timed(eng, "_read_inflight", "read previous tokens")),
             (PendingTokens, "wait", timed(PendingTokens, "wait", "of which waiting on the GPU"))]
    if eng.runner.graphs is not None:
        saved.append((eng.runner.graphs, "run", timed(eng.runner.graphs, "run", "of which graph stage + replay")))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step(partial=False)
    spent["step"] = time.perf_counter() - t0
    for owner, name, fn in saved:
        if owner is PendingTokens:
            setattr(owner, name, fn)
        else:
            delattr(owner, name)   # the instance attribute goes; the class's method shows through again
    return {k: 1e6 * v / steps for k, v in spent.items()}


def advances(events: list[dict]) -> list[tuple[float, float, float, str]]:
    """(start after the first kernel, duration, advance, name) per kernel: advance = how far its end moved the
    latest end so far."""
    t0 = frontier = events[0]["ts"]
    rows = []
    for e in events:
        end = e["ts"] + e["dur"]
        rows.append((e["ts"] - t0, e["dur"], max(0.0, end - frontier), e["name"]))
        frontier = max(frontier, end)
    return rows


def main() -> None:
    import gpu_bench as GB
    from torch.profiler import ProfilerActivity, profile

    from nvllm.bench.offline import random_token_prompts
    from nvllm.config import EngineConfig
    from nvllm.llm import LLM
    from nvllm.sampling_params import SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--quant", default="gptq", help="a gpu_bench.QUANT_CONFIGS method, or bf16")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--tokenizer-dir", default=str(REPO / ".carry/qwen2.5"))
    ap.add_argument("--host-steps", type=int, default=0,
                    help="first time this many unprofiled steps and split their host time (host_split)")
    ap.add_argument("--boundary", action="store_true",
                    help="also profile the host's CUDA calls: $OUT/step_boundary_<quant>.txt, one step boundary")
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "."))
    model_dir = GB.build_model_dir(Path(args.tokenizer_dir))
    qdir = Path(tempfile.mkdtemp())
    for f in model_dir.iterdir():
        shutil.copy(f, qdir / f.name)
    if args.quant != "bf16":
        cfg = json.loads((qdir / "config.json").read_text())
        cfg["quantization_config"] = GB.QUANT_CONFIGS[args.quant]
        (qdir / "config.json").write_text(json.dumps(cfg))
    llm = LLM.from_config(EngineConfig(model=str(qdir), load_format="dummy", dtype="bfloat16", max_model_len=4096,
                                       max_num_seqs=64, log_stats_interval=0))
    eng = llm.engine
    prompt = random_token_prompts(llm.get_tokenizer(), 1, 256, seed=7)[0]
    eng.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=args.steps + args.host_steps + 40,
                                                 ignore_eos=True))
    for _ in range(20):   # the prefill and warm decode steps, outside the profile
        eng.step(partial=False)
    if args.host_steps:
        split = host_split(eng, args.host_steps)
        print(f"host time per step over {args.host_steps} steps (µs): "
              + ", ".join(f"{k} {v:.1f}" for k, v in split.items()), flush=True)
    torch.cuda.synchronize()
    acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.boundary else [])
    with profile(activities=acts) as prof:
        for _ in range(args.steps):
            eng.step(partial=False)
        torch.cuda.synchronize()
    while eng.has_unfinished_requests():
        eng.step(partial=False)
    events = trace_events(prof, out / "trace.json")
    if args.boundary:
        (out / f"step_boundary_{args.quant}.txt").write_text("\n".join(boundary_events(events)))
    rows = advances([e for e in events if e.get("cat") == "kernel"])
    (out / f"step_timeline_{args.quant}.txt").write_text(
        "\n".join(f"{s:10.2f} {d:8.2f} {a:8.2f}  {n[:100]}" for s, d, a, n in rows))
    calls, dur, adv = collections.Counter(), collections.defaultdict(float), collections.defaultdict(float)
    for _, d, a, name in rows:
        key = name[:60]
        calls[key] += 1
        dur[key] += d
        adv[key] += a
    n = args.steps
    span = rows[-1][0] + rows[-1][1]
    print(f"{args.quant}: {n} decode steps, {span / n / 1000:.3f} ms a step under the profiler")
    print(f"| kernel | calls a step | duration µs a step | advance µs a step |")
    print("|---|---|---|---|")
    for key in sorted(adv, key=lambda k: -adv[k]):
        print(f"| {key} | {calls[key] / n:g} | {dur[key] / n:.1f} | {adv[key] / n:.1f} |")


if __name__ == "__main__":
    main()
