"""W8A8 FP8 (``nvllm.kernels.fp8_w8a8``) on the CPU: the Triton token quantizer under the interpreter gives torch's
e4m3 bytes exactly (ties to even, subnormals), the product through ``torch._scaled_mm`` (its CPU build) equals its
torch reference, and ``fp8_linear`` hands it many rows of a weight with one scale a row and names it."""

from __future__ import annotations


import pytest
import torch

from nvllm.kernels import report
from nvllm.quant.fp8 import FP8_DTYPE, FP8_MAX, quantize_rows
from tests.conftest import interpreted_kernels


@pytest.fixture()
def w8a8(monkeypatch):
    return interpreted_kernels(monkeypatch, "fp8_w8a8", "_quantize_tokens_kernel")


def _every_e4m3_value_and_midpoint() -> torch.Tensor:
    """All finite e4m3 magnitudes, the midpoints between neighbours (ties), points just off them, and values under
    half the smallest subnormal, both signs, in one row whose largest magnitude is 448 (its scale is 1)."""
    mags = torch.arange(0, 127, dtype=torch.uint8).view(FP8_DTYPE).float()   # codes 0..126: 0 to 448
    mid = (mags[:-1] + mags[1:]) / 2
    off = torch.cat([mid * (1 + 2 ** -20), mid * (1 - 2 ** -20)])
    tiny = torch.tensor([2.0 ** -10, 3 * 2.0 ** -11, 2.0 ** -12, 2.0 ** -30, 1e-40])   # 1e-40: an fp32 subnormal
    row = torch.cat([mags, mid, off, tiny])
    return torch.cat([row, -row])


def test_token_quantizer_gives_torch_bytes_exactly(w8a8):
    row = _every_e4m3_value_and_midpoint()
    q, s = w8a8.quantize_tokens(row[None])
    want_q, want_s = w8a8.quantize_tokens_reference(row[None])
    assert float(s) == float(want_s) == 1.0
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    # random rows of several dtypes and widths (a ragged last block), an all-zero row, a bf16 input
    gen = torch.Generator().manual_seed(0)
    for dtype, k in ((torch.float32, 200), (torch.bfloat16, 256), (torch.float16, 96)):
        x = (torch.randn(5, k, generator=gen) * torch.logspace(-3, 2, 5)[:, None]).to(dtype)
        x[2] = 0
        q, s = w8a8.quantize_tokens(x)
        want_q, want_s = w8a8.quantize_tokens_reference(x)
        assert q.dtype == FP8_DTYPE and s.shape == (5, 1)
        assert torch.equal(s, want_s) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert float(w8a8.quantize_tokens(torch.zeros(1, 32))[1]) == torch.tensor(w8a8.MIN_SCALE).item()
    x = torch.randn(2, 4096, generator=gen) * 3          # the widest row it takes
    q, s = w8a8.quantize_tokens(x)
    want_q, want_s = w8a8.quantize_tokens_reference(x)
    assert torch.equal(s, want_s) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    with pytest.raises(ValueError, match="at most 4096"):
        w8a8.quantize_tokens(torch.zeros(1, 4097))


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # numpy's, dividing by inf / NaN
def test_token_quantizer_keeps_nans_and_infinities_as_torch(w8a8):
    """Triton's max and min drop NaNs; torch's amax and clamp keep them. A NaN makes its whole row NaN (scale and
    bytes), an infinity an infinite scale (the row's finite values 0, the infinity itself NaN): as the reference,
    so an overflow upstream shows instead of being clamped to ±448."""
    nan, inf = float("nan"), float("inf")
    x = torch.tensor([[1.0, nan, -2.0, 3.0], [1.0, -inf, 2.0, 0.5], [1.0, 2.0, 3.0, 4.0]])
    q, s = w8a8.quantize_tokens(x)
    want_q, want_s = w8a8.quantize_tokens_reference(x)
    torch.testing.assert_close(s, want_s, equal_nan=True)
    assert torch.isnan(s[0]).all() and torch.isinf(s[1]).all()
    got, want = q.float(), want_q.float()
    assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.isnan(got[0]).all()
    assert torch.equal(got[~torch.isnan(got)], want[~torch.isnan(want)])   # NaN bytes: 0x7F whatever the sign
    assert set(q.view(torch.uint8)[torch.isnan(got)].tolist()) == {0x7F}


def test_w8a8_product_equals_its_reference_and_stays_near_w8a16(w8a8):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(48, 160, generator=gen) * 0.05
    q, s = quantize_rows(w)                        # one scale a row: [48, 1]
    x = (torch.randn(7, 160, generator=gen) * 2).to(torch.bfloat16)
    b = torch.randn(48, generator=gen).to(torch.bfloat16)
    assert w8a8.w8a8_supported(x, q, 160)
    y = w8a8.w8a8_linear(x, q, s, b)
    ref = w8a8.w8a8_reference(x, q, s, b).float()
    assert y.dtype == torch.bfloat16 and y.shape == (7, 48)
    assert float((y.float() - ref).abs().max()) <= 8e-3 * float(ref.abs().max())   # bf16 rounding of the output
    exact = torch.nn.functional.linear(x.float(), q.float() * s, b.float())        # activations unrounded
    assert float((y.float() - exact).abs().max()) <= 0.05 * float(exact.abs().max())
    # what it refuses: block scales, activations other than bf16, sides not multiples of 16
    qb, sb = quantize_rows(w, 32)
    assert not w8a8.w8a8_supported(x, qb, 32)
    assert not w8a8.w8a8_supported(x.half(), q, 160)
    assert not w8a8.w8a8_supported(x[:, :150], quantize_rows(w[:, :150])[0], 150)
    wide = torch.zeros(16, 4112, dtype=FP8_DTYPE)                                 # rows past MAX_ROW
    assert not w8a8.w8a8_supported(torch.zeros(2, 4112, dtype=torch.bfloat16), wide, 4112)


def test_fp8_linear_hands_many_rows_to_w8a8_and_names_it(w8a8, monkeypatch):
    """From ``W8A8_LARGE_M`` rows a weight with one scale a row takes the per-token product (no block-wise scales
    here: below that, the W8A16 kernel)."""
    from nvllm.kernels import fp8_gemm as G

    gen = torch.Generator().manual_seed(2)
    q, s = quantize_rows(torch.randn(32, 64, generator=gen) * 0.05)
    x = torch.randn(6, 64, generator=gen).to(torch.bfloat16)
    monkeypatch.setattr(G, "w8a8_linear", w8a8.w8a8_linear)   # the interpreted module's
    monkeypatch.setattr(G, "W8A8_MIN_M", 2)
    monkeypatch.setattr(G, "W8A8_LARGE_M", 4)
    monkeypatch.setattr(G, "DEQUANT_MATMUL_MIN_M", 10 ** 9)
    monkeypatch.setenv("NVLLM_KERNELS", "triton")
    report.reset()
    y = G.fp8_linear(x, q, s, 64)
    assert torch.equal(y, w8a8.w8a8_linear(x, q, s))
    G.fp8_linear(x[:2], q, s, 64)                   # fewer rows: the W8A16 kernel
    monkeypatch.setattr(G, "W8A8_MIN_M", 0)         # off
    G.fp8_linear(x, q, s, 64)
    assert report.snapshot()["fp8_gemm"] == {"fp8 w8a8 (per-token activations) torch._scaled_mm": 1,
                                             "triton w8a16 fp8": 2}
    assert FP8_MAX == 448.0


_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nvllm.kernels.fp8_w8a8 import MIN_SCALE, _quantize_tokens_kernel
sig = {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp32", "K": "i32", "stride_xm": "i32", "stride_qm": "i32",
       "MIN_S": "constexpr", "BLOCK": "constexpr"}
for block in (256, 4096):
    src = ASTSource(fn=_quantize_tokens_kernel, signature=sig, constexprs={(6,): MIN_SCALE, (7,): block})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
    assert "div.rn.f32" in ptx and "div.full.f32" not in ptx, block   # IEEE divisions: torch's scales and bytes
from nvllm.kernels.fp8_w8a8 import GROUP, GROUPS_PER_PROGRAM, _quantize_groups_kernel
sig = {"x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp32", "K": "i32", "G": "i32", "stride_xm": "i32",
       "stride_qm": "i32", "stride_sm": "i32", "stride_sg": "i32", "MIN_S": "constexpr", "GROUP": "constexpr",
       "GROUPS": "constexpr"}
src = ASTSource(fn=_quantize_groups_kernel, signature=sig,
                constexprs={(9,): MIN_SCALE, (10,): GROUP, (11,): GROUPS_PER_PROGRAM})
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
assert "div.rn.f32" in ptx and "div.full.f32" not in ptx
print("compiled")
"""


def test_quantizers_compile_for_hopper_with_ieee_divisions():
    """The interpreter divides as numpy does; on the GPU Triton's default fp32 division may miss by an ulp, which
    would move bytes at ties: the kernel asks for round-to-nearest divisions, checked in its sm_90 PTX."""
    from tests.test_quant_gemv_kernel import compile_for_hopper

    compile_for_hopper(_COMPILE, "compiled")


def test_the_hopper_probe_runs_once_a_device_and_never_inside_a_capture(w8a8, monkeypatch):
    """W8A8 runs on Hopper only, where small row-wise and block-wise ``_scaled_mm`` products are tried once a device
    and kind; inside a CUDA graph capture the answer is no and nothing is tried or remembered (a failing try would
    end the capture)."""
    calls = []
    dev = torch.device("cuda", 0)
    monkeypatch.setattr(w8a8, "_PROBED", {})
    monkeypatch.setattr(w8a8, "_probe", lambda index, kind: calls.append((index, kind)) or True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not w8a8.scaled_mm_runs(dev, "row") and calls == [] and w8a8._PROBED == {}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert w8a8.scaled_mm_runs(dev, "row") and w8a8.scaled_mm_runs(dev, "row") and calls == [(0, "row")]
    assert w8a8.scaled_mm_runs(dev, "block") and calls == [(0, "row"), (0, "block")]
    monkeypatch.undo()
    for capability in ((8, 9), (10, 0), (12, 0)):   # FP8 tensor cores, but not timed (or refused by torch)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, c=capability: c)
        assert not w8a8._probe(0, "row") and not w8a8._probe(0, "block")


# ------------------------------------------------------------------ activations per token and 128 inputs


_SCALED_MM = torch._scaled_mm


def emulated_block_scaled_mm(a, b, scale_a, scale_b, bias=None, out_dtype=None):
    """``torch._scaled_mm`` with block-wise scales, as its CUDA build takes them (no CPU build does): the shapes and
    strides its checks ask for (1×128 scales outer-dim-major, 128×128 ones inner-dim-major), then the product of
    the dequantized operands in fp32, the bias added before the one rounding."""
    M, K = a.shape
    N = b.shape[1]
    G = -(-K // 128)
    if scale_a.shape == (M, 1) and scale_b.shape == (1, N):               # row-wise: the CPU build runs it
        return _SCALED_MM(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype)
    assert K % 16 == 0 and N % 16 == 0 and a.stride(1) == 1
    assert scale_a.dtype == scale_b.dtype == torch.float32 and (bias is None or bias.dtype == out_dtype)
    assert a.dtype == b.dtype == FP8_DTYPE and b.stride(0) == 1          # row-major times column-major
    assert scale_a.shape == (M, G) and (M == 1 or scale_a.stride(0) == 1) and (G == 1 or scale_a.stride(1) == M)
    assert M % 4 == 0                                                      # 16-byte columns (an H100 refused 257)
    wt = scale_b.t()
    if wt.shape == (N, G):                                                 # 1×128 weight scales
        assert (N == 1 or wt.stride(0) == 1) and (G == 1 or wt.stride(1) == N)
        sw = wt.repeat_interleave(128, dim=1)[:, :K]
    else:                                                                  # 128×128 blocks
        assert wt.shape == (-(-N // 128), G) and wt.is_contiguous() and G % 4 == 0
        sw = wt.repeat_interleave(128, dim=0)[:N].repeat_interleave(128, dim=1)[:, :K]
    y = (a.float() * scale_a.repeat_interleave(128, dim=1)[:, :K]) @ (b.t().float() * sw).t()
    return (y if bias is None else y + bias.float()).to(out_dtype)


def test_group_quantizer_gives_torch_bytes_and_the_scale_layout_cublas_takes(w8a8):
    row = _every_e4m3_value_and_midpoint()                                 # 1006 values: 8 groups, the last short
    x = torch.stack([row, row * 3, row.flip(0)])
    x[1, 130] = float("nan")                                               # one group of one row NaN, only it
    q, s = w8a8.quantize_token_groups(x)
    want_q, want_s = w8a8.quantize_token_groups_reference(x)
    assert s.shape == (3, 8) and s.stride() == (1, 3)                      # column by column
    torch.testing.assert_close(s, want_s, equal_nan=True, rtol=0, atol=0)
    assert torch.isnan(s[1, 1]) and not torch.isnan(s[1, [0, 2, 3, 4, 5, 6, 7]]).any()
    got, want = q.view(torch.uint8), want_q.view(torch.uint8)
    nan = torch.isnan(want_q.float())
    assert torch.equal(got[~nan], want[~nan]) and set(got[nan].tolist()) == {0x7F}
    gen = torch.Generator().manual_seed(3)
    for dtype, k in ((torch.bfloat16, 18944), (torch.float16, 48), (torch.float32, 1280)):   # 148 groups; one short
        x = (torch.randn(4, k, generator=gen) * torch.logspace(-3, 2, 4)[:, None]).to(dtype)
        x[:, 128:256] = 0                                                  # an all-zero group: the smallest scale
        q, s = w8a8.quantize_token_groups(x)
        want_q, want_s = w8a8.quantize_token_groups_reference(x)
        assert torch.equal(s, want_s) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
        if k > 128:
            assert float(s[0, 1]) == torch.tensor(w8a8.MIN_SCALE).item()
    assert w8a8.quantize_token_groups(torch.zeros(0, 256))[1].shape == (0, 2)


def _block_weight(n: int, k: int, block: tuple[int, int], gen: torch.Generator):
    from nvllm.quant.fp8 import Fp8Scheme, quantize_blocks, scale_rows

    q, s = quantize_blocks(torch.randn(n, k, generator=gen) * 0.05, block)
    return q, scale_rows(s, Fp8Scheme("block", block), n, k, "w")


def test_block_weight_scales_in_both_layouts_give_the_reference_product(w8a8, monkeypatch):
    """Each weight-scale layout, fed to ``_scaled_mm`` as its CUDA build checks it, gives the reference product:
    128×128 blocks (compact), 128×128 blocks whose rows disagree (a fused layer's shards off the blocks: 1×128),
    256-input blocks and one scale a row (repeated over the groups); 64-input blocks cannot run."""
    monkeypatch.setattr(torch, "_scaled_mm", emulated_block_scaled_mm)
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(5, 512, generator=gen) * 2).to(torch.bfloat16)
    bias = torch.randn(272, generator=gen).to(torch.bfloat16)
    q, s = _block_weight(272, 512, (128, 128), gen)                       # a short last block of rows
    compact = w8a8.block_weight_scales(s, 128, 512, "128x128")
    assert compact.shape == (4, 3) and compact.t().is_contiguous()
    per_group = w8a8.block_weight_scales(s, 128, 512, "1x128")
    assert per_group.shape == (4, 272) and per_group.is_contiguous()
    ref = w8a8.w8a8_block_reference(x, q, s, 128, bias).float()
    exact = torch.nn.functional.linear(x.float(), q.float() * s.repeat_interleave(128, dim=1), bias.float())
    for scales in (compact, per_group):
        y = w8a8.w8a8_block_linear(x, q, scales, bias)
        assert y.dtype == torch.bfloat16 and y.shape == (5, 272)
        assert float((y.float() - ref).abs().max()) <= 8e-3 * float(ref.abs().max())
        assert float((y.float() - exact).abs().max()) <= 0.05 * float(exact.abs().max())   # activations rounded
    wrong = s.clone()
    wrong[:128] *= 2                                                        # a layout read otherwise shows
    for scales in (w8a8.block_weight_scales(wrong, 128, 512, "128x128"), w8a8.block_weight_scales(wrong, 128, 512,
                                                                                                "1x128")):
        y = w8a8.w8a8_block_linear(x, q, scales, bias)
        assert float((y.float() - ref).abs().max()) > 0.1 * float(ref.abs().max())
    shifted = torch.cat([s[:16], s[:-16]])                                 # rows 16 off the 128-row blocks
    assert w8a8.block_weight_scales(shifted, 128, 512, "128x128") is None
    assert w8a8.w8a8_weight_scales(shifted, 128, 512).keys() == {"1x128"}
    q6, s6 = _block_weight(256, 384, (128, 128), gen)                      # 3 groups: rows not 16 bytes a multiple
    assert w8a8.w8a8_weight_scales(s6, 128, 384)["1x128"].shape == (3, 256)
    assert w8a8.block_weight_scales(s6, 128, 384, "128x128") is None
    for block, k in (((256, 256), 640), ((64, 64), 512)):
        qb, sb = _block_weight(128, k, block, gen)
        scales = w8a8.block_weight_scales(sb, block[1], k, "1x128")
        if block[1] % 128:
            assert scales is None and w8a8.w8a8_weight_scales(sb, block[1], k) == {}
            continue
        xb = torch.randn(3, k, generator=gen).to(torch.bfloat16)
        y = w8a8.w8a8_block_linear(xb, qb, scales)
        torch.testing.assert_close(y.float(), w8a8.w8a8_block_reference(xb, qb, sb, block[1]).float(), rtol=8e-3,
                                   atol=1e-3)
    qr, sr = quantize_rows(torch.randn(64, 4352, generator=gen) * 0.05)    # one scale a row, 34 groups
    scales = w8a8.block_weight_scales(sr, 4352, 4352, "1x128")
    assert scales.shape == (34, 64)
    xr = torch.randn(2, 4352, generator=gen).to(torch.bfloat16)
    torch.testing.assert_close(w8a8.w8a8_block_linear(xr, qr, scales).float(),
                               w8a8.w8a8_block_reference(xr, qr, sr, 4352).float(), rtol=8e-3, atol=2e-3)
    # torch's own shape check (its meta function) takes both layouts
    a = torch.empty(8, 512, dtype=FP8_DTYPE, device="meta")
    sa = torch.empty(4, 8, device="meta").t()
    for scales in (compact, per_group):
        b = torch.empty(272, 512, dtype=FP8_DTYPE, device="meta").t()
        assert torch.ops.aten._scaled_mm(a, b, sa, scales.to("meta"), out_dtype=torch.bfloat16).shape == (8, 272)


def test_fp8_linear_and_the_layer_hand_block_scales_to_w8a8_and_name_it(w8a8, monkeypatch):
    """The layer keeps 1×128 weight scales (and its 128×128 blocks where it has them) once loaded; ``fp8_linear``
    runs 1×128 from ``W8A8_MIN_M`` rows, the blocks (or per-token row scales) from ``W8A8_LARGE_M``."""
    from nvllm.kernels import fp8_gemm as G
    from nvllm.layers import fp8_linear as L
    from nvllm.quant.fp8 import Fp8Scheme

    monkeypatch.setattr(torch, "_scaled_mm", emulated_block_scaled_mm)
    for name in ("w8a8_block_linear", "w8a8_block_supported", "w8a8_linear", "w8a8_supported"):
        monkeypatch.setattr(G, name, getattr(w8a8, name))                # the interpreted module's
    monkeypatch.setattr(w8a8, "block_scaled_mm_runs", lambda device: True)
    monkeypatch.setattr(L, "block_scaled_mm_runs", lambda device: True)
    monkeypatch.setattr(G, "W8A8_MIN_M", 4)
    monkeypatch.setattr(G, "W8A8_LARGE_M", 8)
    monkeypatch.setattr(G, "DEQUANT_MATMUL_MIN_M", 10 ** 9)
    monkeypatch.setenv("NVLLM_KERNELS", "triton")
    gen = torch.Generator().manual_seed(5)
    layer = L.Fp8Linear(512, 384, True, None, Fp8Scheme("block", (128, 128)), torch.bfloat16)
    q, s = _block_weight(384, 512, (128, 128), gen)
    layer.weight.data.copy_(q)
    layer.scale.data.copy_(s)
    layer.bias.data.normal_(generator=gen)
    layer.prepare_w8a8()
    scales = layer.w8a8_scales
    assert scales.keys() == {"1x128", "128x128"} and scales["1x128"].shape == (4, 384)
    assert scales["128x128"].shape == (4, 3)
    x = torch.randn(8, 512, generator=gen).to(torch.bfloat16)
    report.reset()
    for rows, layout in ((6, "1x128"), (8, "128x128")):
        y = layer(x[:rows])
        torch.testing.assert_close(y, w8a8.w8a8_block_linear(x[:rows], q, scales[layout], layer.bias), rtol=0,
                                   atol=0)
    layer(x[:2])                                                          # fewer rows: the W8A16 kernel
    block = "fp8 w8a8 (activations per token and 128 inputs, {} weight scales) torch._scaled_mm"
    assert report.snapshot()["fp8_gemm"] == {block.format("1x128"): 1, block.format("128x128"): 1,
                                             "triton w8a16 fp8": 1}
    # one scale a row: 1×128 below W8A8_LARGE_M rows, per token from there where the row is at most 4096 wide
    rows = L.Fp8Linear(256, 64, False, None, Fp8Scheme("channel"), torch.bfloat16)
    wide = L.Fp8Linear(4352, 64, False, None, Fp8Scheme("channel"), torch.bfloat16)
    small = L.Fp8Linear(256, 64, False, None, Fp8Scheme("block", (64, 64)), torch.bfloat16)
    for m in (rows, wide, small):
        m.scale.data.uniform_(1e-3, 2e-3, generator=gen)
        m.prepare_w8a8()
    assert rows.w8a8_scales.keys() == {"1x128"} and rows.w8a8_scales["1x128"].shape == (2, 64)
    assert wide.w8a8_scales["1x128"].shape == (34, 64) and small.w8a8_scales is None
    report.reset()
    for m, k in ((rows, 256), (wide, 4352)):
        xs = torch.randn(8, k, generator=gen).to(torch.bfloat16)
        m(xs[:6])
        m(xs)
    assert report.snapshot()["fp8_gemm"] == {block.format("1x128"): 3,
                                             "fp8 w8a8 (per-token activations) torch._scaled_mm": 1}
    # fp16 activations: the layer keeps no W8A8 scales, and given some, fp8_linear still runs W8A16
    half = L.Fp8Linear(512, 384, False, None, Fp8Scheme("block", (128, 128)), torch.float16)
    half.scale.data.copy_(s)
    half.prepare_w8a8()
    assert half.w8a8_scales is None
    report.reset()
    G.fp8_linear(x.half(), q, s, 128, w8a8_scales=scales)
    assert report.snapshot()["fp8_gemm"] == {"triton w8a16 fp8": 1}
    monkeypatch.setattr(L, "block_scaled_mm_runs", lambda device: False)  # no Hopper GPU: nothing made
    layer.prepare_w8a8()
    assert layer.w8a8_scales is None


def test_the_loader_lays_out_the_w8a8_scales_of_a_128x128_checkpoint(tmp_path, monkeypatch):
    """Loading a Qwen3-FP8-style checkpoint where the block-wise product runs leaves every FP8 layer with its
    1×128 and 128×128 scales (from the checkpoint's blocks), before any CUDA graph is captured."""
    from nvllm.layers import fp8_linear as L
    from tests.conftest import build_tiny_model, make_llm
    from tests.quant_utils import fp8_blocks, write_fp8

    monkeypatch.setattr(L, "block_scaled_mm_runs", lambda device: True)
    base = build_tiny_model("qwen2", tmp_path / "base", hidden_size=512, intermediate_size=512, num_attention_heads=4,
                            num_key_value_heads=2, num_hidden_layers=1)
    path = write_fp8(base, tmp_path / "fp8", {"quant_method": "fp8", "weight_block_size": [128, 128]},
                     fp8_blocks((128, 128)))
    llm = make_llm(str(path), enforce_eager=True, dtype="bfloat16")
    layer = llm.engine.runner.model.layers[0]
    for name, n in (("qkv_proj", 1024), ("o_proj", 512), ("gate_up_proj", 1024), ("down_proj", 512)):
        linear = getattr(layer, name)
        scales = linear.w8a8_scales
        assert scales["1x128"].shape == (4, n) and scales["128x128"].shape == (4, n // 128), name
        want = linear.scale.t()                                                 # [groups, N]: one per row and block
        assert torch.equal(scales["1x128"], want) and torch.equal(scales["128x128"].t(), linear.scale[::128]), name
    llm.close()
