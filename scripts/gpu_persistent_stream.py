"""How fast one persistent kernel could stream a decode step's packed weights while its layers wait on each other
(GPU only, Hopper; Gluon kernels).

Issue 4 asks for a batch-1 W4A16 Qwen2.5-7B step in 1.25 ms. The engine runs about nine dependent kernels a layer;
each boundary stops the weight stream for its ramp and drain (docs/PERF.md, runs CP, DJ). A persistent kernel keeps
copying its next weight tiles into a ring of shared memory while a stage waits for the one before it. This probe
measures that floor without the arithmetic:

- Every program streams its share of each projection's bytes (q/k/v, o, gate_up, down at Qwen2.5-7B's 4-bit g128
  sizes, ``--layers`` layers) in tiles, XORs each into an accumulator, and at the end of each stage stores its
  partial and adds to the stage's counter (release).
- A wait makes a stage's first tile spin (acquire) until the stage before it is done everywhere, and then read
  those partials, as a GEMV reads its input.

Three ways to keep the copies going (``--settings``, comma-separated):

- ``ROWSxDEPTHxPER_SMxWARPS``: the consumers issue ``cp.async`` for the tile DEPTH − 1 ahead before waiting for
  the current one; tiles of ROWS × 512 bytes, each program a fixed contiguous share of each stage. Five waits a
  layer at most, each a bit of ``--masks``: q/k/v after the previous layer's down (1), a zero-byte attention stage
  after q/k/v (2), o after attention (4), gate_up after o (8), down after gate_up (16). Mask 0, always run first,
  is the bare stream: nothing waits.
- ``ws:ROWSxDEPTHxWARPS``: the same shares and masks, copied by one producer warp with TMA into every slot the
  consumers free (``gl.warp_specialize``, mbarriers), so copies continue while the consumers wait; tiles of
  ROWS × 128 bytes.
- ``dyn:ROWSxDEPTHxWARPSxGRAB``: as ``ws``, but the producer takes each stage's tiles GRAB at a time from a counter
  all programs share, so faster SMs do more of a stage; four waits a layer (q/k/v, o, gate_up, down each after the
  stage before) or none.

All programs must be resident at once (a wait would otherwise never end): one or two an SM, as the ring allows.
Each setting runs ``--reps`` times, the first (compile) left out of the median. Checked: every counter ends at its
target; fixed shares give the same partials every time (a wait that let a stage start early would differ); with
``dyn`` each stage's partials XOR to the XOR of its tiles (every tile done once).

    python3 scripts/gpu_persistent_stream.py --layers 28 --settings 64x6x1x8,ws:256x6x4,dyn:128x12x4x4 --masks 31,29
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# a layer's packed projections, bytes (Qwen2.5-7B, 4-bit words: K/8 × N int32)
STAGE_BYTES = {"qkv": 3584 * 4608 // 2, "o": 3584 * 3584 // 2, "gate_up": 3584 * 37888 // 2,
               "down": 18944 * 3584 // 2}
LAYER_BYTES = sum(STAGE_BYTES.values())
STAGES = 5          # q/k/v, attention (no bytes), o, gate_up, down
LINE = 32           # int32s between counters (one 128-byte line each)
_LINE = gl.constexpr(LINE)


@gluon.jit
def _acquire(ptr):
    return gl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _wait(cnt_ptr, out_ptr, g, target, P, SYNC: gl.constexpr, VL: gl.constexpr):
    """Spin until stage ``g`` is done by every program, then read its partials (the next stage's input)."""
    offs = gl.arange(0, VL, layout=gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
    x = gl.zeros([VL], gl.int32, layout=gl.BlockedLayout([1], [32], [gl.num_warps()], [0]))
    if SYNC:
        p = cnt_ptr + g * _LINE + offs * 0
        c = gl.min(_acquire(p), axis=0)
        while c < target:
            c = gl.min(_acquire(p), axis=0)
        x = gl.load(out_ptr + g * P + offs, mask=offs < P, other=0, cache_modifier=".cg")
    return gl.xor_sum(x, axis=0)


@gluon.jit
def _publish(out_ptr, cnt_ptr, acc, g, pid, P, BARRIER: gl.constexpr):
    """Stage ``g``'s partial, then its counter (release). BARRIER: every warp's stores before the release (the
    warp-specialized consumers skip it: the partial is a cross-warp reduction every thread holds, and the thread
    that stores it also releases the counter)."""
    gl.store(out_ptr + g * P + pid, gl.xor_sum(gl.xor_sum(acc, axis=1), axis=0))
    if BARRIER:
        gl.thread_barrier()
    gl.atomic_add(cnt_ptr + g * _LINE, 1, sem="release", scope="gpu")


@gluon.jit
def _stage_waits(acc, out_ptr, cnt_ptr, layer, r, pid, P, target, T_QKV: gl.constexpr, T_O: gl.constexpr,
                 T_GU: gl.constexpr, SYNC: gl.constexpr, VL: gl.constexpr, BARRIER: gl.constexpr):
    """Before a layer's tile ``r``: the waits of the stage that starts there (each a bit of SYNC), and the
    zero-byte attention stage between q/k/v and o."""
    g = layer * 5
    if r == 0:          # q/k/v: after the previous layer's down
        if layer > 0:
            acc = acc ^ _wait(cnt_ptr, out_ptr, g - 1, target, P, SYNC & 1, VL)
    if r == T_QKV:      # attention (no bytes of its own), then o after it
        acc = acc ^ _wait(cnt_ptr, out_ptr, g, target, P, SYNC & 2, VL)
        _publish(out_ptr, cnt_ptr, acc, g + 1, pid, P, BARRIER)
        acc = acc ^ _wait(cnt_ptr, out_ptr, g + 1, target, P, SYNC & 4, VL)
    if r == T_QKV + T_O:
        acc = acc ^ _wait(cnt_ptr, out_ptr, g + 2, target, P, SYNC & 8, VL)
    if r == T_QKV + T_O + T_GU:
        acc = acc ^ _wait(cnt_ptr, out_ptr, g + 3, target, P, SYNC & 16, VL)
    return acc


@gluon.jit
def _stage_publishes(acc, out_ptr, cnt_ptr, layer, r, pid, P, T_QKV: gl.constexpr, T_O: gl.constexpr,
                     T_GU: gl.constexpr, T_DN: gl.constexpr, BARRIER: gl.constexpr):
    """After a layer's tile ``r``: publish the stage it ends, if it ends one."""
    g = layer * 5
    if r == T_QKV - 1:
        _publish(out_ptr, cnt_ptr, acc, g, pid, P, BARRIER)
    if r == T_QKV + T_O - 1:
        _publish(out_ptr, cnt_ptr, acc, g + 2, pid, P, BARRIER)
    if r == T_QKV + T_O + T_GU - 1:
        _publish(out_ptr, cnt_ptr, acc, g + 3, pid, P, BARRIER)
    if r == T_QKV + T_O + T_GU + T_DN - 1:
        _publish(out_ptr, cnt_ptr, acc, g + 4, pid, P, BARRIER)


@gluon.jit
def _issue(w_ptr, ring, offs, i, pid, P, total, T_QKV: gl.constexpr, T_O: gl.constexpr, T_GU: gl.constexpr,
           T_DN: gl.constexpr, TILE: gl.constexpr, DEPTH: gl.constexpr):
    """cp.async of the program's ``i``-th tile into its ring slot (nothing past the last), one commit group."""
    if i < total:
        tile = _tile(i, pid, P, T_QKV, T_O, T_GU, T_DN)
        async_copy.async_copy_global_to_shared(ring.index(i % DEPTH), w_ptr + tile * TILE + offs)
    async_copy.commit_group()


@gluon.jit
def _tile(i, pid, P, T_QKV: gl.constexpr, T_O: gl.constexpr, T_GU: gl.constexpr, T_DN: gl.constexpr):
    """The global index of a program's ``i``-th tile: each stage's tiles are the programs' contiguous shares."""
    T_LAYER: gl.constexpr = T_QKV + T_O + T_GU + T_DN
    layer = i // T_LAYER
    r = i % T_LAYER
    start = gl.where(r < T_QKV, 0, gl.where(r < T_QKV + T_O, T_QKV,
                                              gl.where(r < T_QKV + T_O + T_GU, T_QKV + T_O, T_QKV + T_O + T_GU)))
    size = gl.where(r < T_QKV, T_QKV, gl.where(r < T_QKV + T_O, T_O, gl.where(r < T_QKV + T_O + T_GU, T_GU, T_DN)))
    return layer.to(gl.int64) * P * T_LAYER + P * start + pid * size + (r - start)


@gluon.jit
def _stream_kernel(w_ptr, out_ptr, cnt_ptr, n_layers, target, T_QKV: gl.constexpr, T_O: gl.constexpr,
                   T_GU: gl.constexpr, T_DN: gl.constexpr, ROWS: gl.constexpr, DEPTH: gl.constexpr,
                   SYNC: gl.constexpr, VL: gl.constexpr):
    T_LAYER: gl.constexpr = T_QKV + T_O + T_GU + T_DN
    TILE: gl.constexpr = ROWS * 128
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [gl.num_warps(), 1], [1, 0])
    rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, 128, layout=gl.SliceLayout(0, layout))
    offs = rows[:, None] * 128 + cols[None, :]
    ring = gl.allocate_shared_memory(gl.int32, [DEPTH, ROWS, 128], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    total = n_layers * T_LAYER
    for k in gl.static_range(DEPTH - 1):
        _issue(w_ptr, ring, offs, k, pid, P, total, T_QKV, T_O, T_GU, T_DN, TILE, DEPTH)
    acc = gl.zeros([ROWS, 128], gl.int32, layout=layout)
    for i in range(total):
        _issue(w_ptr, ring, offs, i + DEPTH - 1, pid, P, total, T_QKV, T_O, T_GU, T_DN, TILE, DEPTH)
        async_copy.wait_group(DEPTH - 1)
        gl.thread_barrier()
        layer = i // T_LAYER
        r = i % T_LAYER
        acc = _stage_waits(acc, out_ptr, cnt_ptr, layer, r, pid, P, target, T_QKV, T_O, T_GU, SYNC, VL, True)
        acc = acc ^ ring.index(i % DEPTH).load(layout)
        gl.thread_barrier()  # every warp has read the slot before it is copied into again
        _stage_publishes(acc, out_ptr, cnt_ptr, layer, r, pid, P, T_QKV, T_O, T_GU, T_DN, True)
    async_copy.wait_group(0)


@gluon.jit
def _ws_producer(w_desc, ring, ready, empty, pid, P, total, T_QKV: gl.constexpr, T_O: gl.constexpr,
                 T_GU: gl.constexpr, T_DN: gl.constexpr, ROWS: gl.constexpr, DEPTH: gl.constexpr):
    """One warp: a TMA copy into every slot the consumers have freed, whatever stage they are waiting in."""
    for i in range(total):
        slot = i % DEPTH
        mbarrier.wait(empty.index(slot), ((i // DEPTH) & 1) ^ 1)
        mbarrier.expect(ready.index(slot), w_desc.block_type.nbytes)
        row = (_tile(i, pid, P, T_QKV, T_O, T_GU, T_DN) * ROWS).to(gl.int32)
        tma.async_copy_global_to_shared(w_desc, [row, 0], ready.index(slot), ring.index(slot))


@gluon.jit
def _ws_consumer(out_ptr, cnt_ptr, ring, ready, empty, pid, P, total, target, T_QKV: gl.constexpr,
                 T_O: gl.constexpr, T_GU: gl.constexpr, T_DN: gl.constexpr, SYNC: gl.constexpr, VL: gl.constexpr,
                 ROWS: gl.constexpr, COLS: gl.constexpr, DEPTH: gl.constexpr, layout: gl.constexpr):
    """The default partition: the stages' waits, the XOR of every tile, the partials and counters."""
    T_LAYER: gl.constexpr = T_QKV + T_O + T_GU + T_DN
    acc = gl.zeros([ROWS, COLS], gl.int32, layout=layout)
    for i in range(total):
        layer = i // T_LAYER
        r = i % T_LAYER
        acc = _stage_waits(acc, out_ptr, cnt_ptr, layer, r, pid, P, target, T_QKV, T_O, T_GU, SYNC, VL, False)
        slot = i % DEPTH
        mbarrier.wait(ready.index(slot), (i // DEPTH) & 1)
        acc = acc ^ ring.index(slot).load(layout)
        fence_async_shared()
        mbarrier.arrive(empty.index(slot), count=1)
        _stage_publishes(acc, out_ptr, cnt_ptr, layer, r, pid, P, T_QKV, T_O, T_GU, T_DN, False)


@gluon.jit
def _ws_kernel(w_desc, out_ptr, cnt_ptr, n_layers, target, T_QKV: gl.constexpr, T_O: gl.constexpr,
               T_GU: gl.constexpr, T_DN: gl.constexpr, DEPTH: gl.constexpr, SYNC: gl.constexpr, VL: gl.constexpr):
    ROWS: gl.constexpr = w_desc.block_type.shape[0]
    COLS: gl.constexpr = w_desc.block_type.shape[1]
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (COLS // 4), COLS // 4], [gl.num_warps(), 1], [1, 0])
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    total = n_layers * (T_QKV + T_O + T_GU + T_DN)
    ring = gl.allocate_shared_memory(gl.int32, [DEPTH, ROWS, COLS], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [DEPTH, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [DEPTH, 1], mbarrier.MBarrierLayout())
    for k in gl.static_range(DEPTH):
        mbarrier.init(ready.index(k), count=1)
        mbarrier.init(empty.index(k), count=1)
    gl.warp_specialize([
        (_ws_consumer, (out_ptr, cnt_ptr, ring, ready, empty, pid, P, total, target, T_QKV, T_O, T_GU, T_DN, SYNC,
                        VL, ROWS, COLS, DEPTH, layout)),
        (_ws_producer, (w_desc, ring, ready, empty, pid, P, total, T_QKV, T_O, T_GU, T_DN, ROWS, DEPTH)),
    ], [1], [24])


@gluon.jit
def _dyn_tiles(k, N_QKV: gl.constexpr, N_O: gl.constexpr, N_GU: gl.constexpr, N_DN: gl.constexpr):
    """Tiles of a layer's stage ``k`` (0 q/k/v, 1 o, 2 gate_up, 3 down) and where they start in the layer."""
    n = gl.where(k == 0, N_QKV, gl.where(k == 1, N_O, gl.where(k == 2, N_GU, N_DN)))
    start = gl.where(k == 0, 0, gl.where(k == 1, N_QKV, gl.where(k == 2, N_QKV + N_O, N_QKV + N_O + N_GU)))
    return n, start


@gluon.jit
def _dyn_producer(w_desc, ring, ready, empty, meta, grab_ptr, n_layers, N_QKV: gl.constexpr, N_O: gl.constexpr,
                  N_GU: gl.constexpr, N_DN: gl.constexpr, ROWS: gl.constexpr, DEPTH: gl.constexpr,
                  GRAB: gl.constexpr):
    """One warp: takes the stages' tiles GRAB at a time from a counter every program shares (the fast SMs take
    more), copies each into a free slot and writes its stage beside it; a stage of -1 ends the walk."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    N_LAYER: gl.constexpr = N_QKV + N_O + N_GU + N_DN
    i = 0
    for g in range(n_layers * 4):
        n, start = _dyn_tiles(g % 4, N_QKV, N_O, N_GU, N_DN)
        base = (g // 4).to(gl.int64) * N_LAYER + start
        t = gl.atomic_add(grab_ptr + g * _LINE, GRAB)
        while t < n:
            for j in gl.static_range(GRAB):
                if t + j < n:
                    slot = i % DEPTH
                    mbarrier.wait(empty.index(slot), ((i // DEPTH) & 1) ^ 1)
                    meta.index(slot).store(gl.full([1], g, gl.int32, one))
                    mbarrier.expect(ready.index(slot), w_desc.block_type.nbytes)
                    tma.async_copy_global_to_shared(w_desc, [((base + t + j) * ROWS).to(gl.int32), 0],
                                                    ready.index(slot), ring.index(slot))
                    i += 1
            t = gl.atomic_add(grab_ptr + g * _LINE, GRAB)
    slot = i % DEPTH
    mbarrier.wait(empty.index(slot), ((i // DEPTH) & 1) ^ 1)
    meta.index(slot).store(gl.full([1], -1, gl.int32, one))
    mbarrier.arrive(ready.index(slot), count=1)


@gluon.jit
def _dyn_consumer(out_ptr, cnt_ptr, sink_ptr, ring, ready, empty, meta, pid, P, N_QKV: gl.constexpr, N_O: gl.constexpr,
                  N_GU: gl.constexpr, N_DN: gl.constexpr, SYNC: gl.constexpr, VL: gl.constexpr, ROWS: gl.constexpr,
                  COLS: gl.constexpr, DEPTH: gl.constexpr, layout: gl.constexpr):
    """The default partition: a tile of a new stage first publishes the stage before (its partial, and the tiles
    this program did of it, added to the stage's counter), then waits until all of that stage's tiles are done."""
    one: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    acc = gl.zeros([ROWS, COLS], gl.int32, layout=layout)
    xs = 0          # what the waits read, kept apart so that each stage's partials XOR to its tiles' XOR
    cur = -1
    done = 0
    i = 0
    g = gl.max(meta.index(0).load(one), axis=0) * 0     # the loop's first pass reads the first slot
    while g >= 0:
        slot = i % DEPTH
        mbarrier.wait(ready.index(slot), (i // DEPTH) & 1)
        g = gl.max(meta.index(slot).load(one), axis=0)
        if g != cur:
            if cur >= 0:
                gl.store(out_ptr + cur * P + pid, gl.xor_sum(gl.xor_sum(acc, axis=1), axis=0))
                gl.atomic_add(cnt_ptr + cur * _LINE, done, sem="release", scope="gpu")
                acc = gl.zeros([ROWS, COLS], gl.int32, layout=layout)
            if g > 0:
                prev_n, prev_start = _dyn_tiles((g - 1) % 4, N_QKV, N_O, N_GU, N_DN)
                xs = xs ^ _wait(cnt_ptr, out_ptr, g - 1, prev_n, P, SYNC, VL)
            cur = g
            done = 0
        if g >= 0:
            acc = acc ^ ring.index(slot).load(layout)
            done += 1
        fence_async_shared()
        mbarrier.arrive(empty.index(slot), count=1)
        i += 1
    gl.store(sink_ptr + pid, xs)


@gluon.jit
def _dyn_kernel(w_desc, out_ptr, cnt_ptr, sink_ptr, grab_ptr, n_layers, N_QKV: gl.constexpr, N_O: gl.constexpr,
                N_GU: gl.constexpr, N_DN: gl.constexpr, DEPTH: gl.constexpr, SYNC: gl.constexpr, VL: gl.constexpr,
                GRAB: gl.constexpr):
    ROWS: gl.constexpr = w_desc.block_type.shape[0]
    COLS: gl.constexpr = w_desc.block_type.shape[1]
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (COLS // 4), COLS // 4], [gl.num_warps(), 1], [1, 0])
    pid = gl.program_id(0)
    P = gl.num_programs(0)
    ring = gl.allocate_shared_memory(gl.int32, [DEPTH, ROWS, COLS], w_desc.layout)
    meta = gl.allocate_shared_memory(gl.int32, [DEPTH, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [DEPTH, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [DEPTH, 1], mbarrier.MBarrierLayout())
    for k in gl.static_range(DEPTH):
        mbarrier.init(ready.index(k), count=1)
        mbarrier.init(empty.index(k), count=1)
    gl.warp_specialize([
        (_dyn_consumer, (out_ptr, cnt_ptr, sink_ptr, ring, ready, empty, meta, pid, P, N_QKV, N_O, N_GU, N_DN, SYNC, VL,
                         ROWS, COLS, DEPTH, layout)),
        (_dyn_producer, (w_desc, ring, ready, empty, meta, grab_ptr, n_layers, N_QKV, N_O, N_GU, N_DN, ROWS, DEPTH,
                         GRAB)),
    ], [1], [48])


def plan(programs: int, tile_bytes: int) -> dict[str, int]:
    """Tiles a program takes in each stage: each projection's bytes over the grid, rounded up."""
    return {k: -(-b // (programs * tile_bytes)) for k, b in STAGE_BYTES.items()}


def run(setting: str, masks: list[int], layers: int, reps: int, sms: int) -> dict:
    """The bare stream (mask 0) and each mask of waits, ``reps`` launches each; ms is their median (the first,
    which compiles, left out). ``ROWSxDEPTHxPER_SMxWARPS``: cp.async issued by the consumers, tiles of ROWS ×
    512 bytes; ``ws:ROWSxDEPTHxWARPS``: one producer warp's TMA copies, tiles of ROWS × 128 bytes, one program an
    SM."""
    ws = setting.startswith("ws:")
    if ws:
        rows, depth, warps = (int(v) for v in setting[3:].split("x"))
        per_sm, cols = 1, 32
    else:
        rows, depth, per_sm, warps = (int(v) for v in setting.split("x"))
        cols = 128
    programs = sms * per_sm
    tile_bytes = rows * cols * 4
    t = plan(programs, tile_bytes)
    t_layer = sum(t.values())
    w = torch.randint(-2**31, 2**31 - 1, (layers * programs * t_layer * rows, cols), dtype=torch.int32, device="cuda")
    out = torch.zeros(layers * STAGES * programs, dtype=torch.int32, device="cuda")
    cnt = torch.zeros(layers * STAGES * LINE, dtype=torch.int32, device="cuda")
    vl = max(32 * warps, 1 << (programs - 1).bit_length())
    if ws:
        desc = TensorDescriptor.from_tensor(w, [rows, cols], gl.NVMMASharedLayout.get_default_for([rows, cols],
                                                                                                   gl.int32))

    def launch(n_layers: int, target: int, mask: int) -> None:
        if ws:
            _ws_kernel[(programs,)](desc, out, cnt, n_layers, target, t["qkv"], t["o"], t["gate_up"], t["down"],
                                    depth, mask, vl, num_warps=warps)
        else:
            _stream_kernel[(programs,)](w, out, cnt, n_layers, target, t["qkv"], t["o"], t["gate_up"], t["down"],
                                        rows, depth, mask, vl, num_warps=warps)

    # how much one program's scalar atomic adds (one thread's, or each thread's): the waits' target follows it
    launch(1, 0, 0)
    torch.cuda.synchronize()
    target = int(cnt[0]) if int(cnt[0]) else programs
    row = {"setting": setting, "programs": programs, "warps": warps, "ring_kib": depth * tile_bytes // 1024,
           "bytes": layers * programs * t_layer * tile_bytes, "ms": {}, "ok": {}}
    for mask in [0] + masks:
        times, outs, ok = [], [], True
        for _ in range(reps):
            cnt.zero_()
            out.zero_()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            launch(layers, target, mask)
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
            outs.append(out.clone())
            ok &= bool((cnt.view(-1, LINE)[:, 0] == target).all())
        row["ms"][mask] = sorted(times[1:])[len(times[1:]) // 2]
        row["ok"][mask] = ok and all(torch.equal(outs[1], o) for o in outs[2:])
    return row


def xor_all(x: torch.Tensor) -> torch.Tensor:
    """XOR over every dimension but the first (torch has no XOR reduction)."""
    x = x.reshape(x.shape[0], -1)
    while x.shape[1] > 1:
        if x.shape[1] % 2:
            x = torch.cat([x, torch.zeros_like(x[:, :1])], dim=1)
        x = x[:, 0::2] ^ x[:, 1::2]
    return x[:, 0]


def run_dyn(setting: str, layers: int, reps: int, sms: int) -> dict:
    """``dyn:ROWSxDEPTHxWARPSxGRAB``: the producer takes each stage's tiles from a shared counter, GRAB at a time,
    so the SMs that stream faster do more of a stage; four waits a layer (q/k/v after down, o after q/k/v, gate_up
    after o, down after gate_up) or none. Checked: every stage's partials XOR to its tiles' XOR, and every
    counter ends at the stage's tile count (each tile done once)."""
    rows, depth, warps, grab = (int(v) for v in setting[4:].split("x"))
    cols, programs = 32, sms
    tile_bytes = rows * cols * 4
    n = {k: -(-b // tile_bytes) for k, b in STAGE_BYTES.items()}
    n_layer = sum(n.values())
    w = torch.randint(-2**31, 2**31 - 1, (layers * n_layer * rows, cols), dtype=torch.int32, device="cuda")
    per_tile = xor_all(w.view(layers * n_layer, -1)).view(layers, n_layer)
    bounds = [0, n["qkv"], n["qkv"] + n["o"], n["qkv"] + n["o"] + n["gate_up"], n_layer]
    want = torch.stack([xor_all(per_tile[:, a:b]) for a, b in zip(bounds, bounds[1:])], dim=1).reshape(-1)
    counts = torch.tensor([n["qkv"], n["o"], n["gate_up"], n["down"]] * layers, device="cuda")
    out = torch.zeros(layers * 4 * programs, dtype=torch.int32, device="cuda")
    sink = torch.zeros(programs, dtype=torch.int32, device="cuda")
    cnt = torch.zeros(layers * 4 * LINE, dtype=torch.int32, device="cuda")
    grabs = torch.zeros_like(cnt)
    desc = TensorDescriptor.from_tensor(w, [rows, cols], gl.NVMMASharedLayout.get_default_for([rows, cols], gl.int32))
    vl = max(32 * warps, 1 << (programs - 1).bit_length())
    row = {"setting": setting, "programs": programs, "warps": warps, "ring_kib": depth * tile_bytes // 1024,
           "bytes": layers * n_layer * tile_bytes, "ms": {}, "ok": {}}
    for mask in (0, 1):
        times, ok = [], True
        for _ in range(reps):
            for t in (cnt, grabs, out):
                t.zero_()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            _dyn_kernel[(programs,)](desc, out, cnt, sink, grabs, layers, n["qkv"], n["o"], n["gate_up"], n["down"],
                                     depth, mask, vl, grab, num_warps=warps)
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
            ok &= torch.equal(xor_all(out.view(-1, programs)), want)
            ok &= torch.equal(cnt.view(-1, LINE)[:, 0], counts.to(torch.int32))
        row["ms"][15 if mask else 0] = sorted(times[1:])[len(times[1:]) // 2]
        row["ok"][15 if mask else 0] = bool(ok)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--settings", default="32x8x1x4,64x6x1x8",
                    help="rows x depth x programs-per-SM x warps, comma-separated")
    ap.add_argument("--masks", default="31,29",
                    help="which waits run, a bit each: 1 q/k/v after down, 2 attention after q/k/v, 4 o after "
                         "attention, 8 gate_up after o, 16 down after gate_up (31: all five)")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--out", type=pathlib.Path)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    masks = [int(m) for m in args.masks.split(",")]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    step_bytes = args.layers * LAYER_BYTES
    lines = [f"{args.layers} layers, {step_bytes / 1e9:.3f} GB of packed weights a step; {sms} SMs",
             "| setting | programs | warps | ring KiB | waits (mask) | ms | TB/s | ms at the step's bytes | "
             "µs a wait over the bare stream | checks |", "|---|---|---|---|---|---|---|---|---|---|"]
    print(lines[0], flush=True)
    for s in args.settings.split(","):
        r = run_dyn(s, args.layers, args.reps, sms) if s.startswith("dyn:") else run(s, masks, args.layers,
                                                                                            args.reps, sms)
        torch.cuda.empty_cache()
        scale = step_bytes / r["bytes"]
        for mask, ms in r["ms"].items():
            # layer 0's q/k/v waits on nothing; 15 (dyn only): q/k/v, o, gate_up and down each wait
            waits = bin(mask).count("1") * args.layers - (mask & 1)
            per_wait = f"{(ms - r['ms'][0]) * 1e3 / waits:.2f}" if waits else ""
            line = (f"| {s} | {r['programs']} | {r['warps']} | {r['ring_kib']} | {waits} ({mask}) | {ms:.4f} | "
                    f"{r['bytes'] / ms / 1e9:.2f} | {ms * scale:.4f} | {per_wait} | "
                    f"{'ok' if r['ok'][mask] else 'FAILED'} |")
            lines.append(line)
            print(line, flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "persistent_stream.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
