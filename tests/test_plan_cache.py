"""The plan cache (kvfuse.plans.cache): a validated call signature keeps its template and launch parameters.

- hits and misses are counted; a repeated signature (new argument objects, new tensors) is a hit;
- a rejected call raises the same error, type and message, with the cache warm and with it off
  (cases from tests/test_validation.py, each after a valid call of a neighbouring signature);
- every change of what validation reads (dtype, shape, strides, device of a tensor, a field of an
  argument object, the layout object, the presets behind layout=None) is a miss; a tensor at
  another storage offset is a hit and the launch takes its own pointer;
- the bytes written (cache storage compared whole, outputs) are the same with the cache on and off,
  on the triton (interpreter) and reference backends, for the call that hits;
- force_config, KVFUSE_CHECKS and new outputs still act on every call; the cache holds no tensor,
  is bounded, survives threads, is bypassed while compiling and can be switched off.
"""
from __future__ import annotations

import dataclasses
import gc
import os
import subprocess
import sys
import threading
import weakref

import pytest
import torch

import kvfuse
from kvfuse import (CastArgs, ContiguousOutArgs, HadamardArgs, KVCacheFormat, KVCacheOutArgs, NormArgs, RopeArgs,
                    formats)
from kvfuse import backend as kv_backend
from kvfuse.plans import cache as kv_plan
from kvfuse.plans import fused as kv_fused
from kvfuse.plans.types import PlanTemplate
from kvfuse.kernels import config
from kvfuse.kernels import router as kernels

from helpers import cos_sin_cache, guarded_cache, poison_like, random_bf16
from test_validation import BAD_CASTS, MAX_POS, N, Contig, Setup

fused = kvfuse.fused_norm_rope_hadamard_cast_store_kvcache
BF16 = torch.bfloat16
META = torch.device("meta")
needs_interpreter = pytest.mark.skipif(not kv_backend.interpreter_enabled(), reason="needs TRITON_INTERPRET=1")
BACKENDS = [pytest.param("triton", marks=needs_interpreter), "reference"]


@pytest.fixture(autouse=True)
def _fresh_cache():
    saved_checks = kv_backend._checks_override
    saved_enabled = kv_plan.plan_cache_enabled()
    kvfuse.set_checks(False)
    kv_plan.set_plan_cache(True)
    kv_plan.clear_plan_cache()
    with kvfuse.use_backend("reference"):
        yield
    kv_plan.set_plan_cache(saved_enabled)
    kv_plan.clear_plan_cache()
    kv_backend._checks_override = saved_checks


def counts():
    info = kv_plan.plan_cache_info()
    return info.hits, info.misses


class _Recorder:
    """Stands in for a Triton kernel: records (grid, positional args, keyword args) of each launch."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


# =============================================================================== counting
def test_hits_and_misses_counted():
    s = Setup(formats.MAIN_FP8)
    fused(**s.args)
    assert counts() == (0, 1)
    assert kv_plan.plan_cache_info().size == 1
    fused(**s.args)
    fused(**s.args)
    assert counts() == (2, 1)
    # new argument objects and new tensors of the same signature: a hit
    fused(**Setup(formats.MAIN_FP8).args)
    assert counts() == (3, 1)
    # store / load entries count in the same cache
    kvfuse.load_paged_kv_cache(s.cache, torch.arange(N), formats.MAIN_FP8)
    kvfuse.load_paged_kv_cache(s.cache, torch.arange(N), formats.MAIN_FP8)
    assert counts() == (4, 2)
    kv_plan.clear_plan_cache()
    assert kv_plan.plan_cache_info()[:3] == (0, 0, 0)


def test_switched_off_nothing_is_looked_up_or_stored():
    kv_plan.set_plan_cache(False)
    s = Setup()
    for _ in range(3):
        fused(**s.args)
    assert kv_plan.plan_cache_info()[:3] == (0, 0, 0)
    with pytest.raises(TypeError, match="enabled must be a bool"):
        kv_plan.set_plan_cache(1)


@pytest.mark.parametrize("value,expected", [("0", "False"), ("1", "True"), (None, "True")])
def test_env_switch_read_at_import(value, expected):
    env = {k: v for k, v in os.environ.items() if k != "KVFUSE_PLAN_CACHE"}
    if value is not None:
        env["KVFUSE_PLAN_CACHE"] = value
    out = subprocess.run([sys.executable, "-c", "import kvfuse.plans.cache as p; print(p.plan_cache_enabled())"],
                         env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert out == expected


def test_bypassed_while_compiling(monkeypatch):
    s = Setup()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    for _ in range(2):
        plan, result = kv_fused.build_plan(**s.args)
        assert result is s.out and plan.kv_cache is s.cache
    assert kv_plan.plan_cache_info()[:3] == (0, 0, 0)


# =============================================================================== rejected calls
def _error(call):
    try:
        call()
    except (TypeError, ValueError) as e:
        return type(e), str(e)
    raise AssertionError("the call was accepted")


def _bad_cast_case(cast):
    def make():
        c = Contig()
        c.args["cast_args"] = CastArgs(*cast)
        return c
    return make


def _with(setup_factory, **mutations):
    """A setup whose args get ``mutations`` (key -> function of the setup returning the new value)."""
    def make():
        s = setup_factory()
        for k, fn in mutations.items():
            s.args[k] = fn(s)
        return s
    return make


def _rope(**kw):
    return lambda s: dataclasses.replace(s.args["rope_args"], **kw)


def _oa(**kw):
    return lambda s: dataclasses.replace(s.args["out_args"], **kw)


def _norm(**kw):
    return lambda s: dataclasses.replace(s.args["norm_args"], **kw)


def _cast(**kw):
    return lambda s: dataclasses.replace(s.args["cast_args"], **kw)


def _bad_cache(shape, strides):
    return lambda s: _oa(kv_cache=torch.as_strided(torch.zeros(sum((n - 1) * st for n, st in zip(shape, strides)) + 1,
                                                               dtype=torch.uint8), shape, strides))(s)


def _setup_eps_int():
    s = Setup()
    s.args["norm_args"] = NormArgs(s.args["norm_args"].weight, 1)
    return s


def _setup_offset_int():
    s = Setup()
    s.args["rope_args"] = dataclasses.replace(s.args["rope_args"], offset=64)
    return s


def _setup_layout_none():
    s = Setup()
    s.args["out_args"] = dataclasses.replace(s.args["out_args"], layout=None)
    return s


# (name, the warm-up setup, the rejected setup, exception, message pattern). The warm-up call is the
# rejected call's valid neighbour: for scalars, one that compares equal (1 == True == 1.0).
REJECTED = [
    ("x_float32", Setup, _with(Setup, x=lambda s: s.x.float()), TypeError, "x: expected dtype"),
    ("x_stride", Setup, _with(Setup, x=lambda s: torch.cat([s.x, s.x], -1).view(N, s.D, 2)[..., 0]), ValueError,
     "x: expected stride"),
    ("x_1d", Setup, _with(Setup, x=lambda s: s.x[0]), ValueError, "x: expected \\[n, head_dim\\]"),
    ("weight_shape", Setup, _with(Setup, norm_args=_norm(weight=torch.ones(144, dtype=BF16))), ValueError,
     "norm_args.weight: expected shape"),
    ("weight_device", Setup, _with(Setup, norm_args=_norm(weight=torch.ones(128, dtype=BF16, device=META))),
     ValueError, "norm_args.weight: expected device"),
    ("weight_stride", Setup, _with(Setup, norm_args=_norm(weight=torch.ones(256, dtype=BF16)[::2])), ValueError,
     "norm_args.weight: expected stride"),
    ("eps_negative", Setup, _with(Setup, norm_args=_norm(eps=-1e-6)), ValueError, "norm_args.eps"),
    ("eps_true_after_1", _setup_eps_int, _with(_setup_eps_int, norm_args=_norm(eps=True)), ValueError,
     "norm_args.eps"),
    ("rotary_float", Setup, _with(Setup, rope_args=_rope(rotary_dim=64.0)), ValueError, "rope_args.rotary_dim"),
    ("offset_float", _setup_offset_int, _with(_setup_offset_int, rope_args=_rope(offset=64.0)), ValueError,
     "rope_args.offset"),
    ("is_neox_int", Setup, _with(Setup, rope_args=_rope(is_neox=1)), TypeError, "rope_args.is_neox"),
    ("conjugate_int", Setup, _with(Setup, rope_args=_rope(conjugate=0)), TypeError, "rope_args.conjugate"),
    ("positions_float", Setup, _with(Setup, rope_args=_rope(positions=torch.arange(N, dtype=torch.float32))),
     TypeError, "rope_args.positions: expected dtype"),
    ("positions_long", Setup, _with(Setup, rope_args=_rope(positions=torch.arange(N + 1))), ValueError,
     "rope_args.positions: expected shape"),
    ("positions_device", Setup, _with(Setup, rope_args=_rope(positions=torch.arange(N, device=META))), ValueError,
     "rope_args.positions: expected device"),
    ("cos_sin_float64", Setup, _with(Setup, rope_args=_rope(cos_sin_cache=cos_sin_cache(MAX_POS, 64).double())),
     TypeError, "rope_args.cos_sin_cache: expected dtype"),
    ("cos_sin_stride", Setup, _with(Setup, rope_args=_rope(cos_sin_cache=cos_sin_cache(MAX_POS, 128)[:, ::2])),
     ValueError, "rope_args.cos_sin_cache: expected stride"),
    ("hadamard_scale_true", Setup, _with(Setup, hadamard_args=lambda s: HadamardArgs(True)), ValueError,
     "hadamard_args.scale"),
    ("hadamard_scale_nan", Setup, _with(Setup, hadamard_args=lambda s: HadamardArgs(float("nan"))), ValueError,
     "hadamard_args.scale"),
    ("cast_group_float", Contig, _with(Contig, cast_args=_cast(num_per_channels=32.0)), ValueError,
     "num_per_channels"),
    ("cast_round_sf_int", Contig, _with(Contig, cast_args=_cast(round_sf=1)), TypeError, "round_sf must be a bool"),
    ("cast_back_int", Contig, _with(Contig, cast_args=_cast(cast_back=0)), TypeError,
     "cast_args.cast_back must be a bool"),
    ("cast_vs_cache", Setup, _with(Setup, cast_args=lambda s: CastArgs("e4m3", 128, False, "fp32")), ValueError,
     "cast_args must match the cache format"),
    ("cache_cast_back", Setup, _with(Setup, cast_args=_cast(cast_back=True)), ValueError,
     "cast_args.cast_back must be False with a KV cache"),
    ("cache_stride1", lambda: Setup(formats.MAIN_FP8),
     _with(lambda: Setup(formats.MAIN_FP8), out_args=_bad_cache((2, 8, 1, 532), (4288, 534, 532, 1))),
     ValueError, "out_args.kv_cache: stride\\(1\\) must be a multiple of 4"),
    ("cache_block_wide_dense", Setup,
     _with(Setup, out_args=_bad_cache((2, 8, 1, 132), (1088, 136, 132, 1))), ValueError,
     "a block-wide block must be dense"),
    ("cache_device", Setup, _with(Setup, out_args=_oa(kv_cache=torch.empty(2, 8, 1, 132, dtype=torch.uint8,
                                                                            device=META))),
     ValueError, "out_args.kv_cache: expected device"),
    ("cache_int8", Setup, _with(Setup, out_args=lambda s: _oa(kv_cache=s.cache.view(torch.int8))(s)), TypeError,
     "out_args.kv_cache must be uint8"),
    ("slots_float", Setup, _with(Setup, out_args=_oa(slot_mapping=torch.arange(N, dtype=torch.float32))), TypeError,
     "out_args.slot_mapping: expected dtype"),
    ("slots_long", Setup, _with(Setup, out_args=_oa(slot_mapping=torch.arange(N + 1))), ValueError,
     "out_args.slot_mapping: expected shape"),
    ("out_stage", Setup, _with(Setup, out_args=_oa(out_stage="rope")), ValueError, "out_args.out_stage must be one of"),
    ("out_stage_norm_without_norm", Setup, _with(Setup, norm_args=lambda s: None, out_args=_oa(out_stage="norm")),
     ValueError, "out_stage='norm' needs norm_args"),
    ("out_dtype", Setup, _with(Setup, out_args=_oa(out=torch.empty(N, 128))), TypeError,
     "out_args.out: expected dtype"),
    ("layout_same_size_other_cast", Setup, _with(Setup, out_args=_oa(layout=formats.INDEX_FP8_FP32)), ValueError,
     "cast_args must match the cache format INDEX_FP8_FP32"),
    ("layout_not_a_format", Setup, _with(Setup, out_args=_oa(layout="INDEX_MXFP8")), TypeError,
     "out_args.layout must be a KVCacheFormat"),
    ("out_args_unhashable", Setup, _with(Setup, out_args=lambda s: [s.cache]), TypeError,
     "out_args must be None, a Tensor"),
    ("contig_q_dtype", Contig, _with(Contig, out_args=lambda s: ContiguousOutArgs(s.q.view(torch.uint8), s.sf)),
     TypeError, "out_args.out: expected dtype torch.float8_e4m3fn"),
    ("contig_sf_shape", Contig, _with(Contig, out_args=lambda s: ContiguousOutArgs(s.q, s.sf[:, :2])), ValueError,
     "out_args.sf: expected shape"),
    ("contig_sf_list", Contig, _with(Contig, out_args=lambda s: ContiguousOutArgs(s.q, [0] * 4)), TypeError,
     "out_args.sf must be a torch.Tensor"),
] + [(f"bad_cast_{i}", Contig, _bad_cast_case(c), exc, match) for i, (c, exc, match) in enumerate(BAD_CASTS)]


@pytest.mark.parametrize("name,warm,bad,exc,match", REJECTED, ids=[r[0] for r in REJECTED])
def test_rejected_after_a_warm_cache(name, warm, bad, exc, match):
    good = warm()
    fused(**good.args)
    fused(**good.args)
    hits, misses = counts()
    assert hits == 1 and misses == 1, "the valid neighbour is cached"
    s = bad()
    s.rejects(exc, match)                                          # nothing written either
    with_cache = _error(lambda: fused(**s.args))
    assert counts()[0] == hits, "a rejected call never hits"
    kv_plan.set_plan_cache(False)
    without_cache = _error(lambda: fused(**s.args))
    assert with_cache == without_cache
    assert with_cache[0] is exc


def test_layout_none_follows_the_presets(monkeypatch):
    s = _setup_layout_none()
    fused(**s.args)
    fused(**s.args)
    assert counts() == (1, 1)
    # a second preset of the same size and cast makes inference ambiguous: the warm call now raises
    twin = KVCacheFormat("INDEX_MXFP8_TWIN", 128, "e4m3", 32, "ue8m0", True, sf_bytes=4)
    monkeypatch.setitem(formats.PRESETS, "INDEX_MXFP8_TWIN", twin)
    with pytest.raises(ValueError, match="layout is None and 2 presets match"):
        fused(**s.args)
    monkeypatch.delitem(formats.PRESETS, "INDEX_MXFP8_TWIN")
    fused(**s.args)
    assert counts()[0] == 2


@pytest.mark.parametrize("how", ["set_checks", "env"])
def test_data_checks_run_on_hits(how, monkeypatch):
    s = Setup()
    fused(**s.args)
    if how == "set_checks":
        kvfuse.set_checks(True)
    else:
        monkeypatch.setattr(kv_backend, "_checks_override", None)
        monkeypatch.setenv("KVFUSE_CHECKS", "1")
    bad_pos = _with(Setup, rope_args=_rope(positions=torch.tensor([0, 1, MAX_POS, 2])))()
    bad_pos.rejects(ValueError, "rope_args.positions must lie in")
    dup = _with(Setup, out_args=_oa(slot_mapping=torch.tensor([5, 1, 5, 2])))()
    dup.rejects(ValueError, "duplicate valid slots")
    assert counts() == (2, 1), "both were hits"


# =============================================================================== what makes a miss
def _miss_cases():
    def setup_with(**mutations):
        return _with(Setup, **mutations)

    def wide_x(s):
        return torch.cat([s.x, s.x], -1)[:, :s.D]

    def padded_cache(s):
        cache, _ = guarded_cache(formats.INDEX_MXFP8, 2, 8, block_padding=64)
        return _oa(kv_cache=cache)(s)

    f = formats.INDEX_MXFP8
    twin = KVCacheFormat(f.name, f.head_dim, f.cast_fmt, f.elements_per_sf, f.sf_format, f.token_interleaved)
    assert twin == f and twin is not f

    def equal_format(s):  # equal, but another object: layouts are keyed by identity
        return _oa(layout=twin)(s)

    return {
        "x_3d": setup_with(x=lambda s: s.x[:, None], out_args=lambda s: _oa(out=s.out[:, None])(s)),
        "x_row_stride": setup_with(x=wide_x),
        "weight_dtype": setup_with(norm_args=_norm(weight=torch.ones(128))),
        "positions_dtype": setup_with(rope_args=_rope(positions=torch.arange(N, dtype=torch.int32))),
        "positions_stride": setup_with(rope_args=_rope(positions=torch.arange(2 * N)[::2])),
        "cos_sin_dtype": setup_with(rope_args=_rope(cos_sin_cache=cos_sin_cache(MAX_POS, 64, BF16))),
        "cos_sin_rows": setup_with(rope_args=_rope(cos_sin_cache=cos_sin_cache(MAX_POS + 1, 64))),
        "cos_sin_row_stride": setup_with(rope_args=_rope(cos_sin_cache=cos_sin_cache(MAX_POS, 128)[:, :64])),
        "slots_dtype": setup_with(out_args=_oa(slot_mapping=torch.arange(N, dtype=torch.int32))),
        "cache_block_stride": setup_with(out_args=padded_cache),
        "cache_blocks": setup_with(out_args=lambda s: _oa(kv_cache=guarded_cache(formats.INDEX_MXFP8, 3, 8)[0])(s)),
        "out_none": setup_with(out_args=_oa(out=None, out_stage=None)),
        "out_stage": setup_with(out_args=_oa(out_stage="norm")),
        "layout_equal_object": setup_with(out_args=equal_format),
        "layout_none": _setup_layout_none,
        "eps": setup_with(norm_args=_norm(eps=1e-5)),
        "eps_int": _setup_eps_int,
        "norm_kind": setup_with(norm_args=_norm(kind="layer")),
        "norm_bias": setup_with(norm_args=_norm(kind="layer", bias=torch.zeros(128, dtype=BF16))),
        "rotary_dim": setup_with(rope_args=_rope(rotary_dim=32, cos_sin_cache=cos_sin_cache(MAX_POS, 32))),
        "offset": setup_with(rope_args=_rope(offset=0)),
        "is_neox": setup_with(rope_args=_rope(is_neox=False)),
        "conjugate": setup_with(rope_args=_rope(conjugate=True)),
        "hadamard_scale": setup_with(hadamard_args=lambda s: HadamardArgs(0.5)),
        "hadamard_off": setup_with(hadamard_args=lambda s: None),
        "norm_off": setup_with(norm_args=lambda s: None, out_args=_oa(out_stage="transform")),
        "all_on_meta": setup_with(x=lambda s: s.x.to(META), norm_args=_norm(weight=torch.ones(128, dtype=BF16,
                                                                                                device=META)),
                                  rope_args=_rope(positions=torch.arange(N, device=META),
                                                  cos_sin_cache=cos_sin_cache(MAX_POS, 64).to(META)),
                                  out_args=lambda s: KVCacheOutArgs(formats.INDEX_MXFP8.allocate(2, 8, device=META),
                                                                    torch.arange(N, device=META),
                                                                    out=torch.empty(N, 128, dtype=BF16, device=META),
                                                                    out_stage="transform", layout=formats.INDEX_MXFP8)),
    }


MISS_CASES = _miss_cases()


@pytest.mark.parametrize("case", list(MISS_CASES))
def test_changed_signature_is_a_miss(case):
    fused(**Setup().args)
    assert counts() == (0, 1)
    s = MISS_CASES[case]()
    fused(**s.args)
    assert counts() == (0, 2), f"{case}: a miss"
    fused(**MISS_CASES[case]().args)
    assert counts() == (1, 2), f"{case}: then a hit"


@pytest.mark.parametrize("backend", BACKENDS)
def test_hadamard_scale_sign_is_keyed(backend):
    """-0.0 == 0.0, but scaling by them gives zeros of opposite signs: two entries, two results."""
    x = random_bf16((N, 128), 3)

    def both():
        return [fused(x, hadamard_args=HadamardArgs(scale)).view(torch.int16) for scale in (0.0, -0.0, 0.0, -0.0)]

    with kvfuse.use_backend(backend):
        kv_plan.set_plan_cache(False)
        expected = both()
        kv_plan.set_plan_cache(True)
        got = both()
    assert counts() == (2, 2)
    assert not torch.equal(expected[0], expected[1])
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


def test_unkeyed_argument_classes_validate_every_call(monkeypatch):
    class MyNorm(NormArgs):
        pass

    validations = []
    real = kv_fused.validate
    monkeypatch.setattr(kv_fused, "validate", lambda *a: validations.append(1) or real(*a))
    s = Setup()
    s.args["norm_args"] = MyNorm(torch.ones(128, dtype=BF16))
    for _ in range(3):
        assert fused(**s.args) is s.out
    assert len(validations) == 3
    assert counts() == (0, 0)


# =============================================================================== same bytes, on and off
def _write_case(fmt, nh=1, stage="transform", layout=True, hadamard=True):
    def make(seed):
        D = fmt.head_dim
        x = random_bf16((N, nh, D) if nh > 1 else (N, D), seed)
        cache, storage = guarded_cache(fmt, 2, 8, nh, seed=seed)
        out = poison_like(x) if stage else None
        g = torch.Generator().manual_seed(seed)
        args = dict(x=x, norm_args=NormArgs(random_bf16((D,), seed + 1, outliers=False)),
                    rope_args=RopeArgs(torch.randperm(MAX_POS, generator=g)[:N], cos_sin_cache(MAX_POS, 64), 64, True),
                    hadamard_args=HadamardArgs(D ** -0.5) if hadamard else None,
                    cast_args=CastArgs.from_cache_format(fmt),
                    out_args=KVCacheOutArgs(cache, torch.randperm(16, generator=g)[:N], out=out, out_stage=stage,
                                            layout=fmt if layout else None))
        return args, [storage] + ([out] if stage else [])
    return make


def _contig_case(D=128, nh=1, cast=None, new_outputs=False, cast_back=False):
    def make(seed):
        shape = (N, nh, D) if nh > 1 else (N, D)
        x = random_bf16(shape, seed)
        args = dict(x=x, norm_args=NormArgs(torch.ones(D, dtype=BF16), 1e-5),
                    rope_args=RopeArgs(torch.arange(N), cos_sin_cache(MAX_POS, 64), 64, True), cast_args=cast)
        if cast is None or cast_back:
            args["cast_args"] = None if cast is None else dataclasses.replace(cast, cast_back=True)
            out = None if new_outputs else poison_like(x)
            args["out_args"] = out
            return args, [] if new_outputs else [out]
        lead = shape[:-1]
        q = poison_like(torch.empty(lead + (D if cast.cast_fmt == "e4m3" else D // 2,),
                                    dtype=torch.float8_e4m3fn if cast.cast_fmt == "e4m3" else torch.uint8))
        sf = poison_like(torch.empty(lead + (D // cast.num_per_channels,), dtype=torch.uint8))
        args["out_args"] = None if new_outputs else ContiguousOutArgs(q, sf)
        return args, [] if new_outputs else [q, sf]
    return make


MXFP8 = CastArgs("e4m3", 32, True, "ue8m0")
MXFP4 = CastArgs("e2m1", 32, True, "ue8m0")
BYTES_CASES = {
    "main_fp8_2d": _write_case(formats.MAIN_FP8, stage="cast_back"),
    "main_fp8_2heads": _write_case(formats.MAIN_FP8, nh=2, stage="norm"),
    "index_mxfp4_layout_none": _write_case(formats.INDEX_MXFP4, layout=False),
    "index_bf16": _write_case(formats.INDEX_BF16, stage=None),
    "flashmla_v32": _write_case(formats.FLASHMLA_V32, stage="cast_back", hadamard=False),
    "q_pre_bf16_out_3d": _contig_case(D=512, nh=2),
    "q_pre_new_out": _contig_case(D=512, new_outputs=True),
    "index_q_preallocated": _contig_case(nh=2, cast=MXFP4),
    "index_q_new_outputs": _contig_case(cast=MXFP8, new_outputs=True),
    "cast_back": _contig_case(cast=MXFP8, cast_back=True),
}


def _result_tensors(result, watched):
    if result is None:
        return list(watched)
    return list(watched) + list(result if isinstance(result, tuple) else (result,))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(BYTES_CASES))
def test_bytes_equal_cache_on_and_off(case, backend):
    make = BYTES_CASES[case]
    with kvfuse.use_backend(backend):
        kv_plan.set_plan_cache(False)
        args, watched = make(1)
        expected = [t.clone() for t in _result_tensors(fused(**args), watched)]
        kv_plan.set_plan_cache(True)
        fused(**make(0)[0])                         # another call of the signature: stored
        args, watched = make(1)                     # the same inputs as the uncached call, new tensors
        got = _result_tensors(fused(**args), watched)
    assert counts() == (1, 1)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        assert torch.equal(g.view(torch.uint8) if g.dtype != torch.uint8 else g,
                           e.view(torch.uint8) if e.dtype != torch.uint8 else e), case


@pytest.mark.parametrize("backend", BACKENDS)
def test_new_outputs_are_fresh_on_every_hit(backend):
    x = random_bf16((N, 128), 4)
    rope = RopeArgs(torch.arange(N), cos_sin_cache(MAX_POS, 64), 64, True)
    with kvfuse.use_backend(backend):
        results = [fused(x, rope_args=rope, cast_args=MXFP8) for _ in range(3)]
    assert counts() == (2, 1)
    ptrs = {t.data_ptr() for q, sf in results for t in (q, sf)}
    assert len(ptrs) == 6
    for q, sf in results[1:]:
        assert torch.equal(q.view(torch.uint8), results[0][0].view(torch.uint8))
        assert torch.equal(sf, results[0][1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_other_storage_offset_is_a_hit_writing_at_its_own_address(backend):
    fmt = formats.MAIN_FP8
    make = _write_case(fmt, stage=None)
    args, (storage,) = make(2)
    # the same cache (shape, strides, bytes) 32 bytes further into a larger buffer
    before = storage.clone()
    big = torch.cat([torch.full((32,), 7, dtype=torch.uint8), storage])
    cache = args["out_args"].kv_cache
    moved = torch.as_strided(big, cache.shape, cache.stride(), cache.storage_offset() + 32)
    assert moved.shape == cache.shape and moved.stride() == cache.stride()
    with kvfuse.use_backend(backend):
        fused(**args)
        args["out_args"] = dataclasses.replace(args["out_args"], kv_cache=moved)
        fused(**args)
    assert counts() == (1, 1)
    assert not torch.equal(storage, before), "the first call wrote records"
    assert torch.equal(big[:32], torch.full((32,), 7, dtype=torch.uint8))
    assert torch.equal(big[32:], storage), "the second write landed at its own address, as the first"


# =============================================================================== launches
@needs_interpreter
def test_force_config_takes_effect_on_hits(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(kernels, "fused_kernel", rec)
    s = Setup()
    rows = N
    with kvfuse.use_backend("triton"):
        fused(**s.args)
        fused(**s.args)
        with config.force_config(block_m=1, num_warps=8):
            fused(**s.args)
        with config.force_config(block_m=2):
            fused(**s.args)
        fused(**s.args)
    assert counts() == (4, 1)
    (g0, _, k0), (g1, a1, k1), (g2, _, k2), (g3, _, k3), (g4, a4, k4) = rec.launches
    default_bm = k0["BLOCK_M"]
    assert (k0["BLOCK_M"], k0["num_warps"]) == (k1["BLOCK_M"], k1["num_warps"]) == (k4["BLOCK_M"], k4["num_warps"])
    assert (k2["BLOCK_M"], k2["num_warps"], g2) == (1, 8, (rows,))
    assert (k3["BLOCK_M"], k3["num_warps"], g3) == (2, k0["num_warps"], (rows // 2,))
    assert default_bm != 1 and g4 == g0
    # the launch takes each call's own tensors
    assert a1[0] is s.x and a4[0] is s.x


@needs_interpreter
def test_launch_arguments_equal_the_uncached_ones(monkeypatch):
    """The cached launch passes what the uncached path (run_plan) passes, for each case: the same
    grid, constexprs and scalars, and tensors with the same memory and element type (the call's
    inputs, or the outputs it returns)."""
    rec = _Recorder()
    monkeypatch.setattr(kernels, "fused_kernel", rec)

    def launch(args):
        result = fused(**args)
        new = [t for t in (result if isinstance(result, tuple) else (result,)) if t is not None]
        grid, pos, kw = rec.launches[-1]
        names = {t.data_ptr(): f"result {i}" for i, t in enumerate(new)}
        return grid, kw, [(names.get(a.data_ptr(), a.data_ptr()), a.dtype) if isinstance(a, torch.Tensor)
                          else (type(a), a) for a in pos]

    with kvfuse.use_backend("triton"):
        for case, make in BYTES_CASES.items():
            args, _ = make(0)
            kv_plan.set_plan_cache(False)
            uncached = launch(args)
            kv_plan.set_plan_cache(True)
            assert launch(args) == uncached, f"{case}: miss"
            assert launch(args) == uncached, f"{case}: hit"
    assert counts() == (len(BYTES_CASES), len(BYTES_CASES))


# =============================================================================== store / load
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", [formats.MAIN_FP8, formats.FLASHMLA_V32, formats.INDEX_BF16],
                         ids=lambda f: f.name)
def test_store_and_load_cache_on_and_off(fmt, backend):
    from kvfuse import reference as R

    def payload(seed, nh):
        y = random_bf16((N, nh, fmt.head_dim) if nh > 1 else (N, fmt.head_dim), seed)
        qd = fmt.quant_dim
        if not fmt.quantized:
            return y, None, None
        q, sf = R.quantize(y[..., :qd], fmt.cast_fmt, fmt.elements_per_sf, fmt.sf_format, fmt.scale_floor)
        return q, sf, (y[..., qd:] if fmt.bf16_tail else None)

    def run(seed):
        cache, storage = guarded_cache(fmt, 2, 8, seed=seed)
        slots = torch.randperm(16, generator=torch.Generator().manual_seed(seed))[:N]
        kvfuse.store_kv_cache(*payload(seed, 1)[:2], cache, slots, fmt, tail=payload(seed, 1)[2])
        return storage, kvfuse.load_paged_kv_cache(cache, slots, fmt), kvfuse.load_paged_kv_cache(cache, slots, fmt,
                                                                                                    dequantize=False)

    with kvfuse.use_backend(backend):
        kv_plan.set_plan_cache(False)
        expected = run(1)
        kv_plan.set_plan_cache(True)
        run(0)
        got = run(1)
    assert counts() == (3, 3)
    storage, deq, (data, sf) = got
    e_storage, e_deq, (e_data, e_sf) = expected
    assert torch.equal(storage, e_storage)
    assert torch.equal(deq.view(torch.int16), e_deq.view(torch.int16))
    assert torch.equal(data, e_data) and torch.equal(sf, e_sf)


def test_store_and_load_rejected_after_a_warm_cache():
    fmt = formats.MAIN_FP8
    cache, storage = guarded_cache(fmt, 2, 8)
    y = random_bf16((N, 512), 5)
    from kvfuse import reference as R
    q, sf = R.quantize(y, fmt.cast_fmt, fmt.elements_per_sf, fmt.sf_format, fmt.scale_floor)
    slots = torch.arange(N)
    kvfuse.store_kv_cache(q, sf, cache, slots, fmt)
    kvfuse.load_paged_kv_cache(cache, slots, fmt)
    before = storage.clone()
    bad_calls = [
        (lambda: kvfuse.store_kv_cache(q, sf.float(), cache, slots, fmt), TypeError, "sf: expected dtype"),
        (lambda: kvfuse.store_kv_cache(q, sf, cache, slots.float(), fmt), TypeError, "slot_mapping: expected dtype"),
        (lambda: kvfuse.store_kv_cache(q[:, :256], sf, cache, slots, fmt), ValueError, "data: expected shape"),
        (lambda: kvfuse.store_kv_cache(q, sf, cache, slots, formats.MAIN_FP4), ValueError, "last dim"),
        (lambda: kvfuse.store_kv_cache(q, sf, cache, slots, fmt, tail=y[:, :64]), ValueError, "tail must be None"),
        (lambda: kvfuse.load_paged_kv_cache(cache, slots, fmt, dequantize=1), TypeError, "dequantize must be a bool"),
        (lambda: kvfuse.load_paged_kv_cache(cache, slots[None], fmt), ValueError, "slot_mapping: expected shape"),
    ]
    for call, exc, match in bad_calls:
        with pytest.raises(exc, match=match):
            call()
        with_cache = _error(call)
        kv_plan.set_plan_cache(False)
        assert _error(call) == with_cache
        kv_plan.set_plan_cache(True)
    assert torch.equal(storage, before)
    assert counts()[0] == 0


# =============================================================================== memory, size, threads
def test_the_cache_holds_no_tensors():
    def call():
        s = Setup(formats.MAIN_FP8)
        fused(**s.args)
        fused(**s.args)
        return [weakref.ref(t) for t in (s.x, s.cache, s.storage, s.out, s.args["norm_args"].weight,
                                         s.args["rope_args"].positions, s.args["out_args"].slot_mapping)]

    refs = call()
    gc.collect()
    assert counts() == (1, 1) and kv_plan.plan_cache_info().size == 1
    assert all(r() is None for r in refs)


def test_bounded_and_recently_used_entries_are_spared(monkeypatch):
    monkeypatch.setattr(kv_plan.PLAN_CACHE, "maxsize", 4)
    rope = RopeArgs(torch.arange(N), cos_sin_cache(MAX_POS, 64), 64, True)

    def call(d):
        fused(random_bf16((N, d), 0), rope_args=rope)

    for d in (64, 80, 96, 112):
        call(d)
    call(64)                                        # hit: spared at the next eviction
    for d in (128, 144):
        call(d)
    assert kv_plan.plan_cache_info().size == 4
    hits = counts()[0]
    call(64)
    assert counts()[0] == hits + 1, "the recently used entry survived"
    call(80)
    assert counts()[0] == hits + 1, "the oldest unused entry was evicted"
    for d in range(160, 480, 16):
        call(d)
    assert kv_plan.plan_cache_info().size == 4


@needs_interpreter
def test_concurrent_calls(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(kernels, "fused_kernel", rec)
    monkeypatch.setattr(kv_plan.PLAN_CACHE, "maxsize", 3)
    rope = RopeArgs(torch.arange(N), cos_sin_cache(MAX_POS, 64), 64, True)
    xs = [random_bf16((N, 64 + 16 * i), i) for i in range(6)]
    errors = []

    def worker(k):
        try:
            with kvfuse.use_backend("triton"):
                for i in range(60):
                    x = xs[(i + k) % len(xs)]
                    out = fused(x, rope_args=rope)
                    assert out.shape == x.shape
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(rec.launches) == 240
    assert kv_plan.plan_cache_info().size <= 3
    for grid, args, kwargs in rec.launches:
        assert kwargs["D"] == args[0].shape[-1]     # each launch got its own signature's parameters


def test_the_key_covers_every_argument_field():
    """call_signature keys each argument object field by field: a new field must join the key."""
    keyed = {NormArgs: ("weight", "eps", "bias", "kind"),
             RopeArgs: ("positions", "cos_sin_cache", "rotary_dim", "is_neox", "offset", "conjugate",
                        "mrope_section", "mrope_interleaved"),
             HadamardArgs: ("scale",),
             CastArgs: ("cast_fmt", "num_per_channels", "round_sf", "sf_format", "cast_back", "scale_floor"),
             ContiguousOutArgs: ("out", "sf"),
             KVCacheOutArgs: ("kv_cache", "slot_mapping", "out", "out_stage", "layout")}
    for cls, fields in keyed.items():
        assert tuple(f.name for f in dataclasses.fields(cls)) == fields, f"{cls.__name__}: update call_signature"
    # and each field changes the key
    s = Setup()
    base, _ = kv_fused.call_signature(**s.args)
    variants = [
        dict(norm_args=NormArgs(torch.ones(128), 1e-6)), dict(norm_args=NormArgs(s.args["norm_args"].weight, 1e-5)),
        dict(rope_args=_rope(positions=torch.arange(N, dtype=torch.int32))(s)),
        dict(rope_args=_rope(cos_sin_cache=cos_sin_cache(MAX_POS + 1, 64))(s)),
        dict(rope_args=_rope(rotary_dim=32, cos_sin_cache=cos_sin_cache(MAX_POS, 32))(s)),
        dict(rope_args=_rope(is_neox=False)(s)), dict(rope_args=_rope(offset=0)(s)),
        dict(rope_args=_rope(conjugate=True)(s)), dict(rope_args=_rope(mrope_interleaved=True)(s)),
        dict(rope_args=_rope(mrope_section=(8, 12, 12))(s)), dict(hadamard_args=HadamardArgs(2.0)),
        dict(cast_args=_cast(cast_fmt="e2m1")(s)), dict(cast_args=_cast(num_per_channels=64)(s)),
        dict(cast_args=_cast(round_sf=False)(s)), dict(cast_args=_cast(sf_format="ue8m0_fp32")(s)),
        dict(cast_args=_cast(cast_back=True)(s)), dict(cast_args=_cast(scale_floor=1e-4)(s)),
        dict(out_args=_oa(kv_cache=guarded_cache(formats.INDEX_MXFP8, 3, 8)[0])(s)),
        dict(out_args=_oa(slot_mapping=torch.arange(N, dtype=torch.int32))(s)), dict(out_args=_oa(out=None)(s)),
        dict(out_args=_oa(out_stage="norm")(s)), dict(out_args=_oa(layout=formats.INDEX_FP8_FP32)(s)),
        dict(out_args=ContiguousOutArgs(s.out)), dict(out_args=ContiguousOutArgs(None, s.out)),
    ]
    for v in variants:
        key, _ = kv_fused.call_signature(**{**s.args, **v})
        assert key is not None and key != base, v


# =============================================================================== batch sizes
def _write_call(n, seed, out=True):
    """A MAIN-style write of n rows (norm + rope + INDEX_MXFP8 cache, optional out) and its storage."""
    fmt = formats.INDEX_MXFP8
    cache, storage = guarded_cache(fmt, 4, 8, seed=seed)
    x = random_bf16((n, fmt.head_dim), seed)
    slots = torch.randperm(32, generator=torch.Generator().manual_seed(seed))[:n]
    args = dict(x=x, norm_args=NormArgs(torch.ones(fmt.head_dim, dtype=BF16)),
                rope_args=RopeArgs(torch.arange(n) * 3, cos_sin_cache(MAX_POS, 64), 64, True),
                cast_args=CastArgs.from_cache_format(fmt),
                out_args=KVCacheOutArgs(cache, slots, out=poison_like(x) if out else None,
                                        out_stage="transform" if out else None, layout=fmt))
    return args, storage


def _q_call(n, seed):
    """The indexer-Q shape: [n, 4, 128] rope + MXFP4 cast, (q, sf) allocated by the call."""
    x = random_bf16((n, 4, 128), seed)
    return dict(x=x, rope_args=RopeArgs(torch.arange(n), cos_sin_cache(MAX_POS, 64), 64, True),
                cast_args=CastArgs("e2m1", 32, True, "ue8m0"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_other_batch_sizes_hit_with_the_same_bytes(backend):
    """The key leaves n out: a signature validated at one batch size is a hit at every other, and
    each call's bytes (cache storage, out, new q and sf) equal those of the uncached call."""
    sizes = (5, 9, 1, 16, 9)
    with kvfuse.use_backend(backend):
        for i, n in enumerate(sizes):
            kv_plan.set_plan_cache(True)
            args, storage = _write_call(n, i)
            fused(**args)
            got = (storage.clone(), args["out_args"].out.clone())
            q_got = fused(**_q_call(n, i))
            kv_plan.set_plan_cache(False)
            args, storage = _write_call(n, i)
            fused(**args)
            want = (storage, args["out_args"].out)
            q_want = fused(**_q_call(n, i))
            for g, w in zip(got + tuple(q_got), want + tuple(q_want)):
                assert g.shape == w.shape and torch.equal(g.view(torch.uint8), w.view(torch.uint8)), f"n={n}"
    assert counts() == (2 * (len(sizes) - 1), 2)


def test_zero_rows_after_other_batch_sizes():
    """n = 0 on a signature seen with n > 0: a hit, nothing written, empty new outputs."""
    with kvfuse.use_backend("reference"):
        fused(**_write_call(4, 0)[0])
        fused(**_q_call(4, 0))
        args, storage = _write_call(0, 1)
        before = storage.clone()
        fused(**args)
        q, sf = fused(**_q_call(0, 1))
    assert torch.equal(storage, before) and q.shape == (0, 4, 64) and sf.shape == (0, 4, 4)
    assert counts() == (2, 2)


@pytest.mark.parametrize("field", ["positions", "slot_mapping", "out"])
def test_wrong_length_after_other_batch_sizes(field):
    """A tensor whose leading dim is not the call's n is keyed by that dim: a miss, then the error."""
    with kvfuse.use_backend("reference"):
        fused(**_write_call(4, 0)[0])
        args, storage = _write_call(6, 1)
        before = storage.clone()
        if field == "positions":
            args["rope_args"] = dataclasses.replace(args["rope_args"], positions=torch.arange(4))
            match = "rope_args.positions"
        elif field == "slot_mapping":
            args["out_args"] = dataclasses.replace(args["out_args"], slot_mapping=torch.arange(4))
            match = "out_args.slot_mapping"
        else:
            args["out_args"] = dataclasses.replace(args["out_args"], out=torch.empty(4, 128, dtype=BF16))
            match = "out_args.out"
        with pytest.raises(ValueError, match=match):
            fused(**args)
    assert torch.equal(storage, before)
    assert counts() == (0, 2)


@needs_interpreter
def test_one_launch_per_batch_size(monkeypatch):
    """The triton backend keeps a launch per n with the template: n's grid and n_rows, never another's."""
    n_rows_at = kernels.fused_kernel.arg_names.index("n_rows")   # a positional parameter (before the constexprs)
    rec = _Recorder()
    monkeypatch.setattr(kernels, "fused_kernel", rec)
    with kvfuse.use_backend("triton"):
        for n in (3, 7, 3, 7, 12):
            fused(**_write_call(n, n)[0])
            grid, pos, kw = rec.launches[-1]
            assert grid == (config.cdiv(n, kw["BLOCK_M"]),) and pos[n_rows_at] == n and pos[0].shape[0] == n
    template = next(e for e in kv_plan.PLAN_CACHE._entries.values() if isinstance(e, PlanTemplate))
    assert sorted(template.launches) == [3, 7, 12]
    assert counts() == (4, 1)
