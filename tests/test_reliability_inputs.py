"""Reliability, bad input (SPEC §9): a hypothesis fuzz of the arguments of
``fused_norm_rope_hadamard_cast_store_kvcache``.

Each example builds a VALID call (formats: presets and user formats; stage toggles; head_dims,
heads, 2-d/3-d x, n = 0..6; padded strides of x, cos_sin and outputs; int32/int64 indices; every
destination: new tensor, a Tensor, ContiguousOutArgs, KVCacheOutArgs with out/out_stage/layout)
and then, most of the time, breaks exactly one thing (a dtype, shape, stride, device ('meta'),
type, value, a disallowed combination, a cache that does not fit its format, out of the wrong
shape/dtype, a bad out_stage...). The oracle:

* a valid call must succeed, and its result, outputs and the cache's whole storage (guards,
  padding, reserved bytes, other slots) must equal an independent expectation built from the
  reference's stage functions and the SPEC's record layout (test_reliability_memory.oracle);
  inputs are never modified;
* a broken call must raise ValueError or TypeError (nothing else) whose message names the broken
  argument, and leave every tensor it was given (cache storage, preallocated outputs) unchanged.

Accepted cases run on the reference backend (many) and on the triton kernel (a smaller sample).
Besides: every mutation a few times on its own (test_each_mutation_is_rejected_by_name), valid
calls with every tensor on 'meta' (shapes only: results of the right shapes and dtypes, nothing
computed), and regression / known-bug tests at the end (xfail strict where kvfuse is wrong).
KVFUSE_FUZZ_EXAMPLES=<n> sets the reference example count (triton: a third of it, at least 120;
each mutation: n/100, at least 4); the defaults are sized for CI. KVFUSE_FUZZ_STATS=1 prints the
cases tried per category (with pytest -s).
"""
from __future__ import annotations

import collections
import dataclasses
import os
import re

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import kvfuse
from kvfuse import (CastArgs, ContiguousOutArgs, HadamardArgs, KVCacheFormat, KVCacheOutArgs, NormArgs, RopeArgs,
                    formats)
from helpers import cos_sin_cache, guarded_cache, random_bf16
from test_reliability_memory import as_bytes, assert_same, assert_storage, find_preset, oracle, storage_of

fused = kvfuse.fused_norm_rope_hadamard_cast_store_kvcache
N_REF = int(os.environ.get("KVFUSE_FUZZ_EXAMPLES", "400"))
N_TRITON = max(120, N_REF // 3)
N_EACH = max(4, N_REF // 100)
FUZZ = settings(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much,
                                       HealthCheck.large_base_example])
STATS = collections.Counter()

USER_FORMATS = [
    KVCacheFormat("U_TI_MXFP4_D64_RSV", 64, "e2m1", 32, "ue8m0", True, sf_bytes=5),        # 37-byte records
    KVCacheFormat("U_TI_BF16_D48", 48, None, None, None, True),
    KVCacheFormat("U_BW_E4M3_G16_FP32_D32", 32, "e4m3", 16, "fp32", False),
    KVCacheFormat("U_TI_TAIL_D96", 96, "e4m3", 32, "ue8m0_fp32", True, bf16_tail=32),
    KVCacheFormat("U_BW_NVFP4_TAIL_D64", 64, "e2m1", 16, "e4m3", False, sf_bytes=3, bf16_tail=16),
    KVCacheFormat("U_TI_MXFP4_D64_ZR", 64, "e2m1", 32, "ue8m0", True, sf_bytes=5, zero_reserved=True),
]
CACHE_FORMATS = list(formats.PRESETS.values()) + USER_FORMATS
HEAD_DIMS = [16, 32, 48, 64, 96, 128, 256, 576]
SF_FORMATS = ("ue8m0", "ue8m0_fp32", "e4m3", "fp32")


def pow2_ok(D):
    return 16 <= D <= 1024 and D & (D - 1) == 0


def valid_casts(D):
    out = [("e4m3", g, sf) for g in (16, 32, 64, 128) if D % g == 0 for sf in SF_FORMATS]
    out += [("e2m1", g, sf) for g, sf in ((16, "e4m3"), (32, "ue8m0")) if D % g == 0]
    return out


def make_cast(c, cast_back=False):
    return CastArgs(c[0], c[1], c[2] in ("ue8m0", "ue8m0_fp32"), c[2], cast_back)


def q_shape_dtype(cast, lead, D):
    if cast.cast_fmt == "e2m1":
        return lead + (D // 2,), torch.uint8
    return lead + (D,), torch.float8_e4m3fn


def sf_dtype(sf):
    return {"ue8m0": torch.uint8, "e4m3": torch.float8_e4m3fn}.get(sf, torch.float32)


def garbage(shape, dtype, gen, pad=0):
    """A tensor of random bytes of ``shape``/``dtype``, last dim contiguous, rows padded by ``pad``."""
    item = torch.empty((), dtype=dtype).element_size()
    full = tuple(shape[:-1]) + (shape[-1] + pad,)
    b = torch.randint(0, 256, full[:-1] + (full[-1] * item,), dtype=torch.uint8, generator=gen)
    t = b.view(dtype)
    return t[..., : shape[-1]] if pad else t


# =========================================================================== building a valid call
@dataclasses.dataclass
class Case:
    kw: dict
    D: int
    H: int
    n: int
    dest: str
    fmt: KVCacheFormat = None
    gen: torch.Generator = None


def draw_valid(d, small, needs=None):
    """A valid call; ``needs`` forces some choices (so that a given mutation applies): dest (a tuple),
    quantized (cache format), D (a predicate), cast (bool), cast_back, norm, rope, hadamard, prealloc."""
    needs = needs or {}
    flag = lambda name, label: needs[name] if name in needs else d(st.booleans(), label=label)  # noqa: E731
    seed = d(st.integers(0, 2 ** 31 - 1), label="seed")
    gen = torch.Generator().manual_seed(seed)
    dest = d(st.sampled_from(needs.get("dest", ["none", "tensor", "contig", "cache", "cache"])), label="dest")
    fmt = None
    if dest == "cache":
        fmts = [f for f in CACHE_FORMATS if needs.get("quantized", f.quantized) == f.quantized]
        fmt = d(st.sampled_from(fmts), label="fmt")
        D = fmt.head_dim
        H = d(st.integers(1, 2 if small else 3), label="H") if fmt.token_interleaved else 1
        cast = CastArgs.from_cache_format(fmt)
    else:
        dims = [v for v in HEAD_DIMS if needs.get("D", lambda _: True)(v)
                and (not needs.get("hadamard") or pow2_ok(v))]
        D = d(st.sampled_from(dims), label="D")
        H = d(st.integers(1, 2 if small else 3), label="H")
        want = needs.get("cast")
        c = None if want is False else d((st.none() if want is None else st.nothing()) | st.sampled_from(valid_casts(D)),
                                        label="cast")
        cast = None if c is None else make_cast(c, flag("cast_back", "cast_back"))
    n = d(st.integers(0, 3 if small else 6), label="n")
    two_d = H == 1 and d(st.booleans(), label="2-d x")
    xpad = d(st.sampled_from([0, 0, 16, 8]), label="x row padding")
    x = random_bf16((n, H, D + xpad), seed=seed)[..., :D]
    if two_d:
        x = x[:, 0]
    kw = {"x": x}
    if flag("norm", "norm"):
        wdt = d(st.sampled_from([torch.bfloat16, torch.float32]), label="weight dtype")
        eps = d(st.sampled_from([1e-6, 1e-30, 1e-5, 1]), label="eps")
        kw["norm_args"] = NormArgs((torch.rand(D, generator=gen) * 2).to(wdt), eps)
    if flag("rope", "rope"):
        r = d(st.sampled_from(sorted({2, 4, 16, 32, 64, D} & set(range(2, D + 1, 2)))), label="rotary_dim")
        off = d(st.none() | st.integers(0, D - r), label="offset")
        P = d(st.sampled_from([1, 5, 40]), label="max_position")
        pdt = d(st.sampled_from([torch.int32, torch.int64]), label="positions dtype")
        pos = torch.randint(-2, P + 2, (n,), generator=gen).to(pdt)
        csdt = d(st.sampled_from([torch.float32, torch.bfloat16]), label="cos_sin dtype")
        cspad = d(st.sampled_from([0, 6]), label="cos_sin row padding")
        cs = torch.cat([cos_sin_cache(P, r, csdt), torch.zeros(P, cspad, dtype=csdt)], 1)[:, :r] if cspad \
            else cos_sin_cache(P, r, csdt)
        kw["rope_args"] = RopeArgs(pos, cs, r, d(st.booleans(), label="is_neox"), off, d(st.booleans(), label="conj"))
    if pow2_ok(D) and flag("hadamard", "hadamard"):
        kw["hadamard_args"] = HadamardArgs(d(st.sampled_from([1.0, D ** -0.5, -0.5, 0.0, 3.0]), label="scale"))
    if cast is not None:
        kw["cast_args"] = cast
    lead = tuple(x.shape[:-1])
    opad = d(st.sampled_from([0, 0, 32]), label="out padding")
    if dest == "tensor":
        if cast is None or cast.cast_back:
            kw["out_args"] = garbage(x.shape, torch.bfloat16, gen, opad)
        else:
            shp, dt = q_shape_dtype(cast, lead, D)
            kw["out_args"] = garbage(shp, dt, gen, opad)
    elif dest == "contig":
        out = sf = None
        if cast is None or cast.cast_back:
            if flag("prealloc", "prealloc out"):
                out = garbage(x.shape, torch.bfloat16, gen, opad)
        else:
            shp, dt = q_shape_dtype(cast, lead, D)
            if flag("prealloc", "prealloc q"):
                out = garbage(shp, dt, gen, opad)
            if flag("prealloc", "prealloc sf"):
                sf = garbage(lead + (D // cast.num_per_channels,), sf_dtype(cast.sf_format), gen, opad // 4)
        kw["out_args"] = ContiguousOutArgs(out, sf)
    elif dest == "cache":
        nb = d(st.integers(1, 3), label="num_blocks")
        bs = d(st.sampled_from([1, 2, 4, 16]), label="block_size")
        tpad = d(st.sampled_from([0, 0, 8, 40]), label="token padding") if fmt.token_interleaved else 0
        bpad = d(st.sampled_from([0, 32, 96]), label="block padding")
        cache, _ = guarded_cache(fmt, nb, bs, H, token_padding=tpad, block_padding=bpad, guard=32, seed=seed)
        cap = nb * bs
        valid = torch.randperm(cap, generator=gen)[:n]
        junk = torch.tensor([-1, cap, cap + 3, -(2 ** 31), 2 ** 31 - 1])
        slots = torch.where(torch.rand(n, generator=gen) < 0.3, junk[torch.randint(0, 5, (n,), generator=gen)],
                            torch.cat([valid, torch.full((max(0, n - valid.numel()),), -1)])[:n])
        slots = slots.to(d(st.sampled_from([torch.int32, torch.int64]), label="slots dtype"))
        stages = ["transform"] + (["norm"] if "norm_args" in kw else []) + (["cast_back"] if fmt.quantized else [])
        stage = d(st.none() | st.sampled_from(stages), label="out_stage")
        out = garbage(x.shape, torch.bfloat16, gen, opad) if stage and d(st.booleans(), label="out") else None
        layout = fmt if fmt.name not in formats.PRESETS or d(st.booleans(), label="layout given") else None
        kw["out_args"] = KVCacheOutArgs(cache, slots, out=out, out_stage=stage, layout=layout)
    return Case(kw, D, H, n, dest, fmt, gen)


# =========================================================================== breaking one thing
def _rep(obj, **changes):
    return dataclasses.replace(obj, **changes)


def _meta(t):
    return t.to("meta")


def _strided_last(t):
    """Same shape and dtype, stride(-1) == 2."""
    wide = torch.zeros(tuple(t.shape[:-1]) + (2 * t.shape[-1],), dtype=t.dtype)
    return wide[..., ::2]


def _other_dtype(t, d, choices):
    return d(st.sampled_from([c for c in choices if c != t.dtype]), label="bad dtype")


class Mutation:
    """One way of breaking a valid call: ``applies(case)``, ``apply(case, draw)`` (edits case.kw),
    ``blame``: names of which at least one must appear in the error message."""

    def __init__(self, name, blame, applies, apply):
        self.name, self.blame, self.applies, self.apply = name, blame, applies, apply

    def __repr__(self):
        return f"Mutation({self.name!r})"


def _has(*keys):
    return lambda c: all(k in c.kw for k in keys)


def _oa(c):
    return c.kw.get("out_args")


def _set_oa(c, **ch):
    c.kw["out_args"] = _rep(c.kw["out_args"], **ch)


def _norm(c, **ch):
    c.kw["norm_args"] = _rep(c.kw["norm_args"], **ch)


def _rope(c, **ch):
    c.kw["rope_args"] = _rep(c.kw["rope_args"], **ch)


def _cast(c, **ch):
    c.kw["cast_args"] = _rep(c.kw["cast_args"], **ch)


def _is_cache(c):
    return c.dest == "cache"


def _contig_cast(c):
    return c.dest != "cache" and "cast_args" in c.kw


def _pick(d, label, values):
    return d(st.sampled_from(values), label=label)


def _x_device(c, d):
    c.kw["x"] = _meta(c.kw["x"])


def _other_tensors(c):
    return any(k in c.kw for k in ("norm_args", "rope_args")) or isinstance(_oa(c), (torch.Tensor, KVCacheOutArgs)) \
        or (isinstance(_oa(c), ContiguousOutArgs) and (_oa(c).out is not None or _oa(c).sf is not None))


def _round_up(v, m):
    return -(-v // m) * m


def _bad_cache(c, d):
    """A cache tensor that does not fit its format (rank, last dim, heads, strides)."""
    cache = _oa(c).kv_cache
    fmt = c.fmt
    nb, bs, H, bpt = cache.shape
    s0, s1 = cache.stride(0), cache.stride(1)
    al = fmt.stride_alignment
    kinds = ["rank", "last_dim", "stride0_not_32", "stride0_too_small"]
    if fmt.token_interleaved:
        kinds += ["more_heads", "stride1_too_small"] + (["stride1_misaligned"] if al > 1 else [])
    else:
        kinds += ["two_heads_block_wide", "block_wide_not_dense"]
    kind = d(st.sampled_from(kinds), label="bad cache")
    big = torch.zeros(4 * (nb + 1) * (s0 + 2 * (H + 1) * bpt * bs) + 4096, dtype=torch.uint8)
    view = lambda shape, strides: torch.as_strided(big, shape, strides)  # noqa: E731
    if kind == "rank":
        new = cache[0]
    elif kind == "last_dim":
        new = view((nb, bs, H, bpt - 1), (s0, s1, bpt - 1, 1))
    elif kind == "stride0_not_32":
        new = view((nb, bs, H, bpt), (s0 + 1, s1, bpt, 1))
    elif kind == "stride0_too_small":
        new = view((nb, bs, H, bpt), (32, s1, bpt, 1))          # < one block's bytes (bpt >= 37 here)
    elif kind == "more_heads":
        s1b = _round_up((H + 1) * bpt, al)
        new = view((nb, bs, H + 1, bpt), (_round_up(bs * s1b, 32), s1b, bpt, 1))
    elif kind == "stride1_too_small":
        new = view((nb, bs, H, bpt), (s0, H * bpt - 1, bpt, 1))
    elif kind == "stride1_misaligned":
        s1b = _round_up(H * bpt, al) + 1
        new = view((nb, bs, H, bpt), (_round_up(bs * s1b, 32), s1b, bpt, 1))
    elif kind == "two_heads_block_wide":
        new = view((nb, bs, 2, bpt), (_round_up(2 * bs * bpt, 32), 2 * bpt, bpt, 1))
    else:
        new = view((nb, bs, H, bpt), (_round_up(bs * (bpt + 32), 32), bpt + 32, bpt, 1))
    _set_oa(c, kv_cache=new)


def _cast_mismatch(c, d):
    cur = (c.fmt.cast_fmt, c.fmt.elements_per_sf, c.fmt.sf_format)
    alts = [v for v in valid_casts(c.fmt.quant_dim) if v != cur]
    if _oa(c).layout is None:       # layout inference would (rightly) pick the other preset of that size
        alts = [v for v in alts if not any(f.bytes_per_token == c.fmt.bytes_per_token
                                           and CastArgs.from_cache_format(f) == make_cast(v)
                                           for f in formats.PRESETS.values())]
    c.kw["cast_args"] = make_cast(_pick(d, "other cast", alts))


def _layout_other(c, d):
    others = [f for f in CACHE_FORMATS if f.bytes_per_token != c.fmt.bytes_per_token or f.head_dim != c.fmt.head_dim]
    _set_oa(c, layout=_pick(d, "other layout", others))


def _g_not_dividing(c):
    return _contig_cast(c) and any(c.D % g for g in (32, 64, 128))


MUTATIONS = [
    # ---- x
    Mutation("x dtype", ["x"], lambda c: True,
             lambda c, d: c.kw.update(x=c.kw["x"].to(_other_dtype(c.kw["x"], d, [torch.float32, torch.float16,
                                                                                 torch.int16, torch.uint8])))),
    Mutation("x not a tensor", ["x"], lambda c: True, lambda c, d: c.kw.update(x=c.kw["x"].tolist())),
    Mutation("x rank", ["x"], lambda c: True,
             lambda c, d: c.kw.update(x=_pick(d, "rank", [c.kw["x"].reshape(-1),
                                                          c.kw["x"].reshape(tuple(c.kw["x"].shape[:-1]) + (1, 1, c.D)),
                                                          c.kw["x"].sum().reshape(())]))),
    Mutation("x stride(-1)", ["x"], lambda c: True, lambda c, d: c.kw.update(x=_strided_last(c.kw["x"]))),
    Mutation("x head_dim", ["x", "head_dim"], lambda c: True,
             lambda c, d: c.kw.update(x=c.kw["x"][..., : c.D - _pick(d, "cut", [8, 1, c.D])])),
    Mutation("x zero heads", ["x", "num_heads"], lambda c: True,
             lambda c, d: c.kw.update(x=torch.zeros((c.n, 0, c.D), dtype=torch.bfloat16))),
    Mutation("x on meta", ["x", "weight", "positions", "cos_sin_cache", "out", "sf", "kv_cache", "slot_mapping",
                           "out_args"], _other_tensors, _x_device),
    # ---- norm_args
    Mutation("norm_args type", ["norm_args"], lambda c: True,
             lambda c, d: c.kw.update(norm_args=_pick(d, "obj", [HadamardArgs(), "rmsnorm", 1e-6, torch.ones(c.D)]))),
    Mutation("weight dtype", ["weight"], _has("norm_args"),
             lambda c, d: _norm(c, weight=c.kw["norm_args"].weight.to(_pick(d, "dt", [torch.float16, torch.float64,
                                                                                      torch.int32])))),
    Mutation("weight shape", ["weight"], _has("norm_args"),
             lambda c, d: _norm(c, weight=_pick(d, "shape", [torch.ones(c.D + 16), torch.ones(1, c.D),
                                                            torch.ones(0), torch.ones(())]))),   # [k <= D]: valid
    Mutation("weight not a tensor", ["weight"], _has("norm_args"), lambda c, d: _norm(c, weight=[1.0] * c.D)),
    Mutation("weight stride", ["weight"], _has("norm_args"), lambda c, d: _norm(c, weight=torch.ones(2 * c.D)[::2])),
    Mutation("weight on meta", ["weight"], _has("norm_args"), lambda c, d: _norm(c, weight=_meta(c.kw["norm_args"].weight))),
    Mutation("eps", ["eps"], _has("norm_args"),
             lambda c, d: _norm(c, eps=_pick(d, "eps", [-1e-6, 0.0, float("nan"), float("inf"), "1e-6", None,
                                                       torch.tensor(1e-6)]))),
    # ---- rope_args
    Mutation("rope_args type", ["rope_args"], lambda c: True,
             lambda c, d: c.kw.update(rope_args=_pick(d, "obj", [NormArgs(torch.ones(c.D)), (0, 1), "neox"]))),
    Mutation("rotary_dim", ["rotary_dim", "cos_sin_cache"], _has("rope_args"),
             lambda c, d: _rope(c, rotary_dim=_pick(d, "r", [c.kw["rope_args"].rotary_dim + 1, 0, -2, c.D + 2,
                                                             float(c.kw["rope_args"].rotary_dim), True, None]))),
    Mutation("rope offset", ["offset"], _has("rope_args"),
             lambda c, d: _rope(c, offset=_pick(d, "off", [-1, c.D - c.kw["rope_args"].rotary_dim + 1, c.D, 0.0, "0"]))),
    Mutation("is_neox", ["is_neox"], _has("rope_args"), lambda c, d: _rope(c, is_neox=_pick(d, "v", [1, None, "neox"]))),
    Mutation("conjugate", ["conjugate"], _has("rope_args"), lambda c, d: _rope(c, conjugate=_pick(d, "v", [0, None]))),
    Mutation("positions dtype", ["positions"], _has("rope_args"),
             lambda c, d: _rope(c, positions=c.kw["rope_args"].positions.to(
                 _pick(d, "dt", [torch.float32, torch.int16, torch.uint8, torch.bool, torch.int8])))),
    Mutation("positions shape", ["positions"], _has("rope_args"),
             lambda c, d: _rope(c, positions=_pick(d, "shape", [torch.zeros(c.n + 1, dtype=torch.int64),
                                                                torch.zeros(c.n, 1, dtype=torch.int64),
                                                                torch.zeros((), dtype=torch.int64)]))),
    Mutation("positions not a tensor", ["positions"], _has("rope_args"),
             lambda c, d: _rope(c, positions=list(range(c.n)))),
    Mutation("positions on meta", ["positions"], _has("rope_args"),
             lambda c, d: _rope(c, positions=_meta(c.kw["rope_args"].positions))),
    Mutation("cos_sin dtype", ["cos_sin_cache"], _has("rope_args"),
             lambda c, d: _rope(c, cos_sin_cache=c.kw["rope_args"].cos_sin_cache.to(
                 _pick(d, "dt", [torch.float16, torch.float64, torch.int32])))),
    Mutation("cos_sin shape", ["cos_sin_cache", "rotary_dim"], _has("rope_args"),
             lambda c, d: _rope(c, cos_sin_cache=_pick(d, "shape", [
                 torch.zeros(4, c.kw["rope_args"].rotary_dim + 2), torch.zeros(4 * c.kw["rope_args"].rotary_dim),
                 torch.zeros(1, 4, c.kw["rope_args"].rotary_dim), torch.zeros(4, c.kw["rope_args"].rotary_dim // 2)]))),
    Mutation("cos_sin stride(-1)", ["cos_sin_cache"], lambda c: _has("rope_args")(c) and c.kw["rope_args"].rotary_dim > 1,
             lambda c, d: _rope(c, cos_sin_cache=_strided_last(c.kw["rope_args"].cos_sin_cache))),
    Mutation("cos_sin not a tensor", ["cos_sin_cache"], _has("rope_args"),
             lambda c, d: _rope(c, cos_sin_cache=c.kw["rope_args"].cos_sin_cache.tolist())),
    Mutation("cos_sin on meta", ["cos_sin_cache"], _has("rope_args"),
             lambda c, d: _rope(c, cos_sin_cache=_meta(c.kw["rope_args"].cos_sin_cache))),
    # ---- hadamard_args
    Mutation("hadamard_args type", ["hadamard_args"], lambda c: True,
             lambda c, d: c.kw.update(hadamard_args=_pick(d, "obj", [1.0, "walsh", NormArgs(torch.ones(c.D))]))),
    Mutation("hadamard scale", ["scale"], _has("hadamard_args"),
             lambda c, d: c.kw.update(hadamard_args=HadamardArgs(_pick(d, "s", [float("nan"), float("-inf"), "1", None,
                                                                               torch.tensor(1.0)])))),
    Mutation("hadamard head_dim", ["hadamard_args", "head_dim"], lambda c: not pow2_ok(c.D),
             lambda c, d: c.kw.update(hadamard_args=HadamardArgs())),
    # ---- cast_args (no cache)
    Mutation("cast_fmt", ["cast_fmt"], _contig_cast, lambda c, d: _cast(c, cast_fmt=_pick(d, "v", ["e5m2", "fp8", None, "E4M3"]))),
    Mutation("num_per_channels", ["num_per_channels"], _contig_cast,
             lambda c, d: _cast(c, num_per_channels=_pick(d, "g", [8, 256, 0, 24, -32, True, None, "32", 32.0, 16.0]))),
    Mutation("num_per_channels not dividing", ["num_per_channels"], _g_not_dividing,
             lambda c, d: c.kw.update(cast_args=make_cast(("e4m3", _pick(d, "g", [g for g in (32, 64, 128) if c.D % g]),
                                                           "fp32")))),
    Mutation("round_sf flipped", ["round_sf"], _contig_cast,
             lambda c, d: _cast(c, round_sf=not c.kw["cast_args"].round_sf)),
    Mutation("round_sf type", ["round_sf"], _contig_cast, lambda c, d: _cast(c, round_sf=_pick(d, "v", [1, None, "yes"]))),
    Mutation("sf_format", ["sf_format"], _contig_cast, lambda c, d: _cast(c, sf_format=_pick(d, "v", ["ue8m1", "e5m2", None]))),
    Mutation("e2m1 combination", ["cast_args", "num_per_channels", "sf_format"],
             lambda c: _contig_cast(c) and c.D % 64 == 0,
             lambda c, d: c.kw.update(cast_args=make_cast(_pick(d, "combo", [("e2m1", 32, "e4m3"), ("e2m1", 16, "ue8m0"),
                                                                             ("e2m1", 64, "ue8m0"), ("e2m1", 16, "fp32"),
                                                                             ("e2m1", 32, "ue8m0_fp32")])))),
    Mutation("cast_back type", ["cast_back"], _contig_cast, lambda c, d: _cast(c, cast_back=_pick(d, "v", [1, None, "no"]))),
    Mutation("cast_args type", ["cast_args"], lambda c: True,
             lambda c, d: c.kw.update(cast_args=_pick(d, "obj", ["e4m3", ("e4m3", 32, True, "ue8m0"),
                                                                 NormArgs(torch.ones(c.D)), HadamardArgs()]))),
    # ---- destination: Tensor / ContiguousOutArgs
    Mutation("out_args type", ["out_args"], lambda c: True,
             lambda c, d: c.kw.update(out_args=_pick(d, "obj", ["cache", 3, {"out": None}, (None, None), NormArgs(None)]))),
    Mutation("out tensor dtype", ["out_args"], lambda c: c.dest == "tensor",
             lambda c, d: c.kw.update(out_args=torch.zeros(c.kw["out_args"].shape, dtype=_other_dtype(
                 c.kw["out_args"], d, [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.uint8])))),
    Mutation("out tensor shape", ["out_args"], lambda c: c.dest == "tensor",
             lambda c, d: c.kw.update(out_args=_pick(d, "shape", [c.kw["out_args"][..., :-2],
                                                                  c.kw["out_args"].unsqueeze(0)]))),
    Mutation("out tensor stride(-1)", ["out_args"], lambda c: c.dest == "tensor",
             lambda c, d: c.kw.update(out_args=_strided_last(c.kw["out_args"]))),
    Mutation("out tensor on meta", ["out_args"], lambda c: c.dest == "tensor",
             lambda c, d: c.kw.update(out_args=_meta(c.kw["out_args"]))),
    Mutation("contiguous out bad", ["out"], lambda c: c.dest == "contig" and _oa(c).out is not None,
             lambda c, d: _set_oa(c, out=_pick(d, "bad out", [_oa(c).out[..., :-2], _oa(c).out.to(torch.float32)
                                                              if _oa(c).out.dtype != torch.float32 else _oa(c).out.double(),
                                                              _strided_last(_oa(c).out), _meta(_oa(c).out), "out"]))),
    Mutation("contiguous sf bad", ["sf"], lambda c: c.dest == "contig" and _oa(c).sf is not None,
             lambda c, d: _set_oa(c, sf=_pick(d, "bad sf", [_oa(c).sf[..., :-1], _oa(c).sf.to(torch.float16),
                                                            _oa(c).sf.unsqueeze(-1), _meta(_oa(c).sf)]))),
    Mutation("sf given for a bf16 result", ["sf"],
             lambda c: c.dest == "contig" and ("cast_args" not in c.kw or c.kw["cast_args"].cast_back),
             lambda c, d: _set_oa(c, sf=torch.zeros(tuple(c.kw["x"].shape[:-1]) + (c.D // 16,), dtype=torch.uint8))),
    # ---- destination: KV cache
    Mutation("cache shape/strides", ["kv_cache", "layout", "num_heads"], _is_cache, _bad_cache),
    Mutation("cache dtype", ["kv_cache", "layout"], _is_cache,
             lambda c, d: _set_oa(c, kv_cache=_oa(c).kv_cache.view(_pick(d, "dt", [torch.int8, torch.float8_e4m3fn,
                                                                                   torch.bool])))),
    Mutation("cache not a tensor", ["kv_cache"], _is_cache, lambda c, d: _set_oa(c, kv_cache=[0, 1])),
    Mutation("cache on meta", ["kv_cache"], _is_cache, lambda c, d: _set_oa(c, kv_cache=_meta(_oa(c).kv_cache))),
    Mutation("layout type", ["layout"], _is_cache,
             lambda c, d: _set_oa(c, layout=_pick(d, "v", [c.fmt.name, dataclasses.asdict(c.fmt), 0]))),
    Mutation("layout of another format", ["layout", "kv_cache", "head_dim"], _is_cache, _layout_other),
    Mutation("slot_mapping dtype", ["slot_mapping"], _is_cache,
             lambda c, d: _set_oa(c, slot_mapping=_oa(c).slot_mapping.to(_pick(d, "dt", [torch.float32, torch.int16,
                                                                                         torch.uint8, torch.float64])))),
    Mutation("slot_mapping shape", ["slot_mapping"], _is_cache,
             lambda c, d: _set_oa(c, slot_mapping=_pick(d, "shape", [torch.zeros(c.n + 1, dtype=torch.int64),
                                                                     torch.zeros(c.n, 1, dtype=torch.int32),
                                                                     torch.zeros((), dtype=torch.int64)]))),
    Mutation("slot_mapping not a tensor", ["slot_mapping"], _is_cache, lambda c, d: _set_oa(c, slot_mapping=[0] * c.n)),
    Mutation("slot_mapping on meta", ["slot_mapping"], _is_cache,
             lambda c, d: _set_oa(c, slot_mapping=_meta(_oa(c).slot_mapping))),
    Mutation("out_stage value", ["out_stage"], _is_cache,
             lambda c, d: _set_oa(c, out_stage=_pick(d, "v", ["cast", "", "NORM", "rope", 3, ("norm",)]))),
    Mutation("out without out_stage", ["out_stage"], _is_cache,
             lambda c, d: _set_oa(c, out=torch.zeros(c.kw["x"].shape, dtype=torch.bfloat16), out_stage=None)),
    Mutation("out_stage norm without norm", ["out_stage", "norm"], _is_cache,
             lambda c, d: (c.kw.pop("norm_args", None),
                           _set_oa(c, out=torch.zeros(c.kw["x"].shape, dtype=torch.bfloat16), out_stage="norm"))),
    Mutation("out_stage cast_back on a bf16 cache", ["out_stage", "cast_back"], lambda c: _is_cache(c) and not c.fmt.quantized,
             lambda c, d: _set_oa(c, out=torch.zeros(c.kw["x"].shape, dtype=torch.bfloat16), out_stage="cast_back")),
    Mutation("cache out bad", ["out"], _is_cache,
             lambda c, d: _set_oa(c, out_stage="transform", out=_pick(d, "bad out", [
                 torch.zeros(c.kw["x"].shape, dtype=torch.float32), torch.zeros((c.n + 1,) + tuple(c.kw["x"].shape[1:]),
                                                                                dtype=torch.bfloat16),
                 _strided_last(c.kw["x"]), _meta(torch.zeros(c.kw["x"].shape, dtype=torch.bfloat16)), "out"]))),
    Mutation("cast_args None for a quantized cache", ["cast_args", "layout"], lambda c: _is_cache(c) and c.fmt.quantized,
             lambda c, d: c.kw.pop("cast_args")),
    Mutation("cast_args not matching the cache", ["cast_args", "layout"], lambda c: _is_cache(c) and c.fmt.quantized,
             _cast_mismatch),
    Mutation("float num_per_channels for a cache", ["num_per_channels", "cast_args"],
             lambda c: _is_cache(c) and c.fmt.quantized,
             lambda c, d: _cast(c, num_per_channels=float(c.fmt.elements_per_sf))),
    Mutation("cast_back with a cache", ["cast_back", "cast_args"], lambda c: _is_cache(c) and c.fmt.quantized,
             lambda c, d: _cast(c, cast_back=True)),
    Mutation("cast_args for a bf16 cache", ["cast_args", "layout"], lambda c: _is_cache(c) and not c.fmt.quantized,
             lambda c, d: c.kw.update(cast_args=make_cast(("e4m3", 16, "ue8m0")))),
]
NONCACHE = ("none", "tensor", "contig")
_NORM = {"norm": True}
_ROPE = {"rope": True}
_CCAST = {"dest": NONCACHE, "cast": True}
_CACHE = {"dest": ("cache",)}
NEEDS = {  # what draw_valid must give for a mutation to apply (the per-mutation sweep uses it)
    "x on meta": _NORM, "weight dtype": _NORM, "weight shape": _NORM, "weight not a tensor": _NORM,
    "weight stride": _NORM, "weight on meta": _NORM, "eps": _NORM,
    **{k: _ROPE for k in ("rotary_dim", "rope offset", "is_neox", "conjugate", "positions dtype", "positions shape",
                          "positions not a tensor", "positions on meta", "cos_sin dtype", "cos_sin shape",
                          "cos_sin stride(-1)", "cos_sin not a tensor", "cos_sin on meta")},
    "hadamard scale": {"hadamard": True},
    "hadamard head_dim": {"dest": NONCACHE, "D": lambda v: not pow2_ok(v)},
    **{k: _CCAST for k in ("cast_fmt", "num_per_channels", "round_sf flipped", "round_sf type", "sf_format",
                           "cast_back type")},
    "num_per_channels not dividing": {**_CCAST, "D": lambda v: any(v % g for g in (32, 64, 128))},
    "e2m1 combination": {**_CCAST, "D": lambda v: v % 64 == 0},
    **{k: {"dest": ("tensor",)} for k in ("out tensor dtype", "out tensor shape", "out tensor stride(-1)",
                                          "out tensor on meta")},
    "contiguous out bad": {"dest": ("contig",), "prealloc": True},
    "contiguous sf bad": {"dest": ("contig",), "cast": True, "cast_back": False, "prealloc": True},
    "sf given for a bf16 result": {"dest": ("contig",), "cast": False},
    **{k: _CACHE for k in ("cache shape/strides", "cache dtype", "cache not a tensor", "cache on meta", "layout type",
                           "layout of another format", "slot_mapping dtype", "slot_mapping shape",
                           "slot_mapping not a tensor", "slot_mapping on meta", "out_stage value",
                           "out without out_stage", "out_stage norm without norm", "cache out bad")},
    **{k: {**_CACHE, "quantized": True} for k in ("cast_args None for a quantized cache",
                                                  "float num_per_channels for a cache",
                                                  "cast_args not matching the cache", "cast_back with a cache")},
    **{k: {**_CACHE, "quantized": False} for k in ("out_stage cast_back on a bf16 cache", "cast_args for a bf16 cache")},
}
assert set(NEEDS) <= {m.name for m in MUTATIONS}
# Kept out of the fuzz: a cos_sin_cache with 0 rows (its own regression test below).


def draw_case(data, small, p_valid):
    d = data.draw
    case = draw_valid(d, small)
    mutation = None
    # st.randoms spreads its choices about uniformly (plain integer draws cluster on small values)
    rng = d(st.randoms(use_true_random=False), label="chooser")
    if rng.random() >= p_valid:
        mutation = rng.choice([m for m in MUTATIONS if m.applies(case)])
        d(st.just(mutation.name), label="mutation")
        mutation.apply(case, d)
    return case, mutation


# =========================================================================== running and checking
def tensors_in(obj, prefix="", out=None):
    """{name: tensor} of every tensor reachable in the call's arguments."""
    out = {} if out is None else out
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            tensors_in(getattr(obj, f.name), f"{prefix}.{f.name}", out)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            tensors_in(v, f"{prefix}.{k}" if prefix else k, out)
    return out


def _raw(name, t):
    """The bytes to watch: a cache's whole storage (guards, padding, ...), else the tensor's bytes."""
    if name.endswith("kv_cache") and t.element_size() == 1:
        return storage_of(t.view(torch.uint8))
    return as_bytes(t)


def snapshot(kw):
    return {name: (t, _raw(name, t).clone()) for name, t in tensors_in(kw).items() if t.device.type != "meta"}


def assert_unchanged(snap, skip=()):
    for name, (t, before) in snap.items():
        if name not in skip:
            assert torch.equal(_raw(name, t), before), f"{name} was modified"


def names_blamed(msg, names):
    for nm in names:
        if "." in nm or "_" in nm or len(nm) > 3:
            if nm in msg:
                return True
        elif re.search(rf"(?<![\w]){re.escape(nm)}(?![\w])", msg):
            return True
    return False


def compare_result(actual, expected, kw):
    oa = kw.get("out_args")
    if isinstance(expected, tuple):
        assert isinstance(actual, tuple) and len(actual) == 2, type(actual)
        assert_same(actual[0], expected[0], "q")
        assert_same(actual[1], expected[1], "sf")
        if isinstance(oa, ContiguousOutArgs):
            assert oa.out is None or actual[0] is oa.out
            assert oa.sf is None or actual[1] is oa.sf
        if isinstance(oa, torch.Tensor):
            assert actual[0] is oa
    elif expected is None:
        assert actual is None
    else:
        assert isinstance(actual, torch.Tensor), type(actual)
        assert_same(actual, expected, "result")
        if isinstance(oa, torch.Tensor):
            assert actual is oa
        elif isinstance(oa, (ContiguousOutArgs, KVCacheOutArgs)) and oa.out is not None:
            assert actual is oa.out


def run_case(case, mutation, backend):
    kw = case.kw
    STATS[(backend, "valid" if mutation is None else mutation.name)] += 1
    expected = oracle(**kw) if mutation is None else None
    snap = snapshot(kw)
    try:
        with kvfuse.use_backend(backend):
            result = fused(**kw)
    except (ValueError, TypeError) as e:
        assert mutation is not None, f"a valid call was rejected: {type(e).__name__}: {e}"
        assert names_blamed(str(e), mutation.blame), \
            f"[{mutation.name}] the message does not name {mutation.blame}: {type(e).__name__}: {e}"
        assert_unchanged(snap)
        STATS[(backend, "rejected")] += 1
        return
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"[{mutation.name if mutation else 'valid call'}] raised {type(e).__name__} "
                             f"(only ValueError/TypeError are allowed): {e}") from e
    assert mutation is None, f"[{mutation.name}] an invalid call was accepted"
    STATS[(backend, "accepted")] += 1
    oa = kw.get("out_args")
    written = set()
    if isinstance(oa, KVCacheOutArgs):
        written = {"out_args.kv_cache", "out_args.out"}
        cache = oa.kv_cache
        fmt = oa.layout or find_preset(cache, kw.get("cast_args"))
        assert_storage(storage_of(cache), expected["storage"], cache, fmt)
        if oa.out is not None:
            assert_same(oa.out, expected["out"], f"out (stage {oa.out_stage})")
    elif isinstance(oa, torch.Tensor):
        written = {"out_args"}
    elif isinstance(oa, ContiguousOutArgs):
        written = {"out_args.out", "out_args.sf"}
    compare_result(result, expected["result"], kw)
    assert_unchanged(snap, skip=written)


@settings(FUZZ, max_examples=N_REF)
@given(data=st.data())
def test_fuzz_arguments_reference_backend(data):
    case, mutation = draw_case(data, small=False, p_valid=0.35)
    run_case(case, mutation, "reference")


@settings(FUZZ, max_examples=N_TRITON)
@given(data=st.data())
def test_fuzz_arguments_triton_backend(data):
    case, mutation = draw_case(data, small=True, p_valid=0.6)
    run_case(case, mutation, "triton")


@pytest.mark.parametrize("mutation", MUTATIONS, ids=lambda m: m.name)
@settings(FUZZ, max_examples=N_EACH)
@given(data=st.data())
def test_each_mutation_is_rejected_by_name(mutation, data):
    """Every kind of breakage, a few times each on varied valid calls (reference backend)."""
    case = draw_valid(data.draw, small=True, needs=NEEDS.get(mutation.name))
    assume(mutation.applies(case))
    mutation.apply(case, data.draw)
    run_case(case, mutation, "reference")


def teardown_module():
    rows = sorted(STATS.items())
    if rows and os.environ.get("KVFUSE_FUZZ_STATS"):
        print("\nreliability fuzz, cases per category:")
        for (backend, what), k in rows:
            print(f"  {backend:9s} {what:45s} {k}")


# =========================================================================== whole-call cases
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_rejected_call_writes_nothing_even_late_in_validation(backend):
    """The last checks (out_stage, out) come after the cache and slots were accepted: still nothing
    is written, the cache storage and out stay byte-identical."""
    fmt = formats.MAIN_FP8
    cache, storage = guarded_cache(fmt, 2, 4, 1, seed=3)
    before = storage.clone()
    x = random_bf16((3, 512), seed=1)
    out = torch.full((3, 512), 5.0, dtype=torch.bfloat16)
    for bad in (dict(out=out, out_stage="cast"), dict(out=out, out_stage="norm"),
                dict(out=out[:2], out_stage="transform"), dict(out=out, out_stage=None)):
        with pytest.raises(ValueError, match="out_args.out"), kvfuse.use_backend(backend):
            fused(x, cast_args=CastArgs.from_cache_format(fmt),
                  out_args=KVCacheOutArgs(cache, torch.arange(3), layout=fmt, **bad))
        assert torch.equal(storage, before) and bool((out == 5.0).all())


# =========================================================================== meta tensors
def meta_like(t):
    return torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device="meta")


def to_meta(obj):
    """The call's arguments with every tensor replaced by a meta tensor of the same shape/strides."""
    if isinstance(obj, torch.Tensor):
        return meta_like(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type) and not isinstance(obj, KVCacheFormat):
        return dataclasses.replace(obj, **{f.name: to_meta(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                                           if isinstance(getattr(obj, f.name), torch.Tensor)})
    if isinstance(obj, dict):
        return {k: to_meta(v) for k, v in obj.items()}
    return obj


def _shape_of(r):
    if isinstance(r, tuple):
        return tuple(_shape_of(v) for v in r)
    return None if r is None else (tuple(r.shape), r.dtype)


@settings(FUZZ, max_examples=max(40, N_REF // 8))
@given(data=st.data())
def test_fuzz_valid_calls_on_meta_tensors(data):
    """Valid calls with every tensor on 'meta' (what torch.compile's fake tensors look like from
    eager code): accepted, nothing computed, results shaped and typed as the real call's."""
    case = draw_valid(data.draw, small=True)
    backend = data.draw(st.sampled_from(["reference", "triton"]), label="backend")
    STATS[(backend, "valid call on meta")] += 1
    want = oracle(**case.kw)["result"]
    with kvfuse.use_backend(backend):
        got = fused(**to_meta(case.kw))
    assert _shape_of(got) == _shape_of(want)
    for t in (got if isinstance(got, tuple) else (got,)):
        assert t is None or t.device.type == "meta"


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_meta_store(backend):
    fmt = formats.INDEX_MXFP8
    with kvfuse.use_backend(backend):
        kvfuse.store_kv_cache(torch.empty((4, 128), dtype=torch.float8_e4m3fn, device="meta"),
                              torch.empty((4, 4), dtype=torch.uint8, device="meta"), meta_like(fmt.allocate(2, 4)),
                              torch.empty(4, dtype=torch.int64, device="meta"), fmt)


@pytest.mark.parametrize("backend", [
    "reference",
    "triton"])
def test_meta_load(backend):
    fmt = formats.INDEX_MXFP8
    cache = meta_like(fmt.allocate(2, 4))
    slots = torch.empty(4, dtype=torch.int64, device="meta")
    with kvfuse.use_backend(backend):
        data, sf = kvfuse.load_paged_kv_cache(cache, slots, fmt, dequantize=False)
        y = kvfuse.load_paged_kv_cache(cache, slots, fmt)
    assert data.shape == (4, 1, 128) and sf.shape == (4, 1, 4) and data.device.type == "meta"
    assert y.shape == (4, 1, 128) and y.dtype == torch.bfloat16 and y.device.type == "meta"


# =========================================================================== regressions / known bugs
def _raises_named(fn, *names):
    """fn() raises ValueError/TypeError naming one of ``names``."""
    try:
        fn()
    except (ValueError, TypeError) as e:
        assert names_blamed(str(e), names), f"message does not name {names}: {type(e).__name__}: {e}"
        return
    except Exception as e:  # noqa: BLE001
        raise AssertionError(f"raised {type(e).__name__} (only ValueError/TypeError allowed): {e}") from e
    raise AssertionError("accepted")


def test_cast_args_of_wrong_type():
    """Regression: a cast_args that is not a CastArgs raised AttributeError (contiguous) or a
    TypeError naming nothing (layout inference)."""
    x = random_bf16((2, 128), seed=0)
    _raises_named(lambda: fused(x, cast_args="e4m3"), "cast_args")
    cache, _ = guarded_cache(formats.INDEX_MXFP8, 1, 4, seed=0)
    _raises_named(lambda: fused(x, cast_args=("e4m3", 32, True, "ue8m0"),
                                out_args=KVCacheOutArgs(cache, torch.arange(2))), "cast_args")


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_float_num_per_channels_is_rejected_by_name(backend):
    """Regression: 32.0 passed ``in (16, 32, 64, 128)`` and failed later inside the backend."""
    x = random_bf16((2, 64), seed=0)
    with kvfuse.use_backend(backend):
        _raises_named(lambda: fused(x, cast_args=CastArgs("e4m3", 32.0, True, "ue8m0")), "num_per_channels")


@pytest.mark.parametrize("backend", [
    "reference",
    "triton"])
def test_empty_cos_sin_cache_is_identity_or_rejected(backend):
    x = random_bf16((3, 64), seed=0)
    rope = RopeArgs(torch.arange(3), torch.empty(0, 16), 16, True)
    try:
        with kvfuse.use_backend(backend):
            y = fused(x, rope_args=rope)
    except (ValueError, TypeError) as e:
        assert "cos_sin_cache" in str(e)
        return
    assert_same(y, x, "every position is out of range: identity")
