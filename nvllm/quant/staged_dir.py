"""An output directory built beside its final place and renamed into it when complete, so that a run that stops
leaves either the whole output or nothing.

- The staging directory is a hidden sibling, ``.{name}.partial-{host}-{pid}-{random}``. A run that ends through
  Python (an exception, Ctrl-C, SIGTERM/SIGHUP in the CLI) deletes it, and the parent directories it created.
- A run killed outright (SIGKILL, the out-of-memory killer, a power cut) cannot; its staging directory names the
  host and the process, so the next run writing the same output on that host deletes it once that process is
  gone, and says so (``recover``). An output it had set aside to replace it and not yet deleted is put back when
  nothing took its place.
- An existing output is replaced only by ``commit(replace=True)``: it is renamed aside, the new one renamed in,
  then the old one deleted; a stop between the two renames puts the old one back.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import secrets
import shutil
import socket
from pathlib import Path

logger = logging.getLogger("nvllm")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname())[:64] or "host"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True     # another user's process (or a pid this system cannot name): not ours to judge
    return True


def _sibling(out: Path, kind: str) -> Path:
    return out.parent / f".{out.name}.{kind}-{_host()}-{os.getpid()}-{secrets.token_hex(4)}"


def stale_siblings(out: Path) -> list[Path]:
    """Staging and set-aside directories of ``out`` left on this host by processes that are no longer running."""
    stale = []
    for kind in ("partial", "old"):
        prefix = f".{out.name}.{kind}-{_host()}-"
        for p in out.parent.glob(f"{glob.escape(prefix)}*"):
            m = re.fullmatch(r"(\d+)-[0-9a-f]+", p.name[len(prefix):])
            if m and p.is_dir() and not p.is_symlink() and not _alive(int(m.group(1))):
                stale.append(p)
    return sorted(stale)


def recover(out: str | Path) -> None:
    """Tidy what runs killed outright left beside ``out`` on this host: an output set aside for a replacement that
    never arrived is renamed back; every other leftover is deleted."""
    out = Path(out).resolve()
    if not out.parent.is_dir():
        return
    for p in stale_siblings(out):
        if p.name.startswith(f".{out.name}.old-") and not os.path.lexists(out):
            logger.warning("restoring %s from %s: a run replacing it was killed", out, p)
            os.rename(p, out)
        else:
            logger.warning("removing %s: left by an earlier run writing %s that was killed", p, out)
            shutil.rmtree(p, ignore_errors=True)


class StagedDir:
    """``path``: the staging directory to fill (with the mode the umask gives, which the output keeps); ``commit``
    renames it to ``out``; ``abort`` deletes it (and the parents ``__init__`` created). Run ``recover`` on ``out``
    first (``writer.check_out_dir`` does)."""

    def __init__(self, out: str | Path):
        self.out = Path(out).resolve()
        self.created: list[Path] = []       # parents made for the output, outermost first
        p = self.out.parent
        while not p.exists():
            self.created.insert(0, p)
            p = p.parent
        self.out.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.path = _sibling(self.out, "partial")
            self.path.mkdir()
        except BaseException:
            self._remove_parents()
            raise

    def commit(self, replace: bool = False) -> None:
        """Rename the staging directory to ``out``; an existing ``out`` is replaced only with ``replace``
        (FileExistsError otherwise)."""
        out = self.out
        if not os.path.lexists(out):
            os.rename(self.path, out)
            return
        if not replace:
            raise FileExistsError(f"{out} appeared while the output was being written")
        old = _sibling(out, "old")
        try:
            os.rename(out, old)
            os.rename(self.path, out)
        except BaseException:
            if old.exists() and not os.path.lexists(out):
                os.rename(old, out)
            raise
        shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        self._remove_parents()

    def _remove_parents(self) -> None:
        for p in reversed(self.created):     # innermost first; one that holds something else now stays
            try:
                p.rmdir()
            except OSError:
                break
