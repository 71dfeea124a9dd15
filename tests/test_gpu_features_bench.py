"""scripts/gpu_features_bench.py end to end on the CPU with a tiny Qwen2-shaped config: every row runs (the LoRA
adapter it writes loads, the JSON constraint holds, beam search returns its beams) and the ratios land in the JSON."""

from __future__ import annotations

import importlib.util
import json

from tests.conftest import REPO
from tests.test_gpu_quantize_bench import TINY


def test_cpu_end_to_end(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_features_bench", REPO / "scripts" / "gpu_features_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**TINY, "torch_dtype": "float32"}))
    res = bench.main(["--config", str(cfg), "--device", "cpu", "--tokens", "6", "--batch", "3", "--lora-rank", "4",
                      "--beam-width", "2", "--out", str(tmp_path / "out")])
    saved = json.loads((tmp_path / "out" / "gpu_features_bench.json").read_text())
    assert saved["ratios"] == res["ratios"] and len(res["ratios"]) == 6
    assert res["beam_search"]["beams"] == 2 and res["batch_json"]["tokens"] == res["batch_json_sync"]["tokens"] > 0
    assert all(v > 0 for v in res["ratios"].values())
    assert res["lora_graphs_tokens_equal_eager"] and res["lora_tokens_differ_from_base"]
