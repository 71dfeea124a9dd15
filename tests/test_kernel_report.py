"""The kernel report counts what CUDA graph replays run: a capture's records are kept and counted again at
every replay."""

from __future__ import annotations

from nvllm.kernels import report


def test_recording_and_replay():
    report.reset()
    report.record("gemm", "before")
    with report.recording() as made:
        report.record("gemm", "triton skinny")
        report.record("gemm", "triton skinny")
        report.record("rms_norm", "triton")
    report.record("gemm", "after")
    assert made == {("gemm", "triton skinny"): 2, ("rms_norm", "triton"): 1}
    for _ in range(3):
        report.replay(made)
    snap = report.snapshot()
    assert snap["gemm"] == {"before": 1, "triton skinny": 8, "after": 1}
    assert snap["rms_norm"] == {"triton": 4}
    report.reset()
