"""Local task configs: lm-eval's gsm8k and mmlu, reading files in their published formats instead of the hub.

`render(data_dir, names, out_dir, num_fewshot)` writes the task YAMLs (from the templates in this folder) and
the documents they read into `out_dir`, for `TaskManager(include_path=out_dir, include_defaults=False)`.

Where the files are looked for under `--data-dir DIR`:
  gsm8k   DIR/gsm8k/test.jsonl (+ train.jsonl, the few-shot pool), or DIR/test.jsonl: {"question", "answer"}
          records (JSON lines or a JSON array), checked and copied, so that a malformed file is one line naming it
  mmlu    DIR/mmlu_final_hf, DIR/mmlu, DIR/data or DIR itself, holding test/<subject>_test.csv and
          dev/<subject>_dev.csv (needed for few-shot only), with a header row (question,choice0..3,answer as 0-3)
          or without one (question, A, B, C, D, answer letter: the original release)
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import yaml

from nvllm.eval.datafiles import DataError, read_records, read_text, text_fields

HERE = Path(__file__).resolve().parent
MMLU_SUBJECTS: dict[str, list[str]] = yaml.safe_load((HERE / "mmlu" / "subjects.yaml").read_text())
SUBJECT_CATEGORY = {s: c for c, subjects in MMLU_SUBJECTS.items() for s in subjects}
MMLU_NAMES = {"mmlu", *(f"mmlu_{c}" for c in MMLU_SUBJECTS), *(f"mmlu_{s}" for s in SUBJECT_CATEGORY)}
LOCAL_TASKS = {"gsm8k", *MMLU_NAMES}
_LETTERS = "ABCD"


# ---- finding the files ---------------------------------------------------------------------------------
def find_gsm8k(data_dir: Path) -> tuple[Path, Path | None]:
    for folder in (data_dir / "gsm8k", data_dir):
        if (folder / "test.jsonl").is_file():
            train = folder / "train.jsonl"
            return folder / "test.jsonl", train if train.is_file() else None
    raise DataError(f"GSM8K not found: expected {data_dir / 'gsm8k' / 'test.jsonl'}")


def read_gsm8k(path: Path) -> list[dict]:
    """The {question, answer} documents of a GSM8K file."""
    return [text_fields(r, where, ("question", "answer"), "GSM8K's format") for where, r in read_records(path)]


def find_mmlu(data_dir: Path) -> Path:
    for folder in (data_dir / "mmlu_final_hf", data_dir / "mmlu", data_dir / "data", data_dir):
        if any((folder / "test").glob("*_test.csv")):
            return folder
    raise DataError(f"MMLU not found: expected {data_dir / 'mmlu' / 'test' / '<subject>_test.csv'}")


def read_mmlu_csv(path: Path) -> list[dict]:
    """One MMLU CSV as the hub's schema {question, choices[4], answer 0-3}; a header row is detected by its
    answer column not holding an answer."""
    rows = [r for r in csv.reader(io.StringIO(read_text(path), newline="")) if r]
    if not rows:
        return []
    header = rows[0][-1].strip() not in (*_LETTERS, "0", "1", "2", "3")
    cols = [c.strip().lower() for c in rows[0]] if header else []
    q = cols.index("question") if "question" in cols else 0
    a = cols.index("answer") if "answer" in cols else len(rows[0]) - 1
    docs = []
    for i, r in enumerate(rows[1:] if header else rows, start=2 if header else 1):
        if len(r) < 6:
            raise DataError(f"{path}:{i}: expected 6 columns (question, 4 choices, answer), got {len(r)}")
        choices = [r[j] for j in range(len(r)) if j not in (q, a)][:4]
        ans = r[a].strip()
        if ans in _LETTERS:
            ans = _LETTERS.index(ans)
        elif ans in ("0", "1", "2", "3"):
            ans = int(ans)
        else:
            raise DataError(f"{path}:{i}: answer {r[a]!r} is neither A-D nor 0-3")
        docs.append({"question": r[q], "subject": path.stem.rsplit("_", 1)[0], "choices": choices, "answer": ans})
    return docs


# ---- writing the configs --------------------------------------------------------------------------------
def _fill(template: str, **fields: str) -> str:
    text = (HERE / template).read_text()
    for key, value in fields.items():
        text = text.replace(f"__{key}__", value)
    return text


def _jsonl(path: Path, docs: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    return str(path)


def mmlu_subjects_for(names: list[str], available: set[str]) -> list[str]:
    wanted: list[str] = []
    for name in names:
        if name == "mmlu":
            wanted += list(SUBJECT_CATEGORY)
        elif name[5:] in MMLU_SUBJECTS:
            wanted += MMLU_SUBJECTS[name[5:]]
        else:
            wanted.append(name[5:])
    missing = [s for s in wanted if s not in available]
    explicit = [n for n in names if n[5:] in missing]
    if explicit:
        raise DataError(f"MMLU subject {explicit[0][5:]!r} has no test CSV in the data directory")
    present = [s for s in dict.fromkeys(wanted) if s in available]
    if not present:
        raise DataError("no MMLU subject of the requested tasks has a test CSV in the data directory")
    return present


def render(data_dir: str | Path, names: list[str], out_dir: Path, num_fewshot: int | None = None) -> dict:
    """Write configs for the requested local task names; returns {name: note} about the data used."""
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"data directory {data_dir} does not exist")
    cache = json.dumps(str(out_dir / "hf_cache"))
    notes: dict[str, str] = {}
    if "gsm8k" in names:
        test, train = find_gsm8k(data_dir)
        test_docs, train_docs = read_gsm8k(test), read_gsm8k(train) if train else []
        if not test_docs:
            raise DataError(f"{test} holds no questions")
        shots = 5 if num_fewshot is None else num_fewshot
        if not train_docs and shots > 0:
            raise DataError(f"GSM8K {shots}-shot needs the few-shot pool {test.parent / 'train.jsonl'}")
        files = {"test": _jsonl(out_dir / "gsm8k" / "test.jsonl", test_docs),
                 **({"train": _jsonl(out_dir / "gsm8k" / "train.jsonl", train_docs)} if train_docs else {})}
        (out_dir / "gsm8k.yaml").write_text(_fill("gsm8k.yaml", DATA_FILES=json.dumps(files), CACHE_DIR=cache,
                                                  TRAIN_SPLIT="train" if train_docs else "null"))
        notes["gsm8k"] = str(test)
    mmlu_names = [n for n in names if n in MMLU_NAMES]
    if mmlu_names:
        root = find_mmlu(data_dir)
        available = {p.name[:-len("_test.csv")] for p in (root / "test").glob("*_test.csv")}
        subjects = mmlu_subjects_for(mmlu_names, available)
        folder = out_dir / "mmlu"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "_default_template_yaml").write_text((HERE / "mmlu" / "_default_template_yaml").read_text())
        for s in subjects:
            dev = root / "dev" / f"{s}_dev.csv"
            dev_docs = read_mmlu_csv(dev) if dev.is_file() else []
            if not dev_docs and num_fewshot:
                raise DataError(f"MMLU {num_fewshot}-shot needs the dev questions of {dev}")
            test_docs = read_mmlu_csv(root / "test" / f"{s}_test.csv")
            if not test_docs:
                raise DataError(f"{root / 'test' / f'{s}_test.csv'} holds no questions")
            files = {"test": _jsonl(folder / "data" / f"{s}_test.jsonl", test_docs),  # no dev split at 0-shot
                     **({"dev": _jsonl(folder / "data" / f"{s}_dev.jsonl", dev_docs)} if dev_docs else {})}
            desc = f"The following are multiple choice questions (with answers) about {s.replace('_', ' ')}.\n\n"
            (folder / f"mmlu_{s}.yaml").write_text(_fill(
                "mmlu/_subject.yaml", SUBJECT=s, CATEGORY=SUBJECT_CATEGORY.get(s, "other"),
                DESCRIPTION=json.dumps(desc), DATA_FILES=json.dumps(files), CACHE_DIR=cache,
                FEWSHOT_SPLIT="dev" if dev_docs else "null"))
        categories = [c for c in MMLU_SUBJECTS if any(SUBJECT_CATEGORY.get(s) == c for s in subjects)]
        for c in categories:
            (folder / f"_mmlu_{c}.yaml").write_text(_fill("mmlu/_category.yaml", CATEGORY=c))
        (folder / "_mmlu.yaml").write_text(_fill("mmlu/_mmlu.yaml",
                                                 CATEGORIES=json.dumps([f"mmlu_{c}" for c in categories])))
        notes["mmlu"] = f"{root} ({len(subjects)} of {len(SUBJECT_CATEGORY)} subjects)"
    return notes
