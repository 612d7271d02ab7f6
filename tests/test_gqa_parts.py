"""fused_qk_norm_rope_store_kv with heads held as two tensors, fp8 q / k outputs, the multiply
convention, scales as numbers and a K cache alone (SPEC §3), on both backends: each checked against
an independent statement (the same call on whole tensors, torch's own e4m3 conversion), not against
kvfuse's kernel."""
import pytest
import torch

import kvfuse
from kvfuse.reference.numerics import F32
from gqa_cases import GQACase, build, run_gqa_case

BACKENDS = ["reference"] + (["triton"] if kvfuse.backend.interpreter_enabled() else [])


def _e4m3(x32: torch.Tensor) -> torch.Tensor:
    """torch's own e4m3 conversion (round to nearest even) after the clamp of SPEC §3, as bytes."""
    return x32.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_cache", [True, False])
def test_pairs_equal_whole_tensors(backend, kv_cache):
    """q, k, q_out, k_out (and k_cache) as pairs write the bytes the whole-tensor call writes."""
    base = dict(rotary_dim=64, rope_offset=16, fp8=kv_cache, q_fp8=True, k_out_fp8=not kv_cache, kv_cache=kv_cache,
                seed=31)
    whole = run_gqa_case(GQACase(**base), backend)
    parts = run_gqa_case(GQACase(**base, split=48), backend)
    assert whole.keys() == parts.keys()
    for name in whole:
        assert torch.equal(whole[name], parts[name]), name


def _same_call_data(dst: dict, src: dict) -> None:
    """dst takes src's slots, norms and RoPE (cases with other caches draw other random numbers)."""
    for name in ("slot_mapping", "q_norm_args", "k_norm_args", "rope_args"):
        dst[name] = src[name]


def _records(cache, slots):
    """The records of the valid slots of an NHD cache, as bytes."""
    bs = cache.shape[1]
    slots = slots.long()
    ok = (slots >= 0) & (slots < cache.shape[0] * bs)
    return cache[slots[ok] // bs, slots[ok] % bs].view(torch.uint8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_split_k_cache_holds_the_whole_records_columns(backend):
    split = 64
    kw, _, _, _ = build(GQACase(split=split, k_cache_split=True, v_cache=False, fp8=True, seed=32))
    kw_whole, _, _, _ = build(GQACase(fp8=True, v_cache=False, seed=32))
    _same_call_data(kw_whole, kw)
    with kvfuse.use_backend(backend):
        kvfuse.fused_qk_norm_rope_store_kv(**kw)
        kvfuse.fused_qk_norm_rope_store_kv(**kw_whole)
    slots = kw["slot_mapping"]
    got = torch.cat([_records(part, slots) for part in kw["k_cache"]], dim=-1)
    assert torch.equal(got, _records(kw_whole["k_cache"], slots))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("convention", ["divide", "multiply"])
def test_casts_are_torchs_e4m3_of_the_product_or_quotient(backend, convention):
    """No norm and no RoPE: q_out, the K and V records are e4m3(x * s) or e4m3(x / s) of the inputs."""
    case = GQACase(q_norm=None, k_norm=None, rotary_dim=0, fp8=True, q_fp8=True, scale_convention=convention,
                   scale_numbers=True, slots="contiguous", n=6, extra_blocks=0, block_size=2, seed=33)
    kw, _, _, _ = build(case)
    q, k, v = (kw[name].float() for name in ("q", "k", "v"))
    with kvfuse.use_backend(backend):
        kvfuse.fused_qk_norm_rope_store_kv(**kw)

    def cast(x, s):
        s32 = torch.tensor(s, dtype=F32)
        return _e4m3(x * s32 if convention == "multiply" else x / s32)

    assert torch.equal(kw["q_out"].view(torch.uint8), cast(q, kw["q_scale"]))
    n, hkv = k.shape[0], k.shape[1]
    for cache, x, s in ((kw["k_cache"], k, kw["k_scale"]), (kw["v_cache"], v, kw["v_scale"])):
        records = cache.reshape(-1, *cache.shape[2:])[:n] if case.layout == "NHD" else None
        assert torch.equal(records.view(torch.uint8), cast(x, s)), hkv


@pytest.mark.parametrize("backend", BACKENDS)
def test_scales_as_numbers_equal_scales_as_tensors(backend):
    base = dict(fp8=True, q_fp8=True, scale_convention="multiply", seed=34)
    a = run_gqa_case(GQACase(**base), backend)
    b = run_gqa_case(GQACase(**base, scale_numbers=True), backend)
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_k_cache_alone_writes_what_the_kv_call_writes_to_k(backend):
    a, _, _, _ = build(GQACase(fp8=True, seed=35))
    b, _, _, _ = build(GQACase(fp8=True, v_cache=False, seed=35))
    _same_call_data(b, a)
    v_before = a["v_cache"].view(torch.uint8).clone()
    with kvfuse.use_backend(backend):
        kvfuse.fused_qk_norm_rope_store_kv(**a)
        kvfuse.fused_qk_norm_rope_store_kv(**b)
    assert torch.equal(_records(a["k_cache"], a["slot_mapping"]), _records(b["k_cache"], a["slot_mapping"]))
    assert not torch.equal(a["v_cache"].view(torch.uint8), v_before)      # the control: V was written there


def _kw(**case):
    kw, storages, _, q_buf = build(GQACase(**case))
    return kw


@pytest.mark.parametrize("label,case,change,exc,match", [
    ("mixed scales", dict(fp8=True), dict(k_scale=0.5), TypeError, "k_scale: a number with v_scale a tensor"),
    ("q_scale without fp8 q_out", dict(), dict(q_scale=1.0), ValueError,
     "q_scale must be None without a float8_e4m3fn q_out"),
    ("fp8 q_out without q_scale", dict(q_fp8=True), dict(q_scale=None), ValueError,
     "q_scale: a float8_e4m3fn q_out needs its fp32 scale"),
    ("per-head q_scale", dict(q_fp8=True), dict(q_scale=torch.ones(4)), ValueError,
     r"q_scale: expected one element \(shape \(\) or \(1,\)\), got shape \(4,\)"),
    ("pair widths differ", dict(split=64), dict(k=lambda kw: (kw["k"][0][..., :32], kw["k"][1])), ValueError,
     "k: expected head_dim 128"),
    ("pair split differs", dict(split=64), dict(q_out=lambda kw: (torch.empty(5, 4, 32, dtype=torch.bfloat16),
                                                                  torch.empty(5, 4, 96, dtype=torch.bfloat16))),
     ValueError, r"q_out\[0\]: expected 64 columns"),
    ("k_cache pair dtypes", dict(split=64, k_cache_split=True), dict(
        k_cache=lambda kw: (kw["k_cache"][0], kw["k_cache"][1].view(torch.float16))), TypeError,
     r"k_cache\[1\]: expected dtype torch.bfloat16"),
    ("v without v_cache", dict(), dict(v_cache=None), ValueError, "v: given without v_cache"),
    ("v_scale without v_cache", dict(fp8=True, v_cache=False), dict(v_scale=torch.ones(1)), ValueError,
     "v_scale must be None without v_cache"),
    ("scale_convention", dict(), dict(scale_convention="mul"), ValueError,
     r"scale_convention must be one of \('divide', 'multiply'\), got 'mul'"),
    ("fp8 q_out in a pair's tail", dict(split=64, q_fp8=True),
     dict(q_out=lambda kw: (kw["q_out"][0], kw["q_out"][1].view(torch.uint8))), TypeError,
     r"q_out\[1\]: expected dtype torch.float8_e4m3fn"),
])
def test_bad_parts_raise_before_writing(label, case, change, exc, match):
    kw = _kw(seed=36, **case)
    for name, value in change.items():
        kw[name] = value(kw) if callable(value) else value
    watched = [t for t in (kw.get("k_cache"), kw.get("v_cache"), kw.get("q_out")) for t in
               (t if isinstance(t, tuple) else (t,)) if isinstance(t, torch.Tensor)]
    before = [t.view(torch.uint8).clone() if t.element_size() == 1 else t.clone() for t in watched]
    with pytest.raises(exc, match=match):
        kvfuse.fused_qk_norm_rope_store_kv(**kw)
    for t, b in zip(watched, before):
        now = t.view(torch.uint8) if t.element_size() == 1 else t
        assert torch.equal(now, b) or (now.isnan() == b.isnan()).all()


def test_gpu_matrix_reaches_every_launch_option():
    """Every optional argument qkv.launch_args can pass (each a compile-time branch of the kernel) is
    passed by at least one case of the GPU matrix's GQA section, and each value of each."""
    import gpu_matrix as M
    from kvfuse.kernels import qkv
    from kvfuse.plans import gqa as gqa_plans
    seen = {}
    for _, case in M.gqa_cases():
        kw, _, _, _ = build(case)
        _, _, options = qkv.launch_args(gqa_plans.prepare(**kw))
        for name, value in options.items():
            seen.setdefault(name, set()).add(value if isinstance(value, (bool, int, float, str)) else "tensor")
    for name in ("SPLIT", "Q_FP8", "SCALE_MUL", "SCALE_BY_VALUE", "HAS_V", "ACT", "NUMERICS", "KV_CACHE",
                 "K_SCALE_PER_HEAD", "V_SCALE_PER_HEAD", "HALVES", "qs_ptr", "q2_ptr", "k2_ptr", "qo2_ptr", "kd2_ptr",
                 "pa_b"):
        assert name in seen, name
    assert {True, False} <= seen["HALVES"] and {True, False} <= seen["K_SCALE_PER_HEAD"]
    assert {32, 64} <= seen["SPLIT"]


# --------------------------------------------------------------------------- FlashInfer's append addressing
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", [dict(fp8=True), dict(layout="HND", idx32=True, v_cache=False, n=9),
                                  dict(split=64, k_cache_split=True, q_fp8=True, fp8=True, scale_numbers=True)])
def test_paged_append_writes_what_its_slots_write(backend, case):
    """A PagedAppend whose tokens land where a slot mapping puts them (its invalid slots as each kind of
    out-of-range index) writes the same bytes as the slot mapping."""
    base = dict(seed=37, **case)
    a = run_gqa_case(GQACase(**base), backend)
    b = run_gqa_case(GQACase(**base, paged_append=True), backend)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_paged_append_slots_follow_flashinfer():
    """kvfuse.reference's reading of FlashInfer's addressing, against its formula written out per token."""
    from kvfuse.reference.cache import paged_append_slots
    kv_indices = torch.tensor([7, 2, 9, 4, 0])
    kv_indptr = torch.tensor([0, 3, 5])
    batch = torch.tensor([0, 0, 0, 1, 1, -1, 2, 0, 1])
    pos = torch.tensor([0, 5, 11, 3, 4, 0, 0, -1, 8])
    got = paged_append_slots(batch, pos, kv_indptr, kv_indices, 4).tolist()
    want = []
    for b, p in zip(batch.tolist(), pos.tolist()):
        if b < 0 or b >= 2 or p < 0 or kv_indptr[b] + p // 4 >= len(kv_indices):
            want.append(-1)
        else:
            want.append(int(kv_indices[kv_indptr[b] + p // 4]) * 4 + p % 4)
    assert got == want == [28, 9, 39, 19, 0, -1, -1, -1, -1]


@pytest.mark.parametrize("label,change,exc,match", [
    ("2-d positions", dict(positions=torch.zeros(5, 1, dtype=torch.int64)), ValueError,
     r"slot_mapping.positions: expected shape \(5,\)"),
    ("float indptr", dict(kv_indptr=torch.zeros(3)), TypeError, "slot_mapping.kv_indptr: expected dtype"),
    ("empty indptr", dict(kv_indptr=torch.zeros(0, dtype=torch.int64)), ValueError,
     "slot_mapping.kv_indptr: expected num_requests"),
    ("short batch", dict(batch_indices=torch.zeros(4, dtype=torch.int64)), ValueError,
     r"slot_mapping.batch_indices: expected shape \(5,\)"),
    ("strided positions", dict(positions=torch.zeros(10, dtype=torch.int64)[::2]), ValueError,
     r"slot_mapping.positions: expected a contiguous vector \(stride 1\), got stride 2"),
    ("strided kv_indices", dict(kv_indices=torch.zeros(8, dtype=torch.int32)[::4]), ValueError,
     r"slot_mapping.kv_indices: expected a contiguous vector \(stride 1\), got stride 4"),
])
def test_paged_append_errors(label, change, exc, match):
    import dataclasses
    kw = _kw(seed=38, paged_append=True)
    kw["slot_mapping"] = dataclasses.replace(kw["slot_mapping"], **change)
    with pytest.raises(exc, match=match):
        kvfuse.fused_qk_norm_rope_store_kv(**kw)


def test_paged_append_duplicate_slots_fail_the_data_checks(monkeypatch):
    """With the data checks on, two tokens that FlashInfer's addressing sends to one valid slot are a
    ValueError before anything is written (the slots are computed first); out-of-range ones are not."""
    import dataclasses
    kw = _kw(seed=39, paged_append=True, rotary_dim=0)
    pa = kw["slot_mapping"]
    same = dataclasses.replace(pa, batch_indices=torch.ones_like(pa.batch_indices),
                               positions=torch.zeros_like(pa.positions))          # page kv_indices[1], offset 0
    past = dataclasses.replace(same, kv_indices=torch.full_like(pa.kv_indices, 1 << 20))   # pages past the cache
    before = kw["k_cache"].clone()
    monkeypatch.setattr(kvfuse.backend, "_checks_override", None)      # restored after the test
    kvfuse.set_checks(True)
    with pytest.raises(ValueError, match="slot_mapping holds duplicate valid slots"):
        kvfuse.fused_qk_norm_rope_store_kv(**{**kw, "slot_mapping": same})
    assert torch.equal(kw["k_cache"].view(torch.uint8), before.view(torch.uint8))
    kvfuse.fused_qk_norm_rope_store_kv(**{**kw, "slot_mapping": past})            # writes nothing, no error
    assert torch.equal(kw["k_cache"].view(torch.uint8), before.view(torch.uint8))
