"""Reading local data files for `nvllm eval` (GSM8K's JSON lines, C4 shards, perplexity texts and documents), with
errors of one line that name the file, and the line where there is one.

JSON data is read as the `datasets` JSON loader reads it: JSON lines (one object a line), or one JSON array of
objects, compact or pretty-printed.
"""

from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path
from typing import Any

from nvllm.config import first_line


class DataError(ValueError):
    """Local data missing or malformed (one clear line)."""


def read_text(path: Path) -> str:
    """A file's text (UTF-8; a .gz file decompressed)."""
    try:
        data = path.read_bytes()
        return (gzip.decompress(data) if path.suffix == ".gz" else data).decode("utf-8")
    except (OSError, EOFError, zlib.error, UnicodeDecodeError) as e:  # EOFError: a cut .gz
        raise DataError(f"cannot read {path}: {first_line(e)}") from None


def read_records(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """The objects of a JSON lines file or of a JSON array, each with where it is: ("FILE:LINE", object) for JSON
    lines, ("FILE: item N", object) for an array."""
    text = read_text(path)
    items = _array(text, path)
    if items is not None:
        return [(f"{path}: item {i}", _object(item, f"{path}: item {i}")) for i, item in enumerate(items, start=1)]
    records = []
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not valid JSON ({e.msg}, column {e.colno})") from None
        records.append((where, _object(value, where)))
    return records


def _array(text: str, path: Path) -> list | None:
    """The items of a file holding one JSON array; None for JSON lines (whose first line may be an array too)."""
    if not text.lstrip().startswith("["):
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        try:
            json.loads(text.lstrip().splitlines()[0])
        except json.JSONDecodeError:  # not JSON lines either: a broken array
            raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg}, column {e.colno})") from None
        return None
    return value if isinstance(value, list) else None


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def text_fields(record: dict[str, Any], where: str, keys: tuple[str, ...], kind: str) -> dict[str, str]:
    """{key: text} of a record that must hold every one of ``keys`` as text (``kind``: what the file is, for the
    error)."""
    if all(isinstance(record.get(k), str) for k in keys):
        return {k: record[k] for k in keys}
    names = " and ".join(f'"{k}"' for k in keys)
    got = ", ".join(f"{k} ({type(v).__name__})" if k in keys and not isinstance(v, str) else k
                    for k, v in record.items()) or "no fields"
    raise DataError(f"{where}: expected {names} field{'s' if len(keys) > 1 else ''} holding text ({kind}), got {got}")
