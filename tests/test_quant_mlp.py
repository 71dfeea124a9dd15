"""The one-launch GPTQ MLP (``nvllm.kernels.quant_mlp``) on the CPU under the Triton interpreter: its sums against the
torch reference and against the three kernels it replaces, its buffers left zeroed for the next call, what it
refuses, the engine's greedy tokens with and without it (HF transformers' on the dequantized weights), and its inline
PTX assembled for sm_90."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nvllm.kernels import partial_sum as P  # noqa: E402
from nvllm.kernels import quant_gemm as QG  # noqa: E402
from nvllm.kernels import quant_mlp as QM  # noqa: E402
from nvllm.kernels import report  # noqa: E402
from nvllm.kernels.activation import silu_and_mul  # noqa: E402
from nvllm.quant import formats as F  # noqa: E402
from tests.test_quant_gemv_kernel import compile_for_hopper  # noqa: E402


@pytest.fixture(autouse=True)
def _triton(monkeypatch):
    monkeypatch.setenv("NVLLM_KERNELS", "triton")
    monkeypatch.setenv("NVLLM_FUSED_MLP", "1")


def _mlp(K=128, inter=256, N=320, group=64, seed=0, bits=4, act_order=False):
    """gate_up [2·inter, K] and down [N, inter] as GPTQ layers (N = 320: a ragged last output tile of 256)."""
    g = torch.Generator().manual_seed(seed)
    g_idx = torch.randperm(K, generator=g).to(torch.int32) // group if act_order else None
    gate_up = F.quantize_to_gptq(torch.randn(2 * inter, K, generator=g) * 0.05, bits, group, sym=False, g_idx=g_idx)
    down = F.quantize_to_gptq(torch.randn(N, inter, generator=g) * 0.05, bits, group, sym=False)
    return gate_up, down


def _unfused(x, gate_up, down, bias=None):
    return QG.quant_linear(silu_and_mul(QG.quant_linear(x, gate_up, bias, partial=True)), down, partial=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_fused_mlp_matches_reference_and_the_three_kernels(dtype, with_bias):
    gate_up, down = _mlp()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, gate_up.in_features, generator=g).to(dtype)
    bias = (torch.randn(gate_up.out_features, generator=g) * 0.1).to(dtype) if with_bias else None
    down_bias = torch.randn(down.out_features, generator=g).to(dtype)
    report.reset()
    ps = QM.quant_mlp(x, gate_up, down, bias, down_bias)
    assert isinstance(ps, P.PartialSum) and ps.shape == (1, down.out_features) and ps.dtype == dtype
    assert ps.bias is down_bias
    assert report.snapshot()["quant_gemm"] == {
        "triton w4a16 gptq gemv, gate_up + silu_and_mul + down in one launch": 1}
    got = ps.acc.clone()
    ref = QM.quant_mlp_reference(x, gate_up, down, bias)
    # f16 products as the one-row half2 GEMV rounds them, then the activation rounded to the inputs' dtype (which
    # the interpreter truncates to bf16 instead of rounding)
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(got, ref, rtol=0, atol=tol * ref.abs().max().item())
    three = _unfused(x, gate_up, down, bias)
    torch.testing.assert_close(got, three.acc, rtol=0, atol=2e-3 * ref.abs().max().item())
    three.finish()
    gu, cnt = QM._STATE[torch.device("cpu")][-1]
    assert not gu.any() and not cnt.any()            # left zeroed for the next call
    again = QM.quant_mlp(x, gate_up, down, bias, down_bias)
    assert torch.equal(again.acc, got)               # the interpreter adds in one order: the same bits
    assert torch.equal(again.finish(), (got + down_bias.float()).to(dtype))
    ps.finish()


@pytest.mark.parametrize("K, inter, N, group", [(512, 384, 256, 128), (704, 256, 264, 64), (576, 384, 72, 192)],
                         ids=["splits-of-64", "ragged-last-split", "g192-ragged-n"])
def test_fused_mlp_slices_and_splits(K, inter, N, group, monkeypatch):
    """Several gate_up K splits and slices (splits for 16 programs per SM of the interpreter's 4): K = 512 in splits
    of 64; K = 704 in splits of 192 (the last one 128, the inputs' span 256); groups of 192 and a last output tile
    of 8 columns. Then a larger intermediate size after a smaller one: new buffers, the old ones kept (CUDA graphs
    may hold them)."""
    monkeypatch.setattr(QM, "_STATE", {})
    small = QM.quant_mlp(torch.randn(1, 128).half(), *_mlp(inter=128, N=64))
    small.finish()
    gate_up, down = _mlp(K=K, inter=inter, N=N, group=group, seed=3)
    x = torch.randn(1, K, generator=torch.Generator().manual_seed(4)).to(torch.float16)
    ps = QM.quant_mlp(x, gate_up, down)
    ref = QM.quant_mlp_reference(x, gate_up, down)
    torch.testing.assert_close(ps.acc, ref, rtol=0, atol=2e-3 * ref.abs().max().item())
    three = _unfused(x, gate_up, down)
    torch.testing.assert_close(ps.acc, three.acc, rtol=0, atol=1e-4 * ref.abs().max().item())
    ps.finish()
    three.finish()
    held = QM._STATE[torch.device("cpu")]
    assert len(held) == 2 and held[0][0].numel() == 256 and held[1][0].numel() == 2 * inter
    assert not any(t.any() for pair in held for t in pair)


def test_fused_mlp_falls_back_while_capturing_without_buffers(monkeypatch):
    """Inside a CUDA graph capture nothing may be allocated: without buffers of its size the call gives None (the
    three kernels run), with them it runs."""
    monkeypatch.setattr(QM, "_STATE", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    cpu_state = QM._state(torch.device("cpu"), 256)   # the CPU never captures: allocated regardless
    assert cpu_state is not None
    monkeypatch.setattr(QM, "_STATE", {})
    assert QM._state(torch.device("cuda", 0), 256) is None and QM._STATE == {torch.device("cuda", 0): []}


def test_fused_mlp_layers(monkeypatch):
    """``fused_mlp`` takes two whole QuantLinear layers; LoRA-wrapped layers, a tensor-parallel down_proj and
    ``NVLLM_PARTIAL_SUMS=0`` go the three kernels' way."""
    from types import SimpleNamespace

    from nvllm.layers import quant_linear as QL
    from nvllm.quant.plan import QuantScheme

    scheme = QuantScheme("gptq", 4, 64)
    gate_up = QL.QuantLinear(128, 512, False, [256, 256], scheme, torch.float16)
    down = QL.QuantLinear(256, 64, True, None, scheme, torch.float16)
    gen = torch.Generator().manual_seed(0)
    gate_up.init_dummy(gen)
    down.init_dummy(gen)
    x = torch.randn(1, 128).half()
    ps = QL.fused_mlp(gate_up, down, x)
    assert isinstance(ps, P.PartialSum) and ps.bias is down.bias
    want = QG.quant_linear(silu_and_mul(QG.quant_linear(x, gate_up.quant_weight())), down.quant_weight(), down.bias)
    torch.testing.assert_close(ps.finish(), want, rtol=2e-3, atol=2e-3)
    assert QL.fused_mlp(torch.nn.Identity(), down, x) is None                       # e.g. a LoRALinear
    down.tp = SimpleNamespace(size=2)
    assert QL.fused_mlp(gate_up, down, x) is None
    down.tp = None
    monkeypatch.setenv("NVLLM_PARTIAL_SUMS", "0")
    assert QL.fused_mlp(gate_up, down, x) is None


def test_fused_mlp_refuses_what_it_cannot_take(monkeypatch):
    gate_up, down = _mlp()
    x = torch.randn(1, gate_up.in_features).to(torch.bfloat16)
    assert QM.supported(x, gate_up, down)
    assert not QM.supported(x.repeat(2, 1), gate_up, down)                     # two rows
    assert not QM.supported(x.float(), gate_up, down)                          # fp32 activations
    assert not QM.supported(x, *_mlp(bits=8))                                  # 8-bit
    assert not QM.supported(x, *_mlp(act_order=True))                          # act-order
    assert not QM.supported(x, *_mlp(inter=192))                               # no whole slices of 128
    assert not QM.supported(x, *_mlp(group=32))                                # groups narrower than a K step
    assert not QM.supported(x, down, gate_up)                                  # not a gate_up / down pair
    for off in ("0", ""):
        monkeypatch.setenv("NVLLM_FUSED_MLP", off)
        assert not QM.supported(x, gate_up, down) and QM.quant_mlp(x, gate_up, down) is None
    monkeypatch.setenv("NVLLM_FUSED_MLP", "1")
    monkeypatch.setenv("NVLLM_KERNELS", "torch")
    assert QM.quant_mlp(x, gate_up, down) is None


def test_engine_greedy_with_the_fused_mlp(tmp_path, monkeypatch):
    """A GPTQ 4-bit Qwen2 (intermediate 256: two slices) through the engine in fp16 (the interpreter truncates fp32 to
    bf16): the MLP in one launch at batch 1, the greedy tokens and logprobs of the three kernels, and HF
    transformers' greedy tokens on the dequantized weights."""
    from nvllm import SamplingParams
    from nvllm.engine.llm_engine import LLMEngine
    from tests.conftest import build_tiny_model, make_llm
    from tests.quant_utils import hf_greedy, write_by_hand

    monkeypatch.setattr(LLMEngine, "_warmup", lambda self: None)   # its 2-8-row GEMVs are slow in the interpreter
    src = build_tiny_model("qwen2", tmp_path / "qwen2", intermediate_size=256)
    deq = write_by_hand(src, tmp_path / "gptq", "gptq", 4, 64, sym=False)
    prompt = [1, 17, 42, 99, 7]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0)
    tokens, logprobs = {}, {}
    for on in (True, False):
        monkeypatch.setenv("NVLLM_FUSED_MLP", "1" if on else "0")
        llm = make_llm(str(tmp_path / "gptq"), dtype="float16")
        report.reset()
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        tokens[on] = out.token_ids
        logprobs[on] = [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]
        fused = report.snapshot()["quant_gemm"].get(
            "triton w4a16 gptq gemv, gate_up + silu_and_mul + down in one launch", 0)
        assert (fused > 0) == on, report.snapshot()["quant_gemm"]
        del llm
    assert tokens[True] == tokens[False] == hf_greedy(src, prompt, 5, deq)
    torch.testing.assert_close(logprobs[True], logprobs[False], rtol=0, atol=1e-3)


_ASSEMBLE = r"""
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from nvllm.kernels.quant_mlp import quant_mlp_kernel as kernel
ptrs = dict(x_ptr="*bf16", gqw_ptr="*i32", gqz_ptr="*i32", gs_ptr="*fp16", gbias_ptr="*bf16", dqw_ptr="*i32",
            dqz_ptr="*i32", ds_ptr="*fp16", out_ptr="*fp32", gu_ptr="*fp32", cnt_ptr="*i32", xp_ptr="*i32")
const = dict(GROUP=128, D_GROUP=128, SLICE=128, BLOCK_N=256, X_SPAN=256, XP=128, HAS_BIAS=True, PREFETCH=2,
             D_PREFETCH=2, MAX_POLLS=1 << 24, INTERPRET=False, PDL=True)
sig = {k: ptrs.get(k, "constexpr" if k in const else "i32") for k in kernel.arg_names}
names = list(sig)
# what a launch at the Qwen2.5-7B shapes specializes: pointers, sizes and strides divisible by 16
aligned = list(ptrs) + ["K", "INTER", "N", "k_per_split"] + [k for k in names if k.startswith("stride")]
src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()},
                attrs={(names.index(k),): [["tt.divisibility", 16]] for k in aligned})
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1, "num_stages": 1}).asm["ptx"]
# per K step's eight words: three FMAs after a multiply, for each of a lane's eight columns: gate_up's K loop and
# down's; each word row read as two 16-byte loads a lane (gate_up's S gate and S up columns too), evicted first
assert ptx.count("fma.rn.f16x2") == 3 * 8 * 8 * 2, ptx.count("fma.rn.f16x2")
assert ptx.count("ld.global.L1::evict_first.L2::cache_hint.v4.b32") == 2 * 8 * 2, "vector loads of the words"
assert ptx.count("ld.volatile.global") >= 2 and "trap;" in ptx, "the slice's counter polled, a trap past MAX_POLLS"
assert re.search(r"(ld|atom)\.global\.gpu\.acquire", ptx), "the slice's wait acquires"
assert "ld.global.cg.v4.b32" in ptx, "the slice's sums read from L2"
assert "red.global.gpu.release.add.u32" in ptx or "atom.global.gpu.release.add" in ptx, "gate_up's ticket releases"
assert "griddepcontrol.wait" in ptx and "prefetch.global.L2" in ptx
print("assembled")
"""


def test_fused_mlp_inline_ptx_assembles_for_hopper():
    """The interpreter cannot run inline PTX: compile the kernel for sm_90 (bf16, bias, PDL, prefetch)."""
    compile_for_hopper(_ASSEMBLE, "assembled")
