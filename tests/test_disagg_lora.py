"""Disaggregated serving with LoRA adapters (CPU, real processes): a prefill and a decode worker that name the same
adapter files under one name serve it as one mixed server would — even from other paths; under a name whose files
differ between them, the decode worker refuses the prefill worker's KV (500 handoff_mismatch) and caches none of
it."""

from __future__ import annotations

import datetime
import shutil

import httpx
import torch.distributed as dist

from nvllm.assets import demo_model_path
from tests.lora_utils import make_adapter
from tests.server_utils import spawn
from tests.test_disagg import _stop, _wait_healthy

KEY = "sk-disagg-lora"
AUTH = {"Authorization": f"Bearer {KEY}"}
COMMON = ["--device", "cpu", "--max-model-len", "256", "--log-stats-interval", "0", "--uvicorn-log-level", "warning",
          "--api-key", KEY, "--enable-lora"]
PROMPT = ("Once upon a time there was a little girl named Lily. She loved to play outside in the park with her "
          "friends and her dog")


def test_workers_serve_an_adapter_only_with_the_same_files(tmp_path):
    base = demo_model_path()
    a = make_adapter(base, tmp_path / "a", 1, r=8, lora_alpha=64)
    b = make_adapter(base, tmp_path / "b", 2, r=8, lora_alpha=64)
    a_copy = shutil.copytree(a, tmp_path / "a_copy")
    store = dist.TCPStore("127.0.0.1", 0, None, True, timeout=datetime.timedelta(seconds=120), wait_for_workers=False)
    group = ["--kv-world-size", "2", "--kv-master", f"127.0.0.1:{store.port}", "--kv-store-external"]
    procs, urls, logs = {}, {}, {}
    try:
        for name, rank, modules in (("prefill", 0, f"same={a},differs={a}"),
                                    ("decode", 1, f"same={a_copy},differs={b}")):
            logs[name] = tmp_path / f"{name}.log"
            procs[name], urls[name] = spawn("serve", [*COMMON, "--lora-modules", modules, "--role", name,
                                                      "--kv-rank", str(rank), *group], logs[name])
        _wait_healthy(procs, urls, logs, ["prefill", "decode"])
        logs["router"] = tmp_path / "router.log"
        procs["router"], urls["router"] = spawn("router", ["--prefill", urls["prefill"], "--decode", urls["decode"],
                                                           "--api-key", KEY, "--uvicorn-log-level", "warning"],
                                                logs["router"])
        _wait_healthy(procs, urls, logs, ["router"])

        def ask(url: str, model: str) -> httpx.Response:
            return httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=120,
                              json={"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0})

        routed = ask(urls["router"], "same")
        assert routed.status_code == 200, routed.text
        local = ask(urls["decode"], "same").json()  # the decode worker alone: prompt computed there, with a's copy
        assert routed.json()["choices"][0]["text"] == local["choices"][0]["text"]
        assert local["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the received KV is a's: shared

        refused = ask(urls["router"], "differs")
        assert refused.status_code == 500 and refused.json()["error"]["code"] == "handoff_mismatch", refused.text
        assert "LoRA adapter 'differs'" in refused.json()["error"]["message"]
        assert ask(urls["router"], "same").status_code == 200  # the decode worker stays up for everything else
        local = ask(urls["decode"], "differs").json()
        assert (local["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0
        assert httpx.get(f"{urls['decode']}/health").status_code == 200
    finally:
        _stop(procs)
        del store
