"""Known-answer tests of the reference stages (kvfuse.reference), SPEC §6.

Expected values are worked out by hand in the comments (or by an independent numpy / float64
computation of the SPEC's formula), never by running the reference a second time.
e4m3 byte = sign<<7 | E<<3 | M, value 2^(E-7) * (1 + M/8) for E >= 1, M * 2^-9 for E = 0.
"""
import dataclasses
import math
import struct

import numpy as np
import pytest
import torch

from kvfuse import reference as R
from kvfuse.formats import INDEX_FP8_FP32, MAIN_FP8, allocate_kv_cache

F32 = torch.float32
BF16 = torch.bfloat16


def bf16(vals):
    t = torch.tensor(vals, dtype=F32)
    b = t.to(BF16)
    assert torch.equal(b.to(F32), t), "test value not exactly representable in bf16"
    return b


def u8(t):
    return t.contiguous().view(torch.uint8)


def np_bf16_bits(f):
    """fp32 numpy -> bf16 bit patterns (uint16), round to nearest even (finite values), by integers."""
    u = np.asarray(f, dtype=np.float32).view(np.uint32).astype(np.uint64)
    r = ((u >> 16) & 1) + 0x7FFF
    return ((u + r) >> 16).astype(np.uint16)


def bf16_bits(t):
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def test_constants():
    assert R.AMAX_MARGIN == 1e-4
    assert R.E4M3_SF_MIN == 2.0 ** -9


# ============================================================================ UE8M0 scales
@pytest.mark.parametrize("cast_fmt,amax,byte", [
    ("e4m3", 448.0, 127),              # s = 1       -> e = 0
    ("e4m3", 449.0, 128),              # s > 1       -> e = ceil(log2 s) = 1
    ("e4m3", 896.0, 128),              # s = 2       -> e = 1 exactly
    ("e4m3", 897.0, 129),              # s just above 2 -> 2
    ("e4m3", 224.0, 126),              # s = 1/2     -> -1
    ("e4m3", 225.0, 127),              # s in (1/2, 1] -> 0
    ("e4m3", 1e-4, 105),               # s = 1e-4/448 = 2.23e-7, 2^-23 < s <= 2^-22 -> -22
    ("e4m3", 3.0e38, 247),             # s = 6.7e35, 2^119 < s <= 2^120 -> 120
    ("e2m1", 6.0, 127),                # fmax 6
    ("e2m1", 6.03125, 128),
    ("e2m1", 3.0, 126),
    ("e2m1", 1e-4, 112),               # s = 1.67e-5, 2^-16 < s <= 2^-15 -> -15
])
def test_ue8m0_exponent(cast_fmt, amax, byte):
    a = torch.tensor([amax], dtype=F32)
    stored, m, d = R.group_scales(a, cast_fmt, "ue8m0")
    e = byte - 127
    assert stored.dtype == torch.uint8 and int(stored[0]) == byte
    assert float(m[0]) == 2.0 ** -e and float(d[0]) == 2.0 ** e
    stored32, m2, d2 = R.group_scales(a, cast_fmt, "ue8m0_fp32")
    assert stored32.dtype == F32 and float(stored32[0]) == 2.0 ** e
    assert bytes(u8(stored32).tolist()) == struct.pack("<f", 2.0 ** e)


def test_amax_floor_through_quantize():
    # tiny (but nonzero) values: amax = max(6e-8, 1e-4) = 1e-4 -> UE8M0 byte 105; t = v * 2^22 = 0.25 -> ...
    x = bf16([2.0 ** -24] * 32)
    q, sf = R.quantize(x[None], "e4m3", 32, "ue8m0")
    assert int(sf[0, 0]) == 105
    # t = 2^-24 * 2^22 = 2^-2 = 0.25 -> E = -2 + 7 = 5, M = 0 -> 0x28
    assert u8(q).unique().tolist() == [0x28]


# ============================================================================ e4m3 encoding
# (fp32 value, e4m3 byte) worked out by hand
E4M3_KNOWN = [
    (0.0, 0x00), (-0.0, 0x80),
    (2.0 ** -9, 0x01),                 # smallest subnormal
    (0.5 * 2 ** -9, 0x00),             # tie between 0 and 2^-9 -> even code 0
    (-0.5 * 2 ** -9, 0x80),            # negative value rounding to zero keeps the sign
    (-(2.0 ** -12), 0x80), (-1e-30, 0x80),
    (0.75 * 2 ** -9, 0x01),            # above the tie
    (1.5 * 2 ** -9, 0x02),             # tie between codes 1 and 2 -> even 2
    (2.5 * 2 ** -9, 0x02),             # tie between codes 2 and 3 -> even 2
    (3.5 * 2 ** -9, 0x04),             # tie between codes 3 and 4 -> even 4
    (7.5 * 2 ** -9, 0x08),             # tie between code 7 (7*2^-9) and 2^-6 (code 8) -> 8
    (2.0 ** -6, 0x08),                 # smallest normal, E = 1
    (2.0 ** -6 * 1.0625, 0x08),        # normal tie -> M = 0
    (2.0 ** -6 * 1.1875, 0x0A),        # tie between M = 1 and M = 2 -> 2
    (1.0, 0x38), (1.0625, 0x38),       # tie between 1.0 (M=0) and 1.125 (M=1) -> 1.0
    (1.0625 + 2 ** -23, 0x39),         # just above the tie
    (1.0625 - 2 ** -23, 0x38),
    (1.1875, 0x3A),                    # tie between 1.125 (M=1) and 1.25 (M=2) -> 1.25
    (1.9375, 0x40),                    # tie between 1.875 (M=7) and 2.0 -> carry into the exponent
    (17.0, 0x58),                      # tie 16 / 18 -> 16 (E = 11)
    (19.0, 0x5A),                      # tie 18 / 20 -> 20
    (100.0, 0x6C),                     # 2^6 * 1.5625: M = 4.5 -> tie -> 4 (96)
    (-3.0, 0xC4),                      # 2^1 * 1.5: E = 8, M = 4, sign
    (5.5, 0x4B), (0.125, 0x20), (240.0, 0x77), (416.0, 0x7D),
    (424.0, 0x7D),                     # below the 416/448 midpoint
    (432.0, 0x7E),                     # tie 416 (M=5) / 448 (M=6) -> 448
    (448.0, 0x7E), (-448.0, 0xFE),
]


def test_encode_e4m3_known_answers():
    vals = torch.tensor([v for v, _ in E4M3_KNOWN], dtype=F32)
    got = R.encode_e4m3(vals)
    assert got.dtype == torch.uint8
    assert got.tolist() == [b for _, b in E4M3_KNOWN]
    # decode: the representable values decode to themselves
    dec = R.decode_e4m3(torch.tensor([0x01, 0x08, 0x38, 0x7E, 0xFE, 0x80, 0x26], dtype=torch.uint8))
    assert dec.tolist() == [2.0 ** -9, 2.0 ** -6, 1.0, 448.0, -448.0, -0.0, 0.21875]
    assert math.copysign(1.0, float(dec[5])) == -1.0


def test_quantize_e4m3_known_answers_unit_scale():
    """A group of 32 bf16 values with amax 448: UE8M0 e = 0, m = 1, so t = v and q = e4m3(v)."""
    pairs = [(448.0, 0x7E), (-448.0, 0xFE), (1.0, 0x38), (1.0625, 0x38), (1.1875, 0x3A), (1.9375, 0x40),
             (432.0, 0x7E), (416.0, 0x7D), (424.0, 0x7D), (2.0 ** -9, 0x01), (1.5 * 2 ** -9, 0x02),
             (2.5 * 2 ** -9, 0x02), (3.5 * 2 ** -9, 0x04), (0.5 * 2 ** -9, 0x00), (-0.5 * 2 ** -9, 0x80),
             (-(2.0 ** -12), 0x80), (7.5 * 2 ** -9, 0x08), (2.0 ** -6, 0x08), (2.0 ** -6 * 1.0625, 0x08),
             (2.0 ** -6 * 1.1875, 0x0A), (0.0, 0x00), (-0.0, 0x80), (0.75 * 2 ** -9, 0x01), (240.0, 0x77),
             (17.0, 0x58), (19.0, 0x5A), (-3.0, 0xC4), (0.125, 0x20), (5.5, 0x4B), (100.0, 0x6C),
             (-1.0, 0xB8), (2.0, 0x40)]
    assert len(pairs) == 32
    x = bf16([v for v, _ in pairs])[None]
    q, sf = R.quantize(x, "e4m3", 32, "ue8m0")
    assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == (1, 32)
    assert sf.dtype == torch.uint8 and sf.tolist() == [[127]]
    assert u8(q)[0].tolist() == [b for _, b in pairs]


def test_quantize_e4m3_power_of_two_scale():
    # amax 900: s = 900/448 = 2.009 -> e = 2 (byte 129), m = 1/4; t(900) = 225 -> 2^7*1.7578: M = 6.06 -> 6 (224)
    # t(-8) = -2 -> 0xC0; t(1) = 0.25 -> 0x28; t(0.0390625 = 5*2^-7) = 5*2^-9 -> subnormal code 5
    x = bf16([900.0, -8.0, 1.0, 0.0390625] + [0.0] * 28)[None]
    q, sf = R.quantize(x, "e4m3", 32, "ue8m0")
    assert sf.tolist() == [[129]]
    assert u8(q)[0, :4].tolist() == [0x76, 0xC0, 0x28, 0x05]
    # dequant: 224 * 4 = 896, -2*4 = -8, 0.25*4 = 1, 5*2^-9*4 = 5*2^-7
    back = R.dequantize(q, sf, "e4m3", 32, "ue8m0")
    assert back.dtype == BF16
    assert back[0, :4].tolist() == [896.0, -8.0, 1.0, 0.0390625]


# ============================================================================ e4m3 scale format
def test_e4m3_scale_rounding_and_clamp_high():
    # amax 100 (e4m3 cast, e4m3 sf): s = 100/448 = 0.2232 = 2^-3 * 1.786 -> M = 6.29 -> 6: 0.21875, byte 0x26
    # m = 1/0.21875; t(100) = 457.1 -> clamped to 448 (0x7E); t(0.21875) = 1 (0x38)
    x = bf16([100.0, 0.21875] + [0.0] * 14)[None]
    q, sf = R.quantize(x, "e4m3", 16, "e4m3")
    assert sf.dtype == torch.float8_e4m3fn
    assert u8(sf).tolist() == [[0x26]]
    assert u8(q)[0, :2].tolist() == [0x7E, 0x38]
    back = R.dequantize(q, sf, "e4m3", 16, "e4m3")
    assert back[0, :2].tolist() == [98.0, 0.21875]     # 448 * 0.21875 = 98
    # upper clamp of the scale: amax 2^18 -> s = 585.1 -> 448 (0x7E); t(2^18) = 585.1 -> 448 (0x7E)
    # t(448) = 448 * (1/448) -> 1.0 (0x38, whichever way the fp32 product rounds)
    x = bf16([2.0 ** 18, 448.0, -(2.0 ** 18)] + [0.0] * 13)[None]
    q, sf = R.quantize(x, "e4m3", 16, "e4m3")
    assert u8(sf).tolist() == [[0x7E]]
    assert u8(q)[0, :3].tolist() == [0x7E, 0x38, 0xFE]


@pytest.mark.parametrize("cast_fmt,g", [("e4m3", 16), ("e4m3", 64), ("e2m1", 16)])
def test_e4m3_scale_clamp_low_on_zero_group(cast_fmt, g):
    # amax floor 1e-4: s = 1e-4/fmax < 2^-9 -> clamped to 2^-9 = code 0x01; q all +0
    x = torch.zeros(2, g, dtype=BF16)
    q, sf = R.quantize(x, cast_fmt, g, "e4m3")
    assert u8(sf).tolist() == [[0x01], [0x01]]
    assert int(u8(q).max()) == 0


@pytest.mark.parametrize("cast_fmt,sf_format,g,expect_sf", [
    ("e4m3", "ue8m0", 32, bytes([105])),
    ("e2m1", "ue8m0", 32, bytes([112])),
    ("e4m3", "ue8m0_fp32", 64, struct.pack("<f", 2.0 ** -22)),
    ("e4m3", "e4m3", 32, bytes([0x01])),
    ("e2m1", "e4m3", 16, bytes([0x01])),
    ("e4m3", "fp32", 128, struct.pack("<f", np.float32(1e-4) / np.float32(448.0))),
])
def test_amax_margin_floor_on_all_zero_group(cast_fmt, sf_format, g, expect_sf):
    x = torch.zeros(1, g, dtype=BF16)
    q, sf = R.quantize(x, cast_fmt, g, sf_format)
    assert bytes(u8(sf).flatten().tolist()) == expect_sf
    assert int(u8(q).max()) == 0
    # negative zeros keep their sign: 0x80 for e4m3, 0x8 per nibble for e2m1
    qn, sfn = R.quantize(-x, cast_fmt, g, sf_format)
    assert bytes(u8(sfn).flatten().tolist()) == expect_sf
    assert u8(qn).unique().tolist() == [0x80 if cast_fmt == "e4m3" else 0x88]


def test_fp32_scale_bytes_little_endian():
    # amax 3: s = fp32(3) / fp32(448) stored as 4 little-endian bytes; m = fp32(448) / fp32(3)
    s = np.float32(3.0) / np.float32(448.0)
    m = np.float32(448.0) / np.float32(3.0)
    x = bf16([3.0, 1.5, -0.75] + [0.0] * 125)[None]
    q, sf = R.quantize(x, "e4m3", 128, "fp32")
    assert sf.dtype == F32
    assert bytes(u8(sf).flatten().tolist()) == struct.pack("<f", s)
    # t(1.5) = 1.5 * 149.33334 = 224.000004 -> fp32 224 -> 0x76; t(-0.75) -> -112 = -(2^6 * 1.75) -> 0xEE
    assert float(np.float32(1.5) * m) == 224.0
    assert u8(q)[0, :3].tolist() == [0x7E, 0x76, 0xEE]
    # through a cache: the scale bytes of the record are the same 4 little-endian bytes
    cache = allocate_kv_cache(INDEX_FP8_FP32, 1, 2)
    R.store(cache, torch.tensor([1]), INDEX_FP8_FP32, q[:, None], sf[:, None])
    flat = cache.as_strided((cache.untyped_storage().nbytes(),), (1,), 0)
    # block-wide: 2 tokens' data (2*128 bytes) then the scales, token 1 at +4
    assert bytes(flat[256 + 4:256 + 8].tolist()) == struct.pack("<f", s)
    assert flat[256:260].tolist() == [0, 0, 0, 0]
    assert flat[128:131].tolist() == [0x7E, 0x76, 0xEE]


# ============================================================================ e2m1
E2M1_PAIRS = [  # (value, code); index 0 and 16 hold +-6 so that every 16-group has amax 6
    (6.0, 7), (0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6),
    (-0.0, 8), (-0.1, 8), (4.0, 6), (0.5, 1), (1.0, 2), (1.5, 3), (2.0, 4), (3.0, 5),
    (-6.0, 15), (0.0, 0), (0.2578125, 1), (0.7421875, 1), (1.2578125, 3), (1.7421875, 3), (2.515625, 5),
    (3.484375, 5), (5.03125, 7), (4.96875, 6), (-2.5, 12), (-0.75, 10), (-5.0, 14), (0.125, 0),
    (-1.25, 10), (5.5, 7),
]


def test_encode_e2m1_known_answers():
    vals = torch.tensor([v for v, _ in E2M1_PAIRS], dtype=F32)
    assert R.encode_e2m1(vals).tolist() == [c for _, c in E2M1_PAIRS]


def test_pack_e2m1_nibble_order():
    codes = torch.tensor([[1, 2, 15, 0, 7, 8]], dtype=torch.uint8)
    # byte k = code[2k] (low nibble) | code[2k+1] << 4
    assert R.pack_e2m1(codes).tolist() == [[0x21, 0x0F, 0x87]]
    assert R.unpack_e2m1(torch.tensor([[0x21, 0x0F, 0x87]], dtype=torch.uint8)).tolist() == codes.tolist()


@pytest.mark.parametrize("g,sf_format,expect_sf", [(32, "ue8m0", [127]), (16, "e4m3", [0x38, 0x38])])
def test_quantize_e2m1_known_answers(g, sf_format, expect_sf):
    """amax 6 in each group: MXFP4 (ue8m0) e = 0; NVFP4 (e4m3) s = 1.0 = 0x38; m = 1 -> t = v."""
    vals = [v for v, _ in E2M1_PAIRS]
    x = torch.tensor(vals, dtype=F32).to(BF16)[None]
    q, sf = R.quantize(x, "e2m1", g, sf_format)
    assert q.dtype == torch.uint8 and tuple(q.shape) == (1, 16)
    assert u8(sf).flatten().tolist() == expect_sf
    codes = [c for _, c in E2M1_PAIRS]
    expect = [codes[2 * k] | (codes[2 * k + 1] << 4) for k in range(16)]
    assert q[0].tolist() == expect
    assert q[0, :3].tolist() == [0x07, 0x22, 0x44]    # (6, .25), (.75, 1.25), (1.75, 2.5)
    # dequantize: the code's value times 1
    back = R.dequantize(q, sf, "e2m1", g, sf_format)
    table = [0, .5, 1, 1.5, 2, 3, 4, 6]
    want = [(-1.0 if c & 8 else 1.0) * table[c & 7] for c in codes]
    assert back[0].tolist() == want
    assert math.copysign(1.0, float(back[0, 8])) == -1.0     # -0.0 -> code 8 -> -0.0


def test_e2m1_all_bf16_values_vs_brute_force():
    """Every finite bf16 value with |v| <= 6: nearest e2m1 magnitude, ties to the even code, sign kept."""
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16)
    v = bits.view(BF16).to(F32)
    v = v[torch.isfinite(v) & (v.abs() <= 6)]
    a = v.abs().double().numpy()
    mags = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)
    dist = np.abs(a[:, None] - mags[None, :])
    best = dist.min(axis=1, keepdims=True)
    cand = np.where(dist == best, np.arange(8)[None, :], 99)
    even = np.where((cand % 2 == 0) & (cand < 99), cand, 99).min(axis=1)
    code = np.where(even < 99, even, cand.min(axis=1))
    sign = np.signbit(v.numpy()).astype(np.int64) << 3
    assert R.encode_e2m1(v).numpy().astype(np.int64).tolist() == (code | sign).tolist()


# ============================================================================ e4m3 vs torch / brute force
def _e4m3_sweep_values():
    top = 0x43E00000                                    # bits of 448.0
    strided = torch.arange(0, top + 1, 263, dtype=torch.int64)
    # all e4m3 values and all midpoints between neighbours, +-64 fp32 ulps around each
    pos = R.decode_e4m3(torch.arange(0, 0x7F, dtype=torch.uint8))       # 0 .. 448
    mids = (pos[:-1].double() + pos[1:].double()) / 2
    anchors = torch.cat([pos.double(), mids]).to(F32)
    au = anchors.view(torch.int32).to(torch.int64)
    near = (au[:, None] + torch.arange(-64, 65)[None, :]).flatten()
    near = near[(near >= 0) & (near <= top)]
    u = torch.cat([strided, near, torch.tensor([top])]).to(torch.int32)
    v = u.view(F32)
    return torch.cat([v, -v])


def test_encode_e4m3_matches_torch_cast_dense_sweep():
    v = _e4m3_sweep_values()
    assert v.numel() > 8_000_000
    ours = R.encode_e4m3(v)
    theirs = v.to(torch.float8_e4m3fn).view(torch.uint8)
    bad = (ours != theirs).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} differ, first {float(v[bad[0]])!r}"


def test_encode_e4m3_all_bf16_vs_brute_force():
    """Every finite bf16 value with |v| <= 448 against a nearest-value search (ties to even M)."""
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16)
    v = bits.view(BF16).to(F32)
    v = v[torch.isfinite(v) & (v.abs() <= 448)]
    # independent table: codes 0..126, value by the e4m3 definition
    codes = np.arange(127)
    E, M = codes >> 3, codes & 7
    table = np.where(E == 0, M * 2.0 ** -9, 2.0 ** (E - 7) * (1 + M / 8.0))
    a = v.abs().double().numpy()
    dist = np.abs(a[:, None] - table[None, :])
    best = dist.min(axis=1, keepdims=True)
    cand = np.where(dist == best, codes[None, :], 999)
    even = np.where((cand % 2 == 0) & (cand < 999), cand, 999).min(axis=1)
    code = np.where(even < 999, even, cand.min(axis=1))
    sign = np.signbit(v.numpy()).astype(np.int64) << 7
    assert R.encode_e4m3(v).numpy().astype(np.int64).tolist() == (code | sign).tolist()


# ============================================================================ RoPE
def _rope_case(is_neox, conjugate, offset=None):
    x = bf16([[10, 20, 30, 40, 2, 3, 1, -2]])
    cs = torch.tensor([[9, 9, 9, 9], [0.5, 0.25, 0.75, -1.0], [7, 7, 7, 7]], dtype=F32)   # row 1: c0 c1 s0 s1
    return R.rope(x, torch.tensor([1]), cs, 4, is_neox, offset, conjugate)


@pytest.mark.parametrize("is_neox,conjugate,expect", [
    # NEOX pairs (4,6), (5,7): a=2,b=1,c=.5,s=.75 -> (1-.75, 1.5+.5); a=3,b=-2,c=.25,s=-1 -> (.75-2, -3-.5)
    (True, False, [10, 20, 30, 40, 0.25, -1.25, 2.0, -3.5]),
    # conjugate: (a*c + b*s, b*c - a*s): (1+.75, .5-1.5); (.75+2, -.5+3)
    (True, True, [10, 20, 30, 40, 1.75, 2.75, -1.0, 2.5]),
    # interleaved pairs (4,5), (6,7): a=2,b=3 -> (1-2.25, 1.5+1.5); a=1,b=-2,c=.25,s=-1 -> (.25-2, -1-.5)
    (False, False, [10, 20, 30, 40, -1.25, 3.0, -1.75, -1.5]),
    # interleaved conjugate: (1+2.25, 1.5-1.5); (.25+2, -.5+1)
    (False, True, [10, 20, 30, 40, 3.25, 0.0, 2.25, 0.5]),
])
def test_rope_known_answers(is_neox, conjugate, expect):
    y = _rope_case(is_neox, conjugate)
    assert y.dtype == BF16 and y.shape == (1, 8)
    assert y[0].tolist() == expect
    if not is_neox and conjugate:
        assert u8(y[0, 5:6]).tolist() == [0, 0]          # 1.5 - 1.5 = +0.0


def test_rope_offset_zero():
    # NEOX on dims 0..3: pairs (0,2): a=10,b=30,c=.5,s=.75 -> (5-22.5, 7.5+15); (1,3): a=20,b=40,c=.25,s=-1
    # -> (5+40, -20+10); dims 4..7 untouched
    y = _rope_case(True, False, offset=0)
    assert y[0].tolist() == [-17.5, 45.0, 22.5, -10.0, 2, 3, 1, -2]


def test_rope_positions_out_of_range_are_identity():
    x = bf16([[10, 20, 30, 40, 2, 3, 1, -2]] * 3)
    cs = torch.tensor([[0.5, 0.25, 0.75, -1.0]] * 3, dtype=F32)
    for pos_dtype in (torch.int32, torch.int64):
        y = R.rope(x, torch.tensor([3, -1, 1], dtype=pos_dtype), cs, 4, True)
        assert torch.equal(u8(y[:2]), u8(x[:2]))
        assert y[2].tolist() == [10, 20, 30, 40, 0.25, -1.25, 2.0, -3.5]


def test_rope_bf16_round_to_nearest_even():
    # head_dim 2, rotary 2: a=1, b=-3*2^-8, c=s=1 -> y0 = 1 + 3*2^-8 (tie between 1+2^-7 and 1+2^-6 -> 1+2^-6)
    # y1 = 1 - 3*2^-8 = 253/256 (exact)
    x = bf16([[1.0, -3 * 2 ** -8]])
    cs = torch.tensor([[1.0, 1.0]], dtype=F32)
    y = R.rope(x, torch.tensor([0]), cs, 2, True)
    assert y[0].tolist() == [1 + 2 ** -6, 253 / 256]
    # y0 = 1 + 2^-8 exactly: tie between 1 and 1+2^-7 -> 1
    x = bf16([[1.0, -(2 ** -8)]])
    assert R.rope(x, torch.tensor([0]), cs, 2, True)[0].tolist() == [1.0, 255 / 256]


def test_rope_each_product_rounded_no_fma():
    # a = b = 1 + 2^-7, c = s = fp32(1 + 2^-20): a*c = 1 + 2^-7 + 2^-20 + 2^-27 rounds to 1 + 2^-7 + 2^-20,
    # so y0 = a*c - b*s = 0 exactly (an FMA would give 2^-27); y1 = 2(1 + 2^-7 + 2^-20) -> bf16 2 + 2^-6
    x = bf16([[1 + 2 ** -7, 1 + 2 ** -7]])
    cs = torch.tensor([[1 + 2 ** -20, 1 + 2 ** -20]], dtype=F32)
    y = R.rope(x, torch.tensor([0]), cs, 2, True)
    assert u8(y[0, :1]).tolist() == [0, 0]
    assert float(y[0, 1]) == 2 + 2 ** -6


def test_rope_bf16_cos_sin_cache_and_heads():
    x = bf16([[[10, 20, 30, 40, 2, 3, 1, -2], [0, 0, 0, 0, 1, 1, 1, 1]]])          # [1, 2 heads, 8]
    cs = torch.tensor([[0.5, 0.25, 0.75, -1.0]], dtype=BF16)
    y = R.rope(x, torch.tensor([0]), cs, 4, True)
    assert y[0, 0].tolist() == [10, 20, 30, 40, 0.25, -1.25, 2.0, -3.5]
    # head 1: a=b=1: (.5-.75, .75+.5) = (-.25, 1.25); (.25+1, -1+.25) = (1.25, -.75)
    assert y[0, 1].tolist() == [0, 0, 0, 0, -0.25, 1.25, 1.25, -0.75]


# ============================================================================ Hadamard
def test_hadamard_4_point():
    # distance 1: (1+2, 1-2, 3+4, 3-4) = (3, -1, 7, -1); distance 2: (3+7, -1-1, 3-7, -1+1)
    x = bf16([[1, 2, 3, 4]])
    assert R.hadamard(x)[0].tolist() == [10, -2, -4, 0]
    assert R.hadamard(x, 0.5)[0].tolist() == [5, -1, -2, 0]


def test_hadamard_4_point_butterfly_order():
    # x = [2^24, 1, -2^24, 1]. distance 1 first: (2^24+1 -> 2^24 (tie, even), 2^24-1, -2^24+1, -2^24-1 -> -2^24)
    # then distance 2: (2^24 - (2^24-1), (2^24-1) - 2^24, 2^24 + 2^24-1 -> 2^25, 2^24-1 + 2^24 -> 2^25)
    # (distance 2 first would give [2, -2, 2^25, 2^25]; exact arithmetic [2, 0, 2^25, 2^25])
    x = bf16([[2.0 ** 24, 1.0, -(2.0 ** 24), 1.0]])
    assert R.hadamard(x)[0].tolist() == [1.0, -1.0, 2.0 ** 25, 2.0 ** 25]


def test_hadamard_16_point():
    # x_j = j + 1: y_i = sum_j (-1)^popcount(i&j) x_j = 136 for i = 0, -8 * 2^k for i = 2^k, else 0
    x = bf16([[j + 1.0 for j in range(16)]])
    expect = [0.0] * 16
    expect[0] = 136.0
    for k in range(4):
        expect[1 << k] = -8.0 * 2 ** k
    assert R.hadamard(x)[0].tolist() == expect
    assert R.hadamard(x, 0.25)[0].tolist() == [v / 4 for v in expect]
    # a basis vector e_5 gives row 5 of the Sylvester matrix: (-1)^popcount(i & 5)
    e = torch.zeros(1, 16, dtype=BF16)
    e[0, 5] = 1
    assert R.hadamard(e)[0].tolist() == [(-1.0) ** bin(i & 5).count("1") for i in range(16)]


@pytest.mark.parametrize("d", [16, 128, 1024])
def test_hadamard_matches_sylvester_matrix_on_integers(d):
    # small integers: every fp32 intermediate is exact (|.| <= 8*1024), so the butterflies equal H @ x
    # computed in float64, rounded once to bf16 at the end
    g = torch.Generator().manual_seed(d)
    xi = torch.randint(-8, 9, (3, d), generator=g)
    i = torch.arange(d)
    pc = torch.zeros(d, d, dtype=torch.int64)
    a = i[:, None] & i[None, :]
    while bool(a.any()):
        pc += a & 1
        a = a >> 1
    h = (1 - 2 * (pc % 2)).double()
    want = xi.double() @ h.T
    assert want.abs().max() < 2 ** 24
    assert torch.equal(u8(R.hadamard(xi.to(BF16))), u8(want.to(BF16)))


def test_hadamard_output_rounding_rtne():
    # 2-point: [a, b] -> [a+b, a-b]
    cases = [([1.0, 2 ** -8], [1.0, 255 / 256]),                     # 1+2^-8: tie -> 1 (even)
             ([1 + 2 ** -7, 2 ** -8], [1 + 2 ** -6, 1.0]),           # 1+3*2^-8: tie -> 1+2^-6
             ([1.0, 2 ** -8 + 2 ** -15], [1 + 2 ** -7, 255 / 256])]   # above the tie; 1-2^-8-2^-15 -> 255/256
    for x, want in cases:
        assert R.hadamard(bf16([x]))[0].tolist() == want


# ============================================================================ RMSNorm
def test_rmsnorm_known_answers():
    one = torch.ones(4, dtype=BF16)
    # ss = 16, mean = 4, sqrt = 2, rstd = 0.5
    assert R.rmsnorm(bf16([[2, 2, 2, 2]]), one, 0.0)[0].tolist() == [1, 1, 1, 1]
    # ss = 36, mean = 9, rstd = fp32(1/3); 3 * fp32(1/3) = 1.0000000298 -> fp32 1.0; then * w
    w = bf16([0.5, 2, -1, 3])
    assert R.rmsnorm(bf16([[3, -3, 3, -3]]), w, 0.0)[0].tolist() == [0.5, -2, -1, -3]
    # eps: mean 1 + eps 3 = 4 -> rstd 0.5
    assert R.rmsnorm(bf16([[1, 1, 1, 1]]), one, 3.0)[0].tolist() == [0.5] * 4
    # fp32 weight: same result
    assert R.rmsnorm(bf16([[3, -3, 3, -3]]), w.float(), 0.0)[0].tolist() == [0.5, -2, -1, -3]
    # zeros stay (signed) zeros: rstd = 1/sqrt(1e-6) is finite
    y = R.rmsnorm(bf16([[0.0, -0.0, 0.0, 0.0]]), bf16([1, 1, -1, 1]), 1e-6)
    assert torch.signbit(y[0].float()).tolist() == [False, True, True, False]
    assert y[0].abs().tolist() == [0, 0, 0, 0]


def test_rmsnorm_output_rtne():
    # x = 1 (16 dims), eps 0: rstd = 1, y = bf16(w) with fp32 weights at bf16 ties
    w = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -8 + 2 ** -20, -(1 + 2 ** -8)] + [1.0] * 12, dtype=F32)
    y = R.rmsnorm(torch.ones(1, 16, dtype=BF16), w, 0.0)
    assert y[0, :4].tolist() == [1.0, 1 + 2 ** -6, 1 + 2 ** -7, -1.0]


def test_pairwise_sum_tree_order():
    # [2^24, 1, 1, 1]: tree (2^24+1 -> 2^24) + (1+1) = 2^24 + 2; left to right stays 2^24
    p = torch.tensor([[2.0 ** 24, 1, 1, 1]], dtype=F32)
    assert float(R.pairwise_sum(p)[0]) == 2.0 ** 24 + 2
    # 6 values, zero-padded to 8: [2^24+1 -> 2^24, 2, 2, 0] -> [2^24 + 2, 2] -> 2^24 + 4 (left to right: 2^24)
    p = torch.tensor([[2.0 ** 24, 1, 1, 1, 1, 1]], dtype=F32)
    assert float(R.pairwise_sum(p)[0]) == 2.0 ** 24 + 4
    # [1, 1, 2^24, 1] -> [2, 2^24 + 1 -> 2^24] -> 2^24 + 2; left to right: 2 + 2^24 + 1 = 2^24 + 3 -> 2^24 + 4
    p = torch.tensor([[1.0, 1, 2.0 ** 24, 1]], dtype=F32)
    assert float(R.pairwise_sum(p)[0]) == 2.0 ** 24 + 2


def _np_tree(p):
    d = p.shape[-1]
    w = 1
    while w < d:
        w *= 2
    p = np.concatenate([p, np.zeros(p.shape[:-1] + (w - d,), np.float32)], axis=-1)
    while p.shape[-1] > 1:
        p = (p[..., 0::2] + p[..., 1::2]).astype(np.float32)
    return p[..., 0]


def _np_rmsnorm(x_f32, w_f32, eps, tree=True):
    """SPEC §6 RMSNorm in numpy float32 (each op rounded), sqrt from float64 rounded to float32."""
    p = (x_f32 * x_f32).astype(np.float32)
    if tree:
        ss = _np_tree(p)
    else:
        ss = np.zeros(p.shape[:-1], np.float32)
        for i in range(p.shape[-1]):
            ss = (ss + p[..., i]).astype(np.float32)
    mean = (ss / np.float32(x_f32.shape[-1])).astype(np.float32)
    den = np.sqrt((mean + np.float32(eps)).astype(np.float32).astype(np.float64)).astype(np.float32)
    rstd = (np.float32(1.0) / den).astype(np.float32)
    return np_bf16_bits(((x_f32 * rstd[..., None]).astype(np.float32) * w_f32).astype(np.float32))


@pytest.mark.parametrize("d", [48, 128, 512, 576])
def test_rmsnorm_matches_numpy_tree(d):
    """Random rows (outliers, tiny values) against an independent numpy float32 evaluation of the SPEC
    formula; and the adjacent-pairs tree matters: a left-to-right sum gives different bytes somewhere."""
    from helpers import random_bf16
    x = random_bf16((2048, d), seed=d)
    g = torch.Generator().manual_seed(d + 1)
    w = (torch.rand(d, generator=g) * 2 + 0.25).to(BF16)
    y = R.rmsnorm(x, w, 1e-6)
    xf, wf = x.float().numpy(), w.float().numpy()
    want = _np_rmsnorm(xf, wf, 1e-6)
    assert np.array_equal(bf16_bits(y), want)
    if d == 512:
        seq = _np_rmsnorm(xf, wf, 1e-6, tree=False)
        assert not np.array_equal(seq, want), "input does not tell the tree from a left-to-right sum"


def test_rmsnorm_sqrt_correctly_rounded():
    """mean + eps = v for many fp32 v in [1, 2) (x = 1, eps = v - 1): the output must follow
    rstd = fp32(1 / fp32(sqrt_float64(v))). Weights are chosen so that the product lands next to a bf16
    rounding tie, where one ulp of rstd shows; fp32 torch.sqrt (not correctly rounded) must fail."""
    g = torch.Generator().manual_seed(5)
    vs = (1 + torch.rand(400, generator=g, dtype=torch.float64)).to(F32)
    torch_sqrt = torch.sqrt(vs).numpy()          # fp32 sqrt of torch on this machine (may be 1 ulp off)
    ks = np.arange(-8, 8, dtype=np.float64)
    total_discriminating = 0
    for v, tsq in zip(vs.numpy(), torch_sqrt):
        eps = float(np.float32(v - np.float32(1)))
        assert np.float32(np.float32(1) + np.float32(eps)) == v
        good = np.float32(np.float32(1) / np.float32(np.sqrt(np.float64(v))))
        bad = np.float32(np.float32(1) / tsq)
        w = (((1 + 2 ** -8) + ks * 2 ** -23) / float(good)).astype(np.float32)
        want = np_bf16_bits((good * w).astype(np.float32))
        alt = np_bf16_bits((bad * w).astype(np.float32))
        total_discriminating += int((want != alt).sum())
        y = R.rmsnorm(torch.ones(1, 16, dtype=BF16), torch.from_numpy(w), eps)
        assert np.array_equal(bf16_bits(y)[0], want), v
    assert total_discriminating > 0


# ============================================================================ cast_back / dequantize
@pytest.mark.parametrize("cast_fmt,g,sf_format", [("e4m3", 32, "ue8m0"), ("e4m3", 128, "fp32"),
                                                  ("e4m3", 16, "e4m3"), ("e4m3", 64, "ue8m0_fp32"),
                                                  ("e2m1", 16, "e4m3"), ("e2m1", 32, "ue8m0")])
def test_dequantize_is_bf16_of_code_times_scale(cast_fmt, g, sf_format):
    """dequantize = bf16(f(q) * d) with d decoded independently from the stored scale bytes."""
    from helpers import random_bf16
    x = random_bf16((64, 128), seed=11)
    q, sf = R.quantize(x, cast_fmt, g, sf_format)
    back = R.dequantize(q, sf, cast_fmt, g, sf_format)
    if cast_fmt == "e4m3":
        qf = q.float().numpy()                                   # torch's own fp8 decode
    else:
        table = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)
        b = q.numpy()
        qf = np.stack([table[b & 15], table[b >> 4]], axis=-1).reshape(64, 128)
    sb = u8(sf).numpy()
    if sf_format == "ue8m0":
        d = (2.0 ** (sb.astype(np.float64) - 127)).astype(np.float32)
    elif sf_format == "e4m3":
        d = sf.float().numpy()
    else:
        d = sb.reshape(64, -1).copy().view("<f4").astype(np.float32)
    want = np_bf16_bits((qf.reshape(64, -1, g) * d[:, :, None]).astype(np.float32).reshape(64, 128))
    assert np.array_equal(bf16_bits(back), want)


def test_dequantize_fp32_scale_rounds_to_bf16():
    # q = 448 (0x7E), d = fp32(3/448): 448 * d = 3.0000000x -> bf16 3.0; q = 1.125 (0x39) -> 0.0075334...
    d = np.float32(3.0) / np.float32(448.0)
    q = torch.tensor([[0x7E, 0x39] + [0] * 126], dtype=torch.uint8).view(torch.float8_e4m3fn)
    sf = torch.tensor([[float(d)]], dtype=F32)
    back = R.dequantize(q, sf, "e4m3", 128, "fp32")
    want = np_bf16_bits(np.array([np.float32(448) * d, np.float32(1.125) * d], np.float32))
    assert np.array_equal(bf16_bits(back)[0, :2], want)
    assert float(back[0, 0]) == 3.0


def test_quantize_rows_and_groups_independent():
    """A row's bytes do not depend on the other rows; each group has its own scale."""
    from helpers import random_bf16
    x = random_bf16((8, 512), seed=3)
    q, sf = R.quantize(x, "e4m3", 32, "ue8m0")
    for i in (0, 5):
        qi, sfi = R.quantize(x[i:i + 1], "e4m3", 32, "ue8m0")
        assert torch.equal(u8(q[i:i + 1]), u8(qi)) and torch.equal(sf[i:i + 1], sfi)
    # scaling one group by 2 raises only that group's exponent by one
    x2 = x.clone()
    x2[:, 32:64] *= 2
    q2, sf2 = R.quantize(x2, "e4m3", 32, "ue8m0")
    assert torch.equal(sf2[:, 1].long(), sf[:, 1].long() + 1)
    assert torch.equal(torch.cat([sf2[:, :1], sf2[:, 2:]], 1), torch.cat([sf[:, :1], sf[:, 2:]], 1))
    assert torch.equal(u8(q2), u8(q))


def test_main_fp8_store_known_layout():
    """reference.store: one record of MAIN_FP8 at slot 5 of block_size 4 -> block 1, offset 1: codes, 16 scale
    bytes, then the 4 reserved bytes as zeros (MAIN_FP8.zero_reserved); every other byte as it was."""
    cache = allocate_kv_cache(MAIN_FP8, 2, 4)
    s0, s1 = cache.stride(0), cache.stride(1)
    assert (s0, s1) == (2144, 532)       # 4*532 = 2128 -> 2144
    flat = cache.as_strided((cache.untyped_storage().nbytes(),), (1,), 0)
    flat.fill_(0xAB)
    data = torch.arange(512, dtype=torch.int64).remainder(251).to(torch.uint8).view(torch.float8_e4m3fn)[None, None]
    sf = torch.arange(100, 116, dtype=torch.uint8)[None, None]
    R.store(cache, torch.tensor([5]), MAIN_FP8, data, sf)
    base = 1 * 2144 + 1 * 532
    want = torch.full_like(flat, 0xAB)
    want[base:base + 512] = u8(data).flatten()
    want[base + 512:base + 528] = sf.flatten()
    want[base + 528:base + 532] = 0
    assert torch.equal(flat, want)
    # the same record in a format whose reserved bytes are never written leaves them as they were
    keep = dataclasses.replace(MAIN_FP8, name="MAIN_FP8_KEEP", zero_reserved=False)
    flat.fill_(0xAB)
    R.store(cache, torch.tensor([5]), keep, data, sf)
    want[base + 528:base + 532] = 0xAB
    assert torch.equal(flat, want)


def test_ue8m0_byte_zero_decodes_to_two_pow_minus_127():
    # q = 448 = 1.75 * 2^8 (0x7E), byte 0: d = 2^-127 -> 448 * 2^-127 = 1.75 * 2^-119, a normal bf16
    q = torch.tensor([[0x7E] + [0] * 31], dtype=torch.uint8).view(torch.float8_e4m3fn)
    back = R.dequantize(q, torch.tensor([[0]], dtype=torch.uint8), "e4m3", 32, "ue8m0")
    assert float(back[0, 0]) == 1.75 * 2.0 ** -119
