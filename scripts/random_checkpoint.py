"""A random Hugging Face checkpoint of a given config, written the way the published ones are: config.json,
tokenizer files and bf16 safetensors shards under transformers' own tensor names (a tensor per expert and
projection for a mixture). The model for ``gpu_quantize_bench.py``: quantizing a random model does the same
work as quantizing a trained one of the same shape."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch


def checkpoint_bytes(config: dict) -> int:
    """Bytes of the model's weights in 16-bit (the random checkpoint's size)."""
    h, i, v, n = config["hidden_size"], config["intermediate_size"], config["vocab_size"], config["num_hidden_layers"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    d = config.get("head_dim") or h // heads
    per_layer = h * (heads + 2 * kv) * d + heads * d * h + 3 * h * i
    return 2 * (v * h * (1 if config.get("tie_word_embeddings") else 2) + n * per_layer)



def _mem_available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def default_workdir(config: dict) -> tuple[Path, str]:
    """/dev/shm when it has room for the random checkpoint and the quantized one (and RAM is left for the
    quantizer), so that writing the 15 GB input does not wait for a disk; else $TMPDIR."""
    need = int(1.4 * checkpoint_bytes(config)) + (1 << 30)
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > need \
            and _mem_available() > 2.5 * need:
        return shm, f"/dev/shm (tmpfs; {need / 1e9:.1f} GB needed)"
    tmp = tempfile.gettempdir()
    return Path(tmp), f"{tmp} (/dev/shm too small, or RAM short, for {need / 1e9:.1f} GB)"


def build_model_dir(config_path: Path, tokenizer: str, layers: int | None, workdir: Path,
                    log: Callable[[str], None] = print) -> tuple[Path, dict, str]:
    """A temporary HF directory (config.json + tokenizer files) under ``workdir``; returns (dir, config, what
    tokenizer was used). Reuses gpu_bench.build_model_dir (Qwen2.5 BPE from vocab.json + merges.txt) and
    gpu_tp_bench.model_dir (the demo tokenizer), then writes the chosen config over theirs."""
    from nvllm.assets import demo_model_path
    from nvllm.quant.writer import COPIED_FILES

    old_tempdir, tempfile.tempdir = tempfile.tempdir, str(workdir)   # both helpers call mkdtemp() without dir
    try:
        tok_dir = Path(tokenizer)
        if tokenizer != "demo" and (tok_dir / "vocab.json").is_file() and (tok_dir / "merges.txt").is_file() \
                and not (tok_dir / "tokenizer.json").is_file():
            from gpu_bench import build_model_dir as qwen_model_dir

            d = qwen_model_dir(tok_dir)
            what = f"Qwen2.5 BPE built from {tok_dir}/vocab.json + merges.txt"
        elif tokenizer != "demo" and (tok_dir / "tokenizer.json").is_file():
            d = Path(tempfile.mkdtemp(prefix="model-"))
            for name in COPIED_FILES:
                if (tok_dir / name).is_file() and name != "generation_config.json":
                    shutil.copy(tok_dir / name, d / name)
            what = f"tokenizer files of {tok_dir}"
        else:
            from gpu_tp_bench import model_dir as demo_model_dir

            d = demo_model_dir("qwen2.5-7b")
            what = f"the demo model's tokenizer ({demo_model_path()}, 512 ids)"
            if tokenizer != "demo":
                what += f": NOTE {tokenizer} has no vocab.json + merges.txt / tokenizer.json"
                log(f"NOTE: tokenizer directory {tokenizer} not usable; using the demo model's tokenizer "
                    f"(512 token ids, all inside the model's vocabulary; speed does not depend on the tokenizer)")
    finally:
        tempfile.tempdir = old_tempdir
    config = json.loads(config_path.read_text())
    if layers is not None:
        config["num_hidden_layers"] = min(layers, config["num_hidden_layers"])
        if "max_window_layers" in config:
            config["max_window_layers"] = min(config["max_window_layers"], config["num_hidden_layers"])
    (d / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return d, config, what


@torch.no_grad()
def write_random_weights(model_dir: Path, device: torch.device, seed: int, shard_bytes: int = 4 << 30,
                         log: Callable[[str], None] = print) -> dict:
    """Random weights for ``model_dir/config.json`` as safetensors shards + model.safetensors.index.json, under
    the tensor names of transformers' model class (a meta-device instance: no memory, no init). HF-like init:
    normal(0, initializer_range) for matrices and embeddings, ones for norms, zeros for biases; drawn on
    ``device`` with one seeded generator, in the config's dtype."""
    import transformers
    from safetensors.torch import save_file

    from nvllm.models.loader import checkpoint_dtype

    hf_config = transformers.AutoConfig.from_pretrained(model_dir)
    dtype = checkpoint_dtype(hf_config) or torch.float32
    std = float(getattr(hf_config, "initializer_range", 0.02) or 0.02)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(hf_config)
    params = checkpoint_params(meta)   # tied lm_head appears once
    del meta
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[tuple[str, tuple]]] = [[]]
    size = 0
    for name, shape in params:
        nbytes = itemsize * int(torch.Size(shape).numel())
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    gen = torch.Generator(device=device).manual_seed(seed)
    weight_map, total, t_gen, t_write = {}, 0, 0.0, 0.0
    for k, shard in enumerate(shards, 1):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        t0 = time.perf_counter()
        tensors = {}
        for name, shape in shard:
            if name.endswith("norm.weight"):
                t = torch.ones(shape, dtype=dtype)
            elif name.endswith(".bias"):
                t = torch.zeros(shape, dtype=dtype)
            else:
                t = torch.randn(shape, generator=gen, device=device, dtype=dtype).mul_(std).cpu()
            tensors[name] = t
            weight_map[name] = fname
            total += t.numel() * t.element_size()
        t1 = time.perf_counter()
        save_file(tensors, str(model_dir / fname), metadata={"format": "pt"})
        t2 = time.perf_counter()
        t_gen, t_write = t_gen + t1 - t0, t_write + t2 - t1
        del tensors
        log(f"build: wrote {fname} ({len(shard)} tensors) generate {t1 - t0:.1f}s write {t2 - t1:.1f}s")
    if len(shards) > 1:
        (model_dir / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return {"bytes": total, "tensors": len(params), "shards": len(shards), "dtype": str(dtype).replace("torch.", ""),
            "init_std": std, "generate_s": t_gen, "write_s": t_write, "device": str(device)}


def checkpoint_params(model) -> list[tuple[str, tuple]]:
    """(checkpoint name, shape) of every parameter. transformers 5 holds a mixture's experts stacked
    (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]); published checkpoints, and what
    ``save_pretrained`` writes, have a tensor per expert and projection (``mlp.experts.{e}.gate_proj.weight``;
    Mixtral's ``w1`` / ``w3`` / ``w2``)."""
    out = []
    mixtral = "Mixtral" in type(model).__name__
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    for name, p in model.named_parameters():
        stem, _, leaf = name.rpartition(".")
        if stem.endswith(".experts") and p.dim() == 3:
            e, rows, cols = p.shape
            for k in range(e):
                if leaf == "gate_up_proj":
                    out += [(f"{stem}.{k}.{gate}.weight", (rows // 2, cols)), (f"{stem}.{k}.{up}.weight",
                                                                               (rows // 2, cols))]
                else:
                    out.append((f"{stem}.{k}.{down}.weight", (rows, cols)))
        else:
            out.append((name, tuple(p.shape)))
    return out
