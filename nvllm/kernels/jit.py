"""Lazy `triton.jit` for every kernel file.

A kernel is jitted at its first launch, not at import: the package must import without Triton, and Triton
must be imported only after TRITON_INTERPRET is chosen (the CPU tests pick the interpreter before the first
launch). Kernel bodies refer to `tl` as a module global; `lazy_jit` binds it in the kernel's own module."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def lazy_jit(kernel):
    import triton
    import triton.language

    kernel.__globals__["tl"] = triton.language
    return triton.jit(kernel)
