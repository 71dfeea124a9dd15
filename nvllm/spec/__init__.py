"""Speculative decoding: proposers (a draft model, n-gram lookup), lossless rejection sampling, k=auto, and
the acceptance counters. `SpecDecoder` is what the engine drives."""

from nvllm.spec.config import SpeculativeConfig, parse_speculative

__all__ = ["SpeculativeConfig", "parse_speculative"]
