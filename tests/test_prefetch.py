"""How many word rows a decode GEMV asks of L2 before its PDL wait (``nvllm.kernels.prefetch.rows``), and that the
launcher asks none under the interpreter. That the requests come before the wait is checked in the sm_90 compile
tests of ``test_quant_gemv_kernel.py``."""

from nvllm.kernels import prefetch


def test_rows_fit_the_budget_in_powers_of_two():
    # 1000 programs of 256 columns: 1 MiB a row over the call
    mib = 1000 * 256 * 4
    assert prefetch.rows(0, 1000, 256, 32) == 0
    assert prefetch.rows(mib - 1, 1000, 256, 32) == 0            # not one row fits
    assert prefetch.rows(mib, 1000, 256, 32) == 1
    assert prefetch.rows(3 * mib, 1000, 256, 32) == 2             # floor to a power of two
    assert prefetch.rows(31 * mib, 1000, 256, 32) == 16
    # the whole range fits: its next power of two (the kernel clamps the rows past it to the last)
    assert prefetch.rows(32 * mib, 1000, 256, 32) == 32
    assert prefetch.rows(100 * mib, 1000, 256, 24) == 32
    assert prefetch.rows(100 * mib, 1000, 256, 8) == 8
    assert prefetch.rows(8 << 20, 0, 256, 8) == 0


def test_qwen_7b_shapes_at_the_tuned_budget():
    """The tuned 8 MiB with the H200's split plan (132 SMs, about 16 programs each): q/k/v (18 tiles of 256 columns,
    56 splits of 64 inputs) and o_proj (14 tiles, 56 splits) ask for all 8 rows of a program, the whole matrix;
    gate_up (148 tiles, 14 splits of 256 inputs) and down_proj (14 tiles, 148 splits of 128) for 2 rows of 32 and
    16."""
    assert prefetch.rows(8 << 20, 18 * 56, 256, 8) == 8
    assert prefetch.rows(8 << 20, 14 * 56, 256, 8) == 8
    assert prefetch.rows(8 << 20, 148 * 14, 256, 32) == 2
    assert prefetch.rows(8 << 20, 14 * 148, 256, 16) == 2
