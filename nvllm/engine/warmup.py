"""Engine warm-up: every kernel variant a prefill of up to 256 tokens picks is compiled before the first users'
requests (Triton builds one per tile choice, ~1 s each on first use), then the kernel report is printed."""

from __future__ import annotations

from nvllm.kernels import report
from nvllm.sampling_params import SamplingParams


def warm_up(engine) -> None:
    """Short requests through ``engine`` (an LLMEngine), one at a time, with prompts of 2, 4, 8, … 256 tokens (one
    verified speculative step too when speculation is on), every prompt computed in full (prefix caching off
    meanwhile); then the kernel report. The caller resets its statistics after."""
    report.reset()
    extra = 0 if engine.spec is None else engine.spec.spec_config.num_speculative_tokens
    limit = min(engine.max_model_len - 2 - extra, engine.config.max_num_batched_tokens, 256)
    lengths = [n for n in (2, 4, 8, 16, 32, 64, 128, 256) if n <= limit] or [1]
    bm = engine.block_manager
    caching, bm.enable_prefix_caching = bm.enable_prefix_caching, False
    try:
        for i, n in enumerate(lengths):
            engine.add_request(f"warmup-{i}", [engine.tokenizer.bos_token_id or 0] * n,
                               SamplingParams(max_tokens=2 + extra, temperature=0.0, ignore_eos=True))
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        bm.enable_prefix_caching = caching
    from nvllm.logger import console

    console().print(report.format_table())
