"""One-shot all-reduce over symmetric memory, for the small all-reduces of tensor-parallel decoding.

Each rank copies its tensor into a buffer every rank of the group has mapped (PyTorch's symmetric memory: CUDA
IPC, peer-to-peer loads over NVLink, no multicast), the ranks meet at a barrier, and each reads every peer's copy
and sums it — one kernel (``symm_mem::one_shot_all_reduce_copy_out``), with a closing barrier so no rank refills
its buffer while a peer still reads it. On the H200 pair it took 7.4–7.5 µs per all-reduce of one token's hidden
state inside a CUDA graph where NCCL took 16.1–16.8 µs (scripts/gpu_allreduce_bench.py, docs/PERF.md run V);
a Llama-3-70B decode step runs 160 of them.

Tensors up to ``MAX_BYTES`` take this path; larger ones (prefill) stay on NCCL, whose ring uses the links'
bandwidth better. Every rank decides from the tensor's dtype and size alone, so all ranks take the same path."""

from __future__ import annotations

import torch

MAX_BYTES = 1 << 20
"""Largest all-reduce taken one-shot: a batch of 64 tokens of an 8192-wide bf16 hidden state (14.3 µs against
NCCL's 25.2 µs in the same run)."""
ALIGN = 16  # the kernel's widest vector access; the buffer and the local tensor must share it


class OneShotAllReduce:
    def __init__(self, name: str, rank: int, size: int, store, backend, dtype: torch.dtype, device: torch.device):
        """Map one MAX_BYTES buffer of ``dtype`` on every rank (a collective: every rank calls it). ``backend``: the
        group's NCCL backend, registered under ``name`` (new in this process, the same on every rank) for
        symmetric memory to find; ``store``: where the ranks exchange their buffers' handles. Raises when the
        platform has no symmetric memory or no peer access."""
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem
        from torch._C._distributed_c10d import _register_process_group, _SymmetricMemory

        group = dist.ProcessGroup(store, rank, size)
        group._register_backend(device, dist.ProcessGroup.BackendType.NCCL, backend)
        group._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
        group._set_group_name(name)
        _register_process_group(name, group)
        _SymmetricMemory.set_group_info(name, rank, size, store)
        self.name, self.group = name, group
        self.buffer = symm_mem.empty(MAX_BYTES // torch.empty((), dtype=dtype).element_size(), dtype=dtype,
                                     device=device)
        symm_mem.rendezvous(self.buffer, name)

    def close(self) -> None:
        from torch._C._distributed_c10d import _unregister_process_group

        _unregister_process_group(self.name)

    def takes(self, t: torch.Tensor) -> bool:
        nbytes = t.numel() * t.element_size()
        return t.dtype == self.buffer.dtype and 0 < nbytes <= MAX_BYTES and nbytes % ALIGN == 0

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of ``t`` over the ranks, as a new tensor (``takes(t)`` must hold)."""
        t = t.contiguous()
        if t.data_ptr() % ALIGN:
            t = t.clone()
        out = torch.empty_like(t)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(self.buffer[:t.numel()].view(t.shape), t, "sum",
                                                        self.name, out)
        return out
