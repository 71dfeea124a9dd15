"""How the GPUs of a 2-GPU machine talk, in one call (issues 10 and 11): the link (nvidia-smi topo, peer access,
the transport NCCL picked), the latency of one small all-reduce — what tensor parallelism runs twice a layer —
through NCCL and through PyTorch's symmetric-memory kernels (one-shot and two-shot, peer-to-peer loads, no
multicast), eager and replayed in a CUDA graph, and the bandwidth of one large point-to-point transfer (what a
disaggregated deployment's KV handoff is).

    python scripts/gpu_allreduce_bench.py [--skip-probe]

Then nvllm's own TPGroup (nvllm.distributed.group) with its one-shot path enabled, against NCCL on the same
random tensors: eager at every size up to the one-shot limit and beyond, and 48 different all-reduces captured in
one CUDA graph and replayed on fresh data (a missing barrier would show as a wrong sum).

Prints a table; writes $OUT/allreduce_bench.json and $OUT/nccl_debug_rank*.txt.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = {"7B b1 (3584)": 3584, "70B b1 (8192)": 8192, "70B b64 (64x8192)": 64 * 8192}
P2P_BYTES = 114 << 20  # one 2000-token sequence of Qwen2.5-7B's bf16 KV cache
GRAPH_OPS = 100


def timed(fn, reps: int) -> float:
    """Mean seconds per call of fn (already warm), measured with CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000 / reps


def in_graph(op, reps: int = 20) -> float:
    """Seconds per op when GRAPH_OPS calls of op are captured in one CUDA graph and replayed."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            op()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(GRAPH_OPS):
            op()
    g.replay()
    torch.cuda.synchronize()
    return timed(g.replay, reps) / GRAPH_OPS


def worker(rank: int, port: int, out: str, q) -> None:
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120), device_id=dev)
    group = dist.group.WORLD
    res: dict = {"rank": rank, "allreduce_us": {}, "errors": []}
    for label, n in SIZES.items():
        x = torch.full((n,), float(rank + 1), dtype=torch.bfloat16, device=dev)
        row = {}
        dist.all_reduce(x)
        torch.cuda.synchronize()
        row["nccl_eager"] = timed(lambda: dist.all_reduce(x), 200) * 1e6
        try:
            row["nccl_graph"] = in_graph(lambda: dist.all_reduce(x)) * 1e6
        except Exception as e:  # noqa: BLE001 - report and go on
            res["errors"].append(f"nccl graph {label}: {e!r}"[:300])
        try:
            import torch.distributed._symmetric_memory as symm_mem

            buf = symm_mem.empty(n, dtype=torch.bfloat16, device=dev)
            symm_mem.rendezvous(buf, group.group_name)
            out_t = torch.empty_like(x)
            src = torch.full((n,), float(rank + 1), dtype=torch.bfloat16, device=dev)

            def one_shot():
                buf.copy_(src)
                torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", group.group_name, out_t)

            def two_shot():
                buf.copy_(src)
                torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", group.group_name)

            for name, op, got in (("symm_one_shot", one_shot, lambda: out_t), ("symm_two_shot", two_shot, lambda: buf)):
                op()
                torch.cuda.synchronize()
                ok = bool((got().float() == 3.0).all())
                row[name + "_correct"] = ok
                row[name + "_eager"] = timed(op, 200) * 1e6
                row[name + "_graph"] = in_graph(op) * 1e6
                torch.cuda.synchronize()
                row[name + "_correct_after_graph"] = bool((got().float() == 3.0).all())
        except Exception as e:  # noqa: BLE001
            res["errors"].append(f"symm_mem {label}: {e!r}"[:300])
        res["allreduce_us"][label] = row
    # one large point-to-point transfer, rank 0 → rank 1 (NCCL send/recv), and a peer copy in one process
    buf = torch.empty(P2P_BYTES, dtype=torch.uint8, device=dev)
    times = []
    for _ in range(6):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
        else:
            dist.recv(buf, 0)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    res["p2p_send_GBps"] = P2P_BYTES / min(times[1:]) / 1e9
    res["p2p_send_first_s"] = times[0]
    dist.barrier()
    if rank == 0:
        other = torch.empty(P2P_BYTES, dtype=torch.uint8, device="cuda:1")
        other.copy_(buf)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            other.copy_(buf)
        torch.cuda.synchronize("cuda:1")
        torch.cuda.synchronize()
        res["peer_copy_GBps"] = 5 * P2P_BYTES / (time.perf_counter() - t0) / 1e9
    dist.barrier()
    dist.destroy_process_group()
    q.put(res)


def tpgroup_check(rank: int, port: int, out: str, q) -> None:
    """TPGroup.all_reduce (one-shot where it takes the tensor) against the compute group's NCCL all-reduce."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from nvllm.distributed.group import TPGroup

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    tp = TPGroup.connect(rank, 2, store, dev)
    tp.enable_one_shot(torch.bfloat16, dev)
    res: dict = {"rank": rank, "one_shot": tp.one_shot is not None, "eager": [], "graph": None}
    gen = torch.Generator(device=dev).manual_seed(1234 + rank)

    def reference(x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        tp.compute.allreduce([y]).wait()
        return y

    for shape in ((1, 3584), (1, 8192), (5, 3584), (64, 8192), (65, 8192), (3, 7), (2048, 3584)):
        x = torch.randn(shape, generator=gen, device=dev).to(torch.bfloat16)
        got = tp.all_reduce(x.clone())
        res["eager"].append({"shape": list(shape), "one_shot": bool(tp.one_shot and tp.one_shot.takes(x)),
                             "equal": bool(torch.equal(got, reference(x)))})
    xs = [torch.empty(1, 8192, dtype=torch.bfloat16, device=dev) for _ in range(48)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for x in xs:
            tp.all_reduce(x.clone())
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):  # on copies: NCCL sums in place
        ys = [tp.all_reduce(x.clone()) for x in xs]
    bad = 0
    for _ in range(5):
        for x in xs:
            x.copy_(torch.randn(x.shape, generator=gen, device=dev))
        g.replay()
        torch.cuda.synchronize()
        bad += sum(not torch.equal(y, reference(x)) for x, y in zip(xs, ys))
    res["graph"] = {"all_reduces": len(xs) * 5, "wrong": int(bad)}
    tp.close()
    q.put(res)


def main() -> int:
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)
    if torch.cuda.device_count() < 2:
        print("needs 2 GPUs")
        return 2
    res: dict = {"date": time.strftime("%Y-%m-%d"), "card": torch.cuda.get_device_name(),
                 "commit": os.environ.get("NVLLM_COMMIT", "unknown"), "command": " ".join(sys.argv),
                 "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                        "NVSHMEM_DISABLE_NVLS")}}
    try:
        res["topo"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
    except Exception as e:  # noqa: BLE001
        res["topo"] = repr(e)
    print(res["topo"], flush=True)
    res["can_access_peer"] = torch.cuda.can_device_access_peer(0, 1)
    print("peer access 0 -> 1:", res["can_access_peer"], flush=True)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29600 + os.getpid() % 1000

    def run_pair(target, port: int, timeout: float) -> list[dict]:
        procs = [ctx.Process(target=target, args=(r, port, str(out), q)) for r in range(2)]
        for p in procs:
            p.start()
        got = []
        for _ in procs:
            try:
                got.append(q.get(timeout=timeout))
            except Exception:  # noqa: BLE001
                break
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
        return sorted(got, key=lambda r: r["rank"])

    if "--skip-probe" not in sys.argv:
        os.environ["NCCL_DEBUG"], os.environ["NCCL_DEBUG_FILE"] = "INFO", str(out / "nccl_debug_rank%r.txt")
        res["ranks"] = run_pair(worker, port, 240)
        del os.environ["NCCL_DEBUG"], os.environ["NCCL_DEBUG_FILE"]
        via = set()
        for f in out.glob("nccl_debug_rank*.txt"):
            via |= {ln.split("via", 1)[1].strip() for ln in f.read_text(errors="replace").splitlines() if " via " in ln}
        res["nccl_transports"] = sorted(via)
        print("NCCL transports:", res["nccl_transports"])
        if res["ranks"]:
            r0 = res["ranks"][0]
            print(f"{'size':22s} " + " ".join(f"{k:>22s}" for k in next(iter(r0['allreduce_us'].values()))))
            for label, row in r0["allreduce_us"].items():
                print(f"{label:22s} " + " ".join(f"{v:>22.2f}" if isinstance(v, float) else f"{v!s:>22s}"
                                                 for v in row.values()))
            print(f"NCCL send/recv {P2P_BYTES >> 20} MiB: {r0['p2p_send_GBps']:.1f} GB/s "
                  f"(first {r0['p2p_send_first_s']:.3f} s); peer copy {r0.get('peer_copy_GBps', 0):.1f} GB/s")
            for r in res["ranks"]:
                for e in r["errors"]:
                    print(f"rank {r['rank']}: {e}")
        else:
            print("no rank reported")
    checks = res["tpgroup_check"] = run_pair(tpgroup_check, port + 1, 120)
    (out / "allreduce_bench.json").write_text(json.dumps(res, indent=1))
    ok = len(checks) == 2
    for c in checks:
        print(f"TPGroup rank {c['rank']}: one-shot {c['one_shot']}; eager equal to NCCL: "
              + ", ".join(f"{tuple(e['shape'])}{'*' if e['one_shot'] else ''} {e['equal']}" for e in c["eager"])
              + f"; in a graph {c['graph']['wrong']} wrong of {c['graph']['all_reduces']}")
        ok = ok and c["one_shot"] and all(e["equal"] for e in c["eager"]) and c["graph"]["wrong"] == 0
    print("TPGroup check:", "ok" if ok else "FAILED")
    (out / "allreduce_bench.json").write_text(json.dumps(res, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
