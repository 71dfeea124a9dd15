"""Wall-clock benchmark of nvllm quantize (GPTQ 4-bit g128, 128 x 2048 tokens) on a random Qwen2.5-7B shape.

One call builds the model and quantizes it; the issue's target is GPTQ 4-bit g128 with 128 x 2048 calibration
tokens in <= 8 minutes on an H200.

    python scripts/gpu_quantize_bench.py [--tokenizer .carry/qwen2.5] [--calib auto|calib|PATH] [--layers N]
                                         [--samples 128] [--seqlen 2048] [--method gptq] [--keep] [--out DIR]

1. Model: config.json of scripts/models/qwen2.5-7b (or ``--config FILE``; ``--layers N`` keeps the first N
   decoder layers) and the Qwen2.5 tokenizer built from vocab.json + merges.txt in ``--tokenizer``
   (``random_checkpoint.build_model_dir``; a directory holding tokenizer.json is copied as is; ``demo`` or a
   missing directory: the demo model's 512-token tokenizer, whose ids lie inside any vocabulary of >= 512).
   Weights: HF-like init (normal, std = initializer_range, 0.02; norms 1, biases 0), drawn with a seeded
   generator on the GPU when there is one, written in the config's dtype (bf16) as safetensors shards +
   index under the tensor names transformers' own model class has (taken from a meta-device instance).
   Timed separately ("model build"): it is not part of the quantize time.
2. Quantize: ``nvllm.quant.quantize.quantize_model`` with a ``QuantizeConfig`` from ``recipe.build_config``
   -- exactly what ``nvllm quantize --method gptq --bits 4 --group-size 128 --calib-samples 128
   --calib-seqlen 2048 --device cuda`` runs -- timed end to end (checks, tokenizer, calibration windows,
   model load, layer by layer quantization, packing, writing the checkpoint).
   Calibration text (``--calib``): ``auto`` = the full C4 sample of the shared data (1000 documents, ~470k
   Qwen tokens: enough for 128 x 2048 without overlap) when found (.carry/c4/, shared/data/c4/ beside or above
   the repository), else the 150-document sample shipped in calib/ (~57k tokens: the 128 windows overlap,
   which does not change the work done); ``calib`` = the shipped sample; any other value is a file path.
3. Output: flushed, timestamped lines: each stage of the first and last layer, each finished layer
   (seconds, breakdown, ETA), so a run killed by a time limit still shows how far it got (SIGTERM, as sent by
   ``timeout``, still writes the JSON and the table); at the end a table (model build, calibration,
   layers with the reading, packing and writing of the model's parts inside them, quantize total, peak host
   memory of the quantize, peak GPU memory) and $OUT/gpu_quantize_bench.json (``--out``
   overrides $OUT; default ./out), rewritten after every layer. The quantized checkpoint is checked
   (quantization_config, one qweight per quantized projection). Temporary model directories (~15 GB +
   ~5.5 GB for the 7B) go to /dev/shm when it has room (writing 15 GB then costs no disk time), else $TMPDIR
   (``--workdir`` chooses), and are deleted at the end unless ``--keep``.

The per-layer breakdown (``quantize_timing.py``) wraps a few nvllm functions at run time (``sequential._collect``,
``InputStats.add``, ``gptq_quantize``, ``inverse_hessian_factor``, ``relative_error``) with a CUDA synchronize
before and after, so the GPU time lands where it belongs: about 15 synchronizations per stage, against
seconds of work. ``--no-detail`` leaves them out (phase timings only).

Needs only torch, transformers, safetensors (and triton on the GPU); no datasets, no network.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from quantize_timing import Tracker, instrumented, log  # noqa: E402
from random_checkpoint import build_model_dir, default_workdir, write_random_weights  # noqa: E402

DEFAULT_CONFIG = REPO / "scripts" / "models" / "qwen2.5-7b" / "config.json"
DEFAULT_TOKENIZER = REPO / ".carry" / "qwen2.5"
C4_NAME = "c4-sample.00000-of-00001.jsonl"
C4_CANDIDATES = (REPO / ".carry" / "c4" / C4_NAME, REPO / ".carry" / C4_NAME, REPO / "shared" / "data" / "c4" / C4_NAME,
                 REPO.parent / "shared" / "data" / "c4" / C4_NAME)
RESULT_FILE = "gpu_quantize_bench.json"
TARGET_S = 480.0          # the issue: <= 8 minutes for 128 x 2048 tokens on the 7B shape

# ----------------------------------------------------------------------------------------- calibration, memory


def resolve_calib(choice: str) -> tuple[str, str]:
    """(value for QuantizeConfig.calib_dataset, a line saying what text it is)."""
    if choice == "auto":
        found = next((p for p in C4_CANDIDATES if p.is_file()), None)
        if found is not None:
            return str(found), f"full shared C4 sample {found} (1000 documents)"
        return "calib", ("the 150-document C4 sample shipped in calib/ (no full C4 sample found at "
                         f"{', '.join(str(p) for p in C4_CANDIDATES)})")
    if choice == "calib":
        return "calib", "the 150-document C4 sample shipped in calib/"
    return choice, f"the file {choice}"


def reset_peak_rss() -> None:
    """Linux: the process's peak resident set (VmHWM) starts again from its current size."""
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def peak_rss_gib() -> float | None:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**20
    except (OSError, StopIteration):
        return None


# ------------------------------------------------------------------------------------------------ checks


def check_output(out_dir: Path, cfg, num_layers: int, kept: dict) -> dict:
    """The written checkpoint: quantization_config as asked, and a qweight for every quantized projection."""
    from safetensors import safe_open

    config = json.loads((out_dir / "config.json").read_text())
    qc = config.get("quantization_config") or {}
    problems = []
    want = {"quant_method": "awq" if cfg.method == "awq" else "gptq", "bits": cfg.bits, "group_size": cfg.group_size}
    for k, v in want.items():
        if qc.get(k) != v:
            problems.append(f"quantization_config {k} = {qc.get(k)!r}, expected {v!r}")
    keys: set[str] = set()
    for f in sorted(out_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as s:
            keys.update(s.keys())
    from nvllm.models.llama import ModelShape
    from nvllm.models.loader import load_hf_config
    from nvllm.models.registry import resolve_architecture
    from nvllm.quant.plan import quantizable_units

    hf_config = load_hf_config(str(out_dir))
    hf_config.num_hidden_layers = num_layers
    shape = ModelShape(hf_config, resolve_architecture(hf_config)[0])
    kept_modules = [m for names in kept for m in names.split("/")]    # "mlp.down_proj", "mlp.experts", …
    expected = [f"{n}.qweight" for _, names, _ in quantizable_units(shape) for n in names
                if not any(f".{m}." in f"{n}." for m in kept_modules)]
    missing = [k for k in expected if k not in keys]
    if missing:
        problems.append(f"{len(missing)} qweight tensors missing, e.g. {missing[0]}")
    if not expected:
        problems.append("no projection was quantized")
    return {"ok": not problems, "problems": problems, "quantization_config": qc, "qweight_tensors":
            sum(k.endswith(".qweight") for k in keys), "expected_qweight_tensors": len(expected),
            "files": sorted(p.name for p in out_dir.iterdir())}


# ------------------------------------------------------------------------------------------------- report


def table(res: dict) -> str:
    ph = res.get("phases", {})
    rows = [("model build (random weights; not part of quantize)", res.get("build", {}).get("seconds")),
            ("  calibration: tokenizer load", ph.get("tokenizer_s")),
            ("  calibration: read text", ph.get("read_calib_text_s")),
            ("  calibration: tokenize + windows", ph.get("calib_windows_s")),
            (f"  layers ({res.get('layers_done', 0)}/{res.get('num_layers', '?')})", ph.get("layers_s")),
            ("    of which window embedding", ph.get("embed_windows_s")),
            ("    of which reading the model a part at a time (CPU)", ph.get("load_s")),
            ("    of which packing (CPU)", ph.get("pack_s")),
            ("    of which writing shards", ph.get("write_s")),
            ("  last shard, config, rename", ph.get("finish_s")),
            ("quantize end to end (quantize_model)", res.get("quantize_s")),
            ("script total", res.get("script_s"))]
    lines = [f"{'phase':<54} {'seconds':>9}"]
    lines += [f"{name:<54} {v:>9.1f}" for name, v in rows if v is not None]
    layers = res.get("layers") or []
    if layers:
        n = len(layers)
        mean = {k: sum(x.get(k, 0.0) for x in layers) / n for k in
                ("seconds", "collect_s", "hessian_s", "gptq_s", "cholesky_s", "rel_error_s")}
        stages: dict[str, float] = {}
        for x in layers:
            for k, v in x["stages"].items():
                stages[k] = stages.get(k, 0.0) + v / n
        lines.append(f"per layer (mean of {n}): {mean['seconds']:.2f}s; stages "
                     + ", ".join(f"{k} {v:.2f}" for k, v in stages.items()))
        if res.get("args", {}).get("detail"):
            lines.append(f"  replay+Hessian {mean['collect_s']:.2f}s (Hessian addmm {mean['hessian_s']:.2f}), GPTQ "
                         f"{mean['gptq_s']:.2f}s (Cholesky {mean['cholesky_s']:.2f}), relative error "
                         f"{mean['rel_error_s']:.2f}s, rest (output replay of quantized + reference layer, "
                         f"copies) {mean['seconds'] - mean['collect_s'] - mean['gptq_s'] - mean['rel_error_s']:.2f}s")
    if res.get("peak_host_gib") is not None:
        lines.append(f"peak host memory (VmHWM, reset before quantize) {res['peak_host_gib']:.2f} GiB")
    if res.get("peak_gpu_gib") is not None:
        lines.append(f"peak GPU memory allocated {res['peak_gpu_gib']:.2f} GiB (reserved "
                     f"{res['peak_gpu_reserved_gib']:.2f} GiB) during quantize; model build "
                     f"{res.get('build', {}).get('peak_gpu_gib', 0):.2f} GiB")
    if res.get("quantize_s") is not None and res.get("full_model"):
        verdict = "met" if res["quantize_s"] <= TARGET_S else "MISSED"
        lines.append(f"target <= {TARGET_S:.0f}s for {res['args']['samples']} x {res['args']['seqlen']} tokens: "
                     f"{verdict} ({res['quantize_s']:.1f}s)")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(DEFAULT_CONFIG), help="model config.json (default: Qwen2.5-7B shapes)")
    ap.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER),
                    help="dir with vocab.json + merges.txt (Qwen2.5) or tokenizer.json; 'demo': the demo model's")
    ap.add_argument("--calib", default="auto", help="auto | calib (shipped sample) | a .jsonl/.json.gz/.txt path")
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N decoder layers")
    ap.add_argument("--method", default="gptq", choices=("gptq", "awq", "rtn"))
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--samples", type=int, default=128, help="calibration windows")
    ap.add_argument("--seqlen", type=int, default=2048, help="tokens per window")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", help="auto | cuda | cuda:N | cpu (quantize and weight generation)")
    ap.add_argument("--tf32", action="store_true",
                    help="allow TF32 for fp32 matmuls (torch.set_float32_matmul_precision('high')): an experiment, "
                         "not what nvllm quantize does")
    ap.add_argument("--no-detail", dest="detail", action="store_false",
                    help="no per-stage breakdown (no extra synchronizations)")
    ap.add_argument("--shard-gib", type=float, default=4.0, help="size of the random checkpoint's safetensors shards")
    ap.add_argument("--workdir", default=None, help="where the temporary model directories go (default: /dev/shm "
                    "when it has room, else $TMPDIR)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary model directories")
    ap.add_argument("--out", default=None, help="directory of the JSON result (default: $OUT, else ./out)")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    from nvllm.config import resolve_device
    from nvllm.quant.quantize import quantize_model
    from nvllm.quant.recipe import build_config
    from nvllm.quant.replay import ORDER

    args = parse_args(argv)
    out = Path(args.out or os.environ.get("OUT") or "out")
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(resolve_device(args.device))
    if args.tf32:
        torch.set_float32_matmul_precision("high")
    commit = os.environ.get("NVLLM_COMMIT")    # the device machine gets the tree without .git
    if not commit:
        try:
            commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            commit = ""

    res: dict = {"status": "running", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": commit or "unknown",
                 "command": " ".join([Path(sys.argv[0]).name] + (sys.argv[1:] if argv is None else list(argv))),
                 "args": vars(args), "torch": torch.__version__, "device": str(device),
                 "card": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "cpu_threads": torch.get_num_threads(), "target_s": TARGET_S}

    def save() -> None:
        res["script_s"] = time.perf_counter() - t_script
        tmp = out / (RESULT_FILE + ".tmp")
        tmp.write_text(json.dumps(res, indent=1, default=str))
        os.replace(tmp, out / RESULT_FILE)

    t_script = time.perf_counter()
    if args.workdir:
        base, where = Path(args.workdir), args.workdir
    else:
        config0 = json.loads(Path(args.config).read_text())
        if args.layers is not None:
            config0["num_hidden_layers"] = min(args.layers, config0["num_hidden_layers"])
        base, where = default_workdir(config0)
    base.mkdir(parents=True, exist_ok=True)
    log(f"temporary model directories under {where}")
    workdir = Path(tempfile.mkdtemp(prefix="gptq-bench-", dir=base))
    res["workdir"], res["workdir_where"] = str(workdir), where
    old_term = None
    if threading_main():
        def on_term(signum, frame):   # a wall-clock limit: keep what was measured, then stop
            res["status"] = f"killed (signal {signum})"
            raise SystemExit(124)
        old_term = signal.signal(signal.SIGTERM, on_term)
    try:
        # 1. the model
        t0 = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        model_dir, config, tok_what = build_model_dir(Path(args.config), args.tokenizer, args.layers, workdir, log)
        res["model"] = {"config": args.config, "num_hidden_layers": config["num_hidden_layers"],
                        "hidden_size": config["hidden_size"], "intermediate_size": config["intermediate_size"],
                        "vocab_size": config["vocab_size"], "tokenizer": tok_what, "dir": str(model_dir)}
        res["num_layers"] = config["num_hidden_layers"]
        res["full_model"] = args.config == str(DEFAULT_CONFIG) and args.layers in (None, 28) \
            and args.method == "gptq" and args.samples == 128 and args.seqlen == 2048
        from nvllm.engine.tokenizer import load_tokenizer

        tok = load_tokenizer(str(model_dir))    # calibration ids: the base vocabulary and the EOS separator
        n_tok = max(tok.vocab_size, (tok.eos_token_id or 0) + 1)
        if n_tok > config["vocab_size"]:
            raise SystemExit(f"the tokenizer produces ids up to {n_tok - 1} but the config's vocab_size is "
                             f"{config['vocab_size']}: use a larger vocabulary or --tokenizer demo")
        log(f"model dir {model_dir}: {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
            f"intermediate {config['intermediate_size']}, vocab {config['vocab_size']}; tokenizer: {tok_what}")
        res["build"] = write_random_weights(model_dir, device, args.seed, int(args.shard_gib * 2**30), log)
        res["build"]["seconds"] = time.perf_counter() - t0
        if device.type == "cuda":
            res["build"]["peak_gpu_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        log(f"model build: {res['build']['bytes'] / 1e9:.2f} GB in {res['build']['shards']} shard(s), "
            f"{res['build']['seconds']:.1f}s (generate {res['build']['generate_s']:.1f}s on {device}, "
            f"write {res['build']['write_s']:.1f}s)")
        save()

        # 2. nvllm quantize, as the CLI runs it
        calib, calib_what = resolve_calib(args.calib)
        res["calib_text"] = calib_what
        log(f"calibration text: {calib_what}")
        cfg = build_config(None, method=args.method, bits=args.bits, group_size=args.group_size,
                           calib_dataset=calib, calib_samples=args.samples, calib_seqlen=args.seqlen, seed=args.seed,
                           device=str(device))
        res["quantize_config"] = {k: v for k, v in vars(cfg).items()}
        q_dir = workdir / "quantized"
        tracker = Tracker(res, save, device, args.detail)
        log(f"quantize: {cfg.method} {cfg.bits}-bit g{cfg.group_size}, {cfg.calib_samples} x {cfg.calib_seqlen} "
            f"tokens, device {cfg.device}")
        reset_peak_rss()
        t0 = tracker.q_t0 = time.perf_counter()
        with instrumented(tracker):
            summary = quantize_model(str(model_dir), str(q_dir), cfg, progress=tracker.on_progress,
                                     on_start=tracker.on_start)
        res["quantize_s"] = time.perf_counter() - t0
        res["quantize_model_seconds"] = summary.seconds
        res["peak_host_gib"] = peak_rss_gib()
        if device.type == "cuda":
            res["peak_gpu_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            res["peak_gpu_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
        res["size_before"], res["size_after"] = summary.size_before, summary.size_after
        res["kept"] = summary.kept
        for rep, row in zip(summary.layers, res["layers"]):
            row.update(nvllm_seconds=rep.seconds, layer_error=rep.layer_error, unreached_experts=rep.unreached,
                       errors={n: rep.stage_error(n) for n in ORDER})   # a mixture: mean over its experts
        res["quantized_dir"] = str(q_dir)
        res["check"] = check_output(q_dir, cfg, config["num_hidden_layers"], summary.kept)
        res["status"] = "done" if res["check"]["ok"] else "bad output"
        log(f"output check: {'ok' if res['check']['ok'] else '; '.join(res['check']['problems'])} "
            f"({res['check']['qweight_tensors']} qweight tensors, {summary.size_before / 1e9:.2f} GB -> "
            f"{summary.size_after / 1e9:.2f} GB)")
    except BaseException as e:
        if res["status"] == "running":
            res["status"] = f"failed: {type(e).__name__}: {e}"
        raise
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
            res["workdir_deleted"] = True
        save()
        print(table(res), flush=True)
        print(f"result: {out / RESULT_FILE}", flush=True)
    return res


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":
    result = main()
    sys.exit(0 if result["status"] == "done" else 1)
