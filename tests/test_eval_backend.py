"""NvllmLM's lm-eval API beyond scoring, checked against lm-eval's own `hf` backend on the same weights: chat
templates (`--apply_chat_template`, `--fewshot_as_multiturn`, and `nvllm eval`'s flags for them), `--model_args`,
and the generation kwargs of generate_until."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from nvllm.assets import demo_model_path  # noqa: E402
from nvllm.config import EngineConfig  # noqa: E402
from nvllm.eval import tasks  # noqa: E402
from nvllm.eval.lm_eval_model import NvllmLM  # noqa: E402
from tests.test_eval import DATA, WINDOW, cli  # noqa: E402

# a template of the kind models ship, writing BOS itself: one "role: content" line a turn
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> str:
    """The demo model with a chat template in its tokenizer_config.json."""
    out = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(demo_model_path(), out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return str(out)


@pytest.fixture(scope="module")
def chat_lms(chat_model):
    from lm_eval.models.huggingface import HFLM

    return (NvllmLM(model=chat_model, device="cpu", max_length=WINDOW, show_progress=False),
            HFLM(pretrained=chat_model, device="cpu", dtype="float32", batch_size=16, max_length=WINDOW))


@pytest.fixture(scope="module")
def chat_tasks(tmp_path_factory):
    out = tmp_path_factory.mktemp("tasks")
    tasks.render(DATA, ["mmlu_sociology", "gsm8k"], out, num_fewshot=1)
    return TaskManager(include_path=str(out), include_defaults=False)


# ---- chat templates --------------------------------------------------------------------------------------
@pytest.mark.parametrize("multiturn", [True, False])
def test_chat_template_prompts_and_scores_match_hf_backend(chat_lms, chat_tasks, multiturn):
    """--apply_chat_template (few-shot examples as turns, or one user turn): the same prompts as the hf backend,
    the same log-likelihoods (MMLU) and greedy generations (GSM8K)."""
    nv, hf = chat_lms
    a, b = (lm_eval.simple_evaluate(model=lm, tasks=["mmlu_sociology", "gsm8k"], task_manager=chat_tasks,
                                    num_fewshot=1, limit=2, log_samples=True, gen_kwargs={"max_gen_toks": 8},
                                    apply_chat_template=True, fewshot_as_multiturn=multiturn) for lm in (nv, hf))
    for task in ("mmlu_sociology", "gsm8k"):
        for sa, sb in zip(a["samples"][task], b["samples"][task], strict=True):
            assert sa["arguments"] == sb["arguments"] and sa["prompt_hash"] == sb["prompt_hash"]
            context = sa["arguments"][0][0]
            assert context.startswith("<s>") and context.endswith("\nassistant:")  # the template's prompt
            assert (context.count("\nassistant: ") == 1) == multiturn  # the few-shot answer as its own turn
            for ra, rb in zip(sa["resps"], sb["resps"], strict=True):
                if task == "gsm8k":
                    assert ra == rb
                else:
                    assert ra[0][0] == pytest.approx(rb[0][0], abs=1e-4) and ra[0][1] == rb[0][1]


def test_chat_prompts_match_hf_backend_continuing_and_without_a_system_turn(chat_lms, monkeypatch):
    """add_generation_prompt, or continue_final_message (lm-eval's gen_prefix), as HFLM passes them; a template that
    refuses a system turn gets the history without it, as in HFLM."""
    nv, hf = chat_lms
    history = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "2 + 2?"}]
    cases = [(history, True), (history + [{"role": "assistant", "content": "Answer:"}], False)]
    for messages, gen in cases:
        assert nv.apply_chat_template(messages, gen) == hf.apply_chat_template(messages, gen)
    assert nv.apply_chat_template(*cases[1]).endswith("assistant: Answer:")  # continued, no newline after it
    no_system = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turn') }}{% endif %}" + \
        CHAT_TEMPLATE
    for lm in (nv, hf):
        monkeypatch.setattr(lm.tokenizer, "chat_template", no_system)
    monkeypatch.setattr(nv, "_chat_template", None)
    for messages, gen in cases:
        assert nv.apply_chat_template(messages, gen) == hf.apply_chat_template(messages, gen)
        assert "Answer briefly" not in nv.apply_chat_template(messages, gen)


def test_nvllm_eval_applies_the_chat_template_to_model_and_baseline(chat_model, chat_lms, chat_tasks, tmp_path):
    """--apply-chat-template reaches lm-eval (lm-eval's default: few-shot examples as turns) and the report; with
    --baseline both models see the chat-templated prompts, those of lm-eval's own run with the template."""
    from nvllm.eval import runner
    from nvllm.eval.harness_results import harness_entry

    report = tmp_path / "eval.json"
    r = cli("--model", chat_model, "--tasks", "mmlu_sociology", "--limit", "2", "--num-fewshot", "1",
            "--data-dir", str(DATA), "--apply-chat-template", "--output-json", str(report), "--no-progress")
    assert r.exit_code == 0, r.output
    data = json.loads(report.read_text())
    assert data["apply_chat_template"] is True and data["fewshot_as_multiturn"] is True

    spec = runner.EvalSpec(["mmlu_sociology"], 1, 2, str(DATA), None, WINDOW, apply_chat_template=True)
    results, rows, _ = runner.run_eval(EngineConfig(model=chat_model, device="cpu", log_stats_interval=0), spec,
                                       chat_model, max_drop=1.0, progress=False)
    want = lm_eval.simple_evaluate(model=chat_lms[0], tasks=["mmlu_sociology"], task_manager=chat_tasks,
                                   num_fewshot=1, limit=2, apply_chat_template=True, log_samples=True)
    assert [x["hashes"]["mmlu_sociology"] for x in results] == [harness_entry(want, "mmlu_sociology")[2]] * 2
    assert rows and not any(row.failed for row in rows)


@pytest.mark.parametrize("args, message", [
    (["--apply-chat-template"], "the tokenizer of {demo} has no chat template to apply"),
    (["--fewshot-as-multiturn"], "--fewshot-as-multiturn needs --apply-chat-template"),
    (["--model", "{chat}", "--baseline", "{demo}", "--apply-chat-template"],
     "use different tokenizers (chat templates differ)"),
])
def test_chat_template_flags_bad_input(chat_model, args, message):
    fill = {"demo": demo_model_path(), "chat": chat_model}
    r = cli("--tasks", "mmlu_sociology", "--data-dir", str(DATA), "--no-progress", *[a.format(**fill) for a in args])
    out = " ".join(r.output.split())
    assert r.exit_code == 2 and message.format(**fill) in out, r.output
    assert "Traceback" not in out and len(r.output.strip().splitlines()) == 1


# ---- --model_args --------------------------------------------------------------------------------------------
def test_model_args_take_every_engine_config_field_and_llms_own():
    from nvllm.eval.lm_eval_model import _ENGINE_KEYS

    assert {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "device"} <= _ENGINE_KEYS
    lm = NvllmLM.create_from_arg_string(
        f"pretrained={demo_model_path()},device=cpu,show_progress=False,kv_cache_dtype=int8,quantization=fp8,"
        "revision=main,trust_remote_code=True,tokenizer_mode=auto,swap_space=4,task=generate,max_model_len=128")
    config = lm.llm.config
    assert (config.kv_cache_dtype, config.quantization, config.max_model_len) == ("int8", "fp8", 128)
    with pytest.raises(ValueError, match="unknown nvllm model argument"):
        NvllmLM.create_from_arg_string(f"pretrained={demo_model_path()},device=cpu,num_beams=4")


# ---- generation kwargs -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo_lms():
    from lm_eval.models.huggingface import HFLM

    return (NvllmLM(device="cpu", max_length=128, show_progress=False),
            HFLM(pretrained=demo_model_path(), device="cpu", dtype="float32", batch_size=1, max_length=128))


def test_generation_kwargs_reach_sampling_params_as_in_hf(demo_lms, caplog):
    """Every kwarg that is a sampling parameter is used (repetition_penalty changes the text, as it does in HF);
    do_sample False stays greedy whatever the temperature; the others are named in one warning."""
    nv, hf = demo_lms

    def generate(lm, **kw):
        req = [Instance("generate_until", {}, ("One day", {"until": ["\n"], "max_gen_toks": 40, **kw}), 0)]
        return lm.generate_until(req, disable_tqdm=True)[0]

    plain = generate(nv)
    penalised = generate(nv, do_sample=False, repetition_penalty=2.0)
    assert penalised != plain and penalised == generate(hf, do_sample=False, repetition_penalty=2.0)
    assert generate(nv, do_sample=False, temperature=0.9) == plain
    with caplog.at_level("WARNING", logger="nvllm"):
        assert generate(nv, num_beams=1, early_stopping=True) == plain
        generate(nv, num_beams=1)
    warned = [r.getMessage() for r in caplog.records if "num_beams" in r.getMessage()]
    assert warned == ["ignoring generation kwargs that are not nvllm sampling parameters: early_stopping, num_beams"]
