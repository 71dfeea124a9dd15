"""Mixture-of-experts models (Qwen2-MoE, Qwen3-MoE, Mixtral) beyond the HF comparisons every architecture gets in
test_engine_vs_hf.py: which layers are sparse (HF's rule), routing against transformers' own routers, the
checkpoint's expert tensors (missing, extra), the fused experts op against a per-token loop written from the
definition, and the features that refuse a mixture of experts with one clear error."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch
import transformers
from typer.testing import CliRunner

from nvllm.cli import app
from nvllm.config import ConfigError
from nvllm.kernels import report
from nvllm.kernels.fused_moe import fused_experts
from nvllm.kernels.moe_routing import route
from nvllm.layers.moe import moe_shape
from tests.conftest import build_tiny_model, make_llm
from tests.test_engine_vs_hf import PROMPT, check_against_hf


def _config(kind: str, **overrides):
    from tests.conftest import ARCHS

    cfg_name, _, extra = ARCHS[kind]
    kw = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2)
    return getattr(transformers, cfg_name)(**{**kw, **extra, **overrides})


@pytest.mark.parametrize("overrides, sparse", [
    ({"mlp_only_layers": [0]}, {1, 2, 3, 4, 5}),
    ({"mlp_only_layers": [], "decoder_sparse_step": 2}, {1, 3, 5}),
    ({"mlp_only_layers": [3], "decoder_sparse_step": 3}, {2, 5}),
])
def test_sparse_layers_follow_hf(overrides, sparse):
    c = _config("qwen3-moe", **overrides)
    m = moe_shape(c, "Qwen3MoeForCausalLM")
    hf = transformers.Qwen3MoeForCausalLM(c)
    assert set(m.sparse_layers) == sparse
    assert {i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")} == sparse
    assert moe_shape(_config("mixtral"), "MixtralForCausalLM").sparse_layers == frozenset(range(6))
    assert moe_shape(_config("qwen3-moe", num_experts=0), "Qwen3MoeForCausalLM") is None
    assert moe_shape(c, "Qwen3ForCausalLM") is None


def test_bad_expert_counts_are_config_errors():
    with pytest.raises(ConfigError, match="num_experts_per_tok 9 must be between 1 and num_experts 8"):
        moe_shape(_config("qwen3-moe", num_experts_per_tok=9), "Qwen3MoeForCausalLM")
    edited = SimpleNamespace(**{**_config("qwen3-moe").to_dict(), "moe_intermediate_size": None})
    with pytest.raises(ConfigError, match="moe_intermediate_size must be a non-negative integer, got None"):
        moe_shape(edited, "Qwen3MoeForCausalLM")
    with pytest.raises(ConfigError, match="moe_intermediate_size 40 is not divisible by tensor_parallel_size 3"):
        moe_shape(_config("qwen3-moe"), "Qwen3MoeForCausalLM", 3, 0)
    with pytest.raises(ConfigError, match="moe_intermediate_size must be positive with 8 experts"):
        moe_shape(_config("qwen3-moe", moe_intermediate_size=0), "Qwen3MoeForCausalLM")
    with pytest.raises(ConfigError, match="shared_expert_intermediate_size must be a positive integer, got 0"):
        moe_shape(_config("qwen2-moe", shared_expert_intermediate_size=0), "Qwen2MoeForCausalLM")


def test_an_unused_dense_intermediate_size_need_not_split():
    """Every layer sparse: the dense intermediate_size (97 here) is never built, so it need not divide by the ranks;
    with a dense layer it must."""
    from nvllm.distributed.partition import check_tensor_parallel
    from nvllm.models.llama import ModelShape

    c = _config("qwen3-moe", intermediate_size=97, mlp_only_layers=[])
    check_tensor_parallel(ModelShape(c, "Qwen3MoeForCausalLM", 2), 2, None)
    with pytest.raises(ConfigError, match="intermediate_size 97 is not divisible by tensor_parallel_size 2"):
        c = _config("qwen3-moe", intermediate_size=97, mlp_only_layers=[0])
        check_tensor_parallel(ModelShape(c, "Qwen3MoeForCausalLM", 2), 2, None)


@pytest.mark.parametrize("kind, arch", [("qwen3-moe", "Qwen3MoeForCausalLM"), ("qwen2-moe", "Qwen2MoeForCausalLM"),
                                        ("mixtral", "MixtralForCausalLM")])
def test_mlp_parameters_count_what_transformers_builds(kind, arch):
    from nvllm.models.llama import ModelShape

    c = _config(kind, mlp_only_layers=[2]) if kind != "mixtral" else _config(kind)
    hf = getattr(transformers, arch)(c)
    want = sum(p.numel() for n, p in hf.named_parameters() if ".mlp." in n or ".block_sparse_moe." in n)
    assert ModelShape(c, arch).mlp_parameters() == want


def test_qwen3_moe_sliding_window_caps_every_layer():
    """transformers slides every Qwen3-MoE layer when use_sliding_window is set, whatever max_window_layers says."""
    from nvllm.models.loader import model_len_limit

    c = _config("qwen3-moe", use_sliding_window=True, sliding_window=16, max_window_layers=6,
                max_position_embeddings=256)
    c.architectures = ["Qwen3MoeForCausalLM"]
    assert model_len_limit(c, warn=False) == 16
    c = _config("qwen3-moe", use_sliding_window=False, sliding_window=16, max_position_embeddings=256)
    c.architectures = ["Qwen3MoeForCausalLM"]
    assert model_len_limit(c, warn=False) == 256


@pytest.mark.parametrize("kind, arch, dtype", [("qwen3-moe", "Qwen3MoeForCausalLM", torch.bfloat16),
                                                ("qwen2-moe", "Qwen2MoeForCausalLM", torch.float32),
                                                ("mixtral", "MixtralForCausalLM", torch.bfloat16)])
def test_routing_equals_the_hf_router(kind, arch, dtype):
    c = _config(kind, norm_topk_prob=False) if kind == "qwen2-moe" else _config(kind)
    torch.manual_seed(0)
    hf = getattr(transformers, arch)(c).to(dtype)
    router = hf.model.layers[1].mlp.gate
    with torch.no_grad():
        router.weight.normal_()
        x = torch.randn(9, c.hidden_size, dtype=dtype)
        logits, hf_weights, hf_ids = router(x)
    m = moe_shape(c, arch)
    weights, ids = route(logits, m.top_k, m.renormalize, m.weights_in_dtype)
    assert torch.equal(ids, hf_ids)
    assert weights.dtype == torch.float32
    torch.testing.assert_close(weights, hf_weights.float(), rtol=0, atol=0)


def test_fused_experts_equals_a_loop_over_tokens():
    """The op from its definition, token by token and slot by slot, in float64."""
    g = torch.Generator().manual_seed(0)
    t, e, k, h, i = 7, 5, 2, 12, 10
    x = torch.randn(t, h, generator=g)
    w13, w2 = torch.randn(e, 2 * i, h, generator=g) / 3, torch.randn(e, h, i, generator=g) / 3
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    ids[3] = torch.tensor([4, 0])          # expert 4 once, the others as they fall
    weights = torch.rand(t, k, generator=g)
    want = torch.zeros(t, h, dtype=torch.float64)
    for r in range(t):
        for j in range(k):
            w = w13[ids[r, j]].double()
            gate, up = w[:i] @ x[r].double(), w[i:] @ x[r].double()
            want[r] += weights[r, j].double() * (w2[ids[r, j]].double() @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids).double(), want, rtol=1e-5, atol=1e-5)


def test_qwen3_moe_with_sparse_steps_matches_hf(tmp_path):
    path = build_tiny_model("qwen3-moe", tmp_path / "m", num_hidden_layers=3, mlp_only_layers=[],
                            decoder_sparse_step=2, norm_topk_prob=False)
    check_against_hf(path, PROMPT, 8)


def _edited(src, dst, drop=(), add=None):
    """A copy of the checkpoint at ``src`` without the tensors named in ``drop`` and with ``add``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    for name in drop:
        del tensors[name]
    tensors.update(add or {})
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_missing_and_extra_expert_tensors_are_config_errors(tiny_models, tmp_path):
    src = tiny_models["mixtral"]
    missing = _edited(src, tmp_path / "missing", drop=["model.layers.1.block_sparse_moe.experts.3.w3.weight"])
    with pytest.raises(ConfigError, match=r"missing tensors: layers.1.moe.experts.w13\[shard \(3, 1\)\]"):
        make_llm(str(missing))
    extra = _edited(src, tmp_path / "extra", add={"model.layers.0.block_sparse_moe.experts.4.w1.weight":
                                                   torch.zeros(96, 64)})
    with pytest.raises(ConfigError, match="the config has 4 experts"):
        make_llm(str(extra))
    wrong = _edited(src, tmp_path / "wrong", add={"model.layers.0.block_sparse_moe.experts.2.w2.weight":
                                                   torch.zeros(64, 95)})
    with pytest.raises(ConfigError, match=r"shape mismatch for 'model.layers.0.block_sparse_moe.experts.2.w2"):
        make_llm(str(wrong))


def test_features_without_expert_support_refuse_clearly(tiny_models, tmp_path):
    path = str(tiny_models["qwen3-moe"])
    with pytest.raises(ConfigError, match="mixture of experts, whose experts nvllm serves in full precision or "
                                          r"packed 4/8-bit \(GPTQ, AWQ\), not in FP8 \(--quantization fp8 was given\)"):
        make_llm(path, quantization="fp8")
    from nvllm.engine import model_runner

    def no_loading(*a, **k):
        raise AssertionError("the weights were loaded before the refusal")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model_runner, "load_model", no_loading)
        with pytest.raises(ConfigError, match="LoRA adapters are not supported on mixture-of-experts models"):
            make_llm(path, enable_lora=True)
    result = CliRunner().invoke(app, ["quantize", "--model", path, "--method", "fp8", "--out", str(tmp_path / "q")])
    assert result.exit_code != 0
    assert "is a mixture of experts (Qwen3MoeForCausalLM): nvllm serves FP8 dense models only, so --method fp8 is " \
        "refused for it" in " ".join(result.output.split())
    assert not (tmp_path / "q").exists()


def test_triton_path_matches_the_torch_path(tiny_models, monkeypatch):
    """The whole engine on the Triton kernels (interpreted) against the torch references: prompts in chunks of 16
    tokens (48 expert rows: the sorted grouped GEMMs) and decode steps of three sequences (the small-batch path)."""
    from nvllm import SamplingParams
    from nvllm.kernels import fused_moe

    monkeypatch.setattr(fused_moe, "SMALL_ROWS", 16)
    prompts = [PROMPT, PROMPT[:7], PROMPT[5:]]
    got = {}
    for kernels in ("torch", "triton"):
        monkeypatch.setenv("NVLLM_KERNELS", kernels)
        llm = make_llm(str(tiny_models["qwen2-moe"]), max_num_batched_tokens=16, block_size=8)
        report.reset()
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        got[kernels] = ([o.outputs[0].token_ids for o in outs], report.snapshot()["fused_moe"])
    assert got["triton"][0] == got["torch"][0]
    assert set(got["torch"][1]) == {"torch reference"}
    assert set(got["triton"][1]) == {"triton gemv (a row per token and expert)",
                                     "triton grouped gemm (moe_align, moe_sum)"}


def test_speculative_decoding_keeps_a_mixture_of_experts_greedy_output(tiny_models):
    from nvllm import SamplingParams

    prompts = [PROMPT + PROMPT[:6], PROMPT[3:]]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in make_llm(str(tiny_models["qwen3-moe"])).generate(prompts, greedy,
                                                                                              use_tqdm=False)]
    llm = make_llm(str(tiny_models["qwen3-moe"]), speculative="k=3,method=ngram")
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == want
    assert llm.engine.stats.spec.num_drafts > 0
