"""GPU module for the Gluon fast paths (kvfuse/kernels/gluon/*.py; skipped without CUDA + Triton 3.6;
KVFUSE_TEST_GPU=1): the public entry point takes each fast path for its chain and writes the same
bytes as the reference (the whole cache storage with guard bytes, or the whole q / sf outputs), over
the launch tables' rows, index dtypes, weight and cos/sin dtypes, block sizes, paddings, slot kinds and
head counts (kernel_cases.FAST_CASES; tests/test_gluon_dispatch.py checks on the CPU that every case
is eligible for the module it names); a misaligned x goes to the plain kernel."""
import importlib

import pytest
import torch

import kvfuse
from kvfuse.kernels import router
from kvfuse.kernels.gluon import main_latent as G
from helpers import CountingKernel
from kernel_cases import FAST_CASES, diff_bytes, diff_report, run_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or kvfuse.backend.interpreter_enabled()
                                or not G.available(), reason="needs CUDA, compiled kernels and Triton 3.6's Gluon")

def case_id(entry):
    module, _, c = entry
    return f"{module}-n{c.n}-h{c.heads}-s{c.seed}"


@pytest.mark.parametrize("entry", FAST_CASES, ids=case_id)
def test_fast_path_taken_and_exact(entry, monkeypatch):
    module_name, kernel_name, case = entry
    module = importlib.import_module(f"kvfuse.kernels.gluon.{module_name}")
    assert router.GLUON, "the fast paths should be on with Triton 3.6 on CUDA"
    counting = CountingKernel(getattr(module, kernel_name))
    monkeypatch.setattr(module, kernel_name, counting)
    kvfuse.clear_plan_cache()
    tri = run_case(case, "triton", "cuda")
    ref = run_case(case, "reference", "cuda")
    assert counting.launches >= 1, "the Gluon kernel was not used"
    assert diff_bytes(ref, tri) == 0, case.describe() + " :: " + diff_report(ref, tri)


def test_misaligned_x_takes_the_plain_kernel():
    n = 513
    g = torch.Generator(device="cuda").manual_seed(7)
    big = (torch.randn(n * 512 + 2, generator=g, device="cuda") * 3).to(torch.bfloat16)
    w = torch.rand(512, generator=g, device="cuda").to(torch.bfloat16)
    ang = torch.rand(256, 32, generator=g, device="cuda") * 6
    rope = kvfuse.RopeArgs(torch.randint(0, 256, (n,), device="cuda"), torch.cat([ang.cos(), ang.sin()], 1), 64, True)
    slots = torch.randperm(16 * 64, device="cuda")[:n]
    fmt = kvfuse.formats.MAIN_FP8
    for offset in (0, 1, 0):                      # 1: x is 2 mod 4 bytes: not readable as words
        x = big[offset:offset + n * 512].view(n, 512)
        caches = []
        for backend in ("triton", "reference"):
            cache = fmt.allocate(16, 64, device="cuda")
            cache.view(-1).copy_(torch.randint(0, 256, (cache.numel(),), dtype=torch.uint8, device="cuda",
                                               generator=torch.Generator(device="cuda").manual_seed(8)))
            with kvfuse.use_backend(backend):
                kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(
                    x, kvfuse.NormArgs(w), rope, None, kvfuse.CastArgs.from_cache_format(fmt),
                    kvfuse.KVCacheOutArgs(cache, slots, layout=fmt))
            caches.append(cache)
        torch.cuda.synchronize()
        assert torch.equal(caches[0], caches[1]), f"x offset {offset}"
