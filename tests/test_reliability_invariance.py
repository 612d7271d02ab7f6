"""Reliability, determinism and batch invariance (SPEC §6 invariants, §9 checks).

A row's bytes (its cache record, its q/sf or bf16 output, its stage copy) depend only on that
row's inputs: never on n, its place in the batch, the other rows (even NaN/inf ones), the
num_heads arrangement ([n, H, D] vs the same rows as [n*H, 1, D]), strides (padded rows/heads,
broadcast x, strided positions/slots/cos_sin, padded outputs), the launch configuration
(kvfuse.kernels.config.force_config: rows per program, warps), repeated runs or the backend.
Every triton result is compared with the reference backend's bytes for the same rows.

KVFUSE_CHECKS=1 / kvfuse.set_checks(True): positions out of range and duplicate valid slots raise
ValueError before anything is written; off by default. The checks state is restored after each test.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import pytest
import torch

import kvfuse
from kvfuse import (CastArgs, ContiguousOutArgs, HadamardArgs, KVCacheFormat, KVCacheOutArgs, NormArgs, RopeArgs,
                    formats)
from kvfuse import backend as kv_backend
from kvfuse import reference as R
from kvfuse.kernels import config as kernel_config
from helpers import cos_sin_cache, guarded_cache, random_bf16
from test_reliability_memory import as_bytes, assert_same, assert_storage, storage_of

fused = kvfuse.fused_norm_rope_hadamard_cast_store_kvcache
P = 48                     # max_position of the cos/sin tables


@dataclasses.dataclass(frozen=True)
class Cfg:
    name: str
    fmt: Optional[KVCacheFormat]        # None: contiguous destination
    H: int
    D: int
    norm: bool = True
    rope: Optional[tuple] = (64, None, True, False)     # rotary_dim, offset, is_neox, conjugate
    had: bool = False
    cast: Optional[tuple] = None         # contiguous: (cast_fmt, g, sf_format, cast_back)
    stage: Optional[str] = None          # cache: out_stage of the bf16 copy


CONFIGS = [
    Cfg("MAIN_FP8-H2-norm-rope-had", formats.MAIN_FP8, 2, 512, had=True, stage="cast_back"),
    Cfg("MAIN_FP4-norm-rope-interleaved-conj", formats.MAIN_FP4, 1, 512, rope=(64, None, False, True), stage="norm"),
    Cfg("INDEX_NVFP4-rope-head-had", formats.INDEX_NVFP4, 1, 128, norm=False, rope=(32, 0, True, False), had=True,
        stage="transform"),
    Cfg("INDEX_FP8_FP32-norm-had", formats.INDEX_FP8_FP32, 1, 128, rope=None, had=True, stage="cast_back"),
    Cfg("FLASHMLA_V32-H2-norm-rope", formats.FLASHMLA_V32, 2, 576, stage="cast_back"),
    Cfg("FLASHMLA_MODEL1-norm-rope", formats.FLASHMLA_MODEL1, 1, 512, stage="transform"),
    Cfg("INDEX_BF16-norm-rope-had", formats.INDEX_BF16, 1, 128, had=True, stage="norm"),
    Cfg("contig-e2m1-mx-D64-H3", None, 3, 64, rope=(32, 16, False, False), had=True, cast=("e2m1", 32, "ue8m0", False)),
    Cfg("contig-e4m3-g16-e4m3sf-D192-H2", None, 2, 192, cast=("e4m3", 16, "e4m3", False)),
    Cfg("contig-cast_back-ue8m0fp32-D256", None, 2, 256, had=True, cast=("e4m3", 128, "ue8m0_fp32", True)),
    Cfg("contig-bf16-D96-H2", None, 2, 96, rope=(32, None, True, True)),
]
IDS = [c.name for c in CONFIGS]
TI_CONFIGS = [c for c in CONFIGS if c.fmt is not None and c.fmt.token_interleaved]


@dataclasses.dataclass
class Pool:
    """N tokens' inputs: x [N, H, D], positions [N]; the stage arguments they share."""
    x: torch.Tensor
    pos: torch.Tensor
    norm: Optional[NormArgs]
    cs: Optional[torch.Tensor]


def make_pool(cfg: Cfg, N=8, seed=0):
    g = torch.Generator().manual_seed(seed + 1)
    x = random_bf16((N, cfg.H, cfg.D), seed=seed)
    pos = torch.randint(-1, P + 1, (N,), generator=g)               # a few out-of-range positions too
    norm = NormArgs((torch.rand(cfg.D, generator=g) + 0.5).to(torch.bfloat16), 1e-6) if cfg.norm else None
    cs = cos_sin_cache(P, cfg.rope[0]) if cfg.rope else None
    return Pool(x, pos, norm, cs)


def junk_rows(cfg: Cfg, k, seed=99):
    """Other rows to mix in: huge values, NaN, inf, zeros."""
    j = random_bf16((k, cfg.H, cfg.D), seed=seed) * 1000
    j[0, ..., 1] = float("nan")
    if k > 1:
        j[1] = float("inf")
    if k > 2:
        j[2] = 0
    return j


def stage_kwargs(cfg: Cfg, pool: Pool, positions):
    kw = {}
    if cfg.norm:
        kw["norm_args"] = pool.norm
    if cfg.rope:
        r, off, neox, conj = cfg.rope
        kw["rope_args"] = RopeArgs(positions, pool.cs, r, neox, off, conj)
    if cfg.had:
        kw["hadamard_args"] = HadamardArgs(cfg.D ** -0.5)
    return kw


def contig_kwargs(cfg: Cfg):
    if cfg.cast is None:
        return {}
    fmt_, g, sff, back = cfg.cast
    return {"cast_args": CastArgs(fmt_, g, sff in ("ue8m0", "ue8m0_fp32"), sff, back)}


def run_rows(cfg: Cfg, backend, x, positions, *, nb=4, bs=8, slots=None, cache=None, out=None, q_out=None,
             sf_out=None, slot_dtype=torch.int64):
    """One call; returns per-row bytes [n][...] (cache: the record read back by slot + the stage copy;
    contiguous: q, sf or the bf16 result) and the cache storage (None for contiguous)."""
    n = x.shape[0]
    kw = dict(x=x, **stage_kwargs(cfg, POOLS[cfg.name], positions))
    if cfg.fmt is not None:
        fmt = cfg.fmt
        if cache is None:
            cache, _ = guarded_cache(fmt, nb, bs, cfg.H, seed=1)
        if slots is None:
            slots = torch.randperm(nb * bs, generator=torch.Generator().manual_seed(n))[:n].to(slot_dtype)
        if out is None and cfg.stage:
            out = torch.full(x.shape, -3.0, dtype=torch.bfloat16)
        kw.update(cast_args=CastArgs.from_cache_format(fmt),
                  out_args=KVCacheOutArgs(cache, slots, out=out, out_stage=cfg.stage, layout=fmt))
        with kvfuse.use_backend(backend):
            fused(**kw)
        data, sf = R.load(cache, slots, fmt, False)
        sf = sf[..., : fmt.sf_exact_bytes]          # not the reserved bytes: they belong to the slot
        rows = [torch.cat([data[i].reshape(-1), sf[i].reshape(-1)]
                          + ([as_bytes(out[i])] if out is not None else [])) for i in range(n)]
        return rows, storage_of(cache)
    kw.update(contig_kwargs(cfg))
    if q_out is not None or sf_out is not None:
        kw["out_args"] = ContiguousOutArgs(q_out, sf_out)
    with kvfuse.use_backend(backend):
        res = fused(**kw)
    if isinstance(res, tuple):
        return [torch.cat([as_bytes(res[0][i]), as_bytes(res[1][i])]) for i in range(n)], None
    return [as_bytes(res[i]) for i in range(n)], None


POOLS = {c.name: make_pool(c) for c in CONFIGS}


def ref_rows(cfg):
    pool = POOLS[cfg.name]
    return run_rows(cfg, "reference", pool.x, pool.pos)[0]


def assert_rows(got, want, what):
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        if not torch.equal(a, b):
            raise AssertionError(f"{what}: row {i}: {int((a != b).sum())} of {a.numel()} bytes differ")


# =========================================================================== batch invariance
@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_row_bytes_do_not_depend_on_the_batch(cfg, backend):
    """Full batch, reversed, alone (n=1), amid other (NaN/inf/huge) rows at other places, n=17."""
    pool = POOLS[cfg.name]
    want = ref_rows(cfg)
    x, pos = pool.x, pool.pos
    assert_rows(run_rows(cfg, backend, x, pos)[0], want, "full batch")
    rev = torch.arange(x.shape[0] - 1, -1, -1)
    assert_rows(run_rows(cfg, backend, x[rev], pos[rev])[0], [want[i] for i in rev.tolist()], "reversed batch")
    for i in (0, 5):
        assert_rows(run_rows(cfg, backend, x[i:i + 1], pos[i:i + 1])[0], [want[i]], f"row {i} alone")
    junk = junk_rows(cfg, 3)
    mixed_x = torch.cat([junk[:1], x[3:4], junk[1:], x[6:7]])
    mixed_p = torch.tensor([7, int(pos[3]), 2 ** 40, 0, int(pos[6])])
    got = run_rows(cfg, backend, mixed_x, mixed_p)[0]
    assert_rows([got[1], got[4]], [want[3], want[6]], "rows amid NaN/inf/huge rows")
    big = torch.arange(17) % x.shape[0]                    # n=17: each pool row again, at other places
    got = run_rows(cfg, backend, x[big], pos[big], nb=3, bs=8)[0]
    assert_rows(got, [want[i] for i in big.tolist()], "n=17 with repeated rows")


@pytest.mark.parametrize("cfg", [c for c in CONFIGS if c.fmt is None or c.fmt.token_interleaved], ids=lambda c: c.name)
def test_num_heads_arrangement(cfg):
    """[n, H, D] (positions per token) == the same rows as [n*H, 1, D] (positions repeated per head);
    for a cache, the H-head cache re-viewed as a 1-head cache of block_size*H tokens."""
    pool = POOLS[cfg.name]
    x, pos, H = pool.x, pool.pos, cfg.H
    n = x.shape[0]
    flat_x = x.reshape(n * H, 1, cfg.D)
    flat_pos = pos.repeat_interleave(H)
    if cfg.fmt is None:
        for backend in ("triton", "reference"):
            with kvfuse.use_backend(backend):
                a = fused(x, **contig_kwargs(cfg), **stage_kwargs(cfg, pool, pos))
                b = fused(flat_x, **contig_kwargs(cfg), **stage_kwargs(cfg, pool, flat_pos))
            for u, v in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
                assert_same(v.reshape(u.shape), u, f"{backend}: [n*H, 1, D] vs [n, H, D]")
        return
    fmt, nb, bs = cfg.fmt, 3, 4
    for backend in ("triton", "reference"):
        cache_h, st_h = guarded_cache(fmt, nb, bs, H, seed=2)
        cache_1, st_1 = guarded_cache(fmt, nb, bs, H, seed=2)
        assert cache_1.stride(1) == H * fmt.bytes_per_token
        view1 = torch.as_strided(st_1, (nb, bs * H, 1, fmt.bytes_per_token),
                                 (cache_1.stride(0), fmt.bytes_per_token, fmt.bytes_per_token, 1),
                                 cache_1.storage_offset())
        slots = torch.randperm(nb * bs, generator=torch.Generator().manual_seed(4))[:n]
        slots_1 = ((slots // bs) * bs * H + (slots % bs) * H)[:, None] + torch.arange(H)[None, :]
        out_h = torch.zeros(x.shape, dtype=torch.bfloat16) if cfg.stage else None
        out_1 = torch.zeros(flat_x.shape, dtype=torch.bfloat16) if cfg.stage else None
        run_rows(cfg, backend, x, pos, cache=cache_h, slots=slots, out=out_h)
        run_rows(cfg, backend, flat_x, flat_pos, cache=view1, slots=slots_1.reshape(-1), out=out_1)
        assert_storage(st_1, st_h, cache_h, fmt, what=f"{backend}: [n*H, 1, D] vs [n, H, D]")
        if cfg.stage:
            assert_same(out_1.reshape(x.shape), out_h, "stage copy")


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_strides_do_not_matter(cfg):
    """x with padded rows / padded heads / broadcast (stride 0), strided positions, slots and cos/sin
    rows, padded outputs: the same bytes as contiguous tensors."""
    pool = POOLS[cfg.name]
    want = ref_rows(cfg)
    x, pos = pool.x, pool.pos
    n, H, D = x.shape
    xr = torch.zeros(n, H, D + 48, dtype=torch.bfloat16)
    xr[..., :D] = x
    xh = torch.zeros(n, H + 2, D, dtype=torch.bfloat16)
    xh[:, 1:H + 1] = x
    pos2 = torch.zeros(2 * n, dtype=pos.dtype)
    pos2[::2] = pos
    for xv, what in ((xr[..., :D], "padded rows"), (xh[:, 1:H + 1], "padded heads")):
        assert_rows(run_rows(cfg, "triton", xv, pos2[::2])[0], want, f"{what}, strided positions")
    if cfg.rope:       # a cos/sin table with padded rows
        csw = torch.zeros(P, cfg.rope[0] + 24)
        csw[:, :cfg.rope[0]] = pool.cs
        saved = pool.cs
        pool.cs = csw[:, :cfg.rope[0]]
        try:
            assert_rows(run_rows(cfg, "triton", x, pos)[0], want, "padded cos/sin rows")
        finally:
            pool.cs = saved
    # broadcast x: every row is row 2
    xb = x[2:3].expand(n, H, D)
    assert xb.stride(0) == 0
    got = run_rows(cfg, "triton", xb, pos[2:3].expand(n))[0]
    assert_rows(got, [want[2]] * n, "broadcast x and positions (stride 0)")
    if cfg.fmt is not None:
        nb, bs = 4, 8
        cache, _ = guarded_cache(cfg.fmt, nb, bs, H, seed=1)
        sl = torch.zeros(3 * n, dtype=torch.int32)
        sl[::3] = torch.randperm(nb * bs, generator=torch.Generator().manual_seed(5))[:n].int()
        ow = torch.zeros(n, H, D + 16, dtype=torch.bfloat16)
        got = run_rows(cfg, "triton", x, pos, cache=cache, slots=sl[::3], out=ow[..., :D] if cfg.stage else None)[0]
        assert_rows(got, want, "strided int32 slots, padded out")
    elif cfg.cast is not None and not cfg.cast[3]:
        fmt_, g, sff, _ = cfg.cast
        qd = D // 2 if fmt_ == "e2m1" else D
        qdt = torch.uint8 if fmt_ == "e2m1" else torch.float8_e4m3fn
        sdt = {"ue8m0": torch.uint8, "e4m3": torch.float8_e4m3fn}.get(sff, torch.float32)
        qw = torch.zeros(n, H + 1, qd + 32, dtype=torch.uint8).view(qdt)
        sw = torch.zeros(n, H, D // g + 5, dtype=sdt)
        got = run_rows(cfg, "triton", x, pos, q_out=qw[:, :H, :qd], sf_out=sw[..., : D // g])[0]
        assert_rows(got, want, "padded q/sf outputs")


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[2], CONFIGS[4], CONFIGS[6], CONFIGS[7], CONFIGS[9]],
                         ids=lambda c: c.name)
@pytest.mark.parametrize("block_m,num_warps", [(1, 1), (2, 8), (4, 2), (16, 4), (64, None)])
def test_launch_configuration(cfg, block_m, num_warps):
    """Rows per program and warps forced through kvfuse.kernels.config.force_config."""
    pool = POOLS[cfg.name]
    with kernel_config.force_config(block_m=block_m, num_warps=num_warps):
        got = run_rows(cfg, "triton", pool.x, pool.pos)[0]
    assert_rows(got, ref_rows(cfg), f"BLOCK_M={block_m} num_warps={num_warps}")


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[5], CONFIGS[7]], ids=lambda c: c.name)
def test_repeated_runs_are_identical(cfg):
    pool = POOLS[cfg.name]
    runs = {b: [run_rows(cfg, b, pool.x, pool.pos) for _ in range(2 if b == "triton" else 3)]
            for b in ("triton", "reference")}
    first = runs["reference"][0]
    for b, rs in runs.items():
        for k, (rows, st) in enumerate(rs):
            assert_rows(rows, first[0], f"{b} run {k}")
            if st is not None:
                assert torch.equal(st, first[1]), f"{b} run {k}: cache storage"


# =========================================================================== KVFUSE_CHECKS
@pytest.fixture
def checks_state(monkeypatch):
    """Whatever a test does to the checks (env, set_checks), it is undone afterwards."""
    monkeypatch.setattr(kv_backend, "_checks_override", kv_backend._checks_override)
    monkeypatch.delenv("KVFUSE_CHECKS", raising=False)
    return monkeypatch


def _checks_call(backend, pos, slots, fmt=formats.INDEX_MXFP8):
    n = pos.numel()
    cache, storage = guarded_cache(fmt, 2, 4, seed=6)
    before = storage.clone()
    out = torch.full((n, fmt.head_dim), 2.0, dtype=torch.bfloat16)
    kw = dict(x=random_bf16((n, fmt.head_dim), seed=3), rope_args=RopeArgs(pos, cos_sin_cache(16, 32), 32, True),
              cast_args=CastArgs.from_cache_format(fmt),
              out_args=KVCacheOutArgs(cache, slots, out=out, out_stage="transform", layout=fmt))
    try:
        with kvfuse.use_backend(backend):
            fused(**kw)
    except ValueError as e:
        assert torch.equal(storage, before) and bool((out == 2.0).all()), "a rejected call wrote something"
        return e
    return None


BAD_POSITIONS = [[0, 16, 3], [-1, 2, 3], [0, 1, 2 ** 40], [0, 1, -2 ** 31]]


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("how", ["env", "set_checks"])
def test_checks_reject_positions_and_duplicate_slots(backend, how, checks_state):
    if how == "env":
        checks_state.setenv("KVFUSE_CHECKS", "1")
    else:
        kvfuse.set_checks(True)
    assert kvfuse.checks_enabled()
    ok_slots = torch.tensor([0, 5, 7])
    for bad in BAD_POSITIONS:
        e = _checks_call(backend, torch.tensor(bad), ok_slots)
        assert e is not None and "positions" in str(e), bad
    for dup in ([1, 1, 2], [7, 0, 7]):
        e = _checks_call(backend, torch.tensor([0, 1, 15]), torch.tensor(dup, dtype=torch.int32))
        assert e is not None and "slot" in str(e), dup
    # duplicates of INVALID slots, positions at the ends of the table: accepted
    assert _checks_call(backend, torch.tensor([0, 15, 15]), torch.tensor([-1, -1, 8])) is None
    assert _checks_call(backend, torch.tensor([0, 15, 15], dtype=torch.int32),
                        torch.tensor([2 ** 31 - 1, 8, 8 + 2 ** 32])) is None
    # n = 0 under checks
    assert _checks_call(backend, torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64)) is None


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_checks_off_by_default_and_set_checks_overrides_env(backend, checks_state):
    assert not kvfuse.checks_enabled()
    assert _checks_call(backend, torch.tensor(BAD_POSITIONS[0]), torch.tensor([1, 1, 2])) is None
    checks_state.setenv("KVFUSE_CHECKS", "1")
    kvfuse.set_checks(False)
    assert not kvfuse.checks_enabled()
    assert _checks_call(backend, torch.tensor(BAD_POSITIONS[2]), torch.tensor([3, 3, 3])) is None
    kvfuse.set_checks(True)
    assert _checks_call(backend, torch.tensor(BAD_POSITIONS[1]), torch.tensor([0, 1, 2])) is not None


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_checks_on_store_kv_cache(backend, checks_state):
    kvfuse.set_checks(True)
    fmt = formats.INDEX_BF16
    cache, storage = guarded_cache(fmt, 1, 4, seed=0)
    before = storage.clone()
    data = random_bf16((3, 128), seed=1)
    with pytest.raises(ValueError, match="slot"), kvfuse.use_backend(backend):
        kvfuse.store_kv_cache(data, None, cache, torch.tensor([2, 0, 2]), fmt)
    assert torch.equal(storage, before)
    with kvfuse.use_backend(backend):
        kvfuse.store_kv_cache(data, None, cache, torch.tensor([2, -1, -1]), fmt)
    assert not torch.equal(storage, before)


def test_checks_state_is_restored_between_tests():
    """Runs after the checks tests (file order): they left no override and no env behind."""
    assert kv_backend._checks_override is None or not kvfuse.checks_enabled()
