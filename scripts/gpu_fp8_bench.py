"""FP8-weight GEMM (W8A16, ``nvllm.kernels.fp8_gemm``) on one GPU, for the Qwen2.5-7B projections: checked against
its torch reference, then timed against cuBLAS on the bf16 weight at each M, for 128×128 block scales (Qwen3-FP8,
DeepSeek-V3) and per-row scales (``--quantization fp8``, FP8_DYNAMIC checkpoints). Up to M = 4 it also times the
CUDA-core ``fp8_gemv``. ``--sweep``: a few tile configs of each kernel at M = 1, the best printed next to the
default. From 8 rows on it also times W8A8 (``nvllm.kernels.fp8_w8a8``: the tokens quantized to FP8,
``torch._scaled_mm``) after checking its quantizer's bytes against torch's conversion: per token with per-row
scales (rows of at most 4096 inputs), and per token and 128 inputs against the weight's 128×128 blocks and against
1×128 weight scales (``block_weight_scales``' layouts; per-row scales repeated over the groups), with a bf16 bias
fused.

    python3 scripts/gpu_fp8_bench.py [--ms 1,2,4,8,16,64,256,2048] [--scales block128,row] [--sweep]

Every call runs inside a CUDA graph with the weight rotated past L2 (``gemm_tuner.cuda_graph_timer``). The floor is
the FP8 weight's bytes (and its scales') over the device-to-device copy bandwidth measured in the run. Writes
$OUT/fp8_bench.json (``--out`` overrides $OUT).
"""

from __future__ import annotations

import argparse
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

from nvllm.kernels.fp8_gemm import _pick_config, fp8_dequantize, fp8_gemm, fp8_gemm_reference, fp8_gemv  # noqa: E402
from nvllm.kernels.fp8_w8a8 import (MAX_ROW, block_weight_scales, quantize_token_groups,  # noqa: E402
                                    quantize_token_groups_reference, quantize_tokens, quantize_tokens_reference,
                                    scaled_mm_runs, w8a8_block_linear, w8a8_block_reference, w8a8_linear,
                                    w8a8_reference)
from nvllm.kernels.gemm_tuner import cuda_graph_timer  # noqa: E402
from nvllm.quant.fp8 import Fp8Scheme, quantize_blocks, quantize_rows, scale_rows  # noqa: E402

HIDDEN, INTER, LAYERS = 3584, 18944, 28
SHAPES = {"qkv": (4608, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}
SWEEP = [dict(block_n=bn, num_warps=w, num_stages=3) for bn in (64, 128, 256) for w in (4, 8)]   # K tile: the default
GEMV_SWEEP = [dict(block_n=bn, block_k_tile=bk, num_warps=w) for bn in (8, 16, 32) for bk in (256, 512)
              for w in (4, 8)]


def weights(n: int, k: int, scales: str) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Copies (≥ 256 MiB in all) of one random FP8 weight with its per-row scales: (q, scale, block_k)."""
    w = torch.randn(n, k, device="cuda") * 0.02
    if scales == "block128":
        q, s = quantize_blocks(w, (128, 128))
        s, bk = scale_rows(s, Fp8Scheme("block", (128, 128)), n, k, "w"), 128
    else:
        (q, s), bk = quantize_rows(w), k
    copies = max(2, -(-(256 << 20) // (n * k)))
    u8 = q.view(torch.uint8)   # torch has no roll for float8 on the GPU: rolled as bytes
    return [(u8.roll(i, 0).view(q.dtype), s, bk) for i in range(copies)]


def block_w8a8(row: dict, x: torch.Tensor, ws: list, scales: str, floor_s: float) -> None:
    """W8A8 per token and 128 inputs: the quantizer's bytes and scales against torch's, each weight-scale layout's
    product (a bf16 bias fused) against its reference, then its time, into ``row``."""
    q, s, bk = ws[0]
    n, k = q.shape
    qx, sx = quantize_token_groups(x)
    want_q, want_s = quantize_token_groups_reference(x)
    row["w8a8_block_bytes_differ"] = int((qx.view(torch.uint8) != want_q.view(torch.uint8)).sum())
    row["w8a8_block_scales_differ"] = int((sx != want_s).sum())
    if row["w8a8_block_bytes_differ"] or row["w8a8_block_scales_differ"]:
        raise SystemExit(f"{scales} {row['shape']} M={row['m']}: the group quantizer's bytes / scales off torch's in "
                         f"{row['w8a8_block_bytes_differ']} / {row['w8a8_block_scales_differ']} places")
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    ref = w8a8_block_reference(x, q, s, bk, bias).float()
    for layout in ("1x128", "128x128"):
        wsc = block_weight_scales(s, bk, k, layout)
        if wsc is None:
            continue
        err = float((w8a8_block_linear(x, q, wsc, bias).float() - ref).abs().max() / ref.abs().max())
        row[f"w8a8_{layout}_err"] = err
        if err > 2e-2:
            raise SystemExit(f"{scales} {row['shape']} M={row['m']}: w8a8 {layout} off its reference by {err:.3g}")
        row[f"w8a8_{layout}_us"] = cuda_graph_timer(lambda i: w8a8_block_linear(x, ws[i % len(ws)][0], wsc), len(ws),
                                                    floor_s) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ms", default="1,2,4,8,16,64,256,2048")
    ap.add_argument("--scales", default="block128,row")
    ap.add_argument("--sweep", action="store_true", help="also a few tile configs at M = 1")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    from gpu_bench import measure_bandwidth

    bw = measure_bandwidth()
    res = {"card": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "bandwidth_Bps": bw, "rows": []}
    res["block_scaled_mm"] = scaled_mm_runs(torch.device("cuda"), "block")
    print(f"{res['card']}, copy bandwidth {bw / 1e12:.2f} TB/s, block-wise _scaled_mm runs: {res['block_scaled_mm']}")
    ms = [int(m) for m in args.ms.split(",")]
    totals: dict[tuple[str, int], list[float]] = {}
    for scales in args.scales.split(","):
        for name, (n, k) in SHAPES.items():
            ws = weights(n, k, scales)
            dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                     for _ in range(max(2, -(-(256 << 20) // (n * k * 2))))]
            floor_s = (n * k + ws[0][1].numel() * 4) / bw
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                q, s, bk = ws[0]
                ref = fp8_gemm_reference(x, q, s, bk).float()
                err = float((fp8_gemm(x, q, s, bk).float() - ref).abs().max() / ref.abs().max())
                if err > 2e-2:
                    raise SystemExit(f"{scales} {name} M={m}: fp8_gemm off its reference by {err:.3g}")
                t_fp8 = cuda_graph_timer(lambda i: fp8_gemm(x, *ws[i % len(ws)]), len(ws), floor_s)
                t_bf16 = cuda_graph_timer(lambda i: F.linear(x, dense[i % len(dense)]), len(dense), 2 * floor_s)
                t_deq = cuda_graph_timer(lambda i: F.linear(x, fp8_dequantize(*ws[i % len(ws)], x.dtype)), len(ws),
                                         3 * floor_s)
                row = {"scales": scales, "shape": name, "m": m, "fp8_us": t_fp8 * 1e6, "bf16_us": t_bf16 * 1e6,
                       "floor_us": floor_s * 1e6, "err": err, "config": _pick_config(m, k, bk, torch.bfloat16),
                       "dequant_matmul_us": t_deq * 1e6}
                if scales == "row" and m >= 8 and k <= MAX_ROW:   # W8A8 per token: bytes as torch's, product as ref
                    qx, sx = quantize_tokens(x)
                    want_q, want_s = quantize_tokens_reference(x)
                    row["w8a8_bytes_differ"] = int((qx.view(torch.uint8) != want_q.view(torch.uint8)).sum())
                    row["w8a8_scales_differ"] = int((sx != want_s).sum())
                    row["w8a8_bytes_equal"] = row["w8a8_bytes_differ"] == row["w8a8_scales_differ"] == 0
                    wref = w8a8_reference(x, q, s).float()
                    row["w8a8_err"] = float((w8a8_linear(x, q, s).float() - wref).abs().max() / wref.abs().max())
                    row["w8a8_vs_w8a16"] = float((wref - ref).abs().max() / ref.abs().max())
                    if row["w8a8_err"] > 2e-2 or not row["w8a8_bytes_equal"]:
                        raise SystemExit(f"{scales} {name} M={m}: w8a8 off its reference by {row['w8a8_err']:.3g}, "
                                         f"{row['w8a8_bytes_differ']} bytes and {row['w8a8_scales_differ']} scales "
                                         "off torch's")
                    row["w8a8_us"] = cuda_graph_timer(lambda i: w8a8_linear(x, *ws[i % len(ws)][:2]), len(ws),
                                                      floor_s) * 1e6
                if m >= 8 and res["block_scaled_mm"]:
                    block_w8a8(row, x, ws, scales, floor_s)
                if m <= 4:   # the CUDA-core kernel for few rows: its default and, with --sweep, the best config
                    row["gemv_us"] = cuda_graph_timer(lambda i: fp8_gemv(x, *ws[i % len(ws)]), len(ws), floor_s) * 1e6
                    gerr = float((fp8_gemv(x, q, s, bk).float() - ref).abs().max() / ref.abs().max())
                    if gerr > 2e-2:
                        raise SystemExit(f"{scales} {name} M={m}: fp8_gemv off its reference by {gerr:.3g}")
                    if args.sweep and m == 1:
                        times = []
                        for cfg in GEMV_SWEEP:
                            times.append((cuda_graph_timer(lambda i, c=cfg: fp8_gemv(x, *ws[i % len(ws)], **c),
                                                           len(ws), floor_s) * 1e6, cfg))
                        row["gemv_best_us"], row["gemv_best_config"] = min(times, key=lambda t: t[0])
                if args.sweep and m == 1:
                    best = None
                    for cfg in SWEEP:
                        try:
                            t = cuda_graph_timer(lambda i, c=cfg: fp8_gemm(x, *ws[i % len(ws)], **c), len(ws),
                                                 floor_s)
                        except Exception as e:  # noqa: BLE001 - a config that does not compile for this shape
                            print(f"  {name} {cfg}: {type(e).__name__}")
                            continue
                        if best is None or t < best[0]:
                            best = (t, cfg)
                    row["best_us"], row["best_config"] = best[0] * 1e6, best[1]
                res["rows"].append(row)
                totals.setdefault((scales, m), [0.0, 0.0, 0.0, 0.0, 0.0])
                for j, key in enumerate(("fp8_us", "bf16_us", "floor_us", "gemv_us", "gemv_best_us")):
                    totals[(scales, m)][j] += row.get(key, 0.0) * LAYERS
                best = f"  dequant+cuBLAS {row['dequant_matmul_us']:.2f} µs"
                for layout in ("1x128", "128x128"):
                    if f"w8a8_{layout}_us" in row:
                        best += (f"  w8a8 {layout} {row[f'w8a8_{layout}_us']:.2f} µs "
                                 f"(err {row[f'w8a8_{layout}_err']:.1e})")
                if "w8a8_us" in row:
                    best += (f"  w8a8 {row['w8a8_us']:.2f} µs (vs w8a16 {row['w8a8_vs_w8a16']:.1e}; bytes/scales off "
                             f"torch's {row['w8a8_bytes_differ']}/{row['w8a8_scales_differ']})")
                best += f"  best {row['best_us']:.2f} µs {row['best_config']}" if "best_us" in row else ""
                if "gemv_us" in row:
                    best += f"  gemv {row['gemv_us']:.2f} µs"
                if "gemv_best_us" in row:
                    best += f" (best {row['gemv_best_us']:.2f} µs {row['gemv_best_config']})"
                print(f"{scales:8s} {name:8s} M={m:5d}  fp8 {row['fp8_us']:9.2f} µs  bf16 {row['bf16_us']:9.2f} µs  "
                      f"({row['bf16_us'] / row['fp8_us']:.2f}×)  floor {row['floor_us']:8.2f} µs  "
                      f"({row['floor_us'] / row['fp8_us']:.0%} of it)  err {err:.1e}{best}")
    print("\n28 layers (4 projections each), ms:")
    for (scales, m), (t8, t16, fl, gv, gvb) in totals.items():
        print(f"{scales:8s} M={m:5d}  fp8 {t8 / 1e3:7.3f}  bf16 {t16 / 1e3:7.3f}  ({t16 / t8:.2f}×)  "
              f"floor {fl / 1e3:.3f}" + (f"  gemv {gv / 1e3:.3f}" if gv else "")
              + (f" (best configs {gvb / 1e3:.3f})" if gvb else ""))
        res.setdefault("totals", []).append({"scales": scales, "m": m, "fp8_ms": t8 / 1e3, "bf16_ms": t16 / 1e3,
                                             "floor_ms": fl / 1e3, "gemv_ms": gv / 1e3, "gemv_best_ms": gvb / 1e3})
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "fp8_bench.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
