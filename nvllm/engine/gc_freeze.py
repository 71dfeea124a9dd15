"""frozen_heap(): the engine's step loops run with the objects alive at their start out of the garbage collector's
reach.

Python's full collections walk every tracked object; once an engine is up that is the modules, the tokenizer's
tables, the block pool and everything imported — a collection took ~90 ms on the 2-core CI host — and one landing
inside a request adds its pause to that request's decode time. ``gc.freeze()`` moves every object alive now to a
permanent generation that collections skip (vLLM freezes its engine the same way), so during the loop they walk
only what the steps create. ``gc.unfreeze()`` on the way out hands the frozen objects back, so an engine dropped
after ``generate`` is freed as usual. The freeze is process-wide: nested or concurrent loops share one, released
when the last one leaves.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    global _depth
    with _lock:
        if _depth == 0:
            gc.freeze()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                gc.unfreeze()
