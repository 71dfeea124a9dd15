"""The engine's side of runtime LoRA adapters: loading one for a request, unloading one by id, and forgetting an
adapter that sequences still ran with once the last of them ends (vLLM's runtime loading semantics)."""

from __future__ import annotations

from collections.abc import Callable

from nvllm.config import ConfigError
from nvllm.lora.request import LoRARequest


class LoraAdapters:
    """``slots``: the runner's adapter slots (``nvllm.lora``), None without enable_lora; ``in_use``: the ids of the
    adapters that unfinished sequences run with."""

    def __init__(self, slots, in_use: Callable[[], set[int]]):
        self.slots = slots
        self.in_use = in_use
        self._unload_when_idle: set[int] = set()   # unloaded while sequences ran with them

    def load(self, lora_request: LoRARequest | None) -> bytes | None:
        """Read and check the adapter (ValueError: LoRA is off, or the checkpoint is bad); its prefix-cache salt.
        It goes to the device when the scheduler admits one of its sequences."""
        if lora_request is None:
            return None
        if self.slots is None:
            raise ValueError("LoRA adapters need the engine started with enable_lora (--enable-lora)")
        self.unload_idle()
        try:
            return self.slots.register(lora_request, self.in_use())
        except ConfigError as e:  # a bad checkpoint is this request's fault here, not the engine's
            raise ValueError(str(e)) from None

    def unload(self, lora_id: int) -> bool:
        """Forget an adapter; one that sequences still run with is forgotten once they end (False until then).
        Meanwhile a new adapter may take its name (under another id), as vLLM's runtime loading allows."""
        if self.slots is None:
            return False
        if lora_id in self.in_use():
            self._unload_when_idle.add(lora_id)
            return False
        self._unload_when_idle.discard(lora_id)
        return self.slots.forget(lora_id)

    def unload_idle(self) -> None:
        """Forget the adapters unloaded while in use whose sequences have all ended."""
        if self._unload_when_idle:
            idle = self._unload_when_idle - self.in_use()
            for lora_id in idle:
                self.slots.forget(lora_id)
            self._unload_when_idle -= idle
