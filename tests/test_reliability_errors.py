"""Reliability of error reporting and of what holds without the data checks (SPEC §9).

- Under ``torch.compile(fullgraph=True)`` a bad argument is reported by Dynamo as
  ``torch._dynamo.exc.Unsupported`` ("Observed exception"), whose message holds the real
  TypeError/ValueError (``raised exception TypeError('norm_args.weight: ...')``) and whose
  ``__cause__`` is Dynamo's ``ObservedTypeError`` / ``ObservedValueError``; nothing is written.
  Without ``fullgraph`` Dynamo falls back to eager and the original exception comes through.
  kvfuse cannot change this: the exception is raised inside traced code, and Dynamo turns every
  exception that leaves a fullgraph region into Unsupported.
- Duplicate valid slots: with ``KVFUSE_CHECKS=1`` the call raises ValueError before any write; with
  the checks off, every byte outside the duplicated records is exact and every byte of a duplicated
  record comes from one of the rows that map to it (which row wins is unspecified, and a record may
  mix rows: one row's values with another row's scales).
"""
from __future__ import annotations

import pytest
import torch

import kvfuse
from kvfuse import CastArgs, KVCacheOutArgs, NormArgs, formats
from kvfuse import backend as kv_backend
from kvfuse import reference as R
from helpers import guarded_cache, poison_like, random_bf16, record_regions
from test_reliability_memory import as_bytes, oracle, storage_of

BACKENDS = ("reference", "triton")
fused = kvfuse.fused_norm_rope_hadamard_cast_store_kvcache


@pytest.fixture
def checks(monkeypatch):
    monkeypatch.setattr(kv_backend, "_checks_override", None)
    monkeypatch.delenv("KVFUSE_CHECKS", raising=False)
    return monkeypatch


# =========================================================================== torch.compile(fullgraph=True)
def _compiled_bad_call(fullgraph):
    fmt = formats.INDEX_MXFP8
    cache, storage = guarded_cache(fmt, 2, 4, seed=1)
    before = storage.clone()
    x = random_bf16((3, 128), seed=2)

    def step(x, w, slots):
        return fused(x, norm_args=NormArgs(w), cast_args=CastArgs.from_cache_format(fmt),
                     out_args=KVCacheOutArgs(cache, slots, layout=fmt))

    torch._dynamo.reset()
    try:
        with pytest.raises(Exception) as info:
            torch.compile(step, fullgraph=fullgraph, backend="eager")(x, torch.ones(128, dtype=torch.float16),
                                                                      torch.arange(3))
    finally:
        torch._dynamo.reset()
    assert torch.equal(storage, before), "a rejected call wrote something"
    return info.value


def test_compile_fullgraph_reports_the_real_error_inside_unsupported():
    """The exact behaviour documented in docs/reliability.md (fullgraph=True): Unsupported, with the
    TypeError's text in its message and an ObservedTypeError as its cause."""
    err = _compiled_bad_call(fullgraph=True)
    assert isinstance(err, torch._dynamo.exc.Unsupported), type(err)
    assert "raised exception TypeError('norm_args.weight: expected dtype torch.bfloat16 or torch.float32, " \
           "got torch.float16')" in str(err)
    assert type(err.__cause__).__name__ == "ObservedTypeError"


def test_compile_without_fullgraph_raises_the_original_error():
    err = _compiled_bad_call(fullgraph=False)
    assert type(err) is TypeError and "norm_args.weight" in str(err)


# =========================================================================== duplicate valid slots
def _dup_setup(fmt, seed=0):
    n = 5
    x = random_bf16((n, fmt.head_dim), seed=seed)
    cache, storage = guarded_cache(fmt, 2, 4, seed=seed + 1)
    slots = torch.tensor([3, 6, 3, -1, 6])                # rows 0 and 2 -> slot 3, rows 1 and 4 -> slot 6
    out = poison_like(x)
    kw = dict(x=x, norm_args=NormArgs(torch.ones(fmt.head_dim)), cast_args=CastArgs.from_cache_format(fmt),
              out_args=KVCacheOutArgs(cache, slots, out=out, out_stage="transform", layout=fmt))
    return kw, cache, storage, out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", [formats.MAIN_FP8, formats.FLASHMLA_V32, formats.INDEX_NVFP4],
                         ids=lambda f: f.name)
def test_duplicate_valid_slots_with_checks_on_raise_before_any_write(backend, fmt, checks):
    kvfuse.set_checks(True)
    kw, cache, storage, out = _dup_setup(fmt)
    before, out_before = storage.clone(), as_bytes(out).clone()
    with pytest.raises(ValueError, match="duplicate valid slots"), kvfuse.use_backend(backend):
        fused(**kw)
    assert torch.equal(storage, before) and torch.equal(as_bytes(out), out_before)
    # store_kv_cache too
    y = random_bf16((5, 1, fmt.head_dim), seed=3)
    qd = fmt.quant_dim
    q, sf = R.quantize(y[..., :qd], fmt.cast_fmt, fmt.elements_per_sf, fmt.sf_format)
    tail = y[..., qd:] if fmt.bf16_tail else None
    with pytest.raises(ValueError, match="duplicate valid slots"), kvfuse.use_backend(backend):
        kvfuse.store_kv_cache(q, sf, cache, kw["out_args"].slot_mapping, fmt, tail)
    assert torch.equal(storage, before)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", [formats.MAIN_FP8, formats.FLASHMLA_V32, formats.INDEX_NVFP4],
                         ids=lambda f: f.name)
def test_duplicate_valid_slots_with_checks_off(backend, fmt, checks):
    """What holds with the checks off: every byte outside the duplicated records is exact (the other
    records, reserved bytes, padding, guards, and the stage copy of every row); each byte of a duplicated
    record is that byte of the record of one of the rows mapped to it."""
    assert not kvfuse.checks_enabled()
    kw, cache, storage, out = _dup_setup(fmt)
    slots = kw["out_args"].slot_mapping
    # the record each row would write, alone
    candidates = {}
    for row, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        one = dict(kw, out_args=KVCacheOutArgs(cache, torch.tensor([s if r == row else -1 for r in range(5)]),
                                               layout=fmt))
        candidates.setdefault(s, []).append(oracle(**one)["storage"])
    with kvfuse.use_backend(backend):
        fused(**kw)
    exp_out = oracle(**kw)["out"]
    assert torch.equal(as_bytes(out), as_bytes(exp_out)), "stage copy"
    flat = storage_of(cache)
    nb, bs = cache.shape[:2]
    in_dup = torch.zeros_like(flat, dtype=torch.bool)
    for s in candidates:
        for st, ln in record_regions(fmt, bs, cache.stride(0), cache.stride(1), cache.storage_offset(),
                                     s // bs, s % bs).values():
            in_dup[st:st + ln] = True
    # outside the duplicated records: what was there (only duplicated slots are valid here)
    assert torch.equal(flat[~in_dup], candidates[3][0][~in_dup]), "bytes outside the duplicated records"
    for s, recs in candidates.items():
        for st, ln in record_regions(fmt, bs, cache.stride(0), cache.stride(1), cache.storage_offset(),
                                     s // bs, s % bs).values():
            got = flat[st:st + ln]
            ok = torch.zeros(ln, dtype=torch.bool)
            for rec in recs:
                ok |= got == rec[st:st + ln]
            assert bool(ok.all()), f"slot {s}: a byte that no row mapped to it would write"
