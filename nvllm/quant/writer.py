"""Write a quantized checkpoint as AutoAWQ / AutoGPTQ / llm-compressor do: safetensors under the source
checkpoint's tensor names (each quantized ``…proj.weight`` replaced by ``qweight``/``qzeros``/``scales`` and, for
GPTQ, ``g_idx``; by compressed-tensors' ``weight_packed``/``weight_scale``/``weight_shape`` and, with zero points,
``weight_zero_point``), config.json with ``quantization_config`` (GPTQ also ``quantize_config.json``), and the
source's tokenizer and generation files. Weights larger than ``max_shard_size`` are split as ``save_pretrained``
splits them (``shard_writer``): ``model-00001-of-0000N.safetensors`` and ``model.safetensors.index.json``; smaller
ones go into one ``model.safetensors``.

``CheckpointOutput`` takes the tensors a part of the model at a time (``nvllm quantize`` hands over each decoder
layer as it is done) into a temporary directory beside the output, renamed into place at the end, so an
interrupted run leaves nothing half-written; an existing output directory is replaced only with ``overwrite``
(and only once the new one is complete).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from nvllm.models.loader import safetensors_files
from nvllm.output_file import unwritable_parent
from nvllm.quant.compressed_tensors import pack_compressed_tensors
from nvllm.quant.formats import GroupQuant, pack_awq, pack_gptq
from nvllm.quant.shard_writer import ShardWriter, parse_size
from nvllm.quant.staged_dir import StagedDir, recover

COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "generation_config.json",
                "chat_template.json", "chat_template.jinja")


class OutputExistsError(ValueError):
    pass


def check_out_dir(out_dir: str, overwrite: bool, src_dir: str | None) -> None:
    """Before any work is done: refuse an empty path, an existing output (unless ``overwrite``, and then only a model
    directory or an empty one), an output that is the current directory, the source model (``src_dir``, None while
    a Hub id is not fetched yet) or holds either (replacing it would delete them; compared through links), and an
    output that cannot be created (its nearest existing parent is not a writable directory). First,
    ``staged_dir.recover`` tidies what runs killed outright left beside the output."""
    if not out_dir.strip():
        raise OutputExistsError("--out is empty: name the directory to write the checkpoint to")
    recover(out_dir)        # what runs killed outright left beside it; an output one had set aside is back in place
    out, cwd = Path(out_dir).resolve(), Path.cwd().resolve()
    if out == cwd or out in cwd.parents:
        raise OutputExistsError(f"--out {out_dir} is the current directory or holds it: replacing it would delete "
                                "what it holds; name a new directory")
    if src_dir is not None:
        check_not_source(out_dir, src_dir)
    if os.path.exists(out_dir):
        if not os.path.isdir(out_dir):
            raise OutputExistsError(f"output path {out_dir} exists and is not a directory")
        if not overwrite:
            raise OutputExistsError(f"output directory {out_dir} already exists (pass --overwrite to replace it)")
        if os.listdir(out_dir) and not os.path.isfile(os.path.join(out_dir, "config.json")):
            raise OutputExistsError(f"--overwrite replaces a model directory, and {out_dir} holds no config.json: "
                                    "replacing it would delete what it holds; name a new directory")
    parent = unwritable_parent(out)
    if parent is not None:
        raise OutputExistsError(f"cannot create the output directory {out_dir}: {parent} is not a writable "
                                "directory")


def check_not_source(out_dir: str, src_dir: str) -> None:
    out, src = Path(out_dir).resolve(), Path(src_dir).resolve()
    if out == src or out in src.parents:
        raise OutputExistsError(f"--out {out_dir} is the model directory or holds it: writing there would replace "
                                "the model being quantized")


def _shard_rows(gq: GroupQuant, rows: slice) -> GroupQuant:
    return GroupQuant(q=gq.q[rows], scales=gq.scales[:, rows], zeros=gq.zeros[:, rows], g_idx=gq.g_idx,
                      bits=gq.bits, group_size=gq.group_size)


def packed_tensors(gq: GroupQuant, fmt: str, sym: bool = True) -> dict[str, torch.Tensor]:
    gq = GroupQuant(q=gq.q.cpu(), scales=gq.scales.cpu(), zeros=gq.zeros.cpu(), g_idx=gq.g_idx.cpu(),
                    bits=gq.bits, group_size=gq.group_size)
    if fmt == "awq":
        return pack_awq(gq.q, gq.zeros, gq.scales)
    if fmt == "compressed-tensors":
        return pack_compressed_tensors(gq.q, gq.zeros, gq.scales, gq.bits, sym)
    return pack_gptq(gq.q, gq.zeros, gq.scales, gq.g_idx, gq.bits)


def checkpoint_tensors(model, source_names: list[str], quantized: dict[str, GroupQuant], fmt: str,
                       sym: bool = True) -> dict[str, torch.Tensor]:
    """The tensors to save, under the source checkpoint's names. ``quantized`` maps our linears' names
    (``layers.{i}.qkv_proj``, ``layers.{i}.moe.experts.{e}.gate_up_proj``) to the integer form of their (fused)
    weight; the shards are split by rows."""
    out: dict[str, torch.Tensor] = {}
    for name in source_names:
        target = model.param_for(name)
        if target is None:          # tensors the model does not use (rotary tables, a tied lm_head)
            continue
        pname, shard = target
        module_name, leaf = pname.rsplit(".", 1)
        module = model.get_submodule(module_name)
        key, index, rows = _piece(module, module_name, leaf, shard)
        if key in quantized:
            base = name.rsplit(".", 1)[0]
            for k, value in packed_tensors(_shard_rows(quantized[key], rows), fmt, sym).items():
                out[f"{base}.{k}"] = value.contiguous().clone()
            continue
        value = model.get_parameter(pname).data
        piece = value[index].detach().cpu()
        # a piece of a fused parameter is copied (safetensors refuses tensors that share memory); a whole one is
        # not: the model part it belongs to is released once written, so it can be the checkpoint's tensor
        out[name] = piece if piece.numel() == value.numel() else piece.contiguous().clone()
    return out


def _piece(module, module_name: str, leaf: str, shard) -> tuple[str | None, tuple | slice, slice]:
    """(the quantized linear holding this checkpoint tensor, or None for a tensor that is not a linear's weight;
    its index into the parameter; its rows of that linear). A stacked expert's shard is (expert, 0 gate / 1 up /
    2 down)."""
    if hasattr(module, "shards"):
        e, j = shard
        i = module.m.part.size
        rows = slice(j * i, (j + 1) * i) if leaf == "w13" else slice(None)
        return f"{module_name}.{e}.{'gate_up_proj' if leaf == 'w13' else 'down_proj'}", (e, rows), rows
    rows = module.shard_slice(shard) if shard is not None else slice(None)
    return (module_name if leaf == "weight" else None), rows, rows


def weights_bytes(model_dir: str) -> int:
    """The size of a checkpoint directory's safetensors files (the summary's size before quantizing)."""
    return sum(os.path.getsize(f) for f in safetensors_files(model_dir))


class CheckpointOutput:
    """The output directory being written: a temporary sibling of ``out_dir`` until ``finish`` renames it into place
    (replacing an existing one only with ``overwrite``); left by an exception, it is deleted. ``add`` streams weight
    tensors into its shards (``ShardWriter``), so the caller can hand them over a part of the model at a time."""

    def __init__(self, src_dir: str, out_dir: str, overwrite: bool, max_shard_size: str):
        self.src_dir, self.out_dir, self.overwrite, self.max_shard_size = src_dir, out_dir, overwrite, max_shard_size

    def __enter__(self) -> CheckpointOutput:
        check_out_dir(self.out_dir, self.overwrite, self.src_dir)
        max_bytes = parse_size(self.max_shard_size)
        self.staged = StagedDir(self.out_dir)
        self.tmp = self.staged.path
        self.shards = ShardWriter(self.tmp, max_bytes)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.staged.abort()

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            self.shards.add(name, tensor)

    def finish(self, quantization_config: dict, extra_json: dict[str, Any] | None = None) -> int:
        """Write the last shard, config.json with ``quantization_config``, ``extra_json`` files and the source's
        tokenizer and generation files, then rename the directory into place; returns the weights' size in bytes."""
        check_out_dir(self.out_dir, self.overwrite, self.src_dir)   # nothing took the output's place meanwhile
        tmp = self.tmp
        umask = os.umask(0)
        os.umask(umask)
        size = self.shards.finish()
        with open(Path(self.src_dir) / "config.json") as f:
            config = json.load(f)
        config["quantization_config"] = quantization_config
        with open(tmp / "config.json", "w") as f:
            json.dump(config, f, indent=2)
            f.write("\n")
        for name, data in (extra_json or {}).items():
            with open(tmp / name, "w") as f:
                json.dump(data, f, indent=2)
                f.write("\n")
        for name in COPIED_FILES:
            if (Path(self.src_dir) / name).is_file():
                shutil.copy2(Path(self.src_dir) / name, tmp / name)
        for p in tmp.iterdir():
            os.chmod(p, 0o666 & ~umask)
        self.staged.commit(replace=self.overwrite)
        return size

