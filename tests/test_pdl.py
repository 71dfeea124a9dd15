"""Programmatic dependent launch: the switch, and every kernel that takes ``PDL`` compiled for Hopper (sm_90,
ahead of time: no GPU needed) waits for its predecessor before its first global memory access. (The compile
itself checks that the variants — the SiLU·mul epilogue, the interleaved SiLU·mul — build for sm_90.)

The compiles run in a subprocess without TRITON_INTERPRET (the interpreter the other tests use patches
triton.language in a way the compiler cannot run under)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from nvllm.kernels import pdl

triton = pytest.importorskip("triton")


def test_off_on_cpu_and_switch(monkeypatch):
    assert pdl.launch_args(torch.zeros(1)) == {"PDL": False}
    monkeypatch.setenv("NVLLM_PDL", "1")
    assert not pdl.enabled(torch.zeros(1))  # never on a CPU tensor, whatever was asked


def _raw(kernel):
    """The Python function of a kernel, whether jitted at import (interpreted under the tests) or lazily."""
    from nvllm.kernels.jit import lazy_jit

    fn = getattr(kernel, "fn", kernel)
    if "tl" not in fn.__globals__ or fn.__globals__["tl"] is None:
        lazy_jit(fn)  # binds triton.language into the kernel's module
    return fn


def _ptx(kernel, pointers: dict[str, str], constexprs: dict, floats=(), **options) -> str:
    """PTX of ``kernel`` for sm_90: pointer arguments typed by ``pointers`` (default *bf16), ``floats`` fp32,
    other runtime arguments i32."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    fn = JITFunction(_raw(kernel))
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = pointers.get(name, "*bf16")
        else:
            sig[name] = "fp32" if name in floats else "i32"
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(n),): v for n, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def _kernels():
    from nvllm.kernels import activation, decode_attention, gemm, quant_gemv_tile, rmsnorm, rope_store

    gemv_common = dict(BITS=4, GROUP=128, HAS_BIAS=False, ATOMIC=False, SERIAL=True, STAGES=1,
                       BLOCK_M=1, BLOCK_N=128, BLOCK_K=64)
    gemv_ptrs = {"qw_ptr": "*i32", "qz_ptr": "*i32", "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
    plain = dict(PARTIAL=False, HAS_BIAS=False)
    yield "rms_norm", rmsnorm._rms_norm_kernel, {}, dict(HAS_RESIDUAL=True, BLOCK=1024, EARLY_W=False, **plain), \
        ("eps",)
    # finishing a GEMV's split-K sum (nvllm.kernels.partial_sum): reads, then re-zeroes, its fp32 accumulator
    yield "rms_norm partial sum", rmsnorm._rms_norm_kernel, {"x_ptr": "*fp32"}, dict(
        HAS_RESIDUAL=True, BLOCK=1024, PARTIAL=True, HAS_BIAS=True, EARLY_W=False), ("eps",)
    # the norm's weight (a parameter) read before the wait; the row and the residual after it
    yield "rms_norm partial sum early W", rmsnorm._rms_norm_kernel, {"x_ptr": "*fp32"}, dict(
        HAS_RESIDUAL=True, BLOCK=1024, PARTIAL=True, HAS_BIAS=True, EARLY_W=True), ("eps",)
    yield "silu_and_mul", activation._silu_and_mul_kernel, {}, dict(BLOCK=1024, INTERLEAVE=0, **plain), ()
    yield "silu_and_mul interleaved", activation._silu_and_mul_kernel, {}, dict(BLOCK=1024, INTERLEAVE=4,
                                                                                **plain), ()
    yield "silu_and_mul partial sum", activation._silu_and_mul_kernel, {"x_ptr": "*fp32"}, dict(
        BLOCK=1024, INTERLEAVE=0, PARTIAL=True, HAS_BIAS=True), ()
    rope_ptrs = {"pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slot_ptr": "*i64",
                 "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    rope = dict(BLOCK_SIZE=16, BLOCK_H=32, BLOCK_HKV=4, BLOCK_HALF=64, QUANT=0, QMAX=127)
    yield "rope_store", rope_store._rope_store_kernel, rope_ptrs, dict(EARLY=False, **rope, **plain), ()
    partial_ptrs = dict(rope_ptrs, q_ptr="*fp32", k_ptr="*fp32", v_ptr="*fp32")
    yield "rope_store partial sum", rope_store._rope_store_kernel, partial_ptrs, dict(
        EARLY=False, PARTIAL=True, HAS_BIAS=True, **rope), ()
    # positions, cos/sin rows and cache slots (staged or built launches earlier) before the wait; q, k, v after it
    yield "rope_store partial sum early W", rope_store._rope_store_kernel, partial_ptrs, dict(
        EARLY=True, PARTIAL=True, HAS_BIAS=True, **rope), ()
    skinny = dict(HAS_BIAS=False, SPLIT=True, USE_DOT=False, ACC_K=1, EVEN_K=True, UPCAST=False,
                  DOT_PRECISION="tf32", FMA_STAGES=1, BLOCK_M=1, BLOCK_N=64, BLOCK_K=128)
    skinny_ptrs = {"ws_ptr": "*fp32", "lock_ptr": "*i32"}
    yield "skinny_gemm", gemm._skinny_gemm_kernel, skinny_ptrs, dict(EARLY_W=False, SILU_B=0, **skinny), ()
    # the SiLU·mul epilogue, fma (8-row tiles) and mma (64-row tiles, swap-AB)
    yield "skinny_gemm silu", gemm._skinny_gemm_kernel, skinny_ptrs, dict(
        EARLY_W=False, SILU_B=4, **dict(skinny, BLOCK_N=8, BLOCK_K=256)), ()
    yield "skinny_gemm mma silu", gemm._skinny_gemm_kernel, skinny_ptrs, dict(
        EARLY_W=False, SILU_B=4, **dict(skinny, USE_DOT=True, SPLIT=False, BLOCK_M=16, BLOCK_N=64)), ()
    # EARLY_W: the first W tile is loaded before the wait (weights are read-only); no store may precede it
    yield "skinny_gemm early W", gemm._skinny_gemm_kernel, skinny_ptrs, dict(EARLY_W=True, SILU_B=0, **skinny), ()
    yield "quant_gemv tile", quant_gemv_tile._quant_gemv_kernel, gemv_ptrs, dict(AWQ=False, MAGIC=True,
                                                                           **gemv_common), ()
    yield "quant_gemv row", quant_gemv_tile._quant_gemv_field_kernel, gemv_ptrs, dict(AWQ=True, ROWS=True,
                                                                                **gemv_common), ()
    attn_ptrs = {"block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "part_o_ptr": "*fp32",
                 "part_lse_ptr": "*fp32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    attn = dict(GROUP=7, BLOCK_SIZE=16, BLOCK_G=16, BLOCK_D=128, BLOCK_N=64, SPLIT=True, IEEE_DOT=False)
    yield "decode attention", decode_attention._decode_stage1_kernel, attn_ptrs, dict(
        KV_QUANT=False, FRESH=0, **attn), ("sm_scale_log2",)
    # earlier steps' keys and values read before the wait (int8 cache: and their scales); every write after it
    yield "decode attention early W", decode_attention._decode_stage1_kernel, dict(
        attn_ptrs, k_cache_ptr="*i8", v_cache_ptr="*i8"), dict(
        KV_QUANT=True, FRESH=1, **attn), ("sm_scale_log2",)
    yield "decode attention merge", decode_attention._decode_stage2_kernel, attn_ptrs, dict(BLOCK_S=16,
                                                                                         BLOCK_D=128), ()


MEMORY = re.compile(r"^\s*(@%p\d+\s+)?(ld\.global|st\.global|atom\.|red\.|cp\.async)", re.M)
WRITES = re.compile(r"^\s*(@%p\d+\s+)?(st\.global|atom\.|red\.)", re.M)


def _check_all() -> dict[str, str]:
    """Each kernel's verdict: "ok" or what is wrong (run in the subprocess)."""
    verdicts = {}
    for name, kernel, pointers, constexprs, floats in _kernels():
        ptx = _ptx(kernel, pointers, {**constexprs, "PDL": True}, floats, launch_pdl=True)
        wait = ptx.find("griddepcontrol.wait")
        first = (WRITES if "early W" in name else MEMORY).search(ptx)
        plain = _ptx(kernel, pointers, {**constexprs, "PDL": False}, floats)
        if wait < 0 or "griddepcontrol.launch_dependents" not in ptx:
            verdicts[name] = "no griddepcontrol with PDL"
        elif first is None or first.start() < wait:
            verdicts[name] = "global memory touched before griddepcontrol.wait"
        elif "early W" in name and not MEMORY.search(ptx[:wait]):
            verdicts[name] = "no early load of W"
        elif "griddepcontrol" in plain:
            verdicts[name] = "griddepcontrol without PDL"
        else:
            verdicts[name] = "ok"
    return verdicts


def test_kernels_wait_before_touching_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import json, tests.test_pdl as t; print(json.dumps(t._check_all()))"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    verdicts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(verdicts) == len(list(_kernels())) and set(verdicts.values()) == {"ok"}, verdicts
