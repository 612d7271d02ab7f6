"""Every argument rule of SPEC §1, §2, §6, §7, §9 raises ValueError/TypeError naming the argument, before anything is
written: after each rejected call the guarded cache storage and the preallocated outputs are byte-equal
to what they were."""
import dataclasses

import pytest
import torch

import kvfuse
from kvfuse import (CastArgs, ContiguousOutArgs, HadamardArgs, KVCacheFormat, KVCacheOutArgs, NormArgs, RopeArgs,
                    formats, fused_norm_rope_hadamard_cast_store_kvcache as fused, load_paged_kv_cache,
                    store_kv_cache)
from kvfuse import backend as kvbackend
from kvfuse import reference as R

from helpers import assert_bytes_equal, cos_sin_cache, guarded_cache, poison_like, random_bf16

BF16 = torch.bfloat16
META = torch.device("meta")
N = 4
MAX_POS = 16


@pytest.fixture(autouse=True)
def _reference_backend_and_checks():
    saved = kvbackend._checks_override
    kvfuse.set_checks(False)
    with kvfuse.use_backend("reference"):
        yield
    kvbackend._checks_override = saved


class Setup:
    """A valid call (all stages on, a guarded cache, an out tensor) and the bytes to watch."""

    def __init__(self, fmt=formats.INDEX_MXFP8, nh=1, cache_kw=None):
        self.fmt = fmt
        D = self.D = fmt.head_dim
        self.x = random_bf16((N, nh, D) if nh > 1 else (N, D), 0)
        self.cache, self.storage = guarded_cache(fmt, 2, 8, nh, **(cache_kw or {}))
        self.out = poison_like(self.x)
        self.args = dict(
            x=self.x,
            norm_args=NormArgs(torch.ones(D, dtype=BF16)),
            rope_args=RopeArgs(torch.arange(N), cos_sin_cache(MAX_POS, 64), 64, True),
            hadamard_args=HadamardArgs(D ** -0.5) if D & (D - 1) == 0 else None,
            cast_args=CastArgs.from_cache_format(fmt),
            out_args=KVCacheOutArgs(self.cache, torch.arange(N), out=self.out, out_stage="transform", layout=fmt),
        )
        self.watch = [self.storage, self.out]

    def oa(self, **kw):
        self.args["out_args"] = dataclasses.replace(self.args["out_args"], **kw)

    def rope(self, **kw):
        self.args["rope_args"] = dataclasses.replace(self.args["rope_args"], **kw)

    def rejects(self, exc, match, call=None):
        before = [t.clone() for t in self.watch]
        with pytest.raises(exc, match=match):
            (call or (lambda: fused(**self.args)))()
        for t, b in zip(self.watch, before):
            assert_bytes_equal(t, b, "changed by a rejected call")


class Contig(Setup):
    """A valid call without a cache: (q, sf) into preallocated ContiguousOutArgs."""

    def __init__(self, D=128, cast=CastArgs("e4m3", 32, True, "ue8m0"), xshape=None):
        self.D = D
        self.x = random_bf16(xshape or (N, D), 0)
        lead = self.x.shape[:-1]
        self.q = poison_like(torch.empty(lead + (D if cast.cast_fmt == "e4m3" else D // 2,),
                                         dtype=torch.float8_e4m3fn if cast.cast_fmt == "e4m3" else torch.uint8))
        sfdt = {"ue8m0": torch.uint8, "e4m3": torch.float8_e4m3fn}.get(cast.sf_format, torch.float32)
        self.sf = poison_like(torch.empty(lead + (D // cast.num_per_channels,), dtype=sfdt))
        self.args = dict(x=self.x, norm_args=NormArgs(torch.ones(D, dtype=BF16)),
                         rope_args=RopeArgs(torch.arange(N), cos_sin_cache(MAX_POS, 64), 64, True),
                         hadamard_args=HadamardArgs(1.0) if D & (D - 1) == 0 else None, cast_args=cast,
                         out_args=ContiguousOutArgs(self.q, self.sf))
        self.watch = [self.q, self.sf]


def test_valid_setups_pass():
    for fmt in formats.PRESETS.values():
        s = Setup(fmt)
        if fmt.head_dim & (fmt.head_dim - 1):
            s.args["hadamard_args"] = None
        assert fused(**s.args) is s.out
    c = Contig()
    q, sf = fused(**c.args)
    assert q is c.q and sf is c.sf


# =============================================================================== x
@pytest.mark.parametrize("case,exc,match", [
    ("list", TypeError, "x must be a torch.Tensor"),
    ("float32", TypeError, "x: expected dtype torch.bfloat16"),
    ("float16", TypeError, "x: expected dtype"),
    ("1d", ValueError, "x: expected \\[n, head_dim\\]"),
    ("4d", ValueError, "x: expected \\[n, head_dim\\]"),
    ("stride", ValueError, "x: expected stride\\(-1\\) == 1"),
    ("zero_heads", ValueError, "x: num_heads"),
])
def test_x_rejected(case, exc, match):
    s = Setup()
    x = s.x
    s.args["x"] = {"list": lambda: x.tolist(), "float32": lambda: x.float(), "float16": lambda: x.half(),
                   "1d": lambda: x[0], "4d": lambda: x[None, None], "zero_heads": lambda: x[:, None, :][:, :0],
                   "stride": lambda: torch.cat([x, x], -1).view(N, x.shape[-1], 2)[..., 0]}[case]()
    s.rejects(exc, match)


@pytest.mark.parametrize("D", [8, 24, 136, 520])
def test_x_head_dim_not_multiple_of_16(D):
    s = Setup()
    s.args.update(x=random_bf16((N, D), 1), norm_args=None, rope_args=None, hadamard_args=None)
    s.rejects(ValueError, "x: head_dim must be a positive multiple of 16")


# =============================================================================== norm
@pytest.mark.parametrize("case,exc,match", [
    ("type", TypeError, "norm_args must be a NormArgs"),
    ("not_tensor", TypeError, "norm_args.weight must be a torch.Tensor"),
    ("shape", ValueError, "norm_args.weight: expected shape"),
    ("shape2d", ValueError, "norm_args.weight: expected shape"),
    ("float16", TypeError, "norm_args.weight: expected dtype"),
    ("int", TypeError, "norm_args.weight: expected dtype"),
    ("stride", ValueError, "norm_args.weight: expected stride"),
    ("device", ValueError, "norm_args.weight: expected device"),
    ("eps_negative", ValueError, "norm_args.eps"),
    ("eps_nan", ValueError, "norm_args.eps"),
    ("eps_inf", ValueError, "norm_args.eps"),
    ("eps_str", ValueError, "norm_args.eps"),
])
def test_norm_args_rejected(case, exc, match):
    s = Setup()
    D = s.D
    w = torch.ones(D, dtype=BF16)
    s.args["norm_args"] = {
        "type": lambda: (w, 1e-6),
        "not_tensor": lambda: NormArgs([1.0] * D),
        "shape": lambda: NormArgs(torch.ones(D + 16, dtype=BF16)),
        "shape2d": lambda: NormArgs(torch.ones(1, D, dtype=BF16)),
        "float16": lambda: NormArgs(w.half()),
        "int": lambda: NormArgs(torch.ones(D, dtype=torch.int32)),
        "stride": lambda: NormArgs(torch.ones(2 * D, dtype=BF16)[::2]),
        "device": lambda: NormArgs(torch.ones(D, dtype=BF16, device=META)),
        "eps_negative": lambda: NormArgs(w, -1e-6),
        "eps_nan": lambda: NormArgs(w, float("nan")),
        "eps_inf": lambda: NormArgs(w, float("inf")),
        "eps_str": lambda: NormArgs(w, "1e-6"),
    }[case]()
    s.rejects(exc, match)


# =============================================================================== rope
@pytest.mark.parametrize("case,exc,match", [
    ("type", TypeError, "rope_args must be a RopeArgs"),
    ("rotary_odd", ValueError, "rope_args.rotary_dim"),
    ("rotary_zero", ValueError, "rope_args.rotary_dim"),
    ("rotary_too_big", ValueError, "rope_args.rotary_dim"),
    ("rotary_float", ValueError, "rope_args.rotary_dim"),
    ("offset_overflow", ValueError, "rope_args.offset"),
    ("offset_negative", ValueError, "rope_args.offset"),
    ("offset_float", ValueError, "rope_args.offset"),
    ("is_neox_int", TypeError, "rope_args.is_neox"),
    ("conjugate_str", TypeError, "rope_args.conjugate"),
    ("cs_cols", ValueError, "rope_args.cos_sin_cache: expected shape"),
    ("cs_1d", ValueError, "rope_args.cos_sin_cache: expected shape"),
    ("cs_3d", ValueError, "rope_args.cos_sin_cache: expected shape"),
    ("cs_float64", TypeError, "rope_args.cos_sin_cache: expected dtype"),
    ("cs_float16", TypeError, "rope_args.cos_sin_cache: expected dtype"),
    ("cs_stride", ValueError, "rope_args.cos_sin_cache: expected stride"),
    ("cs_device", ValueError, "rope_args.cos_sin_cache: expected device"),
    ("cs_not_tensor", TypeError, "rope_args.cos_sin_cache must be a torch.Tensor"),
    ("pos_float", TypeError, "rope_args.positions: expected dtype"),
    ("pos_int16", TypeError, "rope_args.positions: expected dtype"),
    ("pos_long", ValueError, "rope_args.positions: expected shape"),
    ("pos_short", ValueError, "rope_args.positions: expected shape"),
    ("pos_2d", ValueError, "rope_args.positions: expected shape"),
    ("pos_device", ValueError, "rope_args.positions: expected device"),
    ("pos_list", TypeError, "rope_args.positions must be a torch.Tensor"),
])
def test_rope_args_rejected(case, exc, match):
    s = Setup()
    D = s.D
    cs = cos_sin_cache(MAX_POS, 64)
    {
        "type": lambda: s.args.update(rope_args={"rotary_dim": 64}),
        "rotary_odd": lambda: s.rope(rotary_dim=63, cos_sin_cache=cos_sin_cache(MAX_POS, 62)[:, :63].contiguous()),
        "rotary_zero": lambda: s.rope(rotary_dim=0),
        "rotary_too_big": lambda: s.rope(rotary_dim=D + 2, cos_sin_cache=cos_sin_cache(MAX_POS, D + 2)),
        "rotary_float": lambda: s.rope(rotary_dim=64.0),
        "offset_overflow": lambda: s.rope(offset=D - 32),
        "offset_negative": lambda: s.rope(offset=-2),
        "offset_float": lambda: s.rope(offset=2.0),
        "is_neox_int": lambda: s.rope(is_neox=1),
        "conjugate_str": lambda: s.rope(conjugate="yes"),
        "cs_cols": lambda: s.rope(cos_sin_cache=cos_sin_cache(MAX_POS, 32)),
        "cs_1d": lambda: s.rope(cos_sin_cache=cs.flatten()[:64].contiguous()),
        "cs_3d": lambda: s.rope(cos_sin_cache=cs[None]),
        "cs_float64": lambda: s.rope(cos_sin_cache=cs.double()),
        "cs_float16": lambda: s.rope(cos_sin_cache=cs.half()),
        "cs_stride": lambda: s.rope(cos_sin_cache=cos_sin_cache(MAX_POS, 128)[:, ::2]),
        "cs_device": lambda: s.rope(cos_sin_cache=cs.to(META)),
        "cs_not_tensor": lambda: s.rope(cos_sin_cache=cs.numpy()),
        "pos_float": lambda: s.rope(positions=torch.arange(N, dtype=torch.float32)),
        "pos_int16": lambda: s.rope(positions=torch.arange(N, dtype=torch.int16)),
        "pos_long": lambda: s.rope(positions=torch.arange(N + 1)),
        "pos_short": lambda: s.rope(positions=torch.arange(N - 1)),
        "pos_2d": lambda: s.rope(positions=torch.arange(N)[None]),
        "pos_device": lambda: s.rope(positions=torch.arange(N, device=META)),
        "pos_list": lambda: s.rope(positions=list(range(N))),
    }[case]()
    s.rejects(exc, match)


def _expected_out(s):
    y = s.x
    if s.args["norm_args"] is not None:
        y = R.rmsnorm(y, s.args["norm_args"].weight, s.args["norm_args"].eps)
    ra = s.args["rope_args"]
    if ra is not None:
        y = R.rope(y, ra.positions, ra.cos_sin_cache, ra.rotary_dim, ra.is_neox, ra.offset, ra.conjugate)
    if s.args["hadamard_args"] is not None:
        y = R.hadamard(y, s.args["hadamard_args"].scale)
    return y


def test_rope_bf16_cos_sin_and_full_rotary_accepted():
    s = Setup()
    s.rope(cos_sin_cache=cos_sin_cache(MAX_POS, 64, BF16))
    assert fused(**s.args) is s.out
    assert_bytes_equal(s.out, _expected_out(s))
    s = Setup()
    s.rope(rotary_dim=s.D, cos_sin_cache=cos_sin_cache(MAX_POS, s.D), offset=0)
    assert fused(**s.args) is s.out
    assert_bytes_equal(s.out, _expected_out(s))


# =============================================================================== hadamard
@pytest.mark.parametrize("D", [48, 96, 576, 2048])
def test_hadamard_head_dim_rejected(D):
    # contiguous output (no cache): only the head_dim rule can fail
    s = Setup()
    x = random_bf16((N, D), 2)
    out = poison_like(x)
    s.args = dict(x=x, hadamard_args=HadamardArgs(1.0), out_args=out)
    s.watch = [out]
    s.rejects(ValueError, "hadamard_args: head_dim must be a power of two in \\[16, 1024\\]")


def test_hadamard_576_cache_rejected():
    s = Setup(formats.FLASHMLA_V32)
    s.args["hadamard_args"] = HadamardArgs(1.0)
    s.rejects(ValueError, "hadamard_args")


@pytest.mark.parametrize("case,exc,match", [
    ("type", TypeError, "hadamard_args must be a HadamardArgs"),
    ("nan", ValueError, "hadamard_args.scale"),
    ("inf", ValueError, "hadamard_args.scale"),
    ("str", ValueError, "hadamard_args.scale"),
    ("bool", ValueError, "hadamard_args.scale"),
])
def test_hadamard_args_rejected(case, exc, match):
    s = Setup()
    s.args["hadamard_args"] = {"type": 1.0, "nan": HadamardArgs(float("nan")), "inf": HadamardArgs(float("inf")),
                               "str": HadamardArgs("1"), "bool": HadamardArgs(True)}[case]
    s.rejects(exc, match)


@pytest.mark.parametrize("D", [16, 1024])
def test_hadamard_extremes_accepted(D):
    x = random_bf16((2, D), 3)
    y = fused(x, hadamard_args=HadamardArgs(1.0))
    assert_bytes_equal(y, R.hadamard(x, 1.0))


# =============================================================================== cast combinations
BAD_CASTS = [
    (("e5m2", 32, True, "ue8m0"), ValueError, "cast_args: cast_fmt"),
    ((None, 32, True, "ue8m0"), ValueError, "cast_args: cast_fmt"),
    (("e4m3", 32, True, "ue4m3"), ValueError, "cast_args: sf_format"),
    (("e4m3", 32, False, "bf16"), ValueError, "cast_args: sf_format"),
    (("e4m3", 8, True, "ue8m0"), ValueError, "cast_args: num_per_channels"),
    (("e4m3", 256, True, "ue8m0"), ValueError, "cast_args: num_per_channels"),
    (("e4m3", 24, True, "ue8m0"), ValueError, "cast_args: num_per_channels"),
    (("e4m3", True, True, "ue8m0"), ValueError, "cast_args: num_per_channels"),
    (("e4m3", 32, False, "ue8m0"), ValueError, "cast_args: round_sf must be True"),
    (("e4m3", 32, False, "ue8m0_fp32"), ValueError, "cast_args: round_sf must be True"),
    (("e4m3", 32, True, "e4m3"), ValueError, "cast_args: round_sf must be False"),
    (("e4m3", 32, True, "fp32"), ValueError, "cast_args: round_sf must be False"),
    (("e4m3", 32, 1, "ue8m0"), TypeError, "cast_args: round_sf must be a bool"),
    (("e2m1", 32, False, "e4m3"), ValueError, "cast_args: e2m1"),
    (("e2m1", 16, True, "ue8m0"), ValueError, "cast_args: e2m1"),
    (("e2m1", 16, False, "fp32"), ValueError, "cast_args: e2m1"),
    (("e2m1", 32, False, "fp32"), ValueError, "cast_args: e2m1"),
    (("e2m1", 64, True, "ue8m0"), ValueError, "cast_args: e2m1"),
    (("e2m1", 128, False, "e4m3"), ValueError, "cast_args: e2m1"),
    (("e2m1", 32, True, "ue8m0_fp32"), ValueError, "cast_args: e2m1"),
    (("e2m1", 16, True, "ue8m0_fp32"), ValueError, "cast_args: e2m1"),
]


@pytest.mark.parametrize("cast,exc,match", BAD_CASTS)
def test_disallowed_cast_combinations(cast, exc, match):
    # contiguous (q, sf) path
    s = Contig()
    s.args["cast_args"] = CastArgs(*cast)
    s.rejects(exc, match)
    # cast_back path
    s = Setup()
    out = poison_like(s.x)
    s.args.update(cast_args=CastArgs(*cast, cast_back=True), out_args=out)
    s.watch = [out]
    s.rejects(exc, match)
    # with a cache (layout given)
    s = Setup()
    s.args["cast_args"] = CastArgs(*cast)
    s.rejects(exc, match)


@pytest.mark.parametrize("D,g", [(48, 32), (80, 64), (96, 64), (112, 32), (144, 128)])
def test_group_size_must_divide_head_dim(D, g):
    s = Contig(D=D, cast=CastArgs("e4m3", g, True, "ue8m0"))
    s.args.update(rope_args=None, hadamard_args=None)
    # the preallocated sf cannot have a fractional shape: give outputs through a fresh call
    s.args["out_args"] = None
    s.rejects(ValueError, f"num_per_channels={g} must divide")


def test_cast_back_must_be_bool():
    s = Contig()
    s.args["cast_args"] = CastArgs("e4m3", 32, True, "ue8m0", cast_back=1)
    s.rejects(TypeError, "cast_args.cast_back must be a bool")


@pytest.mark.parametrize("bad", ["e4m3", 5, ("e4m3", 32, True, "ue8m0")])
def test_cast_args_wrong_type_contiguous(bad):
    s = Contig()
    s.args["cast_args"] = bad
    s.rejects(TypeError, "cast_args")


def test_cast_args_wrong_type_with_layout():
    s = Setup()
    s.args["cast_args"] = "e4m3"
    s.rejects(TypeError, "cast_args must be a CastArgs")


def test_cast_args_wrong_type_layout_none():
    s = Setup()
    s.oa(layout=None)
    s.args["cast_args"] = "e4m3"
    s.rejects(TypeError, "cast_args")


@pytest.mark.parametrize("where", ["contiguous", "cache"])
def test_float_num_per_channels_rejected(where):
    s = Contig() if where == "contiguous" else Setup()
    s.args["cast_args"] = CastArgs("e4m3", 32.0, True, "ue8m0")
    s.rejects((TypeError, ValueError), "num_per_channels")


# =============================================================================== cache: cast / out_stage
@pytest.mark.parametrize("name,cast,match", [
    ("INDEX_MXFP8", CastArgs("e4m3", 128, False, "fp32"), "cast_args must match the cache format"),
    ("INDEX_MXFP8", CastArgs("e4m3", 16, True, "ue8m0"), "cast_args must match the cache format"),
    ("INDEX_FP8_FP32", CastArgs("e4m3", 128, True, "ue8m0"), "cast_args must match the cache format"),
    ("MAIN_FP8", CastArgs("e4m3", 64, True, "ue8m0"), "cast_args must match the cache format"),
    ("MAIN_FP4", CastArgs("e2m1", 32, True, "ue8m0"), "cast_args must match the cache format"),
    ("INDEX_MXFP4", CastArgs("e4m3", 32, True, "ue8m0"), "cast_args must match the cache format"),
    ("FLASHMLA_V32", CastArgs("e4m3", 128, True, "ue8m0"), "cast_args must match the cache format"),
    ("FLASHMLA_MODEL1", CastArgs("e4m3", 32, True, "ue8m0"), "cast_args must match the cache format"),
    ("FLASHMLA_MODEL1", CastArgs("e4m3", 128, True, "ue8m0"), "num_per_channels=128 must divide"),
    ("MAIN_FP8", None, "cast_args must be"),
    ("INDEX_NVFP4", None, "cast_args must be"),
    ("INDEX_BF16", CastArgs("e4m3", 32, True, "ue8m0"), "cast_args must be None for the bf16 cache"),
])
def test_cast_args_must_match_cache(name, cast, match):
    fmt = formats.PRESETS[name]
    s = Setup(fmt)
    if fmt.head_dim & (fmt.head_dim - 1):
        s.args["hadamard_args"] = None
    s.args["cast_args"] = cast
    s.rejects(ValueError, match)


def test_cast_back_true_with_cache():
    s = Setup()
    c = CastArgs.from_cache_format(s.fmt)
    s.args["cast_args"] = dataclasses.replace(c, cast_back=True)
    s.rejects(ValueError, "cast_args.cast_back must be False with a KV cache")


@pytest.mark.parametrize("case,match", [
    ("invalid", "out_args.out_stage must be one of"),
    ("invalid_no_out", "out_args.out_stage must be one of"),
    ("rope", "out_args.out_stage must be one of"),
    ("norm_without_norm", "out_args.out_stage='norm' needs norm_args"),
    ("cast_back_bf16", "out_args.out_stage='cast_back' needs a quantized format"),
    ("out_without_stage", "out_args.out_stage must be one of .* when out_args.out is given"),
])
def test_out_stage_rejected(case, match):
    fmt = formats.INDEX_BF16 if case == "cast_back_bf16" else formats.INDEX_MXFP8
    s = Setup(fmt)
    if case == "invalid":
        s.oa(out_stage="hadamard")
    elif case == "invalid_no_out":
        s.oa(out=None, out_stage="quant")
    elif case == "rope":
        s.oa(out_stage="rope")
    elif case == "norm_without_norm":
        s.args["norm_args"] = None
        s.oa(out_stage="norm")
    elif case == "cast_back_bf16":
        s.oa(out_stage="cast_back")
    else:
        s.oa(out_stage=None)
    s.rejects(ValueError, match)


@pytest.mark.parametrize("case,exc,match", [
    ("shape", ValueError, "out_args.out: expected shape"),
    ("shape3d", ValueError, "out_args.out: expected shape"),
    ("dtype", TypeError, "out_args.out: expected dtype"),
    ("stride", ValueError, "out_args.out: expected stride"),
    ("device", ValueError, "out_args.out: expected device"),
    ("not_tensor", TypeError, "out_args.out must be a torch.Tensor"),
])
def test_cache_out_rejected(case, exc, match):
    s = Setup()
    D = s.D
    bad = {"shape": lambda: torch.empty(N + 1, D, dtype=BF16), "shape3d": lambda: torch.empty(N, 1, D, dtype=BF16),
           "dtype": lambda: torch.empty(N, D, dtype=torch.float32),
           "stride": lambda: torch.empty(N, 2 * D, dtype=BF16)[:, ::2],
           "device": lambda: torch.empty(N, D, dtype=BF16, device=META),
           "not_tensor": lambda: [[0.0] * D] * N}[case]()
    s.oa(out=bad)
    s.rejects(exc, match)


# =============================================================================== cache tensor / strides / layout
def _as_cache(fmt, shape, strides):
    size = sum((n - 1) * st for n, st in zip(shape, strides)) + 1
    return torch.as_strided(torch.zeros(size, dtype=torch.uint8), shape, strides)


@pytest.mark.parametrize("case,exc,match", [
    ("not_tensor", TypeError, "out_args.kv_cache must be a torch.Tensor"),
    ("int8", TypeError, "out_args.kv_cache must be uint8"),
    ("float32", TypeError, "out_args.kv_cache must be uint8"),
    ("3d", ValueError, "out_args.kv_cache must be \\[num_blocks, block_size, num_heads, bytes_per_token\\]"),
    ("last_dim", ValueError, "out_args.kv_cache: last dim must be MAIN_FP8's bytes_per_token 532"),
    ("stride1_alignment", ValueError, "out_args.kv_cache: stride\\(1\\) must be a multiple of 4"),
    ("stride1_small", ValueError, "out_args.kv_cache: stride\\(1\\)"),
    ("stride0_alignment", ValueError, "out_args.kv_cache: stride\\(0\\) must be a multiple of 4 .*got 4258"),
    ("stride0_small", ValueError, "out_args.kv_cache: stride\\(0\\)"),
    ("stride3", ValueError, "out_args.kv_cache: stride\\(3\\) must be 1"),
    ("device", ValueError, "out_args.kv_cache: expected device"),
])
def test_cache_tensor_rejected_token_interleaved(case, exc, match):
    s = Setup(formats.MAIN_FP8)
    bpt = 532
    bad = {
        "not_tensor": lambda: s.cache.numpy(),
        "int8": lambda: s.cache.view(torch.int8),
        "float32": lambda: torch.zeros(2, 8, 1, 133, dtype=torch.float32),
        "3d": lambda: s.cache[:, :, 0],
        "last_dim": lambda: formats.MAIN_FP4.allocate(2, 8),
        "stride1_alignment": lambda: _as_cache(None, (2, 8, 1, bpt), (4288, 534, bpt, 1)),
        "stride1_small": lambda: _as_cache(None, (2, 8, 1, bpt), (4288, 528, bpt, 1)),
        # 4258 >= 8*532 = 4256 but not a multiple of gcd(32, 532) = 4 (4260 would be accepted: SPEC §7)
        "stride0_alignment": lambda: _as_cache(None, (2, 8, 1, bpt), (4258, 532, bpt, 1)),
        "stride0_small": lambda: _as_cache(None, (2, 8, 1, bpt), (4224, 532, bpt, 1)),
        "stride3": lambda: _as_cache(None, (2, 8, 1, bpt), (2 * 8544, 1064, 1064, 2)),
        "device": lambda: torch.empty(2, 8, 1, bpt, dtype=torch.uint8, device=META),
    }[case]()
    s.oa(kv_cache=bad)
    s.rejects(exc, match)


@pytest.mark.parametrize("case,match", [
    ("not_dense", "out_args.kv_cache: a block-wide block must be dense"),
    ("heads", "out_args.kv_cache: a block-wide format \\(INDEX_MXFP8\\) needs num_heads == 1"),
    ("stride0_not_32", "out_args.kv_cache: stride\\(0\\) must be a multiple of 32"),
])
def test_cache_tensor_rejected_block_wide(case, match):
    s = Setup(formats.INDEX_MXFP8)
    bpt = 132
    bad = {"not_dense": lambda: _as_cache(None, (2, 8, 1, bpt), (1088, 136, bpt, 1)),
           "heads": lambda: _as_cache(None, (2, 8, 2, bpt), (2112, 264, bpt, 1)),
           "stride0_not_32": lambda: _as_cache(None, (2, 8, 1, bpt), (1060, 132, bpt, 1))}[case]()
    s.oa(kv_cache=bad)
    s.rejects(ValueError, match)


def test_x_and_cache_devices_differ():
    s = Setup()
    xm = torch.empty(N, s.D, dtype=BF16, device=META)
    s.args.update(x=xm, norm_args=None, rope_args=None, hadamard_args=None)
    s.oa(out=None, out_stage=None)
    s.rejects(ValueError, "out_args.kv_cache: expected device meta")


@pytest.mark.parametrize("case", ["x2d_cache2", "x3d_3_cache2", "x3d_1_cache2"])
def test_num_heads_mismatch(case):
    s = Setup(formats.MAIN_FP8, nh=2)
    s.args["hadamard_args"] = None
    D = s.D
    x = {"x2d_cache2": random_bf16((N, D), 5), "x3d_3_cache2": random_bf16((N, 3, D), 5),
         "x3d_1_cache2": random_bf16((N, 1, D), 5)}[case]
    s.args["x"] = x
    s.oa(out=None, out_stage=None)
    s.rejects(ValueError, "out_args.kv_cache: num_heads must equal x's")


def test_head_dim_mismatch():
    s = Setup(formats.MAIN_FP8)
    x = random_bf16((N, 128), 6)
    s.args.update(x=x, norm_args=None, hadamard_args=None)
    s.oa(out=None, out_stage=None)
    s.rejects(ValueError, "out_args.layout MAIN_FP8 has head_dim 512, but x has head_dim 128")


@pytest.mark.parametrize("layout", ["MAIN_FP8", 532, CastArgs("e4m3", 32, True, "ue8m0")])
def test_layout_not_a_format(layout):
    s = Setup(formats.MAIN_FP8)
    s.oa(layout=layout)
    s.rejects(TypeError, "out_args.layout must be a KVCacheFormat")


def test_layout_other_format_same_size_rejected():
    # INDEX_FP8_FP32 has the same 132-byte records as INDEX_MXFP8 but another cast
    s = Setup(formats.INDEX_MXFP8)
    s.oa(layout=formats.INDEX_FP8_FP32)
    s.rejects(ValueError, "cast_args must match the cache format INDEX_FP8_FP32")


@pytest.mark.parametrize("case,exc,match", [
    ("float", TypeError, "out_args.slot_mapping: expected dtype"),
    ("int16", TypeError, "out_args.slot_mapping: expected dtype"),
    ("uint8", TypeError, "out_args.slot_mapping: expected dtype"),
    ("long", ValueError, "out_args.slot_mapping: expected shape"),
    ("2d", ValueError, "out_args.slot_mapping: expected shape"),
    ("device", ValueError, "out_args.slot_mapping: expected device"),
    ("list", TypeError, "out_args.slot_mapping must be a torch.Tensor"),
])
def test_slot_mapping_rejected(case, exc, match):
    s = Setup()
    bad = {"float": torch.arange(N, dtype=torch.float32), "int16": torch.arange(N, dtype=torch.int16),
           "uint8": torch.arange(N, dtype=torch.uint8), "long": torch.arange(N + 1),
           "2d": torch.arange(N)[None], "device": torch.arange(N, device=META), "list": list(range(N))}[case]
    s.oa(slot_mapping=bad)
    s.rejects(exc, match)


@pytest.mark.parametrize("bad", [{"kv_cache": 1}, (1, 2), [torch.zeros(1)], "cache", 3])
def test_out_args_wrong_type(bad):
    s = Setup()
    s.args["out_args"] = bad
    s.rejects(TypeError, "out_args must be None, a Tensor, ContiguousOutArgs or KVCacheOutArgs")


# =============================================================================== contiguous outputs
@pytest.mark.parametrize("case,exc,match", [
    ("q_dtype", TypeError, "out_args.out: expected dtype torch.float8_e4m3fn"),
    ("q_shape", ValueError, "out_args.out: expected shape"),
    ("q_stride", ValueError, "out_args.out: expected stride"),
    ("q_device", ValueError, "out_args.out: expected device"),
    ("sf_dtype", TypeError, "out_args.sf: expected dtype torch.uint8"),
    ("sf_shape", ValueError, "out_args.sf: expected shape"),
    ("sf_not_tensor", TypeError, "out_args.sf must be a torch.Tensor"),
])
def test_contiguous_out_rejected(case, exc, match):
    c = Contig()
    q, sf = c.q, c.sf
    bad_q, bad_sf = q, sf
    if case == "q_dtype":
        bad_q = torch.empty(q.shape, dtype=torch.uint8)
    elif case == "q_shape":
        bad_q = torch.empty(N, 64, dtype=torch.float8_e4m3fn)
    elif case == "q_stride":
        bad_q = torch.empty(N, 256, dtype=torch.uint8).view(torch.float8_e4m3fn)[:, ::2]
    elif case == "q_device":
        bad_q = torch.empty(q.shape, dtype=q.dtype, device=META)
    elif case == "sf_dtype":
        bad_sf = torch.empty(sf.shape, dtype=torch.float32)
    elif case == "sf_shape":
        bad_sf = torch.empty(N, 8, dtype=torch.uint8)
    else:
        bad_sf = [0] * 4
    c.args["out_args"] = ContiguousOutArgs(bad_q, bad_sf)
    c.rejects(exc, match)


@pytest.mark.parametrize("cast,q,sf,exc,match", [
    # e2m1 q is uint8 [.., D/2]
    (CastArgs("e2m1", 16, False, "e4m3"), (torch.float8_e4m3fn, 64), (torch.float8_e4m3fn, 8), TypeError,
     "out_args.out: expected dtype torch.uint8"),
    (CastArgs("e2m1", 16, False, "e4m3"), (torch.uint8, 128), (torch.float8_e4m3fn, 8), ValueError,
     "out_args.out: expected shape"),
    (CastArgs("e2m1", 16, False, "e4m3"), (torch.uint8, 64), (torch.uint8, 8), TypeError,
     "out_args.sf: expected dtype torch.float8_e4m3fn"),
    (CastArgs("e4m3", 128, False, "fp32"), (torch.float8_e4m3fn, 128), (torch.uint8, 1), TypeError,
     "out_args.sf: expected dtype torch.float32"),
    (CastArgs("e4m3", 64, True, "ue8m0_fp32"), (torch.float8_e4m3fn, 128), (torch.uint8, 2), TypeError,
     "out_args.sf: expected dtype torch.float32"),
    (CastArgs("e4m3", 64, True, "ue8m0_fp32"), (torch.float8_e4m3fn, 128), (torch.float32, 4), ValueError,
     "out_args.sf: expected shape"),
])
def test_contiguous_out_dtype_per_cast(cast, q, sf, exc, match):
    c = Contig(cast=cast)
    bq = poison_like(torch.empty(N, q[1], dtype=q[0]))
    bsf = poison_like(torch.empty(N, sf[1], dtype=sf[0]))
    c.args["out_args"] = ContiguousOutArgs(bq, bsf)
    c.watch = [bq, bsf]
    c.rejects(exc, match)


def test_contiguous_sf_without_cast():
    x = random_bf16((N, 128), 1)
    out = poison_like(x)
    sf = poison_like(torch.empty(N, 4, dtype=torch.uint8))
    s = Setup()
    s.args = dict(x=x, norm_args=NormArgs(torch.ones(128, dtype=BF16)), out_args=ContiguousOutArgs(out, sf))
    s.watch = [out, sf]
    s.rejects(ValueError, "out_args.sf must be None")
    # with cast_back the result is bf16 too
    s.args["cast_args"] = CastArgs("e4m3", 32, True, "ue8m0", cast_back=True)
    s.rejects(ValueError, "out_args.sf must be None")


@pytest.mark.parametrize("case,exc,match", [
    ("dtype", TypeError, "out_args: expected dtype torch.bfloat16"),
    ("shape", ValueError, "out_args: expected shape"),
    ("shape_3d", ValueError, "out_args: expected shape"),
    ("contig_dtype", TypeError, "out_args.out: expected dtype torch.bfloat16"),
    ("cast_back_dtype", TypeError, "out_args: expected dtype torch.bfloat16"),
    ("cast_back_q_shape", ValueError, "out_args.out: expected shape"),
])
def test_bf16_out_rejected(case, exc, match):
    x = random_bf16((N, 128), 1)
    s = Setup()
    s.args = dict(x=x, norm_args=NormArgs(torch.ones(128, dtype=BF16)))
    bad = {"dtype": torch.zeros(N, 128), "shape": torch.zeros(N, 64, dtype=BF16),
           "shape_3d": torch.zeros(N, 1, 128, dtype=BF16),
           "contig_dtype": ContiguousOutArgs(torch.zeros(N, 128, dtype=torch.float16)),
           "cast_back_dtype": torch.zeros(N, 128, dtype=torch.float8_e4m3fn),
           "cast_back_q_shape": ContiguousOutArgs(torch.zeros(N, 64, dtype=BF16))}[case]
    if case.startswith("cast_back"):
        s.args["cast_args"] = CastArgs("e4m3", 32, True, "ue8m0", cast_back=True)
    s.args["out_args"] = bad
    s.watch = [bad.out if isinstance(bad, ContiguousOutArgs) else bad]
    s.rejects(exc, match)


# =============================================================================== store / load entry points
def _store_setup(fmt, nh=1):
    cache, storage = guarded_cache(fmt, 2, 8, nh)
    y = random_bf16((N, nh, fmt.head_dim), 2)
    qd = fmt.head_dim - fmt.bf16_tail
    if fmt.quantized:
        q, sf = R.quantize(y[..., :qd], fmt.cast_fmt, fmt.elements_per_sf, fmt.sf_format)
    else:
        q, sf = y, None
    tail = y[..., qd:] if fmt.bf16_tail else None
    return cache, storage, q, sf, tail


@pytest.mark.parametrize("case,exc,match", [
    ("layout", TypeError, "layout must be a KVCacheFormat"),
    ("data_dtype", TypeError, "data: expected dtype torch.float8_e4m3fn"),
    ("data_shape", ValueError, "data: expected shape"),
    ("data_device", ValueError, "data: expected device"),
    ("sf_dtype", TypeError, "sf: expected dtype torch.uint8"),
    ("sf_shape", ValueError, "sf: expected shape"),
    ("sf_missing", TypeError, "sf must be a torch.Tensor"),
    ("slot_dtype", TypeError, "slot_mapping: expected dtype"),
    ("slot_len", ValueError, "data: expected shape"),
    ("slot_list", TypeError, "slot_mapping must be a torch.Tensor"),
    ("cache_last_dim", ValueError, "kv_cache: last dim"),
    ("tail_given", ValueError, "tail must be None"),
])
def test_store_kv_cache_rejected(case, exc, match):
    fmt = formats.MAIN_FP8
    cache, storage, q, sf, tail = _store_setup(fmt)
    slots = torch.arange(N)
    args = dict(data=q, sf=sf, kv_cache=cache, slot_mapping=slots, layout=fmt)
    if case == "layout":
        args["layout"] = "MAIN_FP8"
    elif case == "data_dtype":
        args["data"] = q.view(torch.uint8)
    elif case == "data_shape":
        args["data"] = q[..., :256]
    elif case == "data_device":
        args["data"] = torch.empty(q.shape, dtype=q.dtype, device=META)
    elif case == "sf_dtype":
        args["sf"] = sf.float()
    elif case == "sf_shape":
        args["sf"] = sf[..., :8]
    elif case == "sf_missing":
        args["sf"] = None
    elif case == "slot_dtype":
        args["slot_mapping"] = slots.float()
    elif case == "slot_len":
        args["slot_mapping"] = torch.arange(N + 1)
    elif case == "slot_list":
        args["slot_mapping"] = [0, 1, 2, 3]
    elif case == "cache_last_dim":
        args["kv_cache"] = formats.MAIN_FP4.allocate(2, 8)
    else:
        args["tail"] = torch.zeros(N, 1, 64, dtype=BF16)
    before = storage.clone()
    with pytest.raises(exc, match=match):
        store_kv_cache(**args)
    assert torch.equal(storage, before)


def test_store_kv_cache_bf16_and_tail_rules():
    cache, storage, y, _, _ = _store_setup(formats.INDEX_BF16)
    before = storage.clone()
    with pytest.raises(ValueError, match="sf must be None for the bf16 cache"):
        store_kv_cache(y, torch.zeros(N, 1, 4, dtype=torch.uint8), cache, torch.arange(N), formats.INDEX_BF16)
    with pytest.raises(TypeError, match="data: expected dtype torch.bfloat16"):
        store_kv_cache(y.float(), None, cache, torch.arange(N), formats.INDEX_BF16)
    assert torch.equal(storage, before)
    fmt = formats.FLASHMLA_V32
    cache, storage, q, sf, tail = _store_setup(fmt)
    before = storage.clone()
    with pytest.raises(TypeError, match="tail must be a torch.Tensor"):
        store_kv_cache(q, sf, cache, torch.arange(N), fmt)
    with pytest.raises(ValueError, match="tail: expected shape"):
        store_kv_cache(q, sf, cache, torch.arange(N), fmt, tail=tail[..., :32])
    with pytest.raises(TypeError, match="tail: expected dtype torch.bfloat16"):
        store_kv_cache(q, sf, cache, torch.arange(N), fmt, tail=tail.float())
    assert torch.equal(storage, before)
    # num_heads: a [n, D'] payload is only accepted for a one-head cache
    fmt = formats.MAIN_FP8
    cache, storage, q, sf, _ = _store_setup(fmt, nh=2)
    before = storage.clone()
    with pytest.raises(ValueError, match="data: expected shape"):
        store_kv_cache(q[:, 0], sf[:, 0], cache, torch.arange(N), fmt)
    assert torch.equal(storage, before)


@pytest.mark.parametrize("case,exc,match", [
    ("layout", TypeError, "layout must be a KVCacheFormat"),
    ("dequantize", TypeError, "dequantize must be a bool"),
    ("slot_dtype", TypeError, "slot_mapping: expected dtype"),
    ("slot_2d", ValueError, "slot_mapping: expected shape"),
    ("cache_dtype", TypeError, "kv_cache must be uint8"),
    ("cache_last_dim", ValueError, "kv_cache: last dim"),
])
def test_load_rejected(case, exc, match):
    fmt = formats.INDEX_MXFP8
    cache = fmt.allocate(2, 8)
    args = dict(kv_cache=cache, slot_mapping=torch.arange(N), layout=fmt)
    if case == "layout":
        args["layout"] = None
    elif case == "dequantize":
        args["dequantize"] = 1
    elif case == "slot_dtype":
        args["slot_mapping"] = torch.arange(N, dtype=torch.float64)
    elif case == "slot_2d":
        args["slot_mapping"] = torch.arange(N)[None]
    elif case == "cache_dtype":
        args["kv_cache"] = cache.view(torch.int8)
    else:
        args["kv_cache"] = formats.INDEX_MXFP4.allocate(2, 8)
    with pytest.raises(exc, match=match):
        load_paged_kv_cache(**args)


# =============================================================================== KVFUSE_CHECKS
def test_data_checks_off_by_default():
    s = Setup()
    s.rope(positions=torch.tensor([0, MAX_POS, -1, 2 ** 40]))
    s.oa(slot_mapping=torch.tensor([3, 3, -1, -1]))
    before = s.storage.clone()
    # identity rotation for the bad positions; duplicate slots are the caller's business
    assert fused(**s.args) is s.out
    assert_bytes_equal(s.out, _expected_out(s))
    assert not torch.equal(s.storage, before)


@pytest.mark.parametrize("how", ["set_checks", "env"])
@pytest.mark.parametrize("case,match", [
    ("pos_high", "rope_args.positions must lie in \\[0, 16\\)"),
    ("pos_negative", "rope_args.positions must lie in \\[0, 16\\)"),
    ("dup_slots", "slot_mapping holds duplicate valid slots"),
    ("dup_slots_int32", "slot_mapping holds duplicate valid slots"),
])
def test_data_checks(how, case, match, monkeypatch):
    if how == "set_checks":
        kvfuse.set_checks(True)
    else:
        monkeypatch.setattr(kvbackend, "_checks_override", None)
        monkeypatch.setenv("KVFUSE_CHECKS", "1")
    assert kvfuse.checks_enabled()
    s = Setup()
    if case == "pos_high":
        s.rope(positions=torch.tensor([0, 1, MAX_POS, 2]))
    elif case == "pos_negative":
        s.rope(positions=torch.tensor([0, -1, 3, 2], dtype=torch.int32))
    elif case == "dup_slots":
        s.oa(slot_mapping=torch.tensor([5, 1, 5, 2]))
    else:
        s.oa(slot_mapping=torch.tensor([0, 15, -1, 15], dtype=torch.int32))
    s.rejects(ValueError, match)


def test_data_checks_allow_repeated_invalid_slots():
    kvfuse.set_checks(True)
    s = Setup()
    s.oa(slot_mapping=torch.tensor([-1, -1, 16, 16]))      # 16 = num_blocks * block_size: invalid
    before = s.storage.clone()
    fused(**s.args)
    assert torch.equal(s.storage, before)                    # nothing valid: nothing written
    assert_bytes_equal(s.out, _expected_out(s))
    # store_kv_cache runs the slot check too
    fmt = formats.MAIN_FP8
    cache, storage, q, sf, _ = _store_setup(fmt)
    before = storage.clone()
    with pytest.raises(ValueError, match="duplicate"):
        store_kv_cache(q, sf, cache, torch.tensor([1, 2, 1, 3]), fmt)
    assert torch.equal(storage, before)
    store_kv_cache(q, sf, cache, torch.tensor([1, 2, -7, -7]), fmt)
    assert not torch.equal(storage, before)


def test_set_checks_type():
    with pytest.raises(TypeError, match="enabled must be a bool"):
        kvfuse.set_checks(1)


def test_use_backend_name():
    with pytest.raises(ValueError, match="backend must be one of"):
        with kvfuse.use_backend("cuda"):
            pass


def test_user_formats_in_the_api_validated():
    # a user format with a bad cast combination cannot even be built; a valid one is checked like a preset
    with pytest.raises(ValueError, match="e2m1"):
        KVCacheFormat("bad", 128, "e2m1", 32, "e4m3", True)
    uf = KVCacheFormat("U", 128, "e4m3", 64, "fp32", True, sf_bytes=12)
    s = Setup(uf)
    s.args["cast_args"] = CastArgs("e4m3", 64, True, "ue8m0")
    s.rejects(ValueError, "cast_args must match the cache format U")


def test_head_dim_mismatch_blames_x_and_the_format_not_the_weight():
    """x of the wrong width for the cache's format: the error names the format and x, even when the
    norm weight was shaped for the format."""
    fmt = kvfuse.formats.MAIN_FP8
    cache = fmt.allocate(2, 4)
    x = torch.zeros(3, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"out_args.layout MAIN_FP8 has head_dim 512, but x has head_dim 128"):
        kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(
            x, norm_args=kvfuse.NormArgs(torch.ones(512)), cast_args=kvfuse.CastArgs.from_cache_format(fmt),
            out_args=kvfuse.KVCacheOutArgs(cache, torch.arange(3), layout=fmt))
