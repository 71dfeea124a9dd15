"""Offline benchmarks through the `LLM` API (no server): `bench throughput` and `bench latency`.

throughput: N requests (a dataset, or random prompts of the given lengths; all N fit max_model_len) submitted at
  once; reports requests/s, output tok/s and total tok/s over the wall time of the generate call, counting the
  tokens the engine really produced. Result keys follow vLLM's throughput benchmark (elapsed_time, num_requests,
  total_num_tokens, requests_per_second, tokens_per_second) plus output_tokens_per_second.
latency: one batch of `batch_size` random prompts, `num_iters_warmup` untimed then `num_iters` timed
  generate calls (the prefix cache emptied before each, so every call prefills in full); reports per-iteration
  latency (vLLM's avg_latency / latencies / percentiles) and the TTFT and TPOT of every request from the engine's
  own timestamps.
Both reset the kernel report after warm-up and return what ran during the measured part; with --speculative
they also report the acceptance of the measured part (the spec_decode_* keys bench serve reports).
"""

from __future__ import annotations

import time
from datetime import datetime
from typing import Any

import numpy as np

from nvllm.bench.datasets import load_requests, plain_token_ids, random_lengths
from nvllm.bench.metrics import summarize
from nvllm.config import EngineConfig

LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)  # vLLM's latency benchmark


def _header(mode: str, llm) -> dict[str, Any]:
    c = llm.config
    return {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "mode": mode, "model_id": c.model,
            "dtype": str(llm.engine.runner.dtype).replace("torch.", ""), "device": c.device,
            "load_format": c.load_format}


def run_throughput(config: EngineConfig, dataset: str = "random", dataset_path: str | None = None,
                   num_prompts: int = 100, input_len: int | None = None, output_len: int | None = None,
                   range_ratio: float = 0.0, ignore_eos: bool = True, progress: bool = True,
                   llm=None) -> dict[str, Any]:
    """`llm`: an engine already built from `config` (scripts measuring several things reuse one)."""
    from nvllm.kernels import report
    from nvllm.llm import LLM
    from nvllm.sampling_params import SamplingParams

    from nvllm.engine.llm_engine import load_tokenizer
    from nvllm.models.hub import resolve_model_path

    # the dataset first, so that a bad file fails before the engine loads; prompts that do not fit the model are
    # skipped while sampling, so that exactly num_prompts requests run
    tokenizer = load_tokenizer(resolve_model_path(config.tokenizer))
    limit = llm.engine.max_model_len if llm is not None else _model_len(config)

    def sample(max_model_len):
        return load_requests(dataset, tokenizer, num_prompts, dataset_path, input_len, output_len, range_ratio,
                             seed=config.seed, max_model_len=max_model_len)

    requests = sample(limit)
    llm = llm or LLM.from_config(config)
    if any(r.prompt_len + r.expected_output_len > llm.engine.max_model_len for r in requests):
        requests = sample(llm.engine.max_model_len)  # the engine's limit is lower (its KV cache holds less)
    prompts = [r.prompt_token_ids or r.prompt for r in requests]
    params = [SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=ignore_eos, max_tokens=r.expected_output_len)
              for r in requests]
    report.reset()
    spec_before = _spec_counters(llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=progress)
    elapsed = time.perf_counter() - start
    n_in = sum(len(o.prompt_token_ids) for o in outputs)
    n_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {
        **_header("throughput", llm), "dataset": dataset, "dataset_path": dataset_path, "num_prompts": num_prompts,
        **_lengths(dataset, input_len, output_len, range_ratio), "seed": config.seed, "ignore_eos": ignore_eos,
        "elapsed_time": elapsed, "num_requests": len(outputs),
        "total_input_tokens": n_in, "total_output_tokens": n_out, "total_num_tokens": n_in + n_out,
        "requests_per_second": len(outputs) / elapsed, "tokens_per_second": (n_in + n_out) / elapsed,
        "output_tokens_per_second": n_out / elapsed,
        **_spec_result(llm, spec_before),
        "kernel_report": report.snapshot(),
    }


def _model_len(config: EngineConfig) -> int | None:
    """The engine's max_model_len read from config.json before the engine loads; None where it cannot be read here
    (a Hub id, a bad config: the engine says what is wrong)."""
    from nvllm.models.loader import config_model_len

    try:
        return config_model_len(config)
    except (OSError, TypeError, ValueError, AttributeError):  # ConfigError is a ValueError
        return None


def _lengths(dataset: str, input_len: int | None, output_len: int | None, range_ratio: float) -> dict[str, Any]:
    """The lengths the requests were drawn with, as a saved run reproduces them: the random dataset's defaults
    filled in; a file's input lengths are its own (None), as its output lengths are without --output-len."""
    if dataset == "random":
        input_len, output_len = random_lengths(input_len, output_len)
        return {"input_len": input_len, "output_len": output_len, "random_range_ratio": range_ratio}
    return {"input_len": None, "output_len": output_len}


def _spec_counters(llm):
    spec = llm.engine.stats.spec
    return spec.copy() if spec is not None else None


def _spec_result(llm, before) -> dict[str, Any]:
    """Speculative decoding during the measured part: the acceptance keys bench serve reports too."""
    spec = llm.engine.stats.spec
    if spec is None:
        return {}
    out = {"speculative": llm.config.speculative.describe()}
    out.update(spec.since(before).as_result())
    return out


def random_token_prompts(tokenizer, batch_size: int, input_len: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    allowed = plain_token_ids(tokenizer)
    return [allowed[rng.integers(0, len(allowed), size=input_len)].tolist() for _ in range(batch_size)]


def check_lengths(input_len: int, output_len: int, max_model_len: int) -> None:
    if input_len + output_len > max_model_len:
        raise ValueError(f"--input-len + --output-len = {input_len + output_len} exceeds max_model_len "
                         f"{max_model_len}")


def run_latency(config: EngineConfig, batch_size: int = 8, input_len: int = 32, output_len: int = 128,
                num_iters_warmup: int = 10, num_iters: int = 30, percentiles: list[float] | None = None,
                progress: bool = True, llm=None, temperature: float = 1.0) -> dict[str, Any]:
    """Every request samples at ``temperature`` (1.0, top-p 1, as vLLM's latency benchmark does; 0: greedy, the
    usual setting for speculative decoding's figures)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from nvllm.kernels import report
    from nvllm.llm import LLM
    from nvllm.logger import console
    from nvllm.sampling_params import SamplingParams

    for name, v, low in (("batch-size", batch_size, 1), ("input-len", input_len, 1), ("output-len", output_len, 1),
                         ("num-iters", num_iters, 1), ("num-iters-warmup", num_iters_warmup, 0)):
        if v < low:
            raise ValueError(f"--{name} must be at least {low}, got {v}")
    if not 0 <= temperature < float("inf"):
        raise ValueError(f"--temperature must be a finite number of at least 0, got {temperature}")
    percentiles = percentiles or [99.0]
    llm = llm or LLM.from_config(config)
    check_lengths(input_len, output_len, llm.engine.max_model_len)
    prompts = random_token_prompts(llm.get_tokenizer(), batch_size, input_len, config.seed)
    params = SamplingParams(temperature=temperature, top_p=1.0, ignore_eos=True, max_tokens=output_len)
    latencies, ttfts, tpots = [], [], []
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console(), disable=not progress) as bar:
        warm = bar.add_task("warm-up", total=num_iters_warmup)
        for _ in range(num_iters_warmup):
            llm.engine.block_manager.reset_prefix_cache()
            llm.generate(prompts, params, use_tqdm=False)
            bar.advance(warm)
        report.reset()
        spec_before = _spec_counters(llm)
        timed = bar.add_task("timed", total=num_iters)
        for _ in range(num_iters):
            llm.engine.block_manager.reset_prefix_cache()  # every iteration prefills its prompts in full
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            latencies.append(time.perf_counter() - start)
            for o in outputs:
                m, n = o.metrics, len(o.outputs[0].token_ids)
                ttfts.append(m.ttft)
                if n > 1:
                    tpots.append((m.last_token_time - m.first_token_time) / (n - 1))
            bar.advance(timed)
    lat = np.asarray(latencies)
    result = {
        **_header("latency", llm), "batch_size": batch_size, "input_len": input_len, "output_len": output_len,
        "num_iters_warmup": num_iters_warmup, "num_iters": num_iters, "temperature": temperature, "seed": config.seed,
        "avg_latency": float(lat.mean()), "latencies": latencies,
        "percentiles": {str(p): float(np.percentile(lat, p)) for p in LATENCY_PERCENTILES},
    }
    result.update(summarize(ttfts, percentiles, "ttft"))
    result.update(summarize(tpots, percentiles, "tpot"))
    result.update(_spec_result(llm, spec_before))
    result["kernel_report"] = report.snapshot()
    return result
