"""Which weights a worker serves, as a short digest the KV transfer group compares at start-up.

The KV a prefill worker hands over is right only for a decode worker running the same weights, and two checkpoints
of one architecture (a base model and its fine-tune) have the same KV layout. The digest covers each safetensors
file's header (every tensor's name, dtype and shape) and the first and last 64 bytes of every tensor's data, read
straight from the file (a few hundred small reads, not the weights): copies of one checkpoint on two hosts agree; a
fine-tune that changes any tensor almost surely differs. Pickle checkpoints contribute 256 samples of 4 KiB spread
over each file; dummy weights their seed.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import struct

from nvllm.models.loader import safetensors_files

_EDGE = 64          # bytes read at each end of a tensor's data
_SAMPLES, _SAMPLE = 256, 4096


def weights_fingerprint(model_dir: str, load_format: str, seed: int) -> str:
    h = hashlib.sha256()
    if load_format == "dummy":
        h.update(f"dummy weights, seed {seed}".encode())
        return h.hexdigest()[:16]
    files = safetensors_files(model_dir) if load_format in ("auto", "safetensors") else []
    if files:
        for path in files:
            _safetensors_digest(path, h)
    else:
        for path in sorted(glob.glob(os.path.join(model_dir, "*.bin")) + glob.glob(os.path.join(model_dir, "*.pt"))):
            _sampled_digest(path, h)
    return h.hexdigest()[:16]


def _safetensors_digest(path: str, h) -> None:
    """The header (its JSON, less ``__metadata__``) and both ends of every tensor's bytes."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        h.update(json.dumps(header, sort_keys=True).encode())
        for name in sorted(header):
            start, end = header[name]["data_offsets"]
            for at in sorted({start, max(start, end - _EDGE)}):
                f.seek(8 + n + at)
                h.update(f.read(min(_EDGE, end - at)))


def _sampled_digest(path: str, h) -> None:
    size = os.path.getsize(path)
    h.update(str(size).encode())
    with open(path, "rb") as f:
        for i in range(_SAMPLES):
            f.seek(i * max(0, size - _SAMPLE) // (_SAMPLES - 1))
            h.update(f.read(_SAMPLE))
