"""The GQA entry's plan cache (kvfuse.plans.gqa: call_signature, GQATemplate, prepare_call): a validated
signature of kvfuse.fused_qk_norm_rope_store_kv keeps its plan and its Triton launches.

- hits and misses are counted; new tensors and argument objects of a signature hit; a change of what
  validation reads (dtype, shape, strides, a scale's value, a pair, a PagedAppend) misses;
- a rejected call raises the same error with the cache warm and with it off (one rejected by
  validation is never stored); the aliasing rules and the rows of a q_out given are checked on every
  hit (same errors);
- the bytes written with the cache on equal those with it off, on the reference and interpreter
  backends, for the calls that hit; the kept launch passes what the uncached launch passes;
- the plan a template binds is the validated one; allocated outputs are new each call; the cache
  holds no tensor and is bypassed by torch.compile(fullgraph=True).
"""
from __future__ import annotations

import dataclasses
import gc
import inspect
import weakref

import pytest
import torch

import kvfuse
from kvfuse import backend as kv_backend
from kvfuse.kernels import config, qkv
from kvfuse.plans import cache as kv_plan
from kvfuse.plans import gqa
from kvfuse.plans.types import GQAPlan
from gqa_cases import GQACase, build, diff_report, run_gqa_case
from test_gqa_api import BAD, _kw
from test_plan_cache import _error, _fresh_cache, counts  # noqa: F401 (_fresh_cache: the autouse fixture)

call = kvfuse.fused_qk_norm_rope_store_kv
needs_interpreter = pytest.mark.skipif(not kv_backend.interpreter_enabled(), reason="needs TRITON_INTERPRET=1")
BACKENDS = [pytest.param("triton", marks=needs_interpreter), "reference"]
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


def templates():
    return [e for e in kv_plan.PLAN_CACHE._entries.values() if isinstance(e, gqa.GQATemplate)]


# =============================================================================== counting
def test_hits_and_misses_counted():
    kw, _ = _kw()
    call(**kw)
    assert counts() == (0, 1) and kv_plan.plan_cache_info().size == 1
    call(**kw)
    call(**_kw(seed=3)[0])            # new tensors and argument objects of the same signature
    assert counts() == (2, 1)
    call(**_kw(fp8=True)[0])          # another signature
    assert counts() == (2, 2) and len(templates()) == 2


def test_switched_off_every_call_is_validated():
    kv_plan.set_plan_cache(False)
    kw, _ = _kw()
    for _ in range(3):
        call(**kw)
    assert kv_plan.plan_cache_info()[:3] == (0, 0, 0)


def test_bypassed_by_compile_fullgraph():
    torch._dynamo.reset()

    def step(**kw):
        return kvfuse.fused_qk_norm_rope_store_kv(**kw).float() * 2

    case = GQACase(fp8=True, q_out_none=True, seed=45)
    kw1, storages1, _, _ = build(case)
    kw2, storages2, _, _ = build(case)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(**kw2)
    assert kv_plan.plan_cache_info()[:3] == (0, 0, 0), "nothing looked up or stored while compiling"
    kv_plan.set_plan_cache(False)
    want = step(**kw1)
    assert torch.equal(want, got)
    for a, b in zip(storages1, storages2):
        assert torch.equal(a, b)


# =============================================================================== rejected calls
@pytest.mark.parametrize("label,change,exc,match", BAD, ids=[b[0] for b in BAD])
def test_rejected_after_a_warm_cache(label, change, exc, match):
    kw, buffers = _kw()
    call(**kw)
    call(**kw)
    assert counts() == (1, 1)
    warm_key, _ = gqa.call_signature(**kw)
    kw, buffers = _kw(seed=1)
    before = [b.clone() for b in buffers]
    change(kw)
    try:
        same_signature = gqa.call_signature(**kw)[0] == warm_key
    except Exception:  # noqa: BLE001 - an argument that cannot be keyed: validated on every call
        same_signature = False
    try:
        gqa.validate(**kw)
        stored = True               # valid arguments whose tensors overlap: the signature is kept
    except (TypeError, ValueError):
        stored = False
    with_cache = _error(lambda: call(**kw))
    again = _error(lambda: call(**kw))
    hits = counts()[0]
    kv_plan.set_plan_cache(False)
    without_cache = _error(lambda: call(**kw))
    assert with_cache == again == without_cache and with_cache[0] is exc and match in with_cache[1]
    # only a validated signature is stored: a call rejected by validation never hits, one rejected by the
    # aliasing rules hits from its second call on (or its first, when it has the valid call's signature)
    assert hits == 1 + (2 if same_signature else 1 if stored else 0)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(buffers, before))


def _strided_like(t, base, offset):
    """A tensor of t's shape, dtype and strides over base's storage at ``offset`` elements of it."""
    return torch.as_strided(base, t.shape, t.stride(), base.storage_offset() + offset)


def _shifted_in_place(kw):
    """q and q_out of the same strides 8 elements apart in one buffer: the one pair whose spans meet."""
    q = kw["q"]
    buf = torch.zeros(q.numel() + 8, dtype=q.dtype)
    kw["q"], kw["q_out"] = buf[:q.numel()].view(q.shape), buf[8:].view(q.shape)


def _overlap_cases():
    """(case, change of its keyword arguments that keeps the signature, message): aliasing that
    depends only on data pointers, rejected on a hit."""
    return [
        ("q_out_over_k", GQACase(), lambda kw: kw.update(q_out=_strided_like(kw["q_out"], kw["k"], 0)),
         "q_out overlaps q in memory"),
        ("q_out_shifted_q", GQACase(inplace=True),
         lambda kw: kw.update(q_out=_strided_like(kw["q"], kw["q"], 1)),
         "q_out overlaps q in memory: an output must not overlap an input (q_out may be q itself"),
        ("q_out_shifted_q_alone", GQACase(inplace=True, packed=False), _shifted_in_place,
         "q_out overlaps q in memory: an output must not overlap an input (q_out may be q itself"),
        ("v_cache_is_k_cache", GQACase(cache="vllm"), lambda kw: kw.update(v_cache=kw["k_cache"]),
         "k_cache overlaps v_cache in memory"),
        ("k_cache_over_v", GQACase(cache="vllm"),
         lambda kw: kw.update(k_cache=_strided_like(kw["k_cache"], kw["v_cache"], 3)),
         "k_cache overlaps v_cache in memory"),
        ("k_out_over_q_weight", GQACase(kv_cache=False, q_norm="bf16"),
         lambda kw: kw.update(q_norm_args=kvfuse.NormArgs(_strided_like(kw["q_norm_args"].weight, kw["k_out"], 7),
                                                          kw["q_norm_args"].eps)),
         "k_out overlaps q_norm_args.weight in memory"),
        ("k_out_pair_shifted", GQACase(kv_cache=False, inplace=True, split=64),
         lambda kw: kw.update(k_out=(kw["k"][0], _strided_like(kw["k"][1], kw["k"][1], 1))),
         "k_out overlaps k_out[1] in memory"),
    ]


@pytest.mark.parametrize("name,case,change,match", _overlap_cases(), ids=[c[0] for c in _overlap_cases()])
def test_aliasing_checked_on_hits(name, case, change, match):
    kw, storages, inputs, _ = build(case)
    call(**kw)
    call(**kw)                                     # a passing call that hits (its verdicts remembered)
    kw, storages, inputs, _ = build(dataclasses.replace(case, seed=9))
    change(kw)
    key, _ = gqa.call_signature(**kw)
    assert key in kv_plan.PLAN_CACHE._entries, "the overlapping call has the valid call's signature"
    before = [t.clone() for t in storages + inputs]
    with_cache = _error(lambda: call(**kw))
    assert counts()[0] == 2, "a hit"
    kv_plan.set_plan_cache(False)
    assert _error(lambda: call(**kw)) == with_cache and with_cache[0] is ValueError and match in with_cache[1]
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(storages + inputs, before))


def test_v_without_caches_is_checked_whole():
    """Without caches v is not validated (nor read): a v of more rows than n that overlaps k_out past its
    n-th row is rejected on a hit as without the cache."""
    def args(seed, overlap):
        kw, _, _, _ = build(GQACase(kv_cache=False, seed=seed))
        buf = torch.zeros(20, 296, dtype=torch.bfloat16)
        kw["k_out"] = buf[10:15, :256].view(5, 2, 128)
        other = buf if overlap else torch.zeros(20, 296, dtype=torch.bfloat16)
        kw["v"] = other[3:11, :256].view(8, 2, 128)        # rows 3..10: row 10 is k_out's first
        return kw

    call(**args(0, False))
    call(**args(1, False))
    with_cache = _error(lambda: call(**args(2, True)))
    assert counts() == (2, 1)
    kv_plan.set_plan_cache(False)
    assert _error(lambda: call(**args(2, True))) == with_cache
    assert "k_out overlaps v in memory" in with_cache[1]


def _k_out_after_k(n, k_out_at, qbuf, buf):
    """A call without caches whose q, k and k_out lie at fixed places: k at element 0 of buf, k_out at
    ``k_out_at`` (rows of 256 elements): k_out meets k once n * 256 > k_out_at."""
    return dict(q=qbuf[:n * 512].view(n, 4, 128), k=buf[:n * 256].view(n, 2, 128), v=None, k_cache=None,
                v_cache=None, slot_mapping=None, k_out=buf[k_out_at:k_out_at + n * 256].view(n, 2, 128))


def test_a_passing_calls_addresses_do_not_pass_another_n_or_pointer():
    """The aliasing check remembers the last call that passed (its pointers, n): the same pointers at a
    larger n, or another pointer, are checked again, and a rejected call is rejected every time."""
    g = torch.Generator().manual_seed(5)
    qbuf = torch.randn(4 * 512, generator=g).to(torch.bfloat16)
    buf = torch.randn(4096, generator=g).to(torch.bfloat16)
    call(**_k_out_after_k(2, 512, qbuf, buf))
    call(**_k_out_after_k(2, 512, qbuf, buf))          # a hit that passes: remembered
    with_cache = _error(lambda: call(**_k_out_after_k(3, 512, qbuf, buf)))   # the same pointers, k_out meets k
    assert with_cache[0] is ValueError and "k_out overlaps k in memory" in with_cache[1]
    call(**_k_out_after_k(2, 512, qbuf, buf))          # the remembered call passes again
    moved = _error(lambda: call(**_k_out_after_k(2, 256, qbuf, buf)))   # another pointer: k_out meets k
    assert moved[0] is ValueError and "k_out overlaps k in memory" in moved[1]
    call(**_k_out_after_k(2, 512, qbuf, buf))
    assert _error(lambda: call(**_k_out_after_k(2, 256, qbuf, buf))) == moved   # rejected every time
    hits, misses = counts()
    assert misses == 1 and hits == 6, "every call after the first hit its signature"
    kv_plan.set_plan_cache(False)
    assert _error(lambda: call(**_k_out_after_k(3, 512, qbuf, buf))) == with_cache
    assert _error(lambda: call(**_k_out_after_k(2, 256, qbuf, buf))) == moved


def test_rows_of_q_out_checked_on_hits():
    """A q_out whose heads are 256 elements apart and rows 128: rows i and i + 1 interleave, rows i and
    i + 2 overlap. Valid at n = 2; the same signature at n = 3 raises the error of validation."""
    def args(n):
        kw, _, _, _ = build(GQACase(n=n, seed=n, block_size=8))
        kw["q_out"] = torch.full((16 * 1024,), float("nan"), dtype=torch.bfloat16).as_strided((n, 4, 128),
                                                                                                (128, 256, 1))
        return kw

    call(**args(2))
    call(**args(2))
    with_cache = _error(lambda: call(**args(3)))
    assert counts() == (2, 1)
    kv_plan.set_plan_cache(False)
    assert _error(lambda: call(**args(3))) == with_cache
    assert "q_out: its rows overlap in memory for n = 3" in with_cache[1]


@pytest.mark.parametrize("how", ["set_checks", "env"])
def test_data_checks_run_on_hits(how, monkeypatch):
    kw, _ = _kw(rotary_dim=0)
    call(**kw)
    if how == "set_checks":
        kvfuse.set_checks(True)
    else:
        monkeypatch.setattr(kv_backend, "_checks_override", None)
        monkeypatch.setenv("KVFUSE_CHECKS", "1")
    kw, buffers = _kw(seed=2, slots="contiguous", rotary_dim=0)
    kw["slot_mapping"] = torch.tensor([3, 1, 3, 0, 2])
    before = [b.clone() for b in buffers]
    with pytest.raises(ValueError, match="duplicate valid slots"):
        call(**kw)
    assert counts() == (1, 1)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(buffers, before))


# =============================================================================== what makes a miss
def _variants():
    """(name, case, change) of calls that each differ from GQACase()'s signature in one value
    validation reads."""
    def swap(**kw_changes):
        return lambda kw: kw.update({k: f(kw) for k, f in kw_changes.items()})

    return [
        ("q_dtype", GQACase(dtype="fp16"), None),
        ("q_strides", GQACase(packed=False), None),
        ("heads", GQACase(hq=2), None),
        ("layout", GQACase(layout="HND"), None),
        ("numerics", GQACase(numerics="fused"), None),
        ("fp8", GQACase(fp8=True), None),
        ("per_head_scale", GQACase(fp8=True, scale_per_head="k"), None),
        ("scale_numbers", GQACase(fp8=True, scale_numbers=True), None),
        ("scale_value", GQACase(fp8=True, scale_numbers=True, scales=(0.5, 0.11)), None),
        ("scale_int", GQACase(fp8=True), swap(k_scale=lambda kw: 1, v_scale=lambda kw: 1)),
        ("scale_float", GQACase(fp8=True), swap(k_scale=lambda kw: 1.0, v_scale=lambda kw: 1)),
        ("multiply", GQACase(fp8=True, scale_convention="multiply"), None),
        ("pair", GQACase(split=64), None),
        ("pair_list", GQACase(split=64), swap(q=lambda kw: list(kw["q"]))),
        ("pair_32", GQACase(split=32), None),
        ("paged_append", GQACase(paged_append=True), None),
        ("slots_int32", GQACase(idx32=True), None),
        ("q_out_none", GQACase(q_out_none=True), None),
        ("inplace", GQACase(inplace=True), None),
        ("no_cache", GQACase(kv_cache=False), None),
        ("k_cache_alone", GQACase(v_cache=False), None),
        ("eps", GQACase(), swap(q_norm_args=lambda kw: kvfuse.NormArgs(kw["q_norm_args"].weight, 1e-5))),
        ("no_norm", GQACase(q_norm=None), None),
        ("rotary", GQACase(rotary_dim=64), None),
        ("neox", GQACase(neox=False), None),
        ("conjugate", GQACase(conjugate=True), None),
        ("offset_given", GQACase(rope_offset=0), None),
        ("cos_sin_dtype", GQACase(cos_sin="bf16"), None),
        ("cache_blocks", GQACase(extra_blocks=2), None),
        ("block_size", GQACase(block_size=8), None),
        ("mrope_chunked", GQACase(mrope="chunked"), None),
        ("mrope_interleaved", GQACase(mrope="interleaved"), None),
        ("mrope_section", GQACase(mrope="chunked", mrope_section=(32, 16, 16)), None),
        ("v_norm_weightless", GQACase(v_norm="none"), None),
        ("v_norm_weight", GQACase(v_norm="bf16"), None),
    ]


def test_each_value_validation_reads_is_keyed():
    base, _ = gqa.call_signature(**build(GQACase())[0])
    keys = {base}
    for name, case, change in _variants():
        kw = build(case)[0]
        if change is not None:
            change(kw)
        key, _ = gqa.call_signature(**kw)
        assert key is not None and key not in keys, name
        keys.add(key)


def test_the_key_covers_every_argument_field():
    """call_signature keys the argument objects field by field, and _call_tensors takes every tensor field
    of the plan: a new field must join them."""
    keyed = {kvfuse.NormArgs: ("weight", "eps", "bias", "kind"),
             kvfuse.RopeArgs: ("positions", "cos_sin_cache", "rotary_dim", "is_neox", "offset", "conjugate",
                               "mrope_section", "mrope_interleaved"),
             kvfuse.PagedAppend: ("kv_indices", "kv_indptr", "batch_indices", "positions")}
    for cls, fields in keyed.items():
        assert tuple(f.name for f in dataclasses.fields(cls)) == fields, f"{cls.__name__}: update call_signature"
    tensor_fields = {f.name for f in dataclasses.fields(GQAPlan) if "Tensor" in str(f.type)}
    assert tensor_fields == set(gqa._FIELDS)
    params = list(inspect.signature(kvfuse.fused_qk_norm_rope_store_kv).parameters)
    assert list(inspect.signature(gqa.call_signature).parameters) == params
    assert list(inspect.signature(gqa.prepare_call).parameters) == params


def test_keyed_calls_take_the_tensors_of_call_tensors():
    """The key and the call's tensors are read in one pass (_key_and_tensors): the same tensors, by field, as
    _call_tensors takes from any validated call."""
    params = inspect.signature(gqa._call_tensors).parameters
    for name, case, change in _variants() + [("no_cache_pairs", GQACase(kv_cache=False, split=64), None),
                                             ("k_cache_pair", GQACase(v_cache=False, k_cache_split=True, split=64),
                                              None)]:
        kw = build(case)[0]
        if change is not None:
            change(kw)
        bound = inspect.signature(call).bind(**kw)
        bound.apply_defaults()
        _, tensors = gqa._key_and_tensors(*bound.args)
        want = gqa._call_tensors(**{p: bound.arguments[p] for p in params})
        assert len(tensors) == len(want) == len(gqa._FIELDS), name
        assert all(a is b for a, b in zip(tensors, want)), name


@pytest.mark.parametrize("at", [(), (2,), (0, 2), (3, 1, 0)])
def test_aliasing_picks_the_tensors_at_its_positions(at):
    """_picker gives the items at ``at`` as a tuple for any count (operator.itemgetter gives a lone one bare)."""
    items = ["a", "b", "c", "d"]
    assert gqa._picker(at)(items) == tuple(items[i] for i in at)


@pytest.mark.parametrize("value", [0.0, -0.0, -1.0, float("nan"), float("inf"), True])
def test_scale_numbers_keyed_without_their_sign(value):
    """A scale given as a number is keyed by its type and value only: every number the entry takes is
    finite and > 0, so 0.0 and -0.0 (equal keys) are both rejected, as is any number no signature holds:
    with the cache warm each raises the error of an uncached call and writes nothing."""
    kw, _ = _kw(fp8=True, scale_numbers=True)
    call(**kw)
    call(**kw)
    kw, buffers = _kw(fp8=True, scale_numbers=True, seed=1)
    kw["k_scale"] = value
    before = [b.clone() for b in buffers]
    with_cache = _error(lambda: call(**kw))
    assert _error(lambda: call(**kw)) == with_cache
    kv_plan.set_plan_cache(False)
    assert _error(lambda: call(**kw)) == with_cache and "k_scale" in with_cache[1]
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(buffers, before))


@pytest.mark.parametrize("eps", [0.0, -0.0, True, float("nan")])
def test_norm_eps_keyed_by_type_and_value(eps):
    """eps is keyed by its type and value: eps must be a finite number > 0, so True (equal to 1), 0.0 and
    -0.0 are rejected with the cache warm (warmed with eps 1 and 0.0's neighbours)."""
    for warm in (1, 1.0):
        kw, _ = _kw()
        kw["q_norm_args"] = kvfuse.NormArgs(kw["q_norm_args"].weight, warm)
        call(**kw)
    kw, buffers = _kw(seed=1)
    kw["q_norm_args"] = kvfuse.NormArgs(kw["q_norm_args"].weight, eps)
    before = [b.clone() for b in buffers]
    with_cache = _error(lambda: call(**kw))
    kv_plan.set_plan_cache(False)
    assert _error(lambda: call(**kw)) == with_cache and "q_norm_args.eps" in with_cache[1]
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(buffers, before))


def test_a_v_of_other_dims_without_caches_is_validated_every_call():
    """The key reads q, k, v, q_out and k_out as 3-d tensors; a v of other dims (read by nothing without
    caches, so valid) leaves its call unkeyed: validated on every call, with the bytes of an uncached call."""
    def run(enabled):
        kv_plan.set_plan_cache(enabled)
        kw, _, _, _ = build(GQACase(kv_cache=False, seed=3))
        kw["v"] = torch.zeros(kw["k"].shape[0], 256, dtype=kw["k"].dtype)
        return [call(**kw) for _ in range(2)]

    got = run(True)
    assert counts() == (0, 0), "not keyed"
    want = run(False)
    for (q1, k1), (q2, k2) in zip(got, want):
        assert torch.equal(q1, q2) and torch.equal(k1, k2)


def test_allocated_outputs_are_contiguous():
    """q_out allocated by a hit is a new contiguous tensor of q's shape (like an uncached call's), also for
    a q whose strides are permuted (dense, not contiguous)."""
    def run(enabled):
        kv_plan.set_plan_cache(enabled)
        kw, _ = _kw(q_out_none=True, seed=4)
        q = kw["q"]
        kw["q"] = q.transpose(0, 1).contiguous().transpose(0, 1)
        assert not kw["q"].is_contiguous() and torch.equal(kw["q"], q)
        return [call(**kw) for _ in range(2)]

    got = run(True)
    assert counts() == (1, 1)
    want = run(False)
    for a, b in zip(got, want):
        assert a.is_contiguous() and a.stride() == b.stride() and torch.equal(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,case,change", [v for v in _variants() if v[2] is None] + [
    ("vllm_fp8_per_head", GQACase(cache="vllm", fp8=True, scale_per_head="kv"), None),
    ("split_q_fp8_multiply_paged", GQACase(split=64, fp8=True, q_fp8=True, scale_numbers=True,
                                           scale_convention="multiply", paged_append=True), None),
    ("mla_caches", GQACase(v_cache=False, fp8=True, k_cache_split=True, split=64), None),
    ("no_cache_fp8_k_out", GQACase(kv_cache=False, k_out_fp8=True, q_fp8=True, split=64), None),
    ("no_cache_allocated", GQACase(kv_cache=False, q_out_none=True, split=64), None),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bytes_equal_with_the_cache_on_and_off(name, case, change, backend):
    kv_plan.set_plan_cache(False)
    want = run_gqa_case(dataclasses.replace(case, seed=2), backend)
    kv_plan.set_plan_cache(True)
    run_gqa_case(case, backend)
    got = run_gqa_case(dataclasses.replace(case, seed=2), backend)
    assert counts() == (1, 1)
    assert not diff_report(want, got), diff_report(want, got)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_numbers_by_value(backend):
    """Scales given as numbers are kernel arguments: a new value is a new signature, and the bytes are
    those of that value."""
    case = GQACase(fp8=True, q_fp8=True, scale_numbers=True, scale_convention="multiply")
    run_gqa_case(case, backend)
    for scales in ((0.5, 0.11), (0.5, 0.25)):
        other = dataclasses.replace(case, scales=scales, seed=4)
        got = run_gqa_case(other, backend)
        kv_plan.set_plan_cache(False)
        want = run_gqa_case(other, backend)
        kv_plan.set_plan_cache(True)
        assert not diff_report(want, got), (scales, diff_report(want, got))
    assert counts() == (0, 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_append_lengths_hit(backend):
    """A PagedAppend's kv_indptr and kv_indices lengths are not in the key (the kernel takes them as
    arguments): other lengths hit, with their own bytes."""
    case = GQACase(paged_append=True, fp8=True, slots="contiguous", extra_blocks=4)
    run_gqa_case(case, backend)

    def more_pages(kw):        # two requests more, each with pages of its own
        pa = kw["slot_mapping"]
        extra = torch.tensor([0, 1, 2], dtype=pa.kv_indices.dtype)
        return dataclasses.replace(pa, kv_indices=torch.cat([pa.kv_indices, extra]),
                                   kv_indptr=torch.cat([pa.kv_indptr, pa.kv_indptr[-1:] + torch.tensor([1, 3])]))

    def run(enabled):
        kv_plan.set_plan_cache(enabled)
        kw, storages, _, q_buf = build(dataclasses.replace(case, seed=5))
        kw["slot_mapping"] = more_pages(kw)
        with kvfuse.use_backend(backend):
            call(**kw)
        return [s.clone() for s in storages] + [q_buf.clone()]

    got = run(True)
    want = run(False)
    assert counts() == (1, 1)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want))
    if backend == "triton":
        assert sorted(key[2:] for key in templates()[0].launches) == [(6, 5), (8, 8)]


# =============================================================================== templates
@pytest.mark.parametrize("case", [GQACase(), GQACase(q_out_none=True, split=64, fp8=True),
                                  GQACase(kv_cache=False, q_out_none=True, split=64),
                                  GQACase(paged_append=True, scale_numbers=True, fp8=True),
                                  GQACase(v_cache=False, k_cache_split=True, split=64, q_norm=None, rotary_dim=0)],
                         ids=["default", "pairs_fp8_q", "no_cache", "paged_numbers", "k_cache_pair"])
def test_the_bound_plan_is_the_validated_plan(case):
    kw = build(case)[0]
    want = gqa.prepare(**kw)
    for _ in range(2):                         # a miss, then a hit
        template, tensors = gqa.prepare_call(**kw)
        got = template.bind(tensors)
        for f in dataclasses.fields(GQAPlan):
            a, b = getattr(got, f.name), getattr(want, f.name)
            if f.name in ("q_out", "q_out_tail", "k_out", "k_out_tail") and kw.get(f.name[:5]) is None:
                # allocated by each call: new tensors of the same shape and dtype
                assert (a is None) == (b is None) and (a is None or (a.shape == b.shape and a.dtype == b.dtype)), f.name
                assert a is None or a.data_ptr() != b.data_ptr()
            else:
                assert a is b or a == b, f.name
    assert counts() == (1, 1)


def test_allocated_outputs_are_new_each_call():
    kw, _ = _kw(q_out_none=True)
    first = call(**kw)
    second = call(**kw)
    assert counts() == (1, 1)
    assert first.data_ptr() != second.data_ptr() and first.shape == second.shape == (5, 4, 128)
    kw, _ = _kw(kv_cache=False, q_out_none=True)
    kw["k_out"] = None
    (q1, k1), (q2, k2) = call(**kw), call(**kw)
    assert len({t.data_ptr() for t in (q1, k1, q2, k2)}) == 4


def test_meta_tensors_and_zero_rows_hit():
    kw = build(GQACase())[0]
    meta = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    meta["q_norm_args"] = kvfuse.NormArgs(kw["q_norm_args"].weight.to("meta"), kw["q_norm_args"].eps)
    meta["k_norm_args"] = kvfuse.NormArgs(kw["k_norm_args"].weight.to("meta"), kw["k_norm_args"].eps)
    meta["rope_args"] = dataclasses.replace(kw["rope_args"], positions=kw["rope_args"].positions.to("meta"),
                                            cos_sin_cache=kw["rope_args"].cos_sin_cache.to("meta"))
    for _ in range(2):
        assert call(**meta).device.type == "meta"
    assert counts() == (1, 1)
    kw, buffers = _kw(n=0)
    before = [b.clone() for b in buffers]
    for _ in range(2):
        assert call(**kw).shape == (0, 4, 128)
    assert counts() == (2, 2)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(buffers, before))


def test_the_cache_holds_no_tensors():
    def run():
        kw, storages, inputs, q_buf = build(GQACase(fp8=True, paged_append=True))
        backend = "triton" if kv_backend.interpreter_enabled() else "reference"
        with kvfuse.use_backend(backend):
            call(**kw)
            call(**kw)
        names = inspect.signature(gqa._call_tensors).parameters
        tensors = [t for t in gqa._call_tensors(**{k: kw.get(k) for k in names}) if t is not None]
        return [weakref.ref(t) for t in tensors + storages + inputs + [q_buf]]

    refs = run()
    gc.collect()
    assert counts() == (1, 1)
    assert all(r() is None for r in refs)


# =============================================================================== launches
class _Recorder:
    """Stands in for qkv_kernel: records (grid, every parameter by name, launch options) of each launch."""

    def __init__(self, kernel):
        self.signature = inspect.signature(kernel.fn)
        self.launches = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            params = {k: v for k, v in kwargs.items() if k in self.signature.parameters}
            options = {k: v for k, v in kwargs.items() if k not in params}
            bound = self.signature.bind(*args, **params)
            bound.apply_defaults()
            self.launches.append((grid, dict(bound.arguments), options))
        return launch


def _described(value, names):
    if isinstance(value, torch.Tensor):
        return names.get(value.data_ptr(), value.data_ptr()), value.dtype, value.shape, value.stride()
    return type(value), value


@needs_interpreter
def test_kept_launch_passes_what_the_uncached_launch_passes(monkeypatch):
    rec = _Recorder(qkv.qkv_kernel)
    monkeypatch.setattr(qkv, "qkv_kernel", rec)
    cases = [v[1] for v in _variants() if v[2] is None] + [
        GQACase(split=64, fp8=True, q_fp8=True, scale_numbers=True, scale_convention="multiply", paged_append=True),
        GQACase(v_cache=False, fp8=True, k_cache_split=True, split=64),
        GQACase(kv_cache=False, k_out_fp8=True, q_fp8=True, split=64), GQACase(n=1), GQACase(n=9)]

    def launch(kw):
        result = call(**kw)
        new = [t for t in (result if isinstance(result, tuple) else (result,)) if isinstance(t, torch.Tensor)]
        grid, params, options = rec.launches[-1]
        names = {t.data_ptr(): f"result {i}" for i, t in enumerate(new)}
        return grid, {k: _described(v, names) for k, v in params.items()}, options

    signatures = set()
    with kvfuse.use_backend("triton"):
        for case in cases:
            kw = build(case)[0]
            signatures.add(gqa.call_signature(**kw)[0])
            kv_plan.set_plan_cache(False)
            uncached = launch(kw)
            kv_plan.set_plan_cache(True)
            assert launch(kw) == uncached, f"{case.describe()}: first call"
            assert launch(kw) == uncached, f"{case.describe()}: hit"
    assert counts() == (2 * len(cases) - len(signatures), len(signatures))


@needs_interpreter
def test_one_launch_per_batch_size_and_force_config(monkeypatch):
    rec = _Recorder(qkv.qkv_kernel)
    monkeypatch.setattr(qkv, "qkv_kernel", rec)
    with kvfuse.use_backend("triton"):
        for n in (3, 7, 3, 7, 12):               # one signature (16-token blocks: the caches' shapes are n's)
            call(**build(GQACase(n=n, seed=n, block_size=16))[0])
            grid, params, _ = rec.launches[-1]
            assert params["n"] == n and params["q_ptr"].shape[0] == n
        with config.force_config(block_m=1, num_warps=2):
            call(**build(GQACase(n=7, block_size=16))[0])
        grid, params, options = rec.launches[-1]
        assert params["BLOCK_M"] == 1 and options["num_warps"] == 2
        call(**build(GQACase(n=7, block_size=16))[0])
        assert rec.launches[-1][1]["BLOCK_M"] != 1
    assert sorted(templates()[0].launches) == [(3, False), (7, False), (12, False)]
    assert counts() == (6, 1)


@pytest.mark.parametrize("case", [GQACase(), GQACase(split=64, fp8=True, q_fp8=True, scale_numbers=True,
                                                    scale_convention="multiply", paged_append=True)],
                         ids=["default", "every_optional_argument"])
@pytest.mark.parametrize("pdl", [False, True])
def test_kept_launch_names_every_later_parameter(case, pdl):
    """launcher.Launch's direct path (compiled kernels, Triton 3.6) passes the positional arguments and
    then the keyword arguments of the kernel's later parameters, in order: the kept launch gives every
    parameter, each once."""
    template, tensors = gqa.prepare_call(**build(case)[0])
    launch = qkv.template_launch(template.bind(tensors), template.tensor_index, len(tensors), pdl)
    args = launch.pick(template.kernel_tensors(tensors) + launch.constants)
    names = qkv.qkv_kernel.arg_names
    assert all(name in launch.options for name in names[len(args):])
    assert not set(names[:len(args)]) & set(launch.options)
    assert args[names.index("PDL")] is pdl and launch.options.get("launch_pdl", False) is pdl
