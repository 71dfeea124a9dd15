"""Quantization: checkpoint formats (AWQ-GEMM, GPTQ) and the quantizers that write them."""
