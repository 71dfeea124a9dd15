"""W8A8 FP8 through the engine on a Hopper GPU (skipped elsewhere; run there with ``TRITON_INTERPRET=0``): a
128×128-block checkpoint (Qwen3-FP8's layout) and a checkpoint quantized at load with one scale a row and MLP rows
wider than the per-token quantizer takes. Prompts of ``W8A8_MIN_M`` tokens and more run W8A8 (the kernel report
names each product), the activations' rounding moves the prompt logprobs about as much as the weights' own rounding
does (W8A16 against the bf16 model), and a batch of decode steps replaying CUDA graphs gives the tokens it gives run
eagerly."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs a CUDA device and compiled Triton kernels (TRITON_INTERPRET=0)", allow_module_level=True)
if torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("W8A8 runs on Hopper GPUs", allow_module_level=True)

from nvllm import SamplingParams  # noqa: E402
from nvllm.kernels import fp8_gemm, report  # noqa: E402
from nvllm.kernels.fp8_w8a8 import (block_weight_scales, quantize_token_groups,  # noqa: E402
                                    quantize_token_groups_reference, w8a8_block_linear, w8a8_block_reference)
from nvllm.quant.fp8 import Fp8Scheme, quantize_blocks, quantize_rows, scale_rows  # noqa: E402
from tests.conftest import build_tiny_model, make_llm  # noqa: E402
from tests.quant_utils import fp8_blocks, write_fp8  # noqa: E402

BLOCK = "fp8 w8a8 (activations per token and 128 inputs, {} weight scales) torch._scaled_mm"
TOKEN = "fp8 w8a8 (per-token activations) torch._scaled_mm"
SHAPE = dict(vocab_size=512, hidden_size=512, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
             max_position_embeddings=1024, initializer_range=0.05)


@pytest.mark.parametrize("k,block", [(1040, 128), (464, 128), (4352, None)])
def test_block_products_at_ragged_shapes_equal_the_reference(k, block):
    """cuBLAS's block-wise products where the shapes are not whole blocks: K not a multiple of 128 (464: a short last
    group in both layouts; 1040: 9 groups, 1×128 only), 272 outputs (a short last block of rows), rows not a
    multiple of 4 (padded), with and without a bias; one scale a row repeated over 34 groups."""
    gen = torch.Generator("cuda").manual_seed(k)
    w = torch.randn(272, k, device="cuda", generator=gen) * 0.05
    if block:
        q, s = quantize_blocks(w, (block, block))
        s = scale_rows(s, Fp8Scheme("block", (block, block)), 272, k, "w")
    else:
        q, s = quantize_rows(w)
    bk = block or k
    bias = torch.randn(272, device="cuda", generator=gen).to(torch.bfloat16)
    layouts = {name: block_weight_scales(s, bk, k, name) for name in ("1x128", "128x128")}
    assert layouts["1x128"] is not None and (layouts["128x128"] is not None) == (k == 464)
    for m in (257, 63, 16):
        x = (torch.randn(m, k, device="cuda", generator=gen) * 3).to(torch.bfloat16)
        qx, sx = quantize_token_groups(x)
        want_q, want_s = quantize_token_groups_reference(x)
        assert torch.equal(qx.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(sx, want_s)
        for b in (None, bias):
            ref = w8a8_block_reference(x, q, s, bk, b).float()
            for name, scales in layouts.items():
                if scales is None:
                    continue
                y = w8a8_block_linear(x, q, scales, b)
                assert y.shape == (m, 272) and y.dtype == torch.bfloat16
                err = float((y.float() - ref).abs().max() / ref.abs().max())
                assert err < 1e-2, (m, name, b is not None, err)


def prompt_logprobs(llm, ids: list[int]) -> torch.Tensor:
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return torch.tensor([lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], ids[1:])])


@pytest.mark.parametrize("case", ["block128", "rows"])
def test_w8a8_through_the_engine(case, tmp_path, monkeypatch):
    assert fp8_gemm.W8A8_MIN_M <= 63 < fp8_gemm.W8A8_LARGE_M <= 301
    if case == "block128":   # Qwen3-FP8's blocks
        base = build_tiny_model("qwen2", tmp_path / "base", intermediate_size=1536, **SHAPE)
        path, kw = write_fp8(base, tmp_path / "fp8", {"quant_method": "fp8", "activation_scheme": "dynamic",
                                                      "weight_block_size": [128, 128]}, fp8_blocks((128, 128))), {}
        want = {"qkv_proj": (4, 8), "o_proj": (4, 4), "gate_up_proj": (4, 24), "down_proj": (12, 4)}   # 128×128
        large = {BLOCK.format("128x128"): 8}
    else:   # one scale a row: per token from W8A8_LARGE_M rows, but down_proj's 4352 inputs are too wide for it
        base = path = build_tiny_model("qwen2", tmp_path / "base", intermediate_size=4352, **SHAPE)
        kw = {"quantization": "fp8"}
        want = {"qkv_proj": None, "o_proj": None, "gate_up_proj": None, "down_proj": None}
        large = {TOKEN: 6, BLOCK.format("1x128"): 2}
    ids = [int(i) for i in torch.randint(3, 512, (301,), generator=torch.Generator().manual_seed(0))]
    prompts = [{"prompt_token_ids": ids[i:i + 5]} for i in range(63)]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    results = {}
    for name, extra in (("w8a8", {}), ("eager", {"enforce_eager": True}), ("w8a16", None), ("bf16", None)):
        if name == "w8a16":
            monkeypatch.setattr(fp8_gemm, "W8A8_MIN_M", 0)
        llm = make_llm(str(base if name == "bf16" else path), device="cuda", dtype="bfloat16", max_num_seqs=64,
                       enable_prefix_caching=False, **({} if name == "bf16" else kw), **(extra or {}))
        layer = llm.engine.runner.model.layers[0]
        if name in ("w8a8", "eager"):
            for lname, shape in want.items():
                got = getattr(layer, lname).w8a8_scales
                assert got.keys() == ({"1x128"} if shape is None else {"1x128", "128x128"}), lname
                assert shape is None or tuple(got["128x128"].shape) == shape, lname
        report.reset()
        lps = [prompt_logprobs(llm, ids), prompt_logprobs(llm, ids[:63])]   # at least W8A8_LARGE_M rows; fewer
        seen = report.snapshot().get("fp8_gemm", {})
        if name in ("w8a8", "eager"):
            assert seen == {**large, BLOCK.format("1x128"): large.get(BLOCK.format("1x128"), 0) + 8}, seen
        else:
            assert not any("w8a8" in k for k in seen), seen
        outs = llm.generate(prompts, greedy, use_tqdm=False)   # 63 decode rows a step (a graph of 64): 1×128
        results[name] = (torch.cat(lps), [o.outputs[0].token_ids for o in outs])
        llm.close()
    lps, tokens = results["w8a8"]
    assert tokens == results["eager"][1]                  # decode graphs replay the W8A8 kernels
    assert float((lps - results["eager"][0]).abs().max()) < 1e-2
    activations = float((lps - results["w8a16"][0]).abs().mean())
    weights = float((results["w8a16"][0] - results["bf16"][0]).abs().mean())
    print(f"{case}: mean |Δ prompt logprob| W8A8 vs W8A16 {activations:.3g}, W8A16 vs bf16 {weights:.3g}")
    assert 0 < activations < 2 * weights
