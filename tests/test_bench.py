"""nvllm bench: metric arithmetic on hand-built timelines, arrival statistics, datasets, the offline modes on the
demo model, and compare (the serve mode: test_bench_serve)."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
from typer.testing import CliRunner

from nvllm.bench import arrivals, datasets, metrics
from nvllm.bench.metrics import RequestResult
from nvllm.bench.report import save_result
from nvllm.cli import app
from tests.conftest import SHARED_DATA

runner = CliRunner()


def said(res) -> str:
    """The command's output with Rich's line wrapping undone."""
    return " ".join(res.output.split())


# ---- metric arithmetic -------------------------------------------------------------------------------
def _timeline() -> list[RequestResult]:
    return [
        RequestResult(10, True, 4, ttft=0.1, itl=[0.02, 0.03, 0.05], latency=0.2, start_time=0.0, generated_text="a"),
        RequestResult(20, True, 2, ttft=0.3, itl=[0.1], latency=0.4, start_time=0.1),
        RequestResult(5, False, error="HTTP 500: boom", start_time=0.2),
        RequestResult(8, True, 1, ttft=0.05, itl=[], latency=0.05, start_time=0.3),
    ]


def test_metrics_on_a_hand_built_timeline():
    r = metrics.calculate_metrics(_timeline(), 2.0, [50, 99], {"ttft": 120, "tpot": 50})
    assert (r["completed"], r["failed"]) == (3, 1)
    assert r["total_input_tokens"] == 38 and r["total_output_tokens"] == 7  # failed requests count no tokens
    assert r["request_throughput"] == pytest.approx(1.5)
    assert r["output_throughput"] == pytest.approx(3.5)
    assert r["total_token_throughput"] == pytest.approx(22.5)
    assert r["request_goodput"] == pytest.approx(1.0)  # req 1 and the 1-token req 4 (TPOT 0) meet both SLOs
    assert r["mean_ttft_ms"] == pytest.approx(150.0)
    assert r["median_ttft_ms"] == pytest.approx(100.0)
    assert r["std_ttft_ms"] == pytest.approx(math.sqrt((50**2 + 150**2 + 100**2) / 3))
    assert r["p99_ttft_ms"] == pytest.approx(100 + 0.98 * 200)  # linear interpolation over [50, 100, 300]
    # TPOT = (E2EL - TTFT) / (out - 1): req 1 (0.2-0.1)/3, req 2 (0.4-0.3)/1; req 4 has one token: excluded
    assert r["mean_tpot_ms"] == pytest.approx((100 / 3 + 100) / 2)
    assert r["mean_itl_ms"] == pytest.approx(50.0) and r["median_itl_ms"] == pytest.approx(40.0)
    assert r["p50_e2el_ms"] == pytest.approx(200.0) and r["mean_e2el_ms"] == pytest.approx(650 / 3)
    # vLLM's bucket count: the three successful requests all fall in second 0, though at most two overlap
    assert r["max_concurrent_requests"] == 3 and r["max_output_tokens_per_s"] == 7.0
    assert r["output_lens"] == [4, 2, 0, 1] and r["input_lens"] == [10, 20, 5, 8]
    assert r["ttfts"][2] is None and r["errors"][2] == "HTTP 500: boom"


def test_metrics_report_none_where_nothing_was_measured():
    r = metrics.calculate_metrics([RequestResult(5, False, error="x")], 1.0, [99])
    assert r["completed"] == 0 and r["request_goodput"] is None
    assert all(r[k] is None for k in ("mean_ttft_ms", "p99_tpot_ms", "median_itl_ms", "std_e2el_ms"))
    one = metrics.calculate_metrics([RequestResult(5, True, 1, ttft=0.1, latency=0.1)], 1.0, [99])
    assert one["mean_ttft_ms"] == pytest.approx(100.0) and one["mean_tpot_ms"] is None and one["mean_itl_ms"] is None


def test_parsers():
    assert metrics.parse_goodput(["ttft:200", "tpot:20"]) == {"ttft": 200.0, "tpot": 20.0}
    assert metrics.parse_goodput(["ttft:200,e2el:1000"]) == {"ttft": 200.0, "e2el": 1000.0}
    for bad in (["ttft"], ["foo:1"], ["ttft:x"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            metrics.parse_goodput(bad)
    for bad in ("ttft:nan", "ttft:inf", "e2el:1e999", "tpot:-inf", "ttft:0"):  # no SLO; nan/inf made runs unsavable
        with pytest.raises(ValueError, match=f"goodput SLO '{bad}' must be a positive finite number"):
            metrics.parse_goodput([bad])
    assert metrics.parse_percentiles("50,90,99.9") == [50.0, 90.0, 99.9]
    assert metrics.percentile_key(99.9) == "p99.9" and metrics.percentile_key(99.0) == "p99"
    with pytest.raises(ValueError):
        metrics.parse_percentiles("50,101")


# ---- arrivals ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("burstiness", [1.0, 0.5])
def test_arrival_statistics(burstiness):
    n, rate = 20000, 8.0
    gaps = arrivals.arrival_gaps(n, rate, burstiness, seed=1)
    assert n / gaps.sum() == pytest.approx(rate, rel=0.03)  # sd of the mean rate ≈ 1/sqrt(n·burstiness)
    cv = gaps.std() / gaps.mean()
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.05)  # Poisson: 1; burstiness 0.5: 1.41
    offsets = arrivals.arrival_offsets(n, rate, burstiness, seed=1)
    assert offsets[-1] == pytest.approx(n / rate) and np.all(np.diff(offsets) >= 0)
    assert np.array_equal(offsets, arrivals.arrival_offsets(n, rate, burstiness, seed=1))
    assert not np.array_equal(offsets, arrivals.arrival_offsets(n, rate, burstiness, seed=2))


def test_arrival_edge_cases():
    assert np.all(arrivals.arrival_offsets(5, float("inf")) == 0)
    assert np.allclose(arrivals.arrival_gaps(4, 2.0, float("inf")), 0.5)
    for kw in ({"request_rate": 0.0}, {"request_rate": 1.0, "burstiness": 0.0}):
        with pytest.raises(ValueError):
            arrivals.arrival_gaps(3, **kw)


# ---- datasets ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok(demo_dir):
    from nvllm.engine.llm_engine import load_tokenizer

    return load_tokenizer(demo_dir)


def test_random_dataset_lengths_and_seed(tok):
    reqs = datasets.load_requests("random", tok, 50, input_len=40, output_len=10, range_ratio=0.5, seed=3)
    assert all(10 <= r.prompt_len <= 62 and 5 <= r.expected_output_len <= 15 for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 5
    assert all(r.prompt_len == len(tok.encode(r.prompt)) == len(r.prompt_token_ids) for r in reqs)
    fixed = datasets.load_requests("random", tok, 20, input_len=40, output_len=10, seed=3)
    assert sum(r.prompt_len == 40 for r in fixed) >= 18  # text round trips keep the length (nearly always)
    again = datasets.load_requests("random", tok, 50, input_len=40, output_len=10, range_ratio=0.5, seed=3)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]
    with pytest.raises(datasets.DatasetError):
        datasets.load_requests("random", tok, 5, range_ratio=1.0)
    with pytest.raises(datasets.DatasetError, match="--input-len 0 leaves no room"):  # not the default 128
        datasets.load_requests("random", tok, 5, input_len=0)


def test_file_datasets(tok, tmp_path):
    share = tmp_path / "share.json"
    share.write_text(json.dumps([{"id": str(i), "conversations": [
        {"from": "human", "value": f"Tell me a story about the number {i} and a dog."},
        {"from": "gpt", "value": "Once upon a time there was a dog. " * (i + 1)}]} for i in range(8)]))
    reqs = datasets.load_requests("sharegpt", tok, 4, str(share), seed=0)
    assert len(reqs) == 4 and all(r.expected_output_len >= 8 for r in reqs)  # output lengths from the replies
    # counted as vLLM counts them (special tokens included); a conversation without a reply is skipped, as vLLM does
    for r in reqs:
        i = int(r.prompt.split("number ")[1].split()[0])
        assert r.expected_output_len == len(tok.encode("Once upon a time there was a dog. " * (i + 1)))
    mixed = tmp_path / "mixed.json"
    mixed.write_text(json.dumps([{"conversations": [{"from": "human", "value": "Hello there, how are you?"}]},
                                 {"conversations": [{"from": "human", "value": "And you, friend?"},
                                                    {"from": "gpt", "value": ""}]}] + json.loads(share.read_text())))
    assert len(datasets.load_requests("sharegpt", tok, 9, str(mixed), seed=0)) == 9  # the 8 with replies, repeated
    no_reply = tmp_path / "prompts_only.json"
    no_reply.write_text(json.dumps([{"conversations": [{"from": "human", "value": "Hello there, how are you?"}]}]))
    with pytest.raises(datasets.DatasetError, match="without a reply .*--output-len"):
        datasets.load_requests("sharegpt", tok, 1, str(no_reply))
    assert datasets.load_requests("sharegpt", tok, 3, str(no_reply), output_len=7)[2].expected_output_len == 7
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": oops}\n')
    with pytest.raises(datasets.DatasetError, match=r"bad.jsonl:2: not valid JSON"):
        datasets.load_requests("jsonl", tok, 1, str(bad), output_len=4)
    (tmp_path / "broken.json").write_text("[{")
    with pytest.raises(datasets.DatasetError, match="not valid JSON"):
        datasets.load_requests("sharegpt", tok, 1, str(tmp_path / "broken.json"))
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text("\n".join(json.dumps({"question": f"What is {i} + {i}?", "answer": f"{i}+{i}={2*i}\n#### {2*i}"})
                             for i in range(5)))
    g = datasets.load_requests("gsm8k", tok, 3, str(gsm), seed=1)
    assert g[0].messages[0]["role"] == "user" and "What is" in g[0].messages[0]["content"]
    assert g[0].prompt.endswith("Assistant:") and g[0].prompt_len == len(tok.encode(g[0].prompt))


def test_prompts_over_max_model_len_are_skipped_while_sampling(tok, tmp_path, caplog):
    """As vLLM's samplers: a prompt whose prompt + output tokens exceed the engine's limit is skipped while sampling
    and the count filled from those that fit, so that exactly --num-prompts requests run (they were dropped after the
    count was filled: 6 asked, 4 ran)."""
    lines = tmp_path / "c.jsonl"
    lines.write_text("\n".join([json.dumps({"prompt": "Once upon a time there was a cat", "output_len": 5}),
                                json.dumps({"prompt": "once upon a time " * 40, "output_len": 5}),
                                json.dumps("Lily went to the park")]))
    reqs = datasets.load_requests("jsonl", tok, 6, str(lines), output_len=5, max_model_len=64)
    assert len(reqs) == 6 and all(r.prompt_len + r.expected_output_len <= 64 for r in reqs)
    assert {r.prompt for r in reqs} == {"Once upon a time there was a cat", "Lily went to the park"}
    assert "2 usable prompts within max_model_len 64; repeating them to reach 6" in caplog.text
    assert len(datasets.load_requests("jsonl", tok, 2, str(lines), output_len=5)) == 2  # no limit: file order
    with pytest.raises(datasets.DatasetError, match=r"no prompt of .*c.jsonl fits max_model_len 8 with its output "
                                                    r"\(3 longer"):
        datasets.load_requests("jsonl", tok, 2, str(lines), output_len=5, max_model_len=8)
    with pytest.raises(datasets.DatasetError, match="--input-len \\+ --output-len = 60 \\(up to 75 \\+ 15 with "
                                                    "--random-range-ratio 0.5\\) exceeds max_model_len 50"):
        datasets.load_requests("random", tok, 4, input_len=50, output_len=10, range_ratio=0.5, max_model_len=50)
    assert len(datasets.load_requests("random", tok, 4, input_len=30, output_len=10, range_ratio=0.5,
                                      max_model_len=61)) == 4


def test_offline_throughput_runs_num_prompts_requests(tmp_path):
    lines = tmp_path / "c.jsonl"
    lines.write_text("\n".join([json.dumps({"prompt": "Once upon a time there was a cat", "output_len": 5}),
                                json.dumps({"prompt": "once upon a time " * 200, "output_len": 5}),
                                json.dumps("Lily went to the park")]))
    out = tmp_path / "tp.json"
    res = runner.invoke(app, ["bench", "throughput", "--dataset", "jsonl", "--dataset-path", str(lines),
                              "--num-prompts", "6", "--output-len", "4", "--save-result", str(out), *OFFLINE])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert (r["num_requests"], r["total_output_tokens"], r["num_prompts"]) == (6, 24, 6)
    res = runner.invoke(app, ["bench", "throughput", "--num-prompts", "2", "--input-len", "600", "--output-len", "8",
                              *OFFLINE])  # refused before the engine loads
    assert res.exit_code == 2 and said(res) == "error: --input-len + --output-len = 608 exceeds max_model_len 512"


@pytest.mark.skipif(SHARED_DATA is None, reason="shared data not present")
def test_shared_sharegpt_file(tok):
    reqs = datasets.load_requests("sharegpt", tok, 20, str(SHARED_DATA / "sharegpt/ShareGPT_V3_filtered_500.json"),
                                  output_len=32, seed=0)
    assert len(reqs) == 20 and all(4 <= r.prompt_len <= 1024 for r in reqs)


# ---- offline ---------------------------------------------------------------------------------------------
OFFLINE = ["--device", "cpu", "--log-stats-interval", "0", "--no-progress"]


def test_offline_throughput(tmp_path):
    out = tmp_path / "tp.json"
    res = runner.invoke(app, ["bench", "throughput", "--num-prompts", "4", "--input-len", "16", "--output-len", "8",
                              "--save-result", str(out), *OFFLINE])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    for k in ("elapsed_time", "num_requests", "total_num_tokens", "requests_per_second", "tokens_per_second",
              "output_tokens_per_second", "total_input_tokens", "total_output_tokens", "kernel_report"):
        assert k in r, k
    assert r["num_requests"] == 4 and r["total_output_tokens"] == 32 and r["total_input_tokens"] == 64
    assert r["tokens_per_second"] == pytest.approx(96 / r["elapsed_time"])
    assert "gemm" in r["kernel_report"] and "Output token throughput" in said(res)
    bad = tmp_path / "bad.json"
    bad.write_text("[{")
    res = runner.invoke(app, ["bench", "throughput", "--dataset", "sharegpt", "--dataset-path", str(bad), *OFFLINE])
    assert res.exit_code == 2 and "bad.json: not valid JSON" in said(res)


def test_offline_latency(tmp_path):
    out = tmp_path / "lat.json"
    res = runner.invoke(app, ["bench", "latency", "--batch-size", "2", "--input-len", "8", "--output-len", "4",
                              "--num-iters-warmup", "1", "--num-iters", "2", "--metric-percentiles", "50,99",
                              "--save-result", str(out), *OFFLINE])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert len(r["latencies"]) == 2 and r["avg_latency"] == pytest.approx(sum(r["latencies"]) / 2)
    assert set(r["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    for k in ("mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p50_ttft_ms", "p99_ttft_ms",
              "mean_tpot_ms", "p99_tpot_ms"):
        assert isinstance(r[k], float) and r[k] > 0, k
    assert r["kernel_report"]["gemm"]
    assert r["temperature"] == 1.0
    bad = runner.invoke(app, ["bench", "latency", "--input-len", "500", "--output-len", "100", *OFFLINE])
    assert bad.exit_code == 2 and "max_model_len" in said(bad)
    bad = runner.invoke(app, ["bench", "latency", "--temperature", "-1", *OFFLINE])
    assert bad.exit_code == 2 and "--temperature must be a finite number of at least 0" in said(bad)
    for path, message in ((tmp_path, "is a directory: name a file to write"),  # refused before the engine starts
                          (out / "x.json", f"{out} is not a writable directory")):
        bad = runner.invoke(app, ["bench", "latency", "--save-result", str(path), *OFFLINE])
        assert bad.exit_code == 2 and message in said(bad) and len(bad.output.strip().splitlines()) == 1
    res = runner.invoke(app, ["bench", "latency", "--batch-size", "1", "--input-len", "8", "--output-len", "4",
                              "--num-iters-warmup", "0", "--num-iters", "1", "--temperature", "0",
                              "--save-result", str(out), *OFFLINE])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["temperature"] == 0.0


def test_a_result_with_non_finite_numbers_is_saved(tmp_path):
    """A finished run is never lost to a number JSON cannot hold: inf and NaN are written as their text, as
    request_rate's inf always was ("Out of range float values are not JSON compliant" came after the whole run)."""
    path = tmp_path / "r.json"
    save_result({"mode": "serve", "request_rate": float("inf"), "goodput_slos_ms": {"ttft": float("nan")},
                 "ttfts": [0.1, float("-inf")], "duration": 1.5}, str(path))
    data = json.loads(path.read_text())
    assert data == {"mode": "serve", "request_rate": "inf", "goodput_slos_ms": {"ttft": "nan"},
                    "ttfts": [0.1, "-inf"], "duration": 1.5}


def test_offline_results_record_the_lengths_and_seed_they_ran_with(tmp_path):
    """input_len/output_len were null where the defaults were used, and seed / random_range_ratio missing: a saved
    run could not be reproduced from its JSON."""
    out = tmp_path / "tp.json"
    res = runner.invoke(app, ["bench", "throughput", "--num-prompts", "2", "--output-len", "2", "--seed", "3",
                              "--random-range-ratio", "0.25", "--save-result", str(out), *OFFLINE])
    assert res.exit_code == 0, res.output
    r = json.loads(out.read_text())
    assert (r["input_len"], r["output_len"], r["random_range_ratio"], r["seed"], r["num_prompts"]) == \
        (128, 2, 0.25, 3, 2)
    res = runner.invoke(app, ["bench", "latency", "--batch-size", "1", "--input-len", "8", "--output-len", "2",
                              "--num-iters-warmup", "0", "--num-iters", "1", "--seed", "5", "--save-result", str(out),
                              *OFFLINE])
    assert res.exit_code == 0, res.output
    assert json.loads(out.read_text())["seed"] == 5


def test_compare_shows_per_iteration_latencies_in_ms(tmp_path):
    """A latency result's avg_latency and percentiles are seconds: 0.0118 s printed as 0.01."""
    a = {"mode": "latency", "avg_latency": 0.011798, "percentiles": {"50": 0.011811}, "mean_ttft_ms": 3.06}
    b = {"mode": "latency", "avg_latency": 0.021566, "percentiles": {"50": 0.021586}, "mean_ttft_ms": 3.08}
    save_result(a, str(tmp_path / "a.json"))
    save_result(b, str(tmp_path / "b.json"))
    res = runner.invoke(app, ["bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")],
                        env={"COLUMNS": "160"})
    assert res.exit_code == 0, res.output
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:5]]
            for line in res.stdout.splitlines() if line.count("│") == 5}
    assert rows["avg_latency (ms)"] == ["11.80", "21.57", "1.828×"]
    assert rows["percentiles.50 (ms)"] == ["11.81", "21.59", "1.828×"] and rows["mean_ttft_ms"][:2] == ["3.06", "3.08"]


# ---- compare ---------------------------------------------------------------------------------------------
def test_compare(tmp_path):
    a = {"mode": "serve", "request_throughput": 2.0, "mean_ttft_ms": 100.0, "p99_ttft_ms": None,
         "ttfts": [0.1], "kernel_report": {"gemm": {"torch": 10}}}
    b = {"mode": "serve", "request_throughput": 3.0, "mean_ttft_ms": 50.0, "p99_ttft_ms": 80.0,
         "kernel_report": {"gemm": {"torch": 4}, "quant_gemm": {"triton w4a16": 6}}}
    save_result(a, str(tmp_path / "a.json"))
    save_result(b, str(tmp_path / "b.json"))
    umask = os.umask(0o022)
    try:  # written atomically, yet with the mode a plain open() gives, not the temporary file's 0600
        save_result(a, str(tmp_path / "shared.json"))
    finally:
        os.umask(umask)
    assert (tmp_path / "shared.json").stat().st_mode & 0o777 == 0o644
    res = runner.invoke(app, ["bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")],
                        env={"COLUMNS": "160"})
    assert res.exit_code == 0, res.output
    assert "1.500×" in said(res) and "0.500×" in said(res) and "triton w4a16" in said(res)
    assert "1.500×" in res.stdout   # the table is the command's result: stdout, for a pipe or a file
    assert "ttfts" not in said(res)  # lists are not compared
    missing = runner.invoke(app, ["bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "nope.json")])
    assert missing.exit_code == 2 and "does not exist" in said(missing)
    (tmp_path / "other.json").write_text("{}")
    other = runner.invoke(app, ["bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "other.json")])
    assert other.exit_code == 2 and "other.json is not a benchmark result" in said(other)
    folder = runner.invoke(app, ["bench", "compare", str(tmp_path), str(tmp_path / "b.json")])
    assert folder.exit_code == 2 and f"result file {tmp_path} is a directory" in said(folder)


def test_an_unreadable_file_is_one_line_naming_it(tmp_path, monkeypatch):
    """A result file the user may not read (its mode, as a non-root user meets it; root reads any, so the read is
    refused here by hand): one line naming it, not a PermissionError traceback."""
    import pathlib

    (tmp_path / "a.json").write_text("{}")
    real = pathlib.Path.read_text

    def refuse(self, *args, **kwargs):
        if self.name == "a.json":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "read_text", refuse)
    res = runner.invoke(app, ["bench", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert res.exit_code == 2 and f"error: {tmp_path / 'a.json'}: Permission denied" in said(res), res.output
