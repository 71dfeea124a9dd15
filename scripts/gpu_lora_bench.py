"""The LoRA slot kernels (``nvllm.kernels.lora``) at a Qwen2.5-7B's four projections, per shrink chunk and expand
block: each setting checked against ``lora_apply_reference``, then timed in a CUDA graph of 20 applications. Four
slots of max rank 64 (per fused projection), ranks 16, 8, 0 and 64; batch 1 runs slot 0, larger batches random
slots including the base model's −1. A table, and $OUT/gpu_lora_bench.json.

    python3 scripts/gpu_lora_bench.py [--batches 1,8,64] [--settings 512x64,256x64,1024x64,512x32,512x128]
"""

from __future__ import annotations

import argparse
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
    ap.add_argument("--settings", default="512x64,256x64,1024x64,512x32,512x128")
    a = ap.parse_args()
    settings = [tuple(int(v) for v in s.split("x")) for s in a.settings.split(",")]
    torch.manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "command": " ".join(sys.argv), "us": {}}
    for T in (int(b) for b in a.batches.split(",")):
        for name, (K, N, parts) in SHAPES.items():
            R = 64 * parts
            a_ = torch.randn(4, R, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
            b_ = torch.randn(4, N, R, device="cuda", dtype=torch.bfloat16) * 1e-2
            ranks = torch.tensor([16 * parts, 8 * parts, 0, 64 * parts], device="cuda", dtype=torch.int32)
            slots = (torch.zeros(T, dtype=torch.long, device="cuda") if T == 1
                     else torch.randint(-1, 4, (T,), device="cuda"))
            x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
            y = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
            want = L.lora_apply_reference(y.clone(), x, a_, b_, ranks, slots).float()
            line = f"T={T:<3d} {name:8s}"
            for k_chunk, block_n in settings:
                L.K_CHUNK, L.BLOCK_N = k_chunk, block_n
                got = L.lora_apply(y.clone(), x, a_, b_, ranks, slots).float()
                err = ((got - want).abs().max() / want.abs().max()).item()
                assert err < 1e-2, (T, name, k_chunk, block_n, err)
                yy = y.clone()
                us = time_us(lambda: L.lora_apply(yy, x, a_, b_, ranks, slots))
                res["us"][f"b{T} {name} {k_chunk}x{block_n}"] = round(us, 3)
                line += f" | {k_chunk}x{block_n} {us:6.2f} µs"
            print(line, flush=True)
    out = Path(os.environ.get("OUT", "."))
    (out / "gpu_lora_bench.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
