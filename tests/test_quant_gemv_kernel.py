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
from nvllm.kernels.quant_gemm import quant_gemm_reference  # noqa: E402
from tests.test_quant_gemm_kernel import CASES, LOOSE, TIGHT, check, make_weight, semantic_ref  # noqa: E402

if not isinstance(QV._quant_gemv_kernel, InterpretedFunction):
    importlib.reload(QV)

CONTIGUOUS = [c for c in CASES if not c[7]]   # act-order stays with quant_gemm


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
    # the GEMV multiplies by the fp32 weight: no rounding of a dequantized tile to x's dtype
    exact = semantic_ref(x.float(), qw, None if bias is None else bias.float()).to(dtype)
    check(y, exact, TIGHT[dtype])
    check(y, quant_gemm_reference(x, qw, bias), LOOSE[dtype])


@pytest.mark.parametrize("magic", [0, 1])
@pytest.mark.parametrize("split_k", [1, 2, 4])
@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[5]], ids=lambda c: c[0])
def test_gemv_split_k_and_conversion(case, split_k, magic):
    qw = make_weight(*case)
    x = torch.randn(2, qw.in_features)
    bias = torch.randn(qw.out_features)
    check(run_gemv(x, qw, bias, split_k=split_k, magic=magic), semantic_ref(x, qw, bias), TIGHT[torch.float32])


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
@pytest.mark.parametrize("variant", QV.VARIANTS)
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
    for variant in QV.VARIANTS:
        check(run_gemv(x, qw, variant=variant, block_n=128, block_k=64, waves=8), semantic_ref(x, qw, None),
              TIGHT[torch.float16])


@pytest.mark.parametrize("variant", QV.VARIANTS)
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
