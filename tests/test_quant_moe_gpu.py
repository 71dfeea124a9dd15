"""Quantized mixtures of experts on a GPU (skipped elsewhere; run there with ``TRITON_INTERPRET=0``): the compiled
4/8-bit experts kernels against their reference at the published expert shapes, and GPTQ / AWQ checkpoints of tiny
Qwen3-MoE / Mixtral models through the engine — fp32 against HF transformers with the dequantized weights, bf16 with
CUDA graphs against the same engine run eagerly."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs a CUDA device and compiled Triton kernels (TRITON_INTERPRET=0)", allow_module_level=True)

from nvllm import SamplingParams  # noqa: E402
from nvllm.kernels import fused_moe, report  # noqa: E402
from nvllm.kernels import quant_moe as QM  # noqa: E402
from nvllm.kernels.moe_routing import route  # noqa: E402
from nvllm.quant import formats as F  # noqa: E402
from tests.conftest import build_tiny_model, make_llm  # noqa: E402
from tests.quant_utils import hf_greedy, write_by_hand  # noqa: E402
from tests.test_quant_moe import dense_copy  # noqa: E402


def stacked(w: torch.Tensor, bits: int, group: int, act_order: bool) -> QM.ExpertWeights:
    qs = []
    for e in range(w.shape[0]):
        g_idx = F.act_order_g_idx(torch.randperm(w.shape[2], device=w.device), group) if act_order else None
        qs.append(F.quantize_to_gptq(w[e].float(), bits, group, sym=not act_order, g_idx=g_idx))
    return QM.ExpertWeights(torch.stack([q.qweight for q in qs]), torch.stack([q.qzeros for q in qs]),
                            torch.stack([q.scales for q in qs]),
                            torch.stack([q.tensors()["g_idx"] for q in qs]) if act_order else None, bits,
                            qs[0].group_size)


@pytest.mark.parametrize("e, k, h, i", [(128, 8, 2048, 768), (8, 2, 4096, 14336)])
@pytest.mark.parametrize("bits, group, act_order", [(4, 128, False), (8, 128, False), (4, 128, True)])
@pytest.mark.parametrize("t", [1, 5, 64, 700])
def test_quant_experts_at_published_shapes(e, k, h, i, bits, group, act_order, t):
    """Qwen3-30B-A3B's and Mixtral-8x7B's experts, bf16 activations, routing from random logits: both paths."""
    gen = torch.Generator("cuda").manual_seed(t)
    w13 = stacked(torch.randn(e, 2 * i, h, device="cuda", generator=gen) * h ** -0.5, bits, group, act_order)
    w2 = stacked(torch.randn(e, h, i, device="cuda", generator=gen) * i ** -0.5, bits, group, act_order)
    x = torch.randn(t, h, device="cuda", generator=gen).bfloat16()
    weights, ids = route(torch.randn(t, e, device="cuda", generator=gen), k, True, True)
    ref = QM.quant_experts_reference(x, w13, w2, weights, ids).float()
    report.reset()
    got = QM.quant_experts(x, w13, w2, weights, ids).float()
    assert float((got - ref).abs().max() / ref.abs().max()) < 2e-2
    path = "gemv (split k)" if t * k <= e else "grouped gemm"      # at these shapes the GEMV splits K
    assert report.snapshot()["quant_moe"] == {f"triton w{bits}a16 gptq {path}": 1}


SHAPE = dict(vocab_size=512, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
             max_position_embeddings=1024, initializer_range=0.05)
MODELS = {"qwen3-moe": dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128, intermediate_size=256),
          "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=256)}


@pytest.mark.parametrize("kind, fmt, act_order", [("qwen3-moe", "gptq", False), ("qwen3-moe", "gptq", True),
                                                   ("mixtral", "awq", False)])
def test_quantized_moe_checkpoints_through_the_engine(kind, fmt, act_order, tmp_path, monkeypatch):
    """fp32 (CUDA graphs, the experts' GEMV splitting K) against HF transformers. Then bf16 with graphs against eager
    with every sum in a fixed order: attention in bf16 (``skip``) and the experts' GEMV unsplit — split K adds with
    atomics, whose order varies from run to run, so graphs and eager runs could differ in a near tie."""
    src = build_tiny_model(kind, tmp_path / kind, **SHAPE, **MODELS[kind])
    deq = write_by_hand(src, tmp_path / "q", fmt, 4, 64, sym=fmt == "gptq", act_order=act_order, skip=("self_attn",))
    prompt = [1, 45, 300, 12, 99, 7, 250, 31, 400, 18]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    fp32 = make_llm(str(tmp_path / "q"), device="cuda", dtype="float32", kv_cache_memory=1)
    got = fp32.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)[0].outputs[0].token_ids
    fp32.close()
    assert got == hf_greedy(dense_copy(src, tmp_path / "deq", deq), prompt, 12)
    assert "triton w4a16 gptq gemv (split k)" in report.snapshot()["quant_moe"]
    monkeypatch.setattr(QM, "GEMV_SPLIT_K", 1)
    prompts = [{"prompt_token_ids": prompt[j:j + 6]} for j in range(5)]
    tokens = {}
    for name, extra in (("graphs", {}), ("eager", {"enforce_eager": True})):
        llm = make_llm(str(tmp_path / "q"), device="cuda", dtype="bfloat16", kv_cache_memory=1, **extra)
        report.reset()
        tokens[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        tokens[name] += [o.outputs[0].token_ids for o in llm.generate(prompts[:1], greedy, use_tqdm=False)]
        assert set(report.snapshot()["quant_moe"]) == {"triton w4a16 gptq gemv", "triton w4a16 gptq grouped gemm"}
        llm.close()
    assert tokens["graphs"] == tokens["eager"]


def test_small_rows_rule_is_shared(monkeypatch):
    """Both experts ops switch paths at the same T·k (fused_moe.SMALL_ROWS)."""
    monkeypatch.setattr(fused_moe, "SMALL_ROWS", 0)
    x, w13, w2 = (torch.randn(1, 256, device="cuda").bfloat16(),
                  stacked(torch.randn(4, 256, 256, device="cuda") * 0.05, 4, 128, False),
                  stacked(torch.randn(4, 256, 128, device="cuda") * 0.05, 4, 128, False))
    weights, ids = route(torch.randn(1, 4, device="cuda"), 2, True, True)
    report.reset()
    QM.quant_experts(x, w13, w2, weights, ids)
    assert report.snapshot()["quant_moe"] == {"triton w4a16 gptq grouped gemm": 1}
