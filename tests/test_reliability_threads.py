"""Calls from several threads at once (SPEC §9): safe on every backend. Triton's interpreter is not
thread-safe (it patches triton.language globally while a launch runs), so kvfuse serializes its
launches when the kernels are interpreted; compiled kernels take no lock.

Each thread runs the REAL kernels (fused write into a guarded cache with a stage copy, (q, sf)
into preallocated outputs, store_kv_cache, load_paged_kv_cache) on its own data, several times,
all threads released together; every thread's whole cache storage, outputs and loads must equal
the same work done by one thread alone.
"""
from __future__ import annotations

import contextlib
import threading

import pytest
import torch

import kvfuse
from kvfuse import CastArgs, ContiguousOutArgs, KVCacheOutArgs, NormArgs, RopeArgs, formats
from kvfuse import reference as R
from helpers import cos_sin_cache, guarded_cache, poison_like, random_bf16

THREADS = 4
REPEATS = 2
FORMATS = (formats.INDEX_MXFP8, formats.MAIN_FP4, formats.FLASHMLA_V32, formats.INDEX_BF16)


def _on(device, cache, storage):
    """(cache, storage) moved to ``device``, the cache still a view of the storage."""
    if device == "cpu":
        return cache, storage
    storage = storage.to(device)
    return torch.as_strided(storage, cache.shape, cache.stride(), cache.storage_offset()), storage


def work(k: int, backend: str, start: threading.Barrier = None, device: str = "cpu", stream=None):
    """Thread k's calls (on ``device``, inside ``stream`` if given); returns the bytes it produced
    (cache storages, outputs, loads), on the CPU."""
    fmt = FORMATS[k % len(FORMATS)]
    D, n = fmt.head_dim, 5
    x = random_bf16((n, D), seed=10 + k)
    cache, storage = guarded_cache(fmt, 2, 4, seed=20 + k)
    store_cache, store_storage = guarded_cache(fmt, 2, 4, seed=30 + k)
    slots = torch.tensor([5, -1, 0, 7, 2 + k % 3])
    out = poison_like(x)
    g = torch.Generator().manual_seed(k)
    kw = dict(norm_args=NormArgs((torch.rand(D, generator=g) + 0.5).to(torch.bfloat16)),
              rope_args=RopeArgs(torch.arange(n) * 3, cos_sin_cache(16, 64), 64, k % 2 == 0))
    q_out = torch.empty((n, 128), dtype=torch.float8_e4m3fn)
    sf_out = torch.empty((n, 4), dtype=torch.uint8)
    if device != "cpu":
        cache, storage = _on(device, cache, storage)
        store_cache, store_storage = _on(device, store_cache, store_storage)
        x, slots, out, q_out, sf_out = (t.to(device) for t in (x, slots, out, q_out, sf_out))
        kw = dict(norm_args=NormArgs(kw["norm_args"].weight.to(device)),
                  rope_args=RopeArgs(kw["rope_args"].positions.to(device), kw["rope_args"].cos_sin_cache.to(device),
                                     64, k % 2 == 0))
    qd = fmt.quant_dim
    if fmt.quantized:
        q, sf = R.quantize(x[:, :qd], fmt.cast_fmt, fmt.elements_per_sf, fmt.sf_format)
    else:
        q, sf = x, None
    tail = x[:, qd:] if fmt.bf16_tail else None
    if start is not None:
        start.wait()
    loads = []
    ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
    with kvfuse.use_backend(backend), ctx:
        for _ in range(REPEATS):
            kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(
                x, cast_args=CastArgs.from_cache_format(fmt),
                out_args=KVCacheOutArgs(cache, slots, out=out, out_stage="transform", layout=fmt), **kw)
            kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(
                x[:, :128], cast_args=CastArgs("e4m3", 32, True, "ue8m0"), out_args=ContiguousOutArgs(q_out, sf_out))
            kvfuse.store_kv_cache(q, sf, store_cache, slots, fmt, tail)
            loads.append(kvfuse.load_paged_kv_cache(cache, slots, fmt))
    if stream is not None:
        stream.synchronize()
    return [t.cpu() for t in [storage, store_storage, out.view(torch.uint8), q_out.view(torch.uint8), sf_out]
            + [y.view(torch.uint8) for y in loads]]


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_threads_write_what_one_thread_writes(backend):
    """Regression: 4 threads on the triton backend under TRITON_INTERPRET=1 raised InterpreterError
    ('Did you forget to add @triton.jit ?') and left partial writes."""
    run_threads(backend)


def run_threads(backend, device="cpu", streams=None):
    """THREADS threads released together (each on its own stream if given) against one thread alone."""
    alone = [work(k, backend, device=device) for k in range(THREADS)]
    results, errors = [None] * THREADS, []
    start = threading.Barrier(THREADS)

    def run(k):
        try:
            results[k] = work(k, backend, start, device, None if streams is None else streams[k])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append((k, e))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    names = ["fused cache storage", "store cache storage", "out", "q", "sf"] + [f"load {i}" for i in range(REPEATS)]
    for k in range(THREADS):
        for name, got, want in zip(names, results[k], alone[k]):
            assert torch.equal(got, want), f"thread {k}: {name} differs from the single-threaded run"


def test_lock_only_in_the_interpreter(monkeypatch):
    """Compiled kernels get the kernels' entry points themselves (no lock on their path); interpreted
    ones a wrapper whose launches share one process-wide lock."""
    from kvfuse import dispatch
    from kvfuse.kernels import router as kernels
    monkeypatch.setattr(dispatch, "_kernels", None)
    monkeypatch.setattr(kernels, "INTERPRET", False)
    plain = dispatch.kernels()
    assert not isinstance(plain, dispatch._InterpreterLaunches) and plain.run_plan is kernels.run_plan
    monkeypatch.setattr(dispatch, "_kernels", None)
    monkeypatch.setattr(kernels, "INTERPRET", True)
    wrapped = dispatch.kernels()
    assert isinstance(wrapped, dispatch._InterpreterLaunches)
    assert wrapped._lock is dispatch._InterpreterLaunches(plain)._lock
