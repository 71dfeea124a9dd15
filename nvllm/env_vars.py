"""Numbers read from nvllm's environment variables (kernel thresholds, timeouts, cache sizes). A value that is not a
number, or is out of range, is named in one warning and the default is used: these are read as modules load, before
any command can answer with an error line, and a mistyped tuning knob must not stop `nvllm --help`."""

from __future__ import annotations

import logging
import math
import os

logger = logging.getLogger("nvllm")


def env_number(name: str, default: int | float, minimum: int | float = 0) -> int | float:
    """``name``'s value as the type of ``default`` (an int, or a float for seconds), at least ``minimum``; the
    default where it is unset, empty or unusable (with a warning)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    kind = type(default)
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or (isinstance(value, float) and not math.isfinite(value)) or value < minimum:
        what = "an integer" if kind is int else "a number"
        logger.warning("%s=%r is not %s of at least %s; %s used", name, raw, what, minimum, default)
        return default
    return value
