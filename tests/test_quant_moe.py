"""Quantized mixtures of experts: GPTQ (4/8-bit, act-order) and AWQ checkpoints of Qwen3-MoE, Qwen2-MoE and Mixtral,
laid out as GPTQModel / AutoAWQ write them (packed tensors per expert and projection), load into ``QuantExperts`` and
compute what HF transformers computes with the dequantized weights; the Triton experts kernels (CPU interpreter)
against their torch reference; what stays refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from nvllm import SamplingParams
from nvllm.config import ConfigError
from nvllm.kernels import fused_moe, report
from nvllm.kernels import quant_moe as QM
from nvllm.layers.quant_experts import QuantExperts
from nvllm.layers.quant_linear import QuantLinear
from nvllm.quant import formats as F
from nvllm.quant.replay import model_logits
from tests.conftest import TOKENIZER_FILES, build_tiny_model, make_llm
from tests.quant_utils import hf_logits, load_nvllm_model, write_by_hand


# ---- the kernels -----------------------------------------------------------------------------------------
def _stack(weights: list[torch.Tensor], bits: int, group: int, sym: bool, act_order: bool) -> QM.ExpertWeights:
    qs = []
    for e, w in enumerate(weights):
        g_idx = None
        if act_order:
            perm = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(e))
            g_idx = F.act_order_g_idx(perm, group)
        qs.append(F.quantize_to_gptq(w, bits, group, sym=sym, g_idx=g_idx))
    return QM.ExpertWeights(torch.stack([q.qweight for q in qs]), torch.stack([q.qzeros for q in qs]),
                            torch.stack([q.scales for q in qs]),
                            torch.stack([q.tensors()["g_idx"] for q in qs]) if act_order else None,
                            bits, qs[0].group_size)


def _problem(e=6, h=64, inter=32, t=3, k=2, bits=4, group=32, sym=True, act_order=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w13 = _stack([torch.randn(2 * inter, h, generator=gen) * 0.1 for _ in range(e)], bits, group, sym, act_order)
    w2 = _stack([torch.randn(h, inter, generator=gen) * 0.1 for _ in range(e)], bits, group, sym, act_order)
    x = torch.randn(t, h, generator=gen)
    weights, ids = torch.topk(torch.randn(t, e, generator=gen).softmax(-1), k)
    return x, w13, w2, weights, ids.to(torch.int32)


def test_reference_is_the_per_token_definition():
    """The reference against the op written out token by token from the dequantized experts."""
    x, w13, w2, weights, ids = _problem()
    out = QM.quant_experts_reference(x, w13, w2, weights, ids)
    inter = w2.in_features
    for t in range(x.shape[0]):
        want = torch.zeros(x.shape[1])
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13.dequantize(e) @ x[t]
            want += weights[t, j] * (w2.dequantize(e) @ (torch.nn.functional.silu(h[:inter]) * h[inter:]))
        torch.testing.assert_close(out[t], want, rtol=1e-5, atol=1e-6)


CASES = {  # id → problem arguments
    "w4-g32-sym": dict(),
    "w8-g16-asym": dict(bits=8, group=16, sym=False),
    "w4-g32-actorder": dict(act_order=True, sym=False),
    "w4-one-group": dict(group=-1),
    "w4-g16-k1": dict(group=16, k=1, t=5),
    "w4-12-pairs": dict(e=16, t=6, k=2),   # more than 8 (token, slot) pairs: the GEMV's step sums
    "w8-12-pairs-actorder": dict(bits=8, e=16, t=6, k=2, act_order=True, sym=False),
    # inputs not a multiple of a K step, outputs not a multiple of a column tile
    "w4-odd-one-group": dict(h=72, inter=40, group=-1, sym=False),
    "w4-odd-actorder": dict(h=72, inter=40, group=8, act_order=True, sym=False),
    "w8-odd-g8": dict(bits=8, h=72, inter=40, group=8),
}


@pytest.mark.parametrize("path", ["gemv", "gemv-split", "grouped", "grouped-small-tiles"])
@pytest.mark.parametrize("case", list(CASES))
def test_triton_equals_reference(monkeypatch, case, path):
    """Each path; the split GEMV with K steps of 16 inputs split three ways (its sums added into zeroed
    accumulators, finished by SiLU·mul and the final cast); the grouped GEMM at its own launch (blocks of 16 rows,
    128 columns and K steps cut to the problem) and with small tiles set through GEMM_TILES (several column tiles
    and K steps a group)."""
    monkeypatch.setenv("NVLLM_KERNELS", "triton")
    monkeypatch.setattr(fused_moe, "SMALL_ROWS", 0 if path.startswith("grouped") else 1000)
    if path == "grouped-small-tiles":
        monkeypatch.setattr(QM, "GEMM_TILES", {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "num_stages": 2})
    monkeypatch.setattr(QM, "GEMV_SPLIT_K", 3 if path == "gemv-split" else 1)
    if path == "gemv-split":
        monkeypatch.setattr(QM, "GEMV_BLOCK_K", 16)
    x, w13, w2, weights, ids = _problem(**CASES[case])
    report.reset()
    out = QM.quant_experts(x, w13, w2, weights, ids)
    ref = QM.quant_experts_reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    kind = {"gemv": "gemv", "gemv-split": "gemv (split k)", "grouped": "grouped gemm",
            "grouped-small-tiles": "grouped gemm"}[path]
    from nvllm.kernels import partial_sum     # the accumulators left zeroed and free for the next GEMV

    assert not partial_sum._HELD and not any(b.any() for b in partial_sum._BUFFERS.get(x.device, []))
    assert report.snapshot()["quant_moe"] == {f"triton w{w13.bits}a16 gptq {kind}": 1}
    xb = x.to(torch.bfloat16)   # the weights rounded to bf16 in the kernels, not in the reference
    out = QM.quant_experts(xb, w13, w2, weights, ids).float()
    ref = QM.quant_experts_reference(xb, w13, w2, weights, ids).float()
    torch.testing.assert_close(out, ref, rtol=0, atol=0.05 * ref.abs().max().item())


def test_grouped_gemm_rows_a_block():
    """The 4-bit grouped GEMM's blocks by pairs an expert (H100 runs FU, FZ and GA): 16 rows up to 16, 64
    up to 64, 128 past it, with K steps of 128 up to 64 pairs an expert and 64 past it."""
    configs = {p: QM.gemm_config(p * 8, 8) for p in (3, 16, 17, 64, 65, 96, 500)}
    rows = {p: (c["BLOCK_M"], c["BLOCK_K"]) for p, c in configs.items()}
    assert rows == {3: (16, 128), 16: (16, 128), 17: (64, 128), 64: (64, 128), 65: (128, 64), 96: (128, 64),
                    500: (128, 64)}


def test_no_tokens_and_the_sorted_path_default(monkeypatch):
    monkeypatch.setenv("NVLLM_KERNELS", "triton")
    x, w13, w2, weights, ids = _problem(t=5, k=2, e=4)   # 10 pairs > 4 experts: the grouped GEMM by default
    report.reset()
    QM.quant_experts(x, w13, w2, weights, ids)
    assert "triton w4a16 gptq grouped gemm" in report.snapshot()["quant_moe"]
    assert QM.quant_experts(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, x.shape[1])


# ---- checkpoints -----------------------------------------------------------------------------------------
def dense_copy(src, dst, deq: dict[str, torch.Tensor]):
    """``src`` with its projections replaced by their dequantized weights: what HF transformers runs."""
    shutil.copytree(src, dst)
    save_file({**load_file(src / "model.safetensors"), **deq}, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qmoe")
    # experts and shared expert of 64 (whole groups of 32 and 16), Qwen3-MoE's dense layer 0 of 96
    return {"qwen3-moe": build_tiny_model("qwen3-moe", root / "qwen3-moe", moe_intermediate_size=64),
            "qwen2-moe": build_tiny_model("qwen2-moe", root / "qwen2-moe", moe_intermediate_size=64,
                                          shared_expert_intermediate_size=64),
            "mixtral": build_tiny_model("mixtral", root / "mixtral")}


CHECKPOINTS = [  # (arch, fmt, bits, group, sym, act_order)
    ("qwen3-moe", "gptq", 4, 32, True, False),
    ("qwen3-moe", "awq", 4, 32, False, False),
    ("qwen3-moe", "gptq", 8, 16, False, True),
    ("qwen2-moe", "gptq", 4, 32, False, False),
    ("qwen2-moe", "awq", 4, 16, False, False),
    ("mixtral", "gptq", 4, 32, True, True),
    ("mixtral", "awq", 4, 32, False, False),
]


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("case", CHECKPOINTS, ids=["-".join(map(str, c[:4])) for c in CHECKPOINTS])
def test_checkpoint_matches_dequantized_hf(tmp_path, moe_dirs, case, kernels, monkeypatch):
    """Each checkpoint through the torch references and through the Triton kernels (CPU interpreter): prompts of 24
    tokens, 48 (token, slot) pairs, take the sorted grouped GEMM."""
    monkeypatch.setenv("NVLLM_KERNELS", kernels)
    arch, fmt, bits, group, sym, act_order = case
    src = moe_dirs[arch]
    deq = write_by_hand(src, tmp_path / "q", fmt, bits, group, sym, act_order)
    model = load_nvllm_model(tmp_path / "q")
    experts = [m for m in model.modules() if isinstance(m, QuantExperts)]
    sparse = [layer for layer in model.layers if layer.moe is not None]
    assert len(experts) == len(sparse) > 0
    assert all(m.scheme.bits == bits and m.scheme.fmt == "gptq" for m in experts)   # AWQ: repacked when loaded
    quant_linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    dense_mlps = len(model.layers) - len(sparse)
    assert len(quant_linears) == 2 * len(model.layers) + 2 * dense_mlps + (2 * len(sparse) if arch == "qwen2-moe"
                                                                          else 0)
    assert all(not isinstance(layer.moe.gate, QuantLinear) for layer in sparse)
    if act_order:
        assert all(m.expert_weights()[0].g_idx is not None for m in experts)
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    ref = hf_logits(dense_copy(src, tmp_path / "deq", deq), ids)
    torch.testing.assert_close(model_logits(model, ids), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_engine_runs_the_triton_experts(tmp_path, moe_dirs, monkeypatch):
    """The engine on a GPTQ Qwen3-MoE with the Triton kernels (interpreter): the same greedy tokens as the torch
    reference path, and ``quant_moe`` in the kernel report for both the prompt (sorted) and the decode (GEMV, K split
    in two: groups of 32 inputs)."""
    # attention in full precision: its quantized GEMVs under the interpreter take most of a minute (test_quant_loading
    # covers them)
    write_by_hand(moe_dirs["qwen3-moe"], tmp_path / "q", "gptq", 4, 32, True, skip=("self_attn",))
    prompt = [1, 45, 300, 12, 99, 7, 250, 31]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)   # the prompt's step, then one decode step
    monkeypatch.setenv("NVLLM_KERNELS", "torch")
    want = make_llm(str(tmp_path / "q"), dtype="float32").generate({"prompt_token_ids": prompt}, params,
                                                                  use_tqdm=False)[0].outputs[0].token_ids
    monkeypatch.setenv("NVLLM_KERNELS", "triton")
    report.reset()
    got = make_llm(str(tmp_path / "q"), dtype="float32", enforce_eager=True, max_num_batched_tokens=16,
                   max_num_seqs=4).generate(
        {"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
    assert set(report.snapshot()["quant_moe"]) == {"triton w4a16 gptq grouped gemm", "triton w4a16 gptq gemv (split k)"}


# ---- what is refused -------------------------------------------------------------------------------------
def _edit(path, fn):
    tensors = load_file(path / "model.safetensors")
    fn(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_bad_quantized_expert_checkpoints(tmp_path, moe_dirs):
    src = moe_dirs["qwen3-moe"]
    write_by_hand(src, tmp_path / "q", "gptq", 4, 32, True)

    def case(name, edit, match):
        dst = tmp_path / name
        shutil.copytree(tmp_path / "q", dst)
        _edit(dst, edit)
        with pytest.raises(ConfigError, match=match):
            load_nvllm_model(dst)

    def dense_expert(t):   # expert 3's down projection left unquantized
        stem = "model.layers.1.mlp.experts.3.down_proj"
        for leaf in ("qweight", "qzeros", "scales", "g_idx"):
            del t[f"{stem}.{leaf}"]
        t[f"{stem}.weight"] = torch.zeros(64, 64)

    case("partial", dense_expert, "quantizes only some of model.layers.1.mlp.experts.0.gate_proj, .*: nvllm stacks a "
                                  "layer's experts, which are quantized as a whole")

    def quantized_router(t):
        w = t.pop("model.layers.1.mlp.gate.weight")
        t.update({f"model.layers.1.mlp.gate.{k}": v for k, v in F.quantize_to_gptq(w, 4, 32).tensors().items()})

    case("router", quantized_router, "stores the router model.layers.1.mlp.gate quantized")

    def up_g_idx(t):
        g = t["model.layers.1.mlp.experts.2.up_proj.g_idx"]
        t["model.layers.1.mlp.experts.2.up_proj.g_idx"] = g.flip(0).contiguous()

    case("g_idx", up_g_idx, "differs from the g_idx of the same expert's other projection")

    def extra_expert(t):
        stem = "model.layers.1.mlp.experts.{}.gate_proj"
        for leaf in ("qweight", "qzeros", "scales", "g_idx"):
            t[f"{stem.format(8)}.{leaf}"] = t[f"{stem.format(0)}.{leaf}"].clone()

    case("extra", extra_expert, "the config has 8 experts")

    def bias(t):
        t["model.layers.1.mlp.experts.0.up_proj.bias"] = torch.ones(64)

    case("bias", bias, "unexpected tensor 'model.layers.1.mlp.experts.0.up_proj.bias'")


def test_fp8_mixtures_of_experts_stay_refused(tmp_path, moe_dirs):
    src = moe_dirs["qwen3-moe"]
    dst = tmp_path / "fp8"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [32, 32]}
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="not in FP8 \\(an FP8 checkpoint was given\\)"):
        make_llm(str(dst))
    with pytest.raises(ConfigError, match="not in FP8 \\(--quantization fp8 was given\\)"):
        make_llm(str(src), quantization="fp8")


def test_dummy_weights_build_quantized_experts(tmp_path, moe_dirs):
    """``load_format=dummy`` with a GPTQ config (benchmarks of the published checkpoints' shapes): the experts are
    built quantized and the engine generates."""
    dst = tmp_path / "cfg"
    dst.mkdir()
    cfg = json.loads((moe_dirs["qwen2-moe"] / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False,
                                  "sym": True}
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in TOKENIZER_FILES:
        shutil.copy(moe_dirs["qwen2-moe"] / f, dst / f)
    llm = make_llm(str(dst), load_format="dummy")
    model = llm.engine.runner.model
    assert sum(isinstance(m, QuantExperts) for m in model.modules()) == 2
    assert isinstance(model.layers[0].moe.shared_expert.down_proj, QuantLinear)
    out = llm.generate({"prompt_token_ids": [1, 5, 9]}, SamplingParams(max_tokens=3, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3


def test_compressed_tensors_experts(tmp_path, moe_dirs):
    """An llm-compressor (compressed-tensors pack-quantized, W4A16 with zero points) Qwen3-MoE, written by hand from
    the format's definition — its experts and attention packed, routers and LM head in its ``ignore`` list — serves
    what HF transformers computes with the dequantized weights."""
    from nvllm.quant.compressed_tensors import pack_compressed_tensors, quantization_config
    from tests.quant_utils import PROJ

    src, dst = moe_dirs["qwen3-moe"], tmp_path / "ct"
    shutil.copytree(src, dst)
    tensors, deq = {}, {}
    for name, w in load_file(src / "model.safetensors").items():
        if not PROJ.match(name):
            tensors[name] = w
            continue
        gq = F.quantize_rtn(w, 4, 32, sym=False)
        stem = name.removesuffix(".weight")
        tensors.update({f"{stem}.{k}": v for k, v in pack_compressed_tensors(gq.q, gq.zeros, gq.scales, 4,
                                                                              False).items()})
        deq[name] = gq.dequantize()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(4, 32, False, None, ["lm_head", "re:.*mlp.gate$"])
    (dst / "config.json").write_text(json.dumps(cfg))
    model = load_nvllm_model(dst)
    assert isinstance(model.layers[1].moe.experts, QuantExperts)
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(1))
    ref = hf_logits(dense_copy(src, tmp_path / "deq", deq), ids)
    torch.testing.assert_close(model_logits(model, ids), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
