"""The `nvllm` command line. Each command parses flags into config objects and calls the package."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from typing import Annotated, Optional

import typer

from nvllm.cli_options import USER_ERRORS, engine_options, fail
from nvllm.config import ConfigError, EngineConfig
from nvllm.disagg.config import DisaggConfig
from nvllm.bench.cli import bench_app
from nvllm.generate_cli import generate
from nvllm.output_file import check_output_file
from nvllm.disagg.options import disagg_options
from nvllm.serve.http_options import HTTPOptions, http_options

app = typer.Typer(help="nvllm: fast, checked LLM inference on one engine.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False)


@app.callback()
def main_callback() -> None:
    """nvllm: fast, checked LLM inference — quantize, serve, bench and eval on one engine."""
    _exit_on_sigterm()


def _exit_on_sigterm() -> None:
    """SIGTERM (a job scheduler's stop, `kill`) ends a command through its clean-up, as Ctrl-C does: an interrupted
    quantize removes its temporary output, a tensor-parallel engine stops its workers. Python's default would end
    the process at once. The server installs its own handlers while it serves (a graceful shutdown)."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminated)


def _terminated(signum, frame) -> None:
    raise SystemExit(128 + signum)


# ---- nvllm generate (the command: nvllm/generate_cli.py) ----------------------------------------------
app.command()(generate)


# ---- nvllm bench (the commands: nvllm/bench/cli.py) ----------------------------------------------------
app.add_typer(bench_app, name="bench")


_FD = Annotated[Optional[int], typer.Option(help="serve on the bound socket behind this inherited file descriptor "
                                          "instead of --host/--port (as uvicorn --fd)")]


@app.command()
@engine_options
@disagg_options
@http_options
def serve(
    model_tag: Annotated[Optional[str], typer.Argument(metavar="MODEL", help="the model, as in `vllm serve MODEL` "
                                                       "(or --model)", show_default=False)] = None,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on")] = 8000,
    api_key: Annotated[Optional[str], typer.Option(envvar="NVLLM_API_KEY",
                                                   help="require 'Authorization: Bearer KEY' (401 without it)")] = None,
    served_model_name: Annotated[Optional[str], typer.Option(help="model name clients send (default: --model)")] = None,
    chat_template: Annotated[Optional[str], typer.Option(help="Jinja chat template file (default: the tokenizer's)")] = None,
    max_request_bytes: Annotated[int, typer.Option(help="larger request bodies get 413")] = 16 * 1024 * 1024,
    shutdown_timeout: Annotated[int, typer.Option(help="seconds in-flight requests get on SIGINT/SIGTERM")] = 30,
    uvicorn_log_level: Annotated[str, typer.Option(help="uvicorn's log level (access lines at info)")] = "info",
    fd: _FD = None,
    enable_auto_tool_choice: Annotated[bool, typer.Option(help="let the model call tools by itself (tool_choice "
                                                          "\"auto\", the default with tools); needs "
                                                          "--tool-call-parser")] = False,
    tool_call_parser: Annotated[Optional[str], typer.Option(help="how the model writes tool calls: hermes "
                                                            "(Qwen2.5, Qwen3, Hermes) | llama3_json (Llama 3.x) | mistral")
                                ] = None,
    chat_template_content_format: Annotated[str, typer.Option(help="auto | string | openai: a message's content "
                                                               "given to the chat template as one string or as "
                                                               "OpenAI's list of text parts (auto: as the template "
                                                               "reads it)")] = "auto",
    return_tokens_as_token_ids: Annotated[bool, typer.Option(help="logprobs name tokens 'token_id:N' (exact for "
                                                             "tokens that are part of a character); a request's "
                                                             "field of the same name overrides it")] = False,
    lora_modules: Annotated[Optional[list[str]], typer.Option(help="LoRA adapters clients pick by name as their "
                                                              "model: name=PEFT_DIR (repeat, or comma-separate); "
                                                              "needs --enable-lora")] = None,
    *, engine_config: EngineConfig, disagg_config: DisaggConfig, http_options: HTTPOptions,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (completions, chat, models, metrics); as a prefill or
    decode worker (--role), or as a whole disaggregated deployment (--disaggregate 1P1D)."""
    from nvllm.serve.api_server import ServerConfig, run_server
    from nvllm.lora.request import check_lora_modules, parse_lora_modules

    try:
        if model_tag is not None:
            engine_config = _with_model(engine_config, model_tag)
        config = ServerConfig(host=host, port=port, api_key=api_key, served_model_name=served_model_name,
                              chat_template=chat_template, max_request_bytes=max_request_bytes,
                              shutdown_timeout=shutdown_timeout, log_level=uvicorn_log_level, fd=fd,
                              enable_auto_tool_choice=enable_auto_tool_choice, tool_call_parser=tool_call_parser,
                              lora_modules=parse_lora_modules(lora_modules), http=http_options,
                              return_tokens_as_token_ids=return_tokens_as_token_ids,
                              chat_template_content_format=chat_template_content_format)
        if http_options.tls and disagg_config.role != "mixed":
            raise ConfigError("prefill and decode workers talk plain HTTP with each other and the router; serve "
                              "HTTPS from `nvllm router` (or from `nvllm serve --disaggregate`, which passes it on)")
        check_lora_modules(config.lora_modules, engine_config)  # before the port and the model: a flag's mistake
        if disagg_config.disaggregate:
            from nvllm.disagg.launcher import launch

            code = launch(engine_config, config, disagg_config)
        else:
            code = run_server(engine_config, config, disagg_config) or 0
    except USER_ERRORS as e:
        fail(str(e))
    if code:
        raise typer.Exit(code)


def _with_model(config: EngineConfig, model: str) -> EngineConfig:
    """The engine config for the positional MODEL; ConfigError when --model names another."""
    import dataclasses
    import os

    from nvllm.assets import demo_model_path

    if config.model not in (demo_model_path(), os.path.expanduser(model)):
        raise ConfigError(f"the model is given twice: {model} and --model {config.model}")
    defaulted = config.tokenizer == config.model  # the tokenizer follows the model unless given apart
    revision = config.tokenizer_revision  # --tokenizer-revision, or --revision copied in when not given
    return dataclasses.replace(config, model=model, tokenizer=None if defaulted else config.tokenizer,
                               tokenizer_revision=None if defaulted and revision == config.revision else revision)


@app.command()
@http_options
def router(
    prefill: Annotated[Optional[str], typer.Option(help="prefill worker URLs, comma-separated")] = None,
    decode: Annotated[Optional[str], typer.Option(help="decode worker URLs, comma-separated")] = None,
    mixed: Annotated[Optional[str], typer.Option(help="or: mixed replicas (plain `nvllm serve`) to balance")] = None,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on")] = 8000,
    api_key: Annotated[Optional[str], typer.Option(envvar="NVLLM_API_KEY", help="required of clients; "
                                                   "passed on to the workers")] = None,
    max_request_bytes: Annotated[int, typer.Option(help="larger request bodies get 413")] = 16 * 1024 * 1024,
    poll_interval: Annotated[float, typer.Option(help="seconds between worker health/load polls")] = 1.0,
    log_interval: Annotated[float, typer.Option(help="seconds between router log lines (0: off)")] = 10.0,
    uvicorn_log_level: Annotated[str, typer.Option(help="uvicorn's log level")] = "info",
    fd: _FD = None,
    shutdown_timeout: Annotated[int, typer.Option(help="seconds in-flight requests get on SIGINT/SIGTERM")] = 30,
    *, http_options: HTTPOptions,
) -> None:
    """One OpenAI endpoint in front of prefill and decode workers (`nvllm serve --role …`) or mixed replicas."""
    from nvllm.disagg.router_app import run_router
    from nvllm.disagg.router_config import RouterConfig, parse_urls

    try:
        run_router(RouterConfig(parse_urls(prefill, "--prefill"), parse_urls(decode, "--decode"),
                                parse_urls(mixed, "--mixed"), host, port, api_key, max_request_bytes, poll_interval,
                                log_interval, uvicorn_log_level, fd, shutdown_timeout, http_options))
    except USER_ERRORS as e:
        fail(str(e))


# ---- nvllm eval ----------------------------------------------------------------------------------------
_GATE = "Regression gate"


@app.command("eval")
@engine_options
def eval_command(
    tasks: Annotated[str, typer.Option(help="comma-separated: gsm8k, mmlu, mmlu_<category|subject>, wikitext, "
                                       "c4, or a text file path")] = "gsm8k,mmlu",
    num_fewshot: Annotated[Optional[int], typer.Option(help="few-shot examples (default: each task's own: gsm8k 5, "
                                                       "mmlu 0)")] = None,
    limit: Annotated[Optional[int], typer.Option(help="only the first N samples of each (sub)task, or N documents "
                                                 "for perplexity")] = None,
    data_dir: Annotated[Optional[str], typer.Option(help="local data (gsm8k/, mmlu/ or mmlu_final_hf/, "
                                                    "wikitext-2-raw/, c4/); required when the HF hub is "
                                                    "unreachable")] = None,
    max_gen_toks: Annotated[Optional[int], typer.Option(help="generation limit per sample (default: the task's, "
                                                        "else 256)")] = None,
    max_length: Annotated[Optional[int], typer.Option(help="scoring window in tokens (default: "
                                                      "max_model_len - 2)")] = None,
    baseline: Annotated[Optional[str], typer.Option(help="baseline model directory: evaluate both on identical samples "
                                                    "and gate", rich_help_panel=_GATE)] = None,
    max_drop: Annotated[Optional[float], typer.Option(help="largest allowed drop in points (accuracy x100, perplexity "
                                                      "in its units; default with --baseline: 1.0)",
                                                      rich_help_panel=_GATE)] = None,
    max_drop_rel: Annotated[Optional[float], typer.Option(help="largest allowed drop in percent of the baseline",
                                                          rich_help_panel=_GATE)] = None,
    output_json: Annotated[Optional[str], typer.Option(help="write the results JSON here")] = None,
    progress: Annotated[bool, typer.Option(help="progress bars")] = True,
    lora: Annotated[Optional[str], typer.Option(help="evaluate the model with this PEFT LoRA adapter (the "
                                                     "baseline, if any, runs without it)")] = None,
    *, engine_config: EngineConfig,
) -> None:
    """Accuracy (GSM8K, MMLU through lm-evaluation-harness) and perplexity on nvllm's engine; with --baseline,
    a regression gate that exits 1 when a task drops more than allowed."""
    from nvllm.eval import runner
    from nvllm.eval.quiet import quiet_libraries
    from nvllm.logger import console, results_console

    runner.require_lm_eval()

    if baseline is None and (max_drop is not None or max_drop_rel is not None):
        fail("--max-drop / --max-drop-rel need --baseline")
    if baseline is not None and max_drop is None and max_drop_rel is None:
        max_drop = 1.0
    _check_thresholds(max_drop, max_drop_rel)
    quiet_libraries()
    try:
        if output_json is not None:
            check_output_file(output_json, "--output-json")
        spec = runner.EvalSpec(tasks.split(","), num_fewshot, limit, data_dir, max_gen_toks, max_length)
        results, rows, notes = runner.run_eval(engine_config, spec, baseline, max_drop, max_drop_rel, progress,
                                               lora)
    except (runner.EvalError, *USER_ERRORS) as e:
        fail(str(e))
    runner.print_eval(results_console(), results, rows, max_drop, max_drop_rel)
    gate = runner.gate_summary(results, rows, max_drop, max_drop_rel) if baseline is not None else None
    if output_json is not None:
        try:
            runner.write_json(output_json, runner.report_json(results, spec, engine_config, notes, gate))
        except ValueError as e:
            fail(str(e))
        console().print(f"results written to {output_json}", highlight=False)
    if gate is not None and not gate["passed"]:
        fail(f"regression gate failed: {', '.join(gate['failed'])}", code=1)


# ---- nvllm quantize ------------------------------------------------------------------------------------
_CAL = "Calibration"


@app.command()
def quantize(
    model: Annotated[Optional[str], typer.Option(help="full-precision HF model directory or Hub id (default: the demo "
                                                 "model)")] = None,
    revision: Annotated[Optional[str], typer.Option(help="the Hub branch, tag or commit of --model (default: the "
                                                    "main branch)")] = None,
    out: Annotated[Optional[str], typer.Option(help="output directory (must not exist unless --overwrite)")] = None,
    method: Annotated[Optional[str], typer.Option(help="awq | gptq | rtn | fp8 (e4m3, no calibration)")] = None,
    bits: Annotated[Optional[int], typer.Option(help="4 | 8 (default 4; awq: 4 only; fp8: 8)")] = None,
    group_size: Annotated[Optional[int], typer.Option(help="inputs per scale/zero group; -1: whole rows "
                                                      "(default 128; fp8: 128×128 blocks, -1 a scale per tensor "
                                                      "or, in compressed-tensors, per channel)")] = None,
    sym: Annotated[Optional[bool], typer.Option("--sym/--no-sym", help="symmetric (gptq/rtn default) or zero "
                                                "point (awq)")] = None,
    desc_act: Annotated[Optional[bool], typer.Option("--desc-act/--no-desc-act", help="GPTQ act-order "
                                                     "(static groups)")] = None,
    quantize_lm_head: Annotated[Optional[bool], typer.Option("--quantize-lm-head/--no-quantize-lm-head",
                                                             help="quantize the LM head too (gptq/rtn; untied "
                                                             "embeddings only) (default off)")] = None,
    checkpoint_format: Annotated[Optional[str], typer.Option("--format", help="awq | gptq | compressed-tensors "
                                                             "(llm-compressor's) | fp8; default: awq for --method "
                                                             "awq, fp8 for fp8, gptq otherwise")] = None,
    calib_dataset: Annotated[Optional[str], typer.Option(help="c4 | calib (the shipped C4 sample) | pileval | "
                                                         "wikitext2 | a Hub dataset id or dataset folder | a .jsonl/"
                                                         ".json.gz/.json/.txt path (default c4)",
                                                         rich_help_panel=_CAL)] = None,
    calib_split: Annotated[Optional[str], typer.Option(help="a dataset's split (default train; pileval: "
                                                       "validation)", rich_help_panel=_CAL)] = None,
    calib_column: Annotated[Optional[str], typer.Option(help="a dataset's column: text, or conversations rendered "
                                                        "by the chat template (default text, else messages)",
                                                        rich_help_panel=_CAL)] = None,
    calib_samples: Annotated[Optional[int], typer.Option(help="windows (default 128)", rich_help_panel=_CAL)] = None,
    calib_seqlen: Annotated[Optional[int], typer.Option(help="tokens per window (default 2048)",
                                                        rich_help_panel=_CAL)] = None,
    seed: Annotated[Optional[int], typer.Option(help="calibration window seed (default 0)",
                                                rich_help_panel=_CAL)] = None,
    recipe: Annotated[Optional[str], typer.Option(help="YAML recipe (recipes/*.yaml); flags override it")] = None,
    overwrite: Annotated[bool, typer.Option(help="replace an existing --out")] = False,
    max_shard_size: Annotated[Optional[str], typer.Option(help="largest weights file, e.g. 5GB or 500MB: larger "
                                                          "weights are split into model-0000k-of-0000n.safetensors "
                                                          "with an index (default 5GB)")] = None,
    device: Annotated[Optional[str], typer.Option(help="auto | cpu | cuda | cuda:N (where layers are "
                                                  "quantized) (default auto)")] = None,
    progress: Annotated[bool, typer.Option(help="progress bar")] = True,
) -> None:
    """Quantize a model to INT4/INT8 (AWQ, GPTQ or RTN) or FP8 and write an AWQ-GEMM, GPTQ, compressed-tensors or
    FP8 checkpoint."""
    from nvllm.assets import demo_model_path
    from nvllm.logger import console
    from nvllm.quant import quantize as q
    from nvllm.quant.recipe import build_config
    from nvllm.quant.report import LayerProgress, print_report

    if out is None:
        fail("--out DIR is required")
    bar = LayerProgress(console(), enabled=progress)
    try:
        cfg = build_config(recipe, method=method, bits=bits, group_size=group_size, sym=sym, desc_act=desc_act,
                           quantize_lm_head=quantize_lm_head, checkpoint_format=checkpoint_format,
                           calib_dataset=calib_dataset, calib_split=calib_split, calib_column=calib_column,
                           calib_samples=calib_samples, calib_seqlen=calib_seqlen, seed=seed, device=device,
                           max_shard_size=max_shard_size)
        summary = q.quantize_model(model or demo_model_path(), out, cfg, overwrite, progress=bar.update,
                                   on_start=bar.start, revision=revision)
    except q.USER_ERRORS as e:
        bar.stop()
        fail(str(e))
    bar.stop()
    print_report(summary, console())


# ---- nvllm pipeline ------------------------------------------------------------------------------------
_Q, _E, _B = "Quantization", "Evaluation", "Benchmark"


@app.command()
@engine_options
def pipeline(
    ctx: typer.Context,
    method: Annotated[Optional[str], typer.Option(help="awq | gptq | rtn | fp8", rich_help_panel=_Q)] = None,
    bits: Annotated[Optional[int], typer.Option(help="4 | 8 (awq: 4; fp8: 8) (default: 4)",
                                                rich_help_panel=_Q)] = None,
    group_size: Annotated[Optional[int], typer.Option(help="inputs per scale/zero group (default: 128)",
                                                      rich_help_panel=_Q)] = None,
    sym: Annotated[Optional[bool], typer.Option("--sym/--no-sym", rich_help_panel=_Q)] = None,
    desc_act: Annotated[Optional[bool], typer.Option("--desc-act/--no-desc-act", rich_help_panel=_Q)] = None,
    quantize_lm_head: Annotated[Optional[bool], typer.Option("--quantize-lm-head/--no-quantize-lm-head",
                                                             help="the LM head too (gptq/rtn)",
                                                             rich_help_panel=_Q)] = None,
    calib_dataset: Annotated[Optional[str], typer.Option(help="c4 | calib | pileval | wikitext2 | a Hub dataset "
                                                         "id or folder | a file (default: c4)",
                                                         rich_help_panel=_Q)] = None,
    calib_split: Annotated[Optional[str], typer.Option(help="a dataset's split", rich_help_panel=_Q)] = None,
    calib_column: Annotated[Optional[str], typer.Option(help="a dataset's column", rich_help_panel=_Q)] = None,
    calib_samples: Annotated[Optional[int], typer.Option(rich_help_panel=_Q)] = None,
    calib_seqlen: Annotated[Optional[int], typer.Option(rich_help_panel=_Q)] = None,
    recipe: Annotated[Optional[str], typer.Option(help="YAML recipe; flags override it", rich_help_panel=_Q)] = None,
    out: Annotated[Optional[str], typer.Option(help="quantized model directory (default: "
                                               "./<model>-<method>-w<bits>)", rich_help_panel=_Q)] = None,
    overwrite: Annotated[bool, typer.Option(help="replace an existing --out", rich_help_panel=_Q)] = False,
    max_shard_size: Annotated[Optional[str], typer.Option(help="largest weights file of --out (default 5GB)",
                                                          rich_help_panel=_Q)] = None,
    tasks: Annotated[str, typer.Option(help="as for nvllm eval", rich_help_panel=_E)] = "gsm8k,mmlu,wikitext",
    num_fewshot: Annotated[Optional[int], typer.Option(rich_help_panel=_E)] = None,
    limit: Annotated[Optional[int], typer.Option(rich_help_panel=_E)] = None,
    data_dir: Annotated[Optional[str], typer.Option(rich_help_panel=_E)] = None,
    max_gen_toks: Annotated[Optional[int], typer.Option(rich_help_panel=_E)] = None,
    max_length: Annotated[Optional[int], typer.Option(rich_help_panel=_E)] = None,
    max_drop: Annotated[Optional[float], typer.Option(help="largest allowed drop in points (default: 1.0 unless "
                                                      "--max-drop-rel)", rich_help_panel=_E)] = None,
    max_drop_rel: Annotated[Optional[float], typer.Option(help="largest allowed drop in % of the original",
                                                          rich_help_panel=_E)] = None,
    batch_size: Annotated[int, typer.Option(help="latency batch", rich_help_panel=_B)] = 8,
    input_len: Annotated[int, typer.Option(rich_help_panel=_B)] = 128,
    output_len: Annotated[int, typer.Option(rich_help_panel=_B)] = 128,
    num_iters_warmup: Annotated[int, typer.Option(rich_help_panel=_B)] = 3,
    num_iters: Annotated[int, typer.Option(rich_help_panel=_B)] = 10,
    num_prompts: Annotated[int, typer.Option(help="throughput requests", rich_help_panel=_B)] = 100,
    report: Annotated[Optional[str], typer.Option(help="report path without extension (writes .md and .json)  "
                                                  " (default: <out>-report)")] = None,
    progress: Annotated[bool, typer.Option(help="progress bars")] = True,
    *, engine_config: EngineConfig,
) -> None:
    """Quantize → regression gate against the original → latency/throughput of both → one Markdown + JSON
    report. Exits 1 when the gate fails (the report is written either way)."""

    from nvllm.eval import pipeline as pipe, runner
    from nvllm.eval.quiet import quiet_libraries
    from nvllm.logger import console
    from nvllm.quant import quantize as q
    from nvllm.quant.recipe import build_config

    runner.require_lm_eval()
    if max_drop is None and max_drop_rel is None:
        max_drop = 1.0
    _check_thresholds(max_drop, max_drop_rel)
    quiet_libraries()
    try:
        # --seed and --device also set the calibration's seed and device, where given; else the recipe's hold
        cfg = build_config(recipe, method=method, bits=bits, group_size=group_size, sym=sym, desc_act=desc_act,
                           quantize_lm_head=quantize_lm_head, calib_dataset=calib_dataset,
                           calib_split=calib_split, calib_column=calib_column,
                           calib_samples=calib_samples, calib_seqlen=calib_seqlen,
                           seed=engine_config.seed if _given(ctx, "seed") else None,
                           device=engine_config.device if _given(ctx, "device") else None,
                           max_shard_size=max_shard_size)
        out = out or f"{Path(engine_config.model).name}-{cfg.method}-w{cfg.bits}"
        spec = runner.EvalSpec(tasks.split(","), num_fewshot, limit, data_dir, max_gen_toks, max_length)
        bench = pipe.BenchSpec(batch_size, input_len, output_len, num_iters_warmup, num_iters, num_prompts)
        result = pipe.run_pipeline(engine_config, out, cfg, overwrite, spec, max_drop, max_drop_rel, bench, report,
                                   console(), progress)
    except (runner.EvalError, *q.USER_ERRORS) as e:
        fail(str(e))
    console().print(f"report written to {' and '.join(result['report_files'])}", highlight=False)
    if not result["gate"]["passed"]:
        fail(f"regression gate failed: {', '.join(result['gate']['failed'])}", code=1)


def _given(ctx: typer.Context, flag: str) -> bool:
    """Whether the command's parameter ``flag`` came from the command line (or the environment), not a default."""
    source = ctx.get_parameter_source(flag)
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")


def _check_thresholds(max_drop: float | None, max_drop_rel: float | None) -> None:
    from nvllm.eval.regression import check_thresholds

    try:
        check_thresholds(max_drop, max_drop_rel)
    except ValueError as e:
        fail(str(e))


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
