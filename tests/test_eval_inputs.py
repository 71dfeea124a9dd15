"""`nvllm eval`'s local data files: MMLU without its dev split, malformed GSM8K files, which C4 shard is scored, and
JSON documents as JSON lines or a JSON array. Bad data is one line naming the file (and line), exit 2."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from nvllm.eval import perplexity, tasks  # noqa: E402
from tests.test_eval import DATA, cli  # noqa: E402

GSM8K_ROWS = [json.loads(x) for x in (DATA / "gsm8k" / "test.jsonl").read_text().splitlines()]


def one_line_error(r, message: str) -> None:
    out = " ".join(r.output.split())
    assert r.exit_code == 2 and message in out, r.output
    assert "Traceback" not in out and len(r.output.strip().splitlines()) == 1, r.output


# ---- MMLU ----------------------------------------------------------------------------------------------------
def test_mmlu_zero_shot_needs_no_dev_split(tmp_path):
    """test/ CSVs only: 0-shot runs (no empty dev split for `datasets` to refuse); few-shot still says what it needs."""
    (tmp_path / "mmlu" / "test").mkdir(parents=True)
    shutil.copy(DATA / "mmlu" / "test" / "sociology_test.csv", tmp_path / "mmlu" / "test")
    report = tmp_path / "eval.json"
    r = cli("--tasks", "mmlu", "--limit", "2", "--data-dir", str(tmp_path), "--output-json", str(report),
            "--no-progress")
    assert r.exit_code == 0, r.output
    assert json.loads(report.read_text())["models"][0]["tasks"]["mmlu"]["n_samples"] == 2
    one_line_error(cli("--tasks", "mmlu", "--num-fewshot", "1", "--data-dir", str(tmp_path), "--no-progress"),
                   f"MMLU 1-shot needs the dev questions of {tmp_path / 'mmlu' / 'dev' / 'sociology_dev.csv'}")


def test_unreadable_mmlu_csv_is_one_line(tmp_path):
    (tmp_path / "mmlu" / "test").mkdir(parents=True)
    bad = tmp_path / "mmlu" / "test" / "sociology_test.csv"
    bad.write_bytes("caf\xe9,a,b,c,d,A\n".encode("latin-1"))
    one_line_error(cli("--tasks", "mmlu", "--data-dir", str(tmp_path), "--no-progress"), f"cannot read {bad}: ")


# ---- GSM8K ---------------------------------------------------------------------------------------------------
def write_gsm8k(root: Path, test: str, train: str | None = None) -> Path:
    (root / "gsm8k").mkdir(parents=True)
    (root / "gsm8k" / "test.jsonl").write_text(test)
    if train is not None:
        (root / "gsm8k" / "train.jsonl").write_text(train)
    return root / "gsm8k"


GOOD = "".join(json.dumps(r) + "\n" for r in GSM8K_ROWS[:2])


@pytest.mark.parametrize("test, train, where, message", [
    (GOOD + '{"question": "broken\n', GOOD, "test.jsonl:3", "not valid JSON (Unterminated string"),
    ('{"q": "x", "a": "y"}\n', GOOD, "test.jsonl:1",
     'expected "question" and "answer" fields holding text (GSM8K\'s format), got q, a'),
    (GOOD, GOOD + '{"q": "x", "a": "y"}\n', "train.jsonl:3", 'expected "question" and "answer" fields'),
    (GOOD, '["question"]\n["answer"]\n', "train.jsonl:1", "expected a JSON object, got list"),
    ('{"question": "x", "answer": 18}\n', GOOD, "test.jsonl:1", "got question, answer (int)"),
    ("\n", GOOD, "test.jsonl", "holds no questions"),
])
def test_malformed_gsm8k_is_one_line_naming_file_and_line(tmp_path, test, train, where, message):
    folder = write_gsm8k(tmp_path, test, train)
    r = cli("--tasks", "gsm8k", "--data-dir", str(tmp_path), "--no-progress")
    one_line_error(r, f"{folder}/{where}")
    assert message in " ".join(r.output.split())


def test_gsm8k_as_a_json_array_gives_the_same_documents(tmp_path):
    (tmp_path / "test.jsonl").write_text(json.dumps(GSM8K_ROWS, indent=2))
    assert tasks.read_gsm8k(tmp_path / "test.jsonl") == tasks.read_gsm8k(DATA / "gsm8k" / "test.jsonl")


# ---- perplexity documents ---------------------------------------------------------------------------------------
def test_c4_scores_the_validation_shard_and_says_so(tmp_path):
    folder = tmp_path / "c4"
    folder.mkdir()
    for name, text in (("c4-train.00000-of-01024.json.gz", "Training text the model saw."),
                       ("c4-validation.00000-of-00008.json.gz", "Once upon a time there was a cat.")):
        (folder / name).write_bytes(gzip.compress((json.dumps({"text": text, "url": "u"}) + "\n").encode()))
    corpus = perplexity.load_corpus("c4", tmp_path)
    assert Path(corpus.source).name.startswith("c4-validation") and corpus.raw == ["Once upon a time there was a cat."]
    r = cli("--tasks", "c4", "--data-dir", str(tmp_path), "--no-progress")
    assert r.exit_code == 0, r.output
    assert f"c4: scored {folder / 'c4-validation.00000-of-00008.json.gz'}" in "".join(r.output.split("\n"))


def test_json_documents_as_lines_or_a_pretty_printed_array(tmp_path):
    docs = [{"text": "Once upon a time there was a cat."}, {"text": "Lily liked to play."}]
    files = {"compact.json": json.dumps(docs), "pretty.json": json.dumps(docs, indent=2),
             "lines.jsonl": "".join(json.dumps(d) + "\n" for d in docs)}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        assert perplexity.load_corpus(str(tmp_path / name), None).raw == [d["text"] for d in docs], name


@pytest.mark.parametrize("name, text, message", [
    ("broken.json", '[\n  {"text": "a"},\n  {"text": "b"\n]\n', "broken.json:4: not valid JSON"),
    ("notext.jsonl", '{"text": "a"}\n{"body": "b"}\n', 'notext.jsonl:2: expected "text" field holding text'),
    ("items.json", '[{"text": "a"}, "b"]', "items.json: item 2: expected a JSON object, got str"),
    ("empty.json", '[{"text": " "}]', "empty.json holds no documents"),
])
def test_malformed_json_documents_are_one_line(tmp_path, name, text, message):
    (tmp_path / name).write_text(text)
    one_line_error(cli("--tasks", str(tmp_path / name), "--no-progress"), message)
