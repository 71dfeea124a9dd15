"""Compute kernels. Each file holds one op: its Triton kernel (where there is one), the torch reference beside
it, and the dispatch that picks between them and records the choice in the kernel report."""
