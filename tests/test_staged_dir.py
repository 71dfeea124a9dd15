"""An output directory is whole or absent (``nvllm/quant/staged_dir.py``), also when the run that wrote it was
killed outright, when its parents did not exist, and when an existing output was being replaced."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys

import pytest

import nvllm.quant.quantize as Q
import nvllm.quant.staged_dir as S
from nvllm.quant.recipe import build_config
from nvllm.quant.writer import OutputExistsError
from tests.conftest import REPO, build_tiny_model

FAST = ["--method", "rtn", "--group-size", "32", "--calib-dataset", "calib", "--calib-samples", "2",
        "--calib-seqlen", "32", "--no-progress", "--max-shard-size", "20KB"]

_SIGNAL_AT_LAYER_ONE = """
import os, signal, sys
import nvllm.quant.sequential as seq
from nvllm.cli import app

sig = int(sys.argv.pop(1))
original = seq.quantize_layers

def quantize_layers(*a, progress=None, **kw):
    def at(layer, stage):
        if layer == 1:   # layer 0 is written by now (20KB shards)
            os.kill(os.getpid(), sig)
        if progress is not None:
            progress(layer, stage)
    return original(*a, progress=at, **kw)

import nvllm.quant.quantize as q
q.quantize_layers = quantize_layers
app(sys.argv[1:])
"""


def _quantize_with_signal(sig: int, src, out) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _SIGNAL_AT_LAYER_ONE, str(int(sig)), "quantize", "--model", str(src),
                           "--out", str(out), *FAST], capture_output=True, text=True, timeout=300, cwd=str(REPO))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_killed_run_is_cleaned_up_by_the_next(tmp_path, caplog):
    """SIGKILL (or the out-of-memory killer) runs no clean-up: the staging directory, with its shards, stays. The
    next run writing the same output on this host removes it, says so, and writes the output."""
    src = build_tiny_model("llama", tmp_path / "m", num_hidden_layers=3)
    out = tmp_path / "out" / "q"
    proc = _quantize_with_signal(signal.SIGKILL, src, out)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    left = list((tmp_path / "out").iterdir())
    assert len(left) == 1 and left[0].name.startswith(".q.partial-") and any(left[0].glob("shard-*.partial"))
    assert not out.exists()
    cfg = build_config(None, method="rtn", group_size=32, calib_dataset="calib", calib_samples=2, calib_seqlen=32)
    with caplog.at_level("WARNING"):
        Q.quantize_model(str(src), str(out), cfg)
    assert f"removing {left[0]}: left by an earlier run writing {out} that was killed" in caplog.text
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["q"] and (out / "config.json").is_file()
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask      # as mkdir would make it, not the staging 0700
    assert {stat.S_IMODE(f.stat().st_mode) for f in out.iterdir()} == {0o666 & ~umask}


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM], ids=["SIGHUP", "SIGTERM"])
def test_a_signal_midway_leaves_nothing_not_even_the_parents(tmp_path, sig):
    """The terminal closed (SIGHUP) or a scheduler's stop (SIGTERM) after the first layer's shards were written:
    the command ends through its clean-up (exit 128 + the signal), and the parent directories it made go too."""
    src = build_tiny_model("llama", tmp_path / "m", num_hidden_layers=3)
    proc = _quantize_with_signal(sig, src, tmp_path / "new" / "sub" / "q")
    assert proc.returncode == 128 + sig, proc.stdout + proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["m"]


def test_what_is_not_stale_stays(tmp_path, monkeypatch):
    """Only this host's leftovers of processes that have ended are removed: not those of a running process, of
    another host, of another output, nor what does not follow the naming."""
    monkeypatch.setattr(S, "_host", lambda: "box-1")
    out = tmp_path / "q"
    out.mkdir()       # so the set-aside leftover is deleted, not put back
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        dead = _dead_pid()
        names = {f".q.partial-box-1-{dead}-0a1b2c3d": False, f".q.old-box-1-{dead}-00ff00ff": False,
                 f".q.partial-box-1-{running.pid}-0a1b2c3d": True, f".q.partial-box-2-{dead}-0a1b2c3d": True,
                 f".qq.partial-box-1-{dead}-0a1b2c3d": True, f".q.partial-box-1-{dead}-notours": True,
                 f".q.partial-box-1-{dead}": True}
        for name in names:
            (tmp_path / name).mkdir()
            (tmp_path / name / "shard-00000.partial").write_bytes(b"x")
        S.recover(out)
        staged = S.StagedDir(out)
        assert staged.path.name.startswith(f".q.partial-box-1-{os.getpid()}-")
        for name, kept in names.items():
            assert (tmp_path / name).exists() == kept, name
        staged.abort()
        assert not staged.path.exists() and tmp_path.exists()
    finally:
        running.kill()
        running.wait()


def test_replacing_an_output_stopped_between_the_renames_keeps_the_old_one(tmp_path, monkeypatch):
    """With --overwrite the old output is set aside, the new one renamed in, then the old one deleted. A stop between
    the two renames puts the old output back where it was; one after them leaves the new one and no leftovers."""
    out = tmp_path / "q"
    out.mkdir()
    (out / "config.json").write_text("old")
    staged = S.StagedDir(out)
    (staged.path / "config.json").write_text("new")
    real_rename, calls = os.rename, []

    def rename(a, b):
        calls.append((a, b))
        if len(calls) == 2:
            raise KeyboardInterrupt
        real_rename(a, b)

    monkeypatch.setattr(S.os, "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        staged.commit(replace=True)
    monkeypatch.setattr(S.os, "rename", real_rename)
    assert (out / "config.json").read_text() == "old"
    staged.abort()
    assert os.listdir(tmp_path) == ["q"]

    staged = S.StagedDir(out)
    (staged.path / "config.json").write_text("new")
    with pytest.raises(FileExistsError):
        staged.commit()
    staged.commit(replace=True)
    assert (out / "config.json").read_text() == "new" and os.listdir(tmp_path) == ["q"]


def test_an_output_set_aside_by_a_killed_replacement_is_put_back(tmp_path, caplog):
    """SIGKILL between the two renames of --overwrite: the old output is hidden and nothing is in its place. The next
    run puts it back (and then, without --overwrite, refuses to replace it, as for any existing output)."""
    out = tmp_path / "q"
    hidden = tmp_path / f".q.old-{S._host()}-{_dead_pid()}-0a1b2c3d"
    hidden.mkdir()
    (hidden / "config.json").write_text("old")
    src = build_tiny_model("llama", tmp_path / "m")
    cfg = build_config(None, method="rtn", group_size=32, calib_dataset="calib", calib_samples=2, calib_seqlen=32)
    with caplog.at_level("WARNING"), pytest.raises(OutputExistsError, match="already exists"):
        Q.quantize_model(str(src), str(out), cfg)
    assert f"restoring {out} from {hidden}" in caplog.text
    assert (out / "config.json").read_text() == "old" and sorted(os.listdir(tmp_path)) == ["m", "q"]
