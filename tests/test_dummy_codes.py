"""Random packed weights for ``load_format=dummy`` (``nvllm.quant.dummy_codes``): codes centred on their zero
points, read back through the formats' own unpacking; a deep quantized mixture of experts on such weights routes
its tokens as widely as one on dense dummy weights."""

import json
import shutil

import pytest
import torch
import transformers

import nvllm.layers.moe as moe
from nvllm import SamplingParams
from nvllm.assets import demo_model_path
from nvllm.layers.quant_linear import QuantLinear
from nvllm.quant import formats as F
from nvllm.quant.dummy_codes import fill_dummy
from nvllm.quant.packing import unpack_cols
from nvllm.quant.plan import QuantScheme
from tests.conftest import TOKENIZER_FILES, make_llm


@pytest.mark.parametrize("fmt,bits", [("gptq", 4), ("gptq", 8), ("awq", 4)])
def test_codes_and_zero_points(fmt, bits):
    lin = QuantLinear(256, 64, False, None, QuantScheme(fmt, bits, 32))
    lin.init_dummy(torch.Generator().manual_seed(0))
    if fmt == "awq":
        q, zeros = F.unpack_awq(lin.qweight, lin.qzeros)
        w = F.dequantize_awq(lin.qweight, lin.qzeros, lin.scales, 32)
    else:
        q, zeros = F.unpack_gptq(lin.qweight, lin.qzeros, bits)
        w = F.dequantize_gptq(lin.qweight, lin.qzeros, lin.scales, lin.g_idx, bits)
    assert int(q.min()) == 1 and int(q.max()) == 2**bits - 1
    assert (zeros == 2 ** (bits - 1)).all()
    # every group's codes centred: the mean of q − z over a group's 32 inputs is within a few of its spread / √32
    centred = (q.float() - 2 ** (bits - 1)).reshape(64, 8, 32).mean(dim=-1)
    spread = (2 ** (bits - 1) - 1) / 3 ** 0.5
    assert centred.abs().max() < 5 * spread / 32 ** 0.5
    assert 0.008 < w.abs().max() <= 7 * 1.5e-3 + 1e-6     # the dense dummy weights' size at 4 and 8 bits


def test_experts_leading_dimension_and_chunks(monkeypatch):
    """Tensors with an experts dimension, drawn in chunks smaller than one tensor: every word is drawn."""
    import nvllm.quant.dummy_codes as dc

    monkeypatch.setattr(dc, "_CHUNK_WORDS", 7)
    qweight = torch.zeros(3, 4, 10, dtype=torch.int32)
    qzeros = torch.zeros(3, 2, 5, dtype=torch.int32)
    scales = torch.zeros(3, 2, 10, dtype=torch.float16)
    fill_dummy(qweight, qzeros, scales, 4, "gptq", torch.Generator().manual_seed(1))
    fields = unpack_cols(qweight.reshape(-1, 1), 4)
    assert (fields >= 1).all() and (fields <= 15).all()
    assert (unpack_cols(qzeros.reshape(-1, 1), 4) == 7).all()               # GPTQ v1 stores z − 1
    assert ((scales >= 5e-4) & (scales <= 1.5e-3)).all()


def _moe_dir(root, quant):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=64,
        norm_topk_prob=True, max_position_embeddings=256, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    config = cfg.to_dict()
    if quant:
        config["quantization_config"] = quant
    root.mkdir()
    (root / "config.json").write_text(json.dumps(config))
    for f in TOKENIZER_FILES:
        shutil.copy(demo_model_path() + "/" + f, root / f)
    return root


def test_deep_quantized_experts_route_widely(tmp_path, monkeypatch):
    """8 layers of 4-bit GPTQ dummy weights: the last router gives 24 tokens nearly as many distinct expert sets as
    dense dummy weights do (codes drawn over the whole range with random zero points gave 7 of 24)."""
    seen = []

    def recording_route(*args, **kwargs):
        weights, ids = route(*args, **kwargs)
        seen.append(ids.clone())
        return weights, ids

    route = moe.route
    monkeypatch.setattr(moe, "route", recording_route)
    prompts = [{"prompt_token_ids": [t, t + 50, t + 3]} for t in range(10, 90, 10)]
    distinct = {}
    quant = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
    for name, q in (("dense", None), ("quantized", quant)):
        llm = make_llm(str(_moe_dir(tmp_path / name, q)), load_format="dummy", enforce_eager=True)
        seen.clear()
        llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
        distinct[name] = len({tuple(sorted(row.tolist())) for row in seen[-1]})
    assert distinct["dense"] >= 20, distinct
    assert distinct["quantized"] >= 18, distinct
