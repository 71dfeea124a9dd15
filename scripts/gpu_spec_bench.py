"""Speculative-decoding speed on one GPU (issue 8), in one call: Qwen2.5-7B-shaped target (random bf16 weights),
k=4, against plain decoding in the same run.

    python scripts/gpu_spec_bench.py [--tokenizer-dir .carry/qwen2.5] [--acceptance 0.5,0.7,0.8,0.9]

Drafts: a Qwen2.5-0.5B-shaped model (scripts/models/qwen2.5-0.5b) and an INT4 (GPTQ g128) copy of the target's
shapes. Random weights accept nothing, so the runs use the BENCHMARK MODE ``synthetic_acceptance``: each
drafted token is accepted with a fixed probability, whatever the models say — the drafts and the target still
run in full, so the speed at a given acceptance is real; the outputs are not the target's. τ is the mean
number of tokens one target step emits (accepted drafts + 1).

Per draft and acceptance: batch-1 TPOT (128 in / 256 out) and its speedup over plain decoding; at 0.8 also
batch 32 (request throughput against plain decoding, since speculation can lose at large batch).
Prints a table; writes $OUT/spec_bench.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import torch  # noqa: E402

from gpu_bench import QUANT_CONFIGS, build_model_dir  # noqa: E402


def model_copy(src: Path, config_from: Path | None = None, quant: dict | None = None) -> Path:
    d = Path(tempfile.mkdtemp(prefix="spec-"))
    for f in src.iterdir():
        shutil.copy(f, d / f.name)
    cfg = json.loads(((config_from or src) / "config.json").read_text())
    if quant:
        cfg["quantization_config"] = quant
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def measure(llm, config, batch: int) -> dict:
    from nvllm.bench.offline import run_latency

    r = run_latency(config, batch_size=batch, input_len=128, output_len=256, num_iters_warmup=1,
                    num_iters=3 if batch == 1 else 2, progress=False, llm=llm)
    out = {"tpot_ms": r["median_tpot_ms"], "latency_s": r["avg_latency"],
           "output_tok_s": batch * 256 / r["avg_latency"]}
    if "spec_decode_acceptance_length" in r:
        out["tau"] = r["spec_decode_acceptance_length"]
        out["acceptance_pct"] = r["spec_decode_acceptance_rate"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer-dir", default=str(REPO / ".carry/qwen2.5"))
    ap.add_argument("--acceptance", default="0.5,0.7,0.8,0.9")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--drafts", default="0.5b,int4", help="which drafts: 0.5b (the small model), int4 (self-draft)")
    args = ap.parse_args()
    from nvllm.config import EngineConfig
    from nvllm.llm import LLM

    out = Path(os.environ.get("OUT", "."))
    res: dict = {"card": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                 "commit": os.environ.get("NVLLM_COMMIT", "unknown"), "command": " ".join(sys.argv), "runs": []}

    def save():
        (out / "spec_bench.json").write_text(json.dumps(res, indent=1, default=str))

    target = build_model_dir(Path(args.tokenizer_dir))
    chosen = args.drafts.split(",")
    drafts = {}
    if "0.5b" in chosen:
        drafts["0.5B-shaped"] = model_copy(target, REPO / "scripts/models/qwen2.5-0.5b")
    if "int4" in chosen:
        drafts["INT4 GPTQ self-draft"] = model_copy(target, quant=QUANT_CONFIGS["gptq"])
    base = dict(model=str(target), load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=64,
                log_stats_interval=0)
    config = EngineConfig(**base)
    llm = LLM.from_config(config)
    plain = {1: measure(llm, config, 1), 32: measure(llm, config, 32)}
    res["plain"] = plain
    save()
    print(f"plain: batch 1 TPOT {plain[1]['tpot_ms']:.2f} ms; batch 32 {plain[32]['output_tok_s']:.0f} tok/s",
          flush=True)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    accs = [float(a) for a in args.acceptance.split(",")]
    for name, ddir in drafts.items():
        spec = f"k={args.k},draft={ddir},synthetic_acceptance={accs[0]}"
        config = EngineConfig(**base, speculative=spec)
        try:
            llm = LLM.from_config(config)
        except Exception as e:  # keep the other draft's results
            res["runs"].append({"draft": name, "error": repr(e)})
            print(f"{name}: {e!r}", flush=True)
            continue
        for acc in accs:
            llm.engine.spec.sampler.synthetic_acceptance = acc   # the same engine at another fixed acceptance
            row = {"draft": name, "k": args.k, "synthetic_acceptance": acc, **measure(llm, config, 1)}
            row["speedup_b1"] = plain[1]["tpot_ms"] / row["tpot_ms"]
            if acc == 0.8:
                b32 = measure(llm, config, 32)
                row["b32_output_tok_s"] = b32["output_tok_s"]
                row["speedup_b32"] = b32["output_tok_s"] / plain[32]["output_tok_s"]
            res["runs"].append(row)
            save()
            print(f"{name:22s} acc {acc:.2f}  tau {row.get('tau', 0):.2f}  TPOT {row['tpot_ms']:.2f} ms  "
                  f"x{row['speedup_b1']:.2f}" + (f"  b32 x{row['speedup_b32']:.2f}" if "speedup_b32" in row else ""),
                  flush=True)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    save()


if __name__ == "__main__":
    main()
