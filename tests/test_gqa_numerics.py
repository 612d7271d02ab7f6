"""The numerics profiles and activation dtypes of kvfuse.fused_qk_norm_rope_store_kv (SPEC §6, §3;
kvfuse/numerics_profiles.py), on both backends (the reference chain and qkv.py in Triton's interpreter):

* each profile x dtype equals a restatement of SPEC written here in numpy float32 (one rounding per
  operation, the adjacent-pairs tree, IEEE division and sqrt), for every row of a small call;
* the interpreter equals the reference byte for byte over whole storages for the new features: fp16 /
  fp32 activations and caches, head_dim 8 / 72 / 120, the fused profiles, calls without caches (k in place);
* fp16 norm weights and cos / sin tables give the bytes of the call with them widened to fp32;
* the GPU matrix's GQA section (tests/gpu_matrix.py) reaches every value of the new constexprs and
  every weight / table dtype.
"""
import dataclasses

import numpy as np
import pytest
import torch

import kvfuse
from kvfuse.numerics_profiles import ACTIVATION_DTYPES, NUMERICS, PROFILES
from gqa_cases import GQACase, build, diff_report, run_gqa_case
from helpers import cos_sin_cache

F32 = np.float32
BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.skipif(
    not kvfuse.backend.interpreter_enabled(), reason="needs TRITON_INTERPRET=1"))]


# --------------------------------------------------------------------------- SPEC restated in numpy
def _round(v: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """float32 -> the nearest-even value of dtype, as float32 (bf16 by its bit pattern, fp16 by numpy)."""
    if dtype == torch.float32:
        return v
    if dtype == torch.float16:
        return v.astype(np.float16).astype(F32)
    u = v.astype(F32).view(np.uint32).astype(np.uint64)
    r = (((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16).astype(np.uint32)
    return r.view(F32)


def _tree(p: np.ndarray) -> np.float32:
    width = 1 << (len(p) - 1).bit_length()
    p = np.concatenate([p, np.zeros(width - len(p), F32)])
    while len(p) > 1:
        p = (p[0::2] + p[1::2]).astype(F32)
    return F32(p[0])


def _row(x, w, eps, cos, sin, rdim, act, profile):
    """One q / k head row under a profile: (the value stored in q_out / an unquantized cache, the value an
    fp8 cast reads)."""
    x = x.astype(F32)
    y = x
    if w is not None:
        rstd = F32(1.0) / np.sqrt(F32(_tree(x * x) / F32(len(x)) + F32(eps)))
        y = ((x * rstd).astype(F32) * w.astype(F32)).astype(F32)
        if profile.round_each_stage:
            y = _round(y, act)
    if cos is not None:
        h = rdim // 2
        a, b = y[:h].copy(), y[h:rdim].copy()
        y = y.copy()
        y[:h] = _round(((a * cos).astype(F32) - (b * sin).astype(F32)).astype(F32), act) \
            if profile.round_each_stage else (a * cos).astype(F32) - (b * sin).astype(F32)
        y[h:rdim] = _round(((a * sin).astype(F32) + (b * cos).astype(F32)).astype(F32), act) \
            if profile.round_each_stage else (a * sin).astype(F32) + (b * cos).astype(F32)
    rounded = _round(y, act)
    return rounded, (y if profile.cast_reads_fp32 else rounded)


def _e4m3(v: np.ndarray, scale: float) -> torch.Tensor:
    t = np.clip((v / F32(scale)).astype(F32), -448.0, 448.0)
    return torch.from_numpy(t).to(torch.float8_e4m3fn).view(torch.uint8)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp8", [False, True], ids=["plain_cache", "fp8"])
@pytest.mark.parametrize("act", ACTIVATION_DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("numerics", NUMERICS)
@pytest.mark.parametrize("d,rdim,norms", [(128, 128, True), (72, 40, True), (64, 64, False)],
                         ids=["d128", "d72_partial", "d64_no_norms"])
def test_profile_equals_spec_restated(numerics, act, fp8, backend, d, rdim, norms):
    profile = PROFILES[numerics]
    n, hq, hkv, bs = 3, 2, 1, 4
    g = torch.Generator().manual_seed(d + 3 * fp8)
    x = torch.randn(n, hq + 2 * hkv, d, generator=g) * torch.tensor([1.0, 3.0, 40.0, 0.5])[None, :, None]
    x = x.to(act)
    q, k, v = x[:, :hq], x[:, hq:hq + hkv], x[:, hq + hkv:]
    wq = (1.0 + 0.3 * torch.randn(d, generator=g)).to(torch.bfloat16)
    wk = (1.0 + 0.3 * torch.randn(d, generator=g)).float()
    pos = torch.tensor([3, 0, 17])
    cs = cos_sin_cache(20, rdim)
    cache_dt = torch.float8_e4m3fn if fp8 else act
    k_cache = torch.zeros(2, bs, hkv, d, dtype=cache_dt)
    v_cache = torch.zeros(2, bs, hkv, d, dtype=cache_dt)
    slots = torch.tensor([5, 0, 2])
    ks, vs = 0.0371, 0.0213
    scales = dict(k_scale=torch.tensor([ks]), v_scale=torch.tensor(vs)) if fp8 else {}
    norm_q, norm_k = (kvfuse.NormArgs(wq, 1e-6), kvfuse.NormArgs(wk, 1e-5)) if norms else (None, None)
    with kvfuse.use_backend(backend):
        q_out = kvfuse.fused_qk_norm_rope_store_kv(
            q, k, v, k_cache, v_cache, slots, norm_q, norm_k, kvfuse.RopeArgs(pos, cs, rdim, True), layout="NHD",
            numerics=numerics, **scales)
    assert q_out.dtype == act
    for t in range(n):
        c, s = cs[pos[t], :rdim // 2].numpy(), cs[pos[t], rdim // 2:].numpy()
        for h in range(hq):
            want, _ = _row(q[t, h].float().numpy(), wq.float().numpy() if norms else None, 1e-6, c, s, rdim, act,
                           profile)
            assert np.array_equal(q_out[t, h].float().numpy().view(np.uint32), want.view(np.uint32)), (t, h)
        blk, off = int(slots[t]) // bs, int(slots[t]) % bs
        stored, cast_in = _row(k[t, 0].float().numpy(), wk.numpy() if norms else None, 1e-5, c, s, rdim, act,
                               profile)
        vv = v[t, 0].float().numpy()
        if fp8:
            assert torch.equal(k_cache[blk, off, 0].view(torch.uint8), _e4m3(cast_in, ks)), t
            assert torch.equal(v_cache[blk, off, 0].view(torch.uint8), _e4m3(vv, vs)), t
        else:
            assert np.array_equal(k_cache[blk, off, 0].float().numpy().view(np.uint32), stored.view(np.uint32)), t
            assert torch.equal(v_cache[blk, off, 0], v[t, 0]), t


def test_profiles_differ_where_they_should():
    """fused differs from staged when a norm precedes RoPE (the norm's rounding is skipped), equals it without
    the norm; fused_fp32_cast differs from fused only in an fp8 cache's bytes."""
    base = dict(n=12, fp8=True, seed=31)
    runs = {p: run_gqa_case(GQACase(numerics=p, **base), "reference") for p in NUMERICS}
    assert diff_report(runs["staged"], runs["fused"])
    assert "q_out" not in diff_report(runs["fused"], runs["fused_fp32_cast"])
    assert "cache_storage0" in diff_report(runs["fused"], runs["fused_fp32_cast"])
    plain = {p: run_gqa_case(GQACase(numerics=p, q_norm=None, k_norm=None, **base), "reference") for p in NUMERICS}
    assert not diff_report(plain["staged"], plain["fused"])
    assert diff_report(plain["fused"], plain["fused_fp32_cast"]).startswith("cache_storage0")   # RoPE's fp32 value
    fp32 = {p: run_gqa_case(GQACase(numerics=p, dtype="fp32", **base), "reference") for p in ("staged", "fused")}
    assert not diff_report(fp32["staged"], fp32["fused"])     # nothing to round in fp32


# --------------------------------------------------------------------------- interpreter == reference
CASES = {
    "fp16_staged_fp8": GQACase(dtype="fp16", fp8=True, seed=50),
    "fp16_bf16_weights_hnd": GQACase(dtype="fp16", layout="HND", neox=False, seed=51),
    "fp32_fp8_per_head": GQACase(dtype="fp32", fp8=True, scale_per_head="kv", hq=4, hkv=2, seed=52),
    "fp32_plain_vllm_views": GQACase(dtype="fp32", cache="vllm", seed=53),
    "fused_bf16_fp8_gptj": GQACase(numerics="fused", fp8=True, neox=False, seed=54),
    "fused_fp16_partial_offset": GQACase(numerics="fused", dtype="fp16", rotary_dim=64, rope_offset=32, seed=55),
    "fp32_cast_fp8_inplace": GQACase(numerics="fused_fp32_cast", fp8=True, inplace=True, seed=56),
    "fp32_cast_fp8_no_norms": GQACase(numerics="fused_fp32_cast", fp8=True, q_norm=None, k_norm=None, seed=68),
    "fp32_cast_fp8_no_norms_rows": GQACase(numerics="fused_fp32_cast", fp8=True, q_norm=None, k_norm=None,
                                           rotary_dim=64, neox=False, dtype="fp16", seed=69),
    "fp32_cast_fp16_fp8_rows": GQACase(numerics="fused_fp32_cast", dtype="fp16", fp8=True, rotary_dim=32,
                                       neox=False, seed=57),
    "d120_fp8": GQACase(d=120, rotary_dim=64, fp8=True, seed=58),
    "d120_full_rotary_fused": GQACase(d=120, numerics="fused", seed=59),
    "d72_dv40_hnd": GQACase(d=72, dv=40, rotary_dim=72, layout="HND", seed=60),
    "d8_fp16": GQACase(d=8, hq=2, hkv=1, dtype="fp16", seed=61),
    "d8_fp8_no_rope": GQACase(d=8, hq=2, hkv=1, fp8=True, rotary_dim=0, seed=62),
    "no_cache_inplace_fused": GQACase(kv_cache=False, inplace=True, numerics="fused", seed=63),
    "no_cache_k_out_fp16_gptj": GQACase(kv_cache=False, dtype="fp16", neox=False, rotary_dim=64, seed=64),
    "no_cache_d120_fp32": GQACase(kv_cache=False, d=120, dtype="fp32", packed=False, seed=65),
    "fp16_weights_fp16_cos_sin_fused": GQACase(dtype="fp16", numerics="fused", q_norm="fp16", k_norm="fp16",
                                               cos_sin="fp16", fp8=True, seed=70),
    "bf16_fp16_q_weight_fp16_cos_sin_rows": GQACase(q_norm="fp16", cos_sin="fp16", rotary_dim=64, neox=False,
                                                    layout="HND", seed=71),
}


@pytest.mark.skipif(not kvfuse.backend.interpreter_enabled(), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_equals_reference(name):
    case = CASES[name]
    report = diff_report(run_gqa_case(case, "reference"), run_gqa_case(case, "triton"))
    assert not report, f"{case.describe()}: {report}"


@pytest.mark.parametrize("act", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_plain_cache_holds_the_input_dtype_and_reads_back(act):
    """An unquantized cache of the activations' dtype: v's bits as given, k's as q_out's chain gives them;
    load_gqa_kv_cache returns them in that dtype."""
    kw, _, _, _ = build(GQACase(dtype="fp16" if act == torch.float16 else "fp32", packed=False, seed=66))
    kvfuse.fused_qk_norm_rope_store_kv(**kw)
    k, v = kvfuse.load_gqa_kv_cache(kw["k_cache"], kw["v_cache"], kw["slot_mapping"], "NHD")
    assert k.dtype == v.dtype == act
    slots = kw["slot_mapping"]
    valid = (slots >= 0) & (slots < kw["k_cache"].shape[0] * kw["k_cache"].shape[1])
    assert torch.equal(v[valid].view(torch.uint8), kw["v"][valid].view(torch.uint8))
    assert not torch.isnan(k[valid]).any()


def test_no_cache_k_equals_cache_write():
    """Without caches, k_out receives exactly the values a cache of the activations' dtype would hold."""
    case = GQACase(fp8=False, packed=False, slots="contiguous", seed=67, numerics="fused")
    kw, _, _, _ = build(case)
    kvfuse.fused_qk_norm_rope_store_kv(**kw)
    cached, _ = kvfuse.load_gqa_kv_cache(kw["k_cache"], kw["v_cache"], kw["slot_mapping"], "NHD")
    q_out, k_out = kvfuse.fused_qk_norm_rope_store_kv(
        **{**kw, "k_cache": None, "v_cache": None, "slot_mapping": None, "q_out": None})
    assert torch.equal(k_out.view(torch.int16), cached.view(torch.int16))
    assert torch.equal(q_out.view(torch.int16), kw["q_out"].view(torch.int16))


# --------------------------------------------------------------------------- fp16 weights and tables
def _widened_to_fp32(kw):
    """The call's keyword arguments with the norm weights and the cos / sin table as fp32 (exact copies)."""
    out = dict(kw)
    for name in ("q_norm_args", "k_norm_args"):
        if kw[name] is not None:
            out[name] = dataclasses.replace(kw[name], weight=kw[name].weight.float())
    if kw.get("rope_args") is not None:
        out["rope_args"] = dataclasses.replace(kw["rope_args"], cos_sin_cache=kw["rope_args"].cos_sin_cache.float())
    return out


def _call_widened(**kw):
    result = kvfuse.fused_qk_norm_rope_store_kv(**_widened_to_fp32(kw))
    return result if kw["k_cache"] is not None else result[0]


FP16_TABLE_CASES = {
    "fp16_act_fused_fp8_halves": GQACase(n=6, hq=4, hkv=2, dtype="fp16", numerics="fused", q_norm="fp16",
                                         k_norm="fp16", cos_sin="fp16", fp8=True, seed=72),
    "bf16_staged_gptj_partial_hnd": GQACase(n=6, hq=4, hkv=2, q_norm="fp16", k_norm="fp32", cos_sin="fp16",
                                            rotary_dim=64, rope_offset=32, neox=False, layout="HND", seed=73),
    "fp32_no_cache_rows": GQACase(n=6, hq=4, hkv=2, d=120, rotary_dim=64, dtype="fp32", q_norm="bf16",
                                  k_norm="fp16", cos_sin="fp16", kv_cache=False, seed=74),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(FP16_TABLE_CASES))
def test_fp16_weights_and_cos_sin_equal_them_widened_to_fp32(name, backend):
    """fp16 norm weights and an fp16 cos / sin table give the bytes of the same call with them widened to
    fp32 first (fp16 -> fp32 is exact; SPEC §6 reads them as fp32)."""
    case = FP16_TABLE_CASES[name]
    kw, _, _, _ = build(case)
    fp16 = [t for t in (kw["q_norm_args"], kw["k_norm_args"]) if t is not None and t.weight.dtype == torch.float16]
    assert fp16 and kw["rope_args"].cos_sin_cache.dtype == torch.float16
    given = run_gqa_case(case, backend)
    widened = run_gqa_case(case, backend, fn=_call_widened)
    report = diff_report(given, widened)
    assert not report, f"{case.describe()}: {report}"


# --------------------------------------------------------------------------- the GPU matrix's cover
def test_gpu_matrix_reaches_every_new_constexpr():
    import gpu_matrix as M
    cases = [c for _, c in M.gqa_cases()]
    assert {c.numerics for c in cases} == set(NUMERICS)
    assert {c.dtype for c in cases} == {"bf16", "fp16", "fp32"}
    assert {c.numerics for c in cases if c.fp8 and c.kv_cache} == set(NUMERICS)
    assert any(not c.kv_cache for c in cases)
    assert {c.d % 16 for c in cases} >= {0, 8}
    assert any(c.d < 16 for c in cases)
    assert {c.q_norm for c in cases} >= {"bf16", "fp16", "fp32"}
    assert {c.k_norm for c in cases} >= {"bf16", "fp16", "fp32"}
    assert {c.cos_sin for c in cases if c.rdim} == {"fp32", "bf16", "fp16"}
