"""Lazy `triton.jit` for every kernel file.

A kernel is jitted at its first launch, not at import: the package must import without Triton, and Triton
must be imported only after TRITON_INTERPRET is chosen (the CPU tests pick the interpreter before the first
launch). Kernel bodies refer to `tl` as a module global; `lazy_jit` binds it in the kernel's own module.

Triton compiles one variant of a kernel per combination of its integer arguments being 1, a multiple of 16,
or neither. Arguments that change from step to step with the batch (a block table's row stride is the longest
sequence's block count) would make a new batch shape compile a new variant — about a second, under live
requests — so a kernel lists them in a ``do_not_specialize`` attribute and they are passed unspecialized.
Functions a kernel calls are named in its ``helpers`` attribute and jitted in place at its first launch."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=None)
def lazy_jit(kernel):
    import triton
    import triton.language

    kernel.__globals__["tl"] = triton.language
    for name in getattr(kernel, "helpers", ()):  # functions the kernel calls: jitted in place, from the Python
        helper = getattr(kernel.__globals__[name], "fn", kernel.__globals__[name])  # function (again after
        helper.__globals__["tl"] = triton.language                                   # cache_clear), in any module
        kernel.__globals__[name] = triton.jit(helper)
    return triton.jit(kernel, do_not_specialize=list(getattr(kernel, "do_not_specialize", ())))
