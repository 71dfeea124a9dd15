"""Quantized-weight checkpoint formats: AWQ-GEMM and GPTQ (v1) packing and unpacking (bit fields into words:
``nvllm.quant.packing``; their ``quantization_config``: ``nvllm.quant.quant_config``).

Pure torch (no Triton): the quantizer writes checkpoints with these functions, the loader reads them, and the
``dequantize_*`` functions are the references the ``quant_gemm`` kernel is tested against.

Conventions used throughout (nn.Linear: ``weight`` is ``[out, in]``, ``y = x @ weight.T``):

* integer form of a group-quantized weight: ``q [out, in]`` in ``[0, 2^bits)``, ``scales [G, out]``,
  ``zeros [G, out]`` (the true zero point, ``w = (q - z) * s``), ``g_idx [in]`` (group of each input column;
  ``G = in / group_size``).

AWQ-GEMM (4-bit only; what AutoAWQ's ``version: gemm`` writes and vLLM reads)
  ``qweight`` int32 ``[in, out/8]``: packed along *out*; nibble ``i`` (bits ``4i..4i+3``) of packed column
  ``c`` holds out column ``c*8 + AWQ_PACK_ORDER[i]`` with ``AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)``.
  ``qzeros`` int32 ``[in/g, out/8]``: same packing, zero points stored as they are.
  ``scales`` fp16 ``[in/g, out]``. Groups are contiguous runs of ``g`` input rows (no g_idx).

GPTQ v1 (AutoGPTQ ``checkpoint_format: gptq``; 4- and 8-bit here)
  ``qweight`` int32 ``[in*bits/32, out]``: packed along *in*; word row ``r`` holds inputs
  ``r*P .. r*P+P-1`` (``P = 32/bits``), input ``r*P + i`` in bits ``i*bits ..`` (lowest first).
  ``qzeros`` int32 ``[G, out*bits/32]``: packed along *out*, plain order, each field stores ``zero - 1``.
  ``scales`` fp16 ``[G, out]``; ``g_idx`` int32 ``[in]`` (non-monotone under act-order / desc_act).
  Readers add the 1 back, so the representable zero points are ``1 .. 2^bits`` — a zero point of 0 cannot be
  stored (see ``pack_gptq``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from nvllm.quant.packing import pack_cols, pack_rows, unpack_cols, unpack_rows

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""Nibble ``i`` of an AWQ word holds column ``c*8 + AWQ_PACK_ORDER[i]``."""
AWQ_UNPACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
"""Column ``c*8 + j`` sits in nibble ``AWQ_UNPACK_ORDER[j]`` (the inverse permutation)."""

SUPPORTED_BITS = {"awq": (4,), "gptq": (4, 8)}


# ---------------------------------------------------------------------------------------- group quantization


@dataclass
class GroupQuant:
    """Integer form of a group-quantized weight (before packing). ``w ≈ (q - zeros[g_idx]) * scales[g_idx]``."""

    q: torch.Tensor        # int32 [out, in], values in [0, 2^bits)
    scales: torch.Tensor   # [G, out] (fp16 by default)
    zeros: torch.Tensor    # int32 [G, out], the true zero point
    g_idx: torch.Tensor    # int32 [in]
    bits: int
    group_size: int

    def dequantize(self) -> torch.Tensor:
        """float32 ``[out, in]``."""
        g = self.g_idx.long()
        s = self.scales.float()[g].t()            # [out, in]
        z = self.zeros.float()[g].t()
        return (self.q.float() - z) * s


def default_g_idx(in_features: int, group_size: int, device=None) -> torch.Tensor:
    """Contiguous groups: input ``k`` belongs to group ``k // group_size``."""
    return (torch.arange(in_features, device=device) // group_size).to(torch.int32)


def act_order_g_idx(perm: torch.Tensor, group_size: int) -> torch.Tensor:
    """g_idx of act-order (desc_act) quantization: inputs are processed in the order ``perm`` (e.g. by
    decreasing Hessian diagonal) and the ``i``-th processed input falls in group ``i // group_size``, so
    ``g_idx[perm[i]] = i // group_size``. (With static groups the g_idx stays ``default_g_idx``.)"""
    g_idx = torch.empty_like(perm, dtype=torch.int32)
    g_idx[perm.long()] = (torch.arange(perm.numel(), device=perm.device) // group_size).to(torch.int32)
    return g_idx


def resolve_group_size(group_size: int, in_features: int) -> int:
    """``-1`` (one group per output channel) → ``in_features``; checks divisibility."""
    g = in_features if group_size == -1 else group_size
    if g <= 0 or in_features % g:
        raise ValueError(f"group_size {group_size} does not divide in_features {in_features}")
    return g


MIN_SCALE = 2.0 ** -14
"""The smallest scale: float16's smallest normal number. A group of zeros (a pruned head, GPTQ's dead inputs) or of
weights ~1e-7 would otherwise get a scale that rounds to 0 in the stored float16, and codes of 0 / 0."""


def group_scale_zero(w: torch.Tensor, bits: int, sym: bool, zero_min: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of each group of ``w [..., g]`` (float32, the scale not yet rounded to its
    storage dtype); the rules are ``quantize_rtn``'s."""
    w = w.float()
    maxq = 2**bits - 1
    if sym:
        scales = (2 * w.abs().amax(dim=-1) / maxq).clamp(min=MIN_SCALE)
        return scales, torch.full_like(scales, float((maxq + 1) // 2))
    wmin = w.amin(dim=-1).clamp(max=0)
    wmax = w.amax(dim=-1).clamp(min=0)
    scales = ((wmax - wmin) / maxq).clamp(min=MIN_SCALE)
    zeros = torch.round(-wmin / scales)
    raised = zeros < zero_min
    zeros = zeros.clamp(min=zero_min, max=maxq)
    if bool(raised.any()):
        room = (maxq - zeros).clamp(min=1)
        scales = torch.where(raised, torch.maximum(scales, wmax / room), scales)
    return scales, zeros


def quantize_rtn(weight: torch.Tensor, bits: int, group_size: int, sym: bool = False,
                 g_idx: torch.Tensor | None = None, zero_min: int = 0,
                 scale_dtype: torch.dtype = torch.float16) -> GroupQuant:
    """Round-to-nearest group quantization of a float ``weight [out, in]``.

    asym: the group's range is widened to include 0 (``min(w, 0) .. max(w, 0)``), ``s = range / maxq``,
    ``z = round(-min / s)`` — so 0 is exactly representable. ``zero_min=1`` keeps every zero point ≥ 1 (what
    GPTQ v1 can store); groups whose zero is raised get their scale widened so that ``max`` still fits.
    sym: ``s = 2·max|w| / maxq``, ``z = 2^(bits-1)`` (the AutoGPTQ convention).
    Scales are rounded to ``scale_dtype`` first and ``q`` is computed with the rounded scales, as the
    checkpoint writers do. ``g_idx`` (each group exactly ``group_size`` members) selects act-order groups.
    """
    out_f, in_f = weight.shape
    g = resolve_group_size(group_size, in_f)
    n_groups = in_f // g
    maxq = 2**bits - 1
    if g_idx is None:
        g_idx = default_g_idx(in_f, g, weight.device)
    g_idx = g_idx.to(device=weight.device, dtype=torch.int32)
    counts = torch.bincount(g_idx.long(), minlength=n_groups)
    if counts.numel() != n_groups or bool((counts != g).any()):
        raise ValueError(f"g_idx must put exactly {g} inputs in each of {n_groups} groups")

    order = torch.argsort(g_idx.long(), stable=True)            # columns grouped contiguously
    w = weight.float()[:, order].reshape(out_f, n_groups, g)
    scales, zeros = group_scale_zero(w, bits, sym, zero_min)  # [out, G]
    scales = scales.to(scale_dtype)
    s = scales.float().unsqueeze(-1)
    q = torch.clamp(torch.round(w / s) + zeros.unsqueeze(-1), 0, maxq)
    q_cols = torch.empty(out_f, in_f, dtype=torch.int32, device=weight.device)
    q_cols[:, order] = q.reshape(out_f, in_f).to(torch.int32)
    return GroupQuant(q=q_cols, scales=scales.t().contiguous(), zeros=zeros.to(torch.int32).t().contiguous(),
                      g_idx=g_idx, bits=bits, group_size=g)


# ------------------------------------------------------------------------------------------------ AWQ-GEMM


def pack_awq(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """``q [out, in]``, ``zeros [G, out]``, ``scales [G, out]`` → AWQ-GEMM tensors (4-bit)."""
    return {
        "qweight": pack_cols(q.t().contiguous(), 4, AWQ_PACK_ORDER),
        "qzeros": pack_cols(zeros, 4, AWQ_PACK_ORDER),
        "scales": scales.to(torch.float16).contiguous(),
    }


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ-GEMM ``qweight``/``qzeros`` → ``q [out, in]``, ``zeros [G, out]`` (int32)."""
    q = unpack_cols(qweight, 4, AWQ_PACK_ORDER).t().contiguous()
    return q, unpack_cols(qzeros, 4, AWQ_PACK_ORDER)


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight ``[out, in]`` of an AWQ-GEMM layer: ``w = (q - z) * s`` per contiguous input group."""
    q, zeros = unpack_awq(qweight, qzeros)
    in_f = qweight.shape[0]
    g = resolve_group_size(group_size, in_f)
    if scales.shape[0] * g != in_f or qzeros.shape[0] != scales.shape[0]:
        raise ValueError(f"AWQ shapes disagree: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                         f"scales {tuple(scales.shape)}, group_size {group_size}")
    groups = torch.arange(in_f, device=qweight.device) // g
    w = (q.float() - zeros.float()[groups].t()) * scales.float()[groups].t()
    return w.to(dtype)


# --------------------------------------------------------------------------------------------------- GPTQ


def pack_gptq(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
              bits: int) -> dict[str, torch.Tensor]:
    """``q [out, in]``, ``zeros [G, out]``, ``scales [G, out]``, ``g_idx [in]`` → GPTQ v1 tensors.

    v1 stores ``zero - 1``; a zero point of 0 has no v1 encoding (the writers that store -1 corrupt the
    neighbouring fields), so zero points must lie in ``1 .. 2^bits`` — quantize with ``zero_min=1``."""
    if bits not in SUPPORTED_BITS["gptq"]:
        raise ValueError(f"GPTQ packing supports bits {SUPPORTED_BITS['gptq']}, got {bits}")
    if zeros.numel() and (int(zeros.min()) < 1 or int(zeros.max()) > 2**bits):
        raise ValueError(f"GPTQ v1 stores zero-1: zero points must lie in [1, {2**bits}], got "
                         f"[{int(zeros.min())}, {int(zeros.max())}] (quantize with zero_min=1)")
    return {
        "qweight": pack_rows(q.t().contiguous(), bits),
        "qzeros": pack_cols(zeros.to(torch.int64) - 1, bits),
        "scales": scales.to(torch.float16).contiguous(),
        "g_idx": g_idx.to(torch.int32).contiguous(),
    }


def gptq_v1_tensors(qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor,
                    bits: int) -> dict[str, torch.Tensor]:
    """A packed layer (``qweight [in*bits/32, out]``, ``g_idx [in]``) with its true zero points ``zeros [G, out]``
    (0 .. 2^bits - 1, as compressed-tensors and GPTQ v2 store them) → GPTQ v1 tensors. v1 stores zero − 1, which a
    zero of 0 cannot be: such a group is mirrored — codes 2^bits−1−q, zero 2^bits−1, scale negated — which gives the
    same weights, (−s)·((top − q) − top) = s·q."""
    mirror = zeros == 0
    if mirror.any():
        top = (1 << bits) - 1
        q = unpack_rows(qweight, bits)                                      # [in, out]
        qweight = pack_rows(torch.where(mirror[g_idx.long()], top - q, q), bits)
        zeros = torch.where(mirror, top, zeros)
        scales = torch.where(mirror, -scales, scales)
    return {"qweight": qweight, "qzeros": pack_cols(zeros - 1, bits), "scales": scales, "g_idx": g_idx}


def unpack_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ v1 ``qweight``/``qzeros`` → ``q [out, in]``, true ``zeros [G, out]`` (stored value + 1)."""
    q = unpack_rows(qweight, bits).t().contiguous()
    return q, unpack_cols(qzeros, bits) + 1


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    g_idx: torch.Tensor | None, bits: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight ``[out, in]`` of a GPTQ v1 layer: ``w[:, k] = (q[:, k] - z[g_idx[k]]) * s[g_idx[k]]``.
    ``g_idx=None`` means contiguous groups of ``in / G``."""
    q, zeros = unpack_gptq(qweight, qzeros, bits)
    in_f = q.shape[1]
    n_groups = scales.shape[0]
    if g_idx is None:
        g_idx = default_g_idx(in_f, resolve_group_size(in_f // max(n_groups, 1), in_f), qweight.device)
    if g_idx.numel() != in_f or zeros.shape != scales.shape:
        raise ValueError(f"GPTQ shapes disagree: qweight {tuple(qweight.shape)} ({bits}-bit), qzeros "
                         f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)}, g_idx {tuple(g_idx.shape)}")
    g = g_idx.long()
    w = (q.float() - zeros.float()[g].t()) * scales.float()[g].t()
    return w.to(dtype)


# ------------------------------------------------------------------------------- the weight a layer owns


@dataclass
class QuantWeight:
    """Packed tensors of one quantized linear layer plus what is needed to read them.

    ``fmt`` is ``"awq"`` (AWQ-GEMM, packed along out, interleaved) or ``"gptq"`` (v1, packed along in,
    zero+1). ``group_size`` is the resolved size (never -1). ``g_idx`` is kept only when it differs from
    contiguous groups (act-order); otherwise it is None and groups are ``k // group_size``."""

    fmt: str
    bits: int
    group_size: int
    in_features: int
    out_features: int
    qweight: torch.Tensor
    qzeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_awq(cls, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                 group_size: int) -> "QuantWeight":
        in_f, out_f = qweight.shape[0], qweight.shape[1] * 8
        g = resolve_group_size(group_size, in_f)
        expect = {"qweight": (in_f, out_f // 8), "qzeros": (in_f // g, out_f // 8), "scales": (in_f // g, out_f)}
        _check_shapes("AWQ", expect, {"qweight": qweight, "qzeros": qzeros, "scales": scales})
        return cls("awq", 4, g, in_f, out_f, qweight.contiguous(), qzeros.contiguous(), scales.contiguous())

    @classmethod
    def from_gptq(cls, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                  g_idx: torch.Tensor | None, bits: int, group_size: int | None = None) -> "QuantWeight":
        if bits not in SUPPORTED_BITS["gptq"]:
            raise ValueError(f"GPTQ supports bits {SUPPORTED_BITS['gptq']}, got {bits}")
        per_word = 32 // bits
        in_f, out_f = qweight.shape[0] * per_word, qweight.shape[1]
        n_groups = scales.shape[0]
        g = resolve_group_size(group_size, in_f) if group_size is not None else in_f // max(n_groups, 1)
        g = resolve_group_size(g, in_f)
        expect = {"qweight": (in_f // per_word, out_f), "qzeros": (in_f // g, out_f // per_word),
                  "scales": (in_f // g, out_f)}
        _check_shapes("GPTQ", expect, {"qweight": qweight, "qzeros": qzeros, "scales": scales})
        if g_idx is not None:
            if g_idx.numel() != in_f:
                raise ValueError(f"GPTQ g_idx has {g_idx.numel()} entries, expected {in_f}")
            g_idx = g_idx.to(torch.int32).contiguous()
            if torch.equal(g_idx, default_g_idx(in_f, g, g_idx.device)):
                g_idx = None
        return cls("gptq", bits, g, in_f, out_f, qweight.contiguous(), qzeros.contiguous(), scales.contiguous(),
                   g_idx)

    @property
    def act_order(self) -> bool:
        return self.g_idx is not None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight ``[out, in]``."""
        if self.fmt == "awq":
            return dequantize_awq(self.qweight, self.qzeros, self.scales, self.group_size, dtype)
        g_idx = self.g_idx if self.g_idx is not None else default_g_idx(self.in_features, self.group_size,
                                                                        self.qweight.device)
        return dequantize_gptq(self.qweight, self.qzeros, self.scales, g_idx, self.bits, dtype)

    def to(self, device=None, scales_dtype: torch.dtype | None = None) -> "QuantWeight":
        mv = (lambda t: None if t is None else t.to(device))
        scales = mv(self.scales)
        if scales_dtype is not None:
            scales = scales.to(scales_dtype)
        return replace(self, qweight=mv(self.qweight), qzeros=mv(self.qzeros), scales=scales,
                       g_idx=mv(self.g_idx))

    def tensors(self) -> dict[str, torch.Tensor]:
        """The checkpoint tensors under their usual names (GPTQ always writes a g_idx)."""
        out = {"qweight": self.qweight, "qzeros": self.qzeros, "scales": self.scales}
        if self.fmt == "gptq":
            out["g_idx"] = self.g_idx if self.g_idx is not None else default_g_idx(
                self.in_features, self.group_size, self.qweight.device)
        return out


def awq_to_gptq(qw: QuantWeight, chunk: int = 8192) -> QuantWeight:
    """The same 4-bit AWQ-GEMM weight in the GPTQ v1 layout (packed along *in*), exactly: every weight
    dequantizes to the same value, so the kernels written for GPTQ (the one-row ``half2`` GEMV) serve AWQ
    checkpoints too. GPTQ v1 stores ``zero - 1`` and cannot hold a zero point of 0; such a (group, column) is
    stored mirrored — codes ``15 - q``, zero 15, scale ``-s`` — since ``(15 - q - 15)·(-s) = (q - 0)·s``.
    Converted ``chunk`` output columns (a multiple of 8) at a time: the unpacked codes of a whole LM head would take
    gigabytes. The scales keep their dtype. ``extra["from"]`` records the source format."""
    if qw.fmt != "awq":
        raise ValueError(f"awq_to_gptq takes an AWQ weight, not {qw.fmt}")
    if chunk <= 0 or chunk % 8 or qw.in_features % 8:
        raise ValueError(f"awq_to_gptq needs whole 8-column chunks (got {chunk}) and inputs in whole GPTQ words "
                         f"(got {qw.in_features})")
    g_idx = default_g_idx(qw.in_features, qw.group_size, qw.qweight.device)
    qweight = torch.empty(qw.in_features // 8, qw.out_features, dtype=torch.int32, device=qw.qweight.device)
    qzeros = torch.empty_like(qw.qzeros)
    scales = torch.empty_like(qw.scales)
    for c0 in range(0, qw.out_features, chunk):
        c1 = min(c0 + chunk, qw.out_features)
        q, zeros = unpack_awq(qw.qweight[:, c0 // 8:c1 // 8], qw.qzeros[:, c0 // 8:c1 // 8])
        s = qw.scales[:, c0:c1]
        mirror = zeros == 0                                                  # [G, cols]
        q = torch.where(mirror[g_idx.long()].t(), 15 - q, q)
        p = pack_gptq(q, torch.where(mirror, 15, zeros), s, g_idx, 4)
        qweight[:, c0:c1] = p["qweight"]
        qzeros[:, c0 // 8:c1 // 8] = p["qzeros"]
        scales[:, c0:c1] = torch.where(mirror, -s, s)
    out = QuantWeight.from_gptq(qweight, qzeros, scales, None, 4, qw.group_size)
    out.extra["from"] = "awq"
    return out


def _check_shapes(name: str, expect: dict[str, tuple[int, int]], got: dict[str, torch.Tensor]) -> None:
    for key, shape in expect.items():
        if tuple(got[key].shape) != shape:
            raise ValueError(f"{name} {key} has shape {tuple(got[key].shape)}, expected {shape}")
    for key in ("qweight", "qzeros"):
        if got[key].dtype != torch.int32:
            raise ValueError(f"{name} {key} must be int32, got {got[key].dtype}")


def quantize_to_awq(weight: torch.Tensor, group_size: int = 128) -> QuantWeight:
    """RTN-quantize a float ``weight [out, in]`` to a 4-bit AWQ-GEMM layer (asym, zero point)."""
    gq = quantize_rtn(weight, 4, group_size, sym=False)
    p = pack_awq(gq.q, gq.zeros, gq.scales)
    return QuantWeight.from_awq(p["qweight"], p["qzeros"], p["scales"], gq.group_size)


def quantize_to_gptq(weight: torch.Tensor, bits: int = 4, group_size: int = 128, sym: bool = True,
                     g_idx: torch.Tensor | None = None) -> QuantWeight:
    """RTN-quantize a float ``weight [out, in]`` to a GPTQ v1 layer (``g_idx`` for act-order groups)."""
    gq = quantize_rtn(weight, bits, group_size, sym=sym, g_idx=g_idx, zero_min=0 if sym else 1)
    p = pack_gptq(gq.q, gq.zeros, gq.scales, gq.g_idx, bits)
    return QuantWeight.from_gptq(p["qweight"], p["qzeros"], p["scales"], p["g_idx"], bits, gq.group_size)
