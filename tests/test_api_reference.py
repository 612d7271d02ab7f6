"""The article's test matrix through the public API on the CPU with the reference backend (SPEC §1, §2, §6, §7, §8).

The expected cache is built independently: the stage outputs come from the reference's stage functions
(rmsnorm / rope / hadamard / quantize), and their bytes are written into a copy of the guarded storage at
addresses computed in tests/helpers.py from the SPEC's layout text (not through reference.store). The
whole storage (guards, padding, reserved scale bytes, other slots) is then compared byte for byte.
"""
import zlib

import pytest
import torch

import kvfuse
from kvfuse import (CastArgs, ContiguousOutArgs, HadamardArgs, KVCacheFormat, KVCacheOutArgs, NormArgs, RopeArgs,
                    formats, fused_norm_rope_hadamard_cast_store_kvcache as fused, load_paged_kv_cache,
                    store_kv_cache)
from kvfuse import reference as R

from helpers import (assert_bytes_equal, cache_strides, cos_sin_cache, guarded_cache, poison_like, random_bf16,
                     write_records)

BF16 = torch.bfloat16
MAX_POS = 96
PRESET_NAMES = sorted(formats.PRESETS)


@pytest.fixture(autouse=True)
def _reference_backend():
    with kvfuse.use_backend("reference"):
        yield


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def u8(t):
    return t.contiguous().view(torch.uint8)


# ------------------------------------------------------------------------------ configuration
STAGES = {
    # name: (norm, rope: None | (rotary_dim or None for 64, is_neox, offset, conjugate), hadamard)
    "none": (False, None, False),
    "norm": (True, None, False),
    "rope_neox": (False, (None, True, None, False), False),
    "rope_interleaved_conj": (False, (None, False, None, True), False),
    "norm_rope_neox": (True, (None, True, None, False), False),            # the article's main path
    "norm_rope_offset_had": (True, (32, False, 16, False), True),          # RoPE segment inside the head
    "had": (False, None, True),
    "norm_had": (True, None, True),
    "rope_neox_conj_had": (False, (None, True, None, True), True),
}


def power_of_two(d):
    return d & (d - 1) == 0 and 16 <= d <= 1024


def make_args(stage, n, D, seed, fp32_weight=False, positions=None):
    norm, rope, had = STAGES[stage]
    g = torch.Generator().manual_seed(seed)
    norm_args = rope_args = had_args = None
    if norm:
        w = (torch.rand(D, generator=g) * 1.5 + 0.25)
        norm_args = NormArgs(w if fp32_weight else w.to(BF16), eps=1e-6)
    if rope:
        rd, neox, off, conj = rope
        rd = 64 if rd is None else rd
        pos = torch.randint(0, MAX_POS, (n,), generator=g) if positions is None else positions
        rope_args = RopeArgs(pos, cos_sin_cache(MAX_POS, rd), rd, neox, off, conj)
    if had:
        had_args = HadamardArgs(scale=D ** -0.5)
    return norm_args, rope_args, had_args


def expected_transform(x3, norm_args, rope_args, had_args):
    """(after norm or None, transform output) from the reference's stage functions."""
    y, normed = x3, None
    if norm_args is not None:
        y = normed = R.rmsnorm(y, norm_args.weight, norm_args.eps)
    if rope_args is not None:
        y = R.rope(y, rope_args.positions, rope_args.cos_sin_cache, rope_args.rotary_dim, rope_args.is_neox,
                   rope_args.offset, rope_args.conjugate)
    if had_args is not None:
        y = R.hadamard(y, had_args.scale)
    return normed, y


def expected_payload(fmt, y3):
    """Record payloads of fmt for the bf16 transform output y3 [n, H, D]:
    (quant bytes, exact scale bytes, tail bytes, cast_back bf16)."""
    if not fmt.quantized:
        return u8(y3), None, None, None
    qd = fmt.head_dim - fmt.bf16_tail
    q, sf = R.quantize(y3[..., :qd], fmt.cast_fmt, fmt.elements_per_sf, fmt.sf_format, fmt.scale_floor)
    back = R.dequantize(q, sf, fmt.cast_fmt, fmt.elements_per_sf, fmt.sf_format, fmt.scale_floor)
    tail = y3[..., qd:]
    back = torch.cat([back, tail], dim=-1)
    return u8(q), u8(sf), (u8(tail) if fmt.bf16_tail else None), back


def make_slots(mode, n, nb, bs, seed, dtype):
    cap = nb * bs
    g = torch.Generator().manual_seed(seed)
    if mode == "continuous":
        start = int(torch.randint(0, cap - n + 1, (1,), generator=g))
        s = torch.arange(start, start + n)
    elif mode == "cross_page":
        # a run that starts just before a page boundary, in shuffled order (n=1: the last slot of a page)
        start = bs - 1 - (n // 2) % bs if n < cap - bs else 0
        s = torch.arange(start, start + n)
        s = s[torch.randperm(n, generator=g)]
    else:
        big = 2 ** 31 - 1 if dtype == torch.int32 else 2 ** 40
        bad = torch.tensor([-1, -2, -bs, -big, cap, cap + 1, big, -1], dtype=torch.int64)
        if n == 1:
            s = torch.tensor([-1])
        else:
            k = min(len(bad), n // 2)
            valid = torch.randperm(cap, generator=g)[: n - k]
            s = torch.cat([bad[:k], valid])
            s = s[torch.randperm(n, generator=g)]
    return s.to(dtype)


def run_cache_case(fmt, stage, n, mode, *, nb=4, bs=8, nh=1, token_padding=0, block_padding=0, out_stage=None,
                   x3d=False, slot_dtype=torch.int64, check_load=True, x_noncontig=False):
    seed = seed_of(fmt.name, stage, n, mode, nh, out_stage)
    D = fmt.head_dim
    shape = (n, nh, D) if (x3d or nh > 1) else (n, D)
    if x_noncontig:
        big = random_bf16((n, nh, D + 32), seed)
        x = big[:, :, 16:16 + D]
        if len(shape) == 2:
            x = x[:, 0]
    else:
        x = random_bf16(shape, seed)
    norm_args, rope_args, had_args = make_args(stage, n, D, seed + 1)
    cast = CastArgs.from_cache_format(fmt)
    cache, storage = guarded_cache(fmt, nb, bs, nh, token_padding, block_padding, seed=seed + 2)
    s0, s1 = cache_strides(fmt, bs, nh, token_padding, block_padding)
    slots = make_slots(mode, n, nb, bs, seed + 3, slot_dtype)
    before = storage.clone()
    out = None
    if out_stage is not None:
        out = poison_like(torch.empty(shape, dtype=BF16))
    ret = fused(x, norm_args, rope_args, had_args, cast,
                KVCacheOutArgs(cache, slots, out=out, out_stage=out_stage, layout=fmt))
    assert ret is out

    x3 = x.reshape(n, nh, D)
    normed, y = expected_transform(x3, norm_args, rope_args, had_args)
    qb, sfb, tb, back = expected_payload(fmt, y)
    expect = write_records(before.clone(), fmt, bs, nb, s0, s1, 64, slots, qb, sfb, tb)
    assert_bytes_equal(storage, expect, f"{fmt.name} {stage} n={n} {mode} storage")
    if out_stage is not None:
        want = {"norm": normed, "transform": y, "cast_back": back}[out_stage]
        assert_bytes_equal(out, want.reshape(shape), f"out_stage={out_stage}")
    if check_load:
        loaded = load_paged_kv_cache(cache, slots, fmt)
        s64 = slots.long()
        valid = (s64 >= 0) & (s64 < nb * bs)
        ref = (y if back is None else back).clone()
        ref[~valid] = 0
        assert_bytes_equal(loaded, ref, "load_paged_kv_cache round trip")
    return x, y, back, cache, slots


# ------------------------------------------------------------------------------ the matrix
MATRIX = [(name, stage, n, mode)
          for name in PRESET_NAMES for stage in STAGES for n in (1, 17)
          for mode in ("continuous", "cross_page", "invalid")
          if not (STAGES[stage][2] and not power_of_two(formats.PRESETS[name].head_dim))]


@pytest.mark.parametrize("name,stage,n,mode", MATRIX)
def test_matrix(name, stage, n, mode):
    fmt = formats.PRESETS[name]
    padded = mode != "continuous"
    tp = 4 if (padded and fmt.token_interleaved) else 0
    bp = 40 if padded else 0
    slot_dtype = torch.int32 if mode == "cross_page" else torch.int64
    run_cache_case(fmt, stage, n, mode, token_padding=tp, block_padding=bp, slot_dtype=slot_dtype,
                   out_stage="transform" if mode == "invalid" else None)


@pytest.mark.parametrize("name,stage,mode", [
    ("MAIN_FP8", "norm_rope_neox", "continuous"),
    ("INDEX_NVFP4", "norm_rope_offset_had", "invalid"),
    ("FLASHMLA_V32", "norm_rope_neox", "cross_page"),
])
def test_large_n_32769(name, stage, mode):
    fmt = formats.PRESETS[name]
    run_cache_case(fmt, stage, 32769, mode, nb=260, bs=128, block_padding=32, check_load=(name == "INDEX_NVFP4"))


# cast_back needs a quantized format (its rejection is tested in test_validation)
@pytest.mark.parametrize("out_stage,name", [
    pytest.param(stage, name, id=f"{stage}-{name}") for stage in ("norm", "transform", "cast_back")
    for name in PRESET_NAMES if stage != "cast_back" or formats.PRESETS[name].quantized])
def test_out_stage(name, out_stage):
    fmt = formats.PRESETS[name]
    stage = "norm_rope_neox"
    run_cache_case(fmt, stage, 17, "invalid", out_stage=out_stage, block_padding=32)
    # also with a 3-D x [n, 1, D]
    run_cache_case(fmt, stage, 5, "cross_page", out_stage=out_stage, x3d=True)


USER_TI_FORMATS = [
    KVCacheFormat("USER_BF16_TI", 64, None, None, None, True),
    KVCacheFormat("USER_FP8_FP32_RESERVED", 256, "e4m3", 64, "fp32", True, sf_bytes=24),
    KVCacheFormat("USER_NVFP4_TI", 128, "e2m1", 16, "e4m3", True, sf_bytes=12),
    KVCacheFormat("USER_TAIL_TI", 192, "e4m3", 64, "ue8m0", True, sf_bytes=4, bf16_tail=64),
]


@pytest.mark.parametrize("fmt", [formats.MAIN_FP8, formats.MAIN_FP4, formats.FLASHMLA_V32] + USER_TI_FORMATS,
                         ids=lambda f: f.name)
@pytest.mark.parametrize("nh", [2, 3])
def test_num_heads(fmt, nh):
    stage = "norm_rope_neox" if fmt.head_dim >= 64 else "norm"
    out_stage = "cast_back" if fmt.quantized else "norm"
    run_cache_case(fmt, stage, 17, "invalid", nh=nh, token_padding=8, block_padding=64, out_stage=out_stage)
    run_cache_case(fmt, stage, 9, "cross_page", nh=nh, slot_dtype=torch.int32)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_noncontiguous_x(name):
    fmt = formats.PRESETS[name]
    stage = "norm_rope_neox"
    run_cache_case(fmt, stage, 17, "cross_page", x_noncontig=True, out_stage="transform")


def test_user_block_wide_format_and_fp32_weight():
    fmt = KVCacheFormat("USER_BW", 256, "e4m3", 128, "ue8m0_fp32", False, sf_bytes=12, bf16_tail=0)
    run_cache_case(fmt, "norm_rope_offset_had", 17, "invalid", block_padding=96, out_stage="cast_back")
    seed = 9
    x = random_bf16((17, 256), seed)
    norm_args, _, _ = make_args("norm", 17, 256, seed, fp32_weight=True)
    assert norm_args.weight.dtype == torch.float32
    y = fused(x, norm_args)
    assert_bytes_equal(y, R.rmsnorm(x, norm_args.weight, 1e-6))


# ------------------------------------------------------------------------------ positions / data
def test_positions_out_of_range_rotate_by_identity():
    fmt = formats.INDEX_BF16
    n, D = 6, 128
    x = random_bf16((n, D), 1)
    pos = torch.tensor([0, MAX_POS, -1, 5, 2 ** 40, -(2 ** 40)])
    cs = cos_sin_cache(MAX_POS, 64)
    cache, storage = guarded_cache(fmt, 2, 4)
    slots = torch.arange(n)
    fused(x, rope_args=RopeArgs(pos, cs, 64, True), out_args=KVCacheOutArgs(cache, slots, layout=fmt))
    got = load_paged_kv_cache(cache, slots, fmt)[:, 0]
    for i in (1, 2, 4, 5):
        assert_bytes_equal(got[i], x[i], f"row {i}")
    assert not torch.equal(u8(got[3]), u8(x[3]))
    for i in (0, 3):
        assert_bytes_equal(got[i], R.rope(x[i:i + 1], pos[i:i + 1], cs, 64, True)[0])


def test_rows_independent_of_batch():
    """A row's cache bytes do not depend on n or on the other rows."""
    fmt = formats.MAIN_FP8
    D = 512
    x = random_bf16((33, D), 4)
    norm_args, rope_args, _ = make_args("norm_rope_neox", 33, D, 5)
    c1, st1 = guarded_cache(fmt, 8, 8)
    slots = torch.randperm(64)[:33]
    fused(x, norm_args, rope_args, None, CastArgs.from_cache_format(fmt), KVCacheOutArgs(c1, slots, layout=fmt))
    c2, st2 = guarded_cache(fmt, 8, 8)
    for i in range(0, 33, 4):
        ra = RopeArgs(rope_args.positions[i:i + 4], rope_args.cos_sin_cache, 64, True)
        fused(x[i:i + 4], norm_args, ra, None, CastArgs.from_cache_format(fmt),
              KVCacheOutArgs(c2, slots[i:i + 4], layout=fmt))
    assert_bytes_equal(st1, st2)


def test_nonfinite_input_confined_to_its_group():
    fmt = formats.MAIN_FP8
    x = random_bf16((3, 512), 8)
    bad = x.clone()
    bad[1, 40] = float("nan")
    bad[1, 300] = float("inf")
    c1, s1 = guarded_cache(fmt, 2, 4)
    c2, s2 = guarded_cache(fmt, 2, 4)
    slots = torch.tensor([0, 1, 2])
    cast = CastArgs.from_cache_format(fmt)
    fused(x, cast_args=cast, out_args=KVCacheOutArgs(c1, slots, layout=fmt))
    fused(bad, cast_args=cast, out_args=KVCacheOutArgs(c2, slots, layout=fmt))
    diff = (s1 != s2).nonzero().flatten()
    # only row 1's groups 1 (dims 32..63) and 9 (dims 288..319) and their scale bytes may differ
    rec = 64 + 1 * c1.stride(1)
    allowed = set(range(rec + 32, rec + 64)) | set(range(rec + 288, rec + 320)) | {rec + 512 + 1, rec + 512 + 9}
    assert set(diff.tolist()) <= allowed


# ------------------------------------------------------------------------------ round trips and error bounds
def decode_scales(fmt, sf_raw):
    """Dequant multipliers d [n, H, num_scales] from raw scale bytes (SPEC §6), independently."""
    ns = (fmt.head_dim - fmt.bf16_tail) // fmt.elements_per_sf
    if fmt.sf_format == "ue8m0":
        return torch.pow(2.0, sf_raw[..., :ns].double() - 127)
    if fmt.sf_format == "e4m3":
        return sf_raw[..., :ns].contiguous().view(torch.float8_e4m3fn).float().double()
    return sf_raw[..., :4 * ns].contiguous().view(torch.float32).double()


@pytest.mark.parametrize("name", [n for n in PRESET_NAMES if formats.PRESETS[n].quantized])
def test_round_trip_error_bounds(name):
    fmt = formats.PRESETS[name]
    n = 64
    x, y, back, cache, slots = run_cache_case(fmt, "norm_rope_neox", n, "continuous", nb=8, bs=16)
    loaded = load_paged_kv_cache(cache, slots, fmt)
    assert_bytes_equal(loaded, back)
    data_raw, sf_raw = load_paged_kv_cache(cache, slots, fmt, dequantize=False)
    assert data_raw.dtype == torch.uint8 and tuple(data_raw.shape) == (n, 1, fmt.data_bytes)
    assert tuple(sf_raw.shape) == (n, 1, fmt.sf_bytes)
    qd = fmt.head_dim - fmt.bf16_tail
    g = fmt.elements_per_sf
    d = decode_scales(fmt, sf_raw).repeat_interleave(g, dim=-1)           # [n, 1, qd]
    v = y[..., :qd].double()
    err = (loaded[..., :qd].double() - v).abs()
    if fmt.cast_fmt == "e4m3":
        # 3 mantissa bits: RTNE relative error < 2^-4 for normal codes (|t| >= 2^-6), plus the bf16 rounding
        # of the dequantized value; subnormal codes: half a step, 2^-10 * d
        rel, sub, normal, frac = 2.0 ** -4 + 2.0 ** -8, 2.0 ** -10, 2.0 ** -6, 0.5
    else:
        # e2m1: for |t| >= 1 the worst case is a tie (1.25 -> 1, 2.5 -> 2, 5 -> 4): 0.2; below: 0.25 * d
        rel, sub, normal, frac = 0.2 + 2.0 ** -7, 0.25, 1.0, 0.2
    assert bool((err <= rel * v.abs() + sub * d).all())
    is_normal = v.abs() >= normal * d
    assert int(is_normal.sum()) > frac * n * qd
    assert bool((err[is_normal] <= rel * v.abs()[is_normal]).all())
    # the tail is stored raw
    assert_bytes_equal(loaded[..., qd:], y[..., qd:])


@pytest.mark.parametrize("name", PRESET_NAMES)
@pytest.mark.parametrize("heads3d", [False, True])
def test_store_kv_cache_then_load(name, heads3d):
    fmt = formats.PRESETS[name]
    n, nb, bs = 17, 3, 8
    seed = seed_of("store", name, heads3d)
    D = fmt.head_dim
    y = random_bf16((n, 1, D), seed)
    cache, storage = guarded_cache(fmt, nb, bs, 1, 0, 32, seed=seed)
    s0, s1 = cache_strides(fmt, bs, 1, 0, 32)
    slots = make_slots("invalid", n, nb, bs, seed, torch.int64)
    before = storage.clone()
    qd = D - fmt.bf16_tail

    def shape(t):
        return t if (heads3d or t is None) else t[:, 0]

    if fmt.quantized:
        q, sf = R.quantize(y[..., :qd], fmt.cast_fmt, fmt.elements_per_sf, fmt.sf_format, fmt.scale_floor)
        tail = y[..., qd:] if fmt.bf16_tail else None
        store_kv_cache(shape(q), shape(sf), cache, slots, fmt, tail=shape(tail))
    else:
        store_kv_cache(shape(y), None, cache, slots, fmt)
    qb, sfb, tb, back = expected_payload(fmt, y)
    expect = write_records(before.clone(), fmt, bs, nb, s0, s1, 64, slots, qb, sfb, tb)
    assert_bytes_equal(storage, expect)
    loaded = load_paged_kv_cache(cache, slots, fmt)
    valid = (slots >= 0) & (slots < nb * bs)
    ref = (y if back is None else back).clone()
    ref[~valid] = 0
    assert_bytes_equal(loaded, ref)
    # raw read: data = quantized bytes then tail; scales include the (untouched, random) reserved bytes
    data_raw, sf_raw = load_paged_kv_cache(cache, slots, fmt, dequantize=False)
    want_data = qb if tb is None else torch.cat([qb, tb], dim=-1)
    assert torch.equal(data_raw[valid], want_data[valid])
    assert int(data_raw[~valid].abs().sum()) == 0
    if fmt.quantized:
        assert torch.equal(sf_raw[valid][..., :sfb.shape[-1]], sfb[valid])


# ------------------------------------------------------------------------------ contiguous outputs
CASTS = ([CastArgs("e4m3", g, sf in ("ue8m0", "ue8m0_fp32"), sf) for sf in ("ue8m0", "ue8m0_fp32", "e4m3", "fp32")
          for g in (16, 32, 64, 128)]
         + [CastArgs("e2m1", 16, False, "e4m3"), CastArgs("e2m1", 32, True, "ue8m0")])
SF_DTYPES = {"ue8m0": torch.uint8, "ue8m0_fp32": torch.float32, "e4m3": torch.float8_e4m3fn, "fp32": torch.float32}


def cast_id(c):
    return f"{c.cast_fmt}-{c.num_per_channels}-{c.sf_format}"


@pytest.mark.parametrize("cast", CASTS, ids=cast_id)
@pytest.mark.parametrize("xshape", [(17, 128), (5, 3, 128)], ids=["2d", "3d"])
def test_contiguous_q_sf(cast, xshape):
    seed = seed_of(cast_id(cast), xshape)
    x = random_bf16(xshape, seed)
    n = xshape[0]
    norm_args, rope_args, had_args = make_args("norm_rope_offset_had", n, 128, seed)
    q, sf = fused(x, norm_args, rope_args, had_args, cast)
    lead = xshape[:-1]
    qdt = torch.float8_e4m3fn if cast.cast_fmt == "e4m3" else torch.uint8
    assert q.dtype == qdt and tuple(q.shape) == lead + (128 if cast.cast_fmt == "e4m3" else 64,)
    assert sf.dtype == SF_DTYPES[cast.sf_format] and tuple(sf.shape) == lead + (128 // cast.num_per_channels,)
    _, y = expected_transform(x.reshape(n, -1, 128), norm_args, rope_args, had_args)
    eq, esf = R.quantize(y, cast.cast_fmt, cast.num_per_channels, cast.sf_format, cast.scale_floor)
    assert_bytes_equal(u8(q), u8(eq).reshape(u8(q).shape))
    assert_bytes_equal(u8(sf), u8(esf).reshape(u8(sf).shape))
    # preallocated outputs: written in place and returned as the same objects
    po, ps = poison_like(q), poison_like(sf)
    r = fused(x, norm_args, rope_args, had_args, cast, ContiguousOutArgs(po, ps))
    assert r[0] is po and r[1] is ps
    assert_bytes_equal(u8(po), u8(q))
    assert_bytes_equal(u8(ps), u8(sf))
    # cast_back: the dequantized bf16, shaped like x
    cb = CastArgs(cast.cast_fmt, cast.num_per_channels, cast.round_sf, cast.sf_format, cast_back=True)
    back = fused(x, norm_args, rope_args, had_args, cb)
    assert back.dtype == BF16 and back.shape == x.shape
    want = R.dequantize(eq, esf, cast.cast_fmt, cast.num_per_channels, cast.sf_format).reshape(x.shape)
    assert_bytes_equal(back, want)
    po = poison_like(back)
    assert fused(x, norm_args, rope_args, had_args, cb, po) is po
    assert_bytes_equal(po, want)
    po = poison_like(back)
    assert fused(x, norm_args, rope_args, had_args, cb, ContiguousOutArgs(out=po)) is po
    assert_bytes_equal(po, want)


def _no_cast_valid(stage, D):
    """The stage chain exists at head_dim D: Hadamard needs a power of two, the default rotary_dim 64 fits."""
    _, rope, had = STAGES[stage]
    return not (had and not power_of_two(D)) and not (rope and rope[0] is None and D < 64)


@pytest.mark.parametrize("xshape,stage", [
    pytest.param(xshape, stage, id=f"{xid}-{stage}") for stage in STAGES
    for xid, xshape in (("2d", (17, 128)), ("3d", (4, 2, 64)), ("576", (3, 576))) if _no_cast_valid(stage, xshape[-1])])
def test_contiguous_no_cast(stage, xshape):
    D = xshape[-1]
    seed = seed_of("nocast", stage, xshape)
    x = random_bf16(xshape, seed)
    n = xshape[0]
    args = make_args(stage, n, D, seed)
    y = fused(x, *args)
    assert y.dtype == BF16 and y.shape == x.shape
    _, want = expected_transform(x.reshape(n, -1, D), *args)
    assert_bytes_equal(y, want.reshape(x.shape))
    if stage == "none":
        assert_bytes_equal(y, x)
        assert y.data_ptr() != x.data_ptr()
    o = poison_like(x)
    assert fused(x, *args, None, o) is o
    assert_bytes_equal(o, y)
    o = poison_like(x)
    assert fused(x, *args, None, ContiguousOutArgs(out=o)) is o
    assert_bytes_equal(o, y)


def test_contiguous_noncontiguous_x_and_zero_rows():
    big = random_bf16((9, 4, 160), 3)
    x = big[:, 1:3, 16:144]                              # [9, 2, 128], stride(-1) = 1
    xc = x.contiguous()
    cast = CastArgs("e4m3", 32, True, "ue8m0")
    na = NormArgs(torch.ones(128, dtype=BF16))
    q1, s1 = fused(x, na, cast_args=cast)
    q2, s2 = fused(xc, na, cast_args=cast)
    assert_bytes_equal(u8(q1), u8(q2))
    assert_bytes_equal(s1, s2)
    xt = xc.transpose(0, 1).contiguous().transpose(0, 1)   # heads outermost in memory
    q3, s3 = fused(xt, na, cast_args=cast)
    assert_bytes_equal(u8(q3), u8(q2))
    # n = 0
    e = fused(torch.empty(0, 128, dtype=BF16), na)
    assert e.shape == (0, 128) and e.dtype == BF16
    q0, s0 = fused(torch.empty(0, 128, dtype=BF16), cast_args=cast)
    assert q0.shape == (0, 128) and s0.shape == (0, 4)


# ------------------------------------------------------------------------------ layout inference
@pytest.mark.parametrize("name", PRESET_NAMES)
def test_layout_none_inference(name):
    fmt = formats.PRESETS[name]
    D = fmt.head_dim
    x = random_bf16((9, D), 2)
    slots = torch.tensor([0, 3, 9, -1, 1, 30, 31, 12, 13])
    ca = CastArgs.from_cache_format(fmt)
    c1, st1 = guarded_cache(fmt, 4, 8, seed=4)
    c2, st2 = guarded_cache(fmt, 4, 8, seed=4)
    fused(x, cast_args=ca, out_args=KVCacheOutArgs(c1, slots, layout=fmt))
    fused(x, cast_args=ca, out_args=KVCacheOutArgs(c2, slots))
    assert_bytes_equal(st1, st2)
    assert not torch.equal(st1, guarded_cache(fmt, 4, 8, seed=4)[1])


def test_layout_none_picks_by_cast():
    # INDEX_MXFP8 and INDEX_FP8_FP32 both have 132-byte records: the cast decides
    x = random_bf16((4, 128), 3)
    slots = torch.arange(4)
    for fmt in (formats.INDEX_MXFP8, formats.INDEX_FP8_FP32):
        c1, st1 = guarded_cache(fmt, 1, 8)
        c2, st2 = guarded_cache(fmt, 1, 8)
        ca = CastArgs.from_cache_format(fmt)
        fused(x, cast_args=ca, out_args=KVCacheOutArgs(c1, slots, layout=fmt))
        fused(x, cast_args=ca, out_args=KVCacheOutArgs(c2, slots))
        assert_bytes_equal(st1, st2)


def test_layout_none_ambiguous_or_unknown(monkeypatch):
    x = random_bf16((4, 128), 3)
    slots = torch.arange(4)
    ca = CastArgs.from_cache_format(formats.INDEX_MXFP8)
    cache, storage = guarded_cache(formats.INDEX_MXFP8, 1, 8)
    before = storage.clone()
    # no preset with this cast and 132 bytes
    with pytest.raises(ValueError, match="layout"):
        fused(x, cast_args=CastArgs("e4m3", 16, False, "e4m3"), out_args=KVCacheOutArgs(cache, slots))
    # a user format's record size matches no preset
    uf = KVCacheFormat("U", 128, "e4m3", 64, "ue8m0", False, sf_bytes=16)
    uc, _ = guarded_cache(uf, 1, 8)
    with pytest.raises(ValueError, match="layout"):
        fused(x, cast_args=CastArgs.from_cache_format(uf), out_args=KVCacheOutArgs(uc, slots))
    # two presets match
    monkeypatch.setitem(formats.PRESETS, "INDEX_MXFP8_TWIN",
                        KVCacheFormat("INDEX_MXFP8_TWIN", 128, "e4m3", 32, "ue8m0", True, sf_bytes=4))
    with pytest.raises(ValueError, match="layout"):
        fused(x, cast_args=ca, out_args=KVCacheOutArgs(cache, slots))
    assert torch.equal(storage, before)
