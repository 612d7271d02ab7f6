"""Programmatic dependent launch on the GPU (kvfuse.set_pdl): every kernel the dispatcher can pick
waits for the previous kernel before its first read of x.

A producer kernel lets its dependents launch at once (griddepcontrol.launch_dependents), then spins
for 20 us and only then writes x (x is NaN until then). A kvfuse call launched right after it with
PDL on must write exactly the reference's bytes for the real x: eagerly (current and side stream)
and inside a CUDA graph. Limit, measured on the H200 (Triton 3.6, driver 580): a copy kernel
launched the same way WITHOUT the wait also read the written x in every try (current or side stream,
producer launched with or without PDL), so the early start this setup intends was never provoked:
these cases prove that PDL launches keep the bytes, not that the wait alone orders them (the PTX
check, tests/ptx_check.py, shows the wait ahead of every load). Run with KVFUSE_TEST_GPU=1
on a Hopper (or newer) GPU:

    KVFUSE_TEST_GPU=1 python3 -m pytest -q tests/gpu/test_gpu_pdl.py
"""
import dataclasses

import pytest
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, globaltimer

import kvfuse
from kvfuse.kernels import router
from gpu_matrix import dispatch_of, fast_cases
from kernel_cases import Case, build, diff_bytes, diff_report, plan_of, run_case

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or kvfuse.backend.interpreter_enabled()
    or torch.cuda.get_device_capability()[0] < 9,
    reason="needs a Hopper-or-newer CUDA GPU and compiled kernels (KVFUSE_TEST_GPU=1)")

SPIN_NS = 20_000
PRODUCER_CTAS = 64


@triton.jit
def _late_writer(src, dst, numel, spin_ns, BLOCK: tl.constexpr):
    gdc_launch_dependents()                     # dependents may launch now ...
    t0 = globaltimer()
    while globaltimer() - t0 < spin_ns:         # ... while x is still NaN
        pass
    for start in range(tl.program_id(0) * BLOCK, numel, tl.num_programs(0) * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < numel), mask=offs < numel)


def _late_write(src, dst):
    _late_writer[(PRODUCER_CTAS,)](src, dst, src.numel(), SPIN_NS, BLOCK=1024)


def _cases():
    """One case per launch-table entry the dispatcher can pick for these chains: every fast-path
    entry (from the GPU matrix's fast cases) and the portable kernel's one-row (EARLY) and multi-row
    programs; and the calls whose path PDL changes (a module's MIN_ROWS_PDL below its MIN_ROWS: one
    row of DeepSeek V3.2's indexer K chain, which takes the indexer fast path only under PDL)."""
    by_label = {}
    for c in fast_cases():
        if c.fmt is not None:
            by_label.setdefault(dispatch_of(c), c)
    # conjugate RoPE: no fast path takes it
    base = dict(heads=1, head_dim=128, rotary_dim=64, seed=7, hadamard=True, conjugate=True,
                fmt=kvfuse.formats.INDEX_MXFP8)
    for n in (1, 3000):
        c = Case(n=n, **base, num_blocks=n // 16 + 2)
        by_label.setdefault(dispatch_of(c), c)
    for module in router.FAST_PATH_MODULES:
        if module.MIN_ROWS_PDL < module.MIN_ROWS:
            name = module.__name__.rsplit(".", 1)[1]
            c = Case(n=module.MIN_ROWS_PDL, heads=1, head_dim=128, rotary_dim=64, out_stage=None, neox=True,
                     norm_kind="layer", bias=True, rope_offset=0, hadamard=True, fmt=kvfuse.formats.INDEX_FP8_FP32,
                     seed=8, num_blocks=4)
            assert name == "indexer" and module.eligible(plan_of(c)), name   # a chain this module serves
            by_label[f"{name} entry 0 at {c.n} row (MIN_ROWS_PDL)"] = c
    return sorted(by_label.items())


CASES = _cases() if torch.cuda.is_available() else []


def _pdl_call(case, graph: bool, early: bool = False):
    """The case's kvfuse call with PDL on (``early``: with its early reads of the slots and positions, which
    the producer does not write), right after a producer that writes x late; its outputs."""
    args, outs, storage = build(case, "cuda")
    x = args["x"]
    src = x.clone()
    x.fill_(float("nan"))
    kvfuse.set_pdl(True, early_reads=early)
    try:
        with kvfuse.use_backend("triton"):
            kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(**{**args, "x": src})   # compile, warm the plan
            if graph:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    _late_write(src, x)
                    kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(**args)
                x.fill_(float("nan"))
                g.replay()
            else:
                _late_write(src, x)
                kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(**args)
    finally:
        kvfuse.set_pdl(False)
    torch.cuda.synchronize()
    res = {k: v.view(torch.uint8).cpu() for k, v in outs.items()}
    if storage is not None:
        res["storage"] = storage.cpu()
    return res


@pytest.mark.parametrize("early", [False, True], ids=["pdl", "pdl early reads"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("side_stream", [False, True], ids=["current stream", "side stream"])
@pytest.mark.parametrize("label,case", CASES, ids=[label for label, _ in CASES])
def test_pdl_call_waits_for_the_producer(label, case, graph, side_stream, early):
    ref = run_case(case, "reference", "cuda")
    if side_stream:
        with torch.cuda.stream(torch.cuda.Stream()):
            got = _pdl_call(case, graph, early)
    else:
        got = _pdl_call(case, graph, early)
    assert diff_bytes(ref, got) == 0, label + " :: " + diff_report(ref, got)


def test_early_reads_reach_every_fast_path():
    """Under set_pdl(True, early_reads=True) each fast path launches with its PDL_EARLY constexpr on (for
    at least one case; the cast alone of main_latent names none and keeps every read after the wait),
    and no launch of the portable kernel names one."""
    early_by_path = {}
    real = router.with_pdl
    current = {}

    def spy(options, pdl):
        out = real(options, pdl)
        if out.get("PDL_EARLY"):
            early_by_path[current["label"].split()[0]] = True
        if current["label"].startswith("plain"):
            assert "PDL_EARLY" not in options, current["label"]
        return out

    router.with_pdl = spy
    kvfuse.set_pdl(True, early_reads=True)
    cache_was = kvfuse.plan_cache_enabled()
    kvfuse.set_plan_cache(False)
    try:
        with kvfuse.use_backend("triton"):
            for label, case in CASES:
                current["label"] = label
                args, _, _ = build(case, "cuda")
                kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(**args)
    finally:
        router.with_pdl = real
        kvfuse.set_pdl(False)
        kvfuse.set_plan_cache(cache_was)
    names = {module.__name__.rsplit(".", 1)[1] for module in router.FAST_PATH_MODULES}
    assert names <= set(early_by_path), (names, early_by_path)


@pytest.mark.parametrize("n", [1, 300])
def test_pdl_gqa_call_waits_for_the_producer(n):
    """fused_qk_norm_rope_store_kv with PDL on, right after a producer that writes the packed QKV late:
    the reference's bytes (per-head programs at n = 1 and the multi-token ones)."""
    import gqa_cases as G
    case = G.GQACase(n=n, fp8=True, neox=False, seed=50 + n)
    ref = G.run_gqa_case(case, "reference", "cpu")
    kw, storages, inputs, q_buf = G.build(case, "cuda")
    qkv_buf = inputs[0]
    src = qkv_buf.clone()
    kvfuse.set_pdl(True)
    try:
        kvfuse.fused_qk_norm_rope_store_kv(**kw)          # compile first (q_out is not q: inputs unchanged)
        qkv_buf.fill_(float("nan"))
        _late_write(src, qkv_buf)
        result = kvfuse.fused_qk_norm_rope_store_kv(**kw)
    finally:
        kvfuse.set_pdl(False)
    torch.cuda.synchronize()
    got = {f"cache_storage{i}": G._bytes(t) for i, t in enumerate(storages)}
    got.update({f"input{i}": G._bytes(t) for i, t in enumerate(inputs)})
    got["q_out"] = G._bytes(result) if q_buf is None else G._bytes(q_buf)
    assert not G.diff_report(ref, got), G.diff_report(ref, got)


def test_cases_cover_every_fast_path_and_both_portable_programs():
    labels = {label for label, _ in CASES}
    for module in router.FAST_PATH_MODULES:
        name = module.__name__.rsplit(".", 1)[1]
        assert any(label.startswith(name) for label in labels), name
    assert sum(label.startswith("plain") for label in labels) >= 2, labels
