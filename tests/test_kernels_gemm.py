"""The skinny-GEMM Triton kernel (run by Triton's CPU interpreter) against F.linear, and the measured dispatch.

Cases cover both inner loops (fma with full-tile and per-step accumulation, mma), M in {1, 3, 8}, N and K
that are not multiples of the blocks (ragged K tail, clamped N rows, K not a multiple of 16), strided x,
bias or not, split-K 1 and > 1. Outputs and the split-K workspace are poisoned with NaN before the kernel
runs, so an unwritten output or an unwritten partial shows up.

Tolerance, relative to the largest |output| of the case (reference: fp32 F.linear of the same rounded
inputs): fp32 1e-5; fp16 2e-3; bf16 1e-2 (the interpreter truncates fp32 → bf16 instead of rounding to
nearest: up to 1 ulp = 2^-7).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is jitted

import glob  # noqa: E402
import json  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from nvllm.kernels import gemm as G  # noqa: E402
from nvllm.kernels import gemm_tuner as T  # noqa: E402
from nvllm.kernels import report  # noqa: E402

if not isinstance(G._jit(G._skinny_gemm_kernel), InterpretedFunction):
    G._jit.cache_clear()  # jitted for a GPU before TRITON_INTERPRET was set: jit again for the interpreter

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}

CONFIGS = {
    # fma, 1·16·64 ≤ 32·128 accumulators per thread: full-tile accumulation, reduced after the loop
    "fma-deferred": G.SkinnyConfig("fma", 16, 64, split_k=1),
    # fma with one warp: 32·64 > 32·32 → reduce every step; split-K 3, pipelined K loop
    "fma-perstep-split3": G.SkinnyConfig("fma", 32, 64, split_k=3, num_warps=1, num_stages=2),
    "mma": G.SkinnyConfig("mma", 16, 32, split_k=1, num_stages=2),
    "mma-split4": G.SkinnyConfig("mma", 32, 32, split_k=4),
}
# (dtype, N, K, bias, strided x): fp32 with K a multiple of 32 but not 64 (ragged tail for BLOCK_K=64),
# bf16 with K=100 (not a multiple of 16: ragged for every block, unaligned rows), fp16 with bias
SHAPES = [
    (torch.float32, 72, 160, True, False),
    (torch.bfloat16, 72, 100, False, True),
    (torch.float16, 40, 96, True, False),
]


def _inputs(M, N, K, dtype, bias, strided, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K + (8 if strided else 0), generator=gen).to(dtype)
    x = x[:, 3:3 + K] if strided else x
    w = torch.randn(N, K, generator=gen).to(dtype)
    b = torch.randn(N, generator=gen).to(dtype) if bias else None
    return x, w, b


def _check(y, x, w, b):
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert not torch.isnan(y).any(), "an output was never written"
    err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
    assert err <= TOL[x.dtype], err


def _poison_workspaces():
    for partials, locks in G._workspaces.values():
        partials.fill_(float("nan"))
        assert int(locks.abs().sum()) == 0, "a split-K arrival counter was not re-armed"


@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype,N,K,bias,strided", SHAPES, ids=["fp32", "bf16", "fp16"])
def test_skinny_gemm_matches_linear(name, M, dtype, N, K, bias, strided):
    cfg = CONFIGS[name]
    x, w, b = _inputs(M, N, K, dtype, bias, strided)
    assert x.stride(0) == K + (8 if strided else 0)
    _poison_workspaces()
    out = torch.full((M, N), float("nan"), dtype=dtype)
    y = G.skinny_gemm(x, w, b, cfg, out=out)
    assert y is out
    _check(y, x, w, b)
    _poison_workspaces()  # every counter back to 0


@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("name", ["fma-deferred", "fma-perstep-split3"])
@pytest.mark.parametrize("dtype,N,K,bias,strided", SHAPES[:2], ids=["fp32", "bf16"])
def test_skinny_gemm_early_first_tile(name, M, dtype, N, K, bias, strided):
    """The fma loop with its first W tile peeled off and loaded up front (what PDL launches do on the GPU):
    the same result as the plain loop, bit for bit."""
    x, w, b = _inputs(M, N, K, dtype, bias, strided)
    plain = G.skinny_gemm(x, w, b, CONFIGS[name], early_w=False)
    early = G.skinny_gemm(x, w, b, CONFIGS[name], early_w=True)
    _check(early, x, w, b)
    assert torch.equal(early, plain)
    _poison_workspaces()


@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("name", ["fma-deferred", "fma-perstep-split3", "mma"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_skinny_gemm_wide_output_holds_the_rounded_result(name, M, dtype):
    """A 16-bit GEMM into an fp32 ``out`` (the LM head's logits) stores the values the 16-bit output holds, bit
    for bit, not the unrounded fp32 sums (greedy ties then break as with a cast after the GEMM); ``gemm``'s
    ``out_dtype`` gives the same on both paths."""
    x, w, b = _inputs(M, 72, 160, dtype, True, False)
    narrow = G.skinny_gemm(x, w, b, CONFIGS[name])
    wide = G.skinny_gemm(x, w, b, CONFIGS[name], out=torch.full((M, 72), float("nan")))
    assert wide.dtype == torch.float32 and torch.equal(wide, narrow.float())
    assert torch.equal(G.gemm(x, w, b, out_dtype=torch.float32), F.linear(x, w, b).float())   # not in the table
    _poison_workspaces()


@pytest.mark.parametrize("M", [1, 3])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype,bias", [(torch.float32, True), (torch.bfloat16, False)], ids=["fp32", "bf16"])
def test_skinny_gemm_silu_and_mul_epilogue(name, M, dtype, bias):
    """An interleaved gate_up (blocks of 4): SiLU·mul in the epilogue gives the bits of the same GEMM followed
    by the interleaved silu_and_mul kernel, and the plain layer's result."""
    from nvllm.kernels.activation import interleave_rows, silu_and_mul_reference, silu_and_mul_triton

    N, K = 72, 160                                  # I = 36: nine blocks of 4, the last tile partly masked
    x, w, b = _inputs(M, N, K, dtype, bias, False)
    wi, bi = interleave_rows(w, 4), None if b is None else interleave_rows(b, 4)
    fused = G.skinny_gemm(x, wi, bi, CONFIGS[name], silu_block=4)
    two_step = silu_and_mul_triton(G.skinny_gemm(x, wi, bi, CONFIGS[name]), interleave=4)
    assert fused.shape == (M, N // 2) and torch.equal(fused, two_step)
    ref = silu_and_mul_reference(F.linear(x.float(), w.float(), None if b is None else b.float()))
    assert ((fused.float() - ref).abs().max() / ref.abs().max()).item() <= 2 * TOL[dtype]
    _poison_workspaces()


def test_gemm_silu_and_mul_dispatch(table):
    """Fused where the table picks a skinny config whose tile holds whole blocks; the GEMM then the interleaved
    kernel otherwise (cuBLAS choice, or a tile narrower than a block pair)."""
    from nvllm.kernels.activation import interleave_rows, silu_and_mul_reference

    x, w, _ = _inputs(1, 72, 160, torch.float32, False, False)
    wi = interleave_rows(w, 4)
    want = silu_and_mul_reference(F.linear(x, w))
    for choice, fused in ((G.SkinnyConfig("fma", 8, 64), True), (G.SkinnyConfig("fma", 4, 64), False),
                          (G.CUBLAS, False)):
        G.set_gemm_choice(72, 160, 1, torch.float32, choice)
        report.reset()
        torch.testing.assert_close(G.gemm_silu_and_mul(x, wi, None, 4), want, rtol=1e-5, atol=1e-6)
        assert ("in the gate_up GEMM's epilogue" in report.snapshot()["silu_and_mul"]) == fused, choice


def test_split_k_geometry_trims_empty_splits():
    # K=100 with BLOCK_K=64 → 2 K blocks: split 3 would leave one split empty → 2 programs along K
    _, bk, k_blocks, per_split, splits, n_tiles, m_tiles = G._geometry(3, 72, 100, CONFIGS["fma-perstep-split3"])
    assert (bk, k_blocks, per_split, splits) == (64, 2, 1, 2)
    _, bk, k_blocks, per_split, splits, n_tiles, m_tiles = G._geometry(8, 72, 160, CONFIGS["mma-split4"])
    assert (bk, k_blocks, per_split, splits, n_tiles, m_tiles) == (32, 5, 2, 3, 3, 1)


def test_split_k_is_deterministic_and_matches_unsplit():
    x, w, b = _inputs(3, 72, 160, torch.float32, True, False, seed=1)
    split = G.SkinnyConfig("mma", 32, 32, split_k=5)
    y1 = G.skinny_gemm(x, w, b, split)
    y2 = G.skinny_gemm(x, w, b, split)
    assert torch.equal(y1, y2)
    y0 = G.skinny_gemm(x, w, b, G.SkinnyConfig("mma", 32, 32, split_k=1))
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-5)


def test_config_validation_and_describe():
    with pytest.raises(ValueError):
        G.SkinnyConfig("fma", 12, 64)
    with pytest.raises(ValueError):
        G.SkinnyConfig("mma", 8, 64)
    with pytest.raises(ValueError):
        G.SkinnyConfig("wgmma", 16, 64)
    cfg = G.SkinnyConfig("mma", 64, 128, split_k=4, num_warps=4, num_stages=4)
    assert cfg.describe() == "triton skinny (BLOCK_N=64 BLOCK_K=128 SPLIT_K=4 mma warps=4 stages=4)"
    assert G.SkinnyConfig.from_dict(cfg.to_dict()) == cfg
    assert [cfg.block_m(m) for m in (1, 3, 16, 17, 64, 65)] == [16, 16, 16, 32, 64, 64]
    assert [G.SkinnyConfig("fma", 8, 64).block_m(m) for m in (1, 2, 3, 4, 9)] == [1, 2, 4, 4, 4]


# ----------------------------------------------------------------------------------------------- dispatch


@pytest.fixture
def table(monkeypatch):
    monkeypatch.setenv("NVLLM_KERNELS", "triton")  # Triton path on the CPU (interpreter)
    G.clear_gemm_table()
    report.reset()
    yield G.gemm_table()
    G.clear_gemm_table()
    report.reset()


def test_table_routes_to_the_chosen_implementation(table, monkeypatch):
    cfg = G.SkinnyConfig("fma", 16, 64, split_k=2)
    G.set_gemm_choice(72, 160, 4, torch.float32, cfg)     # bucket 4: M = 3 and 4
    G.set_gemm_choice(40, 96, 1, torch.float32, G.CUBLAS)
    assert G.gemm_choice(72, 160, 3, torch.float32) == cfg
    assert G.gemm_choice(72, 160, 8, torch.float32) == G.CUBLAS    # other bucket: untuned
    assert G.gemm_choice(72, 160, 4, torch.float16) == G.CUBLAS    # other dtype

    x, w, b = _inputs(3, 72, 160, torch.float32, True, False)
    _check(G.gemm(x, w, b), x, w, b)
    x4 = torch.randn(2, 2, 160)                                    # leading dims: M = 4
    y4 = G.gemm(x4, w)
    assert y4.shape == (2, 2, 72)
    _check(y4.reshape(4, 72), x4.reshape(4, 160), w, None)
    assert report.snapshot() == {"gemm": {cfg.describe(): 2}}

    report.reset()
    G.gemm(torch.randn(1, 96), torch.randn(40, 96))               # table says cuBLAS
    G.gemm(torch.randn(8, 160), w)                                # M=8: not in the table
    G.gemm(torch.randn(3, 160).half(), w.half())                  # fp16: not in the table
    assert report.snapshot() == {"gemm": {"torch F.linear (cpu)": 3}}

    report.reset()
    monkeypatch.setenv("NVLLM_KERNELS", "torch")                  # the torch override wins over the table
    G.gemm(x, w, b)
    monkeypatch.setenv("NVLLM_KERNELS", "auto")                   # auto: a CPU tensor never runs Triton
    G.gemm(x, w, b)
    assert report.snapshot() == {"gemm": {"torch F.linear (cpu)": 2}}


def test_gemm_writes_into_out(table):
    """``out=``: both paths fill the given buffer (a static CUDA-graph buffer) and return it."""
    cfg = G.SkinnyConfig("fma", 16, 64)
    G.set_gemm_choice(72, 160, 4, torch.float32, cfg)
    x, w, b = _inputs(3, 72, 160, torch.float32, True, False)
    for bias in (b, None):
        for xs in (x, torch.randn(3, 96)):         # M=3 in the table (skinny); K=96 is not (cuBLAS / CPU)
            wt = w if xs.shape[1] == 160 else torch.randn(72, 96)
            buf = torch.full((5, 72), float("nan"))
            y = G.gemm(xs, wt, bias, out=buf[:3])
            assert y.data_ptr() == buf.data_ptr() and torch.isnan(buf[3:]).all()
            _check(buf[:3], xs, wt, bias)
    assert report.snapshot()["gemm"] == {cfg.describe(): 2, "torch F.linear (cpu)": 2}


def test_table_rejects_bad_entries(table):
    with pytest.raises(ValueError):
        G.set_gemm_choice(72, 160, G.MAX_TUNED_M + 1, torch.float32, G.CUBLAS)
    with pytest.raises(ValueError):
        G.set_gemm_choice(72, 160, 1, torch.float32, "triton")
    assert G.gemm_bucket(0) is None and G.gemm_bucket(5) == 8 and G.gemm_bucket(G.MAX_TUNED_M + 1) is None


def test_table_save_and_load(table, tmp_path):
    cfg = G.SkinnyConfig("mma", 64, 128, split_k=4, num_warps=4, num_stages=4)
    G.set_gemm_choice(3584, 3584, 1, torch.bfloat16, cfg)
    G.set_gemm_choice(152064, 3584, 16, torch.bfloat16, G.CUBLAS)
    path = tmp_path / "table.json"
    G.save_gemm_table(str(path), meta={"device": "test"})
    assert json.loads(path.read_text())["meta"] == {"device": "test"}
    saved = dict(table)
    G.clear_gemm_table()
    assert G.load_gemm_table(str(path)) == 2
    assert G.gemm_table() == saved


def test_tuner_fills_the_table_from_measurements(table):
    """The tuner on the CPU with a fake timer: every candidate is checked against F.linear (interpreter),
    the fastest wins when it beats cuBLAS by the margin, otherwise cuBLAS stays."""
    fma = (16, 32, 4, 1)
    mma = (16, 32, 4, 2)
    times = {("fma", 48): 5.0, ("mma", 48): 7.0, ("fma", 64): 9.9, ("mma", 64): 9.8}

    def fake_timer(call, n_copies, estimate_s, choice):
        assert n_copies == 2
        n = call(n_copies - 1).shape[1]  # runs on the last weight copy
        return 10.0 if choice == G.CUBLAS else times[(choice.kernel, n)]

    tuner = T.GemmTuner(timer=fake_timer, rotate_bytes=1, fma_tiles=[fma], mma_tiles=[mma])
    results = tuner.tune([(48, 64), (64, 64)], [1, 3], torch.float32, "cpu")
    assert [(r["n"], r["m"]) for r in results] == [(48, 1), (48, 4), (64, 1), (64, 4)]
    for r in results:
        assert len(r["candidates"]) == 2 and all(c["rel_err"] < 1e-5 for c in r["candidates"])
    fma_cfg = G.SkinnyConfig("fma", 16, 32, 1, 4, 1)
    assert G.gemm_choice(48, 64, 1, torch.float32) == fma_cfg
    assert G.gemm_choice(48, 64, 3, torch.float32) == fma_cfg
    assert G.gemm_choice(64, 64, 1, torch.float32) == G.CUBLAS   # 9.8 is within the 3% margin of 10.0
    assert results[2]["choice"] == G.CUBLAS and results[2]["best_config"]["kernel"] == "mma"

    # a candidate that fails its accuracy check is never timed nor chosen
    G.clear_gemm_table()
    strict = T.GemmTuner(timer=fake_timer, rotate_bytes=1, max_err=-1.0, fma_tiles=[fma], mma_tiles=[])
    r = strict.tune([(48, 64)], [1], torch.float32, "cpu")[0]
    assert "error" in r["candidates"][0] and "time_s" not in r["candidates"][0]
    assert G.gemm_choice(48, 64, 1, torch.float32) == G.CUBLAS


def test_tune_gemm_is_a_no_op_off_the_gpu(table):
    assert T.tune_gemm([(72, 160)], [1, 2], torch.float32, "cpu") == []
    assert G.gemm_table() == {}


def test_candidates_for_decode_shapes():
    # o_proj 3584→3584 at M=1 on 132 SMs: fma and mma candidates, split-K offered where tiles are few
    cands = T.candidate_configs(3584, 3584, 1, 132)
    kinds = {c.kernel for c in cands}
    assert kinds == {"fma", "mma"}
    assert any(c.split_k > 1 for c in cands if c.kernel == "mma")
    assert all(c.split_k == 1 for c in cands if c.kernel == "fma" and c.block_n == 4)   # 896 tiles
    # M=8: mma only; lm_head 152064 rows: never split
    assert {c.kernel for c in T.candidate_configs(3584, 3584, 8, 132)} == {"mma"}
    assert all(c.split_k == 1 for c in T.candidate_configs(152064, 3584, 1, 132))
    assert T.split_choices(56, 28, 132) == [1, 2, 4, 8]      # ≥ 2 K blocks per split
    assert T.split_choices(56, 74, 132) == [1, 2, 4, 8, 16]
    assert T.split_choices(448, 7, 132) == [1, 2]


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(os.path.dirname(G.__file__), "configs", "gemm_*.json"))),
                         ids=os.path.basename)
def test_shipped_tables_load_under_their_device_name(path):
    """Each shipped table sits where the engine looks for its GPU (the device named in every run's meta) and every
    entry is a valid choice."""
    from nvllm.kernels.gemm_table import gemm_table_path

    data = json.loads(open(path).read())
    devices = {m["device"] for m in data["meta"].values()}
    assert len(devices) == 1 and gemm_table_path(devices.pop()) == path
    G.clear_gemm_table()
    try:
        assert G.load_gemm_table(path) == len(data["entries"]) > 0
        for e in data["entries"]:
            choice = e["choice"]
            assert choice == G.CUBLAS or G.SkinnyConfig.from_dict(choice).kernel in ("fma", "mma")
            assert e["m"] & (e["m"] - 1) == 0 and e["dtype"] == "bfloat16"
    finally:
        G.clear_gemm_table()


def test_merge_gemm_table(tmp_path):
    """Several models' runs into one file a GPU model: entries of the same key replaced, meta kept per run; a file of
    another device refused; the merged file loads back whole."""
    path = str(tmp_path / "gemm_GPU.json")
    fma = G.SkinnyConfig("fma", 8, 256)
    G.clear_gemm_table()
    try:
        G.set_gemm_choice(256, 128, 1, torch.bfloat16, fma)
        G.set_gemm_choice(256, 128, 2, torch.bfloat16, G.CUBLAS)
        assert G.merge_gemm_table(path, "model a", {"device": "GPU"}) == 2
        G.clear_gemm_table()
        G.set_gemm_choice(256, 128, 2, torch.bfloat16, fma)           # the same key: replaced
        G.set_gemm_choice(512, 128, 1, torch.bfloat16, G.CUBLAS)
        assert G.merge_gemm_table(path, "model b", {"device": "GPU"}) == 3
        data = json.loads(open(path).read())
        assert list(data["meta"]) == ["model a", "model b"]
        with pytest.raises(ValueError, match="one GPU model"):
            G.merge_gemm_table(path, "model c", {"device": "other GPU"})
        G.clear_gemm_table()
        assert G.load_gemm_table(path) == 3
        assert G.gemm_choice(256, 128, 1, torch.bfloat16) == fma == G.gemm_choice(256, 128, 2, torch.bfloat16)
        assert G.gemm_choice(512, 128, 1, torch.bfloat16) == G.CUBLAS
        assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]                  # nothing half-written left
    finally:
        G.clear_gemm_table()


def test_bench_script_dry_run_merges_its_table(tmp_path):
    """scripts/gpu_gemm_bench.py on the CPU (interpreter, shapes / 64): its checks pass and --merge-into adds its
    table to the file under the model's name."""
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dest = tmp_path / "gemm_cpu.json"
    run = subprocess.run([sys.executable, os.path.join(repo, "scripts", "gpu_gemm_bench.py"), "--dry-run-cpu",
                          "--shapes", "o", "--ms", "1", "--merge-into", str(dest)], capture_output=True, text=True,
                         env={**os.environ, "OUT": str(tmp_path)}, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    data = json.loads(dest.read_text())
    assert list(data["meta"]) == ["qwen2.5-7b"] and len(data["entries"]) == 1
