"""Beam search (vLLM's LLM.beam_search and use_beam_search) against HF transformers' own beam search: the same beams
and cumulative log-probabilities; EOS ends a beam as vLLM ends it; the server returns the offline search's beams to
the official client and refuses what beam search does not combine with."""

from __future__ import annotations

import signal

import openai
import pytest
import torch

from nvllm.assets import demo_model_path
from nvllm.beam_search import BeamSearchParams
from tests.conftest import build_tiny_model, make_llm
from tests.quant_utils import hf_model
from tests.server_utils import start_server, stop_server

PROMPT = [1, 45, 67, 89, 120, 33]


def test_beams_and_scores_are_hfs(tmp_path):
    base = build_tiny_model("qwen2", tmp_path / "base")
    model = hf_model(base)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0  # no beam ends early
    with torch.no_grad():
        g = model.generate(torch.tensor([PROMPT]), num_beams=4, num_return_sequences=4, max_new_tokens=6,
                           do_sample=False, length_penalty=1.0, early_stopping=False, output_scores=True,
                           return_dict_in_generate=True)
    want = [(s[len(PROMPT):].tolist(), score.item() * 6) for s, score in zip(g.sequences, g.sequences_scores)]
    out = make_llm(str(base)).beam_search([PROMPT], BeamSearchParams(beam_width=4, max_tokens=6, ignore_eos=True))[0]
    assert [s.output_token_ids for s in out.sequences] == [w[0] for w in want]
    assert [s.cum_logprob for s in out.sequences] == pytest.approx([w[1] for w in want], abs=1e-4)
    assert len({tuple(s.output_token_ids) for s in out.sequences}) == 4


def test_eos_ends_a_beam_as_vllm_ends_it(tmp_path):
    from safetensors.torch import load_file, save_file

    base = build_tiny_model("qwen2", tmp_path / "base")
    weights = load_file(base / "model.safetensors")
    weights["lm_head.weight"][2] *= 4  # EOS (id 2) now often among a beam's best candidates
    save_file(weights, base / "model.safetensors")
    llm = make_llm(str(base))
    eos = llm.engine.eos_token_ids
    for penalty in (1.0, 0.0):
        out = llm.beam_search([PROMPT], BeamSearchParams(beam_width=3, max_tokens=12, length_penalty=penalty))[0]
        scores = [s.cum_logprob / (len(s.tokens) ** penalty) for s in out.sequences]
        assert len(out.sequences) == 3 and scores == sorted(scores, reverse=True)  # best first, vLLM's score
        tok = llm.get_tokenizer()
        for s in out.sequences:  # EOS only at the end of a stopped beam's tokens, never in its text
            stop = s.finish_reason == "stop"
            assert s.finish_reason in ("stop", "length") and not set(s.output_token_ids[:-1]) & eos
            assert (s.output_token_ids[-1] in eos) == stop
            assert s.text == tok.decode(s.output_token_ids[:-1] if stop else s.output_token_ids)
            assert len(s.logprobs) == len(s.output_token_ids) and s.cum_logprob == pytest.approx(sum(s.logprobs))
    stopped = [s for s in out.sequences if s.finish_reason == "stop"]
    assert stopped  # with the raw sum (length_penalty 0), beams that ended early come first
    for penalty in (1000.0, -1000.0):  # n**penalty overflows a float; the ranking is taken in log space
        far = llm.beam_search([PROMPT], BeamSearchParams(beam_width=3, max_tokens=12, length_penalty=penalty))[0]
        lengths = [len(s.tokens) - (s.finish_reason == "stop") for s in far.sequences]
        assert len(lengths) == 3 and lengths == sorted(lengths, reverse=penalty > 0)
    kept = llm.beam_search([PROMPT], BeamSearchParams(beam_width=3, max_tokens=12, length_penalty=0.0,
                                                      include_stop_str_in_output=True))[0]
    assert [s.text for s in kept.sequences if s.finish_reason == "stop"] == [
        tok.decode(s.output_token_ids, skip_special_tokens=True) for s in stopped]
    # a prompt one token short of max_model_len still gets its token, as generate gives it
    short = make_llm(str(base), max_model_len=16).beam_search([list(range(3, 18))],
                                                             BeamSearchParams(beam_width=2, max_tokens=4))[0]
    assert [len(s.output_token_ids) for s in short.sequences] == [1, 1]
    with pytest.raises(ValueError, match="beam_width must be at least 1"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="length_penalty must be a finite number"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=float("nan"))


def test_an_adapter_per_prompt_a_concurrency_limit_and_a_progress_factory(tmp_path):
    """vLLM's beam_search arguments: lora_request one per prompt (each prompt's beams are those of a search with its
    adapter alone), concurrency_limit (prompts searched a few at a time: the same beams), use_tqdm as a factory."""
    from nvllm import LoRARequest
    from tests.lora_utils import make_adapter

    base = build_tiny_model("qwen2", tmp_path / "base")
    adapter = LoRARequest("a", 1, str(make_adapter(base, tmp_path / "a", 1, r=8, lora_alpha=16)))
    llm = make_llm(str(base), enable_lora=True)
    params = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    prompts = [PROMPT, PROMPT[:4], PROMPT[1:]]
    loras = [adapter, None, adapter]
    alone = [llm.beam_search([p], params, lora_request=lo)[0] for p, lo in zip(prompts, loras)]

    class Bar:
        made: list = []

        def __init__(self, total, desc):
            self.made.append(self)
            self.total, self.count, self.closed = total, 0, False

        def update(self, n):
            self.count += n

        def close(self):
            self.closed = True

    for limit in (None, 1, 2):
        got = llm.beam_search(prompts, params, lora_request=loras, concurrency_limit=limit, use_tqdm=Bar)
        assert [[s.tokens for s in o.sequences] for o in got] == [[s.tokens for s in o.sequences] for o in alone]
        assert (Bar.made[-1].total, Bar.made[-1].count, Bar.made[-1].closed) == (3, 3, True)
    assert alone[0].sequences[0].tokens != llm.beam_search([PROMPT], params)[0].sequences[0].tokens
    with pytest.raises(ValueError, match="3 prompts but 2 LoRA requests"):
        llm.beam_search(prompts, params, lora_request=loras[:2])
    with pytest.raises(ValueError, match="concurrency_limit must be a positive integer"):
        llm.beam_search(prompts, params, concurrency_limit=0)


def test_a_beams_text_reads_on_from_the_prompt():
    """SentencePiece drops a text's leading space: a beam's text is decoded after the prompt's last tokens, so a
    beam of one is greedy sampling's text, word space included, and echo gives the prompt's text + the beam's."""
    from nvllm.sampling_params import SamplingParams

    llm = make_llm(demo_model_path())
    greedy = llm.generate(["Once upon"], SamplingParams(max_tokens=8, temperature=0.0))[0].outputs[0]
    beam = llm.beam_search(["Once upon"], BeamSearchParams(beam_width=1, max_tokens=8))[0].sequences[0]
    assert beam.output_token_ids == list(greedy.token_ids)
    assert beam.text == greedy.text and beam.text.startswith(" ")


def test_server_beams_are_the_offline_beams(tmp_path):
    proc, url = start_server(["--device", "cpu", "--max-model-len", "256", "--log-stats-interval", "0",
                              "--uvicorn-log-level", "warning"], tmp_path / "log")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        llm = make_llm(demo_model_path())
        want = llm.beam_search(["Once upon a time"], BeamSearchParams(beam_width=3, max_tokens=30))[0]
        r = client.completions.create(model="stories260K", prompt="Once upon a time", n=3, max_tokens=30,
                                      extra_body={"use_beam_search": True})
        assert [c.text for c in r.choices] == [s.text for s in want.sequences]
        assert [c.finish_reason for c in r.choices] == [s.finish_reason for s in want.sequences]
        assert r.usage.completion_tokens == sum(len(s.output_token_ids) for s in want.sequences)
        chat = client.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": "Hi"}], n=2,
                                              max_tokens=12, extra_body={"use_beam_search": True})
        assert len(chat.choices) == 2 and all(c.message.content for c in chat.choices)
        with pytest.raises(openai.BadRequestError):  # no room left: a 400, not a 500
            client.completions.create(model="stories260K", prompt=[5] * 256, max_tokens=1, n=2,
                                      extra_body={"use_beam_search": True})
        chat = client.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": "Hi"}], n=2,
                                              max_tokens=4, logprobs=False, extra_body={"use_beam_search": True})
        assert len(chat.choices) == 2  # logprobs: false asks for nothing
        for kw, param in ((dict(stream=True), "stream"), (dict(stop=["x"]), "stop"), (dict(logprobs=0), "logprobs"),
                          (dict(extra_body={"use_beam_search": True, "guided_regex": "a"}), "use_beam_search")):
            kw.setdefault("extra_body", {"use_beam_search": True})
            with pytest.raises(openai.BadRequestError) as e:
                client.completions.create(model="stories260K", prompt="x", max_tokens=4, **kw)
            assert e.value.body["param"] == param
    finally:
        stop_server(proc)


def test_a_shutdown_ends_beam_searches_in_flight(tmp_path):
    """SIGTERM while beam searches run: each ends at its aborted step with the beams so far (the live ones finishing
    with "abort", as an aborted request's choices do), the client gets its 200, and the server exits 0 within
    --shutdown-timeout rather than after uvicorn cancels the searches into bare 500s."""
    import concurrent.futures
    import time

    proc, url = start_server(["--device", "cpu", "--max-model-len", "512", "--log-stats-interval", "0",
                              "--uvicorn-log-level", "warning", "--shutdown-timeout", "1"], tmp_path / "log")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(client.completions.create, model="stories260K", prompt=["Once upon a time", "The dog"],
                               n=4, max_tokens=400, extra_body={"use_beam_search": True, "ignore_eos": True})
                   for _ in range(2)]
        time.sleep(3)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
        waited = time.monotonic() - t0
        replies = [f.result() for f in futures]
    # (the replies tell the abort from uvicorn's cancel, which would have answered bare 500s: the time only bounds
    # a hang, loosely, as a loaded machine's shutdown takes longer)
    assert rc == 0 and waited < 30, (rc, waited, (tmp_path / "log").read_text()[-3000:])
    for r in replies:
        assert len(r.choices) == 8 and {c.finish_reason for c in r.choices} == {"abort"}
        assert all(0 < len(c.text) for c in r.choices)


def test_generate_command_prints_the_beams():
    from typer.testing import CliRunner

    from nvllm.cli import app

    want = make_llm(demo_model_path()).beam_search(["Once upon a time"], BeamSearchParams(beam_width=2, max_tokens=8))
    res = CliRunner().invoke(app, ["generate", "--device", "cpu", "--beam-width", "2", "--max-tokens", "8"],
                             env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    printed = [line for line in res.output.splitlines() if line.startswith("Once upon a time")]
    assert printed == ["Once upon a time" + s.text for s in want[0].sequences]
    res = CliRunner().invoke(app, ["generate", "--device", "cpu", "--beam-width", "2", "--max-tokens", "8",
                                   "--temperature", "0"], env={"COLUMNS": "200"})   # no sampling: what beams do
    assert res.exit_code == 0 and [line for line in res.output.splitlines()
                                   if line.startswith("Once upon a time")] == printed, res.output
    for flags in (["--stop", "a"], ["--regex", "[0-9]+"], ["-n", "3"], ["--temperature", "0.8"], ["--logprobs", "2"]):
        res = CliRunner().invoke(app, ["generate", "--device", "cpu", "--beam-width", "2", *flags],
                                 env={"COLUMNS": "200"})
        assert res.exit_code == 2 and "does not apply to it" in res.output, flags
    res = CliRunner().invoke(app, ["generate", "--beam-width", "0"], env={"COLUMNS": "200"})
    assert res.exit_code == 2 and "beam_width must be at least 1" in res.output
