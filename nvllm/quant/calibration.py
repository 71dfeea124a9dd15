"""Calibration data: text (or conversations) from C4, the sample shipped in calib/, other Hub datasets or local files,
cut into seeded random windows of ``seqlen`` tokens.

Sources
  ``c4``       allenai/c4 (en, validation shard 0) through the ``datasets`` package when it is installed and the
               Hugging Face Hub answers; otherwise the shipped sample, and the returned note says why.
  ``calib``    the sample shipped in the repository's calib/ (150 C4 documents; see calib/README.md).
  ``pileval``  mit-han-lab/pile-val-backup (validation), AutoAWQ's default calibration set.
  ``wikitext2`` Salesforce/wikitext (wikitext-2-raw-v1, train), its lines joined into one text as GPTQ's reference
               code does.
  a file       ``.jsonl`` / ``.jsonl.gz`` / ``.json.gz`` (one JSON object with a ``"text"``, ``"messages"`` or
               ShareGPT ``"conversations"`` field, or a string, per line), ``.json`` (a list of those, as ShareGPT's
               files) or ``.txt`` (the whole file is one document).
  a dataset    a Hub dataset id (``owner/name``) or a local folder, loaded by ``datasets`` (a folder
               ``save_to_disk`` wrote through ``load_from_disk``; a folder of data files as ``load_dataset`` reads it,
               its .txt files a document per line): ``split`` (default train), ``column`` (default ``text``, else
               ``messages``, else ``conversations``) and ``config`` say what to read, as AutoAWQ's ``split`` and
               ``text_column`` and llm-compressor's ``dataset_config_name``. A folder named like a named set is
               ``./NAME``.

A document is a text, or a conversation (a list of ``{"role", "content"}`` messages, as in chat datasets such as
ultrachat, or ShareGPT's ``{"from", "value"}`` turns) that the model's chat template renders, as llm-compressor
calibrates instruct models.

Windows: the documents are shuffled (seeded), tokenized without special tokens and joined (EOS after each text; a
rendered conversation ends as its template ends it) until there are enough tokens; each sample is a window
starting at a seeded random offset.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import re
import zlib
from pathlib import Path
from typing import NamedTuple

import torch

from nvllm.config import first_line
from nvllm.models import hub

CALIB_DIR = Path(__file__).resolve().parents[1] / "assets" / "calib"  # the repository's calib/, in the package
SHIPPED_SAMPLE = CALIB_DIR / "c4-sample.jsonl"
C4_REPO = "allenai/c4"
C4_FILE = "en/c4-validation.00000-of-00008.json.gz"




class HubSet(NamedTuple):
    repo: str
    config: str | None
    split: str
    column: str
    joined: bool = False              # its rows are lines of one text: joined into one document
    needs: str | None = None          # a module its files need (pileval's are zstd-compressed)


# the named Hub sets besides c4 (a folder of the same name is ./NAME)
NAMED = {"pileval": HubSet("mit-han-lab/pile-val-backup", None, "validation", "text", needs="zstandard"),
         "wikitext2": HubSet("Salesforce/wikitext", "wikitext-2-raw-v1", "train", "text", joined=True)}
FILE_SUFFIXES = (".jsonl.gz", ".json.gz", ".jsonl", ".json", ".txt")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


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


# ShareGPT's speakers (its dumps name the assistant gpt, and some chatgpt, bing or bard)
SHAREGPT_ROLES = {"human": "user", "user": "user", "system": "system",
                  **dict.fromkeys(("gpt", "assistant", "chatgpt", "bing", "bard"), "assistant")}


def _is_conversation(value) -> bool:
    """A list of messages with a role each (their content, text or parts or none, is the chat template's to take)."""
    return isinstance(value, list) and bool(value) and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                           for m in value)


def _from_sharegpt(value):
    """ShareGPT's turns (``{"from": "human" | "gpt" | "system", "value"}``) as messages; None when not such."""
    turn = (lambda t: isinstance(t, dict) and t.get("from") in SHAREGPT_ROLES and isinstance(t.get("value"), str))
    if not (isinstance(value, list) and value and all(turn(t) for t in value)):
        return None
    return [{"role": SHAREGPT_ROLES[t["from"]], "content": t["value"]} for t in value]


def _conversation(value):
    """A conversation as messages (ShareGPT's turns converted), or None."""
    return value if _is_conversation(value) else _from_sharegpt(value)


def _text_of(item, where: str):
    """A document: a string, an object's ``"text"``, or its ``"messages"`` / ShareGPT ``"conversations"``."""
    if isinstance(item, str):
        return item
    if isinstance(item, dict):
        if isinstance(item.get("text"), str):
            return item["text"]
        for key in ("messages", "conversations"):
            conversation = _conversation(item.get(key))
            if conversation is not None:
                return conversation
    raise CalibrationError(f"{where}: expected a string or an object with a \"text\" field, \"messages\" (a list "
                           f"of {{\"role\", \"content\"}} messages) or ShareGPT's \"conversations\"")


def _blank(doc) -> bool:
    return isinstance(doc, str) and not doc.strip()


def read_texts(path: str | os.PathLike) -> list:
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
    texts = [t for t in texts if not _blank(t)]
    if not texts:
        raise CalibrationError(f"calibration file {path} holds no text")
    return texts


def _c4_texts() -> tuple[list[str] | None, str]:
    """C4 through ``datasets``, or (None, why not)."""
    try:
        import datasets
    except ImportError:
        return None, "the datasets package is not installed"
    if hub.hub_offline():
        return None, "the Hugging Face Hub is set offline"
    if not hub.hub_reachable():
        return None, "the Hugging Face Hub is not reachable"
    try:
        ds = datasets.load_dataset(C4_REPO, data_files={"validation": C4_FILE}, split="validation")
    except Exception as e:  # network, auth, disk: all mean "use the shipped sample"
        return None, f"loading {C4_REPO} failed ({type(e).__name__}: {first_line(e)[:120]})"
    return list(ds["text"]), ""


def _load_dataset(name: str, config: str | None, split: str, needs: str | None = None):
    """A ``datasets`` Dataset: a folder ``save_to_disk`` wrote, a folder of data files, or a Hub id."""
    try:
        import datasets
    except ImportError:
        raise CalibrationError(f"--calib-dataset {name} is read through the datasets package, which is not "
                               f"installed: pip install 'nvllm[quant]' (or use calib or a local file)") from None
    folder = Path(name)
    if folder.is_dir() and any((folder / f).is_file() for f in ("state.json", "dataset_dict.json")):
        try:
            ds = datasets.load_from_disk(str(folder))
        except Exception as e:  # noqa: BLE001 - a damaged folder: one line
            raise CalibrationError(f"cannot load calibration dataset {name}: {type(e).__name__}: "
                                   f"{first_line(e)[:200]}") from None
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise CalibrationError(f"calibration dataset {name} has no split {split!r} (it has "
                                       f"{', '.join(ds)}): pass --calib-split")
            ds = ds[split]
        return ds
    if needs is not None and importlib.util.find_spec(needs) is None:
        raise CalibrationError(f"--calib-dataset {name}: its files need the {needs} package: pip install {needs}")
    if not folder.is_dir() and not hub.hub_offline() and not hub.hub_reachable():  # not half a minute of retries
        raise CalibrationError(f"cannot load calibration dataset {name}: not a local file or folder, and the "
                               f"Hugging Face Hub is not reachable (with HF_HUB_OFFLINE=1 a copy in the datasets "
                               f"cache is used)")
    try:
        return datasets.load_dataset(name, config, split=split)
    except Exception as e:  # noqa: BLE001 - network, a missing split or config, a bad folder: one line
        where = "" if folder.is_dir() else " (not a local file or folder)"
        raise CalibrationError(f"cannot load calibration dataset {name}{where}, split {split}: {type(e).__name__}: "
                               f"{first_line(e)[:200]}") from None


def _dataset_texts(name: str, config: str | None, split: str, column: str | None, joined: bool = False,
                   needs: str | None = None) -> tuple[list, str]:
    """(the documents of one column of a ``datasets`` dataset, the column read)."""
    ds = _load_dataset(name, config, split, needs)
    names = list(ds.column_names)
    if column is None:
        column = next((c for c in ("text", "messages", "conversations") if c in names), None)
        if column is None:
            raise CalibrationError(f"calibration dataset {name} has no text, messages or conversations column (it "
                                   f"has {', '.join(names)}): pass --calib-column")
    elif column not in names:
        raise CalibrationError(f"calibration dataset {name} has no column {column!r} (it has {', '.join(names)})")
    docs = []
    for i, value in enumerate(ds[column]):
        if value is None:  # a nullable column's empty rows
            continue
        doc = value if isinstance(value, str) else _conversation(value)
        if doc is None:
            raise CalibrationError(f"{name}: row {i} of {column!r} is neither text nor a conversation (a list of "
                                   f"{{\"role\", \"content\"}} messages or ShareGPT turns): {type(value).__name__} "
                                   f"{str(value)[:60]!r}")
        docs.append(doc)
    if joined:
        docs = ["\n\n".join(docs)]
    docs = [d for d in docs if not _blank(d)]
    if not docs:
        raise CalibrationError(f"calibration dataset {name} (split {split}, column {column!r}) holds no text")
    return docs, column


def load_texts(source: str, split: str | None = None, column: str | None = None,
               config: str | None = None) -> tuple[list, str]:
    """(documents, a line saying where they came from) for ``c4``, ``calib``, ``pileval``, ``wikitext2``, a file, a
    dataset folder or a Hub dataset id. ``split`` / ``column`` / ``config``: which part of a dataset (named sets:
    their own unless given)."""
    if not source.strip():
        raise CalibrationError("--calib-dataset is empty: name c4, calib, pileval, wikitext2, a file, a dataset "
                               "folder or a Hub dataset id")
    path = Path(source)
    hub_id = not path.exists() and not source.lower().endswith(FILE_SUFFIXES) and ".." not in source and \
        HUB_ID.fullmatch(source) is not None
    dataset = source in NAMED or (source not in ("c4", "calib") and (path.is_dir() or hub_id))
    if (split, column, config) != (None, None, None) and not dataset:
        raise CalibrationError(f"--calib-split, --calib-column and --calib-config choose the part of a dataset "
                               f"(pileval, wikitext2, a Hub id or a dataset folder), not of {source}")
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
    if dataset:
        named = NAMED.get(source)
        name, joined, needs = (named.repo, named.joined, named.needs) if named else (source, False, None)
        config = config or (named.config if named else None)
        split = split or (named.split if named else "train")
        docs, column = _dataset_texts(name, config, split, column or (named.column if named else None), joined, needs)
        return docs, f"{name}{f' ({config})' if config else ''}, split {split}, column {column} via datasets"
    return read_texts(source), f"{source}"


def render(tokenizer, doc) -> str:
    """A document's text: a conversation through the tokenizer's chat template, as the server renders chats
    (``nvllm.chat_template.render_chat``), without a generation prompt."""
    from nvllm.chat_template import ChatTemplateError, render_chat

    if isinstance(doc, str):
        return doc
    if not getattr(tokenizer, "chat_template", None):
        raise CalibrationError("the calibration data holds conversations (messages), but the model's tokenizer has "
                               "no chat template to render them: use a text column or file")
    try:
        return render_chat(tokenizer, tokenizer.chat_template, doc, add_generation_prompt=False)
    except ChatTemplateError as e:  # a template that refuses the conversation (roles out of order, …)
        raise CalibrationError(f"a calibration conversation: {first_line(e)[:200]}") from None


def calibration_windows(tokenizer, texts: list, n_samples: int, seqlen: int, seed: int,
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
        doc = texts[k]  # a rendered conversation ends as its template ends it: no EOS after it
        ids.extend(tokenizer(render(tokenizer, doc), add_special_tokens=False, verbose=False)["input_ids"] +
                   (sep if isinstance(doc, str) else []))
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
