"""What an installed wheel holds: every data file the code reads lies inside the nvllm package and is matched by the
package data pyproject.toml declares (a file outside it, as the calibration sample once was, is missing from every
non-editable install)."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest

import nvllm
from nvllm.assets import demo_model_path
from nvllm.quant.calibration import CALIB_DIR
from nvllm.quant.recipe import RECIPES_DIR
from tests.conftest import REPO

PACKAGE = Path(nvllm.__file__).parent


def declared_package_data() -> dict[str, list[str]]:
    tomllib = pytest.importorskip("tomllib")
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["package-data"]


def shipped(path: Path, package_data: dict[str, list[str]]) -> bool:
    """Whether setuptools puts ``path`` (under the nvllm package, links not followed) in the wheel."""
    rel = path.relative_to(PACKAGE.parent)  # ValueError: outside the package
    for package, patterns in package_data.items():
        root = Path(*package.split("."))
        if root in rel.parents and any(fnmatch.fnmatch(str(rel.relative_to(root)), p) for p in patterns):
            return True
    return False


def test_the_data_files_the_code_reads_are_package_data():
    data = declared_package_data()
    files = [CALIB_DIR / "c4-sample.jsonl", *RECIPES_DIR.glob("*.yaml"), *Path(demo_model_path()).iterdir(),
             *(PACKAGE / "kernels" / "configs").glob("*.json"), *(PACKAGE / "eval" / "tasks").rglob("*.yaml")]
    assert len(list(RECIPES_DIR.glob("*.yaml"))) >= 6
    for f in files:
        assert f.is_file(), f
        assert PACKAGE in Path(str(f)).parents, f"{f} lies outside the package: no wheel has it"
        assert shipped(Path(str(f)), data), f"{f} is matched by no package-data pattern"
    # the package's calib/ and recipes/ are the repository's own (links), not copies that could drift
    assert CALIB_DIR.resolve() == (REPO / "calib").resolve() and RECIPES_DIR.resolve() == (REPO / "recipes").resolve()
