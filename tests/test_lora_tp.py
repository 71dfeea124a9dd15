"""LoRA with tensor parallelism on the CPU: real worker processes joined by gloo. Each rank holds its piece of every
adapter — B's rows of a column-parallel linear, A's columns of a row-parallel one, whose B·(A x) joins the partial
output before the ranks' sum (and before a bias added once) — and two ranks give PEFT's greedy tokens and
first-token logprobs: over a dense Llama with biases in its row-parallel layers, and over an AWQ Qwen2 (one KV
head, replicated) whose two adapters take turns in a single slot, which the workers fill as rank 0 does, with the
weights rank 0 read."""

from __future__ import annotations

import os

import pytest
import torch

from nvllm import LoRARequest, SamplingParams
from nvllm.config import ConfigError
from nvllm.engine.step_inputs import StepInputs
from nvllm.lora.manager import adapter_digest, loads_message, read_loads_message
from tests.conftest import build_tiny_model, make_llm
from tests.lora_utils import PROMPTS, check_against_peft, make_adapter
from tests.quant_utils import hf_model, write_by_hand


def adapters_of(base, root) -> dict:
    return {"all": make_adapter(base, root / "all", 1, r=8, lora_alpha=16),
            "attn": make_adapter(base, root / "attn", 2, r=4, lora_alpha=4, use_rslora=True,
                                 target_modules=["q_proj", "v_proj", "o_proj"])}


def test_two_ranks_match_peft_over_a_dense_base_with_biases(tmp_path):
    base = build_tiny_model("llama", tmp_path / "base", intermediate_size=128, mlp_bias=True)
    adapters = adapters_of(base, tmp_path)
    with make_llm(str(base), enable_lora=True, tensor_parallel_size=2) as llm:
        check_against_peft(llm, hf_model(base), adapters)
        assert llm.engine.runner.lora.pending == []  # every slot filled was sent to the worker


def test_two_ranks_swap_adapters_through_one_slot_over_an_awq_base(tmp_path):
    """One KV head: both ranks hold it, and the k/v adapters' B rows whole."""
    base = build_tiny_model("qwen2", tmp_path / "base", intermediate_size=128, num_key_value_heads=1)
    adapters = adapters_of(base, tmp_path)
    deq = write_by_hand(base, tmp_path / "awq", "awq", group=32)
    with make_llm(str(tmp_path / "awq"), enable_lora=True, tensor_parallel_size=2, max_loras=1) as llm:
        check_against_peft(llm, hf_model(base, deq), adapters)


def test_the_workers_messages_round_trip():
    loads = [(0, LoRARequest("sql", 3, "/adapters/sql"), b"\x00\xffsalt"), (1, LoRARequest("ünï", 7, "/a b/c"), b"")]
    message = loads_message(loads)
    assert message.dtype == torch.int64 and int(message[0]) == -1
    assert read_loads_message(message) == loads
    step = StepInputs([5, 6], [0, 1], [16, 17], [0, 1, 2], [1, 2], [[1], [2]], logit_rows=[0, 1], max_query_len=1,
                      max_context_len=2, lora_slots=[-1, 0])
    assert read_loads_message(step.pack()) is None
    assert StepInputs.unpack(step.pack()) == step
    step.lora_slots = None
    assert StepInputs.unpack(step.pack()) == step


def test_a_rank_keeps_its_piece_of_each_adapter(tmp_path):
    """The ranks' pieces put together are the whole adapter: A whole and B's rows split per projection for q/k/v
    and gate/up; A's columns split and B whole for o and down."""
    from nvllm.lora.adapter import load_adapter
    from tests.test_tensor_parallel import rank_models

    base = build_tiny_model("llama", tmp_path / "base", intermediate_size=128)
    path = str(adapters_of(base, tmp_path)["all"])
    full, ranks = rank_models(str(base))
    whole = load_adapter(path, full, torch.float32, torch.device("cpu"), 8)
    pieces = [load_adapter(path, r, torch.float32, torch.device("cpu"), 8) for r in ranks]
    assert set(whole) == {f"layers.{i}.{n}" for i in range(2) for n in ("qkv_proj", "o_proj", "gate_up_proj",
                                                                          "down_proj")}
    for name, w in whole.items():
        a, b = [p[name].a for p in pieces], [p[name].b for p in pieces]
        if name.endswith(("o_proj", "down_proj")):
            assert torch.equal(torch.cat(a, 1), w.a) and all(torch.equal(x, w.b) for x in b)
            continue
        assert all(torch.equal(x, w.a) for x in a)
        sizes = ranks[0].get_submodule(name).output_sizes  # each rank's [q_r, k_r, v_r] or [gate_r, up_r]
        per_rank = [x.split(sizes) for x in b]
        assert torch.equal(torch.cat([piece[j] for j in range(len(sizes)) for piece in per_rank]), w.b)


def test_a_worker_loads_the_weights_rank0_read_or_refuses(tmp_path):
    """``put`` (a worker's side of rank 0's slot choice) fills the slot from its host copy or the files; files
    changed on disk since rank 0 read them (here its config: another lora_alpha) are a ConfigError, never other
    weights in the slot; files only touched are the same adapter."""
    import json

    base = build_tiny_model("qwen2", tmp_path / "base")
    path = adapters_of(base, tmp_path)["all"]
    lora = make_llm(str(base), enable_lora=True).engine.runner.lora
    request = LoRARequest("all", 1, str(path))
    digest = adapter_digest(str(path))
    lora.put(1, request, digest)
    qkv = lora.linears["layers.0.qkv_proj"]
    assert dict(lora.loaded) == {1: 1} and qkv.slot_ranks[1] == 24 and qkv.a[1, :24].abs().sum() > 0
    lora.put(0, request, digest)  # the host copy, into another slot
    assert dict(lora.loaded) == {1: 0} and torch.equal(qkv.a[0], qkv.a[1])
    weights = path / "adapter_model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    lora.forget(1)
    lora.put(1, request, digest)  # read again: the same bytes
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 64}))
    lora.put(1, request, digest)  # still rank 0's weights: the host copy
    lora.forget(1)
    with pytest.raises(ConfigError, match="changed on disk after rank 0 read it"):
        lora.put(1, request, digest)
    assert 1 not in lora.known


def test_adapters_touched_on_disk_keep_serving_on_every_rank(tmp_path):
    """One slot and host room for two adapters: rank 0 and the worker keep different host copies, so the worker
    reads an adapter from disk that rank 0 holds; after its file's time changed (same weights) the ranks still load
    the same weights — rank 0 reads it again too — and the output is the adapter's."""
    base = build_tiny_model("qwen2", tmp_path / "base")
    paths = {**adapters_of(base, tmp_path), "c": make_adapter(base, tmp_path / "c", 3, r=2)}
    requests = {n: LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(paths.items())}
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with make_llm(str(base), enable_lora=True, tensor_parallel_size=2, max_loras=1, max_cpu_loras=2) as llm:
        def run(name):
            out = llm.generate([PROMPTS[0]], params, lora_request=requests[name], use_tqdm=False)
            return out[0].outputs[0].token_ids
        first = {n: run(n) for n in ("all", "attn")}
        assert run("all") == first["all"] and run("c") != first["all"]
        weights = paths["all"] / "adapter_model.safetensors"
        st = weights.stat()
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        assert run("all") == first["all"] and run("attn") == first["attn"]


def test_an_adapter_rewritten_on_disk_is_read_again_with_a_fresh_prefix_cache(tmp_path):
    """An adapter in host memory but on no device slot, whose files were rewritten (retrained weights): rank 0
    reads it again, as the workers do, and its next request runs the new weights throughout — none of the KV cached
    under the old ones, the tokens a fresh engine gives."""
    import shutil
    import time

    base = build_tiny_model("llama", tmp_path / "base", intermediate_size=128)
    a = make_adapter(base, tmp_path / "a", 1, r=8, lora_alpha=16)
    retrained = make_adapter(base, tmp_path / "retrained", 7, r=8, lora_alpha=16)
    b = make_adapter(base, tmp_path / "b", 2, r=4, lora_alpha=4)
    prompt = [1, 300, 12, 7, 7, 99, 250, 4, 18] * 3
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    A, B = LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))
    with make_llm(str(base), enable_lora=True, tensor_parallel_size=2, max_loras=1, max_cpu_loras=2,
                  block_size=4) as llm:
        old = llm.generate([prompt], params, lora_request=A, use_tqdm=False)[0]
        llm.generate([prompt[:3]], params, lora_request=B, use_tqdm=False)  # B takes the only slot
        time.sleep(0.05)
        shutil.copy(retrained / "adapter_model.safetensors", a / "adapter_model.safetensors")
        new = llm.generate([prompt], params, lora_request=A, use_tqdm=False)[0]
    fresh = make_llm(str(base), enable_lora=True, block_size=4).generate([prompt], params, lora_request=A,
                                                                          use_tqdm=False)[0]
    assert new.num_cached_tokens == 0
    assert new.outputs[0].token_ids == fresh.outputs[0].token_ids != old.outputs[0].token_ids
