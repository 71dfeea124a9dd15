"""`nvllm generate`: prompts in, continuations printed — sampled, constrained (structured outputs), with a LoRA
adapter, or by beam search. Registered on the `nvllm` app by nvllm/cli.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Optional

import typer

from nvllm.cli_options import USER_ERRORS, engine_options, fail
from nvllm.config import EngineConfig

# `nvllm generate`'s own sampling defaults, where neither the flags nor the model's generation_config.json set one
_GENERATE_DEFAULTS = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
                      "max_tokens": 128}


@engine_options
def generate(
    prompts: Annotated[Optional[list[str]], typer.Argument(help="prompt(s); default: 'Once upon a time'")] = None,
    max_tokens: Annotated[Optional[int], typer.Option(help="tokens to generate per prompt (default: the model's "
                                                      "max_new_tokens, else 128)")] = None,
    temperature: Annotated[Optional[float], typer.Option(help="0 = greedy (default: the model's, else 0)")] = None,
    top_p: Annotated[Optional[float], typer.Option(help="(default: the model's, else 1)")] = None,
    top_k: Annotated[Optional[int], typer.Option(help="-1 = off (default: the model's, else -1)")] = None,
    min_p: Annotated[Optional[float], typer.Option(help="(default: the model's, else 0)")] = None,
    presence_penalty: Annotated[float, typer.Option(help="[-2, 2]: minus this for every token already generated")
                                ] = 0.0,
    frequency_penalty: Annotated[float, typer.Option(help="[-2, 2]: minus this times a token's count in the "
                                                          "output")] = 0.0,
    repetition_penalty: Annotated[Optional[float], typer.Option(help="> 0, 1 = off: tokens of the prompt or the "
                                                                     "output weighed down by this factor (default: "
                                                                     "the model's, else 1)")] = None,
    sample_seed: Annotated[Optional[int], typer.Option("--sample-seed", help="per-request sampling seed")] = None,
    n: Annotated[int, typer.Option("-n", help="samples per prompt")] = 1,
    stop: Annotated[Optional[list[str]], typer.Option(help="stop string (repeatable)")] = None,
    ignore_eos: Annotated[bool, typer.Option()] = False,
    logprobs: Annotated[Optional[int], typer.Option(
        help="print top-N log-probabilities per token (-1: the whole vocabulary)")] = None,
    json_schema: Annotated[Optional[str], typer.Option(help="constrain the output to this JSON schema (its text, "
                                                            "or a file holding it)")] = None,
    regex: Annotated[Optional[str], typer.Option(help="constrain the output to this regular expression")] = None,
    choice: Annotated[Optional[list[str]], typer.Option(help="constrain the output to one of these strings "
                                                             "(repeatable)")] = None,
    lora: Annotated[Optional[str], typer.Option(help="a PEFT LoRA adapter directory to generate with (turns "
                                                     "--enable-lora on)")] = None,
    beam_width: Annotated[Optional[int], typer.Option(help="beam search with this many beams (printed best first) "
                                                           "instead of sampling")] = None,
    *, engine_config: EngineConfig,
) -> None:
    """Generate continuations of prompts and print them. Sampling flags left out take the model's recommended
    values (its generation_config.json; --generation-config vllm: none), else greedy decoding of 128 tokens."""
    from nvllm.engine.generation_defaults import announce, with_defaults
    from nvllm.llm import LLM
    from nvllm.logger import console
    from nvllm.beam_search import BeamSearchParams
    from nvllm.lora.request import LoRARequest
    from nvllm.sampling_params import SamplingParams

    given = dict(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                 repetition_penalty=repetition_penalty, max_tokens=max_tokens)

    def params(defaults: dict) -> SamplingParams:
        return SamplingParams(n=n, seed=sample_seed, stop=stop or [], ignore_eos=ignore_eos, logprobs=logprobs,
                              presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                              structured_outputs=constraint, **with_defaults(given, defaults, _GENERATE_DEFAULTS))

    try:
        constraint = _constraint(json_schema, regex, choice)
        params({})  # a bad flag fails before the model loads
        if beam_width is not None:
            BeamSearchParams(beam_width=beam_width, max_tokens=1)  # a bad width too
            sampled = dict(stop=stop, logprobs=logprobs, sample_seed=sample_seed,
                           temperature=temperature or None,     # 0 asks for what beam search does: no sampling
                           top_p=top_p, top_k=top_k, min_p=min_p, repetition_penalty=repetition_penalty,
                           json_schema=json_schema, regex=regex, choice=choice)
            unused = [k for k, v in sampled.items() if v is not None] + (["n"] if n != 1 else []) + [
                k for k, v in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)) if v]
            if unused:
                flag = "--" + unused[0].replace("_", "-")
                raise ValueError(f"--beam-width ranks beams by their log-probabilities: {flag} does not apply to it")
        lora_request = None
        if lora is not None:
            lora_request = LoRARequest(Path(lora).name or "lora", 1, lora)
            engine_config = dataclasses.replace(engine_config, enable_lora=True)
        llm = LLM.from_config(engine_config)
        defaults = {k: v for k, v in llm.engine.generation_defaults.items() if given[k] is None}
        announce(defaults)
        if beam_width is not None:
            _print_beams(llm, prompts or ["Once upon a time"], BeamSearchParams(
                beam_width=beam_width, max_tokens=params(defaults).max_tokens, ignore_eos=ignore_eos), lora_request)
            return
        outputs = llm.generate(prompts or ["Once upon a time"], params(defaults), lora_request=lora_request)
    except USER_ERRORS as e:
        fail(e)
    out = console()
    for o in outputs:
        for c in o.outputs:
            print(o.prompt + c.text, flush=True)
            out.print(f"[dim]({len(c.token_ids)} tokens, finish_reason={c.finish_reason}, "
                      f"ttft {1000 * (o.metrics.ttft or 0):.1f} ms)[/]", highlight=False)
            if c.logprobs:
                text = llm.get_tokenizer().decode
                for tok, lp in zip(c.token_ids, c.logprobs):   # the chosen token, then the top `logprobs`
                    top = sorted((x.rank, t, x.logprob) for t, x in lp.items() if logprobs == -1 or x.rank <= logprobs)
                    alts = ", ".join(f"{text([t])!r} {v:.4f}" for _, t, v in top)
                    out.print(f"  {text([tok])!r}: {lp[tok].logprob:.4f}" + (f"  top: {alts}" if alts else ""),
                              highlight=False)


def _print_beams(llm, prompts: list[str], params, lora_request) -> None:
    from nvllm.logger import console

    for prompt, result in zip(prompts, llm.beam_search(prompts, params, lora_request=lora_request)):
        for beam in result.sequences:
            print(prompt + beam.text, flush=True)
            console().print(f"[dim]({len(beam.output_token_ids)} tokens, finish_reason={beam.finish_reason}, "
                            f"cum_logprob {beam.cum_logprob:.4f})[/]", highlight=False)


def _constraint(json_schema: str | None, regex: str | None, choice: list[str] | None):
    """`nvllm generate`'s structured output flags as StructuredOutputsParams (None without them)."""
    from nvllm.sampling_params import StructuredOutputsParams

    if json_schema is None and regex is None and not choice:
        return None
    if json_schema is not None and not json_schema.lstrip().startswith("{"):
        path = Path(json_schema).expanduser()
        if not path.is_file():
            raise ValueError(f"--json-schema {json_schema}: neither a JSON object nor a file")
        json_schema = path.read_text()
    return StructuredOutputsParams(json=json_schema, regex=regex, choice=choice or None)
