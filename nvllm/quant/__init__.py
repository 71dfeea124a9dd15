"""Quantization: checkpoint formats (AWQ-GEMM, GPTQ v1, compressed-tensors, FP8) and the quantizers that write them."""
