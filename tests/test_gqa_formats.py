"""The GQA entry's cache formats (kvfuse.gqa_formats, SPEC §3): the registry, the k_format / v_format /
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


# --------------------------------------------------------------------------- every preset, both backends
from gqa_format_cases import (EVERY_BF16_FORMATS, FormatCase, build_format_call, every_bf16_run,  # noqa: E402
                              run_format_case)

# (K format, V format) pairs: every preset as both, and caches of two formats
FORMAT_PAIRS = [(name, name) for name in PRESETS] + [
    ("auto", "int8_per_token_head"), ("fp8_per_token_head", "fp8_e5m2"), ("fp8_e5m2", "auto"),
    ("int8_per_token_head", "fp8_e4m3")]
FORMAT_CASES = []
for _i, (_kf, _vf) in enumerate(FORMAT_PAIRS):
    for _layout, _numerics in (("NHD", "staged"), ("HND", "fused_fp32_cast")):
        FORMAT_CASES.append(FormatCase(GQACase(layout=_layout, numerics=_numerics, hq=4, hkv=2, n=6,
                                               neox=_i % 2 == 0, seed=_i), _kf, _vf))
FORMAT_CASES += [
    # vLLM's inline scales (as_strided fp32 views of the cache's allocation), NHD and HND
    FormatCase(GQACase(n=7, hq=4, hkv=2, slots="invalid", seed=31), "fp8_per_token_head", "fp8_per_token_head",
               inline=True),
    FormatCase(GQACase(n=5, hq=2, hkv=2, layout="HND", rotary_dim=64, seed=32), "int8_per_token_head",
               "int8_per_token_head", inline=True),
    # heads as pairs (the amax over both parts), per-head static scales, fp16 / fp32 activations, a K cache alone,
    # dv != d, the fused profile, FlashInfer's page addressing
    FormatCase(GQACase(split=64, rotary_dim=64, hq=4, hkv=2, seed=33), "int8_per_token_head", "fp8_per_token_head"),
    FormatCase(GQACase(dtype="fp16", scale_per_head="kv", hq=6, hkv=3, seed=34, q_norm="fp16", k_norm="fp16",
                       cos_sin="fp16"), "fp8_e5m2", "fp8_e5m2"),
    FormatCase(GQACase(dtype="fp32", numerics="fused", dv=64, layout="HND", seed=35), "fp8_per_token_head",
               "int8_per_token_head"),
    FormatCase(GQACase(v_cache=False, neox=False, seed=36, paged_append=True), "int8_per_token_head", None),
    # K's cache as two (FlashInfer's kpe / ckv split) with its scale per row over both; FlashInfer's multiply
    # convention with e5m2 and per-head scales
    FormatCase(GQACase(split=64, k_cache_split=True, v_cache=False, rotary_dim=64, hq=4, hkv=1, seed=37),
               "fp8_per_token_head", None),
    FormatCase(GQACase(scale_convention="multiply", scale_per_head="k", hq=6, hkv=3, layout="HND", seed=38),
               "fp8_e5m2", "fp8_e4m3"),
]


@INTERPRETER
@pytest.mark.parametrize("fc", FORMAT_CASES, ids=[fc.describe() for fc in FORMAT_CASES])
def test_format_kernel_equals_reference(fc):
    """The kernel writes the reference's bytes: whole cache and scale-cache storages (random bytes, guards and
    padding between blocks), q_out (poisoned) and the inputs."""
    ref = run_format_case(fc, "reference")
    got = run_format_case(fc, "triton")
    assert not diff_report(ref, got), diff_report(ref, got)


def test_format_cases_write_something():
    """The reference runs of the cases change their caches (each case writes at least one record)."""
    for fc in FORMAT_CASES[:4]:
        kw, storages, _, _ = build_format_call(fc)
        before = {k: v.clone() for k, v in storages.items()}
        with kvfuse.use_backend("reference"):
            kvfuse.fused_qk_norm_rope_store_kv(**kw)
        assert all(not torch.equal(before[k], storages[k]) for k in storages), fc.describe()


# --------------------------------------------------------------------------- vLLM's semantics, written out
def _vllm_per_token_head(v: torch.Tensor, code: str):
    """vLLM's _reshape_cache_per_token_head on rows v [n, H, D] with IEEE fp32 operations (numpy float32,
    element by element as its Triton code reads): scale = max(amax / QMAX, 1e-6), q = v * (1 / scale); int8:
    round half away from zero, clamp [-128, 127], truncate; fp8: clamp [-448, 448], e4m3 by torch's own cast."""
    import numpy as np
    x = v.float().numpy().astype(np.float32)
    qmax = np.float32(127.0 if code == "int8" else 448.0)
    amax = np.abs(x).max(-1)
    s = np.maximum(amax / qmax, np.float32(1e-6)).astype(np.float32)
    t = (x * (np.float32(1.0) / s)[..., None]).astype(np.float32)
    if code == "int8":
        u = np.where(t >= 0, t + np.float32(0.5), t - np.float32(0.5)).astype(np.float32)
        codes = torch.from_numpy(np.trunc(np.clip(u, -128, 127)).astype(np.int8))
    else:
        codes = torch.from_numpy(np.clip(t, -448, 448)).to(torch.float8_e4m3fn).view(torch.int8)
    return codes, torch.from_numpy(s)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=INTERPRETER)])
@pytest.mark.parametrize("fmt,layout", [("int8_per_token_head", "NHD"), ("fp8_per_token_head", "HND")])
def test_v_per_token_head_as_vllm_writes_it(backend, fmt, layout):
    """V's records and scales as vLLM's rule gives them, at slot s: codes at block s // block_size, offset
    s % block_size; the scale at [block, offset, head] (NHD) / [block, head, offset] (HND); slots < 0 or
    past the cache write nothing (no record, no scale)."""
    fc = FormatCase(GQACase(layout=layout, n=9, hq=4, hkv=2, seed=41), "auto", fmt)
    kw, storages, _, _ = build_format_call(fc)
    before_v, before_s = kw["v_cache"].clone(), kw["v_scale_cache"].clone()
    with kvfuse.use_backend(backend):
        kvfuse.fused_qk_norm_rope_store_kv(**kw)
    codes, scales = _vllm_per_token_head(kw["v"], fmt.split("_")[0])
    vc, vs = kw["v_cache"].view(torch.int8), kw["v_scale_cache"]
    bs = fc.base.block_size
    written = torch.zeros(vs.shape, dtype=torch.bool)
    for i, slot in enumerate(kw["slot_mapping"].tolist()):
        if not 0 <= slot < vs.shape[0] * bs:
            continue
        b, o = divmod(slot, bs)
        rec = vc[b, o] if layout == "NHD" else vc[b, :, o]
        sc = vs[b, o] if layout == "NHD" else vs[b, :, o]
        assert torch.equal(rec, codes[i]) and torch.equal(sc, scales[i]), i
        (written[b, o] if layout == "NHD" else written[b, :, o]).fill_(True)
    assert int(written.sum()) > 0 and int((~written).sum()) > 0
    keep = ~written
    assert torch.equal(vs[keep].view(torch.int32), before_s[keep].view(torch.int32))
    assert torch.equal(vc.view(torch.uint8)[keep], before_v.view(torch.uint8)[keep])


def test_per_token_head_edge_rows():
    """Rows of zeros (the scale bound 1e-6), a row whose largest value lands on a tie, int8's -128 clamp (a
    code vLLM's rounding gives only past 127.5 in magnitude: never, as |q| <= 127), signed zeros."""
    from kvfuse.reference import quantize_per_token_head
    x = torch.zeros(1, 4, 8)
    x[0, 1] = torch.tensor([-0.0, 0.0, 1.0, -1.0, 0.5, -0.25, 127.0, 3.0])
    x[0, 2] = torch.tensor([-254.0] + [1.0] * 7)
    x[0, 3, 0] = float("nan")
    codes, s = quantize_per_token_head(x, "int8")
    assert s[0, 0] == torch.tensor(1e-6, dtype=torch.float32) and torch.all(codes[0, 0] == 0)
    assert s[0, 1] == 1.0 and codes[0, 1].view(torch.int8).tolist() == [0, 0, 1, -1, 1, 0, 127, 3]   # 0.5 -> 1
    assert s[0, 2] == 2.0 and codes[0, 2].view(torch.int8).tolist() == [-127] + [1] * 7        # 0.5 -> 1 away from 0
    assert s[0, 3].view(torch.int32) == 0x7FC00000 and torch.all(codes[0, 3] == 0)           # NaN row: code 0
    x[0, 3, 0] = -float("nan")
    c8, s8 = quantize_per_token_head(x, "e4m3")
    assert s8[0, 3].view(torch.int32) == 0x7FC00000 and torch.all(c8[0, 3] == 0x7F)         # canonical NaNs
    assert c8[0, 1, :2].tolist() == [0x80, 0x00] and s8[0, 1] == torch.div(torch.tensor(127.0), torch.tensor(448.0))


def test_e5m2_encoder_equals_torchs_cast():
    """kvfuse.reference.encode_e5m2 (integer arithmetic) gives torch's float8_e5m2 cast (RTNE) for every
    finite value in range: normals, subnormals, ties, the smallest values, signed zeros, the largest."""
    from kvfuse.reference import encode_e5m2
    g = torch.Generator().manual_seed(5)
    bits = torch.randint(0, 2 ** 31 - 1, (200000,), generator=g, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    x = torch.where(torch.isfinite(x), x, torch.zeros_like(x)) * torch.where(torch.rand(x.shape, generator=g) < 0.5,
                                                                                -1.0, 1.0)
    ties = torch.tensor([2.0 ** -17, 3 * 2.0 ** -17, 2.0 ** -16 * 2.5, 1.125, 1.375, -1.125, 57344.0, -57344.0,
                         0.0, -0.0, 2.0 ** -14, 2.0 ** -14 * 0.875, 61440.0 - 2.0 ** 11])
    x = torch.clamp(torch.cat([x, ties, x * 2.0 ** -100, x * 2.0 ** -120]), -57344.0, 57344.0)
    assert torch.equal(encode_e5m2(x), x.to(torch.float8_e5m2).view(torch.uint8))


def test_e5m2_static_cast_saturates_and_keeps_the_sign():
    from kvfuse.reference import quantize_per_tensor
    x = torch.tensor([[[1e30, -1e30, float("inf"), -0.0, 3.0, 1e-30, float("nan"), 57344.0 * 1.2]]])
    codes = quantize_per_tensor(x, torch.tensor(1.0), code="e5m2")
    assert codes.tolist() == [[[0x7B, 0xFB, 0x7B, 0x80, 0x42, 0x00, 0x7F, 0x7B]]]


# --------------------------------------------------------------------------- bad input
def _pth_kw(**change):
    fc = FormatCase(GQACase(n=3, d=64, hq=2, hkv=2, seed=51), "fp8_per_token_head", "int8_per_token_head")
    kw, _, _, _ = build_format_call(fc)
    kw.update(change)
    return kw


PTH_BAD = [
    ("scale cache missing", dict(k_scale_cache=None), ValueError,
     "k_scale_cache: k_format 'fp8_per_token_head' stores its scales: expected a torch.float32 tensor of shape"),
    ("scale cache dtype", lambda kw: dict(v_scale_cache=kw["v_scale_cache"].to(torch.bfloat16)), TypeError,
     "v_scale_cache: expected dtype torch.float32, got torch.bfloat16"),
    ("scale cache shape", lambda kw: dict(k_scale_cache=kw["k_scale_cache"][:, :, :1]), ValueError,
     "k_scale_cache: expected shape"),
    ("scale cache expanded",
     lambda kw: dict(k_scale_cache=kw["k_scale_cache"][:, :1].expand(kw["k_scale_cache"].shape)),
     ValueError, "k_scale_cache: its elements overlap in memory"),
    ("static scale given", dict(k_scale=torch.ones(1)), ValueError,
     "k_scale must be None without a static-scale k_format ('fp8_per_token_head' here)"),
    ("int8 cache unnamed", dict(v_format=None, v_scale_cache=None), TypeError,
     "v_cache: expected dtype torch.bfloat16 or torch.float8_e4m3fn, got torch.int8"),
    ("scale cache overlaps the cache", lambda kw: dict(k_scale_cache=torch.as_strided(
        _overlapping_scales(kw), kw["k_scale_cache"].shape, kw["k_scale_cache"].stride())), ValueError,
     "k_cache overlaps k_scale_cache in memory"),
    ("scale caches share elements", lambda kw: dict(v_scale_cache=kw["k_scale_cache"]), ValueError,
     "k_scale_cache overlaps v_scale_cache in memory: an output must not overlap another output"),
]


def _overlapping_scales(kw):
    """fp32 elements over the bytes of k_cache's storage (a scale cache inside the codes)."""
    storage = kw["k_cache"].untyped_storage()
    return torch.empty(0, dtype=torch.float32).set_(storage)[16:]


@pytest.mark.parametrize("label,change,exc,match", PTH_BAD, ids=[b[0] for b in PTH_BAD])
def test_bad_scale_cache_arguments(label, change, exc, match):
    kw = _pth_kw()
    kw.update(change(kw) if callable(change) else change)
    before = [t.clone() for t in (kw["k_cache"].view(torch.uint8), kw["v_cache"].view(torch.uint8))]
    with kvfuse.use_backend("reference"), pytest.raises(exc, match=re.escape(match)):
        kvfuse.fused_qk_norm_rope_store_kv(**kw)
    assert torch.equal(before[0], kw["k_cache"].view(torch.uint8))
    assert torch.equal(before[1], kw["v_cache"].view(torch.uint8))


def test_token_head_format_without_caches_is_refused():
    kw = _kw()
    kw.update(k_cache=None, v_cache=None, slot_mapping=None)
    with pytest.raises(ValueError, match=re.escape("k_format: without caches k goes to k_out (torch.bfloat16): "
                                                   "expected None or a format of that dtype without stored scales, "
                                                   "got 'int8_per_token_head'")):
        kvfuse.fused_qk_norm_rope_store_kv(**kw, k_format="int8_per_token_head")


# --------------------------------------------------------------------------- the read side
@pytest.mark.parametrize("kf,vf,inline", [("fp8_e5m2", "fp8_per_token_head", False),
                                          ("int8_per_token_head", "auto", False),
                                          ("fp8_per_token_head", "fp8_per_token_head", True)])
def test_load_reads_back_each_format(kf, vf, inline):
    """load_gqa_kv_cache gives bf16(f(code) * f(scale)) with the static scale or the slot's stored one
    (decoded here from the bytes independently), the stored bits for "auto", zeros for invalid slots; and the
    values are within the format's step of what was written."""
    fc = FormatCase(GQACase(n=6, hq=2, hkv=2, seed=61, layout="HND" if inline else "NHD"), kf, vf, inline=inline)
    kw, _, _, _ = build_format_call(fc)
    with kvfuse.use_backend("reference"):
        kvfuse.fused_qk_norm_rope_store_kv(**kw)
    names = ("k_format", "v_format", "k_scale", "v_scale", "k_scale_cache", "v_scale_cache")
    k, v = kvfuse.load_gqa_kv_cache(kw["k_cache"], kw["v_cache"], kw["slot_mapping"], fc.base.layout,
                                    **{n: kw.get(n) for n in names})
    bs = fc.base.block_size
    for got, which, fmt in ((k, "k", PRESETS[kf]), (v, "v", PRESETS[vf])):
        cache = kw[which + "_cache"]
        for i, slot in enumerate(kw["slot_mapping"].tolist()):
            if not 0 <= slot < cache.shape[0] * bs:
                assert torch.all(got[i].view(torch.int16) == 0)
                continue
            b, o = divmod(slot, bs)
            rec = cache[b, o] if fc.base.layout == "NHD" else cache[b, :, o]
            if fmt.code == "act":
                assert torch.equal(got[i], rec)
                continue
            if fmt.scale == "static":
                scale = kw[which + "_scale"].reshape(-1)[:, None].expand(rec.shape[0], 1)
            else:
                sc = kw[which + "_scale_cache"]
                scale = (sc[b, o] if fc.base.layout == "NHD" else sc[b, :, o])[:, None]
            want = (rec.float() * scale).to(torch.bfloat16)
            assert torch.equal(got[i], want), (which, i)
            if which == "v":        # V is stored without a transform: the read value is near the written one
                x = kw["v"][i].float()
                step = scale * (1.0 if fmt.code == "int8" else 2.0 ** -3) * torch.clamp(x.abs() / scale, min=1)
                assert torch.all((got[i].float() - x).abs() <= step * 1.01 + 2.0 ** -8 * x.abs())


def test_load_bad_arguments():
    kw = _pth_kw()
    args = (kw["k_cache"], kw["v_cache"], kw["slot_mapping"])
    with pytest.raises(ValueError, match="k_scale_cache: k_format 'fp8_per_token_head' stores its scales"):
        kvfuse.load_gqa_kv_cache(*args, k_format="fp8_per_token_head", v_format="int8_per_token_head",
                                 v_scale_cache=kw["v_scale_cache"])
    with pytest.raises(TypeError, match=re.escape("v_cache: expected dtype torch.float8_e5m2 (v_format 'fp8_e5m2')")):
        kvfuse.load_gqa_kv_cache(*args, k_format="fp8_per_token_head", v_format="fp8_e5m2")


@INTERPRETER
@pytest.mark.parametrize("fmt", ["int8_per_token_head", "fp8_per_token_head"])
def test_per_token_head_edge_rows_kernel(fmt):
    """V rows of zeros, signed zeros, a NaN, an infinity, tiny values: the kernel writes the reference's bytes
    (NaN-propagating amax, the 1e-6 bound, NaN codes)."""
    fc = FormatCase(GQACase(n=4, hq=2, hkv=2, d=64, slots="contiguous", seed=71), "fp8_per_token_head", fmt)
    runs = []
    for backend in ("reference", "triton"):
        kw, storages, _, _ = build_format_call(fc)
        v = kw["v"]
        v[0, 0] = 0.0
        v[0, 1] = -0.0
        v[1, 0, 5] = float("nan")
        v[1, 1, 3] = float("inf")
        v[2, 0] = 1e-30
        v[2, 1, ::2] = -3e38
        v[3, 1, 7] = -float("nan")
        with kvfuse.use_backend(backend):
            kvfuse.fused_qk_norm_rope_store_kv(**kw)
        runs.append({k: s.clone() for k, s in storages.items()})
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


# --------------------------------------------------------------------------- the GPU suite's coverage
def test_gpu_format_cases_reach_every_preset():
    """tests/gpu_matrix.py's format section holds every preset as K's format and as V's, in the kernel's
    halves form and its rows form, a decode and a batch of several programs,
    both layouts; vLLM's inline scales for each format that stores one per (token, head). A preset without
    GPU cases fails here."""
    import gpu_matrix
    from kvfuse.kernels import qkv
    cases = [fc for _, fc in gpu_matrix.gqa_format_cases()]
    for name, fmt in PRESETS.items():
        for which in ("k_format", "v_format"):
            mine = [fc for fc in cases if getattr(fc, which) == name]
            forms = {qkv.halves_mode(_plan_of(fc), fc.base.d, fc.base.d) for fc in mine}
            assert forms == {True, False}, (name, which)
            assert {fc.base.n == 1 for fc in mine} == {True, False} and {fc.base.layout for fc in mine} == \
                {"NHD", "HND"}, (name, which)
        if fmt.scale == "token_head":
            assert any(fc.inline and fc.k_format == name for fc in cases), name


def _plan_of(fc):
    kw, _, _, _ = build_format_call(fc)
    return kvfuse.plans.gqa.validate(**kw)


@INTERPRETER
def test_gpu_format_cases_small_ones_under_the_interpreter():
    """The GPU section's cases of a few tokens, run here: the kernel (interpreted) writes the reference's bytes."""
    import gpu_matrix
    small = [(label, fc) for label, fc in gpu_matrix.gqa_format_cases() if fc.base.n <= 5]
    assert len(small) >= 2 * len(PRESETS)
    for label, fc in small:
        report = diff_report(run_format_case(fc, "reference"), run_format_case(fc, "triton"))
        assert not report, label + " :: " + report


@INTERPRETER
@pytest.mark.parametrize("fmt,scale", EVERY_BF16_FORMATS)
def test_every_bf16_value_through_v(fmt, scale):
    """Every bf16 value (infinities, subnormals, ties of every code) through V into each format: the kernel's
    integer encoders give the reference's bytes (the GPU module runs the native conversions the same way)."""
    ref = every_bf16_run(fmt, scale, "reference")
    got = every_bf16_run(fmt, scale, "triton")
    assert not diff_report(ref, got), diff_report(ref, got)


# --------------------------------------------------------------------------- vLLM's per-(token, head) writer
class _Mode:       # stands for vLLM's KVQuantMode (read by its name)
    def __init__(self, name):
        self.name = name


@pytest.mark.parametrize("mode,dtype", [("INT8_PER_TOKEN_HEAD", torch.int8), ("FP8_PER_TOKEN_HEAD", torch.uint8)])
def test_vllm_per_token_head_adapter(mode, dtype):
    """kvfuse.engines.vllm's writer with vLLM's signature and its allocation (per (head, slot) a row of codes
    and scale padding, the caches wider than head_size, the scales strided fp32 views of the same bytes):
    the bytes of the GQA entry on the written columns and scales, the padding bytes left alone, and
    vLLM's rule (written out above) for V."""
    from kvfuse.engines import vllm as ops
    n, h, d, nb, bs = 5, 2, 64, 3, 4
    g = torch.Generator().manual_seed(81)
    key, value = (torch.randn(n, h, d, generator=g).to(torch.bfloat16) for _ in range(2))
    row = 2 * (d + 4)
    raw = torch.randint(0, 256, (nb * bs * h * row,), generator=g, dtype=torch.int64).to(torch.uint8)
    kv = raw.view(nb, bs, h, row)
    key_cache, value_cache = kv[..., :d + 4].view(dtype), kv[..., d + 4:].view(dtype)     # [.., d + 4]: padded rows
    f32 = raw.view(torch.float32)
    ks = torch.as_strided(f32, (nb, bs, h), (bs * h * row // 4, h * row // 4, row // 4), d // 4)
    vs = torch.as_strided(f32, (nb, bs, h), (bs * h * row // 4, h * row // 4, row // 4), (2 * d + 4) // 4)
    slots = torch.tensor([3, -1, 0, 11, 6])
    before = raw.clone()
    ops.triton_reshape_and_cache_flash_per_token_head_quant(key, value, key_cache, value_cache, ks, vs, slots,
                                                            _Mode(mode))
    codes, scales = _vllm_per_token_head(value, "int8" if dtype == torch.int8 else "e4m3")
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        b, o = divmod(s, bs)
        assert torch.equal(value_cache[b, o, :, :d].view(torch.int8), codes[i]) and torch.equal(vs[b, o], scales[i])
    written = torch.zeros(nb, bs, dtype=torch.bool)
    written.view(-1)[slots[slots >= 0]] = True
    assert torch.equal(raw.view(nb, bs, -1)[~written], before.view(nb, bs, -1)[~written])
    # the same call on the GQA entry
    raw2 = before.clone()
    kv2 = raw2.view(nb, bs, h, row)
    fmt = "int8_per_token_head" if dtype == torch.int8 else "fp8_per_token_head"
    cdt = torch.int8 if dtype == torch.int8 else torch.float8_e4m3fn
    f32b = raw2.view(torch.float32)
    kvfuse.fused_qk_norm_rope_store_kv(key[:, :0], key, value, kv2[..., :d].view(cdt),
                                       kv2[..., d + 4:2 * d + 4].view(cdt), slots, k_format=fmt, v_format=fmt,
                                       k_scale_cache=torch.as_strided(f32b, ks.shape, ks.stride(), ks.storage_offset()),
                                       v_scale_cache=torch.as_strided(f32b, vs.shape, vs.stride(), vs.storage_offset()))
    assert torch.equal(raw, raw2)


def test_vllm_per_token_head_adapter_errors():
    from kvfuse.engines import vllm as ops
    key = torch.zeros(2, 1, 64, dtype=torch.bfloat16)
    cache = torch.zeros(2, 4, 1, 64, dtype=torch.int8)
    sc = torch.zeros(2, 4, 1)
    with pytest.raises(ValueError, match="kv_quant_mode: expected one of"):
        ops.triton_reshape_and_cache_flash_per_token_head_quant(key, key, cache, cache.clone(), sc, sc.clone(),
                                                                torch.zeros(2, dtype=torch.long), "INT4_PER_TOKEN_HEAD")
    with pytest.raises(TypeError, match="key_cache: an fp8 e4m3 cache must be uint8 or float8_e4m3fn"):
        ops.triton_reshape_and_cache_flash_per_token_head_quant(key, key, cache, cache.clone(), sc, sc.clone(),
                                                                torch.zeros(2, dtype=torch.long), "FP8_PER_TOKEN_HEAD")
    with pytest.raises(ValueError, match="k_scale_cache: expected shape"):
        ops.triton_reshape_and_cache_flash_per_token_head_quant(key, key, cache, cache.clone(), sc[:, :2], sc.clone(),
                                                                torch.zeros(2, dtype=torch.long),
                                                                _Mode("INT8_PER_TOKEN_HEAD"))


def test_opcheck_per_token_head():
    """The custom op with int8 per-(token, head) caches and their scale caches (mutated, declared so)."""
    from kvfuse.plans import opargs
    op = torch.ops.kvfuse.fused_qk_norm_rope_store_kv.default
    fc = FormatCase(GQACase(n=4, hq=2, hkv=2, d=64, seed=91), "int8_per_token_head", "int8_per_token_head")
    kw, _, _, _ = build_format_call(fc)
    for name in ("k_scale_cache", "v_scale_cache"):
        kw[name] = torch.zeros(kw[name].shape)          # finite values: opcheck compares with allclose
    args = opargs.flatten(kvfuse.plans.gqa.prepare(**kw))
    with kvfuse.use_backend("reference"):
        torch.library.opcheck(op, args)


def test_compiled_call_equals_eager():
    """Under torch.compile(fullgraph=True) the call (through the custom op) writes the eager call's bytes."""
    fc = FormatCase(GQACase(n=4, hq=2, hkv=2, d=64, seed=92), "fp8_per_token_head", "fp8_e5m2")
    outs = []
    for compiled in (False, True):
        kw, storages, _, q_buf = build_format_call(fc)
        fn = kvfuse.fused_qk_norm_rope_store_kv
        if compiled:
            torch._dynamo.reset()
            fn = torch.compile(fn, fullgraph=True, backend="eager")
        with kvfuse.use_backend("reference"):
            fn(**kw)
        outs.append([s.clone() for s in storages.values()] + [q_buf.view(torch.uint8).clone()])
    assert all(torch.equal(a, b) for a, b in zip(*outs))


@INTERPRETER
def test_per_token_head_int64_slot_path(monkeypatch):
    """The slots' int64 path (caches of 2^31 slots and more) addresses the scale caches as the codes."""
    from kvfuse.kernels import config
    monkeypatch.setattr(config, "INT32_LIMIT", 4)
    fc = FormatCase(GQACase(n=6, hq=2, hkv=2, layout="HND", seed=93), "int8_per_token_head", "fp8_per_token_head")
    report = diff_report(run_format_case(fc, "reference"), run_format_case(fc, "triton"))
    assert not report, report
