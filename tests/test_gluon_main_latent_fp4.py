"""kvfuse/kernels/gluon/main_latent_fp4.py on the CPU: which calls the Gluon MAIN_FP4 fast path takes
(``eligible`` for the MAIN_FP4 chain and not for its neighbours, user formats with MAIN_FP4's
records, the cache pointer's alignment, the record addressing, the per-call word alignment of x and
the weight, force_config), its launch table and argument table (with a stand-in occupancy: no
device here), the registry entry in kvfuse.kernels.router, that the module imports and stays off
unless Triton 3.6 + CUDA and KVFUSE_GLUON / KVFUSE_GLUON_SKIP allow it, and the host mirror of its
e2m1 encoder against the reference encoder. The kernel itself runs only on the H200
(tests/gpu/test_gpu_fast_paths.py; Gluon has no interpreter)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import kvfuse
from kvfuse import KVCacheFormat
from kvfuse import reference as ref
from kvfuse.kernels import router as fused_kernels
from kvfuse.kernels.gluon import main_latent_fp4 as G
from kvfuse.kernels.launcher import PlanTensor, tensor_arg
from helpers import cache_at
from kernel_cases import Case, plan_of, recast

F = kvfuse.formats
MAIN = F.MAIN_FP4


def main_case(**kw):
    """The fast path's chain: norm, NEOX RoPE on the last 64 columns, MAIN_FP4 cache, no stage copy."""
    base = dict(n=5, heads=1, head_dim=512, fmt=MAIN, rotary_dim=64, neox=True, out_stage=None)
    return Case(**{**base, **kw})


# ---------------------------------------------------------------------------------- eligible
def test_the_main_fp4_chain_is_eligible():
    assert G.eligible(plan_of(main_case()))
    assert G.eligible(plan_of(main_case(w_fp32=True, cs_bf16=True, idx32=True, block_size=24, token_padding=32,
                                        block_padding=40, x2d=True, x_row_pad=8)))
    assert G.eligible(plan_of(main_case(n=1, slot_kind="invalid", block_size=1, num_blocks=7)))
    assert G.eligible(plan_of(main_case(neox=False)))                    # GPT-J on the tail (DeepSeek V4)


@pytest.mark.parametrize("change", [
    dict(out_stage="transform"), dict(out_stage="cast_back"), dict(out_stage="norm"),   # a stage copy
    dict(norm_kind="layer"), dict(conjugate=True), dict(rotary_dim=32), dict(rotary_dim=64, rope_offset=0),
    dict(rope=False), dict(norm=False), dict(hadamard=True), dict(heads=2),
    dict(fmt=F.MAIN_FP8), dict(fmt=F.FLASHMLA_MODEL1), dict(fmt=F.FLASHMLA_V32, head_dim=576),
], ids=lambda c: ",".join(f"{k}={getattr(v, 'name', v)}" for k, v in c.items()))
def test_neighbouring_chains_are_not(change):
    assert not G.eligible(plan_of(main_case(**change)))


@pytest.mark.parametrize("fmt", [F.INDEX_NVFP4, F.INDEX_MXFP4, F.INDEX_BF16], ids=lambda f: f.name)
def test_index_formats_are_not(fmt):
    assert not G.eligible(plan_of(main_case(fmt=fmt, head_dim=128)))


def test_a_user_format_with_main_fp4s_records_is_eligible_others_are_not():
    same = KVCacheFormat("MY_MAIN_FP4", 512, "e2m1", 16, "e4m3", True)
    assert G.eligible(plan_of(main_case(fmt=same)))
    for other in (KVCacheFormat("MY_MAIN_FP4_RESERVED", 512, "e2m1", 16, "e4m3", True, sf_bytes=64),  # 320-byte records
                  KVCacheFormat("MY_MAIN_MXFP4", 512, "e2m1", 32, "ue8m0", True),                    # MXFP4 scales
                  KVCacheFormat("MY_MAIN_E4M3_G16", 512, "e4m3", 16, "e4m3", True),                  # e4m3 values
                  KVCacheFormat("BW_MAIN_FP4", 512, "e2m1", 16, "e4m3", False),                      # block-wide
                  KVCacheFormat("MY_MAIN_FP4_TAIL", 512, "e2m1", 16, "e4m3", True, bf16_tail=64)):   # bf16 tail
        assert not G.eligible(plan_of(main_case(fmt=other))), other.name


@pytest.mark.parametrize("offset,ok", [(0, True), (8, True), (24, True), (4, False), (2, False), (1, False)])
def test_cache_pointer_alignment(offset, ok):
    """The codes leave as 64-bit stores: the cache pointer must be 8-byte aligned (the strides are
    multiples of 32 by the format)."""
    plan = plan_of(main_case())
    cache = cache_at(MAIN, offset)
    moved = recast(plan, kv_cache=cache, addressing=MAIN.addressing_for(cache))
    assert G.eligible(moved) is ok


def test_addressing_must_be_main_fp4s():
    plan = plan_of(main_case())
    a = plan.addressing
    for change in (dict(data_offset=8), dict(sf_offset=a.sf_offset + 4), dict(sf_token_stride=a.sf_token_stride + 32),
                   dict(data_token_stride=a.data_token_stride + 32)):
        assert not G.eligible(recast(plan, addressing=dataclasses.replace(a, **change))), change


def test_cast_must_be_nvfp4():
    plan = plan_of(main_case())
    for change in (dict(group=32), dict(sf_format="ue8m0"), dict(cast_fmt="e4m3")):
        assert not G.eligible(recast(plan, cast=dataclasses.replace(plan.cast, **change))), change
    assert not G.eligible(recast(plan, quant_dim=448))


# ---------------------------------------------------------------------------------- per call
def test_odd_x_row_stride_is_not_eligible():
    assert not G.eligible(plan_of(main_case(x_row_pad=1)))         # rows 513 bf16 apart: not whole words


# ---------------------------------------------------------------------------------- launch
def test_launch_table():
    assert G.MIN_ROWS == 1
    assert G.launch_table(1) == (2, 1, False) and G.launch_table(8192) == (2, 1, False)
    assert G.launch_table(8193) == (1, 1, False) and G.launch_table(262144) == (1, 1, False)
    for n in (1, 3, 300, 513, 4097, 20000, 1 << 20):
        nw, rpw, pipe = G.launch_table(n)
        assert nw in (1, 2, 4, 8) and rpw in (1, 2, 4) and isinstance(pipe, bool)


def _parts(plan, num_warps=4, rows_per_warp=1, pipeline=False, **kw):
    x = plan.x[:, 0, :]
    return G._launch_parts(tensor_arg, x.shape[0], plan.eps, x, plan.weight, plan.positions, plan.cos_sin,
                           plan.slot_mapping, plan.kv_cache, num_warps, rows_per_warp, pipeline, **kw)


def test_argument_table():
    """The positional arguments come from the plan (tensors as placeholders) in the kernel's order, and
    every kernel parameter after them is a constexpr given by name (kvfuse's direct launcher)."""
    plan = plan_of(main_case(n=7, block_size=24, token_padding=32, block_padding=40, idx32=True))
    grid, args, constexprs, options = _parts(plan, ctas_per_sm=2, sm_count=4)
    cache = plan.kv_cache
    assert [a.field for a in args if isinstance(a, PlanTensor)] == ["x", "weight", "positions", "cos_sin",
                                                                     "slot_mapping", "kv_cache"]
    numbers = [v for v in args if not isinstance(v, PlanTensor)]
    assert numbers == [plan.x.stride(0) // 2, plan.eps, plan.positions.stride(0), plan.cos_sin.stride(0),
                       plan.cos_sin.shape[0], plan.slot_mapping.stride(0), cache.stride(0), cache.stride(1), 24,
                       cache.shape[0] * 24, 7]
    assert cache.stride(1) == 288 + 32 and cache.stride(0) % 32 == 0
    assert constexprs["LOG2_BLOCK"] == -1 and constexprs["SLOT32"] and constexprs["OFFSETS32"]
    assert constexprs["W_BF16"] and constexprs["ROWS_PER_WARP"] == 1 and not constexprs["PIPELINE"]
    assert constexprs["FP4"]
    assert options == dict(num_warps=4, num_stages=1, enable_fp_fusion=False)
    assert grid == (2,)                                               # 7 rows in tiles of 4
    kernel = getattr(G, "main_fp4_kernel", None)
    if kernel is not None:                                            # Gluon importable: the parameter order
        names = list(kernel.arg_names)
        assert len(names) == len(args) + len(constexprs)
        assert names[len(args):] == list(constexprs)
    plan64 = plan_of(main_case(block_size=64, w_fp32=True))
    _, _, c64, _ = _parts(plan64, 1, 1, True, ctas_per_sm=1, sm_count=8)
    assert c64["LOG2_BLOCK"] == 6 and not c64["W_BF16"] and c64["PIPELINE"]


def test_plan_launch_shape(monkeypatch):
    plan = plan_of(main_case(n=7))
    real = G._launch_parts
    # no device here: a fixed occupancy (2 CTAs on each of 4 SMs) instead of compiling the kernel
    monkeypatch.setattr(G, "_launch_parts", lambda *a, **k: real(*a, ctas_per_sm=2, sm_count=4))
    name, grid, args, kwargs, namespace = G.plan_launch(plan, tensor_arg)
    assert name == "main_fp4_kernel" and namespace is vars(G)
    assert grid == (4,) and kwargs["num_warps"] == 2 and kwargs["PIPELINE"] == 0     # 7 rows, tiles of 2
    assert kwargs["enable_fp_fusion"] is False and kwargs["num_stages"] == 1


# ---------------------------------------------------------------------------------- dispatch
def test_registered_with_the_fast_paths():
    assert G in fused_kernels.FAST_PATH_MODULES
    # the chains of the registered modules never overlap: MAIN_FP4 is no other module's, MAIN_FP8 not this one's
    plan = plan_of(main_case())
    assert [m for m in fused_kernels.FAST_PATH_MODULES if m.eligible(plan)] == [G]
    assert not G.eligible(plan_of(main_case(fmt=F.MAIN_FP8)))


def test_interface():
    for name in ("enabled", "available", "eligible", "plan_launch", "word_aligned", "call_guard", "launch_table",
                 "supports", "main_latent_fp4_write"):
        assert callable(getattr(G, name)), name
    assert isinstance(G.MIN_ROWS, int) and G.MIN_ROWS >= 1
    check, fields = G.call_guard(plan_of(main_case()))
    assert check is G.word_aligned and fields == ("x", "weight")


def test_direct_entry_checks_its_inputs():
    """``supports`` (CPU tensors: everything but the device passes for the right shapes)."""
    n = 3
    x = torch.zeros(n, 512, dtype=torch.bfloat16)
    w = torch.ones(512, dtype=torch.bfloat16)
    pos = torch.zeros(n, dtype=torch.int32)
    cs = torch.zeros(8, 64)
    slots = torch.zeros(n, dtype=torch.int64)
    cache = MAIN.allocate(2, 16)
    assert G.supports(x, w, pos, cs, slots, cache) == "all tensors must be on one CUDA device"
    assert "kv_cache" in G.supports(x, w, pos, cs, slots, F.MAIN_FP8.allocate(2, 16))
    assert "8-byte" in G.supports(x, w, pos, cs, slots, cache_at(MAIN, 4))
    assert "x rows" in G.supports(torch.zeros(n * 512 + 1, dtype=torch.bfloat16)[1:].view(n, 512), w, pos, cs, slots,
                                  cache)
    assert "weight" in G.supports(x, w[:256], pos, cs, slots, cache)
    assert "cos_sin" in G.supports(x, w, pos, cs[:, :32], slots, cache)
    assert "positions" in G.supports(x, w, pos[:2], cs, slots, cache)
    if not G.available():
        with pytest.raises(RuntimeError):
            G.main_latent_fp4_write(x, w, 1e-6, pos, cs, slots, cache)


# ---------------------------------------------------------------------------------- encoder
def test_e2m1_nibble_encoder_gives_the_reference_codes():
    """``_e2m1_nibble``'s host mirror on 2^21 random fp32 patterns, every fp32 within 3 ulps of every
    e2m1 rounding boundary, grid value and binade edge (and their negatives), and every bf16 pattern
    (tests/gpu/test_gpu_fast_paths.py runs all 2^32). NaN inputs are left out
    (SPEC §6 leaves their group free)."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (1 << 21,), generator=g, dtype=torch.int64).to(torch.int32)
    edges = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0,
                          2.0 ** -126, 2.0 ** -149, 2.0 ** -127, 3.4e38, float("inf")], dtype=torch.float32)
    edges = edges.view(torch.int32)
    near = (edges[:, None] + torch.arange(-3, 4, dtype=torch.int32)[None, :]).flatten()
    near = torch.cat([near, near | -2 ** 31])
    all_bf16 = torch.arange(1 << 16, dtype=torch.int32) << 16
    t = torch.cat([bits, near, all_bf16]).view(torch.float32)
    keep = ~torch.isnan(t)
    assert torch.equal(G.e2m1_nibble_mirror(t)[keep], ref.encode_e2m1(t).to(torch.int32)[keep])


def test_main_fp4_record_shape():
    assert (MAIN.bytes_per_token, MAIN.data_bytes, MAIN.token_interleaved) == (288, 256, True)
