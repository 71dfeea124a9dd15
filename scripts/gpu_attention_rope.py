"""Rotary and the KV store inside decode attention (``nvllm.kernels.attention_rope``) against ``rope_store`` then
decode attention, on one GPU with Qwen2.5-7B shapes: the qkv projection (3584 → 4608, GPTQ 4-bit g128, bias) leaves
its sums pending, 28 query heads, 4 KV heads, head_dim 128, batch 1, bf16, a block table for 4096 tokens (the split
grid a decode CUDA graph gets), and o_proj (merging the partials, as the engine does).

For each context length: the partials, merged, and the cache row each way (largest difference, equal cache bits),
then the time of qkv → rotate/store → attention → o_proj each way, in a CUDA graph over weight copies larger than L2
(with programmatic dependent launch, as the engine's graphs run), and the registers / spills of every compiled
stage-1 variant. Results: $OUT/attention_rope.json and a table.

    python scripts/gpu_attention_rope.py --contexts 100,256,1000
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

HEADS, KV_HEADS, HEAD_DIM, BLOCK, CAPACITY, HIDDEN = 28, 4, 128, 16, 4096, 3584


def watch_registers() -> dict[str, str]:
    """Registers and spilled bytes of every stage-1 kernel launched from now on, by its ROPE constexpr (the launch
    returns the compiled kernel)."""
    from nvllm.kernels import decode_attention as DA

    seen: dict[str, str] = {}
    jitted = DA._jit(DA._decode_stage1_kernel)
    run = jitted.run

    def watched(*args, **kw):
        k = run(*args, **kw)
        seen[f"ROPE={kw.get('ROPE')}"] = f"{k.n_regs} registers, {k.n_spills} spilled"
        return k

    jitted.run = watched
    return seen


def main() -> None:
    from gpu_quant_bench import random_weight, rotated_copies
    from nvllm.kernels import attention_rope
    from nvllm.kernels import quant_gemv as QV
    from nvllm.kernels.decode_attention import decode_attention
    from nvllm.kernels.gemm_tuner import cuda_graph_timer
    from nvllm.kernels.partial_sum import PartialSum
    from nvllm.kernels.rope_store import rope_store_triton
    from nvllm.layers.rotary import RotaryEmbedding

    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="100,256,1000")
    args = ap.parse_args()
    g = torch.Generator("cuda").manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    q_size, kv_size = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    n_qkv = q_size + 2 * kv_size
    blocks = CAPACITY // BLOCK
    caches = [torch.randn(blocks + 1, BLOCK, KV_HEADS, HEAD_DIM, generator=g, device=dev).to(bf16) for _ in "kv"]
    tables = torch.randperm(blocks, generator=g, device=dev).to(torch.int32)[None]
    x = torch.randn(1, HIDDEN, generator=g, device=dev).to(bf16)
    bias = (torch.randn(n_qkv, generator=g, device=dev) * 0.1).to(bf16)
    qkv0 = random_weight("gptq", n_qkv, HIDDEN, g, dev)
    o0 = random_weight("gptq", HIDDEN, q_size, g, dev)
    qkvs, _ = rotated_copies(qkv0, n_qkv, HIDDEN)
    os_, _ = rotated_copies(o0, HIDDEN, q_size)
    rot = RotaryEmbedding(HEAD_DIM, CAPACITY, 1e6, None).to(dev)
    scale = HEAD_DIM ** -0.5
    acc = torch.zeros(1, n_qkv, device=dev)
    o_acc = torch.zeros(1, HIDDEN, device=dev)
    rows = []
    regs = watch_registers()

    def gemv(inp, qw, into):
        return QV.quant_gemv(inp, qw.qweight, qw.qzeros, qw.scales, fmt="gptq", bits=4, group_size=128, acc=into)

    for ctx in (int(c) for c in args.contexts.split(",")):
        lens = torch.tensor([ctx], dtype=torch.int32, device=dev)
        pos = torch.tensor([ctx - 1], device=dev)
        slot = (tables[0, (ctx - 1) // BLOCK].long() * BLOCK + (ctx - 1) % BLOCK).view(1)

        def chain(i: int, fused: bool, kc, vc):
            gemv(x, qkvs[i], acc)
            total = PartialSum(acc, bias, bf16)
            q, k, v = (total.heads(0, HEADS, HEAD_DIM), total.heads(q_size, KV_HEADS, HEAD_DIM),
                       total.heads(q_size + kv_size, KV_HEADS, HEAD_DIM))
            if fused:
                rope = attention_rope.prepare(q, k, v, pos, rot.cos, rot.sin, slot, False, 1, 1)
                parts = decode_attention(q, kc, vc, tables, lens, scale, fresh_tokens=1, defer_merge=True, rope=rope)
            else:
                q, _ = rope_store_triton(q, k, v, pos, rot.cos, rot.sin, kc, vc, slot)
                parts = decode_attention(q, kc, vc, tables, lens, scale, fresh_tokens=1, defer_merge=True)
            return gemv(parts, os_[i % len(os_)], o_acc) if i >= 0 else parts.finish()

        outs, kept = {}, {}
        for fused in (False, True):
            kc, vc = (c.clone() for c in caches)
            outs[fused] = chain(-1, fused, kc, vc)   # (−1: the merged rows, no o_proj)
            kept[fused] = (kc, vc)
            assert not acc.any(), "the consumer leaves the sums zeroed"
        row = {"context": ctx,
               "max_diff": ((outs[True].float() - outs[False].float()).abs().max() /
                            outs[False].float().abs().max()).item(),
               "cache_equal": all(torch.equal(a, b) for a, b in zip(kept[True], kept[False]))}
        for name, fused in (("rope_store_us", False), ("in_attention_us", True)):
            row[name] = cuda_graph_timer(lambda i, f=fused: chain(i, f, *caches), len(qkvs), 2e-5) * 1e6
        o_acc.zero_()
        rows.append(row)
        print(json.dumps(row), flush=True)
    regs = [f"{k}: {v}" for k, v in regs.items()]
    out = Path(os.environ.get("OUT", "."))
    (out / "attention_rope.json").write_text(json.dumps({"card": torch.cuda.get_device_name(), "rows": rows,
                                                         "registers": regs}, indent=1))
    print("\n".join(regs))
    print("| context | max diff | cache equal | rope_store + attention µs | in attention µs |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']} | {r['max_diff']:.2e} | {r['cache_equal']} | {r['rope_store_us']:.2f} | "
              f"{r['in_attention_us']:.2f} |")


if __name__ == "__main__":
    main()
