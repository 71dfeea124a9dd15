"""The one-launch GPTQ MLP (``nvllm.kernels.quant_mlp``) against the three kernels it replaces, on one GPU, at the
Qwen2.5-7B shapes (hidden 3584, intermediate 18944, 4-bit g128, one bf16 row).

First a check: the fused sums against the torch reference and against the three kernels (largest difference over
the largest sum), and its buffers zeroed after the call. Then the time of a decoder layer's MLP half as the engine
runs it — the residual add + RMSNorm that finishes the previous sums, then the MLP — repeated over weight copies
larger than L2 inside one CUDA graph (with programmatic dependent launch where the GPU has it), each way. The floor
is the MLP's packed bytes over the device-to-device copy bandwidth measured in the run. Results:
$OUT/mlp_bench.json (``--out`` overrides $OUT) and a table.

    python3 scripts/gpu_mlp_bench.py [--reps 9]
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

HIDDEN, INTER = 3584, 18944


def main() -> int:
    from gpu_quant_bench import random_weight
    from nvllm.kernels import quant_mlp as QM
    from nvllm.kernels.activation import silu_and_mul
    from nvllm.kernels.gemm_tuner import cuda_graph_timer
    from nvllm.kernels.quant_gemm import quant_linear
    from nvllm.kernels.rmsnorm import fused_add_rms_norm
    from nvllm.quant.formats import QuantWeight

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    os.environ["NVLLM_KERNELS"] = "triton"
    os.environ["NVLLM_FUSED_MLP"] = "1"
    g = torch.Generator("cuda").manual_seed(0)
    gate_up0 = random_weight("gptq", 2 * INTER, HIDDEN, g, "cuda")
    down0 = random_weight("gptq", HIDDEN, INTER, g, "cuda")
    packed = sum(t.numel() * t.element_size() for w in (gate_up0, down0) for t in (w.qweight, w.qzeros, w.scales))
    copies = max(2, -(-(256 << 20) // packed))

    def rolled(w: QuantWeight, i: int) -> QuantWeight:
        return QuantWeight("gptq", 4, w.group_size, w.in_features, w.out_features, w.qweight.roll(i, 0), w.qzeros,
                           w.scales)

    mlps = [(gate_up0, down0)] + [(rolled(gate_up0, i), rolled(down0, i)) for i in range(1, copies)]
    x = (torch.randn(1, HIDDEN, generator=g, device="cuda") * 0.5).to(torch.bfloat16)
    res: dict[str, object] = {"device": torch.cuda.get_device_name(), "copies": copies, "packed_bytes": packed}

    def three(h, gu, dn):
        return quant_linear(silu_and_mul(quant_linear(h, gu, partial=True)), dn, partial=True)

    # ---- check
    ref = QM.quant_mlp_reference(x, gate_up0, down0)
    fused = QM.quant_mlp(x, gate_up0, down0)
    assert fused is not None, "the fused kernel refused the 7B MLP"
    unfused = three(x, gate_up0, down0)
    scale = ref.abs().max().item()
    res["fused_vs_reference"] = (fused.acc - ref).abs().max().item() / scale
    res["fused_vs_three"] = (fused.acc - unfused.acc).abs().max().item() / scale
    res["three_vs_reference"] = (unfused.acc - ref).abs().max().item() / scale
    fused.finish()
    unfused.finish()
    gu, cnt = QM._STATE[torch.device("cuda", torch.cuda.current_device())][-1]
    res["state_zeroed"] = not gu.any().item() and not cnt.any().item()
    for i in range(3):   # repeated calls: the zeroing holds
        again = QM.quant_mlp(x, gate_up0, down0)
        res[f"repeat_{i}_vs_reference"] = (again.acc - ref).abs().max().item() / scale
        again.finish()
    print({k: v for k, v in res.items() if "vs" in k or "zeroed" in k}, flush=True)

    # ---- bandwidth
    src = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t_copy = cuda_graph_timer(lambda i: dst.copy_(src), 1, 1e-4, reps=args.reps)
    res["copy_tb_s"] = 2 * src.numel() / t_copy / 1e12
    res["floor_us"] = packed / (res["copy_tb_s"] * 1e12) * 1e6

    # ---- replays: the fused MLP and the norm that finishes its sums (new residual = 0 + the sums), in a CUDA graph
    weight = torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16)
    zero_res = torch.zeros(1, HIDDEN, device="cuda", dtype=torch.bfloat16)

    def mlp_and_norm() -> torch.Tensor:
        return fused_add_rms_norm(QM.quant_mlp(x, gate_up0, down0), zero_res, weight, 1e-6)[1]

    mlp_and_norm()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        finished = mlp_and_norm()
    for i in range(3):
        graph.replay()
        torch.cuda.synchronize()
        res[f"replay_{i}_vs_reference"] = (finished.float() - ref).abs().max().item() / scale
    del graph
    res["state_zeroed_after_replays"] = not gu.any().item() and not cnt.any().item()
    print({k: v for k, v in res.items() if "replay" in k}, flush=True)

    # ---- timing: residual add + RMSNorm finishing the previous sums, then the MLP; down's L2 prefetch budgets
    residual = torch.randn(1, HIDDEN, generator=g, device="cuda").to(torch.bfloat16)
    variants = (("three", "0", 8, 0), ("fused", "1", 8, 0), ("fused_dp0", "1", 0, 0), ("fused_dp64", "1", 64, 0),
                ("fused_r128", "1", 8, 128))
    for name, env, budget, regs in variants:
        os.environ["NVLLM_FUSED_MLP"] = env
        QM.DOWN_PREFETCH_MIB, QM.MAXNREG = budget, regs
        state = {"h": x.clone(), "res": residual.clone()}

        def layer(i: int) -> None:
            h, state["res"] = fused_add_rms_norm(state["h"], state["res"], weight, 1e-6)
            gu_w, dn_w = mlps[i]
            y = QM.quant_mlp(h, gu_w, dn_w)
            state["h"] = y if y is not None else three(h, gu_w, dn_w)

        t = cuda_graph_timer(layer, copies, 40e-6, reps=args.reps)
        res[f"{name}_us"] = t * 1e6
        print(f"{name}: {t * 1e6:.2f} µs a layer (norm + MLP)", flush=True)
    res["fused_over_three"] = res["fused_us"] / res["three_us"]
    res["state_zeroed_after_timing"] = not gu.any().item() and not cnt.any().item()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mlp_bench.json").write_text(json.dumps(res, indent=1))
    print(f"| device | copy TB/s | floor µs | three kernels µs | one launch µs | ratio | fused vs ref | vs three |\n"
          f"| {res['device']} | {res['copy_tb_s']:.2f} | {res['floor_us']:.2f} | {res['three_us']:.2f} | "
          f"{res['fused_us']:.2f} | {res['fused_over_three']:.3f} | {res['fused_vs_reference']:.2e} | "
          f"{res['fused_vs_three']:.2e} |")
    print("one launch, down's L2 prefetch budget / registers: " + ", ".join(
        f"{b} MiB / {r or 'any'} {res[n + '_us']:.2f} µs" for n, _, b, r in variants[1:]))
    errors = [v for k, v in res.items() if k.endswith("vs_reference") or k == "fused_vs_three"]
    zeroed = all(v for k, v in res.items() if k.startswith("state_zeroed"))
    # bf16 activations, f16 products: the three kernels' own distance from the reference is the yardstick
    ok = zeroed and max(errors) <= max(4 * res["three_vs_reference"], 1e-3)
    print("checks", "passed" if ok else "FAILED", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
