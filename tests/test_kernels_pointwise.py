"""Triton RMSNorm (plain and with the fused residual add), rotary embedding and SiLU·mul kernels against their
torch references, on the CPU under the Triton interpreter.

Outputs are poisoned with NaN before the kernel runs (the kernels take ``out=`` buffers), so an unwritten
element shows up as NaN; strided inputs are views of a wider buffer whose unused columns hold NaN, so a read
outside a row shows up too. Rotary works in place: its test checks the returned tensors are the caller's and
that the rest of the fused qkv buffer (v and padding) is left bit-for-bit as it was.
The last test runs a tiny Qwen3 through the engine with every kernel forced to Triton (interpreted) and
checks the greedy tokens equal the torch path's.

Tolerances (max |kernel − reference| ≤ atol + rtol·|reference|):
  fp32: atol 1e-6, rtol 1e-6 (RMSNorm sums the row in another order; exp may differ by an ulp);
  fp16: one fp16 ulp, rtol 1e-3 (the 16-bit steps round exactly as the reference does; an fp32 difference
        in the last bit may flip one rounding);
  bf16: two bf16 ulps, rtol 1.6e-2 — the 3.9 interpreter converts fp32 → bf16 by truncation (the GPU
        rounds to nearest even, as torch does), so under the interpreter bf16 cannot match bit-for-bit.
The fused residual add is exact in fp32/fp16 and within one bf16 ulp (truncation) in bf16.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel module is imported

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from nvllm.kernels import report  # noqa: E402
from nvllm.kernels.activation import (  # noqa: E402
    deinterleave_columns, interleave_rows, silu_and_mul, silu_and_mul_reference, silu_and_mul_triton)
from nvllm.kernels.rmsnorm import (  # noqa: E402
    fused_add_rms_norm, fused_add_rms_norm_reference, fused_add_rms_norm_triton, rms_norm, rms_norm_reference,
    rms_norm_triton)
from nvllm.kernels.rotary import apply_rotary, apply_rotary_reference, apply_rotary_triton  # noqa: E402
from nvllm.layers.norm import RMSNorm  # noqa: E402
from nvllm.layers.rotary import RotaryEmbedding  # noqa: E402

DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in (torch.float32, torch.float16, torch.bfloat16)]
TOL = {torch.float32: (1e-6, 1e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1.6e-2, 1.6e-2)}
EPS = 1e-6


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None):
    assert not torch.isnan(actual).any(), "unwritten (NaN-poisoned) elements"
    atol, rtol = TOL[dtype or expected.dtype]
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def _nan(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype)


def _weight(n, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (1.0 + 0.2 * torch.randn(n, generator=g)).to(dtype)


# ------------------------------------------------------------------------------------------------ RMSNorm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [72, 172])
@pytest.mark.parametrize("tokens", [1, 5])
def test_rms_norm(dtype, hidden, tokens):
    torch.manual_seed(0)
    x = (2.0 * torch.randn(tokens, hidden)).to(dtype)
    w = _weight(hidden, dtype)
    x0 = x.clone()
    out = rms_norm_triton(x, w, EPS, out=_nan((tokens, hidden), dtype))
    _close(out, rms_norm_reference(x, w, EPS))
    assert torch.equal(x, x0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [72, 172])
@pytest.mark.parametrize("tokens", [1, 5])
def test_fused_add_rms_norm(dtype, hidden, tokens):
    torch.manual_seed(0)
    x = (2.0 * torch.randn(tokens, hidden)).to(dtype)
    residual = (3.0 * torch.randn(tokens, hidden)).to(dtype)
    w = _weight(hidden, dtype)
    x0, r0 = x.clone(), residual.clone()
    normed, new_res = fused_add_rms_norm_triton(x, residual, w, EPS, out=_nan((tokens, hidden), dtype),
                                                residual_out=_nan((tokens, hidden), dtype))
    ref_normed, ref_res = fused_add_rms_norm_reference(x, residual, w, EPS)
    assert not torch.isnan(new_res).any()
    if dtype == torch.bfloat16:  # the interpreter truncates fp32 -> bf16: at most one ulp away
        torch.testing.assert_close(new_res, ref_res, atol=0, rtol=2 ** -7)
    else:
        assert torch.equal(new_res, ref_res)
    _close(normed, ref_normed)
    _close(normed, rms_norm_reference(new_res, w, EPS))  # the norm of the residual it wrote
    assert torch.equal(x, x0) and torch.equal(residual, r0)


def test_fused_add_rms_norm_dispatch_residual_out(monkeypatch):
    """The dispatch writes the new residual into ``residual_out`` on either path."""
    x, residual, w = torch.randn(3, 64), torch.randn(3, 64), _weight(64, torch.float32)
    ref_normed, ref_res = fused_add_rms_norm_reference(x, residual, w, EPS)
    for kernels in ("torch", "triton"):
        monkeypatch.setenv("NVLLM_KERNELS", kernels)
        buf = _nan((3, 64), torch.float32)
        normed, new_res = fused_add_rms_norm(x, residual, w, EPS, residual_out=buf)
        assert new_res.data_ptr() == buf.data_ptr()
        torch.testing.assert_close(buf, ref_res)
        _close(normed, ref_normed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_strided_heads(dtype):
    """Qwen3's per-head q_norm: x is a [T, H, D] view of a wider buffer (the fused qkv output)."""
    torch.manual_seed(0)
    tokens, heads, head_dim, width = 5, 3, 40, 3 * 40 + 56
    buf = _nan((tokens, width), dtype)
    buf[:, :heads * head_dim] = torch.randn(tokens, heads * head_dim).to(dtype)
    q = buf[:, :heads * head_dim].view(tokens, heads, head_dim)
    w = _weight(head_dim, dtype)
    out = rms_norm_triton(q, w, EPS, out=_nan((tokens, heads, head_dim), dtype))
    assert out.shape == q.shape
    _close(out, rms_norm_reference(q, w, EPS))


def test_rms_norm_weight_dtype_promotes():
    """fp32 weight on an fp16 input: the output is fp32, as `weight * normed.to(fp16)` is in torch."""
    torch.manual_seed(0)
    x = torch.randn(5, 72).half()
    w = _weight(72, torch.float32)
    out = rms_norm_triton(x, w, EPS)
    ref = rms_norm_reference(x, w, EPS)
    assert out.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------------------------------------- rotary


def _qkv(tokens, heads, kv_heads, head_dim, dtype, pad=24):
    """A fused qkv buffer whose v part and padding hold NaN, and its q/k views."""
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    buf = _nan((tokens, q_size + 2 * kv_size + pad), dtype)
    buf[:, :q_size + kv_size] = torch.randn(tokens, q_size + kv_size).to(dtype)
    q = buf[:, :q_size].view(tokens, heads, head_dim)
    k = buf[:, q_size:q_size + kv_size].view(tokens, kv_heads, head_dim)
    return buf, q, k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (6, 1, 40), (3, 3, 16)])
def test_rotary(dtype, tokens, heads, kv_heads, head_dim):
    torch.manual_seed(0)
    rope = RotaryEmbedding(head_dim, max_position=96, theta=10000.0, scaling=None)
    positions = torch.tensor([57, 3, 90, 0, 31][:tokens], dtype=torch.int64)  # not sorted
    buf, q, k = _qkv(tokens, heads, kv_heads, head_dim, dtype)
    q_ref, k_ref = apply_rotary_reference(q.clone(), k.clone(), positions, rope.cos, rope.sin)
    tail = buf[:, q.shape[1] * head_dim + k.shape[1] * head_dim:].clone()

    q_out, k_out = apply_rotary_triton(q, k, positions, rope.cos, rope.sin)
    assert q_out is q and k_out is k  # in place, into the caller's views
    _close(q_out, q_ref)
    _close(k_out, k_ref)
    rest = buf[:, q.shape[1] * head_dim + k.shape[1] * head_dim:]
    assert torch.equal(rest.isnan(), tail.isnan()) and rest.isnan().all()  # v and padding untouched


def test_rotary_reference_is_the_rotate_half_formula():
    """The reference (in place) against the rotate-half formula written out, with llama3-scaled tables."""
    torch.manual_seed(0)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}
    rope = RotaryEmbedding(32, max_position=64, theta=500000.0, scaling=scaling)
    positions = torch.tensor([9, 2, 40], dtype=torch.int64)
    q, k = torch.randn(3, 4, 32), torch.randn(3, 2, 32)

    def rotate_half(x):
        return torch.cat((-x[..., 16:], x[..., :16]), dim=-1)

    cos = torch.cat([rope.cos[positions]] * 2, -1).unsqueeze(1)
    sin = torch.cat([rope.sin[positions]] * 2, -1).unsqueeze(1)
    expect_q, expect_k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    q_out, k_out = rope(positions, q, k)
    assert q_out is q and k_out is k
    torch.testing.assert_close(q_out, expect_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_out, expect_k, atol=1e-6, rtol=1e-6)


# ---------------------------------------------------------------------------------------------- SiLU·mul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [72, 172, 1100])  # 1100: two column blocks, the second masked
@pytest.mark.parametrize("tokens", [1, 5])
def test_silu_and_mul(dtype, inter, tokens):
    torch.manual_seed(0)
    x = (3.0 * torch.randn(tokens, 2 * inter)).to(dtype)
    out = silu_and_mul_triton(x, out=_nan((tokens, inter), dtype))
    _close(out, silu_and_mul_reference(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [172, 1028])
def test_silu_and_mul_interleaved(dtype, inter):
    """A gate_up output whose weight rows were interleaved in blocks of 4: the same result as the plain layout."""
    torch.manual_seed(0)
    plain = (3.0 * torch.randn(3, 2 * inter)).to(dtype)
    mixed = interleave_rows(plain.t(), 4).t().contiguous()     # the columns a row-interleaved weight yields
    assert torch.equal(deinterleave_columns(mixed, 4), plain)
    assert torch.equal(silu_and_mul_reference(mixed, 4), silu_and_mul_reference(plain))
    out = silu_and_mul_triton(mixed, out=_nan((3, inter), dtype), interleave=4)
    assert torch.equal(out, silu_and_mul_triton(plain))


def test_silu_and_mul_strided_rows():
    torch.manual_seed(0)
    buf = _nan((5, 2 * 172 + 8), torch.float32)
    buf[:, :2 * 172] = torch.randn(5, 2 * 172)
    x = buf[:, :2 * 172]
    _close(silu_and_mul_triton(x), silu_and_mul_reference(x))


# ------------------------------------------------------------------------------------ empty batch, dispatch


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_tokens(dtype):
    w = _weight(72, dtype)
    x = torch.empty(0, 72, dtype=dtype)
    assert rms_norm_triton(x, w, EPS).shape == (0, 72)
    normed, res = fused_add_rms_norm_triton(x, x.clone(), w, EPS)
    assert normed.shape == res.shape == (0, 72)
    rope = RotaryEmbedding(16, 8, 10000.0, None)
    q, k = torch.empty(0, 4, 16, dtype=dtype), torch.empty(0, 2, 16, dtype=dtype)
    q_out, k_out = apply_rotary_triton(q, k, torch.empty(0, dtype=torch.int64), rope.cos, rope.sin)
    assert q_out.shape == (0, 4, 16) and k_out.shape == (0, 2, 16)
    assert silu_and_mul_triton(torch.empty(0, 144, dtype=dtype)).shape == (0, 72)


def _delta(before, after):
    return {(op, impl): n - before.get(op, {}).get(impl, 0)
            for op, impls in after.items() for impl, n in impls.items() if n != before.get(op, {}).get(impl, 0)}


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_dispatch_and_layers(monkeypatch, backend):
    """The layers go through the dispatch: forced Triton equals the torch path, and the report says which
    implementation ran."""
    torch.manual_seed(0)
    tokens, heads, kv_heads, head_dim, hidden = 5, 4, 2, 16, 72
    norm = RMSNorm(hidden, EPS, torch.float32)
    norm.weight.data = _weight(hidden, torch.float32)
    rope = RotaryEmbedding(head_dim, 64, 10000.0, None)
    x, residual = torch.randn(tokens, hidden), torch.randn(tokens, hidden)
    gate_up = torch.randn(tokens, 2 * hidden)
    positions = torch.tensor([7, 1, 33, 2, 60])
    _, q, k = _qkv(tokens, heads, kv_heads, head_dim, torch.float32)
    expect = (rms_norm_reference(x, norm.weight, EPS), *fused_add_rms_norm_reference(x, residual, norm.weight, EPS),
              *apply_rotary_reference(q.clone(), k.clone(), positions, rope.cos, rope.sin),
              silu_and_mul_reference(gate_up))

    monkeypatch.setenv("NVLLM_KERNELS", backend)
    before = report.snapshot()
    got = (norm(x), *norm(x, residual), *rope(positions, q, k), silu_and_mul(gate_up))
    for g, e in zip(got, expect):
        _close(g, e)
    impl = "triton" if backend == "triton" else "torch"
    delta = _delta(before, report.snapshot())
    ops = {op for op, _ in delta}
    assert ops == {"rms_norm", "fused_add_rms_norm", "rotary", "silu_and_mul"}, delta
    assert all(name.startswith(impl) for _, name in delta), delta
    # the public entry points are the same functions the layers call
    assert norm.forward.__func__.__globals__["rms_norm"] is rms_norm
    assert norm.forward.__func__.__globals__["fused_add_rms_norm"] is fused_add_rms_norm
    assert rope.forward.__func__.__globals__["apply_rotary"] is apply_rotary


def test_engine_greedy_same_on_forced_triton(monkeypatch, tmp_path):
    """A tiny Qwen3 (per-head q/k norm on strided qkv views, in-place rotary, GQA) through the whole engine:
    greedy tokens with every kernel forced to Triton (interpreted) equal the torch path's."""
    from nvllm import SamplingParams
    from tests.conftest import build_tiny_model, make_llm

    path = build_tiny_model("qwen3", tmp_path / "qwen3")
    prompt = [1, 45, 300, 12, 99, 7, 250, 31, 400, 18, 77, 5]
    tokens = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("NVLLM_KERNELS", backend)
        llm = make_llm(str(path))
        out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
        tokens[backend] = out[0].outputs[0].token_ids
    assert len(tokens["torch"]) == 8 and tokens["triton"] == tokens["torch"]
