"""Issue-11 benchmark on one host with 2 GPUs, in one call (under 9 minutes): prefill/decode disaggregation
(1P1D: one prefill worker, one decode worker, `nvllm serve --disaggregate 1P1D`) against the same two GPUs
serving as two mixed replicas behind `nvllm router --mixed`, on long prompts (random, ~2000 tokens) with
200-token outputs at rising request rates. Per rate and deployment: TTFT p99, TPOT p99 and goodput under the
SLO TTFT <= 1 s, TPOT <= 25 ms; for 1P1D also the TTFT split and the KV transfer figures. Then the advisor
(`nvllm bench advise`, measured on one mixed replica) on a long-prompt and a short-prompt workload.

    python3 scripts/gpu_disagg_bench.py [--rates 4,8,16,24] [--seconds-per-rate 12]

Model: Qwen2.5-7B shapes (scripts/models/qwen2.5-7b/config.json) with random bf16 weights (--load-format dummy)
and the Qwen2.5 tokenizer from .carry/qwen2.5 (vocab.json + merges.txt). Wheels in .whl/ (fastapi, uvicorn,
httpx, prometheus-client and what they need) are installed first into /tmp/site when the machine lacks them.
Everything is written under $OUT (default .): one JSON per run, the server logs, disagg_bench.json.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = Path(os.environ.get("OUT", ".")).resolve()
SITE = "/tmp/site"
NEEDED = ("fastapi", "uvicorn", "starlette", "pydantic", "httpx", "httpcore", "h11", "anyio", "prometheus_client",
          "typer", "rich", "transformers")
MODEL_NAME = "qwen2.5-7b-dummy"
SLO = ["--goodput", "ttft:1000", "tpot:25"]
T0 = time.monotonic()


def install_wheels() -> None:
    wheels = sorted(glob.glob(str(REPO / ".whl" / "*.whl")))
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", SITE, *wheels], check=True)
        sys.path.insert(0, SITE)
        importlib.invalidate_caches()  # SITE may have been on the path, and listed, before the install
        paths = [SITE, str(REPO), os.environ.get("PYTHONPATH", "")]
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    missing = []
    for name in NEEDED:
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        sys.exit(f"missing Python packages: {', '.join(missing)} (carry their wheels in .whl/)")


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


class Deployment:
    """Processes started together and stopped together (SIGTERM, then SIGKILL)."""

    def __init__(self, name: str):
        self.name, self.procs = name, []

    def start(self, args: list[str], log_name: str, gpu: str | None = None) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200")
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        with open(OUT / log_name, "w") as f:
            self.procs.append(subprocess.Popen([sys.executable, "-m", "nvllm.cli", *args], stdout=f,
                                               stderr=subprocess.STDOUT, env=env, cwd=REPO))

    def wait_healthy(self, url: str, timeout: float) -> bool:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(p.poll() is not None for p in self.procs):
                return False
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(1)
        return False

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(40)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs = []


def probe(url: str) -> str | None:
    """One request end to end, its KV really transferred (a decode worker that had to recompute the prompt
    answers too, so the transfer counters are checked); None when it worked, else why not."""
    import httpx

    try:
        r = httpx.post(f"{url}/v1/completions", timeout=90, json={
            "model": MODEL_NAME, "prompt": "Hello world " * 300, "max_tokens": 8, "ignore_eos": True})
        if r.status_code != 200:
            return f"HTTP {r.status_code}: {r.text[:300]}"
        workers = httpx.get(f"{url}/router/workers", timeout=10).json()["workers"]
        stats = [httpx.get(f"{w['url']}/internal/info", timeout=10).json()["transfer"]
                 for w in workers if w["role"] == "decode"]
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"
    if not stats or not sum(t["transfers_ok"] for t in stats):
        return f"the KV transfer did not complete (decode side: {stats})"
    return None


def bench(url: str, model_dir: Path, rate: float, n: int, save: Path, input_len: int = 2000) -> dict | None:
    cmd = [sys.executable, "-m", "nvllm.cli", "bench", "serve", "--base-url", url, "--model", MODEL_NAME,
           "--tokenizer", str(model_dir), "--dataset", "random", "--input-len", str(input_len), "--output-len", "200",
           "--ignore-eos", "--num-prompts", str(n), "--request-rate", str(rate), "--metric-percentiles", "50,90,99",
           *SLO, "--seed", str(int(rate * 10)), "--save-result", str(save), "--no-progress"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    (OUT / f"{save.stem}.log").write_text(r.stdout + r.stderr)
    if not save.exists():
        log(f"bench at rate {rate} failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}")
        return None
    return json.loads(save.read_text())


def worker_counters(urls: list[str]) -> dict[str, dict | None]:
    """Each worker's /metrics counters (bench serve's own reader), keyed by URL."""
    import asyncio

    import httpx

    from nvllm.bench.serve import prometheus_counters

    async def read():
        async with httpx.AsyncClient(timeout=10) as client:
            return {u: await prometheus_counters(client, u) for u in urls}
    return asyncio.run(read())


def worker_steps(before: dict, after: dict) -> dict:
    """Per worker over one rate: its engine steps by kind (mean decode step, prefill share: bench's step_stats) and
    the tokens it generated per decode-carrying step, from the change in its counters. A TPOT far above the decode
    worker's step time points at the host (the API thread, the streams), one close to it at the engine."""
    from nvllm.bench.server_metrics import counter_delta, step_stats, total

    out = {}
    for url, a in after.items():
        b = before.get(url)
        if a is None or b is None:
            continue
        delta = counter_delta(b, a)
        steps = step_stats(delta) or {}
        decoding = total(delta, "nvllm:engine_steps_total", kind="decode") + \
            total(delta, "nvllm:engine_steps_total", kind="mixed")
        tokens = total(delta, "nvllm:generation_tokens_total")
        out[url] = {**{k: steps.get(k) for k in ("steps", "decode_step_ms", "mixed_step_ms", "prefill_share")},
                    "tokens_per_decode_step": tokens / decoding if decoding else None}
    return out


def advise(url: str, model_dir: Path, name: str, extra: list[str]) -> dict | None:
    save = OUT / f"advise_{name}.json"
    cmd = [sys.executable, "-m", "nvllm.cli", "bench", "advise", "--base-url", url, "--model", MODEL_NAME,
           "--tokenizer", str(model_dir), "--dataset", "random", "--output-len", "200", "--ignore-eos",
           "--num-gpus", "2", "--no-progress", "--save-result", str(save), *extra]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    (OUT / f"advise_{name}.log").write_text(r.stdout + r.stderr)
    print(r.stderr[-4000:], flush=True)
    return json.loads(save.read_text()) if save.exists() else None


TPOT_SLOS_MS = (10, 15, 25)  # goodput also under tighter TPOT SLOs (TTFT <= 1 s in each)


def goodput_by_tpot(row: dict) -> dict:
    """Requests per second meeting TTFT <= 1 s and TPOT <= each of TPOT_SLOS_MS, from the run's per-request
    TTFTs, latencies and output lengths (TPOT as bench serve computes it)."""
    from nvllm.bench.metrics import request_tpot

    duration = row["completed"] / row["request_throughput"] if row.get("request_throughput") else 0
    reqs = [(t, request_tpot(lat, t, n)) for t, lat, n in zip(row["ttfts"], row["latencies"], row["output_lens"])
            if t is not None]
    out = {}
    for slo in TPOT_SLOS_MS:
        good = sum(t <= 1.0 and tpot <= slo / 1000 for t, tpot in reqs)
        out[f"goodput_tpot{slo}"] = good / duration if duration else 0.0
    return out


def summarize(row: dict | None) -> dict:
    if row is None:
        return {"ok": False}
    keys = ("completed", "failed", "request_throughput", "request_goodput", "p99_ttft_ms", "p99_tpot_ms",
            "median_ttft_ms", "median_tpot_ms", "output_throughput")
    out = {k: row.get(k) for k in keys}
    out.update({k: v for k, v in row.items() if k.startswith("disagg_")})
    if row.get("completed"):
        out.update(goodput_by_tpot(row))
    return out


def peer_copy() -> dict:
    """Whether GPU 0 reaches GPU 1 directly, and a 1 GiB cuda:0 → cuda:1 copy's speed: the ceiling of a KV
    transfer between the two workers."""
    import torch

    if torch.cuda.device_count() < 2:
        return {}
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda:0")
    b = torch.empty_like(a, device="cuda:1")
    b.copy_(a)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    t = time.perf_counter()
    for _ in range(5):
        b.copy_(a)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    gbps = 5 * a.numel() / (time.perf_counter() - t) / 1e9
    out = {"can_access_peer": torch.cuda.can_device_access_peer(0, 1), "copy_GBps": gbps}
    del a, b
    torch.cuda.empty_cache()
    log(f"GPU 0 -> GPU 1: peer access {out['can_access_peer']}, {gbps:.1f} GB/s")
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="4,8,16,24", help="aggregate request rates (req/s), comma-separated "
                    "(run H: up to 8 req/s two mixed replicas kept TPOT p99 under 8 ms)")
    ap.add_argument("--seconds-per-rate", type=float, default=12.0, help="arrivals last about this long per rate")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds; rates that would not fit are skipped")
    ap.add_argument("--skip-advisor", action="store_true", help="only the rate runs")
    ap.add_argument("--skip-mixed", action="store_true", help="only 1P1D (the mixed replicas measured before)")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    install_wheels()
    sys.path.insert(0, str(REPO / "scripts"))
    import gpu_bench

    model_dir = gpu_bench.build_model_dir(REPO / ".carry/qwen2.5")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast on the lent machines
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: the gloo groups need no other interface
    engine = ["--model", str(model_dir), "--served-model-name", MODEL_NAME, "--load-format", "dummy",
              "--dtype", "bfloat16", "--max-model-len", "4096", "--max-num-seqs", "128", "--log-stats-interval", "10",
              "--uvicorn-log-level", "warning"]
    rates = [float(r) for r in args.rates.split(",")]
    results: dict = {"rates": rates, "slo": {"ttft_ms": 1000, "tpot_ms": 25}, "mixed_x2": {}, "disagg_1p1d": {},
                     "advisor": {}, "peer_copy": peer_copy()}

    def run_rates(url: str, key: str, deadline: float, workers: list[str]) -> None:
        for rate in rates:
            n = max(16, int(rate * args.seconds_per_rate))
            if time.monotonic() + n / rate + 25 > deadline:
                log(f"{key}: skipping rate {rate} (time budget)")
                continue
            log(f"{key}: rate {rate} req/s, {n} requests")
            before = worker_counters(workers)
            row = bench(url, model_dir, rate, n, OUT / f"{key}_rate{rate:g}.json")
            results[key][f"{rate:g}"] = summarize(row)
            results[key][f"{rate:g}"]["workers"] = worker_steps(before, worker_counters(workers))
            log(f"  -> {json.dumps(results[key][f'{rate:g}'])[:400]}")

    # ---- two mixed replicas behind the router; the advisor on replica 0 ----
    if not args.skip_mixed:
        mixed = Deployment("mixed")
        started = time.monotonic()
        try:
            for i in range(2):
                mixed.start(["serve", *engine, "--port", str(8001 + i)], f"mixed{i}.log", gpu=str(i))
            mixed.start(["router", "--mixed", "http://127.0.0.1:8001,http://127.0.0.1:8002", "--port", "8000",
                         "--uvicorn-log-level", "warning"], "router_mixed.log")
            if not mixed.wait_healthy("http://127.0.0.1:8000", 300):
                sys.exit(f"the mixed replicas did not start; see {OUT}/mixed0.log")
            startup = time.monotonic() - started
            log(f"mixed x2 ready after {startup:.0f} s")
            if not args.skip_advisor:
                results["advisor"]["long_prompts"] = advise("http://127.0.0.1:8001", model_dir, "long", [
                    "--input-len", "2048", "--num-prompts", "64", "--max-concurrency", "32"])
                results["advisor"]["short_prompts"] = advise("http://127.0.0.1:8001", model_dir, "short", [
                    "--input-len", "200", "--num-prompts", "24", "--request-rate", "2"])
            # half of what is left after the 1P1D start-up (about as long as this one's) goes to the mixed rates
            left = args.budget - (time.monotonic() - T0) - startup - 30
            run_rates("http://127.0.0.1:8000", "mixed_x2", time.monotonic() + left / 2,
                      ["http://127.0.0.1:8001", "http://127.0.0.1:8002"])
        finally:
            mixed.stop()

    # ---- 1P1D (NCCL; gloo through host memory if NCCL fails) ----
    for backend in ("auto", "gloo"):
        disagg = Deployment("1p1d")
        try:
            disagg.start(["serve", *engine, "--disaggregate", "1P1D", "--port", "8000", "--kv-backend", backend,
                          "--kv-transfer-timeout", "30"], f"disagg_{backend}.log")
            if not disagg.wait_healthy("http://127.0.0.1:8000", 300):
                log(f"1P1D ({backend}) did not start; see {OUT}/disagg_{backend}.log")
                continue
            why = probe("http://127.0.0.1:8000")
            if why is not None:
                log(f"1P1D ({backend}): the probe request failed: {why}")
                continue
            results["disagg_backend"] = backend
            log(f"1P1D ready (kv backend {backend})")
            import httpx

            listed = httpx.get("http://127.0.0.1:8000/router/workers", timeout=10).json()["workers"]
            workers = [w["url"] for w in listed]
            run_rates("http://127.0.0.1:8000", "disagg_1p1d", T0 + args.budget, workers)
            break
        finally:
            disagg.stop()

    (OUT / "disagg_bench.json").write_text(json.dumps(results, indent=2))
    print_table(results)
    log(f"done; results in {OUT}/disagg_bench.json")


def print_table(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="long prompts (~2000 tok), 200-token outputs, 2x H200: mixed x2 vs 1P1D "
                    "(goodput: TTFT <= 1 s and TPOT <= 25 ms)")
    for col in ("rate", "deployment", "done/failed", "TTFT p99 ms", "TPOT p99 ms", "goodput req/s",
                *(f"goodput TPOT<={slo}" for slo in TPOT_SLOS_MS), "prefill ms", "KV ms",
                "ask/wire/copy ms", "sent: queue/gather/send ms", "KV GB/s", "decode step ms / tok per step"):
        t.add_column(col, justify="right")

    def f(v, d=1):
        return "n/a" if v is None else f"{v:,.{d}f}"

    for rate in results["rates"]:
        for key, label in (("mixed_x2", "mixed x2"), ("disagg_1p1d", "1P1D")):
            r = results[key].get(f"{rate:g}")
            if not r or not r.get("completed"):
                t.add_row(f"{rate:g}", label, *["-"] * (10 + len(TPOT_SLOS_MS)))
                continue
            t.add_row(f"{rate:g}", label, f"{r['completed']}/{r['failed']}", f(r["p99_ttft_ms"]), f(r["p99_tpot_ms"]),
                      f(r["request_goodput"], 2), *(f(r.get(f"goodput_tpot{slo}"), 2) for slo in TPOT_SLOS_MS),
                      f(r.get("disagg_mean_prefill_ms")),
                      f(r.get("disagg_mean_kv_transfer_ms"), 2),
                      "/".join(f(r.get(f"disagg_mean_kv_{p}_ms"), 1) for p in ("ask", "wire", "copy")),
                      "/".join(f(r.get(f"disagg_mean_kv_{p}_ms"), 1) for p in ("queue", "gather", "send")),
                      f(r.get("disagg_kv_transfer_gb_per_s"), 2),
                      ", ".join(f"{f(w.get('decode_step_ms'), 2)} / {f(w.get('tokens_per_decode_step'))}"
                                for w in r.get("workers", {}).values() if w.get("decode_step_ms")))
    Console(width=200).print(t)
    for name, adv in results["advisor"].items():
        if adv:
            rec = adv["recommendation"]
            print(f"advisor, {name}: {rec['verdict']} ({rec['prefill_workers']}:{rec['decode_workers']}) — "
                  f"{'; '.join(rec['reasons'])}")


if __name__ == "__main__":
    main()
