"""The one-launch top-k routing kernel (``nvllm.kernels.moe_routing``) against its torch reference, on the CPU under
the Triton interpreter: softmax, the k largest (largest first), renormalised or not, rounded to the logits' dtype
or not; equal logits go to the lowest expert ids."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel module is imported

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nvllm.kernels import report  # noqa: E402
from nvllm.kernels.moe_routing import route, route_reference, route_triton  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, e, k", [(1, 8, 2), (5, 60, 4), (3, 128, 8), (2, 6, 6), (4, 7, 1)])
@pytest.mark.parametrize("renormalize, in_dtype", [(True, True), (False, True), (True, False)])
def test_kernel_equals_the_reference(dtype, t, e, k, renormalize, in_dtype):
    logits = (torch.randn(t, e, generator=torch.Generator().manual_seed(e + k)) * 2).to(dtype)
    want_w, want_ids = route_reference(logits, k, renormalize, in_dtype)
    got_w, got_ids = route_triton(logits, k, renormalize, in_dtype)
    assert got_ids.dtype == torch.int32 and got_w.dtype == torch.float32
    assert torch.equal(got_ids.long(), want_ids)
    # fp32 softmax by another exp; rounded to bf16, both sides may land one bf16 ulp apart
    tol = 1e-6 if dtype == torch.float32 or not in_dtype else 2 ** -8
    torch.testing.assert_close(got_w, want_w, rtol=tol, atol=tol)
    if renormalize:
        torch.testing.assert_close(got_w.sum(-1), torch.ones(t), rtol=0, atol=k * tol)


def test_equal_logits_go_to_the_lowest_ids_and_strided_rows_are_read():
    wide = torch.zeros(3, 20)
    wide[1, 12] = wide[1, 15] = 1.0       # a tie between two experts above the rest
    logits = wide[:, :16]                 # rows of 16 with a stride of 20
    w, ids = route_triton(logits, 3, True, False)
    assert ids.tolist() == [[0, 1, 2], [12, 15, 0], [0, 1, 2]]
    torch.testing.assert_close(w[0], torch.full((3,), 1 / 3))


def test_empty_batch_and_the_dispatch(monkeypatch):
    w, ids = route_triton(torch.zeros(0, 8), 2, True, True)
    assert w.shape == ids.shape == (0, 2)
    monkeypatch.setenv("NVLLM_KERNELS", "triton")
    with report.recording() as made:
        route(torch.randn(2, 8), 2, True, True)
    assert ("moe_routing", "triton top-k routing") in made


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # inf − inf, on purpose
def test_non_finite_logits_give_nan_weights_and_valid_ids():
    """A row with an infinite or NaN logit (an overflowing token) gets NaN weights, as torch gives, and expert ids
    within range: the expert kernels index weights by them."""
    logits = torch.tensor([[0.1, float("inf"), 0.3, 0.0, 0.2, 0.5], [0.1, float("nan"), 0.3, 0.0, 0.2, 0.5],
                           [0.1, 0.7, 0.3, 0.0, 0.2, 0.5]])
    w, ids = route_triton(logits, 2, True, False)
    assert ((ids >= 0) & (ids < 6)).all()
    assert w[:2].isnan().all() and not w[2].isnan().any()
    assert ids[2].tolist() == route_reference(logits, 2, True, False)[1][2].tolist()
