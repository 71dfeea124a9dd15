"""Engine options shared by every command that builds an engine (generate, serve, bench, eval, pipeline), and the
commands' one way to fail.

`engine_options` adds the flags to a Typer command's signature and hands the command one EngineConfig, so
the flags are declared once and parsed the same way everywhere."""

from __future__ import annotations

import functools
import inspect
import typing
from typing import Annotated, Any, Optional

import typer

from nvllm.config import ConfigError, EngineConfig

_PANEL = "Engine"
# an unreadable file or a directory given for one (and the reverse) is the user's too: OSError's own text says which
USER_ERRORS = (ConfigError, ValueError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


def fail(message: str | BaseException, code: int = 2):
    """One clear line on stderr and a non-zero exit: how every user mistake ends. The line is never broken at the
    console's width (80 columns when stderr is not a terminal); a terminal wraps it for display. An OSError that names
    its file says it as ``FILE: reason``."""
    from nvllm.logger import console

    from rich.markup import escape

    if isinstance(message, OSError) and message.filename is not None and message.strerror:
        message = f"{message.filename}: {message.strerror}"
    message = str(message)

    # the message is text: a path or a pip extra in brackets ('.[eval]') is printed as written
    console().print(f"[bold red]error:[/] {escape(message)}", highlight=False, markup=True, soft_wrap=True)
    raise typer.Exit(code)


def check_gate_thresholds(max_drop: float | None, max_drop_rel: float | None) -> tuple[float | None, float | None]:
    """The regression gate's thresholds in force (eval --baseline, pipeline): neither given, a drop of at most 1.0
    point; or one line and exit 2."""
    from nvllm.eval.regression import check_thresholds

    if max_drop is None and max_drop_rel is None:
        max_drop = 1.0
    try:
        check_thresholds(max_drop, max_drop_rel)
    except ValueError as e:
        fail(str(e))
    return max_drop, max_drop_rel


def panel_option(panel: str):
    """``opt(default, annotation, help, *flags)`` → (default, Annotated option) shown under ``panel`` in --help: how
    an option group (see ``option_group``) declares its flags."""

    def opt(default: Any, annotation: Any, help: str, *flags: str) -> tuple[Any, Any]:
        return default, Annotated[annotation, typer.Option(*flags, help=help, rich_help_panel=panel)]

    return opt


_opt = panel_option(_PANEL)


ENGINE_OPTIONS: dict[str, tuple[Any, Any]] = {
    "model": _opt(None, Optional[str], "HF model directory or Hub id (default: the embedded stories260K demo "
                  "model)"),
    "tokenizer": _opt(None, Optional[str], "tokenizer directory or Hub id (default: the model's)"),
    "revision": _opt(None, Optional[str], "the Hub branch, tag or commit of --model (default: the main branch)"),
    "tokenizer_revision": _opt(None, Optional[str], "the Hub branch, tag or commit of --tokenizer (default: "
                               "--revision when the tokenizer is the model's)"),
    "tokenizer_mode": _opt("auto", str, "auto: the model's HF tokenizer files (vLLM's flag; the only mode)"),
    "quantization": _opt(None, Optional[str], "awq | gptq | compressed-tensors | fp8: the checkpoint's method, "
                         "checked against its config.json (default: read from it); fp8 on a 16/32-bit checkpoint "
                         "quantizes its decoder linears to FP8 while it loads", "--quantization", "-q"),
    "trust_remote_code": _opt(False, bool, "accepted for vLLM's command lines, without effect: nvllm runs its own "
                              "code for the architectures it supports"),
    "disable_log_stats": _opt(False, bool, "no periodic stats lines (vLLM's flag; --log-stats-interval 0)"),
    "max_logprobs": _opt(None, Optional[int], "the most logprobs / prompt_logprobs a request may ask (-1: the "
                         "vocabulary; default: 20 on the server, the vocabulary offline)"),
    "dtype": _opt("auto", str, "auto | float32 | bfloat16 | float16 (auto: float32 on CPU; on a GPU the "
                  "checkpoint's, bfloat16 for a float32 one)"),
    "device": _opt("auto", str, "auto | cpu | cuda | cuda:N"),
    "seed": _opt(0, int, "engine seed (sampling without a per-request seed, dummy weights)"),
    "load_format": _opt("auto", str, "auto | safetensors | pt | dummy (random weights from config.json)"),
    "allow_pickle": _opt(False, bool, "allow loading pickle (.bin/.pt) checkpoints, which can run code"),
    "max_model_len": _opt(None, Optional[int], "maximum tokens per sequence (default: the model's)"),
    "block_size": _opt(16, int, "tokens per KV-cache block"),
    "num_kv_blocks": _opt(None, Optional[int], "KV-cache blocks (overrides the memory-based sizing)"),
    "kv_cache_memory": _opt(None, Optional[float], "KV-cache size in GiB (the CPU's way to size the pool)"),
    "kv_cache_dtype": _opt("auto", str, "auto | int8 | fp8_e4m3 (or fp8): KV-cache elements (auto: the model dtype; "
                           "int8/fp8_e4m3: 8 bits with a scale per token and head, about twice the tokens; "
                           "fp8_e4m3 on GPUs of compute capability >= 8.9 and on CPU)"),
    "gpu_memory_utilization": _opt(0.9, float, "fraction of GPU memory for weights, activations and KV cache"),
    "max_num_seqs": _opt(256, int, "maximum sequences in one batch"),
    "max_num_batched_tokens": _opt(2048, int, "token budget of one step (prefill chunks + decodes)"),
    "scheduling_policy": _opt("fcfs", str, "fcfs | priority: requests' priority (lower first) orders admission "
                              "and preemption"),
    "enable_prefix_caching": _opt(True, bool, "share KV blocks of common prompt prefixes",
                                  "--enable-prefix-caching/--no-enable-prefix-caching"),
    "enforce_eager": _opt(False, bool, "never capture CUDA graphs"),
    "async_scheduling": _opt(None, Optional[bool], "schedule and launch the next step while the GPU runs this "
                             "one (default: on for one GPU without speculative decoding)",
                             "--async-scheduling/--no-async-scheduling"),
    "tensor_parallel_size": _opt(1, int, "split the model over N GPUs (N processes; gloo ranks on CPU)",
                                 "--tensor-parallel-size", "-tp"),
    "hf_overrides": _opt(None, Optional[str], "JSON object of config.json fields to replace, e.g. "
                         "'{\"max_position_embeddings\": 4096}'"),
    "log_stats_interval": _opt(5.0, float, "seconds between engine log lines (0: off)"),
    "generation_config": _opt("auto", str, "sampling defaults for requests that leave them unset: auto (the "
                              "model's generation_config.json: temperature, top_p, top_k, min_p, "
                              "repetition_penalty, max_new_tokens) | vllm (ignore it) | a folder holding one"),
    "structured_outputs_config": _opt(None, Optional[str], "JSON settings of structured outputs (response_format, "
                                      "guided_*): {\"backend\": \"xgrammar\", \"disable_any_whitespace\": true} "
                                      "keeps JSON free of runs of whitespace a small model may loop in"),
    "reasoning_parser": _opt(None, Optional[str], "a thinking model's <think> block: qwen3 | deepseek_r1 (DeepSeek-R1, "
                             "QwQ, Qwen3-Thinking); served in reasoning_content, and structured outputs apply after "
                             "it"),
    "enable_lora": _opt(False, bool, "serve LoRA adapters on top of the model (PEFT checkpoints)"),
    "max_loras": _opt(4, int, "LoRA adapters held on the device at once"),
    "max_lora_rank": _opt(64, int, "largest LoRA rank accepted"),
    "max_cpu_loras": _opt(None, Optional[int], "LoRA adapters kept in host memory (default: --max-loras)"),
    "speculative": _opt(None, Optional[str], "speculative decoding: k=4,draft=DIR | k=3,method=ngram | "
                        "k=auto,draft=DIR | JSON {\"model\": DIR, \"num_speculative_tokens\": 4} (also as "
                        "vLLM's --speculative-config)", "--speculative", "--speculative-config"),
}


def option_group(options: dict[str, tuple[Any, Any]], build, kwarg: str):
    """A decorator adding `options` (name → (default, Annotated type)) to a Typer command's flags; the command
    receives `kwarg=build(**values)` instead (a user mistake in build: one line and exit 2)."""

    def decorate(fn):
        sig = inspect.signature(fn)
        hints = typing.get_type_hints(fn, include_extras=True)  # resolve string annotations for Typer
        own = [p.replace(annotation=hints.get(name, p.annotation))
               for name, p in sig.parameters.items() if name != kwarg]
        extra = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=ann)
                 for name, (default, ann) in options.items()]

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            opts = {name: kwargs.pop(name) for name in options}
            try:
                value = build(**opts)
            except USER_ERRORS as e:
                fail(e)
            return fn(*args, **{kwarg: value}, **kwargs)

        wrapper.__signature__ = sig.replace(parameters=own + extra)
        wrapper.__annotations__ = {p.name: p.annotation for p in own + extra}
        del wrapper.__wrapped__  # Typer must read the new signature, not the original's
        return wrapper

    return decorate


# Decorator: append ENGINE_OPTIONS to fn's CLI flags; fn receives `engine_config: EngineConfig`.
engine_options = option_group(ENGINE_OPTIONS, EngineConfig, "engine_config")
