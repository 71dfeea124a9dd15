"""Model names: a local directory is used as is; anything else is taken as a Hugging Face Hub repo id and
downloaded (config, tokenizer and safetensors only; not Mistral's consolidated.safetensors) when the network
allows, at ``revision`` (a branch, tag or commit; the default branch when None) — from the local Hub cache when the
network is off (HF_HUB_OFFLINE=1). As in vLLM, a revision given with a local directory has nothing to select and is
ignored."""

from __future__ import annotations

import os
import socket
from urllib.parse import urlparse

from nvllm.config import ConfigError, first_line

_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
_IGNORED = ["consolidated*"]    # Mistral's own format of the same weights, beside the Hugging Face files: not read


def resolve_model_path(name: str, revision: str | None = None, weights: bool = True, what: str = "model") -> str:
    """``name`` as a local directory (downloaded first when it is a Hub id); ``weights`` False: the config and
    tokenizer files alone (what a benchmark client counts tokens with); ``what`` names it in an error."""
    if os.path.isdir(name):
        return name
    if os.path.sep in name.strip("/") and name.count("/") != 1 or name.startswith(("/", ".", "~")):
        raise ConfigError(f"{what} directory not found: {name}")
    try:
        from huggingface_hub import snapshot_download

        patterns = _PATTERNS if weights else [p for p in _PATTERNS if p != "*.safetensors"]
        return snapshot_download(repo_id=name, revision=revision, allow_patterns=patterns, ignore_patterns=_IGNORED)
    except Exception as e:
        at = f" at revision {revision!r}" if revision else ""
        raise ConfigError(f"{what} directory not found, and {name!r}{at} could not be fetched from the "
                          f"Hugging Face Hub: {type(e).__name__}: {first_line(e)}") from e


def hub_offline() -> bool:
    """HF_HUB_OFFLINE / HF_DATASETS_OFFLINE as huggingface_hub reads them (1, true, yes, on)."""
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hub's endpoint (HF_ENDPOINT, a mirror, or huggingface.co) answers a connection; assumed so behind
    a proxy, which only a request through it can tell. The offline switches are hub_offline's to read."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True
    url = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        socket.create_connection((url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)),
                                 timeout=timeout).close()
        return True
    except OSError:
        return False
