"""A split decode attention's partials merged by the one-row ``half2`` GEMV that reads them
(``nvllm.kernels.attention_partials``), on the CPU under the Triton interpreter: against the same GEMV of stage 2's
merged rows and against dequantize-then-matmul of the torch attention reference."""

from __future__ import annotations

import pytest
import torch

from tests.test_kernels_attention import _paged_cache, _skip_unsupported
from tests.test_quant_gemm_kernel import check, make_weight, semantic_ref
from tests.test_quant_gemv_kernel import HALF2_TOL, run_gemv  # noqa: I001  (sets up the interpreter's kernels)

from nvllm.kernels import quant_gemv as QV  # noqa: E402
from nvllm.kernels import report  # noqa: E402
from nvllm.kernels.attention_partials import AttentionPartials  # noqa: E402
from nvllm.kernels.decode_attention import decode_attention, decode_attention_reference  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32


def _attention(ctx: int, dtype, capacity: int, defer: bool, partition: int = 16):
    """One sequence of ``ctx`` tokens in a block table of ``capacity`` tokens, in partitions (so the split
    count follows the capacity, as in a CUDA graph, and partitions past the context hold no tokens). Returns the
    attention's result, its poisoned output buffer and the torch reference."""
    gen = torch.Generator().manual_seed(ctx)
    k_cache, v_cache, tables = _paged_cache([ctx], KV_HEADS, HEAD_DIM, 16, dtype, gen)
    pad = torch.full((1, capacity // 16 - tables.shape[1]), int(tables[0, -1]), dtype=torch.int32)
    tables = torch.cat([tables, pad], 1)
    q = torch.randn(1, HEADS, HEAD_DIM, generator=gen).to(dtype)
    lens = torch.tensor([ctx], dtype=torch.int32)
    out = torch.full_like(q, float("nan"))
    got = decode_attention(q, k_cache, v_cache, tables, lens, HEAD_DIM ** -0.5, out=out, partition_size=partition,
                           defer_merge=defer)
    ref = decode_attention_reference(q, k_cache, v_cache, tables, lens, HEAD_DIM ** -0.5)
    return got, out, ref.view(1, -1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)   # bf16: where the interpreter can
@pytest.mark.parametrize("ctx", [100, 300, 0])   # 7 live partitions; 19 (three loads of 8); none
@pytest.mark.parametrize("block_k,split_k", [(32, 4), (16, 8)])   # each split one head, or half a head
def test_gemv_merges_the_partials(dtype, ctx, block_k, split_k, monkeypatch):
    _skip_unsupported(dtype)
    monkeypatch.setattr(QV, "MERGE_CHUNK", 8 if block_k == 16 else QV.MERGE_CHUNK)
    qw = make_weight("gptq4-k128-n64-g32", "gptq", 4, HEADS * HEAD_DIM, 64, 32, False, False)
    kw = dict(variant="half2", block_n=32, block_k=block_k, split_k=split_k, x_pairs=1)
    partials, out, ref = _attention(ctx, dtype, 512, defer=True)
    assert isinstance(partials, AttentionPartials) and partials.num_splits == 32
    with report.recording() as made:
        fused = run_gemv(partials, qw, **kw)
    assert made[("attention.merge", "in the w4a16 gemv's prologue")] == 1
    assert torch.isnan(out).all()                       # merged in the GEMV: stage 2 never ran
    merged, _, _ = _attention(ctx, dtype, 512, defer=False)
    unfused = run_gemv(merged.view(1, -1), qw, **kw)
    check(fused, unfused, HALF2_TOL)
    check(fused, semantic_ref(ref, qw, None), HALF2_TOL)
    if ctx == 0:
        assert not fused.any()


@pytest.mark.parametrize("live", [5, 20])
def test_bf16_partials_merge_as_stage_2_does(live):
    """bf16 outputs from partials made by hand (the interpreter's stage 1 may not run bf16): the merged inputs are
    rounded to bf16 as stage 2 rounds its output, so the GEMV sees what it sees after stage 2."""
    gen = torch.Generator().manual_seed(live)
    splits, part_d = 32, HEAD_DIM
    part_o = torch.randn(1, HEADS, splits, part_d, generator=gen) * 3
    part_lse = torch.randn(1, HEADS, splits, generator=gen) * 4
    part_lse[:, :, live:] = float("-inf")
    lens = torch.tensor([live * 16 - 3], dtype=torch.int32)   # the last live partition part full
    qw = make_weight("gptq4-k128-n64-g32", "gptq", 4, HEADS * HEAD_DIM, 64, 32, False, False)
    kw = dict(variant="half2", block_n=32, block_k=16, split_k=8, x_pairs=1)
    fused = run_gemv(AttentionPartials(torch.empty(1, HEADS, HEAD_DIM, dtype=torch.bfloat16), part_o, part_lse, lens,
                                       16), qw, **kw)
    rows = AttentionPartials(torch.empty(1, HEADS, HEAD_DIM, dtype=torch.bfloat16), part_o, part_lse, lens,
                             16).finish()
    # 1e-3: a one-ulp flip where the sums' order differs from stage 2's passes, inputs left unrounded (3e-3) do not
    check(fused, run_gemv(rows, qw, **kw), 1e-3)


def test_other_calls_merge_first():
    """A GEMV that cannot merge (a split wider than a head; another variant) runs stage 2 first: exactly the
    GEMV of the merged rows."""
    qw = make_weight("gptq4-k128-n64-g32", "gptq", 4, HEADS * HEAD_DIM, 64, 32, False, False)
    merged, _, _ = _attention(100, torch.float16, 256, defer=False)
    for kw in (dict(variant="half2", block_n=32, block_k=32, split_k=2, x_pairs=1), dict(variant="row")):
        partials, out, _ = _attention(100, torch.float16, 256, defer=True)
        with report.recording() as made:
            got = run_gemv(partials, qw, **kw)
        assert made[("attention.merge", "triton decode merge")] == 1
        assert torch.equal(out, merged)
        assert torch.equal(got, run_gemv(merged.view(1, -1), qw, **kw))


def test_a_dense_o_proj_merges_first():
    """A bf16/fp16 model's o_proj (``Linear``) takes the partials too: stage 2 first, then its GEMM."""
    from nvllm.layers.linear import Linear

    merged, _, _ = _attention(100, torch.float16, 256, defer=False)
    partials, out, _ = _attention(100, torch.float16, 256, defer=True)
    o_proj = Linear(HEADS * HEAD_DIM, 64, dtype=torch.float16)
    torch.nn.init.normal_(o_proj.weight, std=0.05)
    with report.recording() as made:
        got = o_proj(partials)
    assert made[("attention.merge", "triton decode merge")] == 1
    assert torch.equal(out, merged) and torch.equal(got, o_proj(merged.view(1, -1)))


def test_one_partition_is_no_partials():
    """A context inside one partition is written whole by stage 1: nothing to defer."""
    got, out, ref = _attention(12, torch.float16, 64, defer=True, partition=64)
    assert got is out
    torch.testing.assert_close(got.view(1, -1).float(), ref.float(), atol=3e-3, rtol=3e-3)


def test_engine_greedy_with_the_merge_in_o_proj(tmp_path, monkeypatch):
    """A GPTQ 4-bit Qwen2 with 64-dim heads through the engine on the Triton kernels, a 70-token prompt (decode
    splits it into 64-token partitions): o_proj merges the partials, and the greedy tokens are HF transformers' on
    the dequantized weights."""
    from nvllm import SamplingParams
    from tests.conftest import build_tiny_model, make_llm
    from tests.quant_utils import hf_greedy, write_by_hand

    from nvllm.engine.llm_engine import LLMEngine

    monkeypatch.setenv("NVLLM_KERNELS", "triton")
    monkeypatch.setattr(LLMEngine, "_warmup", lambda self: None)   # its 2-8-row GEMVs are slow in the interpreter
    src = build_tiny_model("qwen2", tmp_path / "qwen2", hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                           intermediate_size=128)
    deq = write_by_hand(src, tmp_path / "gptq", "gptq", 4, 32, sym=False)
    prompt = [1] + [(7 * i) % 500 + 3 for i in range(69)]
    llm = make_llm(str(tmp_path / "gptq"), max_num_batched_tokens=128, max_model_len=128, max_num_seqs=1)
    report.reset()
    got = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    assert report.snapshot()["attention.merge"] == {"in the w4a16 gemv's prologue": 2 * 2}   # 2 layers, 2 decodes
    assert got == hf_greedy(src, prompt, 3, deq)
