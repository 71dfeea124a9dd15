"""`nvllm bench …`: serve (any OpenAI-compatible server), advise (disaggregate or not), throughput and latency
(offline, through the engine), compare. Each command parses its flags and calls the bench package."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from nvllm.cli_options import USER_ERRORS, engine_options, fail
from nvllm.config import EngineConfig
from nvllm.output_file import check_output_file

bench_app = typer.Typer(help="Benchmarks: serving (any OpenAI-compatible server), offline throughput and "
                             "latency, compare, and the disaggregation advisor.", no_args_is_help=True)
_DATA = "Dataset"


def _check_save(path: str | None) -> None:
    """--save-result checked before the benchmark runs: a path that cannot take the file fails now."""
    if path is not None:
        try:
            check_output_file(path, "--save-result")
        except ValueError as e:
            fail(str(e))


def _finish(result: dict, path: str | None) -> None:
    from nvllm.bench import report

    try:
        report.finish(result, path)
    except ValueError as e:  # the file system refused after the check (full, removed): the table was printed
        fail(str(e))


@bench_app.command("serve")
def bench_serve(
    more_slos: Annotated[Optional[list[str]], typer.Argument(hidden=True, metavar="KEY:MS",
                                                             help="more --goodput pairs")] = None,
    base_url: Annotated[Optional[str], typer.Option(help="server root (default http://127.0.0.1:8000)")] = None,
    host: Annotated[Optional[str], typer.Option(help="or the server's host (vLLM's flags, with --port)")] = None,
    port: Annotated[Optional[int], typer.Option(help="and port")] = None,
    endpoint: Annotated[Optional[str], typer.Option(help="/v1/completions or /v1/chat/completions (default: "
                                                    "--backend's)")] = None,
    backend: Annotated[str, typer.Option(help="vLLM's: openai | vllm (completions) or openai-chat (chat)")] = "openai",
    model: Annotated[Optional[str], typer.Option(help="model name to request (default: the server's first)")] = None,
    served_model_name: Annotated[Optional[str], typer.Option(help="vLLM's: the name to request, when --model "
                                                             "names the tokenizer's model")] = None,
    lora_modules: Annotated[Optional[list[str]], typer.Option(help="LoRA adapter names the server serves: each "
                                                              "request asks for one at random (repeat, or "
                                                              "comma-separate)")] = None,
    tokenizer: Annotated[Optional[str], typer.Option(
        help="tokenizer for prompt lengths (default: --model's, a directory or a Hub id; else the demo "
             "model's)")] = None,
    dataset: Annotated[str, typer.Option("--dataset", "--dataset-name", help="random | sharegpt | jsonl | gsm8k",
                                         rich_help_panel=_DATA)] = "random",
    dataset_path: Annotated[Optional[str], typer.Option(rich_help_panel=_DATA)] = None,
    num_prompts: Annotated[int, typer.Option(rich_help_panel=_DATA)] = 1000,
    input_len: Annotated[Optional[int], typer.Option("--input-len", "--random-input-len",
                                                     help="random: prompt tokens (default 128)",
                                                     rich_help_panel=_DATA)] = None,
    output_len: Annotated[Optional[int], typer.Option("--output-len", "--random-output-len", "--sharegpt-output-len",
                                                      help="max_tokens per request (default: from the data; "
                                                      "random: 128)", rich_help_panel=_DATA)] = None,
    random_range_ratio: Annotated[float, typer.Option(rich_help_panel=_DATA)] = 0.0,
    request_rate: Annotated[float, typer.Option(help="requests/s; inf sends all at once")] = float("inf"),
    burstiness: Annotated[float, typer.Option(help="gamma shape of the gaps; 1 = Poisson")] = 1.0,
    max_concurrency: Annotated[Optional[int], typer.Option(help="cap on requests in flight")] = None,
    ignore_eos: Annotated[bool, typer.Option(help="ask the server to ignore EOS (vLLM extension)")] = False,
    temperature: Annotated[float, typer.Option(help="sampling temperature of every request (0: greedy, as vLLM's "
                                               "benchmark sends by default)")] = 0.0,
    goodput: Annotated[Optional[list[str]], typer.Option(help="SLOs in ms, e.g. --goodput ttft:200 tpot:20")] = None,
    metric_percentiles: Annotated[str, typer.Option(help="e.g. 50,90,99")] = "99",
    seed: Annotated[int, typer.Option(min=0, help="dataset and arrival seed")] = 0,
    api_key: Annotated[Optional[str], typer.Option(envvar="OPENAI_API_KEY", show_envvar=False)] = None,
    save_result: Annotated[Optional[str], typer.Option(help="write the result JSON here")] = None,
    progress: Annotated[bool, typer.Option(help="live progress bar")] = True,
    disable_tqdm: Annotated[bool, typer.Option(help="vLLM's: no progress bar")] = False,
) -> None:
    """Benchmark a running OpenAI-compatible server over streaming HTTP (TTFT, TPOT, ITL, E2EL, goodput). vLLM's
    `bench serve` flags work too: --host/--port, --backend, --served-model-name, --dataset-name,
    --random-input-len/--random-output-len, --sharegpt-output-len, --disable-tqdm."""

    from nvllm.bench import datasets, metrics, serve
    from nvllm.engine.llm_engine import load_tokenizer

    _check_save(save_result)
    if more_slos and not goodput:
        fail(f"unexpected argument {more_slos[0]!r}")
    try:
        base_url, endpoint = _server(base_url, host, port, endpoint, backend)
        requested = served_model_name or model  # with --served-model-name, --model names the tokenizer's model
        slos = metrics.parse_goodput((goodput or []) + (more_slos or []))
        opts = serve.ServeOptions(base_url=base_url, endpoint=endpoint, model=requested, request_rate=request_rate,
                                  burstiness=burstiness, max_concurrency=max_concurrency, ignore_eos=ignore_eos,
                                  temperature=temperature, percentiles=metrics.parse_percentiles(metric_percentiles),
                                  goodput=slos, seed=seed, api_key=api_key, progress=progress and not disable_tqdm,
                                  lora_modules=[n for m in lora_modules or [] for n in m.split(",") if n])
        tok = load_tokenizer(tokenizer) if tokenizer else _model_tokenizer(model, served_model_name is not None)
        requests = datasets.load_requests(dataset, tok, num_prompts, dataset_path, input_len, output_len,
                                          random_range_ratio, seed)
        result = serve.run_serve_benchmark(opts, requests, tok)
    except (serve.BenchError, *USER_ERRORS) as e:
        fail(e)
    _finish(result, save_result)
    if result["completed"] == 0:
        fail(f"all {result['failed']} requests failed", code=1)


def _model_tokenizer(model: str | None, names_model: bool):
    """The tokenizer that counts prompt tokens when --tokenizer is not given: --model's (a directory, or a Hub id as
    vLLM's benchmark loads it), else the demo model's, said in a warning unless --model names the demo model."""
    from pathlib import Path

    from nvllm.assets import demo_model_path
    from nvllm.engine.llm_engine import load_tokenizer
    from nvllm.logger import console
    from nvllm.models.hub import resolve_model_path

    if model and (names_model or Path(model).is_dir() or "/" in model):
        try:  # a Hub id: its tokenizer files alone (one quick failure without the network, not per-file retries)
            return load_tokenizer(resolve_model_path(model, weights=False))
        except Exception as e:  # noqa: BLE001 - no such directory or Hub id, or no network: the fallback below
            if names_model or Path(model).is_dir():
                raise ValueError(f"cannot load the tokenizer of --model {model}: {e}") from None
    if model != "stories260K":
        whose = f"{model}'s" if model else "the served model's"
        console().print(f"[yellow]warning:[/] prompt tokens are counted with the demo model's tokenizer; pass "
                        f"--tokenizer (or --model) for {whose}", highlight=False, soft_wrap=True)
    return load_tokenizer(demo_model_path())


def _server(base_url: str | None, host: str | None, port: int | None, endpoint: str | None,
            backend: str) -> tuple[str, str]:
    """(base URL, endpoint) from nvllm's flags or vLLM's (--host/--port, --backend)."""
    from nvllm.config import ConfigError

    if backend not in ("openai", "vllm", "openai-chat"):
        raise ConfigError(f"--backend {backend!r} is not supported: openai or vllm (completions), openai-chat (chat)")
    if base_url is not None and (host is not None or port is not None):
        raise ConfigError("give --base-url or --host/--port, not both")
    if base_url is None:
        host = host or "127.0.0.1"
        host = f"[{host}]" if ":" in host and not host.startswith("[") else host  # an IPv6 address, as a URL holds it
        base_url = f"http://{host}:{port or 8000}"
    return base_url, endpoint or ("/v1/chat/completions" if backend == "openai-chat" else "/v1/completions")


@bench_app.command("advise")
def bench_advise(
    base_url: Annotated[str, typer.Option(help="a mixed server's root")] = "http://127.0.0.1:8000",
    endpoint: Annotated[str, typer.Option(help="/v1/completions or /v1/chat/completions")] = "/v1/completions",
    model: Annotated[Optional[str], typer.Option(help="model name to request (default: the server's first)")] = None,
    tokenizer: Annotated[Optional[str], typer.Option(
        help="tokenizer (default: --model's, a directory or a Hub id; else the demo model's)")] = None,
    dataset: Annotated[str, typer.Option("--dataset", "--dataset-name", help="random | sharegpt | jsonl | gsm8k",
                                         rich_help_panel=_DATA)] = "random",
    dataset_path: Annotated[Optional[str], typer.Option(rich_help_panel=_DATA)] = None,
    num_prompts: Annotated[int, typer.Option(rich_help_panel=_DATA)] = 200,
    input_len: Annotated[Optional[int], typer.Option(rich_help_panel=_DATA)] = None,
    output_len: Annotated[Optional[int], typer.Option(rich_help_panel=_DATA)] = None,
    request_rate: Annotated[float, typer.Option(help="requests/s of the workload; inf: all at once")] = float("inf"),
    max_concurrency: Annotated[Optional[int], typer.Option(help="cap on requests in flight")] = None,
    ignore_eos: Annotated[bool, typer.Option(help="ask the server to ignore EOS")] = False,
    num_gpus: Annotated[Optional[int], typer.Option(help="GPUs of the host to deploy on (default: this one's)")] = None,
    api_key: Annotated[Optional[str], typer.Option(envvar="OPENAI_API_KEY", show_envvar=False)] = None,
    save_result: Annotated[Optional[str], typer.Option(help="write the measurements and verdict (JSON) here")] = None,
    progress: Annotated[bool, typer.Option(help="live progress bar")] = True,
) -> None:
    """Measure a workload on a mixed server and recommend whether (and how) to disaggregate prefill and decode."""

    from nvllm.bench import advise, datasets, report, serve
    from nvllm.disagg.advisor import tables
    from nvllm.engine.llm_engine import load_tokenizer
    from nvllm.logger import console, results_console

    _check_save(save_result)
    if num_gpus is not None and num_gpus < 1:
        fail("--num-gpus must be at least 1")
    try:
        opts = serve.ServeOptions(base_url=base_url, endpoint=endpoint, model=model, request_rate=request_rate,
                                  max_concurrency=max_concurrency, ignore_eos=ignore_eos, api_key=api_key,
                                  progress=progress)
        tok = load_tokenizer(tokenizer) if tokenizer else _model_tokenizer(model, False)
        requests = datasets.load_requests(dataset, tok, num_prompts, dataset_path, input_len, output_len)
        result, workload, rec = advise.run_advise(opts, requests, tok, num_gpus)
    except (serve.BenchError, *USER_ERRORS) as e:
        fail(e)
    for table in tables(workload, rec):
        results_console().print(table)
    if save_result:
        try:
            report.save_result(result, save_result)
        except ValueError as e:
            fail(str(e))
        console().print(f"saved {save_result}", highlight=False)


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
    from nvllm.bench import offline

    _check_save(save_result)
    try:
        result = offline.run_throughput(engine_config, dataset, dataset_path, num_prompts, input_len, output_len,
                                        random_range_ratio, ignore_eos, progress)
    except USER_ERRORS as e:
        fail(e)
    _finish(result, save_result)


@bench_app.command("latency")
@engine_options
def bench_latency(
    batch_size: Annotated[int, typer.Option()] = 8,
    input_len: Annotated[int, typer.Option()] = 32,
    output_len: Annotated[int, typer.Option()] = 128,
    num_iters_warmup: Annotated[int, typer.Option()] = 10,
    num_iters: Annotated[int, typer.Option()] = 30,
    metric_percentiles: Annotated[str, typer.Option(help="TTFT/TPOT percentiles, e.g. 50,90,99")] = "99",
    temperature: Annotated[float, typer.Option(help="sampling temperature of every request (0: greedy)")] = 1.0,
    save_result: Annotated[Optional[str], typer.Option(help="write the result JSON here")] = None,
    progress: Annotated[bool, typer.Option(help="progress bar")] = True,
    *, engine_config: EngineConfig,
) -> None:
    """Offline latency of one batch: per-iteration latency percentiles, TTFT and TPOT."""
    from nvllm.bench import metrics, offline

    _check_save(save_result)
    try:
        result = offline.run_latency(engine_config, batch_size, input_len, output_len, num_iters_warmup, num_iters,
                                     metrics.parse_percentiles(metric_percentiles), progress,
                                     temperature=temperature)
    except USER_ERRORS as e:
        fail(e)
    _finish(result, save_result)


@bench_app.command("compare")
def bench_compare(
    a: Annotated[str, typer.Argument(help="baseline result JSON")],
    b: Annotated[str, typer.Argument(help="result JSON to compare with it")],
) -> None:
    """Two saved results side by side, with B / A ratios."""
    from nvllm.bench import report
    from nvllm.logger import console, results_console

    try:
        ra, rb = report.load_result(a), report.load_result(b)
    except USER_ERRORS as e:
        fail(e)
    if ra.get("mode") != rb.get("mode"):
        console().print(f"[yellow]note:[/] comparing a {ra.get('mode')!r} result with a {rb.get('mode')!r} one")
    for table in report.compare_tables(ra, rb, a, b):
        results_console().print(table)
