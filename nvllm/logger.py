"""The `nvllm` logger, printed through Rich."""

from __future__ import annotations

import logging

_configured = False


def setup_logging(level: int | str = logging.INFO) -> logging.Logger:
    global _configured
    logger = logging.getLogger("nvllm")
    if not _configured:
        from rich.logging import RichHandler

        handler = RichHandler(console=console(), show_path=False, rich_tracebacks=False, markup=False)
        handler.setFormatter(logging.Formatter("%(message)s", datefmt="[%X]"))
        logger.addHandler(handler)
        logger.propagate = False
        _configured = True
    logger.setLevel(level)
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
