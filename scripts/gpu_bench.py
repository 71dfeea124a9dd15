"""Issue-3 benchmark on one GPU, in one call: the bandwidth and bf16 GEMM ceilings measured on the spot,
HF transformers on the same shapes, and nvllm (`bench latency` / `bench throughput` code paths), printed
as a table of ratios and saved to $OUT/gpu_bench.json.

    python scripts/gpu_bench.py [--tokenizer-dir DIR] [--skip-hf] [--throughput-prompts 1000]

Model: Qwen2.5-7B shapes (scripts/models/qwen2.5-7b/config.json), random bf16 weights (load_format dummy);
the Qwen2.5 tokenizer is built from vocab.json + merges.txt (../shared/data/tokenizers/qwen2.5, carried to
the GPU machine).
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

from gpu_profile import PROFILE_CASES, profile_steps  # noqa: E402
from hf_baselines import hf_baseline, hf_compiled_baseline  # noqa: E402


def measure_bandwidth(gib: float = 4.0, device: int | str = "cuda") -> float:
    """Device-to-device copy on one GPU: bytes read + written per second (median of 20 after 5 warm-ups)."""
    n = int(gib * (1 << 30)) // 2
    a = torch.randn(n, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    times = []
    with torch.cuda.device(a.device):
        for _ in range(25):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            b.copy_(a)
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) / 1e3)
    t = sorted(times[5:])[len(times[5:]) // 2]
    del a, b
    torch.cuda.empty_cache()
    return 2 * n * 2 / t


def measure_gemm_flops(n: int = 8192) -> float:
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 2 * n ** 3 * 10 / (time.perf_counter() - t0)


def build_model_dir(tokenizer_dir: Path) -> Path:
    from transformers import Qwen2Tokenizer

    d = Path(tempfile.mkdtemp(prefix="qwen7b-"))
    shutil.copy(REPO / "scripts/models/qwen2.5-7b/config.json", d / "config.json")
    tok = Qwen2Tokenizer(vocab=str(tokenizer_dir / "vocab.json"), merges=str(tokenizer_dir / "merges.txt"))
    assert tok.encode("Hello world") == [9707, 1879], tok.encode("Hello world")
    tok.save_pretrained(d)
    return d


QUANT_CONFIGS = {
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
             "checkpoint_format": "gptq"},
    # the LM head quantized too (GPTQModel's lm_head=True, nvllm quantize --quantize-lm-head)
    "gptq-head": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
                  "checkpoint_format": "gptq", "lm_head": True},
    # FP8 weights in 128×128 blocks (Qwen3-*-FP8, DeepSeek-V3): W8A16 at batch 1, W8A8 on Hopper from
    # nvllm.kernels.fp8_gemm.W8A8_MIN_M rows; keys say w8
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]},
}


def quant_runs(model_dir: Path, res: dict, methods: list[str], save, suffix: str = "", profile: bool = False,
               batches: tuple[int, ...] = ()) -> None:
    """W4A16 g128 decode at batch 1 (random packed weights; bf16 lm_head unless "-head") against the bf16 TPOT of
    this run; keys ``nvllm_{method}_w4{suffix}_…`` (``w8`` for fp8). ``batches``: also the decode step at each of
    these batch sizes with 256-token contexts (``…_b{n}_step_ms``). ``profile``: then torch.profiler over 32 decode steps of each
    (``profile_{method}_decode_b1…``)."""
    from nvllm.bench.offline import run_latency
    from nvllm.config import EngineConfig
    from nvllm.llm import LLM

    for method in methods:
        qdir = Path(tempfile.mkdtemp(prefix=f"qwen7b-{method}-"))
        for f in model_dir.iterdir():
            shutil.copy(f, qdir / f.name)
        cfg = json.loads((qdir / "config.json").read_text())
        cfg["quantization_config"] = QUANT_CONFIGS[method]
        (qdir / "config.json").write_text(json.dumps(cfg))
        config = EngineConfig(model=str(qdir), load_format="dummy", dtype="bfloat16", max_model_len=4096,
                              max_num_seqs=64, log_stats_interval=0)
        llm = LLM.from_config(config)
        lat = run_latency(config, batch_size=1, input_len=128, output_len=256, num_iters_warmup=1, num_iters=3,
                          progress=False, llm=llm)
        bits = "w8" if method.startswith("fp8") else "w4"
        res[f"nvllm_{method}_{bits}{suffix}_tpot_ms"] = lat["median_tpot_ms"]
        res[f"nvllm_{method}_{bits}{suffix}_kernel_report"] = lat["kernel_report"]
        res[f"nvllm_{method}_{bits}{suffix}_greedy"] = greedy_ids(llm)
        for b in batches:
            res[f"nvllm_{method}_{bits}{suffix}_b{b}_step_ms"] = decode_step_ms(llm, b, 256, steps=32)
        save()
        if profile:  # last: a profiler session slows the process's later launches
            profile_steps(llm, res, [c for c in PROFILE_CASES if c[0].startswith("decode")], f"{method}_")
            save()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def greedy_ids(llm, tokens: int = 48) -> list[list[int]]:
    """Greedy token ids of four fixed random prompts (batch 4 and batch 1), to compare settings' engines by."""
    from nvllm.bench.offline import random_token_prompts
    from nvllm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    prompts = random_token_prompts(llm.get_tokenizer(), 4, 64, seed=5)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    return outs + [llm.generate(prompts[:1], params, use_tqdm=False)[0].outputs[0].token_ids]


def decode_step_ms(llm, batch: int, context: int, steps: int = 16) -> float:
    """Mean time of a pure decode step for `batch` sequences of `context` tokens: every prompt is prefilled
    first, then `steps` decode steps are timed (TPOT from request timestamps would count the other
    requests' prefills that chunked prefill interleaves)."""
    from nvllm.bench.offline import random_token_prompts
    from nvllm.sampling_params import SamplingParams

    eng = llm.engine
    eng.block_manager.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for p in random_token_prompts(llm.get_tokenizer(), batch, context, seed=3):
        eng.add_request(None, p, params)
    sched = eng.scheduler
    while sched.waiting or any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running):
        eng.step(partial=False)
    eng.step(partial=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step(partial=False)
    torch.cuda.synchronize()
    ms = 1000 * (time.perf_counter() - t0) / steps
    while eng.has_unfinished_requests():
        eng.step(partial=False)
    return ms


def kv_runs(model_dir: Path, res: dict, dtypes: list[str], save) -> None:
    """Quantized KV cache: pool capacity at the same gpu_memory_utilization, and the decode step time with
    8K-token contexts at batch 1 and 32, against the bf16 cache, in this run."""
    from nvllm.config import EngineConfig
    from nvllm.llm import LLM

    for kv in dtypes:
        config = EngineConfig(model=str(model_dir), load_format="dummy", dtype="bfloat16", max_model_len=8448,
                              max_num_seqs=32, max_num_batched_tokens=8192, kv_cache_dtype=kv, log_stats_interval=0)
        llm = LLM.from_config(config)
        res[f"kv_{kv}_tokens"] = llm.engine.runner.num_blocks * llm.engine.runner.block_size
        for batch in (1, 32):
            res[f"kv_{kv}_b{batch}_8k_step_ms"] = decode_step_ms(llm, batch, 8192)
            save()
        del llm
        gc.collect()
        torch.cuda.empty_cache()


def kv_throughput_runs(model_dir: Path, res: dict, dtypes: list[str], save, gib: float = 12.0) -> None:
    """Offline throughput at a load the bf16 cache cannot hold: 400 requests of 1536 in / 256 out, up to 256 at
    once (≈ 460K tokens) against a pool of `gib` GiB (≈ 224K bf16 tokens): the 8-bit caches fit about twice
    the running sequences in the same bytes."""
    from nvllm.bench.offline import run_throughput
    from nvllm.config import EngineConfig
    from nvllm.llm import LLM

    for kv in dtypes:
        config = EngineConfig(model=str(model_dir), load_format="dummy", dtype="bfloat16", max_model_len=4096,
                              max_num_seqs=256, max_num_batched_tokens=8192, kv_cache_dtype=kv,
                              kv_cache_memory=gib, log_stats_interval=10)
        llm = LLM.from_config(config)
        res[f"kvthr_{kv}_tokens"] = llm.engine.runner.num_blocks * llm.engine.runner.block_size
        thr = run_throughput(config, num_prompts=400, input_len=1536, output_len=256, progress=False, llm=llm)
        res[f"kvthr_{kv}_output_tok_s"] = thr["output_tokens_per_second"]
        res[f"kvthr_{kv}_elapsed_s"] = thr["elapsed_time"]
        res[f"kvthr_{kv}_preemptions"] = llm.engine.scheduler.num_preemptions
        save()
        del llm
        gc.collect()
        torch.cuda.empty_cache()




def skinny_demo_gemms(dtype) -> None:
    """Route the demo model's small-batch GEMMs (batch buckets 1-4) to the skinny kernel with 8-row tiles, so that
    the check runs it — and the SiLU·mul epilogue of the interleaved gate/up — and not cuBLAS, which the
    shipped table leaves these small shapes to."""
    from nvllm.assets import demo_model_path
    from nvllm.kernels import gemm as G

    c = json.loads((Path(demo_model_path()) / "config.json").read_text())
    h, inter, heads = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
    kv = c.get("num_key_value_heads", heads) * (h // heads)
    for n, k in ((h + 2 * kv, h), (h, h), (2 * inter, h), (h, inter), (c["vocab_size"], h)):
        for m in (1, 2, 4):
            G.set_gemm_choice(n, k, m, dtype, G.SkinnyConfig("fma", 8, 64))


def check_greedy(res: dict) -> None:
    """Correctness on the GPU before speed: the demo model's greedy outputs through the Triton kernels and
    CUDA graphs (its small-batch GEMMs on the skinny kernel) equal those of the torch references run eagerly,
    for a batch of 16 mixed-length prompts; the last configuration gives half of them a logit_bias and the
    repetition / presence / frequency penalties (counted on the device under asynchronous scheduling)."""
    from nvllm import LLM, SamplingParams
    from nvllm.kernels import gemm as G

    words = "Once upon a time there was a little girl named Lily who loved to play in the park".split()
    prompts = [" ".join(words[: 2 + (3 * i) % 15]) for i in range(16)]
    plain = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    penalized = [plain if i % 2 else SamplingParams(temperature=0, max_tokens=48, ignore_eos=True,
                                                    repetition_penalty=1.3, presence_penalty=0.4,
                                                    frequency_penalty=0.3, logit_bias={13: -5.0, 29: 2.0})
                 for i in range(len(prompts))]
    for dtype, kv, params in (("float32", "auto", plain), ("bfloat16", "auto", plain), ("float32", "int8", plain),
                              ("float32", "auto", penalized)):
        got = {}
        for kernels in ("torch", "auto"):
            os.environ["NVLLM_KERNELS"] = kernels
            G.clear_gemm_table()
            if kernels == "auto":  # before the engine is built: its gate/up layout and graphs follow the table
                skinny_demo_gemms(getattr(torch, dtype))
            llm = LLM(dtype=dtype, kv_cache_dtype=kv, enforce_eager=kernels == "torch", log_stats_interval=0,
                      max_num_seqs=32)
            got[kernels] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            del llm
            gc.collect()
            torch.cuda.empty_cache()
        os.environ.pop("NVLLM_KERNELS")
        G.clear_gemm_table()
        same = sum(a == b for a, b in zip(got["torch"], got["auto"]))
        tag = "" if params is plain else "_penalties"
        res[f"greedy_check_{dtype}_kv_{kv}{tag}"] = f"{same}/{len(prompts)}"
        print(f"[check] demo model {dtype}, kv cache {kv}{tag.replace('_', ', ')}: triton+graphs greedy == torch "
              f"eager for {same}/{len(prompts)} prompts", flush=True)


def nvllm_runs(model_dir: Path, res: dict, throughput_prompts: int, enforce_eager: bool, save,
               profile: bool = False, async_scheduling: bool = True, tag: str | None = None) -> None:
    from nvllm.bench.offline import run_latency, run_throughput
    from nvllm.config import EngineConfig
    from nvllm.kernels import report
    from nvllm.llm import LLM

    tag = tag or ("eager" if enforce_eager else "graphs" if async_scheduling else "sync")
    config = EngineConfig(model=str(model_dir), load_format="dummy", dtype="bfloat16", max_model_len=4096,
                          max_num_seqs=256, max_num_batched_tokens=8192, enforce_eager=enforce_eager,
                          async_scheduling=async_scheduling and not enforce_eager, log_stats_interval=10)
    t0 = time.perf_counter()
    llm = LLM.from_config(config)
    res[f"nvllm_{tag}_startup_s"] = time.perf_counter() - t0
    model = llm.engine.runner.model
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    embed_bytes = model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    res["param_bytes"] = param_bytes
    res["decode_step_weight_bytes"] = param_bytes - embed_bytes + model.shape.hidden_size * 2
    res["num_params"] = sum(p.numel() for p in model.parameters())
    res["kv_tokens"] = llm.engine.runner.num_blocks * llm.engine.runner.block_size

    lat = run_latency(config, batch_size=1, input_len=128, output_len=256, num_iters_warmup=1, num_iters=3,
                      progress=False, llm=llm)
    res[f"nvllm_{tag}_tpot_ms"] = lat["median_tpot_ms"]
    res[f"nvllm_{tag}_kernel_report_decode"] = lat["kernel_report"]
    save()
    for n in (512, 2048):
        p = run_latency(config, batch_size=1, input_len=n, output_len=1, num_iters_warmup=1, num_iters=5,
                        progress=False, llm=llm)
        res[f"nvllm_{tag}_ttft_{n}_ms"] = p["median_ttft_ms"]
        save()
    if throughput_prompts and not enforce_eager:
        report.reset()
        thr = run_throughput(config, num_prompts=throughput_prompts, input_len=512, output_len=256, progress=False,
                             llm=llm)
        key = "nvllm_throughput" if tag == "graphs" else f"nvllm_{tag}_throughput"
        res[f"{key}_output_tok_s"] = thr["output_tokens_per_second"]
        res[f"{key}_elapsed_s"] = thr["elapsed_time"]
        res[f"{key}_requests"] = thr["num_requests"]
        res[f"{key}_kernel_report"] = thr["kernel_report"]
    if profile:  # last: a torch.profiler session leaves the process's later launches slower
        profile_steps(llm, res)
        save()
    del llm, model
    gc.collect()
    torch.cuda.empty_cache()


def with_env(name: str, value: str, fn):
    """Run ``fn`` with environment variable ``name`` set to ``value`` (engines read it when they are built)."""
    return with_envs({name: value}, fn)


def with_envs(env: dict[str, str], fn):
    """Run ``fn`` with the variables of ``env`` set, then restore them as they were; returns what ``fn`` returns."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return fn()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def with_tuned(entries: dict, fn, merge: bool = False):
    """Run ``fn`` with ``quant_gemv.TUNED[key]`` set to ``entries[key]`` (engines pick their GEMV config per call from
    it; ``merge``: laid over the shipped entry instead of replacing it), then restore the shipped defaults; returns
    what ``fn`` returns."""
    from nvllm.kernels import quant_gemv as QV

    old = {k: dict(v) for k, v in QV.TUNED.items()}
    for key, cfg in entries.items():
        QV.TUNED[key] = dict(QV.TUNED.get(key, {}), **cfg) if merge else dict(cfg)
    try:
        return fn()
    finally:
        QV.TUNED.clear()
        QV.TUNED.update(old)


def with_gemv_defaults(configs: dict, fn) -> None:
    """``with_tuned`` for the one-row 4-bit entry of each format: ``configs[format]`` replaces it."""
    with_tuned({(fmt, 4, 1): cfg for fmt, cfg in configs.items()}, fn)


def table(res: dict) -> str:
    bw, fl = res["bandwidth_Bps"], res["gemm_flops"]
    lines = [f"card {res['card']}  commit {res['commit']}  bandwidth {bw / 1e12:.2f} TB/s  "
             f"bf16 GEMM {fl / 1e12:.0f} TFLOP/s"]
    if "decode_step_weight_bytes" not in res:  # the bf16 engine runs were skipped
        res = dict(res, decode_step_weight_bytes=0, num_params=0)
    wall_ms = 1000 * res["decode_step_weight_bytes"] / bw
    if wall_ms:
        lines.append(f"decode wall (batch 1, weights only): {wall_ms:.2f} ms/token = {1000 / wall_ms:.0f} tok/s")
    for tag in ("graphs", "nopdl", "silu", "sync", "eager"):
        k = f"nvllm_{tag}_tpot_ms"
        if k in res:
            t = res[k]
            lines.append(f"nvllm {tag:6s} TPOT {t:.2f} ms = {1000 / t:.0f} tok/s = {100 * wall_ms / t:.1f}% of wall"
                         + (f", {res['hf_tpot_ms'] / t:.2f}x HF" if "hf_tpot_ms" in res else "")
                         + (f", {res['hf_compiled_tpot_ms'] / t:.3f}x HF compiled" if "hf_compiled_tpot_ms" in res else ""))
    if "hf_tpot_ms" in res:
        lines.append(f"HF eager     TPOT {res['hf_tpot_ms']:.2f} ms = {1000 / res['hf_tpot_ms']:.0f} tok/s")
    if "hf_compiled_tpot_ms" in res:
        t = res["hf_compiled_tpot_ms"]
        lines.append(f"HF compiled  TPOT {t:.2f} ms = {1000 / t:.0f} tok/s (static cache; warm-up "
                     f"{res['hf_compiled_warmup_s']:.0f} s, {res['hf_compiled_graphs']} compiled graphs)")
    for n in (512, 2048) if res["num_params"] else ():
        limit_ms = 1000 * 2 * res["num_params"] * n / fl
        row = f"prefill {n}: FLOP limit {limit_ms:.1f} ms"
        for tag in ("graphs", "nopdl", "silu", "sync", "eager"):
            k = f"nvllm_{tag}_ttft_{n}_ms"
            if k in res:
                row += f"; nvllm {tag} {res[k]:.1f} ms ({res[k] / limit_ms:.2f}x)"
        if f"hf_prefill_{n}_ms" in res:
            row += f"; HF {res[f'hf_prefill_{n}_ms']:.1f} ms ({res[f'hf_prefill_{n}_ms'] / limit_ms:.2f}x)"
        lines.append(row)
    for method, suffix in ((m, s) for m in QUANT_CONFIGS for s in ("", "_finished", "_nopdl", "_gemv", "_stage2")):
        bits = "w8" if method.startswith("fp8") else "w4"
        k = f"nvllm_{method}_{bits}{suffix}_tpot_ms"
        if k in res:
            what = "fp8 block 128" if bits == "w8" else "W4A16 g128"
            line = f"{method}{suffix} {what} TPOT {res[k]:.2f} ms = {1000 / res[k]:.0f} tok/s"
            if "nvllm_graphs_tpot_ms" in res:
                line += f" ({res['nvllm_graphs_tpot_ms'] / res[k]:.2f}x nvllm bf16)"
            pre = f"nvllm_{method}_{bits}{suffix}_b"
            per_batch = [(int(b[len(pre):-len("_step_ms")]), v) for b, v in res.items()
                         if b.startswith(pre) and b.endswith("_step_ms")]
            if per_batch:
                line += "; decode step at 256 tokens: " + ", ".join(f"b{b} {v:.3f} ms" for b, v in sorted(per_batch))
            lines.append(line)
    for kv in ("auto", "int8", "fp8_e4m3"):
        if f"kv_{kv}_tokens" in res:
            line = f"kv cache {kv}: {res[f'kv_{kv}_tokens']} tokens"
            if kv != "auto" and "kv_auto_tokens" in res:
                line += f" ({res[f'kv_{kv}_tokens'] / res['kv_auto_tokens']:.2f}x bf16)"
            for b in (1, 32):
                k = f"kv_{kv}_b{b}_8k_step_ms"
                if k in res:
                    line += f"; 8K ctx batch {b} decode step {res[k]:.2f} ms"
                    if kv != "auto" and f"kv_auto_b{b}_8k_step_ms" in res:
                        line += f" ({res[f'kv_auto_b{b}_8k_step_ms'] / res[k]:.2f}x bf16 speed)"
            lines.append(line)
    for kv in ("auto", "int8", "fp8_e4m3"):
        if f"kvthr_{kv}_output_tok_s" in res:
            line = (f"KV-bound throughput ({res[f'kvthr_{kv}_tokens']} {kv} tokens), 400 x 1536/256: "
                    f"{res[f'kvthr_{kv}_output_tok_s']:.0f} output tok/s, {res[f'kvthr_{kv}_preemptions']} preemptions")
            if kv != "auto" and "kvthr_auto_output_tok_s" in res:
                line += f" ({res[f'kvthr_{kv}_output_tok_s'] / res['kvthr_auto_output_tok_s']:.2f}x bf16)"
            lines.append(line)
    for key, what in (("nvllm_throughput", "async scheduling"), ("nvllm_nopdl_throughput", "no PDL"),
                      ("nvllm_silu_throughput", "SiLU·mul in the gate_up epilogue"),
                      ("nvllm_sync_throughput", "synchronous")):
        if f"{key}_output_tok_s" in res:
            lines.append(f"throughput {res[f'{key}_requests']} x 512/256 ({what}): "
                         f"{res[f'{key}_output_tok_s']:.0f} output tok/s ({res[f'{key}_elapsed_s']:.1f} s)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer-dir", default=str(REPO / ".carry/qwen2.5"))
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--hf-compiled", action="store_true",
                    help="also HF transformers with a static cache and its compiled decode (the gpt-fast way)")
    ap.add_argument("--skip-nvllm", action="store_true", help="skip the bf16 latency/prefill/throughput runs")
    ap.add_argument("--skip-eager", action="store_true")
    ap.add_argument("--sync", action="store_true", help="also run the graphs engine with asynchronous scheduling off")
    ap.add_argument("--throughput-prompts", type=int, default=1000)
    ap.add_argument("--silu-compare", action="store_true",
                    help="also run the graphs engine with SiLU·mul in the gate_up epilogue (NVLLM_FUSED_SILU=1), first")
    ap.add_argument("--pdl-compare", action="store_true",
                    help="also run the graphs engine (and --quant) with programmatic dependent launch off, first")
    ap.add_argument("--profile", action="store_true",
                    help="profile a prefill and decode steps (torch.profiler); with --quant, each format's decode steps too")
    ap.add_argument("--kv", default="", help="comma-separated KV-cache dtypes to compare at 8K context: auto,int8,...")
    ap.add_argument("--kv-throughput", default="",
                    help="comma-separated KV-cache dtypes for the KV-bound throughput run: auto,int8,...")
    ap.add_argument("--quant", default="",
                    help="comma-separated quantized formats to time at batch 1: awq,gptq,gptq-head,fp8")
    ap.add_argument("--quant-batches", default="",
                    help="comma-separated batch sizes: with --quant, also the decode step at each (256-token contexts)")
    ap.add_argument("--partial-compare", action="store_true",
                    help="also run --quant with every split-K sum finished in the GEMV (NVLLM_PARTIAL_SUMS=0), first; "
                         "keys _finished")
    ap.add_argument("--merge-compare", action="store_true",
                    help="also run --quant with decode attention merged by its own kernel "
                         "(NVLLM_ATTENTION_PARTIALS=0), first; keys _stage2")
    ap.add_argument("--gemv-compare", default="",
                    help='also run --quant with these one-row GEMV defaults (JSON, format -> quant_gemv config, e.g. '
                         '{"gptq": {"variant": "half2", "block_n": 128, "block_k": 64, "num_warps": 1}}); keys _gemv')
    args = ap.parse_args()
    out = Path(os.environ.get("OUT", "."))
    res: dict = {"card": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    # the device machine gets the working tree without .git: the caller passes NVLLM_COMMIT
    res["commit"] = os.environ.get("NVLLM_COMMIT") or subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    res["bandwidth_Bps"] = measure_bandwidth()
    res["gemm_flops"] = measure_gemm_flops()
    model_dir = build_model_dir(Path(args.tokenizer_dir))

    def save() -> None:
        (out / "gpu_bench.json").write_text(json.dumps(res, indent=1, default=str))

    steps = [] if args.skip_check else [("check", lambda: check_greedy(res))]
    if not args.skip_hf:
        steps.append(("hf", lambda: hf_baseline(model_dir, res)))
    if args.sync:
        steps.append(("nvllm sync", lambda: nvllm_runs(model_dir, res, args.throughput_prompts, False, save,
                                                       async_scheduling=False)))
    if args.silu_compare and not args.skip_nvllm:
        steps.append(("nvllm silu", lambda: with_env("NVLLM_FUSED_SILU", "1", lambda: nvllm_runs(
            model_dir, res, args.throughput_prompts, False, save, tag="silu"))))
    if args.pdl_compare and not args.skip_nvllm:
        steps.append(("nvllm nopdl", lambda: with_env("NVLLM_PDL", "0", lambda: nvllm_runs(
            model_dir, res, args.throughput_prompts, False, save, tag="nopdl"))))
    if not args.skip_nvllm:
        steps.append(("nvllm graphs", lambda: nvllm_runs(model_dir, res, args.throughput_prompts, False, save,
                                                         args.profile)))
    if not args.skip_eager:
        steps.append(("nvllm eager", lambda: nvllm_runs(model_dir, res, 0, True, save)))
    if args.kv:
        steps.append(("kv", lambda: kv_runs(model_dir, res, args.kv.split(","), save)))
    if args.kv_throughput:
        steps.append(("kv throughput", lambda: kv_throughput_runs(model_dir, res, args.kv_throughput.split(","), save)))
    if args.quant and args.pdl_compare:
        steps.append(("quant nopdl", lambda: with_env("NVLLM_PDL", "0", lambda: quant_runs(
            model_dir, res, args.quant.split(","), save, "_nopdl"))))
    quant_batches = tuple(int(b) for b in args.quant_batches.split(",") if b)
    if args.quant and args.partial_compare:
        steps.append(("quant finished", lambda: with_env("NVLLM_PARTIAL_SUMS", "0", lambda: quant_runs(
            model_dir, res, args.quant.split(","), save, "_finished", batches=quant_batches))))
    if args.quant and args.merge_compare:
        steps.append(("quant stage2", lambda: with_env("NVLLM_ATTENTION_PARTIALS", "0", lambda: quant_runs(
            model_dir, res, args.quant.split(","), save, "_stage2", batches=quant_batches))))
    if args.quant:
        steps.append(("quant", lambda: quant_runs(model_dir, res, args.quant.split(","), save, profile=args.profile,
                                                  batches=quant_batches)))
    if args.quant and args.gemv_compare:
        res["gemv_compare"] = json.loads(args.gemv_compare)
        steps.append(("quant gemv", lambda: with_gemv_defaults(res["gemv_compare"], lambda: quant_runs(
            model_dir, res, args.quant.split(","), save, "_gemv"))))
    if args.hf_compiled:  # last: its compile time is the least predictable
        steps.append(("hf compiled", lambda: hf_compiled_baseline(model_dir, res)))
    for name, fn in steps:
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as e:  # keep what was measured so far
            import traceback

            traceback.print_exc()
            res[f"{name}_error"] = repr(e)
        print(f"[{name}] {time.perf_counter() - t0:.1f} s", flush=True)
        save()
        try:
            print(table(res), flush=True)
        except KeyError:
            pass


if __name__ == "__main__":
    main()
