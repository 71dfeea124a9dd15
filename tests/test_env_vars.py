"""nvllm's numeric environment variables: a mistyped value is one warning and the default, never a traceback."""

import logging
import os
import subprocess
import sys

import pytest

from nvllm.env_vars import env_number


@pytest.mark.parametrize("raw, default, minimum, want, warns", [
    (None, 256, 1, 256, False), ("", 256, 1, 256, False), ("64", 256, 1, 64, False), (" 8 ", 2, 0, 8, False),
    ("0", 2, 0, 0, False), ("abc", 256, 1, 256, True), ("1.5", 256, 1, 256, True), ("-5", 512, 1, 512, True),
    ("0", 256, 1, 256, True), ("90", 600.0, 1.0, 90.0, False), ("10m", 600.0, 1.0, 600.0, True),
    ("nan", 600.0, 1.0, 600.0, True), ("inf", 600.0, 1.0, 600.0, True),
])
def test_env_number(monkeypatch, caplog, raw, default, minimum, want, warns):
    if raw is None:
        monkeypatch.delenv("NVLLM_TEST_KNOB", raising=False)
    else:
        monkeypatch.setenv("NVLLM_TEST_KNOB", raw)
    log = logging.getLogger("nvllm")  # it does not propagate once an engine set it up: listen on it directly
    log.addHandler(caplog.handler)
    try:
        got = env_number("NVLLM_TEST_KNOB", default, minimum)
    finally:
        log.removeHandler(caplog.handler)
    assert got == want and type(got) is type(default)
    assert any("NVLLM_TEST_KNOB" in r.getMessage() for r in caplog.records) == warns


def test_a_bad_value_does_not_stop_a_command():
    """Every command imports the kernels, whose thresholds are read as they load: `nvllm --help` with a mistyped
    NVLLM_TP_TIMEOUT and NVLLM_GEMV_MAX_SPLITS was a traceback and exit 1."""
    env = {**os.environ, "NVLLM_TP_TIMEOUT": "10m", "NVLLM_GEMV_MAX_SPLITS": "abc", "NVLLM_FP8_W8A8_MIN_M": "x"}
    res = subprocess.run([sys.executable, "-m", "nvllm.cli", "--help"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert "NVLLM_TP_TIMEOUT='10m' is not a number of at least 1.0; 600.0 used" in res.stderr
    assert "NVLLM_GEMV_MAX_SPLITS='abc' is not an integer of at least 1; 256 used" in res.stderr


def test_an_unknown_kernels_choice_is_named_and_taken_as_auto(monkeypatch, caplog):
    from nvllm.kernels import backend

    log = logging.getLogger("nvllm")
    log.addHandler(caplog.handler)
    try:
        monkeypatch.setenv("NVLLM_KERNELS", "tritom")
        assert backend.triton_on("cpu") is False
        monkeypatch.setenv("NVLLM_KERNELS", "triton")
        monkeypatch.setenv("TRITON_INTERPRET", "0")   # no CPU target without the interpreter: the torch references
        assert backend.triton_on("cpu") is False
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert backend.triton_on("cpu") is backend.triton_available()
    finally:
        log.removeHandler(caplog.handler)
    assert "NVLLM_KERNELS='tritom' is not auto, torch or triton; auto used" in caplog.text
