"""The `nvllm` command line. Each command parses flags into config objects and calls the package."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from nvllm.cli_options import USER_ERRORS, engine_options, fail
from nvllm.config import EngineConfig

app = typer.Typer(help="nvllm: fast, checked LLM inference on one engine.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False)


@app.callback()
def main_callback() -> None:
    """nvllm: fast, checked LLM inference — quantize, serve, bench and eval on one engine."""


@app.command()
@engine_options
def generate(
    prompts: Annotated[Optional[list[str]], typer.Argument(help="prompt(s); default: 'Once upon a time'")] = None,
    max_tokens: Annotated[int, typer.Option(help="tokens to generate per prompt")] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    top_k: Annotated[int, typer.Option(help="-1 = off")] = -1,
    min_p: Annotated[float, typer.Option()] = 0.0,
    sample_seed: Annotated[Optional[int], typer.Option("--sample-seed", help="per-request sampling seed")] = None,
    n: Annotated[int, typer.Option("-n", help="samples per prompt")] = 1,
    stop: Annotated[Optional[list[str]], typer.Option(help="stop string (repeatable)")] = None,
    ignore_eos: Annotated[bool, typer.Option()] = False,
    logprobs: Annotated[Optional[int], typer.Option(help="print top-N log-probabilities per token")] = None,
    *, engine_config: EngineConfig,
) -> None:
    """Generate continuations of prompts and print them."""
    from nvllm.llm import LLM
    from nvllm.logger import console
    from nvllm.sampling_params import SamplingParams

    try:
        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                seed=sample_seed, max_tokens=max_tokens, stop=stop or [], ignore_eos=ignore_eos,
                                logprobs=logprobs)
        llm = LLM.from_config(engine_config)
        outputs = llm.generate(prompts or ["Once upon a time"], params)
    except USER_ERRORS as e:
        fail(str(e))
    out = console()
    for o in outputs:
        for c in o.outputs:
            print(o.prompt + c.text, flush=True)
            out.print(f"[dim]({len(c.token_ids)} tokens, finish_reason={c.finish_reason}, "
                      f"ttft {1000 * (o.metrics.ttft or 0):.1f} ms)[/]", highlight=False)
            if c.logprobs:
                for tok, lp in zip(c.token_ids, c.logprobs):
                    out.print(f"  {llm.get_tokenizer().decode([tok])!r}: {lp[tok].logprob:.4f}", highlight=False)


# ---- nvllm bench ---------------------------------------------------------------------------------------
bench_app = typer.Typer(help="Benchmarks: serving (any OpenAI-compatible server), offline throughput and "
                             "latency, and compare.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")
_DATA = "Dataset"


@bench_app.command("serve")
def bench_serve(
    more_slos: Annotated[Optional[list[str]], typer.Argument(hidden=True, metavar="KEY:MS",
                                                             help="more --goodput pairs")] = None,
    base_url: Annotated[str, typer.Option(help="server root, e.g. http://127.0.0.1:8000")] = "http://127.0.0.1:8000",
    endpoint: Annotated[str, typer.Option(help="/v1/completions or /v1/chat/completions")] = "/v1/completions",
    model: Annotated[Optional[str], typer.Option(help="model name to request (default: the server's first)")] = None,
    tokenizer: Annotated[Optional[str], typer.Option(help="tokenizer directory for prompt lengths "
                                                     "(default: --model if a directory, else the demo model's)")] = None,
    dataset: Annotated[str, typer.Option("--dataset", "--dataset-name", help="random | sharegpt | jsonl | gsm8k",
                                         rich_help_panel=_DATA)] = "random",
    dataset_path: Annotated[Optional[str], typer.Option(rich_help_panel=_DATA)] = None,
    num_prompts: Annotated[int, typer.Option(rich_help_panel=_DATA)] = 1000,
    input_len: Annotated[Optional[int], typer.Option(help="random: prompt tokens (default 128)",
                                                     rich_help_panel=_DATA)] = None,
    output_len: Annotated[Optional[int], typer.Option(help="max_tokens per request (default: from the data; "
                                                      "random: 128)", rich_help_panel=_DATA)] = None,
    random_range_ratio: Annotated[float, typer.Option(rich_help_panel=_DATA)] = 0.0,
    request_rate: Annotated[float, typer.Option(help="requests/s; inf sends all at once")] = float("inf"),
    burstiness: Annotated[float, typer.Option(help="gamma shape of the gaps; 1 = Poisson")] = 1.0,
    max_concurrency: Annotated[Optional[int], typer.Option(help="cap on requests in flight")] = None,
    ignore_eos: Annotated[bool, typer.Option(help="ask the server to ignore EOS (vLLM extension)")] = False,
    temperature: Annotated[Optional[float], typer.Option(help="default: the server's")] = None,
    goodput: Annotated[Optional[list[str]], typer.Option(help="SLOs in ms, e.g. --goodput ttft:200 tpot:20")] = None,
    metric_percentiles: Annotated[str, typer.Option(help="e.g. 50,90,99")] = "99",
    seed: Annotated[int, typer.Option(help="dataset and arrival seed")] = 0,
    api_key: Annotated[Optional[str], typer.Option(envvar="OPENAI_API_KEY", show_envvar=False)] = None,
    save_result: Annotated[Optional[str], typer.Option(help="write the result JSON here")] = None,
    progress: Annotated[bool, typer.Option(help="live progress bar")] = True,
) -> None:
    """Benchmark a running OpenAI-compatible server over streaming HTTP (TTFT, TPOT, ITL, E2EL, goodput)."""
    from pathlib import Path

    from nvllm.assets import demo_model_path
    from nvllm.bench import datasets, metrics, report, serve
    from nvllm.engine.llm_engine import load_tokenizer

    if more_slos and not goodput:
        fail(f"unexpected argument {more_slos[0]!r}")
    try:
        slos = metrics.parse_goodput((goodput or []) + (more_slos or []))
        opts = serve.ServeOptions(base_url=base_url, endpoint=endpoint, model=model, request_rate=request_rate,
                                  burstiness=burstiness, max_concurrency=max_concurrency, ignore_eos=ignore_eos,
                                  temperature=temperature, percentiles=metrics.parse_percentiles(metric_percentiles),
                                  goodput=slos, seed=seed, api_key=api_key, progress=progress)
        tok = load_tokenizer(tokenizer or (model if model and Path(model).is_dir() else demo_model_path()))
        requests = datasets.load_requests(dataset, tok, num_prompts, dataset_path, input_len, output_len,
                                          random_range_ratio, seed)
        result = serve.run_serve_benchmark(opts, requests, tok)
    except (serve.BenchError, *USER_ERRORS) as e:
        fail(str(e))
    report.finish(result, save_result)
    if result["completed"] == 0:
        fail(f"all {result['failed']} requests failed", code=1)


@bench_app.command("throughput")
@engine_options
def bench_throughput(
    dataset: Annotated[str, typer.Option("--dataset", "--dataset-name", help="random | sharegpt | jsonl | gsm8k",
                                         rich_help_panel=_DATA)] = "random",
    dataset_path: Annotated[Optional[str], typer.Option(rich_help_panel=_DATA)] = None,
    num_prompts: Annotated[int, typer.Option(rich_help_panel=_DATA)] = 100,
    input_len: Annotated[Optional[int], typer.Option(help="random: prompt tokens (default 128)",
                                                     rich_help_panel=_DATA)] = None,
    output_len: Annotated[Optional[int], typer.Option(help="tokens per request (default: from the data; "
                                                      "random: 128)", rich_help_panel=_DATA)] = None,
    random_range_ratio: Annotated[float, typer.Option(rich_help_panel=_DATA)] = 0.0,
    ignore_eos: Annotated[bool, typer.Option(help="generate exactly the output length")] = True,
    save_result: Annotated[Optional[str], typer.Option(help="write the result JSON here")] = None,
    progress: Annotated[bool, typer.Option(help="progress bar")] = True,
    *, engine_config: EngineConfig,
) -> None:
    """Offline throughput through the engine: requests/s, output tok/s, total tok/s."""
    from nvllm.bench import offline, report

    try:
        result = offline.run_throughput(engine_config, dataset, dataset_path, num_prompts, input_len, output_len,
                                        random_range_ratio, ignore_eos, progress)
    except USER_ERRORS as e:
        fail(str(e))
    report.finish(result, save_result)


@bench_app.command("latency")
@engine_options
def bench_latency(
    batch_size: Annotated[int, typer.Option()] = 8,
    input_len: Annotated[int, typer.Option()] = 32,
    output_len: Annotated[int, typer.Option()] = 128,
    num_iters_warmup: Annotated[int, typer.Option()] = 10,
    num_iters: Annotated[int, typer.Option()] = 30,
    metric_percentiles: Annotated[str, typer.Option(help="TTFT/TPOT percentiles, e.g. 50,90,99")] = "99",
    save_result: Annotated[Optional[str], typer.Option(help="write the result JSON here")] = None,
    progress: Annotated[bool, typer.Option(help="progress bar")] = True,
    *, engine_config: EngineConfig,
) -> None:
    """Offline latency of one batch: per-iteration latency percentiles, TTFT and TPOT."""
    from nvllm.bench import metrics, offline, report

    try:
        result = offline.run_latency(engine_config, batch_size, input_len, output_len, num_iters_warmup, num_iters,
                                     metrics.parse_percentiles(metric_percentiles), progress)
    except USER_ERRORS as e:
        fail(str(e))
    report.finish(result, save_result)


@bench_app.command("compare")
def bench_compare(
    a: Annotated[str, typer.Argument(help="baseline result JSON")],
    b: Annotated[str, typer.Argument(help="result JSON to compare with it")],
) -> None:
    """Two saved results side by side, with B / A ratios."""
    from nvllm.bench import report
    from nvllm.logger import console

    try:
        ra, rb = report.load_result(a), report.load_result(b)
    except ValueError as e:
        fail(str(e))
    if ra.get("mode") != rb.get("mode"):
        console().print(f"[yellow]note:[/] comparing a {ra.get('mode')!r} result with a {rb.get('mode')!r} one")
    for table in report.compare_tables(ra, rb, a, b):
        console().print(table)


@app.command()
@engine_options
def serve(
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on")] = 8000,
    api_key: Annotated[Optional[str], typer.Option(envvar="NVLLM_API_KEY",
                                                   help="require 'Authorization: Bearer KEY' (401 without it)")] = None,
    served_model_name: Annotated[Optional[str], typer.Option(help="model name clients send (default: --model)")] = None,
    chat_template: Annotated[Optional[str], typer.Option(help="Jinja chat template file (default: the tokenizer's)")] = None,
    max_request_bytes: Annotated[int, typer.Option(help="larger request bodies get 413")] = 16 * 1024 * 1024,
    shutdown_timeout: Annotated[int, typer.Option(help="seconds in-flight requests get on SIGINT/SIGTERM")] = 30,
    uvicorn_log_level: Annotated[str, typer.Option(help="uvicorn's log level (access lines at info)")] = "info",
    *, engine_config: EngineConfig,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (completions, chat, models, metrics)."""
    from nvllm.serve.api_server import ServerConfig, run_server

    try:
        config = ServerConfig(host=host, port=port, api_key=api_key, served_model_name=served_model_name,
                              chat_template=chat_template, max_request_bytes=max_request_bytes,
                              shutdown_timeout=shutdown_timeout, log_level=uvicorn_log_level)
        run_server(engine_config, config)
    except USER_ERRORS as e:
        fail(str(e))


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
