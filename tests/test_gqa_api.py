"""kvfuse.fused_qk_norm_rope_store_kv (kvfuse/gqa.py) and its custom op (kvfuse/ops.py), SPEC §3 / §9:
validation errors name the argument and write nothing; the aliasing rules (q_out may be q; vLLM's
kv_cache[:, 0] / [:, 1] views are accepted; any other overlap is rejected); the data checks; q_out
allocation; meta tensors and n = 0; torch.library.opcheck; torch.compile(fullgraph=True)."""
import dataclasses
import re

import pytest
import torch

import kvfuse
from kvfuse import dispatch
from kvfuse.plans import gqa, opargs
from gqa_cases import GQACase, build, diff_report, run_gqa_case
from helpers import cos_sin_cache

OP = torch.ops.kvfuse.fused_qk_norm_rope_store_kv.default
# torch's own opcheck/compile internals use torch.jit.script_method (deprecated in torch 2.13)
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def _kw(**case):
    kw, storages, inputs, q_buf = build(GQACase(**case))
    return kw, storages + inputs + ([q_buf] if q_buf is not None else [])


def _snapshot(buffers):
    return [b.clone() for b in buffers]


def _unchanged(buffers, before):
    return all(torch.equal(a.view(torch.uint8) if a.dtype != torch.uint8 else a,
                           b.view(torch.uint8) if b.dtype != torch.uint8 else b) for a, b in zip(buffers, before))


# --------------------------------------------------------------------------- validation
def _bad_calls():
    """(label, change to the keyword arguments, exception, message fragment)."""
    n, d = 5, 128

    def rope(**kw):
        base = dict(positions=torch.arange(n), cos_sin_cache=cos_sin_cache(8, d), rotary_dim=d, is_neox=True)
        base.update(kw)
        return kvfuse.RopeArgs(**base)

    def cache_like(kw, name, **changes):
        c = kw[name]
        return torch.zeros(changes.get("shape", c.shape), dtype=changes.get("dtype", c.dtype))

    return [
        ("q not a tensor", lambda kw: kw.update(q=[1]), TypeError, "q must be a torch.Tensor"),
        ("q fp64", lambda kw: kw.update(q=kw["q"].double()), TypeError,
         "q: expected dtype torch.bfloat16 or torch.float16 or torch.float32, got torch.float64"),
        ("k fp16 with bf16 q", lambda kw: kw.update(k=kw["k"].half()), TypeError,
         "k: expected dtype torch.bfloat16, got torch.float16"),
        ("v fp32 with bf16 q", lambda kw: kw.update(v=kw["v"].float()), TypeError,
         "v: expected dtype torch.bfloat16, got torch.float32"),
        ("q 2-d", lambda kw: kw.update(q=kw["q"][:, 0]), ValueError, "q: expected shape [n, num_heads, head_dim]"),
        ("q head_dim 12", lambda kw: kw.update(q=kw["q"][..., :12]), ValueError,
         "q: head_dim must be a positive multiple of 8, got 12"),
        ("v head_dim 20", lambda kw: kw.update(v=torch.zeros(n, 2, 20, dtype=torch.bfloat16)), ValueError,
         "v: head_dim must be a positive multiple of 8, got 20"),
        ("numerics", lambda kw: kw.update(numerics="fp32"), ValueError,
         "numerics must be one of ('staged', 'fused', 'fused_fp32_cast'), got 'fp32'"),
        ("numerics type", lambda kw: kw.update(numerics=None), ValueError, "numerics must be one of"),
        ("v_cache None alone", lambda kw: kw.update(v_cache=None), ValueError,
         "v: given without v_cache; pass v_cache too, or v=None for a K cache alone"),
        ("k_cache None alone", lambda kw: kw.update(k_cache=None), ValueError,
         "k_cache: None with v_cache given; pass both caches, k_cache alone"),
        ("slots without caches", lambda kw: kw.update(k_cache=None, v_cache=None), ValueError,
         "slot_mapping must be None without caches"),
        ("scale without caches", lambda kw: kw.update(k_cache=None, v_cache=None, slot_mapping=None,
                                                      k_scale=torch.ones(1)), ValueError,
         "k_scale must be None without a float8_e4m3fn k_out"),
        ("k_out with caches", lambda kw: kw.update(k_out=kw["k"]), ValueError, "k_out must be None when k goes"),
        ("k_out shape", lambda kw: kw.update(k_cache=None, v_cache=None, slot_mapping=None,
                                             k_out=torch.zeros(n, 2, 64, dtype=torch.bfloat16)), ValueError,
         "k_out: expected shape (5, 2, 128)"),
        ("k_out dtype", lambda kw: kw.update(k_cache=None, v_cache=None, slot_mapping=None,
                                             k_out=torch.zeros(n, 2, d)), TypeError, "k_out: expected dtype"),
        ("k_out overlaps q", lambda kw: kw.update(k_cache=None, v_cache=None, slot_mapping=None,
                                                  k_out=torch.as_strided(kw["q"], (n, 2, d), kw["k"].stride())),
         ValueError, "k_out overlaps q in memory"),
        ("k_out shifted k", lambda kw: kw.update(k_cache=None, v_cache=None, slot_mapping=None,
                                                 k_out=torch.as_strided(kw["k"], (n, 2, d), kw["k"].stride(),
                                                                        kw["k"].storage_offset() + 1)),
         ValueError, "k_out overlaps k in memory: an output must not overlap an input (k_out may be k itself"),
        ("fp16 cache for bf16", lambda kw: kw.update(k_cache=cache_like(kw, "k_cache", dtype=torch.float16)),
         TypeError, "k_cache: expected dtype torch.bfloat16 or torch.float8_e4m3fn, got torch.float16"),
        ("q strided last dim", lambda kw: kw.update(q=torch.zeros(n, 4, 2 * d, dtype=torch.bfloat16)[..., ::2]), ValueError,
         "q: expected stride(-1) == 1"),
        ("k tokens", lambda kw: kw.update(k=kw["k"][:3]), ValueError, "k: expected 5 tokens"),
        ("k head_dim", lambda kw: kw.update(k=torch.zeros(n, 2, 64, dtype=torch.bfloat16)), ValueError,
         "k: expected head_dim 128"),
        ("v heads", lambda kw: kw.update(v=torch.zeros(n, 1, d, dtype=torch.bfloat16)), ValueError,
         "v: expected 2 heads"),
        ("gqa ratio", lambda kw: kw.update(q=torch.zeros(n, 3, d, dtype=torch.bfloat16)), ValueError,
         "multiple of k's num_heads"),
        ("layout", lambda kw: kw.update(layout="NDH"), ValueError, "layout must be one of"),
        ("cache dtype", lambda kw: kw.update(k_cache=cache_like(kw, "k_cache", dtype=torch.float16)), TypeError,
         "k_cache: expected dtype torch.bfloat16 or torch.float8_e4m3fn"),
        ("cache uint8", lambda kw: kw.update(v_cache=cache_like(kw, "v_cache", dtype=torch.uint8)), TypeError,
         "v_cache: expected dtype"),
        ("cache heads", lambda kw: kw.update(k_cache=cache_like(kw, "k_cache", shape=(3, 4, 1, d))), ValueError,
         "k_cache: expected NHD shape"),
        ("cache 3-d", lambda kw: kw.update(k_cache=kw["k_cache"][0]), ValueError, "k_cache: expected NHD shape"),
        ("v_cache blocks", lambda kw: kw.update(v_cache=kw["v_cache"][:1]), ValueError, "v_cache: expected NHD shape"),
        ("v_cache dtype", lambda kw: kw.update(v_cache=cache_like(kw, "v_cache", dtype=torch.float8_e4m3fn)),
         TypeError, "v_cache: expected dtype torch.bfloat16 (k_cache's)"),
        ("cache strided last", lambda kw: kw.update(k_cache=torch.zeros(3, 4, 2, 2 * d, dtype=torch.bfloat16)[..., ::2]),
         ValueError, "k_cache: expected stride(-1) == 1"),
        ("cache expanded", lambda kw: kw.update(k_cache=torch.zeros(1, 4, 2, d, dtype=torch.bfloat16).expand(3, 4, 2, d)),
         ValueError, "k_cache: its blocks overlap"),
        ("cache device", lambda kw: kw.update(k_cache=kw["k_cache"].to("meta")), ValueError, "k_cache: expected device"),
        ("slots dtype", lambda kw: kw.update(slot_mapping=kw["slot_mapping"].float()), TypeError, "slot_mapping"),
        ("slots shape", lambda kw: kw.update(slot_mapping=kw["slot_mapping"][:2]), ValueError,
         "slot_mapping: expected shape (5,)"),
        ("scale for bf16", lambda kw: kw.update(k_scale=torch.ones(1)), ValueError, "k_scale must be None"),
        ("norm type", lambda kw: kw.update(q_norm_args=(1,)), TypeError, "q_norm_args must be a NormArgs"),
        ("norm kind", lambda kw: kw.update(k_norm_args=kvfuse.NormArgs(torch.ones(d), kind="layer")), ValueError,
         "k_norm_args.kind must be 'rms'"),
        ("norm weight shape", lambda kw: kw.update(q_norm_args=kvfuse.NormArgs(torch.ones(64))), ValueError,
         "q_norm_args.weight: expected shape (128,)"),
        ("norm eps", lambda kw: kw.update(q_norm_args=kvfuse.NormArgs(torch.ones(d), eps=0.0)), ValueError,
         "q_norm_args.eps must be"),
        ("norm weight fp64", lambda kw: kw.update(k_norm_args=kvfuse.NormArgs(torch.ones(d, dtype=torch.float64))),
         TypeError, "k_norm_args.weight: expected dtype torch.bfloat16 or torch.float16 or torch.float32, got "
                    "torch.float64"),
        ("rope type", lambda kw: kw.update(rope_args=3), TypeError, "rope_args must be a RopeArgs"),
        ("rotary odd", lambda kw: kw.update(rope_args=rope(rotary_dim=7, cos_sin_cache=cos_sin_cache(8, 6))),
         ValueError, "rope_args.rotary_dim must be an even int"),
        ("rope offset", lambda kw: kw.update(rope_args=rope(rotary_dim=64, offset=96,
                                                            cos_sin_cache=cos_sin_cache(8, 64))),
         ValueError, "rope_args.offset"),
        ("rope neox", lambda kw: kw.update(rope_args=rope(is_neox=1)), TypeError, "rope_args.is_neox must be a bool"),
        ("positions", lambda kw: kw.update(rope_args=rope(positions=torch.arange(4))), ValueError,
         "rope_args.positions: expected shape (5,)"),
        ("cos_sin width", lambda kw: kw.update(rope_args=rope(cos_sin_cache=cos_sin_cache(8, 64))), ValueError,
         "rope_args.cos_sin_cache: expected shape"),
        ("cos_sin fp64", lambda kw: kw.update(rope_args=rope(cos_sin_cache=cos_sin_cache(8, d, torch.float64))),
         TypeError, "rope_args.cos_sin_cache: expected dtype torch.float32 or torch.bfloat16 or torch.float16, "
                    "got torch.float64"),
        ("q_out shape", lambda kw: kw.update(q_out=torch.zeros(n, 4, 64, dtype=torch.bfloat16)), ValueError,
         "q_out: expected shape (5, 4, 128)"),
        ("q_out dtype", lambda kw: kw.update(q_out=torch.zeros(n, 4, d)), TypeError, "q_out: expected dtype"),
        ("q_out rows overlap", lambda kw: kw.update(q_out=torch.zeros(1, 4, d, dtype=torch.bfloat16).expand(n, 4, d)),
         ValueError, "q_out: its rows overlap"),
        ("q_out overlaps k", lambda kw: kw.update(q_out=torch.as_strided(kw["k"], (n, 4, d), kw["q"].stride())),
         ValueError, "q_out overlaps k in memory"),
        ("q_out shifted q", lambda kw: kw.update(q_out=torch.as_strided(kw["q"], (n, 4, d), kw["q"].stride(),
                                                                        kw["q"].storage_offset() + 1)),
         ValueError, "q_out overlaps q in memory"),
        ("k_cache is v_cache", lambda kw: kw.update(v_cache=kw["k_cache"]), ValueError,
         "k_cache overlaps v_cache"),
        ("cache over q", lambda kw: kw.update(k_cache=torch.as_strided(kw["q"], (3, 4, 2, d), (8 * d, 2 * d, d, 1))),
         ValueError, "k_cache overlaps q in memory"),
    ]


BAD = _bad_calls()


@pytest.mark.parametrize("label,change,exc,match", BAD, ids=[b[0] for b in BAD])
def test_bad_argument_raises_before_writing(label, change, exc, match):
    kw, buffers = _kw()
    before = _snapshot(buffers)
    change(kw)
    with kvfuse.use_backend("reference"), pytest.raises(exc, match=re.escape(match)):
        kvfuse.fused_qk_norm_rope_store_kv(**kw)
    assert _unchanged(buffers, before)


def test_fp8_cache_needs_both_scales():
    kw, buffers = _kw(fp8=True)
    before = _snapshot(buffers)
    for name, bad, exc, match in (("k_scale", None, ValueError, "k_scale: a float8_e4m3fn cache needs"),
                                  ("v_scale", torch.ones(3), ValueError, r"v_scale: expected one element \(shape \(\) or \(1,\)\) or one per kv head \(shape \(2,\)\)"),
                                  ("v_scale", torch.ones(1, dtype=torch.float64), TypeError, "v_scale: expected dtype"),
                                  ("k_scale", "0.5", TypeError, "k_scale must be a torch.Tensor"),
                                  ("k_scale", 0.5, TypeError, "k_scale: a number with v_scale a tensor"),
                                  ("k_scale", float("inf"), ValueError, "k_scale must be a finite number > 0")):
        with pytest.raises(exc, match=match):
            numbers = {"v_scale": 1.0} if name == "k_scale" and isinstance(bad, float) and bad > 1 else {}
            kvfuse.fused_qk_norm_rope_store_kv(**{**kw, **numbers, name: bad})
    assert _unchanged(buffers, before)


# --------------------------------------------------------------------------- aliasing that is allowed
def test_inplace_equals_separate_q_out():
    case = dict(fp8=True, neox=False, seed=40)
    a = run_gqa_case(GQACase(**case, inplace=True), "reference")
    b = run_gqa_case(GQACase(**case), "reference")
    assert a["cache_storage0"].equal(b["cache_storage0"]) and a["cache_storage1"].equal(b["cache_storage1"])
    kw, _, _, q_buf = build(GQACase(**case))
    q_in_place = a["input0"].view(torch.bfloat16).view(5, -1)[:, :4 * 128]
    assert torch.equal(q_in_place.contiguous().view(torch.uint8).flatten(),
                       b["q_out"].view(torch.bfloat16).view(5, -1)[:, :4 * 128].contiguous().view(torch.uint8).flatten())


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_zero_q_heads_write_the_same_k_and_v(backend, fp8):
    """q with zero heads: K and V alone, the records equal to a call with q heads (an engine's cache
    write without attention's q, e.g. vLLM's reshape_and_cache_flash); q_out is returned empty."""
    if backend == "triton" and not kvfuse.backend.interpreter_enabled():
        pytest.skip("the triton backend on CPU tensors needs TRITON_INTERPRET=1")
    case = GQACase(fp8=fp8, q_norm=None, seed=45)
    full = run_gqa_case(case, backend)

    def k_and_v_only(**kw):
        kw = dict(kw, q=kw["q"][:, :0], q_out=None)
        return kvfuse.fused_qk_norm_rope_store_kv(**kw)

    alone = run_gqa_case(dataclasses.replace(case, q_out_none=True), backend, fn=k_and_v_only)
    assert alone["q_out"].numel() == 0
    for name in ("cache_storage0", "cache_storage1"):
        assert torch.equal(full[name], alone[name]), name


def test_vllm_kv_views_and_allocated_q_out():
    """kv_cache[:, 0] / [:, 1] share one allocation without sharing an element: accepted; q_out=None
    returns a new contiguous tensor equal to a given q_out."""
    a = run_gqa_case(GQACase(cache="vllm", q_out_none=True, seed=41), "reference")
    b = run_gqa_case(GQACase(cache="vllm", seed=41), "reference")
    assert torch.equal(a["cache_storage0"], b["cache_storage0"])
    q = b["q_out"].view(torch.bfloat16).view(5, -1)[:, :4 * 128].contiguous()
    assert torch.equal(a["q_out"], q.view(torch.uint8).flatten())


def test_reference_writes_exactly_the_valid_records():
    """The cache bytes the reference changes are exactly the records of the valid slots (the kernel
    tests compare against this reference, so this pins what both write)."""
    case = GQACase(fp8=True, layout="HND", seed=42)
    kw, storages, _, _ = build(case)
    before = [s.clone() for s in storages]
    kvfuse.fused_qk_norm_rope_store_kv(**kw)
    slots, bs = kw["slot_mapping"].tolist(), case.block_size
    for cache, storage, old in zip((kw["k_cache"], kw["v_cache"]), storages, before):
        expect = torch.zeros_like(storage, dtype=torch.bool)
        cap = cache.shape[0] * bs
        for s in slots:
            if 0 <= s < cap:
                for h in range(case.hkv):
                    rec = cache[s // bs, h, s % bs]
                    start = rec.storage_offset() - cache.storage_offset() + 48   # GUARD
                    expect[start:start + rec.numel()] = True
        changed = storage.view(torch.uint8) != old.view(torch.uint8)
        assert not (changed & ~expect).any()
        assert changed.sum() > 0.9 * expect.sum()      # a few codes may equal the random bytes they replace


# --------------------------------------------------------------------------- data checks, meta, n = 0
def test_data_checks(monkeypatch):
    monkeypatch.setattr(kvfuse.backend, "_checks_override", None)
    kvfuse.set_checks(True)
    kw, buffers = _kw(fp8=True, slots="contiguous")
    kw["rope_args"] = kvfuse.RopeArgs(torch.arange(5), kw["rope_args"].cos_sin_cache, 128, True)  # all in range
    before = _snapshot(buffers)
    dup = kw["slot_mapping"].clone()
    dup[1] = dup[0]
    with pytest.raises(ValueError, match="duplicate"):
        kvfuse.fused_qk_norm_rope_store_kv(**{**kw, "slot_mapping": dup})
    with pytest.raises(ValueError, match="k_scale must hold finite numbers > 0"):
        kvfuse.fused_qk_norm_rope_store_kv(**{**kw, "k_scale": torch.tensor([0.0])})
    bad_pos = kvfuse.RopeArgs(torch.full((5,), 99), kw["rope_args"].cos_sin_cache, 128, True)
    with pytest.raises(ValueError, match="positions must lie in"):
        kvfuse.fused_qk_norm_rope_store_kv(**{**kw, "rope_args": bad_pos})
    assert _unchanged(buffers, before)
    kvfuse.fused_qk_norm_rope_store_kv(**kw)
    assert not _unchanged(buffers, before)


def test_meta_and_empty_batches():
    kw, _ = _kw()
    meta = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    meta["q_norm_args"] = kvfuse.NormArgs(kw["q_norm_args"].weight.to("meta"))
    meta["k_norm_args"] = meta["rope_args"] = None
    out = kvfuse.fused_qk_norm_rope_store_kv(**meta)
    assert out is meta["q_out"]
    kw, buffers = _kw(n=0)
    before = _snapshot(buffers)
    with kvfuse.use_backend("triton" if kvfuse.backend.interpreter_enabled() else "reference"):
        assert kvfuse.fused_qk_norm_rope_store_kv(**kw).shape == (0, 4, 128)
    assert _unchanged(buffers, before)


def test_inference_mode_caches():
    """Caches made under torch.inference_mode() (engines allocate there) are written outside it."""
    with torch.inference_mode():
        kw, buffers = _kw(seed=43)
    before = _snapshot(buffers)
    kvfuse.fused_qk_norm_rope_store_kv(**kw)
    assert not _unchanged(buffers, before)


# --------------------------------------------------------------------------- custom op
def _op_args(**case):
    kw, _ = _kw(**case)
    return opargs.flatten(gqa.prepare(**kw))


@pytest.mark.parametrize("case", [dict(), dict(layout="HND", q_norm=None, rotary_dim=0),
                                  dict(kv_cache=False, numerics="fused", dtype="fp16"),
                                  dict(numerics="fused_fp32_cast", dtype="fp32", d=120, rotary_dim=64)],
                         ids=["nhd_bf16", "hnd_plain", "no_cache_fused_fp16", "fp32_cast_fp32_d120"])
def test_opcheck(case):
    with kvfuse.use_backend("reference"):
        torch.library.opcheck(OP, _op_args(**case))


def test_opcheck_fp8():
    """float8 arguments: opcheck's SchemaCheckMode step compares with allclose (not implemented for float8 on
    the CPU), so it is replaced by a byte check that only the mutable arguments change."""
    args = _op_args(fp8=True)
    with kvfuse.use_backend("reference"):
        torch.library.opcheck(OP, args, test_utils=("test_autograd_registration", "test_faketensor",
                                                    "test_aot_dispatch_dynamic"))
        mutable = {i for i, a in enumerate(OP._schema.arguments) if a.alias_info is not None and a.alias_info.is_write}
        before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        OP(*args)
    for i, (a, b) in enumerate(zip(args, before)):
        if isinstance(a, torch.Tensor) and i not in mutable:
            assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a, b.view(torch.uint8)
                               if b.element_size() == 1 else b), OP._schema.arguments[i].name
    assert {OP._schema.arguments[i].name for i in mutable} == {"k_cache", "v_cache", "q_out", "k_out", "q_out_tail",
                                                               "k_out_tail", "k_cache_tail", "k_scale_cache",
                                                               "v_scale_cache"}


@pytest.mark.skipif(not kvfuse.backend.interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (CPU tensors)")
def test_op_on_triton_backend_equals_direct():
    case = GQACase(fp8=True, layout="HND", seed=44)
    direct = run_gqa_case(case, "triton")
    def via_op_fn(**kw):
        with dispatch.via_ops():
            return kvfuse.fused_qk_norm_rope_store_kv(**kw)
    via_op = run_gqa_case(case, "triton", fn=via_op_fn)
    assert not diff_report(direct, via_op)


@pytest.mark.parametrize("case", [GQACase(fp8=True, inplace=False, q_out_none=True, seed=45),
                                  GQACase(mrope="interleaved", v_norm="bf16", fp8=True, q_out_none=True, seed=21)],
                         ids=["plain", "mrope_v_norm"])
def test_compile_fullgraph_public_function(case):
    """torch.compile(fullgraph=True) of a step calling the public function: it routes through the op, which
    carries the plan's fields (mRoPE's section and the V-norm too)."""
    torch._dynamo.reset()

    def step(**kw):
        q_out = kvfuse.fused_qk_norm_rope_store_kv(**kw)
        return q_out.float() * 2

    kw1, storages1, _, _ = build(case)
    kw2, storages2, _, _ = build(case)
    with kvfuse.use_backend("reference"):
        want = step(**kw1)
        got = torch.compile(step, fullgraph=True, backend="aot_eager")(**kw2)
    assert torch.equal(want, got)
    for a, b in zip(storages1, storages2):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_load_reads_per_head_scales_back(layout):
    """load_gqa_kv_cache with one scale per kv head: head h's records read back as bf16(f(code) * scale[h])."""
    case = GQACase(hq=4, hkv=2, fp8=True, layout=layout, scale_per_head="kv", seed=46)
    kw, _, _, _ = build(case)
    with kvfuse.use_backend("reference"):
        kvfuse.fused_qk_norm_rope_store_kv(**kw)
    k, v = kvfuse.load_gqa_kv_cache(kw["k_cache"], kw["v_cache"], kw["slot_mapping"], layout, kw["k_scale"],
                                    kw["v_scale"])
    slots = kw["slot_mapping"].long()
    cache = kw["k_cache"] if layout == "NHD" else kw["k_cache"].transpose(1, 2)
    bs = cache.shape[1]
    for i, s in enumerate(slots.tolist()):
        if 0 <= s < cache.shape[0] * bs:
            codes = cache[s // bs, s % bs].float()                       # [Hkv, D]
            want = (codes * kw["k_scale"][:, None]).to(torch.bfloat16)
            assert torch.equal(k[i].view(torch.int16), want.view(torch.int16)), f"token {i}"
        else:
            assert not k[i].any() and not v[i].any()
