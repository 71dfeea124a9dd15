"""LLM: the offline entry point. `LLM(model=DIR, **engine_options).generate(prompts, SamplingParams(...))`
returns one RequestOutput per prompt, in order. With `tensor_parallel_size=N` the engine runs N − 1 worker
processes: `close()` (or a `with` block) stops them; otherwise garbage collection or interpreter exit does.
A script that builds one must guard its top level with `if __name__ == "__main__":` (workers are spawned)."""

from __future__ import annotations

import numbers
from collections.abc import Sequence as Seq
from typing import Any

from nvllm.config import EngineConfig
from nvllm.engine.generation_defaults import default_sampling_params
from nvllm.engine.llm_engine import LLMEngine
from nvllm.logger import console, setup_logging
from nvllm.outputs import RequestOutput
from nvllm.sampling_params import SamplingParams

Prompt = str | Seq[int] | dict[str, Any]


class LLM:
    def __init__(self, model: str | None = None, **engine_options: Any):
        """engine_options: EngineConfig's fields; `speculative_config=` is accepted for `speculative=`."""
        setup_logging()
        if "speculative_config" in engine_options:
            if engine_options.get("speculative") is not None:
                raise ValueError("give speculative or speculative_config, not both")
            engine_options["speculative"] = engine_options.pop("speculative_config")
        self.config = EngineConfig(model=model, **engine_options)
        self.engine = LLMEngine(self.config)

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        setup_logging()
        llm = cls.__new__(cls)
        llm.config, llm.engine = config, LLMEngine(config)
        return llm

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses when given no sampling params: SamplingParams() with the model's recommended
        temperature, top_p, top_k, min_p, repetition_penalty and max_tokens (generation_config.json, see
        EngineConfig.generation_config) in place."""
        return default_sampling_params(self.engine.generation_defaults)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent); a split engine cannot generate afterwards."""
        self.engine.runner.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: Prompt | Seq[Prompt], sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Prompts: a string, a list of strings, a list of token-id lists, or {"prompt": "..."} /
        {"prompt_token_ids": [...]} dicts. Without sampling_params, `get_default_sampling_params()` (the model's
        recommended settings). Every prompt is validated before any runs: one bad prompt raises ValueError and
        nothing is queued."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                 and isinstance(prompts[0], numbers.Integral)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError("prompts: a string, a list of token ids, a dict, or a list of those; got "
                             f"{type(prompts).__name__}")
        prompts = [_prompt_of(p) for p in prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        for p, sp in zip(prompts, params):  # all-or-nothing: every request is checked before any is queued
            self.engine.validate(p, sp)
        ids = [self.engine.add_request(None, p, sp) for p, sp in zip(prompts, params)]
        return self._run(ids, use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        done: dict[str, RequestOutput] = {}
        with Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      disable=not use_tqdm, transient=True, console=console()) as bar:
            task = bar.add_task("generate", total=len(request_ids))
            while self.engine.has_unfinished_requests():
                for out in self.engine.step(partial=False):
                    if out.finished:
                        done[out.request_id] = out
                        bar.advance(task)
        self.engine.stat_logger.maybe_log(self.engine.stats, force=True)
        return [done[r] for r in request_ids]


def _prompt_of(p):
    """A dict prompt's text or token ids (as vLLM's TextPrompt and TokensPrompt); anything else as it is."""
    if not isinstance(p, dict):
        return p
    if ("prompt" in p) == ("prompt_token_ids" in p):
        raise ValueError(f"a dict prompt holds exactly one of 'prompt' and 'prompt_token_ids', got {sorted(p)}")
    return p["prompt"] if "prompt" in p else p["prompt_token_ids"]
