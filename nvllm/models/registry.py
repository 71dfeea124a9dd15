"""HF `architectures` name → model class."""

from __future__ import annotations

from nvllm.config import ConfigError
from nvllm.models.llama import LlamaForCausalLM

MODELS = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
}


def resolve_architecture(hf_config) -> tuple[str, type]:
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in MODELS:
            return arch, MODELS[arch]
    raise ConfigError(f"unsupported architecture {archs or '(none in config.json)'}; "
                      f"supported: {', '.join(sorted(MODELS))}")
