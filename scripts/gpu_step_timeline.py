"""Where a decode step's time goes on the critical path, from a torch.profiler trace of the engine (PDL as shipped).

    python scripts/gpu_step_timeline.py [--quant gptq|awq|bf16] [--steps 8]

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


def kernel_events(prof, path: Path) -> list[dict]:
    """The profile's GPU kernels (name, ts, dur in µs), in start order."""
    prof.export_chrome_trace(str(path))
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("cat") == "kernel"]
    path.unlink()
    return sorted(events, key=lambda e: e["ts"])


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
    eng.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=args.steps + 40, ignore_eos=True))
    for _ in range(20):   # the prefill and warm decode steps, outside the profile
        eng.step(partial=False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            eng.step(partial=False)
        torch.cuda.synchronize()
    while eng.has_unfinished_requests():
        eng.step(partial=False)
    rows = advances(kernel_events(prof, out / "trace.json"))
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
