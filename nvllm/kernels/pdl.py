"""Programmatic dependent launch (PDL) for the kernels of a decode step.

A batch-1 decode step is ~290 short kernels; between two of them the GPU drains one grid, flushes its writes
and only then starts scheduling the next (≈ 0.6 µs per boundary on the H200 inside a CUDA graph, by
subtraction from run K's profile). On Hopper and newer a kernel launched with the programmatic-stream-
serialization attribute may start while its predecessor is still finishing: its programs begin once every
program of the predecessor has signalled (``gdc_launch_dependents``) or exited, and they must wait
(``gdc_wait``: the predecessor complete, its writes visible) before they touch anything it wrote. CUDA graphs
capture the relation as a programmatic edge.

Every kernel here that takes ``PDL`` does, first thing when it is set::

    tl.extra.cuda.gdc_wait()                 # the previous kernel has completed; its writes are visible
    tl.extra.cuda.gdc_launch_dependents()    # the next kernel may start scheduling its programs

so nothing is read or written before the predecessor is done (the correctness of a plain launch), and the
next kernel's launch overlaps this one's run. The exceptions read, before the wait, only what the kernel just
before them cannot be writing: the skinny GEMM's weights (``EARLY_W``), the decode GEMVs' first weights (asked of
L2, ``prefetch``; a one-step split's words, scales and zeros into registers, ``quant_gemv_half2`` ``EARLY``),
decode attention's keys and values of earlier steps (``fresh_tokens``), RMSNorm's weight and rope_store's positions,
cos/sin rows and cache slots (``early_params``). A kernel launched
without the attribute (torch's own, cuBLAS) waits as usual; one launched with it but not waiting would race, so
``launch_args`` ties the two together.

Reading before the wait what the kernel two or more launches back wrote is safe: the kernel just before has passed
its own wait (every kernel here waits before it lets the next one start), so those writes are complete and visible.

``NVLLM_PDL``: ``0`` off; otherwise on where supported (compute capability 9.0+, a Triton with ``launch_pdl``).
It is read at each launch: engines built while it is ``0`` capture their graphs without PDL (the GPU benchmark
compares both).
"""

from __future__ import annotations

import functools
import os

import torch


@functools.lru_cache(maxsize=None)
def _supported(device_index: int) -> bool:
    try:
        import dataclasses

        import triton.language as tl
        from triton.backends.nvidia.compiler import CUDAOptions

        has_option = any(f.name == "launch_pdl" for f in dataclasses.fields(CUDAOptions))
        has_ops = hasattr(tl.extra.cuda, "gdc_wait") and hasattr(tl.extra.cuda, "gdc_launch_dependents")
    except Exception:
        return False
    return has_option and has_ops and torch.cuda.get_device_capability(device_index) >= (9, 0)


def enabled(t: torch.Tensor) -> bool:
    """Whether kernels launched on ``t``'s device use PDL."""
    if not t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return os.environ.get("NVLLM_PDL", "1").lower() not in ("0", "off") and _supported(index)


def launch_args(t: torch.Tensor) -> dict:
    """Keyword arguments for a launch of a kernel that takes ``PDL``: the constexpr and the launch attribute,
    always together."""
    return {"PDL": True, "launch_pdl": True} if enabled(t) else {"PDL": False}


def early_params() -> bool:
    """Whether RMSNorm and rope_store read, before the PDL wait, what no kernel of the step writes just before them
    (``NVLLM_PDL_EARLY_PARAMS=0``: after it, as every other read). Read at each launch, like ``NVLLM_PDL``."""
    return os.environ.get("NVLLM_PDL_EARLY_PARAMS", "1").lower() not in ("0", "off")
