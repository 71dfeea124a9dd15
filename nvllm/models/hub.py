"""Model names: a local directory is used as is; anything else is taken as a Hugging Face Hub repo id and
downloaded (config, tokenizer and safetensors only; not Mistral's consolidated.safetensors) when the network
allows, at ``revision`` (a branch, tag or commit; the default branch when None) — from the local Hub cache when the
network is off (HF_HUB_OFFLINE=1). As in vLLM, a revision given with a local directory has nothing to select and is
ignored."""

from __future__ import annotations

import os

from nvllm.config import ConfigError, first_line

_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
_IGNORED = ["consolidated*"]    # Mistral's own format of the same weights, beside the Hugging Face files: not read


def resolve_model_path(name: str, revision: str | None = None, weights: bool = True) -> str:
    """``name`` as a local directory (downloaded first when it is a Hub id); ``weights`` False: the config and
    tokenizer files alone (what a benchmark client counts tokens with)."""
    if os.path.isdir(name):
        return name
    if os.path.sep in name.strip("/") and name.count("/") != 1 or name.startswith(("/", ".", "~")):
        raise ConfigError(f"model directory not found: {name}")
    try:
        from huggingface_hub import snapshot_download

        patterns = _PATTERNS if weights else [p for p in _PATTERNS if p != "*.safetensors"]
        return snapshot_download(repo_id=name, revision=revision, allow_patterns=patterns, ignore_patterns=_IGNORED)
    except Exception as e:
        at = f" at revision {revision!r}" if revision else ""
        raise ConfigError(f"model directory not found, and {name!r}{at} could not be fetched from the "
                          f"Hugging Face Hub: {type(e).__name__}: {first_line(e)}") from e
