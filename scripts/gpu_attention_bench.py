"""Paged decode attention inside a CUDA graph, as the decode graphs run it (context length unknown on the host,
the split grid sized from the block-table capacity): µs per call for the split policy and for forced partition
lengths, at Qwen2.5-7B's heads (28 query / 4 KV heads, head_dim 128), bf16, 16-token blocks.

    python3 scripts/gpu_attention_bench.py [--capacity 4096] [--out DIR]
    python3 scripts/gpu_attention_bench.py --prefill [--lengths 512,2048]

Prints one row per (batch, context) and writes decode_attention.json under --out (or $OUT). ``--prefill``: the
paged prefill kernel on one causal prompt of each length (blocks in random order), for a few tile shapes, against
PyTorch's scaled_dot_product_attention (its flash kernel, contiguous K/V) on the same data; writes
prefill_attention.json."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nvllm.kernels.decode_attention import decode_attention  # noqa: E402
from nvllm.kernels.prefill_attention import prefill_attention  # noqa: E402

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


PREFILL_TILES = (None, (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 4, 3), (128, 64, 4, 3), (128, 64, 8, 4),
                 (64, 64, 4, 3), (64, 128, 4, 3))
"""(BLOCK_M, BLOCK_N, num_warps, num_stages); None: the kernel's own choice (128, 128, 8, 3 for these shapes)."""


def prefill_bench(lengths: list[int], out_dir: str) -> None:
    import torch.nn.functional as F

    dev = torch.device("cuda")
    rows = []
    print("per prompt length: µs and TFLOP/s (causal half) of each (BLOCK_M, BLOCK_N, warps, stages), and SDPA's")
    for n in lengths:
        blocks = -(-n // BLOCK)
        k_cache = torch.randn(blocks + 1, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev)
        v_cache = torch.randn_like(k_cache)
        table = (torch.randperm(blocks, device=dev) + 1).to(torch.int32)[None, :]
        q = torch.randn(n, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev)
        qsl = torch.tensor([0, n], dtype=torch.int32, device=dev)
        lens = torch.tensor([n], dtype=torch.int32, device=dev)
        k = k_cache[table[0].long()].reshape(-1, KV_HEADS, HEAD_DIM)[:n]
        v = v_cache[table[0].long()].reshape(-1, KV_HEADS, HEAD_DIM)[:n]
        qh, kh, vh = (t.transpose(0, 1)[None].contiguous() for t in (q, k, v))
        scale = HEAD_DIM ** -0.5
        ref = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale, enable_gqa=True)[0].transpose(0, 1)
        flops = 4 * n * n * HEAD_DIM * HEADS / 2
        sdpa = time_in_graph(lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                                                     enable_gqa=True))
        out = torch.empty_like(q)
        us = {}
        for tile in PREFILL_TILES:
            bm, bn, nw, ns = tile or (None,) * 4

            def fn(bm=bm, bn=bn, nw=nw, ns=ns):
                prefill_attention(q, k_cache, v_cache, table, qsl, lens, scale, n, out, block_m=bm, block_n=bn,
                                  num_warps=nw, num_stages=ns)
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - a config the GPU cannot run (shared memory): skip it
                print(f"   {tile}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            torch.cuda.synchronize()
            err = (out.float() - ref.float()).abs().max().item()
            assert err < 2e-2, (n, tile, err)
            us[str(tile or "default")] = time_in_graph(fn, iters=100)
        rows.append({"tokens": n, "sdpa_us": sdpa, "us": us, "causal_flops": flops})
        print(f"{n} tokens: sdpa {sdpa:.1f} µs {flops / sdpa / 1e6:.0f} TFLOP/s; "
              + "; ".join(f"{k} {t:.1f} µs {flops / t / 1e6:.0f}" for k, t in us.items()), flush=True)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / "prefill_attention.json").write_text(json.dumps(
        {"card": torch.cuda.get_device_name(), "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
         "rows": rows}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", action="store_true", help="the prefill kernel instead (see above)")
    ap.add_argument("--lengths", default="512,2048", help="prompt lengths of --prefill")
    ap.add_argument("--capacity", type=int, default=4096, help="block-table capacity in tokens (max_model_len)")
    ap.add_argument("--batches", default="1,4,16,64,256")
    ap.add_argument("--contexts", default="384,1024,4000")
    ap.add_argument("--partitions", default="policy,32,64,128,256")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if args.prefill:
        prefill_bench([int(n) for n in args.lengths.split(",")], args.out)
        return
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
