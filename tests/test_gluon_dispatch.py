"""kvfuse/kernels/gluon/main_latent.py on the CPU: which calls the Gluon MAIN_FP8 fast path takes
(``eligible``, the per-call word alignment, force_config), its launch table, and that the module
imports and stays off without Triton 3.6 + CUDA. The kernel itself runs only on the H200
(tests/gpu/test_gpu_gluon.py; Gluon has no interpreter)."""
from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

import kvfuse
from kvfuse import CastArgs, KVCacheFormat
from kvfuse.kernels import config
from kvfuse.kernels.portable import fused_args
from kvfuse.kernels import router as fused_kernels
from kvfuse.kernels.gluon import common as gluon_common, indexer, main_latent_fp4, flashmla
from kvfuse.kernels.gluon import main_latent as G
from helpers import CountingKernel
from kvfuse.kernels.launcher import tensor_arg
from kernel_cases import FAST_CASES, FAST_CHAIN, FAST_MAIN, Case, plan_of, recast

MAIN = kvfuse.formats.MAIN_FP8


def main_case(**kw):
    """The fast path's chain: norm, NEOX RoPE on the last 64 columns, MAIN_FP8 cache, no stage copy."""
    base = dict(n=5, heads=1, head_dim=512, fmt=MAIN, rotary_dim=64, neox=True, out_stage=None)
    return Case(**{**base, **kw})


def test_the_main_fp8_chain_is_eligible():
    assert G.eligible(plan_of(main_case()))
    assert G.eligible(plan_of(main_case(w_fp32=True, cs_bf16=True, idx32=True, block_size=24, token_padding=8)))
    assert G.eligible(plan_of(main_case(neox=False)))                    # GPT-J on the tail (DeepSeek)


def test_the_cast_alone_is_eligible():
    """No norm and no RoPE (kvfuse.mla.store_gathered, the CP second pass): the kernel's CAST_ONLY
    variant, whose stand-in pointers (x) are never read; MAIN_FP4 the same."""
    from kvfuse.kernels.gluon import main_latent_fp4
    from kvfuse.kernels.launcher import tensor_arg
    plan = plan_of(main_case(norm=False, rope=False))
    assert G.eligible(plan)
    x = plan.x[:, 0, :]
    _, args, constexprs, _ = G.launch_parts_records(G.RECORDS, tensor_arg, 5, plan.eps, x, None, None, None,
                                                    plan.slot_mapping, plan.kv_cache, 1, 1, False, ctas_per_sm=1,
                                                    sm_count=1)
    assert constexprs["CAST_ONLY"] and not constexprs["FP4"]
    numbers = [a for a in args if not hasattr(a, "field")]
    assert numbers[2:5] == [0, 0, 0]          # s_pos, s_cs, P: nothing about positions or cos/sin is read
    assert main_latent_fp4.eligible(plan_of(main_case(norm=False, rope=False, fmt=kvfuse.formats.MAIN_FP4)))
    for change in (dict(hadamard=True), dict(out_stage="transform"), dict(heads=2)):
        assert not G.eligible(plan_of(main_case(norm=False, rope=False, **change))), change


@pytest.mark.parametrize("change", [
    dict(out_stage="transform"), dict(out_stage="cast_back"), dict(out_stage="norm"),   # a stage copy
    dict(conjugate=True), dict(rotary_dim=32), dict(rope=False), dict(norm=False), dict(norm_kind="layer"),
    dict(norm_kind="layer", bias=True), dict(neox=False, rope_offset=0), dict(hadamard=True), dict(heads=2), dict(fmt=kvfuse.formats.MAIN_FP4, head_dim=512),
    dict(fmt=kvfuse.formats.FLASHMLA_MODEL1),
])
def test_other_chains_are_not(change):
    assert not G.eligible(plan_of(main_case(**change)))


def test_a_user_format_with_main_fp8s_records_is_eligible_another_is_not():
    same = KVCacheFormat("MY_MAIN", 512, "e4m3", 32, "ue8m0", True, sf_bytes=20, zero_reserved=True)
    assert G.eligible(plan_of(main_case(fmt=same)))
    unwritten = KVCacheFormat("MY_MAIN_KEEP", 512, "e4m3", 32, "ue8m0", True, sf_bytes=20)   # reserved bytes kept
    assert not G.eligible(plan_of(main_case(fmt=unwritten)))
    wider = KVCacheFormat("MY_MAIN_24", 512, "e4m3", 32, "ue8m0", True, sf_bytes=24)   # 536-byte records
    assert not G.eligible(plan_of(main_case(fmt=wider)))


def test_launch_table():
    assert G.launch_table(1) == (1, 1, False) and G.launch_table(1024) == (1, 1, False)
    assert G.launch_table(1025) == (4, 1, False) and G.launch_table(8192) == (4, 1, False)
    assert G.launch_table(8193) == (1, 1, False) and G.launch_table(16384) == (1, 1, False)
    assert G.launch_table(16385) == (1, 1, True) and G.launch_table(262144) == (1, 1, True)


def test_every_fast_path_module_has_the_interface():
    for module in fused_kernels.FAST_PATH_MODULES:
        for name in ("enabled", "available", "eligible", "plan_launch", "word_aligned", "call_guard", "launch_table"):
            assert callable(getattr(module, name)), (module.__name__, name)
        assert isinstance(module.MIN_ROWS, int) and module.MIN_ROWS >= 1
        assert isinstance(module.MIN_ROWS_PDL, int) and module.MIN_ROWS_PDL >= 1


def test_off_without_triton_36_and_cuda(monkeypatch):
    if not torch.cuda.is_available():
        assert not G.available() and not G.enabled()
    monkeypatch.setenv("KVFUSE_GLUON", "0")
    assert not G.enabled()
    assert fused_kernels.GLUON is False or torch.cuda.is_available()


def test_plan_fields_they_read_exist():
    """Every fast path's eligible() / launch code reads these Plan and RecordAddressing fields: a rename
    must fail here, not silently disable a path."""
    names = {f.name for f in dataclasses.fields(kvfuse.plans.types.Plan)}
    assert {"x", "weight", "eps", "positions", "cos_sin", "rotary_dim", "rope_offset", "is_neox", "conjugate",
            "hadamard_scale", "cast", "quant_dim", "out", "out_stage", "kv_cache", "slot_mapping", "fmt",
            "addressing", "q_out", "sf_out"} <= names
    addressing = {f.name for f in dataclasses.fields(kvfuse.formats.RecordAddressing)}
    assert {"data_token_stride", "sf_token_stride", "head_stride", "data_offset", "sf_offset",
            "tail_offset"} <= addressing
    assert CastArgs.from_cache_format(MAIN) is not None


@pytest.mark.parametrize("module", fused_kernels.FAST_PATH_MODULES, ids=lambda m: m.__name__.rsplit(".", 1)[1])
def test_on_where_available_unless_turned_off(module, monkeypatch):
    names = {m.NAME for m in fused_kernels.FAST_PATH_MODULES}
    name = module.NAME
    assert name == module.__name__.rsplit(".", 1)[1]                # the skip name is the module's name
    if not torch.cuda.is_available():
        assert not module.available() and not module.enabled()
    monkeypatch.setattr(module, "available", lambda: True)
    monkeypatch.delenv("KVFUSE_GLUON", raising=False)
    monkeypatch.delenv("KVFUSE_GLUON_SKIP", raising=False)
    assert module.enabled()
    monkeypatch.setenv("KVFUSE_GLUON_SKIP", f" {name} ,")
    assert not module.enabled()
    for other in names - {name}:                      # MAIN_FP4 runs MAIN_FP8's kernel, yet
        monkeypatch.setenv("KVFUSE_GLUON_SKIP", other)              # skipping one path leaves the others on
        assert module.enabled()
    monkeypatch.setenv("KVFUSE_GLUON_SKIP", f"{name}_v2")          # names, not prefixes: an unknown name
    with pytest.raises(ValueError, match=f"KVFUSE_GLUON_SKIP: expected names from .*got {name}_v2"):
        module.enabled()
    monkeypatch.setenv("KVFUSE_GLUON_SKIP", " , ")                   # empty entries name nothing
    assert module.enabled()
    monkeypatch.setenv("KVFUSE_GLUON", "0")
    assert not module.enabled()
    monkeypatch.setattr(module, "available", lambda: False)
    monkeypatch.delenv("KVFUSE_GLUON")
    assert not module.enabled()


def test_decode_sizes_follow_min_rows(monkeypatch):
    """A minimum above the call's rows leaves it to the plain kernel: MIN_ROWS, or MIN_ROWS_PDL for a
    launch with programmatic dependent launch (one-row calls of the index path: the plain kernel
    without PDL, the fast path with it, as measured)."""
    plan = plan_of(main_case(n=5))
    with fused_kernels.fast_paths(only=G):
        assert fused_kernels.fast_path(plan) is G
    with fused_kernels.fast_paths(only=G, min_rows=6):
        assert fused_kernels.fast_path(plan) is None
        assert fused_kernels.fast_path(plan_of(main_case(n=6))) is G
    monkeypatch.setattr(G, "MIN_ROWS", 6)
    monkeypatch.setattr(G, "MIN_ROWS_PDL", 5)
    with fused_kernels.fast_paths(only=G):
        assert fused_kernels.fast_path(plan) is None
        assert fused_kernels.fast_path(plan, pdl=True) is G
        assert fused_kernels.fast_path(plan_of(main_case(n=4)), pdl=True) is None
    from kvfuse.kernels.gluon import indexer, flashmla
    assert (flashmla.MIN_ROWS, indexer.MIN_ROWS) == (1, 2)
    assert (flashmla.MIN_ROWS_PDL, indexer.MIN_ROWS_PDL) == (1, 1)


def _main_write(backend, offset):
    """A MAIN_FP8 write of 3 rows whose x starts ``offset`` bf16 into a shared buffer (1: not word-aligned),
    on ``backend``, into a cache of random bytes; returns the cache's whole storage."""
    n, fmt = 3, MAIN
    g = torch.Generator().manual_seed(5)
    big = (torch.randn(n * 512 + 2, generator=g) * 3).to(torch.bfloat16)
    w = (torch.rand(512, generator=g) * 2).to(torch.bfloat16)
    ang = torch.rand(16, 32, generator=g) * 6
    rope = kvfuse.RopeArgs(torch.tensor([1, 5, 9]), torch.cat([ang.cos(), ang.sin()], 1), 64, True)
    cache = fmt.allocate(2, 4)
    storage = cache.as_strided((cache.untyped_storage().nbytes(),), (1,), 0)     # padding included
    storage.copy_(torch.randint(0, 256, storage.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(6)))
    with kvfuse.use_backend(backend):
        kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(
            big[offset:offset + n * 512].view(n, 512), kvfuse.NormArgs(w), rope, None,
            CastArgs.from_cache_format(fmt), kvfuse.KVCacheOutArgs(cache, torch.tensor([4, 0, 7]), layout=fmt))
    return storage


def test_a_rejected_call_runs_the_plain_kernel(monkeypatch):
    """The dispatch wiring around a fast path's per-call guard, in the interpreter: a stand-in fast
    path (the plain kernel's own launch parts under the fast path's guard) takes word-aligned x; a
    call whose x is 2 bytes off is rejected by the guard and runs the plain kernel uncached. Both
    give the reference's bytes."""
    taken = []
    stand_in = CountingKernel(fused_kernels.fused_kernel)     # launches through the kept (guarded) launch

    def plan_launch(plan, tensor):
        taken.append(plan.x.data_ptr())
        return ("fused_kernel", *fused_args(plan, tensor), {"fused_kernel": stand_in})
    # the launch kept for the signature is under test, and router.fast_paths keeps none: the default set
    monkeypatch.setattr(fused_kernels, "GLUON", True)
    monkeypatch.setattr(fused_kernels, "FAST_PATHS", (G,))
    monkeypatch.setattr(G, "plan_launch", plan_launch)
    kvfuse.clear_plan_cache()
    for offset, guarded_launches in ((0, 1), (1, 1), (0, 2)):
        caches = [_main_write(backend, offset) for backend in ("triton", "reference")]
        assert torch.equal(caches[0], caches[1]), f"x offset {offset}"
        assert len(taken) == 1                    # one launch kept for the signature
        assert stand_in.launches == guarded_launches, "the rejected call must not use the kept launch"


def test_bind_tensors_replaces_plan_tensor_slots_only():
    from kvfuse.kernels.gluon import common as gluon_common
    from kvfuse.kernels.launcher import tensor_arg
    x, w = torch.zeros(2), torch.ones(2)
    args = (tensor_arg("x"), 7, tensor_arg("weight"), 0.5, w)
    assert gluon_common.bind_tensors(args, {"x": x, "weight": w}) == (x, 7, w, 0.5, w)
    plan = plan_of(main_case())
    named = gluon_common.plan_tensors(plan)
    assert named["x"] is plan.x and named["kv_cache"] is plan.kv_cache and named["weight"] is plan.weight


@pytest.mark.parametrize("entry", FAST_CASES, ids=lambda e: f"{e[0]}-n{e[2].n}-h{e[2].heads}-s{e[2].seed}")
def test_gpu_cases_reach_their_fast_path(entry):
    """Each case of the GPU module tests/gpu/test_gpu_gluon.py is the chain of the module it names
    (eligible, and no other registered module's), at a size the dispatch sends there: so the GPU
    test compares that fast path, not the plain kernel, against the reference."""
    module_name, kernel_name, case = entry
    module = importlib.import_module(f"kvfuse.kernels.gluon.{module_name}")
    assert hasattr(module, kernel_name) or module.gluon is None
    with fused_kernels.fast_paths(only=fused_kernels.FAST_PATH_MODULES):
        assert fused_kernels.fast_path(plan_of(case)) is module


def test_occupancy_grid_asks_the_device_only_for_what_is_missing(monkeypatch):
    """gluon_common.occupancy_grid (every fast path's persistent grid): given both numbers it neither
    compiles nor queries the device; otherwise the occupancy comes from cached_ctas_per_sm (keyed by
    device, dtypes, constexprs, num_warps; None tensors bound to x) and the SM count from the device."""
    from kvfuse.kernels.gluon import common as GC
    from kvfuse.kernels.launcher import PlanTensor
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    w = torch.zeros(8, dtype=torch.float32)
    args = (PlanTensor("x"), 3, PlanTensor("weight"), PlanTensor("kv_cache"))
    constexprs, options = dict(A=1), dict(num_warps=2)
    asked = []

    def fake_ctas(kernel, known, key, real, cx, opts, device_index):
        asked.append((key, real))
        return 3
    monkeypatch.setattr(GC, "cached_ctas_per_sm", fake_ctas)
    monkeypatch.setattr(GC, "device_index_of", lambda t: 5)
    monkeypatch.setattr(GC.torch.cuda, "get_device_properties",
                        lambda i: type("P", (), {"multi_processor_count": 4})())
    tensors = dict(x=x, weight=w, kv_cache=None)
    assert GC.occupancy_grid("k", {}, x, 100, args, tensors, constexprs, options, 2, 7) == (14,)
    assert asked == []
    assert GC.occupancy_grid("k", {}, x, 100, args, tensors, constexprs, options) == (12,)     # 3 CTAs x 4 SMs
    key, real = asked[0]
    assert key == (5, (torch.bfloat16, torch.float32, torch.bfloat16), (("A", 1),), 2)
    assert real[0] is x and real[1] == 3 and real[2] is w and real[3] is x                    # None: x stands in
    assert GC.occupancy_grid("k", {}, x, 5, args, tensors, constexprs, options, 2) == (5,)      # one CTA a tile


# ---------------------------------------------------------------------------------- every fast path
F = kvfuse.formats
BASE_CASES = {                      # each module's chain, a few rows (the dispatch rules below)
    "main_latent": dict(**FAST_MAIN, fmt=F.MAIN_FP8),
    "main_latent_fp4": dict(**FAST_MAIN, fmt=F.MAIN_FP4),
    "flashmla": dict(**FAST_CHAIN, head_dim=576, fmt=F.FLASHMLA_V32),
    "indexer": dict(**FAST_CHAIN, head_dim=128, fmt=F.INDEX_NVFP4),
}
MODULES = {"main_latent": G, "main_latent_fp4": main_latent_fp4, "flashmla": flashmla,
           "indexer": indexer}


@pytest.mark.parametrize("name", sorted(BASE_CASES))
def test_dispatch_follows_eligibility_and_force_config(name):
    module, kw = MODULES[name], BASE_CASES[name]
    plan = plan_of(Case(n=5, **kw))
    with fused_kernels.fast_paths(only=module, min_rows=1):    # the case's few rows (decode sizes may stay plain)
        assert fused_kernels.fast_path(plan) is module
        with config.force_config(block_m=1):
            assert fused_kernels.fast_path(plan) is None   # forced configurations are the plain kernel's
        assert fused_kernels.fast_path(plan_of(Case(n=5, **{**kw, "out_stage": "transform"}))) is None
    with fused_kernels.fast_paths(only=()):
        assert fused_kernels.fast_path(plan) is None


@pytest.mark.parametrize("name", sorted(BASE_CASES))
def test_plan_without_a_field_is_not(name):
    module = MODULES[name]
    plan = plan_of(Case(n=5, **BASE_CASES[name]))
    assert module.eligible(plan)
    for field in ("weight", "positions", "kv_cache", "slot_mapping", "fmt", "addressing", "cast"):
        if field in ("weight", "positions") and name == "flashmla":
            continue        # no norm / no RoPE are among its chains (NO_NORM, NO_ROPE: test_gluon_flashmla.py)
        assert not module.eligible(recast(plan, **{field: None})), field
    if name != "flashmla":       # its cos/sin loads are masked by the position check: P = 0 is safe there
        assert not module.eligible(recast(plan, cos_sin=plan.cos_sin[:0]))         # P = 0: no row to load


@pytest.mark.parametrize("head_dim", [512, 128, 576])
def test_word_alignment_is_per_call(head_dim):
    """x and the weight are read as 4-byte words (every cache-write fast path uses this check)."""
    assert all(m.word_aligned is gluon_common.word_aligned for m in fused_kernels.FAST_PATH_MODULES)
    x = torch.zeros(2 * head_dim + 1, dtype=torch.bfloat16)
    w = torch.zeros(head_dim, dtype=torch.bfloat16)
    assert G.word_aligned(x[:2 * head_dim], w)
    assert not G.word_aligned(x[1:], w)
    assert not G.word_aligned(x[:2 * head_dim], torch.zeros(head_dim + 1, dtype=torch.bfloat16)[1:])
    assert G.word_aligned(x[:2 * head_dim], torch.zeros(head_dim, dtype=torch.float32))


# ---------------------------------------------------------------------------------- fast_paths (tools, tests)
@pytest.mark.parametrize("bad", [dict(only="indexer"), dict(only=(object(),)), dict(only=[G, None]),
                                 dict(min_rows=0), dict(min_rows=True), dict(min_rows=1.0),
                                 dict(launch_table=(1, 1, False))])
def test_fast_paths_rejects_bad_arguments(bad):
    with pytest.raises(ValueError, match="fast_paths"):
        with fused_kernels.fast_paths(**bad):
            pass


def test_fast_paths_is_per_thread_and_nests():
    import threading
    plan = plan_of(main_case(n=5))
    default = fused_kernels.fast_path(plan)           # G on a GPU with Triton 3.6, else None
    seen = []
    with fused_kernels.fast_paths(only=[G], min_rows=1) as choice:
        assert fused_kernels.fast_path(plan) is G and choice.only == (G,)
        other = threading.Thread(target=lambda: seen.append(fused_kernels.fast_path(plan)))
        other.start()
        other.join()
        with fused_kernels.fast_paths(only=()):
            assert fused_kernels.fast_path(plan) is None
        assert fused_kernels.fast_path(plan) is G
    assert seen == [default] and fused_kernels.fast_path(plan) is default


@pytest.mark.parametrize("name", sorted(BASE_CASES))
def test_each_plan_launch_takes_its_launch_table_from_the_caller(name):
    """fast_paths(launch_table=...) reaches the module: plan_launch asks the given table (first, before
    any device work) for the plan's rows."""
    class Asked(Exception):
        pass

    def table(n_rows):
        raise Asked(n_rows)
    with pytest.raises(Asked) as asked:
        MODULES[name].plan_launch(plan_of(Case(n=5, **BASE_CASES[name])), tensor_arg, table)
    assert asked.value.args == (5,)


def test_calls_inside_fast_paths_are_routed_per_call_and_counted(monkeypatch):
    """In the interpreter, a stand-in for MAIN_FP8's launch (the plain kernel's launch parts): inside the
    block every call asks plan_launch (no launch is kept for the signature) with the block's table,
    a call whose x fails the per-call guard runs the plain kernel uncounted, and the bytes are the
    reference's; with only=() no call reaches it."""
    asked = []

    def plan_launch(plan, tensor, table=None):
        asked.append(table)
        return ("fused_kernel", *fused_args(plan, tensor), vars(fused_kernels))
    monkeypatch.setattr(G, "plan_launch", plan_launch)
    kvfuse.clear_plan_cache()

    def table(n_rows):
        return (1, 1, False)
    with fused_kernels.fast_paths(only=G, launch_table=table) as choice:
        got = [_main_write("triton", offset) for offset in (0, 0, 1)]      # 1: x 2 bytes off, the guard declines
    assert asked == [table, table] and choice.fast_calls == 2
    with fused_kernels.fast_paths(only=()) as portable:
        got.append(_main_write("triton", 0))
    assert len(asked) == 2 and portable.fast_calls == 0
    for storage, offset in zip(got, (0, 0, 1, 0)):
        assert torch.equal(storage, _main_write("reference", offset)), offset
