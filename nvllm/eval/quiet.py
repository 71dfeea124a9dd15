"""Keeping lm-eval, datasets and transformers quiet under `nvllm eval`, which shows its own progress and tables."""

from __future__ import annotations

import functools
import logging
import subprocess
from contextlib import contextmanager
from unittest import mock


def quiet_libraries() -> None:
    """lm-eval, datasets and transformers log a lot at INFO; `nvllm eval` shows its own progress and table."""
    for name in ("lm_eval", "lm-eval", "datasets", "evaluate"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import datasets
        import transformers

        datasets.disable_progress_bars()
        transformers.logging.set_verbosity_error()
    except ImportError:  # pragma: no cover
        pass
    import lm_eval.evaluator

    # lm-eval records the working directory's git commit by running git with the terminal as its stderr: outside
    # a repository every run printed "fatal: not a git repository". The same lookup, git's complaint discarded.
    lm_eval.evaluator.get_git_commit_hash = _git_commit_quietly


@contextmanager
def harness_bars(enabled: bool):
    """lm-eval builds each task's contexts under a tqdm bar of its own, with no switch to turn it off: with
    --no-progress that bar is the one left on the terminal. Off, the same bar is built disabled."""
    import lm_eval.api.task

    if enabled or not hasattr(lm_eval.api.task, "tqdm"):
        yield
        return
    with mock.patch.object(lm_eval.api.task, "tqdm", functools.partial(lm_eval.api.task.tqdm, disable=True)):
        yield


def _git_commit_quietly() -> str | None:
    try:
        return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL).strip().decode()
    except (subprocess.CalledProcessError, FileNotFoundError):
        return None
