"""From a request to its sequences: the prompt tokenized or checked (and truncated as asked), the sampling parameters
checked against the model (vocabulary, max_model_len; a structured outputs constraint compiled), then one Sequence
per sample with what the sampler and the detokenizer keep for it (seeded generator, grammar matcher, bad words,
logprob lists). Nothing here changes the engine's state: a bad request is a ValueError before anything is queued."""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Sequence as Seq

import torch

from nvllm.engine.block_manager import prefix_salt
from nvllm.engine.detokenizer import IncrementalDetokenizer
from nvllm.engine.sequence import Sequence
from nvllm.engine.structured_output import StructuredOutputs
from nvllm.engine.think_or_constraint import ThinkOrConstraint
from nvllm.layers.token_masks import bad_words_token_ids
from nvllm.outputs import RequestMetrics
from nvllm.sampling_params import SamplingParams


class Admission:
    def __init__(self, tokenizer, vocab_size: int, structured: StructuredOutputs, reasoning, device: torch.device,
                 max_logprobs: int | None = None):
        self.tokenizer, self.vocab_size, self.structured = tokenizer, vocab_size, structured
        self.reasoning, self.device = reasoning, device
        self.max_logprobs = max_logprobs  # the engine's cap on logprobs / prompt_logprobs (None, -1: none)

    @functools.cached_property
    def _think_open_id(self) -> int | None:
        """The token that opens a reasoning block, where the tokenizer has one (Qwen3's ``<think>``); a model that
        spells it in several tokens cannot open one in its first token, and its reply is constrained from the
        start. Asked once, by the first constrained request that could open a block."""
        from nvllm.reasoning_parsers import START

        ids = self.tokenizer.encode(START, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def tokenize(self, prompt: str | Seq[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty")
            ids = self.tokenizer.encode(prompt)
            if not ids:  # a sequence needs a token to start from (an empty tokenizer's, or one that drops the text)
                raise ValueError(f"the prompt {prompt[:40]!r} tokenizes to no tokens")
            return ids
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        odd = next((t for t in prompt if not isinstance(t, numbers.Integral) or isinstance(t, bool)), None)
        if odd is not None:
            raise ValueError(f"prompt token ids must be integers, got {odd!r}")
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")
        return ids

    def validate(self, prompt: str | Seq[int], params: SamplingParams, max_model_len: int) -> list[int]:
        """The prompt's token ids, or ValueError naming what makes this request unservable."""
        ids = self.tokenize(prompt)
        if params.truncate_prompt_tokens is not None:  # the last k (-1: all that leave room for one token)
            keep = params.truncate_prompt_tokens
            ids = ids[-(max_model_len - 1 if keep == -1 else keep):]
        if len(ids) >= max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {max_model_len} "
                             "(room for at least one generated token is needed)")
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"stop token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(params, name)
            if (asked or 0) > self.vocab_size:
                raise ValueError(f"{name} must be at most the vocabulary size {self.vocab_size}, got {asked}")
            if self.max_logprobs not in (None, -1) and (self.vocab_size if asked == -1 else asked or 0) > \
                    self.max_logprobs:
                whole = f" (the whole vocabulary, {self.vocab_size})" if asked == -1 else ""
                raise ValueError(f"{name} must be at most max_logprobs {self.max_logprobs}, got {asked}{whole}")
        for name in ("logit_bias", "allowed_token_ids"):
            bad = [t for t in getattr(params, name) or () if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name} token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")
        if params.bad_words:  # a tokenizer may know more tokens than the model scores (vLLM refuses them too)
            bad = [t for ids in bad_words_token_ids(params.bad_words, self.tokenizer) for t in ids
                   if t >= self.vocab_size]
            if bad:
                raise ValueError(f"bad_words tokenize to token id {bad[0]}, outside the model's vocabulary (size "
                                 f"{self.vocab_size})")
        if params.structured_outputs is not None:
            self.structured.compile(params.structured_outputs)
        return ids

    def sequences(self, request_id: str, ids: list[int], params: SamplingParams, metrics: RequestMetrics,
                  lora_digest: bytes | None, lora_id: int, cache_salt: str | None) -> list[Sequence]:
        """The request's n sequences (``lora_digest``, ``lora_id``: its adapter's digest and id, None and 0 for none;
        ``cache_salt``: its own prefix-cache salt). A
        logprobs count of -1 (vLLM's: the whole vocabulary) becomes the vocabulary's size here, once."""
        whole = {name: self.vocab_size for name in ("logprobs", "prompt_logprobs") if getattr(params, name) == -1}
        params = dataclasses.replace(params, **whole) if whole else params
        salt = prefix_salt(lora_digest, cache_salt)
        seqs = []
        bad_words = bad_words_token_ids(params.bad_words, self.tokenizer) if params.bad_words else None
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(params.seed + i)
            seq = Sequence(request_id, i, list(ids), len(ids), params, metrics, gen)
            if params.detokenize:
                seq.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
            seq.cache_salt, seq.request_cache_salt, seq.lora_id = salt, cache_salt, lora_id
            seq.bad_words = bad_words
            if params.structured_outputs is not None:
                seq.grammar = self.structured.matcher(params.structured_outputs)
                seq.grammar_waits = self.reasoning is not None and self.reasoning.constraint_waits(self.tokenizer, ids)
                if seq.grammar_waits and self.reasoning.opens_itself:  # the first token decides (qwen3)
                    open_id = self._think_open_id
                    seq.grammar_waits = False
                    if open_id is not None:
                        seq.grammar = ThinkOrConstraint(seq.grammar, open_id)
            if params.logprobs is not None:
                seq.logprobs = []
            if params.prompt_logprobs is not None:
                seq.prompt_logprobs = [None]
            seqs.append(seq)
        return seqs
