"""Engine configuration: one dataclass, validated once, shared by every command."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nvllm.kernels.backend import triton_on

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
KV_CACHE_DTYPE_CHOICES = ("auto", "int8", "fp8_e4m3")
MIN_TRITON_BLOCK_SIZE = 8  # the paged attention kernels' smallest block (the torch path takes 1, 2 and 4 too)


class ConfigError(ValueError):
    """A user mistake in the engine options or the model directory (one clear line)."""


def first_line(e: BaseException) -> str:
    """An exception's first non-blank line (libraries' messages often run over several), or its type's name. A line
    that ends in a colon only introduces the reason, on the next line: the two are joined."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    out = lines[0] if lines else type(e).__name__
    for line in lines[1:]:
        if not out.endswith(":"):
            break
        out = f"{out} {line}"
    return out


def missing(path: str | os.PathLike, kind: str = "file") -> str:
    """Why ``path`` is not the ``kind`` ("file" or "directory") expected there, for a message: "does not exist", or
    "is a directory" / "is not a directory" (a file given for a directory, or the reverse)."""
    p = Path(path).expanduser()
    if not p.exists():
        return "does not exist"
    if kind == "directory":
        return "is not a directory"
    return "is a directory" if p.is_dir() else "is not a regular file"


def resolve_device(name: str) -> str:
    """``auto``: cuda when available, else cpu. Otherwise cpu, cuda or cuda:N, checked against this machine."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"unknown device {name!r}; use auto, cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name} requested but CUDA is not available")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(f"device {name} requested but {torch.cuda.device_count()} GPU(s) are visible")
    return name


def _json_object(value: Any, name: str, what: str) -> dict:
    """A dict, its JSON text or None (an empty dict): the CLI's JSON-valued options."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{name} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{name} must be a JSON object of {what}, got {value!r}")
    return dict(value)


@dataclass
class EngineConfig:
    model: str | None = None  # None: the embedded demo model
    tokenizer: str | None = None
    # the Hub revision (branch, tag or commit) of a model given as a repo id; the tokenizer's defaults to the
    # model's when the tokenizer is the model's (as vLLM's)
    revision: str | None = None
    tokenizer_revision: str | None = None
    # vLLM's, for its command lines and scripts: "auto" (or "hf") reads the HF tokenizer files, as nvllm always
    # does; quantization names the checkpoint's method (checked against it), or "fp8" for a 16/32-bit checkpoint
    # quantized to FP8 while it loads (nvllm.quant.fp8); trust_remote_code has nothing to allow, since nvllm runs
    # its own code for the architectures it supports and refuses the others
    tokenizer_mode: str = "auto"
    quantization: str | None = None
    trust_remote_code: bool = False
    # vLLM's --max-logprobs: the most logprobs / prompt_logprobs a request may ask (-1: the whole vocabulary);
    # None: 20 on the server, the vocabulary offline
    max_logprobs: int | None = None
    disable_log_stats: bool = False  # vLLM's name for log_stats_interval 0
    dtype: str = "auto"  # auto: the checkpoint's dtype on GPU, float32 on CPU
    device: str = "auto"  # auto: cuda when available
    seed: int = 0
    load_format: str = "auto"  # auto | safetensors | pt | dummy
    allow_pickle: bool = False  # .bin/.pt checkpoints are pickles: refused unless the user opts in
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: float | None = None  # GiB; the CPU's way to size the pool
    kv_cache_dtype: str = "auto"  # auto (the model dtype) | int8 | fp8_e4m3: 8-bit K/V, per-token-head scales
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    # fcfs: first come, first served; priority: a request's priority (lower first, then arrival) orders admission,
    # and preemption takes the highest value first (vLLM's --scheduling-policy)
    scheduling_policy: str = "fcfs"
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    # schedule and launch step N + 1 while step N runs, its sampled tokens fed on the device; None: on for one
    # CUDA device without speculative decoding
    async_scheduling: bool | None = None
    tensor_parallel_size: int = 1  # ranks (GPUs) the model is split over; one worker process per extra rank
    log_stats_interval: float = 5.0  # seconds between periodic log lines; 0 turns them off
    hf_overrides: dict[str, Any] = field(default_factory=dict)  # config.json fields to replace (or JSON text)
    # speculative decoding: "k=4,draft=DIR" | "k=3,method=ngram" | "k=auto,draft=DIR" | JSON | dict | None
    speculative: Any = None  # parsed into nvllm.spec.config.SpeculativeConfig
    # sampling defaults (vLLM's --generation-config): auto (the model's generation_config.json) | vllm (ignore it)
    # | a folder holding one; nvllm.engine.generation_defaults
    generation_config: str = "auto"
    # structured outputs for the whole engine (vLLM's --structured-outputs-config): {"backend": "auto" | "xgrammar",
    # "disable_any_whitespace": bool} or its JSON text; requests' constraints use it
    structured_outputs_config: Any = None
    # a thinking model's <think> block (nvllm.reasoning_parsers): the server puts it in reasoning_content, and a
    # request's structured outputs constraint applies from its end on (vLLM's --reasoning-parser)
    reasoning_parser: str | None = None
    # LoRA adapters (vLLM's --enable-lora): at most max_loras on the device at once, of rank up to max_lora_rank;
    # decode steps replay CUDA graphs that read each row's adapter slot; any tensor-parallel size, with or without
    # speculative decoding (the draft proposes without adapters)
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 64
    max_cpu_loras: int | None = None  # adapters kept in host memory (None: max_loras), idle ones dropped first

    def __post_init__(self) -> None:
        if self.model is None:
            from nvllm.assets import demo_model_path

            self.model = demo_model_path()
        self.model = os.path.expanduser(str(self.model))
        if self.tokenizer is None:
            self.tokenizer = self.model
            if self.tokenizer_revision is None:
                self.tokenizer_revision = self.revision
        for name in ("revision", "tokenizer_revision"):
            if getattr(self, name) is not None and not (isinstance(getattr(self, name), str) and getattr(self, name)):
                raise ConfigError(f"{name} must be a non-empty string (a branch, tag or commit), got "
                                  f"{getattr(self, name)!r}")
        self.device = resolve_device(self.device)
        if isinstance(self.dtype, torch.dtype):  # LLM(dtype=torch.bfloat16), as vLLM takes it
            self.dtype = next((k for k, v in _DTYPES.items() if v == self.dtype), str(self.dtype))
        if self.seed is None:  # vLLM's seed=None: unseeded, so a seed of its own each time
            import secrets

            self.seed = secrets.randbelow(2**31)
        if self.tokenizer_mode not in ("auto", "hf"):
            raise ConfigError(f"tokenizer_mode {self.tokenizer_mode!r} is not supported: nvllm reads the model's HF "
                              "tokenizer files (tokenizer_mode auto)")
        if self.quantization is not None:
            self.quantization = str(self.quantization).lower().replace("_", "-").removesuffix("-marlin")
            if self.quantization not in ("awq", "gptq", "compressed-tensors", "fp8"):
                raise ConfigError(f"quantization {self.quantization!r} is not supported: nvllm serves awq, gptq, fp8 "
                                  "and compressed-tensors checkpoints (`nvllm quantize` makes them) and finds the "
                                  "method in config.json without this option; fp8 also quantizes a 16/32-bit "
                                  "checkpoint while it loads")
        if self.disable_log_stats:
            self.log_stats_interval = 0
        if self.max_logprobs is not None and (isinstance(self.max_logprobs, bool) or self.max_logprobs < -1):
            raise ConfigError(f"max_logprobs must be -1 (the vocabulary) or at least 0, got {self.max_logprobs}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; choose auto, float32, bfloat16 or float16")
        if self.load_format not in ("auto", "safetensors", "pt", "dummy"):
            raise ConfigError(f"unknown load format {self.load_format!r}; choose auto, safetensors, pt or dummy")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.block_size < MIN_TRITON_BLOCK_SIZE and triton_on(self.device):
            raise ConfigError(f"block_size must be at least {MIN_TRITON_BLOCK_SIZE} on {self.device} (the Triton "
                              f"attention kernels' smallest), got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs must be at least 1")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError(f"scheduling_policy {self.scheduling_policy!r} is not supported: fcfs or priority")
        if self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens must be at least 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError("num_kv_blocks must be at least 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization must be in (0, 1]")
        if self.kv_cache_memory is not None and not (0 < self.kv_cache_memory and math.isfinite(self.kv_cache_memory)):
            raise ConfigError(f"kv_cache_memory must be a positive number of GiB, got {self.kv_cache_memory}")
        if not (self.log_stats_interval >= 0 and math.isfinite(self.log_stats_interval)):
            raise ConfigError(f"log_stats_interval must be a non-negative number of seconds (0: off), got "
                              f"{self.log_stats_interval}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError("max_model_len must be at least 1")
        self._check_hf_overrides()
        self._check_structured_outputs_config()
        if self.reasoning_parser is not None:
            from nvllm.reasoning_parsers import REASONING_PARSERS

            if self.reasoning_parser not in REASONING_PARSERS:
                raise ConfigError(f"unknown reasoning parser {self.reasoning_parser!r}; choose "
                                  f"{', '.join(sorted(REASONING_PARSERS))}")
        self._check_tensor_parallel_size()
        self._check_kv_cache_dtype()
        from nvllm.engine.generation_defaults import check_setting

        self.generation_config = check_setting(self.generation_config)
        if self.speculative is not None:
            from nvllm.spec.config import parse_speculative

            self.speculative = parse_speculative(self.speculative)
        self._check_async_scheduling()
        self._check_lora()

    def _check_lora(self) -> None:
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ConfigError("max_loras and max_lora_rank must be at least 1")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")

    def _check_async_scheduling(self) -> None:
        if self.async_scheduling and self.speculative is not None:
            raise ConfigError("async_scheduling does not combine with speculative decoding (its steps read the "
                              "verified tokens back at once)")
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ConfigError("async_scheduling runs on one rank; turn it off with tensor_parallel_size > 1")
        if self.async_scheduling is None:
            self.async_scheduling = (self.device.startswith("cuda") and self.speculative is None
                                     and self.tensor_parallel_size == 1)

    def _check_hf_overrides(self) -> None:
        """A dict of config.json fields, or its JSON text (the CLI's --hf-overrides)."""
        self.hf_overrides = _json_object(self.hf_overrides, "hf_overrides", "config.json fields")

    def _check_structured_outputs_config(self) -> None:
        value = _json_object(self.structured_outputs_config, "structured_outputs_config", "settings")
        unknown = sorted(set(value) - {"backend", "disable_any_whitespace"})
        if unknown:
            raise ConfigError(f"unknown structured_outputs_config field {unknown[0]!r}; the fields are backend and "
                              "disable_any_whitespace")
        if value.setdefault("backend", "auto") not in ("auto", "xgrammar"):
            raise ConfigError(f"structured outputs backend {value['backend']!r} is not available; nvllm uses xgrammar "
                              "(auto)")
        if not isinstance(value.setdefault("disable_any_whitespace", False), bool):
            raise ConfigError("structured_outputs_config's disable_any_whitespace must be true or false")
        self.structured_outputs_config = value

    def _check_tensor_parallel_size(self) -> None:
        n = self.tensor_parallel_size
        if not isinstance(n, int) or n < 1:
            raise ConfigError(f"tensor_parallel_size must be a positive integer, got {n!r}")
        if n > 1 and self.device.startswith("cuda"):
            first, count = torch.device(self.device).index or 0, torch.cuda.device_count()
            if first + n > count:
                raise ConfigError(f"tensor_parallel_size {n} needs GPUs cuda:{first}..cuda:{first + n - 1}, but "
                                  f"{count} GPU(s) are visible")

    def _check_kv_cache_dtype(self) -> None:
        if self.kv_cache_dtype == "fp8":  # vLLM's name for it
            self.kv_cache_dtype = "fp8_e4m3"
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ConfigError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; choose auto, int8 or fp8_e4m3")
        if self.kv_cache_dtype == "fp8_e4m3" and self.device.startswith("cuda") and torch.cuda.is_available():
            dev = torch.device(self.device)
            major, minor = torch.cuda.get_device_capability(dev)
            if (major, minor) < (8, 9):
                raise ConfigError(f"kv_cache_dtype fp8_e4m3 needs a GPU of compute capability 8.9 or newer; "
                                  f"{torch.cuda.get_device_name(dev)} is {major}.{minor} (use int8)")

    def torch_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        """float32 on CPU; on GPU the checkpoint's half type, bfloat16 for float32 checkpoints."""
        if self.dtype != "auto":
            return _DTYPES[self.dtype]
        if self.device == "cpu":
            return torch.float32
        return checkpoint_dtype if checkpoint_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16

    @property
    def tokenizer_follows_model(self) -> bool:
        """The tokenizer is the model's own (the same name at the same revision): resolved with it."""
        return self.tokenizer == self.model and self.tokenizer_revision == self.revision

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        return json.dumps(self.to_dict(), default=str)
