"""Mixtures of experts on a GPU (skipped elsewhere; run there with ``TRITON_INTERPRET=0``): the compiled fused experts
op and the pairs' grouping by expert against their references at the published expert shapes, and tiny Qwen3-MoE /
Qwen2-MoE / Mixtral models through the engine — fp32 against HF transformers' forward and greedy tokens, bf16 with
CUDA graphs against the same engine run eagerly, with the kernel report naming the Triton op."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs a CUDA device and compiled Triton kernels (TRITON_INTERPRET=0)", allow_module_level=True)

from nvllm import SamplingParams  # noqa: E402
from nvllm.kernels import report  # noqa: E402
from nvllm.kernels.fused_moe import fused_experts, fused_experts_reference  # noqa: E402
from nvllm.kernels.moe_align import align_tokens_reference, align_tokens_triton  # noqa: E402
from nvllm.kernels.moe_routing import route, route_reference, route_triton  # noqa: E402
from tests.conftest import build_tiny_model, make_llm  # noqa: E402
from tests.test_engine_vs_hf import PROMPT, check_against_hf  # noqa: E402

SHAPE = dict(vocab_size=512, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3,
             max_position_embeddings=1024, initializer_range=0.05)
MOE = {"qwen3-moe": dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=96),
       "qwen2-moe": dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=96,
                         shared_expert_intermediate_size=160),
       "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=200)}


@pytest.mark.parametrize("e, k, h, i", [(128, 8, 2048, 768), (8, 2, 4096, 14336), (60, 4, 2048, 1408)])
@pytest.mark.parametrize("t", [1, 3, 64, 700])
def test_fused_experts_at_published_shapes(e, k, h, i, t):
    """Qwen3-30B-A3B, Mixtral-8x7B and Qwen1.5-MoE-A2.7B experts, bf16, routing from random logits."""
    gen = torch.Generator("cuda").manual_seed(t)
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=gen) * h ** -0.5).bfloat16()
    w2 = (torch.randn(e, h, i, device="cuda", generator=gen) * i ** -0.5).bfloat16()
    x = torch.randn(t, h, device="cuda", generator=gen).bfloat16()
    weights, ids = route(torch.randn(t, e, device="cuda", generator=gen), k, True, True)
    ref = fused_experts_reference(x, w13, w2, weights, ids).float()
    got = fused_experts(x, w13, w2, weights, ids).float()
    assert float((got - ref).abs().max() / ref.abs().max()) < 2e-2


@pytest.mark.parametrize("e, k", [(128, 8), (8, 2), (60, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_kernel_equals_the_reference(e, k, dtype):
    """The same probabilities picked in the same order (bf16 logits tie often: which of two equal experts comes first
    may differ from torch.topk's choice), the same weights."""
    logits = (torch.randn(300, e, device="cuda", generator=torch.Generator("cuda").manual_seed(e)) * 3).to(dtype)
    want_w, want_ids = route_reference(logits, k, True, True)
    got_w, got_ids = route_triton(logits, k, True, True)
    probs = torch.softmax(logits.float(), -1)
    assert torch.equal(probs.gather(1, got_ids.long()), probs.gather(1, want_ids))
    if dtype == torch.float32:
        assert torch.equal(got_ids.long(), want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=2 ** -8, atol=2 ** -8)


@pytest.mark.parametrize("e, k", [(128, 8), (8, 2), (60, 4)])
@pytest.mark.parametrize("t, block_m", [(33, 16), (700, 64), (4096, 128)])
def test_align_kernel_equals_the_reference(e, k, t, block_m):
    """The pairs grouped by expert: the compiled kernel's bits against the stable sort's, one program to several."""
    gen = torch.Generator("cuda").manual_seed(t + e)
    _, ids = route(torch.randn(t, e, device="cuda", generator=gen), k, True, True)
    for got, want in zip(align_tokens_triton(ids, e, block_m), align_tokens_reference(ids, e, block_m)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("kind", list(MOE))
def test_tiny_moe_models_through_the_engine(kind, tmp_path):
    path = build_tiny_model(kind, tmp_path / kind, **SHAPE, **MOE[kind])
    # a fixed 1 GiB KV cache each: an engine left for the garbage collector keeps its cache until it is collected
    check_against_hf(path, PROMPT, 16, device="cuda", dtype="float32", kv_cache_memory=1)
    prompts = [{"prompt_token_ids": PROMPT[i:i + 6]} for i in range(12)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for name, extra in (("graphs", {}), ("eager", {"enforce_eager": True})):
        llm = make_llm(str(path), device="cuda", dtype="bfloat16", kv_cache_memory=1, **extra)
        report.reset()
        tokens[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        # two sequences: decode steps of T·k ≤ E (the GEMVs; twelve take the sorted grouped GEMM)
        tokens[name] += [o.outputs[0].token_ids for o in llm.generate(prompts[:2], greedy, use_tqdm=False)]
        assert set(report.snapshot()["fused_moe"]) == {"triton gemv (a row per token and expert)",
                                                       "triton grouped gemm (moe_align, moe_sum)"}
        llm.close()
    assert tokens["graphs"] == tokens["eager"]
