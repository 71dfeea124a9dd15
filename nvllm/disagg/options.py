"""`nvllm serve` flags of disaggregated serving, declared once: `@disagg_options` hands the command a DisaggConfig."""

from __future__ import annotations

from typing import Any, Optional

from nvllm.cli_options import option_group, panel_option
from nvllm.disagg.config import DisaggConfig

_opt = panel_option("Disaggregation")


DISAGG_OPTIONS: dict[str, tuple[Any, Any]] = {
    "role": _opt("mixed", str, "mixed | prefill | decode: mixed serves alone; prefill and decode workers serve "
                 "behind `nvllm router`"),
    "disaggregate": _opt(None, Optional[str], "xPyD (e.g. 1P1D): start x prefill and y decode workers (one GPU "
                         "each under CUDA) and a router on --host/--port, and stop them together"),
    "kv_rank": _opt(None, Optional[int], "this worker's rank in the KV transfer group"),
    "kv_world_size": _opt(None, Optional[int], "prefill + decode workers in the KV transfer group"),
    "kv_master": _opt(None, Optional[str], "HOST:PORT of the KV transfer group's store (rank 0 listens there)"),
    "kv_store_external": _opt(False, bool, "another process already serves the store at --kv-master (as "
                              "--disaggregate does): rank 0 connects to it instead of listening"),
    "kv_backend": _opt("auto", str, "auto | gloo | nccl (auto: NCCL between GPUs, gloo on the CPU)"),
    "max_prefill_length": _opt(None, Optional[int], "prefill workers refuse longer prompts (400, saying so)"),
    "prefill_max_num_seqs": _opt(None, Optional[int], "with --disaggregate: the prefill workers' batch "
                                 "(--max-num-seqs is the decode workers'; default: the same)"),
    "kv_handle_timeout": _opt(60.0, float, "seconds a prefilled request's KV waits for its decode worker"),
    "kv_transfer_timeout": _opt(60.0, float, "seconds one KV transfer may take before it is given up (the "
                                "decode worker then recomputes the prompt)"),
}

disagg_options = option_group(DISAGG_OPTIONS, DisaggConfig, "disagg_config")
