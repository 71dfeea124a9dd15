"""FP8-weight checkpoints and ``--quantization fp8`` (nvllm.quant.fp8, served W8A16 through ``fp8_gemm``).

References no one here wrote: transformers' own fine-grained FP8 loader (``quant_method: fp8``, which dequantizes
on a machine without a GPU) and the compressed-tensors library (it quantizes, writes and decompresses its FP8
checkpoints); for vLLM's per-tensor layout and the online quantization, an HF model holding the weights the
format's formula ``w = q · scale`` gives. Every prompt logprob must agree. The kernel itself runs under Triton's
interpreter against its torch reference."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nvllm import SamplingParams
from nvllm.config import ConfigError
from nvllm.kernels import report
from nvllm.quant.fp8 import FP8_DTYPE, FP8_MAX, Fp8Scheme, dequantize_rows, quantize_blocks, quantize_rows, scale_rows
from tests.conftest import build_tiny_model, interpreted_kernels, make_llm
from tests.quant_utils import IDS, PROJ, engine_errors, fp8_blocks, hf_logprobs, save_compressed, write_fp8

def dense_copy(fp8_dir: Path, out: Path, block: tuple[int, int] | None = None) -> Path:
    """The FP8 checkpoint's weights by the format's formula as a plain HF checkpoint, the reference for layouts
    transformers does not read: ``weight · scale`` (per tensor), or with ``block`` element (i, j) times scale
    (i // bn, j // bk)."""
    shutil.copytree(fp8_dir, out)
    tensors = load_file(fp8_dir / "model.safetensors")
    dense = {}
    for name, t in tensors.items():
        if name.endswith((".weight_scale", ".weight_scale_inv", ".input_scale")):
            continue
        if t.dtype == FP8_DTYPE:
            stem = name.removesuffix(".weight")
            scale = tensors.get(f"{stem}.weight_scale", tensors.get(f"{stem}.weight_scale_inv"))
            if block is None:
                t = t.float() * scale.float().reshape(-1)[0]
            else:
                rows, cols = torch.arange(t.shape[0]) // block[0], torch.arange(t.shape[1]) // block[1]
                t = t.float() * scale.float()[rows][:, cols]
        dense[name] = t
    save_file(dense, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    del cfg["quantization_config"]
    (out / "config.json").write_text(json.dumps(cfg))
    return out


# ------------------------------------------------------------------------------------------------ formats


def test_quantize_rows_and_blocks_round_trip_within_e4m3_precision():
    torch.manual_seed(0)
    w = torch.randn(48, 200) * 0.05
    for q, s, bk in (quantize_rows(w) + (200,), quantize_rows(w, 64) + (64,)):
        assert q.dtype == FP8_DTYPE and s.shape == (48, -(-200 // bk))
        back = dequantize_rows(q, s, bk)
        # e4m3 keeps 3 mantissa bits: each element within 1/16 of itself, or of the scale where it is tiny
        assert bool(((back - w).abs() <= w.abs() / 16 + s.repeat_interleave(bk, 1)[:, :200] / 8).all())
        assert float(q.float().abs().max()) == FP8_MAX          # each block's largest element uses the top code
    q, s = quantize_blocks(w, (32, 64))
    assert s.shape == (2, 4)
    rows = scale_rows(s, Fp8Scheme("block", (32, 64)), 48, 200, "s")
    assert rows.shape == (48, 4) and torch.equal(rows[31], s[0]) and torch.equal(rows[32], s[1])
    back = dequantize_rows(q, rows, 64)
    assert bool(((back - w).abs() <= w.abs() / 16 + rows.repeat_interleave(64, 1)[:, :200] / 8).all())


def test_scale_rows_refuses_shapes_that_do_not_fit():
    with pytest.raises(ValueError, match="one per-tensor scale"):
        scale_rows(torch.ones(2), Fp8Scheme("tensor"), 8, 32, "x.weight_scale")
    with pytest.raises(ValueError, match=r"expected \[8, 1\]"):
        scale_rows(torch.ones(8, 2), Fp8Scheme("channel"), 8, 32, "x.weight_scale")
    with pytest.raises(ValueError, match=r"expected \[1, 2\]"):
        scale_rows(torch.ones(2, 2), Fp8Scheme("block", (16, 16)), 8, 32, "x.weight_scale_inv")


# ------------------------------------------------------------------------------------------------- kernel


@pytest.fixture()
def interpreted_kernel(monkeypatch):
    return interpreted_kernels(monkeypatch, "fp8_gemm", "_fp8_gemm_kernel")


@pytest.mark.parametrize("m, n, k, block_k, dtype, bias", [
    (1, 64, 256, 128, torch.bfloat16, False),   # block scales, split-K
    (3, 96, 200, None, torch.float16, True),     # per-row scale, K not a multiple of the tile
    (17, 80, 256, 64, torch.float32, True),
    (70, 64, 160, 32, torch.bfloat16, False),    # wide tiles, partial last scale block
    (1, 48, 96, 16, torch.float32, False),
])
@pytest.mark.parametrize("by_bits", [False, True], ids=["native", "bits"])
def test_fp8_gemm_kernel_equals_its_reference(interpreted_kernel, monkeypatch, m, n, k, block_k, dtype, bias,
                                              by_bits):
    """Every e4m3 code is exact in x's dtype and the scales multiply fp32 sums, so the kernel differs from the fp32
    reference only by the order of its sums and the output's rounding; both ways of decoding the bytes agree."""
    G = interpreted_kernel
    monkeypatch.setattr(G, "NVLLM_FP8_DECODE_BITS", by_bits)
    gen = torch.Generator().manual_seed(m * 1000 + n)
    w = torch.randn(n, k, generator=gen) * 0.05
    q, s = quantize_rows(w, block_k)
    bk = k if block_k is None else block_k
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    y = G.fp8_gemm(x, q, s, bk, b)
    ref = G.fp8_gemm_reference(x, q, s, bk, b).float()
    assert y.dtype == dtype and y.shape == (m, n)
    assert float((y.float() - ref).abs().max()) <= TOL[dtype] * float(ref.abs().max())
    for split in (1, 3):   # unsplit and a forced split give the same sums
        assert float((G.fp8_gemm(x, q, s, bk, b, split_k=split).float() - ref).abs().max()) \
            <= TOL[dtype] * float(ref.abs().max())


TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}   # of the largest output: its rounding


def test_many_rows_dequantize_and_run_a_dense_matmul(interpreted_kernel, monkeypatch):
    G = interpreted_kernel
    q, s = quantize_rows(torch.randn(40, 96) * 0.05, 32)
    w = G.fp8_dequantize(q, s, 32, torch.bfloat16)
    assert w.dtype == torch.bfloat16   # within one bf16 rounding (the interpreter rounds toward zero)
    torch.testing.assert_close(w.float(), dequantize_rows(q, s, 32), rtol=2 ** -7, atol=0)
    monkeypatch.setattr(G, "DEQUANT_MATMUL_MIN_M", 3)
    monkeypatch.setenv("NVLLM_KERNELS", "triton")
    x, b = torch.randn(5, 96), torch.randn(40)
    report.reset()
    torch.testing.assert_close(G.fp8_linear(x, q, s, 32, b), G.fp8_gemm_reference(x, q, s, 32, b),
                               rtol=1e-5, atol=1e-5)
    assert report.snapshot()["fp8_gemm"] == {"triton fp8 dequant + torch matmul": 1}


def test_fp8_kernels_take_contiguous_rows_only(interpreted_kernel):
    G = interpreted_kernel
    q, s = quantize_rows(torch.randn(64, 64))
    with pytest.raises(ValueError, match="contiguous rows"):
        G.fp8_gemm(torch.randn(2, 64), q.t().contiguous().t(), s, 64)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        G.fp8_gemm(torch.randn(2, 64), q.view(torch.uint8), s, 64)


@pytest.mark.parametrize("m, n, k, block_k, dtype, tile", [
    (1, 40, 256, 128, torch.bfloat16, 256),    # the K step shrinks to the 128-wide scale blocks
    (3, 64, 200, None, torch.float16, 64),     # per-row scale, ragged K
    (4, 24, 96, 32, torch.float32, 32),
])
def test_fp8_gemv_kernel_equals_its_reference(interpreted_kernel, monkeypatch, m, n, k, block_k, dtype, tile):
    G = interpreted_kernel
    gen = torch.Generator().manual_seed(m * 100 + k)
    q, s = quantize_rows(torch.randn(n, k, generator=gen) * 0.05, block_k)
    bk = k if block_k is None else block_k
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype)
    ref = G.fp8_gemm_reference(x, q, s, bk, b).float()
    for split, by_bits in ((None, False), (1, True), (2, False)):
        monkeypatch.setattr(G, "NVLLM_FP8_DECODE_BITS", by_bits)
        y = G.fp8_gemv(x, q, s, bk, b, split_k=split, block_n=8, block_k_tile=tile)
        assert y.dtype == dtype and float((y.float() - ref).abs().max()) <= TOL[dtype] * float(ref.abs().max())
    with pytest.raises(ValueError, match="at most 8 rows"):
        G.fp8_gemv(torch.randn(9, k).to(dtype), q, s, bk)


def test_fp8_linear_runs_the_triton_kernel_and_names_it(interpreted_kernel, monkeypatch):
    G = interpreted_kernel
    q, s = quantize_rows(torch.randn(32, 64) * 0.05)
    x = torch.randn(2, 3, 64)
    report.reset()
    monkeypatch.setenv("NVLLM_KERNELS", "triton")
    y = G.fp8_linear(x, q, s, 64)
    monkeypatch.setenv("NVLLM_KERNELS", "torch")
    assert y.shape == (2, 3, 32)
    assert torch.allclose(y, G.fp8_linear(x, q, s, 64), atol=1e-5)
    monkeypatch.setattr(G, "GEMV_MAX_M", 2)
    monkeypatch.setenv("NVLLM_KERNELS", "triton")
    torch.testing.assert_close(G.fp8_linear(x[0, :2], q, s, 64), y[0, :2], atol=1e-5, rtol=1e-5)
    assert report.snapshot()["fp8_gemm"] == {"triton w8a16 fp8": 1, "torch dequant+matmul": 1,
                                             "triton w8a16 fp8 gemv": 1}
    with pytest.raises(ValueError, match="expects 64"):
        G.fp8_linear(torch.randn(2, 65), q, s, 64)


# ------------------------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model("qwen2", tmp_path_factory.mktemp("fp8") / "base")


def test_block_scales_load_as_transformers_reads_them(tiny, tmp_path):
    """DeepSeek-V3 / Qwen3-*-FP8 layout: ``weight_scale_inv`` per 32×32 block here."""
    path = write_fp8(tiny, tmp_path / "ckpt", {"quant_method": "fp8", "activation_scheme": "dynamic",
                                               "fmt": "e4m3", "weight_block_size": [32, 32]}, fp8_blocks((32, 32)))
    want = hf_logprobs(path)          # transformers dequantizes the blocks itself (no GPU here)
    dense = hf_logprobs(tiny)
    assert float((want - dense).abs().max()) > 1e-4   # the FP8 weights really differ from the dense ones
    report.reset()
    err, llm = engine_errors(path, want)
    assert err < 1e-4, err
    layer = llm.engine.runner.model.layers[0]
    assert type(layer.qkv_proj).__name__ == "Fp8Linear" and layer.qkv_proj.weight.dtype == FP8_DTYPE
    assert type(llm.engine.runner.model.lm_head).__name__ != "QuantLMHead"
    assert "fp8_gemm" in report.snapshot() and "quant_gemm" not in report.snapshot()


def test_partial_blocks_at_the_edges(tiny, tmp_path):
    """Blocks of 64×64 leave partial blocks (32 kv rows, 96 MLP inputs): scale (i // 64, j // 64) covers them, as
    DeepSeek-V3's reference dequantization and vLLM read them (transformers' CPU dequantization needs whole
    blocks, so the reference here is the formula)."""
    path = write_fp8(tiny, tmp_path / "ckpt", {"quant_method": "fp8", "weight_block_size": [64, 64]},
                     fp8_blocks((64, 64)))
    err, _ = engine_errors(path, hf_logprobs(dense_copy(path, tmp_path / "dense", block=(64, 64))))
    assert err < 1e-4, err


def test_per_tensor_scales_in_either_name(tiny, tmp_path):
    """transformers writes a per-tensor scale as ``weight_scale_inv``; vLLM's export as ``weight_scale`` with an
    ``input_scale`` (static activations), which nvllm keeps and does not apply (W8A16)."""
    def per_tensor(name, w):
        scale = w.abs().max() / FP8_MAX
        return {"weight": (w / scale).to(FP8_DTYPE), "scale": scale.reshape(())}

    hf = write_fp8(tiny, tmp_path / "hf", {"quant_method": "fp8", "activation_scheme": "dynamic",
                                           "weight_block_size": None},
                   lambda n, w: {("weight_scale_inv" if k == "scale" else k): v for k, v in per_tensor(n, w).items()})
    err, _ = engine_errors(hf, hf_logprobs(hf))
    assert err < 1e-4, err

    vllm = write_fp8(tiny, tmp_path / "vllm", {"quant_method": "fp8", "activation_scheme": "static"},
                     lambda n, w: {"weight": per_tensor(n, w)["weight"], "weight_scale": per_tensor(n, w)["scale"],
                                   "input_scale": torch.tensor([0.02])})
    err, llm = engine_errors(vllm, hf_logprobs(dense_copy(vllm, tmp_path / "vllm-dense")))
    assert err < 1e-4, err
    qkv = llm.engine.runner.model.layers[0].qkv_proj
    assert torch.allclose(qkv.input_scale, torch.full((3,), 0.02))
    # q, k and v each keep their own tensor scale, spread over their rows of the fused layer
    assert qkv.weight_scale[0, 0] != qkv.weight_scale[-1, 0]


def _compressed_tensors_fp8(src: Path, out: Path, weights: dict, inputs: dict | None):
    """Quantize ``src`` with compressed-tensors (its own observers and compressor), save it as llm-compressor
    does, and return the HF model with the library's decompressed weights."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    group = {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "symmetric": True, **weights}}
    if inputs is not None:
        group["input_activations"] = inputs
    apply_quantization_config(model, QuantizationConfig.model_validate(
        {"config_groups": {"group_0": group}, "ignore": ["lm_head"], "format": "float-quantized"}))
    for _, m in model.named_modules():
        if not hasattr(m, "weight_scale"):
            continue
        w, shape = m.weight.data, m.weight_scale.shape
        if weights["strategy"] == "block":
            bn, bk = weights["block_structure"]
            blocks = torch.nn.functional.pad(w, (0, -w.shape[1] % bk, 0, -w.shape[0] % bn))
            blocks = blocks.reshape(blocks.shape[0] // bn, bn, -1, bk).transpose(1, 2)
            lo, hi = blocks.amin((-1, -2)), blocks.amax((-1, -2))
        else:
            per = w.reshape(w.shape[0], -1, weights.get("group_size") or w.shape[1])
            lo, hi = (per.amin(-1), per.amax(-1)) if weights["strategy"] != "tensor" else (w.min(), w.max())
        scale, _ = calculate_qparams(lo.reshape(-1), hi.reshape(-1), m.quantization_scheme.weights)
        m.weight_scale.data.copy_(scale.reshape(shape))
        if hasattr(m, "input_scale"):
            m.input_scale.data.fill_(0.05)
    save_compressed(model, out, src, "float-quantized")
    # the decompressed weights without the library's fake quantization of the inputs: W8A16, as nvllm serves it
    from compressed_tensors.quantization import disable_quantization

    model.apply(disable_quantization)
    return model


CT_CASES = {
    "FP8_DYNAMIC (channel, tokens)": (dict(strategy="channel"),
                                      dict(num_bits=8, type="float", strategy="token", dynamic=True, symmetric=True)),
    "FP8 (tensor, static inputs)": (dict(strategy="tensor"),
                                    dict(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)),
    "FP8_BLOCK (32x32)": (dict(strategy="block", block_structure=[32, 32]), None),
    "group 32": (dict(strategy="group", group_size=32), None),
}


@pytest.mark.parametrize("case", list(CT_CASES))
def test_compressed_tensors_fp8_served_as_the_library_decompresses_it(case, tiny, tmp_path):
    ref = _compressed_tensors_fp8(tiny, tmp_path / "ckpt", *CT_CASES[case])
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "float-quantized"
    with torch.no_grad():
        want = torch.log_softmax(ref(torch.tensor([IDS])).logits[0].float(), dim=-1)
    err, llm = engine_errors(tmp_path / "ckpt", want)
    assert err < 1e-4, err
    assert type(llm.engine.runner.model.layers[1].down_proj).__name__ == "Fp8Linear"


# ------------------------------------------------------------------------------------------------- online


def test_quantization_fp8_quantizes_a_dense_checkpoint_while_it_loads(tiny, tmp_path):
    # the reference: the dense model with each linear replaced by its per-row FP8 quantization, dequantized
    ref = tmp_path / "ref"
    shutil.copytree(tiny, ref)
    tensors = load_file(tiny / "model.safetensors")
    for name, w in tensors.items():
        if PROJ.match(name):
            q, s = quantize_rows(w)
            tensors[name] = dequantize_rows(q, s, w.shape[1])
    save_file(tensors, ref / "model.safetensors", metadata={"format": "pt"})
    want = hf_logprobs(ref)
    report.reset()
    err, llm = engine_errors(tiny, want, quantization="fp8")
    assert err < 1e-4, err
    model = llm.engine.runner.model
    assert all(type(getattr(layer, n)).__name__ == "Fp8Linear" for layer in model.layers
               for n in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    assert model.layers[0].gate_up_proj.weight.dtype == FP8_DTYPE
    assert "fp8_gemm" in report.snapshot()


def test_quantization_fp8_with_dummy_weights_and_with_a_quantized_checkpoint(tiny, tmp_path):
    llm = make_llm(str(tiny), load_format="dummy", quantization="fp8")
    down = llm.engine.runner.model.layers[1].down_proj
    assert down.weight.dtype == FP8_DTYPE and down.scheme.online
    # random codes over the whole e4m3 range with scales that keep |w| ≲ 0.01 (as the dense dummy weights)
    w = dequantize_rows(down.weight, down.scale, down.block_k)
    assert 5e-3 < float(w.abs().max()) <= 1e-2 and float(down.weight.float().abs().max()) > 200
    out = llm.generate("hello", SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
    blocks = write_fp8(tiny, tmp_path / "blocks", {"quant_method": "fp8", "weight_block_size": [32, 32]},
                       fp8_blocks((32, 32)))
    llm = make_llm(str(blocks), quantization="fp8")   # the checkpoint's own method: served as stored
    assert llm.engine.runner.model.layers[0].o_proj.scheme.granularity == "block"


# ---------------------------------------------------------------------------------------------- bad input


def _with_config(tiny: Path, out: Path, qcfg: dict) -> Path:
    shutil.copytree(tiny, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = qcfg
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("qcfg, message", [
    ({"quant_method": "fp8", "weight_block_size": [128, 100]}, "multiple of 16"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "two positive integers"),
    ({"quant_method": "fp8", "activation_scheme": "per-token"}, "activation_scheme"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "e4m3"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "tensor"}}}}, "num_bits 4"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"}}}},
     "format 'pack-quantized' for float"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}},
     "input activations"),
])
def test_fp8_configs_it_cannot_serve_are_one_clear_error(qcfg, message, tiny, tmp_path):
    with pytest.raises(ConfigError, match=message):
        make_llm(str(_with_config(tiny, tmp_path / "m", qcfg)), load_format="dummy")


def test_fp8_checkpoints_with_bad_tensors_are_one_clear_error(tiny, tmp_path):
    qcfg = {"quant_method": "fp8", "weight_block_size": [32, 32]}

    blocks = fp8_blocks((32, 32))
    wrong_scale = write_fp8(tiny, tmp_path / "a", qcfg, lambda n, w: {
        **blocks(n, w), **({"weight_scale_inv": torch.ones(1, 1)} if "o_proj" in n else {})})
    with pytest.raises(ConfigError, match=r"o_proj.weight_scale_inv has shape \(1, 1\), expected \[2, 2\]"):
        make_llm(str(wrong_scale))
    bf16_weight = write_fp8(tiny, tmp_path / "b", qcfg, lambda n, w: {
        **blocks(n, w), **({"weight": w.bfloat16()} if "down_proj" in n else {})})
    with pytest.raises(ConfigError, match="down_proj.weight' must be float8_e4m3fn"):
        make_llm(str(bf16_weight))
    no_scale = write_fp8(tiny, tmp_path / "d", qcfg, lambda n, w: {
        k: v for k, v in blocks(n, w).items() if not ("down_proj" in n and k == "weight_scale_inv")})
    with pytest.raises(ConfigError, match="down_proj.weight' is float8_e4m3fn, a quantized weight, in a layer the "
                                          "checkpoint's quantization config leaves in full precision"):
        make_llm(str(no_scale))
    only_q = write_fp8(tiny, tmp_path / "c", qcfg, lambda n, w: blocks(n, w) if "q_proj" in n else {"weight": w})
    with pytest.raises(ConfigError, match="quantizes only some of"):
        make_llm(str(only_q))
    with pytest.raises(ConfigError, match="not quantized .*--quantization fp8 quantizes"):
        make_llm(str(tiny), quantization="awq")


def test_kv_cache_scales_of_an_fp8_checkpoint_are_left_out(tiny, tmp_path, caplog):
    """AutoFP8 / llm-compressor write k_scale / v_scale (or k_proj.output_scale) for an FP8 KV cache; nvllm's
    quantized KV cache computes its own scales, so they are skipped (and said so), and the weights load as without
    them."""
    path = write_fp8(tiny, tmp_path / "kv", {"quant_method": "fp8", "weight_block_size": [32, 32]},
                     fp8_blocks((32, 32)))
    tensors = load_file(path / "model.safetensors")
    plain = hf_logprobs(path)
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.1)
        tensors[f"model.layers.{i}.self_attn.v_proj.output_scale"] = torch.tensor([0.2])
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    import logging

    log = logging.getLogger("nvllm")   # its records go to its own handler, not to the root's
    log.addHandler(caplog.handler)
    try:
        err, _ = engine_errors(path, plain)
    finally:
        log.removeHandler(caplog.handler)
    assert err < 1e-4, err
    assert "4 KV-cache / attention scales" in caplog.text


def test_an_fp8_lm_head_is_refused(tiny, tmp_path):
    path = write_fp8(tiny, tmp_path / "head", {"quant_method": "fp8", "weight_block_size": [32, 32]},
                     fp8_blocks((32, 32)))
    tensors = load_file(path / "model.safetensors")
    q, s = quantize_blocks(tensors["lm_head.weight"], (32, 32))
    tensors.update({"lm_head.weight": q, "lm_head.weight_scale_inv": s})
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="lm_head in FP8"):
        make_llm(str(path))


def test_generate_cli_with_quantization_fp8(tiny):
    from typer.testing import CliRunner

    from nvllm.cli import app

    result = CliRunner().invoke(app, ["generate", "hi", "--model", str(tiny), "--quantization", "fp8",
                                      "--max-tokens", "4", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "fp8_gemm" in result.output


def test_quantization_fp8_costs_little_perplexity_on_the_demo_model():
    """WikiText-2 held-out slice through the engine: fp32 115.50, FP8 113.10 when this was written."""
    from tests.quant_utils import perplexity

    dense, fp8 = perplexity(None), perplexity(None, quantization="fp8")
    assert fp8 != dense and abs(fp8 / dense - 1) < 0.03, (dense, fp8)
