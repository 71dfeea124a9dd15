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
from nvllm.kernels.rope_store import rope_store  # noqa: E402
from nvllm.layers.rotary import RotaryEmbedding  # noqa: E402
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


def test_finish_and_the_buffers(monkeypatch):
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
    monkeypatch.setenv("NVLLM_PARTIAL_SUMS", "0")
    assert isinstance(QG.quant_linear(x, qw, bias, partial=True), torch.Tensor)


@pytest.mark.parametrize("cache", [None, torch.int8], ids=["model-dtype", "int8"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_rope_store_finishes_the_sum(with_bias, cache):
    """q, k, v as one PartialSum's heads (GQA 2, head_dim 32, a padding row with slot −1): the rotated q and the
    caches equal ``rope_store`` on the finished projection, bit for bit; the accumulator is zeroed, padding row
    included."""
    from tests.test_rope_store import _case, _same, _views

    heads, kv_heads, head_dim, tokens = 4, 2, 32, 5
    rope = RotaryEmbedding(head_dim, 64, 10000.0, None)
    # fp16: the interpreter rounds fp32 -> fp16 as torch does (fp32 -> bf16 it truncates)
    buf, positions, slots, caches = _case(tokens, heads, kv_heads, head_dim, torch.float16, cache, pad=0)
    g = torch.Generator().manual_seed(5)
    acc = torch.randn(buf.shape, generator=g) * 2
    bias = torch.randn(buf.shape[1], generator=g).to(torch.float16) if with_bias else None
    want_caches = [c.clone() for c in caches]
    finished = P.PartialSum(acc.clone(), bias, torch.float16).finish()
    want_q, _ = rope_store(*_views(finished, heads, kv_heads, head_dim), positions, rope.cos, rope.sin,
                           *want_caches[:2], slots, *want_caches[2:])
    ps = P.PartialSum(acc, bias, torch.float16)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    views = (ps.heads(0, heads, head_dim), ps.heads(q_size, kv_heads, head_dim),
             ps.heads(q_size + kv_size, kv_heads, head_dim))
    report.reset()
    got_q, got_k = rope_store(*views, positions, rope.cos, rope.sin, *caches[:2], slots, *caches[2:])
    assert report.snapshot()["rotary"] == {"triton rope_store (fused with kv_store, finishes split-K sums)": 1}
    assert got_k is None and _same(got_q, want_q) and got_q.is_contiguous()
    for c, w in zip(caches, want_caches):
        assert _same(c, w)
    assert not acc.any()


def test_buffers_made_in_inference_mode_serve_outside_it(monkeypatch):
    """A buffer first made while an engine ran (inference mode) is zeroed in place by ``finish`` outside it too."""
    monkeypatch.setattr(P, "_BUFFERS", {})
    monkeypatch.setattr(P, "_HELD", set())
    qw = _layer()
    x = torch.randn(1, qw.in_features, generator=torch.Generator().manual_seed(7))
    with torch.inference_mode():
        inside = QG.quant_linear(x, qw, None, partial=True).finish()
    ps = QG.quant_linear(x, qw, None, partial=True)
    assert len(P._BUFFERS[torch.device("cpu")]) == 1   # the same buffer
    assert torch.equal(ps.finish(), inside) and not ps.acc.any()


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
    """A GPTQ 4-bit Qwen2 (qkv bias) through the engine on the Triton kernels: qkv, o_proj, gate_up and down
    leave their sums to rope_store, the norms and SiLU·mul; the greedy tokens are HF transformers' on the dequantized weights,
    and the same with every sum finished in the GEMV."""
    from nvllm import SamplingParams
    from nvllm.engine.llm_engine import LLMEngine
    from tests.conftest import build_tiny_model, make_llm
    from tests.quant_utils import hf_greedy, write_by_hand

    monkeypatch.setattr(LLMEngine, "_warmup", lambda self: None)   # its 2-8-row GEMVs are slow in the interpreter
    src = build_tiny_model("qwen2", tmp_path / "qwen2", intermediate_size=128)
    deq = write_by_hand(src, tmp_path / "gptq", "gptq", 4, 32, sym=False)
    prompt = [1, 17, 42, 99, 7]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    tokens = {}
    for on in (True, False):
        monkeypatch.setenv("NVLLM_PARTIAL_SUMS", "1" if on else "0")
        llm = make_llm(str(tmp_path / "gptq"))
        report.reset()
        tokens[on] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        seen = report.snapshot()
        finished_by = {impl for op in ("fused_add_rms_norm", "silu_and_mul", "rotary") for impl in seen[op]}
        assert sum("finishes split-K sums" in impl for impl in finished_by) == (3 if on else 0), finished_by
        del llm
    assert tokens[True] == tokens[False] == hf_greedy(src, prompt, 4, deq)


_BARRIER = r"""
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nvllm.kernels.jit import lazy_jit
from nvllm.kernels.activation import _silu_and_mul_kernel
from nvllm.kernels.rmsnorm import _rms_norm_kernel
from nvllm.kernels.rope_store import _rope_store_kernel
cases = (
    (_rms_norm_kernel, {"x_ptr": "*fp32", "res_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
                        "res_out_ptr": "*bf16", "bias_ptr": "*bf16", "n_inner": "i32", "n_cols": "i32", "eps": "fp32",
                        **{f"stride_{a}{b}": "i32" for a in "xros" for b in "oi"}},
     dict(HAS_RESIDUAL=True, PARTIAL=True, HAS_BIAS=True, BLOCK=4096, PDL=True, EARLY_W=True), 8, 1),
    (_silu_and_mul_kernel, {"x_ptr": "*fp32", "out_ptr": "*bf16", "bias_ptr": "*bf16", "stride_xt": "i32",
                            "stride_ot": "i32", "inter": "i32"},
     dict(BLOCK=1024, INTERLEAVE=0, PARTIAL=True, HAS_BIAS=True, PDL=True), 4, 2),
)
rope = {n: "*bf16" for n in ("k_cache_ptr", "v_cache_ptr", "q_out_ptr", "qb_ptr", "kb_ptr", "vb_ptr")}
rope.update({n: "*fp32" for n in ("q_ptr", "k_ptr", "v_ptr", "cos_ptr", "sin_ptr", "k_scale_ptr", "v_scale_ptr")})
rope.update(pos_ptr="*i64", slot_ptr="*i64")
for name in lazy_jit(_rope_store_kernel).arg_names:
    if name not in rope:
        rope[name] = "i32"
rope_const = dict(BLOCK_SIZE=16, BLOCK_H=32, BLOCK_HKV=4, BLOCK_HALF=64, QUANT=0, QMAX=127, PARTIAL=True,
                  HAS_BIAS=True, PDL=True, EARLY=True)
for c in rope_const:
    rope.pop(c)
# k's program zeroes k and v (4 stores), q's program q (2): both after their own barrier, the last 2 after the last
cases += ((_rope_store_kernel, rope, rope_const, 4, 2),)
for kernel, sig, const, warps, zero_stores in cases:
    fn = lazy_jit(kernel)
    sig = dict(sig, **{k: "constexpr" for k in const})
    src = ASTSource(fn=fn, signature=sig, constexprs={(list(sig).index(k),): v for k, v in const.items()})
    ttgir = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ttgir"]
    body = ttgir[ttgir.index("tt.func public"):]
    stores = [m.start() for m in re.finditer(r"tt\.store[^\n]*!tt\.ptr<f32>", body)]   # into the accumulator
    barriers = [m.start() for m in re.finditer(r"(gpu|ttg)\.barrier", body)]
    assert barriers and all(s > barriers[0] for s in stores), (kernel.__name__, barriers, stores)
    assert sum(s > barriers[-1] for s in stores) == zero_stores, (kernel.__name__, barriers, stores)
print("barriers ok")
"""


def test_zeroing_waits_for_every_read():
    """The GPU reads the accumulator and the bias or residual in different layouts, so the thread that zeroes an
    element may not be the one that read it (on the H200 that raced: 14% of the finished values wrong). Compile
    both consumers for sm_90 (no GPU needed) and check their zero stores come after a barrier."""
    from tests.test_quant_gemv_kernel import compile_for_hopper

    compile_for_hopper(_BARRIER, "barriers ok")
