"""kvfuse.mla's cache writes keyed from their raw arguments (write_main_cache, write_indexer_k: a repeated
call finds its launch in the plan cache without building argument objects, kvfuse.plans.fused.prepare_keyed).

- a repeated call is a hit, and writes the bytes the call writes with the plan cache off (the whole
  guarded cache storage and the out_stage output compared), on the reference backend and the kernel;
- after a valid call warmed the cache, a call that differs from it in one thing only raises what it
  raises with the cache off (type and message): another dtype, shape, stride or device of any tensor,
  a non-contiguous row, a slot_mapping of another dtype, an out that overlaps the cache (a data-pointer
  check: the key does not hold pointers), another format, a configuration without an indexer, an
  unhashable out_stage;
- a configuration that differs in a field the call reads is a miss and writes its own bytes; a subclass
  of MLAConfig is not keyed.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import kvfuse
from kvfuse import backend as kv_backend
from kvfuse import formats as F
from kvfuse import mla
from kvfuse import models as M
from kvfuse.plans import cache as kv_plan

from helpers import cos_sin_cache, guarded_cache, random_bf16
from test_plan_cache import _error, _fresh_cache, counts  # noqa: F401 (_fresh_cache: the autouse fixture)

N = 5
SLOTS = [3, 0, -1, 9, 6]
BF16 = torch.bfloat16


def _weight(d, seed, dtype=BF16):
    g = torch.Generator().manual_seed(seed)
    return (1.0 + 0.25 * torch.randn(d, generator=g)).to(dtype)


def _v4(**kw):
    """write_main_cache of DeepSeek V4 (MAIN_FP8, one [n, 512] tensor): its keyword arguments."""
    cache, _ = guarded_cache(F.MAIN_FP8, 3, 4, seed=1)
    return dict(cfg=M.DEEPSEEK_V4, kv=random_bf16((N, 512), 2), positions=torch.tensor([1, 7, 0, 30, 12]),
                cos_sin=cos_sin_cache(64, 64), norm_weight=_weight(512, 3), kv_cache=cache,
                slot_mapping=torch.tensor(SLOTS), **kw)


def _v3(**kw):
    """write_main_cache of DeepSeek V3 from (kv_c, k_pe) views of one [n, 576] buffer (FLASHMLA_V32)."""
    buf = random_bf16((N, 576), 4)
    cache, _ = guarded_cache(F.FLASHMLA_V32, 3, 4, seed=5)
    return dict(cfg=M.DEEPSEEK_V3, kv=(buf[:, :512], buf[:, 512:]), positions=torch.tensor([2, 9, 4, 0, 63]),
                cos_sin=cos_sin_cache(64, 64), norm_weight=_weight(512, 6), kv_cache=cache,
                slot_mapping=torch.tensor(SLOTS), **kw)


def _v32_index(**kw):
    """write_indexer_k of DeepSeek V3.2 (LayerNorm with bias, Hadamard, INDEX_FP8_FP32)."""
    cache, _ = guarded_cache(M.DEEPSEEK_V32.index_format, 3, 4, seed=7)
    return dict(cfg=M.DEEPSEEK_V32, k=random_bf16((N, 128), 8), positions=torch.tensor([5, 1, 2, 40, 3]),
                cos_sin=cos_sin_cache(64, 64), norm_weight=_weight(128, 9), kv_cache=cache,
                slot_mapping=torch.tensor(SLOTS), norm_bias=_weight(128, 10) - 1, **kw)


WRITES = {"v4_main": (mla.write_main_cache, _v4), "v3_kv_c_k_pe": (mla.write_main_cache, _v3),
          "v32_indexer_k": (mla.write_indexer_k, _v32_index)}


def _cold_and_warm_errors(fn, good, bad):
    """The error of fn(**bad) with the cache off, and after fn(**good) warmed it (twice: a hit)."""
    kv_plan.set_plan_cache(False)
    cold = _error(lambda: fn(**bad))
    kv_plan.set_plan_cache(True)
    fn(**good)
    fn(**good)
    hits = counts()[0]
    warm = _error(lambda: fn(**bad))
    assert hits >= 1
    return cold, warm


# =============================================================================== hits, bytes
@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("write", list(WRITES))
def test_a_repeated_write_is_a_hit_and_writes_the_same_bytes(write, backend):
    if backend == "triton" and not kv_backend.interpreter_enabled():
        pytest.skip("CPU tensors through the Triton kernel need TRITON_INTERPRET=1")
    fn, make = WRITES[write]
    stored = []
    with kvfuse.use_backend(backend):
        for cache_on in (False, True, True):
            kv_plan.set_plan_cache(cache_on)
            args = make(out=torch.empty(N, 576 if write == "v3_kv_c_k_pe" else
                                        (512 if write == "v4_main" else 128), dtype=BF16), out_stage="transform")
            storage = args["kv_cache"]._base      # guarded_cache's storage: the cache is a view into it
            assert fn(**args) is args["out"]
            stored.append((storage.clone(), args["out"].clone()))
    # the first call misses its raw arguments' key and the entry's own key (validated once, stored under
    # both), the second finds the first
    assert counts() == (1, 2) and kv_plan.plan_cache_info().size == 2
    for storage, out in stored[1:]:
        assert torch.equal(storage, stored[0][0]) and torch.equal(out.view(torch.int16), stored[0][1].view(torch.int16))


def test_write_draft_kv_and_model1_go_through_the_keyed_write():
    cfg = M.DEEPSEEK_V4_FLASHMLA
    cache, storage = guarded_cache(F.FLASHMLA_MODEL1, 3, 4, seed=1)
    args = (cfg, random_bf16((N, 512), 2), torch.arange(N), cos_sin_cache(64, 64), _weight(512, 3), cache,
            torch.tensor(SLOTS))
    mla.write_flashmla_model1(*args)
    mla.write_flashmla_model1(*args)
    assert counts() == (1, 2)


# =============================================================================== one difference from a warm call
def _strided_rows(t):
    """t's values with stride(-1) == 2 (a non-contiguous last dim)."""
    wide = torch.zeros(t.shape[:-1] + (2 * t.shape[-1],), dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


def _overlapping_out(cache, shape):
    """A contiguous bf16 tensor of ``shape`` over the first bytes of ``cache`` (a view into guarded_cache's
    storage): an out that overlaps it."""
    storage = cache._base
    start = cache.storage_offset() - storage.storage_offset()
    return storage[start:start + 2 * shape[0] * shape[1]].view(BF16).view(shape)


def _variants(write):
    """(name, a function of the warm call's arguments -> the arguments of a call that differs in one thing)."""
    x = "k" if write == "v32_indexer_k" else "kv"
    dim = {"v4_main": 512, "v3_kv_c_k_pe": 576, "v32_indexer_k": 128}[write]

    def on_x(f):
        def change(a):
            v = a[x]
            return {**a, x: tuple(map(f, v)) if isinstance(v, tuple) else f(v)}
        return change

    return [
        ("x fp16", on_x(lambda t: t.to(torch.float16))),
        ("x strided rows", on_x(_strided_rows)),
        ("x of other tokens", on_x(lambda t: t[:N - 1])),
        ("x on meta", on_x(lambda t: t.to("meta"))),
        ("norm weight fp16", lambda a: {**a, "norm_weight": a["norm_weight"].to(torch.float16)}),
        ("norm weight shape", lambda a: {**a, "norm_weight": a["norm_weight"][:64]}),
        ("norm weight strided", lambda a: {**a, "norm_weight": _strided_rows(a["norm_weight"])}),
        ("norm weight a list", lambda a: {**a, "norm_weight": a["norm_weight"].tolist()}),
        ("positions fp32", lambda a: {**a, "positions": a["positions"].float()}),
        ("positions of other tokens", lambda a: {**a, "positions": a["positions"][:2]}),
        ("cos_sin fp16", lambda a: {**a, "cos_sin": a["cos_sin"].to(torch.float16)}),
        ("cos_sin strided", lambda a: {**a, "cos_sin": _strided_rows(a["cos_sin"])}),
        ("slot_mapping int16", lambda a: {**a, "slot_mapping": a["slot_mapping"].to(torch.int16)}),
        ("slot_mapping float", lambda a: {**a, "slot_mapping": a["slot_mapping"].float()}),
        ("slot_mapping 2-d", lambda a: {**a, "slot_mapping": a["slot_mapping"][:, None]}),
        ("kv_cache int8", lambda a: {**a, "kv_cache": a["kv_cache"].view(torch.int8)}),
        ("kv_cache of another format", lambda a: {**a, "kv_cache": guarded_cache(F.MAIN_FP4, 3, 4)[0]}),
        ("out overlaps kv_cache", lambda a: {**a, "out": _overlapping_out(a["kv_cache"], (N, dim)),
                                             "out_stage": "transform"}),
        ("out fp32", lambda a: {**a, "out": torch.empty(N, dim), "out_stage": "transform"}),
        ("out without its stage", lambda a: {**a, "out": torch.empty(N, dim, dtype=BF16)}),
        ("out_stage unknown", lambda a: {**a, "out": torch.empty(N, dim, dtype=BF16), "out_stage": "rope"}),
        ("out_stage unhashable", lambda a: {**a, "out": torch.empty(N, dim, dtype=BF16), "out_stage": ["norm"]}),
    ]


@pytest.mark.parametrize("write", list(WRITES))
def test_a_call_that_differs_in_one_thing_raises_as_with_the_cache_off(write):
    fn, make = WRITES[write]
    failures = []
    for name, change in _variants(write):
        kv_plan.clear_plan_cache()
        good = make()
        cold, warm = _cold_and_warm_errors(fn, good, change(good))
        if cold != warm:
            failures.append((name, cold, warm))
    assert not failures, failures


@pytest.mark.parametrize("write", list(WRITES))
def test_an_accepted_call_that_differs_in_one_thing_writes_its_own_bytes(write):
    """Differences validation accepts (another index dtype, strided index vectors, a bf16 table): after a
    warm call, each writes what it writes with the cache off."""
    fn, make = WRITES[write]
    changes = [{"slot_mapping": torch.tensor(SLOTS, dtype=torch.int32)},
               {"slot_mapping": _strided_rows(torch.tensor(SLOTS))},
               {"positions": _strided_rows(make()["positions"])},
               {"positions": make()["positions"].to(torch.int32)},
               {"cos_sin": cos_sin_cache(64, 64, dtype=BF16)}]
    for change in changes:
        written = []
        for cache_on in (False, True):
            kv_plan.set_plan_cache(cache_on)
            fn(**make())                  # warm: the signature of the unchanged call
            args = {**make(), **change}
            fn(**args)
            written.append(args["kv_cache"]._base.clone())
        assert torch.equal(written[0], written[1]), change


def test_the_aliasing_check_reads_each_calls_pointers():
    """The same signature (dtype, shape, strides, device, alignment) once with an out of its own, then with
    an out over the cache's bytes: the second raises (the key holds no pointer)."""
    good = _v4(out=torch.empty(N, 512, dtype=BF16), out_stage="norm")
    mla.write_main_cache(**good)
    mla.write_main_cache(**good)
    bad = {**good, "out": _overlapping_out(good["kv_cache"], (N, 512))}
    assert bad["out"].stride() == good["out"].stride()
    with pytest.raises(ValueError, match="overlap"):
        mla.write_main_cache(**bad)
    assert counts()[0] == 2          # the bad call was a hit: the check ran on its pointers


@pytest.mark.parametrize("cfg", [M.DEEPSEEK_V3, M.DEEPSEEK_V4])
def test_configuration_errors_as_with_the_cache_off(cfg):
    """After a valid V3.2 indexer K write: V3 has no indexer; V4's indexer K norm (an RMSNorm) takes no bias."""
    good = _v32_index()
    cold, warm = _cold_and_warm_errors(mla.write_indexer_k, good, {**good, "cfg": cfg})
    assert cold is not None and cold == warm


# =============================================================================== configurations
@pytest.mark.parametrize("change", [dict(norm_eps=1e-2), dict(rope_is_neox=True)])
def test_a_configuration_that_differs_is_a_miss_with_its_own_bytes(change):
    other = dataclasses.replace(M.DEEPSEEK_V4, **change)
    outs = {}
    for cache_on in (False, True):
        kv_plan.set_plan_cache(cache_on)
        for cfg in (M.DEEPSEEK_V4, other):
            a = _v4(out=torch.empty(N, 512, dtype=BF16), out_stage="transform")
            mla.write_main_cache(**{**a, "cfg": cfg})
            outs[cache_on, cfg is other] = a["out"].view(torch.int16)
    assert counts() == (0, 4)        # each configuration misses both keys
    assert torch.equal(outs[True, False], outs[False, False]) and torch.equal(outs[True, True], outs[False, True])
    assert not torch.equal(outs[True, False], outs[True, True])


def test_an_int_eps_is_keyed_apart_from_a_float_one():
    for eps in (1.0, 1, 1.0):
        mla.write_main_cache(**{**_v4(), "cfg": dataclasses.replace(M.DEEPSEEK_V4, norm_eps=eps)})
    assert counts() == (1, 4)


def test_a_subclass_of_mlaconfig_is_not_keyed():
    @dataclasses.dataclass(frozen=True)
    class Config(mla.MLAConfig):
        pass

    cfg = Config(**{f.name: getattr(M.DEEPSEEK_V4, f.name) for f in dataclasses.fields(mla.MLAConfig)})
    for _ in range(2):
        mla.write_main_cache(**{**_v4(), "cfg": cfg})
    # only the entry's own key: a miss, then a hit (no key of the raw arguments stored)
    assert counts() == (1, 1) and kv_plan.plan_cache_info().size == 1
