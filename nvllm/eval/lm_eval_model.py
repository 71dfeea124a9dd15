"""nvllm as an lm-evaluation-harness backend: `NvllmLM`, a `TemplateLM` on nvllm's `LLM`.

Log-likelihoods come from the engine's prompt log-probabilities (`SamplingParams(prompt_logprobs=0)` gives the
log-probability and rank of every prompt token), so a (context, continuation) pair costs one prefill; greedy
generation honours `until` (stop strings) and `max_gen_toks`. Tokenisation, truncation, rolling windows and
post-processing follow lm-eval's `hf` backend, so the two agree number for number on the same weights.

    lm_eval --model nvllm --model_args model=DIR,dtype=bfloat16 --tasks gsm8k      # lm-eval with entry points
    python -m nvllm.eval --model nvllm --model_args model=DIR --tasks gsm8k        # any lm-eval version

One limit of the engine shows here: a request must leave room for one generated token, so the scoring window
(`max_length`) is at most max_model_len - 2 tokens of input (the `hf` backend uses the full max_model_len).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from nvllm.config import EngineConfig
from nvllm.lora.request import LoRARequest
from nvllm.sampling_params import SamplingParams

logger = logging.getLogger("nvllm")
Window = tuple[list[int], list[int]]  # (context tokens, continuation tokens to score)
# every EngineConfig field, and what LLM(...) takes besides (vLLM's names); model and device are arguments of their own
_ENGINE_KEYS = ({f.name for f in dataclasses.fields(EngineConfig)} - {"model", "device"}) | \
    {"speculative_config", "swap_space", "task"}
# generation kwargs passed on to SamplingParams as vLLM's backend passes them; the backend sets these itself
_SAMPLING_KEYS = {f.name for f in dataclasses.fields(SamplingParams)} - {"max_tokens", "stop", "temperature"}


def chat_template_of(tokenizer, name: str) -> str | dict[str, str]:
    """The tokenizer's chat template, through nvllm's loader; a ValueError where it has none, as the hf backend
    (transformers) fails then: nvllm's plain fallback template would make prompts no reference backend scores."""
    from nvllm.chat_template import load_chat_template

    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer of {name} has no chat template to apply")
    return load_chat_template(tokenizer, None)[0]


@register_model("nvllm")
class NvllmLM(TemplateLM):
    """lm-eval model backed by nvllm's engine.

    `model` (alias `pretrained`) is an HF model directory (default: the demo model); every EngineConfig field
    (dtype, max_model_len, kv_cache_dtype, quantization, revision, ...) and what `LLM(...)` takes besides
    (speculative_config, swap_space, task) may be given too, or a ready `llm`. lm-eval's `batch_size` is
    accepted and ignored: the engine batches continuously (bounded by max_num_seqs / max_num_batched_tokens);
    `requests_per_call` only sets how many requests go to the engine at once (memory and progress).
    `lora_local_path` (vLLM's backend's name for it): a PEFT LoRA adapter every request runs with.
    """

    def __init__(self, model: str | None = None, pretrained: str | None = None, llm: Any = None,
                 max_length: int | None = None, max_gen_toks: int = 256, add_bos_token: bool | None = None,
                 prefix_token_id: int | None = None, requests_per_call: int = 1024, show_progress: bool = True,
                 batch_size: Any = None, max_batch_size: Any = None, device: str | None = None,
                 lora_local_path: str | None = None, **engine_options: Any):
        super().__init__()
        unknown = set(engine_options) - _ENGINE_KEYS
        if unknown:
            raise ValueError(f"unknown nvllm model argument(s): {', '.join(sorted(unknown))}")
        if llm is None:
            from nvllm.llm import LLM

            engine_options.setdefault("log_stats_interval", 0)
            if lora_local_path is not None:
                engine_options["enable_lora"] = True
            llm = LLM(model=model or pretrained, device=device or "auto", **engine_options)
        self.llm = llm
        self.lora_request = None
        if lora_local_path is not None:
            if not llm.config.enable_lora:
                raise ValueError("lora_local_path needs an engine with enable_lora")
            self.lora_request = LoRARequest(Path(lora_local_path).name or "lora", 1, lora_local_path)
            llm.engine.load_lora(self.lora_request)  # a bad adapter fails here, before any task runs
        self.tokenizer = llm.get_tokenizer()
        limit = llm.engine.max_model_len - 2  # the scored window plus its last token plus one generated token
        if max_length is not None and not 1 <= int(max_length) <= limit:
            raise ValueError(f"max_length must be in [1, {limit}] (max_model_len {llm.engine.max_model_len} "
                             "leaves room for one generated token)")
        self._max_length = int(max_length) if max_length is not None else limit
        self._max_gen_toks = int(max_gen_toks)
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self.requests_per_call = max(1, int(requests_per_call))
        self.show_progress = show_progress
        self.progress = None  # a rich.progress.Progress to report into (set by `nvllm eval`); else our own bar
        self.progress_prefix = ""
        self.truncated = 0  # requests that lost tokens on the left to fit max_length
        self._device = llm.config.device
        self._chat_template: str | dict[str, str] | None = None  # the tokenizer's, loaded by the first chat prompt
        self._unused_gen_kwargs: set[str] = set()  # generation kwargs already warned about

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "NvllmLM":
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "NvllmLM":
        """--model_args win over lm-eval's own settings; lm-eval's default device (cuda:0) is only a hint
        on a machine without CUDA."""
        import torch

        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        if str(extra.get("device", "")).startswith("cuda") and not torch.cuda.is_available():
            extra.pop("device")
        return cls(**arg_dict, **extra)

    # ---- what TemplateLM asks for ---------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """Conditions the first token of an empty context or of a rolling window: BOS if any, else EOS (as hf)."""
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs) -> list[int]:
        if add_special_tokens is not None:
            kw = {"add_special_tokens": add_special_tokens}
        elif self.add_bos_token is not None:
            kw = {"add_special_tokens": self.add_bos_token}
        else:
            kw = {}
        bos = self.tokenizer.decode(self.prefix_token_id)
        if add_special_tokens is None and bos and string.startswith(bos):
            kw["add_special_tokens"] = False  # the text already carries its BOS
        ids = self.tokenizer.encode(string, **kw)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: list[int] | int, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # ---- chat templates (lm-eval's --apply_chat_template) -------------------------------------------------
    def require_chat_template(self) -> str | dict[str, str]:
        """The template apply_chat_template renders with (``chat_template_of``), loaded once."""
        if self._chat_template is None:
            self._chat_template = chat_template_of(self.tokenizer, self.llm.config.tokenizer or self.llm.config.model)
        return self._chat_template

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text of lm-eval's chat history, rendered as the hf backend renders it (the tokenizer's
        template, each content one string, add_generation_prompt or else continue_final_message; a template that
        refuses a system turn gets the history without it)."""
        from nvllm.chat_template import ChatTemplateError, render_chat

        def render(messages: list[dict[str, str]]) -> str:
            return render_chat(self.tokenizer, self.require_chat_template(), messages, add_generation_prompt,
                               not add_generation_prompt, content_format="string")

        try:
            return render(chat_history)
        except ChatTemplateError:
            if not any(m.get("role") == "system" for m in chat_history):
                raise
            logger.warning("the chat template failed on the chat history; applying it without the system turn")
            return render([m for m in chat_history if m.get("role") != "system"])

    def get_model_info(self) -> dict:
        return {"model_backend": "nvllm", "model_path": self.llm.config.model, "max_length": self.max_length}

    # ---- log-likelihoods ------------------------------------------------------------------------------
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm or self.progress is not None)

    def _loglikelihood_tokens(self, requests: list[tuple[tuple[str, str] | None, list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        answers = self.score_windows([(ctx, cont) for _, ctx, cont in requests], "loglikelihood", disable_tqdm)
        for (key, _, _), answer in zip(requests, answers):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-document log-likelihood over disjoint windows of max_length tokens, as lm-eval's hf backend."""
        strings = [req.args[0] for req in requests]
        per_doc = [self.rolling_windows(self.tok_encode(s)) for s in strings]
        flat = [w for windows in per_doc for w in windows]
        scores = iter(self.score_windows(flat, "loglikelihood_rolling", disable_tqdm))
        totals = []
        for s, windows in zip(strings, per_doc):
            total = sum(next(scores)[0] for _ in windows)
            totals.append(total)
            self.cache_hook.add_partial("loglikelihood_rolling", (s,), total)
        return totals

    def rolling_windows(self, tokens: list[int]) -> list[Window]:
        """Every token scored once: the first window conditions on `prefix_token_id`, the next ones on the
        tokens before them (a full window of max_length inputs for each)."""
        return [make_disjoint_window(w) for w in
                get_rolling_token_windows(token_list=tokens, prefix_token=self.prefix_token_id,
                                          max_seq_len=self.max_length, context_len=1)]

    def score_windows(self, windows: list[Window], label: str = "scoring",
                      disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(sum of log p(continuation | context), whether greedy decoding reproduces the continuation) for each
        window. Inputs longer than max_length + 1 tokens lose tokens on the left, as in the hf backend."""
        prompts: dict[tuple[int, ...], int] = {}  # identical inputs run once; value: positions to keep
        keys = []
        for ctx, cont in windows:
            if not cont or not ctx:
                raise ValueError("a window to score needs at least one context and one continuation token")
            if len(cont) > self.max_length:
                raise ValueError(f"a continuation of {len(cont)} tokens exceeds max_length {self.max_length}")
            key = tuple((ctx + cont)[-(self.max_length + 1):])
            self.truncated += len(ctx) + len(cont) > len(key)
            prompts[key] = max(prompts.get(key, 0), len(cont))
            keys.append((key, len(cont)))
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        scored: dict[tuple[int, ...], list[tuple[float, int]]] = {}
        items = list(prompts.items())
        with self._track(label, len(items), disable_tqdm) as advance:
            for i in range(0, len(items), self.requests_per_call):
                chunk = items[i:i + self.requests_per_call]
                outs = self.llm.generate([list(k) for k, _ in chunk], params, use_tqdm=False,
                                         lora_request=self.lora_request)
                for (key, keep), out in zip(chunk, outs):
                    tail = range(len(key) - keep, len(key))
                    scored[key] = [(lp[key[p]].logprob, lp[key[p]].rank)
                                   for p, lp in zip(tail, out.prompt_logprobs[-keep:])]
                advance(len(chunk))
        answers = []
        for key, n in keys:
            pos = scored[key][-n:]
            answers.append((float(sum(lp for lp, _ in pos)), all(rank == 1 for _, rank in pos)))
        return answers

    # ---- generation -----------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        prompts, params, stops = [], [], []
        for req in requests:
            context, gen_kwargs = req.args
            kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen = int(kwargs.pop("max_gen_toks"))
            max_ctx = self.max_length - max_gen
            if max_ctx <= 0:
                raise ValueError(f"max_gen_toks {max_gen} leaves no room for the prompt in max_length "
                                 f"{self.max_length}")
            ids = self.tok_encode(context) or [self.prefix_token_id]
            self.truncated += len(ids) > max_ctx
            ids = ids[-max_ctx:]
            prompts.append(ids)
            params.append(self.sampling_params(kwargs, max_gen, until))
            stops.append(until)
        texts: list[str] = []
        with self._track("generate_until", len(prompts), disable_tqdm) as advance:
            for i in range(0, len(prompts), self.requests_per_call):
                outs = self.llm.generate(prompts[i:i + self.requests_per_call],
                                         params[i:i + self.requests_per_call], use_tqdm=False,
                                         lora_request=self.lora_request)
                for out in outs:
                    # decode the generated ids and cut at the first stop string, as the hf backend does
                    text = self.tok_decode(out.outputs[0].token_ids, params[len(texts)].skip_special_tokens)
                    texts.append(postprocess_generated_text(text, stops[len(texts)], None))
                advance(len(outs))
        for req, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts

    def sampling_params(self, kwargs: dict[str, Any], max_gen: int, until: list[str]) -> SamplingParams:
        """A request's SamplingParams: greedy unless do_sample (then the kwargs' temperature), every other kwarg that
        is a SamplingParams field passed on as vLLM's backend passes it (repetition_penalty, top_p, seed, ...); the
        others (HF-only ones such as num_beams) are ignored, with one warning naming them."""
        sample, temperature = bool(kwargs.pop("do_sample", False)), float(kwargs.pop("temperature", 0.0))
        unused = sorted(set(kwargs) - _SAMPLING_KEYS - self._unused_gen_kwargs)
        if unused:
            self._unused_gen_kwargs.update(unused)
            logger.warning("ignoring generation kwargs that are not nvllm sampling parameters: %s", ", ".join(unused))
        return SamplingParams(temperature=temperature if sample else 0.0, max_tokens=max_gen,
                              stop=[u for u in until if u], **{k: v for k, v in kwargs.items() if k in _SAMPLING_KEYS})

    # ---- progress -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _track(self, label: str, total: int, disable: bool) -> Iterator:
        if self.progress is not None:
            task = self.progress.add_task(self.progress_prefix + label, total=total)
            yield lambda n: self.progress.advance(task, n)
            return
        if disable or not self.show_progress or total == 0:
            yield lambda n: None
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from nvllm.logger import console

        with Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console(), transient=True) as bar:
            task = bar.add_task(label, total=total)
            yield lambda n: bar.advance(task, n)
