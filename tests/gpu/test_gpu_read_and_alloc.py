"""GPU module: the read side on random cache bytes (NaN codes included: SPEC §7 decodes them as NaN,
each written as the bf16 0x7FC0) and writes into FlashMLA-style allocations (blocks of
(block_size + 1) * 656 bytes), the compiled kernels against the reference on the GPU, whole
storages compared byte for byte. Run with KVFUSE_TEST_GPU=1 on a CUDA machine."""
import pytest
import torch

import kvfuse
from kvfuse import formats
from kernel_cases import Case, diff_bytes, diff_report, run_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or kvfuse.backend.interpreter_enabled(),
                                reason="needs CUDA and compiled kernels (KVFUSE_TEST_GPU=1)")


@pytest.mark.parametrize("fmt", list(formats.PRESETS.values()), ids=lambda f: f.name)
def test_load_of_random_bytes(fmt):
    g = torch.Generator().manual_seed(17)
    heads = 2 if fmt.token_interleaved else 1
    cache = fmt.allocate(40, 16, heads, device="cuda")
    flat = cache.as_strided((cache.untyped_storage().nbytes(),), (1,), 0)
    flat.copy_(torch.randint(0, 256, flat.shape, generator=g, dtype=torch.uint8).cuda())
    slots = torch.randint(-8, 40 * 16 + 8, (3000,), generator=g).cuda()
    got = {}
    for backend in ("reference", "triton"):
        with kvfuse.use_backend(backend):
            got[backend] = kvfuse.load_paged_kv_cache(cache, slots, fmt)
    assert torch.equal(got["reference"].view(torch.int16), got["triton"].view(torch.int16))
    if fmt.quantized:
        assert bool(torch.isnan(got["triton"].float()).any())      # random bytes hold NaN codes


@pytest.mark.parametrize("block_size", [1, 3, 16, 64])
@pytest.mark.parametrize("neox", [True, False])
def test_flashmla_v32_engine_allocation(block_size, neox):
    """FlashMLA's tests allocate V32 blocks of (block_size + 1) * 656 bytes: accepted, and the padding
    after each block's records stays untouched (the whole poisoned storage is compared)."""
    n = 3000
    num_blocks = n // block_size + 2
    case = Case(n=n, heads=1, head_dim=576, fmt=formats.FLASHMLA_V32, neox=neox, block_size=block_size,
                num_blocks=num_blocks, block_padding=656, slot_kind="random", seed=block_size)
    ref = run_case(case, "reference", "cuda")
    for _ in range(2):                    # Triton's launch, then the direct launcher
        tri = run_case(case, "triton", "cuda")
        assert diff_bytes(ref, tri) == 0, diff_report(ref, tri)


@pytest.mark.parametrize("fmt", [formats.FLASHMLA_V32, formats.FLASHMLA_MODEL1], ids=lambda f: f.name)
@pytest.mark.parametrize("n", [1, 300, 20000])
@pytest.mark.parametrize("norm", [True, False])
def test_flashmla_scale_floor_zero_tiny_and_huge_rows(fmt, n, norm):
    """The presets' scale_floor (FlashMLA's 2^-13 smallest scale) on the fast path (norm on) and the
    portable kernel (norm off): zero rows, tiny and huge rows (kernel_cases' data), whole storages."""
    case = Case(n=n, heads=1, head_dim=fmt.head_dim, fmt=fmt, norm=norm, neox=n % 2 == 0, block_size=64,
                num_blocks=n // 64 + 2, slot_kind="random", seed=n + norm)
    ref = run_case(case, "reference", "cuda")
    for _ in range(2):
        tri = run_case(case, "triton", "cuda")
        assert diff_bytes(ref, tri) == 0, diff_report(ref, tri)
