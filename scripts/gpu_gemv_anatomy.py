"""Where the one-row ``half2`` GEMV's time goes on one GPU: the kernel with parts knocked out, per Qwen2.5-7B
projection (GPTQ 4-bit g128, M = 1, n256 k64, one warp, waves 8 and 16), timed in a CUDA graph with PDL as the
engine launches it. The results are not checked (parts are missing by design).

    python scripts/gpu_gemv_anatomy.py        # about 15 s on an H200; $OUT/gemv_anatomy.json

Variants (input-scale prologue, main loop, split-K epilogue):
  base        the kernel as it was at 5af2bfb (prologue: one load and reduction per K step; ticket epilogue)
  nopro       no input scale (inputs used as they are)
  noepi       partial tiles stored without the split-K reduction
  red_only    partial tiles added atomically, no ticket and no last-split pass
  main_only   neither prologue nor epilogue
  loads+epi   the weights loaded and summed as integers (no dequantization, no products), with the epilogue
  loads_only  the same without the epilogue
  pro+epi     no main loop
  empty       only the programs' launch, PDL wait and a store
(PERF.md session 9, run AT.)"""
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from gpu_quant_bench import GROUP, SHAPES, random_weight, rotated_copies  # noqa: E402
from nvllm.kernels import quant_gemv as QV  # noqa: E402
from nvllm.kernels.gemm_tuner import cuda_graph_timer  # noqa: E402
from nvllm.kernels.quant_gemv_half2 import _WORD_DOT, _pairs, epilogue, words_of  # noqa: E402
from nvllm.kernels.split_k import plan_split_k  # noqa: E402


@triton.jit
def anatomy_kernel(x_ptr, xw_ptr, qw_ptr, qz_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr, N, K, stride_qw, stride_qz,
                   stride_s, k_per_split, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRO: tl.constexpr, MAIN: tl.constexpr, EPI: tl.constexpr, PDL: tl.constexpr):
    """The one-row half2 kernel with PRO (input scale), MAIN (0 none, 1 the products, 2 the weights summed as
    integers) and EPI (0 plain store, 1 split-K with ticket, 2 atomic adds only) switched."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    if PRO:
        m = 0.0
        for k0 in range(k_begin, k_end, BLOCK_K):
            m = tl.maximum(m, tl.max(tl.abs(tl.load(x_ptr + k0 + tl.arange(0, BLOCK_K)).to(tl.float32))))
        e = tl.minimum(tl.maximum((m.to(tl.int32, bitcast=True) >> 23) & 255, 8), 253)
        sc = ((262 - e) << 23).to(tl.float32, bitcast=True)
        unscale = ((e - 8) << 23).to(tl.float32, bitcast=True)
    else:
        sc = 1.0
        unscale = 1.0
    zshift = (offs_n % 8) * 4
    acc = tl.full((BLOCK_N,), 0.0, tl.float32)
    if MAIN > 0:
        for k0 in tl.range(k_begin, k_end, BLOCK_K, num_stages=1):
            grp = k0 // GROUP
            s = tl.load(s_ptr + grp * stride_s + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            zw = tl.load(qz_ptr + grp * stride_qz + offs_n // 8, mask=mask_n, other=0)
            z = ((zw >> zshift) & 15) + 1
            z1 = (0x6400 + z).to(tl.uint32) * 0x10001
            z16 = (0x6400 + 16 * z).to(tl.uint32) * 0x10001
            for w in tl.static_range(BLOCK_K // 8):
                words = words_of(qw_ptr + (k0 // 8 + w) * stride_qw + offs_n, mask_n)
                kb = k0 + 8 * w
                if MAIN == 1:
                    p0, p1, p2, p3 = _pairs(xw_ptr, kb, sc, True)
                    d = tl.inline_asm_elementwise(_WORD_DOT, "=f,r,r,r,r,r,r,r", [words, z1, z16, p0, p1, p2, p3],
                                                  dtype=tl.float32, is_pure=True, pack=1)
                else:
                    d = words.to(tl.float32)
                if w == 0:
                    part = d
                else:
                    part += d
            acc += s * part
    offs_m = tl.arange(0, 1)
    if EPI == 1:
        epilogue((acc * unscale)[None, :], out_ptr, 0, offs_m, offs_m < 1, offs_n, mask_n, out_ptr, ws_ptr, cnt_ptr,
                 N, False, False, True, 1, BLOCK_N)
    elif EPI == 2:
        tl.atomic_add(ws_ptr + offs_n, acc * unscale, mask=mask_n, sem="relaxed")
    else:
        tl.store(out_ptr + offs_n, (acc * unscale).to(out_ptr.dtype.element_ty), mask=mask_n)


COMBOS = {"base": (1, 1, 1), "nopro": (0, 1, 1), "noepi": (1, 1, 0), "red_only": (1, 1, 2), "main_only": (0, 1, 0),
          "loads+epi": (0, 2, 1), "loads_only": (0, 2, 0), "pro+epi": (1, 0, 1), "empty": (0, 0, 0)}
BN, BK = 256, 64


def main() -> int:
    res = {}
    for name, (n, k) in SHAPES.items():
        qw0 = random_weight("gptq", n, k, torch.Generator("cuda").manual_seed(0), "cuda")
        qws, _ = rotated_copies(qw0, n, k)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        n_tiles = triton.cdiv(n, BN)
        for waves in (8, 16):
            sk, kps = plan_split_k(n_tiles, k, BK, x.device, QV._splits(n_tiles, k, BK, x.device, waves))
            ws, cnt = QV._workspace(x.device, n, n_tiles)
            for cname, (pro, main_loop, epi) in COMBOS.items():
                def call(i, pro=pro, main_loop=main_loop, epi=epi, qws=qws, x=x, out=out, ws=ws, cnt=cnt):
                    q = qws[i]
                    anatomy_kernel[(n_tiles, sk)](
                        x, x.view(torch.int32), q.qweight, q.qzeros, q.scales, out, ws, cnt, n, k,
                        q.qweight.stride(0), q.qzeros.stride(0), q.scales.stride(0), kps, GROUP=GROUP, BLOCK_N=BN,
                        BLOCK_K=BK, PRO=pro, MAIN=main_loop, EPI=epi, PDL=True, launch_pdl=True, num_warps=1)
                t = cuda_graph_timer(call, len(qws), 1e-5) * 1e6
                res[f"{name} w{waves} {cname}"] = t
                print(f"{name:8s} waves{waves:<3d} splits {sk:3d} programs {n_tiles * sk:5d} {cname:10s} {t:7.2f} us",
                      flush=True)
            ws.zero_()
            cnt.zero_()
        del qws
    out_dir = Path(os.environ.get("OUT", "."))
    (out_dir / "gemv_anatomy.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
