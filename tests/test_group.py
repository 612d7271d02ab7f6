"""kvfuse.fused_group / kvfuse.mla.write_layer: several calls of the fused operator in one launch,
on the CPU (the kernels in Triton's interpreter).

- every model's layer (Q, main cache, indexer K, indexer Q) as one group writes the bytes of its
  calls made one by one (whole cache storages with guards, q in place or into a poisoned buffer),
  in exactly one launch of the grouped kernel;
- groups of 2 and 3 calls, calls of different n, a call with n = 0, a single call;
- the reference backend gives the same bytes;
- errors: bad containers, a bad call (named calls[i]), calls that write what another call reads
  or writes, KVFUSE_CHECKS data checks inside a group;
- the custom op: opcheck, and torch.compile(fullgraph=True) of a function that calls fused_group.
"""
import dataclasses

import pytest
import torch

import kvfuse
from kvfuse import CastArgs, ContiguousOutArgs, FusedCall, KVCacheOutArgs, NormArgs, RopeArgs
from kvfuse import formats as F
from kvfuse.plans import opargs
from kvfuse.plans.types import GroupPlan
from kvfuse.kernels import router as fused_kernels
from kvfuse.kernels import grouped

from group_cases import LAYERS, LayerCase, run_layer
from group_cases import inputs as initial_inputs
from helpers import CountingKernel, assert_bytes_equal, cos_sin_cache, guarded_cache, random_bf16

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


@pytest.fixture
def triton_backend():
    with kvfuse.use_backend("triton"):
        yield


@pytest.fixture
def counted(monkeypatch):
    """(grouped_kernel counter, fused_kernel counter): launches through Triton's own path."""
    g = CountingKernel(grouped.grouped_kernel)
    f = CountingKernel(fused_kernels.fused_kernel)
    monkeypatch.setattr(grouped, "grouped_kernel", g)
    monkeypatch.setattr(fused_kernels, "fused_kernel", f)
    return g, f


def _equal(a: dict, b: dict, what: str):
    assert sorted(a) == sorted(b), what
    for k in a:
        assert_bytes_equal(a[k], b[k], f"{what}: {k}")


@pytest.mark.parametrize("model", sorted(LAYERS))
@pytest.mark.parametrize("q_in_place", [True, False])
def test_layer_in_one_launch_equals_its_calls(model, q_in_place, triton_backend, counted):
    case = LayerCase(model=model, n=6, q_heads=3, index_heads=2, q_in_place=q_in_place, seed=11)
    one_by_one = run_layer(case, "cpu", grouped=False)
    g, f = counted
    f.launches = 0
    together = run_layer(case, "cpu", grouped=True)
    assert (g.launches, f.launches) == (1, 0)
    _equal(together, one_by_one, model)
    # the calls did write: the caches no longer hold their random initial bytes
    initial = initial_inputs(case)
    assert not torch.equal(together["kv_storage"], initial["kv_cache"][1])
    if "index_cache" in initial:
        assert not torch.equal(together["index_storage"], initial["index_cache"][1])


@pytest.mark.parametrize("members", [("q", "kv"), ("kv", "index_k", "index_q"), ("index_q", "index_k")])
def test_groups_of_two_and_three(members, triton_backend, counted):
    case = LayerCase(model="deepseek-v4", n=5, q_heads=2, index_heads=3, members=members, seed=3)
    one_by_one = run_layer(case, "cpu", grouped=False)
    g, _ = counted
    _equal(run_layer(case, "cpu", grouped=True), one_by_one, str(members))
    assert g.launches == 1


def test_reference_backend_same_bytes():
    case = LayerCase(model="deepseek-v3.2", n=4, q_heads=2, index_heads=2, seed=5)
    with kvfuse.use_backend("triton"):
        kernel = run_layer(case, "cpu", grouped=True)
    with kvfuse.use_backend("reference"):
        ref = run_layer(case, "cpu", grouped=True)
    _equal(kernel, ref, "reference")


def _generic_calls(n_main=5, n_q=3, n_idx=0):
    """A main-cache write, a bf16 Q-like call with its own n, and an index Q cast (maybe n = 0)."""
    cs = cos_sin_cache(32, 64)
    g = torch.Generator().manual_seed(7)
    w = (1 + 0.1 * torch.randn(512, generator=g)).bfloat16()
    cache, storage = guarded_cache(F.MAIN_FP8, 2, 8, seed=9)
    calls = [
        FusedCall(random_bf16((n_main, 512), 1), NormArgs(w), RopeArgs(torch.randint(0, 32, (n_main,), generator=g),
                                                                       cs, 64, False),
                  cast_args=CastArgs.from_cache_format(F.MAIN_FP8),
                  out_args=KVCacheOutArgs(cache, torch.randperm(16, generator=g)[:n_main], layout=F.MAIN_FP8)),
        FusedCall(random_bf16((n_q, 4, 192), 2), rope_args=RopeArgs(torch.randint(0, 32, (n_q,), generator=g),
                                                                    cs, 64, True)),
        FusedCall(random_bf16((n_idx, 2, 128), 3), rope_args=RopeArgs(torch.randint(0, 32, (n_idx,), generator=g),
                                                                      cs, 64, True, offset=0),
                  hadamard_args=kvfuse.HadamardArgs(128 ** -0.5), cast_args=CastArgs("e4m3", 128, False, "fp32")),
    ]
    return calls, storage


def _call_one(c):
    return kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(c.x, c.norm_args, c.rope_args, c.hadamard_args,
                                                              c.cast_args, c.out_args)


def _flat(results):
    out = []
    for r in results:
        if isinstance(r, tuple):
            out += list(r)
        elif r is not None:
            out.append(r)
    return out


@pytest.mark.parametrize("n_idx", [0, 4])
def test_calls_of_different_n(n_idx, triton_backend, counted):
    calls, storage = _generic_calls(n_idx=n_idx)
    want = _flat([_call_one(c) for c in calls])
    want_storage = storage.clone()
    calls, storage = _generic_calls(n_idx=n_idx)
    got = _flat(kvfuse.fused_group(calls))
    assert_bytes_equal(storage, want_storage, "cache storage")
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert_bytes_equal(a, b, "result")
    assert counted[0].launches == 1


def test_past_the_one_launch_limit_the_calls_run_one_by_one(triton_backend, counted, monkeypatch):
    from kvfuse import dispatch

    monkeypatch.setattr(dispatch, "GROUP_ONE_LAUNCH_MAX_N", 4)     # n = 5 and 3: past it
    calls, storage = _generic_calls(n_idx=2)
    want = _flat([_call_one(c) for c in calls])
    want_storage = storage.clone()
    calls, storage = _generic_calls(n_idx=2)
    g, f = counted
    f.launches = 0
    got = _flat(kvfuse.fused_group(calls))
    assert (g.launches, f.launches) == (0, 3)
    assert_bytes_equal(storage, want_storage, "cache storage")
    for a, b in zip(got, want):
        assert_bytes_equal(a, b, "result")


def test_single_call_takes_its_own_kernel(triton_backend, counted):
    calls, storage = _generic_calls()
    want = _call_one(calls[1])
    g, f = counted
    f.launches = 0
    (got,) = kvfuse.fused_group([calls[1]])
    assert_bytes_equal(got, want, "single call")
    assert (g.launches, f.launches) == (0, 1)


# --------------------------------------------------------------------------- errors
def test_bad_containers():
    calls, _ = _generic_calls()
    with pytest.raises(TypeError, match="calls must be a list or tuple"):
        kvfuse.fused_group(calls[0])
    with pytest.raises(ValueError, match="calls: expected 1 to 4 calls, got 0"):
        kvfuse.fused_group([])
    with pytest.raises(ValueError, match="calls: expected 1 to 4 calls, got 5"):
        kvfuse.fused_group([calls[1]] * 5)
    with pytest.raises(TypeError, match=r"calls\[1\] must be a FusedCall, got dict"):
        kvfuse.fused_group([calls[1], {}])


def test_bad_call_is_named():
    calls, _ = _generic_calls()
    bad = dataclasses.replace(calls[1], x=calls[1].x.float())
    with pytest.raises(TypeError, match=r"calls\[1\]: x: expected dtype torch.bfloat16"):
        kvfuse.fused_group([calls[0], bad])


def test_a_call_may_not_write_what_another_reads(triton_backend):
    calls, storage = _generic_calls()
    before = storage.clone()
    q = calls[1].x
    in_place = dataclasses.replace(calls[1], out_args=q)          # writes q ...
    reader = FusedCall(q, rope_args=calls[1].rope_args)           # ... which this call reads
    with pytest.raises(ValueError, match=r"calls\[0\]\.out_args overlaps calls\[1\]\.x"):
        kvfuse.fused_group([in_place, reader])
    # two calls into one cache (even at different slots): rejected before anything is written
    other = dataclasses.replace(calls[0], x=random_bf16((5, 512), 4))
    with pytest.raises(ValueError, match=r"calls\[0\]\.out_args\.kv_cache overlaps calls\[1\]\.out_args\.kv_cache"):
        kvfuse.fused_group([calls[0], other])
    assert torch.equal(storage, before)
    # shared inputs are fine: the same positions and cos/sin table, the same x read twice
    kvfuse.fused_group([calls[1], FusedCall(q, rope_args=calls[1].rope_args)])


def test_data_checks_run_inside_a_group(triton_backend, monkeypatch):
    from kvfuse import backend

    calls, _ = _generic_calls()
    dup = dataclasses.replace(calls[0], out_args=dataclasses.replace(
        calls[0].out_args, slot_mapping=torch.tensor([1, 2, 1, 3, 4])))
    monkeypatch.setattr(backend, "_checks_override", backend._checks_override)   # undone after the test
    kvfuse.set_checks(True)
    with pytest.raises(ValueError, match="duplicate valid slots"):
        kvfuse.fused_group([dup, calls[1]])


# --------------------------------------------------------------------------- the custom op
def _group_plans():
    from kvfuse.plans.fused import build_plan

    calls, _ = _generic_calls(n_idx=4)
    out = ContiguousOutArgs(torch.empty(4, 2, 128, dtype=torch.float8_e4m3fn), torch.empty(4, 2, 1))
    calls[2] = dataclasses.replace(calls[2], out_args=out)
    calls[1] = dataclasses.replace(calls[1], out_args=torch.empty_like(calls[1].x))
    return [build_plan(c.x, c.norm_args, c.rope_args, c.hadamard_args, c.cast_args, c.out_args)[0] for c in calls]


def test_opcheck_group_op():
    args = opargs.flatten_group(GroupPlan(_group_plans()))
    torch.library.opcheck(torch.ops.kvfuse.fused_group.default, args,
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_op_arguments_round_trip():
    plans = _group_plans()
    back = opargs.unflatten_group(*opargs.flatten_group(GroupPlan(plans))).members
    assert len(back) == len(plans)
    for a, b in zip(plans, back):
        assert opargs.flatten(a) == opargs.flatten(b)
        assert a.addressing == b.addressing


def test_compile_fullgraph(triton_backend):
    torch._dynamo.reset()
    cfg = LAYERS["deepseek-v4"]

    def step(q, kv, pos, cs, w, cache, slots):
        return kvfuse.mla.write_layer(cfg, pos, cs, q=q, q_out=q, kv=kv, kv_norm_weight=w, kv_cache=cache,
                                      slot_mapping=slots)["q"]

    def inputs():
        g = torch.Generator().manual_seed(2)
        cache, storage = guarded_cache(F.MAIN_FP8, 2, 8, seed=1)
        return (random_bf16((3, 2, 512), 1), random_bf16((3, 512), 2), torch.randint(0, 32, (3,), generator=g),
                cos_sin_cache(32, 64), (1 + 0.1 * torch.randn(512, generator=g)).bfloat16(), cache,
                torch.tensor([4, -1, 9])), storage

    args, storage = inputs()
    want = step(*args).clone()
    want_storage = storage.clone()
    args, storage = inputs()
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*args)
    assert_bytes_equal(got, want, "q")
    assert_bytes_equal(storage, want_storage, "cache storage")
