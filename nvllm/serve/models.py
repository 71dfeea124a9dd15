"""The model names a server answers to: the base model's, and each LoRA adapter's (``--lora-modules``), as vLLM
lists and resolves them. A request's ``model`` picks the adapter; its response carries the name it asked for."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from nvllm.lora.request import LoRARequest
from nvllm.serve.errors import APIError
from nvllm.serve.http import parse_body
from nvllm.serve.protocol import LoadLoRAAdapterRequest, ModelCard, ModelList, UnloadLoRAAdapterRequest


class ServedModels:
    def __init__(self, base_name: str, root: str, max_model_len: int, adapters: list[LoRARequest] | None = None,
                 aliases: list[str] | tuple[str, ...] = ()):
        """``aliases``: the base model's other names (--served-model-name given more than once), as vLLM serves
        them: requests may name any, and responses carry the first."""
        self.base_name, self.root, self.max_model_len = base_name, root, max_model_len
        self.aliases = [a for a in dict.fromkeys(aliases) if a != base_name]
        self.adapters = {a.lora_name: a for a in adapters or []}
        self._next_id = max((a.lora_int_id for a in self.adapters.values()), default=0) + 1  # never reused
        taken = sorted({base_name, *self.aliases} & set(self.adapters))
        if taken:
            raise ValueError(f"LoRA adapter name {taken[0]!r} is a served model name")

    def _is_base(self, name: str | None) -> bool:
        return not name or name == self.base_name or name in self.aliases

    def check(self, name: str | None) -> None:
        """404 for a name the server does not serve (None or "": the base model, as vLLM takes them)."""
        if not self._is_base(name) and name not in self.adapters:
            served = ", ".join(f"`{n}`" for n in [self.base_name, *self.aliases, *self.adapters])
            raise APIError(404, f"The model `{name}` does not exist (this server serves {served})", "model",
                           "model_not_found")

    def lora(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names, or None for the base model; 404 for an adapter unloaded since
        the request's name was checked (it never runs on the base model under the adapter's name)."""
        if self._is_base(name):
            return None
        self.check(name)
        return self.adapters[name]

    def response_name(self, name: str | None) -> str:
        """The name a response carries: the adapter's the request gave (checked when it came: an adapter unloaded
        since keeps its name on the replies of requests that named it), else the base model's first name."""
        return self.base_name if self._is_base(name) else name

    def add(self, name: str, path: str) -> LoRARequest:
        """A new adapter name (its id the next free one); ValueError when the name is taken."""
        if self._is_base(name) or name in self.adapters:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        adapter = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        self.adapters[name] = adapter
        return adapter

    def discard(self, adapter: LoRARequest) -> None:
        """Forget ``adapter``'s name if it still names this adapter (a load that failed: while it waited for the
        engine, an unload and a new load of the same name may have come and gone)."""
        if self.adapters.get(adapter.lora_name) is adapter:
            del self.adapters[adapter.lora_name]

    def remove(self, name: str) -> LoRARequest:
        if name not in self.adapters:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
        return self.adapters.pop(name)

    def cards(self) -> ModelList:
        base = [ModelCard(id=n, root=self.root, max_model_len=self.max_model_len) for n in [self.base_name,
                                                                                               *self.aliases]]
        return ModelList(data=[*base, *(ModelCard(id=a.lora_name, root=a.lora_path, parent=self.base_name,
                                                 max_model_len=self.max_model_len) for a in self.adapters.values())])


def lora_routes(models: ServedModels, engine, limit: int) -> APIRouter:
    """vLLM's runtime adapter endpoints (``NVLLM_ALLOW_RUNTIME_LORA_UPDATING=1``): POST /v1/load_lora_adapter and
    /v1/unload_lora_adapter, each answering plain text as vLLM's do."""
    router = APIRouter()

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        req = await parse_body(request, LoadLoRAAdapterRequest, limit)
        if not engine.engine.config.enable_lora:
            raise APIError(400, "LoRA adapters need the server started with --enable-lora", "lora_name")
        try:
            adapter = models.add(req.lora_name, req.lora_path)
        except ValueError as e:
            raise APIError(400, str(e), "lora_name") from None
        try:
            await asyncio.wrap_future(engine.call(lambda e: e.load_lora(adapter)))
        except Exception as e:  # noqa: BLE001 - whatever the adapter did, the name is released
            models.discard(adapter)
            raise APIError(400, str(e), "lora_path") from None
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        req = await parse_body(request, UnloadLoRAAdapterRequest, limit)
        adapter = models.remove(req.lora_name)  # no new requests; its weights go once its requests end
        engine.call(lambda e: e.unload_lora(adapter.lora_int_id))
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    return router
