"""Piecewise CUDA graphs for prefill steps (and any step of many tokens).

A prefill step cannot replay one whole-model graph: its attention grid depends on the query lengths. Everything
else is row-wise, so — as vLLM does — the model is cut at its attention calls and the parts between two
attentions are captured, once per token-count bucket:

  piece 0      embedding + layer 0 pre-attention (input norm, qkv_proj, q/k norms; q and k left unrotated)
  piece i      layer i−1 post-attention (o_proj, norm, gate_up, SiLU·mul, down) + layer i pre-attention
  piece L      layer L−1 post-attention + final norm

A step of T tokens runs with the smallest bucket n ≥ T: its inputs are staged into static buffers (padding rows:
token 0 at position 0, slot −1), piece 0 is replayed, then for each layer its attention step
(``DecoderLayer.attention``: rotary of q and k fused with the KV store, then paged attention) runs eagerly on
rows [0, n) — with the step's real query_start_loc / context_lens / block tables, so attention reads and writes
only the real rows and the real sequences' cache blocks; padding rows store nowhere (slot −1; they are rotated,
at position 0, like any row) and their attention output is never written — and the next piece is replayed.
Every op of a piece acts on each row alone, so whatever the padding rows hold never reaches a real row. About
3·L + 1 Python launches a step instead of ≈ 16·L.

Memory: the pieces pass data only through static buffers allocated here, outside the graph pool — inputs
(token ids, positions, slots), q/k/v (one [n, (H + 2·H_kv)·D] buffer, the fused projection's layout), the
residual, the attention output and the final hidden states — each sized for the largest bucket and shared by
every piece and bucket. A piece's intermediates are freed when its capture ends, so all pieces of all buckets
(and, when given its pool, the decode graphs) share one memory pool whose size is one piece's working set at
the largest bucket. Safe because pieces replay one at a time on one stream and nothing is read across pieces
except the static buffers.

Tensor parallelism: every rank captures the same buckets in the same order (the pieces hold the row-parallel
layers' all-reduces) and replays the same bucket, chosen from the same StepInputs.

On a machine without CUDA (tests) a piece's "graph" is the recorded callable, replayed eagerly on the same
static buffers (``EagerPiece``); ``graph_factory`` chooses.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from nvllm.kernels import report
from nvllm.layers.attention import AttentionMetadata

logger = logging.getLogger("nvllm")

MIN_BUCKET = 32


def token_bucket_ladder(max_tokens: int, min_tokens: int = MIN_BUCKET) -> list[int]:
    """Token counts to capture: powers of two from ``min_tokens`` to 256 (there the GEMMs read weights and
    padding is almost free), then four buckets per doubling (320, 384, 448, 512, 640, …: at most 25% padding
    where the GEMMs are compute-bound), up to ``max_tokens``, which ends the ladder when it is not on it."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    sizes: list[int] = []
    n = min_tokens
    while n < max_tokens:
        sizes.append(n)
        n = n * 2 if n < 256 else n + (1 << (n.bit_length() - 1)) // 4
    sizes.append(max_tokens)
    return sizes


class CudaPiece:
    """One captured piece: ``fn`` recorded into a CUDA graph on ``stream``, sharing memory pool ``pool``.
    Unlike ``torch.cuda.graph`` this does not synchronize and empty the allocator's cache for every capture
    (hundreds of pieces); the caller synchronizes once per bucket."""

    def __init__(self, fn: Callable[[], None], pool, stream: torch.cuda.Stream):
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            self.graph.capture_begin(pool=pool)
            try:
                fn()
            finally:
                self.graph.capture_end()

    def replay(self) -> None:
        self.graph.replay()

    def pool(self):
        return self.graph.pool()


class EagerPiece:
    """The stand-in without CUDA: capturing records ``fn``, replaying calls it on the same static buffers (what
    a graph replays is what ``fn`` launched at capture: it closes over those buffers only)."""

    def __init__(self, fn: Callable[[], None], pool=None):
        self.fn = fn

    def replay(self) -> None:
        self.fn()

    def pool(self):
        return None


def _capture_stream() -> torch.cuda.Stream:
    """The side stream ``torch.cuda.graph`` captures on by default (DecodeGraphs uses it): blocks of a shared
    pool are reused only by captures on the stream that freed them."""
    if torch.cuda.graph.default_capture_stream is None:
        torch.cuda.graph.default_capture_stream = torch.cuda.Stream()
    return torch.cuda.graph.default_capture_stream


class PiecewiseGraphs:
    """``run(input_ids, positions, meta)`` → the final hidden states of T ≤ ``max_tokens`` tokens, as
    ``model(input_ids, positions, kv_caches, meta)`` computes them (the row-wise ops run on the bucket's n rows,
    so GEMM results may differ in the last bits where the GEMM library picks another kernel for n rows).

    ``model``: a LlamaForCausalLM (``embed_tokens``, ``layers`` with ``pre_attention`` / ``attention`` /
    ``post_attention``, ``norm``); ``kv_caches``: its per-layer caches; ``max_tokens``: the largest step to
    capture (the ladder's top); ``sizes``: the buckets (default ``token_bucket_ladder(max_tokens)``); ``pool``:
    a graph memory pool to share (e.g. the decode graphs'); ``graph_factory(fn, pool)``: makes a piece
    (default: ``CudaPiece`` on a CUDA device, ``EagerPiece`` elsewhere)."""

    def __init__(self, model, kv_caches, max_tokens: int, device: torch.device | str,
                 sizes: list[int] | None = None, pool=None,
                 graph_factory: Callable[[Callable[[], None], object], object] | None = None):
        self.model = model
        self.kv_caches = kv_caches
        self.device = torch.device(device)
        self.sizes = sorted(set(sizes)) if sizes else token_bucket_ladder(max_tokens)
        if self.sizes[0] < 1:
            raise ValueError(f"bucket sizes must be positive, got {self.sizes}")
        self.pool = pool
        cuda = self.device.type == "cuda"
        if graph_factory is None:
            graph_factory = (lambda fn, p: CudaPiece(fn, p, _capture_stream())) if cuda else EagerPiece
        self.graph_factory = graph_factory

        s = model.shape
        n = self.sizes[-1]
        dtype = model.embed_tokens.weight.dtype
        self.q_size, self.kv_size = s.num_local_heads * s.head_dim, s.num_local_kv_heads * s.head_dim
        self.heads, self.kv_heads, self.head_dim = s.num_local_heads, s.num_local_kv_heads, s.head_dim
        # rows 0..2: token ids, positions, slots; one host-to-device copy fills them
        self.meta = torch.zeros(3, n, dtype=torch.int64, device=self.device)
        self.input_ids, self.positions, self.slot_mapping = self.meta[0], self.meta[1], self.meta[2]
        self.slot_mapping.fill_(-1)
        self.host_meta = torch.zeros(3, n, dtype=torch.int64, pin_memory=cuda)
        self.copied = torch.cuda.Event() if cuda else None
        # q, k, v side by side as the fused projection writes them (views; strides as in the eager path)
        w = self.q_size + 2 * self.kv_size
        self.qkv = torch.zeros(n, w, dtype=dtype, device=self.device)
        self.q = self.qkv[:, :self.q_size].view(n, self.heads, self.head_dim)
        self.k = self.qkv[:, self.q_size:self.q_size + self.kv_size].view(n, self.kv_heads, self.head_dim)
        self.v = self.qkv[:, self.q_size + self.kv_size:].view(n, self.kv_heads, self.head_dim)
        self.residual = torch.zeros(n, s.hidden_size, dtype=dtype, device=self.device)
        self.attn_out = torch.zeros(n, self.q_size, dtype=dtype, device=self.device)
        self.hidden = torch.zeros(n, s.hidden_size, dtype=dtype, device=self.device)
        self.pieces: dict[int, list] = {}  # bucket → its L + 1 pieces, in replay order
        self.recorded: dict[int, object] = {}  # bucket → kernel-report records of its captures
        self._bucket_views: dict[int, tuple[torch.Tensor, ...]] = {}

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1]

    def fits(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.sizes[-1]

    def bucket(self, num_tokens: int) -> int:
        """The captured size a step of ``num_tokens`` tokens runs at."""
        if not self.fits(num_tokens):
            raise ValueError(f"{num_tokens} tokens: piecewise graphs hold 1..{self.max_tokens}")
        return self.sizes[bisect.bisect_left(self.sizes, num_tokens)]

    # ---- the pieces ------------------------------------------------------------------------------------
    def _stage_qkv(self, n: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """q, k, v → the static buffer: nothing to do when the projection wrote there (``qkv_out``); else one
        copy when they are the column ranges of one row-major tensor, else one per tensor not already in place
        (Qwen3's normed q and k are new tensors)."""
        if q.data_ptr() == self.q.data_ptr() and k.data_ptr() == self.k.data_ptr():
            return
        w, e = self.qkv.shape[1], q.element_size()
        d = self.head_dim
        fused = (q.stride() == (w, d, 1) and k.stride() == (w, d, 1) and v.stride() == (w, d, 1)
                 and q.dtype == k.dtype == v.dtype == self.qkv.dtype
                 and k.data_ptr() == q.data_ptr() + self.q_size * e
                 and v.data_ptr() == k.data_ptr() + self.kv_size * e)
        if fused:
            self.qkv[:n].copy_(q.as_strided((n, w), (w, 1)))
        else:
            for src, dst in ((q, self.q), (k, self.k), (v, self.v)):
                if src.data_ptr() != dst.data_ptr():
                    dst[:n].copy_(src)

    def _piece(self, i: int, n: int) -> Callable[[], None]:
        """Piece ``i`` of bucket ``n`` (see the module doc): reads and writes rows [0, n) of the static buffers
        only, so a replay recomputes it from whatever they hold then."""
        model, layers = self.model, self.model.layers
        ids, pos = self.input_ids[:n], self.positions[:n]
        attn_out, residual_buf = self.attn_out[:n], self.residual[:n]

        def piece() -> None:
            if i == 0:
                hidden, residual = model.embed_tokens(ids), None
            else:
                hidden, residual = layers[i - 1].post_attention(attn_out, residual_buf)
            if i < len(layers):
                q, k, v, _ = layers[i].pre_attention(pos, hidden, residual, rotate=False, qkv_out=self.qkv[:n],
                                                     residual_out=residual_buf)
                self._stage_qkv(n, q, k, v)
            else:
                hidden, _ = model.norm(hidden, residual)
                self.hidden[:n].copy_(hidden)

        return piece

    def _views(self, n: int) -> tuple[torch.Tensor, ...]:
        """Rows [0, n) of q, k, v, the attention output (as [n, H, D]), the slots and the positions, made once
        per bucket."""
        views = self._bucket_views.get(n)
        if views is None:
            views = self._bucket_views[n] = (self.q[:n], self.k[:n], self.v[:n],
                                             self.attn_out[:n].view(n, self.heads, self.head_dim),
                                             self.slot_mapping[:n], self.positions[:n])
        return views

    @staticmethod
    def _attend(layer, kv_cache, views, meta: AttentionMetadata) -> None:
        """The layer's attention step (``DecoderLayer.attention``: rotary of the staged q and k fused with the
        KV store, then paged attention over the cache) on the bucket's rows, written into the static buffer
        the next piece reads (``out=``: no copy)."""
        q, k, v, out, _, positions = views
        layer.attention(positions, q, k, v, kv_cache, meta, out=out)

    # ---- start-up --------------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Per bucket, largest first: run the pieces once eagerly (compiles kernels, allocates split-K
        workspaces and cuBLAS state outside capture), then capture them in order into the shared pool."""
        start = time.perf_counter()
        cuda = self.device.type == "cuda"
        reserved = torch.cuda.memory_reserved(self.device) if cuda else 0
        num_pieces = len(self.model.layers) + 1
        for n in reversed(self.sizes):
            fns = [self._piece(i, n) for i in range(num_pieces)]
            for fn in fns:  # warm-up on the static buffers (attention not needed: pieces read its buffer)
                fn()
            if cuda:
                torch.cuda.synchronize(self.device)
            pieces = []
            with report.recording() as self.recorded[n]:  # what the captured pieces run, for the kernel report
                for fn in fns:
                    piece = self.graph_factory(fn, self.pool)
                    if self.pool is None:
                        self.pool = piece.pool()
                    pieces.append(piece)
            self.pieces[n] = pieces
        grown = ""
        if cuda:
            torch.cuda.synchronize(self.device)
            grown = f", memory reserved +{(torch.cuda.memory_reserved(self.device) - reserved) / (1 << 30):.2f} GiB"
        logger.info("captured %d piecewise %s (%d pieces x %d token buckets %s) in %.1f s%s",
                    num_pieces * len(self.sizes), "CUDA graphs" if cuda else "graph stand-ins", num_pieces,
                    len(self.sizes), self.sizes, time.perf_counter() - start, grown)

    # ---- one step --------------------------------------------------------------------------------------
    def _stage_inputs(self, t: int, n: int, rows) -> None:
        """Token ids, positions and slots of the t real rows (+ padding to n) into the static device buffer:
        lists and host tensors through the pinned staging buffer and one asynchronous copy, tensors already
        on the device by a device copy after it (nothing waits for them)."""
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copy out of the staging buffer is done
        on_device = []
        for r, values in enumerate(rows):
            # by device type: a tensor on "cuda:0" is on a runner's torch.device("cuda") (never a D2H copy)
            if isinstance(values, torch.Tensor) and values.device.type == self.device.type:
                on_device.append((r, values))
            elif isinstance(values, torch.Tensor):
                self.host_meta[r, :t] = values
            else:
                self.host_meta[r, :t] = torch.tensor(values, dtype=torch.int64)
        self.host_meta[:2, t:n] = 0  # padding rows: token 0 at position 0, stored nowhere
        self.host_meta[2, t:n] = -1
        # the whole contiguous buffer: a strided slice would be staged through pageable memory by copy_
        self.meta.copy_(self.host_meta, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        for r, values in on_device:
            self.meta[r, :t].copy_(values)

    @torch.inference_mode()
    def run(self, input_ids: list[int] | torch.Tensor, positions: list[int] | torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """The final hidden states [T, hidden] of T = len(positions) tokens (a view of a static buffer: valid
        until the next run). ``input_ids`` / ``positions`` / ``meta.slot_mapping``: T values each, lists or
        tensors (a tensor on the device is copied on the device); the other ``meta`` fields (device tensors
        and host ints, as for the eager forward) are used as they are."""
        t = len(positions)
        n = self.bucket(t)
        self._stage_inputs(t, n, (input_ids, positions, meta.slot_mapping))
        views = self._views(n)
        padded = AttentionMetadata(views[4], meta.block_tables, meta.query_start_loc, meta.context_lens,
                                   meta.max_query_len, meta.max_context_len)
        pieces = self.pieces[n]
        pieces[0].replay()
        for layer, kv_cache, piece in zip(self.model.layers, self.kv_caches, pieces[1:]):
            self._attend(layer, kv_cache, views, padded)
            piece.replay()
        report.record("prefill step", f"piecewise cuda graphs (bucket {n})")
        report.replay(self.recorded[n])
        return self.hidden[:t]
