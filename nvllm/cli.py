"""The `nvllm` command line. Each command parses flags into config objects and calls the package."""

from __future__ import annotations

import signal
import sys
import threading
from typing import Annotated, Optional

import typer

from nvllm.cli_options import USER_ERRORS, check_gate_thresholds, engine_options, fail
from nvllm.config import ConfigError, EngineConfig
from nvllm.disagg.config import DisaggConfig
from nvllm.bench.cli import bench_app
from nvllm.generate_cli import generate
from nvllm.pipeline_cli import pipeline
from nvllm.quantize_cli import quantize
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
    """SIGTERM (a job scheduler's stop, `kill`) and SIGHUP (the terminal closed) end a command through its clean-up,
    as Ctrl-C does: an interrupted quantize removes its temporary output, a tensor-parallel engine stops its
    workers. Python's default would end the process at once. The server installs its own handlers while it serves
    (a graceful shutdown)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
        if sig is not None and signal.getsignal(sig) == signal.SIG_DFL:
            signal.signal(sig, _terminated)


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
    api_key: Annotated[Optional[str], typer.Option(envvar=["NVLLM_API_KEY", "VLLM_API_KEY"],
                                                   help="require 'Authorization: Bearer KEY' (401 without it)")] = None,
    served_model_name: Annotated[Optional[list[str]], typer.Option(
        help="model name clients send (default: --model); repeat the flag for several names, the first is the one "
             "responses carry")] = None,
    chat_template: Annotated[Optional[str], typer.Option(
        help="Jinja chat template: a file, or the template text itself (default: the tokenizer's)")] = None,
    max_request_bytes: Annotated[int, typer.Option(help="larger request bodies get 413")] = 16 * 1024 * 1024,
    shutdown_timeout: Annotated[int, typer.Option(help="seconds in-flight requests get on SIGINT/SIGTERM")] = 30,
    uvicorn_log_level: Annotated[str, typer.Option(help="uvicorn's log level (access lines at info)")] = "info",
    fd: _FD = None,
    enable_auto_tool_choice: Annotated[bool, typer.Option(help="let the model call tools by itself (tool_choice "
                                                          "\"auto\", the default with tools); needs "
                                                          "--tool-call-parser")] = False,
    tool_call_parser: Annotated[Optional[str], typer.Option(
        help="how the model writes tool calls: hermes (Qwen2.5, Qwen3, Hermes) | llama3_json (Llama 3.x) | mistral"
    )] = None,
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
        fail(e)
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
    api_key: Annotated[Optional[str], typer.Option(envvar=["NVLLM_API_KEY", "VLLM_API_KEY"],
                                                   help="required of clients; passed on to the workers")] = None,
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
        fail(e)


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
    apply_chat_template: Annotated[bool, typer.Option(help="task prompts through the tokenizer's chat template "
                                                      "(lm-eval's --apply_chat_template; the baseline's too)")] = False,
    fewshot_as_multiturn: Annotated[Optional[bool], typer.Option(help="few-shot examples as chat turns (default: "
                                                                 "with --apply-chat-template)")] = None,
    baseline: Annotated[Optional[str], typer.Option(help="baseline model directory: evaluate both on identical samples "
                                                    "and gate; it loads as its checkpoint is (--quantization, "
                                                    "--kv-cache-dtype, --hf-overrides, --speculative, --revision "
                                                    "apply to the model only)", rich_help_panel=_GATE)] = None,
    max_drop: Annotated[Optional[float], typer.Option(help="largest allowed drop in points (accuracy x100, perplexity "
                                                      "in its units; default with --baseline and no --max-drop-rel: "
                                                      "1.0)",
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
    if baseline is not None:
        max_drop, max_drop_rel = check_gate_thresholds(max_drop, max_drop_rel)
    quiet_libraries()
    try:
        if output_json is not None:
            check_output_file(output_json, "--output-json")
        spec = runner.EvalSpec(tasks.split(","), num_fewshot, limit, data_dir, max_gen_toks, max_length,
                               apply_chat_template, fewshot_as_multiturn)
        results, rows, notes = runner.run_eval(engine_config, spec, baseline, max_drop, max_drop_rel, progress,
                                               lora)
    except (runner.EvalError, *USER_ERRORS) as e:
        fail(e)
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


# ---- nvllm quantize and nvllm pipeline (the commands: nvllm/quantize_cli.py, nvllm/pipeline_cli.py) ----
app.command()(quantize)
app.command()(pipeline)


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
