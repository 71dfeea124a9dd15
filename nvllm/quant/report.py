"""What ``nvllm quantize`` shows: a progress bar per layer, then a table of per-layer relative reconstruction
errors and times, and a summary (method, bits, sizes, calibration, what stayed in full precision)."""

from __future__ import annotations

from nvllm.quant.quantize import QuantizeSummary, quantize_model
from nvllm.quant.replay import ORDER
from nvllm.quant.sequential import ERROR_WINDOWS


class LayerProgress:
    """A Rich progress bar over the decoder layers; ``update(layer, stage)`` is the quantizer's callback."""

    def __init__(self, console, enabled: bool = True):
        self.console, self.enabled = console, enabled
        self.bar = self.task = None
        self.current = -1

    def start(self, summary: QuantizeSummary, num_layers: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        c = summary.config
        if c.method == "fp8":
            self.console.print(f"quantizing to FP8 (e4m3), {_fp8_scales(c)}: no calibration data", highlight=False)
        else:
            self.console.print(f"quantizing with {c.method} {c.bits}-bit, group size {c.group_size}: "
                               f"{summary.tokens} calibration tokens from {summary.calibration}", highlight=False)
        for name, why in summary.kept.items():
            self.console.print(f"[yellow]kept in full precision:[/] {name} — {why}", highlight=False)
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=self.console, transient=True, disable=not self.enabled)
        self.bar.start()
        self.task = self.bar.add_task("layer 0", total=num_layers)

    def update(self, layer: int, stage: str) -> None:
        if self.bar is None:
            return
        if layer != self.current:
            self.bar.update(self.task, completed=layer)
            self.current = layer
        self.bar.update(self.task, description=stage if stage == "lm_head" else f"layer {layer}: {stage}")

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _fp8_scales(c) -> str:
    if c.group_size != -1:
        return f"scales per {c.group_size}×{c.group_size} block"
    return "a scale per output channel" if c.writes == "compressed-tensors" else "a scale per tensor"


def error_table(summary: QuantizeSummary):
    from rich.table import Table

    fp8 = summary.config.method == "fp8"
    table = Table(title="relative weight error ‖Ŵ − W‖² / ‖W‖² (FP8: no calibration tokens)" if fp8 else
                  "relative reconstruction error ‖ŷ − y‖² / ‖y‖² on the calibration tokens")
    table.add_column("layer", justify="right")
    for name in ORDER:
        table.add_column(name.removesuffix("_proj"), justify="right")
    windows = min(ERROR_WINDOWS, summary.config.calib_samples)
    table.add_column("layer weights" if fp8 else "layer output" + (
        f" (first {windows} windows)" if windows < summary.config.calib_samples else f" ({windows} windows)"),
        justify="right")
    table.add_column("time", justify="right")
    for rep in summary.layers:
        cells = [_cell(rep.stage_error(n)) for n in ORDER]
        table.add_row(str(rep.index), *cells, f"{rep.layer_error:.2e}", f"{rep.seconds:.2f} s")
    if any(n.startswith("moe.") for rep in summary.layers for n in rep.errors):
        table.caption = "a mixture of experts' gate_up and down: the mean over its experts (and shared expert)"
    return table


def _cell(err: float | None) -> str:
    if err is None:
        return "fp"
    return "no tokens" if err != err else f"{err:.2e}"


def summary_lines(summary: QuantizeSummary) -> list[str]:
    c = summary.config
    if c.method == "fp8":
        return _fp8_summary_lines(summary)
    fmt = {"awq": "AWQ-GEMM", "gptq": "GPTQ v1", "compressed-tensors": "compressed-tensors (pack-quantized)"}[c.writes]
    extra = " act-order" + (" (static groups)" if c.static_groups else "") if c.desc_act else ""
    lines = [
        f"method {c.method}, {c.bits}-bit, group size {c.group_size}, "
        f"{'symmetric' if c.sym else 'zero point'}{extra}; format {fmt}",
        f"size {_size(summary.size_before)} → {_size(summary.size_after)} "
        f"({summary.size_after / max(summary.size_before, 1):.2f}×); " +
        ("embeddings in full precision, lm_head quantized" if c.quantize_lm_head
         else "embeddings and lm_head in full precision"),
    ]
    if c.quantize_lm_head and summary.head_error is not None:
        lines.append(f"lm_head quantized ({c.method} {c.bits}-bit, group size {c.group_size}): "
                     f"{_size(summary.head_size_before)} → {_size(summary.head_size_after)}, relative error "
                     f"{summary.head_error:.2e} on the calibration tokens")
    lines.append(f"calibration: {summary.tokens} tokens from {summary.calibration}")
    for name, why in summary.kept.items():
        lines.append(f"kept in full precision in every layer: {name} ({why})")
    lines += summary.notes
    lines.append(f"written to {summary.out_dir} in {summary.seconds:.1f} s")
    return lines


def _fp8_summary_lines(summary: QuantizeSummary) -> list[str]:
    c = summary.config
    fmt = "compressed-tensors (float-quantized)" if c.writes == "compressed-tensors" else "fp8 (quant_method fp8)"
    return [f"method fp8 (e4m3), {_fp8_scales(c)}; format {fmt}",
            f"size {_size(summary.size_before)} → {_size(summary.size_after)} "
            f"({summary.size_after / max(summary.size_before, 1):.2f}×); embeddings and lm_head in full precision",
            f"calibration: {summary.calibration}", *summary.notes,
            f"written to {summary.out_dir} in {summary.seconds:.1f} s"]


def print_report(summary: QuantizeSummary, console) -> None:
    console.print(error_table(summary))
    for line in summary_lines(summary):
        console.print(line, highlight=False, markup=False)


def quantize_with_report(model: str, out: str, cfg, overwrite: bool, console, progress: bool,
                         revision: str | None = None) -> QuantizeSummary:
    """``quantize_model`` under the per-layer progress bar, then the report: what `nvllm quantize` and
    `nvllm pipeline` show. The bar is stopped whatever happens (the caller turns a user error into its one line)."""
    bar = LayerProgress(console, enabled=progress)
    try:
        summary = quantize_model(model, out, cfg, overwrite, progress=bar.update, on_start=bar.start,
                                 revision=revision)
    finally:
        bar.stop()
    print_report(summary, console)
    return summary
