"""The `nvllm` command line. Each command parses flags into config objects and calls the package."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from nvllm.cli_options import USER_ERRORS, engine_options, fail
from nvllm.config import EngineConfig
from nvllm.disagg.config import DisaggConfig
from nvllm.bench.cli import bench_app
from nvllm.disagg.options import disagg_options

app = typer.Typer(help="nvllm: fast, checked LLM inference on one engine.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False)


@app.callback()
def main_callback() -> None:
    """nvllm: fast, checked LLM inference — quantize, serve, bench and eval on one engine."""


# `nvllm generate`'s own sampling defaults, where neither the flags nor the model's generation_config.json set one
_GENERATE_DEFAULTS = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
                      "max_tokens": 128}


@app.command()
@engine_options
def generate(
    prompts: Annotated[Optional[list[str]], typer.Argument(help="prompt(s); default: 'Once upon a time'")] = None,
    max_tokens: Annotated[Optional[int], typer.Option(help="tokens to generate per prompt (default: the model's "
                                                      "max_new_tokens, else 128)")] = None,
    temperature: Annotated[Optional[float], typer.Option(help="0 = greedy (default: the model's, else 0)")] = None,
    top_p: Annotated[Optional[float], typer.Option(help="(default: the model's, else 1)")] = None,
    top_k: Annotated[Optional[int], typer.Option(help="-1 = off (default: the model's, else -1)")] = None,
    min_p: Annotated[Optional[float], typer.Option(help="(default: the model's, else 0)")] = None,
    presence_penalty: Annotated[float, typer.Option(help="[-2, 2]: minus this for every token already generated")
                                ] = 0.0,
    frequency_penalty: Annotated[float, typer.Option(help="[-2, 2]: minus this times a token's count in the "
                                                          "output")] = 0.0,
    repetition_penalty: Annotated[Optional[float], typer.Option(help="> 0, 1 = off: tokens of the prompt or the "
                                                                     "output weighed down by this factor (default: "
                                                                     "the model's, else 1)")] = None,
    sample_seed: Annotated[Optional[int], typer.Option("--sample-seed", help="per-request sampling seed")] = None,
    n: Annotated[int, typer.Option("-n", help="samples per prompt")] = 1,
    stop: Annotated[Optional[list[str]], typer.Option(help="stop string (repeatable)")] = None,
    ignore_eos: Annotated[bool, typer.Option()] = False,
    logprobs: Annotated[Optional[int], typer.Option(help="print top-N log-probabilities per token")] = None,
    json_schema: Annotated[Optional[str], typer.Option(help="constrain the output to this JSON schema (its text, "
                                                            "or a file holding it)")] = None,
    regex: Annotated[Optional[str], typer.Option(help="constrain the output to this regular expression")] = None,
    choice: Annotated[Optional[list[str]], typer.Option(help="constrain the output to one of these strings "
                                                             "(repeatable)")] = None,
    lora: Annotated[Optional[str], typer.Option(help="a PEFT LoRA adapter directory to generate with (turns "
                                                     "--enable-lora on)")] = None,
    beam_width: Annotated[Optional[int], typer.Option(help="beam search with this many beams (printed best first) "
                                                           "instead of sampling")] = None,
    *, engine_config: EngineConfig,
) -> None:
    """Generate continuations of prompts and print them. Sampling flags left out take the model's recommended
    values (its generation_config.json; --generation-config vllm: none), else greedy decoding of 128 tokens."""
    from nvllm.engine.generation_defaults import announce, with_defaults
    from nvllm.llm import LLM
    from nvllm.logger import console
    from nvllm.beam_search import BeamSearchParams
    from nvllm.lora.request import LoRARequest
    from nvllm.sampling_params import SamplingParams

    given = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                 repetition_penalty=repetition_penalty, max_tokens=max_tokens)

    def params(defaults: dict) -> SamplingParams:
        return SamplingParams(n=n, seed=sample_seed, stop=stop or [], ignore_eos=ignore_eos, logprobs=logprobs,
                              presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                              structured_outputs=constraint, **with_defaults(given, defaults, _GENERATE_DEFAULTS))

    try:
        constraint = _constraint(json_schema, regex, choice)
        params({})  # a bad flag fails before the model loads
        lora_request = None
        if lora is not None:
            lora_request = LoRARequest(Path(lora).name or "lora", 1, lora)
            engine_config = dataclasses.replace(engine_config, enable_lora=True)
        llm = LLM.from_config(engine_config)
        defaults = {k: v for k, v in llm.engine.generation_defaults.items() if given[k] is None}
        announce(defaults)
        if beam_width is not None:
            _print_beams(llm, prompts or ["Once upon a time"], BeamSearchParams(
                beam_width=beam_width, max_tokens=params(defaults).max_tokens, ignore_eos=ignore_eos), lora_request)
            return
        outputs = llm.generate(prompts or ["Once upon a time"], params(defaults), lora_request=lora_request)
    except USER_ERRORS as e:
        fail(str(e))
    out = console()
    for o in outputs:
        for c in o.outputs:
            print(o.prompt + c.text, flush=True)
            out.print(f"[dim]({len(c.token_ids)} tokens, finish_reason={c.finish_reason}, "
                      f"ttft {1000 * (o.metrics.ttft or 0):.1f} ms)[/]", highlight=False)
            if c.logprobs:
                text = llm.get_tokenizer().decode
                for tok, lp in zip(c.token_ids, c.logprobs):   # the chosen token, then the top `logprobs`
                    top = sorted((x.rank, t, x.logprob) for t, x in lp.items() if x.rank <= logprobs)
                    alts = ", ".join(f"{text([t])!r} {v:.4f}" for _, t, v in top)
                    out.print(f"  {text([tok])!r}: {lp[tok].logprob:.4f}" + (f"  top: {alts}" if alts else ""),
                              highlight=False)


def _print_beams(llm, prompts: list[str], params, lora_request) -> None:
    from nvllm.logger import console

    for prompt, result in zip(prompts, llm.beam_search(prompts, params, lora_request=lora_request)):
        for beam in result.sequences:
            print(prompt + beam.text, flush=True)
            console().print(f"[dim]({len(beam.output_token_ids)} tokens, finish_reason={beam.finish_reason}, "
                            f"cum_logprob {beam.cum_logprob:.4f})[/]", highlight=False)


def _constraint(json_schema: str | None, regex: str | None, choice: list[str] | None):
    """`nvllm generate`'s structured output flags as StructuredOutputsParams (None without them)."""
    from nvllm.sampling_params import StructuredOutputsParams

    if json_schema is None and regex is None and not choice:
        return None
    if json_schema is not None and not json_schema.lstrip().startswith("{"):
        path = Path(json_schema).expanduser()
        if not path.is_file():
            raise ValueError(f"--json-schema {json_schema}: neither a JSON object nor a file")
        json_schema = path.read_text()
    return StructuredOutputsParams(json=json_schema, regex=regex, choice=choice or None)


# ---- nvllm bench (the commands: nvllm/bench/cli.py) ----------------------------------------------------
app.add_typer(bench_app, name="bench")


_FD = Annotated[Optional[int], typer.Option(help="serve on the bound socket behind this inherited file descriptor "
                                          "instead of --host/--port (as uvicorn --fd)")]


@app.command()
@engine_options
@disagg_options
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
    fd: _FD = None,
    enable_auto_tool_choice: Annotated[bool, typer.Option(help="let the model call tools by itself (tool_choice "
                                                          "\"auto\", the default with tools); needs "
                                                          "--tool-call-parser")] = False,
    tool_call_parser: Annotated[Optional[str], typer.Option(help="how the model writes tool calls: hermes "
                                                            "(Qwen2.5, Qwen3, Hermes) | llama3_json (Llama 3.x)")
                                ] = None,
    lora_modules: Annotated[Optional[list[str]], typer.Option(help="LoRA adapters clients pick by name as their "
                                                              "model: name=PEFT_DIR (repeat, or comma-separate); "
                                                              "needs --enable-lora")] = None,
    *, engine_config: EngineConfig, disagg_config: DisaggConfig,
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (completions, chat, models, metrics); as a prefill or
    decode worker (--role), or as a whole disaggregated deployment (--disaggregate 1P1D)."""
    from nvllm.serve.api_server import ServerConfig, run_server
    from nvllm.lora.request import parse_lora_modules

    try:
        config = ServerConfig(host=host, port=port, api_key=api_key, served_model_name=served_model_name,
                              chat_template=chat_template, max_request_bytes=max_request_bytes,
                              shutdown_timeout=shutdown_timeout, log_level=uvicorn_log_level, fd=fd,
                              enable_auto_tool_choice=enable_auto_tool_choice, tool_call_parser=tool_call_parser,
                              lora_modules=parse_lora_modules(lora_modules))
        if disagg_config.disaggregate:
            from nvllm.disagg.launcher import launch

            code = launch(engine_config, config, disagg_config)
        else:
            code = run_server(engine_config, config, disagg_config) or 0
    except USER_ERRORS as e:
        fail(str(e))
    if code:
        raise typer.Exit(code)


@app.command()
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
) -> None:
    """One OpenAI endpoint in front of prefill and decode workers (`nvllm serve --role …`) or mixed replicas."""
    from nvllm.disagg.router import RouterConfig, parse_urls, run_router

    try:
        run_router(RouterConfig(parse_urls(prefill, "--prefill"), parse_urls(decode, "--decode"),
                                parse_urls(mixed, "--mixed"), host, port, api_key, max_request_bytes, poll_interval,
                                log_interval, uvicorn_log_level, fd, shutdown_timeout))
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
    from nvllm.logger import console

    runner.require_lm_eval()

    if baseline is None and (max_drop is not None or max_drop_rel is not None):
        fail("--max-drop / --max-drop-rel need --baseline")
    if baseline is not None and max_drop is None and max_drop_rel is None:
        max_drop = 1.0
    _check_thresholds(max_drop, max_drop_rel)
    runner.quiet_libraries()
    try:
        spec = runner.EvalSpec(tasks.split(","), num_fewshot, limit, data_dir, max_gen_toks, max_length)
        results, rows, notes = runner.run_eval(engine_config, spec, baseline, max_drop, max_drop_rel, progress,
                                               lora)
    except (runner.EvalError, *USER_ERRORS) as e:
        fail(str(e))
    runner.print_eval(console(), results, rows, max_drop, max_drop_rel)
    gate = runner.gate_summary(results, rows, max_drop, max_drop_rel) if baseline is not None else None
    if output_json:
        runner.write_json(output_json, runner.report_json(results, spec, engine_config, notes, gate))
        console().print(f"results written to {output_json}", highlight=False)
    if gate is not None and not gate["passed"]:
        fail(f"regression gate failed: {', '.join(gate['failed'])}", code=1)


# ---- nvllm quantize ------------------------------------------------------------------------------------
_CAL = "Calibration"


@app.command()
def quantize(
    model: Annotated[Optional[str], typer.Option(help="full-precision HF model directory (default: the demo model)")] = None,
    out: Annotated[Optional[str], typer.Option(help="output directory (must not exist unless --overwrite)")] = None,
    method: Annotated[Optional[str], typer.Option(help="awq | gptq | rtn")] = None,
    bits: Annotated[Optional[int], typer.Option(help="4 | 8 (default 4; awq: 4 only)")] = None,
    group_size: Annotated[Optional[int], typer.Option(help="inputs per scale/zero group; -1: whole rows "
                                                      "(default 128)")] = None,
    sym: Annotated[Optional[bool], typer.Option("--sym/--no-sym", help="symmetric (gptq/rtn default) or zero "
                                                "point (awq)")] = None,
    desc_act: Annotated[Optional[bool], typer.Option("--desc-act/--no-desc-act", help="GPTQ act-order "
                                                     "(static groups)")] = None,
    quantize_lm_head: Annotated[Optional[bool], typer.Option("--quantize-lm-head/--no-quantize-lm-head",
                                                             help="quantize the LM head too (gptq/rtn; untied "
                                                             "embeddings only) (default off)")] = None,
    calib_dataset: Annotated[Optional[str], typer.Option(help="c4 | calib (the shipped C4 sample) | a .jsonl/"
                                                         ".json.gz/.json/.txt path (default c4)",
                                                         rich_help_panel=_CAL)] = None,
    calib_samples: Annotated[Optional[int], typer.Option(help="windows (default 128)", rich_help_panel=_CAL)] = None,
    calib_seqlen: Annotated[Optional[int], typer.Option(help="tokens per window (default 2048)",
                                                        rich_help_panel=_CAL)] = None,
    seed: Annotated[Optional[int], typer.Option(help="calibration window seed (default 0)",
                                                rich_help_panel=_CAL)] = None,
    recipe: Annotated[Optional[str], typer.Option(help="YAML recipe (recipes/*.yaml); flags override it")] = None,
    overwrite: Annotated[bool, typer.Option(help="replace an existing --out")] = False,
    device: Annotated[Optional[str], typer.Option(help="auto | cpu | cuda | cuda:N (where layers are "
                                                  "quantized) (default auto)")] = None,
    progress: Annotated[bool, typer.Option(help="progress bar")] = True,
) -> None:
    """Quantize a model to INT4/INT8 (AWQ, GPTQ or RTN) and write an AWQ-GEMM / GPTQ checkpoint."""
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
                           quantize_lm_head=quantize_lm_head, calib_dataset=calib_dataset,
                           calib_samples=calib_samples, calib_seqlen=calib_seqlen, seed=seed, device=device)
        summary = q.quantize_model(model or demo_model_path(), out, cfg, overwrite, progress=bar.update,
                                   on_start=bar.start)
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
    method: Annotated[Optional[str], typer.Option(help="awq | gptq | rtn", rich_help_panel=_Q)] = None,
    bits: Annotated[Optional[int], typer.Option(help="4 | 8 (awq: 4) (default: 4)", rich_help_panel=_Q)] = None,
    group_size: Annotated[Optional[int], typer.Option(help="inputs per scale/zero group (default: 128)",
                                                      rich_help_panel=_Q)] = None,
    sym: Annotated[Optional[bool], typer.Option("--sym/--no-sym", rich_help_panel=_Q)] = None,
    desc_act: Annotated[Optional[bool], typer.Option("--desc-act/--no-desc-act", rich_help_panel=_Q)] = None,
    quantize_lm_head: Annotated[Optional[bool], typer.Option("--quantize-lm-head/--no-quantize-lm-head",
                                                             help="the LM head too (gptq/rtn)",
                                                             rich_help_panel=_Q)] = None,
    calib_dataset: Annotated[Optional[str], typer.Option(help="c4 | calib | a file (default: c4)",
                                                         rich_help_panel=_Q)] = None,
    calib_samples: Annotated[Optional[int], typer.Option(rich_help_panel=_Q)] = None,
    calib_seqlen: Annotated[Optional[int], typer.Option(rich_help_panel=_Q)] = None,
    recipe: Annotated[Optional[str], typer.Option(help="YAML recipe; flags override it", rich_help_panel=_Q)] = None,
    out: Annotated[Optional[str], typer.Option(help="quantized model directory (default: "
                                               "./<model>-<method>-w<bits>)", rich_help_panel=_Q)] = None,
    overwrite: Annotated[bool, typer.Option(help="replace an existing --out", rich_help_panel=_Q)] = False,
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
    from pathlib import Path

    from nvllm.eval import pipeline as pipe, runner
    from nvllm.logger import console
    from nvllm.quant import quantize as q
    from nvllm.quant.recipe import build_config

    runner.require_lm_eval()
    if max_drop is None and max_drop_rel is None:
        max_drop = 1.0
    _check_thresholds(max_drop, max_drop_rel)
    runner.quiet_libraries()
    try:
        cfg = build_config(recipe, method=method, bits=bits, group_size=group_size, sym=sym, desc_act=desc_act,
                           quantize_lm_head=quantize_lm_head, calib_dataset=calib_dataset,
                           calib_samples=calib_samples, calib_seqlen=calib_seqlen, seed=engine_config.seed,
                           device=engine_config.device)
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
