"""Timing of one ``nvllm.quant.quantize.quantize_model`` call for ``gpu_quantize_bench.py``: progress lines, the
phases (tokenizer, calibration windows, layers; the model's parts read, packed and written inside the layers) and,
with ``detail``, each layer's replay, Hessian, GPTQ, Cholesky and error time. nvllm's functions are wrapped at run
time with a CUDA synchronize before and after, so the GPU time lands where it belongs, and restored on exit."""

from __future__ import annotations

import contextlib
import time

import torch

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def _sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


class Tracker:
    """Progress lines, per-layer timings and the phase timings of one ``quantize_model`` call."""

    def __init__(self, res: dict, save, device: torch.device, detail: bool):
        self.res, self.save, self.device, self.detail = res, save, device, detail
        self.num_layers = 0
        self.layer: int | None = None
        self.layers_start: float | None = None
        self.q_t0 = time.perf_counter()          # set again just before quantize_model
        self.layer_t0 = self.stage_t0 = 0.0
        self.stage: str | None = None
        self.cur: dict = {}
        self.layers: list[dict] = res.setdefault("layers", [])
        self.phases: dict = res.setdefault("phases", {})

    # -- callbacks of quantize_model
    def on_start(self, summary, num_layers: int) -> None:
        self.num_layers = num_layers
        self.res["calibration"] = {"source": summary.calibration, "tokens": summary.tokens,
                                   "notes": list(summary.notes)}
        log(f"calibration ready: {summary.tokens} tokens from {summary.calibration}")
        for note in summary.notes:
            log(f"note: {note}")
        for name, why in summary.kept.items():
            log(f"kept in full precision: {name} ({why})")
        self.save()

    def on_progress(self, layer: int, stage: str) -> None:
        now = time.perf_counter()
        self._close_stage(now)
        if layer != self.layer:
            if self.layer is not None:
                self._finish_layer(now)
            elif self.layers_start is not None:
                self.phases["embed_windows_s"] = now - self.layers_start
            self.layer, self.layer_t0 = layer, now
            self.cur = {"index": layer, "stages": {}, "collect_s": 0.0, "hessian_s": 0.0, "gptq_s": 0.0,
                        "cholesky_s": 0.0, "rel_error_s": 0.0}
        self.stage, self.stage_t0 = stage, now
        self.res["current"] = {"layer": layer + 1, "stage": stage, "at_s": now - self.q_t0}
        if layer == 0 or layer == self.num_layers - 1:     # the other layers: one line when done (short output)
            log(f"layer {layer + 1}/{self.num_layers} {stage}")

    def _close_stage(self, now: float) -> None:
        if self.stage is not None:
            self.cur["stages"][self.stage] = now - self.stage_t0
            self.stage = None

    def _finish_layer(self, now: float, complete: bool = True) -> None:
        self._close_stage(now)
        c = self.cur
        c["seconds"] = now - self.layer_t0
        if not complete:     # interrupted (time limit, error): kept apart from the finished layers
            self.res["interrupted_layer"] = c
            log(f"layer {c['index'] + 1}/{self.num_layers} interrupted after {c['seconds']:.1f}s "
                f"[{' '.join(f'{k} {v:.1f}' for k, v in c['stages'].items())}]")
            self.save()
            return
        self.layers.append(c)
        done = len(self.layers)
        mean = sum(x["seconds"] for x in self.layers) / done
        eta = mean * (self.num_layers - done)
        parts = " ".join(f"{k} {v:.1f}" for k, v in c["stages"].items())
        extra = ""
        if self.detail:
            extra = (f" replay+H {c['collect_s']:.1f} (H {c['hessian_s']:.1f}) gptq {c['gptq_s']:.1f} "
                     f"(chol {c['cholesky_s']:.1f}) err {c['rel_error_s']:.1f}")
        log(f"layer {c['index'] + 1}/{self.num_layers} {c['seconds']:.1f}s [{parts}]{extra} | mean {mean:.1f} "
            f"ETA {eta:.0f}s, last layer at ~{now - self.q_t0 + eta:.0f}s of quantize")
        self.res["layers_done"] = done
        self.save()

    # -- wrappers
    def phase(self, key: str, fn, sync: bool = True, quiet: bool = False):
        """``fn`` timed into phases[key + "_s"] (summed over calls; ``quiet``: no line a call, for the parts of the
        model read, packed and written inside the layers phase)."""
        def wrapped(*a, **kw):
            if sync:
                _sync(self.device)
            t0 = time.perf_counter()
            if key == "layers":
                self.layers_start = t0
            ok = False
            try:
                out = fn(*a, **kw)
                ok = True
                return out
            finally:
                if sync and ok:
                    _sync(self.device)
                t1 = time.perf_counter()
                self.phases[f"{key}_s"] = self.phases.get(f"{key}_s", 0.0) + t1 - t0
                if key == "layers" and self.layer is not None:
                    self._finish_layer(t1, complete=ok)
                    self.layer = None
                if not quiet or not ok:
                    log(f"phase {key}: {t1 - t0:.1f}s" + ("" if ok else " (interrupted)"))
        return wrapped

    def detail_timer(self, key: str, fn):
        def wrapped(*a, **kw):
            _sync(self.device)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                _sync(self.device)
                if self.cur:
                    self.cur[key] = self.cur.get(key, 0.0) + time.perf_counter() - t0
        return wrapped


@contextlib.contextmanager
def instrumented(tracker: Tracker):
    """Wrap nvllm's quantize phases (and, with detail, the per-stage steps) for timing; restored on exit."""
    import nvllm.engine.tokenizer as tok_mod
    import nvllm.quant.gptq as gptq_mod
    import nvllm.quant.methods as methods
    import nvllm.quant.quantize as qmod
    import nvllm.quant.sequential as seq
    from nvllm.quant.lazy_model import LazyModel
    from nvllm.quant.writer import CheckpointOutput

    patches = [(tok_mod, "load_tokenizer", tracker.phase("tokenizer", tok_mod.load_tokenizer, sync=False)),
               (qmod, "load_texts", tracker.phase("read_calib_text", qmod.load_texts, sync=False)),
               (qmod, "calibration_windows", tracker.phase("calib_windows", qmod.calibration_windows, sync=False)),
               (qmod, "quantize_layers", tracker.phase("layers", qmod.quantize_layers)),
               # the model is read, packed and written a part at a time, inside the layers phase
               (LazyModel, "load", tracker.phase("load", LazyModel.load, sync=False, quiet=True)),
               (qmod, "checkpoint_tensors", tracker.phase("pack", qmod.checkpoint_tensors, quiet=True)),
               (CheckpointOutput, "add", tracker.phase("write", CheckpointOutput.add, sync=False, quiet=True)),
               (CheckpointOutput, "finish", tracker.phase("finish", CheckpointOutput.finish, sync=False))]
    if tracker.detail:
        patches += [(seq, "_collect", tracker.detail_timer("collect_s", seq._collect)),
                    (methods.InputStats, "add", tracker.detail_timer("hessian_s", methods.InputStats.add)),
                    (methods, "gptq_quantize", tracker.detail_timer("gptq_s", methods.gptq_quantize)),
                    (gptq_mod, "inverse_hessian_factor",
                     tracker.detail_timer("cholesky_s", gptq_mod.inverse_hessian_factor)),
                    (methods, "relative_error", tracker.detail_timer("rel_error_s", methods.relative_error))]
    saved = [(obj, name, obj.__dict__[name]) for obj, name, _ in patches]
    try:
        for obj, name, new in patches:
            setattr(obj, name, new)
        yield
    finally:
        for obj, name, old in saved:
            setattr(obj, name, old)
