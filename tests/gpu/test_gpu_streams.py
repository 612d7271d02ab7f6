"""GPU module (skipped without CUDA; KVFUSE_TEST_GPU=1): two CUDA streams writing
disjoint slots of one cache concurrently give the same bytes as one stream writing both halves,
and repeated runs and every forced launch configuration give identical bytes."""
import pytest
import torch

import kvfuse
from kvfuse import CastArgs, KVCacheOutArgs, NormArgs, RopeArgs, formats
from kvfuse.kernels.config import force_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or kvfuse.backend.interpreter_enabled(),
                                reason="needs CUDA and compiled kernels (KVFUSE_TEST_GPU=1)")
FMT = formats.MAIN_FP8


def inputs(n, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(n, 512, generator=g, device="cuda") * 3).to(torch.bfloat16)
    w = torch.rand(512, generator=g, device="cuda").to(torch.bfloat16)
    ang = torch.rand(4096, 32, generator=g, device="cuda") * 6
    pos = torch.randint(0, 4096, (n,), generator=g, device="cuda")
    return x, NormArgs(w), RopeArgs(pos, torch.cat([ang.cos(), ang.sin()], 1), 64, True)


def write(x, norm, rope, cache, slots):
    kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(x, norm, rope, None, CastArgs.from_cache_format(FMT),
                                                       KVCacheOutArgs(cache, slots, layout=FMT))


def storage(cache):
    return cache.as_strided((cache.untyped_storage().nbytes(),), (1,), 0)


def test_two_streams_disjoint_slots():
    n = 65536
    x, norm, rope = inputs(n, 0)
    perm = torch.randperm(2 * n, device="cuda")
    slots_a, slots_b = perm[:n], perm[n:]
    half = n // 2
    one = FMT.allocate(2 * n // 64, 64, device="cuda")
    storage(one).copy_(torch.randint(0, 256, storage(one).shape, dtype=torch.uint8, device="cuda"))
    two = FMT.allocate(2 * n // 64, 64, device="cuda")
    storage(two).copy_(storage(one))
    write(x, norm, rope, one, torch.cat([slots_a[:half], slots_b[half:]]))
    ra = RopeArgs(rope.positions[:half], rope.cos_sin_cache, 64, True)
    rb = RopeArgs(rope.positions[half:], rope.cos_sin_cache, 64, True)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    s1.wait_stream(torch.cuda.current_stream())
    s2.wait_stream(torch.cuda.current_stream())
    for _ in range(3):                                   # the same bytes each time: idempotent writes
        with torch.cuda.stream(s1):
            write(x[:half], norm, ra, two, slots_a[:half])
        with torch.cuda.stream(s2):
            write(x[half:], norm, rb, two, slots_b[half:])
    torch.cuda.synchronize()
    assert torch.equal(storage(one), storage(two))


def test_repeated_runs_and_launch_configs_identical():
    n = 3000
    x, norm, rope = inputs(n, 1)
    slots = torch.randperm(64 * 64, device="cuda")[:n]
    results = []
    configs = [(None, None), (1, 1), (1, 4), (2, 1), (4, 2), (8, 4), (16, 8)]
    for bm, nw in configs + [(None, None)]:
        cache = FMT.allocate(64, 64, device="cuda")
        with force_config(bm, nw):
            write(x, norm, rope, cache, slots)
        results.append(storage(cache).clone())
    assert all(torch.equal(results[0], r) for r in results[1:])
