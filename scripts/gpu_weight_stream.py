"""How fast a decode GEMV's weight stream can be read, by access pattern alone (no arithmetic).

The one-row ``half2`` GEMV reads GPTQ's ``qweight [K/8, N]`` in its own pieces: program (column tile, K split) takes
``rows`` word rows of ``cols`` words, each row a separate ``cols · 4``-byte piece ``N · 4`` bytes from the next. This
script reads the same bytes with the same grid and warps two ways and reports the bandwidth:

* ``strided``: the GEMV's pieces, in place in ``[K/8, N]``;
* ``tiled``: the same pieces laid out one after another (each program's ``rows × cols`` words contiguous), as a
  load-time repacking would store them;
* ``tma BOXxSTAGES`` (``--tma``): the strided pieces through the bulk tensor copy engine — a tensor descriptor over
  ``[K/8, N]`` whose boxes of ``BOX`` word rows Triton's software pipeline keeps ``STAGES`` deep in shared memory —
  instead of loads into registers. The same XOR per program as ``strided`` is checked.

The last shape holds as many words as a layer's four projections together, read by one launch.

Each program XORs its words (8 rows a step, as the GEMV loads them) and stores one word, so the loads stay. Timed
in a CUDA graph over copies that together exceed L2. Results: $OUT/weight_stream.json and a table.

    python scripts/gpu_weight_stream.py [--tma 8x2,8x3,16x3] [--shapes gate_up,down]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from nvllm.kernels.gemm_tuner import cuda_graph_timer  # noqa: E402

# Qwen2.5-7B projections as the one-row GEMV splits them (waves 16 on 132 SMs): (K/8, N, rows a program)
SHAPES = {"qkv": (448, 4608, 8), "o": (448, 3584, 8), "gate_up": (448, 37888, 32), "down": (2368, 3584, 16),
          # a layer's four weights (116.5 MB) in one launch: what the kernel boundaries between them cost
          "layer in one": (768, 37888, 48)}


@triton.jit
def _stream_kernel(w_ptr, out_ptr, stride_row, n_k, ROWS: tl.constexpr, COLS: tl.constexpr, TILED: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    r = tl.arange(0, 8)[:, None]
    c = tl.arange(0, COLS)[None, :]
    if TILED:
        base = w_ptr + ((pid_n * n_k + pid_k) * ROWS).to(tl.int64) * COLS
        stride = COLS
    else:
        base = w_ptr + (pid_k * ROWS).to(tl.int64) * stride_row + pid_n * COLS
        stride = stride_row
    acc = tl.zeros((8, COLS), tl.int32)
    for r0 in range(0, ROWS, 8):
        acc ^= tl.load(base + (r0 + r).to(tl.int64) * stride + c, eviction_policy="evict_first")
    tl.store(out_ptr + pid_k * tl.num_programs(0) + pid_n, tl.reduce(tl.reduce(acc, 1, _xor), 0, _xor))


@triton.jit
def _stream_tma_kernel(desc, out_ptr, ROWS: tl.constexpr, COLS: tl.constexpr, BOX: tl.constexpr,
                       STAGES: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    acc = tl.zeros((BOX, COLS), tl.int32)
    for r0 in tl.range(0, ROWS, BOX, num_stages=STAGES):
        acc ^= desc.load([pid_k * ROWS + r0, pid_n * COLS])
    tl.store(out_ptr + pid_k * tl.num_programs(0) + pid_n, tl.reduce(tl.reduce(acc, 1, _xor), 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


def measure(name: str, k8: int, n: int, rows: int, cols: int, warps: int, tma: list[tuple[int, int]]) -> dict:
    n_tiles, n_k = n // cols, k8 // rows
    nbytes = k8 * n * 4
    copies = [torch.randint(-2**31, 2**31 - 1, (k8, n), device="cuda", dtype=torch.int32)
              for _ in range(max(2, -(-(256 << 20) // nbytes)))]
    out = torch.empty(n_tiles * n_k, device="cuda", dtype=torch.int32)
    res = {"shape": name, "cols": cols, "warps": warps, "programs": n_tiles * n_k}
    for tiled in (False, True):
        def call(i, tiled=tiled):
            _stream_kernel[(n_tiles, n_k)](copies[i], out, n, n_k, ROWS=rows, COLS=cols, TILED=tiled,
                                           num_warps=warps)
        s = cuda_graph_timer(call, len(copies), nbytes / 4e12)
        res["tiled" if tiled else "strided"] = {"us": s * 1e6, "TBps": nbytes / s / 1e12}
    _stream_kernel[(n_tiles, n_k)](copies[0], out, n, n_k, ROWS=rows, COLS=cols, TILED=False, num_warps=warps)
    want = out.clone()
    for box, stages in tma:
        if rows % box or cols > 256:   # a box spans at most 256 elements a dimension
            continue
        descs = [TensorDescriptor.from_tensor(c, [box, cols]) for c in copies]

        def call(i, box=box, stages=stages, descs=descs):
            _stream_tma_kernel[(n_tiles, n_k)](descs[i], out, ROWS=rows, COLS=cols, BOX=box, STAGES=stages,
                                               num_warps=warps)
        call(0)
        if not torch.equal(out, want):
            raise SystemExit(f"tma {box}x{stages} on {name}: XOR differs from the strided loads")
        s = cuda_graph_timer(call, len(copies), nbytes / 4e12)
        res[f"tma {box}x{stages}"] = {"us": s * 1e6, "TBps": nbytes / s / 1e12}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tma", default="", help="BOXxSTAGES settings of the tensor-copy reads, e.g. 8x2,16x3")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    tma = [tuple(int(v) for v in t.split("x")) for t in args.tma.split(",") if t]
    out_dir = Path(os.environ.get("OUT", "."))
    # the tensor descriptors' scratch, should Triton ask for one
    triton.set_allocator(lambda size, align, stream: torch.empty(size, device="cuda", dtype=torch.int8))
    results = {"card": torch.cuda.get_device_name(), "commit": os.environ.get("NVLLM_COMMIT", "unknown"),
               "runs": []}
    modes = ["strided", "tiled"] + [f"tma {b}x{st}" for b, st in tma]
    print("| shape | cols | warps | programs | " + " | ".join(f"{m} µs | TB/s" for m in modes) + " |")
    print("|---|---|---|---|" + "---|---|" * len(modes))
    for name in args.shapes.split(","):
        k8, n, rows = SHAPES[name]
        for cols, warps in ((256, 1), (256, 4), (512, 2), (1024, 4)):
            if n % cols:
                continue
            r = measure(name, k8, n, rows, cols, warps, tma)
            results["runs"].append(r)
            cells = [f"{r[m]['us']:.2f} | {r[m]['TBps']:.2f}" if m in r else "— | —" for m in modes]
            print(f"| {name} | {cols} | {warps} | {r['programs']} | " + " | ".join(cells) + " |", flush=True)
    (out_dir / "weight_stream.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
