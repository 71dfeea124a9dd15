"""The whole engine on the Triton kernels (under the interpreter on CPU) gives the torch path's greedy
outputs on the demo model, with batching, chunked prefill and prefix-cache hits in play."""

from __future__ import annotations

from nvllm import SamplingParams
from nvllm.kernels import report
from tests.conftest import make_llm

PROMPTS = ["Once upon a time", "The little dog ran to the park and saw a big red ball. He wanted",
           "Once upon a time, there was a girl"]


def run(demo_dir, monkeypatch, kernels: str):
    monkeypatch.setenv("NVLLM_KERNELS", kernels)
    llm = make_llm(demo_dir, max_num_batched_tokens=16, block_size=8)
    report.reset()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], report.snapshot()


def test_triton_path_matches_torch_path(demo_dir, monkeypatch):
    want, torch_report = run(demo_dir, monkeypatch, "torch")
    got, triton_report = run(demo_dir, monkeypatch, "triton")
    assert got == want
    assert set(torch_report["attention.decode"]) == {"torch reference"}
    assert set(triton_report["attention.decode"]) == {"triton paged decode"}
    assert set(triton_report["attention.prefill"]) == {"triton paged prefill"}
    assert set(triton_report["kv_store"]) == {"triton store_kv"}
    assert all(impl.startswith("triton") for impl in triton_report["fused_add_rms_norm"])


def test_fused_silu_and_mul_epilogue_end_to_end(demo_dir, monkeypatch):
    """gate_up interleaved (as the engine does on a GPU) and the table routing its small-batch GEMMs to the skinny
    kernel: decode steps run SiLU·mul in that GEMM's epilogue, prefill chunks the interleaved kernel; the greedy
    outputs stay the torch path's."""
    import torch

    from nvllm.kernels import gemm as G
    from nvllm.layers.linear import interleave_gate_ups

    want, _ = run(demo_dir, monkeypatch, "torch")
    monkeypatch.setenv("NVLLM_KERNELS", "triton")
    llm = make_llm(demo_dir, max_num_batched_tokens=16, block_size=8)
    model = llm.engine.runner.model
    n, k = model.layers[0].gate_up_proj.weight.shape
    G.clear_gemm_table()
    try:
        assert interleave_gate_ups(model) == 0                   # no table entry: cuBLAS, nothing to fuse
        G.set_gemm_choice(n, k, 1, torch.float32, G.SkinnyConfig("fma", 4, 64))
        assert interleave_gate_ups(model) == 0                   # 4-row tiles cannot hold a block pair
        for m in (1, 2, 4):
            G.set_gemm_choice(n, k, m, torch.float32, G.SkinnyConfig("fma", 8, 64))
        assert interleave_gate_ups(model) == len(model.layers)
        report.reset()
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    finally:
        G.clear_gemm_table()
    assert [o.outputs[0].token_ids for o in outs] == [w[:6] for w in want]
    impls = report.snapshot()["silu_and_mul"]
    assert impls.get("in the gate_up GEMM's epilogue", 0) > 0 and impls.get("triton silu_and_mul", 0) > 0, impls


def test_blocks_smaller_than_the_kernels_take_are_refused_up_front(demo_dir, monkeypatch):
    """Blocks of 1, 2 and 4 tokens run on the torch path; where the Triton kernels would run, the config refuses
    them in one line (the attention kernels assert a block of at least 8 deep inside the warm-up)."""
    import pytest

    from nvllm import EngineConfig
    from nvllm.config import ConfigError

    monkeypatch.setenv("NVLLM_KERNELS", "torch")
    assert EngineConfig(model=demo_dir, device="cpu", block_size=4).block_size == 4
    monkeypatch.setenv("NVLLM_KERNELS", "triton")
    with pytest.raises(ConfigError, match="block_size must be at least 8 on cpu"):
        EngineConfig(model=demo_dir, device="cpu", block_size=4)
    assert EngineConfig(model=demo_dir, device="cpu", block_size=8).block_size == 8
