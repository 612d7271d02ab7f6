"""Two inputs for one row (x = (x_main, x_tail)) and a norm over the leading dims (NormArgs.weight [k],
k < head_dim), on both backends (the reference chain and the Triton kernel in the interpreter): every
call writes the bytes of the same call on ``torch.cat(x, -1)`` through the reference chain, and a
leading-dims norm equals a norm-only call on those dims followed by the rest of the chain."""
from __future__ import annotations

import pytest
import torch

import kvfuse
from kvfuse import formats as F
from kvfuse.args import CastArgs, ContiguousOutArgs, HadamardArgs, KVCacheOutArgs, NormArgs, RopeArgs

from helpers import assert_bytes_equal, cos_sin_cache, guarded_cache, random_bf16

BACKENDS = ["reference", "triton"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    with kvfuse.use_backend(request.param):
        yield request.param


def _weight(k, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(k, generator=g) * 2 + 0.25).to(dtype)


def _call(x, norm=None, rope=None, had=None, cast=None, out=None):
    return kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(x, norm, rope, had, cast, out)


def _expected(x, norm=None, rope=None, had=None, cast=None, out=None):
    """The same call on one input through the reference chain."""
    whole = torch.cat(x, dim=-1) if isinstance(x, tuple) else x
    with kvfuse.use_backend("reference"):
        return _call(whole, norm, rope, had, cast, out)


def _rope(n, rotary_dim, offset, neox, seed=3, conjugate=False):
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 64, (n,), generator=g)
    pos[0] = 70                                   # outside the table: not rotated
    return RopeArgs(pos, cos_sin_cache(64, rotary_dim), rotary_dim, neox, offset, conjugate)


def _v32_inputs(n, seed=0):
    """DeepSeek V3's projection output [n, 576] and its kv_c / k_pe views."""
    buf = random_bf16((n, 576), seed)
    return buf, buf[:, :512], buf[:, 512:]


# =============================================================================== the leading-dims norm
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_leading_norm_reference_is_the_norm_of_the_leading_dims(kind):
    """reference.norm with weight [k]: the first k dims are the norm of x[..., :k] alone, the rest x's bits."""
    x = random_bf16((9, 2, 96), 1)
    w = _weight(80, 2)
    b = _weight(80, 5) if kind == "layer" else None
    y = kvfuse.reference.norm(x, w, 1e-6, kind, b)
    assert_bytes_equal(y[..., :80], kvfuse.reference.norm(x[..., :80].contiguous(), w, 1e-6, kind, b), "normed dims")
    assert_bytes_equal(y[..., 80:], x[..., 80:], "passed through")
    assert not torch.equal(y[..., :80], x[..., :80])


def test_leading_norm_equals_two_calls(backend):
    """The V3 record in one call = the former two: a norm-only call on the latent, then RoPE + cast on the cat."""
    n = 37
    buf, kv_c, k_pe = _v32_inputs(n)
    w = _weight(512, 1)
    rope = _rope(n, 64, 512, True)
    cache, storage = guarded_cache(F.FLASHMLA_V32, 4, 16)
    slots = torch.randperm(64)[:n]
    _call((kv_c, k_pe), NormArgs(w), rope, None, CastArgs.from_cache_format(F.FLASHMLA_V32),
          KVCacheOutArgs(cache, slots, layout=F.FLASHMLA_V32))
    cache2, storage2 = guarded_cache(F.FLASHMLA_V32, 4, 16)
    with kvfuse.use_backend("reference"):
        latent = _call(kv_c, NormArgs(w))
        _call(torch.cat([latent, k_pe], -1), None, rope, None, CastArgs.from_cache_format(F.FLASHMLA_V32),
              KVCacheOutArgs(cache2, slots, layout=F.FLASHMLA_V32))
    assert_bytes_equal(storage, storage2, "one call vs norm-only call + cat + call")


# =============================================================================== against cat + reference
ROPE_PLACEMENTS = [  # (rotary_dim, offset, neox): tail, head, straddling the split and the norm's end, inside
    (32, None, True), (32, None, False), (32, 0, True), (32, 0, False), (64, 32, True), (16, 72, False),
    (96, 0, True)]


@pytest.mark.parametrize("rotary_dim,offset,neox", ROPE_PLACEMENTS)
@pytest.mark.parametrize("split,norm_dim", [(80, None), (None, 80), (80, 80), (64, 72), (48, 96)])
@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_bf16_out_matches_cat_reference(backend, rotary_dim, offset, neox, split, norm_dim, kind):
    n, H, D = 11, 2, 96
    whole = random_bf16((n, H, D), 7)
    x = whole if split is None else (whole[..., :split], whole[..., split:])
    k = D if norm_dim is None else norm_dim
    norm = NormArgs(_weight(k, 2), 1e-6, _weight(k, 4, torch.float32) if kind == "layer" else None, kind)
    rope = _rope(n, rotary_dim, offset, neox)
    assert_bytes_equal(_call(x, norm, rope), _expected(x, norm, rope), "bf16 out")


@pytest.mark.parametrize("stage", ["norm", "transform", "cast_back"])
@pytest.mark.parametrize("fmt", [F.FLASHMLA_V32, F.MAIN_FP8, F.FLASHMLA_MODEL1], ids=lambda f: f.name)
def test_cache_write_matches_cat_reference(backend, fmt, stage):
    """Split at the record's quantized part (the latent), norm over it, RoPE on the tail: the whole buffer and
    the stage copy equal the cat's (strided views of one projection output)."""
    n = 29
    D, tail = fmt.head_dim, 64
    buf = random_bf16((n, D + 32), 11)[:, 16:16 + D]            # a row stride other than D
    x = (buf[:, :D - tail], buf[:, D - tail:])
    norm = NormArgs(_weight(D - tail, 1))
    rope = _rope(n, 64, D - tail, fmt is not F.MAIN_FP8)
    cast = CastArgs.from_cache_format(fmt)
    slots = torch.randperm(64)[:n]
    slots[3] = -1
    results = []
    for run in (_call, _expected):
        cache, storage = guarded_cache(fmt, 4, 16)
        out = torch.empty(n, D, dtype=torch.bfloat16)
        run(x, norm, rope, None, cast, KVCacheOutArgs(cache, slots, out=out, out_stage=stage, layout=fmt))
        results.append((storage, out))
    assert_bytes_equal(results[0][0], results[1][0], "cache buffer")
    assert_bytes_equal(results[0][1], results[1][1], f"out ({stage})")


def test_contiguous_cast_and_hadamard_match_cat_reference(backend):
    n, H, D = 6, 3, 128
    whole = random_bf16((n, H, D), 5)
    x = (whole[..., :48], whole[..., 48:].clone())
    norm = NormArgs(_weight(112, 3))
    rope = _rope(n, 64, 0, False)
    cast = CastArgs("e4m3", 32, True, "ue8m0")
    for had in (None, HadamardArgs(D ** -0.5)):
        q, sf = _call(x, norm, rope, had, cast)
        q2, sf2 = _expected(x, norm, rope, had, cast)
        assert_bytes_equal(q, q2, "q")
        assert_bytes_equal(sf, sf2, "sf")
    out = torch.empty(n, H, D, dtype=torch.bfloat16)
    _call(x, norm, rope, None, None, ContiguousOutArgs(out))
    assert_bytes_equal(out, _expected(x, norm, rope), "ContiguousOutArgs.out")


def test_nan_passes_through_a_leading_norm(backend):
    """Pass-through dims keep their bits, NaN payloads included (no bf16 conversion of them)."""
    x = random_bf16((4, 64), 2)
    x.view(torch.int16)[:, 40] = 0x7FC5        # a NaN with a payload
    x.view(torch.int16)[:, 41] = -0x0001        # 0xFFFF: a negative NaN
    y = _call(x, NormArgs(_weight(32, 1)))
    assert_bytes_equal(y[:, 32:], x[:, 32:], "passed through")
    assert_bytes_equal(y, _expected(x, NormArgs(_weight(32, 1))), "whole row")


# =============================================================================== errors
def test_errors_name_the_argument():
    x = random_bf16((4, 64), 0)
    with pytest.raises(ValueError, match=r"norm_args.weight: expected shape \(k,\) with 1 <= k <= head_dim \(64\)"):
        _call(x, NormArgs(_weight(80, 0)))
    with pytest.raises(ValueError, match=r"norm_args.bias: expected shape \(32,\)"):
        _call(x, NormArgs(_weight(32, 0), bias=_weight(64, 0), kind="layer"))
    with pytest.raises(ValueError, match="x: a tuple must hold two tensors"):
        _call((x, x, x))
    with pytest.raises(TypeError, match="x\\[1\\] must be a torch.Tensor"):
        _call((x, None))
    with pytest.raises(TypeError, match="x\\[1\\]: expected dtype torch.bfloat16"):
        _call((x, x.float()))
    with pytest.raises(ValueError, match="x\\[1\\]: expected the leading dims"):
        _call((x, x[:3]))
    with pytest.raises(ValueError, match="x\\[0\\]: expected stride\\(-1\\) == 1"):
        _call((x.t().contiguous().t()[:, :32], x[:, 32:]))
    with pytest.raises(ValueError, match="x: head_dim must be a positive multiple of 16, got 72"):
        _call((x, x[:, :8]))
    with pytest.raises(ValueError, match="x\\[1\\]: expected \\[n, head_dim\\]"):
        _call((x, x[:, :16].unsqueeze(1).unsqueeze(1)))


def test_output_overlapping_the_second_input_is_refused():
    buf = random_bf16((4, 96), 0)
    with pytest.raises(ValueError, match="x\\[1\\]"):
        _call((buf[:, :32], buf[:, 32:64]), None, None, None, None, buf[:, 32:96])


def test_plan_cache_keys_the_second_input():
    """A call with a tail of other strides is another signature (its bytes still the cat's)."""
    kvfuse.clear_plan_cache()
    w = NormArgs(_weight(32, 1))
    a = random_bf16((5, 64), 1)
    b = random_bf16((5, 64), 2)
    y1 = _call((a[:, :32], a[:, 32:]), w)
    y2 = _call((a[:, :32], b[:, :32].clone()), w)
    assert_bytes_equal(y1, _expected((a[:, :32], a[:, 32:]), w))
    assert_bytes_equal(y2, _expected((a[:, :32], b[:, :32]), w))


# =============================================================================== kvfuse.mla, the vLLM adapter
def _v3():
    import dataclasses
    from kvfuse import models
    return dataclasses.replace(models.get("deepseek-v3"), num_heads=4)


def _v3_write_inputs(n, seed):
    """(buf [n, 576], kv_c, k_pe views, latent norm weight [512], positions, cos_sin, slots) of a V3 main write."""
    buf, kv_c, k_pe = _v32_inputs(n, seed)
    pos = torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(seed))
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(seed))[:n]
    return buf, kv_c, k_pe, _weight(512, seed + 1), pos, cos_sin_cache(64, 64), slots


def _count_calls(monkeypatch, module, name):
    """Record the x of every call of ``module.name`` (the fused entry point as that module sees it)."""
    seen = []
    real = getattr(module, name)

    def counted(x, *args, **kwargs):
        seen.append(x)
        return real(x, *args, **kwargs)
    monkeypatch.setattr(module, name, counted)
    return seen


def _count_dispatched(monkeypatch):
    """Record (x, x_tail) of every fused-operator call handed to kvfuse.dispatch (a write of kvfuse.mla
    reaches it through the entry point, or from its plan-cache key without building the entry's arguments)."""
    from kvfuse import dispatch
    from kvfuse.plans.types import X, X_TAIL
    seen = []
    real = dispatch.call_fused

    def counted(template, tensors):
        seen.append((tensors[X], tensors[X_TAIL]))
        return real(template, tensors)
    monkeypatch.setattr(dispatch, "call_fused", counted)
    return seen


@pytest.mark.parametrize("stage", [None, "norm", "transform", "cast_back"])
def test_mla_v3_main_write_is_one_launch_from_kv_c_k_pe(backend, monkeypatch, stage):
    """write_main_cache from (kv_c, k_pe) views of one [n, 576] buffer, from the buffer itself and the
    former two-call chain: the same bytes; one entry-point call, on the caller's views."""
    from kvfuse import mla
    cfg = _v3()
    n = 21
    buf, kv_c, k_pe, w, pos, cs, slots = _v3_write_inputs(n, 8)
    seen = _count_dispatched(monkeypatch)
    results = []
    for kv in ((kv_c, k_pe), buf):
        cache, storage = guarded_cache(F.FLASHMLA_V32, 4, 16)
        out = None if stage is None else torch.empty(n, 576, dtype=torch.bfloat16)
        mla.write_main_cache(cfg, kv, pos, cs, w, cache, slots, out=out, out_stage=stage)
        results.append((storage, out))
    assert len(seen) == 2 and seen[0][0] is kv_c and seen[0][1] is k_pe and seen[1] == (buf, None)
    cache, storage = guarded_cache(F.FLASHMLA_V32, 4, 16)
    out = None if stage in (None, "norm") else torch.empty(n, 576, dtype=torch.bfloat16)
    with kvfuse.use_backend("reference"):
        latent = kvfuse.reference.rmsnorm(kv_c, w, cfg.norm_eps)
        _call(torch.cat([latent, k_pe], -1), None, cfg.main_rope_args(pos, cs, F.FLASHMLA_V32), None,
              CastArgs.from_cache_format(F.FLASHMLA_V32),
              KVCacheOutArgs(cache, slots, out=out, out_stage=None if stage == "norm" else stage,
                             layout=F.FLASHMLA_V32))
    if stage == "norm":   # the norm stage: the normalized latent, then k_pe as it came
        out = torch.cat([latent, k_pe], -1)
    for storage_i, out_i in results:
        assert_bytes_equal(storage_i, storage, "cache buffer")
        if stage is not None:
            assert_bytes_equal(out_i, out, f"out ({stage})")


def test_mla_write_layer_and_flashmla_v32_take_the_pair(backend):
    from kvfuse import mla
    cfg = _v3()
    n = 13
    buf, kv_c, k_pe, w, pos, cs, slots = _v3_write_inputs(n, 4)
    storages = []
    for write in ("main", "layer", "v32"):
        cache, storage = guarded_cache(F.FLASHMLA_V32, 4, 16)
        if write == "main":
            mla.write_main_cache(cfg, buf, pos, cs, w, cache, slots)
        elif write == "layer":
            q = random_bf16((n, 4, cfg.qk_head_dim), 6)
            res = mla.write_layer(cfg, pos, cs, q=q, kv=(kv_c, k_pe), kv_norm_weight=w, kv_cache=cache,
                                  slot_mapping=slots)
            assert_bytes_equal(res["q"], mla.q_preprocess(cfg, q, pos, cs), "write_layer q")
        else:
            mla.write_flashmla_v32(cfg, kv_c, k_pe, pos, cs, cache, slots, norm_weight=w)
        storages.append(storage)
    assert_bytes_equal(storages[1], storages[0], "write_layer((kv_c, k_pe))")
    assert_bytes_equal(storages[2], storages[0], "write_flashmla_v32(norm_weight=)")


def test_vllm_fp8_ds_mla_reads_kv_c_and_k_pe_in_place(backend, monkeypatch):
    """concat_and_cache_mla "fp8_ds_mla": one entry-point call on the caller's kv_c / k_pe (no
    concatenation), the bytes of the record [kv_c | k_pe] written through the reference chain."""
    from kvfuse.engines import vllm
    n = 10
    buf, kv_c, k_pe = _v32_inputs(n, 12)
    slots = torch.randperm(64)[:n]
    slots[2] = -1
    seen = _count_calls(monkeypatch, vllm, "fused_norm_rope_hadamard_cast_store_kvcache")
    cache, storage = guarded_cache(F.FLASHMLA_V32, 4, 16)
    vllm.concat_and_cache_mla(kv_c, k_pe, cache[:, :, 0], slots, "fp8_ds_mla", torch.tensor(1.0))
    assert len(seen) == 1 and isinstance(seen[0], tuple)
    assert seen[0][0].data_ptr() == kv_c.data_ptr() and seen[0][1].data_ptr() == k_pe.data_ptr()
    cache2, storage2 = guarded_cache(F.FLASHMLA_V32, 4, 16)
    _expected((kv_c, k_pe), None, None, None, CastArgs.from_cache_format(F.FLASHMLA_V32),
              KVCacheOutArgs(cache2, slots, layout=F.FLASHMLA_V32))
    assert_bytes_equal(storage, storage2, "fp8_ds_mla cache buffer")


# =============================================================================== the custom op, torch.compile
def _v3_step(kv_c, k_pe, w, pos, cs, cache, slots, out):
    kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(
        (kv_c, k_pe), NormArgs(w), RopeArgs(pos, cs, 64, False), None, CastArgs.from_cache_format(F.FLASHMLA_V32),
        KVCacheOutArgs(cache, slots, out=out, out_stage="norm", layout=F.FLASHMLA_V32))
    return out


def _v3_step_inputs():
    buf, kv_c, k_pe, w, pos, cs, slots = _v3_write_inputs(9, 21)
    cache, storage = guarded_cache(F.FLASHMLA_V32, 4, 16)
    return (kv_c, k_pe, w, pos, cs, cache, slots, torch.empty(9, 576, dtype=torch.bfloat16)), storage


def test_the_custom_op_takes_the_second_input():
    """Through kvfuse.dispatch.via_ops (the plan's fields as op arguments, x_tail among them): the eager bytes."""
    from kvfuse import dispatch
    (args, storage), (args2, storage2) = _v3_step_inputs(), _v3_step_inputs()
    with kvfuse.use_backend("reference"):
        with dispatch.via_ops():
            _v3_step(*args)
        _v3_step(*args2)
    assert_bytes_equal(storage, storage2, "cache buffer through the op")
    assert_bytes_equal(args[-1], args2[-1], "out through the op")


def test_compile_fullgraph_with_two_inputs():
    torch._dynamo.reset()
    (args, storage), (args2, storage2) = _v3_step_inputs(), _v3_step_inputs()
    before = storage.clone()
    with kvfuse.use_backend("reference"):
        got = torch.compile(_v3_step, fullgraph=True, backend="aot_eager")(*args)
        want = _v3_step(*args2)
    assert_bytes_equal(got, want, "out (norm stage)")
    assert_bytes_equal(storage, storage2, "cache buffer")
    assert not torch.equal(storage, before)
