"""``nvllm quantize --quantize-lm-head`` (GPTQ / RTN, GPTQModel's ``lm_head=True``): the checkpoint it writes
(``"lm_head": true``, ``lm_head.qweight/qzeros/scales/g_idx`` in the GPTQ layout), the engine serving it (the
head through ``quant_gemm``, logits equal to a dequantize-then-matmul reference unpacked here by hand), the
errors (AWQ, tied embeddings, a vocabulary that does not pack or split), tensor parallelism (the head split
by vocabulary over two ranks) and its accuracy cost.

Accuracy cost (perplexity through the engine on the held-out WikiText-2 slice, ``tests/quant_utils``), on an
untied copy of the demo model (stories260K with ``lm_head.weight`` = its embedding, ``tie_word_embeddings:
false``: the same function, perplexity 115.50), W4 g32 sym, calibration 16 × 256 tokens of the shipped C4
sample, seed 0. Only attention is quantized in the decoder (the MLP's 172 does not pack at g32). Measured:
  GPTQ 119.14 without the head, 119.33 with it; RTN 132.73 without, 144.12 with (2026-12-07).
Bounds asserted: GPTQ with the head within 3% of GPTQ without and within 5% of fp32; RTN with the head within
15% of RTN without; the head's cost under GPTQ below its cost under RTN.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from nvllm.assets import demo_model_path
from nvllm.cli import app
from nvllm.config import ConfigError, EngineConfig
from nvllm.kernels import report
from nvllm.layers.embed_head import QuantLMHead
from nvllm.models.loader import load_hf_config, load_model, quantization_plan
from nvllm.quant.quantize import QuantizeError, quantize_model
from nvllm.quant.recipe import RecipeError, build_config
from nvllm.quant.replay import model_logits
from tests.conftest import build_tiny_model, make_llm
from tests.quant_utils import hf_logits, load_nvllm_model, perplexity

FAST = dict(calib_dataset="calib", calib_samples=4, calib_seqlen=64)
CLI_FAST = ["--calib-dataset", "calib", "--calib-samples", "4", "--calib-seqlen", "64", "--no-progress"]
HIDDEN, VOCAB = 64, 512


def cli(*args: str):
    result = CliRunner().invoke(app, ["quantize", *args], env={"COLUMNS": "200"})
    return result.exit_code, " ".join(result.output.split())


@pytest.fixture(scope="module")
def untied(tmp_path_factory) -> Path:
    # Llama, tie_word_embeddings false; intermediate 96 so every decoder linear packs at g32 too
    return build_tiny_model("llama", tmp_path_factory.mktemp("lmh") / "llama")


@pytest.fixture(scope="module")
def quantized(untied, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lmh_q")
    out = {}
    for method in ("rtn", "gptq"):
        cfg = build_config(None, method=method, group_size=32, quantize_lm_head=True, **FAST)
        quantize_model(str(untied), str(root / method), cfg)
        out[method] = root / method
    return out


def unpack_gptq_by_hand(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                        bits: int = 4) -> torch.Tensor:
    """GPTQ v1 → float ``W [out, in]``, written out from the format's definition: input k of column n is field
    k mod (32/bits) of ``qweight[k // (32/bits), n]``; the zero of group g, column n is field n mod (32/bits) of
    ``qzeros[g, n // (32/bits)]`` plus one (v1 stores zero − 1); ``W[n, k] = scales[g_idx[k], n] · (q − z)``."""
    per = 32 // bits
    mask = (1 << bits) - 1
    k_in, n_out = qweight.shape[0] * per, qweight.shape[1]
    q = torch.empty(k_in, n_out, dtype=torch.int64)
    for k in range(k_in):
        q[k] = (qweight[k // per].to(torch.int64) >> (bits * (k % per))) & mask
    z = torch.empty(qzeros.shape[0], n_out, dtype=torch.int64)
    for n in range(n_out):
        z[:, n] = ((qzeros[:, n // per].to(torch.int64) >> (bits * (n % per))) & mask) + 1
    g = g_idx.long()
    w = scales.float()[g] * (q - z[g]).float()          # [in, out]
    return w.t().contiguous()


def dequantized_weights(ckpt: Path) -> dict[str, torch.Tensor]:
    state = load_file(ckpt / "model.safetensors")
    return {base + ".weight": unpack_gptq_by_hand(state[base + ".qweight"], state[base + ".qzeros"],
                                                  state[base + ".scales"], state[base + ".g_idx"])
            for base in (k[: -len(".qweight")] for k in state if k.endswith(".qweight"))}


def test_checkpoint_layout(quantized):
    for method, ckpt in quantized.items():
        qc = json.loads((ckpt / "config.json").read_text())["quantization_config"]
        assert qc["lm_head"] is True and qc["quant_method"] == "gptq" and qc["checkpoint_format"] == "gptq"
        assert json.loads((ckpt / "quantize_config.json").read_text())["lm_head"] is True
        with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
            assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
            shapes = {k: (tuple(f.get_tensor(k).shape), f.get_tensor(k).dtype)
                      for k in keys if k.startswith("lm_head.")}
        assert shapes == {"lm_head.qweight": ((HIDDEN // 8, VOCAB), torch.int32),
                          "lm_head.qzeros": ((HIDDEN // 32, VOCAB // 8), torch.int32),
                          "lm_head.scales": ((HIDDEN // 32, VOCAB), torch.float16),
                          "lm_head.g_idx": ((HIDDEN,), torch.int32)}, method


def test_a_kept_layer_and_the_head_listed_as_vllm_reads_them(untied, tmp_path):
    """g64 keeps down_proj (its 96 inputs do not split) in full precision: modules_in_block_to_quantize then lists
    the quantized modules, and vLLM quantizes only what that list names (a substring test on each module's name),
    so the quantized head must be in it too or vLLM builds a full-precision head and finds no lm_head.weight."""
    cfg = build_config(None, method="rtn", group_size=64, quantize_lm_head=True)
    quantize_model(str(untied), str(tmp_path / "q"), cfg)
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    listed = [name for group in qc["modules_in_block_to_quantize"] for name in group]
    assert qc["lm_head"] is True and "lm_head" in listed and not any("down_proj" in n for n in listed)
    assert any("down_proj" in pattern for pattern in qc["dynamic"])
    assert isinstance(load_nvllm_model(tmp_path / "q").lm_head, QuantLMHead)


def test_logits_equal_dequantized_reference(untied, quantized):
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    fp_ref = hf_logits(untied, ids)
    for method, ckpt in quantized.items():
        deq = dequantized_weights(ckpt)
        assert "lm_head.weight" in deq and len(deq) == 1 + 7 * 2
        model = load_nvllm_model(ckpt)
        assert isinstance(model.lm_head, QuantLMHead)
        ours = model_logits(model, ids)
        ref = hf_logits(untied, ids, deq)
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
        # the head really is the quantized one: with the full-precision head the logits differ
        fp_head = {k: v for k, v in deq.items() if k != "lm_head.weight"}
        assert (hf_logits(untied, ids, fp_head) - ref).abs().max() > 1e-3 * ref.abs().max()
        rel = float((ours - fp_ref).norm() / fp_ref.norm())
        print(f"{method}: relative logit error vs the full-precision model {rel:.3f}")
        assert rel < 0.5                                                      # still near the fp model


def test_plan_and_dummy_weights(quantized):
    ckpt = str(quantized["gptq"])
    hf = load_hf_config(ckpt)
    plan = quantization_plan(EngineConfig(model=ckpt, device="cpu"), hf, "LlamaForCausalLM", log=False)
    assert plan["lm_head"].fmt == "gptq" and len(plan) == 4 * 2 + 1
    # dummy weights: the config alone (lm_head: true) decides
    model = load_model(EngineConfig(model=ckpt, device="cpu", load_format="dummy"), hf, torch.float32,
                       torch.device("cpu"))
    assert isinstance(model.lm_head, QuantLMHead)
    assert torch.isfinite(model.compute_logits(torch.randn(3, HIDDEN))).all()


def test_engine_generates_through_quant_gemm(untied, quantized):
    import transformers

    ckpt = quantized["gptq"]
    llm = make_llm(str(ckpt))
    prompt, steps = [1, 17, 42, 99, 7], 6
    report.reset()
    got = llm.generate([prompt], _greedy(steps), use_tqdm=False)[0].outputs[0].token_ids
    calls = sum(report.snapshot()["quant_gemm"].values())
    assert calls == steps * (4 * 2 + 1), report.snapshot()      # every step: 8 decoder linears + the head
    hf = transformers.AutoModelForCausalLM.from_pretrained(untied, dtype=torch.float32)
    with torch.no_grad():
        params = dict(hf.named_parameters())
        for name, w in dequantized_weights(ckpt).items():
            params[name].copy_(w)
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False)[0, len(prompt):]
    assert list(got) == want.tolist()


def _greedy(n: int):
    from nvllm import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


def test_tensor_parallel_splits_the_head(tmp_path):
    """Two ranks (gloo): each holds half the vocabulary's packed columns; greedy and seeded sampled outputs
    equal one rank's."""
    from nvllm import SamplingParams
    from tests.test_tensor_parallel import assert_workers_gone

    model = build_tiny_model("llama", tmp_path / "llama", intermediate_size=128)   # two groups of 32 a rank
    cfg = build_config(None, method="gptq", group_size=32, quantize_lm_head=True, **FAST)
    quantize_model(str(model), str(tmp_path / "gptq"), cfg)
    ckpt = str(tmp_path / "gptq")
    prompts = [[1, 17, 42, 99, 7], [5, 6, 7]]
    params = [_greedy(8), SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=8, ignore_eos=True)]
    one = make_llm(ckpt).generate(prompts, params, use_tqdm=False)
    with make_llm(ckpt, tensor_parallel_size=2) as llm:
        head = llm.engine.runner.model.lm_head
        assert isinstance(head, QuantLMHead) and head.qweight.shape[1] == VOCAB // 2
        two = llm.generate(prompts, params, use_tqdm=False)
    assert_workers_gone(llm)
    assert [o.outputs[0].token_ids for o in one] == [o.outputs[0].token_ids for o in two]


def test_tensor_parallel_vocab_that_does_not_split():
    from nvllm.distributed.group import TPGroup
    from nvllm.quant.plan import QuantScheme

    scheme = QuantScheme("gptq", 4, 32)
    QuantLMHead(528, HIDDEN, scheme, tp=TPGroup(1, 2))        # 264 columns a rank: whole 8-column words
    with pytest.raises(ConfigError, match="vocabulary of 520 cannot be split over tensor_parallel_size 2 in "
                                          "whole 8-column packed words"):
        QuantLMHead(520, HIDDEN, scheme, tp=TPGroup(0, 2))


def test_cli_flag_recipe_and_report(tmp_path, untied):
    code, out = cli("--model", str(untied), "--method", "gptq", "--group-size", "32", "--quantize-lm-head",
                    "--out", str(tmp_path / "q"), *CLI_FAST)
    assert code == 0, out
    assert "embeddings in full precision, lm_head quantized" in out
    assert "lm_head quantized (gptq 4-bit, group size 32): 128.00 KiB → 18.75 KiB, relative error" in out
    assert json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]["lm_head"] is True
    # without the flag: no lm_head key, the head stays dense
    code, out = cli("--model", str(untied), "--method", "rtn", "--group-size", "32", "--out", str(tmp_path / "n"),
                    *CLI_FAST)
    assert code == 0 and "embeddings and lm_head in full precision" in out
    assert "lm_head" not in json.loads((tmp_path / "n" / "config.json").read_text())["quantization_config"]
    with safe_open(str(tmp_path / "n" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" in f.keys() and "lm_head.qweight" not in f.keys()
    # the recipe key, validated like the others
    r = tmp_path / "r.yaml"
    r.write_text("method: rtn\nquantize_lm_head: true\n")
    assert build_config(str(r)).quantize_lm_head is True
    r.write_text("method: rtn\nquantize_lm_head: yes please\n")
    with pytest.raises(RecipeError, match="quantize_lm_head must be true or false"):
        build_config(str(r))


@pytest.mark.parametrize("which, args, message", [
    ("untied", ["--method", "awq"], "--quantize-lm-head applies to GPTQ and RTN only: AutoAWQ checkpoints keep "
                                    "the lm_head in full precision"),
    ("demo", ["--method", "gptq"], "--quantize-lm-head: the model ties its word embeddings "
                                   "(tie_word_embeddings: true): the lm_head is the embedding matrix"),
    ("vocab508", ["--method", "rtn"], "--quantize-lm-head: vocabulary size 508 is not a multiple of 8 "
                                      "(gptq 4-bit packing)"),
])
def test_errors(tmp_path, untied, which, args, message):
    model = {"untied": str(untied), "demo": demo_model_path()}.get(which)
    if which == "vocab508":
        model = str(build_tiny_model("llama", tmp_path / "v508", vocab_size=508))
    code, out = cli("--model", model, *args, "--group-size", "32", "--quantize-lm-head", "--out",
                    str(tmp_path / "out"), *CLI_FAST)
    assert code == 2, out
    assert message in out and "Traceback" not in out
    assert not (tmp_path / "out").exists()


def test_tied_model_error_from_the_api():
    cfg = build_config(None, method="rtn", group_size=32, quantize_lm_head=True, **FAST)
    with pytest.raises(QuantizeError, match="tie_word_embeddings"):
        quantize_model(demo_model_path(), "/nonexistent-out-dir/q", cfg)


def untie(src: Path, dst: Path) -> Path:
    """A copy of ``src`` (tied) with its head stored as its own tensor: the same function, untied."""
    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_accuracy_cost_of_the_quantized_head(tmp_path):
    src = untie(Path(demo_model_path()), tmp_path / "demo-untied")
    ppl = {"fp32": perplexity(src)}
    for method in ("gptq", "rtn"):
        for head in (False, True):
            cfg = build_config(None, method=method, group_size=32, quantize_lm_head=head, calib_dataset="calib",
                               calib_samples=16, calib_seqlen=256)
            out = tmp_path / f"{method}-{head}"
            quantize_model(str(src), str(out), cfg)
            ppl[f"{method}{' + lm_head' if head else ''}"] = perplexity(out)
    print("perplexity (W4 g32, untied stories260K):", {k: round(v, 2) for k, v in ppl.items()})
    assert abs(ppl["fp32"] - 115.5) < 0.1          # the untied copy is the demo model
    assert ppl["gptq + lm_head"] <= 1.03 * ppl["gptq"]
    assert ppl["gptq + lm_head"] <= 1.05 * ppl["fp32"]
    assert ppl["rtn"] <= ppl["rtn + lm_head"] <= 1.15 * ppl["rtn"]
    assert ppl["gptq + lm_head"] / ppl["gptq"] < ppl["rtn + lm_head"] / ppl["rtn"]
