"""The model runner's LoRA adapters: the decoder linears wrapped once (``LoRALinear``, with their device slots);
adapters read and checked when a request names them (``register``: a bad checkpoint is that request's error) and
kept in host memory; put in a device slot when the scheduler admits one of their sequences (``activate``), at most
``max_loras`` at once, an adapter no running sequence uses making room, least recently used first (a sequence
whose adapter finds no slot waits, as in vLLM); and each step's mapping of tokens to slots.

Tensor parallelism: rank 0's manager decides; every slot it fills is queued (``pending``) and rank 0 broadcasts the
queue before the next step (``loads_message``); each worker reads the adapter from the same path into the same slot
(``put``), its own piece of each linear, and the step carries each token's slot."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import OrderedDict
from typing import NamedTuple

import torch

from nvllm.config import ConfigError, first_line
from nvllm.lora.adapter import LoRAWeights, load_adapter
from nvllm.lora.layers import LoRALinear, LoRAMapping
from nvllm.lora.request import LoRARequest

logger = logging.getLogger("nvllm")

_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


MOE_REFUSAL = ("LoRA adapters are not supported on mixture-of-experts models (their experts take none); serve the "
               "model without --enable-lora")


class KnownAdapter(NamedTuple):
    """An adapter read into host memory."""

    request: LoRARequest
    weights: dict[str, LoRAWeights]
    digest: bytes  # adapter_digest of its files when read
    signature: tuple  # files_signature when read


def layer_linears(layer) -> list[str]:
    """The names of a decoder layer's linears that take adapters (all four); ConfigError for a layer whose MLP
    is a mixture of experts, which takes none."""
    if getattr(layer, "moe", None) is not None:
        raise ConfigError(MOE_REFUSAL)
    return list(_LINEARS)


class LoRAManager:
    def __init__(self, model, dtype: torch.dtype, device: torch.device, max_loras: int, max_lora_rank: int,
                 allow_pickle: bool = False, max_cpu_loras: int | None = None, mirrored: bool = False):
        self.model, self.dtype, self.device = model, dtype, device
        self.max_loras, self.max_lora_rank, self.allow_pickle = max_loras, max_lora_rank, allow_pickle
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.linears: dict[str, LoRALinear] = {}
        for i, layer in enumerate(model.layers):
            for attr in layer_linears(layer):
                wrapped = LoRALinear(getattr(layer, attr), max_loras, max_lora_rank, dtype, device)
                setattr(layer, attr, wrapped)
                self.linears[f"layers.{i}.{attr}"] = wrapped
        self.known: OrderedDict[int, KnownAdapter] = OrderedDict()  # by id, least recently used first
        self.loaded: OrderedDict[int, int] = OrderedDict()  # id → its device slot, least recently used first
        self.mirrored = mirrored  # tensor parallelism: the workers fill the same slots
        self.pending: list[tuple[int, LoRARequest, bytes]] = []  # (slot, adapter, digest) since the workers last heard

    def register(self, request: LoRARequest, in_use: set[int]) -> bytes:
        """Read and check the adapter (unless known) and return its digest (``adapter_digest``: its sequences'
        prefix-cache salt). ConfigError for a bad checkpoint, or an id another adapter holds while sequences use it.
        An idle adapter of the same id or name is replaced; one in use under the same name (another id) stays until
        its sequences end."""
        have = self.known.get(request.lora_int_id)
        if have is not None and have.request == request:
            self.known.move_to_end(request.lora_int_id)
            return have.digest
        for lora_id, other in list(self.known.items()):
            if lora_id == request.lora_int_id and lora_id in in_use:  # the id is what sequences and slots name
                raise ConfigError(f"LoRA adapter {other.request.lora_name!r} (id {lora_id}) is in use; "
                                  f"{request.lora_name!r} cannot take its id")
            if (lora_id == request.lora_int_id or other.request.lora_name == request.lora_name) \
                    and lora_id not in in_use:
                self.forget(lora_id)  # replaced; one in use under the same name finishes on its own weights
        self.known[request.lora_int_id] = self._read(request)
        while len(self.known) > self.max_cpu_loras:  # host memory: drop the least recently used idle adapter
            idle = next((i for i in self.known if i not in in_use and i != request.lora_int_id), None)
            if idle is None:
                break
            self.forget(idle)
        return self.known[request.lora_int_id].digest

    def _read(self, request: LoRARequest) -> KnownAdapter:
        """The adapter's host copy, read from its files, with their digest and signature taken first (a file
        rewritten meanwhile is read again next time); ConfigError for a bad checkpoint."""
        signature, digest = files_signature(request.lora_path), adapter_digest(request.lora_path)
        try:
            weights = load_adapter(request.lora_path, self.model, self.dtype, torch.device("cpu"), self.max_lora_rank,
                                   self.allow_pickle)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - a damaged file, an adapter of another model: this request's error
            raise ConfigError(f"cannot load LoRA adapter {request.lora_path}: {first_line(e)}") from None
        if self.device.type == "cuda":  # pinned: putting it in a slot later does not wait for the step in flight
            weights = {name: LoRAWeights(w.a.pin_memory(), w.b.pin_memory()) for name, w in weights.items()}
        return KnownAdapter(request, weights, digest, signature)

    def activate(self, lora_id: int, in_use: set[int]) -> bytes | None:
        """Have the adapter on the device for a sequence being admitted; returns its digest (the sequence's
        prefix-cache salt from now on), or None when every slot holds an adapter of ``in_use`` (the running
        sequences')."""
        self.known.move_to_end(lora_id)
        if lora_id in self.loaded:
            self.loaded.move_to_end(lora_id)
            return self.known[lora_id].digest
        while len(self.loaded) >= self.max_loras:
            idle = next((i for i in self.loaded if i not in in_use), None)
            if idle is None:
                return None
            self._drop(idle)
        entry = self.known[lora_id]
        if self.mirrored and files_signature(entry.request.lora_path) != entry.signature:
            # the workers read the files as they are now: so does rank 0, and the sequences admitted from now on
            # take the new digest (none runs with the old weights: the adapter was on no slot)
            logger.warning("LoRA adapter %r changed on disk since it was read; reading it again",
                           entry.request.lora_name)
            entry = self.known[lora_id] = self._read(entry.request)
        slot = min(set(range(self.max_loras)) - set(self.loaded.values()))
        self._fill(slot, entry.weights)
        self.loaded[lora_id] = slot
        if self.mirrored:  # what the workers put in this slot before the next step; an earlier load there is void
            self.pending = [p for p in self.pending if p[0] != slot] + [(slot, entry.request, entry.digest)]
        logger.info("LoRA adapter %r on the device (id %d, slot %d, %d linears)", entry.request.lora_name, lora_id,
                    slot, len(entry.weights))
        return entry.digest

    def _fill(self, slot: int, weights: dict[str, LoRAWeights]) -> None:
        for name, linear in self.linears.items():
            linear.load(slot, weights.get(name))

    def put(self, slot: int, request: LoRARequest, digest: bytes) -> None:
        """A worker's side of rank 0's ``activate``: the adapter into ``slot``, the weights rank 0 read (``digest``,
        of their files); files changed since then are a ConfigError, never other weights."""
        have = self.known.get(request.lora_int_id)
        if have is not None and have.request == request and have.digest == digest:
            self.known.move_to_end(request.lora_int_id)
        else:
            self.forget(request.lora_int_id)
            self.register(request, set())
            if self.known[request.lora_int_id].digest != digest:
                self.forget(request.lora_int_id)
                raise ConfigError(f"LoRA adapter {request.lora_path} changed on disk after rank 0 read it; the "
                                  "tensor-parallel ranks cannot load the same weights")
        self._fill(slot, self.known[request.lora_int_id].weights)
        for lora_id in [i for i, s in self.loaded.items() if s == slot]:
            del self.loaded[lora_id]
        self.loaded[request.lora_int_id] = slot

    def forget(self, lora_id: int) -> bool:
        """Remove an adapter (its device and host copies); the caller makes sure no sequence still uses it."""
        self._drop(lora_id)
        return self.known.pop(lora_id, None) is not None

    def _drop(self, lora_id: int) -> None:
        self.loaded.pop(lora_id, None)  # its slot's weights stay until the next adapter there overwrites them

    def slots(self, token_lora_ids: list[int]) -> list[int] | None:
        """Each token's device slot, −1 for the base model (id 0); None when no token runs an adapter."""
        if not any(token_lora_ids):
            return None
        return [self.loaded[i] if i else -1 for i in token_lora_ids]

    def mapping(self, slots: list[int] | None, per_token: bool) -> LoRAMapping | None:
        """The step's mapping from each token's slot (``slots``; None when no token runs an adapter): the slots
        themselves (``per_token``: decode steps), else each slot's rows."""
        if slots is None:
            return None
        if per_token:
            return LoRAMapping(slots=torch.tensor(slots, dtype=torch.long).to(self.device, non_blocking=True))
        rows: dict[int, list[int]] = {}
        for row, slot in enumerate(slots):
            if slot >= 0:
                rows.setdefault(slot, []).append(row)
        return LoRAMapping(rows={s: torch.tensor(r, dtype=torch.long).to(self.device, non_blocking=True)
                                 for s, r in rows.items()})


_LOADS = -1  # a control message's first word: adapters to put in slots (a step's first word is its token count)


def loads_message(loads: list[tuple[int, LoRARequest, bytes]]) -> torch.Tensor:
    """``pending`` as one int64 tensor for the control group: the marker, the byte count, then JSON in 8-byte words."""
    data = json.dumps([[slot, r.lora_name, r.lora_int_id, r.lora_path, d.hex()] for slot, r, d in loads]).encode()
    words = torch.frombuffer(bytearray(data + b"\0" * (-len(data) % 8)), dtype=torch.int64)
    return torch.cat([torch.tensor([_LOADS, len(data)], dtype=torch.int64), words])


def read_loads_message(message: torch.Tensor) -> list[tuple[int, LoRARequest, bytes]] | None:
    """The inverse of ``loads_message``; None for any other message (a step's, the shutdown's)."""
    if message.numel() < 2 or int(message[0]) != _LOADS:
        return None
    data = message[2:].numpy().tobytes()[:int(message[1])]
    return [(slot, LoRARequest(name, lora_id, path), bytes.fromhex(digest))
            for slot, name, lora_id, path, digest in json.loads(data)]


_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


def adapter_digest(path: str) -> bytes:
    """SHA-256 of an adapter's files (its config and weights): what the KV its sequences compute depends on, so their
    prefix-cache salt, and what two workers compare to know they hold the same adapter. Copies of one adapter under
    other names, paths or hosts share it; another lora_alpha or r, or other weights, never do (whatever the files'
    sizes and times: `cp -p` keeps those)."""
    h = hashlib.sha256(b"lora")
    for name in _FILES:
        try:
            with open(os.path.join(path, name), "rb") as f:
                h.update(f"\0{name}\0".encode())
                while chunk := f.read(1 << 20):
                    h.update(chunk)
        except OSError:
            pass
    return h.digest()


def files_signature(path: str) -> tuple:
    """The adapter files' sizes and modification times: a cheap test of whether they changed since they were read."""
    out = []
    for name in _FILES:
        try:
            st = os.stat(os.path.join(path, name))
            out.append((name, st.st_size, st.st_mtime_ns))
        except OSError:
            pass
    return tuple(out)
