"""LoRARequest: which adapter a request runs with (vLLM's class of the same name and fields)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str  # what clients send as ``model``; also part of the prefix-cache key
    lora_int_id: int  # a positive id, unique per adapter
    lora_path: str  # a PEFT adapter directory (adapter_config.json + adapter_model.safetensors)

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("a LoRA adapter needs a name")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        object.__setattr__(self, "lora_path", os.path.expanduser(str(self.lora_path)))


def parse_lora_modules(specs: list[str] | None) -> list[LoRARequest]:
    """``--lora-modules`` values: ``name=path`` items (repeated, or comma-separated), or vLLM's JSON form
    ``{"name": ..., "path": ...}``; ids in order of appearance. ValueError on a malformed or repeated name."""
    import json

    items: list[tuple[str, str]] = []
    for spec in specs or []:
        spec = spec.strip()
        if spec.startswith("{"):
            try:
                d = json.loads(spec)
                items.append((d["name"], d["path"]))
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-modules JSON must be {{\"name\": ..., \"path\": ...}}, got {spec!r}") \
                    from None
            continue
        for part in filter(None, (p.strip() for p in spec.split(","))):
            name, eq, path = part.partition("=")
            if not eq or not name or not path:
                raise ValueError(f"--lora-modules takes name=path, got {part!r}")
            items.append((name, path))
    names = [n for n, _ in items]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ValueError(f"LoRA adapter name {dup!r} is given twice")
    return [LoRARequest(n, i + 1, p) for i, (n, p) in enumerate(items)]


def check_lora_modules(modules: list[LoRARequest], engine_config) -> None:
    """What can be checked of ``--lora-modules`` before the model loads: LoRA is on, and each adapter directory
    holds a readable adapter_config.json (ConfigError otherwise). The server checks the weights as it loads them."""
    from nvllm.config import ConfigError
    from nvllm.lora.adapter import read_adapter_config

    if modules and not engine_config.enable_lora:
        raise ConfigError("--lora-modules needs --enable-lora")
    for m in modules:
        read_adapter_config(m.lora_path)
