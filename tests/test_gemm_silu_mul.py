"""SiLU·mul fused into the skinny GEMM's operand loads (``skinny_gemm(..., silu_mul=True)``, ``gemm_silu_mul``,
``Linear.forward_silu_mul``), run by Triton's CPU interpreter.

The fused kernel must equal the unfused Triton pair (``silu_and_mul_triton`` then ``skinny_gemm`` with the same
config) bit for bit — the interpreter computes both in the same order, so any difference would be a rounding
step missing or added — and be close to the torch reference ``F.linear(silu_and_mul_reference(x), W, b)``.
Tolerances against that reference (relative to the largest |output|): fp32 1e-5, fp16 2e-3, bf16 2e-2 (the
interpreter truncates fp32 → bf16 instead of rounding to nearest, both for the activation and for the output,
so bf16 errors are biased: up to ~2 ulp of 2^-7; on the GPU they round).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is jitted

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from nvllm.kernels import activation as A  # noqa: E402
from nvllm.kernels import gemm as G  # noqa: E402
from nvllm.kernels import report  # noqa: E402

for _kernel, _jit in ((G._skinny_gemm_kernel, G._jit), (A._silu_and_mul_kernel, A._jit)):
    if not isinstance(_jit(_kernel), InterpretedFunction):
        _jit.cache_clear()  # jitted for a GPU before TRITON_INTERPRET was set: jit again for the interpreter

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}

CONFIGS = {
    "fma-deferred": G.SkinnyConfig("fma", 16, 64, split_k=1),
    "fma-perstep-split3": G.SkinnyConfig("fma", 32, 64, split_k=3, num_warps=1, num_stages=2),
    "mma": G.SkinnyConfig("mma", 16, 32, split_k=1, num_stages=2),
    "mma-split4": G.SkinnyConfig("mma", 32, 32, split_k=4),
}
# (dtype, N, K, bias, strided gate_up): K=100 is a multiple of neither 16 nor any BLOCK_K (ragged tail, and the
# up half starts at an unaligned column); K=128 takes the unmasked EVEN_K loads; strided: gate_up is a view
# into wider rows (a row stride > 2K)
SHAPES = [
    (torch.float32, 40, 100, True, False),
    (torch.float16, 24, 128, False, True),
    (torch.bfloat16, 40, 100, True, True),
]


def _inputs(M, N, K, dtype, bias, strided, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pad = 6 if strided else 0
    x = (torch.randn(M, 2 * K + pad, generator=gen) * 2).to(dtype)
    x = x[:, 1:1 + 2 * K] if strided else x
    w = torch.randn(N, K, generator=gen).to(dtype)
    b = torch.randn(N, generator=gen).to(dtype) if bias else None
    return x, w, b


def _check_reference(y, x, w, b):
    ref = F.linear(A.silu_and_mul_reference(x).float(), w.float(), None if b is None else b.float())
    assert not torch.isnan(y).any(), "an output was never written"
    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
    assert err <= TOL[x.dtype], err


def _poison_workspaces():
    for partials, locks in G._workspaces.values():
        partials.fill_(float("nan"))
        assert int(locks.abs().sum()) == 0, "a split-K arrival counter was not re-armed"


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype,N,K,bias,strided", SHAPES, ids=["fp32-K100", "fp16-K128", "bf16-K100"])
def test_fused_kernel_equals_silu_and_mul_then_gemm(name, dtype, N, K, bias, strided):
    cfg = CONFIGS[name]
    for M in range(1, 17):
        x, w, b = _inputs(M, N, K, dtype, bias, strided, seed=M)
        assert x.stride(0) == 2 * K + (6 if strided else 0)
        _poison_workspaces()
        out = torch.full((M, N), float("nan"), dtype=dtype)
        y = G.skinny_gemm(x, w, b, cfg, out=out, silu_mul=True)
        assert y is out
        unfused = G.skinny_gemm(A.silu_and_mul_triton(x), w, b, cfg)
        assert torch.equal(y, unfused), (M, (y.float() - unfused.float()).abs().max().item())
        _check_reference(y, x, w, b)
    _poison_workspaces()  # every counter back to 0


def test_fused_split_k_is_deterministic_and_matches_unsplit():
    x, w, b = _inputs(5, 72, 160, torch.float32, True, False, seed=3)
    split = G.SkinnyConfig("mma", 32, 32, split_k=5)
    y1 = G.skinny_gemm(x, w, b, split, silu_mul=True)
    y2 = G.skinny_gemm(x, w, b, split, silu_mul=True)
    assert torch.equal(y1, y2)
    y0 = G.skinny_gemm(x, w, b, G.SkinnyConfig("mma", 32, 32, split_k=1), silu_mul=True)
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-5)
    _check_reference(y1, x, w, b)


def test_fused_kernel_rejects_bad_shapes():
    cfg = CONFIGS["mma"]
    with pytest.raises(ValueError, match="even number of columns"):
        G.skinny_gemm(torch.randn(2, 7), torch.randn(8, 3), None, cfg, silu_mul=True)
    with pytest.raises(ValueError, match="after silu·mul"):
        G.skinny_gemm(torch.randn(2, 16), torch.randn(8, 16), None, cfg, silu_mul=True)


# ----------------------------------------------------------------------------------------------- dispatch


@pytest.fixture
def table(monkeypatch):
    monkeypatch.setenv("NVLLM_KERNELS", "triton")  # Triton path on the CPU (interpreter)
    G.clear_gemm_table()
    report.reset()
    yield G.gemm_table()
    G.clear_gemm_table()
    report.reset()


def test_dispatch_fuses_where_gemm_runs_the_skinny_kernel(table):
    cfg = G.SkinnyConfig("fma", 16, 64, split_k=2)
    G.set_gemm_choice(40, 100, 4, torch.float32, cfg)       # bucket 4: M = 3 and 4
    x, w, b = _inputs(3, 40, 100, torch.float32, True, False)
    y = G.gemm_silu_mul(x, w, b)
    assert report.snapshot() == {"gemm": {cfg.describe(fused="silu·mul"): 1}}
    assert cfg.describe(fused="silu·mul").startswith("triton skinny (silu·mul fused, BLOCK_N=16 ")
    assert torch.equal(y, G.skinny_gemm(A.silu_and_mul_triton(x), w, b, cfg))
    _check_reference(y, x, w, b)

    report.reset()                                          # leading dims: [2, 2, 2K] → M = 4, same bucket
    x4 = _inputs(4, 40, 100, torch.float32, False, False)[0].view(2, 2, 200)
    y4 = G.gemm_silu_mul(x4, w)
    assert y4.shape == (2, 2, 40)
    assert report.snapshot() == {"gemm": {cfg.describe(fused="silu·mul"): 1}}
    _check_reference(y4.reshape(4, 40), x4.reshape(4, 200), w, None)


def test_dispatch_falls_back_to_the_unfused_pair(table, monkeypatch):
    cfg = G.SkinnyConfig("mma", 16, 32)
    for m in (1, G.MAX_TUNED_M):
        G.set_gemm_choice(40, 100, m, torch.float32, cfg)
    G.set_gemm_choice(40, 100, 2, torch.float32, G.CUBLAS)
    w = torch.randn(40, 100)
    unfused = {"silu_and_mul": {"triton silu_and_mul": 1}, "gemm": {"torch F.linear (cpu)": 1}}
    cases = [
        (G.MAX_TUNED_M + 1, torch.float32),   # past the M limit: never the skinny kernel
        (2, torch.float32),                   # the table says cuBLAS
        (8, torch.float32),                   # untuned bucket
        (1, torch.float16),                   # untuned dtype
    ]
    for m, dtype in cases:
        report.reset()
        x = _inputs(m, 40, 100, dtype, False, False, seed=m)[0]
        y = G.gemm_silu_mul(x, w.to(dtype))
        assert report.snapshot() == unfused, (m, dtype)
        assert torch.equal(y, F.linear(A.silu_and_mul_triton(x), w.to(dtype)))

    # the torch override (and a CPU tensor under auto): the torch reference, bit for bit
    for kernels in ("torch", "auto"):
        monkeypatch.setenv("NVLLM_KERNELS", kernels)
        report.reset()
        x, w16, b16 = _inputs(1, 40, 100, torch.bfloat16, True, False)
        y = G.gemm_silu_mul(x, w16, b16)
        assert report.snapshot() == {"silu_and_mul": {"torch reference": 1}, "gemm": {"torch F.linear (cpu)": 1}}
        assert torch.equal(y, G.gemm_silu_mul_reference(x, w16, b16))

    with pytest.raises(ValueError, match="even number of columns"):
        G.gemm_silu_mul(torch.randn(1, 9), w)


# ------------------------------------------------------------------------------------------------ layers


class _FakeTP:
    """A two-rank group whose other rank contributes ``peer`` to every all-reduce."""

    size = 2

    def __init__(self, peer: torch.Tensor):
        self.peer, self.calls = peer, 0

    def all_reduce(self, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return y + self.peer


@pytest.mark.parametrize("tp", [False, True], ids=["single", "row-parallel-tp2"])
def test_linear_forward_silu_mul(table, tp):
    from nvllm.distributed.partition import LinearShard, Part
    from nvllm.layers.linear import Linear

    K, N, M = 100, 40, 3
    x, w, b = _inputs(M, N, K, torch.float32, True, False, seed=7)
    group = _FakeTP(torch.randn(M, N)) if tp else None
    shard = LinearShard(inputs=Part(0, K, 2 * K)) if tp else None
    lin = Linear(K, N, bias=True, dtype=torch.float32, shard=shard, tp=group)
    lin.weight.data.copy_(w)
    lin.bias.data.copy_(b)
    cfg = G.SkinnyConfig("mma", 16, 32, split_k=2)
    G.set_gemm_choice(N, K, M, torch.float32, cfg)

    y = lin.forward_silu_mul(x)
    assert report.snapshot()["gemm"] == {cfg.describe(fused="silu·mul"): 1}
    want = lin(A.silu_and_mul_triton(x))        # the unfused pair through forward: same partial, same reduce
    assert torch.equal(y, want)
    partial = F.linear(A.silu_and_mul_reference(x), w)
    ref = (partial + group.peer if tp else partial) + b    # the bias once, after the sum
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    if tp:
        assert group.calls == 2


def test_quant_linear_forward_silu_mul_falls_back():
    from nvllm.layers.quant_linear import QuantLinear
    from nvllm.quant.plan import QuantScheme

    layer = QuantLinear(64, 32, False, None, QuantScheme("awq", 4, 32), dtype=torch.float32)
    layer.init_dummy(torch.Generator().manual_seed(0))
    x = torch.randn(2, 128)
    assert torch.equal(layer.forward_silu_mul(x), layer(A.silu_and_mul(x)))
