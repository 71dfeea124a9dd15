"""The GPTQ block kernel (nvllm.kernels.gptq_block) against its torch reference, under the Triton interpreter:
one block or segment directly, and whole ``gptq_quantize`` runs through the Triton path vs the torch path."""

from __future__ import annotations

import pytest
import torch

from nvllm.kernels import report
from nvllm.kernels.gptq_block import gptq_block, gptq_block_reference
from nvllm.quant.gptq import gptq_quantize, inverse_hessian_factor
from nvllm.quant.rtn import Grid, find_params, relative_error


def problem(out_f, in_f, n=256, seed=0):
    """A weight and a Hessian of correlated, unevenly scaled inputs (as in tests/test_quant_algorithms.py)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g)
    mix = torch.randn(in_f, in_f, generator=g) / in_f ** 0.5 + torch.eye(in_f)
    x = torch.randn(n, in_f, generator=g) @ mix * torch.exp(torch.randn(in_f, generator=g))
    return w, 2 * x.t() @ x / n


def run_block(fn, w1, u1, scales, zeros, groups, segments, maxq):
    w1 = w1.clone()
    codes = torch.full_like(w1, -1.0)
    err1 = torch.zeros_like(w1)
    for s0, s1 in segments:
        fn(w1, u1, codes, err1, scales, zeros, groups, s0, s1, maxq)
    return w1, codes, err1


@pytest.mark.parametrize("out_f, nb, g, grid, segments, permute", [
    (24, 32, 32, Grid(4, True), [(0, 32)], False),
    (40, 64, 32, Grid(4, False, 1), [(0, 64)], True),               # static act-order groups
    (33, 128, 64, Grid(3, False), [(0, 48), (48, 100), (100, 128)], False),
    (40, 128, 128, Grid(8, True), [(0, 128)], True),
])
def test_block_kernel_matches_reference(monkeypatch, out_f, nb, g, grid, segments, permute):
    monkeypatch.setenv("NVLLM_KERNELS", "triton")
    in_f = 2 * nb
    w, h = problem(out_f, in_f)
    u = inverse_hessian_factor(h, 0.01)
    scales, zeros = (t.t().contiguous() for t in find_params(w.reshape(out_f, in_f // g, g), grid))
    groups = torch.arange(in_f) // g
    if permute:
        groups = groups[torch.randperm(in_f, generator=torch.Generator().manual_seed(1))]
    b0 = nb                                                          # the second block of the matrix
    args = (w[:, b0:b0 + nb], u[b0:b0 + nb, b0:b0 + nb], scales, zeros, groups[b0:b0 + nb].contiguous(),
            segments, grid.maxq)
    report.reset()
    w_t, q_t, e_t = run_block(gptq_block, *args)
    assert report.snapshot()["gptq_block"] == {"triton gptq_block": len(segments)}
    w_r, q_r, e_r = run_block(gptq_block_reference, *args)
    assert (q_t == q_r).float().mean() >= 0.999
    torch.testing.assert_close(e_t, e_r, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w_t, w_r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("out_f, in_f, block, g, grid, act_order, static", [
    (24, 64, 32, 32, Grid(4, True), False, True),
    (40, 128, 64, 32, Grid(4, False, 1), True, True),                # static groups, act-order permutation
    (32, 128, 64, 64, Grid(4, False), True, False),                  # dynamic groups in processing order
    (40, 256, 128, 128, Grid(4, True), False, False),                # one launch per block
    (24, 192, 64, 96, Grid(3, False, 1), False, False),              # groups straddle block ends
    (24, 128, 32, 64, Grid(4, True), True, False),                   # groups span two blocks
])
def test_gptq_quantize_triton_vs_torch(monkeypatch, out_f, in_f, block, g, grid, act_order, static):
    w, h = problem(out_f, in_f, seed=2)
    h[3, :] = 0                                                      # a dead input
    h[:, 3] = 0
    kw = dict(block_size=block, act_order=act_order, static_groups=static)
    monkeypatch.setenv("NVLLM_KERNELS", "torch")
    ref = gptq_quantize(w, h, grid, g, **kw)
    monkeypatch.setenv("NVLLM_KERNELS", "triton")
    report.reset()
    tri = gptq_quantize(w, h, grid, g, **kw)
    assert set(report.snapshot()["gptq_block"]) == {"triton gptq_block"}
    assert torch.equal(tri.g_idx, ref.g_idx)
    assert (tri.q == ref.q).float().mean() >= 0.999
    assert (tri.scales == ref.scales).float().mean() >= 0.999
    err_ref = relative_error(w, ref.dequantize(), h)
    err_tri = relative_error(w, tri.dequantize(), h)
    assert abs(err_tri - err_ref) <= 1e-3 * err_ref


def test_block_kernel_rounds_half_to_even(monkeypatch):
    """Ties round to even as torch.round does (scale 0.5: w/scale lands exactly on k + 0.5)."""
    monkeypatch.setenv("NVLLM_KERNELS", "triton")
    out_f, nb = 20, 32
    w1 = (torch.arange(out_f * nb, dtype=torch.float32).reshape(out_f, nb) % 15 - 7 + 0.5) * 0.5
    u1 = torch.eye(nb)
    scales, zeros = torch.full((1, out_f), 0.5), torch.full((1, out_f), 8.0)
    groups = torch.zeros(nb, dtype=torch.int64)
    _, q_t, e_t = run_block(gptq_block, w1, u1, scales, zeros, groups, [(0, nb)], 15)
    expect = torch.clamp(torch.round(w1 / 0.5) + 8, 0, 15)
    assert torch.equal(q_t, expect)
    assert torch.equal(e_t, w1 - (expect - 8) * 0.5)
