"""A one-row GPTQ 4-bit MLP in one launch: gate_up, SiLU·mul and down_proj (``quant_mlp``).

A batch-1 decode step runs the MLP as three kernels: the gate_up GEMV (K split over programs, sums left in an fp32
accumulator), SiLU·mul (which finishes those sums) and the down GEMV (K split again). Each boundary drains one grid
before the next may read its output. But down_proj's K splits need only their own part of the intermediate vector:
a split of K rows ``[j·S, (j+1)·S)`` reads SiLU(gate)·up of those S intermediate outputs, and nothing else. So the
three kernels become one grid of two kinds of programs, whose only dependency is per slice of S = ``SLICE``
intermediate outputs:

* gate_up programs (first in the grid, slice-major): program (j, s) computes the S gate and the S up columns of
  slice j over K split s — the one-row ``half2`` GEMV's loop, its input pairs and its bits — adds them into a
  zeroed fp32 accumulator ``[gate | up]`` and takes a ticket on slice j's counter.
* down programs (after them, slice-major): program (j, t) asks L2 for its weights (rows of slice j, output tile t),
  waits until slice j's counter shows every K split of gate_up, reads the slice's sums, forms SiLU(gate)·up with
  ``silu_and_mul``'s roundings (gate and up rounded to the activations' dtype, SiLU rounded, the product rounded),
  packs them into its input pairs and runs the ``half2`` loop over its S rows; its sums go atomically into the
  output accumulator, a ``PartialSum`` that the next RMSNorm finishes (bias, cast, zeroing), as down_proj's GEMV
  leaves it. The slice's last reader (a second ticket) zeroes the slice's sums and both counters for the next call.

A down program waits only on programs with lower ids, which the GPU has started before it, so the wait cannot
deadlock. gate_up's K splits and down's S rows per program are the unfused GEMVs' (``quant_gemv``'s split
heuristic; S = 128 = down's split at the Qwen2.5-7B shapes), so each program's partial sums have the unfused bits;
only the order of the fp32 atomic adds differs, as between any two runs.

Off by default until it has been timed on a GPU: ``NVLLM_FUSED_MLP=1`` turns it on (``scripts/gpu_mlp_bench.py`` and
``gpu_bench.py --mlp-compare`` measure it). The torch reference is ``quant_mlp_reference``.
"""

from __future__ import annotations

import os

import torch

from nvllm.kernels import pdl, prefetch, report
from nvllm.kernels.backend import eager_triton, use_triton
from nvllm.kernels.partial_sum import PartialSum, take
from nvllm.kernels.prefetch import prefetch_rows
from nvllm.kernels.quant_gemm import quant_gemm_reference
from nvllm.kernels.quant_gemv_half2 import _row_dot, _scratch_pairs, _zero_consts, value_pairs
from nvllm.kernels.quant_gemv_tile import _words as words_of
from nvllm.quant.formats import QuantWeight

triton, tl, _jit = eager_triton()  # jitted at import (the CPU tests reload under the interpreter)

SLICE = 128       # intermediate outputs per slice: gate_up programs hold 2·SLICE columns, down programs SLICE rows
BLOCK_N = 256     # down's output columns per program (one warp, eight columns a lane, as the one-row GEMV)
BLOCK_K = 64      # one K step: eight GPTQ word rows, inside one group
WAVES = 16        # gate_up's K splits: about this many programs per SM (``quant_gemv``'s one-row default)
PREFETCH_MIB = 8  # gate_up's weights asked of L2 before the PDL wait, as the one-row GEMV (``prefetch``)
DOWN_PREFETCH_MIB = 8   # down's weights asked of L2 before its programs wait for their slice
MAX_POLLS = 1 << 24     # a slice's counter polled this often (seconds) without its count: trap
MAXNREG = 0             # registers a thread the compiler may use (0: its choice, 150 on sm_90)


def enabled() -> bool:
    """``NVLLM_FUSED_MLP`` (read at each call): ``1`` runs the one-row MLP in one launch, else three kernels."""
    return os.environ.get("NVLLM_FUSED_MLP", "0").lower() in ("1", "on")


# ---------------------------------------------------------------------------------------------- reference


def quant_mlp_reference(x: torch.Tensor, gate_up: QuantWeight, down: QuantWeight,
                        gate_up_bias: torch.Tensor | None = None) -> torch.Tensor:
    """down_proj's fp32 sum (no bias: the ``PartialSum``'s) of SiLU(gate)·up, each rounded as the unfused path
    rounds it: gate_up's output and the activation in x's dtype."""
    from nvllm.kernels.activation import silu_and_mul_reference

    h = silu_and_mul_reference(quant_gemm_reference(x, gate_up, gate_up_bias))
    return quant_gemm_reference(h, down).float()


# ------------------------------------------------------------------------------------------------- Triton


@_jit
def _gate_up_program(pid, x_ptr, qw_ptr, qz_ptr, s_ptr, gu_ptr, cnt_ptr, xp, K, INTER, stride_qw, stride_qz,
                     stride_s, gu_splits, k_per_split, GROUP: tl.constexpr, SLICE: tl.constexpr,
                     X_SPAN: tl.constexpr, PREFETCH: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr):
    """Program (j, s): gate and up columns of slice j over K split s, added into ``gu``; then slice j's ticket."""
    j = pid // gu_splits
    k_begin = (pid - j * gu_splits) * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    c = tl.arange(0, 2 * SLICE)
    offs_n = j * SLICE + c % SLICE + (c // SLICE) * INTER            # S gate columns, then the same S up columns
    mask_n = offs_n < 2 * INTER
    if PREFETCH:   # its first word rows asked of L2 while the previous kernel runs (``prefetch``)
        prefetch_rows(qw_ptr, stride_qw, k_begin // 8, k_end // 8, j * SLICE, 2 * INTER, PREFETCH, SLICE)
        prefetch_rows(qw_ptr, stride_qw, k_begin // 8, k_end // 8, INTER + j * SLICE, 2 * INTER, PREFETCH, SLICE)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    unscale = _scratch_pairs(x_ptr, xp, k_begin, k_end, X_SPAN, INTERPRET)
    tl.debug_barrier()                                   # every lane's pairs written before any is read
    zshift = (offs_n % 8) * 4
    acc = tl.full((2 * SLICE,), 0.0, tl.float32)
    for k0 in range(k_begin, k_end, 64):
        grp = k0 // GROUP
        s = tl.load(s_ptr + grp * stride_s + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        zw = tl.load(qz_ptr + grp * stride_qz + offs_n // 8, mask=mask_n, other=0)
        z, z1, z16 = _zero_consts(zw, zshift)
        for w in tl.static_range(8):
            words = words_of(qw_ptr + (k0 // 8 + w) * stride_qw + offs_n, mask_n)
            d = _row_dot(words, xp, (k0 + 8 * w - k_begin) // 2, z, z1, z16, INTERPRET)
            if w == 0:
                part = d
            else:
                part += d
        acc += s * part
    tl.atomic_add(gu_ptr + offs_n, acc * unscale, mask=mask_n, sem="relaxed")
    tl.debug_barrier()                                   # every lane's adds before the ticket
    tl.atomic_add(cnt_ptr + j, 1, sem="release")


@_jit
def _down_program(pid, x_ptr, bias_ptr, qw_ptr, qz_ptr, s_ptr, out_ptr, gu_ptr, cnt_ptr, xp, INTER, N, stride_qw,
                  stride_qz, stride_s, gu_splits, d_tiles, GROUP: tl.constexpr,
                  SLICE: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr, D_PREFETCH: tl.constexpr,
                  MAX_POLLS: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr):
    """Program (j, t): down_proj's output tile t over the K rows of slice j, once gate_up has finished slice j."""
    OUT_TY: tl.constexpr = x_ptr.dtype.element_ty
    j = pid // d_tiles
    offs_n = (pid - j * d_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    k_begin = j * SLICE
    if D_PREFETCH:   # its first word rows asked of L2 before it waits
        prefetch_rows(qw_ptr, stride_qw, k_begin // 8, (k_begin + SLICE) // 8, (pid - j * d_tiles) * BLOCK_N, N,
                      D_PREFETCH, BLOCK_N)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # slice j's gate_up programs have lower ids: started before this one. Polled with volatile loads (an acquiring
    # load would invalidate the SM's L1 at every poll, which its other programs read their input pairs from), then
    # one acquire. A count that never comes (a corrupted counter) ends the kernel with a trap, not a hang.
    polls = 0
    done = tl.load(cnt_ptr + j, volatile=True)
    while (done < gu_splits) & (polls < MAX_POLLS):
        done = tl.load(cnt_ptr + j, volatile=True)
        polls += 1
    if tl.atomic_add(cnt_ptr + j, 0, sem="acquire") < gu_splits:
        if not INTERPRET:
            tl.inline_asm_elementwise("trap;\nmov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()
    i = k_begin + tl.arange(0, SLICE)
    gate = tl.load(gu_ptr + i, cache_modifier=".cg")
    up = tl.load(gu_ptr + INTER + i, cache_modifier=".cg")
    if HAS_BIAS:
        gate += tl.load(bias_ptr + i).to(tl.float32)
        up += tl.load(bias_ptr + INTER + i).to(tl.float32)
    gate = gate.to(OUT_TY).to(tl.float32)                # gate_up's output as the finished GEMV rounds it
    up = up.to(OUT_TY).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(OUT_TY).to(tl.float32)    # silu_and_mul's roundings
    unscale = value_pairs((act * up).to(OUT_TY).to(tl.float32), xp, SLICE, INTERPRET)
    tl.debug_barrier()                                   # pairs written and the slice's sums read by every lane
    if tl.atomic_add(cnt_ptr + INTER // SLICE + j, 1, sem="acq_rel") == d_tiles - 1:
        zero = tl.full((SLICE,), 0.0, tl.float32)        # the slice's last reader: zeroed for the next call
        tl.store(gu_ptr + i, zero)
        tl.store(gu_ptr + INTER + i, zero)
        tl.atomic_xchg(cnt_ptr + j, 0)
        tl.atomic_xchg(cnt_ptr + INTER // SLICE + j, 0)
    zshift = (offs_n % 8) * 4
    acc = tl.full((BLOCK_N,), 0.0, tl.float32)
    for k0 in range(0, SLICE, 64):                      # a loop, not unrolled: gate_up programs pay its registers
        grp = (k_begin + k0) // GROUP
        s = tl.load(s_ptr + grp * stride_s + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        zw = tl.load(qz_ptr + grp * stride_qz + offs_n // 8, mask=mask_n, other=0)
        z, z1, z16 = _zero_consts(zw, zshift)
        for w in tl.static_range(8):
            words = words_of(qw_ptr + ((k_begin + k0) // 8 + w) * stride_qw + offs_n, mask_n)
            d = _row_dot(words, xp, (k0 + 8 * w) // 2, z, z1, z16, INTERPRET)
            if w == 0:
                part = d
            else:
                part += d
        acc += s * part
    tl.atomic_add(out_ptr + offs_n, acc * unscale, mask=mask_n, sem="relaxed")


@_jit
def quant_mlp_kernel(
    x_ptr,                                     # [K] one row, bf16/fp16
    gqw_ptr, gqz_ptr, gs_ptr, gbias_ptr,       # gate_up: qweight [K/8, 2I], qzeros, scales, bias [2I]
    dqw_ptr, dqz_ptr, ds_ptr,                  # down: qweight [I/8, N], qzeros, scales
    out_ptr,                                   # [N] fp32, zeroed: down's sums are added in
    gu_ptr,                                    # [2I] fp32, zeroed: gate_up's sums; left zeroed
    cnt_ptr,                                   # [2 I/S] int32, zeroed: per slice, gate_up's and down's tickets
    xp_ptr,                                    # int32 scratch, XP words a program: its input pairs
    K, INTER, N,
    stride_gqw, stride_gqz, stride_gs, stride_dqw, stride_dqz, stride_ds,
    gu_splits, k_per_split, d_tiles,
    GROUP: tl.constexpr, D_GROUP: tl.constexpr, SLICE: tl.constexpr, BLOCK_N: tl.constexpr,
    X_SPAN: tl.constexpr,                      # a power of two ≥ k_per_split (gate_up's inputs in one load)
    XP: tl.constexpr,                          # scratch words a program (max(X_SPAN, SLICE) / 2)
    HAS_BIAS: tl.constexpr,
    PREFETCH: tl.constexpr,                    # gate_up's word rows a program asks of L2 before the PDL wait
    D_PREFETCH: tl.constexpr,                  # down's word rows a program asks of L2 before its wait
    MAX_POLLS: tl.constexpr,                   # polls of a slice's counter before the kernel traps
    INTERPRET: tl.constexpr, PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    n_gu = (INTER // SLICE) * gu_splits
    xp = xp_ptr + pid.to(tl.int64) * XP
    if pid < n_gu:
        _gate_up_program(pid, x_ptr, gqw_ptr, gqz_ptr, gs_ptr, gu_ptr, cnt_ptr, xp, K, INTER, stride_gqw,
                         stride_gqz, stride_gs, gu_splits, k_per_split, GROUP, SLICE, X_SPAN, PREFETCH, INTERPRET,
                         PDL)
    else:
        _down_program(pid - n_gu, x_ptr, gbias_ptr, dqw_ptr, dqz_ptr, ds_ptr, out_ptr, gu_ptr, cnt_ptr, xp, INTER, N,
                      stride_dqw, stride_dqz, stride_ds, gu_splits, d_tiles, D_GROUP, SLICE,
                      BLOCK_N, HAS_BIAS, D_PREFETCH, MAX_POLLS, INTERPRET, PDL)


# ----------------------------------------------------------------------------------------------- dispatch


def supported(x: torch.Tensor, gate_up: QuantWeight, down: QuantWeight) -> bool:
    """Whether the fused kernel takes this MLP: one 16-bit row on the Triton path, both layers 4-bit GPTQ layouts
    with contiguous groups of whole K steps, whole slices of intermediate outputs."""
    inter = down.in_features
    return (enabled() and x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16)
            and use_triton(x) and x.shape[1] == gate_up.in_features and x.device == gate_up.qweight.device
            and gate_up.out_features == 2 * inter and inter % SLICE == 0
            and all(w.fmt == "gptq" and w.bits == 4 and not w.act_order and w.group_size % BLOCK_K == 0
                    and w.in_features % BLOCK_K == 0 for w in (gate_up, down)))


_STATE: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}


def _state(device: torch.device, inter: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The zeroed fp32 ``[gate | up]`` accumulator and int32 ticket counters (the kernel leaves both zeroed),
    grown as needed (older ones stay allocated: CUDA graphs may hold them); None while a CUDA graph is being
    captured and none large enough exists yet. One per device, like the GEMVs' scratch: calls on concurrent
    streams must not use it (the engine runs its decode steps on one stream)."""
    held = _STATE.setdefault(device, [])
    if held and held[-1][0].numel() >= 2 * inter:
        return held[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    with torch.inference_mode(False):
        held.append((torch.zeros(2 * inter, device=device, dtype=torch.float32),
                     torch.zeros(2 * (inter // SLICE), device=device, dtype=torch.int32)))
    return held[-1]


def quant_mlp(x: torch.Tensor, gate_up: QuantWeight, down: QuantWeight, gate_up_bias: torch.Tensor | None = None,
              down_bias: torch.Tensor | None = None) -> PartialSum | None:
    """down_proj(SiLU(gate)·up) of one row ``x [1, K]`` as down's unfinished ``PartialSum`` (its consumer adds
    ``down_bias``, casts and re-zeroes), or None when the fused kernel cannot take the call (``supported``, or
    its buffers would have to be allocated during a CUDA graph capture): the caller then runs the three kernels."""
    from nvllm.kernels.quant_gemv import _pairs_scratch, _splits, _x_span

    if not supported(x, gate_up, down):
        return None
    K, inter, N = gate_up.in_features, down.in_features, down.out_features
    slices = inter // SLICE
    state = _state(x.device, inter)
    split = _splits(slices, K, BLOCK_K, x.device, WAVES) or 1
    k_per_split = -(-(K // BLOCK_K) // split) * BLOCK_K
    gu_splits = -(-K // k_per_split)
    x_span = _x_span(k_per_split)
    d_tiles = triton.cdiv(N, BLOCK_N)
    programs = slices * (gu_splits + d_tiles)
    xp_words = max(x_span, SLICE) // 2
    xp = _pairs_scratch(x.device, programs * xp_words) if state is not None and x_span else None
    acc = take(x.device, N) if xp is not None else None
    if acc is None:
        return None
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    x = x.contiguous()
    gu, cnt = state
    ahead = 0 if interpret else prefetch.rows(PREFETCH_MIB << 20, slices * gu_splits, 2 * SLICE, k_per_split // 8)
    down_ahead = 0 if interpret else prefetch.rows(DOWN_PREFETCH_MIB << 20, slices * d_tiles, BLOCK_N, SLICE // 8)
    report.record("quant_gemm", "triton w4a16 gptq gemv, gate_up + silu_and_mul + down in one launch")
    quant_mlp_kernel[(programs,)](
        x, gate_up.qweight, gate_up.qzeros, gate_up.scales, gate_up_bias if gate_up_bias is not None else x,
        down.qweight, down.qzeros, down.scales, acc, gu, cnt, xp,
        K, inter, N, gate_up.qweight.stride(0), gate_up.qzeros.stride(0), gate_up.scales.stride(0),
        down.qweight.stride(0), down.qzeros.stride(0), down.scales.stride(0), gu_splits, k_per_split, d_tiles,
        GROUP=gate_up.group_size, D_GROUP=down.group_size, SLICE=SLICE, BLOCK_N=BLOCK_N, X_SPAN=x_span,
        XP=xp_words, HAS_BIAS=gate_up_bias is not None, PREFETCH=ahead, D_PREFETCH=down_ahead, MAX_POLLS=MAX_POLLS,
        INTERPRET=interpret, num_warps=1, **({"maxnreg": MAXNREG} if MAXNREG and not interpret else {}),
        **pdl.launch_args(x))
    return PartialSum(acc[:N].view(1, N), down_bias, x.dtype)
