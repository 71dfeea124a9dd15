"""``ShardWriter`` against huggingface_hub's shard planner: the same files for the same tensors in the same order."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from nvllm.quant.shard_writer import ShardWriter


@pytest.mark.parametrize("max_size", [100, 1000, 4096, 10**6])
def test_shards_as_huggingface_hub_plans_them(tmp_path, max_size):
    """The same tensors in the same order: the same shard files, names, contents and index as
    ``split_torch_state_dict_into_shards`` (what ``save_pretrained`` uses)."""
    from huggingface_hub import split_torch_state_dict_into_shards

    g = torch.Generator().manual_seed(0)
    sizes = [3, 40, 7, 300, 1, 64, 2000, 12, 200, 90, 5, 800, 33]      # float32 elements: 12 B to 8 kB
    tensors = {f"t{i:02d}.weight": torch.randn(n, generator=g) for i, n in enumerate(sizes)}
    tensors["t99.bf16"] = torch.randn(4, 30, generator=g).to(torch.bfloat16)
    w = ShardWriter(tmp_path, max_size)
    for name, t in tensors.items():
        w.add(name, t)
    size = w.finish()
    plan = split_torch_state_dict_into_shards(tensors, max_shard_size=max_size)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == sorted(plan.filename_to_tensors) + (["model.safetensors.index.json"] if plan.is_sharded else [])
    for filename, names in plan.filename_to_tensors.items():
        with safe_open(str(tmp_path / filename), framework="pt") as f:
            assert sorted(f.keys()) == sorted(names)
            assert all(torch.equal(f.get_tensor(n), tensors[n]) for n in names)
    if plan.is_sharded:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert index == {"metadata": plan.metadata, "weight_map": plan.tensor_to_filename}
    assert size == sum((tmp_path / f).stat().st_size for f in plan.filename_to_tensors)
    with pytest.raises(ValueError, match="written twice"):
        w.add("t00.weight", tensors["t00.weight"])
