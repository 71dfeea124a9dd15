"""The LoRA slot kernels (``nvllm.kernels.lora``) at a Qwen2.5-7B's four projections, per shrink chunk and expand
block: each setting checked against ``lora_apply_reference``, then timed in a CUDA graph of 20 applications. Four
slots of max rank ``--max-rank`` (per projection of a fused one; the engine's default ``max_lora_rank`` is 16),
ranks a quarter, an eighth, 0 and all of it; batch 1 runs slot 0, larger batches random slots including the base
model's −1. ``--ab FILE`` times a second copy of the kernels' module (the last commit's, say) in the same run, same
settings. A table, and $OUT/gpu_lora_bench.json.

    python3 scripts/gpu_lora_bench.py [--batches 1,8,64] [--max-rank 16] [--ab OLD_LORA_PY]
                                      [--settings auto,128x64,256x64,512x64,256x128,512x128]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import nvllm.kernels.lora as L  # noqa: E402

SHAPES = {"qkv": (3584, 4608, 3), "o": (3584, 3584, 1), "gate_up": (3584, 37888, 2), "down": (18944, 3584, 1)}


def time_us(fn, reps: int = 10, per_graph: int = 20) -> float:
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(per_graph):
            fn()
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / (reps * per_graph) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--settings", default="128x64,256x64,512x64,256x128,512x128",
                    help="K_CHUNKxBLOCK_N sizes; auto: the shipped launch_sizes")
    ap.add_argument("--max-rank", type=int, default=16)
    ap.add_argument("--ab", default=None, help="a second copy of nvllm/kernels/lora.py to time beside it")
    a = ap.parse_args()
    settings = [(None, None) if s == "auto" else tuple(int(v) for v in s.split("x")) for s in a.settings.split(",")]
    modules = {"": L}
    if a.ab:
        spec = importlib.util.spec_from_file_location("lora_ab", a.ab)
        modules["ab "] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(modules["ab "])
    torch.manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "command": " ".join(sys.argv), "us": {}}
    for T in (int(b) for b in a.batches.split(",")):
        for name, (K, N, parts) in SHAPES.items():
            R = a.max_rank * parts
            a_ = torch.randn(4, R, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
            b_ = torch.randn(4, N, R, device="cuda", dtype=torch.bfloat16) * 1e-2
            ranks = torch.tensor([max(1, R // 4), max(1, R // 8), 0, R], device="cuda", dtype=torch.int32)
            slots = (torch.zeros(T, dtype=torch.long, device="cuda") if T == 1
                     else torch.randint(-1, 4, (T,), device="cuda"))
            x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
            y = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
            want = L.lora_apply_reference(y.clone(), x, a_, b_, ranks, slots).float()
            for tag, M in modules.items():
                line = f"{tag}T={T:<3d} {name:8s}"
                for k_chunk, block_n in settings:
                    M.K_CHUNK, M.BLOCK_N = k_chunk, block_n
                    got = M.lora_apply(y.clone(), x, a_, b_, ranks, slots).float()
                    err = ((got - want).abs().max() / want.abs().max()).item()
                    assert err < 1e-2, (tag, T, name, k_chunk, block_n, err)
                    yy = y.clone()
                    us = time_us(lambda: M.lora_apply(yy, x, a_, b_, ranks, slots))
                    size = "auto" if k_chunk is None else f"{k_chunk}x{block_n}"
                    res["us"][f"{tag}b{T} {name} {size}"] = round(us, 3)
                    line += f" | {size} {us:6.2f} µs"
                print(line, flush=True)
    out = Path(os.environ.get("OUT", "."))
    (out / "gpu_lora_bench.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
