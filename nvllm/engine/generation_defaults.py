"""The model creator's recommended sampling settings as defaults (vLLM's ``--generation-config``).

``auto`` (the default) reads the model directory's generation_config.json, ``vllm`` ignores it (the neutral
defaults below), a folder reads the generation_config.json in it. As in vLLM, the fields taken are
temperature, top_p, top_k, min_p and repetition_penalty, plus max_new_tokens as the default max_tokens; the
rest of the file (do_sample included: vLLM ignores it too) changes nothing. They are defaults only: a request
that sets a field (an explicit SamplingParams, a request field that is not null) wins."""

from __future__ import annotations

import json
import logging
import numbers
import os
from typing import Any

from nvllm.config import ConfigError, first_line
from nvllm.sampling_params import SamplingParams

logger = logging.getLogger("nvllm")

FILE = "generation_config.json"
SETTINGS_HELP = "auto (the model's generation_config.json), vllm (ignore it) or a folder holding one"
# what a request that leaves a field unset gets when the model recommends nothing (SamplingParams' defaults)
NEUTRAL: dict[str, Any] = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")  # vLLM's list
_INTEGERS = ("top_k", "max_new_tokens")
_announced: set[str] = set()


def check_setting(value: str) -> str:
    """``auto``, ``vllm``, or a folder (``~`` expanded) that holds a generation_config.json."""
    if value in ("auto", "vllm"):
        return value
    folder = os.path.expanduser(str(value))
    if not os.path.isdir(folder):
        raise ConfigError(f"generation_config {value!r} is not a folder; use {SETTINGS_HELP}")
    if not os.path.isfile(os.path.join(folder, FILE)):
        raise ConfigError(f"generation_config: no {FILE} in {folder}; use {SETTINGS_HELP}")
    return folder


def load(setting: str, model_dir: str) -> dict[str, Any]:
    """The sampling defaults the setting names, as SamplingParams keywords ({} for ``vllm``, or for ``auto``
    when the model has no generation_config.json). A file that cannot be read or holds a bad value is a
    ConfigError naming it when a folder was given; under ``auto`` it is a warning and no defaults, as vLLM
    ignores a generation config it cannot read (the model still serves)."""
    if setting == "vllm":
        return {}
    folder = model_dir if setting == "auto" else setting
    path = os.path.join(folder, FILE)
    if not os.path.isfile(path):
        return {}
    try:
        found = _read(folder)
    except ConfigError as e:
        if setting != "auto":
            raise
        logger.warning("%s; the model's sampling defaults are not used", e)
        return {}
    return found


def _read(folder: str) -> dict[str, Any]:
    """The folder's generation_config.json sampling fields, checked as SamplingParams checks them (ConfigError
    naming the file)."""
    path = os.path.join(folder, FILE)
    from transformers import GenerationConfig
    from transformers.utils import logging as hf_logging

    # with do_sample false transformers warns that the sampling fields "may be ignored": here they are not
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        config = GenerationConfig.from_pretrained(folder)
    except Exception as e:
        raise ConfigError(f"cannot read {path}: {first_line(e)}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    written = config.to_diff_dict()  # the fields the file sets, not transformers' own defaults
    found = {k: written[k] for k in _FIELDS if written.get(k) is not None}
    for k, v in found.items():
        integral = isinstance(v, numbers.Integral) if k in _INTEGERS else isinstance(v, numbers.Real)
        if isinstance(v, bool) or not integral:
            raise ConfigError(f"{path}: {k} must be {'an integer' if k in _INTEGERS else 'a number'}, got {v!r}")
    if "max_new_tokens" in found:
        found["max_tokens"] = found.pop("max_new_tokens")
    try:
        SamplingParams(**found)
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from None
    return found


def announce(defaults: dict[str, Any]) -> None:
    """Say once per process, where they are first used, that the model's defaults replace the neutral ones."""
    key = json.dumps(defaults, sort_keys=True)
    if defaults and key not in _announced:
        _announced.add(key)
        logger.warning("Default sampling parameters have been overridden by the model's Hugging Face generation "
                       "config recommended from the model creator: %s. If this is not intended, pass "
                       "--generation-config vllm (LLM(..., generation_config='vllm')).", defaults)


def with_defaults(given: dict[str, Any], defaults: dict[str, Any],
                  fallback: dict[str, Any] | None = None) -> dict[str, Any]:
    """Each field of ``fallback`` (NEUTRAL when None): its value in ``given`` unless that is None, else the
    model's default, else fallback's."""
    fallback = NEUTRAL if fallback is None else fallback
    return {k: given[k] if given.get(k) is not None else defaults.get(k, v) for k, v in fallback.items()}


def default_sampling_params(defaults: dict[str, Any]) -> SamplingParams:
    """SamplingParams() with the model's defaults in place (vLLM's LLM.get_default_sampling_params)."""
    announce(defaults)
    return SamplingParams(**defaults)
