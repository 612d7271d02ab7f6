"""Reliability of outputs (SPEC §5 as amended): inference-mode and requires-grad outputs.

- Caches and outputs created under ``torch.inference_mode()`` (engines allocate there) are accepted
  outside it, on every backend: the write succeeds and equals the same call on ordinary tensors
  (the reference backend used to write the data bytes, then raise before the scales).
- An ``out`` that is a leaf with ``requires_grad=True`` is written like any buffer (no autograd
  record), on every backend.

Whole storages (poisoned or random before the call, guards included) are compared byte for byte.
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
    cache, storage = guarded_cache(fmt, 2, 4, seed=5)
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
