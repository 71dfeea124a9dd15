"""The stacked-slot LoRA kernels (``nvllm.kernels.lora``) against their torch reference on the CPU under the Triton
interpreter, and the reference against the per-token formula written out: slots of different ranks, a slot of rank 0,
base-model tokens (slot −1) left bit for bit, inputs longer than one shrink chunk with a ragged tail (short and long
inputs, which launch different chunk and block sizes at a small batch), ranks over one expand step, and stack
entries beyond a slot's rank holding NaN, which nothing may read."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel module is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nvllm.kernels import report  # noqa: E402
from nvllm.kernels.lora import launch_sizes, lora_apply, lora_apply_reference  # noqa: E402


def case(dtype, T=6, K=launch_sizes(6, 1)[0] * 2 + 77, N=130, R=40, ranks=(40, 7, 0), slots=(0, -1, 2, 0, 1, -1),
         seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(len(ranks), R, K, generator=g) / K ** 0.5
    b = torch.randn(len(ranks), N, R, generator=g)
    for s, r in enumerate(ranks):   # past each slot's rank: poison
        a[s, r:] = float("nan")
        b[s, :, r:] = float("nan")
    x = torch.randn(T, K, generator=g).to(dtype)
    y = torch.randn(T, N, generator=g).to(dtype)
    return (y, x, a.to(dtype), b.to(dtype), torch.tensor(ranks, dtype=torch.int32),
            torch.tensor(slots[:T], dtype=torch.int64))


def written_out(y, x, a, b, ranks, slots) -> torch.Tensor:
    out = y.float().clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            r = int(ranks[s])
            out[t] += b[s, :, :r].float() @ (a[s, :r].float() @ x[t].float())
    return out.to(y.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_reference_is_the_per_token_formula(dtype):
    y, x, a, b, ranks, slots = case(dtype)
    want = written_out(y, x, a, b, ranks, slots)
    got = lora_apply_reference(y.clone(), x, a, b, ranks, slots)
    torch.testing.assert_close(got, want, atol=1e-5 if dtype == torch.float32 else 2e-2, rtol=1e-5)


@pytest.mark.parametrize("K", [launch_sizes(6, 1)[0] * 2 + 77, 4096 + launch_sizes(6, 8192)[0] + 77],
                         ids=["short", "long"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernels_equal_the_reference(dtype, K, monkeypatch):
    monkeypatch.setenv("NVLLM_KERNELS", "triton")
    y, x, a, b, ranks, slots = case(dtype, K=K)
    want = lora_apply_reference(y.clone(), x, a, b, ranks, slots)
    got = y.clone()
    report.reset()
    assert lora_apply(got, x, a, b, ranks, slots) is got
    assert report.snapshot()["lora"] == {"triton shrink + expand (a slot per token)": 1}
    assert not torch.isnan(got).any()
    # bf16: the 3.9 interpreter rounds fp32 → bf16 by truncation, torch to nearest: one ulp apart at most
    torch.testing.assert_close(got, want, atol=1e-5 if dtype == torch.float32 else 1.6e-2,
                               rtol=1e-5 if dtype == torch.float32 else 1.6e-2)
    base = slots < 0
    assert torch.equal(got[base], y[base])                       # base-model tokens untouched, bit for bit
    rank0 = slots == 2
    assert torch.equal(got[rank0], y[rank0])                     # a slot of rank 0 adds nothing
    assert not torch.equal(got[slots == 0], y[slots == 0])


def test_small_stacks_and_strided_rows(monkeypatch):
    """A rank below one expand step, a stack narrower than the kernels' smallest block, and row-strided x and y
    (views of wider buffers)."""
    monkeypatch.setenv("NVLLM_KERNELS", "triton")
    y, x, a, b, ranks, slots = case(torch.float32, T=3, K=40, N=9, R=5, ranks=(5, 3), slots=(1, 0, -1))
    xw = torch.full((3, 64), float("nan"))
    xw[:, :40] = x
    yw = torch.full((3, 16), float("nan"))
    yw[:, :9] = y
    want = lora_apply_reference(y.clone(), x, a, b, ranks, slots)
    lora_apply(yw[:, :9], xw[:, :40], a, b, ranks, slots)
    torch.testing.assert_close(yw[:, :9], want, atol=1e-5, rtol=1e-5)
    assert torch.isnan(yw[:, 9:]).all()
