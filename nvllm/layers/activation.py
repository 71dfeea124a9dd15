"""SiLU(gate) · up on the fused gate_up projection's output (nvllm/kernels/activation.py holds the Triton
kernel and the torch reference)."""

from __future__ import annotations

from nvllm.kernels.activation import silu_and_mul

__all__ = ["silu_and_mul"]
