"""A quantized GEMV's split-K sum left to its consumer (``nvllm.kernels.partial_sum``), on the CPU under the Triton
interpreter: the fused residual add + RMSNorm and SiLU·mul finish it to the same values as the finished GEMV's
output (bias included), leave its accumulator zeroed and hand the buffer back; and a GPTQ checkpoint generates
through the engine with its sums finished by the consumers, the greedy tokens HF transformers gives on the
dequantized weights."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nvllm.kernels import partial_sum as P  # noqa: E402
from nvllm.kernels import quant_gemm as QG  # noqa: E402
from nvllm.kernels import report  # noqa: E402
from nvllm.kernels.activation import silu_and_mul  # noqa: E402
from nvllm.kernels.rmsnorm import fused_add_rms_norm  # noqa: E402
from nvllm.quant import formats as F  # noqa: E402

EPS = 1e-6


def _layer(K=128, N=256, group=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    return F.quantize_to_gptq(w, 4, group, sym=False)


def _held(ps: P.PartialSum) -> bool:
    return ps.acc.untyped_storage().data_ptr() in P._HELD


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    monkeypatch.setenv("NVLLM_KERNELS", "triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("M", [1, 3])
def test_fused_add_rms_norm_finishes_the_sum(M, dtype):
    qw = _layer()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(M, qw.in_features, generator=g).to(dtype)
    bias = torch.randn(qw.out_features, generator=g).to(dtype)
    residual = torch.randn(M, qw.out_features, generator=g).to(dtype)
    weight = (1 + 0.1 * torch.randn(qw.out_features, generator=g)).to(dtype)
    y = QG.quant_linear(x, qw, bias)
    want = fused_add_rms_norm(y, residual, weight, EPS)
    ps = QG.quant_linear(x, qw, bias, partial=True)
    assert isinstance(ps, P.PartialSum) and ps.shape == (M, qw.out_features) and ps.dtype == dtype
    assert _held(ps) and ps.acc.abs().sum() > 0
    report.reset()
    got = fused_add_rms_norm(ps, residual, weight, EPS)
    assert report.snapshot()["fused_add_rms_norm"] == {"triton fused_add_rms_norm (finishes split-K sums)": 1}
    for a, b in zip(got, want):   # the interpreter adds the splits in one order: the same bits
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert not ps.acc.any() and not _held(ps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_silu_and_mul_finishes_the_sum(dtype):
    qw = _layer(N=2 * 192)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, qw.in_features, generator=g).to(dtype)
    for bias in (None, torch.randn(qw.out_features, generator=g).to(dtype)):
        want = silu_and_mul(QG.quant_linear(x, qw, bias))
        ps = QG.quant_linear(x, qw, bias, partial=True)
        got = silu_and_mul(ps)
        assert got.dtype == dtype and torch.equal(got, want)
        assert not ps.acc.any() and not _held(ps)


def test_finish_and_the_buffers():
    """``finish`` gives the finished GEMV's output; a held buffer is not handed out twice; inputs with leading
    dimensions, and ``NVLLM_PARTIAL_SUMS=0``, give finished outputs."""
    qw = _layer()
    x = torch.randn(2, qw.in_features, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(qw.out_features)
    want = QG.quant_linear(x, qw, bias)
    a = QG.quant_linear(x, qw, bias, partial=True)
    b = QG.quant_linear(x, qw, None, partial=True)
    assert a.acc.untyped_storage().data_ptr() != b.acc.untyped_storage().data_ptr()
    torch.testing.assert_close(a.finish(), want, rtol=0, atol=0)
    torch.testing.assert_close(b.finish(), want - bias, rtol=1e-5, atol=1e-5)
    assert not a.acc.any() and not b.acc.any() and not _held(a) and not _held(b)
    assert isinstance(QG.quant_linear(x.view(1, 2, -1), qw, bias, partial=True), torch.Tensor)
    QG.PARTIAL_SUMS = False
    try:
        assert isinstance(QG.quant_linear(x, qw, bias, partial=True), torch.Tensor)
    finally:
        QG.PARTIAL_SUMS = True


def test_consumers_without_triton_finish_first(monkeypatch):
    qw = _layer()
    x = torch.randn(1, qw.in_features, generator=torch.Generator().manual_seed(4))
    residual, weight = torch.randn(1, qw.out_features), torch.ones(qw.out_features)
    ps = QG.quant_linear(x, qw, None, partial=True)
    y = ps.acc.clone()
    monkeypatch.setenv("NVLLM_KERNELS", "torch")
    got, new_res = fused_add_rms_norm(ps, residual, weight, EPS)
    torch.testing.assert_close(new_res, y + residual)
    assert not ps.acc.any() and not _held(ps)


def test_engine_greedy_with_sums_finished_by_consumers(tmp_path, monkeypatch):
    """A GPTQ 4-bit Qwen2 (qkv bias) through the engine on the Triton kernels: o_proj, gate_up and down leave
    their sums to the norms and SiLU·mul; the greedy tokens are HF transformers' on the dequantized weights,
    and the same with every sum finished in the GEMV."""
    import transformers

    from nvllm import SamplingParams
    from tests.conftest import build_tiny_model, make_llm
    from tests.quant_utils import write_by_hand

    src = build_tiny_model("qwen2", tmp_path / "qwen2", intermediate_size=128)
    deq = write_by_hand(src, tmp_path / "gptq", "gptq", 4, 32, sym=False)
    prompt = [1, 17, 42, 99, 7]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for on in (True, False):
        monkeypatch.setattr(QG, "PARTIAL_SUMS", on)
        llm = make_llm(str(tmp_path / "gptq"))
        report.reset()
        tokens[on] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        finished_by = {impl for op in ("fused_add_rms_norm", "silu_and_mul") for impl in report.snapshot()[op]}
        assert any("finishes split-K sums" in impl for impl in finished_by) == on, finished_by
        del llm
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        named = dict(hf.named_parameters())
        for name, w in deq.items():
            named[name].copy_(w)
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
    assert tokens[True] == tokens[False] == want


_BARRIER = r"""
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nvllm.kernels.jit import lazy_jit
from nvllm.kernels.activation import _silu_and_mul_kernel
from nvllm.kernels.rmsnorm import _rms_norm_kernel
cases = (
    (_rms_norm_kernel, {"x_ptr": "*fp32", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
                        "res_out_ptr": "*bf16", "bias_ptr": "*bf16", "n_inner": "i32", "n_cols": "i32", "eps": "fp32",
                        **{f"stride_{a}{b}": "i32" for a in "xros" for b in "oi"}},
     dict(HAS_RESIDUAL=True, PARTIAL=True, HAS_BIAS=True, BLOCK=4096, PDL=True), 8, 1),
    (_silu_and_mul_kernel, {"x_ptr": "*fp32", "out_ptr": "*bf16", "bias_ptr": "*bf16", "stride_xt": "i32",
                            "stride_ot": "i32", "inter": "i32"},
     dict(BLOCK=1024, INTERLEAVE=0, PARTIAL=True, HAS_BIAS=True, PDL=True), 4, 2),
)
for kernel, sig, const, warps, zero_stores in cases:
    fn = lazy_jit(kernel)
    sig = dict(sig, **{k: "constexpr" for k in const})
    src = ASTSource(fn=fn, signature=sig, constexprs={(list(sig).index(k),): v for k, v in const.items()})
    ttgir = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ttgir"]
    body = ttgir[ttgir.index("tt.func public"):]
    stores = [m.start() for m in re.finditer(r"tt\.store", body)]
    barrier = max((m.start() for m in re.finditer(r"(gpu|ttg)\.barrier", body)), default=-1)
    assert barrier > 0 and sum(s > barrier for s in stores) == zero_stores, (kernel.__name__, barrier, stores)
print("barriers ok")
"""


def test_zeroing_waits_for_every_read():
    """The GPU reads the accumulator and the bias or residual in different layouts, so the thread that zeroes an
    element may not be the one that read it (on the H200 that raced: 14% of the finished values wrong). Compile
    both consumers for sm_90 (no GPU needed) and check their zero stores come after a barrier."""
    from tests.test_quant_gemv_kernel import compile_for_hopper

    compile_for_hopper(_BARRIER, "barriers ok")
