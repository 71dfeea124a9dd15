"""SpecDecoder: what the engine drives when `speculative` is set.

Per step: the scheduler asks `lookahead(seq)` how many extra positions to reserve for each decoding sequence
(the budget and the block reservation count them); `propose` fills them with drafted tokens (a draft model's
still on the device); the target runner scores the last real token plus the drafts as one chunk per sequence;
the engine reads the drafts (`Drafts.read`) and `verify` runs the rejection sampler on those k+1 rows; the
engine appends the emitted tokens one by one (stop conditions cut a run short) and calls `after_verify`, which
rolls the draft's cache count back to what was accepted and tunes k=auto.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from nvllm.config import ConfigError, EngineConfig
from nvllm.engine.sequence import Sequence
from nvllm.engine.stop_checker import min_tokens_banned
from nvllm.layers.attention import KVCacheTooLarge
from nvllm.spec.adaptive import AdaptiveK
from nvllm.spec.config import SpeculativeConfig
from nvllm.spec.proposer import DraftModelProposer, Drafts, NgramProposer, Proposal
from nvllm.spec.rejection_sampler import RejectionSampler, VerifyRequest, VerifyResult

logger = logging.getLogger("nvllm")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def check_draft_vocab(draft_dir: str, draft_vocab: int, target_vocab: int, tokenizer) -> bool:
    """Draft and target must speak the same vocabulary: the same token → id map (when the draft ships a
    tokenizer) and a logit width covering every token. Returns whether the draft has its own tokenizer."""
    from nvllm.engine.tokenizer import load_tokenizer

    has_tok = any(os.path.isfile(os.path.join(draft_dir, f)) for f in _TOKENIZER_FILES)
    if has_tok:
        own, theirs = tokenizer.get_vocab(), load_tokenizer(draft_dir).get_vocab()
        if own != theirs:
            diff = sum(1 for t, i in theirs.items() if own.get(t) != i) + sum(1 for t in own if t not in theirs)
            raise ConfigError(f"the draft model's tokenizer differs from the target's ({len(theirs)} vs "
                              f"{len(own)} tokens, {diff} differ): speculative decoding needs one vocabulary")
    elif draft_vocab != target_vocab:
        raise ConfigError(f"the draft model has no tokenizer to compare and its vocab_size {draft_vocab} differs "
                          f"from the target's {target_vocab}")
    if draft_vocab != target_vocab and draft_vocab < min(target_vocab, len(tokenizer)):
        raise ConfigError(f"the draft model's vocab_size {draft_vocab} does not cover the target's vocabulary "
                          f"({min(target_vocab, len(tokenizer))} tokens)")
    return has_tok


def load_draft_runner(config: EngineConfig, target, tokenizer):
    """The draft's ModelRunner: same block count and block size as the target's cache, same device (rank 0's
    under tensor parallelism: the draft is not split), dtype rule, KV-cache dtype and seed; its own
    max_model_len (sequences longer than it decode without drafts; the engine keeps the target's). No LoRA:
    adapters change the target alone, whose verification keeps each request's output its adapter's."""
    from nvllm.engine.model_runner import ModelRunner
    from nvllm.models.hub import resolve_model_path
    from nvllm.models.loader import load_hf_config, model_len_limit

    spec: SpeculativeConfig = config.speculative
    path = resolve_model_path(spec.draft_model)
    hf = load_hf_config(path)
    has_tok = check_draft_vocab(path, hf.vocab_size, target.model.shape.vocab_size, tokenizer)
    limit = model_len_limit(hf, warn=False)
    draft_config = dataclasses.replace(  # the draft runs whole on rank 0, also when the target is split
        config, model=path, tokenizer=path if has_tok else config.tokenizer, num_kv_blocks=target.num_blocks,
        kv_cache_memory=None, max_model_len=min(target.max_model_len, limit), speculative=None, hf_overrides={},
        quantization=None, revision=None, tokenizer_revision=None,  # the target's, not the draft's
        tensor_parallel_size=1, enable_lora=False)  # LoRA adapters are the target's: the draft proposes without
    try:
        return ModelRunner(draft_config, draft=True)
    except (torch.cuda.OutOfMemoryError, KVCacheTooLarge):  # its weights, or the cache as large as the target's
        per_token_t = target.kv_bytes_per_token
        per_token_d = 2 * hf.num_hidden_layers * (getattr(hf, "num_key_value_heads", None) or
                                                  hf.num_attention_heads) * \
            (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads) * 2
        fit = target.num_blocks * per_token_t // (per_token_t + per_token_d)
        raise ConfigError(f"no GPU memory left for the draft model and its {target.num_blocks}-block KV cache; "
                          f"pass --num-kv-blocks (about {fit}) or lower --gpu-memory-utilization") from None


class SpecDecoder:
    def __init__(self, config: EngineConfig, target, tokenizer, eos_token_ids: set[int]):
        sc: SpeculativeConfig = config.speculative
        self.spec_config = sc
        self.eos_token_ids = eos_token_ids
        self.vocab_size = target.model.shape.vocab_size
        self.adaptive = AdaptiveK(start=sc.num_speculative_tokens) if sc.auto else None
        self.sampler = RejectionSampler(config.seed, sc.synthetic_acceptance)
        if sc.synthetic_acceptance is not None:
            logger.warning("speculative decoding in BENCHMARK MODE: every drafted token is accepted with "
                           "probability %g whatever the models say; outputs do NOT follow the target model",
                           sc.synthetic_acceptance)
        self.device = target.device
        self.max_model_len = target.max_model_len
        self.draft_limit = self.max_model_len   # positions the draft takes: longer sequences decode without drafts
        self.draft_runner = None
        self._pending: dict[int, list[int]] = {}  # n-gram proposals made while scheduling
        self.drafting = True  # False in a step that disable_by_batch_size turns speculation off for
        if sc.method == "draft":
            self.draft_runner = load_draft_runner(config, target, tokenizer)
            self.draft_limit = self.draft_runner.max_model_len
            if self.draft_limit < self.max_model_len:
                logger.warning("speculative decoding: the draft model takes %d positions; sequences longer than "
                               "that decode without drafts (max_model_len %d)", self.draft_limit, self.max_model_len)
            self.proposer = DraftModelProposer(self.draft_runner, self.vocab_size, self.banned,
                                               chain_k=0 if sc.auto else sc.num_speculative_tokens,
                                               paused=lambda seq: bool(seq.spec_state and seq.spec_state.paused))
        else:
            self.proposer = NgramProposer(sc.prompt_lookup_min, sc.prompt_lookup_max)
        logger.info("speculative decoding: %s", sc.describe())

    # ---- scheduling ------------------------------------------------------------------------------------
    def banned(self, seq: Sequence) -> tuple[int, list[int]]:
        """(how many upcoming outputs are still under min_tokens, the token ids banned for them)."""
        p = seq.params
        rows = p.min_tokens - seq.num_output_tokens
        if rows <= 0:
            return 0, []
        return rows, min_tokens_banned(seq, self.eos_token_ids)

    def target_k(self, seq: Sequence) -> int:
        if self.adaptive is None:
            return self.spec_config.num_speculative_tokens
        if seq.spec_state is None:
            seq.spec_state = self.adaptive.new_state()
        return self.adaptive.k_now(seq.spec_state)

    def begin_step(self, num_running: int) -> None:
        """Before scheduling: a batch of ``disable_by_batch_size`` running sequences or more decodes plainly."""
        limit = self.spec_config.disable_by_batch_size
        drafting = limit is None or num_running < limit
        if drafting != self.drafting:
            logger.debug("speculative decoding %s at %d running sequences", "resumed" if drafting else "paused",
                         num_running)
        self.drafting = drafting

    def lookahead(self, seq: Sequence) -> int:
        """Drafted positions to reserve for a decoding sequence this step (0: decode plainly). Never more
        than the request can still use: the step emits up to k + 1 tokens."""
        if seq.wants_prompt_logprobs or not self.drafting:
            return 0
        k = min(self.target_k(seq), self.draft_limit - seq.num_tokens - 1)
        if seq.params.max_tokens is not None:
            k = min(k, seq.params.max_tokens - seq.num_output_tokens - 1)
        if k <= 0:
            return 0
        if isinstance(self.proposer, NgramProposer):  # cheap and exact: propose now, reserve what was found
            drafts = self.proposer.propose_one(seq.token_ids, k)
            self._pending[id(seq)] = drafts
            return len(drafts)
        return k

    def propose(self, scheduled: list[tuple[Sequence, int]]) -> tuple[list[tuple[Sequence, int]], Drafts]:
        """Drafts for the sequences the scheduler gave extra positions; the chunks resized to what was drafted.
        A draft model's tokens are not read here: their count is the plan's."""
        plan = {id(seq): n - (seq.num_tokens - seq.num_computed_tokens) for seq, n in scheduled
                if seq.num_computed_tokens + n > seq.num_tokens}
        if isinstance(self.proposer, NgramProposer):
            drafts = Drafts({i: Proposal(self._pending[i][:k]) for i, k in plan.items()})  # the budget may cut k
            self._pending.clear()
        elif not self.drafting:  # paused: the draft's cache falls behind and catches up when drafting resumes
            return list(scheduled), Drafts()
        else:  # the draft model also mirrors this step's prefill chunks, so it runs even without a plan
            drafts = self.proposer.propose(scheduled, plan, self.sampler.generator(self.device))
        drafts.proposals = {i: p for i, p in drafts.proposals.items() if p.ids}
        out = []
        for seq, n in scheduled:
            if id(seq) in plan:
                p = drafts.proposals.get(id(seq))
                n = seq.num_tokens - seq.num_computed_tokens + (len(p.ids) if p is not None else 0)
            out.append((seq, n))
        return out, drafts

    # ---- verification ----------------------------------------------------------------------------------
    def verify(self, logits: torch.Tensor, entries: list[tuple[Sequence, Proposal]]) -> list[VerifyResult]:
        """The proposals' ids must be on the host (``Drafts.read()``)."""
        reqs = []
        for seq, p in entries:
            assert min(p.ids) >= 0, "drafted ids still on the device: Drafts.read() first"
            rows, ids = self.banned(seq)
            reqs.append(VerifyRequest(seq.params, seq.generator, p.ids, p.probs, rows, ids,
                                      seq.token_ids if seq.params.penalized else None, seq.num_prompt_tokens,
                                      None if seq.grammar_waits else seq.grammar, seq.params.allowed_token_ids,
                                      seq.bad_words, seq.output_token_ids if seq.bad_words else None))
        return self.sampler(logits, reqs)

    def after_verify(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """``accepted``: the accepted drafts the engine kept (fewer than verification accepted where a structured
        outputs constraint began inside the run: the rest is drawn again under it)."""
        if self.adaptive is not None and seq.spec_state is not None:
            self.adaptive.update(seq.spec_state, drafted, accepted)
        if self.draft_runner is not None:
            DraftModelProposer.after_verify(seq, drafted, accepted)
