"""`nvllm quantize`: a full-precision model in, an AWQ / GPTQ / compressed-tensors / FP8 checkpoint out, with a
table of per-layer errors and a summary. Registered on the `nvllm` app by nvllm/cli.py."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from nvllm.cli_options import fail

_CAL = "Calibration"


def quantize(
    model: Annotated[Optional[str], typer.Option(help="full-precision HF model directory or Hub id (default: the demo "
                                                 "model)")] = None,
    revision: Annotated[Optional[str], typer.Option(help="the Hub branch, tag or commit of --model (default: the "
                                                    "main branch)")] = None,
    out: Annotated[Optional[str], typer.Option(help="output directory (must not exist unless --overwrite)")] = None,
    method: Annotated[Optional[str], typer.Option(help="awq | gptq | rtn | fp8 (e4m3, no calibration)")] = None,
    bits: Annotated[Optional[int], typer.Option(help="4 | 8 (default 4; awq: 4 only; fp8: 8)")] = None,
    group_size: Annotated[Optional[int], typer.Option(help="inputs per scale/zero group; -1: whole rows "
                                                      "(default 128; fp8: 128×128 blocks, -1 a scale per tensor "
                                                      "or, in compressed-tensors, per channel)")] = None,
    sym: Annotated[Optional[bool], typer.Option("--sym/--no-sym", help="symmetric (gptq/rtn default) or zero "
                                                "point (awq)")] = None,
    desc_act: Annotated[Optional[bool], typer.Option("--desc-act/--no-desc-act", help="GPTQ act-order "
                                                     "(static groups)")] = None,
    quantize_lm_head: Annotated[Optional[bool], typer.Option("--quantize-lm-head/--no-quantize-lm-head",
                                                             help="quantize the LM head too (gptq/rtn; untied "
                                                             "embeddings only) (default off)")] = None,
    checkpoint_format: Annotated[Optional[str], typer.Option("--format", help="awq | gptq | compressed-tensors "
                                                             "(llm-compressor's) | fp8; default: awq for --method "
                                                             "awq, fp8 for fp8, gptq otherwise")] = None,
    calib_dataset: Annotated[Optional[str], typer.Option(help="c4 | calib (the shipped C4 sample) | pileval | "
                                                         "wikitext2 | a Hub dataset id or dataset folder | a .jsonl/"
                                                         ".json.gz/.json/.txt path (default c4)",
                                                         rich_help_panel=_CAL)] = None,
    calib_split: Annotated[Optional[str], typer.Option(help="a dataset's split (default train; pileval: "
                                                       "validation)", rich_help_panel=_CAL)] = None,
    calib_column: Annotated[Optional[str], typer.Option(help="a dataset's column: text, or conversations rendered "
                                                        "by the chat template (default text, else messages)",
                                                        rich_help_panel=_CAL)] = None,
    calib_config: Annotated[Optional[str], typer.Option(help="a Hub dataset's configuration (e.g. "
                                                        "wikitext-2-raw-v1)", rich_help_panel=_CAL)] = None,
    calib_samples: Annotated[Optional[int], typer.Option(help="windows (default 128)", rich_help_panel=_CAL)] = None,
    calib_seqlen: Annotated[Optional[int], typer.Option(help="tokens per window (default 2048)",
                                                        rich_help_panel=_CAL)] = None,
    seed: Annotated[Optional[int], typer.Option(help="calibration window seed (default 0)",
                                                rich_help_panel=_CAL)] = None,
    recipe: Annotated[Optional[str], typer.Option(
        help="YAML recipe: a file, or a shipped one by name (gptq-w4g128, awq-w4g128, rtn-w4g128, …, as in "
             "recipes/); flags override it")] = None,
    overwrite: Annotated[bool, typer.Option(
        help="replace an existing --out (a model directory, one with a config.json, or an empty one)")] = False,
    max_shard_size: Annotated[Optional[str], typer.Option(help="largest weights file, e.g. 5GB or 500MB: larger "
                                                          "weights are split into model-0000k-of-0000n.safetensors "
                                                          "with an index (default 5GB)")] = None,
    device: Annotated[Optional[str], typer.Option(help="auto | cpu | cuda | cuda:N (where layers are "
                                                  "quantized) (default auto)")] = None,
    progress: Annotated[bool, typer.Option(help="progress bar")] = True,
) -> None:
    """Quantize a model to INT4/INT8 (AWQ, GPTQ or RTN) or FP8 and write an AWQ-GEMM, GPTQ, compressed-tensors or
    FP8 checkpoint."""
    from nvllm.assets import demo_model_path
    from nvllm.logger import console
    from nvllm.quant import quantize as q
    from nvllm.quant.recipe import build_config
    from nvllm.quant.report import quantize_with_report

    if out is None:
        fail("--out DIR is required")
    if model == "":  # an unset $MODEL in a script: not the demo model, quietly
        fail("--model is empty")
    try:
        cfg = build_config(recipe, method=method, bits=bits, group_size=group_size, sym=sym, desc_act=desc_act,
                           quantize_lm_head=quantize_lm_head, checkpoint_format=checkpoint_format,
                           calib_dataset=calib_dataset, calib_split=calib_split, calib_column=calib_column,
                           calib_config=calib_config, calib_samples=calib_samples, calib_seqlen=calib_seqlen,
                           seed=seed, device=device, max_shard_size=max_shard_size)
        quantize_with_report(model or demo_model_path(), out, cfg, overwrite, console(), progress, revision)
    except q.USER_ERRORS as e:
        fail(e)
