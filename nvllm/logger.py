"""The `nvllm` logger, printed through Rich."""

from __future__ import annotations

import logging
import os

_configured = False


def setup_logging() -> logging.Logger:
    """The `nvllm` logger with its Rich handler, set up once per process: at NVLLM_LOGGING_LEVEL (vLLM's
    VLLM_LOGGING_LEVEL; INFO by default). Later calls (every LLM built) leave the level as the program set it."""
    global _configured
    logger = logging.getLogger("nvllm")
    if not _configured:
        from rich.logging import RichHandler

        handler = RichHandler(console=console(), show_path=False, rich_tracebacks=False, markup=False)
        handler.setFormatter(logging.Formatter("%(message)s", datefmt="[%X]"))
        logger.addHandler(handler)
        logger.propagate = False
        level = os.environ.get("NVLLM_LOGGING_LEVEL", "INFO").upper()
        if not isinstance(logging.getLevelName(level), int):
            logger.setLevel(logging.INFO)
            logger.warning("NVLLM_LOGGING_LEVEL %r is not a logging level (DEBUG, INFO, WARNING, ERROR); INFO used",
                           level)
        else:
            logger.setLevel(level)
        _configured = True
    return logger


def console():
    """The Rich console (stderr) used for tables next to the log lines."""
    from rich.console import Console

    global _console
    if _console is None:
        _console = Console(stderr=True)
    return _console


_console = None


def results_console():
    """A Rich console on stdout, for a command's results (eval's and bench's tables): what a user redirects to a
    file or pipes on, as lm-eval and vLLM's benchmark print theirs; logs and progress stay on stderr."""
    from rich.console import Console

    global _results_console
    if _results_console is None:
        _results_console = Console()
    return _results_console


_results_console = None
