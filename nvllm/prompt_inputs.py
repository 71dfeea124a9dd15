"""vLLM's dict prompts (TextPrompt {"prompt": ...}, TokensPrompt {"prompt_token_ids": ...}, ``cache_salt`` beside
either), read the same way by LLM and LLMEngine."""

from __future__ import annotations


def prompt_of(p):
    """A dict prompt's text or token ids; anything else as it is."""
    if not isinstance(p, dict):
        return p
    if ("prompt" in p) == ("prompt_token_ids" in p):
        raise ValueError(f"a dict prompt holds exactly one of 'prompt' and 'prompt_token_ids', got {sorted(p)}")
    return p["prompt"] if "prompt" in p else p["prompt_token_ids"]


def cache_salt_of(p) -> str | None:
    """A dict prompt's cache_salt (None for none); ValueError for one that is not a non-empty string."""
    salt = p.get("cache_salt") if isinstance(p, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
    return salt


def cache_salts(prompts) -> list[str | None]:
    return [cache_salt_of(p) for p in prompts]
