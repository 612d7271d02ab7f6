"""KVCacheFormat, presets, allocate_kv_cache, split and check_cache against SPEC §7 and §8.

Every expected number below is written out from the SPEC's tables (not computed by kvfuse).
"""
import dataclasses

import pytest
import torch

import kvfuse
from kvfuse import formats
from kvfuse.formats import KVCacheFormat, allocate_kv_cache

from helpers import cache_strides, guarded_cache, record_regions

# name: (token_interleaved, head_dim, cast_fmt, g, sf_format, quant_bytes, data_bytes, sf_bytes,
#        exact scale bytes, bytes_per_token, stride_alignment, bf16_tail)
SPEC_TABLE = {
    # SPEC §7: 512 + 20 (16 scales + 4 reserved) = 532; gcd(32, 532) = 4
    "MAIN_FP8": (True, 512, "e4m3", 32, "ue8m0", 512, 512, 20, 16, 532, 4, 0),
    # DeepSeek V4.1: 512 + 16 (16 scales, no reserved bytes) = 528; gcd(32, 528) = 16
    "MAIN_MXFP8": (True, 512, "e4m3", 32, "ue8m0", 512, 512, 16, 16, 528, 16, 0),
    # 256 + 32 = 288 (32 e4m3 scales); gcd(32, 288) = 32
    "MAIN_FP4": (True, 512, "e2m1", 16, "e4m3", 256, 256, 32, 32, 288, 32, 0),
    # block-wide: stride_alignment 32
    "INDEX_MXFP8": (False, 128, "e4m3", 32, "ue8m0", 128, 128, 4, 4, 132, 32, 0),
    "INDEX_FP8_FP32": (False, 128, "e4m3", 128, "fp32", 128, 128, 4, 4, 132, 32, 0),
    "INDEX_MXFP4": (False, 128, "e2m1", 32, "ue8m0", 64, 64, 4, 4, 68, 32, 0),
    "INDEX_NVFP4": (False, 128, "e2m1", 16, "e4m3", 64, 64, 8, 8, 72, 32, 0),
    "INDEX_BF16": (False, 128, None, None, None, 256, 256, 0, 0, 256, 32, 0),
    # SPEC §8: 512 quantized + 128 tail bytes = 640 data, 4 fp32 scales = 16; 656; gcd(32, 656) = 16
    "FLASHMLA_V32": (True, 576, "e4m3", 128, "ue8m0_fp32", 512, 640, 16, 16, 656, 16, 64),
    # 448 quantized + 128 tail = 576 data, 7 scales + 1 reserved = 8; 584; block-wide -> 32
    "FLASHMLA_MODEL1": (False, 512, "e4m3", 64, "ue8m0", 448, 576, 8, 7, 584, 32, 64),
}


def test_presets_are_exactly_the_spec_table():
    assert set(formats.PRESETS) == set(SPEC_TABLE)
    for name, fmt in formats.PRESETS.items():
        assert fmt.name == name
        assert getattr(formats, name) is fmt


@pytest.mark.parametrize("name", sorted(SPEC_TABLE))
def test_preset_sizes(name):
    ti, hd, cast, g, sff, qb, db, sfb, sfx, bpt, align, tail = SPEC_TABLE[name]
    f = formats.PRESETS[name]
    assert f.token_interleaved is ti
    assert f.head_dim == hd
    assert f.cast_fmt == cast
    assert f.elements_per_sf == g
    assert f.sf_format == sff
    assert f.quant_bytes == qb
    assert f.data_bytes == db
    assert f.sf_bytes == sfb
    assert f.sf_exact_bytes == sfx
    assert f.bytes_per_token == bpt
    assert f.bytes_per_token == f.data_bytes + f.sf_bytes
    assert f.stride_alignment == align
    assert f.bf16_tail == tail
    assert f.quantized is (cast is not None)
    assert f.quant_dim == hd - tail
    assert f.num_scales == (0 if g is None else (hd - tail) // g)


def test_flashmla_block_alignments():
    # FlashMLA's SM100 sparse decode: k_cache.stride(0) % TMA_K_STRIDE == 0, 656 (V32) / 576 (MODEL1)
    assert formats.FLASHMLA_V32.block_alignment == 656
    assert formats.FLASHMLA_MODEL1.block_alignment == 576
    for name, f in formats.PRESETS.items():
        if not name.startswith("FLASHMLA"):
            assert f.block_alignment == 32


@pytest.mark.parametrize("name,cast", [
    ("MAIN_FP8", kvfuse.CastArgs("e4m3", 32, True, "ue8m0")),
    ("MAIN_MXFP8", kvfuse.CastArgs("e4m3", 32, True, "ue8m0", scale_floor=1e-4)),
    ("MAIN_FP4", kvfuse.CastArgs("e2m1", 16, False, "e4m3")),
    ("INDEX_MXFP8", kvfuse.CastArgs("e4m3", 32, True, "ue8m0")),
    ("INDEX_FP8_FP32", kvfuse.CastArgs("e4m3", 128, False, "fp32")),
    ("INDEX_MXFP4", kvfuse.CastArgs("e2m1", 32, True, "ue8m0")),
    ("INDEX_NVFP4", kvfuse.CastArgs("e2m1", 16, False, "e4m3")),
    ("INDEX_BF16", None),
    ("FLASHMLA_V32", kvfuse.CastArgs("e4m3", 128, True, "ue8m0_fp32", scale_floor=1e-4)),
    ("FLASHMLA_MODEL1", kvfuse.CastArgs("e4m3", 64, True, "ue8m0", scale_floor=1e-4)),
])
def test_cast_args_from_cache_format(name, cast):
    assert kvfuse.CastArgs.from_cache_format(formats.PRESETS[name]) == cast


def test_sf_dtype():
    assert formats.MAIN_FP8.sf_dtype == torch.uint8
    assert formats.MAIN_FP4.sf_dtype == torch.float8_e4m3fn
    assert formats.INDEX_FP8_FP32.sf_dtype == torch.float32
    assert formats.FLASHMLA_V32.sf_dtype == torch.float32
    assert formats.INDEX_BF16.sf_dtype is None


# ------------------------------------------------------------------------------ user formats
@pytest.mark.parametrize("kw,expect", [
    # (head_dim 256, e4m3, g=64, fp32 scales): 256 + 4*4 = 272, gcd(32, 272) = 16
    (dict(head_dim=256, cast_fmt="e4m3", elements_per_sf=64, sf_format="fp32", token_interleaved=True),
     (256, 16, 272, 16)),
    # e2m1 g=16 e4m3 on 64 dims: 32 + 4 = 36, gcd(32, 36) = 4
    (dict(head_dim=64, cast_fmt="e2m1", elements_per_sf=16, sf_format="e4m3", token_interleaved=True),
     (32, 4, 36, 4)),
    # bf16 token-interleaved, head_dim 64: 128 bytes, gcd(32, 128) = 32
    (dict(head_dim=64, cast_fmt=None, elements_per_sf=None, sf_format=None, token_interleaved=True),
     (128, 0, 128, 32)),
    # reserved scale bytes: 192 dims, g=32 ue8m0 -> 6 exact + 10 reserved = 16; 192 + 16 = 208; gcd = 16
    (dict(head_dim=192, cast_fmt="e4m3", elements_per_sf=32, sf_format="ue8m0", token_interleaved=True,
          sf_bytes=16), (192, 16, 208, 16)),
    # block-wide with a tail: 256 dims, tail 128 -> 128 e4m3 + 256 tail bytes; 1 scale fp32-pow2 = 4
    (dict(head_dim=256, cast_fmt="e4m3", elements_per_sf=128, sf_format="ue8m0_fp32", token_interleaved=False,
          bf16_tail=128), (384, 4, 388, 32)),
    # head_dim 1024, e2m1 MX: 512 + 32 = 544; gcd(32, 544) = 32
    (dict(head_dim=1024, cast_fmt="e2m1", elements_per_sf=32, sf_format="ue8m0", token_interleaved=True),
     (512, 32, 544, 32)),
])
def test_user_formats(kw, expect):
    f = KVCacheFormat("user", **kw)
    assert (f.data_bytes, f.sf_bytes, f.bytes_per_token, f.stride_alignment) == expect


INVALID_FORMATS = [
    (dict(head_dim=0, cast_fmt="e4m3", elements_per_sf=16, sf_format="e4m3"), ValueError, "head_dim"),
    (dict(head_dim=24, cast_fmt="e4m3", elements_per_sf=16, sf_format="e4m3"), ValueError, "head_dim"),
    (dict(head_dim=-16, cast_fmt="e4m3", elements_per_sf=16, sf_format="e4m3"), ValueError, "head_dim"),
    (dict(head_dim=128.0, cast_fmt="e4m3", elements_per_sf=16, sf_format="e4m3"), TypeError, "head_dim"),
    (dict(head_dim=True, cast_fmt="e4m3", elements_per_sf=16, sf_format="e4m3"), TypeError, "head_dim"),
    (dict(head_dim=128, cast_fmt="e5m2", elements_per_sf=32, sf_format="ue8m0"), ValueError, "cast_fmt"),
    (dict(head_dim=128, cast_fmt="e4m3", elements_per_sf=32, sf_format="ue4m3"), ValueError, "sf_format"),
    (dict(head_dim=128, cast_fmt="e4m3", elements_per_sf=8, sf_format="ue8m0"), ValueError, "num_per_channels"),
    (dict(head_dim=512, cast_fmt="e4m3", elements_per_sf=256, sf_format="ue8m0"), ValueError, "num_per_channels"),
    (dict(head_dim=48, cast_fmt="e4m3", elements_per_sf=32, sf_format="ue8m0"), ValueError, "divide"),
    # quant_dim 448 is not a multiple of 128
    (dict(head_dim=512, cast_fmt="e4m3", elements_per_sf=128, sf_format="ue8m0", bf16_tail=64), ValueError,
     "divide"),
    (dict(head_dim=128, cast_fmt="e2m1", elements_per_sf=32, sf_format="e4m3"), ValueError, "e2m1"),
    (dict(head_dim=128, cast_fmt="e2m1", elements_per_sf=16, sf_format="ue8m0"), ValueError, "e2m1"),
    (dict(head_dim=128, cast_fmt="e2m1", elements_per_sf=16, sf_format="fp32"), ValueError, "e2m1"),
    (dict(head_dim=128, cast_fmt="e2m1", elements_per_sf=64, sf_format="ue8m0"), ValueError, "e2m1"),
    (dict(head_dim=128, cast_fmt="e2m1", elements_per_sf=32, sf_format="ue8m0_fp32"), ValueError, "e2m1"),
    (dict(head_dim=128, cast_fmt=None, elements_per_sf=32, sf_format=None), ValueError, "bf16"),
    (dict(head_dim=128, cast_fmt=None, elements_per_sf=None, sf_format="ue8m0"), ValueError, "bf16"),
    (dict(head_dim=128, cast_fmt=None, elements_per_sf=None, sf_format=None, bf16_tail=64), ValueError,
     "bf16_tail"),
    (dict(head_dim=128, cast_fmt=None, elements_per_sf=None, sf_format=None, sf_bytes=4), ValueError, "sf_bytes"),
    (dict(head_dim=128, cast_fmt="e4m3", elements_per_sf=32, sf_format="ue8m0", sf_bytes=3), ValueError,
     "sf_bytes"),
    (dict(head_dim=128, cast_fmt="e4m3", elements_per_sf=32, sf_format="fp32", sf_bytes=15), ValueError,
     "sf_bytes"),
    (dict(head_dim=128, cast_fmt="e4m3", elements_per_sf=32, sf_format="ue8m0", sf_bytes=4.0), ValueError,
     "sf_bytes"),
    (dict(head_dim=128, cast_fmt="e4m3", elements_per_sf=32, sf_format="ue8m0", bf16_tail=8), ValueError,
     "bf16_tail"),
    (dict(head_dim=128, cast_fmt="e4m3", elements_per_sf=32, sf_format="ue8m0", bf16_tail=128), ValueError,
     "bf16_tail"),
    (dict(head_dim=128, cast_fmt="e4m3", elements_per_sf=32, sf_format="ue8m0", bf16_tail=-16), ValueError,
     "bf16_tail"),
    (dict(head_dim=128, cast_fmt="e4m3", elements_per_sf=32, sf_format="ue8m0", block_alignment=0), ValueError,
     "block_alignment"),
]


@pytest.mark.parametrize("kw,exc,match", INVALID_FORMATS)
def test_invalid_formats_raise(kw, exc, match):
    kw = dict(kw)
    with pytest.raises(exc, match=match):
        KVCacheFormat("bad", token_interleaved=kw.pop("token_interleaved", True), **kw)


def test_token_interleaved_must_be_bool():
    with pytest.raises(TypeError, match="token_interleaved"):
        KVCacheFormat("bad", 128, "e4m3", 32, "ue8m0", 1)


def test_zero_reserved_needs_reserved_bytes_and_a_bool():
    """SPEC §7: the reserved bytes after the scales are written as zeros only where the format says so; only
    MAIN_FP8 among the presets (4 bytes; FLASHMLA_MODEL1's reserved byte is never written)."""
    assert [name for name, f in formats.PRESETS.items() if f.zero_reserved] == ["MAIN_FP8"]
    assert formats.MAIN_FP8.reserved_bytes == 4 and formats.FLASHMLA_MODEL1.reserved_bytes == 1
    assert formats.MAIN_MXFP8.reserved_bytes == 0
    with pytest.raises(ValueError, match="zero_reserved needs reserved scale bytes"):
        KVCacheFormat("bad", 128, "e4m3", 32, "ue8m0", True, zero_reserved=True)
    with pytest.raises(ValueError, match="zero_reserved needs reserved scale bytes"):
        KVCacheFormat("bad", 128, None, None, None, True, zero_reserved=True)
    with pytest.raises(TypeError, match="zero_reserved must be a bool"):
        KVCacheFormat("bad", 128, "e4m3", 32, "ue8m0", True, sf_bytes=8, zero_reserved=1)
    assert KVCacheFormat("ok", 128, "e4m3", 32, "ue8m0", True, sf_bytes=8, zero_reserved=True).reserved_bytes == 4


def test_float_group_size_rejected():
    with pytest.raises((TypeError, ValueError), match="num_per_channels"):
        KVCacheFormat("bad", 128, "e4m3", 32.0, "ue8m0", True)


def test_formats_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        formats.MAIN_FP8.head_dim = 128


# ------------------------------------------------------------------------------ allocate_kv_cache
# (fmt, num_blocks, block_size, num_heads, token_padding, block_padding, stride(0), stride(1)), by hand:
ALLOC_CASES = [
    # 532-byte records, stride(1) = 532 (multiple of 4); block = 16*532 = 8512 = 266*32
    ("MAIN_FP8", 3, 16, 1, 0, 0, 8512, 532),
    # token_padding 3: 535 -> 536; block 16*536 = 8576 = 268*32
    ("MAIN_FP8", 2, 16, 1, 3, 0, 8576, 536),
    # block_padding 10: 8512 + 10 = 8522 -> 8544
    ("MAIN_FP8", 2, 16, 1, 0, 10, 8544, 532),
    # block_size 1: 532 -> 544
    ("MAIN_FP8", 2, 1, 1, 0, 0, 544, 532),
    # 4 heads: 4*288 = 1152 per token; block 16*1152 = 18432
    ("MAIN_FP4", 2, 16, 4, 0, 0, 18432, 1152),
    # 2 heads + token_padding 1: 576 + 1 -> 608 (multiple of 32); 8 * 608 = 4864 = 152*32
    ("MAIN_FP4", 2, 8, 2, 1, 0, 4864, 608),
    # FLASHMLA_V32: blocks a multiple of 656 (FlashMLA SM100 asserts stride(0) % 656 == 0), i.e.
    # exactly block_size * 656 for one head: 1, 3, 16, 64 tokens
    ("FLASHMLA_V32", 2, 1, 1, 0, 0, 656, 656),
    ("FLASHMLA_V32", 2, 3, 1, 0, 0, 1968, 656),
    ("FLASHMLA_V32", 2, 16, 1, 0, 0, 10496, 656),
    ("FLASHMLA_V32", 2, 64, 1, 0, 0, 41984, 656),
    # 2 heads: 1312 per token (multiple of 16); 3 tokens: 3936 = 6*656
    ("FLASHMLA_V32", 2, 3, 2, 0, 0, 3936, 1312),
    # block_padding 10: 1968 + 10 -> 2624 = 4*656
    ("FLASHMLA_V32", 2, 3, 1, 0, 10, 2624, 656),
    # block-wide: dense blocks; 64 * 132 = 8448 = 264*32
    ("INDEX_MXFP8", 2, 64, 1, 0, 0, 8448, 132),
    # 1 token: 132 -> 160; with padding 40: 172 -> 192
    ("INDEX_FP8_FP32", 2, 1, 1, 0, 0, 160, 132),
    ("INDEX_FP8_FP32", 2, 1, 1, 0, 40, 192, 132),
    ("INDEX_MXFP4", 3, 5, 1, 0, 0, 352, 68),          # 340 -> 352
    ("INDEX_NVFP4", 3, 5, 1, 0, 0, 384, 72),          # 360 -> 384
    ("INDEX_BF16", 2, 3, 1, 0, 0, 768, 256),
    # FLASHMLA_MODEL1: blocks padded to multiples of 576: 64*584 = 37376 -> 65*576 = 37440
    ("FLASHMLA_MODEL1", 2, 64, 1, 0, 0, 37440, 584),
    # 1 token: 584 -> 1152; block_padding 600: 1184 -> 1728
    ("FLASHMLA_MODEL1", 2, 1, 1, 0, 0, 1152, 584),
    ("FLASHMLA_MODEL1", 2, 1, 1, 0, 600, 1728, 584),
]


@pytest.mark.parametrize("name,nb,bs,nh,tp,bp,s0,s1", ALLOC_CASES)
def test_allocate_strides(name, nb, bs, nh, tp, bp, s0, s1):
    fmt = formats.PRESETS[name]
    c = allocate_kv_cache(fmt, nb, bs, nh, token_padding=tp, block_padding=bp)
    assert c.dtype == torch.uint8
    assert tuple(c.shape) == (nb, bs, nh, fmt.bytes_per_token)
    assert c.stride() == (s0, s1, fmt.bytes_per_token, 1)
    assert c.untyped_storage().nbytes() == nb * s0
    assert c.storage_offset() == 0
    assert torch.equal(c, torch.zeros_like(c))
    fmt.check_cache(c)
    # the helper's independent stride formula agrees with the hand-written numbers
    assert cache_strides(fmt, bs, nh, tp, bp) == (s0, s1)
    # fmt.allocate is the same thing
    c2 = fmt.allocate(nb, bs, nh, token_padding=tp, block_padding=bp)
    assert c2.stride() == c.stride() and c2.shape == c.shape


def test_allocate_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_heads"):
        allocate_kv_cache(formats.INDEX_MXFP8, 2, 16, 2)
    with pytest.raises(ValueError, match="token_padding"):
        allocate_kv_cache(formats.INDEX_MXFP8, 2, 16, token_padding=4)
    with pytest.raises(ValueError, match="num_blocks"):
        allocate_kv_cache(formats.MAIN_FP8, 0, 16)
    with pytest.raises(ValueError, match="block_size"):
        allocate_kv_cache(formats.MAIN_FP8, 1, 0)
    with pytest.raises(ValueError, match="padding"):
        allocate_kv_cache(formats.MAIN_FP8, 1, 4, block_padding=-1)


# ------------------------------------------------------------------------------ split / tail_view
SPLIT_CASES = [
    ("MAIN_FP8", 3, 4, 1, 0, 0), ("MAIN_FP8", 2, 3, 2, 5, 40), ("MAIN_FP4", 2, 4, 3, 0, 32),
    ("INDEX_MXFP8", 3, 4, 1, 0, 0), ("INDEX_FP8_FP32", 2, 5, 1, 0, 64), ("INDEX_MXFP4", 2, 3, 1, 0, 0),
    ("INDEX_NVFP4", 2, 3, 1, 0, 7), ("INDEX_BF16", 2, 2, 1, 0, 0), ("FLASHMLA_V32", 2, 3, 2, 16, 0),
    ("FLASHMLA_MODEL1", 2, 3, 1, 0, 0),
]


@pytest.mark.parametrize("name,nb,bs,nh,tp,bp", SPLIT_CASES)
def test_split_views_address_the_right_bytes(name, nb, bs, nh, tp, bp):
    """Write distinct values through the data / sf / tail views; each byte must land where the SPEC's
    layout puts it, and nothing else (reserved bytes, padding, guards) may change."""
    fmt = formats.PRESETS[name]
    guard = 64
    cache, storage = guarded_cache(fmt, nb, bs, nh, tp, bp, guard=guard, seed=7)
    before = storage.clone()
    s0, s1 = cache_strides(fmt, bs, nh, tp, bp)
    data, sf = fmt.split(cache)
    if fmt.token_interleaved:
        assert tuple(sf.shape) == (nb, bs, nh, fmt.sf_bytes)
    else:
        assert tuple(data.shape) == (nb, bs, fmt.data_bytes)
        assert tuple(sf.shape) == (nb, bs, fmt.sf_bytes)
    tail = fmt.tail_view(cache) if fmt.bf16_tail else None
    g = torch.Generator().manual_seed(3)
    dvals = torch.randint(0, 256, data.shape, dtype=torch.uint8, generator=g)
    svals = torch.randint(0, 256, sf.shape, dtype=torch.uint8, generator=g)
    data.copy_(dvals)
    sf.copy_(svals)
    if tail is not None:
        tvals = torch.randint(0, 256, tail.shape, dtype=torch.uint8, generator=g)
        tail.copy_(tvals)
    expect = before.clone()
    for b in range(nb):
        for o in range(bs):
            for h in range(nh):
                r = record_regions(fmt, bs, s0, s1, guard, b, o, h)
                qs, ql = r["quant"]
                ts, tl = r["tail"]
                ss = r["sf"][0]
                if fmt.token_interleaved:
                    dv, sv = dvals[b, o, h], svals[b, o, h]
                    # data view: the quantized bytes (and, without a tail, all data bytes)
                    expect[qs:qs + dv.numel()] = dv
                    expect[ss:ss + fmt.sf_bytes] = sv
                    if tail is not None:
                        assert dv.numel() == ql
                        expect[ts:ts + tl] = tvals[b, o, h]
                else:
                    dv, sv = dvals[b, o], svals[b, o]
                    assert dv.numel() == fmt.data_bytes
                    expect[qs:qs + fmt.data_bytes] = dv  # [quantized | tail]
                    expect[ss:ss + fmt.sf_bytes] = sv
                    if tail is not None:
                        assert ts == qs + ql
                        expect[ts:ts + tl] = tvals[b, o]
    assert torch.equal(storage, expect)


def test_split_covers_each_record_exactly_once():
    """data + sf (+ tail) of a record are disjoint and together the whole record."""
    for fmt in formats.PRESETS.values():
        nh = 2 if fmt.token_interleaved else 1
        cache = fmt.allocate(2, 3, nh)
        data, sf = fmt.split(cache)
        data.add_(1)
        sf.add_(1)
        if fmt.bf16_tail and fmt.token_interleaved:
            fmt.tail_view(cache).add_(1)
        assert torch.equal(cache, torch.ones_like(cache)), fmt.name


def test_tail_view_without_tail_raises():
    with pytest.raises(ValueError, match="tail"):
        formats.MAIN_FP8.tail_view(formats.MAIN_FP8.allocate(1, 2))


# ------------------------------------------------------------------------------ check_cache
def _strided(fmt, shape, strides, extra=0):
    size = sum((n - 1) * s for n, s in zip(shape, strides)) + 1 + extra
    return torch.as_strided(torch.zeros(size, dtype=torch.uint8), shape, strides)


@pytest.mark.parametrize("case", [
    "not_tensor", "dtype_int8", "dtype_float", "dims3", "dims5", "last_dim", "stride3", "stride2",
    "stride1_alignment", "stride1_too_small", "blockwide_heads", "blockwide_not_dense", "stride0_alignment",
    "stride0_too_small", "zero_blocks", "blockwide_stride0_not_32", "v32_stride0_not_16",
])
def test_check_cache_rejects(case):
    fmt = formats.MAIN_FP8 if not case.startswith("blockwide") else formats.INDEX_MXFP8
    bpt = fmt.bytes_per_token
    good = fmt.allocate(2, 4)
    exc, match = ValueError, None
    if case == "not_tensor":
        bad, exc, match = good.numpy(), TypeError, "torch.Tensor"
    elif case == "dtype_int8":
        bad, exc, match = good.view(torch.int8), TypeError, "uint8"
    elif case == "dtype_float":
        bad, exc, match = torch.zeros(2, 4, 1, bpt // 4, dtype=torch.float32), TypeError, "uint8"
    elif case == "dims3":
        bad, match = good[:, :, 0], "dims"
    elif case == "dims5":
        bad, match = good[None], "dims"
    elif case == "last_dim":
        bad, match = formats.INDEX_FP8_FP32.allocate(2, 4), "bytes_per_token"
        fmt = formats.MAIN_FP8
    elif case == "stride3":
        bad, match = _strided(fmt, (2, 4, 1, bpt), (4 * 2 * bpt * 2, 2 * bpt, 2 * bpt, 2)), "stride\\(3\\)"
    elif case == "stride2":
        bad, match = _strided(fmt, (2, 4, 2, bpt), (4 * 1088 * 2, 1088, 544, 1)), "stride\\(2\\)"
    elif case == "stride1_alignment":
        # 534 is not a multiple of gcd(32, 532) = 4
        bad, match = _strided(fmt, (2, 4, 1, bpt), (4 * 534 + 32 - (4 * 534) % 32, 534, bpt, 1)), "stride\\(1\\)"
    elif case == "stride1_too_small":
        bad, match = _strided(fmt, (2, 4, 2, bpt), (8704, 536, bpt, 1)), "stride\\(1\\)"
    elif case == "blockwide_heads":
        bad, match = _strided(fmt, (2, 4, 2, bpt), (2112, 264, bpt, 1)), "num_heads"
    elif case == "blockwide_not_dense":
        bad, match = _strided(fmt, (2, 4, 1, bpt), (640, 160, bpt, 1)), "dense"
    elif case == "stride0_alignment":
        # 2130 >= 4*532 but not a multiple of gcd(32, 532) = 4
        bad, match = _strided(fmt, (2, 4, 1, bpt), (2130, 532, bpt, 1)), "stride\\(0\\) must be a multiple of 4"
    elif case == "blockwide_stride0_not_32":
        # block-wide: stride_alignment 32; 4*132 = 528 -> 536 is a multiple of 4, not of 32
        bad, match = _strided(fmt, (2, 4, 1, bpt), (536, bpt, bpt, 1)), "stride\\(0\\) must be a multiple of 32"
    elif case == "v32_stride0_not_16":
        # FLASHMLA_V32: gcd(32, 656) = 16; 4*656 + 8 is not a multiple of 16
        fmt, bpt = formats.FLASHMLA_V32, 656
        bad, match = _strided(fmt, (2, 4, 1, bpt), (4 * 656 + 8, 656, bpt, 1)), "stride\\(0\\) must be a multiple of 16"
    elif case == "stride0_too_small":
        bad, match = _strided(fmt, (2, 4, 1, bpt), (2112, 532, bpt, 1)), "stride\\(0\\)"
    elif case == "zero_blocks":
        bad, match = torch.zeros(0, 4, 1, bpt, dtype=torch.uint8), ">= 1"
    with pytest.raises(exc, match=match):
        fmt.check_cache(bad)


def test_check_cache_accepts_valid_padded_caches():
    # stride(1) a multiple of 4 (MAIN_FP8's alignment) but not of 32, padding between blocks
    fmt = formats.MAIN_FP8
    c = _strided(fmt, (3, 4, 1, 532), (2176, 536, 532, 1))
    fmt.check_cache(c)
    fmt.split(c)
    # stride(0) a multiple of 32 larger than the block; for MODEL1 576 is not required by check_cache
    m = formats.FLASHMLA_MODEL1
    c = _strided(m, (2, 2, 1, 584), (1184, 584, 584, 1))
    m.check_cache(c)


def test_check_cache_stride0_multiple_of_stride_alignment_only():
    """SPEC §7: stride(0) need only be a multiple of stride_alignment (gcd(32, bytes_per_token) for
    token-interleaved formats), not of 32."""
    fmt = formats.MAIN_FP8
    c = _strided(fmt, (2, 4, 1, 532), (2132, 532, 532, 1))     # 2132 = 4 * 533, not a multiple of 32
    fmt.check_cache(c)
    v32 = formats.FLASHMLA_V32
    c = _strided(v32, (2, 3, 1, 656), (3 * 656 + 16, 656, 656, 1))   # 1984 = 16 * 124
    v32.check_cache(c)


@pytest.mark.parametrize("block_size", [1, 2, 3, 16, 64])
def test_check_cache_accepts_flashmla_test_allocation(block_size):
    """FlashMLA's tests/quant.py allocates V32 caches as [num_blocks, block_size + 1, 656] and keeps the
    first block_size tokens: stride(0) = (block_size + 1) * 656 (not a multiple of 32 for even
    block sizes). MODEL1 blocks are padded to a multiple of 576 bytes."""
    nb = 3
    v32 = formats.FLASHMLA_V32
    c = torch.zeros(nb, block_size + 1, 656, dtype=torch.uint8)[:, :block_size, :].view(nb, block_size, 1, 656)
    assert c.stride() == ((block_size + 1) * 656, 656, 656, 1)
    v32.check_cache(c)
    data, sf = v32.split(c)
    assert data.shape == (nb, block_size, 1, 512) and sf.shape == (nb, block_size, 1, 16)
    m1 = formats.FLASHMLA_MODEL1
    padded = -(-block_size * 584 // 576) * 576
    c = torch.zeros(nb, padded, dtype=torch.uint8)[:, :block_size * 584].view(nb, block_size, 1, 584)
    assert c.stride() == (padded, 584, 584, 1)
    m1.check_cache(c)           # block-wide: stride_alignment 32 divides 576


def test_check_cache_messages_name_the_argument_and_the_value():
    v32 = formats.FLASHMLA_V32
    bad = _strided(v32, (2, 4, 1, 656), (4 * 656 + 8, 656, 656, 1))
    with pytest.raises(ValueError) as e:
        v32.check_cache(bad, "out_args.kv_cache")
    msg = str(e.value)
    assert msg.startswith("out_args.kv_cache: stride(0) must be a multiple of 16")
    assert msg.endswith(f"got {4 * 656 + 8}")
    bad = _strided(v32, (2, 4, 1, 656), (4 * 656 - 16, 656, 656, 1))    # overlaps the next block
    with pytest.raises(ValueError, match=f">= {4 * 656} .*got {4 * 656 - 16}"):
        v32.check_cache(bad)
