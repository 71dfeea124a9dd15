"""LoRA adapters with speculative decoding on the CPU: the draft (a model, or prompt lookup) proposes without the
adapters, the target verifies each chunk through its request's adapter, so every request's greedy output and
logprobs are those of plain decoding with its adapter — PEFT's, for the first tokens — with several adapters and the
base in one batch, fixed and self-tuning k, adapters swapped through one slot, and a target split over two ranks."""

from __future__ import annotations

import pytest

from nvllm import LoRARequest, SamplingParams
from tests.conftest import make_llm
from tests.lora_utils import PROMPTS, check_against_peft, lora_setup
from tests.quant_utils import hf_model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return lora_setup(tmp_path_factory.mktemp("lora_spec"))


def outputs(llm, adapters):
    requests = [None] + [LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(adapters.items())]
    prompts = [p + [7, 7, 8] * j for j in range(2) for p in PROMPTS for _ in requests]
    loras = [r for _ in range(2) for _ in PROMPTS for r in requests]
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=0, ignore_eos=True)
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


@pytest.mark.parametrize("spec,options", [("k=3,draft={base}", {}), ("k=auto,draft={base}", {"max_loras": 1}),
                                          ("k=3,method=ngram", {}), ("k=3,draft={base}", {"tensor_parallel_size": 2})],
                         ids=["draft", "auto-one-slot", "ngram", "draft-two-ranks"])
def test_each_request_keeps_its_adapters_output(setup, spec, options):
    _, base, adapters = setup
    want = outputs(make_llm(str(base), enable_lora=True), adapters)
    with make_llm(str(base), enable_lora=True, speculative=spec.format(base=base), **options) as llm:
        got = outputs(llm, adapters)
        if not options:
            check_against_peft(llm, hf_model(base), adapters)
    assert llm.engine.spec.draft_runner is None or llm.engine.spec.draft_runner.lora is None
    assert llm.engine.stats.spec.num_drafts > 0
    for (tokens, lps), (want_tokens, want_lps) in zip(got, want):
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(lps, want_lps)) < 1e-4
    assert len({tuple(t) for t, _ in want}) > len(PROMPTS) * 2  # the adapters change the output
