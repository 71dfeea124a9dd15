"""Weight-only quantized GEMV for decode (a handful of rows): ``y = x @ dequant(W).T`` without ``tl.dot``.

The fused GEMM in ``quant_gemm`` feeds tensor cores a 16-row tile of which decode uses one row; this kernel
multiplies and sums on the CUDA cores in fp32, everything in registers, the K loop software-pipelined
(``STAGES``). Scales leave the inner loop: within one group ``Σ_k x_k (q_kn − z_n) s_n = s_n Σ_k x_k (q_kn −
z_n)``, one multiply per group and column. Variants (config key ``variant``; ``scripts/gpu_quant_bench.py``
compares them):

* ``tile``, ``field`` and ``row`` (any format, 4 or 8 bits; ``quant_gemv_tile``): the K step unpacked to a
  float tile summed over K, field by field, or one word row at a time into the accumulator.
* ``half2`` (4-bit GPTQ; ``quant_gemv_half2`` for one row, ``quant_gemv_half2_rows`` for 2-4, each word dequantized
  once for all rows): the ``row`` loop with the dequantization and the products as packed f16x2 instructions
  (inline PTX): 3.3–4.0 instead of 4.7 SASS instructions per weight in the loop, products rounded to f16.
* ``mma`` (4-bit GPTQ, 1-8 rows, 64-column tiles; ``quant_gemv_mma``): each word dequantized into tensor-core
  fragments, the products and sums on ``mma.sync``; every row up to eight for the price of one. The default for
  3-8 rows; at one or two rows ``half2`` is faster.

It needs every K tile inside one group (contiguous groups, ``group_size % BLOCK_K == 0``); act-order and
large M stay with ``quant_gemm``. K is split across programs until about ``waves`` programs per SM (0: two
waves, ``plan_split_k``); the splits ``atomic_add`` into a zeroed fp32 output that is then cast, or
(``serial``) into a persistent workspace whose last split writes the output (one launch instead of three).
``TUNED`` holds the measured per-(format, bits, rows) defaults. The torch reference is
``quant_gemm.quant_gemm_reference``; which rows go here is decided by ``quant_gemm.quant_linear``
(``GEMV_MAX_M``).
"""

from __future__ import annotations

import os

import torch

from nvllm.env_vars import env_number
from nvllm.kernels.split_k import finish_split_k, plan_split_k, split_k_output
from nvllm.kernels import pdl, prefetch, quant_gemv_tile as tile, report
from nvllm.kernels.attention_partials import AttentionPartials
from nvllm.kernels.backend import eager_triton

triton = eager_triton()[0]   # the kernels live in quant_gemv_tile / _half2 / _half2_rows / _mma

VARIANTS = ("tile", "field", "row", "half2", "mma")  # half2, mma: 4-bit GPTQ (quant_gemv_half2[_rows], quant_gemv_mma)


TUNED: dict[tuple[str, int, int], dict[str, int | str]] = {
    # run M (H200, scripts/gpu_quant_bench.py, Qwen2.5-7B projections, 4-bit g128): the best single config over
    # the four shapes; 28 layers at M = 1: AWQ 1.967 ms (tile 3.179), GPTQ 2.151 ms (tile 2.567). Run AB (--waves
    # 8,16,32,64, M = 1; its second call): AWQ 1.859 ms with 32 programs per SM (gate_up 29.6 µs); GPTQ still best
    # at 8 (2.080 ms)
    # (since session 9 QuantLinear repacks AWQ layers into GPTQ's layout at load, so the "gptq" entries serve AWQ
    # checkpoints; these two serve AWQ layers whose inputs fill no whole GPTQ word, and direct calls)
    ("awq", 4, 1): dict(variant="row", block_n=1024, block_k=32, num_warps=4, stages=1, waves=32, serial=1),
    ("awq", 4, 2): dict(variant="row", block_n=1024, block_k=32, num_warps=4, stages=1, waves=8, serial=1),
    # run AE (the same sweep with half2): GPTQ 1.441 ms with half2 against 1.969 ms with row; run AQ (K splits up to
    # MAX_SPLITS = 256 instead of 64): 1.318 ms, still the best single config; run BK (x_pairs: each program packs
    # its inputs once): 1.288 against 1.314 ms, batch-1 decode 1.873 against 1.909 ms; session 12 (weights asked of
    # L2 before the PDL wait; PERF runs BP, BQ): 8 MiB best, batch-1 TPOT 1.8038 / 1.8032 against 1.8675 / 1.8659 ms;
    # session 15 (early=2, runs CS, CT): q/k/v 4.20–4.25 against 4.63–5.05 µs, TPOT 1.695–1.699 against 1.699–1.703
    ("gptq", 4, 1): dict(variant="half2", block_n=256, block_k=64, num_warps=1, stages=1, waves=16, serial=1,
                         x_pairs=1, prefetch=8, early=2),
    # session 9 (half2 over several rows, each word dequantized once for all; --ms 2,4 --waves 8,16): 28 layers at
    # M = 2 2.130 ms (row, the earlier default, 2.917 ms); at M = 4 3.316 ms (row 4.346, tile 6.026); session 12:
    # batch-2 step 2.6399 against 2.6699 ms with 8 MiB prefetched (run BQ)
    ("gptq", 4, 2): dict(variant="half2", block_n=256, block_k=64, num_warps=1, stages=1, waves=16, serial=1,
                         prefetch=8),
    # session 10 (the tensor-core variant mma; PERF runs BD, BG): 28 layers at M = 4 2.942 ms (half2 3.049 ms in the
    # same run), M = 8 3.694 ms (no GEMV took 5-8 rows before); at M = 1 mma took 2.308 ms against half2's 1.281.
    # No prefetch: batch-8 steps 3.76 / 3.80 ms with it against 3.62 (run BQ)
    ("gptq", 4, 4): dict(variant="mma", block_n=64, block_k=128, num_warps=1, stages=1, waves=16, serial=1),
    ("gptq", 4, 8): dict(variant="mma", block_n=64, block_k=64, num_warps=1, stages=1, waves=16, serial=1),
}
"""(format, bits, BLOCK_M) → config overrides, from the "best single config" lines of
``scripts/gpu_quant_bench.py``; elsewhere (8 bits: not measured) ``tile`` with the heuristic's tiles."""


def gemv_tuned(M: int, K: int, group_size: int, fmt: str | None, bits: int | None, N: int | None = None) -> bool:
    """Whether this call's default GEMV config is a measured ``half2`` or ``mma`` one (``TUNED``, its K step fitting
    the group): such calls take the GEMV past ``quant_gemm.GEMV_MAX_M`` (batch-4 GPTQ decode step 5.39 ms with the
    fused kernel, 4.20 ms with ``half2``, PERF.md runs AZ and BB)."""
    return (fmt, bits, 1 << max(0, (M - 1).bit_length())) in TUNED and \
        pick_gemv_config(M, K, group_size, fmt, bits, N)["variant"] in ("half2", "mma")


def gemv_supported(M: int, K: int, group_size: int, act_order: bool, block_k: int | None = None,
                   fmt: str | None = None, bits: int | None = None) -> bool:
    """Whether ``quant_gemv`` can take this call: few rows, contiguous groups that whole K tiles fit in."""
    bk = block_k or pick_gemv_config(M, K, group_size, fmt, bits)["block_k"]
    return M <= 16 and not act_order and group_size % bk == 0 and K % bk == 0


def pick_gemv_config(M: int, K: int, group_size: int, fmt: str | None = None,
                     bits: int | None = None, N: int | None = None) -> dict[str, int | str]:
    """Tile sizes: BLOCK_M covers the rows, BLOCK_K shrinks as rows grow (the [M, K, N] products live in
    registers), the largest of 128/64/32 that divides the group. H200 sweep (scripts/gpu_quant_bench.py, the
    Qwen2.5-7B projections, M 1–2), variant ``tile``: 128 × 128 tiles, 4 warps, a 3-stage K loop were best or
    within 10% on every shape but GPTQ down (M = 1), for both layouts. Then ``TUNED[(fmt, bits, BLOCK_M)]`` where
    its BLOCK_K fits the group and K (a ``half2`` or ``mma`` config narrows its K step to the group: g32 was not
    measured, but the alternative, ``tile``, took 1.8× ``half2``'s time at g128, runs M and AE); an ``mma`` one needs
    N, a multiple of 64."""
    block_m = 1 << max(0, (M - 1).bit_length())
    want_k = 128 if block_m <= 2 else 64 if block_m <= 4 else 32
    block_k = next((c for c in (want_k, 64, 32, 16) if c <= want_k and group_size % c == 0 and K % c == 0), 16)
    block_n = 128 if block_m <= 2 else 64
    cfg = {"variant": "tile", "block_m": block_m, "block_n": block_n, "block_k": block_k, "num_warps": 4,
           "magic": 0, "stages": 3, "waves": 0, "serial": 0, "x_once": 1, "x_pairs": 0,
           "prefetch": 0, "early": 0}
    tuned = dict(TUNED.get((fmt, bits, block_m), {}))
    if tuned.get("variant") == "mma" and (N is None or N % 64):
        tuned = {}
    if tuned.get("variant") in ("half2", "mma"):   # groups narrower than its K step (g32, g16): the widest that fits
        steps = (tuned["block_k"], 64, 32) + ((16,) if tuned["variant"] == "half2" else ())
        tuned["block_k"] = next((c for c in steps if c <= tuned["block_k"] and group_size % c == 0 and K % c == 0),
                                tuned["block_k"])
    if tuned and group_size % tuned.get("block_k", block_k) == 0 and K % tuned.get("block_k", block_k) == 0:
        cfg.update(tuned)
    return cfg


MAX_SPLITS = env_number("NVLLM_GEMV_MAX_SPLITS", 256, minimum=1)
"""Most K splits ``waves`` asks for (``NVLLM_GEMV_MAX_SPLITS`` overrides). Capped at 64, GPTQ down (K 18944, 14 column
tiles of 256) got 840 programs, 6.4 per SM where ``waves=16`` aims at 16: batch-1 GPTQ decode 2.18 ms; at 128 2.08 ms,
at 256 2.03 ms, down 13.56 µs = 61% of its floor (PERF run AQ)."""


def _splits(n_tiles: int, K: int, block_k: int, device: torch.device, waves: int) -> int | None:
    """Splits for about ``waves`` programs per SM (at most ``MAX_SPLITS``, at least one K tile each); None: the
    default."""
    if not waves:
        return None
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(-(-waves * sms // n_tiles), K // block_k, MAX_SPLITS))


X_SPAN_MAX = 1024
"""Longest K range (inputs) whose max one-row ``half2`` takes in one load (``x_once``); longer ranges loop. With
several rows 256 (the widest the session-9 sweeps measured; ptxas gives two rows at 1024 a spill)."""

MERGE_CHUNK = 32
"""Attention partitions a one-row ``half2`` program merges per load of its inputs (``attention_partials``): contexts
of up to 32 partitions take one trip to memory, longer ones one more per 32. H200, Qwen2.5-7B o_proj, attention +
o_proj at 2-47 partitions: 7.7-9.5 µs with 32, 8.5-11.2 with 8 and 16, stage 2 then the GEMV 10.0-11.2 (PERF run
DA). The kernel then takes 167 registers a thread (no spill), which only o_proj's 784 programs pay."""


def _x_span(k_per_split: int, rows: int = 1) -> int:
    """``half2``'s X_SPAN: the power of two that covers a split's inputs, or 0 (a loop) past ``X_SPAN_MAX`` (256
    with several rows)."""
    span = triton.next_power_of_2(k_per_split)
    return span if span <= (X_SPAN_MAX if rows == 1 else 256) else 0


_WORKSPACES: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}


def _workspace(device: torch.device, numel: int, tiles: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The zeroed fp32 workspace and int32 ticket counters of ``serial`` split-K on this device (the kernels
    leave them zeroed), grown as needed; older ones stay allocated (CUDA graphs may hold them). None while a
    CUDA graph is being captured and none large enough exists yet: the caller then takes the atomic path.
    One per device: calls on concurrent streams must not use ``serial``."""
    held = _WORKSPACES.setdefault(device, [])
    if held and held[-1][0].numel() >= numel and held[-1][1].numel() >= tiles:
        return held[-1]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    held.append((torch.zeros(max(numel, 1 << 20), device=device, dtype=torch.float32),
                 torch.zeros(max(tiles, 4096), device=device, dtype=torch.int32)))
    return held[-1]


_SCRATCH: dict[torch.device, torch.Tensor] = {}


def _pairs_scratch(device: torch.device, numel: int) -> torch.Tensor | None:
    """The int32 scratch where one-row ``half2`` programs build their input pairs (``x_pairs``), grown as needed
    (older ones stay allocated: CUDA graphs may hold them); None while a CUDA graph is being captured and none is
    large enough yet (the call then builds its pairs per word row, as without ``x_pairs``). Programs write and
    read only their own part; one per device, so calls on concurrent streams must not use it."""
    held = _SCRATCH.get(device)
    if held is not None and held.numel() >= numel:
        return held
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    _SCRATCH[device] = held = torch.empty(max(numel, 1 << 20), device=device, dtype=torch.int32)
    return held


def quant_gemv(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *,
               fmt: str, bits: int, group_size: int, bias: torch.Tensor | None = None,
               split_k: int | None = None, acc: torch.Tensor | None = None, **config: int | str) -> torch.Tensor:
    """``x [M, K]`` (M ≤ 16, contiguous rows) times the packed layer → ``[M, N]`` in x's dtype, fp32 math.
    ``acc``: a zeroed fp32 ``[M, N]`` tensor (contiguous rows) that the splits add into instead, returned as it is
    (no bias, no cast: ``partial_sum.PartialSum``'s consumer finishes it).
    ``config`` overrides ``variant`` (``VARIANTS``), ``block_m``, ``block_n``, ``block_k``, ``num_warps``,
    ``magic`` (0/1, variant tile), ``stages``, ``waves`` (ignored with an explicit ``split_k``), ``serial``
    (0/1: split-K finished inside the kernel, no zeroing and cast launches; see ``_workspace``), ``x_once`` (0/1,
    variant half2: the max of a split's inputs in one load, see ``X_SPAN_MAX``), ``x_pairs`` (0/1, one-row half2
    with ``x_once``: the split's input pairs built once per program, see ``_pairs_scratch``), ``prefetch`` (MiB,
    variants half2 and mma: the call's weights asked of L2 before the PDL wait, at most this much; ``prefetch.py``),
    ``early`` (0/1/2, one-row half2 with ``x_pairs`` and splits of one K step of 64: the split's words, scales and
    zeros loaded into registers before its inputs; 2: before the PDL wait, in place of the L2 prefetch).
    ``x`` may be a split decode attention's unmerged ``AttentionPartials``: a one-row ``half2`` call with input pairs
    whose K splits each lie inside one head merges them in its prologue; any other call merges them first."""
    merge = x if isinstance(x, AttentionPartials) else None
    x = x.rows if merge is not None else x
    M, K = x.shape
    N = scales.shape[1]
    cfg = pick_gemv_config(M, K, group_size, fmt, bits, N)
    unknown = set(config) - set(cfg)
    if unknown:
        raise TypeError(f"unknown quant_gemv config keys {sorted(unknown)}")
    cfg.update(config)
    variant = cfg["variant"]
    if variant not in VARIANTS:
        raise ValueError(f"unknown quant_gemv variant {variant!r}; expected one of {VARIANTS}")
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    if bm < M or not gemv_supported(M, K, group_size, False, bk, fmt, bits):
        raise ValueError(f"quant_gemv cannot take M={M}, K={K}, group {group_size} with block_m {bm}, "
                         f"block_k {bk}")
    if bn % 8 or bk % (32 // bits) or (fmt == "awq" and bits != 4):
        raise ValueError(f"quant_gemv: block_n {bn} / block_k {bk} do not hold whole {bits}-bit {fmt} words")
    if variant in ("half2", "mma") and (fmt != "gptq" or bits != 4):
        raise ValueError(f"quant_gemv variant {variant} takes a 4-bit GPTQ weight, not {bits}-bit {fmt}")
    if variant == "mma" and (M > 8 or bk % 32 or bn != 64 or N % 64):
        raise ValueError(f"quant_gemv variant mma takes at most 8 rows, block_k a multiple of 32, block_n 64 and "
                         f"N a multiple of 64, not M={M}, block_k {bk}, block_n {bn}, N={N}")
    if x.stride(1) != 1:
        x = x.contiguous()
    n_tiles = triton.cdiv(N, bn)
    if split_k is None:
        split_k = _splits(n_tiles, K, bk, x.device, cfg["waves"])
    split_k, k_per_split = plan_split_k(n_tiles, K, bk, x.device, split_k)
    x_span = _x_span(k_per_split, bm) if cfg["x_once"] else 0
    pairs = variant == "half2" and bm == 1 and bool(cfg["x_pairs"]) and x_span > 0
    if merge is not None and not (pairs and merge.fits(M, k_per_split)):
        merge, x = None, merge.finish()
    if acc is not None:
        assert acc.shape == (M, N) and acc.dtype == torch.float32 and acc.stride(1) == 1, (acc.shape, acc.dtype)
        bias = None
    ws = _workspace(x.device, M * N, n_tiles) if cfg["serial"] and split_k > 1 and acc is None else None
    atomic = (split_k > 1 and ws is None) or acc is not None
    out = acc if acc is not None else split_k_output(M, N, x, 2 if atomic else 1)
    if M == 0:
        return out if acc is not None else out.to(x.dtype)
    direct_bias = bias is not None and not atomic
    args = (x, qweight, qzeros, scales, bias if direct_bias else qweight, out,
            *(ws if ws is not None else (out, out)),
            M, N, K, x.stride(0), out.stride(0),
            qweight.stride(0), qzeros.stride(0), scales.stride(0), k_per_split)
    common = dict(BITS=bits, AWQ=fmt == "awq", GROUP=group_size, HAS_BIAS=direct_bias, ATOMIC=atomic,
                  SERIAL=ws is not None, STAGES=cfg["stages"], BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                  num_warps=cfg["num_warps"], **pdl.launch_args(x))
    if variant in ("half2", "mma"):
        interpret = os.environ.get("TRITON_INTERPRET") == "1"
        x_words = (x.dtype == torch.bfloat16 and not interpret       # K is a multiple of the 8 inputs of a word
                   and x.stride(0) % 2 == 0 and x.storage_offset() % 2 == 0)
        h2_args = (x, x.view(torch.int32) if x_words else x, qweight, qzeros, scales, bias if direct_bias else qweight,
                   out, *(ws if ws is not None else (out, out)))
        h2_kw = dict(GROUP=group_size, HAS_BIAS=direct_bias, ATOMIC=atomic, SERIAL=ws is not None, STAGES=cfg["stages"],
                     BLOCK_K=bk, INTERPRET=interpret, X_WORDS=x_words, num_warps=cfg["num_warps"],
                     **pdl.launch_args(x))
        ahead = 0 if interpret or bn % 32 else prefetch.rows(cfg["prefetch"] << 20, n_tiles * split_k, bn,
                                                               k_per_split // 8)
        h2_kw["PREFETCH"] = ahead
        if variant == "mma":
            from nvllm.kernels.quant_gemv_mma import quant_gemv_mma_kernel

            rows = triton.next_power_of_2(max(M, 1))
            quant_gemv_mma_kernel[(n_tiles, split_k)](
                *h2_args, M, N, K, x.stride(0), out.stride(0), qweight.stride(0), qzeros.stride(0), scales.stride(0),
                k_per_split, ROWS=rows, X_CHUNK=min(triton.next_power_of_2(k_per_split), 1024), **h2_kw)
        elif bm == 1:
            from nvllm.kernels.quant_gemv_half2 import quant_gemv_half2_kernel

            xp = _pairs_scratch(x.device, n_tiles * split_k * x_span // 2) if pairs else None
            if merge is not None:
                report.record("attention.merge", "in the w4a16 gemv's prologue")
                ms = merge.num_splits
                m_args = (merge.part_lse, merge.part_o, merge.context_lens, ms, merge.partition)
                m_kw = dict(MERGE=True, HEAD_DIM=merge.head_dim, PO_D=merge.part_o.shape[3],
                            MERGE_S=triton.next_power_of_2(ms), MERGE_C=min(triton.next_power_of_2(ms), MERGE_CHUNK))
            else:
                m_args, m_kw = (out, out, out, 0, 0), dict(MERGE=False, HEAD_DIM=1, PO_D=1, MERGE_S=1, MERGE_C=1)
            quant_gemv_half2_kernel[(n_tiles, split_k)](
                *h2_args, xp if xp is not None else out, *m_args, N, K, qweight.stride(0), qzeros.stride(0),
                scales.stride(0), k_per_split, BLOCK_N=bn, X_SPAN=x_span, X_PAIRS=xp is not None,
                EARLY=cfg["early"] if xp is not None and k_per_split == bk == 64 else 0, **m_kw, **h2_kw)
        else:
            from nvllm.kernels.quant_gemv_half2_rows import quant_gemv_half2_rows_kernel

            quant_gemv_half2_rows_kernel[(n_tiles, split_k)](
                *h2_args, M, N, K, x.stride(0), out.stride(0), qweight.stride(0), qzeros.stride(0), scales.stride(0),
                k_per_split, BLOCK_M=bm, BLOCK_N=bn, X_SPAN=x_span, **h2_kw)
    elif variant in ("field", "row"):
        tile._quant_gemv_field_kernel[(n_tiles, split_k)](*args, 0x4B000000, ROWS=variant == "row", **common)
    else:
        tile._quant_gemv_kernel[(n_tiles, split_k)](*args, MAGIC=bool(cfg["magic"]), **common)
    return out if acc is not None else finish_split_k(out, bias, x.dtype, 2 if atomic else 1)
