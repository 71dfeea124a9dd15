"""LoRA on a GPU (skipped elsewhere; run there with ``TRITON_INTERPRET=0``): the compiled slot kernels against their
torch reference at a 7B's shapes, and the engine whose decode steps replay the CUDA graphs captured with LoRA
against the same engine run eagerly, against one that must swap adapters through a single slot, and against PEFT.
The engines run in float32, as PEFT's reference does: a bf16 engine's first logprobs differ from it by more than any
tolerance that would still catch a wrong slot (the kernels' bf16 path is the first test's, at a 7B's shapes)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs a CUDA device and compiled Triton kernels (TRITON_INTERPRET=0)", allow_module_level=True)

from nvllm import LoRARequest, SamplingParams  # noqa: E402
from nvllm.kernels.lora import lora_apply, lora_apply_reference  # noqa: E402
from tests.conftest import make_llm  # noqa: E402
from tests.lora_utils import PROMPTS, check_against_peft, lora_setup  # noqa: E402
from tests.quant_utils import hf_model  # noqa: E402


@pytest.mark.parametrize("T,K,N,R,ranks", [(1, 3584, 4608, 192, (48, 8, 0, 192)), (7, 18944, 3584, 64, (16, 3)),
                                           (300, 3584, 37888, 128, (32, 1, 128)), (5, 513, 100, 1000, (1000, 999))])
def test_compiled_kernels_equal_the_reference(T, K, N, R, ranks):
    g = torch.Generator("cuda").manual_seed(0)
    a = torch.randn(len(ranks), R, K, device="cuda", generator=g) / K ** 0.5
    b = torch.randn(len(ranks), N, R, device="cuda", generator=g)
    for s, r in enumerate(ranks):   # past each slot's rank: poison
        a[s, r:] = float("nan")
        b[s, :, r:] = float("nan")
    a, b = a.bfloat16(), b.bfloat16()
    x = torch.randn(T, K, device="cuda", generator=g).bfloat16()
    y = torch.randn(T, N, device="cuda", generator=g).bfloat16()
    slots = torch.randint(-1, len(ranks), (T,), device="cuda", generator=g)
    ranks = torch.tensor(ranks, dtype=torch.int32, device="cuda")
    want = lora_apply_reference(y.clone(), x, a, b, ranks, slots)
    got = lora_apply(y.clone(), x, a, b, ranks, slots)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(got[slots < 0], y[slots < 0])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return lora_setup(tmp_path_factory.mktemp("lora_gpu"))


def generate_all(llm, adapters):
    names = [None, *adapters]
    requests = {n: LoRARequest(n, i + 1, str(adapters[n])) for i, n in enumerate(adapters)}
    prompts = [p for p in PROMPTS for _ in names] * 2
    loras = [requests.get(n) for _ in PROMPTS for n in names] * 2
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=0, ignore_eos=True)
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def test_lora_decode_graphs_equal_eager_and_peft(setup):
    _, base, adapters = setup
    runs = {}
    replays = {}
    for name, kw in (("graphs", {}), ("eager", {"enforce_eager": True}), ("one slot", {"max_loras": 1})):
        llm = make_llm(str(base), device="cuda", dtype="float32", enable_lora=True, **kw)
        graphs = llm.engine.runner.graphs
        assert (graphs is None) == (name == "eager")
        if graphs is not None:
            run, seen = graphs.run, replays.setdefault(name, [])

            def counted(*args, run=run, seen=seen):
                seen.append(args[5] is not None)
                return run(*args)
            graphs.run = counted
        runs[name] = generate_all(llm, adapters)
        if name == "graphs":
            check_against_peft(llm, hf_model(base), adapters, logprob_tol=1e-3)
            llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
            assert replays[name][-1] is False                         # the base alone: the graphs without LoRA
        llm.close()
    assert any(replays["graphs"]) and any(replays["one slot"])        # decode steps replayed the LoRA graphs
    for name in ("graphs", "one slot"):
        for (tokens, lps), (want, want_lps) in zip(runs[name], runs["eager"]):
            assert tokens == want, name
            assert max(abs(a - b) for a, b in zip(lps, want_lps)) < 1e-3, name
    assert len({tuple(t) for t, _ in runs["eager"]}) > len(PROMPTS)   # the adapters change the output
