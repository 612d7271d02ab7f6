"""Reliability of outputs (SPEC §9 as amended): inference-mode and requires-grad outputs, and aliasing.

- Caches and outputs created under ``torch.inference_mode()`` (engines allocate there) are accepted
  outside it, on every backend: the write succeeds and equals the same call on ordinary tensors
  (the reference backend used to write the data bytes, then raise before the scales).
- An ``out`` that is a leaf with ``requires_grad=True`` is written like any buffer (no autograd
  record), on every backend.
- An output that overlaps itself (expanded, stride 0, rows or heads closer than their length), two
  outputs that overlap, or an output that overlaps an input (x, weight, positions, cos_sin,
  slot_mapping; store_kv_cache's data, sf, tail) is a ValueError naming the arguments, raised
  before any byte is written; the check depends on data pointers, so it runs on every call (a
  signature already in the plan cache is still checked). ``out`` may be x itself (in place): the
  cache bytes and the copy equal those of a call with a separate ``out``. Tensors whose spans meet
  but whose elements do not (q and sf side by side in one buffer's rows, an ``out`` in the padding
  between cache blocks) are accepted.

Rejected calls leave every byte of the buffers involved unchanged (whole storages, poisoned or
random before the call, guards included).
"""
from __future__ import annotations

import pytest
import torch

import kvfuse
from kvfuse import CastArgs, ContiguousOutArgs, HadamardArgs, KVCacheOutArgs, NormArgs, RopeArgs, formats
from kvfuse import reference as R
from helpers import cos_sin_cache, guarded_cache, poison_like, random_bf16
from test_reliability_memory import as_bytes, assert_same, assert_storage, oracle, storage_of

BACKENDS = ("reference", "triton")
fused = kvfuse.fused_norm_rope_hadamard_cast_store_kvcache
BF16 = torch.bfloat16


def call(backend, **kw):
    with kvfuse.use_backend(backend):
        return fused(**kw)


def stages(D, n, seed=0, norm=True):
    g = torch.Generator().manual_seed(seed)
    kw = dict(rope_args=RopeArgs(torch.arange(n) * 2, cos_sin_cache(16, 32), 32, True))
    if norm:
        kw["norm_args"] = NormArgs((torch.rand(D, generator=g) + 0.5).to(BF16))
    if D & (D - 1) == 0:
        kw["hadamard_args"] = HadamardArgs(D ** -0.5)
    return kw


def arena(nbytes, seed=0):
    """A uint8 buffer of random bytes to carve tensors from (see carve)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def carve(buf, byte_offset, shape, dtype, strides=None):
    """A tensor of ``dtype`` viewing ``buf`` (uint8) at ``byte_offset`` (dense strides unless given)."""
    es = torch.empty((), dtype=dtype).element_size()
    assert byte_offset % es == 0 and buf.numel() % es == 0
    if strides is None:
        strides, acc = [], 1
        for s in reversed(shape):
            strides.insert(0, acc)
            acc *= s
    return torch.as_strided(buf.view(dtype), tuple(shape), tuple(strides), byte_offset // es)


# =========================================================================== inference mode, requires_grad
INFERENCE_FORMATS = (formats.INDEX_MXFP8, formats.FLASHMLA_V32, formats.MAIN_FP4)


def _all_writes(backend, fmt, make):
    """Every kind of write with outputs made by ``make`` (a context: inference mode or not); returns the
    bytes written: cache storages, the stage copy, (q, sf), a Tensor destination, the loaded rows."""
    n, D = 5, fmt.head_dim
    x = random_bf16((n, D), seed=1)
    kw = stages(D, n)
    slots = torch.tensor([6, -1, 0, 3, 7])
    qd = fmt.quant_dim
    q, sf = R.quantize(x[:, :qd], fmt.cast_fmt, fmt.elements_per_sf, fmt.sf_format)
    tail = x[:, qd:] if fmt.bf16_tail else None
    with make():
        cache, storage = guarded_cache(fmt, 2, 4, seed=2)
        cache2, storage2 = guarded_cache(fmt, 2, 4, seed=3)
        out = poison_like(x)
        dest = poison_like(x)
        q_out = torch.full((n, 128), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)
        sf_out = torch.full((n, 4), 0xEE, dtype=torch.uint8)
    with kvfuse.use_backend(backend):
        fused(x, cast_args=CastArgs.from_cache_format(fmt),
              out_args=KVCacheOutArgs(cache, slots, out=out, out_stage="cast_back", layout=fmt), **kw)
        fused(x[:, :128], cast_args=CastArgs("e4m3", 32, True, "ue8m0"), out_args=ContiguousOutArgs(q_out, sf_out))
        fused(x, out_args=dest, **kw)
        kvfuse.store_kv_cache(q, sf, cache2, slots, fmt, tail)
        loaded = kvfuse.load_paged_kv_cache(cache, slots, fmt)
    return {"cache storage": storage, "store cache storage": storage2, "out": as_bytes(out), "q": as_bytes(q_out),
            "sf": sf_out, "Tensor destination": as_bytes(dest), "load": as_bytes(loaded)}


class _plain:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", INFERENCE_FORMATS, ids=lambda f: f.name)
def test_inference_mode_outputs_are_written_outside_inference_mode(backend, fmt):
    """Regression: with a cache made under torch.inference_mode(), the reference backend wrote the data
    bytes and then raised RuntimeError before the scales (store_kv_cache too)."""
    want = _all_writes(backend, fmt, _plain)
    got = _all_writes(backend, fmt, torch.inference_mode)
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_inside_inference_mode(backend):
    """Ordinary and inference tensors, called inside inference mode (what engines do)."""
    fmt = formats.INDEX_MXFP8
    want = _all_writes(backend, fmt, _plain)
    with torch.inference_mode():
        got = _all_writes(backend, fmt, _plain)
        got2 = _all_writes(backend, fmt, torch.inference_mode)
    for name in want:
        assert torch.equal(got[name], want[name]) and torch.equal(got2[name], want[name]), name


@pytest.mark.parametrize("backend", BACKENDS)
def test_requires_grad_out_is_written_like_any_buffer(backend):
    """An out that is a leaf with requires_grad=True (and an x that requires grad) is accepted and written
    (the write is not recorded by autograd: kvfuse is an inference op). Regression: the reference backend
    wrote the cache, then raised RuntimeError on the out copy."""
    fmt = formats.INDEX_MXFP8
    n, D = 4, 128
    x = random_bf16((n, D), seed=4)
    kw = stages(D, n)
    slots = torch.tensor([1, 5, -1, 0])
    cache, storage = guarded_cache(fmt, 4, 8, seed=5)
    out = poison_like(x)
    args = dict(x=x, cast_args=CastArgs.from_cache_format(fmt),
                out_args=KVCacheOutArgs(cache, slots, out=out, out_stage="transform", layout=fmt), **kw)
    exp = oracle(**args)
    out.requires_grad_(True)
    xg = x.clone().requires_grad_(True)
    res = call(backend, **dict(args, x=xg))
    assert res is out and out.requires_grad and out.is_leaf and out.grad_fn is None
    assert_storage(storage, exp["storage"], cache, fmt)
    assert_same(out.detach(), exp["out"], "out")
    dest = poison_like(x).requires_grad_(True)
    res = call(backend, x=xg, out_args=dest, **kw)
    assert res is dest and dest.is_leaf
    assert_same(dest.detach(), oracle(x=x, **kw)["result"], "Tensor destination")
    back = poison_like(x).requires_grad_(True)
    call(backend, x=x, cast_args=CastArgs("e4m3", 32, True, "ue8m0", cast_back=True),
         out_args=ContiguousOutArgs(back), **kw)
    assert_same(back.detach(), oracle(x=x, cast_args=CastArgs("e4m3", 32, True, "ue8m0", cast_back=True),
                                      **kw)["result"], "cast_back destination")


# =========================================================================== aliasing: rejected
def _rejects(backend, kw, names, buffers):
    """The call raises ValueError naming every one of ``names``, and no byte of ``buffers`` changed."""
    before = [as_bytes(b).clone() for b in buffers]
    with pytest.raises(ValueError) as info:
        call(backend, **kw)
    msg = str(info.value)
    for name in names:
        assert name in msg, f"{name!r} not named: {msg}"
    for b, was in zip(buffers, before):
        assert torch.equal(as_bytes(b), was), "a rejected call wrote something"
    return msg


def _cache_call(fmt=formats.INDEX_MXFP8, n=4, seed=0, **cache_kw):
    x = random_bf16((n, fmt.head_dim), seed=seed)
    cache, storage = guarded_cache(fmt, 2, 4, seed=seed + 1, **cache_kw)
    kw = dict(x=x, cast_args=CastArgs.from_cache_format(fmt), **stages(fmt.head_dim, n, seed))
    return kw, cache, storage


@pytest.mark.parametrize("backend", BACKENDS)
def test_self_overlapping_outputs_are_rejected_by_name(backend):
    """Regression: the triton backend accepted an expanded (stride 0) out and its rows raced; the reference
    wrote the cache, then raised RuntimeError on the copy."""
    n, D = 4, 128
    kw, cache, storage = _cache_call(n=n)
    x = kw["x"]
    row = poison_like(x[:1])
    kw_nocache = {k: v for k, v in kw.items() if k != "cast_args"}
    # a Tensor destination, expanded
    _rejects(backend, dict(kw_nocache, out_args=row.expand(n, D)), ["out_args"], [row])
    # the stage copy of a cache write, expanded: the cache is not written either
    _rejects(backend, dict(kw, out_args=KVCacheOutArgs(cache, torch.arange(n), out=row.expand(n, D),
                                                       out_stage="transform", layout=formats.INDEX_MXFP8)),
             ["out_args.out"], [row, storage])
    # q / sf expanded
    q1 = torch.full((1, D), 0x7F, dtype=torch.uint8)
    sf1 = torch.full((1, 4), 0xEE, dtype=torch.uint8)
    q_ok = torch.full((n, D), 0x7F, dtype=torch.uint8)
    sf_ok = torch.full((n, 4), 0xEE, dtype=torch.uint8)
    cast = CastArgs("e4m3", 32, True, "ue8m0")
    _rejects(backend, dict(kw_nocache, cast_args=cast,
                           out_args=ContiguousOutArgs(q1.expand(n, D).view(torch.float8_e4m3fn), sf_ok)),
             ["out_args.out"], [q1, sf_ok])
    _rejects(backend, dict(kw_nocache, cast_args=cast,
                           out_args=ContiguousOutArgs(q_ok.view(torch.float8_e4m3fn), sf1.expand(n, 4))),
             ["out_args.sf"], [q_ok, sf1])
    # one scale per row (D / g == 1): the last dim's stride is free, the rows are not
    sf_col = torch.full((1, 1), 1.5, dtype=torch.float32)
    _rejects(backend, dict(kw_nocache, cast_args=CastArgs("e4m3", 128, False, "fp32"),
                           out_args=ContiguousOutArgs(q_ok.view(torch.float8_e4m3fn), sf_col.expand(n, 1))),
             ["out_args.sf"], [q_ok, sf_col])
    # heads that overlap: [n, 2, D] with a head stride of D / 2
    x3 = random_bf16((n, 2, D), seed=3)
    buf = poison_like(torch.empty(n * 2 * D, dtype=BF16))
    _rejects(backend, dict(x=x3, out_args=buf.as_strided((n, 2, D), (2 * D, D // 2, 1))), ["out_args"], [buf])


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_that_overlap_for_larger_n_are_rejected_on_every_call(backend):
    """Rows D/2 apart do not overlap for n = 1 (accepted, and the signature enters the plan cache, whose key
    leaves n out); for n = 3 they do: rejected, although the signature is cached."""
    D = 128
    buf = poison_like(torch.empty(4 * D, dtype=BF16))
    x1 = random_bf16((1, D), seed=1)
    out1 = buf.as_strided((1, D), (D // 2, 1))
    y = call(backend, x=x1, out_args=out1, **stages(D, 1))
    assert y is out1 and torch.equal(as_bytes(out1), as_bytes(oracle(x=x1, **stages(D, 1))["result"]))
    x3 = random_bf16((3, D), seed=2)
    _rejects(backend, dict(x=x3, out_args=buf.as_strided((3, D), (D // 2, 1)), **stages(D, 3)),
             ["out_args", "n = 3"], [buf])


def _overlap_cases(n=4):
    """(name, kwargs, names the error must give, buffers that must stay unchanged) of calls whose outputs
    overlap an input or another output. Tensors are carved from one random buffer."""
    D, fmt = 128, formats.INDEX_MXFP8
    cases = []
    # out overlaps x: rows shifted by one
    buf = arena((n + 1) * D * 2, seed=1)
    x = carve(buf, 0, (n, D), BF16)
    x.copy_(random_bf16((n, D), seed=1))
    cases.append(("out overlaps x (shifted rows)", dict(x=x, out_args=carve(buf, 2 * D, (n, D), BF16)),
                  ["out_args", "x"], [buf]))
    # out starts at x but with other strides (not the same view): not in place
    buf = arena(n * (D + 16) * 2, seed=2)
    x = carve(buf, 0, (n, D), BF16, (D + 16, 1))
    x.copy_(random_bf16((n, D), seed=2))
    cases.append(("out at x's address, other strides", dict(x=x, out_args=carve(buf, 0, (n, D), BF16)),
                  ["out_args", "x"], [buf]))
    # out overlaps the norm weight, the positions, the cos/sin table
    for what, name in (("weight", "norm_args.weight"), ("positions", "rope_args.positions"),
                       ("cos_sin", "rope_args.cos_sin_cache")):
        buf = arena(n * D * 2 + 4096, seed=3)
        out = carve(buf, 0, (n, D), BF16)
        kw = stages(D, n)
        if what == "weight":
            w = carve(buf, 2 * D, (D,), BF16)
            w.copy_(kw["norm_args"].weight)
            kw["norm_args"] = NormArgs(w)
        elif what == "positions":
            p = carve(buf, 8 * 16, (n,), torch.int64)
            p.copy_(kw["rope_args"].positions)
            kw["rope_args"] = RopeArgs(p, kw["rope_args"].cos_sin_cache, 32, True)
        else:
            cs = carve(buf, 4 * 32, (16, 32), torch.float32)
            cs.copy_(cos_sin_cache(16, 32))
            kw["rope_args"] = RopeArgs(kw["rope_args"].positions, cs, 32, True)
        cases.append((f"out overlaps {what}", dict(x=random_bf16((n, D), seed=4), out_args=out, **kw),
                      ["out_args", name], [buf]))
    # the cache overlaps x, slot_mapping; the stage copy overlaps the cache
    cache, storage = guarded_cache(fmt, 4, 8, seed=5)
    rec = cache.storage_offset()
    x = carve(storage, rec + 64, (n, D), BF16)
    x.copy_(random_bf16((n, D), seed=5))
    cases.append(("cache overlaps x", dict(x=x, cast_args=CastArgs.from_cache_format(fmt),
                                           out_args=KVCacheOutArgs(cache, torch.arange(n), layout=fmt)),
                  ["out_args.kv_cache", "x"], [storage]))
    cache, storage = guarded_cache(fmt, 4, 8, seed=6)
    slots = carve(storage, cache.storage_offset() + 8 * 40, (n,), torch.int64)
    slots.copy_(torch.arange(n))
    cases.append(("cache overlaps slot_mapping",
                  dict(x=random_bf16((n, D), seed=6), cast_args=CastArgs.from_cache_format(fmt),
                       out_args=KVCacheOutArgs(cache, slots, layout=fmt)),
                  ["out_args.kv_cache", "out_args.slot_mapping"], [storage]))
    cache, storage = guarded_cache(fmt, 4, 8, seed=7)
    out = carve(storage, cache.storage_offset() + 2 * 300, (n, D), BF16)
    cases.append(("stage copy overlaps the cache",
                  dict(x=random_bf16((n, D), seed=7), cast_args=CastArgs.from_cache_format(fmt),
                       out_args=KVCacheOutArgs(cache, torch.arange(n), out=out, out_stage="transform", layout=fmt)),
                  ["out_args.out", "out_args.kv_cache"], [storage]))
    # q and sf overlap
    buf = arena(n * D + 64, seed=8)
    q = carve(buf, 0, (n, D), torch.float8_e4m3fn)
    sf = carve(buf, D, (n, 4), torch.uint8)
    cases.append(("q overlaps sf", dict(x=random_bf16((n, D), seed=8), cast_args=CastArgs("e4m3", 32, True, "ue8m0"),
                                        out_args=ContiguousOutArgs(q, sf)),
                  ["out_args.out", "out_args.sf"], [buf]))
    return cases


CASE_NAMES = [c[0] for c in _overlap_cases()]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASE_NAMES)
def test_overlapping_outputs_are_rejected_by_name(backend, case):
    name, kw, names, buffers = next(c for c in _overlap_cases() if c[0] == case)
    _rejects(backend, kw, names, buffers)


@pytest.mark.parametrize("backend", BACKENDS)
def test_overlap_is_checked_on_every_call_of_a_cached_signature(backend):
    """The plan cache keys shapes and strides, not addresses: a signature first called with separate
    buffers is still rejected when a later call's out overlaps its x."""
    n, D = 4, 128
    kw = stages(D, n)
    buf = arena((2 * n + 1) * D * 2, seed=9)
    x = carve(buf, 0, (n, D), BF16)
    x.copy_(random_bf16((n, D), seed=9))
    out = carve(buf, (n + 1) * D * 2, (n, D), BF16)          # after x, a row apart: disjoint
    assert call(backend, x=x, out_args=out, **kw) is out
    assert_same(out, oracle(x=x, **kw)["result"], "disjoint out")
    _rejects(backend, dict(x=x, out_args=carve(buf, D, (n, D), BF16), **kw), ["out_args", "x"], [buf])


@pytest.mark.parametrize("backend", BACKENDS)
def test_store_kv_cache_rejects_payloads_inside_the_cache(backend):
    fmt = formats.FLASHMLA_V32
    n = 3
    y = random_bf16((n, 1, fmt.head_dim), seed=1)
    q, sf = R.quantize(y[..., :512], fmt.cast_fmt, fmt.elements_per_sf, fmt.sf_format)
    tail = y[..., 512:]
    for what in ("data", "sf", "tail", "slot_mapping"):
        cache, storage = guarded_cache(fmt, 2, 4, seed=2)
        args = dict(data=q, sf=sf, tail=tail, slot_mapping=torch.tensor([0, 5, 2]))
        t = args[what]
        inside = carve(storage, cache.storage_offset() + 656 * 2, tuple(t.shape), t.dtype)
        inside.copy_(t)
        args[what] = inside
        before = storage.clone()
        with pytest.raises(ValueError, match=f"kv_cache overlaps {what}|{what} .*kv_cache"), \
                kvfuse.use_backend(backend):
            kvfuse.store_kv_cache(args["data"], args["sf"], cache, args["slot_mapping"], fmt, args["tail"])
        assert torch.equal(storage, before), what


# =========================================================================== aliasing: accepted
def _inplace_cases(n=4):
    """(name, kwargs with out being x, the same call with a separate out) of in-place calls."""
    cases = []
    for D, H in ((128, None), (64, 3)):
        shape = (n, D) if H is None else (n, H, D)
        x = random_bf16(shape, seed=D)
        kw = stages(D, n)
        cases.append((f"Tensor destination {shape}", dict(x=x, out_args=x, **kw), dict(x=x.clone(), **kw)))
        back = CastArgs("e4m3", 32, True, "ue8m0", cast_back=True)
        x = random_bf16(shape, seed=D + 1)
        cases.append((f"cast_back into x {shape}", dict(x=x, cast_args=back, out_args=ContiguousOutArgs(x), **kw),
                      dict(x=x.clone(), cast_args=back, **kw)))
    for fmt, stage, had in ((formats.INDEX_MXFP8, "transform", True), (formats.MAIN_FP8, "norm", True),
                            (formats.INDEX_MXFP8, "norm", False), (formats.FLASHMLA_V32, "cast_back", True)):
        D = fmt.head_dim
        x = random_bf16((n, D), seed=D + 2)
        kw = stages(D, n)
        if not had:                       # RoPE on its own sub-tile (the kernel's ROPE_SUBTILE)
            kw.pop("hadamard_args")
        for who, seed in (("in place", 3), ("separate", 3)):
            cache, storage = guarded_cache(fmt, 2, 4, seed=seed)
            out = x if who == "in place" else poison_like(x)
            args = dict(x=x if who == "in place" else x.clone(), cast_args=CastArgs.from_cache_format(fmt),
                        out_args=KVCacheOutArgs(cache, torch.tensor([5, 0, -1, 2]), out=out, out_stage=stage,
                                                layout=fmt), **kw)
            if who == "in place":
                inplace = args
            else:
                separate = args
        cases.append((f"{fmt.name} stage {stage}{'' if had else ' no Hadamard'} into x", inplace, separate))
    return cases


INPLACE_NAMES = [c[0] for c in _inplace_cases()]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", INPLACE_NAMES)
def test_out_may_be_x_itself(backend, case):
    """In place: the result and the cache bytes equal those of the same call with a separate out."""
    _, inplace, separate = next(c for c in _inplace_cases() if c[0] == case)
    want = call(backend, **separate)
    got = call(backend, **inplace)
    x = inplace["x"]
    assert got is x
    assert_same(got, want, "in-place result")
    oa_in, oa_sep = inplace.get("out_args"), separate.get("out_args")
    if isinstance(oa_in, KVCacheOutArgs):
        assert torch.equal(storage_of(oa_in.kv_cache), storage_of(oa_sep.kv_cache)), "cache storage"


@pytest.mark.parametrize("backend", BACKENDS)
def test_spans_that_meet_without_shared_elements_are_accepted(backend):
    """The exact test behind the span test: q and sf side by side in each row of one buffer; a stage copy
    in the padding between cache blocks; inputs sharing one buffer (positions == slot_mapping)."""
    n, D = 4, 128
    x = random_bf16((n, D), seed=11)
    kw = stages(D, n)
    cast = CastArgs("e4m3", 32, True, "ue8m0")
    buf = arena(n * (D + 4), seed=12)
    q = carve(buf, 0, (n, D), torch.float8_e4m3fn, (D + 4, 1))
    sf = carve(buf, D, (n, 4), torch.uint8, (D + 4, 1))
    rq, rsf = call(backend, x=x, cast_args=cast, out_args=ContiguousOutArgs(q, sf), **kw)
    want_q, want_sf = oracle(x=x, cast_args=cast, **kw)["result"]
    assert rq is q and rsf is sf
    assert_same(q, want_q, "q")
    assert_same(sf, want_sf, "sf")
    # a stage copy living in the padding between the cache's blocks
    fmt = formats.INDEX_MXFP8
    pad = n * D * 2 + 128
    cache, storage = guarded_cache(fmt, 2, 4, block_padding=pad, seed=13)
    block_end = cache.storage_offset() + 4 * fmt.bytes_per_token
    out = carve(storage, -(-block_end // 64) * 64, (n, D), BF16)
    out.fill_(float("nan"))
    slots = torch.tensor([0, 7, 3, 4])
    args = dict(x=x, cast_args=CastArgs.from_cache_format(fmt),
                out_args=KVCacheOutArgs(cache, slots, out=out, out_stage="transform", layout=fmt), **kw)
    exp = oracle(**args)                    # its storage already holds nothing of out: patch out's bytes in
    exp_storage = exp["storage"]
    o0 = out.storage_offset() * 2
    exp_storage[o0:o0 + n * D * 2] = as_bytes(exp["out"])
    assert call(backend, **args) is out
    assert torch.equal(storage, exp_storage)
    # inputs may share memory: positions and slot_mapping are one tensor, x and the weight one buffer
    cache, storage = guarded_cache(fmt, 2, 4, seed=14)
    idx = torch.tensor([3, 0, 6, 1])
    both = arena((n + 1) * D * 2, seed=15)
    x2 = carve(both, 0, (n, D), BF16)
    x2.copy_(x)
    w = carve(both, n * D * 2, (D,), BF16)
    w.copy_(kw["norm_args"].weight)
    args = dict(x=x2, norm_args=NormArgs(w), rope_args=RopeArgs(idx, cos_sin_cache(16, 32), 32, True),
                hadamard_args=kw["hadamard_args"], cast_args=CastArgs.from_cache_format(fmt),
                out_args=KVCacheOutArgs(cache, idx, layout=fmt))
    exp = oracle(**args)
    call(backend, **args)
    assert torch.equal(storage, exp["storage"])


# =========================================================================== the exact tests themselves
def _addresses(t):
    """Every byte address of t's elements (brute force)."""
    es = t.element_size()
    idx = torch.zeros(1, dtype=torch.int64)
    for size, st in zip(t.shape, t.stride()):
        idx = (idx[:, None] + torch.arange(size) * st).reshape(-1)
    return set((t.data_ptr() + (idx[:, None] * es + torch.arange(es)).reshape(-1)).tolist())


def test_row_limit_and_tensors_overlap_are_exact():
    """kvfuse.overlap against brute force on random strided layouts: row_limit is the largest n whose rows
    do not share a byte (or a ValueError when one row overlaps itself), tensors_overlap is True iff two
    tensors share a byte."""
    from kvfuse.overlap import INF, row_limit, tensors_overlap
    g = torch.Generator().manual_seed(0)
    buf = torch.zeros(1 << 14, dtype=torch.uint8)
    rnd = lambda hi: int(torch.randint(0, hi, (1,), generator=g))  # noqa: E731
    checked = 0
    for _ in range(300):
        H, W = 1 + rnd(4), 1 + rnd(12)
        s1, s0 = rnd(2 * W * H + 2), rnd(3 * W * H + 2)
        dtype = (torch.uint8, BF16, torch.float32)[rnd(3)]
        es = torch.empty((), dtype=dtype).element_size()
        base = buf.view(dtype)
        inner = torch.as_strided(base, (H, W), (s1, 1), 0)
        one_row_overlaps = len(_addresses(inner)) < H * W * es
        if one_row_overlaps:
            with pytest.raises(ValueError, match="overlap"):
                row_limit(torch.as_strided(base, (1, H, W), (s0, s1, 1), 0), "t")
            continue
        lim = row_limit(torch.as_strided(base, (1, H, W), (s0, s1, 1), 0), "t")
        brute = INF
        for n in range(2, 12):
            t = torch.as_strided(base, (n, H, W), (s0, s1, 1), 0)
            if len(_addresses(t)) < n * H * W * es:
                brute = n - 1
                break
        if brute == INF:
            assert lim == INF or lim >= 11, (H, W, s0, s1, lim)
        else:
            assert lim == brute, (H, W, s0, s1, lim, brute)
        # two tensors of this layout at a random distance
        n = 1 + rnd(4)
        a = torch.as_strided(base, (n, H, W), (max(s0, H * s1 + W), s1, 1), 0)
        b = torch.as_strided(base, (n, H, W), (max(s0, H * s1 + W), s1, 1), rnd(64))
        assert tensors_overlap(a, b) == bool(_addresses(a) & _addresses(b)), (H, W, s0, s1, n)
        checked += 1
    assert checked > 100


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_op_path_applies_the_same_rules(backend):
    """Through the custom op (what torch.compile traces), called eagerly: an overlapping out is
    rejected by name, and an in-place call equals a separate out."""
    from kvfuse.dispatch import via_ops
    name, inplace, separate = next(c for c in _inplace_cases() if c[0] == "MAIN_FP8 stage norm into x")
    with kvfuse.use_backend(backend), via_ops():
        kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(**separate)
        kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(**inplace)
    assert_same(inplace["x"], separate["out_args"].out, "in-place stage copy")
    assert torch.equal(storage_of(inplace["out_args"].kv_cache), storage_of(separate["out_args"].kv_cache))
    _, kw, names, buffers = next(c for c in _overlap_cases() if c[0] == "out overlaps x (shifted rows)")
    before = [as_bytes(b).clone() for b in buffers]
    with pytest.raises(ValueError, match="out_args overlaps x"), kvfuse.use_backend(backend), via_ops():
        kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(**kw)
    assert all(torch.equal(as_bytes(b), w) for b, w in zip(buffers, before))
