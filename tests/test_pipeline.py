"""`nvllm pipeline`: quantize → gate → speed → report end to end; bad input and engine flags it cannot honour refused
before any work; the report's "original" is one configuration (the gate's baseline is the speed table's original)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from unittest import mock

import pytest

pytest.importorskip("lm_eval")

from typer.testing import CliRunner  # noqa: E402

from nvllm.assets import demo_model_path  # noqa: E402
from nvllm.cli import app  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "eval"
SMALL = ["--device", "cpu", "--tasks", "wikitext", "--limit", "1", "--max-length", "128", "--data-dir", str(DATA),
         "--batch-size", "2", "--input-len", "8", "--output-len", "4", "--num-iters-warmup", "0", "--num-iters", "1",
         "--num-prompts", "2", "--no-progress"]
RTN = ["--method", "rtn", "--group-size", "32", "--calib-samples", "2", "--calib-seqlen", "32"]
QUICK = [*SMALL, *RTN]


def invoke(*args):
    r = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["pipeline", *args])
    return r, " ".join(r.output.split())


class Stop(Exception):
    pass


def reaches_quantization(*args) -> bool:
    """Whether the pipeline's checks pass: it is stopped where it would start quantizing."""
    from nvllm.eval import pipeline

    def stop(*a, **kw):
        raise pipeline.runner.EvalError("stopped before quantizing")

    with mock.patch.object(pipeline, "quantize_step", stop):
        r, said = invoke(*args)
    assert r.exit_code == 2, said
    return "stopped before quantizing" in said


@pytest.mark.parametrize("method, q", [(RTN, "fp8"), (["--method", "awq", *RTN[2:]], "gptq"),
                                       (["--method", "fp8"], "gptq")])
def test_a_quantization_that_contradicts_the_method_is_refused_before_any_work(tmp_path, method, q):
    """-q names how the quantized copy is served; the pipeline writes that copy, so a -q other than the format --method
    writes contradicts it. It was refused only after the quantization and the baseline's evaluation, --out left."""
    out = tmp_path / "q"
    r, said = invoke(*SMALL, *method, "-q", q, "--out", str(out))
    assert r.exit_code == 2 and f"--quantization {q} contradicts the quantized copy" in said, said
    assert "Traceback" not in r.output and not out.exists() and "quantizing" not in said


def test_a_quantization_naming_the_written_format_is_taken(tmp_path):
    assert reaches_quantization(*QUICK, "-q", "gptq", "--out", str(tmp_path / "q"))  # rtn writes GPTQ v1
    assert reaches_quantization(*SMALL, "--method", "fp8", "-q", "fp8", "--out", str(tmp_path / "q"))


def test_a_tokenizer_other_than_the_models_is_refused_before_any_work(tmp_path):
    """--tokenizer was accepted, then ignored by the quantization and the gate: a model directory without tokenizer
    files failed with "no tokenizer in …" after the checks. It is refused up front, saying what to do."""
    notok, tokdir = tmp_path / "notok", tmp_path / "tokdir"
    notok.mkdir()
    tokdir.mkdir()
    demo = Path(demo_model_path())
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(demo / name, notok)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(demo / name, tokdir)
    out = tmp_path / "q"
    r, said = invoke(*QUICK, "--model", str(notok), "--tokenizer", str(tokdir), "--out", str(out))
    assert r.exit_code == 2 and f"--tokenizer {tokdir}: the pipeline quantizes, gates and benchmarks with the " \
        f"model's own tokenizer" in said and f"put the tokenizer's files in {notok}" in said, said
    assert not out.exists() and "Traceback" not in r.output
    # the model's own directory, however spelled, is its own tokenizer
    assert reaches_quantization(*QUICK, "--tokenizer", f"{demo}/", "--out", str(tmp_path / "q"))


def test_the_speed_tables_original_is_the_gates_baseline(tmp_path):
    """With --kv-cache-dtype int8 the gate's baseline ran with the model's own cache and the speed table's original
    with an int8 one: one "original", two configurations. Both are now the baseline (runner.baseline_config), and the
    report says what the quantized rows ran with."""
    out = tmp_path / "q"
    r, said = invoke(*QUICK, "--kv-cache-dtype", "int8", "--max-drop-rel", "1000", "--out", str(out))
    assert r.exit_code == 0, said
    report = json.loads((tmp_path / "q-report.json").read_text())
    gate = {m["label"]: m["kernel_report"]["kv_store"] for m in report["eval"]["models"]}
    speed = {k: report["bench"][k]["latency"]["kernel_report"]["kv_store"] for k in ("original", "quantized")}
    assert set(speed["original"]) == set(gate["baseline"]) == {"torch index_copy"}, (gate, speed)
    assert set(speed["quantized"]) == set(gate["candidate"]) == {"torch quantize + index_copy"}
    assert report["differing_settings"] == {"kv_cache_dtype": {"original": "auto", "quantized": "int8"}}
    md = " ".join((tmp_path / "q-report.md").read_text().split())
    assert "the quantized rows ran with kv_cache_dtype int8 (original: auto)" in md


def test_pipeline_quantizes_gates_benches_and_reports(tmp_path):
    out = tmp_path / "q"
    r = CliRunner(env={"COLUMNS": "200"}).invoke(app, [
        "pipeline", "--device", "cpu", "--method", "rtn", "--bits", "4", "--group-size", "32", "--calib-samples",
        "2", "--calib-seqlen", "32", "--out", str(out), "--tasks", "wikitext", "--limit", "1", "--max-length", "128",
        "--data-dir", str(DATA), "--max-drop-rel", "1000", "--batch-size", "2", "--input-len", "8", "--output-len",
        "4", "--num-iters-warmup", "0", "--num-iters", "1", "--num-prompts", "2", "--no-progress"])
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "q-report.json").read_text())
    assert report["quantization"]["config"]["method"] == "rtn" and (out / "config.json").is_file()
    assert report["gate"]["passed"] and report["gate"]["rows"][0]["metric"] == "token_perplexity"
    assert report["eval"]["models"][1]["quantization_config"]["quant_method"] == "gptq"
    quant_kernels = report["bench"]["quantized"]["latency"]["kernel_report"]
    assert "quant_gemm" in quant_kernels and "quant_gemm" not in report["bench"]["original"]["latency"]["kernel_report"]
    assert all(row["speedup"] > 0 for row in report["bench"]["rows"])
    md = (tmp_path / "q-report.md").read_text()
    for heading in ("## Quantization", "## Accuracy: regression gate passed", "## Speed", "## Kernel report"):
        assert heading in md


@pytest.mark.parametrize("args, message", [
    (["--tasks", "wikitext", "--data-dir", str(DATA)], "choose a method"),
    (["--method", "rtn", "--tasks", "/no/such/file.txt"], "perplexity file /no/such/file.txt does not exist"),
    (["--method", "rtn", "--tasks", "wikitext", "--data-dir", str(DATA), "--num-iters", "0"],
     "--num-iters must be at least 1"),
    (["--method", "rtn", "--tasks", "gsm8k", "--data-dir", str(DATA / "mmlu")], "GSM8K not found"),
    (["--method", "rtn", "--tasks", "wikitext", "--data-dir", str(DATA), "--max-drop", "inf"],
     "--max-drop must be a finite number of at least 0, got inf"),
    (["--method", "awq", "--quantize-lm-head", "--tasks", "wikitext", "--data-dir", str(DATA)],
     "--quantize-lm-head applies to GPTQ and RTN only"),
    (["--method", "rtn", "--group-size", "32", "--quantize-lm-head", "--tasks", "wikitext", "--data-dir", str(DATA)],
     "the model ties its word embeddings"),
    (["--method", "rtn", "--group-size", "32", "--tasks", "wikitext", "--data-dir", str(DATA), "--max-model-len",
      "200"], "--input-len + --output-len = 256 exceeds max_model_len 200"),
    (["--method", "rtn", "--tasks", "wikitext", "--data-dir", str(DATA), "--report", ""], "--report is empty"),
    (["--method", "rtn", "--tasks", "wikitext", "--data-dir", str(DATA), "--out", ""], "--out is empty"),
    (["--method", "rtn", "--tasks", "wikitext", "--data-dir", str(DATA), "--report", "/tmp/"],
     "--report /tmp/ is a folder"),   # it wrote /tmp/.json and /tmp/.md
    (["--method", "rtn", "--group-size", "32", "--tasks", "wikitext", "--data-dir", str(DATA), "--max-length",
      "100000"], "--max-length 100000 is longer than the model takes: at most 510"),  # it came after quantizing
])
def test_pipeline_bad_input_fails_before_quantizing(tmp_path, args, message):
    r = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["pipeline", "--device", "cpu", "--out", str(tmp_path / "q"),
                                                       *args])
    assert r.exit_code == 2 and message in " ".join(r.output.split()) and not (tmp_path / "q").exists()


def test_a_pipeline_failing_after_its_quantization_leaves_no_copy(tmp_path, monkeypatch):
    """An evaluation that fails (a task's few-shot pool smaller than --num-fewshot, a full disk) removes the copy the
    run wrote: the same command again was refused for it ("already exists")."""
    from nvllm.eval import runner

    def fail(*args, **kwargs):
        raise runner.EvalError("--num-fewshot 100000 is more examples than a task's few-shot split holds")

    monkeypatch.setattr(runner, "run_eval", fail)
    args = ["pipeline", "--device", "cpu", "--method", "rtn", "--group-size", "32", "--tasks", "wikitext",
            "--data-dir", str(DATA), "--no-progress"]
    r = CliRunner(env={"COLUMNS": "200"}).invoke(app, [*args, "--out", str(tmp_path / "q")])
    assert r.exit_code == 2 and "few-shot split" in r.output and not (tmp_path / "q").exists(), r.output
    (tmp_path / "kept").mkdir()   # a folder that was there before (--overwrite) is not this run's to remove
    r = CliRunner(env={"COLUMNS": "200"}).invoke(app, [*args, "--out", str(tmp_path / "kept"), "--overwrite"])
    assert r.exit_code == 2 and (tmp_path / "kept" / "config.json").exists(), r.output


def test_pipeline_takes_the_recipes_seed_and_device_unless_given(tmp_path):
    """A recipe's calibration seed and device hold unless --seed / --device are given (as in `nvllm quantize`)."""
    from nvllm.eval import pipeline

    recipe = tmp_path / "r.yaml"
    recipe.write_text("method: rtn\ngroup_size: 32\ndevice: cuda:7\ncalibration: {dataset: calib, samples: 2, "
                      "seqlen: 32, seed: 7}\n")
    seen = []

    def stop(model, out, cfg, *a, **kw):
        seen.append((cfg.seed, cfg.device))
        raise pipeline.runner.EvalError("stopped after the settings")

    with mock.patch.object(pipeline, "quantize_step", stop):
        for extra in ([], ["--seed", "3", "--device", "cpu"]):
            r = CliRunner(env={"COLUMNS": "200"}).invoke(app, [
                "pipeline", "--recipe", str(recipe), "--out", str(tmp_path / "q"), "--tasks", "wikitext",
                "--data-dir", str(DATA), *(extra or ["--device", "cpu"])])
            assert r.exit_code == 2 and "stopped after the settings" in r.output, r.output
    assert seen == [(7, "cpu"), (3, "cpu")]


def test_pipeline_markdown_shows_a_missing_delta_as_n_a():
    """A NaN score's delta is null in the JSON: the Markdown says n/a (it raised a TypeError)."""
    from nvllm.eval.pipeline import markdown

    row = {"task": "wikitext", "metric": "token_perplexity", "n": 1, "baseline": 4.0, "candidate": None,
           "delta": None, "delta_se": None, "failed": True}
    report = {"model": "m", "date": "d", "engine": {"device": "cpu"}, "quantization": {"out_dir": "q"},
              "gate": {"passed": False, "max_drop": 1.0, "max_drop_rel": None, "rows": [row]},
              "bench": {"settings": {"batch_size": 1, "input_len": 4, "output_len": 2, "num_iters": 1,
                                     "num_prompts": 1}, "rows": [], "quantized": {"latency": {}}}}
    assert "| wikitext | token_perplexity | 1 | 4.00 | n/a | n/a | FAIL |" in markdown(report, [])


def test_pipeline_report_that_cannot_be_written_fails_before_quantizing(tmp_path):
    (tmp_path / "r.md").mkdir()
    r = CliRunner(env={"COLUMNS": "200"}).invoke(app, [
        "pipeline", "--device", "cpu", "--method", "rtn", "--out", str(tmp_path / "q"), "--tasks", "wikitext",
        "--data-dir", str(DATA), "--report", str(tmp_path / "r")])
    assert r.exit_code == 2 and f"--report {tmp_path / 'r.md'} is a directory" in " ".join(r.output.split())
    assert not (tmp_path / "q").exists()
