"""LoRA adapters against PEFT's own model: adapters PEFT creates and saves are served by the engine, several at once
and beside the base model in one batch, on dense, GPTQ and FP8 bases; the greedy tokens and log-probabilities
are PEFT's (on GPTQ and FP8 bases, PEFT runs their dequantized weights). The prefix cache never hands one adapter's
KV to another (it knows adapters by their files); bad adapters and settings are one clear error; the server picks
adapters by model name for the official client."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import peft
import pytest
import torch
from typer.testing import CliRunner

from nvllm import LoRARequest, SamplingParams
from nvllm.cli import app
from nvllm.config import ConfigError, EngineConfig
from nvllm.engine.kv_budget import lora_footprint
from nvllm.lora.request import parse_lora_modules
from tests.conftest import build_tiny_model, make_llm
from tests.lora_utils import N, PROMPTS, check_against_peft, lora_setup, make_adapter, peft_greedy
from tests.quant_utils import hf_model, write_by_hand
from tests.server_utils import start_server, stop_server


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return lora_setup(tmp_path_factory.mktemp("lora"))


def test_adapters_and_the_base_in_one_batch_match_peft(setup):
    """... and the kernel report names the LoRA paths that ran: per-adapter matmuls on prompt rows, a slot per token
    in decode steps."""
    from nvllm.kernels import report

    _, base, adapters = setup
    llm = make_llm(str(base), enable_lora=True)
    report.reset()
    check_against_peft(llm, hf_model(base), adapters)
    ran = set(report.snapshot().get("lora", {}))
    assert ran == {"torch matmuls per adapter (prompt rows)", "torch reference (a slot per token)"}, ran


def test_decode_graph_rows_apply_each_rows_adapter_slot(setup):
    """The runner's decode-graph path: a stand-in for DecodeGraphs (tests/test_graph_rows.py) runs the model on the
    rows and LoRA slots a replay would stage; adapters beside the base model still match PEFT, and steps of the base
    model alone replay the graphs without LoRA."""
    from tests.test_graph_rows import with_row_graphs

    _, base, adapters = setup
    llm = make_llm(str(base), enable_lora=True)
    graphs = with_row_graphs(llm)
    check_against_peft(llm, hf_model(base), adapters)
    seen = [s for s in graphs.lora_rows_seen if s is not None]
    decodes = [s for s in seen if len(s) == len(PROMPTS) * (len(adapters) + 1)]  # (prompts ran as rows too)
    assert len(decodes) >= N - 1 and all(set(s) == {-1, 0, 1} for s in seen)  # the base's rows −1; two slots
    assert all(sorted(s) == sorted([-1, 0, 1] * len(PROMPTS)) for s in decodes)
    llm.generate(PROMPTS, SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert graphs.lora_rows_seen[-1] is None


def test_adapters_on_a_gptq_base_match_peft_on_its_dequantized_weights(setup):
    root, base, adapters = setup
    deq = write_by_hand(base, root / "gptq", "gptq", bits=4, group=32)
    llm = make_llm(str(root / "gptq"), enable_lora=True)
    check_against_peft(llm, hf_model(base, deq), adapters)


def test_adapters_on_an_fp8_base_match_peft_on_its_dequantized_weights(setup):
    from safetensors.torch import load_file

    from nvllm.quant.fp8 import dequantize_rows, quantize_rows
    from tests.quant_utils import PROJ

    _, base, adapters = setup
    deq = {name: dequantize_rows(*quantize_rows(w), w.shape[1])
           for name, w in load_file(base / "model.safetensors").items() if PROJ.match(name)}
    llm = make_llm(str(base), enable_lora=True, quantization="fp8")
    assert type(llm.engine.runner.model.layers[0].qkv_proj.base).__name__ == "Fp8Linear"
    check_against_peft(llm, hf_model(base, deq), adapters)


def test_the_prefix_cache_keeps_adapters_apart(setup):
    _, base, adapters = setup
    llm = make_llm(str(base), enable_lora=True, block_size=4)
    a = LoRARequest("all", 1, str(adapters["all"]))
    prompt = PROMPTS[1] * 3
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    alone = make_llm(str(base)).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    first = llm.generate([prompt], params, lora_request=a, use_tqdm=False)[0]
    again = llm.generate([prompt], params, lora_request=a, use_tqdm=False)[0]
    plain = llm.generate([prompt], params, use_tqdm=False)[0]
    assert plain.outputs[0].token_ids == alone != first.outputs[0].token_ids
    assert plain.num_cached_tokens == 0 and again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_the_prefix_cache_knows_adapters_by_their_files(setup, tmp_path):
    """The prefix cache keys an adapter's KV by what its files hold: a copy under another name and path shares it;
    the same name, id and path whose adapter_config.json changed (lora_alpha: a new scale, same weights file)
    shares nothing with the KV of before, and gives what a fresh engine gives."""
    import shutil

    _, base, adapters = setup
    llm = make_llm(str(base), enable_lora=True, block_size=4, max_loras=1, max_cpu_loras=1)
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    prompt = PROMPTS[1] * 3
    ad = shutil.copytree(adapters["all"], tmp_path / "ad")
    copy = shutil.copytree(adapters["all"], tmp_path / "copy")
    request = LoRARequest("ad", 1, str(ad))
    first = llm.generate([prompt], params, lora_request=request, use_tqdm=False)[0]
    shared = llm.generate([prompt], params, lora_request=LoRARequest("copy", 2, str(copy)), use_tqdm=False)[0]
    assert shared.num_cached_tokens > 0 and shared.outputs[0].token_ids == first.outputs[0].token_ids
    assert 1 not in llm.engine.runner.lora.known  # max_cpu_loras 1: "ad" left host memory; next time it is read
    config = json.loads((ad / "adapter_config.json").read_text())
    (ad / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": config["lora_alpha"] * 4}))
    again = llm.generate([prompt], params, lora_request=request, use_tqdm=False)[0]
    fresh = make_llm(str(base), enable_lora=True).generate([prompt], params, lora_request=request, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == fresh.outputs[0].token_ids != first.outputs[0].token_ids


def test_adapters_beyond_max_loras_wait_for_a_slot(setup):
    _, base, adapters = setup
    a, b = LoRARequest("all", 1, str(adapters["all"])), LoRARequest("attn", 2, str(adapters["attn"]))
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    roomy = make_llm(str(base), enable_lora=True)
    want = [o.outputs[0].token_ids for o in roomy.generate([PROMPTS[0]] * 3, params, lora_request=[a, b, None],
                                                            use_tqdm=False)]
    llm = make_llm(str(base), enable_lora=True, max_loras=1)
    got = [o.outputs[0].token_ids for o in llm.generate([PROMPTS[0]] * 3, params, lora_request=[a, b, None],
                                                         use_tqdm=False)]
    assert got == want and len(set(map(tuple, got))) == 3  # one slot: the second adapter ran after the first
    assert list(llm.engine.runner.lora.loaded) in ([1], [2])


def test_reloading_a_name_never_reuses_the_old_adapters_cache(setup):
    _, base, adapters = setup
    llm = make_llm(str(base), enable_lora=True, block_size=4)
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    prompt = PROMPTS[1] * 3
    first = llm.generate([prompt], params, lora_request=LoRARequest("x", 1, str(adapters["all"])), use_tqdm=False)
    assert llm.engine.unload_lora(1)
    again = llm.generate([prompt], params, lora_request=LoRARequest("x", 2, str(adapters["attn"])), use_tqdm=False)
    alone = make_llm(str(base), enable_lora=True).generate(
        [prompt], params, lora_request=LoRARequest("attn", 1, str(adapters["attn"])), use_tqdm=False)
    assert again[0].num_cached_tokens == 0 and again[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert first[0].outputs[0].token_ids != alone[0].outputs[0].token_ids


def test_an_adapter_unloaded_in_use_finishes_its_requests_and_then_goes(setup):
    """vLLM's runtime swap: unload a name while a request runs with it, load other weights under the same name
    (a new id) at once; the running request ends on its own weights, new requests get the new ones, and the old
    adapter is forgotten once idle."""
    _, base, adapters = setup
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    old, new = LoRARequest("x", 1, str(adapters["all"])), LoRARequest("x", 2, str(adapters["attn"]))
    alone = {r.lora_int_id: make_llm(str(base), enable_lora=True).generate(
        [PROMPTS[0]], params, lora_request=r, use_tqdm=False)[0].outputs[0].token_ids for r in (old, new)}
    engine = make_llm(str(base), enable_lora=True).engine
    running = engine.add_request(None, PROMPTS[0], params, lora_request=old)
    engine.step()
    assert not engine.unload_lora(1)  # in use: it goes later
    later = engine.add_request(None, PROMPTS[0], params, lora_request=new)  # its name, another id: no refusal
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert done == {running: alone[1], later: alone[2]}
    engine.step()
    assert set(engine.runner.lora.known) == {2}


def test_peft_variants_load_as_peft_reads_them(setup, tmp_path):
    root, base, adapters = setup
    # no lora_alpha in the config (PEFT's default 8), keys carrying the adapter's name, a pickle-only checkpoint
    import shutil

    from safetensors.torch import load_file

    variant = tmp_path / "variant"
    shutil.copytree(adapters["attn"], variant)
    cfg = json.loads((variant / "adapter_config.json").read_text())
    del cfg["lora_alpha"]
    (variant / "adapter_config.json").write_text(json.dumps(cfg))
    tensors = load_file(variant / "adapter_model.safetensors")
    (variant / "adapter_model.safetensors").unlink()
    torch.save({k.replace(".weight", ".default.weight"): v for k, v in tensors.items()}, variant / "adapter_model.bin")
    request = LoRARequest("v", 1, str(variant))
    with pytest.raises(ValueError, match="pass --allow-pickle"):
        make_llm(str(base), enable_lora=True).generate([PROMPTS[0]], lora_request=request, use_tqdm=False)
    llm = make_llm(str(base), enable_lora=True, allow_pickle=True)
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    got = llm.generate([PROMPTS[0]], params, lora_request=request, use_tqdm=False)[0].outputs[0].token_ids
    want, _ = peft_greedy(hf_model(base), variant, PROMPTS[0])
    assert got[:len(want)] == want


def test_an_adapter_unloaded_after_its_name_was_checked_is_a_404():
    """A request whose adapter is unloaded between the name check and its engine request (while its prompt is
    tokenized) ends in a 404: it never runs on the base model under the adapter's name."""
    from nvllm.serve.errors import APIError
    from nvllm.serve.models import ServedModels

    models = ServedModels("base", "", 64, [LoRARequest("zz", 1, "/x")])
    models.check("zz")
    assert models.lora("zz").lora_name == "zz" and models.lora("base") is None and models.lora("") is None
    models.remove("zz")
    with pytest.raises(APIError) as e:
        models.lora("zz")
    assert e.value.status == 404


def test_bad_adapters_and_settings_are_one_clear_error(setup, tmp_path):
    root, base, adapters = setup
    llm = make_llm(str(base), enable_lora=True, max_lora_rank=4)
    cases = [(LoRARequest("x", 9, str(tmp_path / "missing")), "is not a directory"),
             (LoRARequest("all", 1, str(adapters["all"])), "has rank 8, above max_lora_rank 4")]
    dora = make_adapter(base, tmp_path / "dora", 3, r=2, use_dora=True)
    cases.append((LoRARequest("dora", 3, str(dora)), "DoRA adapters are not supported"))
    head = make_adapter(base, tmp_path / "head", 4, r=2, target_modules=["lm_head"])
    cases.append((LoRARequest("head", 4, str(head)), "LoRA on embeddings and the LM head is not supported"))
    wrong_r = tmp_path / "wrong_r"
    import shutil

    shutil.copytree(adapters["attn"], wrong_r)
    cfg = json.loads((wrong_r / "adapter_config.json").read_text())
    (wrong_r / "adapter_config.json").write_text(json.dumps({**cfg, "r": 2}))
    cases.append((LoRARequest("wrong_r", 5, str(wrong_r)), "not of rank r=2"))
    deep = build_tiny_model("qwen2", tmp_path / "deep_base", num_hidden_layers=3)
    cases.append((LoRARequest("deep", 6, str(make_adapter(deep, tmp_path / "deep", 5, r=2))),
                  r"is in layer \d+, and the model has \d+ layers \(an adapter of another model\?\)"))
    for request, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2), lora_request=request, use_tqdm=False)
    with pytest.raises(ValueError, match="enable_lora"):
        make_llm(str(base)).generate([PROMPTS[0]], lora_request=cases[1][0], use_tqdm=False)
    assert [(r.lora_name, r.lora_int_id) for r in parse_lora_modules(["a=/x,b=/y", '{"name": "c", "path": "/z"}'])] \
        == [("a", 1), ("b", 2), ("c", 3)]
    for bad, message in ((["a"], "name=path"), (["a=/x", "a=/y"], "given twice")):
        with pytest.raises(ValueError, match=message):
            parse_lora_modules(bad)


def test_server_picks_the_adapter_by_model_name(setup, tmp_path, monkeypatch):
    _, base, adapters = setup
    monkeypatch.setenv("NVLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    proc, url = start_server(["--model", str(base), "--device", "cpu", "--enable-lora",
                              "--lora-modules", f"all={adapters['all']}", "--lora-modules", f"attn={adapters['attn']}",
                              "--log-stats-interval", "0", "--uvicorn-log-level", "warning"], tmp_path / "log")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        import httpx

        assert 'nvllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""}' in \
            httpx.get(f"{url}/metrics").text
        cards = {m.id: m for m in client.models.list().data}
        assert set(cards) == {str(base), "all", "attn"} and cards["all"].model_extra["parent"] == str(base)
        llm = make_llm(str(base), enable_lora=True)
        params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
        for name, lora in ((str(base), None), ("all", LoRARequest("all", 1, str(adapters["all"])))):
            r = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=N, temperature=0,
                                          extra_body={"ignore_eos": True})
            want = llm.generate([PROMPTS[0]], params, lora_request=lora, use_tqdm=False)[0].outputs[0].token_ids
            assert r.model == name and r.choices[0].text == llm.get_tokenizer().decode(want)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="nope", prompt="x", max_tokens=2)
        # vLLM's runtime endpoints: the adapter under a new name, then gone
        r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(adapters["attn"])})
        assert r.status_code == 200 and "late" in {m.id for m in client.models.list().data}
        want = llm.generate([PROMPTS[0]], params, lora_request=LoRARequest("attn", 2, str(adapters["attn"])),
                            use_tqdm=False)[0].outputs[0].token_ids
        r = client.completions.create(model="late", prompt=PROMPTS[0], max_tokens=N, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == llm.get_tokenizer().decode(want)
        for body, status in (({"lora_name": "late", "lora_path": str(adapters["all"])}, 400),  # the name is taken
                             ({"lora_name": "bad", "lora_path": "/no/such"}, 400)):
            assert httpx.post(f"{url}/v1/load_lora_adapter", json=body).status_code == status
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 404
        assert {m.id for m in client.models.list().data} == {str(base), "all", "attn"}
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="late", prompt="x", max_tokens=2)
        # nvllm bench serve --lora-modules: each request names one of the adapters (an unknown one fails them all)
        bench = ["bench", "serve", "--base-url", url, "--tokenizer", str(base), "--num-prompts", "6", "--input-len",
                 "8", "--output-len", "4", "--no-progress"]
        report = tmp_path / "bench.json"
        res = CliRunner().invoke(app, [*bench, "--lora-modules", "all,attn", "--save-result", str(report)],
                                 env={"COLUMNS": "200"})
        result = json.loads(report.read_text())
        assert res.exit_code == 0 and result["completed"] == 6 and result["lora_modules"] == ["all", "attn"]
        res = CliRunner().invoke(app, [*bench, "--lora-modules", "nope"], env={"COLUMNS": "200"})
        assert res.exit_code == 1 and "all 6 requests failed" in res.output
    finally:
        stop_server(proc)
    for args, message in ((["--lora-modules", f"a={adapters['all']}"], "--lora-modules needs --enable-lora"),
                          (["--enable-lora", "--lora-modules", "a=/no/such"], "is not a directory")):
        res = CliRunner().invoke(app, ["serve", "--model", str(base), "--device", "cpu", *args],
                                 env={"COLUMNS": "200"})
        assert res.exit_code == 2 and message in res.output, res.output
    assert json.loads((adapters["all"] / "adapter_config.json").read_text())["r"] == 8
    res = CliRunner().invoke(app, ["generate", "--model", str(base), "--device", "cpu", "--lora", str(adapters["all"]),
                                   "--max-tokens", str(N), "--ignore-eos", "Once"], env={"COLUMNS": "200"})
    want = llm.generate(["Once"], params, lora_request=LoRARequest("all", 1, str(adapters["all"])),
                        use_tqdm=False)[0].outputs[0].text
    assert res.exit_code == 0 and "Once" + want in res.output.splitlines()


def test_eval_scores_an_adapter_as_lm_evals_hf_backend_on_the_merged_model(setup, tmp_path):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from nvllm.eval import perplexity
    from nvllm.eval.lm_eval_model import NvllmLM

    _, base, adapters = setup
    data = Path(__file__).resolve().parent / "data" / "eval"
    doc = perplexity.load_corpus("wikitext", data).scored[0][:1500]
    reqs = [Instance("loglikelihood_rolling", {}, (doc,), 0)]
    nv = NvllmLM(model=str(base), device="cpu", max_length=200, show_progress=False,
                 lora_local_path=str(adapters["all"]))
    # PEFT's merge of the adapter, saved as a model (HFLM's own peft= path pads the vocabulary when the tokenizer
    # has no pad token, which changes every log-probability)
    merged = peft.PeftModel.from_pretrained(hf_model(base), adapters["all"]).merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (tmp_path / "merged" / f).write_bytes((base / f).read_bytes())
    hf = HFLM(pretrained=str(tmp_path / "merged"), device="cpu", dtype="float32", max_length=200)
    plain = NvllmLM(model=str(base), device="cpu", max_length=200, show_progress=False)
    got, want = nv.loglikelihood_rolling(reqs), hf.loglikelihood_rolling(reqs)
    assert got == pytest.approx(want, rel=1e-5) and got != pytest.approx(plain.loglikelihood_rolling(reqs), rel=1e-3)
    report = tmp_path / "eval.json"
    res = CliRunner().invoke(app, ["eval", "--model", str(base), "--device", "cpu", "--lora", str(adapters["all"]),
                                   "--baseline", str(base), "--tasks", "wikitext", "--limit", "1", "--max-length",
                                   "128", "--data-dir", str(data), "--max-drop", "1000", "--output-json", str(report),
                                   "--no-progress"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    models = json.loads(report.read_text())["models"]
    assert [m["lora"] for m in models] == [None, str(adapters["all"])]
    assert models[0]["tasks"]["wikitext"]["metrics"] != models[1]["tasks"]["wikitext"]["metrics"]


def test_host_memory_keeps_max_cpu_loras_adapters(setup):
    _, base, adapters = setup
    llm = make_llm(str(base), enable_lora=True, max_loras=1, max_cpu_loras=1)
    params = SamplingParams(max_tokens=2, temperature=0)
    for i, name in enumerate(("all", "attn", "all")):
        llm.generate([PROMPTS[0]], params, lora_request=LoRARequest(name, i + 1, str(adapters[name])), use_tqdm=False)
        assert list(llm.engine.runner.lora.known) == [i + 1]  # the idle one before it was dropped
    with pytest.raises(ConfigError, match="max_cpu_loras"):
        EngineConfig(model=str(base), device="cpu", enable_lora=True, max_loras=2, max_cpu_loras=1)


def test_the_kv_cache_leaves_room_for_max_loras_adapters(setup):
    _, base, _ = setup
    llm = make_llm(str(base), enable_lora=True, max_loras=3, max_lora_rank=8)
    h, inter, q, kv, layers = 64, 96, 64, 32, 2  # tests/conftest.py's tiny shapes
    per_layer = 8 * (3 * (h + q + 2 * kv) + (q + h) + 2 * (h + 2 * inter) + (inter + h))
    r = llm.engine.runner
    assert lora_footprint(r.config, r.model, r.dtype) == 3 * layers * per_layer * 4  # float32 on the CPU
    r = make_llm(str(base)).engine.runner
    assert lora_footprint(r.config, r.model, r.dtype) == 0


def test_metrics_name_the_running_and_waiting_adapters(setup):
    from nvllm.serve.metrics import ServerMetrics

    _, base, adapters = setup
    llm = make_llm(str(base), enable_lora=True, max_loras=1)
    engine = llm.engine
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request("a", PROMPTS[0], params, lora_request=LoRARequest("all", 1, str(adapters["all"])))
    engine.add_request("b", PROMPTS[0], params, lora_request=LoRARequest("attn", 2, str(adapters["attn"])))
    engine.step()  # one slot: "all" runs, "attn" waits for it
    text = ServerMetrics(engine, "m").render().decode()
    assert 'nvllm:lora_requests_info{max_lora="1",running_lora_adapters="all",waiting_lora_adapters="attn"}' in text


def test_a_failed_runtime_load_releases_only_its_own_name():
    """POST /v1/load_lora_adapter reserves the name, then waits for the engine; if an unload and a new load of the
    same name come meanwhile and the first load then fails, the new adapter keeps its name (it had been dropped:
    served 200, then 404 on every request naming it)."""
    import asyncio
    import concurrent.futures
    from types import SimpleNamespace

    import httpx
    from fastapi import FastAPI

    from nvllm.serve.errors import install_error_handlers
    from nvllm.serve.models import ServedModels, lora_routes

    calls: list[concurrent.futures.Future] = []

    def call(fn):  # the engine's command queue, answered by the test
        calls.append(concurrent.futures.Future())
        return calls[-1]

    engine = SimpleNamespace(engine=SimpleNamespace(config=SimpleNamespace(enable_lora=True)), call=call)
    models = ServedModels("base", "/base", 64)
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(lora_routes(models, engine, 65536))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            failing = asyncio.ensure_future(client.post("/v1/load_lora_adapter",
                                                        json={"lora_name": "late", "lora_path": "/old"}))
            while not calls:
                await asyncio.sleep(0.01)
            assert (await client.post("/v1/unload_lora_adapter", json={"lora_name": "late"})).status_code == 200
            loading = asyncio.ensure_future(client.post("/v1/load_lora_adapter",
                                                        json={"lora_name": "late", "lora_path": "/new"}))
            while len(calls) < 3:
                await asyncio.sleep(0.01)
            calls[2].set_result(None)
            assert (await loading).status_code == 200
            calls[0].set_exception(ValueError("not an adapter"))
            assert (await failing).status_code == 400

    asyncio.run(main())
    assert models.adapters["late"].lora_path == "/new"
