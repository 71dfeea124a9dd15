"""Shared fixtures: tiny random HF models of each supported architecture, saved as real HF directories
(config.json + model.safetensors + the demo tokenizer) so they load through the real loader."""

from __future__ import annotations

import os

# Without a GPU, Triton kernels can only run under the interpreter, and it must be chosen before triton is
# first imported anywhere.
os.environ.setdefault("TRITON_INTERPRET", "1")

import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from nvllm.assets import demo_model_path  # noqa: E402

# The test models are tiny: one intra-op thread is faster than two fighting over the machine's cores with
# the server subprocesses some tests start.
torch.set_num_threads(1)

TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = next((p for p in (REPO.parent / "shared" / "data", Path("/work/shared/data")) if p.is_dir()), None)

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": False}),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", {
        "tie_word_embeddings": True, "max_position_embeddings": 1024,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64}, "rope_theta": 500000.0}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": False}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"tie_word_embeddings": True, "head_dim": 32}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"tie_word_embeddings": False, "sliding_window": None}),
    # mixtures of experts: Qwen3-MoE with a dense first layer, Qwen2-MoE with its shared expert, Mixtral
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {
        "tie_word_embeddings": False, "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
        "moe_intermediate_size": 40, "norm_topk_prob": True, "mlp_only_layers": [0]}),
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "tie_word_embeddings": False, "num_experts": 6, "num_experts_per_tok": 3, "moe_intermediate_size": 24,
        "shared_expert_intermediate_size": 48}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {
        "tie_word_embeddings": False, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
}


def build_tiny_model(kind: str, path: Path, seed: int = 0, **overrides) -> Path:
    import transformers

    cfg_name, model_name, extra = ARCHS[kind]
    kwargs = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kwargs.update(extra)
    kwargs.update(overrides)
    config = getattr(transformers, cfg_name)(**kwargs)
    config.architectures = [model_name]
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(torch.float32)
    with torch.no_grad():  # give biases and norms non-trivial values so they are really checked
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path, safe_serialization=True)
    for f in TOKENIZER_FILES:
        shutil.copy(Path(demo_model_path()) / f, path / f)
    return path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {k: build_tiny_model(k, root / k) for k in ARCHS}


@pytest.fixture(scope="session")
def demo_dir() -> str:
    return demo_model_path()


def interpreted_kernels(monkeypatch, module: str, kernel: str):
    """``nvllm.kernels.<module>`` with its Triton kernels run by the interpreter: TRITON_INTERPRET set, and the module
    reloaded when ``kernel`` was compiled at import (skipped without Triton)."""
    import importlib

    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    mod = importlib.import_module(f"nvllm.kernels.{module}")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if not isinstance(getattr(mod, kernel), InterpretedFunction):
        importlib.reload(mod)
    return mod


def make_llm(model: str, **kw):
    from nvllm import LLM

    kw.setdefault("log_stats_interval", 0)
    kw.setdefault("device", "cpu")
    return LLM(model, **kw)
