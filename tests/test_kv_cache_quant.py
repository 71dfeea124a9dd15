"""KV cache in INT8 / FP8 e4m3 with per-(token, KV head) scales computed when K/V are stored.

Kernels (Triton under the interpreter, small shapes) against the torch references:
  * quantize-on-store: INT8 elements and every scale bit-exact; FP8 scales bit-exact and elements equal to the
    kernel's own cast of the reference's scaled values (this Triton interpreter rounds fp32 -> e4m3 wrongly
    where the mantissa carries into the exponent, e.g. 127.9 -> 64; the GPU's cvt rounds to nearest even,
    as torch does — the cast itself is checked on the GPU);
  * decode and prefill attention that dequantize inside the kernel vs the reference that dequantizes the cache
    explicitly: fp32 atol/rtol 2e-5, fp16 3e-3, bf16 2e-2 (the tolerances of the unquantized kernels).
Accuracy (stated bounds; the numbers measured when written in brackets):
  * one quantize -> dequantize round trip: INT8 |x - x'| <= amax/254 per element; FP8 <= 2^-4 |x| + 2^-10 scale;
  * attention output, random N(0, 1) K/V and q, head_dim 64: relative L2 error vs the fp32 cache
    INT8 <= 1.2% [0.74%], FP8 <= 5% [3.3%];
  * attention output on the demo model's own K/V (all 5 layers, a 32-token story): INT8 <= 10% per layer
    [3.3-6.9%], FP8 <= 25% [8.3-15%]. The demo model is unusually sensitive: |q|, |k| reach 20-35 at
    head_dim 8, so scores span hundreds and softmax is sharp (K's relative error is only 0.5% in INT8, 1.5% in
    FP8); rounding its K/V to bf16 (0.17% error) already moves the output 0.7-1.0%;
  * greedy: 16 prompts x 16 new tokens, INT8 cache identical to the fp32 cache on >= 11 [12: two diverge at
    the first token, two at tokens 13 and 14]; FP8 >= 8 [9];
  * perplexity of 8 x 255 held-out WikiText-2 tokens (tests/data/wikitext-2-test-head.raw) through
    prompt_logprobs: INT8 within +1% [+0.48%], FP8 within +2% [+0.69%] of the fp32 cache.
Capacity: at the same kv_cache_memory a 16-bit model with head_dim 128 holds 2·128/(128+4) = 1.939x the tokens
with an INT8 cache (scales: one fp32 per token, layer, K/V and KV head); the fp32 demo model 4·8/(8+4) = 2.667x.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel module is imported

import functools  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from nvllm import SamplingParams  # noqa: E402
from nvllm.config import ConfigError, EngineConfig  # noqa: E402
from nvllm.kernels import report  # noqa: E402
from nvllm.kernels.decode_attention import decode_attention, decode_attention_reference  # noqa: E402
from nvllm.kernels.kv_store import (KV_QMAX, dequantize_kv_reference, quantize_kv_reference,  # noqa: E402
                                    store_kv, store_kv_reference, store_kv_triton)
from nvllm.kernels.paged_attention import paged_attention, paged_attention_reference  # noqa: E402
from nvllm.kernels.prefill_attention import prefill_attention, prefill_attention_reference  # noqa: E402
from tests.conftest import build_tiny_model, make_llm  # noqa: E402
from tests.quant_utils import held_out_windows  # noqa: E402
from tests.test_kernels_attention import TOL, _interpreter_bf16_dot_ok  # noqa: E402

INT8, FP8 = torch.int8, torch.float8_e4m3fn
QDTYPES = [pytest.param(INT8, id="int8"), pytest.param(FP8, id="fp8")]


# --------------------------------------------------------------------------------------------------- helpers


@triton.jit
def _cast_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i, mask=i < n).to(y_ptr.dtype.element_ty), mask=i < n)


def _triton_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    y = torch.empty(x.shape, dtype=dtype)
    _cast_kernel[(triton.cdiv(x.numel(), 256),)](x.contiguous(), y, x.numel(), BLOCK=256)
    return y


def _paged(ctx_lens, num_kv_heads, head_dim, block_size, qdtype, gen):
    """The same random K/V per context stored twice, through the same block tables: into an fp32 cache and
    (by the reference quantize-on-store) into a ``qdtype`` cache with scales. Everything a kernel must not read
    (tails of last blocks, spare blocks, block-table padding) is NaN in the fp32 cache and in the scales."""
    need = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    block_tables = torch.full((len(ctx_lens), max(need) + 2), int(perm[-1]), dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    fp = [torch.full(shape, float("nan")) for _ in range(2)]
    q = [torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8).view(torch.uint8).view(qdtype)
         if qdtype == INT8 else torch.full(shape, float("nan")).to(qdtype) for _ in range(2)]
    scales = [torch.full(shape[:3], float("nan")) for _ in range(2)]
    used = 0
    for b, (c, n) in enumerate(zip(ctx_lens, need)):
        block_tables[b, :n] = perm[used:used + n]
        used += n
        pos = torch.arange(c)
        slots = block_tables[b, pos // block_size].long() * block_size + pos % block_size
        key = torch.randn(c, num_kv_heads, head_dim, generator=gen)
        value = torch.randn(c, num_kv_heads, head_dim, generator=gen)
        store_kv_reference(key, value, *fp, slots)
        store_kv_reference(key, value, *q, slots, *scales)
    return block_tables, fp, (*q, *scales)


def _skip_unsupported(dtype):
    if dtype == torch.bfloat16 and not _interpreter_bf16_dot_ok():
        pytest.skip("Triton interpreter computes tl.dot on bf16 operands wrongly (raw bits); checked on the GPU")


def _close(out, ref, dtype):
    assert torch.isfinite(out).all(), "kernel left unwritten (NaN) rows or read past a context"
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# ------------------------------------------------------------------------------------------- quantize-on-store


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("src", [torch.float32, torch.float16])
def test_store_quantizes_like_reference(qdtype, src):
    gen = torch.Generator().manual_seed(1)
    num_kv_heads, head_dim, block_size, num_blocks, tokens = 3, 24, 8, 7, 21   # non-powers of two: masks
    qkv = (torch.randn(tokens, 4 * num_kv_heads * head_dim, generator=gen) * 3).to(src)
    kv = num_kv_heads * head_dim
    key = qkv[:, 2 * kv:3 * kv].view(tokens, num_kv_heads, head_dim)        # strided views of a fused output
    value = qkv[:, 3 * kv:].view(tokens, num_kv_heads, head_dim)
    key[3, 1] = 0                                                            # an all-zero vector: q = 0
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[torch.tensor([0, 5, 20])] = -1
    slots = slots.to(torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.zeros(shape, dtype=qdtype) for _ in range(2)] + [torch.full(shape[:3], -1.0) for _ in range(2)]
    ref = [c.clone() for c in caches]
    store_kv_triton(key, value, *caches[:2], slots, *caches[2:])
    store_kv_reference(key, value, *ref[:2], slots, *ref[2:])

    assert torch.equal(caches[2], ref[2]) and torch.equal(caches[3], ref[3])  # scales bit-exact
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[slots >= 0].long()] = False
    assert (caches[2].view(-1, num_kv_heads)[untouched] == -1).all()       # skipped / other slots untouched
    for got, want, x in ((caches[0], ref[0], key), (caches[1], ref[1], value)):
        if qdtype == FP8:  # the kernel's scaled values, cast by this backend's fp32 -> e4m3 conversion
            valid = slots >= 0
            xf = x[valid].float()
            amax = xf.abs().amax(-1).clamp_min(1e-10)
            y = (xf * (KV_QMAX[FP8] / amax)[..., None]).clamp(-448, 448)
            want = want.clone()
            want.view(-1, num_kv_heads, head_dim)[slots[valid].long()] = _triton_cast(y, FP8)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    k = dequantize_kv_reference(ref[0], ref[2]).view(-1, num_kv_heads, head_dim)
    flat = slots[3].long()
    assert torch.equal(k[flat, 1], torch.zeros(head_dim))


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_round_trip_error_bound(qdtype):
    x = torch.randn(500, 4, 64, generator=torch.Generator().manual_seed(2)) * torch.logspace(-3, 2, 500)[:, None, None]
    q, scale = quantize_kv_reference(x, qdtype)
    assert q.dtype == qdtype and scale.shape == x.shape[:2] and scale.dtype == torch.float32
    err = (dequantize_kv_reference(q, scale) - x).abs()
    if qdtype == INT8:
        assert (err <= scale[..., None] / 2 * (1 + 1e-5)).all()              # half a step of amax/127
    else:
        assert (err <= x.abs() * 2 ** -4 + scale[..., None] * 2 ** -10).all()


# ------------------------------------------------------------------------------ attention that dequantizes inside


ATTN_DTYPES = [pytest.param(d, id=str(d).removeprefix("torch."))
               for d in (torch.float32, torch.float16, torch.bfloat16)]
GQA = [(1, 2, 8), (4, 1, 16)]           # (group, H_kv, block_size)


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("dtype", ATTN_DTYPES)
@pytest.mark.parametrize("group,num_kv_heads,block_size", GQA)
def test_decode_dequantizes_like_reference(qdtype, dtype, group, num_kv_heads, block_size):
    _skip_unsupported(dtype)
    gen = torch.Generator().manual_seed(3)
    head_dim, ctx_lens = 32, [1, 13, 64, 100, 0]         # ... and a padding row (context 0)
    block_tables, _, (kc, vc, ks, vs) = _paged(ctx_lens, num_kv_heads, head_dim, block_size, qdtype, gen)
    q = torch.randn(len(ctx_lens), group * num_kv_heads, head_dim, generator=gen).to(dtype)
    context_lens = torch.tensor(ctx_lens, dtype=torch.int32)
    ref = decode_attention_reference(q, kc, vc, block_tables, context_lens, head_dim ** -0.5, ks, vs)
    # one split; then split-KV with the stage-2 merge; each also with the newest token's row and scales read
    # after the rest of the first tile (fresh_tokens)
    for partition_size, fresh in ((None, 0), (16, 0), (None, 1), (16, 1)):
        out = torch.full_like(q, float("nan"))
        decode_attention(q, kc, vc, block_tables, context_lens, head_dim ** -0.5, out=out,
                         partition_size=partition_size, k_scale=ks, v_scale=vs, fresh_tokens=fresh)
        _close(out, ref, dtype)


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("dtype", ATTN_DTYPES)
@pytest.mark.parametrize("group,num_kv_heads,block_size", GQA)
def test_prefill_dequantizes_like_reference(qdtype, dtype, group, num_kv_heads, block_size):
    _skip_unsupported(dtype)
    gen = torch.Generator().manual_seed(4)
    head_dim = 24                                        # padded to 32 with masks
    ctx_q = [(13, 13), (37, 5), (100, 30), (9, 1), (20, 0)]   # plain prefill, extends, an idle sequence
    ctx_lens, q_lens = [c for c, _ in ctx_q], [n for _, n in ctx_q]
    block_tables, _, (kc, vc, ks, vs) = _paged(ctx_lens, num_kv_heads, head_dim, block_size, qdtype, gen)
    q = torch.randn(sum(q_lens), group * num_kv_heads, head_dim, generator=gen).to(dtype)
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    context_lens = torch.tensor(ctx_lens, dtype=torch.int32)
    ref = prefill_attention_reference(q, kc, vc, block_tables, qsl, context_lens, 0.3, ks, vs)
    for block_m, block_n in ((None, None), (16, 16)):
        out = torch.full_like(q, float("nan"))
        prefill_attention(q, kc, vc, block_tables, qsl, context_lens, 0.3, max(q_lens), out=out,
                          block_m=block_m, block_n=block_n, k_scale=ks, v_scale=vs)
        _close(out, ref, dtype)


def test_dispatch_store_then_attend_quantized(monkeypatch):
    """The Attention layer's path with NVLLM_KERNELS=triton: quantizing store, then decode and mixed steps."""
    monkeypatch.setenv("NVLLM_KERNELS", "triton")
    report.reset()
    gen = torch.Generator().manual_seed(5)
    num_kv_heads, head_dim, block_size = 2, 16, 8
    block_tables, _, cache = _paged([9, 25], num_kv_heads, head_dim, block_size, INT8, gen)
    ref_cache = [c.clone() for c in cache]
    new_k, new_v = (torch.randn(2, num_kv_heads, head_dim, generator=gen) for _ in range(2))
    pos = torch.tensor([9, 25])
    slots = (block_tables[[0, 1], pos // block_size].long() * block_size + pos % block_size).to(torch.int32)
    store_kv(new_k, new_v, cache[0], cache[1], slots, cache[2], cache[3])
    store_kv_reference(new_k, new_v, ref_cache[0], ref_cache[1], slots, ref_cache[2], ref_cache[3])
    for a, b in zip(cache, ref_cache):
        assert torch.equal(a.nan_to_num(), b.nan_to_num())
    context_lens = torch.tensor([10, 26], dtype=torch.int32)
    for qsl, max_q in (([0, 1, 2], 1), ([0, 6, 7], 6)):
        qsl = torch.tensor(qsl, dtype=torch.int32)
        q = torch.randn(int(qsl[-1]), 4, head_dim, generator=gen)
        ref = paged_attention_reference(q, cache[0], cache[1], block_tables, qsl, context_lens, 0.25,
                                        k_scale=cache[2], v_scale=cache[3])
        got = paged_attention(q, cache[0], cache[1], block_tables, qsl, context_lens, 0.25, max_q,
                              k_scale=cache[2], v_scale=cache[3])
        _close(got, ref, torch.float32)
    assert report.snapshot() == {"attention.decode": {"triton paged decode (int8 KV)": 1},
                                 "attention.prefill": {"triton paged prefill (int8 KV)": 1},
                                 "kv_store": {"triton store_kv (quantize)": 1}}
    report.reset()


# ------------------------------------------------------------------------------ accuracy vs the fp32 cache


@pytest.mark.parametrize("qdtype,bound", [(INT8, 0.012), (FP8, 0.05)], ids=["int8", "fp8"])
def test_attention_close_to_fp32_cache_random(qdtype, bound):
    gen = torch.Generator().manual_seed(6)
    head_dim, ctx_lens, q_lens = 64, [200, 77, 130], [1, 20, 130]
    block_tables, fp, (kc, vc, ks, vs) = _paged(ctx_lens, 2, head_dim, 16, qdtype, gen)
    q = torch.randn(sum(q_lens), 4, head_dim, generator=gen)
    qsl = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    context_lens = torch.tensor(ctx_lens, dtype=torch.int32)
    want = paged_attention_reference(q, *fp, block_tables, qsl, context_lens, head_dim ** -0.5)
    got = prefill_attention(q, kc, vc, block_tables, qsl, context_lens, head_dim ** -0.5, max(q_lens),
                            k_scale=ks, v_scale=vs)
    assert _rel(got, want) < bound


@pytest.fixture(scope="module")
def demo_qkv(demo_dir):
    """Every layer's (q, k, v) of the demo model on a 32-token story, captured from the engine (fp32)."""
    llm = make_llm(demo_dir, kv_cache_memory=0.01)
    captured = []
    # after the call: the fused rotary + KV store rotates q and k in place
    hooks = [layer.attn.register_forward_hook(lambda m, args, out: captured.append([t.clone() for t in args[:3]]))
             for layer in llm.engine.runner.model.layers]
    prompt = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with"
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    for h in hooks:
        h.remove()
    return captured


@pytest.mark.parametrize("qdtype,bound", [(INT8, 0.10), (FP8, 0.25)], ids=["int8", "fp8"])
def test_attention_close_to_fp32_cache_on_demo_model_kv(demo_qkv, qdtype, bound):
    for q, k, v in demo_qkv:
        n, num_kv_heads, head_dim = k.shape
        block_size = 8
        nb = -(-n // block_size)
        slots = torch.arange(n, dtype=torch.int32)
        shape = (nb, block_size, num_kv_heads, head_dim)
        fp = [torch.zeros(shape) for _ in range(2)]
        qc = [torch.zeros(shape, dtype=qdtype) for _ in range(2)] + [torch.zeros(shape[:3]) for _ in range(2)]
        store_kv_reference(k, v, *fp, slots)
        store_kv_reference(k, v, *qc[:2], slots, *qc[2:])   # the GPU's e4m3 rounding (see the top)
        tables = torch.arange(nb, dtype=torch.int32)[None]
        qsl, ctx = torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
        want = paged_attention_reference(q, *fp, tables, qsl, ctx, head_dim ** -0.5)
        got = prefill_attention(q, qc[0], qc[1], tables, qsl, ctx, head_dim ** -0.5, n, k_scale=qc[2], v_scale=qc[3])
        assert _rel(got, want) < bound
        # the last row as a decode step reads the same quantized cache
        dec = decode_attention(q[-1:], qc[0], qc[1], tables, ctx, head_dim ** -0.5, k_scale=qc[2], v_scale=qc[3])
        _close(dec, got[-1:], torch.float32)


# -------------------------------------------------------------------------------------- end to end (demo model)

PROMPTS = ["Once upon a time", "The little dog", "Lily and Tom went to the park", "One day, a big bear",
           "Tim had a red ball", "The sun was hot and the birds", "Mom said to Sue", "There was a small cat named",
           "Ben wanted to fly", "A girl found a shiny", "The boy was sad because", "In the big forest",
           "Sara liked to draw", "The old man had a boat", "Max and his dad", "It was a rainy day and"]


@functools.lru_cache(maxsize=None)
def _demo_run(demo_dir: str, kv_cache_dtype: str):
    """(greedy token ids of PROMPTS, held-out perplexity) with the given KV-cache dtype."""
    llm = make_llm(demo_dir, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=0.02)
    greedy = [o.outputs[0].token_ids
              for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)]
    windows = held_out_windows(llm.get_tokenizer())
    outs = llm.generate([{"prompt_token_ids": w} for w in windows],
                        SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    nll = [-lp[tok].logprob for w, o in zip(windows, outs) for tok, lp in zip(w[1:], o.prompt_logprobs[1:])]
    return greedy, math.exp(sum(nll) / len(nll))


@pytest.mark.parametrize("kv,min_same,max_ppl_increase", [("int8", 11, 0.01), ("fp8_e4m3", 8, 0.02)])
def test_demo_greedy_and_perplexity_close_to_fp32_cache(demo_dir, kv, min_same, max_ppl_increase):
    want, ppl = _demo_run(demo_dir, "auto")
    got, ppl_q = _demo_run(demo_dir, kv)
    same = sum(a == b for a, b in zip(got, want))
    assert same >= min_same, f"{same}/{len(PROMPTS)} greedy outputs identical"
    assert abs(ppl_q / ppl - 1) < max_ppl_increase, (ppl, ppl_q)


def test_int8_cache_with_prefix_caching_chunked_prefill_and_preemption(demo_dir):
    """Block ids move, scales move with them: a tight pool (preemptions), 12-token chunks and prefix-cache
    hits give the outputs of the same INT8 engine with room for everything, whole prompts, no prefix cache."""
    from tests.test_scheduler import GREEDY, prompts

    batch = prompts(8) + prompts(2)
    plain = make_llm(demo_dir, kv_cache_dtype="int8", enable_prefix_caching=False, kv_cache_memory=0.01)
    want = [o.outputs[0].token_ids for o in plain.generate(batch, GREEDY, use_tqdm=False)]
    llm = make_llm(demo_dir, kv_cache_dtype="int8", block_size=8, num_kv_blocks=8, max_num_batched_tokens=12,
                   max_num_seqs=6, max_model_len=64)
    outs = llm.generate(batch, GREEDY, use_tqdm=False)
    bm = llm.engine.block_manager  # hits of new prompts or of preempted sequences coming back to their blocks
    assert llm.engine.scheduler.num_preemptions > 0 and bm.prefix_hits + bm.preempted_hits > 0
    assert [o.outputs[0].token_ids for o in outs] == want


def test_triton_path_int8_matches_torch_path_int8(demo_dir, monkeypatch):
    from tests.test_triton_path import PROMPTS as TP

    got = {}
    for kernels in ("torch", "triton"):
        monkeypatch.setenv("NVLLM_KERNELS", kernels)
        llm = make_llm(demo_dir, kv_cache_dtype="int8", max_num_batched_tokens=16, block_size=8,
                       kv_cache_memory=0.01)
        report.reset()
        outs = llm.generate(TP, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
        got[kernels] = [o.outputs[0].token_ids for o in outs]
        rep = report.snapshot()
    assert got["triton"] == got["torch"]
    assert set(rep["kv_store"]) == {"triton store_kv (quantize)"}
    assert set(rep["attention.decode"]) == {"triton paged decode (int8 KV)"}
    assert set(rep["attention.prefill"]) == {"triton paged prefill (int8 KV)"}


# ----------------------------------------------------------------------------------------- capacity and options


def _runner(model, **kw):
    from nvllm.engine.model_runner import ModelRunner

    return ModelRunner(EngineConfig(model=str(model), device="cpu", log_stats_interval=0, **kw))


def test_pool_holds_twice_the_tokens(tmp_path, demo_dir):
    from nvllm.logger import setup_logging

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    setup_logging().addHandler(handler)
    try:
        hd128 = build_tiny_model("llama", tmp_path / "hd128", head_dim=128, num_hidden_layers=1)
        mem = 0.01                                                          # GiB
        runs = {kv: _runner(hd128, dtype="bfloat16", kv_cache_memory=mem, kv_cache_dtype=kv)
                for kv in ("auto", "int8", "fp8_e4m3")}
    finally:
        logging.getLogger("nvllm").removeHandler(handler)
    # 1 layer x 2 KV heads x (K, V): 16-bit elements vs 1-byte elements + one fp32 scale per vector
    assert runs["auto"].kv_bytes_per_token == 2 * 2 * 128 * 2
    assert runs["int8"].kv_bytes_per_token == runs["fp8_e4m3"].kv_bytes_per_token == 2 * 2 * (128 + 4)
    for kv, r in runs.items():
        assert r.num_blocks == int(mem * 2 ** 30 // (r.kv_bytes_per_token * 16))
        held = sum(t.numel() * t.element_size() for c in r.kv_caches for t in c if t is not None)
        assert held == r.num_blocks * 16 * r.kv_bytes_per_token            # the accounting is the real bytes
    ratio = runs["int8"].num_blocks / runs["auto"].num_blocks
    assert abs(ratio - 2 * 128 / (128 + 4)) < 0.01                         # 1.939x
    assert runs["int8"].kv_caches[0].k.dtype == torch.int8 and runs["fp8_e4m3"].kv_caches[0].v.dtype == FP8
    lines = [r.getMessage() for r in records if r.getMessage().startswith("KV cache:")]
    assert any("int8 + fp32 scale" in s and "528 bytes" in s and f"{runs['int8'].num_blocks * 16} tokens" in s
               for s in lines), lines
    # the fp32 demo model: 4-byte elements vs 1 byte + 4 per 8-element vector
    fp32, int8 = (_runner(demo_dir, kv_cache_memory=mem, kv_cache_dtype=kv) for kv in ("auto", "int8"))
    assert (fp32.kv_bytes_per_token, int8.kv_bytes_per_token) == (1280, 480)
    assert abs(int8.num_blocks / fp32.num_blocks - 32 / 12) < 0.01


def test_bad_kv_cache_dtype_is_one_clear_error(monkeypatch):
    with pytest.raises(ConfigError, match="unknown kv_cache_dtype 'int4'; choose auto, int8 or fp8_e4m3"):
        EngineConfig(kv_cache_dtype="int4", device="cpu")
    assert EngineConfig(kv_cache_dtype="fp8", device="cpu").kv_cache_dtype == "fp8_e4m3"  # vLLM's name
    r = subprocess.run([sys.executable, "-m", "nvllm.cli", "generate", "--kv-cache-dtype", "int4"],
                       capture_output=True, text=True, timeout=120, env=dict(os.environ, COLUMNS="200"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "unknown kv_cache_dtype 'int4'" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    # fp8 on a GPU older than compute capability 8.9
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100")
    with pytest.raises(ConfigError, match="fp8_e4m3 needs a GPU of compute capability 8.9 or newer; "
                                          r"NVIDIA A100 is 8.0 \(use int8\)"):
        EngineConfig(kv_cache_dtype="fp8_e4m3", device="cuda")


def test_every_command_has_the_flag():
    from typer.testing import CliRunner

    from nvllm.cli import app

    runner = CliRunner()
    for cmd in (["generate"], ["serve"], ["bench", "throughput"], ["bench", "latency"]):
        out = runner.invoke(app, [*cmd, "--help"], env={"COLUMNS": "200"}).output
        assert "--kv-cache-dtype" in out, cmd
