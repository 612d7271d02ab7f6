"""The read side's NaN codes (SPEC §7): load_paged_kv_cache decodes a ue8m0 scale byte 0xFF as NaN
(OCP MX; torch.float8_e8m0fnu), the e4m3 codes 0x7F / 0xFF as NaN (values and e4m3 scales), and an
fp32 / ue8m0_fp32 NaN scale as NaN, on every backend, each NaN written as the bf16 0x7FC0; the raw
bf16 parts (the §8 tail, bf16 caches) keep their bits. Crafted caches are loaded with the
reference and the Triton kernel (interpreter) and compared bit for bit."""
import pytest
import torch

import kvfuse
from kvfuse import formats
from kvfuse import reference as R

needs_interpreter = pytest.mark.skipif(not kvfuse.backend.interpreter_enabled(),
                                       reason="the triton backend on CPU tensors needs TRITON_INTERPRET=1")

QUANTIZED = [f for f in formats.PRESETS.values() if f.quantized]
NB, BS = 2, 4
N = NB * BS
CANONICAL = 0x7FC0
TAIL_NAN = -63 & 0xFFFF          # 0xFFC1: a negative NaN with a payload, kept raw in the tail


def _load(cache, slots, fmt, backend):
    with kvfuse.use_backend(backend):
        return kvfuse.load_paged_kv_cache(cache, slots, fmt)


def _crafted(fmt, seed=0):
    """A cache of fmt whose N records are finite, except the NaN codes listed in the returned mask
    [N, 1, head_dim] (True where the load must give NaN)."""
    g = torch.Generator().manual_seed(seed)
    H = 1
    cache = fmt.allocate(NB, BS, H)
    slots = torch.randperm(N, generator=g)
    D, dq, G = fmt.head_dim, fmt.quant_dim, fmt.elements_per_sf
    quant = torch.randint(0, 256, (N, H, fmt.quant_bytes), dtype=torch.uint8, generator=g)
    if fmt.cast_fmt == "e4m3":
        quant[(quant & 0x7F) == 0x7F] = 0x00
    if fmt.sf_format == "ue8m0":
        sf = torch.randint(110, 136, (N, H, fmt.num_scales), dtype=torch.uint8, generator=g)
    elif fmt.sf_format == "e4m3":
        sf = torch.randint(0x20, 0x50, (N, H, fmt.num_scales), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    elif fmt.sf_format == "ue8m0_fp32":
        sf = torch.exp2(torch.randint(-8, 8, (N, H, fmt.num_scales), generator=g).float())
    else:
        sf = torch.rand((N, H, fmt.num_scales), generator=g) + 0.01
    tail = torch.randn((N, H, fmt.bf16_tail), generator=g).to(torch.bfloat16)
    expect = torch.zeros(N, H, D, dtype=torch.bool)
    sfb = sf.view(torch.uint8).view(N, H, fmt.num_scales, -1)    # the bytes of each scale
    # row 0: two e4m3 value NaNs (0x7F, 0xFF); e2m1 has no NaN code
    if fmt.cast_fmt == "e4m3":
        quant[0, 0, 5], quant[0, 0, 9] = 0x7F, 0xFF
        expect[0, 0, 5] = expect[0, 0, 9] = True
    # rows 1 and 2: a NaN scale -> its whole group
    for row, group, pattern in ((1, 1 % fmt.num_scales, 0), (2, 0, 1)):
        if fmt.sf_format == "ue8m0":
            sfb[row, 0, group] = 0xFF
        elif fmt.sf_format == "e4m3":
            sfb[row, 0, group] = (0x7F, 0xFF)[pattern]
        else:   # fp32 bits, little-endian: a quiet NaN with a payload / a negative NaN
            bits = (0x7FC00001, 0xFFFFFFFF)[pattern]
            sfb[row, 0, group] = torch.tensor([(bits >> (8 * i)) & 0xFF for i in range(4)], dtype=torch.uint8)
        expect[row, 0, group * G:(group + 1) * G] = True
    if fmt.bf16_tail:
        tail.view(torch.int16)[3, 0, 3] = TAIL_NAN - 0x10000
        expect[3, 0, dq + 3] = True
    R.store(cache, slots, fmt, quant, sf, tail if fmt.bf16_tail else None)
    # reserved scale bytes (MAIN_FP8: 4, FLASHMLA_MODEL1: 1) set to 0xFF are not scales: no NaN
    if fmt.sf_bytes > fmt.sf_exact_bytes:
        fmt.split(cache)[1][..., fmt.sf_exact_bytes:] = 0xFF
    return cache, slots, expect


@needs_interpreter
@pytest.mark.parametrize("fmt", QUANTIZED, ids=lambda f: f.name)
def test_nan_codes_decode_as_nan_on_every_backend(fmt):
    cache, slots, expect = _crafted(fmt)
    ref = _load(cache, slots, fmt, "reference")
    tri = _load(cache, slots, fmt, "triton")
    assert torch.equal(torch.isnan(ref.float()), expect), "reference: NaN where not expected or missing"
    assert torch.equal(ref.view(torch.int16), tri.view(torch.int16)), "backends differ"
    bits = ref.view(torch.int16).to(torch.int32) & 0xFFFF
    dq = fmt.quant_dim
    assert (bits[..., :dq][expect[..., :dq]] == CANONICAL).all()
    if fmt.bf16_tail:
        assert int(bits[3, 0, dq + 3]) == TAIL_NAN        # the raw tail keeps its NaN's bits
    # everything else is finite
    assert torch.isfinite(ref.float()[~expect]).all()


@needs_interpreter
def test_bf16_cache_keeps_raw_nan_bits():
    fmt = formats.INDEX_BF16
    cache = fmt.allocate(NB, BS)
    slots = torch.arange(N)
    x = torch.randn(N, 1, fmt.head_dim).to(torch.bfloat16)
    x.view(torch.int16)[2, 0, 7] = TAIL_NAN - 0x10000
    R.store(cache, slots, fmt, x)
    ref = _load(cache, slots, fmt, "reference")
    tri = _load(cache, slots, fmt, "triton")
    assert torch.equal(ref.view(torch.int16), x.view(torch.int16))
    assert torch.equal(tri.view(torch.int16), x.view(torch.int16))


def test_ue8m0_read_decode_is_torch_e8m0fnu():
    """Every ue8m0 byte decodes (read side) to torch's float8_e8m0fnu value: 2^(b-127), 0xFF NaN."""
    b = torch.arange(256, dtype=torch.uint8)
    ours = R.dequant_scale(b, "ue8m0", ue8m0_nan=True)
    theirs = b.view(torch.float8_e8m0fnu).float()
    assert torch.equal(torch.isnan(ours), torch.isnan(theirs)) and int(torch.isnan(ours).sum()) == 1
    ok = ~torch.isnan(ours)
    assert torch.equal(ours[ok].view(torch.int32), theirs[ok].view(torch.int32))
    # the write side's cast_back keeps SPEC §6's d = 2^e (byte 255: inf)
    assert torch.isinf(R.dequant_scale(b[255:], "ue8m0")).all()


def test_e4m3_nan_codes():
    b = torch.arange(256, dtype=torch.uint8)
    nan = torch.isnan(R.decode_e4m3(b))
    assert nan.nonzero().flatten().tolist() == [0x7F, 0xFF]
