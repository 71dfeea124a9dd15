"""`nvllm serve --disaggregate xPyD`: x prefill and y decode workers and the router, in one command.

Each worker is an `nvllm serve --role prefill|decode` subprocess with the same engine options (the prefill
workers' batch from --prefill-max-num-seqs), all in one KV transfer group (prefill workers take ranks 0..x-1,
decode workers x..x+y-1). This process binds each worker's HTTP socket on a free local port and hands it over
(`--fd`), and serves the group's store itself (`--kv-store-external`): no port is chosen here and bound later
elsewhere, so no other process can take one in between. With CUDA each worker gets its own GPU
(CUDA_VISIBLE_DEVICES), so x + y GPUs are needed; on the CPU they all run on the CPU. The router runs in this
process on --host/--port. Its log lines and the workers' (prefixed with their name) share this terminal.
SIGINT/SIGTERM stop the router, then the workers; when every worker of one role has exited, the deployment
cannot serve and stops with exit status 1.
"""

from __future__ import annotations

import ctypes
import datetime
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import typing

import torch

from nvllm.cli_options import ENGINE_OPTIONS
from nvllm.config import ConfigError, EngineConfig, first_line
from nvllm.disagg.config import DisaggConfig, parse_xpyd
from nvllm.disagg.router_app import run_router
from nvllm.disagg.router_config import RouterConfig
from nvllm.distributed.group import local_store
from nvllm.serve.api_server import ServerConfig
from nvllm.serve.sockets import bind_socket, listen_socket

logger = logging.getLogger("nvllm")


def engine_cli_args(config: EngineConfig, **overrides) -> list[str]:
    """The `nvllm serve` engine flags that rebuild this config (defaults left out)."""
    args: list[str] = []
    for name, (default, annotation) in ENGINE_OPTIONS.items():
        value = overrides.get(name, getattr(config, name))
        if name == "tokenizer" and value == config.model:
            continue
        if value is None or value == default or value == {}:
            continue
        info = typing.get_args(annotation)[1]
        decl = info.default if isinstance(info.default, str) and info.default.startswith("--") else None
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            on, _, off = (decl or f"{flag}/--no-{flag[2:]}").partition("/")
            args.append(on if value else off)
        elif isinstance(value, (str, int, float)):
            args += [(decl or flag).split("/")[0], str(value)]
        elif isinstance(value, dict):  # --hf-overrides: its JSON text
            args += [flag, json.dumps(value)]
        else:
            raise ConfigError(f"--{name.replace('_', '-')} cannot be passed on to disaggregated workers")
    return args


def _gpus(config: EngineConfig, n: int) -> list[str] | None:
    """The CUDA_VISIBLE_DEVICES entry of each worker (None: on the CPU)."""
    if not config.device.startswith("cuda"):
        return None
    if config.device != "cuda":
        raise ConfigError("--disaggregate places one worker per GPU: give --device cuda (or auto), not "
                          f"{config.device}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else \
        [str(i) for i in range(torch.cuda.device_count())]
    if len(ids) < n:
        raise ConfigError(f"--disaggregate needs one GPU per worker: {n} workers, {len(ids)} GPU(s) visible")
    return ids[:n]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class _Worker:
    def __init__(self, name: str, role: str, cmd: list[str], env: dict, fd: int):
        """``fd``: the worker's bound HTTP socket, inherited under the same number (its ``--fd``)."""
        self.name, self.role = name, role
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     bufsize=1, start_new_session=True, preexec_fn=_die_with_parent,
                                     pass_fds=(fd,))
        self._pump = threading.Thread(target=self._lines, name=f"nvllm-{name}-log", daemon=True)
        self._pump.start()

    def _lines(self) -> None:
        for line in self.proc.stdout:
            sys.stderr.write(f"[{self.name}] {line}")
        sys.stderr.flush()

    def stop(self, timeout: float) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("%s did not stop within %.0f s; killing it", self.name, timeout)
            self.proc.kill()
            self.proc.wait()
        self._pump.join(5)


def launch(engine_config: EngineConfig, server: ServerConfig, disagg: DisaggConfig) -> int:
    """Run the deployment until SIGINT/SIGTERM (0) or until one side has no worker left (1)."""
    from nvllm.logger import setup_logging

    setup_logging()
    num_prefill, num_decode = parse_xpyd(disagg.disaggregate)
    if engine_config.speculative is not None:
        raise ConfigError("speculative decoding is not supported with --disaggregate")
    if engine_config.tensor_parallel_size > 1:
        raise ConfigError("--disaggregate runs every worker on one GPU (tensor_parallel_size 1)")
    n = num_prefill + num_decode
    gpus = _gpus(engine_config, n)
    sock = listen_socket(server.host, server.port, server.fd)  # the router's: a taken port fails before anything starts
    try:
        # the group's store, served by this process (a local, alive until the workers have stopped)
        store = local_store(None, datetime.timedelta(seconds=900))
    except Exception as e:  # noqa: BLE001 - one line, whatever the store raised
        sock.close()
        raise ConfigError(f"cannot start the KV transfer group's store: {first_line(e)[:200]}") from None
    master = f"127.0.0.1:{store.port}"
    serve_args = []
    for name in server.served_model_name or []:
        serve_args += ["--served-model-name", name]
    for key in ("chat_template", "tool_call_parser", "chat_template_content_format"):
        if getattr(server, key):
            serve_args += [f"--{key.replace('_', '-')}", str(getattr(server, key))]
    if server.enable_auto_tool_choice:
        serve_args.append("--enable-auto-tool-choice")
    if server.return_tokens_as_token_ids:
        serve_args.append("--return-tokens-as-token-ids")
    for adapter in server.lora_modules:
        serve_args += ["--lora-modules", f"{adapter.lora_name}={adapter.lora_path}"]
    # the workers answer the router alone: no CORS headers for browsers (CORS and TLS are the router's)
    serve_args += ["--allowed-origins", "[]", "--max-request-bytes", str(server.max_request_bytes),
                   "--shutdown-timeout", str(server.shutdown_timeout), "--uvicorn-log-level", server.log_level,
                   "--kv-world-size", str(n), "--kv-master", master, "--kv-store-external",
                   "--kv-backend", disagg.kv_backend,
                   "--kv-handle-timeout", str(disagg.kv_handle_timeout),
                   "--kv-transfer-timeout", str(disagg.kv_transfer_timeout)]
    env = {**os.environ, "COLUMNS": os.environ.get("COLUMNS", "200"), "PYTHONUNBUFFERED": "1"}
    if server.api_key:
        env["NVLLM_API_KEY"] = server.api_key
    workers, urls = [], {"prefill": [], "decode": []}
    failed, stopping = threading.Event(), threading.Event()
    watch = threading.Thread(target=_watch, args=(workers, failed, stopping), name="nvllm-worker-watch", daemon=True)
    try:
        for rank in range(n):
            role = "prefill" if rank < num_prefill else "decode"
            overrides = {"device": "cuda" if gpus else "cpu"}
            if role == "prefill" and disagg.prefill_max_num_seqs is not None:
                overrides["max_num_seqs"] = disagg.prefill_max_num_seqs
            wsock = bind_socket("127.0.0.1", 0)
            port = wsock.getsockname()[1]
            cmd = [sys.executable, "-m", "nvllm.cli", "serve", "--fd", str(wsock.fileno()), "--role", role,
                   "--kv-rank", str(rank), *serve_args, *engine_cli_args(engine_config, **overrides)]
            if role == "prefill" and disagg.max_prefill_length is not None:
                cmd += ["--max-prefill-length", str(disagg.max_prefill_length)]
            worker_env = dict(env, **({"CUDA_VISIBLE_DEVICES": gpus[rank]} if gpus else {}))
            name = f"{role}-{len(urls[role])}"
            logger.info("starting %s on %s, port %d: %s", name, f"GPU {gpus[rank]}" if gpus else "the CPU", port,
                        " ".join(cmd[2:]))
            try:
                workers.append(_Worker(name, role, cmd, worker_env, wsock.fileno()))
            finally:
                wsock.close()  # the worker holds its own copy
            urls[role].append(f"http://127.0.0.1:{port}")
        watch.start()
        # once the router's shutdown begins, a worker that exits is no failure of the deployment; once its grace has
        # passed, the workers abort what they still run
        run_router(RouterConfig(prefill=urls["prefill"], decode=urls["decode"], host=server.host, port=server.port,
                                api_key=server.api_key, max_request_bytes=server.max_request_bytes,
                                log_level=server.log_level, log_interval=engine_config.log_stats_interval,
                                shutdown_timeout=server.shutdown_timeout, http=server.http), sock,
                   on_grace=lambda: _abort_all(workers), on_shutdown=stopping.set)
        return 1 if failed.is_set() else 0
    finally:
        stopping.set()
        if watch.is_alive():
            watch.join()
        sock.close()
        for w in workers:
            w.stop(server.shutdown_timeout + 15)


def _abort_all(workers: list[_Worker]) -> None:
    """The router's shutdown grace is over: SIGUSR1 to every worker, which aborts what it still runs (each stream
    ends with its last chunk and [DONE], relayed by the router); they are stopped once the router has. (A SIGTERM
    that reached the workers as well, from a service manager, shuts them down with the same grace.)"""
    logger.warning("shutdown: the workers abort the requests still in flight")
    for w in workers:
        if w.proc.poll() is None:
            w.proc.send_signal(signal.SIGUSR1)


def _watch(workers: list[_Worker], failed: threading.Event, stopping: threading.Event) -> None:
    """Log workers that exit; stop the deployment (SIGTERM to this process) once a role has none left."""
    alive = {w.name: w for w in workers}
    while not stopping.wait(0.5):
        for name, w in list(alive.items()):
            if w.proc.poll() is not None:
                del alive[name]
                logger.error("%s exited with status %d", name, w.proc.returncode)
        for role in ("prefill", "decode"):
            if not any(w.role == role for w in alive.values()):
                logger.error("no %s worker is left; stopping the deployment", role)
                failed.set()
                os.kill(os.getpid(), signal.SIGTERM)
                return
