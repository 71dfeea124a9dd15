"""The `nvllm` command line. Each command parses flags into config objects and calls the package."""

from __future__ import annotations

import sys
from typing import Annotated, Optional

import typer

from nvllm.cli_options import USER_ERRORS, engine_options, fail
from nvllm.config import EngineConfig

app = typer.Typer(help="nvllm: fast, checked LLM inference on one engine.", no_args_is_help=True,
                  pretty_exceptions_enable=False, add_completion=False)


@app.callback()
def main_callback() -> None:
    """nvllm: fast, checked LLM inference — quantize, serve, bench and eval on one engine."""


@app.command()
@engine_options
def generate(
    prompts: Annotated[Optional[list[str]], typer.Argument(help="prompt(s); default: 'Once upon a time'")] = None,
    max_tokens: Annotated[int, typer.Option(help="tokens to generate per prompt")] = 128,
    temperature: Annotated[float, typer.Option(help="0 = greedy")] = 0.0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    top_k: Annotated[int, typer.Option(help="-1 = off")] = -1,
    min_p: Annotated[float, typer.Option()] = 0.0,
    sample_seed: Annotated[Optional[int], typer.Option("--sample-seed", help="per-request sampling seed")] = None,
    n: Annotated[int, typer.Option("-n", help="samples per prompt")] = 1,
    stop: Annotated[Optional[list[str]], typer.Option(help="stop string (repeatable)")] = None,
    ignore_eos: Annotated[bool, typer.Option()] = False,
    logprobs: Annotated[Optional[int], typer.Option(help="print top-N log-probabilities per token")] = None,
    *, engine_config: EngineConfig,
) -> None:
    """Generate continuations of prompts and print them."""
    from nvllm.llm import LLM
    from nvllm.logger import console
    from nvllm.sampling_params import SamplingParams

    try:
        params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                seed=sample_seed, max_tokens=max_tokens, stop=stop or [], ignore_eos=ignore_eos,
                                logprobs=logprobs)
        llm = LLM.from_config(engine_config)
        outputs = llm.generate(prompts or ["Once upon a time"], params)
    except USER_ERRORS as e:
        fail(str(e))
    out = console()
    for o in outputs:
        for c in o.outputs:
            print(o.prompt + c.text, flush=True)
            out.print(f"[dim]({len(c.token_ids)} tokens, finish_reason={c.finish_reason}, "
                      f"ttft {1000 * (o.metrics.ttft or 0):.1f} ms)[/]", highlight=False)
            if c.logprobs:
                for tok, lp in zip(c.token_ids, c.logprobs):
                    out.print(f"  {llm.get_tokenizer().decode([tok])!r}: {lp[tok].logprob:.4f}", highlight=False)


def main() -> None:  # pragma: no cover - console entry
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
