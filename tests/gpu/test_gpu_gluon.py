"""GPU module for the Gluon MAIN_FP8 fast path (kvfuse/kernels/gluon_main_fp8.py; skipped without
CUDA + Triton 3.6; KVFUSE_TEST_GPU=1): the public entry point takes it for the MAIN_FP8 chain
and writes the same bytes as the reference (the whole cache storage with guard bytes), over the
launch table's rows (1-warp rows, 4 warps, the pipelined persistent loop), index dtypes, weight and
cos/sin dtypes, block sizes, paddings and slot kinds; a misaligned x goes to the plain kernel."""
import pytest
import torch

import kvfuse
from kvfuse.kernels import fused
from kvfuse.kernels import gluon_main_fp8 as G
from helpers import CountingKernel
from kernel_cases import Case, diff_bytes, diff_report, run_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or kvfuse.backend.interpreter_enabled()
                                or not G.available(), reason="needs CUDA, compiled kernels and Triton 3.6's Gluon")


MAIN = dict(heads=1, head_dim=512, fmt=kvfuse.formats.MAIN_FP8, rotary_dim=64, neox=True, out_stage=None)
CASES = [
    Case(n=1, **MAIN, seed=1),
    Case(n=3, **MAIN, seed=2, idx32=True, w_fp32=True),
    Case(n=300, **MAIN, seed=3, cs_bf16=True, slot_kind="invalid", block_size=24, num_blocks=16),
    Case(n=4097, **MAIN, seed=4, block_size=64, num_blocks=70, slot_kind="cross_page", token_padding=8,
         block_padding=96),
    Case(n=20000, **MAIN, seed=5, block_size=1, num_blocks=20050, x_row_pad=16),
    Case(n=65537, **MAIN, seed=6, block_size=64, num_blocks=1100, slot_kind="random", idx32=True, x2d=True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"n{c.n}-s{c.seed}")
def test_fast_path_taken_and_exact(case, monkeypatch):
    assert fused.GLUON, "the fast path should be on with Triton 3.6 on CUDA"
    counting = CountingKernel(G.main_fp8_kernel)
    monkeypatch.setattr(G, "main_fp8_kernel", counting)
    kvfuse.plan.clear_plan_cache()
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
