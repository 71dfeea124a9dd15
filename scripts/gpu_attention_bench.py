"""Paged decode attention inside a CUDA graph, as the decode graphs run it (context length unknown on the host,
the split grid sized from the block-table capacity): µs per call for the split policy and for forced partition
lengths, each with both merges of a split context (``merge``: "kernel", the stage-2 launch; "serial", the last
stage-1 program of a group merges), at Qwen2.5-7B's heads (28 query / 4 KV heads, head_dim 128), bf16,
16-token blocks.

    python3 scripts/gpu_attention_bench.py [--capacity 4096] [--merges kernel,serial] [--out DIR]

Prints one row per (batch, context) — the policy's split count, then one column per (partition, merge) —
and writes decode_attention.json under --out (or $OUT)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nvllm.kernels.decode_attention import (  # noqa: E402
    _decode_block_n, _num_sms, decode_attention, decode_split_policy)

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
    ap.add_argument("--merges", default="kernel,serial", help="merges of a split context to time, each a column")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    merges = args.merges.split(",")
    assert set(merges) <= {"kernel", "serial"}, merges
    dev = torch.device("cuda")
    width = args.capacity // BLOCK
    rows = []
    parts = [None if p == "policy" else int(p) for p in args.partitions.split(",")]
    cols = [(p, m) for p in parts for m in merges]
    names = [f"{'policy' if p is None else f'p{p}'}/{m}" for p, m in cols]
    print(f"{'batch':>5} {'ctx':>5} {'splits':>6} " + " ".join(f"{n:>14}" for n in names))
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
            # the policy's split count at this batch (the graphs size it from the capacity, not the context)
            splits = decode_split_policy(b, KV_HEADS, args.capacity, _decode_block_n(HEAD_DIM),
                                         _num_sms(dev.index or 0))[0]
            times = []
            for p, m in cols:
                def fn(p=p, m=m):
                    decode_attention(q, k_cache, v_cache, tables, lens, HEAD_DIM ** -0.5, out, partition_size=p,
                                     merge=m)
                out.fill_(float("nan"))
                fn()  # outside the capture: compiles, and allocates the serial merge's counters
                torch.cuda.synchronize()
                err = (out.float() - ref.float()).abs().max().item()
                assert err < 2e-2, (b, ctx, p, m, err)
                times.append(time_in_graph(fn))
            rows.append({"batch": b, "context": ctx, "policy_splits": splits, "us": dict(zip(names, times))})
            print(f"{b:5d} {ctx:5d} {splits:6d} " + " ".join(f"{t:14.2f}" for t in times), flush=True)
        del k_cache, v_cache
        torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "decode_attention.json").write_text(json.dumps(
        {"card": torch.cuda.get_device_name(), "capacity": args.capacity, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
