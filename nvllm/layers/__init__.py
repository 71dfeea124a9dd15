"""Model building blocks. Each layer owns its parameters and calls a dispatcher in nvllm.kernels."""
