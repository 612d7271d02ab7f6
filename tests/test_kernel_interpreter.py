"""The Triton kernels under TRITON_INTERPRET=1 against the reference, byte for byte: outputs and the
cache's whole storage (guards, padding, reserved scale bytes, untouched slots)."""
import random

import pytest
import torch

import kvfuse
from kvfuse import CastArgs
from kernel_cases import ALL_FORMATS, Case, build, diff_bytes, random_case, run_case
from kvfuse.kernels import config
from kvfuse.kernels import portable as fused_kernels
from kvfuse.plans.fused import build_plan

pytestmark = pytest.mark.skipif(not kvfuse.backend.interpreter_enabled(), reason="interpreter tests (CPU)")


def check(case: Case):
    ref = run_case(case, "reference", "cpu")
    tri = run_case(case, "triton", "cpu")
    assert diff_bytes(ref, tri) == 0, case.describe()


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("n", [1, 17, 300])
def test_every_format_full_chain(fmt, n):
    rdim = 64 if fmt.head_dim >= 128 else 32
    stage = "cast_back" if fmt.quantized else "transform"
    bs = 16
    check(Case(n=n, heads=1, head_dim=fmt.head_dim, fmt=fmt, rotary_dim=rdim, out_stage=stage, block_size=bs,
               num_blocks=(n + bs - 1) // bs + 1, slot_kind="random", seed=n, idx32=n == 17, x2d=n == 1))


@pytest.mark.parametrize("fmt", [f for f in ALL_FORMATS if f.head_dim & (f.head_dim - 1) == 0], ids=lambda f: f.name)
@pytest.mark.parametrize("toggles", ["norm", "rope", "had", "norm+had", "none", "rope+had"])
def test_stage_toggles(fmt, toggles):
    check(Case(n=17, heads=1, head_dim=fmt.head_dim, fmt=fmt, norm="norm" in toggles, rope="rope" in toggles,
               hadamard="had" in toggles, rotary_dim=32, out_stage="transform", block_size=4, num_blocks=6,
               slot_kind="cross_page", seed=3))


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("conjugate", [False, True])
@pytest.mark.parametrize("offset", [None, 0, 96])
def test_rope_variants(neox, conjugate, offset):
    fmt = kvfuse.formats.MAIN_FP8
    check(Case(n=17, heads=2, head_dim=512, fmt=fmt, neox=neox, conjugate=conjugate, rope_offset=offset,
               rotary_dim=64, out_stage="norm", slot_kind="continuous", token_padding=32, block_padding=64, seed=5))


@pytest.mark.parametrize("stage", ["norm", "transform", "cast_back"])
@pytest.mark.parametrize("fmt", [kvfuse.formats.MAIN_FP4, kvfuse.formats.FLASHMLA_V32, kvfuse.formats.INDEX_NVFP4],
                         ids=lambda f: f.name)
def test_out_stages(stage, fmt):
    check(Case(n=17, heads=1, head_dim=fmt.head_dim, fmt=fmt, out_stage=stage, slot_kind="invalid", seed=7))


CASTS = [CastArgs("e4m3", g, sf.startswith("ue8m0"), sf) for g in (16, 32, 64, 128)
         for sf in ("ue8m0", "ue8m0_fp32", "e4m3", "fp32")] + [CastArgs("e2m1", 16, False, "e4m3"),
                                                             CastArgs("e2m1", 32, True, "ue8m0")]


@pytest.mark.parametrize("cast", CASTS, ids=lambda c: f"{c.cast_fmt}-{c.num_per_channels}-{c.sf_format}")
@pytest.mark.parametrize("cast_back", [False, True])
def test_contiguous_casts(cast, cast_back):
    c = CastArgs(cast.cast_fmt, cast.num_per_channels, cast.round_sf, cast.sf_format, cast_back)
    check(Case(n=9, heads=3, head_dim=256, fmt=None, cast=c, hadamard=True, seed=11))


@pytest.mark.parametrize("head_dim", [16, 64, 192, 576, 1024])
def test_bf16_out_any_head_dim(head_dim):
    check(Case(n=5, heads=2, head_dim=head_dim, fmt=None, cast=None, rotary_dim=16, x_row_pad=16,
               hadamard=head_dim & (head_dim - 1) == 0, seed=13))


def test_random_cases():
    rng = random.Random(2026)
    for _ in range(120):
        check(random_case(rng, max_n=40))


@pytest.mark.parametrize("fmt", ALL_FORMATS, ids=lambda f: f.name)
def test_store_and_load_kernels(fmt):
    gen = torch.Generator().manual_seed(1)
    heads = 2 if fmt.token_interleaved else 1
    n = 13
    x = (torch.randn(n, heads, fmt.head_dim, generator=gen) * 3).to(torch.bfloat16)
    slots = torch.tensor([0, 3, 4, 31, -1, 8, 40, 9, 17, 16, -9, 2, 1])
    results = {}
    for backend in ("reference", "triton"):
        cache = fmt.allocate(4, 8, heads, block_padding=32)
        flat = cache.as_strided((cache.untyped_storage().nbytes(),), (1,), 0)
        flat.copy_(torch.randint(0, 256, flat.shape, generator=torch.Generator().manual_seed(2), dtype=torch.uint8))
        with kvfuse.use_backend(backend):
            if fmt.quantized:
                spec = CastArgs.from_cache_format(fmt)
                q, sf = kvfuse.reference.quantize(x[..., : fmt.quant_dim], spec.cast_fmt, spec.num_per_channels,
                                                  spec.sf_format)
                tail = x[..., fmt.quant_dim:] if fmt.bf16_tail else None
                kvfuse.store_kv_cache(q, sf, cache, slots, fmt, tail=tail)
            else:
                kvfuse.store_kv_cache(x, None, cache, slots, fmt)
            loaded = kvfuse.load_paged_kv_cache(cache, slots, fmt)
            data, sfb = kvfuse.load_paged_kv_cache(cache, slots, fmt, dequantize=False)
        results[backend] = (flat.clone(), loaded.view(torch.uint8), data, sfb)
    for a, b in zip(results["reference"], results["triton"]):
        assert torch.equal(a, b)


def test_int64_row_and_slot_paths(monkeypatch):
    """Row and slot arithmetic in int64 (what caches of >= 2**31 token slots and launches of >= 2**31
    rows use) gives the same bytes."""
    monkeypatch.setattr(config, "INT32_LIMIT", 0)
    rng = random.Random(64)
    for _ in range(12):
        check(random_case(rng, max_n=24))
    check(Case(n=7, heads=3, head_dim=64, fmt=None, cast=CastArgs("e4m3", 16, False, "e4m3"), seed=5))


def _plan(case):
    args, _, _ = build(case, "cpu")
    return build_plan(**args)[0]


@pytest.mark.parametrize("case, mode, vec", [
    (Case(n=3, heads=1, head_dim=512, fmt=kvfuse.formats.MAIN_FP8), 2, 4),       # 532-byte records: 4-aligned
    (Case(n=3, heads=1, head_dim=512, fmt=kvfuse.formats.MAIN_FP4), 2, 8),
    (Case(n=3, heads=1, head_dim=576, fmt=kvfuse.formats.FLASHMLA_V32), 2, 8),   # rope in the bf16 tail
    (Case(n=3, heads=1, head_dim=128, fmt=kvfuse.formats.INDEX_FP8_FP32), 1, 8),  # one group of 128 spans it
    (Case(n=3, heads=1, head_dim=128, fmt=kvfuse.formats.INDEX_NVFP4, neox=False), 2, 8),
    (Case(n=3, heads=1, head_dim=128, fmt=kvfuse.formats.INDEX_MXFP8, hadamard=True), 1, 8),
    (Case(n=3, heads=2, head_dim=256, fmt=None, rotary_dim=64, rope_offset=96,
          cast=CastArgs("e4m3", 64, False, "fp32")), 1, 8),                       # offset 96 splits a group
    (Case(n=3, heads=2, head_dim=256, fmt=None, cast=None, rotary_dim=48), 1, 8),  # 24 pairs: not a power of 2
    (Case(n=3, heads=2, head_dim=256, fmt=None, cast=None, rope=False), 0, 8),
])
def test_rope_mode_and_vector_width(case, mode, vec):
    plan = _plan(case)
    assert fused_kernels.rope_mode(plan) == mode
    qal = fused_kernels.record_alignments(plan)[0] if plan.kv_cache is not None else 16
    assert fused_kernels.vec_width(plan, qal) == vec
    check(case)


@pytest.mark.parametrize("vec", [4, 8])
def test_forced_vector_width(vec):
    with config.force_config(vec=vec):
        check(Case(n=5, heads=1, head_dim=512, fmt=kvfuse.formats.MAIN_FP8, seed=3, out_stage="cast_back"))
        check(Case(n=5, heads=2, head_dim=128, fmt=None, cast=CastArgs("e2m1", 32, True, "ue8m0"), seed=4))
