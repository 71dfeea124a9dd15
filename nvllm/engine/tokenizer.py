"""The tokenizer of a model directory (one clear error when there is none) and the token ids that end a sequence."""

from __future__ import annotations

import os
import re

from nvllm.config import ConfigError, first_line

_TOKENIZER_FILE = re.compile(r"(tokenizer.*|vocab.*|.*\.model|.*\.tiktoken)$")


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as e:
        if os.path.isdir(path) and not any(_TOKENIZER_FILE.match(f) for f in os.listdir(path)):
            raise ConfigError(f"no tokenizer in {path} (no tokenizer.json, tokenizer_config.json, vocab or "
                              ".model file)") from e
        raise ConfigError(f"cannot load a tokenizer from {path}: {first_line(e)}") from e
    # prompts are checked against the engine's max_model_len; transformers' warning that one exceeds the tokenizer's
    # model_max_length (often not the length served) is marked as given, so that it never adds a misleading line
    if isinstance(getattr(tokenizer, "deprecation_warnings", None), dict):
        tokenizer.deprecation_warnings["sequence-length-is-longer-than-the-specified-maximum"] = True
    return tokenizer


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
