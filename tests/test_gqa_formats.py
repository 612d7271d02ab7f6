"""The GQA entry's cache formats (kvfuse.gqa_formats, SPEC §11): the registry, the k_format / v_format /
scale-cache arguments and their validation, caches of two formats, and the read side."""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import kvfuse
from kvfuse import dispatch, gqa_formats
from kvfuse.gqa_formats import GQACacheFormat, PRESETS
from gqa_cases import GQACase, build, diff_report, run_gqa_case

INTERPRETER = pytest.mark.skipif(not kvfuse.backend.interpreter_enabled(), reason="needs TRITON_INTERPRET=1")


# --------------------------------------------------------------------------- the registry
def test_names_and_aliases():
    assert gqa_formats.names() == tuple(PRESETS)
    assert {"auto", "fp8_e4m3"} <= set(gqa_formats.names())
    assert gqa_formats.get("FP8") is PRESETS["fp8_e4m3"]          # vLLM's alias, any case
    assert gqa_formats.get("Auto") is PRESETS["auto"]
    for name, fmt in PRESETS.items():
        assert fmt.name == name and gqa_formats.get(name.upper()) is fmt and fmt.reader


def test_get_unknown_lists_the_names():
    with pytest.raises(ValueError, match="'auto', 'fp8_e4m3'.*'fp8'.*got 'fp9'"):
        gqa_formats.get("fp9")
    with pytest.raises(ValueError, match="got None"):
        gqa_formats.get(None)


def test_resolve():
    fmt = PRESETS["fp8_e4m3"]
    assert gqa_formats.resolve(dataclasses.replace(fmt), "k_format") is fmt       # an equal format: the preset
    with pytest.raises(ValueError, match="k_format: expected one of kvfuse.gqa_formats.PRESETS"):
        gqa_formats.resolve(dataclasses.replace(fmt, qmax=240.0), "k_format")
    with pytest.raises(TypeError, match="v_format: expected a format name .*, got int"):
        gqa_formats.resolve(3, "v_format")
    with pytest.raises(ValueError, match="v_format: expected a GQA cache format name"):
        gqa_formats.resolve("int4", "v_format")


@pytest.mark.parametrize("fields,match", [
    (dict(code="e3m4"), "code must be one of"),
    (dict(scale="tensor"), "scale must be one of"),
    (dict(cache_dtype=None), "code 'act' goes with"),
    (dict(scale_dtype=torch.float32), "scale_dtype must be given exactly"),
    (dict(scale="block", scale_dtype=torch.float32), "group must be > 0"),
])
def test_format_fields_checked(fields, match):
    with pytest.raises(ValueError, match=match):
        dataclasses.replace(PRESETS["fp8_e4m3"], **fields)


def test_byte_model_helpers():
    auto, fp8 = PRESETS["auto"], PRESETS["fp8_e4m3"]
    assert auto.row_bytes(128, torch.bfloat16) == 256 and auto.row_bytes(64, torch.float32) == 256
    assert fp8.row_bytes(128) == 128 and fp8.scale_bytes(128) == 0 and not fp8.stores_scale
    assert auto.dtype_for(torch.float16) == torch.float16 and fp8.dtype_for(torch.float16) == torch.float8_e4m3fn
    assert auto.scale_cache_shape((3, 4, 2, 128), 128) is None
    th = GQACacheFormat("t", "e4m3", torch.float8_e4m3fn, "token_head", scale_dtype=torch.float32, qmax=448.0)
    assert th.scale_cache_shape((3, 4, 2, 128), 128) == (3, 4, 2) and th.row_bytes(128) == 132
    blk = GQACacheFormat("b", "e2m1", torch.uint8, "block", group=16, scale_dtype=torch.float8_e4m3fn, qmax=6.0)
    assert blk.scale_cache_shape((3, 2, 4, 64), 128) == (3, 2, 4, 8) and blk.row_bytes(128) == 64 + 8


def test_exported():
    assert kvfuse.GQACacheFormat is GQACacheFormat and kvfuse.gqa_formats is gqa_formats


# --------------------------------------------------------------------------- the arguments
def _same_call_bytes(case, backend, **formats):
    kw, storages, inputs, q_buf = build(case)
    with kvfuse.use_backend(backend):
        kvfuse.fused_qk_norm_rope_store_kv(**kw, **formats)
    return [s.view(torch.uint8).clone() for s in storages] + [q_buf.view(torch.uint8).clone()]


@pytest.mark.parametrize("fp8", [False, True])
def test_named_formats_equal_the_inferred_ones(fp8):
    """A format named (a name, an alias, a GQACacheFormat) writes what the cache's dtype alone means."""
    case = GQACase(fp8=fp8, seed=3)
    want = _same_call_bytes(case, "reference")
    name = "fp8" if fp8 else "AUTO"
    obj = PRESETS["fp8_e4m3" if fp8 else "auto"]
    for got in (_same_call_bytes(case, "reference", k_format=name, v_format=obj),
                _same_call_bytes(case, "reference", k_format=obj, v_format=None)):
        assert all(torch.equal(a, b) for a, b in zip(want, got))


def _two_formats(k_fp8: bool, v_fp8: bool, layout: str, backend: str, seed: int = 7, numerics: str = "staged"):
    """A call with K's cache of one format and V's of another; (k cache storage, v cache storage, q_out) bytes
    and the same bytes of the calls with both caches of K's format and both of V's."""
    def case(fp8):
        return GQACase(fp8=fp8, layout=layout, seed=seed, numerics=numerics, hq=6, hkv=3, scale_per_head="v")

    kk, ks, _, kq = build(case(k_fp8))
    vk, vs, _, _ = build(case(v_fp8))
    assert torch.equal(kk["slot_mapping"], vk["slot_mapping"])
    kw = dict(kk, v_cache=vk["v_cache"], v_scale=vk.get("v_scale"), k_format="fp8" if k_fp8 else "auto",
              v_format="fp8" if v_fp8 else "auto")
    if not v_fp8:
        kw["v_scale"] = None
    if not k_fp8:
        kw["k_scale"] = None
    with kvfuse.use_backend(backend):
        kvfuse.fused_qk_norm_rope_store_kv(**kw)
    got = (ks[0].clone(), vs[1].clone(), kq.clone())
    want_k = run_gqa_case(case(k_fp8), "reference")
    want_v = run_gqa_case(case(v_fp8), "reference")
    return got, (want_k["cache_storage0"], want_v["cache_storage1"], want_k["q_out"])


def _as_bytes(t):
    return t.contiguous().view(-1).view(torch.uint8)


@pytest.mark.parametrize("k_fp8,v_fp8", [(False, True), (True, False)])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_caches_of_two_formats_reference(k_fp8, v_fp8, layout):
    """K's cache holds what a call with both caches of K's format writes there, V's what one of V's does."""
    got, want = _two_formats(k_fp8, v_fp8, layout, "reference")
    for g, w in zip(got, want):
        assert torch.equal(_as_bytes(g), w)


@INTERPRETER
@pytest.mark.parametrize("k_fp8,v_fp8,layout,numerics", [(False, True, "NHD", "staged"),
                                                         (True, False, "HND", "fused_fp32_cast")])
def test_caches_of_two_formats_kernel(k_fp8, v_fp8, layout, numerics):
    got, want = _two_formats(k_fp8, v_fp8, layout, "triton", seed=11, numerics=numerics)
    for g, w in zip(got, want):
        assert torch.equal(_as_bytes(g), w)


def _kw(fp8=False, **case):
    kw, _, _, _ = build(GQACase(fp8=fp8, n=3, d=64, **case))
    return kw


def _scale_cache(cache):
    return torch.zeros(cache.shape[:-1], dtype=torch.float32)


BAD = [
    ("k_format bf16 cache", lambda kw: kw.update(k_format="fp8"), TypeError,
     "k_cache: expected dtype torch.float8_e4m3fn (k_format 'fp8_e4m3'), got torch.bfloat16"),
    ("v_format fp8 cache", lambda kw: kw.update(v_format="auto"), TypeError, None),
    ("k_format unknown", lambda kw: kw.update(k_format="fp8_e3m4"), ValueError,
     "k_format: expected a GQA cache format name ("),
    ("k_format type", lambda kw: kw.update(k_format=torch.float8_e4m3fn), TypeError,
     "k_format: expected a format name (str) or a GQACacheFormat, got dtype"),
    ("scale cache without a stored scale", lambda kw: kw.update(k_scale_cache=_scale_cache(kw["k_cache"])),
     ValueError, "k_scale_cache must be None without a format that stores its scales (k_format 'auto')"),
    ("v_format without v_cache", lambda kw: kw.update(v=None, v_cache=None, v_format="auto"), ValueError,
     "v_format must be None without v_cache"),
    ("v_scale_cache without v_cache", lambda kw: kw.update(v=None, v_cache=None,
                                                           v_scale_cache=torch.zeros(3)), ValueError,
     "v_scale_cache must be None without v_cache"),
    ("v_format without caches", lambda kw: kw.update(k_cache=None, v_cache=None, slot_mapping=None,
                                                     v_format="auto"), ValueError,
     "v_format must be None without caches"),
    ("k_format of another k_out", lambda kw: kw.update(k_cache=None, v_cache=None, slot_mapping=None,
                                                       k_format="fp8"), ValueError,
     "k_format: without caches k goes to k_out (torch.bfloat16): expected None or a format of that dtype"),
]


@pytest.mark.parametrize("label,change,exc,match", BAD, ids=[b[0] for b in BAD])
def test_bad_format_arguments(label, change, exc, match):
    kw = _kw(fp8=label == "v_format fp8 cache")
    if label == "v_format fp8 cache":
        match = "v_cache: expected dtype torch.bfloat16 (v_format 'auto'), got torch.float8_e4m3fn"
    before = [kw["k_cache"].clone(), None if kw["v_cache"] is None else kw["v_cache"].clone()]
    change(kw)
    with kvfuse.use_backend("reference"), pytest.raises(exc, match=re.escape(match)):
        kvfuse.fused_qk_norm_rope_store_kv(**kw)
    assert torch.equal(kw["k_cache"].view(torch.uint8), before[0].view(torch.uint8)) if kw["k_cache"] is not None \
        else True


def test_static_scale_follows_the_format():
    kw = _kw(fp8=False)
    bf16_v = kw["v_cache"]
    kw_fp8 = _kw(fp8=True)
    # K fp8 with its scale, V bf16: a v_scale is refused, K's scale required
    call = dict(kw_fp8, v_cache=bf16_v, k_format="fp8", v_format="auto")
    with pytest.raises(ValueError, match=re.escape("v_scale must be None without a static-scale v_format ('auto' "
                                                   "here), got a Tensor")):
        kvfuse.fused_qk_norm_rope_store_kv(**call)
    with pytest.raises(ValueError, match="k_scale: a float8_e4m3fn cache needs its fp32 scale"):
        kvfuse.fused_qk_norm_rope_store_kv(**dict(call, v_scale=None, k_scale=None))
    kvfuse.fused_qk_norm_rope_store_kv(**dict(call, v_scale=None))


def test_plan_cache_key_covers_the_formats():
    """A signature validated with k_format None is not reused for the same tensors with another format."""
    kvfuse.clear_plan_cache()
    kw = _kw(fp8=False)
    with kvfuse.use_backend("reference"):
        kvfuse.fused_qk_norm_rope_store_kv(**kw)
        kvfuse.fused_qk_norm_rope_store_kv(**kw, k_format="auto")
        with pytest.raises(TypeError, match=re.escape("k_cache: expected dtype torch.float8_e4m3fn (k_format")):
            kvfuse.fused_qk_norm_rope_store_kv(**kw, k_format="fp8")


def test_plan_carries_the_formats_through_the_op():
    """The formats go through the custom op's arguments as names (kvfuse.plans.opargs)."""
    kk = _kw(fp8=False)
    kv = _kw(fp8=True)
    kw = dict(kk, v_cache=kv["v_cache"], v_scale=kv["v_scale"], k_format="auto", v_format="fp8")
    plan = kvfuse.plans.gqa.prepare(**kw)
    assert (plan.k_format, plan.v_format) == ("auto", "fp8_e4m3")
    assert (plan.k_fmt, plan.v_fmt) == (PRESETS["auto"], PRESETS["fp8_e4m3"])
    from kvfuse.plans import opargs
    back = opargs.unflatten(type(plan), opargs.flatten(plan))
    assert (back.k_format, back.v_format, back.k_scale_cache, back.v_scale_cache) == ("auto", "fp8_e4m3", None, None)
    ref = {}
    for name, via in (("direct", None), ("op", dispatch.via_ops)):
        k2, s2, _, q2 = build(GQACase(fp8=False, n=3, d=64))
        v2 = build(GQACase(fp8=True, n=3, d=64))[0]
        call = dict(k2, v_cache=v2["v_cache"], v_scale=v2["v_scale"], k_format="auto", v_format="fp8")
        with kvfuse.use_backend("reference"):
            if via is None:
                kvfuse.fused_qk_norm_rope_store_kv(**call)
            else:
                with via():
                    kvfuse.fused_qk_norm_rope_store_kv(**call)
        ref[name] = (_as_bytes(call["k_cache"]).clone(), _as_bytes(call["v_cache"]).clone(), q2.clone())
    assert all(torch.equal(_as_bytes(a), _as_bytes(b)) for a, b in zip(ref["direct"], ref["op"]))
