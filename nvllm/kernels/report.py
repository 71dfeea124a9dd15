"""Kernel report: which implementation ran each op, and how often.

Every dispatch point calls ``record(op, impl)``; the engine prints the table once at start-up (after the
warm-up step) and benchmarks print and save it with their results. On CPU the torch references run and the
report says so.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_counts: Counter[tuple[str, str]] = Counter()


def record(op: str, impl: str, times: int = 1) -> None:
    with _lock:
        _counts[(op, impl)] += times


@contextmanager
def recording() -> Iterator[Counter]:
    """The records made inside the block (they count in the report as usual). Around a CUDA graph capture: what
    the graph holds, which ``replay`` counts again at each replay, so graphs show what they run."""
    with _lock:
        before = Counter(_counts)
    made: Counter[tuple[str, str]] = Counter()
    try:
        yield made
    finally:
        with _lock:
            made.update(_counts - before)


def replay(made: Counter) -> None:
    """Count a recorded set of dispatches again (a CUDA graph replay)."""
    with _lock:
        _counts.update(made)


def snapshot() -> dict[str, dict[str, int]]:
    """{op: {impl: calls}} — a plain dict, safe to serialise into JSON results."""
    with _lock:
        out: dict[str, dict[str, int]] = {}
        for (op, impl), n in sorted(_counts.items()):
            out.setdefault(op, {})[impl] = n
        return out


def reset() -> None:
    with _lock:
        _counts.clear()


def format_table(report: dict[str, dict[str, int]] | None = None):
    """A Rich table of the report (op, implementation, calls)."""
    from rich.table import Table

    report = snapshot() if report is None else report
    table = Table(title="kernel report")
    table.add_column("op")
    table.add_column("implementation")
    table.add_column("calls", justify="right")
    for op, impls in report.items():
        for impl, n in impls.items():
            table.add_row(op, impl, str(n))
    return table
