"""kvfuse.ops: the torch.library custom ops (SPEC §8), on the CPU.

- torch.library.opcheck on small shapes for each op (schema/mutations, fake tensors, AOT dispatch);
- the op path writes the same bytes as the direct (eager) path;
- torch.compile(fullgraph=True) of functions that call the public functions, which kvfuse.dispatch
  routes through the ops while tracing (aot_eager, and once inductor), with dynamic n, and with the
  data checks (KVFUSE_CHECKS) still running inside the op;
- the dispatcher's per-call cost (printed, not asserted: run with -s to see it).
"""
import logging
import time

import pytest
import torch

import kvfuse
from kvfuse import formats as F
from kvfuse import dispatch
from kvfuse.plans import cache_io, opargs
from kvfuse.plans.fused import build_plan

from helpers import assert_bytes_equal, byte_view, cos_sin_cache, guarded_cache, random_bf16

OPS = torch.ops.kvfuse


def _via_op(fn):
    """fn (a public function) with its eager calls run through the custom op (kvfuse.dispatch.via_ops)."""
    def call(*args, **kwargs):
        with dispatch.via_ops():
            return fn(*args, **kwargs)
    return call


class ops:   # the public functions, run through the custom ops
    fused_norm_rope_hadamard_cast_store_kvcache = staticmethod(_via_op(kvfuse.fused_norm_rope_hadamard_cast_store_kvcache))
    store_kv_cache = staticmethod(_via_op(kvfuse.store_kv_cache))
    load_paged_kv_cache = staticmethod(_via_op(kvfuse.load_paged_kv_cache))
    fused_qk_norm_rope_store_kv = staticmethod(_via_op(kvfuse.fused_qk_norm_rope_store_kv))


# torch's own opcheck/compile internals use torch.jit.script_method (deprecated in torch 2.13)
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
N = 6
CUSTOM = F.KVCacheFormat("CUSTOM_FP8_FP32", 256, "e4m3", 64, "fp32", True, sf_bytes=24)
SLOTS = [3, 0, -1, 7, 100, 5]


def _cache(fmt, seed=0, num_blocks=2, block_size=4):
    num_heads = 2 if fmt is CUSTOM else 1
    return guarded_cache(fmt, num_blocks, block_size, num_heads=num_heads, block_padding=32, seed=seed)


def _storage(cache):
    return cache.as_strided((cache.untyped_storage().nbytes(),), (1,), 0)


def _args(case, seed=0):
    """(keyword arguments but out_args, the cache format or None, out_stage) of a named case."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 32, (N,), generator=g)
    w = (1 + 0.1 * torch.randn(512, generator=g)).to(torch.bfloat16)
    if case == "main_fp8_cache":
        x = random_bf16((N, 512), seed)
        return dict(x=x, norm_args=kvfuse.NormArgs(w), rope_args=kvfuse.RopeArgs(pos, cos_sin_cache(32, 64), 64, True),
                    cast_args=kvfuse.CastArgs.from_cache_format(F.MAIN_FP8)), F.MAIN_FP8, "norm"
    if case == "v32_cache":
        x = random_bf16((N, 576), seed)
        return dict(x=x, rope_args=kvfuse.RopeArgs(pos, cos_sin_cache(32, 64), 64, False),
                    cast_args=kvfuse.CastArgs.from_cache_format(F.FLASHMLA_V32)), F.FLASHMLA_V32, "cast_back"
    if case == "index_bf16_cache":
        x = random_bf16((N, 128), seed)
        return dict(x=x, rope_args=kvfuse.RopeArgs(pos, cos_sin_cache(32, 64), 64, True),
                    hadamard_args=kvfuse.HadamardArgs(128 ** -0.5)), F.INDEX_BF16, None
    if case == "nvfp4_q_sf":   # indexer Q: several heads, (q, sf) returned
        x = random_bf16((N, 3, 128), seed)
        return dict(x=x, rope_args=kvfuse.RopeArgs(pos, cos_sin_cache(32, 64), 64, True),
                    hadamard_args=kvfuse.HadamardArgs(128 ** -0.5),
                    cast_args=kvfuse.CastArgs.from_cache_format(F.INDEX_NVFP4)), None, None
    if case == "custom_multihead_cache":   # a user-defined format, 2 heads per token (SPEC §8)
        x = random_bf16((N, 2, 256), seed)
        return dict(x=x, norm_args=kvfuse.NormArgs(w[:256]), hadamard_args=kvfuse.HadamardArgs(1 / 16),
                    cast_args=kvfuse.CastArgs.from_cache_format(CUSTOM)), CUSTOM, "transform"
    if case == "cast_back":
        x = random_bf16((N, 512), seed)
        return dict(x=x, norm_args=kvfuse.NormArgs(w.float()),
                    cast_args=kvfuse.CastArgs("e4m3", 32, True, "ue8m0", cast_back=True)), None, None
    if case == "bf16_q":       # Q preprocessing: norm + rope, bf16 out
        x = random_bf16((N, 4, 512), seed)
        return dict(x=x, norm_args=kvfuse.NormArgs(w), rope_args=kvfuse.RopeArgs(pos, cos_sin_cache(32, 64), 64, True,
                                                                                  offset=448)), None, None
    raise KeyError(case)


CASES = ["main_fp8_cache", "v32_cache", "index_bf16_cache", "custom_multihead_cache", "nvfp4_q_sf", "cast_back",
         "bf16_q"]


def _run(fn, case, seed=0):
    """Call fn (the public function or ops' twin) on a fresh copy of the case; returns every byte
    it produced: the result tensors and, for a cache case, the whole guarded storage."""
    kw, fmt, stage = _args(case, seed)
    if fmt is None:
        res = fn(**kw)
        res = res if isinstance(res, tuple) else (res,)
        return [byte_view(t) for t in res]
    cache, storage = _cache(fmt, seed)
    out = torch.empty_like(kw["x"]) if stage else None
    r = fn(**kw, out_args=kvfuse.KVCacheOutArgs(cache, torch.tensor(SLOTS), out=out, out_stage=stage, layout=fmt))
    assert r is out
    return [storage.clone()] + ([byte_view(out)] if stage else [])


# --------------------------------------------------------------------------- opcheck
FP8 = (torch.float8_e4m3fn,)


def _opcheck(op, args):
    """torch.library.opcheck; where an argument is float8, its SchemaCheckMode step ("test_schema")
    cannot run (it compares tensors with torch.allclose, not implemented for float8 on the CPU), so
    that step is replaced by a byte check: only the arguments the schema marks mutable change."""
    if not any(isinstance(a, torch.Tensor) and a.dtype in FP8 for a in args):
        torch.library.opcheck(op, args)
        return
    torch.library.opcheck(op, args, test_utils=("test_autograd_registration", "test_faketensor",
                                                "test_aot_dispatch_dynamic"))
    mutable = {i for i, a in enumerate(op._schema.arguments) if a.alias_info is not None and a.alias_info.is_write}
    before = [_bytes_of(a) for a in args]
    op(*args)
    for i, (a, b) in enumerate(zip(args, before)):
        if isinstance(a, torch.Tensor) and i not in mutable:
            assert torch.equal(_bytes_of(a), b), f"argument {op._schema.arguments[i].name} was mutated"


def _bytes_of(a):
    if not isinstance(a, torch.Tensor):
        return a
    return _storage(a).clone() if a.dtype == torch.uint8 else a.contiguous().view(torch.uint8).clone()


@pytest.mark.parametrize("case", CASES)
def test_opcheck_fused(case):
    kw, fmt, stage = _args(case)
    out_args = None
    if fmt is not None:
        cache, _ = _cache(fmt)
        out_args = kvfuse.KVCacheOutArgs(cache, torch.tensor(SLOTS), out=torch.empty_like(kw["x"]) if stage else None,
                                         out_stage=stage, layout=fmt)
    plan, _ = build_plan(out_args=out_args, **kw)
    _opcheck(OPS.fused_norm_rope_hadamard_cast_store.default, opargs.flatten(plan))


@pytest.mark.skipif(not kvfuse.backend.interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (CPU tensors)")
def test_opcheck_fused_triton_backend():
    with kvfuse.use_backend("triton"):
        test_opcheck_fused("main_fp8_cache")


@pytest.mark.parametrize("fmt", [F.MAIN_FP4, F.FLASHMLA_MODEL1, F.INDEX_BF16], ids=lambda f: f.name)
def test_opcheck_store_and_load(fmt):
    x = random_bf16((N, fmt.head_dim), 3)
    cache, _ = _cache(fmt)
    slots = torch.tensor(SLOTS)
    if fmt.quantized:
        qd = fmt.quant_dim
        q, sf = kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(
            x[:, :qd].contiguous(), cast_args=kvfuse.CastArgs.from_cache_format(fmt))
        tail = x[:, qd:].contiguous() if fmt.bf16_tail else None
    else:
        q, sf, tail = x, None, None
    _opcheck(OPS.store_kv_cache.default, opargs.flatten(cache_io.validate_store(q, sf, cache, slots, fmt, tail)))
    ops.store_kv_cache(q, sf, cache, slots, fmt, tail)
    for dequantize in (True, False):    # the outputs allocated before the op, as kvfuse.dispatch.through_op does
        load = cache_io.validate_load(cache, slots, fmt, dequantize)
        load.allocate_outputs()
        _opcheck(OPS.load_paged_kv_cache.default, opargs.flatten(load))


def test_format_round_trips_through_op_arguments():
    """A plan's format comes back from the op's arguments as the preset object itself, or as an equal
    user format; a plan without a cache keeps fmt None."""
    slots = torch.tensor(SLOTS)
    for fmt in F.PRESETS.values():
        cache, _ = _cache(fmt)
        back = opargs.unflatten(type(p := cache_io.validate_load(cache, slots, fmt)), opargs.flatten(p))
        assert back.fmt is fmt
    custom = F.KVCacheFormat("MINE", 256, "e4m3", 64, "fp32", True, sf_bytes=32)
    cache = torch.zeros(2, 4, 1, custom.bytes_per_token, dtype=torch.uint8)
    back = opargs.unflatten(type(p := cache_io.validate_load(cache, slots, custom)), opargs.flatten(p))
    assert back.fmt == custom and back.fmt is not custom and back.fmt.sf_bytes == 32
    plan, _ = build_plan(random_bf16((N, 128), 1))
    assert opargs.unflatten(type(plan), opargs.flatten(plan)).fmt is None


def test_op_schemas_follow_the_plan_fields():
    """Every field of a plan type is an argument of its op (derived ones aside), written tensors marked."""
    import dataclasses
    from kvfuse.plans import types as T
    for cls in (T.Plan, T.GQAPlan, T.StorePlan, T.LoadPlan):
        schema = getattr(OPS, cls.OP).default._schema
        names = {a.name for a in schema.arguments}
        for f in dataclasses.fields(cls):
            if f.metadata.get("derived"):
                assert f.name not in names
            elif f.name in ("cast", "fmt"):
                assert {n for n in names if n.startswith(f.name + "_")}, f.name
            else:
                assert f.name in names, (cls.OP, f.name)
        written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
        assert written == set(cls.WRITES), cls.OP


# --------------------------------------------------------------------------- eager equality
@pytest.mark.parametrize("case", CASES)
def test_op_path_equals_direct_path(case):
    direct = _run(kvfuse.fused_norm_rope_hadamard_cast_store_kvcache, case)
    via_op = _run(ops.fused_norm_rope_hadamard_cast_store_kvcache, case)
    assert len(direct) == len(via_op)
    for a, b in zip(direct, via_op):
        assert_bytes_equal(a, b, case)


def test_store_and_load_wrappers_equal_direct():
    fmt = F.MAIN_FP8
    x = random_bf16((N, 512), 4)
    q, sf = kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(x, cast_args=kvfuse.CastArgs.from_cache_format(fmt))
    slots = torch.tensor(SLOTS)
    (c1, s1), (c2, s2) = _cache(fmt, 5), _cache(fmt, 5)
    kvfuse.store_kv_cache(q, sf, c1, slots, fmt)
    ops.store_kv_cache(q, sf, c2, slots, fmt)
    assert_bytes_equal(s1, s2, "store")
    assert_bytes_equal(ops.load_paged_kv_cache(c2, slots, fmt), kvfuse.load_paged_kv_cache(c1, slots, fmt), "load")
    for a, b in zip(ops.load_paged_kv_cache(c2, slots, fmt, dequantize=False),
                    kvfuse.load_paged_kv_cache(c1, slots, fmt, dequantize=False)):
        assert_bytes_equal(a, b, "load raw")
    with pytest.raises(TypeError, match="layout"):
        ops.store_kv_cache(q, sf, c2, slots, "MAIN_FP8")
    with pytest.raises(ValueError, match="sf"):      # validated again inside the op, eagerly
        ops.store_kv_cache(q, sf[:, :3], c2, slots, fmt)


# --------------------------------------------------------------------------- torch.compile
# (the public functions: while torch.compile traces, kvfuse.dispatch routes them through the ops)
@pytest.mark.parametrize("case", CASES)
def test_compile_fullgraph_ops(case):
    torch._dynamo.reset()
    compiled = torch.compile(kvfuse.fused_norm_rope_hadamard_cast_store_kvcache, fullgraph=True, backend="aot_eager")
    want = _run(kvfuse.fused_norm_rope_hadamard_cast_store_kvcache, case, seed=1)
    got = _run(compiled, case, seed=1)
    for a, b in zip(want, got):
        assert_bytes_equal(a, b, f"compiled {case}")


def test_compile_inductor_write_then_read():
    """Inductor: one graph that writes MAIN_FP8 records and reads them back (ops only, no copies
    of the cache: the op mutates the padded, strided cache in place)."""
    torch._dynamo.reset()
    fmt = F.MAIN_FP8

    def step(x, w, pos, cs, cache, slots):
        kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(
            x, kvfuse.NormArgs(w), kvfuse.RopeArgs(pos, cs, 64, True), None, kvfuse.CastArgs.from_cache_format(fmt),
            kvfuse.KVCacheOutArgs(cache, slots, layout=fmt))
        return kvfuse.load_paged_kv_cache(cache, slots, fmt) * 2

    kw, _, _ = _args("main_fp8_cache", seed=2)
    args = (kw["x"], kw["norm_args"].weight, kw["rope_args"].positions, kw["rope_args"].cos_sin_cache)
    slots = torch.tensor(SLOTS)
    (c1, s1), (c2, s2) = _cache(fmt, 6), _cache(fmt, 6)
    want = step(*args, c1, slots)
    got = torch.compile(step, fullgraph=True)(*args, c2, slots)
    assert_bytes_equal(s1, s2, "inductor cache")
    assert_bytes_equal(got, want, "inductor read-back")


def test_compile_dynamic_n():
    torch._dynamo.reset()
    fmt = F.INDEX_MXFP8

    def write(x, pos, cs, cache, slots):
        kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(
            x, rope_args=kvfuse.RopeArgs(pos, cs, 64, True), hadamard_args=kvfuse.HadamardArgs(128 ** -0.5),
            cast_args=kvfuse.CastArgs.from_cache_format(fmt), out_args=kvfuse.KVCacheOutArgs(cache, slots, layout=fmt))

    compiled = torch.compile(write, fullgraph=True, backend="aot_eager", dynamic=True)
    cs = cos_sin_cache(32, 64)
    for n in (3, 5, 8):
        x = random_bf16((n, 128), n)
        pos, slots = torch.arange(n) % 32, torch.randperm(16)[:n]
        (c1, s1), (c2, s2) = _cache(fmt, n, num_blocks=4), _cache(fmt, n, num_blocks=4)
        write(x, pos, cs, c1, slots)
        compiled(x, pos, cs, c2, slots)
        assert_bytes_equal(s1, s2, f"dynamic n={n}")


def test_compile_data_checks_run_inside_the_op(monkeypatch):
    """KVFUSE_CHECKS: the data-dependent checks run at run time inside the op (no graph break)."""
    torch._dynamo.reset()
    fmt = F.INDEX_NVFP4

    def write(x, cache, slots):
        kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(x, cast_args=kvfuse.CastArgs.from_cache_format(fmt),
                                                        out_args=kvfuse.KVCacheOutArgs(cache, slots, layout=fmt))

    compiled = torch.compile(write, fullgraph=True, backend="aot_eager")
    cache, storage = _cache(fmt)
    x = random_bf16((3, 128), 7)
    before = storage.clone()
    monkeypatch.setattr(kvfuse.backend, "_checks_override", kvfuse.backend._checks_override)  # restored after
    kvfuse.set_checks(True)
    with pytest.raises(ValueError, match="duplicate"):
        compiled(x, cache, torch.tensor([1, 4, 1]))
    assert_bytes_equal(storage, before, "nothing written on a rejected call")
    compiled(x, cache, torch.tensor([1, 4, 2]))
    assert not torch.equal(storage, before)


def test_compile_fullgraph_public_api():
    """torch.compile(fullgraph=True) of the public entry points (write, store, load): kvfuse.dispatch
    routes them through the custom ops while compiling."""
    torch._dynamo.reset()
    fmt = F.MAIN_FP8

    def step(x, w, pos, cs, cache, slots, cache2, slots2):
        out = torch.empty_like(x)
        kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(
            x, kvfuse.NormArgs(w), kvfuse.RopeArgs(pos, cs, 64, True), None, kvfuse.CastArgs.from_cache_format(fmt),
            kvfuse.KVCacheOutArgs(cache, slots, out=out, out_stage="norm", layout=fmt))
        data, sf = kvfuse.load_paged_kv_cache(cache, slots, fmt, dequantize=False)
        kvfuse.store_kv_cache(data[:, 0].view(torch.float8_e4m3fn), sf[:, 0, :16], cache2, slots2, fmt)
        return out, kvfuse.load_paged_kv_cache(cache2, slots2, fmt)

    kw, _, _ = _args("main_fp8_cache", seed=3)
    args = (kw["x"], kw["norm_args"].weight, kw["rope_args"].positions, kw["rope_args"].cos_sin_cache)
    slots, slots2 = torch.tensor([3, 0, 6, 7, 1, 5]), torch.tensor([1, 2, 3, 4, 5, 6])
    c = [_cache(fmt, 8) for _ in range(4)]
    want = step(*args, c[0][0], slots, c[1][0], slots2)
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*args, c[2][0], slots, c[3][0], slots2)
    for a, b in zip(want, got):
        assert_bytes_equal(a, b, "public API compiled")
    assert_bytes_equal(c[0][1], c[2][1], "cache")
    assert_bytes_equal(c[1][1], c[3][1], "cache2")


# --------------------------------------------------------------------------- dispatcher cost
def _per_call_us(fn, iters):
    for _ in range(20):
        fn()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters * 1e6


@pytest.mark.parametrize("n", [0, 16])
def test_dispatcher_cost(n):
    """Per-call cost of the op path (dispatch.through_op: flatten the Plan, dispatch, rebuild the Plan)
    over the direct path (dispatch.run), same plan, reference backend. Logged at DEBUG on the
    "kvfuse.ops" logger (``pytest --log-cli-level=DEBUG`` shows it), not asserted: timings on a
    shared CPU are noise."""
    fmt = F.MAIN_FP8
    x = random_bf16((n, 512), 9)
    w = torch.ones(512, dtype=torch.bfloat16)
    (c1, s1), (c2, s2) = _cache(fmt, 9, num_blocks=8), _cache(fmt, 9, num_blocks=8)
    plans = [build_plan(x, kvfuse.NormArgs(w), kvfuse.RopeArgs(torch.arange(n), cos_sin_cache(32, 64), 64, True),
                        None, kvfuse.CastArgs.from_cache_format(fmt),
                        kvfuse.KVCacheOutArgs(c, torch.arange(n), layout=fmt))[0] for c in (c1, c2)]
    iters = 400 if n == 0 else 20
    direct = _per_call_us(lambda: dispatch.run(plans[0]), iters)
    via_op = _per_call_us(lambda: dispatch.through_op(plans[1]), iters)
    logging.getLogger("kvfuse.ops").debug("n=%d: direct dispatch.run %.1f us/call, via torch.ops.kvfuse %.1f us/call, "
                                          "dispatcher overhead %+.1f us/call", n, direct, via_op, via_op - direct)
    assert_bytes_equal(s1, s2, "same bytes through both paths")
