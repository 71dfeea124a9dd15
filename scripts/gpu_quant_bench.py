"""W4A16 decode-GEMM benchmark on one GPU: the GEMV kernel's tile candidates against the fused GEMM kernel and
cuBLAS on the bf16 weight, for the Qwen2.5-7B projections at M = 1, 2, 4, 8, 16, AWQ and GPTQ (4-bit, g128).

Usage (repository root, one GPU; about 2 minutes on an H200, most of it Triton compiling):
    python scripts/gpu_quant_bench.py [--ms 1,2,4,8,16] [--fmts awq,gptq]

Every call is timed inside a CUDA graph with the weight rotated past L2 (``gemm_tuner.cuda_graph_timer``) and
checked first against the torch reference (max |Δ| / max |ref| < 1e-2). %bw = bytes of the packed weight,
scales, zeros, x and y over time, against a device-to-device copy measured in the run. Prints a table;
writes $OUT/quant_bench.json (every candidate's time).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gpu_bench import measure_bandwidth  # noqa: E402
from nvllm.kernels.gemm_tuner import cuda_graph_timer  # noqa: E402
from nvllm.kernels.quant_gemm import quant_gemm, quant_gemm_reference  # noqa: E402
from nvllm.kernels.quant_gemv import gemv_supported, quant_gemv  # noqa: E402
from nvllm.quant.formats import QuantWeight, pack_awq, pack_gptq  # noqa: E402

HIDDEN, INTER, LAYERS = 3584, 18944, 28
SHAPES = {"qkv": (4608, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}
GROUP = 128
DEVICE = "cuda"
GEMV_TILES = {  # fmt: candidate configs (split_k None = about two waves of programs)
    "gptq": [dict(block_n=bn, block_k=bk, num_warps=4, stages=st, split_k=sk) for bn, bk, st, sk in
             itertools.product((16, 32, 64, 128), (64, 128), (1, 3), (None, 1))]
    + [dict(block_n=32, block_k=128, num_warps=4, stages=1, split_k=None, magic=1)],
    "awq": [dict(block_n=bn, block_k=bk, num_warps=4, stages=st) for bn, bk, st in
            itertools.product((64, 128), (64, 128), (1, 3))],
}
MAX_TILE_PRODUCTS = 32768   # block_m · block_k · block_n: past this the products no longer fit in registers


def random_weight(fmt: str, n: int, k: int, gen: torch.Generator) -> QuantWeight:
    """Random codes, zeros and small scales, packed as the checkpoints store them, on the GPU."""
    groups = k // GROUP
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.int32)
    zeros = torch.randint(0, 16, (groups, n), generator=gen, dtype=torch.int32)
    scales = (torch.rand(groups, n, generator=gen) * 1e-3 + 5e-4).half()
    if fmt == "awq":
        t = pack_awq(q, zeros, scales)
        qw = QuantWeight.from_awq(t["qweight"], t["qzeros"], t["scales"], GROUP)
    else:
        g_idx = torch.arange(k, dtype=torch.int32) // GROUP
        t = pack_gptq(q, zeros.clamp(1, 15), scales, g_idx, bits=4)
        qw = QuantWeight.from_gptq(t["qweight"], t["qzeros"], t["scales"], None, 4, GROUP)
    return qw.to(DEVICE)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,2,4")
    ap.add_argument("--fmts", default="awq,gptq")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "."))
    ms = [int(m) for m in args.ms.split(",")]
    bw = measure_bandwidth()
    res = {"card": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "bandwidth_Bps": bw,
           "commit": os.environ.get("NVLLM_COMMIT", "unknown"), "rows": []}
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    gen = torch.Generator().manual_seed(0)
    for fmt in args.fmts.split(","):
        for name in args.shapes.split(","):
            n, k = SHAPES[name]
            qw0 = random_weight(fmt, n, k, gen)
            packed = sum(t.numel() * t.element_size() for t in (qw0.qweight, qw0.qzeros, qw0.scales))
            copies = max(2, -(-(256 << 20) // packed))   # ≥ 256 MiB of weights: never L2-resident
            qws = [qw0] + [QuantWeight(qw0.fmt, 4, GROUP, k, n, qw0.qweight.roll(i, 0), qw0.qzeros, qw0.scales)
                           for i in range(1, copies)]
            dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                     for _ in range(max(2, -(-(256 << 20) // (n * k * 2))))]
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = quant_gemm_reference(x, qw0).float()
                nbytes = packed + 2 * m * (n + k)

                def rel(y):
                    return float((y.float() - ref).abs().max() / ref.abs().max())

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
    return 0


if __name__ == "__main__":
    sys.exit(main())
