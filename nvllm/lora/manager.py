"""The model runner's LoRA adapters: the decoder linears wrapped once (``LoRALinear``), adapters loaded onto them
on demand (at most ``max_loras`` at once; one no unfinished sequence uses is dropped, least recently used first,
to make room), and each step's mapping of tokens to adapters."""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict

import torch

from nvllm.lora.adapter import load_adapter
from nvllm.lora.layers import LoRALinear, LoRAMapping
from nvllm.lora.request import LoRARequest

logger = logging.getLogger("nvllm")

_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def lora_salt(request: LoRARequest) -> bytes:
    """The prefix-cache salt of an adapter's sequences (nvllm.engine.block_manager)."""
    return hashlib.sha256(b"lora\0" + request.lora_name.encode()).digest()


class LoRAManager:
    def __init__(self, model, dtype: torch.dtype, device: torch.device, max_loras: int, max_lora_rank: int):
        self.model, self.dtype, self.device = model, dtype, device
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.linears: dict[str, LoRALinear] = {}
        for i, layer in enumerate(model.layers):
            for attr in _LINEARS:
                wrapped = LoRALinear(getattr(layer, attr))
                setattr(layer, attr, wrapped)
                self.linears[f"layers.{i}.{attr}"] = wrapped
        self.loaded: OrderedDict[int, LoRARequest] = OrderedDict()  # least recently used first

    def add(self, request: LoRARequest, in_use: set[int]) -> None:
        """Load the adapter unless it is loaded; ValueError when it cannot be (a bad checkpoint, no room, an id or
        a name that another adapter holds)."""
        have = self.loaded.get(request.lora_int_id)
        if have is not None:
            if (have.lora_name, have.lora_path) != (request.lora_name, request.lora_path):
                raise ValueError(f"lora_int_id {request.lora_int_id} is already adapter {have.lora_name!r} "
                                 f"({have.lora_path})")
            self.loaded.move_to_end(request.lora_int_id)
            return
        other = next((r for r in self.loaded.values() if r.lora_name == request.lora_name), None)
        if other is not None:
            raise ValueError(f"LoRA adapter name {request.lora_name!r} is already loaded with id {other.lora_int_id}")
        while len(self.loaded) >= self.max_loras:
            idle = next((i for i in self.loaded if i not in in_use), None)
            if idle is None:
                raise ValueError(f"{self.max_loras} LoRA adapters are in use (max_loras); wait for their requests "
                                 "or raise --max-loras")
            self.remove(idle)
        weights = load_adapter(request.lora_path, self.model, self.dtype, self.device, self.max_lora_rank)
        for name, w in weights.items():
            self.linears[name].adapters[request.lora_int_id] = w
        self.loaded[request.lora_int_id] = request
        logger.info("LoRA adapter %r loaded from %s (id %d, %d linears)", request.lora_name, request.lora_path,
                    request.lora_int_id, len(weights))

    def remove(self, lora_id: int) -> bool:
        request = self.loaded.pop(lora_id, None)
        if request is None:
            return False
        for linear in self.linears.values():
            linear.adapters.pop(lora_id, None)
        logger.info("LoRA adapter %r unloaded", request.lora_name)
        return True

    def mapping(self, token_lora_ids: list[int]) -> LoRAMapping | None:
        """The step's rows of each adapter (id 0, the base model, has none); None when no token runs one."""
        rows: dict[int, list[int]] = {}
        for row, lora_id in enumerate(token_lora_ids):
            if lora_id:
                rows.setdefault(lora_id, []).append(row)
        if not rows:
            return None
        return LoRAMapping({i: torch.tensor(r, dtype=torch.long).to(self.device, non_blocking=True)
                            for i, r in rows.items()})
