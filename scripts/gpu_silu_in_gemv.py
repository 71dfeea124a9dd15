"""SiLU·mul left to down_proj's GEMV (``activation.PendingSiluMul``) on one GPU, Qwen2.5-7B shapes: gate_up 37888 ×
3584 and down_proj 3584 × 18944, GPTQ 4-bit g128, one bf16 row.

down_proj's fp32 sums with SiLU·mul in its prologue against the SiLU·mul kernel then the GEMV (largest difference;
the K splits add atomically, in no fixed order) and against the torch references; gate_up's accumulator and the
tickets left zeroed. Then the time of gate_up + SiLU·mul + down_proj each way in a CUDA graph over weight copies
larger than L2 (PDL on, as the engine's graphs run). Results: $OUT/silu_in_gemv.json and a line on stdout.

    python scripts/gpu_silu_in_gemv.py
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import torch  # noqa: E402

HIDDEN, INTER = 3584, 18944


def main() -> None:
    from gpu_quant_bench import random_weight, rotated_copies
    from nvllm.kernels import quant_gemv as QV
    from nvllm.kernels.activation import PendingSiluMul, pending_silu_and_mul, silu_and_mul
    from nvllm.kernels.gemm_tuner import cuda_graph_timer
    from nvllm.kernels.partial_sum import PartialSum
    from nvllm.kernels.quant_gemm import quant_gemm_reference, quant_linear

    g = torch.Generator("cuda").manual_seed(0)
    gate_up0 = random_weight("gptq", 2 * INTER, HIDDEN, g, "cuda")
    down0 = random_weight("gptq", HIDDEN, INTER, g, "cuda")
    x = torch.randn(1, HIDDEN, generator=g, device="cuda").to(torch.bfloat16)

    def layer(gate_up, down, fused: bool) -> PartialSum:
        ps = quant_linear(x, gate_up, None, partial=True)
        y = pending_silu_and_mul(ps) if fused else silu_and_mul(ps)
        assert isinstance(y, PendingSiluMul) == fused
        return quant_linear(y, down, None, partial=True)

    got = layer(gate_up0, down0, True)
    fused = got.acc.clone()
    got.finish()
    assert all(not b.any() for b in QV._TICKETS.values()), "tickets left non-zero"
    want = layer(gate_up0, down0, False)
    unfused = want.acc.clone()
    want.finish()
    h = quant_gemm_reference(x, gate_up0, None)
    ref = quant_gemm_reference(torch.nn.functional.silu(h[:, :INTER]) * h[:, INTER:], down0, None).float()
    res = {"card": torch.cuda.get_device_name(),
           "max_diff_vs_kernel": ((fused - unfused).abs().max() / unfused.abs().max()).item(),
           "max_diff_vs_reference": ((fused - ref).abs().max() / ref.abs().max()).item(),
           "kernel_vs_reference": ((unfused - ref).abs().max() / ref.abs().max()).item()}
    assert res["max_diff_vs_reference"] < 2e-2, res
    gate_ups, _ = rotated_copies(gate_up0, 2 * INTER, HIDDEN)
    downs, _ = rotated_copies(down0, HIDDEN, INTER)
    n = min(len(gate_ups), len(downs))
    for name, on in (("fused_us", True), ("kernel_us", False)):
        res[name] = cuda_graph_timer(lambda i, on=on: layer(gate_ups[i], downs[i], on).finish(), n, 4e-5) * 1e6
    out = Path(os.environ.get("OUT", "."))
    (out / "silu_in_gemv.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
