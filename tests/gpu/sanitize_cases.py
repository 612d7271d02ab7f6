#!/usr/bin/env python3
"""Adversarial kernel cases for compute-sanitizer (a script, not a pytest module).

On the GPU (the kernels compiled, every tensor its own cudaMalloc so memcheck sees exact bounds):

    compute-sanitizer --tool memcheck --error-exitcode 3 python tests/gpu/sanitize_cases.py

(PYTORCH_NO_CUDA_MEMORY_CACHING=1 is set here before torch is imported: with torch's caching
allocator a tensor lives inside a larger pooled block and an out-of-bounds access that stays inside
the block is invisible to memcheck.) Options: --quick (fewer cases), --no-large (skip the 2.2 GB
cache and the n = 70000 batch), --list.

Every case runs the triton backend on the device and the reference backend on CPU copies of the
same inputs (the 2.2 GB cache: the reference on the GPU), and compares every byte: results, the
bf16 stage copy, and the WHOLE storage of the cache (random guard bytes before and after,
padding between tokens and blocks, reserved scale bytes, other slots). Rows fed NaN/inf are
compared everywhere except their own records/rows. Cases: every preset and three user formats x
adversarial slots (int32/int64 extremes, == capacity, 2**32 + k truncation traps, duplicates of
invalid slots) / positions out of range (int32/int64 extremes, 2**32 + 1) / NaN-inf rows / a cache
that ends exactly at the end of its allocation, at an odd (unaligned) base / store_kv_cache and
load_paged_kv_cache with adversarial slots / n = 0; then n = 1, 512, 513, 70000; a cache larger
than 2**31 bytes written near its end; every launch configuration of force_config on one case;
broadcast x (stride 0), strided positions/slots, padded outputs.

Exit status: 0 all equal; 1 some bytes differ; 2 a case raised. Without CUDA the same cases run in
Triton's interpreter on the CPU (a smoke test of the script itself).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
import torch  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0") else "cpu"
if DEV == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))            # tests/ (helpers)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))            # the repository (kvfuse)

import kvfuse  # noqa: E402
from kvfuse import (CastArgs, ContiguousOutArgs, HadamardArgs, KVCacheFormat, KVCacheOutArgs, NormArgs,  # noqa: E402
                    RopeArgs, formats)
from helpers import cache_strides, cos_sin_cache, random_bf16, record_regions  # noqa: E402

I32_MIN, I32_MAX, I64_MIN, I64_MAX = -2 ** 31, 2 ** 31 - 1, -2 ** 63, 2 ** 63 - 1
USER_FORMATS = [
    KVCacheFormat("U_TI_MXFP4_D64_RSV", 64, "e2m1", 32, "ue8m0", True, sf_bytes=5),       # 37-byte records
    KVCacheFormat("U_TI_TAIL_D320", 320, "e4m3", 32, "ue8m0_fp32", True, bf16_tail=64),
    KVCacheFormat("U_BW_NVFP4_TAIL_D64", 64, "e2m1", 16, "e4m3", False, sf_bytes=3, bf16_tail=16),
]
FORMATS = list(formats.PRESETS.values()) + USER_FORMATS


# =========================================================================== inputs (built on the CPU)
def make_cache(fmt, nb, bs, H, token_padding=0, block_padding=0, before=96, after=96, seed=0):
    """(cache view, storage): random bytes everywhere; ``after=0``: the view ends exactly at the
    storage's end (no slack byte), ``before`` odd: an unaligned base."""
    s0, s1 = cache_strides(fmt, bs, H, token_padding, block_padding)
    bpt = fmt.bytes_per_token
    extent = (nb - 1) * s0 + (bs - 1) * s1 + H * bpt
    g = torch.Generator().manual_seed(seed)
    storage = torch.randint(0, 256, (before + extent + after,), dtype=torch.uint8, generator=g)
    return storage, ((nb, bs, H, bpt), (s0, s1, bpt, 1), before)


def heads(fmt):
    """Two heads in token-interleaved caches (SPEC §8), one in block-wide ones."""
    return 2 if fmt.token_interleaved else 1


def stages(D, seed, norm=True, hadamard=True):
    g = torch.Generator().manual_seed(seed)
    kw = {}
    if norm:
        kw["norm_args"] = NormArgs((torch.rand(D, generator=g) + 0.5).to(torch.bfloat16), 1e-6)
    if hadamard and D & (D - 1) == 0 and 16 <= D <= 1024:
        kw["hadamard_args"] = HadamardArgs(D ** -0.5)
    return kw


def adversarial_slots(cap, dtype):
    if dtype == torch.int32:
        v = [-1, I32_MIN, I32_MAX, cap, cap + 1, 0, cap - 1, -1, 5, cap, I32_MIN, -7]
    else:
        v = [I64_MIN, I64_MAX, 2 ** 62, 2 ** 32 + 3, -2 ** 32 + 3, 2 ** 31, 2 ** 32, cap, 1, cap - 1, 7, I64_MIN, -1]
    return torch.tensor(v, dtype=dtype)


@dataclasses.dataclass
class Spec:
    """A call described on the CPU; ``materialize(dev)`` gives fresh tensors on ``dev``.
    kind "fused" | "store" | "load"; cache = (storage, (shape, strides, storage_offset));
    x_view / slot_view / pos_view: applied to the device tensors (strides, broadcasts);
    contiguous: preallocated ContiguousOutArgs (shape, dtype, slice) pairs; bad_rows: NaN/inf rows."""
    kind: str
    x: Optional[torch.Tensor] = None
    stage_kw: Optional[dict] = None
    rope: Optional[tuple] = None
    cast: Optional[CastArgs] = None
    fmt: Optional[KVCacheFormat] = None
    cache: Optional[tuple] = None
    slots: Optional[torch.Tensor] = None
    out_stage: Optional[str] = None
    out_shape: Optional[tuple] = None
    contiguous: Optional[list] = None
    store: Optional[tuple] = None
    bad_rows: tuple = ()
    x_view: Optional[Callable] = None
    slot_view: Optional[Callable] = None
    pos_view: Optional[Callable] = None

    def materialize(self, dev):
        t = lambda v: None if v is None else v.to(dev)  # noqa: E731
        got = {}
        if self.cache is not None:
            storage, (shape, strides, off) = self.cache
            st = storage.to(dev)
            got["storage"] = st
            cache = torch.as_strided(st, shape, strides, off)
        if self.kind == "store":
            data, sf, tail = self.store
            return ("store", dict(data=t(data), sf=t(sf), kv_cache=cache, slot_mapping=t(self.slots), layout=self.fmt,
                                  tail=t(tail)), got)
        if self.kind == "load":
            return ("load", dict(kv_cache=cache, slot_mapping=t(self.slots), layout=self.fmt), got)
        x = t(self.x)
        if self.x_view is not None:
            x = self.x_view(x)
        kw = {"x": x}
        for k, v in (self.stage_kw or {}).items():
            kw[k] = NormArgs(t(v.weight), v.eps) if isinstance(v, NormArgs) else v
        if self.rope is not None:
            pos, cs, r, neox, off, conj = self.rope
            pos = t(pos)
            if self.pos_view is not None:
                pos = self.pos_view(pos)
            kw["rope_args"] = RopeArgs(pos, t(cs), r, neox, off, conj)
        if self.cast is not None:
            kw["cast_args"] = self.cast
        if self.fmt is not None:
            out = None
            if self.out_stage:
                out = torch.full(self.out_shape, -7.0, dtype=torch.bfloat16, device=dev)
                got["out"] = out
            slots = t(self.slots)
            if self.slot_view is not None:
                slots = self.slot_view(slots)
            kw["out_args"] = KVCacheOutArgs(cache, slots, out=out, out_stage=self.out_stage, layout=self.fmt)
        elif self.contiguous is not None:
            outs = [None if s is None else torch.full(s[0], 0x5A, dtype=torch.uint8, device=dev).view(s[1])[s[2]]
                    for s in self.contiguous]
            kw["out_args"] = ContiguousOutArgs(*outs)
        return ("fused", kw, got)


def run(spec, dev, backend):
    kind, kw, got = spec.materialize(dev)
    with kvfuse.use_backend(backend):
        if kind == "fused":
            res = kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(**kw)
        elif kind == "store":
            res = kvfuse.store_kv_cache(**kw)
        else:
            res = kvfuse.load_paged_kv_cache(**kw, dequantize=False)
    if isinstance(res, tuple):
        got["result.0"], got["result.1"] = res
    elif isinstance(res, torch.Tensor) and res is not got.get("out"):
        got["result"] = res
    if dev != "cpu":
        torch.cuda.synchronize()
    return {k: v.detach().contiguous().view(torch.uint8).reshape(-1).cpu() if v.numel() else
            torch.empty(0, dtype=torch.uint8) for k, v in got.items()}


def ignore_masks(spec, got):
    """Bytes a non-finite row may change: its records (storage) and its rows of out/results."""
    masks = {}
    if not spec.bad_rows:
        return masks
    if "storage" in got:
        m = torch.zeros_like(got["storage"], dtype=torch.bool)
        (nb, bs, H, _), (s0, s1, _, _), base = spec.cache[1]
        for row in spec.bad_rows:
            s = int(spec.slots[row])
            if 0 <= s < nb * bs:
                for h in range(H):
                    for a, ln in record_regions(spec.fmt, bs, s0, s1, base, s // bs, s % bs, h).values():
                        m[a:a + ln] = True
        masks["storage"] = m
    n = spec.x.shape[0]
    for k, v in got.items():
        if k != "storage" and v.numel() and v.numel() % n == 0:
            m = torch.zeros(n, v.numel() // n, dtype=torch.bool)
            m[list(spec.bad_rows)] = True
            masks[k] = m.reshape(-1)
    return masks


RESULTS = {"cases": 0, "diff_cases": 0, "diff_bytes": 0, "errors": 0}


def check(name, spec, ref_dev="cpu"):
    t0 = time.time()
    RESULTS["cases"] += 1
    try:
        tri = run(spec, DEV, "triton")
        ref = run(spec, ref_dev, "reference")
    except Exception:  # noqa: BLE001
        RESULTS["errors"] += 1
        print(f"ERROR {name}\n{traceback.format_exc()}", flush=True)
        return
    masks = ignore_masks(spec, ref)
    bad = 0
    notes = []
    for k in sorted(set(tri) | set(ref)):
        a, b = tri.get(k), ref.get(k)
        if a is None or b is None or a.shape != b.shape:
            bad += 1
            notes.append(f"{k}: missing or shape {None if a is None else a.shape} vs {None if b is None else b.shape}")
            continue
        d = a != b
        if k in masks:
            d &= ~masks[k]
        if bool(d.any()):
            idx = d.nonzero().flatten()
            bad += idx.numel()
            notes.append(f"{k}: {idx.numel()} bytes differ (first at {int(idx[0])})")
    if bad:
        RESULTS["diff_cases"] += 1
        RESULTS["diff_bytes"] += bad
        print(f"DIFF  {name}: " + "; ".join(notes), flush=True)
    else:
        print(f"ok    {name} ({time.time() - t0:.2f}s)", flush=True)


# =========================================================================== the cases
def fused_spec(fmt, n, H, seed, slots, pos=None, P=64, x=None, norm=True, hadamard=True, rope_dim=16, neox=True,
               out_stage="transform", cache=None, bad_rows=(), **extra):
    D = fmt.head_dim
    x = random_bf16((n, H, D), seed=seed) if x is None else x
    pos = torch.arange(n, dtype=torch.int64) * 7 % P if pos is None else pos
    rope = (pos, cos_sin_cache(P, rope_dim), rope_dim, neox, None, False) if rope_dim else None
    cache = cache or make_cache(fmt, 3, 4, H, token_padding=40 if fmt.token_interleaved else 0, block_padding=96,
                                seed=seed)
    return Spec("fused", x=x, stage_kw=stages(D, seed, norm=norm, hadamard=hadamard), rope=rope,
                cast=CastArgs.from_cache_format(fmt), fmt=fmt, cache=cache, slots=slots, out_stage=out_stage,
                out_shape=(n, H, D), bad_rows=bad_rows, **extra)


def per_format_cases(fmt, quick):
    H, D = heads(fmt), fmt.head_dim
    cap = 12
    for dt in (torch.int32, torch.int64):
        s = adversarial_slots(cap, dt)
        yield f"{fmt.name} adversarial slots {str(dt)[6:]}", fused_spec(fmt, s.numel(), H, 1, s,
                                                                        out_stage="cast_back" if fmt.quantized else "norm")
    P = 24
    for dt, bad in ((torch.int32, [-1, P, P + 1, I32_MIN, I32_MAX]),
                    (torch.int64, [I64_MIN, I64_MAX, 2 ** 62, 2 ** 32 + 1, -2 ** 32 + 1, 2 ** 31])):
        pos = torch.tensor(bad + [3, 17, P - 1], dtype=dt)
        n = pos.numel()
        yield f"{fmt.name} positions out of range {str(dt)[6:]}", fused_spec(
            fmt, n, H, 2, torch.randperm(cap)[:n] if n <= cap else torch.arange(n) % cap, pos=pos, P=P, norm=False,
            hadamard=False, rope_dim=64 if D >= 64 else 32, neox=dt == torch.int64)
    # non-finite rows (their records may hold anything; nothing else may change)
    x = random_bf16((6, H, D), seed=3)
    x[1, 0, 3] = float("nan")
    x[3, H - 1, D - 1] = float("inf")
    x[4] = float("-inf")
    yield f"{fmt.name} NaN/inf rows", fused_spec(fmt, 6, H, 3, torch.tensor([3, 11, 0, 7, 5, 9]), x=x,
                                                 bad_rows=(1, 3, 4))
    # the cache ends exactly at the end of its allocation; odd base
    for before in (0, 7):
        c = make_cache(fmt, 2, 3, H, token_padding=24 if fmt.token_interleaved else 0, block_padding=64,
                       before=before, after=0, seed=4)
        yield f"{fmt.name} cache at the end of its allocation, base +{before}", fused_spec(
            fmt, 4, H, 4, torch.tensor([5, 0, 6, -1]), cache=c)
    if quick:
        return
    # store / load with adversarial slots
    s = adversarial_slots(cap, torch.int64)
    n = s.numel()
    g = torch.Generator().manual_seed(5)
    if fmt.quantized:
        q = torch.randint(0, 256, (n, H, fmt.quant_bytes), dtype=torch.uint8, generator=g)
        q = q.view(torch.float8_e4m3fn) if fmt.cast_fmt == "e4m3" else q
        sfb = torch.randint(100, 140, (n, H, fmt.sf_exact_bytes), dtype=torch.uint8, generator=g)
        sf = sfb.view(fmt.sf_dtype)
        tail = random_bf16((n, H, fmt.bf16_tail), seed=6) if fmt.bf16_tail else None
    else:
        q, sf, tail = random_bf16((n, H, D), seed=6), None, None
    yield f"{fmt.name} store_kv_cache adversarial slots", Spec("store", fmt=fmt, cache=make_cache(fmt, 3, 4, H, seed=7),
                                                              slots=s, store=(q, sf, tail))
    yield f"{fmt.name} load_paged_kv_cache adversarial slots", Spec("load", fmt=fmt,
                                                                    cache=make_cache(fmt, 3, 4, H, seed=8), slots=s)
    yield f"{fmt.name} n=0", fused_spec(fmt, 0, H, 9, torch.empty(0, dtype=torch.int64))


def batch_cases(large):
    fmt = formats.MAIN_FP8
    sizes = [1, 512, 513] + ([70000] if large else [])
    for n in sizes:
        bs = 64
        nb = n // bs + 2
        g = torch.Generator().manual_seed(n)
        slots = torch.randperm(nb * bs, generator=g)[:n]
        slots = torch.where(torch.rand(n, generator=g) < 0.1, torch.tensor(-1), slots)
        c = make_cache(fmt, nb, bs, 1, block_padding=32, seed=n)
        yield f"MAIN_FP8 n={n}", fused_spec(fmt, n, 1, n, slots, pos=torch.randint(-2, 66, (n,), generator=g), cache=c,
                                            out_stage="cast_back")
    fmt = formats.INDEX_MXFP4
    for n in ([600, 70000] if large else [600]):
        g = torch.Generator().manual_seed(n + 1)
        c = make_cache(fmt, n // 64 + 1, 64, 1, seed=3)
        yield f"INDEX_MXFP4 n={n}", fused_spec(fmt, n, 1, n + 1, torch.randperm((n // 64 + 1) * 64, generator=g)[:n],
                                               cache=c, out_stage="transform")


def large_cache_case():
    """A MAIN_FP8 cache of 64000 blocks x 64 tokens (2.18 GB): records beyond byte 2**31 written."""
    fmt = formats.MAIN_FP8
    nb, bs = 64000, 64
    cap = nb * bs
    slots = torch.tensor([cap - 1, cap - 64, 2 ** 31 // 532 + 5, 0, cap, -1, 2 ** 32 + 5], dtype=torch.int64)
    s0, s1 = cache_strides(fmt, bs, 1, 0, 0)
    storage = torch.full((nb * s0,), 0x5A, dtype=torch.uint8)
    spec = fused_spec(fmt, slots.numel(), 1, 11, slots, cache=(storage, ((nb, bs, 1, 532), (s0, s1, 532, 1), 0)),
                      out_stage="cast_back")
    return "MAIN_FP8 cache of 2.18 GB, slots past byte 2**31", spec


def layout_cases():
    fmt = formats.MAIN_FP4
    n, H = 9, 2
    s = torch.randperm(12)[:n]
    x = random_bf16((n, H + 1, fmt.head_dim + 32), seed=12)
    yield "MAIN_FP4 x with padded rows/heads, strided int32 slots and positions", fused_spec(
        fmt, n, H, 12, torch.stack([s, s], 1).reshape(-1).int(), x=x, pos=torch.arange(2 * n) % 64,
        x_view=lambda t: t[:, 1:, : fmt.head_dim], slot_view=lambda t: t[::2], pos_view=lambda t: t[::2])
    x = random_bf16((1, 1, 512), seed=13)
    yield "MAIN_FP8 broadcast x (stride 0)", fused_spec(
        formats.MAIN_FP8, 6, 1, 13, torch.tensor([0, 3, 5, 7, 9, 11]), x=x, x_view=lambda t: t.expand(6, 1, 512),
        pos=torch.tensor([4]), pos_view=lambda t: t.expand(6))
    # contiguous outputs with padded strides
    D, n = 256, 7
    for cast in (CastArgs("e2m1", 16, False, "e4m3"), CastArgs("e4m3", 128, True, "ue8m0_fp32"),
                 CastArgs("e4m3", 32, False, "fp32")):
        qd, qdt = (D // 2, torch.uint8) if cast.cast_fmt == "e2m1" else (D, torch.float8_e4m3fn)
        sdt = {"ue8m0": torch.uint8, "e4m3": torch.float8_e4m3fn}.get(cast.sf_format, torch.float32)
        ng = D // cast.num_per_channels
        item = torch.empty((), dtype=sdt).element_size()
        spec = Spec("fused", x=random_bf16((n, 2, D), seed=14), stage_kw=stages(D, 14), cast=cast,
                    contiguous=[((n, 2, qd + 32), qdt, (slice(None), slice(None), slice(0, qd))),
                                ((n, 3, (ng + 4) * item), sdt, (slice(None), slice(0, 2), slice(0, ng)))])
        yield f"contiguous {cast.cast_fmt}/{cast.num_per_channels}/{cast.sf_format}, padded q/sf", spec


def fast_chain_cases(large):
    """The bench's write chain (norm, NEOX RoPE on the last 64, no Hadamard, no stage copy) that the
    Gluon fast paths take (kvfuse/kernels/gluon/*.py: MAIN_FP8 / MAIN_FP4 and the FlashMLA formats at
    every size, the index formats from 2 rows, the plain kernel otherwise): adversarial slots and positions, non-finite
    rows, a cache ending at its allocation's end (base +0 / +4: the fast paths where their alignment
    allows; +2: the plain kernel), every launch-table row and a large batch."""
    kw = dict(hadamard=False, rope_dim=64, neox=True, out_stage=None)
    P = 24
    for fmt in (formats.MAIN_FP8, formats.MAIN_FP4, formats.FLASHMLA_V32, formats.FLASHMLA_MODEL1,
                formats.INDEX_MXFP4, formats.INDEX_NVFP4, formats.INDEX_FP8_FP32, formats.INDEX_MXFP8):
        D, name = fmt.head_dim, f"fast chain {fmt.name}"
        for dt in (torch.int32, torch.int64):
            s = adversarial_slots(12, dt)
            yield f"{name} adversarial slots {str(dt)[6:]}", fused_spec(fmt, s.numel(), 1, 41, s, **kw)
        pos = torch.tensor([I64_MIN, I64_MAX, 2 ** 32 + 1, -1, P, 3, 17, P - 1], dtype=torch.int64)
        yield f"{name} positions out of range", fused_spec(fmt, pos.numel(), 1, 42, torch.randperm(12)[:pos.numel()],
                                                           pos=pos, P=P, **kw)
        x = random_bf16((6, 1, D), seed=43)
        x[1, 0, 3] = float("nan")
        x[3, 0, D - 1] = float("inf")
        x[4] = float("-inf")
        yield f"{name} NaN/inf rows", fused_spec(fmt, 6, 1, 43, torch.tensor([3, 11, 0, 7, 5, 9]), x=x,
                                                 bad_rows=(1, 3, 4), **kw)
        for before in (0, 4, 2):
            c = make_cache(fmt, 2, 3, 1, token_padding=24 if fmt.token_interleaved else 0, block_padding=64,
                           before=before, after=0, seed=44)
            yield f"{name} cache at the end of its allocation, base +{before}", fused_spec(
                fmt, 4, 1, 44, torch.tensor([5, 0, 2, -1]), cache=c, **kw)
        for n in [1, 700, 4099, 20000] + ([70000] if large else []):
            bs = 64
            nb = n // bs + 2
            g = torch.Generator().manual_seed(n + 45)
            slots = torch.randperm(nb * bs, generator=g)[:n]
            slots = torch.where(torch.rand(n, generator=g) < 0.1, torch.tensor(-1), slots)
            c = make_cache(fmt, nb, bs, 1, block_padding=32, after=0, seed=n)
            yield f"{name} n={n}", fused_spec(fmt, n, 1, n + 45, slots, pos=torch.randint(-2, 66, (n,), generator=g),
                                              cache=c, **kw)


def fast_q_cases(large):
    """The index kernel's contiguous path (indexer CONTIG: the (q, sf) of a cast without a cache,
    x [n, H, 128], NEOX RoPE on columns 64..127, norm optional): 64 heads with positions out of range,
    NaN/inf rows, padded q / sf rows, both launch-table regimes of a large batch."""
    P = 24
    for fmt in (formats.INDEX_MXFP4, formats.INDEX_NVFP4, formats.INDEX_FP8_FP32, formats.INDEX_MXFP8):
        cast = CastArgs.from_cache_format(fmt)
        qd, qdt = (64, torch.uint8) if cast.cast_fmt == "e2m1" else (128, torch.float8_e4m3fn)
        sdt = {"ue8m0": torch.uint8, "e4m3": torch.float8_e4m3fn}.get(cast.sf_format, torch.float32)
        ng = 128 // cast.num_per_channels
        item = torch.empty((), dtype=sdt).element_size()             # the buffers are bytes, viewed as sdt
        name = f"fast chain Q {fmt.name}"

        def spec(n, H, seed, pos, norm=False, x=None, pad=0, bad_rows=()):
            x = random_bf16((n, H, 128), seed=seed) if x is None else x
            return Spec("fused", x=x, stage_kw=stages(128, seed, norm=norm, hadamard=False),
                        rope=(pos, cos_sin_cache(P, 64), 64, True, None, False), cast=cast,
                        contiguous=[((n, H, qd + pad), qdt, (slice(None), slice(None), slice(0, qd))),
                                    ((n, H, (ng + pad) * item), sdt, (slice(None), slice(None), slice(0, ng)))],
                        bad_rows=bad_rows)
        pos = torch.tensor([I64_MIN, I64_MAX, 2 ** 32 + 1, -1, P, 3, 17, P - 1], dtype=torch.int64)
        yield f"{name} 64 heads, positions out of range", spec(8, 64, 51, pos)
        x = random_bf16((6, 4, 128), seed=52)
        x[1, 0, 3] = float("nan")
        x[3, 2, 127] = float("inf")
        x[4] = float("-inf")
        yield f"{name} NaN/inf rows, norm, padded rows", spec(6, 4, 52, torch.arange(6) % P, norm=True, x=x, pad=8,
                                                           bad_rows=(1, 3, 4))
        for n in [1, 300] + ([1100] if large else []):
            g = torch.Generator().manual_seed(n + 53)
            yield f"{name} 64 heads n={n}", spec(n, 64, n + 53, torch.randint(-2, P + 2, (n,), generator=g))


def force_config_cases():
    try:
        from kvfuse.kernels.config import force_config
    except ImportError:
        print("note: kvfuse.kernels.config.force_config not found; launch-configuration cases skipped")
        return
    fmt = formats.FLASHMLA_V32
    n = 37
    for bm, nw in ((1, 1), (1, 4), (2, 2), (4, 8), (16, 4), (32, 1), (128, 8)):
        spec = fused_spec(fmt, n, 2, 20, torch.randperm(48)[:n], cache=make_cache(fmt, 6, 8, 2, seed=20),
                          out_stage="cast_back")
        yield f"FLASHMLA_V32 H=2 n={n} force_config(block_m={bm}, num_warps={nw})", spec, force_config(bm, nw)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer cases")
    ap.add_argument("--no-large", action="store_true", help="skip the 2.2 GB cache and n = 70000")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--only", default=None, help="only the cases whose name starts with this")
    a = ap.parse_args(argv)
    large = not a.no_large and DEV == "cuda"
    print(f"device: {DEV}" + (f" ({torch.cuda.get_device_name()})" if DEV == "cuda" else " (Triton interpreter)")
          + f", torch {torch.__version__}", flush=True)
    cases = []
    for fmt in FORMATS:
        cases += [(nm, sp, None) for nm, sp in per_format_cases(fmt, a.quick)]
    cases += [(nm, sp, None) for nm, sp in batch_cases(large)]
    cases += [(nm, sp, None) for nm, sp in layout_cases()]
    cases += [(nm, sp, None) for nm, sp in fast_chain_cases(large)]
    cases += [(nm, sp, None) for nm, sp in fast_q_cases(large)]
    if not a.quick:
        cases += list(force_config_cases())
    if large:
        nm, sp = large_cache_case()
        cases.append((nm, sp, "gpu-ref"))
    if a.only:
        cases = [c for c in cases if c[0].startswith(a.only)]
    if a.list:
        print("\n".join(c[0] for c in cases))
        return 0
    t0 = time.time()
    for name, spec, extra in cases:
        if extra == "gpu-ref":
            check(name, spec, ref_dev=DEV)
        elif extra is not None:
            with extra:
                check(name, spec)
        else:
            check(name, spec)
    r = RESULTS
    print(f"\n{r['cases']} cases in {time.time() - t0:.0f}s: {r['diff_cases']} with differing bytes "
          f"({r['diff_bytes']} bytes), {r['errors']} raised", flush=True)
    return 2 if r["errors"] else (1 if r["diff_cases"] else 0)


if __name__ == "__main__":
    sys.exit(main())
