"""What `nvllm eval` runs: tasks through lm-eval on an NvllmLM (local task configs offline, lm-eval's own when
the hub is reachable), perplexity through perplexity.py, one result dict per model, the results table."""

from __future__ import annotations

import gc
import logging
import math
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from nvllm import output_file
from nvllm.config import ConfigError, EngineConfig, first_line, missing
from nvllm.eval.harness_results import digest, harness_entry
from nvllm.models import hub
from nvllm.quant.plan import read_quantization_config
from nvllm.eval.quiet import harness_bars

TASK_HELP = "gsm8k, mmlu, mmlu_<category|subject>, wikitext, c4 or a text file path"


class EvalError(ValueError):
    """A user mistake in the eval flags or data (one clear line)."""


@dataclass
class EvalSpec:
    tasks: list[str]
    num_fewshot: int | None = None
    limit: int | None = None
    data_dir: str | None = None
    max_gen_toks: int | None = None
    max_length: int | None = None
    apply_chat_template: bool = False
    fewshot_as_multiturn: bool | None = None  # None: as apply_chat_template (lm-eval's default)

    def __post_init__(self) -> None:
        from nvllm.eval.perplexity import is_perplexity_task

        self.tasks = list(dict.fromkeys(t.strip() for t in self.tasks if t.strip()))
        if not self.tasks:
            raise EvalError(f"no task given; choose from {TASK_HELP}")
        for name, v in (("limit", self.limit), ("max_gen_toks", self.max_gen_toks), ("max_length", self.max_length)):
            if v is not None and v < 1:
                raise EvalError(f"--{name.replace('_', '-')} must be at least 1, got {v}")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise EvalError(f"--num-fewshot must be non-negative, got {self.num_fewshot}")
        if self.data_dir is not None and not Path(self.data_dir).is_dir():
            raise EvalError(f"data directory {self.data_dir} {missing(self.data_dir, 'directory')}")
        if self.fewshot_as_multiturn and not self.apply_chat_template:
            raise EvalError("--fewshot-as-multiturn needs --apply-chat-template")
        if self.fewshot_as_multiturn is None:
            self.fewshot_as_multiturn = self.apply_chat_template
        self.ppl_tasks = [t for t in self.tasks if is_perplexity_task(t)]
        self.harness_tasks = [t for t in self.tasks if t not in self.ppl_tasks]


def require_lm_eval() -> None:
    """One clear line when the `eval` extra is missing."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        from nvllm.cli_options import fail

        fail("nvllm eval needs lm-eval: pip install 'nvllm[eval]' (from a checkout: pip install -e '.[eval]')")


@contextmanager
def task_manager(spec: EvalSpec):
    """lm-eval's TaskManager for the harness tasks: local configs rendered into a temporary folder when
    --data-dir is given, else lm-eval's own tasks (the hub must be reachable). Yields (manager, notes)."""
    from lm_eval.tasks import TaskManager

    from nvllm.eval import tasks as local

    if not spec.harness_tasks:
        yield None, {}
        return
    if spec.data_dir is not None:
        unknown = [t for t in spec.harness_tasks if t not in local.LOCAL_TASKS]
        if unknown:
            raise EvalError(f"unknown task {unknown[0]!r}; choose from {TASK_HELP}")
        with tempfile.TemporaryDirectory(prefix="nvllm-eval-") as tmp:
            try:
                notes = local.render(spec.data_dir, spec.harness_tasks, Path(tmp), spec.num_fewshot)
            except local.DataError as e:
                raise EvalError(str(e)) from e
            yield TaskManager(include_path=tmp, include_defaults=False), notes
        return
    manager = TaskManager()  # lm-eval's own task index, on disk: a name it lacks is unknown, online or not
    unknown = [t for t in spec.harness_tasks if t not in manager.all_tasks]
    if unknown:
        raise EvalError(f"unknown task {unknown[0]!r}; choose from {TASK_HELP}")
    if hub.hub_offline() or not hub.hub_reachable():
        raise EvalError("the Hugging Face hub is unreachable and no --data-dir was given: pass --data-dir DIR "
                        "with local copies (gsm8k/test.jsonl, mmlu/test/*.csv, ...)")
    yield manager, {t: "lm-eval task (hub)" for t in spec.harness_tasks}


def evaluate_model(config: EngineConfig, spec: EvalSpec, manager, label: str = "model", progress=None,
                   lora: str | None = None) -> dict:
    """Evaluate one model (with the LoRA adapter ``lora``) on every task of `spec`; the result dict `nvllm eval`
    prints, compares and saves. The nvllm log level it lowers under progress bars is restored after."""
    from nvllm.logger import setup_logging

    logger = setup_logging()  # configured first: the level restored is the one in force, never NOTSET
    level = logger.level
    try:
        return _evaluate_model(config, spec, manager, label, progress, lora)
    finally:
        logger.setLevel(level)


def _evaluate_model(config: EngineConfig, spec: EvalSpec, manager, label: str, progress, lora: str | None) -> dict:
    import lm_eval

    from nvllm.eval.lm_eval_model import NvllmLM
    from nvllm.eval.perplexity import PerplexityError, evaluate_perplexity, load_corpus
    from nvllm.kernels import report
    from nvllm.llm import LLM

    corpora = []
    for name in spec.ppl_tasks:  # read the text before loading weights: a missing file fails fast
        try:
            corpora.append(load_corpus(name, spec.data_dir))
        except PerplexityError as e:
            raise EvalError(str(e)) from e
    start = time.time()
    llm = LLM.from_config(config)
    report.reset()  # the kernel report of this evaluation, not of the engine's warm-up
    if progress is not None and not progress.disable:  # the bars show progress; skip the per-batch stat lines
        logging.getLogger("nvllm").setLevel(logging.WARNING)
    try:
        lm = NvllmLM(llm=llm, max_length=spec.max_length, lora_local_path=lora,
                     **({"max_gen_toks": spec.max_gen_toks} if spec.max_gen_toks else {}))
    except ValueError as e:
        raise EvalError(str(e)) from e
    lm.progress, lm.progress_prefix = progress, f"{label}: "
    out: dict = {"label": label, "model": config.model, "lora": lora, "tokenizer": config.tokenizer,
                 "quantization_config": read_quantization_config(config.model, llm.engine.runner.hf_config),
                 "max_length": lm.max_length,
                 "tasks": {}, "samples": {}, "hashes": {}}
    if spec.harness_tasks:
        try:
            with harness_bars(progress is not None and not progress.disable):
                r = lm_eval.simple_evaluate(model=lm, tasks=list(spec.harness_tasks), task_manager=manager,
                                            num_fewshot=spec.num_fewshot, limit=spec.limit, log_samples=True,
                                            gen_kwargs={"max_gen_toks": spec.max_gen_toks} if spec.max_gen_toks
                                            else None, apply_chat_template=spec.apply_chat_template,
                                            fewshot_as_multiturn=spec.fewshot_as_multiturn)
        except (AssertionError, ValueError) as e:  # lm-eval's checks of the few-shot pool's size
            if spec.num_fewshot is None or not ("available" in str(e) or "larger than population" in str(e)):
                raise
            raise EvalError(f"--num-fewshot {spec.num_fewshot} is more examples than a task's few-shot split "
                            f"holds ({first_line(e)})") from None
        for name in spec.harness_tasks:
            out["tasks"][name], out["samples"][name], out["hashes"][name] = harness_entry(r, name)
        out["lm_eval_version"] = r.get("lm_eval_version")
    for corpus in corpora:
        res = evaluate_perplexity(lm, corpus, spec.limit)
        per_doc = res.pop("per_doc")
        out["tasks"][corpus.name] = {**res, "stderr": {}, "num_fewshot": None,
                                     "higher_is_better": {k: False for k in res["metrics"]}}
        out["hashes"][corpus.name] = digest([(str(i), str(n)) for i, n in enumerate(per_doc["tokens"])])
    out["truncated_requests"] = lm.truncated
    out["kernel_report"] = report.snapshot()
    out["elapsed_s"] = round(time.time() - start, 2)
    del lm, llm
    gc.collect()
    _empty_cuda_cache()
    return out


# what makes the candidate the model under test, not how the engine runs: the baseline loads as its checkpoint is
CANDIDATE_ONLY = ("quantization", "kv_cache_dtype", "hf_overrides", "load_format", "revision", "tokenizer_revision",
                  "speculative")


def baseline_config(candidate: EngineConfig, baseline: str) -> EngineConfig:
    """The candidate's engine settings (device, dtype, lengths, batching), the baseline's weights and tokenizer (a
    directory, or a Hub id fetched as --model's is), loaded as its checkpoint is: a gate of ``-q fp8`` or an 8-bit
    KV cache compares with the model without them."""
    import dataclasses

    from nvllm.models.hub import resolve_model_path

    defaults = {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
                for f in dataclasses.fields(EngineConfig) if f.name in CANDIDATE_ONLY}
    return dataclasses.replace(candidate, model=resolve_model_path(baseline), tokenizer=None, **defaults)


def run_eval(engine_config: EngineConfig, spec: EvalSpec, baseline: str | None = None,
             max_drop: float | None = None, max_drop_rel: float | None = None, progress: bool = True,
             lora: str | None = None):
    """Evaluate the model (with the LoRA adapter ``lora``; and its baseline first, when given, without it) on
    identical samples. Returns (results, gate rows, data notes); rows are empty without a baseline."""
    import dataclasses

    from nvllm.eval import regression

    candidate = dataclasses.replace(engine_config, enable_lora=True) if lora else engine_config
    configs = [("model", candidate, lora)]
    if baseline is not None:
        base = baseline_config(engine_config, baseline)
        regression.check_same_tokenizer(base.tokenizer, engine_config.tokenizer, spec.apply_chat_template)
        configs = [("baseline", base, None), ("candidate", candidate, lora)]
        window = check_max_length(spec, [base, candidate])  # one scoring window for both, or their samples differ
        if spec.max_length is None:
            spec = dataclasses.replace(spec, max_length=window)
    if spec.apply_chat_template and spec.harness_tasks:  # a tokenizer without a template fails before any model loads
        require_chat_templates([c for _, c, _ in configs])
    with task_manager(spec) as (manager, notes), progress_bar(progress) as bar:
        results = [evaluate_model(config, spec, manager, label, bar, adapter) for label, config, adapter in configs]
    rows = regression.compare(results[0], results[1], max_drop, max_drop_rel) if baseline is not None else []
    return results, rows, notes


def require_chat_templates(configs: list[EngineConfig]) -> None:
    from nvllm.engine.tokenizer import load_tokenizer
    from nvllm.eval.lm_eval_model import chat_template_of

    for c in configs:
        try:
            chat_template_of(load_tokenizer(c.tokenizer), c.tokenizer)
        except ValueError as e:
            raise EvalError(str(e)) from None


def check_max_length(spec: EvalSpec, configs: list[EngineConfig]) -> int | None:
    """The models' common scoring window (``common_window``); an EvalError when --max-length is longer, before any
    model is evaluated (or, in the pipeline, quantized)."""
    window = common_window(configs)
    if spec.max_length is not None and window is not None and spec.max_length > window:
        which = ("both models take", " of the shorter") if len(configs) > 1 else ("the model takes", "")
        raise EvalError(f"--max-length {spec.max_length} is longer than {which[0]}: at most {window} "
                        f"(max_model_len − 2{which[1]})")
    return window


def common_window(configs: list[EngineConfig]) -> int | None:
    """The longest scoring window every model takes (NvllmLM's default: max_model_len − 2); None where a config
    cannot be read here (the engine then says what is wrong with it)."""
    try:
        from nvllm.models.loader import config_model_len

        return min(config_model_len(c) for c in configs) - 2
    except (TypeError, ValueError, AttributeError):  # ConfigError is a ValueError
        return None


def gate_summary(results: list[dict], rows: list, max_drop: float | None, max_drop_rel: float | None) -> dict:
    return {"baseline": results[0]["model"], "candidate": results[-1]["model"], "max_drop": max_drop,
            "max_drop_rel": max_drop_rel, "passed": not any(r.failed for r in rows),
            "failed": sorted({f"{r.task} ({r.metric})" for r in rows if r.failed}),
            "rows": [r.to_dict() for r in rows]}


def print_eval(out, results: list[dict], rows: list, max_drop: float | None, max_drop_rel: float | None) -> None:
    from nvllm.eval import regression

    for r in results:
        adapter = f" + LoRA {r['lora']}" if r.get("lora") else ""
        out.print(results_table(r, f"{r['label']}: {r['model']}{adapter}"))
        if r["truncated_requests"]:
            out.print(f"[yellow]note:[/] {r['truncated_requests']} requests were cut on the left to the scoring "
                      f"window of {r['max_length']} tokens", highlight=False)
    for name, task in results[0]["tasks"].items():  # which file a perplexity was computed on (C4: one shard)
        if task.get("source", name) != name:
            out.print(f"{name}: scored {task['source']}", highlight=False)
    if rows:
        out.print(regression.gate_table(rows, max_drop, max_drop_rel))


def _empty_cuda_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def results_table(result: dict, title: str):
    from rich.table import Table

    better = [hb for t in result["tasks"].values() for hb in
              (t.get("higher_is_better", {}).get(key, True) for key in t["metrics"])]
    caption = "; ".join(part for part, shown in (("accuracy in %", any(better)),
                                                  ("perplexity: lower is better", not all(better))) if shown)
    table = Table(title=title, caption=f"{caption}; ± standard error")
    for col, just in (("task", "left"), ("metric", "left"), ("n", "right"), ("shots", "right"),
                      ("value", "right")):
        table.add_column(col, justify=just)
    for name, t in result["tasks"].items():
        for key, v in t["metrics"].items():
            se = t.get("stderr", {}).get(key)
            scale = 100.0 if t.get("higher_is_better", {}).get(key, True) else 1.0
            text = "n/a" if v is None else f"{v * scale:.2f}" + ("" if se is None else f" ± {se * scale:.2f}")
            shots = t.get("num_fewshot")
            table.add_row(name, key, str(t.get("n_samples", "")), "" if shots is None else str(shots), text)
    return table


def report_json(results: list[dict], spec: EvalSpec, engine: EngineConfig, notes: dict, gate: dict | None) -> dict:
    """The JSON `--output-json` writes: per-model task results (no per-sample values), the run's settings."""
    models = [{k: v for k, v in r.items() if k not in ("samples", "hashes")} for r in results]
    # max_gen_toks: the run's --max-gen-toks (None: each task's own), which changes generative scores
    return {"tasks": spec.tasks, "num_fewshot": spec.num_fewshot, "limit": spec.limit, "data_dir": spec.data_dir,
            "max_gen_toks": spec.max_gen_toks, "apply_chat_template": spec.apply_chat_template,
            "fewshot_as_multiturn": spec.fewshot_as_multiturn,
            "data": notes, "engine": {k: v for k, v in engine.to_dict().items() if k not in ("model", "tokenizer")},
            "models": models, "gate": gate, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


@contextmanager
def progress_bar(enabled: bool = True):
    """One Rich progress display for the whole run; each model's request batches add their bars to it."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from nvllm.logger import console

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console(), disable=not enabled) as bar:
        yield bar


def write_json(path: str, data: dict) -> None:
    """Write whole or not at all (``nvllm.output_file``). A score that is not a number (a NaN perplexity) is written
    as null, so the file stays valid JSON."""
    output_file.write_json(path, _finite(data))


def _finite(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


__all__ = ["ConfigError", "EvalError", "EvalSpec", "evaluate_model", "report_json", "results_table", "task_manager"]
