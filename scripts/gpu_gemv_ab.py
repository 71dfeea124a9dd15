"""Decode GEMV defaults compared on one GPU, in one process: for each named setting (``quant_gemv.TUNED`` entries
changed), the four Qwen2.5-7B projections timed alone, then the engine's GPTQ decode (batch-1 TPOT and the decode
step at several batch sizes). Settings run in the order given; repeat one to see the run-to-run spread.

    python scripts/gpu_gemv_ab.py \
        --settings '{"p0": {"gptq,4,1": {"prefetch": 0}}, "p8": {"gptq,4,1": {"prefetch": 8}}}'

Per projection: ``quant_gemv`` at M = 1 with the setting's defaults into a PartialSum-style fp32 accumulator (as the
engine calls it), checked against the torch reference once, then timed in a CUDA graph over copies of the weight
that together exceed L2 (``gpu_quant_bench.rotated_copies``). Results: $OUT/gemv_ab.json and a table on stdout,
with the registers of each one-row ``half2`` kernel compiled along the way (a change to the loop that costs
occupancy shows there first).
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


def parse_settings(text: str) -> dict[str, dict]:
    """``{"name": {"fmt,bits,rows": {config…}, "env": {VAR: value}}}`` → ``{"name": {(fmt, bits, rows): {config…},
    "env": {…}}}`` (``env``: environment variables set while the setting runs, e.g. ``NVLLM_PDL_EARLY_PARAMS``)."""
    out = {}
    for name, entries in json.loads(text).items():
        out[name] = {}
        for key, cfg in entries.items():
            if key == "env":
                out[name]["env"] = {k: str(v) for k, v in cfg.items()}
                continue
            fmt, bits, rows = key.split(",")
            out[name][(fmt, int(bits), int(rows))] = cfg
    return out


def watch_registers() -> dict[str, str]:
    """Registers and spilled bytes of every one-row ``half2`` kernel launched from now on, by its K-loop
    constexprs (the launch returns the compiled kernel)."""
    from nvllm.kernels import quant_gemv_half2 as QH

    seen: dict[str, str] = {}
    run = QH.quant_gemv_half2_kernel.run

    def watched(*args, **kw):
        k = run(*args, **kw)
        key = ",".join(f"{c}={kw.get(c)}" for c in ("X_SPAN", "EARLY", "MERGE", "STAGES"))
        seen[key] = f"{k.n_regs} registers, {k.n_spills} spilled"
        return k

    QH.quant_gemv_half2_kernel.run = watched
    return seen


def shape_times() -> dict[str, float]:
    """µs per call of each projection at M = 1 (GPTQ 4-bit g128, the defaults in force), and their sum × 28 in ms."""
    from gpu_quant_bench import SHAPES, random_weight, rotated_copies
    from nvllm.kernels import quant_gemv as QV
    from nvllm.kernels.gemm_tuner import cuda_graph_timer
    from nvllm.kernels.quant_gemm import quant_gemm_reference

    g = torch.Generator("cuda").manual_seed(0)
    res = {}
    for name, (n, k) in SHAPES.items():
        qw0 = random_weight("gptq", n, k, g, "cuda")
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        acc = torch.zeros(1, n, device="cuda", dtype=torch.float32)
        y = QV.quant_gemv(x, qw0.qweight, qw0.qzeros, qw0.scales, fmt="gptq", bits=4, group_size=128, acc=acc)
        ref = quant_gemm_reference(x, qw0, None).float()
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        assert err < 5e-3, (name, err)
        qws, _ = rotated_copies(qw0, n, k)
        res[name] = cuda_graph_timer(lambda i: QV.quant_gemv(x, qws[i].qweight, qws[i].qzeros, qws[i].scales,
                                                             fmt="gptq", bits=4, group_size=128, acc=acc),
                                     len(qws), 1e-5) * 1e6
        del qws
    res["28 layers ms"] = sum(res[s] for s in SHAPES) * 28 / 1000
    return res


def main() -> None:
    import gpu_bench as GB

    ap = argparse.ArgumentParser()
    ap.add_argument("--settings", required=True, help='{"name": {"gptq,4,1": {quant_gemv config…}}, …}')
    ap.add_argument("--batches", default="1,2,4,8", help="decode-step batch sizes (256-token contexts)")
    ap.add_argument("--tokenizer-dir", default=str(REPO / ".carry/qwen2.5"))
    ap.add_argument("--skip-shapes", action="store_true")
    ap.add_argument("--skip-engine", action="store_true")
    args = ap.parse_args()
    settings = parse_settings(args.settings)
    batches = tuple(int(b) for b in args.batches.split(",") if b)
    out = Path(os.environ.get("OUT", "."))
    res: dict = {"card": torch.cuda.get_device_name(), "command": " ".join(sys.argv),
                 "commit": os.environ.get("NVLLM_COMMIT", "unknown"), "settings": json.loads(args.settings)}
    save = lambda: (out / "gemv_ab.json").write_text(json.dumps(res, indent=1))
    model_dir = None if args.skip_engine else GB.build_model_dir(Path(args.tokenizer_dir))
    res["half2_registers"] = watch_registers()
    rows = []
    for name, setting in settings.items():
        row = {}
        env = setting.pop("env", {})
        if not args.skip_shapes:
            row_shapes = GB.with_envs(env, lambda: GB.with_tuned(setting, shape_times, merge=True))
            res[f"{name}_shapes_us"] = row_shapes
            row.update(row_shapes)
        if model_dir is not None:
            GB.with_envs(env, lambda: GB.with_tuned(setting, lambda: GB.quant_runs(
                model_dir, res, ["gptq"], save, suffix="_" + name, batches=batches), merge=True))
            row["tpot ms"] = res[f"nvllm_gptq_w4_{name}_tpot_ms"]
            for b in batches:
                row[f"b{b} step ms"] = res[f"nvllm_gptq_w4_{name}_b{b}_step_ms"]
            greedy = res[f"nvllm_gptq_w4_{name}_greedy"]
            first = res.setdefault("greedy_first_setting", greedy)
            row["greedy = first"] = float(greedy == first)   # the same weights (seeded): the same tokens
        save()
        rows.append((name, row))
        print(name, " ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
    for key, regs in res["half2_registers"].items():
        print(f"half2 {key}: {regs}")
    cols = list(rows[0][1]) if rows else []
    print("| setting | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name, row in rows:
        print(f"| {name} | " + " | ".join(f"{row[c]:.3f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
