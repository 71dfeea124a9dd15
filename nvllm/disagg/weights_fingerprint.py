"""Which weights a worker serves, as a short digest the KV transfer group compares at start-up.

The KV a prefill worker hands over is right only for a decode worker running the same weights, and two checkpoints
of one architecture (a base model and its fine-tune) have the same KV layout. The digest covers every tensor of the
safetensors files by name, dtype and shape, and the first and last 64 bytes of its data, read straight from the
files (a few small reads a tensor, not the weights) — however the checkpoint is sharded or laid out, so copies and
re-saved copies agree, and a fine-tune that changes any tensor almost surely differs — plus what changes the
served weights on top of the files: the config (dummy weights come from it and a seed), online quantization and
``--hf-overrides``. Pickle checkpoints contribute 256 samples of 4 KiB spread over each file.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct

from nvllm.models.loader import pickle_files, safetensors_files

_EDGE = 64          # bytes read at each end of a tensor's data
_SAMPLES, _SAMPLE = 256, 4096


def weights_fingerprint(model_dir: str, load_format: str, seed: int, served: dict) -> str:
    """``served``: the engine settings that change the weights served from the files (quantization, hf_overrides)."""
    h = hashlib.sha256(json.dumps(served, sort_keys=True, default=str).encode())
    if load_format == "dummy":
        with open(os.path.join(model_dir, "config.json"), "rb") as f:
            h.update(f.read())
        h.update(f"dummy weights, seed {seed}".encode())
        return h.hexdigest()[:16]
    files = safetensors_files(model_dir) if load_format in ("auto", "safetensors") else []
    if files:
        tensors: dict[str, bytes] = {}
        for path in files:
            tensors.update(_safetensors_edges(path))
        for name in sorted(tensors):
            h.update(name.encode() + b"\0" + tensors[name])
    else:
        for path in pickle_files(model_dir):
            _sampled_digest(path, h)
    return h.hexdigest()[:16]


def _safetensors_edges(path: str) -> dict[str, bytes]:
    """{tensor name: its dtype and shape, then both ends of its bytes} for one safetensors file (the header's data
    offsets count from the end of the header)."""
    out = {}
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        for name, entry in header.items():
            start, end = entry["data_offsets"]
            parts = [f"{entry['dtype']}{entry['shape']}".encode()]
            for at in sorted({start, max(start, end - _EDGE)}):
                f.seek(8 + n + at)
                parts.append(f.read(min(_EDGE, end - at)))
            out[name] = b"".join(parts)
    return out


def _sampled_digest(path: str, h) -> None:
    size = os.path.getsize(path)
    h.update(str(size).encode())
    with open(path, "rb") as f:
        for i in range(_SAMPLES):
            f.seek(i * max(0, size - _SAMPLE) // (_SAMPLES - 1))
            h.update(f.read(_SAMPLE))
