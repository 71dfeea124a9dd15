"""Tensor-parallel benchmark on a 2-GPU machine, in one call: batch-1 TPOT of Qwen2.5-7B on one GPU and split
over two, Llama-3-70B split over two (against the two-GPU bandwidth wall), and decode throughput at batch 64;
printed as a table and saved to $OUT/gpu_tp_bench.json.

    python scripts/gpu_tp_bench.py [--skip-70b] [--output-len 256] [--iters 3]

Models: the published shapes (scripts/models/qwen2.5-7b, scripts/models/llama-3-70b) with random bf16 weights
(load_format dummy) and the demo model's tokenizer (prompts are random token ids below 512, valid in both
vocabularies; speed does not depend on the tokenizer). Needs only torch, triton, transformers, safetensors,
typer, rich and numpy.

The wall: a decode step reads every weight once (the embedding table only one row per token); split over N
GPUs each reads its own 1/N concurrently, so the step cannot beat bytes / N / copy bandwidth (measured on the
spot, device-to-device, read + write).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from gpu_bench import measure_bandwidth  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def model_dir(name: str) -> Path:
    """A temporary HF directory: the benchmark config.json and the demo model's tokenizer."""
    from nvllm.assets import demo_model_path

    d = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    shutil.copy(REPO / "scripts" / "models" / name / "config.json", d / "config.json")
    for f in TOKENIZER_FILES:
        shutil.copy(Path(demo_model_path()) / f, d / f)
    return d


def decode_bytes_per_rank(llm) -> int:
    """Bytes rank 0 reads in one batch-1 decode step: its parameters, less its embedding slice but one row."""
    model = llm.engine.runner.model
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed_tokens.weight
    return params - embed.numel() * embed.element_size() + embed.shape[1] * embed.element_size()


def measure(name: str, tp: int, args, res: dict, save) -> None:
    """Batch-1 TPOT and batch-64 decode throughput of one model at one TP size."""
    from nvllm.bench.offline import run_latency
    from nvllm.config import EngineConfig
    from nvllm.llm import LLM

    tag = f"{name}_tp{tp}"
    config = EngineConfig(model=str(model_dir(name)), load_format="dummy", dtype="bfloat16", max_model_len=4096,
                          max_num_seqs=args.batch, max_num_batched_tokens=8192, tensor_parallel_size=tp,
                          log_stats_interval=0)
    t0 = time.perf_counter()
    llm = LLM.from_config(config)
    with llm:
        res[f"{tag}_startup_s"] = time.perf_counter() - t0
        res[f"{tag}_decode_bytes_per_rank"] = decode_bytes_per_rank(llm)
        res[f"{tag}_kv_tokens_per_rank"] = llm.engine.runner.num_blocks * llm.engine.runner.block_size
        one = run_latency(config, batch_size=1, input_len=args.input_len, output_len=args.output_len,
                          num_iters_warmup=1, num_iters=args.iters, progress=False, llm=llm)
        res[f"{tag}_b1_tpot_ms"] = one["median_tpot_ms"]
        res[f"{tag}_b1_kernel_report"] = one["kernel_report"]
        save()
        many = run_latency(config, batch_size=args.batch, input_len=args.input_len, output_len=args.output_len,
                           num_iters_warmup=1, num_iters=args.iters, progress=False, llm=llm)
        res[f"{tag}_b{args.batch}_tpot_ms"] = many["median_tpot_ms"]
        res[f"{tag}_b{args.batch}_output_tok_s"] = args.batch * args.output_len / many["avg_latency"]
        save()
        t0 = time.perf_counter()
    res[f"{tag}_close_s"] = time.perf_counter() - t0    # the engine's close, workers and communicators included
    print(f"[close] {name} tensor_parallel_size={tp}: {res[f'{tag}_close_s']:.1f} s", flush=True)
    save()
    del llm
    gc.collect()
    for d in range(torch.cuda.device_count()):
        with torch.cuda.device(d):
            torch.cuda.empty_cache()


def table(res: dict, batch: int) -> str:
    bw = res["bandwidth_Bps"]
    lines = [f"cards {res['cards']}  commit {res['commit']}  copy bandwidth {bw / 1e12:.2f} TB/s per GPU",
             f"{'model':<12} {'TP':>3} {'b1 TPOT ms':>11} {'wall ms':>8} {'% wall':>7} {'b1 tok/s':>9} "
             f"{f'b{batch} tok/s':>11}  speed-up vs TP1"]
    for name in ("qwen2.5-7b", "llama-3-70b"):
        for tp in (1, 2):
            tag = f"{name}_tp{tp}"
            if f"{tag}_b1_tpot_ms" not in res:
                continue
            tpot = res[f"{tag}_b1_tpot_ms"]
            wall = 1000 * res[f"{tag}_decode_bytes_per_rank"] / bw
            base = res.get(f"{name}_tp1_b1_tpot_ms")
            speedup = f"{base / tpot:.2f}x" if base and tp > 1 else ""
            lines.append(f"{name:<12} {tp:>3} {tpot:>11.2f} {wall:>8.2f} {100 * wall / tpot:>6.1f}% "
                         f"{1000 / tpot:>9.1f} {res.get(f'{tag}_b{batch}_output_tok_s', float('nan')):>11.0f}  "
                         f"{speedup}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-70b", action="store_true", help="only the Qwen2.5-7B runs")
    ap.add_argument("--only-70b", action="store_true", help="only the Llama-3-70B run")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=64, help="batch of the throughput runs")
    ap.add_argument("--iters", type=int, default=3, help="timed generate calls per measurement")
    ap.add_argument("--shutdown-check", action="store_true",
                    help="only start, run and close Qwen2.5-7B over two GPUs (16 tokens, batch 4): the close time; "
                         "the process's exit status says whether it ended cleanly")
    args = ap.parse_args()
    if args.shutdown_check:
        args.skip_70b, args.only_70b, args.output_len, args.iters, args.batch = True, False, 16, 1, 4
    if torch.cuda.device_count() < 2:
        sys.exit(f"needs 2 GPUs, {torch.cuda.device_count()} visible")
    out = Path(os.environ.get("OUT", "."))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    # the device machine gets the working tree without its git history: the caller passes NVLLM_COMMIT
    res = {"date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "commit": os.environ.get("NVLLM_COMMIT") or commit.stdout.strip() or "unknown",
           "cards": f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}",
           "bandwidth_Bps": min(measure_bandwidth(device=0), measure_bandwidth(device=1)), "args": vars(args)}

    def save() -> None:
        (out / "gpu_tp_bench.json").write_text(json.dumps(res, indent=2, default=str))

    save()
    runs = [("qwen2.5-7b", 2)] if args.shutdown_check else \
        ([] if args.only_70b else [("qwen2.5-7b", 1), ("qwen2.5-7b", 2)]) + \
        ([] if args.skip_70b else [("llama-3-70b", 2)])
    for name, tp in runs:
        print(f"[run] {name} tensor_parallel_size={tp}", flush=True)
        measure(name, tp, args, res, save)
        print(table(res, args.batch), flush=True)
    save()
    print(table(res, args.batch))


if __name__ == "__main__":
    main()
