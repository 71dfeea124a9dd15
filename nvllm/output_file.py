"""Result files the commands write (eval's --output-json, bench's --save-result, the pipeline's report): checked
before the work that fills them, so a bad path is one error line at the start rather than a traceback after an
hour, and written through a temporary file and a rename, so a file is whole or absent."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def unwritable_parent(path: str | Path) -> Path | None:
    """The nearest existing ancestor of ``path`` (where creating it would start) when that is not a writable
    directory; None when it is."""
    parent = next(p for p in Path(path).expanduser().resolve().parents if p.exists())
    return None if parent.is_dir() and os.access(parent, os.W_OK | os.X_OK) else parent


def check_output_file(path: str, flag: str) -> None:
    """ValueError when ``path`` cannot take a result file: empty, a directory, or below no writable directory."""
    if not path.strip():
        raise ValueError(f"{flag} is empty: name the file to write")
    target = Path(path).expanduser()
    if target.is_dir():
        raise ValueError(f"{flag} {path} is a directory: name a file to write")
    parent = unwritable_parent(target)
    if parent is not None:
        raise ValueError(f"{flag} {path} cannot be written: {parent} is not a writable directory")


def write_text(path: str, text: str) -> None:
    """Write ``text`` whole or not at all, with the mode a plain open() would give the file (mkstemp's 0600 would
    outlive the rename). ValueError, naming the file, when the system refuses."""
    target = Path(path).expanduser()
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, target)
    except BaseException as e:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise ValueError(f"cannot write {path}: {e.strerror or e}") from None
        raise


def write_json(path: str, data: Any) -> None:
    """``data`` as indented JSON (values JSON has no type for as their text; NaN refused: callers map it first)."""
    write_text(path, json.dumps(data, indent=2, default=str, allow_nan=False) + "\n")
