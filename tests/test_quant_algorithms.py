"""RTN / GPTQ / AWQ building blocks on small random problems, and the full-sequence replay they run on."""

from __future__ import annotations

import copy

import pytest
import torch

from nvllm.quant import formats as F, methods as M
from nvllm.quant.awq import AWQOptions, GRID4, apply_scales, scale_groups, search_clip, search_scales
from nvllm.quant.gptq import gptq_quantize
from nvllm.quant.replay import layer_forward, model_logits
from nvllm.quant.sequential import quantize_layers
from nvllm.quant.rtn import Grid, fake_quantize, find_params, relative_error, round_to_grid
from tests.conftest import build_tiny_model
from tests.quant_utils import hf_logits, load_nvllm_model


def problem(out_f=48, in_f=128, n=512, seed=0):
    """A weight and inputs with correlated, unevenly scaled channels (as real activations are)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g)
    mix = torch.randn(in_f, in_f, generator=g) / in_f ** 0.5 + torch.eye(in_f)
    x = torch.randn(n, in_f, generator=g) @ mix * torch.exp(torch.randn(in_f, generator=g))
    return w, x, 2 * x.t() @ x / n


@pytest.mark.parametrize("sym, zero_min", [(True, 0), (False, 0), (False, 1)])
def test_find_params_matches_format_rtn(sym, zero_min):
    w, _, _ = problem()
    gq = F.quantize_rtn(w, 4, 32, sym=sym, zero_min=zero_min)
    scale, zero = find_params(w.reshape(48, 4, 32), Grid(4, sym, zero_min))
    torch.testing.assert_close(scale, gq.scales.float().t(), rtol=0, atol=0)
    torch.testing.assert_close(zero, gq.zeros.float().t(), rtol=0, atol=0)
    torch.testing.assert_close(fake_quantize(w, Grid(4, sym, zero_min), 32), gq.dequantize())


@pytest.mark.parametrize("act_order, static", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("bits, sym", [(4, True), (4, False), (8, True)])
def test_gptq_beats_rtn_and_packs(bits, sym, act_order, static):
    w, _, h = problem()
    grid = Grid(bits, sym, zero_min=0 if sym else 1)
    gq = gptq_quantize(w, h, grid, 32, act_order=act_order, static_groups=static, block_size=64)
    rtn = F.quantize_rtn(w, bits, 32, sym=sym, zero_min=grid.zero_min)
    assert relative_error(w, gq.dequantize(), h) < 0.8 * relative_error(w, rtn.dequantize(), h)
    if act_order and not static:
        assert not torch.equal(gq.g_idx, F.default_g_idx(128, 32))
    else:
        assert torch.equal(gq.g_idx, F.default_g_idx(128, 32))
    # what the writer packs reads back as the same weight
    p = F.pack_gptq(gq.q, gq.zeros, gq.scales, gq.g_idx, bits)
    qw = F.QuantWeight.from_gptq(p["qweight"], p["qzeros"], p["scales"], p["g_idx"], bits, 32)
    torch.testing.assert_close(qw.dequantize(), gq.dequantize(), rtol=0, atol=0)


def test_gptq_group_spanning_blocks_and_dead_inputs():
    w, x, h = problem()
    h[5, :] = 0
    h[:, 5] = 0
    gq = gptq_quantize(w, h, Grid(4, True), 64, block_size=16)       # groups span 4 lazy blocks
    rtn = F.quantize_rtn(w, 4, 64, sym=True)
    assert torch.isfinite(gq.dequantize()).all()
    assert relative_error(w, gq.dequantize(), h) < relative_error(w, rtn.dequantize(), h)


def lazy_gptq_codes(w, h, grid, g, block, damp=0.01):
    """GPTQ's lazy-batch loop one column at a time, as AutoGPTQ's ``fasterquant`` runs it (no act-order): a
    group's scale and zero come from ``W[:, c:c + g]`` when column c starts it, and W outside the current block
    changes only when a block ends."""
    w, n = w.clone().double(), w.shape[1]
    h = h.double() + damp * h.diag().mean().double() * torch.eye(n, dtype=torch.float64)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    codes = torch.zeros_like(w)
    for b0 in range(0, n, block):
        b1 = min(b0 + block, n)
        w1, err, u1 = w[:, b0:b1].clone(), torch.zeros(w.shape[0], b1 - b0, dtype=torch.float64), u[b0:b1, b0:b1]
        for i in range(b1 - b0):
            if (b0 + i) % g == 0:
                scale, zero = (t.double() for t in find_params(w[:, b0 + i:b0 + i + g].float(), grid))
            codes[:, b0 + i] = round_to_grid(w1[:, i], scale, zero, grid.maxq)
            err[:, i] = (w1[:, i] - (codes[:, b0 + i] - zero) * scale) / u1[i, i]
            w1[:, i:] -= err[:, i:i + 1] * u1[i:i + 1, i:]
        w[:, b1:] -= err @ u[b0:b1, b1:]
    return codes


@pytest.mark.parametrize("g, block", [(32, 128), (64, 128), (128, 128), (64, 48)])
def test_gptq_group_parameters_as_autogptq_finds_them(g, block):
    """Groups that start inside a lazy block take their scale and zero from the weights as the block found them
    (AutoGPTQ, GPTQModel): the codes equal the column-by-column reference's, up to a few rounding ties."""
    w, _, h = problem(out_f=64, in_f=256)
    gq = gptq_quantize(w, h, Grid(4, True), g, block_size=block, act_order=False, static_groups=False)
    want = lazy_gptq_codes(w, h, Grid(4, True), g, block)
    assert (gq.q.double() != want).float().mean() < 0.002


@pytest.mark.parametrize("sym", [True, False])
def test_a_group_of_zeros_or_of_tiny_weights_keeps_a_scale(sym):
    """A pruned head or 32 dead inputs give a group of zeros: its scale must survive float16 (a 0 scale made codes
    of 0 / 0, NaN in GPTQ's updates and a failed Cholesky in the next layer); tiny weights round to small codes."""
    w, _, h = problem()
    w[0, :32] = 0
    w[1, :32] = 1e-7 * torch.arange(32)
    grid = Grid(4, sym, zero_min=0 if sym else 1)
    scale, _ = find_params(w.reshape(48, 4, 32), grid)
    assert (scale > 0).all() and scale.min() == F.MIN_SCALE
    for gq in (F.quantize_rtn(w, 4, 32, sym=sym, zero_min=grid.zero_min), gptq_quantize(w, h, grid, 32)):
        deq = gq.dequantize()
        assert torch.isfinite(deq).all() and gq.q.min() >= 0 and gq.q.max() <= 15
        assert (deq[0, :32] == 0).all() and (deq[1, :32] - w[1, :32]).abs().max() <= F.MIN_SCALE
        assert relative_error(w, deq, h) < 0.05


def test_awq_search_never_worse_than_rtn_and_clip_helps():
    w, x, h = problem(seed=1)
    opts = AWQOptions()
    s = search_scales(w, h, x.abs().mean(0), 32, opts)
    plain = relative_error(w, fake_quantize(w, GRID4, 32), h)
    scaled = relative_error(w, fake_quantize(w * s, GRID4, 32) / s, h)
    assert scaled < plain
    ws, hs = w * s, h / (s[:, None] * s[None, :])
    clipped = search_clip(ws, hs, 32, opts)
    assert relative_error(ws, fake_quantize(clipped, GRID4, 32), hs) <= relative_error(ws, fake_quantize(ws, GRID4, 32), hs)
    assert torch.equal(search_clip(ws, hs, 32, opts, rows=slice(40, None))[:40], ws[:40])


def test_awq_folding_keeps_the_full_precision_function(tmp_path):
    """Scaling a linear's inputs and dividing its producer (norm, v rows, up rows) changes nothing unquantized."""
    path = build_tiny_model("llama", tmp_path / "mha", num_key_value_heads=4, intermediate_size=128)
    layer = load_nvllm_model(path).layers[0]
    groups = scale_groups(layer, {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"})
    assert [(g.linear, g.prev) for g in groups] == [("qkv_proj", "input_layernorm"), ("o_proj", "qkv_proj"),
                                                    ("gate_up_proj", "post_attention_layernorm"),
                                                    ("down_proj", "gate_up_proj")]
    x = torch.randn(2, 10, 64)
    pos = torch.arange(10)
    want = layer_forward(layer, x, pos)
    scaled = copy.deepcopy(layer)
    gen = torch.Generator().manual_seed(0)
    for g in groups:
        n_in = getattr(scaled, g.linear).in_features
        apply_scales(scaled, g, torch.rand(n_in, generator=gen) + 0.5)
    torch.testing.assert_close(layer_forward(scaled, x, pos), want, rtol=1e-4, atol=1e-5)
    # GQA: o_proj's input (4 heads) is wider than v (2 heads): no o ← v group
    gqa = load_nvllm_model(build_tiny_model("llama", tmp_path / "gqa")).layers[0]
    assert "o_proj" not in [g.linear for g in scale_groups(gqa, {"qkv_proj", "o_proj"})]


@pytest.mark.parametrize("method, full_precision", [("awq", True), ("gptq", False)])
def test_next_layer_calibrated_on_the_activations_its_method_expects(tmp_path, monkeypatch, method, full_precision):
    """AWQ calibrates every layer on the full-precision model's activations (AutoAWQ); GPTQ layer i + 1 on the
    outputs of the already quantized layer i."""
    path = build_tiny_model("llama", tmp_path / "m", num_hidden_layers=3, intermediate_size=128)
    model = load_nvllm_model(path)
    ids = torch.randint(3, 500, (4, 24), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(24)
    x = model.embed_tokens(ids)
    want = []   # mean |x| of q/k/v's inputs in the full-precision model, layer by layer
    with torch.no_grad():
        for layer in model.layers:
            want.append(layer.input_layernorm(x.reshape(-1, 64)).abs().mean(0))
            x = layer_forward(layer, x, pos)
    seen = []
    cls = M.AWQMethod if method == "awq" else M.GPTQMethod
    run = cls.quantize_stage

    def spy(self, layer, names, stats):
        if "qkv_proj" in names:
            seen.append(stats["qkv_proj"].mean_abs.clone())
        return run(self, layer, names, stats)

    monkeypatch.setattr(cls, "quantize_stage", spy)
    names = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    m = M.AWQMethod(GRID4, 32) if method == "awq" else M.GPTQMethod(Grid(4, True), 32)
    quantize_layers(model, ids, m, {i: names for i in range(3)}, torch.device("cpu"), batch=2)
    torch.testing.assert_close(seen[0], want[0])
    for got, fp in zip(seen[1:], want[1:]):
        rel = float((got - fp).norm() / fp.norm())
        assert rel < 1e-5 if full_precision else rel > 1e-3, rel


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama3-rope"])
def test_replay_matches_hf(tmp_path, kind):
    path = build_tiny_model(kind, tmp_path / kind)
    ids = torch.randint(3, 500, (2, 33), generator=torch.Generator().manual_seed(0))
    ref = hf_logits(path, ids)
    torch.testing.assert_close(model_logits(load_nvllm_model(path), ids), ref, rtol=1e-4,
                               atol=1e-4 * ref.abs().max().item())
