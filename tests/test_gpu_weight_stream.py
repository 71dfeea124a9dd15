"""scripts/gpu_weight_stream.py's kernel under the Triton interpreter: each program's XOR covers exactly the words
the one-row GEMV's program reads (``strided``: its pieces of ``[K/8, N]``) or the same count laid out one program
after another (``tiled``)."""

from __future__ import annotations

import functools
import importlib.util
import operator
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from tests.conftest import REPO  # noqa: E402


def _load():
    spec = importlib.util.spec_from_file_location("gpu_weight_stream", REPO / "scripts" / "gpu_weight_stream.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _xor(t: torch.Tensor) -> int:
    return functools.reduce(operator.xor, t.flatten().tolist())


@pytest.mark.parametrize("rows", [8, 16])
def test_each_program_reads_its_own_words(rows):
    ws = _load()
    k8, n, cols = 2 * rows, 3 * 64, 64
    n_tiles, n_k = n // cols, k8 // rows
    w = torch.randint(-2**31, 2**31 - 1, (k8, n), dtype=torch.int32, generator=torch.Generator().manual_seed(rows))
    out = torch.empty(n_tiles * n_k, dtype=torch.int32)
    ws._stream_kernel[(n_tiles, n_k)](w, out, n, n_k, ROWS=rows, COLS=cols, TILED=False, num_warps=1)
    assert out.tolist() == [_xor(w[k * rows:(k + 1) * rows, t * cols:(t + 1) * cols])
                            for k in range(n_k) for t in range(n_tiles)]
    ws._stream_kernel[(n_tiles, n_k)](w, out, n, n_k, ROWS=rows, COLS=cols, TILED=True, num_warps=1)
    flat, piece = w.flatten(), rows * cols
    assert out.tolist() == [_xor(flat[(t * n_k + k) * piece:(t * n_k + k + 1) * piece])
                            for k in range(n_k) for t in range(n_tiles)]
