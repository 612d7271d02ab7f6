"""GPU module (skipped without CUDA; run with KVFUSE_TEST_GPU=1 so the kernels are compiled, not
interpreted): the full matrix including n = 32769, and a random stress of thousands of cases,
the compiled kernel against the reference on the GPU (and on the CPU for a sample), bytes compared.
KVFUSE_GPU_STRESS sets the number of random cases (default 800)."""
import os
import random
import time

import pytest
import torch

import kvfuse
from kernel_cases import ALL_FORMATS, Case, diff_bytes, diff_report, random_case, run_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or kvfuse.backend.interpreter_enabled(),
                                reason="needs CUDA and compiled kernels (KVFUSE_TEST_GPU=1)")
SUMMARY = {"cases": 0, "cpu_ref_cases": 0, "byte_diffs": 0}


def check(case: Case, cpu_too: bool = False):
    tri = run_case(case, "triton", "cuda")
    ref = run_case(case, "reference", "cuda")
    d = diff_bytes(ref, tri)
    report = "gpu-ref vs triton: " + diff_report(ref, tri)
    SUMMARY["cases"] += 1
    if cpu_too:
        cpu = run_case(case, "reference", "cpu")
        d += diff_bytes(cpu, tri)
        report += " | cpu-ref vs triton: " + diff_report(cpu, tri) + " | cpu-ref vs gpu-ref: " + diff_report(cpu, ref)
        SUMMARY["cpu_ref_cases"] += 1
    SUMMARY["byte_diffs"] += d
    assert d == 0, case.describe() + " :: " + report


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("n", [1, 17, 300, 32769])
@pytest.mark.parametrize("slot_kind", ["continuous", "cross_page", "invalid"])
def test_matrix(fmt, n, slot_kind):
    bs = 64
    rdim = 64 if fmt.head_dim >= 128 else 32
    pow2 = fmt.head_dim & (fmt.head_dim - 1) == 0
    for i, (had, neox, conj, stage) in enumerate([(False, True, False, "cast_back"), (pow2, False, True, "norm"),
                                                  (False, True, False, "transform")]):
        if stage == "cast_back" and not fmt.quantized:
            stage = "transform"
        check(Case(n=n, heads=1, head_dim=fmt.head_dim, fmt=fmt, rotary_dim=rdim, hadamard=had, neox=neox,
                   conjugate=conj, out_stage=stage, block_size=bs, num_blocks=(n + bs - 1) // bs + 1,
                   block_padding=64 * i, slot_kind=slot_kind, seed=n + i, idx32=i == 1,
                   x2d=i == 2), cpu_too=(n <= 300 and i == 0))


def test_random_stress():
    count = int(os.environ.get("KVFUSE_GPU_STRESS", "800"))
    rng = random.Random(20261129)
    t0 = time.time()
    for i in range(count):
        check(random_case(rng, max_n=2048, variants=48), cpu_too=(i % 50 == 0))
    print(f"\nstress: {count} cases in {time.time() - t0:.1f}s")


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
def test_store_load(fmt):
    gen = torch.Generator().manual_seed(3)
    heads = 2 if fmt.token_interleaved else 1
    n = 4097
    x = (torch.randn(n, heads, fmt.head_dim, generator=gen) * 3).to(torch.bfloat16).cuda()
    slots = torch.randperm(8192, generator=gen)[:n].cuda()
    slots[::7] = -1
    res = {}
    for backend in ("reference", "triton"):
        cache = fmt.allocate(128, 64, heads, block_padding=32, device="cuda")
        flat = cache.as_strided((cache.untyped_storage().nbytes(),), (1,), 0)
        flat.copy_(torch.randint(0, 256, flat.shape, generator=torch.Generator().manual_seed(4),
                                 dtype=torch.uint8).cuda())
        with kvfuse.use_backend(backend):
            if fmt.quantized:
                c = kvfuse.CastArgs.from_cache_format(fmt)
                q, sf = kvfuse.reference.quantize(x[..., : fmt.quant_dim], c.cast_fmt, c.num_per_channels, c.sf_format)
                kvfuse.store_kv_cache(q, sf, cache, slots, fmt, tail=x[..., fmt.quant_dim:] if fmt.bf16_tail else None)
            else:
                kvfuse.store_kv_cache(x, None, cache, slots, fmt)
            res[backend] = (flat.clone(), kvfuse.load_paged_kv_cache(cache, slots, fmt).view(torch.uint8),
                            *kvfuse.load_paged_kv_cache(cache, slots, fmt, dequantize=False))
    for a, b in zip(res["reference"], res["triton"]):
        assert torch.equal(a, b)


def test_zz_summary():
    print(f"\nGPU summary: {torch.cuda.get_device_name()} torch {torch.__version__} triton "
          f"{__import__('triton').__version__}: {SUMMARY['cases']} cases vs GPU reference "
          f"({SUMMARY['cpu_ref_cases']} also vs CPU reference), {SUMMARY['byte_diffs']} byte differences")
    assert SUMMARY["cases"] > 0 and SUMMARY["byte_diffs"] == 0
