"""MAIN_MXFP8, DeepSeek V4.1's 528-byte main record: its layout checked against an encoder written here
from the readers' description (FlashMLA's KVCacheFormat<V41>, SGLang's V41_NEW store_row_fp8: per token
512 e4m3 codes, then 16 scale bytes, one per 32 codes, scale 2^ceil(log2(max(amax / 448, 1e-4))) stored
as its biased exponent, codes e4m3(y / scale) rounded to nearest even), on the reference and the
kernel (Triton's interpreter); the deepseek-v4.1 configuration's main-cache write on both; and the
Gluon main path's eligibility and launch constants for these records (CPU: no compile)."""
import pytest
import torch

import kvfuse
from kvfuse import CastArgs, KVCacheFormat, KVCacheOutArgs, NormArgs, RopeArgs, mla
from kvfuse import formats as F
from kvfuse import models as M
from kvfuse import reference as R
from kvfuse.engines import sglang
from kvfuse.kernels.codes import NO_FLOOR
from kvfuse.kernels.gluon import main_latent
from kvfuse.plans.fused import build_plan
from helpers import assert_bytes_equal, cos_sin_cache, random_bf16

BACKENDS = ("reference", "triton")
BLOCK_SIZE = 16


@pytest.fixture(params=BACKENDS)
def backend(request):
    with kvfuse.use_backend(request.param):
        yield request.param


def v41_records(y: torch.Tensor) -> torch.Tensor:
    """bf16 [n, 512] -> uint8 [n, 528], DeepSeek V4.1's records as the readers describe them."""
    n = y.shape[0]
    groups = y.float().reshape(n, 16, 32)
    ratio = groups.abs().amax(dim=-1) / torch.tensor(448.0)                      # fp32 division
    ratio = torch.clamp_min(ratio, torch.tensor(1e-4, dtype=torch.float32))
    mantissa, exponent = torch.frexp(ratio)                                      # ratio = mantissa * 2^exponent
    e = torch.where(mantissa == 0.5, exponent - 1, exponent)                     # ceil(log2(ratio))
    codes = (groups / torch.exp2(e.float()).unsqueeze(-1)).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([codes.reshape(n, 512), (e + 127).to(torch.uint8)], dim=-1)


def paged(records: torch.Tensor, slots, like: torch.Tensor) -> torch.Tensor:
    """``like`` (a MAIN_MXFP8 cache) with ``records[i]`` at slot ``slots[i]``."""
    out = like.clone()
    for i, slot in enumerate(slots):
        out[slot // BLOCK_SIZE, slot % BLOCK_SIZE, 0] = records[i]
    return out


def values_across_the_floor(n: int, seed: int) -> torch.Tensor:
    """bf16 [n, 512]: random groups of every scale, groups whose amax / 448 lies below 1e-4 (the floor
    decides their scale), all-zero groups and exact powers of two (amax / 448 at a binade's edge)."""
    x = random_bf16((n, 512), seed)
    g = torch.Generator().manual_seed(seed + 1)
    scales = torch.exp2(torch.randint(-30, 6, (n, 16, 1), generator=g).float())
    x = (x.float().reshape(n, 16, 32) * scales).reshape(n, 512)
    x[0, :32] = 0.0
    x[1 % n, 32:64] = 448.0 * 2.0 ** -14          # amax / 448 = 2^-14: floored to 2^-13
    x[2 % n, 64:96] = 448.0 * 2.0 ** -13          # exactly the floor
    x[3 % n, 96:128] = -448.0                      # scale exactly 1
    return x.to(torch.bfloat16)


def test_encoder_of_this_test_knows_the_floor():
    """The test's own encoder: a group of amax 448 * 2^-14 gets the floor byte 114 (2^-13), 448 gets 127."""
    y = torch.zeros(1, 512, dtype=torch.bfloat16)
    y[0, :32] = 448.0 * 2.0 ** -14
    y[0, 32:64] = 448.0
    rec = v41_records(y)
    assert rec.shape == (1, 528)
    assert rec[0, 512:516].tolist() == [114, 127, 114, 114]
    assert rec[0, 0].item() == 0x76                # 448 * 2^-14 / 2^-13 = 224 = 1.75 * 2^7: e4m3 0 1110 110
    assert rec[0, 32].item() == 0x7E                # 448: the largest e4m3


def test_preset_layout():
    f = F.MAIN_MXFP8
    assert F.PRESETS["MAIN_MXFP8"] is f and "MAIN_MXFP8" in F.READERS
    assert (f.head_dim, f.cast_fmt, f.elements_per_sf, f.sf_format, f.token_interleaved) == (512, "e4m3", 32, "ue8m0",
                                                                                            True)
    assert (f.quant_bytes, f.sf_bytes, f.sf_exact_bytes, f.bf16_tail, f.bytes_per_token) == (512, 16, 16, 0, 528)
    assert f.scale_floor == 1e-4 and F.scale_floor_exponent(f.scale_floor) == -13
    cache = f.allocate(2, BLOCK_SIZE)
    assert cache.stride()[:2] == (BLOCK_SIZE * 528, 528)      # 528 = 16 * 33: no padding between records
    a = f.addressing_for(cache)
    assert (a.data_offset, a.sf_offset, a.data_token_stride) == (0, 512, 528)
    # SGLang's v41_new pages are these records: one definition
    assert sglang.V41_NEW is f and sglang.LAYOUTS["v41_new"] == (f, 528)


SLOTS = [5, 0, 17, 31, 16, 9]


def test_cast_writes_the_readers_records(backend):
    """The cast alone (what a CP second pass or a store writes) into MAIN_MXFP8 pages."""
    x = values_across_the_floor(len(SLOTS), seed=3)
    cache = torch.randint(0, 256, (2, BLOCK_SIZE, 1, 528), generator=torch.Generator().manual_seed(4),
                          dtype=torch.uint8)
    expected = paged(v41_records(x), SLOTS, cache)
    kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(
        x, None, None, None, CastArgs.from_cache_format(F.MAIN_MXFP8),
        KVCacheOutArgs(cache, torch.tensor(SLOTS), layout=F.MAIN_MXFP8))
    assert_bytes_equal(cache, expected, f"MAIN_MXFP8 records ({backend})")


def test_floor_separates_it_from_main_fp8_scales(backend):
    """The same values into MAIN_FP8 (no floor) store smaller scales where amax / 448 < 2^-13: the floor
    is what the V4.1 readers expect, not MAIN_FP8's rule without its reserved bytes."""
    x = values_across_the_floor(4, seed=5)
    slots = torch.arange(4)
    mx = F.MAIN_MXFP8.allocate(1, BLOCK_SIZE)
    fp8 = F.MAIN_FP8.allocate(1, BLOCK_SIZE)
    for fmt, cache in ((F.MAIN_MXFP8, mx), (F.MAIN_FP8, fp8)):
        kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(x, None, None, None, CastArgs.from_cache_format(fmt),
                                                           KVCacheOutArgs(cache, slots, layout=fmt))
    mx_sf, fp8_sf = mx[0, :4, 0, 512:528], fp8[0, :4, 0, 512:528]
    assert mx_sf.min().item() == 114 and fp8_sf.min().item() < 114
    assert torch.equal(mx_sf, torch.clamp_min(fp8_sf, 114))


def test_deepseek_v41_main_cache_write(backend):
    """deepseek-v4.1's write_main_cache: RMSNorm -> GPT-J RoPE on the last 64 -> all 512 columns cast
    into 528-byte records, as the readers' encoder writes the reference chain's transform."""
    cfg = M.get("deepseek-v4.1")
    assert cfg.main_format is F.MAIN_MXFP8 and cfg.draft_format is F.MAIN_MXFP8 and not cfg.rope_is_neox
    n = len(SLOTS)
    kv = values_across_the_floor(n, seed=7)
    w = (1.0 + 0.1 * torch.randn(512, generator=torch.Generator().manual_seed(8))).to(torch.bfloat16)
    pos = torch.tensor([0, 3, 100, 7, 63, 2])
    cs = cos_sin_cache(128, 64)
    cache = torch.randint(0, 256, (2, BLOCK_SIZE, 1, 528), generator=torch.Generator().manual_seed(9),
                          dtype=torch.uint8)
    y = R.rope(R.rmsnorm(kv, w, cfg.norm_eps), pos, cs, 64, False, offset=448)
    expected = paged(v41_records(y), SLOTS, cache)
    mla.write_main_cache(cfg, kv, pos, cs, w, cache, torch.tensor(SLOTS))
    assert_bytes_equal(cache, expected, f"deepseek-v4.1 main cache ({backend})")


# --------------------------------------------------------------------------- the Gluon main path (CPU)
def _plan(fmt, rope=True):
    x = random_bf16((3, 512), seed=11)
    cache = fmt.allocate(2, BLOCK_SIZE)
    norm = NormArgs(torch.ones(512, dtype=torch.bfloat16), 1e-6) if rope else None
    rope_args = RopeArgs(torch.arange(3), cos_sin_cache(8, 64), 64, False) if rope else None
    return build_plan(x, norm, rope_args, None, CastArgs.from_cache_format(fmt),
                      KVCacheOutArgs(cache, torch.tensor([1, 2, 3]), layout=fmt))[0]


@pytest.mark.parametrize("rope", [True, False], ids=["norm-rope", "cast-only"])
def test_gluon_main_path_takes_mxfp8_records(rope):
    plan = _plan(F.MAIN_MXFP8, rope=rope)
    assert main_latent.eligible(plan) and main_latent.records_of(plan) is main_latent.RECORDS_MXFP8
    assert main_latent.records_of(_plan(F.MAIN_FP8, rope=rope)) is main_latent.RECORDS
    # the same 528-byte records without the floor are another chain: the portable kernel's
    no_floor = KVCacheFormat("MXFP8_NO_FLOOR", 512, "e4m3", 32, "ue8m0", True)
    assert not main_latent.eligible(_plan(no_floor, rope=rope))


def _launch(rec, fmt, n=3):
    """(positional args, constexprs) of a launch of ``n`` rows of ``rec``'s records."""
    plan = _plan(fmt)
    x = plan.x[:, 0, :]
    _, args, constexprs, _ = main_latent.launch_parts_records(
        rec, lambda name: name, n, plan.eps, x, plan.weight, plan.positions, plan.cos_sin, plan.slot_mapping,
        plan.kv_cache, 1, 1, False, ctas_per_sm=1, sm_count=132, neox=False)
    return args, constexprs


def test_gluon_launch_constants():
    """MAIN_MXFP8 launches take FLOOR_E -13 and write no reserved bytes (there are none); MAIN_FP8's take
    NO_FLOOR (the kernel without the floor) and write their 4 reserved bytes as zeros. Every constexpr is named
    (kvfuse's direct launcher), PDL_EARLY up to PDL_EARLY_MAX_ROWS rows."""
    args, mx = _launch(main_latent.RECORDS_MXFP8, F.MAIN_MXFP8, n=300)
    assert mx["FLOOR_E"] == -13 and mx["ZERO_RESERVED"] is False
    _, fp8 = _launch(main_latent.RECORDS, F.MAIN_FP8, n=300)
    assert fp8["FLOOR_E"] == NO_FLOOR.value and fp8["ZERO_RESERVED"] is True
    assert list(mx) == list(fp8)
    kernel = getattr(main_latent, "main_fp8_kernel", None)
    if kernel is not None:                     # Gluon importable (Triton 3.6): the kernel's parameter order
        names = list(kernel.arg_names)     # PDL_EARLY, last, is named only up to PDL_EARLY_MAX_ROWS rows
        assert names[len(args):] == list(mx) + ["PDL_EARLY"]
        _, small = _launch(main_latent.RECORDS_MXFP8, F.MAIN_MXFP8, n=1)
        assert names[len(args):] == list(small) and small["PDL_EARLY"] is False
    assert F.MAIN_MXFP8 in main_latent.FORMATS
