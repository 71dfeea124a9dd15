"""Calibration data: text from C4 (or the sample shipped in calib/, or a local file), cut into seeded random
windows of ``seqlen`` tokens.

Sources
  ``c4``     allenai/c4 (en, validation shard 0) through the ``datasets`` package when it is installed and the
             Hugging Face Hub answers; otherwise the shipped sample, and the returned note says why.
  ``calib``  the sample shipped in the repository's calib/ (150 C4 documents; see calib/README.md).
  a path     ``.jsonl`` / ``.jsonl.gz`` / ``.json.gz`` (one JSON object with a ``"text"`` field, or a string,
             per line), ``.json`` (a list of those) or ``.txt`` (the whole file is one document).

Windows: the documents are shuffled (seeded), tokenized without special tokens and joined (EOS between
documents) until there are enough tokens; each sample is a window starting at a seeded random offset.
"""

from __future__ import annotations

import gzip
import json
import os
import socket
import zlib
from pathlib import Path

import torch

from nvllm.config import first_line

CALIB_DIR = Path(__file__).resolve().parents[2] / "calib"
SHIPPED_SAMPLE = CALIB_DIR / "c4-sample.jsonl"
C4_REPO = "allenai/c4"
C4_FILE = "en/c4-validation.00000-of-00008.json.gz"


class CalibrationError(ValueError):
    """Calibration data that cannot be read or is too short (one clear line)."""


def _texts_from_lines(lines, where: str) -> list[str]:
    texts = []
    for n, line in enumerate(lines, 1):
        line = line.strip()
        if not line:
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise CalibrationError(f"{where}: line {n} is not JSON ({e.msg})") from e
        texts.append(_text_of(item, f"{where}: line {n}"))
    return texts


def _text_of(item, where: str) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, dict) and isinstance(item.get("text"), str):
        return item["text"]
    raise CalibrationError(f"{where}: expected a string or an object with a \"text\" field")


def read_texts(path: str | os.PathLike) -> list[str]:
    """Documents of a local calibration file (see the module docstring for the formats)."""
    p = Path(path)
    if not p.is_file():
        raise CalibrationError(f"calibration file not found: {path}")
    name = p.name.lower()
    try:
        if name.endswith((".jsonl.gz", ".json.gz")):
            with gzip.open(p, "rt", encoding="utf-8") as f:
                texts = _texts_from_lines(f, str(p))
        elif name.endswith(".jsonl"):
            with open(p, encoding="utf-8") as f:
                texts = _texts_from_lines(f, str(p))
        elif name.endswith(".json"):
            with open(p, encoding="utf-8") as f:
                data = json.load(f)
            if not isinstance(data, list):
                raise CalibrationError(f"{p}: expected a JSON list of documents")
            texts = [_text_of(item, f"{p}: item {i}") for i, item in enumerate(data)]
        elif name.endswith(".txt"):
            texts = [p.read_text(encoding="utf-8")]
        else:
            raise CalibrationError(f"unsupported calibration file {path}: use .jsonl, .jsonl.gz, .json.gz, .json "
                                   f"or .txt")
    except (OSError, EOFError, zlib.error, UnicodeDecodeError, json.JSONDecodeError) as e:  # EOFError: a cut .gz
        raise CalibrationError(f"cannot read calibration file {path}: {first_line(e)}") from e
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise CalibrationError(f"calibration file {path} holds no text")
    return texts


def _hub_reachable(timeout: float = 3.0) -> bool:
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _c4_texts() -> tuple[list[str] | None, str]:
    """C4 through ``datasets``, or (None, why not)."""
    try:
        import datasets
    except ImportError:
        return None, "the datasets package is not installed"
    if os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1":
        return None, "the Hugging Face Hub is set offline"
    if not _hub_reachable():
        return None, "huggingface.co is not reachable"
    try:
        ds = datasets.load_dataset(C4_REPO, data_files={"validation": C4_FILE}, split="validation")
    except Exception as e:  # network, auth, disk: all mean "use the shipped sample"
        return None, f"loading {C4_REPO} failed ({type(e).__name__}: {first_line(e)[:120]})"
    return list(ds["text"]), ""


def load_texts(source: str) -> tuple[list[str], str]:
    """(documents, a line saying where they came from) for ``c4``, ``calib`` or a file path."""
    if source == "c4":
        texts, why = _c4_texts()
        if texts is not None:
            return texts, f"{C4_REPO} ({C4_FILE}) via datasets"
        if not SHIPPED_SAMPLE.is_file():
            raise CalibrationError(f"c4 is unavailable ({why}) and the shipped sample {SHIPPED_SAMPLE} is missing")
        return read_texts(SHIPPED_SAMPLE), f"c4 unavailable ({why}): using the shipped sample {SHIPPED_SAMPLE}"
    if source == "calib":
        if not SHIPPED_SAMPLE.is_file():
            raise CalibrationError(f"the shipped calibration sample {SHIPPED_SAMPLE} is missing (run from a "
                                   f"source checkout, or pass a file path)")
        return read_texts(SHIPPED_SAMPLE), f"the shipped C4 sample {SHIPPED_SAMPLE}"
    return read_texts(source), f"{source}"


def calibration_windows(tokenizer, texts: list[str], n_samples: int, seqlen: int, seed: int,
                        notes: list[str] | None = None) -> torch.Tensor:
    """``[n_samples, seqlen]`` token ids: seeded random windows over the shuffled, concatenated documents.
    When the text is shorter than ``n_samples · seqlen`` tokens the windows overlap; ``notes`` gets a line
    saying so."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(texts), generator=gen).tolist()
    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    want = n_samples * seqlen + seqlen
    ids: list[int] = []
    for k in order:
        ids.extend(tokenizer(texts[k], add_special_tokens=False, verbose=False)["input_ids"] + sep)
        if len(ids) >= want:
            break
    if len(ids) < seqlen:
        raise CalibrationError(f"the calibration text has only {len(ids)} tokens; --calib-seqlen {seqlen} needs "
                               f"at least that many")
    if notes is not None and len(ids) < n_samples * seqlen:
        notes.append(f"the calibration text holds {len(ids)} tokens, fewer than {n_samples} × {seqlen}: the "
                     f"windows overlap (pass a larger --calib-dataset file for more variety)")
    stream = torch.tensor(ids, dtype=torch.long)
    starts = torch.randint(0, len(ids) - seqlen + 1, (n_samples,), generator=gen)
    return torch.stack([stream[s:s + seqlen] for s in starts.tolist()])
