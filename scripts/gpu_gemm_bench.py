"""Decode-GEMM benchmark on one GPU: cuBLAS (F.linear) against the best skinny-GEMM Triton config.

Usage (repository root, one GPU; about 2-3 minutes on an H200, most of it Triton compiling ~60 configs):
    python scripts/gpu_gemm_bench.py [--ms 1,2,4,8,16] [--shapes qkv,o,gate_up,down,lm_head] [--budget-s 150]

1. Copy bandwidth: a 1 GiB device-to-device copy (bytes read + written over time), median of 20.
2. For the Qwen2.5-7B decode shapes (``--model llama-3-70b``: Llama-3-70B's; ``--tp N``: one rank's share)
   (weight [N, K], bf16, no bias) and every M: ``GemmTuner`` from
   nvllm.kernels.gemm times cuBLAS and every candidate Triton config — each call captured in a CUDA graph,
   cycling over enough weight copies (≥ 256 MiB, ≥ 4× L2) that L2 never holds the weight — after checking
   each candidate against F.linear (relative error, max |Δ| / max |ref|, must be < 1e-2).
   Achieved bandwidth = bytes of W + x + y over time.
3. End to end through ``gemm()``: the tuned table routes each shape, the kernel report must name the choice,
   the output must match F.linear; split-K winners are re-run 50 times and must be bitwise identical (the
   last-arriver reduction is deterministic; a memory-ordering bug would show here).
4. The decode step's GEMMs (28 layers + lm_head) summed: cuBLAS only, the dispatch's choices, and the
   bandwidth floor.

``--dry-run-cpu`` runs the same flow on the CPU under the Triton interpreter at shapes scaled down 64×, with
an eager wall-clock timer (checks the script, measures nothing).

Prints a compact table; writes $OUT/gemm_bench.json (everything, including every candidate's time) and
$OUT/gemm_table.json (the dispatch table, loadable with ``nvllm.kernels.gemm.load_gemm_table``), both
rewritten after every shape so a run cut short still leaves results. OUT defaults to ".". ``--merge-into FILE``
then adds the table to FILE when every check passed (``merge_gemm_table``: each shipped table in
nvllm/kernels/configs/ holds several models' runs for one GPU model).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# Import only nvllm.kernels (gemm, report, backend), not the package's __init__ (engine, CLI, ...): this
# one-call benchmark depends on the kernel files alone, so nothing else in the tree can break it.
if "nvllm" not in sys.modules:
    import types

    _pkg = types.ModuleType("nvllm")
    _pkg.__path__ = [str(REPO / "nvllm")]
    sys.modules["nvllm"] = _pkg

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

MODELS = {  # name: hidden, intermediate, vocab, layers, qkv rows (q heads + 2 · kv heads, head_dim 128)
    "qwen2.5-7b": (3584, 18944, 152064, 28, 4608),
    "llama-3-70b": (8192, 28672, 128256, 80, 10240),
    "qwen2.5-0.5b": (896, 4864, 152064, 24, 1152),  # the speculative-decoding benchmark's draft
}


def model_shapes(model: str) -> dict[str, tuple[int, int, int]]:
    """name: (N, K, calls per decode step) of the model's decode GEMMs."""
    hidden, inter, vocab, layers, qkv = MODELS[model]
    return {"qkv": (qkv, hidden, layers), "o": (hidden, hidden, layers), "gate_up": (2 * inter, hidden, layers),
            "down": (hidden, inter, layers), "lm_head": (vocab, hidden, 1)}


SHAPES = model_shapes("qwen2.5-7b")
MAX_REL_ERR = 1e-2


def log(*a):
    print(*a, flush=True)


def copy_bandwidth(device, nbytes=1 << 30, reps=20) -> dict:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(reps):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    med = statistics.median(times)
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes_moved": 2 * nbytes, "median_s": med, "min_s": min(times),
            "GBps_median": 2 * nbytes / med / 1e9, "GBps_best": 2 * nbytes / min(times) / 1e9}


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except Exception:
        return None


def write_json(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_timer(call, n_copies, estimate_s, choice=None, reps=3) -> float:
    """--dry-run-cpu: eager wall clock (the interpreter is slow; numbers mean nothing)."""
    call(0)
    t = time.perf_counter()
    for i in range(reps):
        call(i % n_copies)
    return (time.perf_counter() - t) / reps


def verify_dispatch(G, report, name, n, k, ms, dtype, device) -> list[dict]:
    """Run every tuned (n, k, m) through gemm(): report names the choice, output matches F.linear, split-K
    winners repeat bit for bit."""
    from nvllm.kernels.gemm_tuner import _rel_err as rel_err

    out = []
    w = (torch.randn(n, k, device=device) * 0.05).to(dtype)
    for m in ms:
        x = torch.randn(m, k, device=device).to(dtype)
        choice = G.gemm_choice(n, k, m, dtype)
        torch_impl = "torch F.linear (cuBLAS)" if device.type == "cuda" else "torch F.linear (cpu)"
        expect = choice.describe() if isinstance(choice, G.SkinnyConfig) else torch_impl
        report.reset()
        y = G.gemm(x, w)
        ref = F.linear(x, w)
        sync(device)
        snap = report.snapshot().get("gemm", {})
        err = rel_err(y, ref)
        rec = {"shape": name, "m": m, "expected_impl": expect, "report": snap,
               "report_ok": snap == {expect: 1}, "rel_err": err, "err_ok": err < MAX_REL_ERR}
        if isinstance(choice, G.SkinnyConfig) and y is not None:
            mismatches = 0
            for _ in range(50 if device.type == "cuda" else 2):
                mismatches += int(not torch.equal(G.gemm(x, w), y))
            sync(device)
            rec["repeat_mismatches"] = mismatches
        out.append(rec)
    del w
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,2,4,8,16", help="batch sizes M (comma-separated)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"subset of {','.join(SHAPES)}")
    ap.add_argument("--budget-s", type=float, default=150.0,
                    help="stop timing new Triton candidates after this many seconds of tuning")
    ap.add_argument("--model", default="qwen2.5-7b", choices=list(MODELS), help="whose decode shapes")
    ap.add_argument("--tp", type=int, default=1,
                    help="the shapes one rank of an N-way tensor-parallel engine runs: qkv, gate_up and lm_head split "
                         "along N, o and down along K (the rows the engine's table needs with --tensor-parallel-size)")
    ap.add_argument("--merge-into", metavar="FILE",
                    help="also add the table to FILE (created if missing; one file a GPU model, several models' "
                         "runs in it), e.g. nvllm/kernels/configs/gemm_<device name>.json, which the engine loads")
    ap.add_argument("--dry-run-cpu", action="store_true",
                    help="exercise the script on the CPU (Triton interpreter, shapes / 64, fake timings)")
    args = ap.parse_args()
    dry = args.dry_run_cpu
    if dry:
        os.environ["TRITON_INTERPRET"] = "1"
    ms = [int(m) for m in args.ms.split(",")]
    names = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in names if s not in SHAPES]
    if unknown:
        log(f"unknown shapes {unknown}; choose from {list(SHAPES)}")
        return 2
    if not dry and not torch.cuda.is_available():
        log("no CUDA device: this benchmark needs a GPU (or --dry-run-cpu)")
        return 2

    os.environ["NVLLM_KERNELS"] = "triton" if dry else "auto"  # gemm() consults the tuned table
    import triton

    from nvllm.kernels import gemm as G
    from nvllm.kernels import gemm_tuner as T
    from nvllm.kernels import report

    out_dir = Path(os.environ.get("OUT", "."))
    out_dir.mkdir(parents=True, exist_ok=True)
    row_parallel = ("o", "down")
    shapes = {s: (n, k // args.tp, c) if s in row_parallel else (n // args.tp, k, c)
              for s, (n, k, c) in model_shapes(args.model).items()}
    if dry:
        shapes = {s: (v[0] // 64, v[1] // 64, v[2]) for s, v in shapes.items()}
    if dry:
        device, dev_name, sms, l2 = torch.device("cpu"), "cpu (dry run)", 132, None
    else:
        device = torch.device("cuda", torch.cuda.current_device())
        props = torch.cuda.get_device_properties(device)
        dev_name, sms, l2 = props.name, props.multi_processor_count, getattr(props, "L2_cache_size", None)
    # dry run: two tiles of each kind, BLOCK_K cut to the scaled-down K
    dry_kwargs = {"timer": cpu_timer, "rotate_bytes": 1,
                  "fma_tiles": [(bn, 64, w, st) for bn, _, w, st in T.FMA_TILES[1:3]],
                  "mma_tiles": [(bn, 64, w, st) for bn, _, w, st in T.MMA_TILES[1:3]]}
    dtype = torch.bfloat16
    el = 2
    t_start = time.perf_counter()
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": dev_name, "sms": sms,
            "l2_bytes": l2, "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton.__version__, "commit": git_commit(),
            "dtype": "bfloat16", "ms": ms, "max_rel_err": MAX_REL_ERR,
            "command": "python scripts/gpu_gemm_bench.py " + " ".join(sys.argv[1:])}
    log(f"{dev_name}: {sms} SMs, L2 {l2}, torch {torch.__version__}, "
        f"CUDA {torch.version.cuda}, triton {triton.__version__}, commit {meta['commit']}")

    bw = copy_bandwidth(device) if not dry else {"GBps_median": 1.0, "GBps_best": 1.0, "dry_run": True}
    peak = bw["GBps_median"] * 1e9
    log(f"copy bandwidth: {bw['GBps_median']:.0f} GB/s median ({bw['GBps_best']:.0f} best), "
        f"1 GiB device-to-device, bytes read + written")

    result = {"meta": meta, "copy_bandwidth": bw, "rows": [], "dispatch_checks": [], "errors": []}
    G.clear_gemm_table()
    rows = result["rows"]
    first_error_shown = False
    for name in names:
        n, k, _ = shapes[name]
        remaining = args.budget_s - (time.perf_counter() - t_start)
        tuner = T.GemmTuner(budget_s=max(5.0, remaining), max_err=MAX_REL_ERR, log=lambda s: log("  " + s),
                            **(dry_kwargs if dry else {}))
        log(f"[{time.perf_counter() - t_start:6.1f}s] {name}: W [{n}, {k}], M {ms}")
        try:
            recs = tuner.tune([(n, k)], ms, dtype, device)
        except Exception as e:  # keep going: the other shapes still measure
            msg = f"{name}: {type(e).__name__}: {e}"
            log("  FAILED " + msg)
            result["errors"].append(msg)
            continue
        for r in recs:
            m = r["m"]
            nbytes = (n * k + m * k + m * n) * el
            cub = r["cublas_s"]
            best = r["best_triton_s"]
            errs = [c for c in r["candidates"] if "error" in c]
            if errs and not first_error_shown:
                log(f"  (first candidate error: {errs[0]['config']}: {errs[0]['error']})")
                first_error_shown = True
            best_cand = next((c for c in r["candidates"] if c["config"] == r["best_config"]), {})
            rows.append({
                "shape": name, "n": n, "k": k, "m": m, "bytes": nbytes,
                "cublas_us": cub * 1e6, "cublas_GBps": nbytes / cub / 1e9, "cublas_frac_bw": nbytes / cub / peak,
                "triton_us": best * 1e6 if best else None,
                "triton_GBps": nbytes / best / 1e9 if best else None,
                "triton_frac_bw": nbytes / best / peak if best else None,
                "speedup_vs_cublas": cub / best if best else None,
                "triton_config": r["best_config"], "triton_rel_err": best_cand.get("rel_err"),
                "choice": r["choice"], "candidates_timed": sum("time_s" in c for c in r["candidates"]),
                "candidates_failed": len(errs), "budget_exhausted": r.get("budget_exhausted", False),
                "candidates": r["candidates"],
            })
        try:
            result["dispatch_checks"] += verify_dispatch(G, report, name, n, k, ms, dtype, device)
        except Exception as e:
            msg = f"{name} dispatch check: {type(e).__name__}: {e}"
            log("  FAILED " + msg)
            result["errors"].append(msg)
        G.save_gemm_table(str(out_dir / "gemm_table.json"), meta=meta)
        result["table_entries"] = json.loads((out_dir / "gemm_table.json").read_text())["entries"]
        result["elapsed_s"] = time.perf_counter() - t_start
        write_json(out_dir / "gemm_bench.json", result)

    # ---- table
    log("")
    log(f"copy bandwidth {peak / 1e9:.0f} GB/s; %bw = (W + x + y bytes / time) / copy bandwidth")
    hdr = (f"{'shape':8s} {'N':>6s} {'K':>6s} {'M':>3s} | {'cuBLAS us':>9s} {'%bw':>5s} | {'Triton us':>9s} "
           f"{'%bw':>5s} {'x':>5s} | {'err':>7s} | best Triton config -> dispatch")
    log(hdr)
    log("-" * len(hdr))
    for r in rows:
        cfg = r["triton_config"]
        cfg_s = (f"{cfg['kernel']} {cfg['block_n']}x{cfg['block_k']} s{cfg['split_k']} w{cfg['num_warps']} "
                 f"st{cfg['num_stages']}") if cfg else "-"
        tri = (f"{r['triton_us']:9.2f} {100 * r['triton_frac_bw']:5.1f} {r['speedup_vs_cublas']:5.2f}"
               if r["triton_us"] else f"{'-':>9s} {'-':>5s} {'-':>5s}")
        err = f"{r['triton_rel_err']:.1e}" if r["triton_rel_err"] is not None else "-"
        pick = "Triton" if r["choice"] != G.CUBLAS else "cuBLAS"
        log(f"{r['shape']:8s} {r['n']:6d} {r['k']:6d} {r['m']:3d} | {r['cublas_us']:9.2f} "
            f"{100 * r['cublas_frac_bw']:5.1f} | {tri} | {err:>7s} | {cfg_s} -> {pick}")

    # ---- decode step sum (28 layers + lm_head)
    log("")
    step = {}
    for m in ms:
        sel = {r["shape"]: r for r in rows if r["m"] == m}
        if set(sel) != set(shapes):
            continue
        cub = sum(shapes[s][2] * sel[s]["cublas_us"] for s in shapes)
        disp = sum(shapes[s][2] * (sel[s]["triton_us"] if sel[s]["choice"] != G.CUBLAS else sel[s]["cublas_us"])
                   for s in shapes)
        floor = sum(shapes[s][2] * sel[s]["bytes"] for s in shapes) / peak * 1e6
        step[m] = {"cublas_ms": cub / 1e3, "dispatch_ms": disp / 1e3, "bandwidth_floor_ms": floor / 1e3,
                   "cublas_frac": floor / cub, "dispatch_frac": floor / disp}
        log(f"decode GEMMs per step at M={m:2d}: cuBLAS {cub / 1e3:.3f} ms ({100 * floor / cub:.1f}% of the "
            f"floor), dispatch {disp / 1e3:.3f} ms ({100 * floor / disp:.1f}%), floor {floor / 1e3:.3f} ms")
    result["decode_step"] = step

    # ---- checks
    bad_err = [r for r in rows if r["triton_rel_err"] is not None and not r["triton_rel_err"] < MAX_REL_ERR]
    checks = result["dispatch_checks"]
    bad_report = [c for c in checks if not c["report_ok"]]
    bad_disp_err = [c for c in checks if not c["err_ok"]]
    bad_repeat = [c for c in checks if c.get("repeat_mismatches")]
    failed_cands = sum(r["candidates_failed"] for r in rows)
    log("")
    log(f"checks: best-config rel err < {MAX_REL_ERR:g}: {'ok' if not bad_err else bad_err}; "
        f"dispatch report names the choice: {'ok' if not bad_report else 'FAIL'}; dispatch output vs F.linear: "
        f"{'ok' if not bad_disp_err else 'FAIL'}; split-K repeats bitwise equal: "
        f"{'ok' if not bad_repeat else 'FAIL'}; candidates that failed (compile/resources/accuracy): "
        f"{failed_cands}")
    for c in bad_report + bad_disp_err + bad_repeat:
        log(f"  FAIL {c}")
    for e in result["errors"]:
        log(f"  ERROR {e}")
    result["checks_ok"] = not (bad_err or bad_report or bad_disp_err or bad_repeat or result["errors"])
    result["elapsed_s"] = time.perf_counter() - t_start
    write_json(out_dir / "gemm_bench.json", result)
    log(f"wrote {out_dir / 'gemm_bench.json'} and {out_dir / 'gemm_table.json'} in {result['elapsed_s']:.0f} s")
    if args.merge_into and result["checks_ok"]:
        label = args.model + (f", tensor-parallel {args.tp}" if args.tp > 1 else "")
        held = G.merge_gemm_table(args.merge_into, label, meta)
        log(f"merged into {args.merge_into} under {label!r}: {held} entries")
    elif args.merge_into:
        log(f"not merged into {args.merge_into}: a check failed")
    return 0 if result["checks_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
