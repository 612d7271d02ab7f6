"""kvfuse/kernels/gluon/indexer.py on the CPU: which calls the Gluon INDEXER fast path takes
(``eligible`` for each format's chain and not for its neighbours, the cache pointer's alignment,
the per-call word alignment of x and the weight, force_config), its launch table and argument table
(the kernel's parameter order: every non-constexpr first), that the module imports and stays off
unless KVFUSE_GLUON / KVFUSE_GLUON_SKIP turn it off, and the host mirrors of its two e2m1 encoders against the
reference encoder. The kernel itself runs only on the H200 (tests/gpu/test_gpu_fast_paths.py; Gluon
has no interpreter)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import kvfuse
from kvfuse import CastArgs, KVCacheFormat
from kvfuse import reference as ref
from kvfuse.kernels import router as fused_kernels
from kvfuse.kernels.gluon import indexer as GI
from kvfuse.kernels.launcher import tensor_arg
from helpers import cache_at
from kernel_cases import Case, plan_of, recast

F = kvfuse.formats
INDEX_FORMATS = [F.INDEX_FP8_FP32, F.INDEX_MXFP8, F.INDEX_MXFP4, F.INDEX_NVFP4]


def index_case(fmt=F.INDEX_MXFP4, **kw):
    """The fast path's chain: norm, NEOX RoPE on columns 64..127, an INDEX cache, no stage copy."""
    base = dict(n=5, heads=1, head_dim=128, fmt=fmt, rotary_dim=64, neox=True, out_stage=None)
    return Case(**{**base, **kw})


# ---------------------------------------------------------------------------------- eligible
@pytest.mark.parametrize("fmt", INDEX_FORMATS, ids=lambda f: f.name)
def test_each_index_chain_is_eligible(fmt):
    assert GI.eligible(plan_of(index_case(fmt)))
    assert GI.eligible(plan_of(index_case(fmt, w_fp32=True, cs_bf16=True, idx32=True, block_size=24,
                                          block_padding=40, x2d=True, x_row_pad=8)))
    assert GI.eligible(plan_of(index_case(fmt, n=1, slot_kind="invalid", block_size=1, num_blocks=7)))


# the models' chains: DeepSeek V3.2's indexer K (LayerNorm + bias, NEOX RoPE on columns 0..63, Hadamard)
# and V4's (RMSNorm, GPT-J RoPE on the tail, Hadamard), and their neighbours
MODEL_CHAINS = [
    dict(norm_kind="layer", bias=True, rope_offset=0, hadamard=True),
    dict(neox=False, hadamard=True),
    dict(neox=False), dict(hadamard=True), dict(rope_offset=0), dict(rope_offset=0, neox=False),
    dict(norm_kind="layer"), dict(norm_kind="layer", bias=True, w_fp32=True),
]


@pytest.mark.parametrize("fmt", INDEX_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("change", MODEL_CHAINS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_model_chains_are_eligible(fmt, change):
    assert GI.eligible(plan_of(index_case(fmt, **change)))


@pytest.mark.parametrize("fmt", INDEX_FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("change", [
    dict(conjugate=True), dict(neox=False, conjugate=True),
    dict(out_stage="transform"), dict(out_stage="norm"), dict(out_stage="cast_back"),
    dict(rotary_dim=32), dict(rotary_dim=64, rope_offset=32), dict(rope=False), dict(norm=False),
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_neighbouring_chains_are_not(fmt, change):
    assert not GI.eligible(plan_of(index_case(fmt, **change)))


def test_ue8m0_fp32_scales_of_128_are_eligible():
    """DeepSeek V3.2's shipped indexer format (power-of-two scales stored as fp32): CHAINS' SF 1."""
    from kvfuse.models import INDEX_FP8_UE8M0_FP32
    plan = plan_of(index_case(INDEX_FP8_UE8M0_FP32, norm_kind="layer", bias=True, rope_offset=0, hadamard=True))
    assert GI.eligible(plan) and GI.chain_of(plan) == (1, 128, 1)


@pytest.mark.parametrize("fmt", [
    F.INDEX_BF16, F.MAIN_FP8, F.MAIN_FP4, F.FLASHMLA_MODEL1, F.FLASHMLA_V32,
    KVCacheFormat("BW_E4M3_G16_E4M3", 128, "e4m3", 16, "e4m3", False),         # a cast it has no chain for
    KVCacheFormat("BW_E4M3_G64_FP32", 128, "e4m3", 64, "fp32", False),
    KVCacheFormat("BW_MXFP4_TAIL", 128, "e2m1", 32, "ue8m0", False, bf16_tail=32),
    KVCacheFormat("TI_MXFP4_128", 128, "e2m1", 32, "ue8m0", True),               # token-interleaved records
    KVCacheFormat("TI_FP8_FP32_128", 128, "e4m3", 128, "fp32", True),
], ids=lambda f: f.name)
def test_other_formats_are_not(fmt):
    D = fmt.head_dim
    assert not GI.eligible(plan_of(index_case(fmt, head_dim=D, rotary_dim=64)))


def test_two_heads_are_not():
    two = KVCacheFormat("TI_NVFP4_128", 128, "e2m1", 16, "e4m3", True)      # block-wide formats have one head
    assert not GI.eligible(plan_of(index_case(two, heads=2)))
    assert not GI.eligible(plan_of(index_case(two, heads=1)))             # and the record layout differs


def test_user_formats_with_the_index_records_are_eligible():
    for fmt in (KVCacheFormat("MY_MXFP4", 128, "e2m1", 32, "ue8m0", False),
                KVCacheFormat("MY_NVFP4_RESERVED", 128, "e2m1", 16, "e4m3", False, sf_bytes=12),
                KVCacheFormat("MY_MXFP8_RESERVED", 128, "e4m3", 32, "ue8m0", False, sf_bytes=5)):
        assert GI.eligible(plan_of(index_case(fmt))), fmt.name
    # an fp32 scale leaves as one 32-bit store: its per-token stride must keep 4-byte alignment
    odd = KVCacheFormat("MY_FP8_FP32_6", 128, "e4m3", 128, "fp32", False, sf_bytes=6)
    assert not GI.eligible(plan_of(index_case(odd)))
    wide = KVCacheFormat("MY_FP8_FP32_8", 128, "e4m3", 128, "fp32", False, sf_bytes=8)
    assert GI.eligible(plan_of(index_case(wide)))


@pytest.mark.parametrize("fmt,offset,ok", [
    (F.INDEX_FP8_FP32, 8, True), (F.INDEX_FP8_FP32, 4, False),       # e4m3 codes: 64-bit stores
    (F.INDEX_MXFP8, 24, True), (F.INDEX_MXFP8, 12, False),
    (F.INDEX_MXFP4, 4, True), (F.INDEX_MXFP4, 2, False),             # e2m1 codes: 32-bit stores
    (F.INDEX_NVFP4, 36, True), (F.INDEX_NVFP4, 1, False),
])
def test_cache_pointer_alignment(fmt, offset, ok):
    plan = plan_of(index_case(fmt))
    cache = cache_at(fmt, offset)
    moved = recast(plan, kv_cache=cache, addressing=fmt.addressing_for(cache))
    assert GI.eligible(moved) is ok


def test_addressing_must_be_the_index_layout():
    plan = plan_of(index_case(F.INDEX_NVFP4))
    a = plan.addressing
    for change in (dict(data_offset=8), dict(sf_offset=a.sf_offset + 4), dict(sf_token_stride=16),
                   dict(data_token_stride=128)):
        assert not GI.eligible(recast(plan, addressing=dataclasses.replace(a, **change))), change


# ---------------------------------------------------------------------------------- per call
def test_odd_x_row_stride_is_not_eligible():
    plan = plan_of(index_case(x_row_pad=1))                        # rows 129 bf16 apart: not whole words
    assert not GI.eligible(plan)


def test_launch_table():
    assert GI.launch_table(2) == (4, 1, False) and GI.launch_table(16384) == (4, 1, False)
    assert GI.launch_table(16385) == (2, 1, False) and GI.launch_table(65536) == (2, 1, False)
    assert GI.launch_table(65537) == (4, 2, True) and GI.launch_table(262144) == (4, 2, True)
    for n in (1, 3, 300, 513, 4097, 20000, 1 << 20):
        nw, rpt, pipe = GI.launch_table(n)
        assert nw in (1, 2, 4, 8) and rpt in (1, 2) and isinstance(pipe, bool)


@pytest.mark.parametrize("fmt,chain", [(F.INDEX_FP8_FP32, (1, 128, 3)), (F.INDEX_MXFP8, (1, 32, 0)),
                                       (F.INDEX_MXFP4, (2, 32, 0)), (F.INDEX_NVFP4, (2, 16, 2))],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_argument_table(fmt, chain):
    """The positional arguments come from the plan (tensors as placeholders) in the kernel's order, and
    every kernel parameter after them is a constexpr given by name (kvfuse's direct launcher)."""
    plan = plan_of(index_case(fmt, n=7, block_size=24, block_padding=40, idx32=True))
    args, constexprs, options = GI.launch_args(plan, tensor_arg, 4, 1, False)
    cache, a = plan.kv_cache, plan.addressing
    assert [a_.field for a_ in args if hasattr(a_, "field")] == ["x", "weight", "bias", "positions", "cos_sin",
                                                                 "slot_mapping", "kv_cache", "kv_cache"]
    numbers = [v for v in args if not hasattr(v, "field")]
    assert numbers == [plan.x.stride(0) // 2, plan.eps, 1.0, plan.positions.stride(0), plan.cos_sin.stride(0),
                       plan.cos_sin.shape[0], plan.slot_mapping.stride(0), cache.stride(0), a.sf_offset,
                       a.sf_token_stride, 24, cache.shape[0] * 24, 7, 0, 0]
    assert (constexprs["CAST"], constexprs["G"], constexprs["SF"]) == chain
    assert constexprs["NORM"] and not constexprs["CONTIG"] and constexprs["LOG2_HEADS"] == 0
    assert constexprs["LOG2_BLOCK"] == -1 and constexprs["SLOT32"] and constexprs["OFFSETS32"]
    assert constexprs["W_BF16"] and constexprs["ROWS_PER_THREAD"] == 1 and not constexprs["PIPELINE"]
    assert constexprs["NEOX"] and not (constexprs["LAYER"] or constexprs["HAS_BIAS"] or constexprs["ROPE_A"]
                                       or constexprs["HAD"])
    assert options == dict(num_warps=4, num_stages=1, enable_fp_fusion=False)
    kernel = getattr(GI, "index_write_kernel", None)
    if kernel is not None:                                       # Gluon importable: the parameter order
        names = list(kernel.arg_names)
        assert len(names) == len(args) + len(constexprs)
        assert names[len(args):] == list(constexprs)
    assert GI.launch_args(plan_of(index_case(fmt, block_size=64)), tensor_arg, 1, 1, True)[1]["LOG2_BLOCK"] == 6


# ---------------------------------------------------------------------------------- dispatch
# ---------------------------------------------------------------------------------- encoders
def test_packed_bf16_e2m1_encoder_gives_the_reference_codes():
    """INDEX_MXFP4's codes on packed bf16 (``_e2m1x2_bf16``): for every bf16 y and every UE8M0 multiplier
    m = 2^-e the kernel makes (fp32-subnormal ones for an infinite amax included), the codes of the
    bf16 product equal encode_e2m1 of the fp32 product wherever |y * m| <= 6 (always, for a y of the
    group: m comes from its amax) or y is infinite. NaN inputs are left out (SPEC §6)."""
    y = torch.arange(1 << 16, dtype=torch.int32)
    yf = (y << 16).view(torch.float32)
    for e in range(-15, 129):
        m_bits = ((127 - e) << 23) if e < 127 else (0x400000 >> (e - 127))
        m = torch.tensor([m_bits], dtype=torch.int32).view(torch.float32)
        t = yf * m                                                  # exact in fp32 but below 2^-126
        want = ref.encode_e2m1(t).to(torch.int32)
        got = GI.e2m1_bf16_mirror(t.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF)
        relevant = ~torch.isnan(yf) & ((t.abs() <= 6) | torch.isinf(yf))
        assert torch.equal(want[relevant], got[relevant]), e





# ---------------------------------------------------------------------------------- contiguous (q, sf)
CASTS = {f.name: CastArgs.from_cache_format(f) for f in INDEX_FORMATS}


def q_case(cast=CASTS["INDEX_MXFP4"], **kw):
    """The indexer's Q: x [n, H, 128], NEOX RoPE on columns 64..127 (no norm), a cast into
    contiguous (q, sf)."""
    base = dict(n=3, heads=4, head_dim=128, fmt=None, norm=False, cast=cast, rotary_dim=64, neox=True)
    return Case(**{**base, **kw})


@pytest.mark.parametrize("name", sorted(CASTS))
def test_contiguous_q_chains_are_eligible(name):
    cast = CASTS[name]
    assert GI.eligible(plan_of(q_case(cast)))
    assert GI.eligible(plan_of(q_case(cast, norm=True, w_fp32=True, heads=64, x_row_pad=8, idx32=True)))
    assert GI.eligible(plan_of(q_case(cast, heads=1, x2d=True, n=1)))
    # the models' indexer Q: V3.2 (RoPE on columns 0..63, NEOX) and V4 (GPT-J on the tail), with the Hadamard
    assert GI.eligible(plan_of(q_case(cast, heads=64, rope_offset=0, hadamard=True)))
    assert GI.eligible(plan_of(q_case(cast, heads=64, neox=False, hadamard=True)))


def test_contiguous_q_deviations_are_not_eligible():
    assert not GI.eligible(plan_of(q_case(heads=3)))                 # heads not a power of two
    assert not GI.eligible(plan_of(q_case(x_row_pad=1)))             # rows 129 bf16 apart: not whole words
    assert not GI.eligible(plan_of(q_case(rope_offset=32)))
    assert not GI.eligible(plan_of(q_case(conjugate=True)))
    assert not GI.eligible(plan_of(q_case(cast=CastArgs("e2m1", 32, True, "ue8m0", cast_back=True))))
    assert not GI.eligible(plan_of(q_case(cast=CastArgs("e4m3", 64, True, "ue8m0"))))   # no such chain
    plan = plan_of(q_case())
    q = plan.q_out
    wide = torch.zeros(q.shape[0], q.shape[1], q.shape[2] + 2, dtype=q.dtype)[..., :q.shape[2]]
    assert not GI.eligible(recast(plan, q_out=wide))                  # q rows 66 bytes apart: no 32-bit stores
    heads_apart = torch.zeros(q.shape[1], q.shape[0], q.shape[2], dtype=q.dtype).transpose(0, 1)
    assert not GI.eligible(recast(plan, q_out=heads_apart))           # rows not one evenly spaced sequence


def test_contiguous_argument_table():
    plan = plan_of(q_case(CASTS["INDEX_FP8_FP32"], n=5, heads=8, x_row_pad=8, idx32=True))
    args, constexprs, options = GI.launch_args(plan, tensor_arg, 2, 1, False)
    assert [a_.field for a_ in args if hasattr(a_, "field")] == ["x", "weight", "bias", "positions", "cos_sin",
                                                                 "slot_mapping", "q_out", "sf_out"]
    numbers = [v for v in args if not hasattr(v, "field")]
    assert numbers == [136 // 2, plan.eps, 1.0, plan.positions.stride(0), plan.cos_sin.stride(0),
                       plan.cos_sin.shape[0], 0, 0, 0, 0, 1, 0, 40, 128, 4]
    assert (constexprs["CAST"], constexprs["G"], constexprs["SF"]) == (1, 128, 3)
    assert constexprs["CONTIG"] and not constexprs["NORM"] and constexprs["LOG2_HEADS"] == 3
    kernel = getattr(GI, "index_write_kernel", None)
    if kernel is not None:
        names = list(kernel.arg_names)
        assert len(names) == len(args) + len(constexprs) and names[len(args):] == list(constexprs)


def test_contiguous_call_guard():
    """x (and a weight) 4-byte aligned, q as wide as its code stores, an fp32 sf 4-byte aligned."""
    plan = plan_of(q_case(CASTS["INDEX_FP8_FP32"], norm=True))
    check, fields = GI.call_guard(plan)
    assert fields == ("x", "q_out", "sf_out", "weight")
    x, q, sf, w = plan.x, plan.q_out, plan.sf_out, plan.weight
    assert check(x, q, sf, w)
    buf = torch.zeros(q.numel() + 8, dtype=torch.uint8)
    assert not check(x, buf[4:4 + q.numel()].view(q.dtype).view(q.shape), sf, w)     # e4m3 codes: 8 bytes
    xbuf = torch.zeros(x.numel() + 1, dtype=torch.bfloat16)
    assert not check(xbuf[1:].view(x.shape), q, sf, w)
    check4, fields4 = GI.call_guard(plan_of(q_case()))                 # e2m1 codes: 4 bytes, byte scales
    assert fields4 == ("x", "q_out", "sf_out")
    p4 = plan_of(q_case())
    qb = torch.zeros(p4.q_out.numel() + 8, dtype=torch.uint8)
    assert check4(p4.x, qb[4:4 + p4.q_out.numel()].view(p4.q_out.shape), p4.sf_out)
    assert not check4(p4.x, qb[2:2 + p4.q_out.numel()].view(p4.q_out.shape), p4.sf_out)
    assert GI.call_guard(plan_of(index_case()))[1] == ("x", "weight")


def test_contiguous_dispatch_counts_rows_of_every_head():
    with fused_kernels.fast_paths(only=GI):
        assert fused_kernels.fast_path(plan_of(q_case(n=1, heads=4))) is GI       # 4 rows >= MIN_ROWS
        assert fused_kernels.fast_path(plan_of(q_case(n=1, heads=1, x2d=True))) is None
        assert fused_kernels.fast_path(plan_of(q_case(n=1, heads=1, x2d=True)), pdl=True) is GI   # MIN_ROWS_PDL
