"""Paged decode attention inside a CUDA graph, as the decode graphs run it (context length unknown on the host,
the split grid sized from the block-table capacity): µs per call for the split policy and for forced partition
lengths, at Qwen2.5-7B's heads (28 query / 4 KV heads, head_dim 128), bf16, 16-token blocks.

    python3 scripts/gpu_attention_bench.py [--capacity 4096] [--out DIR]

Prints one row per (batch, context) and writes decode_attention.json under --out (or $OUT)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nvllm.kernels.decode_attention import decode_attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 28, 4, 128, 16


def time_in_graph(fn, iters: int = 200) -> float:
    """µs per call of fn replayed in a CUDA graph of 20 calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(20):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters // 20):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--capacity", type=int, default=4096, help="block-table capacity in tokens (max_model_len)")
    ap.add_argument("--batches", default="1,4,16,64,256")
    ap.add_argument("--contexts", default="384,1024,4000")
    ap.add_argument("--partitions", default="policy,32,64,128,256")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    dev = torch.device("cuda")
    width = args.capacity // BLOCK
    rows = []
    parts = [None if p == "policy" else int(p) for p in args.partitions.split(",")]
    print(f"{'batch':>5} {'ctx':>5} " + " ".join(f"{('policy' if p is None else f'p{p}'):>8}" for p in parts))
    for b in map(int, args.batches.split(",")):
        num_blocks = b * width + 1
        k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev)
        v_cache = torch.randn_like(k_cache)
        tables = torch.randperm(num_blocks - 1, device=dev)[: b * width].view(b, width).to(torch.int32) + 1
        q = torch.randn(b, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev)
        out = torch.empty_like(q)
        for ctx in map(int, args.contexts.split(",")):
            lens = torch.full((b,), min(ctx, args.capacity), dtype=torch.int32, device=dev)
            ref = decode_attention(q, k_cache, v_cache, tables, lens, HEAD_DIM ** -0.5, max_context_len=ctx)
            times = []
            for p in parts:
                def fn(p=p):
                    decode_attention(q, k_cache, v_cache, tables, lens, HEAD_DIM ** -0.5, out, partition_size=p)
                fn()
                torch.cuda.synchronize()
                err = (out.float() - ref.float()).abs().max().item()
                assert err < 2e-2, (b, ctx, p, err)
                times.append(time_in_graph(fn))
            rows.append({"batch": b, "context": ctx, "us": dict(zip(map(str, parts), times))})
            print(f"{b:5d} {ctx:5d} " + " ".join(f"{t:8.2f}" for t in times), flush=True)
        del k_cache, v_cache
        torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "decode_attention.json").write_text(json.dumps(
        {"card": torch.cuda.get_device_name(), "capacity": args.capacity, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
