"""torch.profiler over engine steps, for gpu_bench.py --profile: where a prefill's and a batch-1 decode step's time
goes (the kernels' GPU time against the wall time of engine.step()); tables under $OUT."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

def profiled_steps(eng, steps: int):
    """torch.profiler (CPU and CUDA) over the engine's next ``steps`` steps, then the rest of its requests run
    unprofiled. Returns the profile and the wall seconds per profiled step."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step(partial=False)
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    while eng.has_unfinished_requests():
        eng.step(partial=False)
    return prof, wall


def device_us(prof, labels: str | None = None) -> float:
    """µs of device activity in a profile (kernels, memcpy, memset: torch ops also report their kernels' time).
    ``labels``: the prefix of record_function labels, whose spans the profiler also reports on the device."""
    from torch.autograd import DeviceType

    return sum(e.device_time_total for e in prof.events()
               if e.device_type == DeviceType.CUDA and not (labels and e.name.startswith(labels)))


PROFILE_CASES = (("prefill512", 512, 1), ("prefill2048", 2048, 1), ("decode_b1", 128, 32))  # (name, prompt tokens, steps profiled)


def profile_steps(llm, res: dict, cases=PROFILE_CASES, tag: str = "") -> None:
    """torch.profiler over a 512- and a 2048-token prefill and over 32 batch-1 decode steps (or the given ``cases``):
    the kernels' GPU time against the wall time of engine.step(), so the gap between measured and wall is placed.
    ``tag`` prefixes the cases' names (keys, files)."""
    from nvllm.bench.offline import random_token_prompts
    from nvllm.sampling_params import SamplingParams

    out = Path(os.environ.get("OUT", "."))
    eng = llm.engine
    for name, input_len, steps in cases:
        name = tag + name
        eng.block_manager.reset_prefix_cache()
        prompt = random_token_prompts(llm.get_tokenizer(), 1, input_len, seed=7)[0]
        eng.add_request(None, prompt, SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
        if "decode" in name:
            eng.step(partial=False)  # the prefill, outside the profile
            eng.step(partial=False)
        prof, wall = profiled_steps(eng, steps)
        events = prof.key_averages()
        gpu_us = device_us(prof) / steps
        table_txt = events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=70)
        (out / f"profile_{name}.txt").write_text(table_txt)
        res[f"profile_{name}_wall_ms"] = wall * 1000
        res[f"profile_{name}_gpu_kernel_ms"] = gpu_us / 1000
        top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:12]
        res[f"profile_{name}_top"] = [(e.key[:80], round(e.self_device_time_total / steps, 1), e.count // steps)
                                      for e in top]
        print(f"[profile {name}] wall {wall * 1000:.2f} ms/step, GPU kernels {gpu_us / 1000:.2f} ms/step", flush=True)
        for k, us, c in res[f"profile_{name}_top"]:
            print(f"   {us:9.1f} us  x{c:<4d} {k}", flush=True)
