"""`nvllm eval` and the lm-eval backend, checked against references nobody here wrote: lm-eval's own `hf`
backend (HF transformers) on the same weights and requests, and a direct HF transformers perplexity loop.
Data: the small slices in tests/data/eval (see its README for provenance)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.model import TemplateLM  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

from nvllm.assets import demo_model_path  # noqa: E402
from nvllm.cli import app  # noqa: E402
from nvllm.eval import perplexity, tasks  # noqa: E402
from nvllm.eval.lm_eval_model import NvllmLM  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "eval"
WINDOW = 256  # a scoring window shorter than the prompts, so truncation and multi-window documents happen


@pytest.fixture(scope="module")
def nv() -> NvllmLM:
    return NvllmLM(device="cpu", max_length=WINDOW, show_progress=False)


@pytest.fixture(scope="module")
def hf():
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=demo_model_path(), device="cpu", dtype="float32", batch_size=16, max_length=WINDOW)


@pytest.fixture(scope="module")
def local_tasks(tmp_path_factory):
    out = tmp_path_factory.mktemp("tasks")
    tasks.render(DATA, ["mmlu", "gsm8k"], out, num_fewshot=None)
    return TaskManager(include_path=str(out), include_defaults=False)


def run(lm, manager, task_names, **kw):
    return lm_eval.simple_evaluate(model=lm, tasks=task_names, task_manager=manager, log_samples=True, **kw)


# ---- lm-eval backend vs lm-eval's hf backend ------------------------------------------------------------
def test_mmlu_same_loglikelihoods_and_accuracy_as_hf_backend(nv, hf, local_tasks):
    nv.truncated = 0
    a, b = (run(lm, local_tasks, ["mmlu"], num_fewshot=1, limit=3) for lm in (nv, hf))
    assert nv.truncated > 0  # some 1-shot prompts exceed the window: both backends cut them the same way
    assert a["results"]["mmlu"]["acc,none"] == b["results"]["mmlu"]["acc,none"]
    assert a["results"]["mmlu"]["sample_len"] == 12  # 4 subjects x 3 questions
    pairs = 0
    for task, samples in b["samples"].items():
        for sa, sb in zip(a["samples"][task], samples, strict=True):
            assert sa["doc_id"] == sb["doc_id"] and sa["prompt_hash"] == sb["prompt_hash"]
            for (la, ga), (lb, gb) in zip([r[0] for r in sa["resps"]], [r[0] for r in sb["resps"]], strict=True):
                assert la == pytest.approx(lb, abs=1e-4) and ga == gb
                pairs += 1
    assert pairs == 48


def test_loglikelihood_rolling_matches_hf_backend(nv, hf):
    docs = perplexity.load_corpus("wikitext", DATA).scored[:1]
    reqs = [Instance("loglikelihood_rolling", {}, (d,), i) for i, d in enumerate(docs)]
    a, b = nv.loglikelihood_rolling(reqs), hf.loglikelihood_rolling(reqs)
    assert a == pytest.approx(b, rel=1e-5)


def test_gsm8k_generation_matches_hf_backend_and_scores_both_filters(nv, hf, local_tasks):
    kw = dict(limit=2, gen_kwargs={"max_gen_toks": 16})
    a, b = run(nv, local_tasks, ["gsm8k"], **kw), run(hf, local_tasks, ["gsm8k"], **kw)
    res = a["results"]["gsm8k"]
    for key in ("exact_match,strict-match", "exact_match,flexible-extract"):
        assert key in res and f"exact_match_stderr,{key.split(',')[1]}" in res
    assert a["n-shot"]["gsm8k"] == 5 and a["n-samples"]["gsm8k"]["effective"] == 2
    gen_a = [s["resps"][0][0] for s in a["samples"]["gsm8k"]]
    gen_b = [s["resps"][0][0] for s in b["samples"]["gsm8k"]]
    assert gen_a == gen_b and all(g.strip() for g in gen_a)  # greedy: the same text as HF generate()
    assert {s["filter"] for s in a["samples"]["gsm8k"]} == {"strict-match", "flexible-extract"}


class GoldAnswers(TemplateLM):
    """Answers each GSM8K question with its reference solution: both filters must then score 1."""

    def __init__(self):
        super().__init__()
        rows = [json.loads(x) for x in (DATA / "gsm8k" / "test.jsonl").read_text().splitlines()]
        self.answers = {r["question"]: r["answer"] for r in rows}

    eot_token_id = 0

    def tok_encode(self, string, **kw):
        return [ord(c) for c in string]

    def _loglikelihood_tokens(self, requests, **kw):
        raise NotImplementedError

    def loglikelihood_rolling(self, requests, **kw):
        raise NotImplementedError

    def generate_until(self, requests, **kw):
        return [" " + self.answers[r.args[0].rsplit("Question: ", 1)[1].rsplit("\nAnswer:", 1)[0]] for r in requests]


def test_gsm8k_local_task_scores_reference_answers_fully(local_tasks):
    res = run(GoldAnswers(), local_tasks, ["gsm8k"])["results"]["gsm8k"]
    assert res["exact_match,strict-match"] == 1.0 and res["exact_match,flexible-extract"] == 1.0


# ---- local task configs ---------------------------------------------------------------------------------
def test_mmlu_csv_with_and_without_header_give_the_same_documents(tmp_path):
    for split in ("test", "dev"):
        for f in sorted((DATA / "mmlu" / split).glob("*.csv")):
            with_header = tasks.read_mmlu_csv(DATA / "mmlu_final_hf" / split / f.name)
            assert tasks.read_mmlu_csv(f) == with_header and len(with_header) == 5
    shutil.copytree(DATA / "mmlu", tmp_path / "data" / "mmlu")  # only the header-less copy
    notes = tasks.render(tmp_path / "data", ["mmlu_sociology"], tmp_path / "out")
    assert "1 of 57" in notes["mmlu"]
    docs = [json.loads(x) for x in (tmp_path / "out/mmlu/data/sociology_test.jsonl").read_text().splitlines()]
    assert docs == tasks.read_mmlu_csv(DATA / "mmlu_final_hf/test/sociology_test.csv")
    assert all(d["answer"] in range(4) and len(d["choices"]) == 4 for d in docs)


# ---- perplexity -----------------------------------------------------------------------------------------
def hf_direct_loglik(model, tokens: list[int], bos: int, window: int) -> float:
    """Every token predicted once: chunks of `window` predictions, each chunk's input the `window` ids before
    its last prediction (BOS first), the same token-level definition written plainly against HF."""
    ids = torch.tensor([bos] + tokens)
    total = 0.0
    for s in range(0, len(tokens), window):
        e = min(s + window, len(tokens))
        start = max(0, e - window)
        with torch.no_grad():
            lsm = torch.log_softmax(model(ids[start:e][None]).logits[0].double(), dim=-1)
        k = torch.arange(s, e)
        total += float(lsm[k - start, ids[k + 1]].sum())
    return total


def test_perplexity_matches_direct_hf_computation(nv):
    from transformers import AutoModelForCausalLM

    corpus = perplexity.load_corpus("wikitext", DATA)
    assert len(corpus.raw) == 2 and corpus.raw[1].startswith(" = Du Fu = \n")
    res = perplexity.evaluate_perplexity(nv, corpus, limit=1)
    model = AutoModelForCausalLM.from_pretrained(demo_model_path(), dtype=torch.float32).eval()
    tokens = nv.tokenizer.encode(corpus.scored[0])  # as lm-eval's hf backend: the tokenizer's BOS included
    ll = hf_direct_loglik(model, tokens, nv.tokenizer.bos_token_id, WINDOW)
    assert tokens[0] == nv.tokenizer.bos_token_id and len(tokens) > 4 * WINDOW and res["n_tokens"] == len(tokens)
    # `nvllm eval --tasks wikitext` and lm-eval's loglikelihood_rolling through the nvllm backend: one number
    from types import SimpleNamespace

    assert nv.loglikelihood_rolling([SimpleNamespace(args=(corpus.scored[0],))]) == \
        [pytest.approx(res["per_doc"]["loglikelihood"][0], abs=1e-6)]
    assert res["metrics"]["token_perplexity"] == pytest.approx(math.exp(-ll / len(tokens)), rel=1e-4)
    assert res["metrics"]["bits_per_byte"] == pytest.approx(-ll / len(corpus.raw[0].encode()) / math.log(2),
                                                            rel=1e-4)


def test_perplexity_on_c4_and_a_text_file(nv, tmp_path):
    c4 = perplexity.load_corpus("c4", DATA)
    assert len(c4.raw) == 3
    text = tmp_path / "story.txt"
    text.write_text("Once upon a time, there was a little girl named Lily. She loved to play outside.\n")
    for corpus in (c4, perplexity.load_corpus(str(text), None)):
        m = perplexity.evaluate_perplexity(nv, corpus, limit=2)["metrics"]
        assert all(math.isfinite(v) and v > 0 for v in m.values())


def test_two_text_files_of_one_name_are_two_tasks(tmp_path):
    """d1/doc.txt and d2/doc.txt: each its own row and gate entry (one had overwritten the other)."""
    for d, text in (("d1", "Once upon a time, there was a little girl named Lily.\n"), ("d2", "zq xj vk wp\n" * 3)):
        (tmp_path / d).mkdir()
        (tmp_path / d / "doc.txt").write_text(text)
    report = tmp_path / "eval.json"
    names = [str(tmp_path / d / "doc.txt") for d in ("d1", "d2")]
    r = cli("--tasks", ",".join(names), "--output-json", str(report), "--no-progress")
    assert r.exit_code == 0, r.output
    tasks = json.loads(report.read_text())["models"][0]["tasks"]
    assert sorted(tasks) == names and tasks[names[0]] != tasks[names[1]]


def test_an_evaluation_leaves_the_log_level_as_it_found_it(tmp_path):
    """In a fresh process (nvllm's logger not set up yet), an evaluation under progress bars lowers the level and
    gives back INFO, not the unset level it found: the next model's (a baseline's, the next LLM's) lines show."""
    import subprocess
    import sys

    (tmp_path / "doc.txt").write_text("Once upon a time, there was a little girl named Lily.\n")
    code = ("import logging; from nvllm.eval.runner import EvalSpec, run_eval; from nvllm.config import EngineConfig; "
            f"run_eval(EngineConfig(device='cpu'), EvalSpec(tasks=[{str(tmp_path / 'doc.txt')!r}]), "
            "progress=True); print('level', logging.getLogger('nvllm').getEffectiveLevel())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "level 20" in out.stdout, out.stdout[-1000:] + out.stderr[-2000:]


# ---- the command line -----------------------------------------------------------------------------------
def cli(*args: str, env: dict | None = None):
    return CliRunner(env={"COLUMNS": "200", **(env or {})}).invoke(app, ["eval", "--device", "cpu", *args])


@pytest.fixture(scope="module")
def rtn2_model(tmp_path_factory) -> str:
    """The demo model with every projection rounded to 2 bits (per row) and stored back in float32."""

    from nvllm.quant.formats import quantize_rtn

    out = tmp_path_factory.mktemp("rtn2")
    for f in Path(demo_model_path()).iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    sd = load_file(Path(demo_model_path()) / "model.safetensors")
    sd = {k: quantize_rtn(v, bits=2, group_size=-1).dequantize() if k.endswith("_proj.weight") else v
          for k, v in sd.items()}
    save_file(sd, out / "model.safetensors")
    return str(out)


def test_the_report_names_the_quantization_the_loader_served(tmp_path):
    """An older AutoGPTQ checkpoint keeps its settings in quantize_config.json, not config.json: the eval report
    carries what the loader read from it (it said null for a model served quantized)."""
    from tests.quant_utils import write_by_hand

    model = tmp_path / "gptq"
    write_by_hand(Path(demo_model_path()), model, "gptq", bits=8, skip=("down_proj",))
    cfg = json.loads((model / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    (model / "config.json").write_text(json.dumps(cfg))
    (model / "quantize_config.json").write_text(json.dumps(qc))
    text = tmp_path / "doc.txt"
    text.write_text("Once upon a time, there was a little girl named Lily.\n")
    report = tmp_path / "eval.json"
    r = cli("--model", str(model), "--tasks", str(text), "--output-json", str(report), "--no-progress")
    assert r.exit_code == 0, r.output
    got = json.loads(report.read_text())["models"][0]["quantization_config"]
    assert got["quant_method"] == "gptq" and got["bits"] == 8 and got["group_size"] == qc["group_size"]


def test_a_drop_equal_to_the_limit_passes_whatever_the_rounding():
    """0.25 − 0.24 is 1.0000000000000009 points in floating point: at --max-drop 1 that is within the limit; a drop
    of 2 points is not, nor 2.01% of a 50-point baseline at --max-drop-rel 2."""
    from nvllm.eval.regression import compare

    def result(acc: float) -> dict:
        return {"tasks": {"t": {"metrics": {"acc": acc}, "higher_is_better": {"acc": True}, "n_samples": 100}}}

    assert [r.failed for k in range(1, 100) for r in compare(result(k / 100), result((k - 1) / 100), 1.0, None)] \
        == [False] * 99
    assert compare(result(0.25), result(0.23), 1.0, None)[0].failed
    assert not compare(result(0.50), result(0.49), None, 2.0)[0].failed
    assert compare(result(0.50), result(0.4899), None, 2.0)[0].failed


def test_gate_passes_on_the_same_model_and_writes_the_report(tmp_path):
    report = tmp_path / "eval.json"
    r = cli("--baseline", demo_model_path(), "--tasks", "mmlu,wikitext", "--limit", "1", "--max-length", "128",
            "--data-dir", str(DATA), "--output-json", str(report), "--no-progress")
    assert r.exit_code == 0, r.output
    assert "regression gate" in r.output and "FAIL" not in r.output
    assert not re.search(r"\| *\d+/\d+ \[", r.output), "a progress bar under --no-progress"  # lm-eval's tqdm
    data = json.loads(report.read_text())
    assert data["gate"]["passed"] and [m["label"] for m in data["models"]] == ["baseline", "candidate"]
    assert data["max_gen_toks"] is None and data["limit"] == 1  # the run's settings
    cand = data["models"][1]
    assert cand["model"] == demo_model_path() and "quantization_config" in cand
    assert cand["kernel_report"] and cand["tasks"]["mmlu"]["n_samples"] == 4
    assert "attention.decode" not in cand["kernel_report"]  # scoring prefills only: the warm-up's decodes are not in
    assert set(cand["tasks"]["mmlu"]["stderr"]) == {"acc,none"}
    assert {"mmlu_abstract_algebra", "mmlu_stem"} <= set(cand["tasks"]["mmlu"]["subtasks"])
    assert all(row["delta"] == 0 for row in data["gate"]["rows"])


def test_the_baseline_loads_as_its_checkpoint_is(tmp_path):
    """--kv-cache-dtype, --quantization and the other flags that make the model under test apply to it only: the
    baseline of `--kv-cache-dtype int8` is the model with its own cache, so the gate sees what int8 costs."""
    import dataclasses

    from nvllm.config import EngineConfig
    from nvllm.eval.runner import CANDIDATE_ONLY, baseline_config

    cand = EngineConfig(model=demo_model_path(), quantization="fp8", kv_cache_dtype="int8", max_model_len=256,
                        hf_overrides={"rms_norm_eps": 1e-6}, dtype="float32", enable_prefix_caching=False)
    base = baseline_config(cand, demo_model_path())
    default = EngineConfig(model=demo_model_path())
    assert all(getattr(base, f) == getattr(default, f) for f in CANDIDATE_ONLY)
    assert (base.max_model_len, base.dtype, base.enable_prefix_caching) == (256, "float32", False)
    assert dataclasses.replace(base, model=cand.model) != cand

    reports = []
    for flags in ([], ["--kv-cache-dtype", "int8"]):
        reports.append(tmp_path / f"r{len(reports)}.json")
        r = cli("--baseline", demo_model_path(), "--tasks", "wikitext", "--limit", "1", "--max-length", "128",
                "--data-dir", str(DATA), "--output-json", str(reports[-1]), "--no-progress", "--max-drop-rel", "50",
                *flags)
        assert r.exit_code == 0, r.output
    plain, int8 = (json.loads(p.read_text()) for p in reports)
    ppl = [[m["tasks"]["wikitext"]["metrics"]["token_perplexity"] for m in d["models"]] for d in (plain, int8)]
    assert ppl[1][0] == ppl[0][0] == ppl[0][1]     # the baseline: the model as it is, in both runs
    assert ppl[1][1] != ppl[1][0]                  # the candidate: with its int8 cache


def test_gate_fails_on_a_2bit_copy(rtn2_model, tmp_path):
    r = cli("--model", rtn2_model, "--baseline", demo_model_path(), "--tasks", "wikitext", "--limit", "1",
            "--data-dir", str(DATA), "--max-drop", "1.0", "--max-drop-rel", "1000", "--no-progress")
    assert r.exit_code == 1, r.output
    # the results on stdout (what `> file` keeps, as lm-eval prints them), the relative drop beside Δ
    assert "regression gate" in r.stdout and "token_perplexity" in r.stdout and "drop %" in r.stdout
    assert "drop %" not in r.stderr and "regression gate failed" in r.stderr  # the verdict line is an error
    assert "FAIL" in r.output and "regression gate failed: wikitext (token_perplexity)" in " ".join(r.output.split())
    said = " ".join(r.output.split())  # the tables hold perplexities only: no accuracy caption over them
    assert "perplexity: lower is better; ± standard error" in said and "accuracy in %" not in said


@pytest.mark.parametrize("broken_by", ["nan", "huge logits"])
def test_gate_fails_on_a_nan_model_and_writes_valid_json(tmp_path, broken_by):
    """A candidate whose scores are not numbers (a NaN in its weights), or beyond float range (huge but finite logits:
    a perplexity past what math.exp takes, inf), fails the gate instead of passing as "ok" (NaN > limit is false) or
    crashing, and its results file is still valid JSON (null for the NaN or inf)."""
    broken = tmp_path / "broken"
    shutil.copytree(demo_model_path(), broken)
    sd = load_file(broken / "model.safetensors")
    norm = sd["model.norm.weight"]
    sd["model.norm.weight"] = torch.full_like(norm, float("nan")) if broken_by == "nan" else norm * 1000
    save_file(sd, broken / "model.safetensors")
    report = tmp_path / "eval.json"
    r = cli("--model", str(broken), "--baseline", demo_model_path(), "--tasks", "wikitext", "--limit", "1",
            "--data-dir", str(DATA), "--output-json", str(report), "--no-progress")
    assert r.exit_code == 1, r.output
    assert "regression gate failed: wikitext" in " ".join(r.output.split())
    data = json.loads(report.read_text())
    assert not data["gate"]["passed"] and data["models"][1]["tasks"]["wikitext"]["metrics"]["token_perplexity"] is None


def test_perplexity_beyond_float_range_is_inf():
    m = perplexity.perplexity_metrics([-1e6], [100], [20], [400])
    assert m["token_perplexity"] == m["word_perplexity"] == m["byte_perplexity"] == math.inf
    assert m["bits_per_byte"] == pytest.approx(1e6 / 400 / math.log(2))


def test_gate_scores_both_models_in_one_window(tmp_path):
    """The candidate takes 128 positions, the baseline 512: both are scored in windows of 126 tokens (the same
    samples), and a --max-length the candidate cannot take is refused before the baseline is evaluated."""
    short = tmp_path / "short"
    shutil.copytree(demo_model_path(), short)
    cfg = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 128}))
    report = tmp_path / "eval.json"
    r = cli("--model", str(short), "--baseline", demo_model_path(), "--tasks", "wikitext", "--limit", "2",
            "--data-dir", str(DATA), "--output-json", str(report), "--no-progress")
    assert r.exit_code == 0, r.output
    data = json.loads(report.read_text())
    assert [m["max_length"] for m in data["models"]] == [126, 126]
    rows = data["gate"]["rows"]
    assert rows[0]["baseline"] == rows[0]["candidate"]  # the same weights, scored alike
    r = cli("--model", str(short), "--baseline", demo_model_path(), "--tasks", "wikitext", "--max-length", "200",
            "--data-dir", str(DATA), "--no-progress")
    assert r.exit_code == 2 and "--max-length 200 is longer than both models take: at most 126" in r.output, r.output


def test_gate_refuses_different_tokenizers(tmp_path):
    other = tmp_path / "other"
    shutil.copytree(demo_model_path(), other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["▁Lily"], vocab["▁the"] = vocab["▁the"], vocab["▁Lily"]  # two pieces swap ids
    (other / "tokenizer.json").write_text(json.dumps(tok))
    r = cli("--model", str(other), "--baseline", demo_model_path(), "--tasks", "wikitext", "--data-dir", str(DATA))
    assert r.exit_code == 2 and "different tokenizers" in r.output


@pytest.mark.parametrize("args, env, message", [
    (["--tasks", "hellaswag", "--data-dir", str(DATA)], {}, "unknown task 'hellaswag'"),
    (["--tasks", "gsm8k"], {"HF_HUB_OFFLINE": "1"}, "hub is unreachable and no --data-dir"),
    (["--tasks", "wikitext"], {"HF_HUB_OFFLINE": "1"}, "hub is unreachable: pass --data-dir"),
    (["--tasks", "mmlu", "--data-dir", "/no/such/dir"], {}, "data directory /no/such/dir does not exist"),
    (["--tasks", "gsm8k", "--data-dir", str(DATA / "mmlu")], {}, "GSM8K not found"),
    (["--tasks", "mmlu", "--limit", "0", "--data-dir", str(DATA)], {}, "--limit must be at least 1"),
    (["--tasks", "mmlu", "--limit", "-3", "--data-dir", str(DATA)], {}, "--limit must be at least 1"),
    (["--tasks", "mmlu", "--max-drop", "1"], {}, "need --baseline"),
    (["--tasks", "wikitext", "--baseline", demo_model_path(), "--max-drop", "nan"], {},
     "--max-drop must be a finite number of at least 0, got nan"),
    (["--tasks", "wikitext", "--baseline", demo_model_path(), "--max-drop-rel", "-1"], {},
     "--max-drop-rel must be a finite number of at least 0, got -1.0"),
    (["--tasks", "wikitext", "--baseline", "/no/such/model", "--data-dir", str(DATA)], {},
     "model directory not found: /no/such/model"),
    (["--tasks", "/no/such/file.txt"], {}, "perplexity file /no/such/file.txt does not exist"),
    (["--tasks", "wikitext", "--data-dir", str(DATA), "--output-json", str(DATA)], {},
     f"--output-json {DATA} is a directory: name a file to write"),  # before the run, not after it
    (["--tasks", "hellaswagg"], {"HF_HUB_OFFLINE": "1"}, "unknown task 'hellaswagg'"),  # a typo, even offline
])
def test_eval_bad_input(args, env, message):
    r = cli(*args, env=env)
    assert r.exit_code == 2, r.output
    out = " ".join(r.output.split())
    assert message in out and "Traceback" not in out and len(r.output.strip().splitlines()) == 1


def test_unreadable_perplexity_files_are_one_line(tmp_path):
    import gzip

    whole = gzip.compress(b"Once upon a time there was a cat.\n" * 50)
    for name, data in (("garbage.txt.gz", b"not gzip at all"), ("cut.txt.gz", whole[:len(whole) // 2]),
                       ("latin1.txt", "caf\xe9".encode("latin-1"))):
        (tmp_path / name).write_bytes(data)
        r = cli("--tasks", str(tmp_path / name), "--no-progress")
        out = " ".join(r.output.split())
        assert r.exit_code == 2 and f"cannot read {tmp_path / name}: " in out, r.output
        assert "Traceback" not in out and len(r.output.strip().splitlines()) == 1


# ---- `--model nvllm` in lm-eval's own command line -------------------------------------------------------
def test_entry_point_declared_for_lm_eval():
    from importlib.metadata import entry_points

    eps = {ep.name: ep for ep in entry_points(group="lm_eval.models")}
    assert eps["nvllm"].load() is NvllmLM


@pytest.mark.slow
def test_lm_eval_command_line_runs_the_nvllm_backend(tmp_path):
    tasks.render(DATA, ["mmlu_management"], tmp_path)
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "nvllm.eval", "--model", "nvllm",
                        "--model_args", f"model={demo_model_path()},device=cpu,show_progress=False",
                        "--tasks", "mmlu_management", "--include_path", str(tmp_path), "--limit", "3"],
                       capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("nvllm (") and "|management|" in r.stdout and "|acc   |" in r.stdout


def test_few_shot_beyond_the_split_is_one_line(tmp_path):
    r = cli("--tasks", "mmlu_management", "--limit", "1", "--data-dir", str(DATA), "--num-fewshot", "10",
            "--no-progress")
    assert r.exit_code == 2 and "--num-fewshot 10 is more examples than a task's few-shot split holds" in r.output
    assert "Traceback" not in r.output


def test_no_git_complaint_outside_a_repository(tmp_path, monkeypatch, capfd):
    """lm-eval looks up the working directory's git commit; outside a repository that printed git's "fatal: not a
    git repository" on every `nvllm eval`. The lookup stays (None there), the complaint goes."""
    import lm_eval.evaluator

    from nvllm.eval.quiet import quiet_libraries

    quiet_libraries()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert lm_eval.evaluator.get_git_commit_hash() is None
    assert "fatal" not in capfd.readouterr().err
