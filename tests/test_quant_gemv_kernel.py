"""The decode GEMV kernel (``nvllm.kernels.quant_gemv``, Triton CPU interpreter) against dequantize-then-matmul,
for both packed layouts, 4 and 8 bits, 1–16 rows, with and without split-K (atomic and serial), the bit-pattern
conversion on and off, every variant (``QV.VARIANTS``). Tolerances as in test_quant_gemm_kernel (relative to
the largest |output|)."""

from __future__ import annotations

import importlib
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from nvllm.kernels import quant_gemv as QV  # noqa: E402
from nvllm.kernels import quant_gemv_tile as QT  # noqa: E402
from nvllm.kernels.quant_gemm import quant_gemm_reference  # noqa: E402
from tests.test_quant_gemm_kernel import CASES, LOOSE, TIGHT, check, make_weight, semantic_ref  # noqa: E402

if not isinstance(QT._quant_gemv_kernel, InterpretedFunction):
    importlib.reload(QT)   # quant_gemv reaches the kernels through the module, reloaded in place
from nvllm.kernels import quant_gemv_half2 as QH  # noqa: E402  (after QT: it takes QT's jitted helpers)

if not isinstance(QH.quant_gemv_half2_kernel, InterpretedFunction) or QH.epilogue is not QT._epilogue:
    importlib.reload(QH)
from nvllm.kernels import quant_gemv_half2_rows as QR  # noqa: E402  (after QH: it takes QH's jitted helpers)

if not isinstance(QR.quant_gemv_half2_rows_kernel, InterpretedFunction) or QR._pair is not QH._pair:
    importlib.reload(QR)
from nvllm.kernels import quant_gemv_mma as QM  # noqa: E402  (after QH: it takes QH's jitted helpers)

if not isinstance(QM.quant_gemv_mma_kernel, InterpretedFunction) or QM._pair is not QH._pair:
    importlib.reload(QM)

CONTIGUOUS = [c for c in CASES if not c[7]]   # act-order stays with quant_gemm
ANY_FORMAT = [v for v in QV.VARIANTS if v not in ("half2", "mma")]   # those take 4-bit GPTQ only (tested below)
HALF2_TOL = 2e-3   # f16 products and four-term sums (quant_gemv_half2), relative to the largest |output|; also
# variant mma (inputs rounded to f16)


def run_gemv(x, qw, bias=None, **kw):
    return QV.quant_gemv(x, qw.qweight, qw.qzeros, qw.scales, fmt=qw.fmt, bits=qw.bits,
                         group_size=qw.group_size, bias=bias, **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("case", CONTIGUOUS, ids=[c[0] for c in CONTIGUOUS])
def test_gemv_matches_dequant_matmul(case, M, dtype):
    qw = make_weight(*case)
    gen = torch.Generator().manual_seed(M + 100)
    x = torch.randn(M, qw.in_features, generator=gen).to(dtype)
    bias = (torch.randn(qw.out_features, generator=gen) * 0.1).to(dtype) if M != 3 else None
    y = run_gemv(x, qw, bias)
    # the GEMV multiplies by the fp32 weight: no rounding of a dequantized tile to x's dtype (the default for one
    # row of 4-bit GPTQ, half2, rounds its products to f16)
    exact = semantic_ref(x.float(), qw, None if bias is None else bias.float()).to(dtype)
    half2 = QV.pick_gemv_config(M, qw.in_features, qw.group_size, qw.fmt, qw.bits,
                                qw.out_features)["variant"] in ("half2", "mma")
    check(y, exact, max(HALF2_TOL, TIGHT[dtype]) if half2 else TIGHT[dtype])
    check(y, quant_gemm_reference(x, qw, bias), max(HALF2_TOL, LOOSE[dtype]) if half2 else LOOSE[dtype])


@pytest.mark.parametrize("magic", [0, 1])
@pytest.mark.parametrize("split_k", [1, 2, 4])
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[5]], ids=lambda c: c[0])
def test_gemv_split_k_and_conversion(case, split_k, magic):
    qw = make_weight(*case)
    x = torch.randn(2, qw.in_features)
    bias = torch.randn(qw.out_features)
    half2 = QV.pick_gemv_config(2, qw.in_features, qw.group_size, qw.fmt, qw.bits,
                                qw.out_features)["variant"] in ("half2", "mma")
    check(run_gemv(x, qw, bias, split_k=split_k, magic=magic), semantic_ref(x, qw, bias),
          HALF2_TOL if half2 else TIGHT[torch.float32])


@pytest.mark.parametrize("block_n,block_k", [(32, 16), (128, 32), (16, 64)])
def test_gemv_tiles(block_n, block_k):
    qw = make_weight(*CASES[1])    # AWQ, K 256, group 128
    x = torch.randn(1, qw.in_features)
    check(run_gemv(x, qw, block_n=block_n, block_k=block_k), semantic_ref(x, qw, None), TIGHT[torch.float32])


def test_gemv_refuses_what_it_cannot_take():
    qw = make_weight(*CASES[1])
    with pytest.raises(ValueError, match="cannot take"):
        run_gemv(torch.randn(17, qw.in_features), qw)
    with pytest.raises(ValueError, match="cannot take"):
        run_gemv(torch.randn(1, qw.in_features), qw, block_k=256)    # a K tile wider than the group
    assert not QV.gemv_supported(1, 256, 32, act_order=True)


# ----------------------------------------------------------------------------- variants (config key "variant")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("M", [1, 2])
@pytest.mark.parametrize("variant", ANY_FORMAT)
@pytest.mark.parametrize("case", CONTIGUOUS, ids=[c[0] for c in CONTIGUOUS])
def test_gemv_variants(case, variant, M, dtype):
    qw = make_weight(*case)     # AWQ-4, GPTQ-4 and GPTQ-8, groups 32 .. per-channel
    gen = torch.Generator().manual_seed(M + 200)
    x = torch.randn(M, qw.in_features, generator=gen).to(dtype)
    bias = (torch.randn(qw.out_features, generator=gen) * 0.1).to(dtype) if M == 2 else None
    y = run_gemv(x, qw, bias, variant=variant, split_k=1)
    check(y, semantic_ref(x.float(), qw, None if bias is None else bias.float()).to(dtype), TIGHT[dtype])
    check(y, quant_gemm_reference(x, qw, bias), LOOSE[dtype])


@pytest.mark.parametrize("variant", ["field", "row"])
@pytest.mark.parametrize("M,block_n,block_k,split_k", [(1, 16, 16, 2), (3, 32, 32, None), (16, 64, 32, 4)])
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[5]], ids=lambda c: c[0])
def test_gemv_variant_tiles_and_split_k(case, variant, M, block_n, block_k, split_k):
    qw = make_weight(*case)
    x = torch.randn(M, qw.in_features)
    bias = torch.randn(qw.out_features)
    y = run_gemv(x, qw, bias, variant=variant, block_n=block_n, block_k=block_k, split_k=split_k, stages=1)
    check(y, semantic_ref(x, qw, bias), TIGHT[torch.float32])


@pytest.mark.parametrize("case", [("awq4-k128-n192-g64", "awq", 4, 128, 192, 64, False, False),
                                  ("gptq4-k128-n200-g64", "gptq", 4, 128, 200, 64, False, False)],
                         ids=lambda c: c[0])
def test_gemv_ragged_n_and_waves(case):
    qw = make_weight(*case)    # N not a multiple of the 128-column tile: the last tile partly masked
    x = torch.randn(2, qw.in_features).half()
    for variant in ANY_FORMAT:
        check(run_gemv(x, qw, variant=variant, block_n=128, block_k=64, waves=8), semantic_ref(x, qw, None),
              TIGHT[torch.float16])


@pytest.mark.parametrize("variant", ANY_FORMAT)
def test_gemv_serial_split_k(variant):
    """split-K finished in the kernel: the workspace and tickets are zeroed again for the next call."""
    for case, dtype in ((CASES[0], torch.float16), (CASES[2], torch.bfloat16), (CASES[5], torch.float32)):
        qw = make_weight(*case)
        for M, split_k in ((1, 2), (2, 4), (3, 1)):
            x = torch.randn(M, qw.in_features).to(dtype)
            bias = torch.randn(qw.out_features).to(dtype)
            for _ in range(2):
                y = run_gemv(x, qw, bias, variant=variant, split_k=split_k, serial=1, block_k=32, block_n=32)
                check(y, semantic_ref(x.float(), qw, bias.float()).to(dtype), TIGHT[dtype])
    for ws, cnt in QV._WORKSPACES[torch.device("cpu")]:
        assert not ws.any() and not cnt.any()


def test_gemv_tuned_defaults(monkeypatch):
    assert QV.pick_gemv_config(1, 256, 128)["variant"] == "tile"          # no format: the heuristic
    assert QV.pick_gemv_config(1, 256, 128, "gptq", 8)["variant"] == "tile"  # 8 bits: not measured
    monkeypatch.setitem(QV.TUNED, ("awq", 4, 2), dict(variant="row", block_n=64, block_k=64, num_warps=1, serial=1))
    monkeypatch.delitem(QV.TUNED, ("gptq", 4, 2))
    cfg = QV.pick_gemv_config(2, 256, 128, "awq", 4)
    assert (cfg["variant"], cfg["block_n"], cfg["block_k"], cfg["serial"]) == ("row", 64, 64, 1)
    assert QV.pick_gemv_config(2, 256, 32, "awq", 4)["variant"] == "tile"    # its K tile would span groups
    assert QV.pick_gemv_config(2, 256, 128, "gptq", 4)["variant"] == "tile"
    qw = make_weight(*CASES[1])
    x = torch.randn(2, qw.in_features)
    check(run_gemv(x, qw, split_k=2), semantic_ref(x, qw, None), TIGHT[torch.float32])


def test_gemv_rejects_unknown_variant():
    qw = make_weight(*CASES[1])
    with pytest.raises(ValueError, match="unknown quant_gemv variant"):
        run_gemv(torch.randn(1, qw.in_features), qw, variant="nope")
    with pytest.raises(TypeError, match="unknown quant_gemv config keys"):
        run_gemv(torch.randn(1, qw.in_features), qw, block_x=1)


# ----------------------------------------------------------------------------- variant half2 (quant_gemv_half2)

GPTQ4 = [c for c in CONTIGUOUS if c[1] == "gptq" and c[2] == 4]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("x_scale", [1e-3, 1.0, 3000.0])   # the per-program power-of-two input scale keeps f16 in range
@pytest.mark.parametrize("case", GPTQ4, ids=[c[0] for c in GPTQ4])
def test_gemv_half2_matches_reference(case, x_scale, dtype):
    qw = make_weight(*case)
    gen = torch.Generator().manual_seed(int(x_scale * 1000) + 7)
    x = (torch.randn(1, qw.in_features, generator=gen) * x_scale).to(dtype)
    bias = (torch.randn(qw.out_features, generator=gen) * 0.1 * x_scale).to(dtype)
    exact = semantic_ref(x.float(), qw, bias.float())
    for split_k, serial, x_once, x_pairs in ((1, 0, 1, 0), (2, 0, 1, 0), (2, 1, 1, 0), (3, 1, 1, 0), (2, 1, 0, 0),
                                             (1, 0, 1, 1), (3, 1, 1, 1), (2, 1, 0, 1)):
        y = run_gemv(x, qw, bias, variant="half2", split_k=split_k, serial=serial, block_n=32, block_k=32,
                     x_once=x_once, x_pairs=x_pairs)
        check(y.float(), exact, max(HALF2_TOL, TIGHT[dtype]))


def test_gemv_half2_ragged_n_and_tiles():
    qw = make_weight("gptq4-k128-n200-g64", "gptq", 4, 128, 200, 64, False, False)
    x = torch.randn(1, qw.in_features)
    for bn, bk in ((128, 64), (64, 32), (16, 16)):
        for x_pairs in (0, 1):
            check(run_gemv(x, qw, variant="half2", block_n=bn, block_k=bk, waves=8, x_pairs=x_pairs),
                  semantic_ref(x, qw, None), HALF2_TOL)


def test_gemv_half2_pairs_built_once_per_program():
    """``x_pairs``: each program packs its split's inputs into its part of the scratch once; a ragged last split
    (K 160 in splits of 64: X_SPAN 64, the last split 32 inputs) reads only its own rows."""
    qw = make_weight("gptq4-k160-n64-g32", "gptq", 4, 160, 64, 32, False, False)
    x = torch.randn(1, qw.in_features) * 40
    want = semantic_ref(x, qw, None)
    QV._SCRATCH.clear()
    for split_k in (1, 3):   # the scratch as split 3 left it
        check(run_gemv(x, qw, variant="half2", block_n=32, block_k=32, split_k=split_k, x_pairs=1), want, HALF2_TOL)
    scratch = QV._SCRATCH[torch.device("cpu")]
    tiles, span = 2, 64   # split 3: 64 inputs a split (k_per_split rounds to whole K steps), 8 word rows of 4 words
    pairs = scratch[:tiles * 3 * span // 2].view(3, tiles, span // 8, 4)   # [split, tile, row, pair]
    assert torch.equal(pairs[:, 0], pairs[:, 1])                           # both column tiles built the same pairs
    assert pairs[2, 0, :4].any() and not pairs[2, 0, 4:].any()             # the last split: 32 inputs, 4 rows


def test_gemv_half2_early_words():
    """``early``: a split of one K step of 64 loads its eight word rows, scales and zeros before its inputs (after
    the PDL wait, or before it); the same sums in the same order as the loop, so the same bits."""
    qw = make_weight("gptq4-k256-n64-g128", "gptq", 4, 256, 64, 128, False, False)
    x = torch.randn(1, qw.in_features) * 7
    want = run_gemv(x, qw, variant="half2", block_n=32, block_k=64, split_k=4, x_pairs=1)
    check(want, semantic_ref(x, qw, None), HALF2_TOL)
    for early in (1, 2):
        assert torch.equal(run_gemv(x, qw, variant="half2", block_n=32, block_k=64, split_k=4, x_pairs=1,
                                    early=early), want)
    # splits of two K steps take the loop: early changes nothing
    assert torch.equal(run_gemv(x, qw, variant="half2", block_n=32, block_k=64, split_k=2, x_pairs=1, early=1),
                       run_gemv(x, qw, variant="half2", block_n=32, block_k=64, split_k=2, x_pairs=1))


@pytest.mark.parametrize("M", [2, 3, 4])
def test_gemv_half2_rows(M):
    """Several rows share each dequantized word; each row has its own input scale (rows of very different
    magnitudes), rows past M are masked."""
    qw = make_weight("gptq4-k256-n72-g64", "gptq", 4, 256, 72, 64, False, False)
    gen = torch.Generator().manual_seed(M)
    x = torch.randn(M, qw.in_features, generator=gen) * torch.tensor([1e-3, 3000.0, 1.0, 40.0])[:M, None]
    bias = torch.randn(qw.out_features, generator=gen)
    exact = semantic_ref(x, qw, bias)
    for split_k, serial, x_once in ((1, 0, 1), (2, 0, 1), (3, 1, 1), (2, 1, 0)):
        y = run_gemv(x, qw, bias, variant="half2", split_k=split_k, serial=serial, block_n=32, block_k=32,
                     x_once=x_once)
        for r in range(M):   # relative to each row's own largest output
            check(y[r:r + 1].float(), exact[r:r + 1], HALF2_TOL)


def test_gemv_half2_refuses_other_formats():
    for case, M in ((CASES[1], 1), (CASES[5], 1), (CASES[5], 2)):   # AWQ, 8-bit GPTQ
        qw = make_weight(*case)
        with pytest.raises(ValueError, match="half2 takes a 4-bit GPTQ weight"):
            run_gemv(torch.randn(M, qw.in_features), qw, variant="half2")


_PREFETCH_CHECK = r"""
def check_prefetch(ptx, ahead, cols):
    # the weights' lines asked of L2 (one per 32 columns and word row, 32 lanes each asking at least one) all
    # before the PDL wait, and none without PREFETCH
    asks = [i for i, line in enumerate(ptx.splitlines()) if "prefetch.global.L2" in line]
    wait = next(i for i, line in enumerate(ptx.splitlines()) if "griddepcontrol.wait" in line)
    assert len(asks) == (max(1, ahead * cols // 32 // 32) if ahead else 0), (ahead, len(asks))
    assert all(i < wait for i in asks), (asks, wait)
"""

_ASSEMBLE = _PREFETCH_CHECK + r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nvllm.kernels.quant_gemv_half2 import quant_gemv_half2_kernel as one_row
from nvllm.kernels.quant_gemv_half2_rows import quant_gemv_half2_rows_kernel as rows_kernel
ptrs = {"x_ptr": "*bf16", "xw_ptr": "*i32", "qw_ptr": "*i32", "qz_ptr": "*i32", "s_ptr": "*fp16", "bias_ptr": "*i32",
        "out_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
ints = ["N", "K", "stride_qw", "stride_qz", "stride_s", "k_per_split"]
merge_args = {"lse_ptr": "*fp32", "po_ptr": "*fp32", "ctx_ptr": "*i32", "merge_splits": "i32", "merge_partition": "i32"}
before = {}   # MERGE → global loads before the PDL wait (one row, EARLY 2)
for x_words, rows, x_pairs, ahead, early, merge in (
        (True, 1, False, 0, 0, False), (False, 1, False, 0, 0, False), (True, 1, True, 8, 0, False),
        (True, 1, True, 8, 1, False), (True, 1, True, 0, 2, False), (True, 1, True, 0, 2, True),
        (True, 2, False, 4, 0, False), (True, 4, False, 0, 0, False)):
    kernel = one_row if rows == 1 else rows_kernel
    sig = dict(ptrs, **{k: "i32" for k in (ints if rows == 1 else ["M", "N", "K", "stride_xm", "stride_om"] + ints[2:])})
    const = dict(GROUP=128, HAS_BIAS=False, ATOMIC=False, SERIAL=True, STAGES=1, BLOCK_N=128, BLOCK_K=64,
                 INTERPRET=False, X_WORDS=x_words, X_SPAN=64 if x_words else 0, PREFETCH=ahead, PDL=True)
    if rows > 1:
        const["BLOCK_M"] = rows
    else:
        sig = dict(sig, xp_ptr="*i32", **merge_args)
        sig = {k: sig[k] for k in kernel.arg_names if k in sig}   # in the kernel's argument order
        const["X_PAIRS"] = x_pairs
        const["EARLY"] = early
        const.update(MERGE=merge, HEAD_DIM=128, PO_D=128, MERGE_S=64, MERGE_C=16)
    sig.update({k: "constexpr" for k in kernel.arg_names if k in const})
    src = ASTSource(fn=kernel, signature=sig, constexprs={(list(sig).index(k),): v for k, v in const.items()})
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1, "num_stages": 1})
    # per word (8 of a K step), column (4 a thread) and row: three FMAs after a multiply
    assert ck.asm["cubin"] and ck.asm["ptx"].count("fma.rn.f16x2") == 3 * 8 * 4 * rows, (x_words, rows)
    check_prefetch(ck.asm["ptx"], ahead, 128)
    lines = ck.asm["ptx"].splitlines()
    wait = next(i for i, line in enumerate(lines) if "griddepcontrol.wait" in line)
    early_loads = sum("ld.global" in line for line in lines[:wait])   # EARLY 2: words, scales, zeros before the wait
    assert (early_loads >= 10) == (early == 2) and (early_loads == 0) == (early != 2), (early, early_loads)
    if rows == 1 and early == 2:   # MERGE: the context length too; the partials (the kernel waited for) after it
        before[merge] = early_loads
        if merge:
            assert before[True] == before[False] + 1, before
            assert sum("ld.global" in line for line in lines[wait:]) >= 2 + 8
print("assembled")
"""


def compile_for_hopper(script: str, done: str) -> None:
    """Run ``script`` (which compiles kernels for sm_90 with Triton's own ptxas: no GPU needed) outside the
    interpreter and check it printed ``done``."""
    import pathlib
    import subprocess
    import sys

    ptxas = pathlib.Path(__import__("triton").__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this Triton has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                       cwd=pathlib.Path(__file__).resolve().parents[1])
    assert r.returncode == 0 and done in r.stdout, r.stderr[-3000:]


def test_gemv_half2_inline_ptx_assembles_for_hopper():
    """The interpreter cannot run inline PTX: compile the kernel for sm_90 instead, both input paths, so a PTX
    mistake fails here rather than on the GPU; with ``PREFETCH`` the weights' L2 requests come before the PDL
    wait."""
    compile_for_hopper(_ASSEMBLE, "assembled")


def test_prefetch_config_runs_under_the_interpreter():
    """``prefetch`` (the tuned one- and two-row default) asks nothing of L2 under the interpreter, which cannot run
    the PTX, and the sums are those without it, for every variant that takes it."""
    qw = make_weight("gptq4-k256-n64-g64", "gptq", 4, 256, 64, 64, False, False)
    for rows, variant in ((1, "half2"), (2, "half2"), (3, "mma")):
        x = torch.randn(rows, qw.in_features)
        with_ = run_gemv(x, qw, variant=variant, prefetch=64, block_n=64)
        torch.testing.assert_close(with_, run_gemv(x, qw, variant=variant, prefetch=0, block_n=64), rtol=0, atol=0)
        check(with_, semantic_ref(x, qw, None), HALF2_TOL)


def test_half2_defaults_narrow_their_k_step_to_the_group():
    """A tuned half2 config whose K step is wider than the group (g32, g16) keeps half2 with the widest step that
    fits, and the GEMV through those defaults matches the reference."""
    for group, want in ((128, 64), (64, 64), (32, 32), (16, 16)):
        cfg = QV.pick_gemv_config(1, 256, group, "gptq", 4)
        assert (cfg["variant"], cfg["block_k"]) == ("half2", want), group
    assert QV.pick_gemv_config(4, 256, 16, "gptq", 4)["block_k"] == 16
    qw = make_weight("gptq4-k128-n64-g32", "gptq", 4, 128, 64, 32, False, False)
    for rows in (1, 3):
        x = torch.randn(rows, qw.in_features)
        check(run_gemv(x, qw), semantic_ref(x, qw, None), HALF2_TOL)


# ----------------------------------------------------------------------------- variant mma (quant_gemv_mma)

MMA_CASES = [("gptq4-k256-n128-g64", "gptq", 4, 256, 128, 64, False, False),
             ("gptq4-k256-n64-g32-sym", "gptq", 4, 256, 64, 32, True, False),
             ("gptq4-k256-n192-g128", "gptq", 4, 256, 192, 128, False, False)]


# Each weight case at two of the row counts and dtypes, each row count and dtype at least once: under the interpreter
# a case takes 8–19 s, and the full product (12) took a minute of CI's 2-worker wall time.
MMA_ROWS = [(MMA_CASES[0], 1, torch.bfloat16), (MMA_CASES[0], 8, torch.float32),
            (MMA_CASES[1], 3, torch.float16), (MMA_CASES[1], 8, torch.bfloat16),
            (MMA_CASES[2], 8, torch.bfloat16), (MMA_CASES[2], 3, torch.float16)]


@pytest.mark.parametrize("case,M,dtype", MMA_ROWS, ids=[f"{c[0]}-{m}-{str(d)[6:]}" for c, m, d in MMA_ROWS])
def test_gemv_mma_matches_reference(case, M, dtype):
    """Tensor-core fragments (emulated under the interpreter): every row against the fp32 reference, rows of very
    different magnitudes (each its own input scale), bias, split-K atomic and finished in the kernel (twice: the
    workspace is left zeroed)."""
    qw = make_weight(*case)
    gen = torch.Generator().manual_seed(M + 31)
    mags = torch.tensor([1e-3, 3000.0, 1.0, 40.0, 0.5, 7.0, 1e-2, 2.0])[:M, None]
    x = (torch.randn(M, qw.in_features, generator=gen) * mags).to(dtype)
    bias = (torch.randn(qw.out_features, generator=gen) * mags.mean()).to(dtype)
    exact = semantic_ref(x.float(), qw, bias.float())
    bk = min(qw.group_size, 64)
    for split_k, serial in ((1, 0), (2, 0), (2, 1), (2, 1), (4, 1)):
        y = run_gemv(x, qw, bias, variant="mma", block_n=64, block_k=bk, split_k=split_k, serial=serial)
        for r in range(M):
            check(y[r:r + 1].float(), exact[r:r + 1], max(HALF2_TOL, TIGHT[dtype]))
    for ws, cnt in QV._WORKSPACES[torch.device("cpu")]:
        assert not ws.any() and not cnt.any()


def test_gemv_mma_refuses_what_it_cannot_take():
    qw = make_weight(*MMA_CASES[0])
    for kw, M in ((dict(block_n=128), 1), (dict(block_k=16), 1), ({}, 9)):
        with pytest.raises(ValueError, match="mma takes at most 8 rows"):
            run_gemv(torch.randn(M, qw.in_features), qw, variant="mma", **{"block_n": 64, "block_k": 64, **kw})
    ragged = make_weight("gptq4-k128-n200-g64", "gptq", 4, 128, 200, 64, False, False)
    with pytest.raises(ValueError, match="N a multiple of 64"):
        run_gemv(torch.randn(2, ragged.in_features), ragged, variant="mma", block_n=64, block_k=64)
    with pytest.raises(ValueError, match="mma takes a 4-bit GPTQ weight"):
        awq = make_weight(*CASES[1])
        run_gemv(torch.randn(2, awq.in_features), awq, variant="mma", block_n=64, block_k=64)


def test_mma_defaults_need_whole_subtiles():
    """The tuned mma configs (3-8 rows) apply where N is known and a multiple of 64; elsewhere the heuristic, and
    those calls then stay with quant_gemm past GEMV_MAX_M."""
    assert QV.pick_gemv_config(5, 256, 128, "gptq", 4, 128)["variant"] == "mma"
    assert QV.pick_gemv_config(5, 256, 32, "gptq", 4, 128)["block_k"] == 32      # narrowed to the group
    for n in (None, 200):
        assert QV.pick_gemv_config(5, 256, 128, "gptq", 4, n)["variant"] == "tile"
    assert QV.gemv_tuned(8, 256, 128, "gptq", 4, 192) and not QV.gemv_tuned(8, 256, 128, "gptq", 4, 200)
    assert not QV.gemv_tuned(8, 256, 16, "gptq", 4, 192)                         # g16: no whole mma step
    qw = make_weight(*MMA_CASES[2])
    x = torch.randn(6, qw.in_features)
    check(run_gemv(x, qw), semantic_ref(x, qw, None), HALF2_TOL)                 # the default: mma


_MMA_LAYOUT = _PREFETCH_CHECK + r"""
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nvllm.kernels.quant_gemv_mma import quant_gemv_mma_kernel as kernel
ptrs = {"x_ptr": "*bf16", "xw_ptr": "*i32", "qw_ptr": "*i32", "qz_ptr": "*i32", "s_ptr": "*fp16", "bias_ptr": "*i32",
        "out_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
ints = ["M", "N", "K", "stride_xm", "stride_om", "stride_qw", "stride_qz", "stride_s", "k_per_split"]
for x_words, rows, block_k, ahead in ((True, 1, 128, 16), (False, 8, 64, 0)):
    sig = dict(ptrs, **{k: "i32" for k in ints})
    const = dict(GROUP=128, HAS_BIAS=False, ATOMIC=False, SERIAL=True, STAGES=1, BLOCK_K=block_k, ROWS=rows,
                 X_CHUNK=256, INTERPRET=False, X_WORDS=x_words, PREFETCH=ahead, PDL=True)
    sig.update({k: "constexpr" for k in kernel.arg_names if k in const})
    src = ASTSource(fn=kernel, signature=sig, constexprs={(list(sig).index(k),): v for k, v in const.items()})
    ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1, "num_stages": 1})
    ttgir = ck.asm["ttgir"]
    layouts = dict(re.findall(r"^(#\w+) = (.*)$", ttgir, re.M))
    asm = [l for l in ttgir.splitlines() if "elementwise_inline_asm" in l and "mma.sync" in l]
    assert len(asm) == 8 * block_k // 32, len(asm)                  # eight subtiles per mma step
    for line in asm:                                                 # every operand: one element per lane
        types = re.findall(r"tensor<(\d+)x\w+, (#\w+)>", line.rsplit(" : ", 1)[1])
        assert types and all(n == "32" for n, _ in types), line[-300:]
        for _, lay in types:
            assert re.search(r"sizePerThread = \[1\], threadsPerWarp = \[32\], warpsPerCTA = \[1\]",
                             layouts[lay]), layouts[lay]
    assert ck.asm["cubin"] and ck.asm["ptx"].count("mma.sync.aligned.m16n8k16") == 2 * len(asm)
    check_prefetch(ck.asm["ptx"], ahead, 64)
print("lanes ok")
"""


def test_gemv_mma_fragments_sit_on_their_lanes():
    """The mma fragments are right only if each tensor's element i sits on lane i (a [32] tensor, one warp).
    Compile the kernel for sm_90 with Triton's own ptxas (no GPU needed) and read the layout of every inline-mma
    operand in the TTGIR, so a Triton that lays them out otherwise fails here rather than silently on the GPU."""
    compile_for_hopper(_MMA_LAYOUT, "lanes ok")
