"""LoRA adapters applied per token from stacked slots, in two launches a linear: what a CUDA graph can hold.

The adapters on the device sit in fixed slots of one stack per linear (``LoRALinear``): A ``[slots, R, in]``, B
``[slots, out, R]``, each slot's first ``ranks[s]`` rows of A (columns of B) holding its adapter, the rest unread.
A step's tokens name their slot (``slots[t]``, −1: the base model), so one pair of kernels serves every adapter in
the batch and the launch does not depend on which adapters run — the shape vLLM's punica kernels have:

* ``shrink``: ``xa[t] = A[slots[t]] x[t]`` (fp32), K split in chunks (``launch_sizes``) over a second grid axis so
  that one token's row still spreads over many SMs; each chunk writes its partial to a workspace.
* ``expand``: ``y[t] += B[slots[t]] xa[t]``, summing the chunks' partials as it reads them, in fp32, rounded once
  into ``y`` (the base linear's finished output, changed in place).

Both take ``PDL`` (nvllm.kernels.pdl): inside a decode step's chain they wait for the base linear, not for the
launch gap; the expand reads all chunks' partials of a rank step in one load. Programs of base-model tokens return
at once. The per-token programs reread their slot's A from L2 for every
token, which suits decode batches; the engine's prefill steps use the per-adapter matmuls of ``LoRALinear``.
``lora_apply_reference`` is the torch reference: one masked matmul pair per slot, graph-safe as well.
"""

from __future__ import annotations

import torch

from nvllm.kernels import pdl, report
from nvllm.kernels.backend import eager_triton, use_triton

triton, tl, _jit = eager_triton()  # jitted at import (the CPU tests reload under the interpreter)

R_STEP = 32  # ranks per step of the expand's loop (it runs up to the slot's rank only)
K_CHUNK: int | None = None  # fixed sizes (scripts/gpu_lora_bench.py sweeps them); None: launch_sizes
BLOCK_N: int | None = None


def launch_sizes(tokens: int, k: int) -> tuple[int, int]:
    """(inputs per shrink program, outputs per expand program) for ``tokens`` rows of a linear of ``k`` inputs: the
    best of the sizes measured at a 7B's projections on the H200 (docs/PERF.md run EE). Up to 8 rows, short inputs
    go in chunks of 256 (14 programs a row for 3584), which spreads a row over more SMs; longer inputs (down_proj's
    18944) and larger batches in chunks of 512, with wider expand programs, which then sum fewer copies of the
    chunks' partials."""
    return (256, 64) if tokens <= 8 and k <= 4096 else (512, 128)


@_jit
def _shrink_kernel(x_ptr, a_ptr, slot_ptr, rank_ptr, ws_ptr, T, K, stride_x, stride_as, stride_ar,
                   K_CHUNK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0)
    chunk = tl.program_id(1)
    s = tl.load(slot_ptr + t).to(tl.int32)
    if s >= 0:
        rank = tl.load(rank_ptr + s)
        r = tl.arange(0, BLOCK_R)
        a_rows = a_ptr + s.to(tl.int64) * stride_as + r[:, None].to(tl.int64) * stride_ar
        x_row = x_ptr + t.to(tl.int64) * stride_x
        acc = tl.zeros((BLOCK_R,), tl.float32)
        for k0 in range(chunk * K_CHUNK, tl.minimum(chunk * K_CHUNK + K_CHUNK, K), BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            in_k = k < K
            x = tl.load(x_row + k, mask=in_k, other=0.0).to(tl.float32)
            a = tl.load(a_rows + k[None, :], mask=(r[:, None] < rank) & in_k[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
        tl.store(ws_ptr + (chunk * T + t).to(tl.int64) * BLOCK_R + r, acc)


@_jit
def _expand_kernel(y_ptr, b_ptr, slot_ptr, rank_ptr, ws_ptr, T, N, chunks, stride_y, stride_bs, stride_bn,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, R_STEP: tl.constexpr, BLOCK_C: tl.constexpr,
                   PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    s = tl.load(slot_ptr + t).to(tl.int32)
    if s >= 0:
        rank = tl.load(rank_ptr + s)
        in_n = n < N
        b_rows = b_ptr + s.to(tl.int64) * stride_bs + n[:, None].to(tl.int64) * stride_bn
        acc = tl.zeros((BLOCK_N,), tl.float32)
        for r0 in range(0, rank, R_STEP):
            r = r0 + tl.arange(0, R_STEP)
            in_r = r < rank
            c = tl.arange(0, BLOCK_C)  # every chunk's partial in one load: one latency, not one a chunk
            parts = tl.load(ws_ptr + (c[:, None] * T + t).to(tl.int64) * BLOCK_R + r[None, :],
                            mask=(c[:, None] < chunks) & in_r[None, :], other=0.0)
            xa = tl.sum(parts, axis=0)
            b = tl.load(b_rows + r[None, :], mask=in_n[:, None] & in_r[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(b * xa[None, :], axis=1)
        y_row = y_ptr + t.to(tl.int64) * stride_y + n
        y = tl.load(y_row, mask=in_n, other=0.0).to(tl.float32)
        tl.store(y_row, (y + acc).to(y_ptr.dtype.element_ty), mask=in_n)


def lora_apply_reference(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ranks: torch.Tensor,
                         slots: torch.Tensor) -> torch.Tensor:
    """``y[t] += B[s][:, :ranks[s]] (A[s][:ranks[s]] x[t])`` for each token t of slot s = ``slots[t]`` ≥ 0 (fp32,
    rounded once into y's dtype; tokens of slot −1 unchanged). y [T, out], x [T, in], a [S, R, in], b [S, out, R],
    ranks [S], slots [T]. Changes and returns y."""
    r = torch.arange(a.shape[1], device=a.device)
    delta = torch.zeros(y.shape, dtype=torch.float32, device=y.device)
    for s in range(a.shape[0]):
        keep = r < ranks[s]
        xa = x.float() @ torch.where(keep[:, None], a[s].float(), 0.0).T
        part = xa @ torch.where(keep[None, :], b[s].float(), 0.0).T
        delta += torch.where((slots == s)[:, None], part, 0.0)
    return y.copy_((y.float() + delta).to(y.dtype))


def lora_apply(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, ranks: torch.Tensor,
               slots: torch.Tensor) -> torch.Tensor:
    """``lora_apply_reference`` as the two kernels where Triton runs (``use_triton``)."""
    if not use_triton(x):
        report.record("lora", "torch reference (a slot per token)")
        return lora_apply_reference(y, x, a, b, ranks, slots)
    report.record("lora", "triton shrink + expand (a slot per token)")
    T, K = x.shape
    N = y.shape[1]
    if T == 0:
        return y
    assert y.stride(1) == 1 and x.stride(1) == 1 and a.stride(2) == 1 and b.stride(2) == 1 and ranks.is_contiguous()
    k_chunk, block_n = launch_sizes(T, K)
    k_chunk, block_n = K_CHUNK or k_chunk, BLOCK_N or block_n
    block_r = max(16, triton.next_power_of_2(a.shape[1]))
    block_k = min(k_chunk, max(16, 8192 // block_r))
    chunks = triton.cdiv(K, k_chunk)
    ws = torch.empty(chunks * T * block_r, device=x.device, dtype=torch.float32)
    _shrink_kernel[(T, chunks)](x, a, slots, ranks, ws, T, K, x.stride(0), a.stride(0), a.stride(1),
                                K_CHUNK=k_chunk, BLOCK_R=block_r, BLOCK_K=block_k, num_warps=4,
                                **pdl.launch_args(x))
    _expand_kernel[(T, triton.cdiv(N, block_n))](y, b, slots, ranks, ws, T, N, chunks, y.stride(0), b.stride(0),
                                                 b.stride(1), BLOCK_R=block_r, BLOCK_N=block_n, R_STEP=R_STEP,
                                                 BLOCK_C=triton.next_power_of_2(chunks), num_warps=4,
                                                 **pdl.launch_args(x))
    return y
