"""`nvllm pipeline`: quantize → regression gate against the original → latency and throughput of both → one
report. Registered on the `nvllm` app by nvllm/cli.py."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from nvllm.cli_options import check_gate_thresholds, engine_options, fail
from nvllm.config import EngineConfig

_Q, _E, _B = "Quantization", "Evaluation", "Benchmark"


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
    calib_config: Annotated[Optional[str], typer.Option(help="a Hub dataset's configuration",
                                                        rich_help_panel=_Q)] = None,
    calib_samples: Annotated[Optional[int], typer.Option(rich_help_panel=_Q)] = None,
    calib_seqlen: Annotated[Optional[int], typer.Option(rich_help_panel=_Q)] = None,
    recipe: Annotated[Optional[str], typer.Option(help="YAML recipe; flags override it", rich_help_panel=_Q)] = None,
    out: Annotated[Optional[str], typer.Option(help="quantized model directory (default: "
                                               "./<model>-<method>-w<bits>)", rich_help_panel=_Q)] = None,
    overwrite: Annotated[bool, typer.Option(
        help="replace an existing --out (a model directory, one with a config.json, or an empty one)",
        rich_help_panel=_Q)] = False,
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
    max_drop, max_drop_rel = check_gate_thresholds(max_drop, max_drop_rel)
    quiet_libraries()
    try:
        # --seed and --device also set the calibration's seed and device, where given; else the recipe's hold
        cfg = build_config(recipe, method=method, bits=bits, group_size=group_size, sym=sym, desc_act=desc_act,
                           quantize_lm_head=quantize_lm_head, calib_dataset=calib_dataset,
                           calib_split=calib_split, calib_column=calib_column, calib_config=calib_config,
                           calib_samples=calib_samples, calib_seqlen=calib_seqlen,
                           seed=engine_config.seed if _given(ctx, "seed") else None,
                           device=engine_config.device if _given(ctx, "device") else None,
                           max_shard_size=max_shard_size)
        check_engine_flags(engine_config, cfg)
        if out == "":
            fail("--out is empty")
        out = out or f"{Path(engine_config.model).name}-{cfg.method}-w{cfg.bits}"
        spec = runner.EvalSpec(tasks.split(","), num_fewshot, limit, data_dir, max_gen_toks, max_length)
        bench = pipe.BenchSpec(batch_size, input_len, output_len, num_iters_warmup, num_iters, num_prompts)
        result = pipe.run_pipeline(engine_config, out, cfg, overwrite, spec, max_drop, max_drop_rel, bench, report,
                                   console(), progress)
    except (runner.EvalError, *q.USER_ERRORS) as e:
        fail(e)
    console().print(f"report written to {' and '.join(result['report_files'])}", highlight=False)
    if not result["gate"]["passed"]:
        fail(f"regression gate failed: {', '.join(result['gate']['failed'])}", code=1)


def check_engine_flags(engine_config: EngineConfig, cfg) -> None:
    """Engine flags the pipeline cannot honour, refused before any work (EvalError, one line).

    --quantization names how the quantized copy is served; the pipeline writes that copy, so the flag can only
    repeat the format --method writes (the original runs as its checkpoint is, the gate's baseline and the speed
    table's alike). --tokenizer: quantization calibrates with the model directory's own tokenizer and copies it
    into the quantized copy, which the gate and the benchmarks then read; another one would reach some steps only."""
    from nvllm.eval.runner import EvalError

    q = engine_config.quantization
    if q is not None and q != cfg.writes:
        raise EvalError(f"--quantization {q} contradicts the quantized copy, which --method {cfg.method} writes as "
                        f"{cfg.writes}: the pipeline serves that copy as written; drop --quantization"
                        + (" (or give --method fp8)" if q == "fp8" else ""))
    if not engine_config.tokenizer_follows_model and not _same_path(engine_config.tokenizer, engine_config.model):
        raise EvalError(f"--tokenizer {engine_config.tokenizer}: the pipeline quantizes, gates and benchmarks with "
                        f"the model's own tokenizer (`nvllm quantize` calibrates with it and copies it into the "
                        f"quantized copy); put the tokenizer's files in {engine_config.model}, or drop --tokenizer")


def _same_path(a: str, b: str) -> bool:
    try:
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve() and Path(a).expanduser().is_dir()
    except OSError:
        return False


def _given(ctx: typer.Context, flag: str) -> bool:
    """Whether the command's parameter ``flag`` came from the command line (or the environment), not a default."""
    source = ctx.get_parameter_source(flag)
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")
