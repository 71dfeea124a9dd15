"""Weights asked of L2 before a decode GEMV waits for its inputs (``prefetch`` in ``quant_gemv``'s configs).

Under programmatic dependent launch (``pdl``) a kernel's programs start while the previous kernel still runs and
block in ``gdc_wait`` until it has completed. A decode GEMV's weights are never written by any kernel of the step,
so nothing forbids reading them before that wait: each program asks L2 for the first word rows of its own K range
(``prefetch.global.L2``, one request per 128-byte line, no registers held), then waits. The weight stream then
starts during the previous kernel — a norm, SiLU·mul or attention's reduction, a few µs of latency-bound work that
leaves DRAM idle — and the GEMV's first loads find their lines in L2 or on their way.

How much to ask for is a byte budget over the whole call (``rows``): lines asked of L2 stay there only while L2
(50 MB on the H200) holds them, so a call whose weights do not fit asks for as many rows per program as the budget
allows. On the H200 8 MiB was best (PERF.md runs BP, BQ); 24 and 48 MiB were slower than 8 (the requests then
compete with the previous kernel's own loads, which it waits on — a guess, not measured). Without PDL the requests
still precede the GEMV's input phase. Under the Triton interpreter (the CPU tests) nothing is asked: the loads that
follow read the same bytes either way, so the results cannot differ.
"""

from __future__ import annotations

from nvllm.kernels.backend import eager_triton

triton, tl, _jit = eager_triton()  # jitted at import (the CPU tests reload under the interpreter)


@_jit
def prefetch_rows(w_ptr, stride_w, row0, row_end, col0, N, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Ask L2 for rows ``row0 .. row0 + ROWS`` (clamped below ``row_end``) of the int32 matrix at ``w_ptr`` (row
    stride ``stride_w``), columns ``col0 .. col0 + COLS`` (clamped below N): one request per 32 columns, the
    128-byte line of 32 words (``col0`` and the row stride are multiples of 32 words)."""
    lines = tl.minimum(col0 + 32 * tl.arange(0, COLS // 32), N - 1)
    rows = tl.minimum(row0 + tl.arange(0, ROWS), row_end - 1)
    ptrs = w_ptr + rows[:, None].to(tl.int64) * stride_w + lines[None, :]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\nmov.b32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@_jit
def start_split(qw_ptr, stride_qw, k_per_split, K, N, COLS: tl.constexpr, PREFETCH: tl.constexpr,
                PDL: tl.constexpr):
    """A decode GEMV program's first steps: its column tile and K split (program ids 0 and 1) and the split's K
    range; then its first ``PREFETCH`` word rows of the GPTQ qweight ``[K/8, N]`` (``COLS`` columns from the tile's
    first) asked of L2; then, under PDL, the wait for the previous kernel and the go-ahead for the next one.
    Returns (pid_n, pid_k, k_begin, k_end)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    if PREFETCH:
        prefetch_rows(qw_ptr, stride_qw, k_begin // 8, k_end // 8, pid_n * COLS, N, PREFETCH, COLS)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    return pid_n, pid_k, k_begin, k_end


def rows(budget_bytes: int, programs: int, cols: int, rows_per_program: int) -> int:
    """Word rows each of ``programs`` programs asks for (a power of two, as ``tl.arange`` needs; 0: none): as many
    of its ``rows_per_program`` as fit ``budget_bytes`` over the call, at ``cols`` 4-byte words a row."""
    if budget_bytes <= 0 or programs <= 0 or rows_per_program <= 0:
        return 0
    fit = min(budget_bytes // (programs * cols * 4), rows_per_program)
    if fit < 1:
        return 0
    whole = triton.next_power_of_2(rows_per_program)   # asking past the range repeats its last row (clamped)
    return min(whole, 1 << (fit.bit_length() - 1)) if fit < rows_per_program else whole
