"""Mixture-of-experts models on one GPU: the fused experts op, then the engine on Qwen3-30B-A3B's shapes (random bf16
weights, load_format dummy) against HF transformers on the same shapes, in one call.

    python3 scripts/gpu_moe_bench.py [--layers 48] [--ts 1,8,64,512,4096] [--skip-hf] [--skip-engine] [--gptq]
        [--sweep] [--gemm-sweep] [--align-compare] [--crossing]

1. ``fused_experts`` (Triton) against its torch reference (the per-expert loop transformers runs) at the expert shapes
   of Qwen3-30B-A3B (128 experts of 2048 → 768, 8 a token) and Mixtral-8x7B (8 of 4096 → 14336, 2 a token), random
   routing: the largest difference over the largest output, µs a call inside a CUDA graph (a capture that fails is
   an error: the engine captures the op in its decode graphs), and the floor: the bytes of the distinct experts the
   tokens touch over the copy bandwidth measured in the run.
2. The engine (``--layers`` of Qwen3-30B-A3B's 48; 61 GB of weights at 48): batch-1 TPOT (the ``bench latency`` path,
   greedy), decode steps at batch 8 and 32 with 256-token contexts, the time to the first token of one prompt of 512
   and of 2048 tokens, and the floor: the bytes a batch-1 token reads
   (attention, router, 8 experts a layer, LM head) over the copy bandwidth. HF transformers eager (``generate``) on
   the same shapes gives its TPOT and its forward time for prompts of the same lengths; the greedy tokens of the two
   are not compared (random weights in two layouts).

``--align-compare``: ``align_tokens`` (grouping the pairs by expert for the grouped GEMMs) in torch and in Triton at
``--ts`` (the same bits checked, µs a call in a CUDA graph), and in step 2 the bf16 engine first with the torch
version patched in, then as shipped.

``--crossing``: both paths of the op, bf16 and 4-bit experts, at the token counts around T·k = E (where the GEMVs
hand over to the grouped GEMM), µs a call.

``--gptq``: also the 4-bit experts (GPTQ g128, ``nvllm.kernels.quant_moe``) in step 1, checked against their torch
reference, and in step 2 the engine on the same shapes with a GPTQ 4-bit g128 config (every decoder linear and
expert packed, router and LM head in bf16): its TPOT, decode steps and TTFT against the bf16 engine's in the same
run. ``--gemm-sweep``: the grouped GEMM's launch settings (bf16; with ``--gptq`` 4-bit too) at the ``--ts`` past
T·k = E, µs a call of the op; the engine then runs again with each grouped GEMM launched as the sweep's best nearest
case.
``--sweep``: the 4-bit GEMV's block sizes, warps and K splits at T = 1 (both shapes) and 4 (Qwen3-30B-A3B), µs a
call.

Writes $OUT/moe_bench.json (``--out`` overrides $OUT).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import torch  # noqa: E402

from gpu_bench import decode_step_ms, measure_bandwidth  # noqa: E402
from hf_baselines import hf_baseline  # noqa: E402
from nvllm.kernels import fused_moe as FM  # noqa: E402
from nvllm.kernels.fused_moe import fused_experts, fused_experts_reference  # noqa: E402
from nvllm.kernels.moe_align import align_tokens_reference, align_tokens_triton  # noqa: E402
from nvllm.kernels.moe_routing import route  # noqa: E402
from nvllm.kernels import quant_moe as QM  # noqa: E402
from nvllm.quant.formats import quantize_to_gptq  # noqa: E402

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}   # E, k, H, I


def graph_us(call, iters: int = 20, reps: int = 7) -> float:
    """µs a call: ``iters`` calls captured in one CUDA graph, the median of ``reps`` replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            call()
    graph.replay()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / iters)
    return sorted(times)[reps // 2]


def random_experts(e: int, h: int, i: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 w13 [E, 2I, H] and w2 [E, H, I], normal entries scaled by 1/√fan-in."""
    return ((torch.randn(e, 2 * i, h, device="cuda", generator=gen) * h ** -0.5).to(torch.bfloat16),
            (torch.randn(e, h, i, device="cuda", generator=gen) * i ** -0.5).to(torch.bfloat16))


def kernel_runs(res: dict, ts: list[int], bandwidth: float) -> None:
    for name, (e, k, h, i) in SHAPES.items():
        gen = torch.Generator("cuda").manual_seed(0)
        w13, w2 = random_experts(e, h, i, gen)
        per_expert = (w13[0].numel() + w2[0].numel()) * 2
        for t in ts:
            x = torch.randn(t, h, device="cuda", generator=gen).to(torch.bfloat16)
            logits = torch.randn(t, e, device="cuda", generator=gen)
            weights, ids = route(logits, k, True, True)
            got = fused_experts(x, w13, w2, weights, ids)
            ref = fused_experts_reference(x, w13, w2, weights, ids)
            err = ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            us = graph_us(lambda: fused_experts(x, w13, w2, weights, ids))
            floor = 1e6 * (ids.unique().numel() * per_expert + 4 * t * h) / bandwidth
            row = {"t": t, "rel_err": err, "us": us, "floor_us": floor}
            if t <= 64:   # the reference syncs on the host (it is never captured): timed with events, eagerly
                s, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                fused_experts_reference(x, w13, w2, weights, ids)
                s.record()
                for _ in range(5):
                    fused_experts_reference(x, w13, w2, weights, ids)
                en.record()
                en.synchronize()
                row["reference_us"] = s.elapsed_time(en) * 1e3 / 5
            res.setdefault("kernel", {}).setdefault(name, []).append(row)
            print(f"{name} T={t}: rel err {err:.2e}, {us:.1f} µs (floor {floor:.1f})"
                  + (f", reference {row['reference_us']:.1f} µs" if "reference_us" in row else ""), flush=True)
        w13 = w2 = None   # freed before the next shape
        torch.cuda.empty_cache()


def align_runs(res: dict, ts: list[int]) -> None:
    """``align_tokens`` in torch and in Triton on the same routing: equal outputs, µs a call in a CUDA graph."""
    for name, (e, k, _, _) in SHAPES.items():
        for t in ts:
            gen = torch.Generator("cuda").manual_seed(t)
            _, ids = route(torch.randn(t, e, device="cuda", generator=gen), k, True, True)
            block_m = FM.gemm_config(t * k, e)["BLOCK_M"]
            ref = align_tokens_reference(ids, e, block_m)
            got = align_tokens_triton(ids, e, block_m)
            same = all(torch.equal(a, b) for a, b in zip(ref, got))
            row = {"t": t, "block_m": block_m, "same": same,
                   "torch_us": graph_us(lambda: align_tokens_reference(ids, e, block_m)),
                   "triton_us": graph_us(lambda: align_tokens_triton(ids, e, block_m))}
            res.setdefault("align", {}).setdefault(name, []).append(row)
            print(f"align {name} T={t} (block_m {block_m}): same bits {same}, torch {row['torch_us']:.1f} µs, "
                  f"triton {row['triton_us']:.1f} µs", flush=True)
            assert same, f"align_tokens: Triton differs from torch at {name} T={t}"


def gptq_experts(w: torch.Tensor, group: int = 128) -> QM.ExpertWeights:
    """[E, N, K] bf16 experts → 4-bit GPTQ (symmetric, RTN) stacked as the kernels take them."""
    qs = [quantize_to_gptq(w[e].float(), 4, group) for e in range(w.shape[0])]
    return QM.ExpertWeights(torch.stack([q.qweight for q in qs]), torch.stack([q.qzeros for q in qs]),
                            torch.stack([q.scales for q in qs]), None, 4, group)


def packed_bytes(w: QM.ExpertWeights) -> int:
    return sum(t[0].numel() * t.element_size() for t in (w.qweight, w.qzeros, w.scales))


def quant_kernel_runs(res: dict, ts: list[int], bandwidth: float, sweep: bool) -> None:
    """4-bit experts against their reference, µs a call in a CUDA graph and the floor (packed bytes of the experts
    the tokens touch); ``sweep``: the GEMV's block sizes at T = 1 and 4."""
    for name, (e, k, h, i) in SHAPES.items():
        gen = torch.Generator("cuda").manual_seed(0)
        w13, w2 = map(gptq_experts, random_experts(e, h, i, gen))
        per_expert = packed_bytes(w13) + packed_bytes(w2)
        for t in ts:
            x = torch.randn(t, h, device="cuda", generator=gen).to(torch.bfloat16)
            weights, ids = route(torch.randn(t, e, device="cuda", generator=gen), k, True, True)
            got = QM.quant_experts(x, w13, w2, weights, ids)
            ref = QM.quant_experts_reference(x, w13, w2, weights, ids) if t <= 512 else None
            err = None if ref is None else ((got.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
            us = graph_us(lambda: QM.quant_experts(x, w13, w2, weights, ids))
            floor = 1e6 * (ids.unique().numel() * per_expert + 4 * t * h) / bandwidth
            res.setdefault("quant_kernel", {}).setdefault(name, []).append(
                {"t": t, "rel_err": err, "us": us, "floor_us": floor})
            print(f"gptq4 {name} T={t}: rel err {err if err is None else f'{err:.2e}'}, {us:.1f} µs (floor "
                  f"{floor:.1f})", flush=True)
            if sweep and (t == 1 or (t == 4 and name == "qwen3-30b-a3b")):
                gemv_sweep(res, f"{name} T={t}", lambda: QM.quant_experts(x, w13, w2, weights, ids))
        w13 = w2 = None
        torch.cuda.empty_cache()


CROSSING_TS = {"qwen3-30b-a3b": (4, 8, 12, 16, 24, 32), "mixtral-8x7b": (2, 3, 4, 6, 8)}


def crossing_runs(res: dict) -> None:
    """Where the GEMVs stop paying against the sorted grouped GEMM: both paths forced (``fused_moe.SMALL_ROWS``) at
    the token counts around T·k = E, bf16 and 4-bit experts, µs a call in a CUDA graph."""
    for name, (e, k, h, i) in SHAPES.items():
        gen = torch.Generator("cuda").manual_seed(0)
        w13, w2 = random_experts(e, h, i, gen)
        q13, q2 = gptq_experts(w13), gptq_experts(w2)
        for t in CROSSING_TS[name]:
            x = torch.randn(t, h, device="cuda", generator=gen).to(torch.bfloat16)
            weights, ids = route(torch.randn(t, e, device="cuda", generator=gen), k, True, True)
            row = {"t": t, "pairs": t * k}
            for kind, call in (("bf16", lambda: fused_experts(x, w13, w2, weights, ids)),
                               ("gptq4", lambda: QM.quant_experts(x, q13, q2, weights, ids))):
                for path, rows in (("gemv", 1 << 30), ("grouped", 0)):
                    FM.SMALL_ROWS = rows
                    row[f"{kind}_{path}_us"] = graph_us(call)
            FM.SMALL_ROWS = None
            res.setdefault("crossing", {}).setdefault(name, []).append(row)
            print(f"crossing {name} T={t} ({t * k} pairs): " + ", ".join(
                f"{key[:-3]} {v:.1f}" for key, v in row.items() if key.endswith("_us")) + " µs", flush=True)
        w13 = w2 = q13 = q2 = None
        torch.cuda.empty_cache()


def gemv_sweep(res: dict, case: str, call) -> None:
    """µs a call of ``call`` for each GEMV setting (block N x warps, step sums, K splits; K steps of 128 inputs),
    the five best printed."""
    names = ("GEMV_BLOCK_N", "GEMV_BLOCK_K", "GEMV_NUM_WARPS", "GEMV_NUM_STAGES", "GEMV_STEP_SUM", "GEMV_SPLIT_K")
    saved = [getattr(QM, n) for n in names]
    rows = []
    for bn in (16, 32, 64):
        for nw in (1, 2):
            for ss in (False,) if "T=1" in case else (False, True):
                for split in (1, 2, 4, 8, 16):
                    for n, v in zip(names, (bn, 128, nw, 1, ss, split)):
                        setattr(QM, n, v)
                    rows.append({"case": case, "setting": f"{bn}x128x{nw}wx1s{'+sum' * ss}/{split}k",
                                 "us": graph_us(call)})
    for n, v in zip(names, saved):
        setattr(QM, n, v)
    res.setdefault("gemv_sweep", []).extend(rows)
    best = sorted(rows, key=lambda r: r["us"])[:5]
    print(f"  sweep {case}: shipped setting {res['quant_kernel'][case.split()[0]][-1]['us']:.1f}; best five: "
          + "; ".join(f"{r['setting']} {r['us']:.1f}" for r in best), flush=True)


def gemm_sweep(res: dict, ts: list[int], mod) -> dict:
    """The grouped GEMM's launch (``mod.GEMM_TILES``; ``mod``: fused_moe for bf16 experts, quant_moe for 4-bit GPTQ
    g128 ones) at the token counts of ``ts`` that take it: rows a block (the shipped rule's, half and twice it),
    columns and K step at 4 warps and 3 stages (and 256 columns at 8 warps for blocks of 64 rows or more); then 8
    warps, 4 stages and both for the best three. µs a call of the whole op in a CUDA graph; each setting's output
    against the shipped one's (largest difference over the largest output; 1e-2 or more disqualifies it). Returns
    the best setting of each case, keyed (experts, pairs an expert)."""
    best, kind = {}, "4-bit" if mod is QM else "bf16"
    for name, (e, k, h, i) in SHAPES.items():
        gen = torch.Generator("cuda").manual_seed(0)
        w13, w2 = random_experts(e, h, i, gen)
        if mod is QM:
            w13, w2 = map(gptq_experts, (w13, w2))
        op = QM.quant_experts if mod is QM else fused_experts
        for t in (t for t in ts if t * k > e):
            x = torch.randn(t, h, device="cuda", generator=gen).to(torch.bfloat16)
            weights, ids = route(torch.randn(t, e, device="cuda", generator=gen), k, True, True)

            def call():
                return op(x, w13, w2, weights, ids)

            mod.GEMM_TILES = None
            shipped = mod.gemm_config(t * k, e)
            shipped_out, shipped_us = call().float(), graph_us(call)
            rows = []

            def time_setting(**tiles):
                mod.GEMM_TILES = tiles
                row = {"op": kind, "case": f"{name} T={t}", "tiles": tiles,
                       "setting": "{BLOCK_M}x{BLOCK_N}x{BLOCK_K} {num_warps}w {num_stages}s".format(**tiles)}
                try:
                    row["err"] = ((call().float() - shipped_out).abs().max() / shipped_out.abs().max()).item()
                    row["us"] = graph_us(call)
                except Exception as exc:   # e.g. a tile past the shared memory
                    row["error"] = str(exc)[:200]
                rows.append(row)

            block_m = shipped["BLOCK_M"]
            for bm in sorted({max(16, block_m // 2), block_m, min(128, 2 * block_m)}):
                for bn in (64, 128):
                    for bk in (64, 128):
                        time_setting(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=3)
                if bm >= 64:   # Hopper's wide tiles, at 8 warps
                    time_setting(BLOCK_M=bm, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)

            def ranked():   # the settings that ran and gave the shipped output, fastest first
                return sorted((r for r in rows if "us" in r and r["err"] < 1e-2), key=lambda r: r["us"])

            for r in ranked()[:3]:
                for nw, ns in ((8, 3), (4, 4), (8, 4)):
                    time_setting(**{**r["tiles"], "num_warps": nw, "num_stages": ns})
            mod.GEMM_TILES = None
            res.setdefault("gemm_sweep", []).extend(rows)
            res.setdefault("gemm_sweep_shipped", {})[f"{kind} {name} T={t}"] = {"us": shipped_us, "tiles": shipped}
            timed = ranked()
            if timed:
                best[(e, t * k / e)] = timed[0]["tiles"]
            print(f"  {kind} gemm sweep {name} T={t}: shipped {shipped_us:.1f} µs; best five: " + "; ".join(
                f"{r['setting']} {r['us']:.1f} (err {r['err']:.1e})" for r in timed[:5])
                + f"; {len(rows) - len(timed)} failed or wrong", flush=True)
        w13 = w2 = None
        torch.cuda.empty_cache()
    return best


def swept_config(best: dict, mod):
    """A ``mod.gemm_config`` that launches each call as the sweep's best setting for the case of the same experts
    nearest in pairs an expert (the shipped rule for expert counts the sweep did not see)."""
    shipped = mod.gemm_config

    def config(rows: int, num_experts: int) -> dict:
        cases = [(abs(math.log(rows / num_experts / p)), p) for e, p in best if e == num_experts]
        return dict(best[(num_experts, min(cases)[1])]) if cases else shipped(rows, num_experts)

    return config


def model_dir(layers: int, tokenizer_dir: Path) -> Path:
    from transformers import Qwen2Tokenizer

    d = Path(tempfile.mkdtemp(prefix="qwen3moe-"))
    cfg = json.loads((REPO / "scripts/models/qwen3-30b-a3b/config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (d / "config.json").write_text(json.dumps(cfg))
    Qwen2Tokenizer(vocab=str(tokenizer_dir / "vocab.json"), merges=str(tokenizer_dir / "merges.txt")).save_pretrained(d)
    return d


def token_bytes(cfg: dict) -> int:
    """Bytes a batch-1 decode token reads: attention's four projections, router, k experts a layer, LM head; with a
    ``quantization_config`` the projections and experts at 4 bits plus a fp16 scale and a 4-bit zero a group."""
    h, hd, heads, kv = cfg["hidden_size"], cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    q = cfg.get("quantization_config")
    per_weight = 2 if q is None else 0.5 + 2.5 / q["group_size"]
    packed = h * hd * (heads + 2 * kv) + heads * hd * h \
        + cfg["num_experts_per_tok"] * 3 * h * cfg["moe_intermediate_size"]
    layers = cfg["num_hidden_layers"] * (per_weight * packed + 2 * cfg["num_experts"] * h)
    return int(layers + 2 * cfg["vocab_size"] * h)


def engine_runs(res: dict, d: Path, bandwidth: float, tag: str = "nvllm") -> None:
    from nvllm.bench.offline import run_latency
    from nvllm.config import EngineConfig
    from nvllm.llm import LLM

    config = EngineConfig(model=str(d), load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=64,
                          log_stats_interval=0)
    llm = LLM.from_config(config)
    lat = run_latency(config, batch_size=1, input_len=128, output_len=128, num_iters_warmup=1, num_iters=3,
                      progress=False, llm=llm, temperature=0)
    res[f"{tag}_tpot_ms"] = lat["median_tpot_ms"]
    res[f"{tag}_kernel_report"] = lat["kernel_report"]
    res[f"{tag}_floor_tpot_ms"] = 1e3 * token_bytes(json.loads((d / "config.json").read_text())) / bandwidth
    for b in (8, 32):
        res[f"{tag}_b{b}_step_ms"] = decode_step_ms(llm, b, 256, steps=16)
    for n in (512, 2048):   # one prompt of n tokens: the time to its first token
        p = run_latency(config, batch_size=1, input_len=n, output_len=1, num_iters_warmup=1, num_iters=5,
                        progress=False, llm=llm)
        res[f"{tag}_ttft_{n}_ms"] = p["median_ttft_ms"]
    print(f"{tag} TPOT {res[f'{tag}_tpot_ms']:.3f} ms (floor {res[f'{tag}_floor_tpot_ms']:.3f}); decode step b8 "
          f"{res[f'{tag}_b8_step_ms']:.3f} ms, b32 {res[f'{tag}_b32_step_ms']:.3f} ms; TTFT 512 "
          f"{res[f'{tag}_ttft_512_ms']:.1f} ms, 2048 {res[f'{tag}_ttft_2048_ms']:.1f} ms", flush=True)
    llm.close()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--ts", default="1,8,64,512,4096")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-engine", action="store_true")
    ap.add_argument("--gptq", action="store_true", help="also 4-bit GPTQ experts and engine")
    ap.add_argument("--sweep", action="store_true", help="the 4-bit GEMV's block sizes (with --gptq)")
    ap.add_argument("--gemm-sweep", action="store_true", help="the grouped GEMMs' tiles at --ts")
    ap.add_argument("--align-compare", action="store_true", help="align_tokens in torch against Triton")
    ap.add_argument("--crossing", action="store_true", help="GEMVs against the grouped GEMM around T*k = E")
    ap.add_argument("--tokenizer-dir", default=str(REPO / ".carry/qwen2.5"))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    res: dict = {"device": torch.cuda.get_device_name(), "commit": os.environ.get("NVLLM_COMMIT", ""),
                 "layers": args.layers}
    out = Path(args.out) / "moe_bench.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    bandwidth = res["bandwidth_bytes_s"] = measure_bandwidth()
    print(f"{res['device']}: copy bandwidth {bandwidth / 1e12:.2f} TB/s", flush=True)
    ts = [int(t) for t in args.ts.split(",")]
    kernel_runs(res, ts, bandwidth)
    if args.gptq:
        quant_kernel_runs(res, ts, bandwidth, args.sweep)
    best = best_q = None
    if args.gemm_sweep:
        best = gemm_sweep(res, ts, FM)
        best_q = gemm_sweep(res, ts, QM) if args.gptq else None
        out.write_text(json.dumps(res, indent=1))
    if args.align_compare:
        align_runs(res, ts)
    if args.crossing:
        crossing_runs(res)
    out.write_text(json.dumps(res, indent=1))
    d = model_dir(args.layers, Path(args.tokenizer_dir))
    if not args.skip_engine:
        if args.align_compare:   # the engine's graphs capture whichever align_tokens the ops call
            shipped = FM.align_tokens
            FM.align_tokens = QM.align_tokens = align_tokens_reference
            engine_runs(res, d, bandwidth, "nvllm_torch_align")
            FM.align_tokens = QM.align_tokens = shipped
        engine_runs(res, d, bandwidth)
        if best:   # the same engine with each grouped GEMM launched as the sweep's best setting nearest it
            shipped, FM.gemm_config = FM.gemm_config, swept_config(best, FM)
            engine_runs(res, d, bandwidth, "nvllm_swept")
            FM.gemm_config = shipped
        out.write_text(json.dumps(res, indent=1))
        if args.gptq:
            dq = Path(tempfile.mkdtemp(prefix="qwen3moe-gptq-"))
            shutil.copytree(d, dq, dirs_exist_ok=True)
            cfg = json.loads((dq / "config.json").read_text())
            cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False,
                                          "sym": True}
            (dq / "config.json").write_text(json.dumps(cfg))
            engine_runs(res, dq, bandwidth, "gptq")
            res["gptq_speedup"] = res["nvllm_tpot_ms"] / res["gptq_tpot_ms"]
            print(f"GPTQ 4-bit TPOT {res['gptq_tpot_ms']:.3f} ms: {res['gptq_speedup']:.2f}x bf16's", flush=True)
            if best_q:
                shipped, QM.gemm_config = QM.gemm_config, swept_config(best_q, QM)
                engine_runs(res, dq, bandwidth, "gptq_swept")
                QM.gemm_config = shipped
            shutil.rmtree(dq, ignore_errors=True)
            out.write_text(json.dumps(res, indent=1))
    if not args.skip_hf:
        hf_baseline(d, res)
        print(f"HF transformers TPOT {res['hf_tpot_ms']:.3f} ms; prefill 512 {res['hf_prefill_512_ms']:.1f} ms, "
              f"2048 {res['hf_prefill_2048_ms']:.1f} ms", flush=True)
        out.write_text(json.dumps(res, indent=1))
    shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
