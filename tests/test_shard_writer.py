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


def _every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"b.w": torch.randn(3, 5, generator=g).bfloat16(), "a.q": torch.randint(-99, 99, (4, 2), dtype=torch.int32),
            "z.s": torch.randn(7, generator=g).half(), "m.f8": torch.randn(6, generator=g).to(torch.float8_e4m3fn),
            "n.f8": torch.randn(2, generator=g).to(torch.float8_e5m2), "c.bool": torch.tensor([True, False, True]),
            "e.empty": torch.zeros(0, 4), "s.scalar": torch.tensor(2.5), "u.u8": torch.arange(5, dtype=torch.uint8),
            "i.i8": torch.arange(-3, 3, dtype=torch.int8), "f.f32": torch.randn(2, 2, generator=g),
            "d.f64": torch.randn(3, generator=g).double(), "l.i64": torch.arange(3), "h.i16": torch.arange(4).short(),
            "t.strided": torch.randn(4, 6, generator=g)[:, ::2]}


def test_a_shard_is_the_librarys_own_bytes(tmp_path):
    """The tensors in the order safetensors' ``save_file`` lays them out (dtype, then name): the very same file,
    header and padding included, for every dtype written here, a scalar, an empty and a strided tensor. In another
    order the library reads the same tensors and metadata back."""
    import struct

    from safetensors.torch import load_file, save_file

    tensors = _every_dtype()
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(tmp_path / "lib.safetensors"),
              metadata={"format": "pt"})      # the library takes no strided tensor
    raw = (tmp_path / "lib.safetensors").read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    order = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])
    for name, names in (("ours", order), ("reversed", order[::-1])):
        (tmp_path / name).mkdir()
        w = ShardWriter(tmp_path / name, 10**6)
        for k in names:
            w.add(k, tensors[k])
        w.finish()
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == ["model.safetensors"]
        got = tmp_path / name / "model.safetensors"
        if name == "ours":
            assert got.read_bytes() == raw
        back = load_file(got)
        assert back.keys() == tensors.keys()
        for k, t in tensors.items():
            assert back[k].dtype == t.dtype and back[k].shape == t.shape, k
            assert torch.equal(back[k].reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8)), k
        with safe_open(str(got), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
    (tmp_path / "empty").mkdir()
    ShardWriter(tmp_path / "empty", 100).finish()
    save_file({}, str(tmp_path / "lib_empty.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "empty" / "model.safetensors").read_bytes() == (tmp_path / "lib_empty.safetensors").read_bytes()


def test_the_writer_holds_no_tensor(tmp_path):
    """A tensor's bytes are on disk once ``add`` returns: the writer keeps no reference to it, so the caller's part of
    the model is freed as soon as the caller lets it go."""
    import weakref

    w = ShardWriter(tmp_path, 10**6)
    t = torch.randn(1000)
    ref = weakref.ref(t)
    w.add("t", t)
    del t
    assert ref() is None
    with pytest.raises(ValueError, match="no dtype for torch.complex64"):
        w.add("c", torch.zeros(2, dtype=torch.complex64))
    w.finish()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]
