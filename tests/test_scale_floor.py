"""scale_floor (SPEC §6 as amended): FlashMLA's quantizer floors the SCALE,
2^ceil(log2(clamp_min(amax / 448, 1e-4))) (FlashMLA tests/quant.py), so its smallest scale is 2^-13;
the FLASHMLA presets carry scale_floor = 1e-4 and write the same bytes on every input, zero rows and
tiny groups included. Both backends (the kernel through Triton's interpreter) against a float64
restatement of FlashMLA's rule."""
import math

import pytest
import torch

import kvfuse
from kvfuse import CastArgs, KVCacheFormat, KVCacheOutArgs, formats
from kvfuse import reference as R
from kvfuse.formats import scale_floor_exponent

BACKENDS = ("reference", "triton")


def flashmla_exponent(amax: torch.Tensor) -> torch.Tensor:
    """FlashMLA's rule in float64 (amax already floored at kvfuse's AMAX_MARGIN, which is below it)."""
    s = torch.clamp(amax.double() / 448.0, min=float(torch.tensor(1e-4, dtype=torch.float32)))
    return torch.ceil(torch.log2(s)).to(torch.int64)


def _rows(n):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(n, 576, generator=gen)
    scales = torch.tensor([0.0, 1e-6, 1e-3, 0.01, 0.02734375, 0.0274, 0.05, 1.0, 300.0])
    x = x * scales[torch.arange(n) % len(scales)][:, None]
    return x.to(torch.bfloat16)


def _scale_bytes(fmt, x, backend):
    """The raw scale bytes [n, sf_bytes] of x's rows written through the public call (the cast of x)."""
    n = x.shape[0]
    cache = fmt.allocate(-(-n // 8), 8)
    slots = torch.arange(n)
    with kvfuse.use_backend(backend):
        kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(
            x, cast_args=CastArgs.from_cache_format(fmt), out_args=KVCacheOutArgs(cache, slots, layout=fmt))
    return kvfuse.load_paged_kv_cache(cache, slots, fmt, dequantize=False)[1][:, 0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_flashmla_v32_scales_follow_flashmlas_rule(backend):
    n = 27
    x = _rows(n)
    scales = _scale_bytes(formats.FLASHMLA_V32, x, backend)[:, :16].contiguous().view(torch.float32)  # 2^e
    amax = torch.maximum(x[:, :512].float().abs().reshape(n, 4, 128).amax(-1), torch.tensor(1e-4))
    want = torch.exp2(flashmla_exponent(amax).double()).float()
    assert torch.equal(scales, want)
    assert scales[0].tolist() == [2.0 ** -13] * 4                               # a zero row: 2^-13


@pytest.mark.parametrize("backend", BACKENDS)
def test_flashmla_model1_scale_bytes(backend):
    n = 18
    x = _rows(n)[:, :512].contiguous()
    sf = _scale_bytes(formats.FLASHMLA_MODEL1, x, backend)
    amax = torch.maximum(x[:, :448].float().abs().reshape(n, 7, 64).amax(-1), torch.tensor(1e-4))
    assert torch.equal(sf[:, :7].long(), flashmla_exponent(amax) + 127)


def test_reference_quantize_with_and_without_the_floor():
    x = torch.full((2, 128), 0.01).to(torch.bfloat16)
    _, sf = R.quantize(x, "e4m3", 128, "ue8m0")
    _, sf_floor = R.quantize(x, "e4m3", 128, "ue8m0", scale_floor=1e-4)
    assert sf.tolist() == [[127 - 15]] * 2 and sf_floor.tolist() == [[127 - 13]] * 2
    big = torch.full((1, 128), 100.0).to(torch.bfloat16)        # above the floor: unchanged
    assert torch.equal(R.quantize(big, "e4m3", 128, "ue8m0", 1e-4)[1], R.quantize(big, "e4m3", 128, "ue8m0")[1])


def test_contiguous_cast_with_a_floor_on_both_backends():
    x = _rows(20)[:, :256].contiguous()
    cast = CastArgs("e4m3", 32, True, "ue8m0", scale_floor=2.0 ** -10)
    got = {}
    for backend in BACKENDS:
        with kvfuse.use_backend(backend):
            got[backend] = kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(x, cast_args=cast)
    assert torch.equal(got["reference"][0].view(torch.uint8), got["triton"][0].view(torch.uint8))
    assert torch.equal(got["reference"][1], got["triton"][1])
    assert int(got["triton"][1].min()) == 127 - 10


@pytest.mark.parametrize("bad,match", [
    (dict(sf_format="e4m3", round_sf=False, num_per_channels=16), "scale_floor"),
    (dict(sf_format="fp32", round_sf=False, num_per_channels=128), "scale_floor"),
])
def test_scale_floor_needs_a_power_of_two_format(bad, match):
    args = dict(cast_fmt="e4m3", num_per_channels=32, round_sf=True, sf_format="ue8m0", scale_floor=1e-4)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(torch.ones(2, 128, dtype=torch.bfloat16),
                                                           cast_args=CastArgs(**args))
    with pytest.raises(ValueError, match=match):
        KVCacheFormat("X", 128, "e4m3", args["num_per_channels"], args["sf_format"], False,
                      scale_floor=1e-4)


@pytest.mark.parametrize("value", [0.0, -1e-4, math.inf, math.nan, 1e-40, 1e39, "1e-4", True])
def test_bad_scale_floor_values(value):
    with pytest.raises(ValueError, match="scale_floor"):
        kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(
            torch.ones(2, 128, dtype=torch.bfloat16), cast_args=CastArgs("e4m3", 32, True, "ue8m0", scale_floor=value))


def test_cast_args_must_carry_the_cache_formats_floor():
    fmt = formats.FLASHMLA_V32
    cache = fmt.allocate(1, 4)
    no_floor = CastArgs("e4m3", 128, True, "ue8m0_fp32")
    with pytest.raises(ValueError, match="cast_args must match"):
        kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(
            torch.ones(2, 576, dtype=torch.bfloat16), cast_args=no_floor,
            out_args=KVCacheOutArgs(cache, torch.arange(2), layout=fmt))


def test_floor_exponent():
    assert scale_floor_exponent(1e-4) == -13 and scale_floor_exponent(2.0 ** -13) == -13
    assert scale_floor_exponent(1.0) == 0 and scale_floor_exponent(1.5) == 1
