"""LoRA test helpers: PEFT adapters made and saved as PEFT saves them, PEFT's own greedy tokens, and the engine's
outputs checked against them (tests/test_lora.py on the CPU, tests/test_lora_gpu.py on a GPU)."""

from __future__ import annotations

from pathlib import Path

import peft
import pytest
import torch
import transformers

from nvllm import LoRARequest, SamplingParams
from tests.conftest import build_tiny_model

PROMPTS = [[1, 45, 67, 89, 120, 33], [1, 300, 12, 7, 7, 99, 250, 4, 18]]
N = 8


def make_adapter(base: Path, out: Path, seed: int, **kw) -> Path:
    """A PEFT LoRA of ``base`` with random A and B (PEFT's init_lora_weights=False), saved as PEFT saves it."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    kw.setdefault("target_modules", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **kw)).save_pretrained(out)
    return out


def peft_greedy(base_model, adapter: Path | None, prompt: list[int]) -> tuple[list[int], float]:
    """PEFT's greedy tokens and the first one's log-probability (the base model's without an adapter)."""
    model = base_model if adapter is None else peft.PeftModel.from_pretrained(base_model, adapter)
    with torch.no_grad():
        ids = torch.tensor([prompt])
        first = torch.log_softmax(model(ids).logits[0, -1], -1)
        out = model.generate(ids, max_new_tokens=N, do_sample=False)[0, len(prompt):].tolist()
    if adapter is not None:
        model.unload()  # the base model without the adapter's layers, for the next reference
    return out, first[out[0]].item()


def check_against_peft(llm, reference_base, adapters: dict[str, Path], logprob_tol: float = 1e-4) -> None:
    names = [None, *adapters]
    requests = {n: LoRARequest(n, i + 1, str(adapters[n])) for i, n in enumerate(adapters)}
    prompts = [p for p in PROMPTS for _ in names]
    loras = [requests.get(n) for _ in PROMPTS for n in names]
    params = SamplingParams(max_tokens=N, temperature=0, logprobs=0, ignore_eos=True)
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    got = {}
    for prompt, lora, out in zip(prompts, loras, outs):
        c = out.outputs[0]
        got[(tuple(prompt), lora.lora_name if lora else None)] = (c.token_ids, c.logprobs[0][c.token_ids[0]].logprob)
    for prompt in PROMPTS:
        for n in names:
            want, lp = peft_greedy(reference_base, adapters.get(n), prompt)
            tokens, got_lp = got[(tuple(prompt), n)]
            assert tokens[:len(want)] == want, (n, prompt)  # HF stops at EOS; ignore_eos goes on
            assert got_lp == pytest.approx(lp, abs=logprob_tol), (n, prompt, got_lp, lp)
    assert len({tuple(v[0]) for v in got.values()}) > len(PROMPTS)  # the adapters do change the output


def lora_setup(root: Path) -> tuple[Path, Path, dict[str, Path]]:
    """A tiny Qwen2 and two adapters: every projection at r=8, and attention only at r=4 with rsLoRA."""
    base = build_tiny_model("qwen2", root / "base")
    adapters = {"all": make_adapter(base, root / "all", 1, r=8, lora_alpha=16),
                "attn": make_adapter(base, root / "attn", 2, r=4, lora_alpha=4, use_rslora=True,
                                     target_modules=["q_proj", "v_proj", "o_proj"])}
    return root, base, adapters
