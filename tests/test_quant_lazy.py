"""``nvllm quantize`` reads the model a part at a time and writes each part out as soon as it is done
(``lazy_model``, ``writer.CheckpointOutput``, ``shard_writer``).

Checked against the model whole in memory (the engine's ``load_model``, ``quantize_layers`` without hooks and
``checkpoint_tensors`` over every checkpoint tensor: the same bytes, sharded sources and outputs included), and for
what a user sees: one decoder layer in memory at a time, and a checkpoint that does not fit the model refused before
any layer is quantized, with nothing left on disk. The shard files themselves: ``test_shard_writer.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import nvllm.quant.quantize as Q
from nvllm.assets import demo_model_path
from nvllm.config import ConfigError, EngineConfig
from nvllm.models.loader import checkpoint_keys, load_hf_config, load_model
from nvllm.quant.lazy_model import LazyModel
from nvllm.quant.recipe import build_config
from nvllm.quant.sequential import quantize_layers
from nvllm.quant.shard_writer import ShardWriter
from nvllm.quant.writer import checkpoint_tensors
from tests.conftest import build_tiny_model


def _read_all(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _whole_model_checkpoint(src: str, cfg, captured: dict) -> dict[str, torch.Tensor]:
    """The same quantization with the whole model loaded by the engine's loader (the calibration windows and plan
    of the lazy run, captured)."""
    hf_config = load_hf_config(src)
    dtype = captured["dtype"]
    model = load_model(EngineConfig(model=src, device="cpu", dtype=str(dtype).removeprefix("torch."),
                                    load_format="safetensors"), hf_config, dtype, torch.device("cpu"))
    results, _ = quantize_layers(model, captured["ids"], Q.build_method(cfg), captured["units"], torch.device("cpu"),
                                 head=cfg.quantize_lm_head)
    return checkpoint_tensors(model, sorted(checkpoint_keys(src)), {k: r.quant for k, r in results.items()},
                              cfg.writes, bool(cfg.sym))


def _resharded(src: Path, max_size: int) -> None:
    """The checkpoint in shards of at most ``max_size`` bytes with an index, as save_pretrained writes it."""
    weights = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    writer = ShardWriter(src, max_size)
    for name in sorted(weights, reverse=True):      # a layer's tensors spread over several files
        writer.add(name, weights[name])
    writer.finish()


@pytest.mark.parametrize("kind, kw", [
    ("qwen2", dict(method="gptq", quantize_lm_head=True)),
    ("qwen3", dict(method="awq")),                          # tied embeddings; AWQ folds scales into the norms
    ("qwen2-moe", dict(method="gptq", sym=False)),
    ("mixtral-sharded", dict(method="awq", max_shard_size="40KB")),     # sharded in and out
    ("demo", dict(method="rtn", bits=8)),                   # down_proj (172 inputs) kept in full precision
])
def test_part_at_a_time_equals_the_whole_model(tmp_path, monkeypatch, kind, kw):
    if kind == "demo":
        src = demo_model_path()
    else:
        src = build_tiny_model(kind.removesuffix("-sharded"), tmp_path / kind, num_hidden_layers=3)
        if kind.endswith("-sharded"):
            _resharded(src, 30_000)
            assert len(list(src.glob("*.safetensors"))) > 3
        src = str(src)
    cfg = build_config(None, group_size=32, calib_dataset="calib", calib_samples=4, calib_seqlen=48, **kw)
    captured, resident = {}, []
    run, load = Q.quantize_layers, LazyModel.load

    def spy_run(model, ids, method, units, device, **k):
        captured.update(ids=ids, units=units, dtype=next(iter(model.norm.parameters())).dtype)
        return run(model, ids, method, units, device, **k)

    def spy_load(self, part):
        load(self, part)
        resident.append((part, self.loaded()))

    monkeypatch.setattr(Q, "quantize_layers", spy_run)
    monkeypatch.setattr(LazyModel, "load", spy_load)
    summary = Q.quantize_model(src, str(tmp_path / "q"), cfg)
    got = _read_all(tmp_path / "q")
    if "max_shard_size" in kw:
        assert len(list((tmp_path / "q").glob("model-*-of-*.safetensors"))) > 3
    want = _whole_model_checkpoint(src, cfg, captured)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), [k for k in want if not torch.equal(got[k], want[k])]
    # one part in memory at a time; the quantized head reads the final norm beside it
    layers = int(load_hf_config(src).num_hidden_layers)
    assert [p for p, _ in resident if p.startswith("layers.")] == [f"layers.{i}" for i in range(layers)]
    for part, loaded in resident:
        assert loaded == ([part] if part != "lm_head" or not cfg.quantize_lm_head else ["norm", "lm_head"]), part
    if cfg.quantize_lm_head:
        assert summary.head_size_after == sum(t.numel() * t.element_size() for k, t in got.items()
                                              if k.startswith("lm_head."))


def test_a_checkpoint_that_does_not_fit_is_refused_before_any_work(tmp_path):
    src = build_tiny_model("llama", tmp_path / "m", num_hidden_layers=3)
    cfg = build_config(None, method="gptq", group_size=32, calib_dataset="calib", calib_samples=2, calib_seqlen=32)
    weights = load_file(src / "model.safetensors")
    stages = []
    for change, message in [("wrong shape", "shape mismatch for 'model.layers.2.mlp.down_proj.weight'"),
                            ("missing", "checkpoint is missing tensors: layers.2.post_attention_layernorm.weight"),
                            ("unexpected", "unexpected tensor 'model.layers.2.mlp.extra.weight'")]:
        bad = dict(weights)
        if change == "wrong shape":
            bad["model.layers.2.mlp.down_proj.weight"] = bad["model.layers.2.mlp.down_proj.weight"][:, :64].clone()
        elif change == "missing":
            del bad["model.layers.2.post_attention_layernorm.weight"]
        else:
            bad["model.layers.2.mlp.extra.weight"] = torch.ones(4, 4)
        save_file(bad, src / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
            Q.quantize_model(str(src), str(tmp_path / "out"), cfg, progress=lambda i, s: stages.append((i, s)))
        assert stages == [] and sorted(os.listdir(tmp_path)) == ["m"]


def test_an_all_zero_bias_the_model_lacks_is_accepted(tmp_path):
    """AutoGPTQ / optimum give bias-less linears a zero bias: the loader skips it, and so do the lazy checks."""
    src = build_tiny_model("llama", tmp_path / "m")
    weights = load_file(src / "model.safetensors")
    weights["model.layers.1.self_attn.o_proj.bias"] = torch.zeros(64)
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    lazy = LazyModel(str(src), load_hf_config(str(src)), torch.float32)
    assert lazy.loaded() == [] and "model.layers.1.self_attn.o_proj.bias" not in lazy.parts["layers.1"]
    weights["model.layers.1.self_attn.o_proj.bias"] = torch.ones(64)
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="unexpected tensor 'model.layers.1.self_attn.o_proj.bias'"):
        LazyModel(str(src), load_hf_config(str(src)), torch.float32)


def test_a_run_stopped_midway_leaves_nothing(tmp_path):
    """Shards already written when the run stops (here: Ctrl-C at the second layer) go with their directory."""
    src = build_tiny_model("llama", tmp_path / "m", num_hidden_layers=3)
    cfg = build_config(None, method="rtn", group_size=32, calib_dataset="calib", calib_samples=2, calib_seqlen=32,
                       max_shard_size="20KB")
    seen = []

    def stop(layer, stage):
        seen.append(sorted(p.name for p in tmp_path.glob(".q.partial-*/*")))
        if layer == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Q.quantize_model(str(src), str(tmp_path / "q"), cfg, progress=stop)
    assert any(seen) and sorted(os.listdir(tmp_path)) == ["m"]


def test_a_tied_head_that_differs_from_the_embeddings_is_said(tmp_path, caplog):
    """As the engine's loader says it: config.json ties the head, and the checkpoint's lm_head.weight differs."""
    src = build_tiny_model("qwen3", tmp_path / "m")
    weights = load_file(src / "model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"] + 1
    save_file(weights, src / "model.safetensors", metadata={"format": "pt"})
    cfg = build_config(None, method="rtn", group_size=32, calib_dataset="calib", calib_samples=2, calib_seqlen=32)
    with caplog.at_level("WARNING"):
        Q.quantize_model(str(src), str(tmp_path / "q"), cfg)
    assert "differs from them" in caplog.text
    assert "lm_head.weight" not in _read_all(tmp_path / "q")
