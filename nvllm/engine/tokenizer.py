"""The tokenizer of a model directory (one clear error when there is none) and the token ids that end a sequence."""

from __future__ import annotations

from nvllm.config import ConfigError


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:
        raise ConfigError(f"cannot load a tokenizer from {path}: {e}") from e


def eos_token_ids(model_dir: str, tokenizer) -> set[int]:
    ids: set[int] = set()
    try:
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except Exception:  # no generation_config.json: the tokenizer's EOS alone
        pass
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
