"""HF transformers on the benchmark's shapes, as gpu_bench.py compares nvllm with it (issue 3): eager generate, and
generate with a static KV cache and its compiled decode forward (the gpt-fast way, through transformers' own
CompileConfig). Random weights from the config; ms per token at batch 1 and prefill times."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import torch


def hf_baseline(model_dir: Path, res: dict) -> None:
    """HF transformers eager: batch-1 decode ms/token and prefill times at 512 / 2048 tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 150000, (1, 128), device="cuda")
    gen = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, **gen)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **gen)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=65, min_new_tokens=65, **gen)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        res["hf_tpot_ms"] = 1000 * ((t2 - t1) - (t1 - t0)) / 64
        for n in (512, 2048):
            x = torch.randint(0, 150000, (1, n), device="cuda")
            model(x, logits_to_keep=1)
            torch.cuda.synchronize()
            ts = []
            for _ in range(5):
                t0 = time.perf_counter()
                model(x, logits_to_keep=1)
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t0)
            res[f"hf_prefill_{n}_ms"] = 1000 * sorted(ts)[2]
    del model
    gc.collect()
    torch.cuda.empty_cache()


def hf_compiled_baseline(model_dir: Path, res: dict, device: str = "cuda") -> None:
    """HF transformers the gpt-fast way: static KV cache, the decode forward compiled by generate() (torch.compile,
    CUDA graphs: transformers' own CompileConfig). Batch-1 decode ms/token, after a warm-up that compiles."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    model.generation_config.cache_implementation = "static"
    ids = torch.randint(0, min(cfg.vocab_size, 150000), (1, 128), device=device)
    gen = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    from torch._dynamo.utils import counters

    with torch.no_grad():
        t0 = time.perf_counter()
        for _ in range(2):  # compiles, then replays once more at this cache size
            model.generate(ids, max_new_tokens=65, min_new_tokens=65, **gen)
            if device == "cuda" and not counters["stats"]["unique_graphs"]:  # generate() did not compile: we do
                model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        sync()
        res["hf_compiled_warmup_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **gen)
        sync()
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=65, min_new_tokens=65, **gen)
        sync()
        t2 = time.perf_counter()
    res["hf_compiled_tpot_ms"] = 1000 * ((t2 - t1) - (t1 - t0)) / 64
    res["hf_compiled_graphs"] = int(counters["stats"]["unique_graphs"])  # 0: generate() did not compile
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
