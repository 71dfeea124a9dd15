"""The fused quant_gemm Triton kernel (run by Triton's CPU interpreter) against dequantize-then-matmul.

Tolerances, relative to the largest |output| of the case (``tol · max|ref|``):
  against the kernel-semantics reference (weight dequantized in fp32, rounded to x's dtype, fp32 matmul):
    fp32 1e-5, fp16 2e-3 (≈ 2 ulp of fp16), bf16 1.6e-2 (≈ 2 ulp of bf16);
  against the plain torch reference (fp32 weight, ``quant_gemm_reference``): fp32 1e-5, fp16 4e-3, bf16 3e-2.
"""

from __future__ import annotations

import importlib
import os
import zlib

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from nvllm.kernels import quant_gemm as QG  # noqa: E402
from nvllm.kernels import report  # noqa: E402
from nvllm.quant import formats as F  # noqa: E402

if not isinstance(QG._quant_gemm_kernel, InterpretedFunction):
    # the kernel module was imported (through nvllm) before TRITON_INTERPRET was set: decorate again
    importlib.reload(QG)

TIGHT = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
LOOSE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}

# (name, fmt, bits, K, N, group_size, sym, act_order)
CASES = [
    ("awq4-k128-g32", "awq", 4, 128, 64, 32, False, False),
    ("awq4-k256-g128", "awq", 4, 256, 128, 128, False, False),
    ("gptq4-k256-g64-sym", "gptq", 4, 256, 64, 64, True, False),
    ("gptq4-k128-g128-asym", "gptq", 4, 128, 128, 128, False, False),
    ("gptq4-k256-g32-actorder", "gptq", 4, 256, 64, 32, False, True),
    ("gptq8-k256-g64-asym", "gptq", 8, 256, 64, 64, False, False),
    ("gptq8-k128-perchannel-sym", "gptq", 8, 128, 64, -1, True, False),
    ("gptq8-k128-g32-actorder-sym", "gptq", 8, 128, 64, 32, True, True),
]
_weights: dict[str, F.QuantWeight] = {}


def make_weight(name, fmt, bits, K, N, group_size, sym, act_order) -> F.QuantWeight:
    if name not in _weights:
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        w = torch.randn(N, K, generator=gen) * 0.05
        if fmt == "awq":
            _weights[name] = F.quantize_to_awq(w, group_size)
        else:
            g_idx = F.act_order_g_idx(torch.randperm(K, generator=gen), group_size) if act_order else None
            _weights[name] = F.quantize_to_gptq(w, bits=bits, group_size=group_size, sym=sym, g_idx=g_idx)
        assert _weights[name].act_order == act_order
    return _weights[name]


def semantic_ref(x, qw, bias):
    w = qw.dequantize(torch.float32).to(x.dtype).float()
    y = x.float() @ w.t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def check(y, ref, tol):
    assert y.shape == ref.shape and y.dtype == ref.dtype
    scale = ref.float().abs().max().item()
    err = (y.float() - ref.float()).abs().max().item()
    assert err <= tol * scale, f"max err {err:.3g} > {tol:g} × {scale:.3g}"


def run_kernel(x, qw, bias=None, **kw):
    return QG.quant_gemm(x, qw.qweight, qw.qzeros, qw.scales, fmt=qw.fmt, bits=qw.bits,
                         group_size=qw.group_size, g_idx=qw.g_idx, bias=bias, **kw)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_kernel_matches_dequant_matmul(case, M, dtype):
    qw = make_weight(*case)
    gen = torch.Generator().manual_seed(M)
    x = torch.randn(M, qw.in_features, generator=gen).to(dtype)
    bias = (torch.randn(qw.out_features, generator=gen) * 0.1).to(dtype) if M != 3 else None
    y = run_kernel(x, qw, bias)
    check(y, semantic_ref(x, qw, bias), TIGHT[dtype])
    check(y, QG.quant_gemm_reference(x, qw, bias), LOOSE[dtype])


@pytest.mark.parametrize("case", [CASES[0], CASES[4]], ids=lambda c: c[0])
def test_an_empty_batch_gives_an_empty_output(case):
    qw = make_weight(*case)
    y = run_kernel(torch.randn(0, qw.in_features).half(), qw)
    assert y.shape == (0, qw.out_features) and y.dtype == torch.float16


@pytest.mark.parametrize("split_k", [1, 2, 3])
@pytest.mark.parametrize("case", [CASES[0], CASES[4], CASES[5]], ids=lambda c: c[0])
def test_split_k(case, split_k):
    qw = make_weight(*case)
    x = torch.randn(5, qw.in_features).half()
    bias = torch.randn(qw.out_features).half()
    check(run_kernel(x, qw, bias, split_k=split_k), semantic_ref(x, qw, bias), TIGHT[torch.float16])


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[5]], ids=lambda c: c[0])
def test_tile_spanning_groups_and_small_tiles(case):
    qw = make_weight(*case)   # group 32/64 with BLOCK_K 128 (gathered scales) or 16 (several tiles a group)
    x = torch.randn(20, qw.in_features)
    ref = semantic_ref(x, qw, None)
    check(run_kernel(x, qw, block_k=128, block_n=32, block_m=16), ref, TIGHT[torch.float32])
    check(run_kernel(x, qw, block_k=16, block_n=16, block_m=16), ref, TIGHT[torch.float32])


def test_strided_input():
    qw = make_weight(*CASES[1])
    xt = torch.randn(qw.in_features, 7).half()
    x = xt.t()                                # [7, K], stride (1, 7)
    check(run_kernel(x, qw), semantic_ref(x.contiguous(), qw, None), TIGHT[torch.float16])


@pytest.mark.parametrize("case", [CASES[0], CASES[4], CASES[6]], ids=lambda c: c[0])
def test_dequantize_triton(case):
    qw = make_weight(*case)
    for dtype in (torch.float32, torch.float16):
        w = QG.dequantize_triton(qw, dtype)
        assert w.shape == (qw.in_features, qw.out_features) and w.dtype == dtype
        assert torch.equal(w, qw.dequantize(torch.float32).t().to(dtype))


def test_quant_linear_dispatch(monkeypatch):
    qw = make_weight(*CASES[0])
    x = torch.randn(2, 3, qw.in_features).half()
    bias = torch.randn(qw.out_features).half()
    ref = semantic_ref(x.reshape(-1, qw.in_features), qw, bias).reshape(2, 3, -1)

    report.reset()
    monkeypatch.setenv("NVLLM_KERNELS", "torch")
    y = QG.quant_linear(x, qw, bias)
    assert y.shape == (2, 3, qw.out_features)
    check(y, ref, LOOSE[torch.float16])
    assert report.snapshot() == {"quant_gemm": {"torch dequant+matmul": 1}}

    report.reset()
    monkeypatch.setenv("NVLLM_KERNELS", "triton")
    monkeypatch.setattr(QG, "GEMV_MAX_M", 8)
    check(QG.quant_linear(x, qw, bias), ref, TIGHT[torch.float16])       # 6 rows: the GEMV kernel
    assert report.snapshot() == {"quant_gemm": {"triton w4a16 awq gemv": 1}}

    report.reset()
    monkeypatch.setattr(QG, "GEMV_MAX_M", 4)                              # 6 rows: the fused GEMM kernel
    check(QG.quant_linear(x, qw, bias), ref, TIGHT[torch.float16])
    assert report.snapshot() == {"quant_gemm": {"triton w4a16 awq": 1}}

    report.reset()
    monkeypatch.setattr(QG, "DEQUANT_MATMUL_MIN_M", 4)        # 6 rows: the large-M path
    check(QG.quant_linear(x.float(), qw, bias.float()), semantic_ref(x.reshape(6, -1).float(), qw, bias)
          .reshape(2, 3, -1), TIGHT[torch.float32])
    assert report.snapshot() == {"quant_gemm": {"triton dequant awq + torch matmul": 1}}

    with pytest.raises(ValueError, match="features"):
        QG.quant_linear(torch.randn(2, qw.in_features + 8), qw)


def test_rows_with_a_tuned_half2_config_take_the_gemv(monkeypatch):
    """Past GEMV_MAX_M, row counts that quant_gemv.TUNED gives a half2 config (4-bit GPTQ, up to 4 rows) still run
    the GEMV; 8-bit GPTQ at the same rows runs the fused kernel."""
    monkeypatch.setenv("NVLLM_KERNELS", "triton")
    monkeypatch.setattr(QG, "GEMV_MAX_M", 2)
    for case, rows, want in ((CASES[2], 3, "triton w4a16 gptq gemv"), (CASES[2], 4, "triton w4a16 gptq gemv"),
                             (CASES[5], 4, "triton w8a16 gptq")):
        qw = make_weight(*case)
        x = torch.randn(rows, qw.in_features)
        report.reset()
        y = QG.quant_linear(x, qw)
        assert report.snapshot() == {"quant_gemm": {want: 1}}, (case[0], rows)
        check(y, semantic_ref(x, qw, None), 2e-3 if "gemv" in want else TIGHT[torch.float32])
    monkeypatch.setattr(QG, "GEMV_MAX_M", 0)                   # 0 turns the GEMV off, tuned rows included
    qw = make_weight(*CASES[2])
    report.reset()
    QG.quant_linear(torch.randn(1, qw.in_features), qw)
    assert report.snapshot() == {"quant_gemm": {"triton w4a16 gptq": 1}}
