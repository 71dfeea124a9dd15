"""Which implementation the dispatchers use.

Triton runs when the tensors live on a CUDA device and Triton imports. ``NVLLM_KERNELS=triton`` forces the
Triton path on the CPU too under ``TRITON_INTERPRET=1`` (for tests; without it the CPU runs the torch references);
``NVLLM_KERNELS=torch`` forces the torch references everywhere.
"""

from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    return True


def eager_triton():
    """(triton, triton.language, triton.jit) for kernel files that jit at import; without Triton (None, None,
    a no-op decorator), so the package still imports and those kernels stay plain, never-launched functions."""
    if not triton_available():
        return None, None, lambda fn: fn
    import triton
    import triton.language as tl

    return triton, tl, triton.jit


def use_triton(t: torch.Tensor) -> bool:
    return triton_on(t.device)


def triton_on(device: torch.device | str) -> bool:
    """Whether tensors on ``device`` run the Triton kernels (what a config checks before any tensor exists)."""
    raw = os.environ.get("NVLLM_KERNELS", "auto")
    choice = raw if raw in ("auto", "torch") else _kernels_choice(raw, interpreting())  # (the dispatch's hot path)
    if choice == "torch":
        return False
    if choice == "triton" and (torch.device(device).type == "cuda" or interpreting()):
        return triton_available()
    return torch.device(device).type == "cuda" and triton_available()


@functools.lru_cache(maxsize=None)
def _kernels_choice(raw: str, interpret: bool) -> str:
    """NVLLM_KERNELS as auto, torch or triton; another value is named once (and taken as auto), as is triton for CPU
    tensors without TRITON_INTERPRET=1 (Triton has no CPU target but its interpreter)."""
    import logging

    choice = raw.strip().lower() or "auto"
    if choice not in ("auto", "torch", "triton"):
        logging.getLogger("nvllm").warning("NVLLM_KERNELS=%r is not auto, torch or triton; auto used", raw)
        return "auto"
    if choice == "triton" and not interpret and not torch.cuda.is_available():
        logging.getLogger("nvllm").warning("NVLLM_KERNELS=triton runs on the CPU only under TRITON_INTERPRET=1; the "
                                           "torch references run here")
    return choice


def interpreting() -> bool:
    """Whether Triton kernels run under its CPU interpreter. Its ``tl.dot`` (Triton 3.9) multiplies 16-bit tiles as
    their raw bits, so kernels that take an ``UPCAST`` flag feed it fp32 copies there (loads, unpacking and stores
    keep their dtypes); those kernels call only builtins (``tl.full``, not the ``@jit`` helper ``tl.zeros``), so they
    still interpret when ``triton.language`` was imported before ``TRITON_INTERPRET`` was set."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
