"""Host time of each line of DecodeGraphs.run as it was in run AK (torch ops on the pinned staging tensors), on the
GPU with the demo model's graphs and the GPU idle before each call, then DecodeGraphs.run as it is now (its writes
go through numpy views since; not yet timed on the GPU).

    python scripts/gpu_graph_staging_probe.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from nvllm import LLM  # noqa: E402
from nvllm.assets import demo_model_path  # noqa: E402
from nvllm.kernels import report  # noqa: E402


def main() -> None:
    g = LLM(model=demo_model_path(), log_stats_interval=0).engine.runner.graphs
    b = bs = 1
    ids, pos, slots, tables, ctx = [0], [200], [-1], [list(range(16))], [201]  # slot -1: stores nowhere

    def lines() -> list[float]:
        t = [time.perf_counter()]
        g.copied.synchronize(); t.append(time.perf_counter())
        x = torch.tensor([ids, pos, slots]); t.append(time.perf_counter())
        g.host_meta[:3, :b] = x; t.append(time.perf_counter())   # row 3, the LoRA slots, stays -1
        g.host_meta[:2, b:bs] = 0; g.host_meta[2, b:bs] = -1; t.append(time.perf_counter())
        g.host_ctx[:b] = torch.tensor(ctx, dtype=torch.int32); g.host_ctx[b:bs] = 0; t.append(time.perf_counter())
        g.host_tables[:b, :16] = torch.tensor(tables, dtype=torch.int32); t.append(time.perf_counter())
        g.meta.copy_(g.host_meta, non_blocking=True); t.append(time.perf_counter())
        g.context_lens.copy_(g.host_ctx, non_blocking=True); t.append(time.perf_counter())
        g.block_tables[:b].copy_(g.host_tables[:b], non_blocking=True); t.append(time.perf_counter())
        g.copied.record(); t.append(time.perf_counter())
        g.graphs[bs].replay(); t.append(time.perf_counter())
        report.record("decode step", "probe"); report.replay(g.recorded[bs]); t.append(time.perf_counter())
        return [y - x for x, y in zip(t, t[1:])]

    names = ["copied.synchronize", "torch.tensor(meta)", "host_meta[:, :b] =", "padding rows", "context lengths",
             "block tables", "copy meta", "copy context lengths", "copy block tables", "event record", "replay",
             "kernel report"]
    total, n = [0.0] * len(names), 300
    for i in range(n + 20):
        torch.cuda.synchronize()
        r = lines()
        if i >= 20:
            total = [a + x for a, x in zip(total, r)]
    for name, a in zip(names, total):
        print(f"{name:22s} {a / n * 1e6:8.1f} us")
    whole = []
    for _ in range(200):
        torch.cuda.synchronize()
        t = time.perf_counter()
        g.run(ids, pos, slots, tables, ctx)
        whole.append(time.perf_counter() - t)
    print(f"DecodeGraphs.run median {sorted(whole)[100] * 1e6:.1f} us")


if __name__ == "__main__":
    main()
