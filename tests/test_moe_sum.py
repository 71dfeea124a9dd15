"""``sum_slots`` (each token's k expert outputs weighted by its routing weights and summed, in slot order) on the CPU
under the Triton interpreter against its torch reference, and the reference against the formula written out."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel module is imported

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from nvllm.kernels import moe_sum  # noqa: E402
from nvllm.kernels.moe_sum import sum_slots, sum_slots_reference, sum_slots_triton  # noqa: E402


def _problem(t, k, h, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(t * k, h, generator=g).to(dtype)
    weights = torch.softmax(torch.randn(t, k, generator=g), -1)
    return y, weights


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t, k, h", [(5, 2, 64), (3, 8, 40), (1, 1, 24), (4, 3, 1100)])
def test_kernel_equals_the_reference(monkeypatch, dtype, t, k, h):
    """The same bits: fp32 products and sums in slot order, rounded once (1100 columns: two column tiles). bf16: the
    same fp32 sums, rounded by the interpreter's truncation (the GPU rounds to nearest even, as torch does), so at
    most one ulp low."""
    monkeypatch.setattr(moe_sum, "BLOCK_H", 512)
    y, weights = _problem(t, k, h, dtype)
    got = sum_slots_triton(y, weights, k)
    want = sum_slots_reference(y, weights, k)
    assert got.dtype == dtype and got.shape == (t, h)
    if dtype == torch.bfloat16:
        ulp = 2.0 ** (torch.frexp(want.float())[1] - 8).float()
        assert ((want.float() - got.float()).abs() <= ulp).all()
    else:
        assert torch.equal(got, want)


def test_reference_is_the_weighted_sum():
    y, weights = _problem(6, 4, 32, torch.bfloat16, seed=3)
    want = torch.zeros(6, 32)
    for i in range(6):
        for j in range(4):
            want[i] += weights[i, j] * y[i * 4 + j].float()
    assert torch.equal(sum_slots_reference(y, weights, 4), want.to(torch.bfloat16))


def test_no_tokens_and_flat_weights(monkeypatch):
    """No rows: an empty result. Weights given flat [T·k], through the dispatch with the Triton kernels forced: the
    kernel's bits, as from [T, k] weights in the reference."""
    y = torch.zeros(0, 16)
    assert sum_slots_triton(y, torch.zeros(0), 2).shape == (0, 16)
    y, weights = _problem(2, 3, 16, torch.float32)
    monkeypatch.setenv("NVLLM_KERNELS", "triton")
    calls = []
    real = moe_sum.sum_slots_triton
    monkeypatch.setattr(moe_sum, "sum_slots_triton", lambda *a: calls.append(1) or real(*a))
    assert torch.equal(sum_slots(y, weights.reshape(-1), 3), sum_slots_reference(y, weights, 3)) and calls
