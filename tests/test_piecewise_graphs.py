"""Piecewise CUDA graphs for prefill, on the CPU: the decoder layer split at its attention computes exactly what
the one-piece forward computed, and PiecewiseGraphs — its pieces "captured" as recorded callables replayed on
the same static buffers, which is what a CUDA graph replays — gives the eager forward's hidden states and writes
the same KV cache entries (and nothing else) for prompts of any length, batches of prompt chunks over cached
prefixes, decode rows, an int8 cache and the Triton kernels, whatever the padding rows hold."""

from __future__ import annotations

import random

import pytest
import torch

from nvllm.config import EngineConfig
from nvllm.engine.piecewise_graphs import EagerPiece, PiecewiseGraphs, token_bucket_ladder
from nvllm.kernels import report
from nvllm.layers.attention import AttentionMetadata, allocate_kv_caches
from nvllm.models.loader import load_hf_config, load_model
from tests.conftest import build_tiny_model

BLOCK = 8
NUM_BLOCKS = 48


def load(path) -> torch.nn.Module:
    path = str(path)
    return load_model(EngineConfig(model=path, device="cpu"), load_hf_config(path), torch.float32,
                      torch.device("cpu"))


@pytest.fixture(scope="module")
def models(demo_dir, tmp_path_factory) -> dict[str, torch.nn.Module]:
    root = tmp_path_factory.mktemp("piecewise")
    return {"demo": load(demo_dir),
            "qwen3": load(build_tiny_model("qwen3", root / "qwen3", num_hidden_layers=3)),  # q/k norms
            "qwen2": load(build_tiny_model("qwen2", root / "qwen2"))}  # qkv bias


def caches_for(model, kv_cache_dtype: str = "auto", seed: int = 0):
    """Caches full of random values (zeros for the scales), so a stray write anywhere shows."""
    s = model.shape
    caches = allocate_kv_caches(s.num_layers, NUM_BLOCKS, BLOCK, s.num_local_kv_heads, s.head_dim, torch.float32,
                                kv_cache_dtype, "cpu")
    g = torch.Generator().manual_seed(seed)
    for c in caches:
        for t in c[:2]:
            t.copy_(torch.randn(t.shape, generator=g).mul(3).to(t.dtype))
    return caches


def clone(caches):
    return [type(c)(*(None if t is None else t.clone() for t in c)) for c in caches]


def tensors(cache) -> list[torch.Tensor]:
    """K, V and (quantized cache) their scales."""
    return [t for t in cache if t is not None]


class Seq:
    """A sequence: random tokens and a block table of scattered block ids."""

    def __init__(self, length: int, blocks: list[int], rng: random.Random, vocab: int):
        self.tokens = [rng.randrange(3, vocab) for _ in range(length)]
        self.table = blocks

    def slot(self, p: int) -> int:
        return self.table[p // BLOCK] * BLOCK + p % BLOCK


def make_seqs(lengths: list[int], vocab: int, seed: int = 0) -> list[Seq]:
    rng = random.Random(seed)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    seqs = []
    for n in lengths:
        k = -(-n // BLOCK)
        seqs.append(Seq(n, free[:k], rng, vocab))
        free = free[k:]
    return seqs


def step(chunks: list[tuple[Seq, int, int]]):
    """(token ids, positions, slots, metadata) of a step running tokens [start, end) of each sequence."""
    ids, pos, slots, qsl, ctx = [], [], [], [0], []
    for seq, start, end in chunks:
        ids += seq.tokens[start:end]
        pos += list(range(start, end))
        slots += [seq.slot(p) for p in range(start, end)]
        qsl.append(qsl[-1] + end - start)
        ctx.append(end)
    width = max(len(seq.table) for seq, _, _ in chunks)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        block_tables=torch.tensor([seq.table + [0] * (width - len(seq.table)) for seq, _, _ in chunks],
                                  dtype=torch.int32),
        context_lens=torch.tensor(ctx, dtype=torch.int32),
        max_query_len=max(e - s for _, s, e in chunks), max_context_len=max(ctx))
    return ids, pos, slots, meta


# ---- (a) the split layer ---------------------------------------------------------------------------------
def old_layer_forward(layer, positions, hidden, residual, kv_cache, meta):
    """DecoderLayer.forward as it was before the split, verbatim."""
    if residual is None:
        residual = hidden
        hidden = layer.input_layernorm(hidden)
    else:
        hidden, residual = layer.input_layernorm(hidden, residual)
    q, k, v = layer.split_qkv(layer.qkv_proj(hidden), positions)
    hidden = layer.o_proj(layer.attn(q, k, v, kv_cache, meta))
    hidden, residual = layer.post_attention_layernorm(hidden, residual)
    hidden = layer.down_proj(layer.gate_up_proj.silu_and_mul(hidden))
    return hidden, residual


@pytest.mark.parametrize("name", ["demo", "qwen3", "qwen2"])
@torch.inference_mode()
def test_split_layer_is_the_old_forward(models, name):
    model = models[name]
    seqs = make_seqs([21, 30], model.shape.vocab_size)
    ids, pos, _, meta = step([(seqs[0], 0, 21), (seqs[1], 0, 30)])
    ids, pos = torch.tensor(ids), torch.tensor(pos)
    old_caches, new_caches = caches_for(model), caches_for(model)
    hidden, residual = model.embed_tokens(ids), None
    for layer, old_c, new_c in zip(model.layers, old_caches, new_caches):
        want = old_layer_forward(layer, pos, hidden, residual, old_c, meta)
        got = layer(pos, hidden, residual, new_c, meta)
        q, k, v, r = layer.pre_attention(pos, hidden, residual)  # the halves on their own
        halves = layer.post_attention(layer.attn(q, k, v, caches_for(model)[0], meta), r)
        for a, b, c in zip(want, got, halves):
            assert torch.equal(a, b) and torch.equal(a, c)
        hidden, residual = want
    for a, b in zip(old_caches, new_caches):
        assert all(torch.equal(x, y) for x, y in zip(tensors(a), tensors(b)))
    want_final, _ = model.norm(hidden, residual)
    assert torch.equal(model(ids, pos, caches_for(model), meta), want_final)


# ---- (b) piecewise graphs against the eager forward ------------------------------------------------------
def check_step(model, pw, eager_caches, chunks, ids_as_tensor=False, slots_as_list=False, atol=1e-5):
    """Run one step eagerly and through ``pw`` (on its own caches); hidden states and caches must agree, and
    cache entries outside the step's slots must be untouched."""
    ids, pos, slots, meta = step(chunks)
    before = clone(pw.kv_caches)
    want = model(torch.tensor(ids), torch.tensor(pos), eager_caches, meta)
    pw_meta = meta
    if slots_as_list:
        pw_meta = AttentionMetadata(slots, meta.block_tables, meta.query_start_loc, meta.context_lens,
                                    meta.max_query_len, meta.max_context_len)
    got = pw.run(torch.tensor(ids) if ids_as_tensor else ids, pos, pw_meta)
    assert got.shape == want.shape == (len(ids), model.shape.hidden_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=atol)
    written = torch.zeros(NUM_BLOCKS * BLOCK, dtype=torch.bool)
    written[torch.tensor(slots)] = True
    for layer_pw, layer_eager, layer_before in zip(pw.kv_caches, eager_caches, before):
        for t_pw, t_eager, t_before in zip(tensors(layer_pw), tensors(layer_eager), tensors(layer_before)):
            flat = lambda t: t.reshape(NUM_BLOCKS * BLOCK, -1).float()  # noqa: E731
            torch.testing.assert_close(flat(t_pw)[written], flat(t_eager)[written], rtol=1e-5, atol=atol)
            assert torch.equal(flat(t_pw)[~written], flat(t_before)[~written])  # padding rows wrote nothing
    return pw.bucket(len(ids))


def piecewise(model, caches, max_tokens=128, **kw) -> PiecewiseGraphs:
    pw = PiecewiseGraphs(model, caches, max_tokens, "cpu", **kw)
    pw.capture()
    return pw


@pytest.mark.parametrize("name", ["demo", "qwen3"])
def test_prompts_of_any_length(models, name):
    model = models[name]
    eager = caches_for(model)
    pw = piecewise(model, clone(eager))
    assert pw.sizes == [32, 64, 128] and pw.max_tokens == 128
    assert all(len(p) == len(model.layers) + 1 for p in pw.pieces.values())
    seqs = make_seqs([100, 20, 45, 33], model.shape.vocab_size, seed=1)
    report.reset()
    # largest first: the later, shorter steps find the static buffers' rows past their length holding the
    # earlier steps' values
    buckets = [check_step(model, pw, eager, [(seq, 0, len(seq.tokens))]) for seq in seqs]
    assert buckets == [128, 32, 64, 64]
    assert report.snapshot()["prefill step"] == {"piecewise cuda graphs (bucket 128)": 1,
                                                 "piecewise cuda graphs (bucket 32)": 1,
                                                 "piecewise cuda graphs (bucket 64)": 2}


@pytest.mark.parametrize("name", ["demo", "qwen3"])
def test_chunked_prefill_batches(models, name):
    """Chunks over cached prefixes (one starting mid-block), a prompt, a decode row: step after step, each
    reading what the previous ones stored."""
    model = models[name]
    eager = caches_for(model, seed=2)
    pw = piecewise(model, clone(eager))
    a, b, c, d = make_seqs([40, 31, 31, 60], model.shape.vocab_size, seed=3)
    check_step(model, pw, eager, [(a, 0, 13), (c, 0, 29)])                         # first chunks
    check_step(model, pw, eager, [(a, 13, 24), (b, 0, 9), (c, 29, 30), (d, 0, 16)],  # chunk mid-block, decode
               ids_as_tensor=True)
    check_step(model, pw, eager, [(a, 24, 40), (b, 9, 31), (d, 16, 60)], slots_as_list=True)
    check_step(model, pw, eager, [(c, 30, 31)])                                    # one decode row


def test_int8_kv_cache(models):
    model = models["qwen3"]
    eager = caches_for(model, "int8")
    pw = piecewise(model, clone(eager), max_tokens=64)
    a, b = make_seqs([37, 50], model.shape.vocab_size, seed=4)
    check_step(model, pw, eager, [(a, 0, 20), (b, 0, 11)])
    check_step(model, pw, eager, [(a, 20, 37), (b, 11, 50)])


def test_triton_kernels_with_poisoned_padding(models, monkeypatch):
    """The Triton KV store and prefill attention (interpreted) on padded rows: every static buffer is NaN
    before the steps, and the attention leaves its padding rows as they are — none of it reaches a real row."""
    monkeypatch.setenv("NVLLM_KERNELS", "triton")
    model = models["demo"]
    eager = caches_for(model, seed=5)
    pw = piecewise(model, clone(eager), max_tokens=64)
    for buf in (pw.qkv, pw.residual, pw.attn_out, pw.hidden):
        buf.fill_(float("nan"))
    a, b = make_seqs([30, 25], model.shape.vocab_size, seed=6)
    report.reset()
    check_step(model, pw, eager, [(a, 0, 19)], atol=1e-4)
    check_step(model, pw, eager, [(a, 19, 30), (b, 0, 25)], atol=1e-4)
    assert torch.isnan(pw.attn_out[36:]).all()  # rows no step wrote
    r = report.snapshot()
    assert set(r["attention.prefill"]) == {"triton paged prefill"} and set(r["kv_store"]) == {"triton store_kv"}


def test_pieces_are_replayed_in_order(models):
    """Each step replays its bucket's L + 1 captured pieces, in capture order, and nothing else."""
    model = models["demo"]
    log = []

    class Recorder(EagerPiece):
        def __init__(self, fn, pool=None):
            super().__init__(fn, pool)

        def replay(self):
            log.append(self)
            super().replay()

    eager = caches_for(model)
    pw = piecewise(model, clone(eager), max_tokens=64, graph_factory=Recorder)
    (a,) = make_seqs([50], model.shape.vocab_size)
    log.clear()
    check_step(model, pw, eager, [(a, 0, 50)])
    assert log == pw.pieces[64]


# ---- (c) the bucket ladder -------------------------------------------------------------------------------
def test_bucket_ladder():
    assert token_bucket_ladder(2048) == [32, 64, 128, 256, 320, 384, 448, 512, 640, 768, 896, 1024, 1280, 1536,
                                         1792, 2048]
    assert token_bucket_ladder(8192)[-5:] == [4096, 5120, 6144, 7168, 8192]
    assert token_bucket_ladder(1000) == [32, 64, 128, 256, 320, 384, 448, 512, 640, 768, 896, 1000]
    assert token_bucket_ladder(100) == [32, 64, 100]
    assert token_bucket_ladder(32) == [32] and token_bucket_ladder(20) == [20]
    with pytest.raises(ValueError):
        token_bucket_ladder(0)


def test_bucket_choice(models):
    model = models["demo"]
    pw = PiecewiseGraphs(model, caches_for(model), 1000, "cpu")
    assert pw.max_tokens == 1000 and pw.sizes[-1] == 1000
    assert [pw.bucket(t) for t in (1, 32, 33, 257, 999, 1000)] == [32, 32, 64, 320, 1000, 1000]
    assert pw.fits(1000) and not pw.fits(1001) and not pw.fits(0)
    with pytest.raises(ValueError):
        pw.bucket(1001)
    custom = PiecewiseGraphs(model, caches_for(model), 0, "cpu", sizes=[48, 16, 48])
    assert custom.sizes == [16, 48] and custom.max_tokens == 48 and custom.qkv.shape[0] == 48
