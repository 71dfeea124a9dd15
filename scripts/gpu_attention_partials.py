"""Decode attention's merge left to o_proj (``nvllm.kernels.attention_partials``) on one GPU, Qwen2.5-7B shapes: 28
query heads, 4 KV heads, head_dim 128, o_proj 3584 × 3584 GPTQ 4-bit g128, batch 1, bf16, a block table for 4096
tokens (the split grid a decode CUDA graph gets: 64 partitions of 64 tokens).

For each context length: o_proj's fp32 sums with the merge in the GEMV's prologue against stage 2 then the GEMV
(how many of the 3584 sums are bit-equal, the largest difference) and against the torch references; then the time
of attention + o_proj each way, in a CUDA graph that repeats the pair over weight copies larger than L2 (with
programmatic dependent launch, as the engine's graphs run). Results: $OUT/attention_partials.json and a table.

    python scripts/gpu_attention_partials.py --contexts 100,256,1000,3000 --chunks 8,16,32

(Equal bits are not expected everywhere: the GEMV's K splits add into the sums atomically, in no fixed order.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import torch  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK, CAPACITY = 28, 4, 128, 16, 4096


def main() -> None:
    from gpu_quant_bench import random_weight, rotated_copies
    from nvllm.kernels import quant_gemv as QV
    from nvllm.kernels.attention_partials import AttentionPartials
    from nvllm.kernels.decode_attention import decode_attention, decode_attention_reference
    from nvllm.kernels.gemm_tuner import cuda_graph_timer
    from nvllm.kernels.quant_gemm import quant_gemm_reference

    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="100,256,1000,3000")
    ap.add_argument("--chunks", default="16", help="MERGE_CHUNK values to time the fused pair with")
    args = ap.parse_args()
    g = torch.Generator("cuda").manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    blocks = CAPACITY // BLOCK
    k_cache = torch.randn(blocks + 1, BLOCK, KV_HEADS, HEAD_DIM, generator=g, device=dev).to(bf16)
    v_cache = torch.randn(blocks + 1, BLOCK, KV_HEADS, HEAD_DIM, generator=g, device=dev).to(bf16)
    tables = torch.randperm(blocks, generator=g, device=dev).to(torch.int32)[None]
    q = torch.randn(1, HEADS, HEAD_DIM, generator=g, device=dev).to(bf16)
    qw0 = random_weight("gptq", HEADS * HEAD_DIM, HEADS * HEAD_DIM, g, dev)
    qws, _ = rotated_copies(qw0, HEADS * HEAD_DIM, HEADS * HEAD_DIM)
    scale = HEAD_DIM ** -0.5
    acc = torch.zeros(1, HEADS * HEAD_DIM, device=dev)
    rows = []

    def o_proj(x, qw, into):
        return QV.quant_gemv(x, qw.qweight, qw.qzeros, qw.scales, fmt="gptq", bits=4, group_size=128, acc=into)

    for ctx in (int(c) for c in args.contexts.split(",")):
        lens = torch.tensor([ctx], dtype=torch.int32, device=dev)

        def attention(defer: bool):
            return decode_attention(q, k_cache, v_cache, tables, lens, scale, fresh_tokens=1, defer_merge=defer)

        partials = attention(True)
        assert isinstance(partials, AttentionPartials), "a 4096-token table splits"
        fused = o_proj(partials, qw0, torch.zeros_like(acc))
        merged = attention(False)
        unfused = o_proj(merged.view(1, -1), qw0, torch.zeros_like(acc))
        ref_attn = decode_attention_reference(q, k_cache, v_cache, tables, lens, scale)
        ref = quant_gemm_reference(ref_attn.view(1, -1), qw0, None).float()
        row = {"context": ctx, "partitions": -(-ctx // partials.partition),
               "bits_equal": int((fused == unfused).sum()), "outputs": fused.numel(),
               "max_diff_vs_stage2": (fused - unfused).abs().max().item() / unfused.abs().max().item(),
               "max_diff_vs_reference": (fused - ref).abs().max().item() / ref.abs().max().item(),
               "stage2_vs_reference": (unfused - ref).abs().max().item() / ref.abs().max().item()}
        assert row["max_diff_vs_reference"] < 2e-2, row
        for name, defer, chunk in [(f"fused_c{c}_us", True, int(c)) for c in args.chunks.split(",")] + \
                [("stage2_us", False, 16)]:
            QV.MERGE_CHUNK = chunk

            def pair(i, defer=defer):
                a = attention(defer)
                o_proj(a if defer else a.view(1, -1), qws[i], acc)
            row[name] = cuda_graph_timer(pair, len(qws), 2e-5) * 1e6
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = Path(os.environ.get("OUT", "."))
    (out / "attention_partials.json").write_text(json.dumps({"card": torch.cuda.get_device_name(), "rows": rows},
                                                            indent=1))
    timed = [k for k in rows[0] if k.endswith("_us")]
    print(f"{'context':>8} {'parts':>5} {'equal':>10} {'vs stage2':>10} {'vs ref':>9} " +
          " ".join(f"{k[:-3]:>10}" for k in timed) + "  (µs)")
    for r in rows:
        print(f"{r['context']:>8} {r['partitions']:>5} {r['bits_equal']:>5}/{r['outputs']:<4} "
              f"{r['max_diff_vs_stage2']:>10.2e} {r['max_diff_vs_reference']:>9.2e} " +
              " ".join(f"{r[k]:>10.2f}" for k in timed))


if __name__ == "__main__":
    main()
