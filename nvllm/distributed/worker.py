"""The loop of a tensor-parallel worker process (ranks 1 … N−1), started by rank 0's WorkerPool.

A worker joins the group, builds its ModelRunner (its shard of the weights, its KV cache, its CUDA graphs —
the same start-up as rank 0's, collective for collective), then runs every step rank 0 broadcasts: the same
forward and the same LM-head calls, never sampling. Before a step, rank 0 may send the LoRA adapters it put in
slots, which the worker puts in the same slots. An empty message ends the loop. Any exception is sent to
rank 0 through the pipe (pickled when it can be, so a ConfigError arrives as a ConfigError) before the process
exits; a worker whose parent dies exits too.

A worker ignores SIGINT and SIGTERM: a terminal's Ctrl-C and a service manager's SIGTERM reach every process of the
group, and rank 0 shuts down gracefully (the requests in flight run to their end, which needs every rank), then
ends its workers itself.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
import threading
import traceback


def _exit_with_parent() -> None:
    """A daemon thread that ends this process as soon as the engine's process is gone."""
    import multiprocessing
    from multiprocessing.connection import wait

    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch():
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="nvllm-tp-parent", daemon=True).start()


def _report(conn, rank: int, error: BaseException) -> None:
    """Send (the exception if it pickles, else None; its formatted traceback) to rank 0."""
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    try:
        payload = pickle.dumps(error)
        pickle.loads(payload)
    except Exception:
        payload = None
    try:
        conn.send((payload, f"[tensor-parallel rank {rank}] {text}"))
        conn.close()
    except Exception:  # rank 0 is gone: nobody to tell
        pass


def worker_main(rank: int, size: int, port: int, config, conn, num_threads: int) -> None:
    """Entry point of worker ``rank``: ``config`` is the engine's, with this rank's device."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _exit_with_parent()
    code = 0
    try:
        import torch
        import torch.distributed as dist

        from nvllm.distributed.group import STORE_TIMEOUT, TPGroup
        from nvllm.engine.model_runner import ModelRunner
        from nvllm.engine.step_inputs import StepInputs
        from nvllm.lora.manager import read_loads_message

        torch.set_num_threads(num_threads)
        logger = logging.getLogger("nvllm")  # rank 0 logs for everyone; a worker only adds its errors
        logger.setLevel(logging.ERROR)
        logger.propagate = False
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"[tensor-parallel rank {rank}] %(message)s"))
        logger.addHandler(handler)
        device = torch.device(config.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store = dist.TCPStore("127.0.0.1", port, size, False, timeout=STORE_TIMEOUT)
        store.set(f"ready/{rank}", "1")
        group = TPGroup.connect(rank, size, store, device)
        runner = ModelRunner(config, tp=group)
        while True:
            message = group.broadcast_message()
            loads = read_loads_message(message)
            if loads is not None:
                for slot, request, digest in loads:
                    runner.lora.put(slot, request, digest)
                continue
            step = StepInputs.unpack(message)
            if step is None:
                break
            runner.run_model(step)
    except BaseException as e:  # noqa: BLE001 - everything goes to rank 0
        _report(conn, rank, e)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # no interpreter teardown: destroying an NCCL communicator that CUDA graphs captured can wait forever
    os._exit(code)
