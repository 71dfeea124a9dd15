"""The Triton fused MoE (the grouped GEMM of larger batches, the GEMVs of decode-sized ones)
against its torch reference, on the CPU under the Triton interpreter. Tests that name a path force it by setting
``SMALL_ROWS`` (the T·k up to which the GEMVs run; by default T·k ≤ E) and check, by counting the host wrappers'
calls, that it ran.

Tolerances (max |kernel − reference| ≤ tol · max |reference|):
  fp32: 1e-5 (the GEMMs sum K in another order);
  fp16: 4 ulps (2⁻⁸): an fp32 difference in the last bit may flip one rounding of an intermediate;
  bf16: 4 ulps (2⁻⁵) — the 3.9 interpreter converts fp32 → bf16 by truncation (the GPU rounds to nearest
        even, as torch does), so the gate/up and down products are each up to one ulp low.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel module is imported

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from nvllm.kernels import fused_moe, report  # noqa: E402
from nvllm.kernels.fused_moe import (  # noqa: E402
    fused_experts, fused_experts_reference, fused_experts_triton)

TOL = {torch.float32: 1e-5, torch.float16: 2 ** -8, torch.bfloat16: 2 ** -5}


def _problem(t, e, k, hidden, inter, dtype, ids=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, hidden, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * inter, hidden, generator=g) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(e, hidden, inter, generator=g) / inter ** 0.5).to(dtype)
    if ids is None:
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k)
    ids = ids.to(torch.int32).reshape(t, k)
    weights = torch.softmax(torch.randn(t, k, generator=g), dim=-1)
    return x, w13, w2, weights, ids


CASES = [  # (T, E, k, H, I)
    pytest.param(5, 4, 2, 64, 32, id="T5-E4-k2"),
    pytest.param(1, 4, 2, 40, 24, id="T1-odd-dims"),
    pytest.param(6, 3, 1, 72, 20, id="k1"),
    pytest.param(3, 3, 3, 24, 40, id="k=E"),
    pytest.param(40, 2, 1, 48, 24, id="20-rows-an-expert"),
    pytest.param(150, 3, 2, 40, 16, id="100-rows-an-expert"),
]
DTYPES = [pytest.param(d, id=str(d).removeprefix("torch.")) for d in (torch.float32, torch.float16, torch.bfloat16)]


def _assert_close(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not torch.isnan(out).any()
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= TOL[dtype] * ref.float().abs().max().item(), err


@pytest.fixture
def launches(monkeypatch):
    """Counts of the calls, per host wrapper, made by the Triton path (the wrappers still run)."""
    counts = {name: 0 for name in ("align_tokens", "_moe_gemm", "_moe_gemv_up", "_moe_gemv_down")}

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    for name in counts:
        monkeypatch.setattr(fused_moe, name, counting(name, getattr(fused_moe, name)))
    return counts


SMALL = {"align_tokens": 0, "_moe_gemm": 0, "_moe_gemv_up": 1, "_moe_gemv_down": 1}
LARGE = {"align_tokens": 1, "_moe_gemm": 2, "_moe_gemv_up": 0, "_moe_gemv_down": 0}
PATHS = [pytest.param("small", id="small"), pytest.param("large", id="large")]


def _run_path(path, args, monkeypatch, launches):
    """fused_experts_triton on ``path`` (forced through SMALL_ROWS), having checked that path ran."""
    monkeypatch.setattr(fused_moe, "SMALL_ROWS", 1 << 30 if path == "small" else 0)
    out = fused_experts_triton(*args)
    assert launches == (SMALL if path == "small" else LARGE)
    return out


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t, e, k, hidden, inter", CASES)
def test_fused_experts_triton(t, e, k, hidden, inter, dtype, path, monkeypatch, launches):
    args = _problem(t, e, k, hidden, inter, dtype)
    _assert_close(_run_path(path, args, monkeypatch, launches), fused_experts_reference(*args), dtype)


SMALL_CASES = [  # decode shapes: (T, E, k, H, I), H and I not multiples of 16
    pytest.param(1, 6, 2, 40, 24, id="T1-k2"),
    pytest.param(1, 5, 5, 33, 17, id="T1-k=E"),
    pytest.param(3, 7, 3, 72, 20, id="T3-k3"),
    pytest.param(3, 4, 4, 24, 40, id="T3-k=E"),
    pytest.param(3, 10, 10, 40, 20, id="T3-k10"),   # more slots than the down kernel loads at once: two groups
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t, e, k, hidden, inter", SMALL_CASES)
def test_fused_experts_small_batch(t, e, k, hidden, inter, dtype, monkeypatch, launches):
    """The decode GEMVs (forced where T·k > E)."""
    monkeypatch.setattr(fused_moe, "SMALL_ROWS", 64)
    args = _problem(t, e, k, hidden, inter, dtype, seed=k)
    out = fused_experts_triton(*args)
    assert launches == SMALL
    _assert_close(out, fused_experts_reference(*args), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_experts_small_batch_repeated_experts(dtype, monkeypatch, launches):
    """An expert in several tokens' slots and at different slots (2 in all three tokens, 0 in two), one expert idle:
    each pair reads its own expert, and each token sums its own slots, in their order. int64 ids, as the router's
    topk gives them."""
    monkeypatch.setattr(fused_moe, "SMALL_ROWS", 64)
    ids = torch.tensor([[2, 0, 5], [4, 2, 0], [2, 5, 1]])
    *args, _ = _problem(3, 6, 3, 34, 18, dtype, ids=ids)
    args = (*args, ids)
    out = fused_experts_triton(*args)
    assert launches == SMALL
    _assert_close(out, fused_experts_reference(*args), dtype)


@pytest.mark.parametrize("t, k, expected", [(8, 2, SMALL), (4, 4, SMALL), (1, 16, SMALL), (17, 1, LARGE),
                                             (3, 6, LARGE)],
                         ids=["16-rows", "16-rows-k4", "16-rows-k16", "17-rows", "18-rows"])
def test_fused_experts_path_threshold(t, k, expected, launches):
    """By default (SMALL_ROWS None) the GEMVs while the (token, slot) pairs are no more than the 16 experts, from 17
    the sort and grouped GEMM."""
    assert fused_moe.SMALL_ROWS is None
    args = _problem(t, 16, k, 24, 16, torch.float32)
    out = fused_experts_triton(*args)
    assert launches == expected
    _assert_close(out, fused_experts_reference(*args), torch.float32)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_fused_experts_one_expert_takes_all(dtype, path, monkeypatch, launches):
    """Every token to experts 2 and 0 (several blocks of one expert, experts 1 and 3 idle), H and I odd."""
    t, e, k = 20, 4, 2
    ids = torch.tensor([[2, 0]] * t)
    args = _problem(t, e, k, 33, 17, dtype, ids=ids)
    _assert_close(_run_path(path, args, monkeypatch, launches), fused_experts_reference(*args), dtype)


def test_fused_experts_empty_batch():
    x, w13, w2, weights, ids = _problem(0, 3, 2, 24, 16, torch.float32)
    out = fused_experts_triton(x, w13, w2, weights, ids)
    assert out.shape == (0, 24) and out.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_fused_experts_dispatch_records(monkeypatch, launches, dtype):
    """NVLLM_KERNELS=triton: the Triton path runs (its SiLU·mul too; the GEMVs at this size) and the report says
    so."""
    args = _problem(3, 8, 2, 32, 16, dtype)
    monkeypatch.setenv("NVLLM_KERNELS", "triton")
    with report.recording() as made:
        out = fused_experts(*args)
    assert launches == SMALL
    assert made[("fused_moe", "triton gemv (a row per token and expert)")] == 1
    assert report.snapshot()["fused_moe"]["triton gemv (a row per token and expert)"] >= 1
    assert made[("silu_and_mul", "triton silu_and_mul")] == 1
    _assert_close(out, fused_experts_reference(*args), dtype)
    monkeypatch.setenv("NVLLM_KERNELS", "torch")
    with report.recording() as made:
        fused_experts(*args)
    assert made[("fused_moe", "torch reference")] == 1


def test_fused_experts_blocks_of_128_rows_past_64(monkeypatch, launches):
    """Past 64 rows an expert the grouped GEMM takes blocks of 128 (two experts of 70 and 60 rows here: each one
    block, mostly padding)."""
    assert fused_moe.gemm_config(130, 2)["BLOCK_M"] == 128 and fused_moe.gemm_config(128, 2)["BLOCK_M"] == 64
    ids = torch.tensor([0] * 70 + [1] * 60)[:, None]
    args = _problem(130, 2, 1, 24, 16, torch.float32, ids=ids)
    _assert_close(_run_path("large", args, monkeypatch, launches), fused_experts_reference(*args), torch.float32)


def test_fused_experts_gemm_tiles_override(monkeypatch, launches):
    """GEMM_TILES replaces the grouped GEMM's launch: small tiles give several column tiles and K steps (64 inputs in
    steps of 16, w13's 64 columns in tiles of 16) and the same result."""
    monkeypatch.setattr(fused_moe, "GEMM_TILES", {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "num_stages": 2})
    assert fused_moe.gemm_config(40, 4) == dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=2)
    args = _problem(20, 4, 2, 64, 32, torch.bfloat16)
    _assert_close(_run_path("large", args, monkeypatch, launches), fused_experts_reference(*args), torch.bfloat16)


@pytest.mark.parametrize("elem, shared, expected", [
    (2, 232448, (4, 256)),    # bf16 on an H100/H200 (227 KiB a block): the sweep's setting as it ran
    (2, 166912, (3, 256)),    # an A100 (163 KiB): one stage fewer
    (2, 101376, (2, 256)),    # an L40S / RTX 4090 (99 KiB): two stages
    (4, 166912, (2, 128)),    # fp32 on an A100: two stages of half the columns
    (4, 0, (4, 256)),         # no limit known (the interpreter)
])
def test_grouped_gemm_fits_shared_memory(elem, shared, expected):
    """The widest launch (blocks of 128 rows, 256 columns, K steps of 64, 4 stages) is cut to the device's shared
    memory: stages first, then columns — a launch past it would stop the engine with an out-of-resources error."""
    config = fused_moe.gemm_config(128 * 8, 8)
    assert (config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"], config["num_stages"]) == (128, 256, 64, 4)
    got = fused_moe._fit_shared(config["num_stages"], config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"], elem,
                                shared)
    assert got == expected
    assert not shared or got[0] * (128 + got[1]) * 64 * elem <= shared
