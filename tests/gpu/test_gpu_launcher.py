"""GPU module for the direct launch path (kvfuse/kernels/launcher.py; skipped without CUDA;
KVFUSE_TEST_GPU=1): after the first launch of a signature, calls go straight to Triton's compiled
launcher, and give the same bytes as the reference; a misaligned tensor goes back through Triton
(which compiles the misaligned specialization) and is still exact; store / load too."""
import pytest
import torch
import triton

import kvfuse
from kvfuse import CastArgs, KVCacheOutArgs, NormArgs, RopeArgs, formats
from kvfuse.kernels import router
from helpers import CountingKernel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or kvfuse.backend.interpreter_enabled(),
                                reason="needs CUDA and compiled kernels (KVFUSE_TEST_GPU=1)")
FMT = formats.MAIN_FP8


def storage(cache):
    return cache.as_strided((cache.untyped_storage().nbytes(),), (1,), 0)


def call(x, w, pos, cs, cache, slots, backend):
    with kvfuse.use_backend(backend):
        kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(
            x, NormArgs(w), RopeArgs(pos, cs, 64, True), None, CastArgs.from_cache_format(FMT),
            KVCacheOutArgs(cache, slots, layout=FMT))


def test_direct_path_used_and_exact(monkeypatch):
    if not router.DIRECT_LAUNCH:
        pytest.skip(f"no direct launch on triton {triton.__version__}")
    monkeypatch.setattr(router, "GLUON", False)   # the plain kernel (the Gluon path: test_gpu_gluon.py)
    kvfuse.clear_plan_cache()
    counting = CountingKernel(router.fused_kernel)
    monkeypatch.setattr(router, "fused_kernel", counting)
    n = 777
    g = torch.Generator(device="cuda").manual_seed(3)
    big = (torch.randn(n * 512 + 8, generator=g, device="cuda") * 4).to(torch.bfloat16)
    w = torch.rand(512, generator=g, device="cuda").to(torch.bfloat16)
    ang = torch.rand(1024, 32, generator=g, device="cuda") * 6
    cs = torch.cat([ang.cos(), ang.sin()], 1)
    pos = torch.randint(-4, 1030, (n,), generator=g, device="cuda")
    slots = torch.randperm(64 * 32, device="cuda")[:n]
    slots[::7] = -1
    for offset, expect_triton in ((0, 1), (0, 0), (0, 0), (1, 1), (0, 0), (8, 0)):
        # offset 1 (2 bytes): a pointer Triton does not specialize as aligned; offset 8: 16 bytes
        x = big[offset:offset + n * 512].view(n, 512)
        before = counting.launches
        got = FMT.allocate(64, 32, device="cuda")
        storage(got).copy_(torch.randint(0, 256, storage(got).shape, dtype=torch.uint8, device="cuda"))
        want = got.clone()
        call(x, w, pos, cs, got, slots, "triton")
        call(x, w, pos, cs, want, slots, "reference")
        torch.cuda.synchronize()
        assert counting.launches - before == expect_triton, (offset, counting.launches - before)
        assert torch.equal(storage(got), storage(want)), f"x offset {offset}"


def test_store_and_load_exact_through_repeated_calls():
    fmt = formats.INDEX_MXFP4
    n = 300
    g = torch.Generator(device="cuda").manual_seed(5)
    x = (torch.randn(n, 128, generator=g, device="cuda") * 2).to(torch.bfloat16)
    with kvfuse.use_backend("reference"):
        q, sf = kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(x, cast_args=CastArgs.from_cache_format(fmt))
    slots = torch.randperm(16 * 64, device="cuda")[:n]
    for _ in range(3):
        caches = []
        for backend in ("triton", "reference"):
            cache = fmt.allocate(16, 64, device="cuda")
            storage(cache).copy_(torch.randint(0, 256, storage(cache).shape, dtype=torch.uint8, device="cuda",
                                               generator=torch.Generator(device="cuda").manual_seed(9)))
            with kvfuse.use_backend(backend):
                kvfuse.store_kv_cache(q, sf, cache, slots, layout=fmt)
                caches.append((cache, kvfuse.load_paged_kv_cache(cache, slots, layout=fmt, dequantize=True)))
        torch.cuda.synchronize()
        (c1, l1), (c2, l2) = caches
        assert torch.equal(storage(c1), storage(c2))
        assert torch.equal(l1.view(torch.int16), l2.view(torch.int16))


@pytest.mark.parametrize("write", ["dsv4_main_fp8", "dsv3_main_kv_c_k_pe", "dsv32_index_k"])
def test_mla_writes_keyed_from_raw_arguments_exact(write):
    """kvfuse.mla's writes found in the plan cache from their raw arguments (no argument objects built on
    a hit, the launch kept with the template): three calls with new tensors of one signature, each exact
    against the reference backend."""
    from kvfuse import bench, mla, models
    wl = bench.WORKLOADS[write]
    kvfuse.clear_plan_cache()
    for seed in range(3):
        inp = bench.build_inputs(wl, 37, "cuda", seed=seed)
        storage(inp.cache).copy_(torch.randint(0, 256, storage(inp.cache).shape, dtype=torch.uint8, device="cuda"))
        want = inp.cache.clone()
        for backend, cache in (("triton", inp.cache), ("reference", want)):
            with kvfuse.use_backend(backend):
                if write == "dsv4_main_fp8":
                    mla.write_main_cache(models.DEEPSEEK_V4, inp.x, inp.positions, inp.cos_sin, inp.weight, cache,
                                         inp.slots)
                elif write == "dsv3_main_kv_c_k_pe":
                    mla.write_main_cache(models.DEEPSEEK_V3, (inp.x[:, :512], inp.x[:, 512:]), inp.positions,
                                         inp.cos_sin, inp.weight, cache, inp.slots)
                else:
                    mla.write_indexer_k(models.DEEPSEEK_V32, inp.x, inp.positions, inp.cos_sin, inp.weight, cache,
                                        inp.slots, inp.bias)
        torch.cuda.synchronize()
        assert torch.equal(storage(inp.cache), storage(want)), f"{write}, call {seed}"
    assert kvfuse.plan_cache_info().hits >= 4      # calls 2 and 3 on both backends: the raw arguments' key
