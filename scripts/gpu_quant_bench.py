"""W4A16 decode-GEMM benchmark on one GPU, for the Qwen2.5-7B projections (AWQ and GPTQ, 4-bit, g128).

Two modes:

``--mode variants`` (default; about 3 minutes on an H200, most of it Triton compiling, in parallel): the
GEMV kernel's variants (``quant_gemv.VARIANTS``: tile, field, row, half2, mma), each over a few tile configs and
split-K depths, at M = 1 and 2. Prints per shape and format the best config of each variant (µs, % of the
int4 floor) next to cuBLAS on the bf16 weight, the 28-layer totals per variant, and the best *single*
config per (format, M) over the four shapes (the candidate default for ``pick_gemv_config``). Writes
$OUT/quant_gemv_variants.json (every candidate's time; ``--out`` overrides $OUT).
    python scripts/gpu_quant_bench.py [--ms 1,2] [--fmts awq,gptq] [--variants tile,field,row] [--jobs 14]

``--mode profile``: each (format, shape) once with the engine's default config at M = 1, after one warm-up pass
over all of them, for a profiler: the timed pass is the last ``len(fmts) · len(shapes)`` GEMV launches.
    ncu --clock-control none --set full -k regex:quant_gemv --launch-skip 8 --launch-count 8 \
        python scripts/gpu_quant_bench.py --mode profile

``--mode classic``: the earlier sweep, GEMV ``tile`` candidates against the fused GEMM kernel and cuBLAS at
M = 1, 2, 4 (..16); writes $OUT/quant_bench.json.
    python scripts/gpu_quant_bench.py --mode classic [--ms 1,2,4,8,16] [--fmts awq,gptq]

Every call is timed inside a CUDA graph with the weight rotated past L2 (``gemm_tuner.cuda_graph_timer``) and
checked first against the torch reference (max |Δ| / max |ref| < 1e-2). The floor = bytes of the packed
weight, scales, zeros, x and y over the device-to-device copy bandwidth measured in the run. In variants mode
the kernels are first compiled by ``--jobs`` worker processes into Triton's on-disk cache (same
specialization as the timed calls), then the timing process loads them.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from nvllm.kernels.quant_gemm import quant_gemm, quant_gemm_reference  # noqa: E402
from nvllm.kernels.quant_gemv import VARIANTS, gemv_supported, quant_gemv  # noqa: E402
from nvllm.quant.formats import QuantWeight, pack_awq, pack_gptq  # noqa: E402

HIDDEN, INTER, LAYERS = 3584, 18944, 28
SHAPES = {"qkv": (4608, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}
GROUP = 128
DEVICE = os.environ.get("NVLLM_BENCH_DEVICE", "cuda")   # "cpu": a dry run under TRITON_INTERPRET=1 (tests)
GEMV_TILES = {  # classic mode, fmt: candidate configs (split_k None = about two waves of programs)
    "gptq": [dict(block_n=bn, block_k=bk, num_warps=4, stages=st, split_k=sk) for bn, bk, st, sk in
             itertools.product((16, 32, 64, 128), (64, 128), (1, 3), (None, 1))]
    + [dict(block_n=32, block_k=128, num_warps=4, stages=1, split_k=None, magic=1)],
    "awq": [dict(block_n=bn, block_k=bk, num_warps=4, stages=st) for bn, bk, st in
            itertools.product((64, 128), (64, 128), (1, 3))],
}
MAX_TILE_PRODUCTS = 32768   # block_m · block_k · block_n: past this the products no longer fit in registers

# variants mode: (fmt, variant) → (block_n, block_k, num_warps, stages). Threads run along N (one column, or
# for AWQ one packed word, per thread and repeat), so BLOCK_N / (32 · num_warps) columns (GPTQ) or words (AWQ)
# per thread: the x loads are shared by that many columns. "row" unrolls BLOCK_K (AWQ) / BLOCK_K/8 (GPTQ)
# word-row loads per K step, which costs compile time past 32 / 16 of them.
VARIANT_TILES: dict[tuple[str, str], list[tuple[int, int, int, int]]] = {
    ("gptq", "tile"): [(128, 128, 4, 3), (64, 128, 4, 3), (128, 64, 4, 1), (64, 64, 4, 1)],
    ("awq", "tile"): [(128, 128, 4, 3), (64, 128, 4, 3), (128, 64, 4, 1), (64, 64, 4, 1)],
    ("gptq", "field"): [(128, 64, 1, 3), (256, 64, 1, 3), (256, 32, 1, 3), (512, 32, 2, 3)],
    ("awq", "field"): [(256, 32, 1, 3), (128, 64, 1, 3), (512, 32, 2, 3), (256, 16, 1, 3)],
    ("gptq", "row"): [(128, 128, 1, 3), (128, 128, 1, 1), (256, 64, 1, 3), (256, 64, 1, 1), (256, 128, 2, 3),
                      (512, 64, 2, 3), (512, 128, 4, 3), (128, 64, 1, 3), (64, 64, 1, 1), (128, 32, 1, 1)],
    ("gptq", "half2"): [(128, 64, 1, 3), (128, 64, 1, 1), (128, 128, 1, 3), (256, 64, 1, 3), (256, 64, 1, 1),
                        (256, 128, 2, 3), (512, 64, 2, 3), (64, 64, 1, 1)],
    # mma: eight subtiles of 8 columns, BLOCK_K / 32 mma steps per K step, one warp; any row count ≤ 8
    ("gptq", "mma"): [(64, 128, 1, 1), (64, 64, 1, 1), (64, 32, 1, 1)],
    ("awq", "row"): [(256, 32, 1, 3), (256, 32, 1, 1), (512, 32, 1, 3), (512, 16, 1, 3), (512, 16, 2, 3),
                     (1024, 16, 2, 3), (1024, 32, 4, 1)],
}
# half2 at several rows (each word dequantized once for all of them): fewer words a step as rows grow (registers)
HALF2_ROW_TILES: dict[int, list[tuple[int, int, int, int]]] = {
    2: [(256, 64, 1, 1), (256, 32, 1, 1), (512, 64, 2, 1), (128, 64, 1, 1)],
    4: [(256, 32, 1, 1), (256, 16, 1, 1), (512, 32, 2, 1), (512, 64, 4, 1)],
}
WAVES = {"tile": (0, 4)}      # programs per SM that split-K aims at (0: plan_split_k's two waves)
DEFAULT_WAVES = (2, 4, 8)    # --waves overrides
SERIAL_VARIANTS = ("tile", "row", "half2", "mma")   # also timed with split-K finished in the kernel (config serial=1)


def random_weight(fmt: str, n: int, k: int, gen: torch.Generator, device: str = DEVICE) -> QuantWeight:
    """Random codes, zeros and small scales, packed as the checkpoints store them (``gen`` on ``device``)."""
    groups = k // GROUP
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32, device=gen.device)
    zeros = torch.randint(0, 16, (groups, n), generator=gen, dtype=torch.int32, device=gen.device)
    scales = (torch.rand(groups, n, generator=gen, device=gen.device) * 1e-3 + 5e-4).half()
    if fmt == "awq":
        t = pack_awq(q, zeros, scales)
        qw = QuantWeight.from_awq(t["qweight"], t["qzeros"], t["scales"], GROUP)
    else:
        g_idx = torch.arange(k, dtype=torch.int32, device=gen.device) // GROUP
        t = pack_gptq(q, zeros.clamp(1, 15), scales, g_idx, bits=4)
        qw = QuantWeight.from_gptq(t["qweight"], t["qzeros"], t["scales"], None, 4, GROUP)
    return qw.to(device)


def rotated_copies(qw0: QuantWeight, n: int, k: int) -> tuple[list[QuantWeight], int]:
    """Enough copies of the packed weight (≥ 256 MiB in all) that the timed loop never hits L2."""
    packed = sum(t.numel() * t.element_size() for t in (qw0.qweight, qw0.qzeros, qw0.scales))
    copies = max(2, -(-(256 << 20) // packed))
    qws = [qw0] + [QuantWeight(qw0.fmt, 4, GROUP, k, n, qw0.qweight.roll(i, 0), qw0.qzeros, qw0.scales)
                   for i in range(1, copies)]
    return qws, packed


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).abs().max() / ref.abs().max())


def bf16_copies(n: int, k: int) -> list[torch.Tensor]:
    return [torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * 0.02
            for _ in range(max(2, -(-(256 << 20) // (n * k * 2))))]


# ------------------------------------------------------------------------------------------ variants mode


def variant_configs(fmt: str, m: int, variants: list[str]) -> list[dict]:
    """Every (variant, tile) candidate for a format and row count, as quant_gemv config dicts (no waves)."""
    bm = 1 << max(0, (m - 1).bit_length())
    out = []
    for v in variants:
        tiles = VARIANT_TILES.get((fmt, v), [])
        if v == "half2" and bm != 1:   # (4-bit GPTQ only: no AWQ tiles listed)
            tiles = HALF2_ROW_TILES.get(bm, []) if fmt == "gptq" else []
        for bn, bk, nw, st in tiles:
            if v == "tile" and bm * bk * bn > MAX_TILE_PRODUCTS:
                continue
            out.append(dict(variant=v, block_m=bm, block_n=bn, block_k=bk, num_warps=nw, stages=st))
    return out


def cfg_key(fmt: str, m: int, cfg: dict) -> str:
    return (f"{fmt} m{m} {cfg['variant']} n{cfg['block_n']} k{cfg['block_k']} w{cfg['num_warps']} "
            f"s{cfg['stages']}")


_SMALL: dict[str, QuantWeight] = {}


def _compile_task(fmt: str, m: int, cfg: dict) -> tuple[str, float, str | None]:
    """Worker: compile one config, unsplit and split (fp32 atomics; serial), into Triton's on-disk cache, on a small
    weight whose integer arguments specialize as the timed shapes' do (multiples of 16; M = 1 a constant)."""
    t0 = time.time()
    try:
        if fmt not in _SMALL:
            _SMALL[fmt] = random_weight(fmt, 1024, 256, torch.Generator(DEVICE).manual_seed(1))
        qw = _SMALL[fmt]
        x = torch.randn(m, 256, device=DEVICE, dtype=torch.bfloat16)
        runs = [(1, 0), (2, 0)] + ([(2, 1)] if cfg["variant"] in SERIAL_VARIANTS else [])
        for split, serial in runs:
            quant_gemv(x, qw.qweight, qw.qzeros, qw.scales, fmt=fmt, bits=4, group_size=GROUP, split_k=split,
                       serial=serial, **cfg)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        return cfg_key(fmt, m, cfg), time.time() - t0, None
    except Exception as e:  # noqa: BLE001 — reported, the config is then skipped
        return cfg_key(fmt, m, cfg), time.time() - t0, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def precompile(tasks: list[tuple[str, int, dict]], jobs: int) -> dict[str, str]:
    """Compile all tasks in ``jobs`` spawned processes; returns {config key: error} of those that failed."""
    t0 = time.time()
    failed = {}
    if jobs <= 1:
        results = [_compile_task(*t) for t in tasks]
    else:
        # the slowest first (variant row unrolls one load per word row), so the pool does not end on one
        def cost(t):
            fmt, m, cfg = t
            return m * (cfg["block_k"] // (1 if fmt == "awq" else 8) if cfg["variant"] == "row" else 4)
        order = sorted(tasks, key=cost, reverse=True)
        try:
            with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn")) as pool:
                results = list(pool.map(_compile_task, *zip(*order)))
        except Exception as e:  # noqa: BLE001 — e.g. a worker died: the timing process compiles what is missing
            print(f"  parallel compile failed ({type(e).__name__}: {e}); compiling on first use instead")
            return failed
    slow = max(results, key=lambda r: r[1])
    for key, _, err in results:
        if err:
            failed[key] = err
            print(f"  compile failed: {key}: {err}")
    print(f"compiled {len(tasks)} configs in {time.time() - t0:.0f} s ({jobs} processes; slowest "
          f"{slow[1]:.0f} s: {slow[0]})", flush=True)
    return failed


def run_variants(args, bw: float, out: Path) -> None:
    from nvllm.kernels.gemm_tuner import cuda_graph_timer

    t_start = time.time()
    fmts, ms, shapes = args.fmts.split(","), [int(m) for m in args.ms.split(",")], args.shapes.split(",")
    variants = args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"unknown variant {v!r}; the kernel has {VARIANTS}")
    tasks = [(f, m, c) for f in fmts for m in ms for c in variant_configs(f, m, variants)]
    failed = precompile(tasks, args.jobs)
    res = {"card": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "bandwidth_Bps": bw,
           "commit": os.environ.get("NVLLM_COMMIT", "unknown"), "rows": []}
    deadline = t_start + 60 * args.max_minutes
    gen = torch.Generator(DEVICE).manual_seed(0)
    for fmt in fmts:
        for name in shapes:
            n, k = SHAPES[name]
            qws, packed = rotated_copies(random_weight(fmt, n, k, gen), n, k)
            dense = bf16_copies(n, k)
            for m in ms:
                x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
                ref = quant_gemm_reference(x, qws[0]).float()
                nbytes = packed + 2 * m * (n + k)
                row = {"fmt": fmt, "shape": name, "n": n, "k": k, "m": m, "floor_us": 1e6 * nbytes / bw}
                row["cublas_bf16_us"] = 1e6 * cuda_graph_timer(lambda i: F.linear(x, dense[i % len(dense)]),
                                                                len(dense), 2 * n * k / bw)
                cands = []
                for cfg in variant_configs(fmt, m, variants):
                    key = cfg_key(fmt, m, cfg)
                    if key in failed or not gemv_supported(m, k, GROUP, False, cfg["block_k"]):
                        continue
                    serials = (0, 1) if cfg["variant"] in SERIAL_VARIANTS else (0,)
                    for waves, serial in itertools.product(WAVES.get(cfg["variant"], args.waves), serials):
                        if time.time() > deadline:
                            break

                        def call(i, cfg=cfg, waves=waves, serial=serial):
                            return quant_gemv(x, qws[i].qweight, qws[i].qzeros, qws[i].scales, fmt=fmt, bits=4,
                                              group_size=GROUP, waves=waves, serial=serial, **cfg)
                        try:
                            err = max(rel_err(call(0), ref), rel_err(call(0), ref))   # twice: serial resets
                            if err >= 1e-2:
                                print(f"  WRONG {name} {key} waves {waves} serial {serial}: rel err {err:.3g}")
                                continue
                            t = cuda_graph_timer(call, len(qws), nbytes / bw)
                        except Exception as e:  # noqa: BLE001 — e.g. out of shared memory
                            print(f"  skip {name} {key} waves {waves} serial {serial}: {type(e).__name__}")
                            break
                        cands.append({**cfg, "waves": waves, "serial": serial, "us": 1e6 * t, "rel_err": err})
                cands.sort(key=lambda c: c["us"])
                row["candidates"] = cands
                row["best"] = {v: next((c for c in cands if c["variant"] == v), None) for v in variants}
                res["rows"].append(row)
                cells = " ".join(f"{v} {b['us']:6.2f} ({100 * row['floor_us'] / b['us']:3.0f}%)" if b else f"{v} -"
                                 for v, b in row["best"].items())
                print(f"{fmt:4s} {name:7s} m={m} floor {row['floor_us']:5.2f} cuBLAS {row['cublas_bf16_us']:6.2f} | "
                      f"{cells}   [{time.time() - t_start:.0f} s]", flush=True)
                (out / "quant_gemv_variants.json").write_text(json.dumps(res, indent=1))
            del qws, dense
            torch.cuda.empty_cache()
    if time.time() > deadline:
        print(f"!! --max-minutes {args.max_minutes} reached: later candidates were not timed")
    report_variants(res["rows"], fmts, ms, shapes, variants)


def _cfg_str(c: dict) -> str:
    return (f"{c['variant']} n{c['block_n']} k{c['block_k']} w{c['num_warps']} s{c['stages']} "
            f"waves{c['waves']}{' serial' if c['serial'] else ''}")


def report_variants(rows: list[dict], fmts, ms, shapes, variants) -> None:
    print("\nbest config per shape and variant (µs, % of the int4 floor):")
    for r in rows:
        for v, b in r["best"].items():
            if b:
                print(f"  {r['fmt']:4s} {r['shape']:7s} m={r['m']} {b['us']:7.2f} µs "
                      f"{100 * r['floor_us'] / b['us']:4.0f}%  {_cfg_str(b)}")
    print(f"\nall {LAYERS} layers (one decode step's four projections), ms:")
    for fmt in fmts:
        for m in ms:
            sel = [r for r in rows if r["fmt"] == fmt and r["m"] == m]
            if len(sel) != len(shapes):
                continue
            tot = lambda f: LAYERS * sum(f(r) for r in sel) / 1e3  # noqa: E731
            cells = []
            for v in variants:
                if all(r["best"][v] for r in sel):
                    cells.append(f"{v} {tot(lambda r: r['best'][v]['us']):.3f}")
            best_any = tot(lambda r: r["candidates"][0]["us"]) if all(r["candidates"] for r in sel) else float("nan")
            print(f"  {fmt:4s} m={m}: floor {tot(lambda r: r['floor_us']):.3f}  cuBLAS bf16 "
                  f"{tot(lambda r: r['cublas_bf16_us']):.3f}  | {'  '.join(cells)}  | best per shape {best_any:.3f}")
    print("\nbest single config per (format, M) over the four shapes (candidate default), 28-layer ms:")
    tuned = []
    for fmt in fmts:
        for m in ms:
            sel = [r for r in rows if r["fmt"] == fmt and r["m"] == m]
            if len(sel) != len(shapes):
                continue
            sums: dict[str, list[float]] = {}
            cfgs: dict[str, dict] = {}
            for r in sel:
                for c in r["candidates"]:
                    sums.setdefault(_cfg_str(c), []).append(c["us"])
                    cfgs[_cfg_str(c)] = c
            full = sorted((sum(t), c) for c, t in sums.items() if len(t) == len(sel))
            per_shape = sum(r["candidates"][0]["us"] for r in sel if r["candidates"])
            for rank, (t, c) in enumerate(full[:3]):
                print(f"  {fmt:4s} m={m} #{rank + 1}: {LAYERS * t / 1e3:.3f} ms ({100 * per_shape / t:.0f}% of the "
                      f"per-shape best)  {c}")
            if full:
                best = cfgs[full[0][1]]
                keys = ("variant", "block_n", "block_k", "num_warps", "stages", "waves", "serial")
                tuned.append(f"    ({fmt!r}, 4, {best['block_m']}): dict("
                             + ", ".join(f"{k}={best[k]!r}" for k in keys) + "),")
    if tuned:
        print("\nas quant_gemv.TUNED entries:\n" + "\n".join(tuned))


# ------------------------------------------------------------------------------------------- classic mode


def run_classic(args, bw: float, out: Path) -> None:
    from nvllm.kernels.gemm_tuner import cuda_graph_timer

    ms = [int(m) for m in args.ms.split(",")]
    res = {"card": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "bandwidth_Bps": bw,
           "commit": os.environ.get("NVLLM_COMMIT", "unknown"), "rows": []}
    gen = torch.Generator().manual_seed(0)
    for fmt in args.fmts.split(","):
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            qws, packed = rotated_copies(random_weight(fmt, n, k, gen), n, k)
            qw0 = qws[0]
            copies = len(qws)
            dense = bf16_copies(n, k)
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = quant_gemm_reference(x, qw0).float()
                nbytes = packed + 2 * m * (n + k)

                def rel(y):
                    return rel_err(y, ref)

                row = {"fmt": fmt, "shape": name, "n": n, "k": k, "m": m}
                row["cublas_bf16_us"] = 1e6 * cuda_graph_timer(lambda i: F.linear(x, dense[i % len(dense)]),
                                                                len(dense), 2 * n * k / bw)
                fused = lambda i: quant_gemm(x, qws[i].qweight, qws[i].qzeros, qws[i].scales, fmt=fmt, bits=4,
                                             group_size=GROUP)
                assert rel(fused(0)) < 1e-2, ("fused", rel(fused(0)))
                row["fused_us"] = 1e6 * cuda_graph_timer(fused, copies, nbytes / bw)
                cands = []
                for cfg in GEMV_TILES[fmt]:
                    cfg = {"magic": 0, **cfg}
                    bm = 1 << max(0, (m - 1).bit_length())
                    if (not gemv_supported(m, k, GROUP, False, cfg["block_k"])
                            or bm * cfg["block_k"] * cfg["block_n"] > MAX_TILE_PRODUCTS):
                        continue

                    def call(i, cfg=cfg):
                        return quant_gemv(x, qws[i].qweight, qws[i].qzeros, qws[i].scales, fmt=fmt, bits=4,
                                          group_size=GROUP, **cfg)
                    try:
                        err = rel(call(0))
                        if err >= 1e-2:
                            print(f"  WRONG {fmt} {name} m={m} {cfg}: rel err {err:.3g}")
                            continue
                        t = cuda_graph_timer(call, copies, nbytes / bw)
                    except Exception as e:   # e.g. out of registers / shared memory for this tile
                        print(f"  skip {cfg}: {type(e).__name__}")
                        continue
                    cands.append({**cfg, "us": 1e6 * t})
                cands.sort(key=lambda c: c["us"])
                row["gemv_candidates"] = cands
                best = cands[0] if cands else None
                row["gemv_best"] = best
                row["floor_us"] = 1e6 * nbytes / bw
                res["rows"].append(row)
                b = f"{best['us']:7.2f} ({100 * row['floor_us'] / best['us']:5.1f}%bw) {best}" if best else "-"
                print(f"{fmt:5s} {name:8s} m={m:2d}  cuBLAS bf16 {row['cublas_bf16_us']:7.2f}  "
                      f"fused {row['fused_us']:7.2f}  gemv {b}", flush=True)
                (out / "quant_bench.json").write_text(json.dumps(res, indent=1))
    # one decode step's quantized GEMMs (28 layers), best GEMV vs fused vs bf16 cuBLAS, at each M
    for fmt in args.fmts.split(","):
        for m in ms:
            rows = [r for r in res["rows"] if r["fmt"] == fmt and r["m"] == m]
            if len(rows) == len(SHAPES):
                g = LAYERS * sum(r["gemv_best"]["us"] for r in rows if r["gemv_best"])
                f = LAYERS * sum(r["fused_us"] for r in rows)
                c = LAYERS * sum(r["cublas_bf16_us"] for r in rows)
                fl = LAYERS * sum(r["floor_us"] for r in rows)
                print(f"step {fmt} m={m}: gemv {g / 1e3:.3f} ms, fused {f / 1e3:.3f} ms, cuBLAS bf16 "
                      f"{c / 1e3:.3f} ms, int4 floor {fl / 1e3:.3f} ms")


def run_profile(args, bw: float, out: Path) -> None:
    """One warm-up pass and one pass over every (format, shape) with the default config, M = 1 (for ncu)."""
    gen = torch.Generator(DEVICE).manual_seed(0)
    calls = []
    for fmt in args.fmts.split(","):
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            qw = random_weight(fmt, n, k, gen)
            x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
            calls.append((f"{fmt} {name}", lambda x=x, qw=qw, fmt=fmt: quant_gemv(
                x, qw.qweight, qw.qzeros, qw.scales, fmt=fmt, bits=4, group_size=GROUP)))
    for _, call in calls:
        call()
    torch.cuda.synchronize()
    for label, call in calls:
        call()
        torch.cuda.synchronize()
        print(f"profiled pass: {label}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("variants", "classic", "profile"), default="variants")
    ap.add_argument("--ms", default=None, help="row counts (default: 1,2 variants; 1,2,4 classic)")
    ap.add_argument("--fmts", default="awq,gptq")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--variants", default=",".join(VARIANTS), help="variants mode: which kernel variants")
    ap.add_argument("--jobs", type=int, default=min(14, os.cpu_count() or 1),
                    help="variants mode: compile processes (1: compile in this process)")
    ap.add_argument("--waves", default=",".join(map(str, DEFAULT_WAVES)),
                    help="variants mode: split-K depths to time, as programs per SM (ncu, run AB: 8 left the SMs "
                         "at 0.3-0.4 waves and 10-12%% occupancy)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for the JSON (default $OUT)")
    ap.add_argument("--max-minutes", type=float, default=3.6,
                    help="variants mode: stop timing new candidates after this long (whole run)")
    args = ap.parse_args()
    args.waves = tuple(int(w) for w in args.waves.split(","))
    if args.ms is None:
        args.ms = "1,2" if args.mode == "variants" else "1,2,4"
    from gpu_bench import measure_bandwidth

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bw = measure_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    {"variants": run_variants, "classic": run_classic, "profile": run_profile}[args.mode](args, bw, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
