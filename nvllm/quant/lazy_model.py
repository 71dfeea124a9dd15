"""The model being quantized, with only the part being worked on in host memory.

``nvllm quantize`` builds the engine's model class on the meta device (no memory) and reads a part's tensors from
the safetensors checkpoint when the work reaches it: the embeddings (to embed the calibration windows), then one
decoder layer at a time, then the final norm and LM head. ``release`` puts a part back on the meta device once it
has been written out (``writer.CheckpointOutput``). The host holds one decoder layer in the checkpoint's dtype at
a time instead of the whole model (a 70B in bf16 is ~140 GB); the rotary tables, which are computed rather than
loaded, are built once on the CPU.

Before any work, every checkpoint tensor goes through the loader's own checks (``load_weights``: names, missing
tensors, shapes) as a meta tensor of the shape its safetensors header gives, so a checkpoint that does not fit the
model fails at once rather than at its last layer.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from nvllm.config import ConfigError
from nvllm.layers.rotary import RotaryEmbedding
from nvllm.models.loader import safetensors_files
from nvllm.models.registry import resolve_architecture


def part_of(param: str) -> str:
    """The part of the model a parameter belongs to: "layers.3.qkv_proj.weight" → "layers.3", "norm.weight" →
    "norm"."""
    head, _, rest = param.partition(".")
    return f"{head}.{rest.split('.', 1)[0]}" if head == "layers" else head


class LazyModel:
    """``model``: the engine's model class, every parameter on the meta device until its part is loaded; ``parts``:
    each part's checkpoint tensors, in the model's order."""

    def __init__(self, model_dir: str, hf_config, dtype: torch.dtype):
        arch, cls = resolve_architecture(hf_config)
        with torch.device("meta"):
            self.model = cls(hf_config, arch, dtype)
        s = self.model.shape
        rotary = RotaryEmbedding(s.head_dim, s.max_position, s.rope_theta, s.rope_scaling)
        for layer in self.model.layers:
            layer.rotary = rotary
        self.files: dict[str, str] = {}                     # checkpoint tensor → its file
        shapes: dict[str, list[int]] = {}
        for path in safetensors_files(model_dir):
            with _opened(path) as f:
                for name in f.keys():
                    self.files[name] = path
                    shapes[name] = f.get_slice(name).get_shape()
        # a part's checkpoint tensors, the parts in the model's order: embed_tokens, layers.0, …, norm, lm_head
        self.parts: dict[str, list[str]] = {part_of(n): [] for n, _ in self.model.named_parameters()}
        params = dict(self.model.named_parameters())
        used, strays = {}, set()       # strays: tensors of no parameter (refused by the checks below)
        for name in sorted(self.files):
            target = self.model.param_for(name)
            if target is None:          # tensors the model does not use (rotary tables, a tied lm_head)
                continue
            used[name] = shapes[name]
            if target[0] in params:
                self.parts[part_of(target[0])].append(name)
            else:
                strays.add(name)
        self.model.load_weights(self._headers(used, strays))

    def _headers(self, shapes: dict[str, list[int]], strays: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, shape in shapes.items():
            if name in strays and name.endswith(".bias"):
                yield name, self._read([name])[name]    # a bias the model lacks passes only if it is all zeros
            else:
                yield name, torch.empty(shape, device="meta")

    def _read(self, names: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for path in dict.fromkeys(self.files[n] for n in names):
            with _opened(path) as f:
                out.update({n: f.get_tensor(n) for n in names if self.files[n] == path})
        return out

    def load(self, part: str) -> None:
        """Read ``part``'s tensors ("embed_tokens", "layers.3", "norm", "lm_head") from the checkpoint into
        freshly allocated CPU parameters."""
        module = self.model.get_submodule(part)
        _move(module, "cpu")
        tensors = self._read(self.parts[part])
        self.model.load_weights(iter(tensors.items()), prefix=f"{part}.")
        if part == "embed_tokens" and self.model.shape.tie_word_embeddings and "lm_head.weight" in self.files:
            with _opened(self.files["lm_head.weight"]) as f:    # the loader's warning when they differ
                self.model._check_tied_head(f.get_slice("lm_head.weight")[:8])

    def release(self, part: str) -> None:
        """Free ``part``'s parameters (back on the meta device)."""
        _move(self.model.get_submodule(part), "meta")

    def loaded(self) -> list[str]:
        """The parts whose parameters are in memory now."""
        return [p for p in self.parts if any(t.device.type != "meta" for t in self.model.get_submodule(p).parameters())]


def _move(module: nn.Module, device: str) -> None:
    """Give every parameter of ``module`` new, uninitialised storage on ``device`` (buffers are left alone: the
    rotary tables are shared by every layer)."""
    for m in module.modules():
        for k, p in m._parameters.items():
            if p is not None and p.device.type != device:
                m._parameters[k] = nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad)


@contextmanager
def _opened(path: str):
    """``safe_open``, its failures (a truncated or corrupt file) as one line."""
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt") as f:
            yield f
    except Exception as e:
        raise ConfigError(f"cannot read weight file {path} (truncated or corrupt?): {e}") from e
