"""What one kernel boundary of a decode step costs, and whether a flag beats the PDL wait (GPU only).

A chain of dependent kernels shaped like a decode step's — GEMV-like links (many one-warp programs, each reading
its inputs from the link before and a slice of weights, the way a split-K GEMV does) alternating with one-program
links (a norm or an elementwise kernel) — is captured in one CUDA graph and timed per link, in five ways:

- ``plain``: no PDL; a link's programs start when the previous grid has drained.
- ``wait``: PDL as ``nvllm.kernels.pdl`` does it (``gdc_wait`` then ``gdc_launch_dependents``).
- ``early``: PDL, ``gdc_launch_dependents`` before ``gdc_wait`` (the next link may be scheduled sooner).
- ``flag``: PDL for the scheduling, and instead of ``gdc_wait`` each program spins on a counter the previous
  link's programs increment (release) after their stores; the link two later re-zeroes it.
- ``flags``: as ``flag`` with 32 counters a link (program id mod 32, one 128-byte line each), summed by the spin.

Every variant computes the same thing (each link adds one to a rotated copy of the chain's vector, so a race shows
as a wrong sum), checked after timing. Prints a table; ``--out DIR`` also writes it there.

    python3 scripts/gpu_chain_bench.py --links 200 --shapes 132x1x64,2112x1x64 --patterns g,gs --modes plain,wait,flag
    python3 scripts/gpu_chain_bench.py --links 100 --dram --shapes 2112x1x1024 --patterns gs   # o_proj-sized reads
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import torch
import triton
import triton.language as tl

VEC = 4096          # the chain's vector (a hidden state's size)
CHUNK = 64          # one GEMV-like program's K range of it


@triton.jit
def _acquire(ptr):
    return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _enter(cnt_ptr, link, target, MODE: tl.constexpr, SPREAD: tl.constexpr):
    if MODE == 1:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    elif MODE == 2:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    elif MODE >= 3:
        tl.extra.cuda.gdc_launch_dependents()
        if link == 0:
            tl.extra.cuda.gdc_wait()                        # the graph's first link follows a memset
        else:
            if MODE == 3:
                p = cnt_ptr + (link - 1) * SPREAD * 32 + tl.arange(0, 1)
            else:
                p = cnt_ptr + ((link - 1) * SPREAD + tl.arange(0, SPREAD)) * 32
            c = tl.sum(_acquire(p))
            while c < target:
                c = tl.sum(_acquire(p))
        tl.debug_barrier()


@triton.jit
def _leave(cnt_ptr, link, MODE: tl.constexpr, SPREAD: tl.constexpr):
    if MODE >= 3:
        tl.debug_barrier()                                  # every lane's stores before the release
        j = tl.program_id(0) % SPREAD if MODE == 4 else 0
        tl.atomic_add(cnt_ptr + (link * SPREAD + j) * 32, 1, sem="release", scope="gpu")
        if link >= 2:
            if tl.program_id(0) == 0:                       # link - 1 has passed its spin on link - 2's
                tl.store(cnt_ptr + ((link - 2) * SPREAD + tl.arange(0, SPREAD)) * 32, 0)


@triton.jit
def _gemv_link(x_ptr, y_ptr, w_ptr, junk_ptr, cnt_ptr, link, target, MODE: tl.constexpr, CHUNK: tl.constexpr,
               NCHUNK: tl.constexpr, WORDS: tl.constexpr, SPREAD: tl.constexpr):
    pid = tl.program_id(0)
    _enter(cnt_ptr, link, target, MODE, SPREAD)
    c = pid % NCHUNK
    src = (c + 1) % NCHUNK
    xs = tl.load(x_ptr + src * CHUNK + tl.arange(0, CHUNK))
    w = tl.load(w_ptr + pid.to(tl.int64) * WORDS + tl.arange(0, WORDS))
    junk = tl.sum((w & 15).to(tl.float32)) * tl.sum(xs)
    if pid < NCHUNK:
        tl.store(y_ptr + c * CHUNK + tl.arange(0, CHUNK), xs + 1.0)
    else:
        tl.store(junk_ptr + pid + tl.arange(0, 1), junk + tl.zeros((1,), tl.float32))
    _leave(cnt_ptr, link, MODE, SPREAD)


@triton.jit
def _small_link(x_ptr, y_ptr, cnt_ptr, link, target, MODE: tl.constexpr, VEC: tl.constexpr, CHUNK: tl.constexpr,
                SPREAD: tl.constexpr):
    _enter(cnt_ptr, link, target, MODE, SPREAD)
    offs = tl.arange(0, VEC)
    x = tl.load(x_ptr + (offs + CHUNK) % VEC)
    tl.store(y_ptr + offs, x + 1.0)
    _leave(cnt_ptr, link, MODE, SPREAD)


MODES = {"plain": 0, "wait": 1, "early": 2, "flag": 3, "flags": 4}
SPREAD = 32         # "flags": counters a link's programs increment (pid mod 32), one 128-byte line each


def build(mode: str, links: int, programs: int, warps: int, pattern: str, words: int, dram: bool):
    dev = torch.device("cuda")
    bufs = [torch.zeros(VEC, device=dev) for _ in range(2)]
    # each link its own weights (read from DRAM, as a decode step's are), or all links the same (L2-resident)
    w = torch.randint(0, 2**31 - 1, (links if dram else 1, programs, words), device=dev, dtype=torch.int32)
    junk = torch.zeros(programs, device=dev)
    cnt = torch.zeros((links + 1) * SPREAD * 32, device=dev, dtype=torch.int32)
    m = MODES[mode]
    extra = {} if m == 0 else {"launch_pdl": True}

    def chain():
        cnt.zero_()
        for i in range(links):
            x, y = bufs[i % 2], bufs[(i + 1) % 2]
            kind = pattern[i % len(pattern)]
            prev_programs = programs if pattern[(i - 1) % len(pattern)] == "g" else 1
            if kind == "g":
                _gemv_link[(programs,)](x, y, w[i % w.shape[0]], junk, cnt, i, prev_programs, MODE=m, CHUNK=CHUNK,
                                        NCHUNK=VEC // CHUNK, WORDS=words, SPREAD=SPREAD, num_warps=warps, **extra)
            else:
                _small_link[(1,)](x, y, cnt, i, prev_programs, MODE=m, VEC=VEC, CHUNK=CHUNK, SPREAD=SPREAD, num_warps=8,
                                 **extra)
    return bufs, chain


def run(mode: str, links: int, programs: int, warps: int, pattern: str, reps: int,
        words: int, dram: bool) -> tuple[float, bool]:
    bufs, chain = build(mode, links, programs, warps, pattern, words, dram)
    x0 = torch.arange(VEC, device="cuda", dtype=torch.float32)
    bufs[0].copy_(x0)
    chain()                                                          # compile and warm
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            chain()
    torch.cuda.synchronize()
    # correctness: each link moves the vector by one chunk and adds one
    bufs[0].copy_(x0)
    g.replay()
    torch.cuda.synchronize()
    want = torch.roll(x0, -CHUNK * links) + links
    ok = torch.equal(bufs[links % 2], want)
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(reps):
        g.replay()
    t1.record()
    torch.cuda.synchronize()
    return t0.elapsed_time(t1) * 1000.0 / reps / links, ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--links", type=int, default=200)
    ap.add_argument("--shapes", default="2112x1x2048",
                    help="comma-separated PROGRAMSxWARPSxWORDS of the GEMV-like links (int32 words per program)")
    ap.add_argument("--patterns", default="g,gs", help="comma-separated link patterns: g GEMV-like, s one program")
    ap.add_argument("--modes", default="plain,wait,early,flag,flags,wait")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--dram", action="store_true", help="each link its own weights (else one L2-resident copy)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    lines = [f"{torch.cuda.get_device_name()} · {a.links} links · weights {'per link' if a.dram else 'shared'}",
             "| programs | warps | words | pattern | mode | µs per link | result right |", "|---|---|---|---|---|---|---|"]
    for shape in a.shapes.split(","):
        programs, warps, words = map(int, shape.split("x"))
        for pattern in a.patterns.split(","):
            for mode in a.modes.split(","):
                us, ok = run(mode, a.links, programs, warps, pattern, a.reps, words, a.dram)
                lines.append(f"| {programs} | {warps} | {words} | {pattern} | {mode} | {us:.3f} | {ok} |")
                print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if a.out:
        pathlib.Path(a.out).mkdir(parents=True, exist_ok=True)
        (pathlib.Path(a.out) / "chain_bench.md").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
