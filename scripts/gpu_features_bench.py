"""What the serving features cost, in one call on one GPU: batch-1 decode with a LoRA adapter against the base model
(both in CUDA graphs) and against itself run eagerly (the greedy tokens of the two must be equal); a batch under a JSON constraint against the same batch
unconstrained, and against itself without asynchronous scheduling; beam search against greedy decoding. A table, and $OUT/gpu_features_bench.json.

    python3 scripts/gpu_features_bench.py [--config scripts/models/qwen2.5-7b/config.json] [--layers N]
                                          [--tokens 128] [--batch 32] [--lora-rank 16] [--beam-width 4]
                                          [--device cuda] [--out DIR]

Model: the config's shapes with random weights (load_format dummy) and the demo model's tokenizer (its 512 ids lie
in any larger vocabulary). The adapter: a PEFT-format LoRA of ``--lora-rank`` on every decoder projection, random
A and B written by this script. Structured outputs need xgrammar (on a host without it, carry its wheel and
apache-tvm-ffi's: ``pip download --no-deps xgrammar apache-tvm-ffi``); without it that row is skipped and says so.
Every row decodes ``--tokens`` tokens with ignore_eos, greedy; TPOT is the median over the requests of
(finish - first token) / (tokens - 1).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def model_dir(config: Path, layers: int | None, work: Path) -> Path:
    from nvllm.assets import demo_model_path

    d = work / "model"
    d.mkdir(parents=True)
    cfg = json.loads(config.read_text())
    if layers:
        cfg["num_hidden_layers"] = layers
    (d / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(Path(demo_model_path()) / f, d / f)
    return d


def write_adapter(model: Path, rank: int, out: Path) -> Path:
    """A PEFT LoRA on every decoder projection, random A and B (B small, the outputs stay sane, yet large enough
    to change the greedy tokens)."""
    from safetensors.torch import save_file

    cfg = json.loads((model / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or h // heads
    shapes = {"self_attn.q_proj": (h, heads * hd), "self_attn.k_proj": (h, kv * hd), "self_attn.v_proj": (h, kv * hd),
              "self_attn.o_proj": (heads * hd, h), "mlp.gate_proj": (h, inter), "mlp.up_proj": (h, inter),
              "mlp.down_proj": (inter, h)}
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(cfg["num_hidden_layers"]):
        for name, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{i}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g).to(torch.bfloat16) / fan_in ** .5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g).to(torch.bfloat16) * 1e-2
    out.mkdir(parents=True)
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}))
    return out


def tpot_ms(outs) -> float:
    per = [(o.metrics.finished_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
           for o in outs if len(o.outputs[0].token_ids) > 1]
    return 1000 * statistics.median(per)


def run(name: str, res: dict, device: str, model: Path, fn, **engine) -> None:
    """Build an engine, run ``fn(llm)`` (after one warm-up call), record what it returns under ``name``."""
    from nvllm import LLM

    llm = LLM(str(model), load_format="dummy", device=device, log_stats_interval=0, **engine)
    try:
        fn(llm)  # warm-up: first compilations, adapter on the device
        t0 = time.perf_counter()
        res[name] = {**fn(llm), "wall_s": round(time.perf_counter() - t0, 3)}
        print(f"{name}: {res[name]}", flush=True)
    finally:
        llm.close()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> dict:
    from nvllm import BeamSearchParams, LoRARequest, SamplingParams, StructuredOutputsParams

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(REPO / "scripts/models/qwen2.5-7b/config.json"))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--beam-width", type=int, default=4)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="features-"))
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "args": vars(a),
                 "device": torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"}
    try:
        model = model_dir(Path(a.config), a.layers, work)
        adapter = write_adapter(model, a.lora_rank, work / "adapter")
        prompt = [1] + [100 + i % 300 for i in range(31)]
        one = SamplingParams(max_tokens=a.tokens, temperature=0, ignore_eos=True)
        lora = LoRARequest("bench", 1, str(adapter))

        def decode(lora_request=None):
            def go(llm):
                outs = llm.generate([prompt] * 3, one, use_tqdm=False, lora_request=lora_request)
                return {"tpot_ms": round(tpot_ms(outs), 4), "tokens": outs[0].outputs[0].token_ids}
            return go
        run("base_b1", res, a.device, model, decode())
        run("base_eager_b1", res, a.device, model, decode(), enforce_eager=True)
        run("lora_b1", res, a.device, model, decode(lora), enable_lora=True, max_lora_rank=a.lora_rank)
        run("lora_eager_b1", res, a.device, model, decode(lora), enable_lora=True, max_lora_rank=a.lora_rank,
            enforce_eager=True)
        res["lora_graphs_tokens_equal_eager"] = res["lora_b1"]["tokens"] == res["lora_eager_b1"]["tokens"]
        res["lora_tokens_differ_from_base"] = res["lora_b1"]["tokens"] != res["base_b1"]["tokens"]
        print(f"LoRA greedy tokens: graphs == eager {res['lora_graphs_tokens_equal_eager']}, "
              f"!= base {res['lora_tokens_differ_from_base']}", flush=True)

        def batch(constraint):
            params = SamplingParams(max_tokens=a.tokens, temperature=0, ignore_eos=True,
                                    structured_outputs=constraint)

            def go(llm):
                t0 = time.perf_counter()
                outs = llm.generate([prompt] * a.batch, params, use_tqdm=False)
                n = sum(len(o.outputs[0].token_ids) for o in outs)
                return {"tokens": n, "tok_per_s": round(n / (time.perf_counter() - t0), 1)}
            return go
        run("batch_plain", res, a.device, model, batch(None))
        try:
            import xgrammar  # noqa: F401
        except ImportError:
            res["batch_json"] = {"skipped": "xgrammar is not installed"}
        else:
            # JSON without whitespace limits runs on random weights; the work per token is the same
            run("batch_json", res, a.device, model, batch(StructuredOutputsParams(json_object=True)))
            # the same without asynchronous scheduling: what reading the step in flight before the masks saves
            run("batch_json_sync", res, a.device, model, batch(StructuredOutputsParams(json_object=True)),
                async_scheduling=False)

        beams = BeamSearchParams(beam_width=a.beam_width, max_tokens=a.tokens, ignore_eos=True)
        run("beam_search", res, a.device, model, lambda llm: {"beams": len(llm.beam_search([prompt], beams)[0]
                                                                             .sequences)})
        run("greedy_same_prompt", res, a.device, model,
            lambda llm: {"tokens": len(llm.generate([prompt], one, use_tqdm=False)[0].outputs[0].token_ids)})
    finally:
        shutil.rmtree(work, ignore_errors=True)
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_features_bench.json").write_text(json.dumps(res, indent=1))
    rows = [("LoRA b1 TPOT / base (graphs)", "lora_b1", "base_b1", "tpot_ms"),
            ("LoRA eager b1 TPOT / LoRA (graphs)", "lora_eager_b1", "lora_b1", "tpot_ms"),
            ("base eager TPOT / base (graphs)", "base_eager_b1", "base_b1", "tpot_ms"),
            ("JSON batch tok/s / plain", "batch_json", "batch_plain", "tok_per_s"),
            ("JSON batch tok/s, async / sync scheduling", "batch_json", "batch_json_sync", "tok_per_s"),
            ("beam search wall / greedy wall", "beam_search", "greedy_same_prompt", "wall_s")]
    print(f"{'ratio':40s} value")
    for label, x, y, key in rows:
        if key in res.get(x, {}) and key in res.get(y, {}):
            res.setdefault("ratios", {})[label] = round(res[x][key] / res[y][key], 4)
            print(f"{label:40s} {res['ratios'][label]}")
    (Path(a.out) / "gpu_features_bench.json").write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
