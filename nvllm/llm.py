"""LLM: the offline entry point. `LLM(model=DIR, **engine_options).generate(prompts, SamplingParams(...))`
returns one RequestOutput per prompt, in order; `chat(messages)` one per conversation, through the chat
template. With `tensor_parallel_size=N` the engine runs N − 1 worker processes: `close()` (or a `with` block)
stops them; otherwise garbage collection or interpreter exit does.
A script that builds one must guard its top level with `if __name__ == "__main__":` (workers are spawned)."""

from __future__ import annotations

import contextlib
import numbers
import threading
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

from nvllm.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from nvllm.config import ConfigError, EngineConfig
from nvllm.engine.generation_defaults import default_sampling_params
from nvllm.engine.llm_engine import LLMEngine
from nvllm.logger import console, setup_logging
from nvllm.lora.request import LoRARequest
from nvllm.outputs import RequestOutput
from nvllm.prompt_inputs import cache_salts, prompt_of
from nvllm.sampling_params import SamplingParams

Prompt = str | Seq[int] | dict[str, Any]
Conversation = Seq[dict[str, Any]]


class LLM:
    def __init__(self, model: str | None = None, **engine_options: Any):
        """engine_options: EngineConfig's fields, and a few of vLLM's names: `speculative_config=` for
        `speculative=`, `task` "generate" (or "auto"), and `swap_space` (nothing is swapped: a preempted sequence is
        recomputed)."""
        setup_logging()
        if "speculative_config" in engine_options:
            if engine_options.get("speculative") is not None:
                raise ValueError("give speculative or speculative_config, not both")
            engine_options["speculative"] = engine_options.pop("speculative_config")
        engine_options.pop("swap_space", None)
        task = engine_options.pop("task", "auto")
        if task not in ("auto", "generate"):
            raise ConfigError(f"task {task!r} is not supported: nvllm generates text (task 'generate')")
        self._start(EngineConfig(model=model, **engine_options))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        setup_logging()
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        self.config = config
        self.engine = LLMEngine(config)
        self._chat_template: tuple[str, bool] | None = None  # (template, is_fallback), loaded by the first chat
        self._lock = threading.RLock()  # one call runs the engine at a time (threads sharing an LLM wait)
        self._closed = False

    def get_tokenizer(self):
        return self.engine.tokenizer

    @property
    def llm_engine(self) -> LLMEngine:
        """The engine (vLLM's attribute name; also ``engine``)."""
        return self.engine

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses when given no sampling params: SamplingParams() with the model's recommended
        temperature, top_p, top_k, min_p, repetition_penalty and max_tokens (generation_config.json, see
        EngineConfig.generation_config) in place."""
        return default_sampling_params(self.engine.generation_defaults)

    def reset_prefix_cache(self) -> bool:
        """vLLM's: forget the cached prefixes, so that the next run starts cold (benchmarks call it between runs).
        Blocks of requests still running keep theirs; True, as nothing runs between two calls of this LLM."""
        with self._lock:
            self.engine.block_manager.reset_prefix_cache()
        return True

    def close(self) -> None:
        """Stop the tensor-parallel workers and free the KV cache and the CUDA graphs (idempotent), so that another
        LLM can be built in this process; waits for a call running in another thread. This LLM cannot generate
        afterwards."""
        with self._lock:
            self._closed = True
            self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., Any] = True,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
                 priority: Seq[int] | None = None) -> list[RequestOutput]:
        """Prompts: a string, a list of strings, a list of token-id lists, or {"prompt": "..."} /
        {"prompt_token_ids": [...]} dicts. Without sampling_params, `get_default_sampling_params()` (the model's
        recommended settings). lora_request: one adapter for all prompts, or one (or None) per prompt (the engine
        needs enable_lora=True). priority: one per prompt, lower first (vLLM's; needs scheduling_policy
        "priority"). use_tqdm: a progress bar, or (as vLLM) a tqdm-like factory to build it. Every prompt is
        validated before any runs: one bad prompt raises ValueError and nothing is queued."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                 and isinstance(prompts[0], numbers.Integral)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError("prompts: a string, a list of token ids, a dict, or a list of those; got "
                             f"{type(prompts).__name__}")
        salts = cache_salts(prompts)
        return self._generate([prompt_of(p) for p in prompts], sampling_params, use_tqdm, lora_request=lora_request,
                              cache_salts=salts, priorities=self._priorities(priority, len(prompts)))

    def _priorities(self, priority: Seq[int] | None, n: int) -> list[int] | None:
        if priority is None:
            return None
        priorities = list(priority)
        if len(priorities) != n or not all(isinstance(p, numbers.Integral) for p in priorities):
            raise ValueError(f"priority: one integer per prompt ({n}), got {priority!r}")
        for p in priorities:   # before anything is queued
            self.engine.scheduler.check_priority(p)
        return [int(p) for p in priorities]

    def chat(self, messages: Conversation | Seq[Conversation],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool | Callable[..., Any] = True,
             lora_request: LoRARequest | Seq[LoRARequest | None] | None = None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of {"role": ..., "content": ...} messages; content a string
        or a list of {"type": "text", "text": ...} parts) or a list of them, each rendered through the chat
        template and tokenized as the server's /v1/chat/completions does, then generated as `generate` does
        (one RequestOutput per conversation; its prompt is the rendered text). chat_template: Jinja template
        text; default: the tokenizer's, else the server's plain 'User: … / Assistant:' fallback. tools: OpenAI
        function definitions the template writes into the prompt (the reply is text; the server parses calls).
        lora_request: as in `generate`. chat_template_content_format: auto | string | openai, as vLLM's (each
        message's content one string, or a list of text parts; auto: as the template reads it). Bad messages raise
        ValueError and nothing is queued."""
        from nvllm import chat_template as ct

        many = isinstance(messages, (list, tuple)) and bool(messages) and all(
            isinstance(m, (list, tuple)) for m in messages)
        conversations = list(messages) if many else [messages]
        if chat_template is not None:
            template, fallback = chat_template, False
        else:
            if self._chat_template is None:
                self._chat_template = ct.load_chat_template(self.engine.tokenizer, None)
            template, fallback = self._chat_template
        tok = self.engine.tokenizer
        texts = [ct.render_chat(tok, template, list(c), add_generation_prompt, continue_final_message,
                                chat_template_kwargs, tools, chat_template_content_format) for c in conversations]
        ids = [ct.encode_chat(tok, text, fallback) for text in texts]
        return self._generate(ids, sampling_params, use_tqdm, texts, lora_request=lora_request)

    def beam_search(self, prompts: Prompt | Seq[Prompt], params: BeamSearchParams,
                    lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
                    use_tqdm: bool | Callable[..., Any] = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's LLM.beam_search (nvllm.beam_search): the best ``params.beam_width`` continuations of each prompt,
        best first, each with its tokens, cumulative log-probability and text. ``lora_request``: one adapter, or
        one per prompt; ``concurrency_limit``: how many prompts are searched at once (all by default)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                 and isinstance(prompts[0], numbers.Integral)):
            prompts = [prompts]
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(loras)} LoRA requests")
        if concurrency_limit is not None and (not isinstance(concurrency_limit, int) or concurrency_limit < 1):
            raise ValueError(f"concurrency_limit must be a positive integer, got {concurrency_limit!r}")
        engine = self.engine
        salts = cache_salts(prompts)
        searches = [BeamSearch(engine.tokenize(prompt_of(p)), params, engine.eos_token_ids, engine.max_model_len)
                    for p in prompts]
        limit = concurrency_limit or max(len(searches), 1)
        with _progress("beam search", len(searches), use_tqdm) as advance:
            for start in range(0, len(searches), limit):
                chunk = range(start, min(start + limit, len(searches)))
                while any(not searches[i].done for i in chunk):
                    active = [i for i in chunk if not searches[i].done]
                    beams = [(i, b) for i in active for b in searches[i].live]
                    outs = self._generate([b.tokens for _, b in beams], [searches[i].step_params() for i, _ in beams],
                                          False, lora_request=[loras[i] for i, _ in beams], log=False,
                                          cache_salts=[salts[i] for i, _ in beams])
                    tops = iter({t: lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs)
                    for i in active:
                        searches[i].advance([next(tops) for _ in searches[i].live])
                        if searches[i].done:
                            advance()
        engine.stat_logger.maybe_log(engine.stats, force=True)
        decode = self.get_tokenizer().decode
        return [s.result(lambda ids: decode(ids, skip_special_tokens=True)) for s in searches]

    def _generate(self, prompts: list, sampling_params, use_tqdm: bool, texts: list[str] | None = None,
                  lora_request=None, log: bool = True, cache_salts: list[str | None] | None = None,
                  priorities: list[int] | None = None) -> list[RequestOutput]:
        """Queue the prompts and run the engine until they finish, one call at a time: the engine steps every
        request it holds, so two threads stepping it at once would corrupt its state. A call that ends otherwise
        (an exception, Ctrl-C) aborts its requests: nothing it queued is left for the next call to run."""
        with self._lock:
            return self._generate_locked(prompts, sampling_params, use_tqdm, texts, lora_request, log, cache_salts,
                                         priorities)

    def _generate_locked(self, prompts, sampling_params, use_tqdm, texts, lora_request, log, cache_salts,
                         priorities):
        if self._closed:
            raise RuntimeError("this LLM was closed (LLM.close()); build a new one to generate")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"{len(prompts)} prompts but {len(loras)} LoRA requests")
        for p, sp in zip(prompts, params):  # all-or-nothing: every request is checked before any is queued
            self.engine.validate(p, sp)
        for lora in dict.fromkeys(x for x in loras if x is not None):
            self.engine.load_lora(lora)
        texts = texts or [None] * len(prompts)
        salts = cache_salts or [None] * len(prompts)
        priorities = priorities or [0] * len(prompts)
        ids: list[str] = []
        try:
            for p, sp, t, lr, salt, prio in zip(prompts, params, texts, loras, salts, priorities):
                ids.append(self.engine.add_request(None, p, sp, prompt_text=t, lora_request=lr, cache_salt=salt,
                                                   priority=prio))
            return self._run(ids, use_tqdm, log)
        except BaseException:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise

    def _run(self, request_ids: list[str], use_tqdm, log: bool = True) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        with _progress("generating", len(request_ids), use_tqdm) as advance:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step(partial=False):
                    if out.finished:
                        done[out.request_id] = out
                        advance()
        if log:  # the run's closing stats line (a beam search logs once, after its last step)
            self.engine.stat_logger.maybe_log(self.engine.stats, force=True)
        return [done[r] for r in request_ids]


@contextlib.contextmanager
def _progress(what: str, total: int, use_tqdm):
    """A progress bar over ``total`` items; yields the function that counts one done. ``use_tqdm``: False (none),
    True (a Rich bar), or, as vLLM takes it, a tqdm-like factory called as ``use_tqdm(total=..., desc=...)``."""
    if callable(use_tqdm):
        bar = use_tqdm(total=total, desc=what)
        try:
            yield lambda: bar.update(1)
        finally:
            bar.close()
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn(what), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), disable=not use_tqdm,
                  transient=True, console=console()) as bar:
        task = bar.add_task(what, total=total)
        yield lambda: bar.advance(task)
