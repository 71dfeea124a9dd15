"""W8A8 FP8 through the engine on a Hopper GPU (skipped elsewhere; run there with ``TRITON_INTERPRET=0``): a
128×128-block checkpoint (Qwen3-FP8's layout) and a checkpoint quantized at load with one scale a row and MLP rows
wider than the per-token quantizer takes. Prompts of ``W8A8_MIN_M`` tokens and more run the block-wise product
(activations per token and 128 inputs, the kernel report says so), their prompt logprobs stay near the W8A16 engine's
(the same weights, activations unrounded), and a batch of decode steps as wide as ``W8A8_MIN_M`` gives the
tokens replaying CUDA graphs that it gives run eagerly."""

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
from nvllm.layers import fp8_linear  # noqa: E402
from tests.conftest import build_tiny_model, make_llm  # noqa: E402
from tests.quant_utils import fp8_blocks, write_fp8  # noqa: E402

BLOCK_PATH = "fp8 w8a8 (activations per token and 128 inputs) torch._scaled_mm"
TOKEN_PATH = "fp8 w8a8 (per-token activations) torch._scaled_mm"
SHAPE = dict(vocab_size=512, hidden_size=512, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
             max_position_embeddings=1024, initializer_range=0.05)


def prompt_logprobs(llm, ids: list[int]) -> torch.Tensor:
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    return torch.tensor([lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], ids[1:])])


def w8a16(monkeypatch) -> None:
    monkeypatch.setattr(fp8_gemm, "W8A8_MIN_M", 0)
    monkeypatch.setattr(fp8_linear, "W8A8_MIN_M", 0)


@pytest.mark.parametrize("case", ["block128", "rows"])
def test_w8a8_through_the_engine(case, tmp_path, monkeypatch):
    if case == "block128":   # Qwen3-FP8's blocks: every linear takes the block-wise product (128×128 weight scales)
        base = build_tiny_model("qwen2", tmp_path / "base", intermediate_size=1536, **SHAPE)
        path, kw = write_fp8(base, tmp_path / "fp8", {"quant_method": "fp8", "activation_scheme": "dynamic",
                                                      "weight_block_size": [128, 128]}, fp8_blocks((128, 128))), {}
        want = {"qkv_proj": (4, 8), "o_proj": (4, 4), "gate_up_proj": (4, 24), "down_proj": (12, 4)}
    else:   # one scale a row: per token up to 4096 inputs, down_proj's 4352 inputs block-wise (1×128 weight scales)
        path = build_tiny_model("qwen2", tmp_path / "base", intermediate_size=4352, **SHAPE)
        kw = {"quantization": "fp8"}
        want = {"qkv_proj": None, "o_proj": None, "gate_up_proj": None, "down_proj": (34, 512)}
    ids = [int(i) for i in torch.randint(3, 512, (300,), generator=torch.Generator().manual_seed(0))]
    prompts = [{"prompt_token_ids": ids[i:i + 5]} for i in range(260)]
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    results = {}
    for name, extra in (("w8a8", {}), ("eager", {"enforce_eager": True}), ("w8a16", None)):
        if extra is None:
            w8a16(monkeypatch)
        llm = make_llm(str(path), device="cuda", dtype="bfloat16", max_num_seqs=260, enable_prefix_caching=False,
                       **kw, **(extra or {}))
        layer = llm.engine.runner.model.layers[0]
        for lname, shape in want.items():
            got = getattr(layer, lname).w8a8_scales
            assert (got is None if shape is None or extra is None else tuple(got.shape) == shape), (lname, got)
        report.reset()
        lps = prompt_logprobs(llm, ids)
        seen = report.snapshot()["fp8_gemm"]
        if extra is None:
            assert BLOCK_PATH not in seen and TOKEN_PATH not in seen
        else:
            assert seen.get(BLOCK_PATH, 0) >= (2 if case == "rows" else 8), seen   # down_proj / every linear
            assert (TOKEN_PATH in seen) == (case == "rows"), seen
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        results[name] = (lps, [o.outputs[0].token_ids for o in outs])
        llm.close()
    lps, tokens = results["w8a8"]
    # decode graphs of up to 260 rows replay the W8A8 kernels (a padded batch may take another cuBLAS algorithm)
    assert sum(a != b for a, b in zip(tokens, results["eager"][1])) <= 5
    assert float((lps - results["eager"][0]).abs().max()) < 1e-2
    diff = (lps - results["w8a16"][0]).abs()
    print(f"{case}: |Δ prompt logprob| W8A8 vs W8A16 max {float(diff.max()):.3g} mean {float(diff.mean()):.3g}")
    assert float(diff.mean()) < 0.05 and float(diff.max()) < 0.5
    assert float(diff.max()) > 0                                  # the activations really were rounded
