"""`nvllm pipeline`: quantize a model, gate the quantized copy against the original on identical samples,
benchmark both (latency and throughput, each with its kernel report), and write one Markdown + JSON report.

Every step is the package's own: `nvllm.quant.quantize.quantize_model`, `runner.run_eval` (the same code as
`nvllm eval --baseline`), `nvllm.bench.offline.run_latency` / `run_throughput`. The report is written even
when the gate fails; the caller turns a failed gate into exit code 1.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import shutil
import time
from dataclasses import dataclass

from nvllm import output_file
from nvllm.config import EngineConfig
from nvllm.eval import runner


@dataclass
class BenchSpec:
    batch_size: int = 8
    input_len: int = 128
    output_len: int = 128
    num_iters_warmup: int = 3
    num_iters: int = 10
    num_prompts: int = 100

    def __post_init__(self) -> None:
        for name, v in dataclasses.asdict(self).items():
            if v < (0 if name == "num_iters_warmup" else 1):
                raise runner.EvalError(f"--{name.replace('_', '-')} must be at least "
                                       f"{0 if name == 'num_iters_warmup' else 1}, got {v}")


def quantize_step(model: str, out: str, quant_cfg, overwrite: bool, console, progress: bool):
    from nvllm.quant.report import quantize_with_report

    return quantize_with_report(model, out, quant_cfg, overwrite, console, progress)


def bench_step(configs: list[tuple[str, EngineConfig]], bench: BenchSpec, progress: bool) -> dict:
    """Latency and throughput of each model through one engine per model."""
    from nvllm.bench import offline
    from nvllm.llm import LLM

    out = {}
    for label, config in configs:
        llm = LLM.from_config(config)
        lat = offline.run_latency(config, bench.batch_size, bench.input_len, bench.output_len,
                                  bench.num_iters_warmup, bench.num_iters, [50.0, 99.0], progress, llm=llm)
        lat.pop("latencies", None)
        thr = offline.run_throughput(config, "random", None, bench.num_prompts, bench.input_len, bench.output_len,
                                     0.0, True, progress, llm=llm)
        out[label] = {"latency": lat, "throughput": thr}
        del llm
        gc.collect()
        runner._empty_cuda_cache()
    return out


SPEED_ROWS = [  # (label, result, key, lower is better)
    ("latency per batch (s)", "latency", "avg_latency", True),
    ("TTFT median (ms)", "latency", "median_ttft_ms", True),
    ("TPOT median (ms)", "latency", "median_tpot_ms", True),
    ("throughput (requests/s)", "throughput", "requests_per_second", False),
    ("throughput (output tokens/s)", "throughput", "output_tokens_per_second", False),
]


def speed_rows(bench: dict) -> list[dict]:
    """Original vs quantized; `speedup` > 1 means the quantized model is faster."""
    rows = []
    for label, kind, key, lower in SPEED_ROWS:
        a, b = bench["original"][kind].get(key), bench["quantized"][kind].get(key)
        speedup = None if not a or not b else (a / b if lower else b / a)
        rows.append({"metric": label, "key": key, "original": a, "quantized": b, "speedup": speedup})
    return rows


def _f(v, digits: int = 2, sign: str = "") -> str:
    """A number, or n/a where the JSON holds none (a NaN or infinite score)."""
    return "n/a" if v is None else f"{v:{sign}.{digits}f}"


def _differing(settings: dict | None) -> list[str]:
    if not settings:
        return []
    said = "; ".join(f"{k} {v['quantized']} (original: {v['original']})" for k, v in settings.items())
    return [f"The original runs as its checkpoint is, in the gate and the speed table alike; the quantized rows ran "
            f"with {said}.", ""]


def _limits(gate: dict) -> str:
    limits = [f"max drop {gate['max_drop']:g} points" if gate["max_drop"] is not None else "",
              f"max drop {gate['max_drop_rel']:g}% of the original" if gate["max_drop_rel"] is not None else ""]
    return "fails on " + " or ".join(x for x in limits if x)


def differing_settings(original: EngineConfig, quantized: EngineConfig) -> dict:
    """{setting: {"original": …, "quantized": …}} for the settings only the quantized copy runs with (--kv-cache-dtype
    int8, --speculative …): the original runs as its checkpoint is, in the gate and the speed table alike."""
    a, b = original.to_dict(), quantized.to_dict()
    return {k: {"original": a[k], "quantized": b[k]} for k in runner.CANDIDATE_ONLY if a[k] != b[k]}


def markdown(report: dict, quant_lines: list[str]) -> str:
    q, gate, b = report["quantization"], report["gate"], report["bench"]
    lines = [f"# nvllm pipeline: {report['model']}", "",
             f"{report['date']} · device {report['engine']['device']} · quantized copy `{q['out_dir']}`", "",
             *_differing(report.get("differing_settings")),
             "## Quantization", "", *[f"- {x}" for x in quant_lines], "",
             f"## Accuracy: regression gate {'passed' if gate['passed'] else 'FAILED'}", "",
             f"Identical samples for both models; {_limits(gate)}. Accuracy in points (×100), perplexity in its "
             "units; Δ ± paired standard error.",
             "", "| task | metric | n | original | quantized | Δ | result |", "|---|---|--:|--:|--:|--:|---|"]
    for r in gate["rows"]:
        se = "" if r["delta_se"] is None else f" ± {r['delta_se']:.2f}"
        lines.append(f"| {r['task']} | {r['metric']} | {r['n']} | {_f(r['baseline'])} | {_f(r['candidate'])} | "
                     f"{_f(r['delta'], sign='+')}{se} | {'FAIL' if r['failed'] else 'ok'} |")
    spec = b["settings"]
    lines += ["", "## Speed", "",
              f"Latency: batch {spec['batch_size']}, {spec['input_len']} prompt + {spec['output_len']} output tokens, "
              f"{spec['num_iters']} timed iterations; throughput: {spec['num_prompts']} random prompts.", "",
              "| | original | quantized | speedup |", "|---|--:|--:|--:|"]
    for r in b["rows"]:
        lines.append(f"| {r['metric']} | {_f(r['original'], 3)} | {_f(r['quantized'], 3)} | {_f(r['speedup'])}× |")
    lines += ["", "## Kernel report (quantized model, latency run)", "", "| op | implementation | calls |",
              "|---|---|--:|"]
    for op, impls in b["quantized"]["latency"].get("kernel_report", {}).items():
        lines += [f"| {op} | {impl} | {n} |" for impl, n in impls.items()]
    return "\n".join(lines) + "\n"


def _check_bench_lengths(config: EngineConfig, bench: BenchSpec) -> None:
    """The benchmark's prompt + output must fit the model: checked before the quantization and evaluations."""
    from nvllm.bench.offline import check_lengths
    from nvllm.models.loader import config_model_len

    try:
        check_lengths(bench.input_len, bench.output_len, config_model_len(config))
    except ValueError as e:  # ConfigError included: the model's own problems are one line too
        raise runner.EvalError(str(e)) from None


def run_pipeline(engine_config: EngineConfig, out: str, quant_cfg, overwrite: bool, spec: runner.EvalSpec,
                 max_drop: float | None, max_drop_rel: float | None, bench: BenchSpec, report_prefix: str | None,
                 console, progress: bool = True) -> dict:
    from nvllm.models.hub import resolve_model_path

    model_id = engine_config.model
    if report_prefix is not None and not report_prefix.strip():
        raise runner.EvalError("--report is empty: name the report's path (without extension)")
    if report_prefix is not None and (report_prefix.endswith(("/", os.sep)) or os.path.isdir(report_prefix)):
        raise runner.EvalError(f"--report {report_prefix} is a folder: name the report's path without extension "
                               f"(e.g. {os.path.join(report_prefix, 'report')}, for report.json and report.md)")
    prefix = report_prefix if report_prefix is not None else f"{out.rstrip('/')}-report"
    report_files = [f"{prefix}.json", f"{prefix}.md"]
    for path in report_files:  # a report that cannot be written fails now, not after the whole run
        output_file.check_output_file(path, "--report")
    if spec.ppl_tasks:  # missing data fails now, not after a long quantization
        from nvllm.eval.perplexity import PerplexityError, load_corpus

        try:
            [load_corpus(name, spec.data_dir) for name in spec.ppl_tasks]
        except PerplexityError as e:
            raise runner.EvalError(str(e)) from e
    with runner.task_manager(spec):  # the task data (or the hub) too
        pass
    model = resolve_model_path(model_id, engine_config.revision)  # a Hub id at its revision: quantized and the baseline
    if model != model_id:
        engine_config = dataclasses.replace(engine_config, model=model, tokenizer=model if
                                            engine_config.tokenizer_follows_model else engine_config.tokenizer)
    _check_bench_lengths(engine_config, bench)
    runner.check_max_length(spec, [engine_config])  # the quantized copy keeps the model's length
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    created = not os.path.lexists(out)
    summary = quantize_step(model, out, quant_cfg, overwrite, console, progress)
    try:
        return _evaluate_and_report(engine_config, model_id, model, out, summary, spec, max_drop, max_drop_rel,
                                    bench, report_files, started, progress)
    except Exception:  # what failed after the quantization (a task's few-shot pool, the disk): a rerun with the same
        if created:    # flags would be refused for the copy this run left, so it goes
            shutil.rmtree(out, ignore_errors=True)
        raise


def _evaluate_and_report(engine_config: EngineConfig, model_id: str, model: str, out: str, summary,
                         spec: runner.EvalSpec, max_drop: float | None, max_drop_rel: float | None, bench: BenchSpec,
                         report_files: list[str], started: str, progress: bool) -> dict:
    from nvllm.quant.report import summary_lines

    quantized = dataclasses.replace(engine_config, model=out, tokenizer=None)
    original = runner.baseline_config(quantized, model)  # the gate's baseline is the speed table's original too
    results, rows, notes = runner.run_eval(quantized, spec, model, max_drop, max_drop_rel, progress)
    from nvllm.logger import results_console

    runner.print_eval(results_console(), results, rows, max_drop, max_drop_rel)  # the results, on stdout
    bench_results = bench_step([("original", original), ("quantized", quantized)], bench, progress)
    bench_results["settings"] = dataclasses.asdict(bench)
    bench_results["rows"] = speed_rows(bench_results)
    report = {"date": started, "model": model_id,
              "quantization": {**dataclasses.asdict(summary), "config": dataclasses.asdict(summary.config)},
              "eval": runner.report_json(results, spec, engine_config, notes, None),
              "gate": runner.gate_summary(results, rows, max_drop, max_drop_rel), "bench": bench_results,
              "engine": {k: v for k, v in engine_config.to_dict().items() if k not in ("model", "tokenizer")},
              "differing_settings": differing_settings(original, quantized)}
    report["report_files"] = report_files
    runner.write_json(report["report_files"][0], report)
    output_file.write_text(report["report_files"][1], markdown(report, summary_lines(summary)))
    return report
