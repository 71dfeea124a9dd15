"""Result files: checked before the work, written whole or not at all, with a plain file's mode."""

from __future__ import annotations

import json
import os
import stat

import pytest

from nvllm import output_file


def test_a_result_file_is_written_whole_with_a_plain_files_mode(tmp_path):
    target = tmp_path / "deep" / "r.json"
    output_file.write_json(str(target), {"a": 1.5, "path": tmp_path})  # what JSON has no type for: its text
    assert json.loads(target.read_text()) == {"a": 1.5, "path": str(tmp_path)}
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask
    assert sorted(p.name for p in target.parent.iterdir()) == ["r.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "r.json"
    target.write_text("old")
    with pytest.raises(ValueError):  # NaN is refused (callers map it to null first)
        output_file.write_json(str(target), {"x": float("nan")})
    assert target.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["r.json"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"^cannot write .*/file/r\.json: "):  # the system's refusal, as one line
        output_file.write_text(str(tmp_path / "file" / "r.json"), "{}")


@pytest.mark.parametrize("name, message", [
    ("", "--out-json is empty: name the file to write"),
    ("  ", "--out-json is empty"),
    (".", "--out-json . is a directory: name a file to write"),
    ("file/r.json", "is not a writable directory"),
])
def test_paths_that_cannot_take_a_result_are_refused(tmp_path, monkeypatch, name, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=message):
        output_file.check_output_file(name, "--out-json")
    output_file.check_output_file("new/r.json", "--out-json")  # a file in folders still to be made is fine
