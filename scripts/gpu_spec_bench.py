"""Speculative-decoding speed on one GPU (issue 8), in one call: Qwen2.5-7B-shaped target (random bf16 weights),
k=4, against plain decoding in the same run.

    python scripts/gpu_spec_bench.py [--tokenizer-dir .carry/qwen2.5] [--acceptance 0.5,0.7,0.8,0.9]

Drafts (``--drafts``): a Qwen2.5-0.5B-shaped model (scripts/models/qwen2.5-0.5b), its widths with 4 layers (an
EAGLE-sized draft: a forward reads 1/39 of what the target's does), and an INT4 (GPTQ g128) copy of the target's
shapes. Random weights accept nothing, so the runs use the BENCHMARK MODE ``synthetic_acceptance``: each
drafted token is accepted with a fixed probability, whatever the models say — the drafts and the target still
run in full, so the speed at a given acceptance is real; the outputs are not the target's. τ is the mean
number of tokens one target step emits (accepted drafts + 1).

Per draft and acceptance: batch-1 TPOT (128 in / 256 out) and its speedup over plain decoding, greedy and (beside
it) at temperature 1 (``--temperatures``); at 0.8 also batch 32 (request throughput against plain decoding, since
speculation can lose at large batch). Then, per draft, the draft chain against the step-by-step loop (``chain_check``)
and, with ``--self-check``, the draft drafting for itself, verified for real (``self_draft_check``).
Diagnostics (scripts/spec_diagnostics.py), all optional:
``--timeline``: host and GPU offsets of a batch-1 step's phases, unprofiled (every draft; ``step_timeline``);
``--host-profile``: cProfile of batch-1 steps (every draft);
``--launch``: host cost of launching the batch-1 graphs against their GPU time, and their kernels (first draft);
``--variants``: the verification and draft graphs under other sizes, GEMM choices and without PDL (first draft);
``--profile``: torch.profiler over 24 batch-1 steps of the first draft (it slows graph launches ~40×: GPU times
only).
Prints a table; writes $OUT/spec_bench.json (and the diagnostics' files).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import torch  # noqa: E402

from gpu_bench import QUANT_CONFIGS, build_model_dir  # noqa: E402
from spec_diagnostics import graph_variants, host_profile, launch_costs, profile_spec, step_timeline  # noqa: E402


def model_copy(src: Path, config_from: Path | None = None, quant: dict | None = None,
               layers: int | None = None) -> Path:
    d = Path(tempfile.mkdtemp(prefix="spec-"))
    for f in src.iterdir():
        shutil.copy(f, d / f.name)
    cfg = json.loads(((config_from or src) / "config.json").read_text())
    if quant:
        cfg["quantization_config"] = quant
    if layers:
        cfg["num_hidden_layers"] = cfg["max_window_layers"] = layers
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def measure(llm, config, batch: int, temperature: float = 0.0) -> dict:
    from nvllm.bench.offline import run_latency

    r = run_latency(config, batch_size=batch, input_len=128, output_len=256, num_iters_warmup=1,
                    num_iters=5 if batch == 1 else 2, progress=False, llm=llm, temperature=temperature)
    out = {"tpot_ms": r["median_tpot_ms"], "latency_s": r["avg_latency"],
           "output_tok_s": batch * 256 / r["avg_latency"]}
    if "spec_decode_acceptance_length" in r:
        out["tau"] = r["spec_decode_acceptance_length"]
        out["acceptance_pct"] = r["spec_decode_acceptance_rate"]
    return out


def chain_check(llm, config, plain_tpot: float) -> dict | None:
    """The draft chain (nvllm.spec.draft_chain) against the step-by-step loop on the same engine: greedy outputs of 4
    prompts one at a time (the chain's forwards then have the loop's shapes: the same drafts, token for token) and at
    once (other batch shapes: bf16 rounding may flip a near-tie of the random draft; the share of tokens before each
    output's first difference), then greedy batch-1 TPOT — the benchmark mode's generator reset before each, so both
    draw the same acceptances (same τ) and the same drafts give the same tokens."""
    from nvllm.bench.offline import random_token_prompts
    from nvllm.sampling_params import SamplingParams

    spec = llm.engine.spec
    chain = spec.proposer.chain
    if chain is None:
        return None
    prompts = random_token_prompts(llm.get_tokenizer(), 4, 64, seed=5)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    outs = {"alone": [], "batched": []}

    def generate(ps):
        spec.sampler._generators.clear()
        llm.engine.block_manager.reset_prefix_cache()  # both runs compute their prompts the same way
        return [o.outputs[0].token_ids for o in llm.generate(ps, params, use_tqdm=False)]

    try:
        for c in (chain, None):
            spec.proposer.chain = c
            outs["alone"].append([generate([p])[0] for p in prompts])
            outs["batched"].append(generate(prompts))
        timed = []
        for c in (chain, None):
            spec.proposer.chain = c
            spec.sampler._generators.clear()
            timed.append(measure(llm, config, 1))
    finally:
        spec.proposer.chain = chain
    a, b = outs["batched"]
    return {"same_outputs": outs["alone"][0] == outs["alone"][1],
            "batched_same_tokens": sum(next((i for i, (x, y) in enumerate(zip(u, v)) if x != y), len(u))
                                       for u, v in zip(a, b)) / sum(map(len, a)),  # before each first difference
            "tau": [t.get("tau") for t in timed],
            "chain_tpot_ms": timed[0]["tpot_ms"], "loop_tpot_ms": timed[1]["tpot_ms"],
            "chain_speedup_b1": plain_tpot / timed[0]["tpot_ms"], "loop_speedup_b1": plain_tpot / timed[1]["tpot_ms"]}


def self_draft_check(ddir: Path, base: dict) -> dict:
    """A model drafting for itself, verified for real (no benchmark mode), greedy: with the draft chain and step by
    step, the acceptance rate (1 but for bf16 near-ties between the draft's and the verification's batch shapes) and
    the share of output tokens equal to plain decoding's; then sampled (temperature 0.8, top-p 0.9), the acceptance
    rate (q = p up to the same rounding). A wrong position, slot or catch-up row would show as a
    collapse of the acceptance."""
    from nvllm.bench.offline import random_token_prompts
    from nvllm.config import EngineConfig
    from nvllm.llm import LLM
    from nvllm.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    cfg = dict(base, model=str(ddir))
    llm = LLM.from_config(EngineConfig(**cfg))
    prompts = random_token_prompts(llm.get_tokenizer(), 4, 64, seed=7)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    llm = LLM.from_config(EngineConfig(**cfg, speculative=f"k=4,draft={ddir}"))
    spec, out = llm.engine.spec, {}
    chain = spec.proposer.chain
    for label, c in (("chain", chain), ("loop", None)):
        spec.proposer.chain = c
        llm.engine.stats.spec = type(llm.engine.stats.spec)()
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        same = sum(a == b for g, p in zip(got, plain) for a, b in zip(g, p))
        out[label] = {"acceptance": llm.engine.stats.spec.acceptance_rate, "same_as_plain": same / sum(map(len, plain)),
                      "chain_runs": chain.runs if chain is not None else None}
        # sampled (temperature 0.8, top-p 0.9): q = p but for bf16 rounding at other shapes, so acceptance near 1
        llm.engine.stats.spec = type(llm.engine.stats.spec)()
        llm.generate(prompts, SamplingParams(temperature=0.8, top_p=0.9, max_tokens=64, ignore_eos=True, seed=1),
                     use_tqdm=False)
        out[label]["sampled_acceptance"] = llm.engine.stats.spec.acceptance_rate
    spec.proposer.chain = chain
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer-dir", default=str(REPO / ".carry/qwen2.5"))
    ap.add_argument("--acceptance", default="0.5,0.7,0.8,0.9")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--temperatures", default="0,1",
                    help="sampling temperatures of the batch-1 rows: the first for every row (and batch 32), the others "
                         "beside it")
    ap.add_argument("--drafts", default="0.5b,int4", help="which drafts: 0.5b (the small model), 0.5b-4l (its first 4 layers: an "
                    "EAGLE-sized draft), int4 (self-draft)")
    ap.add_argument("--profile", action="store_true", help="profile batch-1 steps of the first draft (see above)")
    ap.add_argument("--variants", action="store_true", help="graph variants for the verification and the draft")
    ap.add_argument("--host-profile", action="store_true", help="cProfile of batch-1 greedy steps, every draft")
    ap.add_argument("--self-check", action="store_true",
                    help="each draft drafting for itself, verified for real: acceptance with and without the chain")
    ap.add_argument("--timeline", action="store_true", help="unprofiled host/GPU timeline of batch-1 steps (every draft)")
    ap.add_argument("--launch", action="store_true",
                    help="host cost of launching the batch-1 graphs against their GPU time, first draft (see launch_costs)")
    args = ap.parse_args()
    from nvllm.config import EngineConfig
    from nvllm.llm import LLM

    out = Path(os.environ.get("OUT", "."))
    res: dict = {"card": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                 "commit": os.environ.get("NVLLM_COMMIT", "unknown"), "command": " ".join(sys.argv), "runs": []}

    def save():
        (out / "spec_bench.json").write_text(json.dumps(res, indent=1, default=str))

    target = build_model_dir(Path(args.tokenizer_dir))
    chosen = args.drafts.split(",")
    drafts = {}
    if "0.5b" in chosen:
        drafts["0.5B-shaped"] = model_copy(target, REPO / "scripts/models/qwen2.5-0.5b")
    if "0.5b-4l" in chosen:  # EAGLE-sized: a forward reads ~0.39 GB, 1/39 of the target's (EAGLE-3's head ~1/20)
        drafts["0.5B widths, 4 layers"] = model_copy(target, REPO / "scripts/models/qwen2.5-0.5b", layers=4)
    if "int4" in chosen:
        drafts["INT4 GPTQ self-draft"] = model_copy(target, quant=QUANT_CONFIGS["gptq"])
    base = dict(model=str(target), load_format="dummy", dtype="bfloat16", max_model_len=4096, max_num_seqs=64,
                log_stats_interval=0)
    config = EngineConfig(**base)
    llm = LLM.from_config(config)
    temps = [float(t) for t in args.temperatures.split(",")]
    plain = {1: measure(llm, config, 1, temps[0]), 32: measure(llm, config, 32, temps[0]),
             **{f"1 at T={t:g}": measure(llm, config, 1, t) for t in temps[1:]}}
    res["plain"] = plain
    save()
    print(f"plain: batch 1 TPOT {plain[1]['tpot_ms']:.2f} ms; batch 32 {plain[32]['output_tok_s']:.0f} tok/s"
          + "".join(f"; batch 1 at T={t:g} {plain[f'1 at T={t:g}']['tpot_ms']:.2f} ms" for t in temps[1:]), flush=True)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    accs = [float(a) for a in args.acceptance.split(",")]
    for name, ddir in drafts.items():
        spec = f"k={args.k},draft={ddir},synthetic_acceptance={accs[0]}"
        config = EngineConfig(**base, speculative=spec)
        try:
            llm = LLM.from_config(config)
        except Exception as e:  # keep the other draft's results
            res["runs"].append({"draft": name, "error": repr(e)})
            print(f"{name}: {e!r}", flush=True)
            continue
        for acc in accs:
            llm.engine.spec.sampler.synthetic_acceptance = acc   # the same engine at another fixed acceptance
            row = {"draft": name, "k": args.k, "synthetic_acceptance": acc, "temperature": temps[0],
                   **measure(llm, config, 1, temps[0])}
            row["speedup_b1"] = plain[1]["tpot_ms"] / row["tpot_ms"]
            for t in temps[1:]:
                other = row[f"at T={t:g}"] = measure(llm, config, 1, t)
                other["speedup_b1"] = plain[f"1 at T={t:g}"]["tpot_ms"] / other["tpot_ms"]
            if acc == 0.8:
                b32 = measure(llm, config, 32, temps[0])
                row["b32_output_tok_s"] = b32["output_tok_s"]
                row["speedup_b32"] = b32["output_tok_s"] / plain[32]["output_tok_s"]
            res["runs"].append(row)
            save()
            print(f"{name:22s} acc {acc:.2f}  tau {row.get('tau', 0):.2f}  TPOT {row['tpot_ms']:.2f} ms  "
                  f"x{row['speedup_b1']:.2f}" + (f"  b32 x{row['speedup_b32']:.2f}" if "speedup_b32" in row else "")
                  + "".join(f"  | T={t:g}: tau {row[f'at T={t:g}'].get('tau', 0):.2f} TPOT "
                            f"{row[f'at T={t:g}']['tpot_ms']:.2f} ms x{row[f'at T={t:g}']['speedup_b1']:.2f}"
                            for t in temps[1:]), flush=True)
        llm.engine.spec.sampler.synthetic_acceptance = 0.8 if 0.8 in accs else accs[0]
        check = chain_check(llm, config, plain[1]["tpot_ms"])
        if check is not None:
            res["runs"].append({"draft": name, "chain_check": check,
                                "synthetic_acceptance": llm.engine.spec.sampler.synthetic_acceptance})
            save()
            print(f"{name:22s} chain: same outputs as step by step, one prompt at a time: {check['same_outputs']}, "
                  f"4 at once: {check['batched_same_tokens']:.1%} of tokens; tau {check['tau']}: "
                  f"chain TPOT {check['chain_tpot_ms']:.2f} ms x{check['chain_speedup_b1']:.2f}, step by step "
                  f"{check['loop_tpot_ms']:.2f} ms x{check['loop_speedup_b1']:.2f}", flush=True)
        if args.variants and name == next(iter(drafts)):
            graph_variants(llm, res)
        if args.host_profile:
            llm.engine.spec.sampler.synthetic_acceptance = 0.8 if 0.8 in accs else accs[0]
            host_profile(llm, res, name)
        if args.timeline:
            llm.engine.spec.sampler.synthetic_acceptance = 0.8 if 0.8 in accs else accs[0]
            step_timeline(llm, res, name)
        if args.launch and name == next(iter(drafts)):
            launch_costs(llm, res)
        if args.profile and name == next(iter(drafts)):  # last: a profiler session slows later launches
            llm.engine.spec.sampler.synthetic_acceptance = accs[0]
            profile_spec(llm, res)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
        if args.self_check:
            check = self_draft_check(ddir, base)
            gc.collect()  # the engines it made
            torch.cuda.empty_cache()
            res["runs"].append({"draft": name, "self_draft_check": check})
            save()
            print(f"{name:22s} drafting for itself: " + "; ".join(
                f"{k}: acceptance {v['acceptance']:.3f}, tokens as plain decoding {v['same_as_plain']:.3f}, "
                f"sampled acceptance {v['sampled_acceptance']:.3f}"
                for k, v in check.items()), flush=True)
    save()


if __name__ == "__main__":
    main()
