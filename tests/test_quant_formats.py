"""AWQ-GEMM / GPTQ v1 packing checked against words built bit by bit from the format definitions."""

from __future__ import annotations

import pytest
import torch

from nvllm.quant import formats as F
from nvllm.quant import quant_config as QC

ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # written out again here, independent of the module's constant


def signed32(word: int) -> int:
    word &= 0xFFFFFFFF
    return word - (1 << 32) if word >= (1 << 31) else word


def awq_words(mat: list[list[int]]) -> list[list[int]]:
    """mat [rows][cols] of nibbles → AWQ words [rows][cols/8]: nibble i of word c = column c*8+ORDER[i]."""
    out = []
    for row in mat:
        words = []
        for c in range(len(row) // 8):
            w = 0
            for i in range(8):
                w |= row[c * 8 + ORDER[i]] << (4 * i)
            words.append(signed32(w))
        out.append(words)
    return out


def gptq_qweight_words(q_out_in: list[list[int]], bits: int) -> list[list[int]]:
    """q [out][in] → GPTQ qweight [in*bits/32][out]: row r holds inputs r*P..r*P+P-1, lowest bits first."""
    per = 32 // bits
    n_out, n_in = len(q_out_in), len(q_out_in[0])
    rows = []
    for r in range(n_in // per):
        row = []
        for n in range(n_out):
            w = 0
            for i in range(per):
                w |= q_out_in[n][r * per + i] << (bits * i)
            row.append(signed32(w))
        rows.append(row)
    return rows


def gptq_qzeros_words(zeros: list[list[int]], bits: int) -> list[list[int]]:
    """zeros [G][out] → qzeros [G][out*bits/32], each field holding zero - 1, plain order."""
    per = 32 // bits
    out = []
    for row in zeros:
        words = []
        for c in range(len(row) // per):
            w = 0
            for i in range(per):
                w |= (row[c * per + i] - 1) << (bits * i)
            words.append(signed32(w))
        out.append(words)
    return out


def rand_int(shape, lo, hi, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int32)


# ------------------------------------------------------------------------------------------------ AWQ


def test_awq_order_constants():
    assert list(F.AWQ_PACK_ORDER) == ORDER
    # column j sits in nibble UNPACK[j]: the inverse permutation
    assert [ORDER.index(j) for j in range(8)] == list(F.AWQ_UNPACK_ORDER) == [0, 4, 1, 5, 2, 6, 3, 7]


def test_awq_pack_matches_bitwise_definition():
    out_f, in_f, g = 16, 8, 4
    q = rand_int((out_f, in_f), 0, 16, 1)
    zeros = rand_int((in_f // g, out_f), 0, 16, 2)
    scales = torch.rand(in_f // g, out_f) + 0.5
    p = F.pack_awq(q, zeros, scales)
    assert p["qweight"].dtype == torch.int32 and p["qweight"].shape == (in_f, out_f // 8)
    assert p["qzeros"].shape == (in_f // g, out_f // 8)
    assert p["scales"].dtype == torch.float16 and p["scales"].shape == (in_f // g, out_f)
    assert p["qweight"].tolist() == awq_words(q.t().tolist())
    assert p["qzeros"].tolist() == awq_words(zeros.tolist())   # zeros stored as they are
    assert bool((p["qweight"] < 0).any())                      # a top nibble >= 8 makes the int32 negative
    q2, z2 = F.unpack_awq(p["qweight"], p["qzeros"])
    assert torch.equal(q2, q) and torch.equal(z2, zeros)


def test_awq_nibble_positions():
    # one non-zero value per out column: column j of the first word must land in nibble ORDER.index(j)
    for j in range(8):
        q = torch.zeros(8, 1, dtype=torch.int32)   # [out=8, in=1]
        q[j, 0] = 0xB
        word = F.pack_awq(q, torch.zeros(1, 8, dtype=torch.int32), torch.ones(1, 8))["qweight"][0, 0].item()
        assert word & 0xFFFFFFFF == 0xB << (4 * ORDER.index(j))
    # column 1 is nibble 4 (bits 16..19), column 2 is nibble 1
    assert F.AWQ_UNPACK_ORDER[1] == 4 and F.AWQ_UNPACK_ORDER[2] == 1


def test_dequantize_awq_formula():
    out_f, in_f, g = 16, 12, 4
    q = rand_int((out_f, in_f), 0, 16, 3)
    zeros = rand_int((in_f // g, out_f), 0, 16, 4)
    scales = (torch.rand(in_f // g, out_f) + 0.1).half()
    p = F.pack_awq(q, zeros, scales)
    w = F.dequantize_awq(p["qweight"], p["qzeros"], p["scales"], g)
    assert w.shape == (out_f, in_f)
    for n in range(out_f):
        for k in range(in_f):
            expect = (q[n, k].item() - zeros[k // g, n].item()) * scales[k // g, n].float().item()
            assert w[n, k].item() == pytest.approx(expect, abs=1e-6)


def test_awq_rejects_bad_values_and_shapes():
    with pytest.raises(ValueError):
        F.pack_awq(torch.full((8, 4), 16, dtype=torch.int32), torch.zeros(1, 8, dtype=torch.int32), torch.ones(1, 8))
    p = F.pack_awq(torch.zeros(8, 4, dtype=torch.int32), torch.zeros(1, 8, dtype=torch.int32), torch.ones(1, 8))
    with pytest.raises(ValueError):
        F.QuantWeight.from_awq(p["qweight"], p["qzeros"], p["scales"], group_size=2)   # expects 2 groups


# ----------------------------------------------------------------------------------------------- GPTQ


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_pack_matches_bitwise_definition(bits):
    out_f, in_f, g = 8, 16, 8
    maxq = 2**bits - 1
    q = rand_int((out_f, in_f), 0, maxq + 1, 5 + bits)
    zeros = rand_int((in_f // g, out_f), 1, maxq + 2, 6 + bits)       # v1 can hold 1 .. 2^bits
    scales = torch.rand(in_f // g, out_f) + 0.5
    g_idx = F.default_g_idx(in_f, g)
    p = F.pack_gptq(q, zeros, scales, g_idx, bits)
    per = 32 // bits
    assert p["qweight"].shape == (in_f // per, out_f) and p["qzeros"].shape == (in_f // g, out_f // per)
    assert p["g_idx"].dtype == torch.int32
    assert p["qweight"].tolist() == gptq_qweight_words(q.tolist(), bits)
    assert p["qzeros"].tolist() == gptq_qzeros_words(zeros.tolist(), bits)
    q2, z2 = F.unpack_gptq(p["qweight"], p["qzeros"], bits)
    assert torch.equal(q2, q) and torch.equal(z2, zeros)


def test_gptq_4bit_row_holds_eight_inputs_lowest_first():
    q = torch.zeros(8, 8, dtype=torch.int32)   # [out=8, in=8]
    q[0] = torch.arange(1, 9)                  # out 0: input i has value i+1 (8 in nibble 7 sets the sign bit)
    p = F.pack_gptq(q, torch.ones(1, 8, dtype=torch.int32), torch.ones(1, 8), F.default_g_idx(8, 8), 4)
    assert p["qweight"].shape == (1, 8)
    assert p["qweight"][0, 0].item() & 0xFFFFFFFF == 0x87654321 and p["qweight"][0, 0].item() < 0
    assert p["qzeros"].item() == 0                # zero 1 stored as 0


@pytest.mark.parametrize("bits,word", [(4, 0x77777777), (8, 0x7F7F7F7F)])
def test_gptq_symmetric_zero_stored_minus_one(bits, word):
    w = torch.randn(32, 64)
    qw = F.quantize_to_gptq(w, bits=bits, group_size=32, sym=True)
    assert bool((qw.qzeros == word).all())           # zero 2^(bits-1) stored as 2^(bits-1) - 1
    _, zeros = F.unpack_gptq(qw.qweight, qw.qzeros, bits)
    assert bool((zeros == 2 ** (bits - 1)).all())


def test_gptq_zero_point_zero_is_rejected():
    q = torch.zeros(8, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="zero-1"):
        F.pack_gptq(q, torch.zeros(1, 8, dtype=torch.int32), torch.ones(1, 8), F.default_g_idx(8, 8), 4)
    # zero 16 is representable (stored 15, read back 16)
    p = F.pack_gptq(q, torch.full((1, 8), 16, dtype=torch.int32), torch.ones(1, 8), F.default_g_idx(8, 8), 4)
    assert p["qzeros"].item() & 0xFFFFFFFF == 0xFFFFFFFF
    assert bool((F.unpack_gptq(p["qweight"], p["qzeros"], 4)[1] == 16).all())


def test_rtn_zero_min_keeps_gptq_representable():
    w = torch.rand(16, 64) + 0.1                      # all positive: the natural zero point is 0
    assert int(F.quantize_rtn(w, 4, 32).zeros.min()) == 0
    gq = F.quantize_rtn(w, 4, 32, zero_min=1)
    assert int(gq.zeros.min()) >= 1
    assert (gq.dequantize() - w).abs().max() <= gq.scales.float().max() * 0.51
    qw = F.quantize_to_gptq(w, bits=4, group_size=32, sym=False)
    assert torch.allclose(qw.dequantize(), gq.dequantize())


def test_dequantize_gptq_act_order_formula():
    out_f, in_f, g, bits = 8, 32, 8, 4
    perm = torch.randperm(in_f, generator=torch.Generator().manual_seed(7))
    g_idx = F.act_order_g_idx(perm, g)
    assert [g_idx[perm[i]].item() for i in range(in_f)] == [i // g for i in range(in_f)]
    assert not bool((g_idx[1:] >= g_idx[:-1]).all())  # non-monotone
    q = rand_int((out_f, in_f), 0, 16, 8)
    zeros = rand_int((in_f // g, out_f), 1, 17, 9)
    scales = (torch.rand(in_f // g, out_f) + 0.1).half()
    p = F.pack_gptq(q, zeros, scales, g_idx, bits)
    w = F.dequantize_gptq(p["qweight"], p["qzeros"], p["scales"], p["g_idx"], bits)
    for n in range(out_f):
        for k in range(in_f):
            grp = g_idx[k].item()
            expect = (q[n, k].item() - zeros[grp, n].item()) * scales[grp, n].float().item()
            assert w[n, k].item() == pytest.approx(expect, abs=1e-6)
    qw = F.QuantWeight.from_gptq(p["qweight"], p["qzeros"], p["scales"], p["g_idx"], bits)
    assert qw.act_order and qw.group_size == g and torch.equal(qw.dequantize(), w)
    # a trivial g_idx is dropped (contiguous groups), and written back on save
    p2 = F.pack_gptq(q, zeros, scales, F.default_g_idx(in_f, g), bits)
    qw2 = F.QuantWeight.from_gptq(p2["qweight"], p2["qzeros"], p2["scales"], p2["g_idx"], bits)
    assert qw2.g_idx is None and torch.equal(qw2.tensors()["g_idx"], F.default_g_idx(in_f, g))


def test_rtn_act_order_groups_share_scales():
    w = torch.randn(8, 64)
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(3))
    g_idx = F.act_order_g_idx(perm, 16)
    gq = F.quantize_rtn(w, 4, 16, g_idx=g_idx)
    for grp in range(4):
        cols = (g_idx == grp).nonzero().flatten()
        amax = torch.maximum(w[:, cols].amax(1).clamp(min=0), -w[:, cols].amin(1).clamp(max=0))
        assert bool((gq.scales[grp].float() * 15 >= amax * 0.99).all())
    with pytest.raises(ValueError, match="exactly"):
        F.quantize_rtn(w, 4, 16, g_idx=torch.zeros(64, dtype=torch.int32))


@pytest.mark.parametrize("bits,sym", [(4, False), (4, True), (8, False), (8, True)])
def test_rtn_error_within_half_step(bits, sym):
    w = torch.randn(32, 128)
    gq = F.quantize_rtn(w, bits, 32, sym=sym)
    step = gq.scales.float()[gq.g_idx.long()].t()
    # half a step, plus the drift of the range ends from rounding the scale to fp16 (maxq · 2^-11 steps)
    slack = (2**bits - 1) * 2.0**-11 + 1e-3
    assert bool(((gq.dequantize() - w).abs() <= step * (0.5 + slack)).all())
    assert int(gq.q.min()) >= 0 and int(gq.q.max()) <= 2**bits - 1


def test_quantize_to_awq_round_trip():
    w = torch.randn(64, 256)
    qw = F.quantize_to_awq(w, group_size=64)
    assert (qw.fmt, qw.bits, qw.group_size, qw.in_features, qw.out_features) == ("awq", 4, 64, 256, 64)
    gq = F.quantize_rtn(w, 4, 64)
    assert torch.equal(qw.dequantize(), gq.dequantize())
    q, z = F.unpack_awq(qw.qweight, qw.qzeros)
    assert torch.equal(q, gq.q) and torch.equal(z, gq.zeros)


def test_group_size_minus_one_is_per_channel():
    w = torch.randn(16, 64)
    qw = F.quantize_to_gptq(w, bits=8, group_size=-1, sym=True)
    assert qw.group_size == 64 and qw.scales.shape == (1, 16)


# ------------------------------------------------------------------------------------ quantization_config


def test_config_dicts_as_written_by_the_tools():
    assert QC.awq_quantization_config() == {"quant_method": "awq", "zero_point": True, "group_size": 128,
                                           "bits": 4, "version": "gemm", "modules_to_not_convert": None}
    g = QC.gptq_quantization_config(bits=8, group_size=64, desc_act=True, sym=False)
    assert list(g) == ["bits", "group_size", "damp_percent", "desc_act", "static_groups", "sym",
                       "true_sequential", "model_name_or_path", "model_file_base_name", "quant_method",
                       "checkpoint_format"]
    assert (g["quant_method"], g["checkpoint_format"], g["bits"], g["group_size"], g["desc_act"], g["sym"],
            g["damp_percent"], g["static_groups"], g["true_sequential"]) == \
        ("gptq", "gptq", 8, 64, True, False, 0.01, False, True)


def test_parse_configs():
    a = QC.parse_quantization_config({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                                     "version": "gemm"})
    assert a == QC.QuantConfig("awq", 4, 128, desc_act=False, sym=False, packing="awq_gemm")
    assert QC.parse_quantization_config({"quant_method": "AWQ", "w_bit": 4, "q_group_size": 64,
                                        "zero_point": True, "version": "GEMM"}).group_size == 64
    gp = QC.parse_quantization_config(QC.gptq_quantization_config(bits=8, group_size=-1, desc_act=True))
    assert gp == QC.QuantConfig("gptq", 8, -1, desc_act=True, sym=True, packing="gptq_v1")
    # older AutoGPTQ configs carry neither quant_method nor checkpoint_format
    assert QC.parse_quantization_config({"bits": 4, "group_size": 128, "desc_act": False}).method == "gptq"


@pytest.mark.parametrize("cfg,match", [
    ({"quant_method": "awq", "bits": 8, "group_size": 128, "version": "gemm"}, "bits"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero_point"),
    ({"quant_method": "gptq", "bits": 3, "group_size": 128}, "bits"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"}, "checkpoint_format"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "gptq_v3"}, "checkpoint_format"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "is_marlin_format": True}, "marlin"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": "yes"}, "desc_act"),
    ({"quant_method": "bitsandbytes"}, "quant_method"),
    ([], "JSON object"),
])
def test_parse_rejects_unsupported(cfg, match):
    with pytest.raises(ValueError, match=match):
        QC.parse_quantization_config(cfg)


@pytest.mark.parametrize("chunk", [8, 24, 8192])
def test_awq_to_gptq_is_exact(chunk):
    """Every weight dequantizes to the same value in the GPTQ v1 layout; a zero point of 0 (not storable in v1)
    is mirrored: codes 15 - q, stored zero 15 - 1 = 14, scale negated."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (40, 128), generator=gen, dtype=torch.int32)
    zeros = torch.randint(1, 16, (4, 40), generator=gen, dtype=torch.int32)
    zeros[1, :9] = 0                                        # the only zero points of 0
    scales = (torch.rand(4, 40, generator=gen) * 1e-2 + 1e-3).half()
    p = F.pack_awq(q, zeros, scales)
    awq = F.QuantWeight.from_awq(p["qweight"], p["qzeros"], p["scales"], 32)
    gptq = F.awq_to_gptq(awq, chunk=chunk)
    assert (gptq.fmt, gptq.bits, gptq.group_size, gptq.g_idx, gptq.extra) == ("gptq", 4, 32, None, {"from": "awq"})
    assert torch.equal(gptq.dequantize(), awq.dequantize())
    q2, z2 = F.unpack_gptq(gptq.qweight, gptq.qzeros, 4)
    assert torch.equal(z2[1, :9], torch.full((9,), 15, dtype=torch.int32))
    assert torch.equal(q2[:9, 32:64], 15 - q[:9, 32:64]) and torch.equal(q2[9:], q[9:])
    assert torch.equal(gptq.scales[1, :9], -scales[1, :9])
    with pytest.raises(ValueError, match="takes an AWQ weight"):
        F.awq_to_gptq(gptq)
