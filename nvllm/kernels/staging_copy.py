"""A decode step's staged inputs moved into the CUDA graph's buffers by a kernel, not by the copy engine.

Between two decode steps the graph's inputs (token ids, positions, slots, context lengths, block tables; one byte
buffer, ``cuda_graph.staging_views``) used to arrive by a host-to-device copy in stream order after the previous
step's argmax, then the sampled tokens by a device-to-device copy. Copy-engine work starts late after the kernel
it follows: on the H200 the two copies put 21.5 µs between the argmax's end and the next step's first kernel
(PERF.md session 13, run CF). Now the host's copy lands in a second device buffer on a side stream as soon as the
host has staged it, while the previous step still runs, and one kernel in stream order moves it into the graph's
buffer with the sampled tokens over the ids' place: 4.4 µs from the argmax's end to the next step (run CG).

``staging_copy_reference`` is the torch reference.
"""

from __future__ import annotations

import torch

from nvllm.kernels.backend import eager_triton

triton, tl, _jit = eager_triton()  # jitted at import (the CPU tests reload under the interpreter)

BLOCK = 1024


@_jit
def _staging_copy_kernel(src_ptr, dst_ptr, ids_ptr, n_words, id_words, BLOCK: tl.constexpr):
    """int32 words ``0 .. n_words`` of ``src`` into ``dst``; the first ``id_words`` from ``ids`` instead."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    from_ids = i < id_words
    w = tl.load(src_ptr + i, mask=(i < n_words) & ~from_ids, other=0)
    w = tl.where(from_ids, tl.load(ids_ptr + i, mask=from_ids, other=0), w)
    tl.store(dst_ptr + i, w, mask=i < n_words)


def _words(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype != torch.int32 else t


def staging_copy(src: torch.Tensor, dst: torch.Tensor, nbytes: int, ids: torch.Tensor | None = None) -> None:
    """``dst[:nbytes] = src[:nbytes]`` (uint8 buffers, ``nbytes`` a multiple of 4), then the int64 token ``ids``
    over ``dst``'s first ``8 · len(ids)`` bytes (the staging layout puts the ids first), in one kernel."""
    assert src.dtype == dst.dtype == torch.uint8 and nbytes % 4 == 0 and nbytes <= min(src.numel(), dst.numel())
    n_words = nbytes // 4
    if ids is not None:
        ids = ids.to(torch.int64).reshape(-1)
        if ids.stride(0) != 1:   # (a one-element column keeps its parent's stride: contiguous() would return it)
            ids = ids.clone(memory_format=torch.contiguous_format)
        assert 8 * ids.numel() <= nbytes
    id_words = 0 if ids is None else 2 * ids.numel()
    if n_words == 0:
        return
    sw, dw = _words(src[:nbytes]), _words(dst[:nbytes])
    iw = _words(ids) if ids is not None and ids.numel() else dw
    _staging_copy_kernel[(triton.cdiv(n_words, BLOCK),)](sw, dw, iw, n_words, id_words, BLOCK=BLOCK, num_warps=4)


def staging_copy_reference(src: torch.Tensor, dst: torch.Tensor, nbytes: int,
                           ids: torch.Tensor | None = None) -> None:
    dst[:nbytes].copy_(src[:nbytes])
    if ids is not None and ids.numel():
        dst[:8 * ids.numel()].view(torch.int64).copy_(ids.to(torch.int64))
