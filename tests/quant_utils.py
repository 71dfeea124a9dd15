"""Helpers of the quantization tests: hand-written AWQ / GPTQ / FP8 checkpoints (built from the format functions,
not from nvllm's quantizer), a HF transformers reference holding the dequantized weights, perplexity through
the engine's prompt_logprobs, and per-layer output errors of a served checkpoint."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from nvllm.quant import formats as F
from nvllm.quant import quant_config as QC
from tests.conftest import REPO, TOKENIZER_FILES, make_llm

# a decoder projection: attention's and a dense MLP's, and a mixture of experts' (Qwen's experts and shared expert,
# Mixtral's w1/w3/w2); group 1 is the layer
PROJ = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp|block_sparse_moe)\.(?:experts\.\d+\.|shared_expert\.)?"
                  r"(q|k|v|o|gate|up|down)_proj\.weight$|model\.layers\.(\d+)\.block_sparse_moe\.experts\.\d+\.w[123]"
                  r"\.weight$")
HELD_OUT = REPO / "tests" / "data" / "wikitext-2-test-head.raw"


def write_by_hand(src: Path, dst: Path, fmt: str, bits: int = 4, group: int = 32, sym: bool = True,
                  act_order: bool = False, skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Quantize every projection of ``src`` with RTN into ``dst`` as AutoAWQ / AutoGPTQ lay it out (one set
    of packed tensors per HF projection); projections whose name contains one of ``skip`` stay dense and are
    listed in ``modules_to_not_convert``. Returns ``{weight name: dequantized weight}``."""
    dst.mkdir(parents=True)
    state = load_file(src / "model.safetensors")
    out, deq = {}, {}
    for name, t in state.items():
        m = PROJ.match(name)
        if not m or any(s in name for s in skip):
            out[name] = t
            continue
        base = name[: -len(".weight")]
        if fmt == "awq":
            qw = F.quantize_to_awq(t, group)
        else:
            g_idx = None
            if act_order:   # the same input order for all projections reading the same input (an expert's own)
                expert = re.search(r"experts\.(\d+)\.", name)
                seed = int(m.group(1) or m.group(4)) * 10 + t.shape[1] + (1000 * (int(expert.group(1)) + 1)
                                                                          if expert else 0)
                seed += 500 if "down_proj" in name or ".w2." in name else 0   # down reads another input
                gen = torch.Generator().manual_seed(seed)
                g_idx = F.act_order_g_idx(torch.randperm(t.shape[1], generator=gen), group)
            qw = F.quantize_to_gptq(t, bits, group, sym=sym, g_idx=g_idx)
        out.update({f"{base}.{k}": v for k, v in qw.tensors().items()})
        deq[name] = qw.dequantize()
    save_file(out, dst / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    if fmt == "awq":
        cfg["quantization_config"] = QC.awq_quantization_config(group, modules_to_not_convert=list(skip) or None)
    else:
        cfg["quantization_config"] = QC.gptq_quantization_config(bits, group, desc_act=act_order, sym=sym)
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in TOKENIZER_FILES:
        shutil.copy(src / f, dst / f)
    return deq


def write_fp8(src: Path, dst: Path, quantization_config: dict, quantize) -> Path:
    """``src`` with every projection written as FP8 by ``quantize(name, w) -> {leaf: tensor}`` (``weight`` and
    its scale, …) and ``quantization_config`` in config.json."""
    shutil.copytree(src, dst)
    tensors = {}
    for name, w in load_file(src / "model.safetensors").items():
        if PROJ.match(name):
            stem = name.removesuffix(".weight")
            tensors.update({f"{stem}.{leaf}": t for leaf, t in quantize(name, w).items()})
        else:
            tensors[name] = w
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def fp8_blocks(block: tuple[int, int]):
    """``write_fp8``'s ``quantize`` for DeepSeek-V3 / Qwen3-FP8 block scales (``weight_scale_inv``)."""
    from nvllm.quant.fp8 import quantize_blocks

    return lambda name, w: dict(zip(("weight", "weight_scale_inv"), quantize_blocks(w, block)))


IDS = [1, 5, 9, 33, 100, 7, 42, 250, 3]


def hf_logprobs(path: Path) -> torch.Tensor:
    """HF transformers' log-probabilities of ``IDS`` for the checkpoint at ``path`` (fp32), as it loads it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([IDS])).logits[0].float(), dim=-1)


def engine_errors(path: Path, want: torch.Tensor, **kw) -> tuple[float, object]:
    """Largest |Δ logprob| of the engine's top-20 prompt logprobs against ``want``, and the engine."""
    from nvllm import SamplingParams

    llm = make_llm(str(path), enable_prefix_caching=False, dtype="float32", **kw)
    out = llm.generate({"prompt_token_ids": IDS}, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=20),
                       use_tqdm=False)[0]
    errors = [abs(lp.logprob - float(want[pos - 1, tok])) for pos in range(1, len(IDS))
              for tok, lp in out.prompt_logprobs[pos].items()]
    assert out.outputs[0].token_ids == [int(want[-1].argmax())]
    return max(errors), llm


def save_compressed(model, out: Path, src: Path, fmt: str) -> None:
    """Compress ``model`` (compressed-tensors quantization applied, scales set) with the library's own compressor
    in ``fmt``, save it as llm-compressor does (with ``src``'s tokenizer files), then decompress it in place: the
    library's own reading of the checkpoint, the tests' reference."""
    from compressed_tensors.compressors import ModelCompressor

    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(out)
    for f in TOKENIZER_FILES:
        shutil.copy(src / f, out / f)
    compressor.decompress_model(model)


def hf_model(src: Path, replace: dict[str, torch.Tensor] | None = None):
    """HF transformers' float32 model of ``src``, with some weights replaced (e.g. dequantized)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        params = dict(model.named_parameters())
        for name, w in (replace or {}).items():
            params[name].copy_(w)
    return model


def hf_logits(src: Path, ids: torch.Tensor, replace: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """HF transformers' float32 logits for ``ids [B, S]``, with some weights replaced (e.g. dequantized)."""
    with torch.no_grad():
        return hf_model(src, replace)(ids).logits


def hf_greedy(src: Path, prompt: list[int], n: int, replace: dict[str, torch.Tensor] | None = None) -> list[int]:
    """HF transformers' ``n`` greedy tokens after ``prompt`` (float32, weights replaced as in ``hf_model``)."""
    with torch.no_grad():
        out = hf_model(src, replace).generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def load_nvllm_model(path: Path):
    from nvllm.config import EngineConfig
    from nvllm.models.loader import load_hf_config, load_model

    return load_model(EngineConfig(model=str(path), device="cpu"), load_hf_config(str(path)), torch.float32,
                      torch.device("cpu"))


def held_out_windows(tokenizer, n: int = 8, width: int = 255) -> list[list[int]]:
    """``n`` windows of BOS + ``width`` tokens of the held-out WikiText-2 slice."""
    ids = tokenizer(HELD_OUT.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    assert len(ids) >= n * width
    return [[tokenizer.bos_token_id] + ids[i * width:(i + 1) * width] for i in range(n)]


def perplexity(model_dir: str | Path | None, **engine) -> float:
    """Perplexity of the held-out slice through the engine (``prompt_logprobs``), so a quantized checkpoint is
    scored as it is served; ``engine``: more engine arguments (``quantization="fp8"``)."""
    from nvllm import LLM, SamplingParams

    llm = LLM(None if model_dir is None else str(model_dir), device="cpu", log_stats_interval=0, **engine)
    prompts = held_out_windows(llm.get_tokenizer())
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0), use_tqdm=False)
    nll, n = 0.0, 0
    for p, o in zip(prompts, outs):
        for tok, lp in zip(p[1:], o.prompt_logprobs[1:]):
            nll -= lp[tok].logprob
            n += 1
    return math.exp(nll / n)


@torch.no_grad()
def layer_errors(fp_dir: Path, q_dirs: dict[str, Path], ids: torch.Tensor) -> dict[str, list[float]]:
    """Per checkpoint and decoder layer: ``‖y_q − y‖² / ‖y‖²`` where both layers get the full-precision
    model's input of that layer on ``ids`` (held-out tokens); the quantized layer is the one the loader builds
    from the checkpoint."""
    from nvllm.quant.replay import layer_forward

    fp = load_nvllm_model(fp_dir)
    positions = torch.arange(ids.shape[1])
    x = fp.embed_tokens(ids)
    inputs, outputs = [], []
    for layer in fp.layers:
        inputs.append(x)
        x = layer_forward(layer, x, positions)
        outputs.append(x)
    errs = {}
    for name, q_dir in q_dirs.items():
        q = load_nvllm_model(q_dir)
        errs[name] = [float((layer_forward(lq, xi, positions) - y).pow(2).sum() / y.pow(2).sum())
                      for lq, xi, y in zip(q.layers, inputs, outputs)]
    return errs
