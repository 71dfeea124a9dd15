"""Short multi-token chunks through the decode-graph path (one row per token, context ending at the row's own
position): on the CPU a stand-in for DecodeGraphs runs exactly what a replay runs — the model with one query
token per row — and greedy outputs must equal the normal path's, for short prompts (graphs without a
``fresh_tokens`` promise) and for speculative decoding (verification of k + 1 tokens, the draft's catch-up); under
the runner's one-token promise, short prompts stay out of the graphs."""

from __future__ import annotations

import pytest
import torch

from nvllm import SamplingParams
from nvllm.engine import cuda_graph as CG
from nvllm.layers.attention import AttentionMetadata
from nvllm.lora.layers import LoRAMapping, lora_mapping
from tests.conftest import make_llm
from tests.test_spec_decode import drafts, prompts, spec_of  # noqa: F401  (drafts: a module fixture)

GREEDY = SamplingParams(temperature=0, max_tokens=20)


class RowGraphs:
    """DecodeGraphs' interface on the CPU: every row one query token, as the captured graphs compute."""

    def __init__(self, model, kv_caches, max_batch: int = 64, fresh_tokens: int = 0):
        self.model, self.kv_caches, self.max_batch = model, kv_caches, max_batch
        self.fresh_tokens = fresh_tokens   # the attention's promise (DecodeGraphs); 0: none
        self.rows_seen: list[int] = []
        self.lora_rows_seen: list[list[int] | None] = []

    def run(self, input_ids, positions, slots, block_tables, context_lens, lora_slots=None):
        b = len(input_ids)
        assert len(block_tables) == len(context_lens) == b
        self.rows_seen.append(b)
        width = max(len(t) for t in block_tables)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots), block_tables=torch.tensor([t + [0] * (width - len(t))
                                                                         for t in block_tables], dtype=torch.int32),
            query_start_loc=torch.arange(b + 1, dtype=torch.int32),
            context_lens=torch.tensor(context_lens, dtype=torch.int32), max_query_len=1,
            max_context_len=max(context_lens))
        ids = input_ids if isinstance(input_ids, torch.Tensor) else torch.tensor(input_ids)   # draft: on the device
        self.lora_rows_seen.append(lora_slots)
        mapping = None if lora_slots is None else LoRAMapping(slots=torch.tensor(lora_slots))
        with lora_mapping(mapping):   # as the graphs captured with LoRA read their staged slots
            return self.model(ids, torch.tensor(positions), self.kv_caches, meta)


def with_row_graphs(llm, fresh_tokens: int | None = 0) -> RowGraphs:
    """The stand-in graphs on the target's runner (returned) and the draft's; ``fresh_tokens`` None: each with its
    runner's own promise, as on a GPU."""
    runners = [llm.engine.runner]
    if llm.engine.spec is not None and llm.engine.spec.draft_runner is not None:
        runners.append(llm.engine.spec.draft_runner)
    fakes = [RowGraphs(r.model, r.kv_caches, fresh_tokens=r.fresh_tokens if fresh_tokens is None else fresh_tokens)
             for r in runners]
    for r, f in zip(runners, fakes):
        r.graphs = f
    return fakes[0]


def test_short_prompts_through_graph_rows(demo_dir):
    ps = prompts(10)
    want = [o.outputs[0].token_ids for o in make_llm(demo_dir).generate(ps, GREEDY, use_tqdm=False)]
    llm = make_llm(demo_dir, block_size=8, max_num_seqs=2)
    fake = with_row_graphs(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)] == want
    assert any(n > 2 for n in fake.rows_seen)  # steps that carried several tokens of a sequence


def test_a_one_token_promise_keeps_short_prompts_out_of_the_graphs(demo_dir):
    """Graphs whose attention reads earlier steps' keys before the PDL wait (``fresh_tokens`` 1, the runner's promise
    without speculation) replay only one token a sequence: a short prompt's rows would read its earlier tokens
    before they are stored. The prompts run outside them (piecewise on a GPU), the decodes in them, with the same
    tokens."""
    ps = prompts(10)
    want = [o.outputs[0].token_ids for o in make_llm(demo_dir).generate(ps, GREEDY, use_tqdm=False)]
    llm = make_llm(demo_dir, block_size=8, max_num_seqs=1)
    fake = with_row_graphs(llm, fresh_tokens=1)
    assert [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)] == want
    assert set(fake.rows_seen) == {1}   # one sequence at a time: a second row would be a second token of it
    assert CG.graph_query_len(1) == 1 and CG.graph_query_len(5) == 5
    assert CG.graph_query_len(0) == CG.graph_query_len(99) == CG.GRAPH_MAX_QUERY_LEN


def test_speculative_verification_through_graph_rows(demo_dir, drafts):  # noqa: F811
    ps = prompts(8)
    want = [o.outputs[0].token_ids for o in make_llm(demo_dir).generate(ps, GREEDY, use_tqdm=False)]
    for name in ("truncated", "ngram"):
        llm = make_llm(demo_dir, block_size=8, speculative=spec_of(name, drafts, 4))
        draft = llm.engine.spec.draft_runner
        assert (draft is None) == (name == "ngram") and (draft is None or draft.fresh_tokens == 0)
        fake = with_row_graphs(llm)   # (a draft runner's graphs make no promise: its catch-up chunks replay in them)
        outs = llm.generate(ps, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want, name
        assert llm.engine.stats.spec.num_drafts > 0
        assert max(fake.rows_seen) > 1


def test_a_speculative_target_promises_its_verification_chunk(demo_dir, drafts):  # noqa: F811
    """A speculative target's graphs promise k + 1 fresh tokens (a verification chunk: the last token and k drafts),
    k=auto's ceiling under auto; they replay the verification, and a longer chunk (a prompt) runs outside them, with
    the same tokens. The draft's runner promises nothing; without speculation the promise is one token."""
    from nvllm.spec.config import MAX_K, parse_speculative

    ps = prompts(8)
    want = [o.outputs[0].token_ids for o in make_llm(demo_dir).generate(ps, GREEDY, use_tqdm=False)]
    llm = make_llm(demo_dir, block_size=8, max_num_seqs=1, speculative=spec_of("truncated", drafts, 4))
    assert llm.engine.runner.fresh_tokens == 5 and llm.engine.spec.draft_runner.fresh_tokens == 0
    fake = with_row_graphs(llm, fresh_tokens=None)
    assert [o.outputs[0].token_ids for o in llm.generate(ps, GREEDY, use_tqdm=False)] == want
    assert max(fake.rows_seen) == 5   # one sequence at a time: its verification chunks, never a prompt's
    assert CG.fresh_tokens_promise(parse_speculative("k=auto,method=ngram"), False) == MAX_K + 1
    assert CG.fresh_tokens_promise(None, False) == 1 and CG.fresh_tokens_promise(None, True) == 0


def test_long_chunks_stay_eager(demo_dir):
    llm = make_llm(demo_dir)
    fake = with_row_graphs(llm)
    long_prompt = " ".join(["Once upon a time"] * 8)            # > GRAPH_MAX_QUERY_LEN tokens
    assert len(llm.get_tokenizer().encode(long_prompt)) > CG.GRAPH_MAX_QUERY_LEN
    llm.generate([long_prompt], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert fake.rows_seen == [1, 1]                             # the prompt ran eagerly, the decodes in rows


def test_graph_sizes_include_the_verification_rows():
    from nvllm.engine.cuda_graph import batch_size_ladder

    assert batch_size_ladder(40) == [1, 2, 4, 8, 16, 32, 40]
    assert batch_size_ladder(40, (5,)) == [1, 2, 4, 5, 8, 16, 32, 40]  # k = 4: five rows, no padding to 8
    assert batch_size_ladder(4, (5, 0)) == [1, 2, 4]                    # never past max_num_seqs


def test_graph_inputs_staged_with_padding_rows():
    """What a replay reads: the rows given, then padding rows up to the graph's size that store nowhere (slot −1)
    and attend to nothing (context 0); a device tensor of token ids is copied in on the device."""
    from nvllm.engine.cuda_graph import DecodeGraphs

    g = DecodeGraphs(None, None, 8, 4, torch.device("cpu"), extra_sizes=(3,))
    assert g._meta(2).fresh_tokens == 0                       # no promise unless the runner gives one
    assert DecodeGraphs(None, None, 8, 4, torch.device("cpu"), fresh_tokens=1)._meta(4).fresh_tokens == 1
    assert g.stage([7, 8], [10, 20], [100, 200], [[1, 2], [3, 4]], [11, 21]) == 2
    assert g.stage([5, 6, 9], [3, 4, 5], [30, 40, 50], [[1, 2, 0], [3, 0, 0], [4, 5, 6]], [4, 5, 6]) == 3
    assert g.stage([1, 2, 3, 4], [7, 8, 9, 10], [70, 80, 90, 99], [[1]] * 4, [8, 9, 10, 11]) == 4
    assert g.stage(torch.tensor([42, 43]), [5, 6], [50, 60], [[9, 9], [8, 8]], [6, 7]) == 2
    assert g.input_ids[:2].tolist() == [42, 43]
    assert g.positions[:2].tolist() == [5, 6] and g.slot_mapping[:2].tolist() == [50, 60]
    assert g.context_lens[:2].tolist() == [6, 7] and g.block_tables[:2, :2].tolist() == [[9, 9], [8, 8]]
    g.stage([1], [2], [3], [[4]], [3])                        # one row: the batch-1 graph, no padding
    assert g.slot_mapping[:1].tolist() == [3]
    g.stage([1, 2, 3, 4, 5], [2] * 5, [7] * 5, [[4]] * 5, [3] * 5)
    assert g.slot_mapping[:8].tolist() == [7] * 5 + [-1] * 3   # five rows replay the batch-8 graph
    assert g.context_lens[:8].tolist() == [3] * 5 + [0] * 3 and g.positions[5:8].tolist() == [0] * 3


def test_staging_copy_kernel_matches_its_reference():
    """The kernel that moves a decode step's staged bytes into the graph's buffer (the sampled token ids over the ids'
    place) under the interpreter: the same bytes as the torch reference; bytes past the staged prefix untouched."""
    from nvllm.kernels.staging_copy import staging_copy, staging_copy_reference

    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (5000,), generator=g, dtype=torch.uint8)
    drafted = torch.tensor([[11, 12, 13, 14], [21, 22, 23, 24]])   # one sequence's column: one element, stride 4
    for nbytes, ids in ((4096, torch.tensor([7, 2**40 + 3, 151643])), (2052, None), (24, torch.tensor([5])),
                        (0, None), (4096, torch.tensor([], dtype=torch.int64)), (64, drafted[:1, 2]),
                        (64, drafted[:, 1])):
        got = torch.randint(0, 256, (5000,), generator=g, dtype=torch.uint8)
        want = got.clone()
        staging_copy(src, got, nbytes, ids)
        staging_copy_reference(src, want, nbytes, ids)
        assert torch.equal(got, want), nbytes
        if ids is not None and ids.numel():
            assert got[:8 * ids.numel()].view(torch.int64).tolist() == ids.tolist()
    with pytest.raises(AssertionError):
        staging_copy(src, got, 6)   # whole 4-byte words only
