"""FLASHMLA_V32 and FLASHMLA_MODEL1 as FlashMLA lays them out and allocates them.

Source followed: deepseek-ai/FlashMLA, ``tests/quant.py`` (``quantize_k_cache`` /
``dequantize_k_cache``, the layouts ``V32_FP8Sparse`` and ``MODEL1_FP8Sparse``), the "FP8 KV
Cache" section of its ``README.md`` and the docstring of ``flash_mla_with_kvcache`` in
``flash_mla/flash_mla_interface.py`` (the 656-byte V32 record), and the decode kernels' host
checks: ``csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh`` (V32: token stride 656; MODEL1: token
stride 584, i.e. a dense block) and ``csrc/sm100/decode/head64/kernel.cuh`` (k_cache.stride(0) a
multiple of TMA_K_STRIDE = 656 for V32, 576 for MODEL1; the cache pointer 16-byte aligned).

FlashMLA's tests allocate a V32 cache as ``[num_blocks, block_size + 1, 656]`` and keep the first
block_size tokens (blocks of (block_size + 1) * 656 bytes), and a MODEL1 cache as
``[num_blocks, round_up(block_size * 584, 576)]`` with the first block_size * 584 bytes of each
block viewed as ``[block_size, 1, 584]``.

Byte maps stated here (``V32_RECORD``, ``MODEL1_TOKEN_DATA``, ``MODEL1_TOKEN_SCALES`` and the block
maps built from them), checked against kvfuse's addressing (``fmt.addressing_for``, ``fmt.split``,
``fmt.tail_view``) and against a reference-backend write, range by range:

* FLASHMLA_V32, one record per token at t * 656 inside a block: bytes [0, 512) the 512 e4m3 NoPE
  values; [512, 528) 4 fp32 scales (little-endian), scale k for values 128k..128k+127;
  [528, 656) 64 raw bf16 RoPE values. No reserved byte; the rest of a block up to its stride is
  padding ((block_size + 1) * 656-byte blocks in FlashMLA's tests: one unused token's worth).
* FLASHMLA_MODEL1, block-wide: per token t, bytes [576t, 576t + 448) the 448 e4m3 NoPE values and
  [576t + 448, 576t + 576) 64 raw bf16 RoPE values; then per token, at block_size * 576 + 8t,
  7 ue8m0 scale bytes (float8_e8m0fnu; scale k for values 64k..64k+63) and 1 reserved byte; then
  padding up to the block stride, a multiple of 576.

Below, such storages are filled with random bytes and
written through the public fused entry point on the "reference" and "triton" backends (the Triton
kernel runs in Triton's interpreter on the CPU): the whole storage must be byte-equal between the
backends, and every byte outside the written records must keep its random value.
"""
import pytest
import torch

import kvfuse
from kvfuse import CastArgs, KVCacheOutArgs, NormArgs, RopeArgs, formats

from helpers import cos_sin_cache, random_bf16, record_regions

V32 = formats.FLASHMLA_V32
MODEL1 = formats.FLASHMLA_MODEL1
BLOCK_SIZES = [1, 3, 16, 64]
BACKENDS = ["reference", "triton"]


def _round_up(v: int, m: int) -> int:
    return -(-v // m) * m


def flashmla_storage(fmt, num_blocks: int, block_size: int, seed: int):
    """(cache view, storage, stride(0)) of a FlashMLA-style allocation of random bytes."""
    g = torch.Generator().manual_seed(seed)
    if fmt is V32:
        s0 = (block_size + 1) * 656
        storage = torch.randint(0, 256, (num_blocks * s0,), dtype=torch.uint8, generator=g)
        cache = storage.view(num_blocks, block_size + 1, 656)[:, :block_size, :].view(num_blocks, block_size, 1, 656)
    else:
        s0 = _round_up(block_size * 584, 576)
        storage = torch.randint(0, 256, (num_blocks * s0,), dtype=torch.uint8, generator=g)
        cache = storage.view(num_blocks, s0)[:, :block_size * 584].view(num_blocks, block_size, 1, 584)
    assert cache.stride() == (s0, cache.shape[-1], cache.shape[-1], 1)
    assert cache.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr()
    return cache, storage, s0


def write_args(fmt, cache, slots, seed: int):
    """A V3.2 / V4-style write: RMSNorm over the head, GPT-J RoPE on the 64 tail dims, the format's
    cast (the tail stays bf16), plus the cast_back copy."""
    n = slots.shape[0]
    D = fmt.head_dim
    g = torch.Generator().manual_seed(seed)
    x = random_bf16((n, D), seed)
    w = (1.0 + 0.1 * torch.randn(D, generator=g)).to(torch.bfloat16)
    positions = torch.randint(0, 4096, (n,), generator=g)
    out = torch.empty(n, D, dtype=torch.bfloat16)
    return dict(x=x, norm_args=NormArgs(w, 1e-6),
                rope_args=RopeArgs(positions, cos_sin_cache(4096, 64), 64, False),
                cast_args=CastArgs.from_cache_format(fmt),
                out_args=KVCacheOutArgs(cache, slots, out=out, out_stage="cast_back", layout=fmt)), out


def pick_slots(num_blocks: int, block_size: int, n_valid: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    cap = num_blocks * block_size
    valid = torch.randperm(cap, generator=g)[:n_valid]
    return torch.cat([valid, torch.tensor([-1, cap, cap + 7])]).to(torch.int64)[torch.randperm(n_valid + 3,
                                                                                               generator=g)]


def written_mask(fmt, storage, block_size, s0, slots) -> torch.Tensor:
    """True on the bytes the SPEC lets a write of ``slots`` touch: data, exact scales, tail."""
    mask = torch.zeros(storage.numel(), dtype=torch.bool)
    cap = storage.numel() // s0 * block_size
    for s in slots.tolist():
        if not 0 <= s < cap:
            continue
        r = record_regions(fmt, block_size, s0, fmt.bytes_per_token, 0, s // block_size, s % block_size)
        for start, length in r.values():
            mask[start:start + length] = True
    return mask


needs_interpreter = pytest.mark.skipif(not kvfuse.backend.interpreter_enabled(),
                                       reason="the triton backend on CPU tensors needs TRITON_INTERPRET=1")


@needs_interpreter
@pytest.mark.parametrize("fmt", [V32, MODEL1], ids=lambda f: f.name)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_write_into_flashmla_allocation(fmt, block_size):
    num_blocks = 3 if block_size < 64 else 2
    n_valid = min(num_blocks * block_size, 24)
    results = {}
    for backend in BACKENDS:
        cache, storage, s0 = flashmla_storage(fmt, num_blocks, block_size, seed=block_size)
        before = storage.clone()
        slots = pick_slots(num_blocks, block_size, n_valid, seed=block_size + 1)
        args, out = write_args(fmt, cache, slots, seed=block_size + 2)
        with kvfuse.use_backend(backend):
            kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(**args)
        mask = written_mask(fmt, storage, block_size, s0, slots)
        # padding between blocks (V32: the (block_size + 1)-th token; MODEL1: up to the 576 multiple), the
        # MODEL1 reserved scale byte and every record not written keep their random bytes
        assert torch.equal(storage[~mask], before[~mask]), backend
        results[backend] = (storage, out.view(torch.int16))
    ref, tri = results["reference"], results["triton"]
    assert torch.equal(ref[0], tri[0]), "whole storage differs between the backends"
    assert torch.equal(ref[1], tri[1]), "cast_back copies differ between the backends"


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_allocate_gives_flashmla_block_strides(block_size):
    """fmt.allocate: V32 blocks of exactly block_size * 656 bytes (FlashMLA's SM100 decode asserts
    stride(0) % 656 == 0); MODEL1 blocks padded to a multiple of 576."""
    c = V32.allocate(2, block_size)
    assert c.stride() == (block_size * 656, 656, 656, 1)
    assert c.stride(0) % 656 == 0
    m = MODEL1.allocate(2, block_size)
    assert m.stride() == (_round_up(block_size * 584, 576), 584, 584, 1)
    assert m.stride(0) % 576 == 0


# ----------------------------------------------------------------------------- the byte maps
# FLASHMLA_V32 ("V32_FP8Sparse"; README "FP8 KV Cache", flash_mla_with_kvcache's docstring): one
# 656-byte record per token, token stride 656 inside a block. (name, start, length, content)
V32_RECORD = [
    ("nope", 0, 512, "512 e4m3 values; value i at byte i"),
    ("scales", 512, 16, "4 fp32 scales, little-endian; scale k (at 512 + 4k) covers values 128k .. 128k+127"),
    ("rope", 528, 128, "64 bf16 values, raw; value j at 528 + 2j"),
]
V32_RECORD_BYTES = 656          # no reserved byte inside the record


def v32_block_map(block_size: int, block_stride: int):
    """Byte ranges of one V32 block: token t's record at t * 656, then padding up to the block stride
    (FlashMLA's tests: one whole unused token, (block_size + 1) * 656)."""
    spans = [(f"token{t}.{name}", t * 656 + start, length) for t in range(block_size)
             for name, start, length, _ in V32_RECORD]
    if block_stride > block_size * 656:
        spans.append(("padding", block_size * 656, block_stride - block_size * 656))
    return spans


# FLASHMLA_MODEL1 ("MODEL1_FP8Sparse", tests/quant.py): block-wide. Per token t, 576 data bytes at
# t * 576; then per token 8 scale bytes at block_size * 576 + 8t; then padding to a multiple of 576.
MODEL1_TOKEN_DATA = [
    ("nope", 0, 448, "448 e4m3 values; value i at byte i"),
    ("rope", 448, 128, "64 bf16 values, raw; value j at 448 + 2j"),
]
MODEL1_TOKEN_SCALES = [
    ("scales", 0, 7, "7 ue8m0 bytes (float8_e8m0fnu); scale k covers values 64k .. 64k+63"),
    ("reserved", 7, 1, "padding byte of the 8-byte scale slot, never written"),
]


def model1_block_map(block_size: int, block_stride: int):
    spans = [(f"token{t}.{name}", t * 576 + start, length) for t in range(block_size)
             for name, start, length, _ in MODEL1_TOKEN_DATA]
    spans += [(f"token{t}.{name}", block_size * 576 + 8 * t + start, length) for t in range(block_size)
              for name, start, length, _ in MODEL1_TOKEN_SCALES]
    if block_stride > block_size * 584:
        spans.append(("padding", block_size * 584, block_stride - block_size * 584))
    return spans


def block_map(fmt, block_size, block_stride):
    return (v32_block_map if fmt is V32 else model1_block_map)(block_size, block_stride)


@pytest.mark.parametrize("fmt", [V32, MODEL1], ids=lambda f: f.name)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_block_map_tiles_the_block(fmt, block_size):
    """The map covers every byte of a block exactly once."""
    _, _, s0 = flashmla_storage(fmt, 2, block_size, seed=0)
    seen = torch.zeros(s0, dtype=torch.int32)
    for _, start, length in block_map(fmt, block_size, s0):
        seen[start:start + length] += 1
    assert torch.equal(seen, torch.ones_like(seen))


def test_format_sizes_match_the_map():
    assert (V32.head_dim, V32.quant_dim, V32.bf16_tail, V32.elements_per_sf) == (576, 512, 64, 128)
    assert (V32.quant_bytes, V32.sf_bytes, V32.sf_exact_bytes, 2 * V32.bf16_tail) == (512, 16, 16, 128)
    assert V32.bytes_per_token == V32_RECORD_BYTES == sum(length for _, _, length, _ in V32_RECORD)
    assert V32.token_interleaved and V32.sf_format == "ue8m0_fp32" and V32.cast_fmt == "e4m3"
    assert (MODEL1.head_dim, MODEL1.quant_dim, MODEL1.bf16_tail, MODEL1.elements_per_sf) == (512, 448, 64, 64)
    assert (MODEL1.quant_bytes, MODEL1.data_bytes, MODEL1.sf_bytes, MODEL1.sf_exact_bytes) == (448, 576, 8, 7)
    assert not MODEL1.token_interleaved and MODEL1.sf_format == "ue8m0" and MODEL1.cast_fmt == "e4m3"
    assert MODEL1.bytes_per_token == 584


@pytest.mark.parametrize("fmt", [V32, MODEL1], ids=lambda f: f.name)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_kvfuse_addressing_is_the_map(fmt, block_size):
    """fmt.addressing_for, fmt.split and fmt.tail_view put every part where the map says."""
    nb = 2
    cache, storage, s0 = flashmla_storage(fmt, nb, block_size, seed=0)
    a = fmt.addressing_for(cache)
    spans = {name: (start, length) for name, start, length in block_map(fmt, block_size, s0)}
    base = storage.data_ptr()
    data, sf = fmt.split(cache)
    tail = fmt.tail_view(cache)
    for b in range(nb):
        for t in range(block_size):
            nope, scales, rope = (spans[f"token{t}.{k}"] for k in ("nope", "scales", "rope"))
            # RecordAddressing (what the kernels use)
            assert t * a.data_token_stride + a.data_offset == nope[0]
            assert t * a.sf_token_stride + a.sf_offset == scales[0]
            assert t * a.data_token_stride + a.tail_offset == rope[0]
            # the views
            assert data[b, t].data_ptr() - base == b * s0 + nope[0]
            assert sf[b, t].data_ptr() - base == b * s0 + scales[0]
            assert tail[b, t].data_ptr() - base == b * s0 + rope[0]
            assert tail[b, t].numel() == rope[1] == 128
            assert sf[b, t].numel() == fmt.sf_bytes == (16 if fmt is V32 else 8)
    if fmt is V32:
        assert (a.data_token_stride, a.sf_token_stride, a.data_offset, a.sf_offset, a.tail_offset) == \
            (656, 656, 0, 512, 528)
        assert data.shape[-1] == 512
    else:
        assert (a.data_token_stride, a.sf_token_stride, a.data_offset, a.sf_offset, a.tail_offset) == \
            (576, 8, 0, block_size * 576, 448)
        assert data.shape[-1] == 576     # block-wide data = [nope | rope]


def flashmla_bytes(fmt, x: torch.Tensor):
    """FlashMLA's documented quantization of rows x (bf16 [n, head_dim]), written independently of
    kvfuse: per group of the NoPE part, scale = 2^ceil(log2(clamp_min(amax / 448, 1e-4))) (tests/quant.py
    clamps, then rounds the scale up to a power of two; kvfuse's presets carry scale_floor = 1e-4), values
    e4m3(x / scale) (round to nearest even); the RoPE part raw bf16.
    Returns (nope uint8 [n, d_nope], scale bytes uint8 [n, num_scales * item], rope uint8 [n, 128])."""
    d_nope, g = fmt.quant_dim, fmt.elements_per_sf
    v = x[:, :d_nope].float().reshape(x.shape[0], d_nope // g, g)
    s = torch.clamp(v.abs().amax(-1) / 448.0, min=1e-4)
    mant, exp = torch.frexp(s)                                    # s = mant * 2^exp, mant in [0.5, 1)
    e = torch.where(mant == 0.5, exp - 1, exp)                    # ceil(log2 s)
    scale = torch.ldexp(torch.ones_like(s), e)
    q = (v / scale[..., None]).to(torch.float8_e4m3fn).view(torch.uint8).reshape(x.shape[0], d_nope)
    if fmt is V32:
        sb = scale.contiguous().view(torch.uint8)                 # fp32, little-endian
    else:
        sb = scale.to(torch.float8_e8m0fnu).view(torch.uint8)     # exact for powers of two
    rope = x[:, d_nope:].contiguous().view(torch.uint8)
    return q, sb, rope


@pytest.mark.parametrize("fmt", [V32, MODEL1], ids=lambda f: f.name)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_reference_write_at_every_mapped_range(fmt, block_size):
    """A reference-backend write (no norm / RoPE: the cast of x itself) into a FlashMLA-style
    allocation: each mapped range holds FlashMLA's bytes for its token, the reserved byte and the
    padding keep their random bytes, and nothing else changes."""
    nb = 2
    cache, storage, s0 = flashmla_storage(fmt, nb, block_size, seed=3)
    before = storage.clone()
    cap = nb * block_size
    g = torch.Generator().manual_seed(block_size)
    slots = torch.randperm(cap, generator=g)[:min(cap, 20)]
    n = slots.numel()
    x = (torch.randn(n, fmt.head_dim, generator=g) * torch.exp2(torch.randint(-3, 8, (n, 1), generator=g).float()))
    x[::5] *= 1e-4                                 # tiny groups: FlashMLA's scale floor binds
    x[1::7] = 0.0                                  # zero rows: scale 2^-13
    x = x.to(torch.bfloat16)
    with kvfuse.use_backend("reference"):
        kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(
            x, cast_args=CastArgs.from_cache_format(fmt), out_args=KVCacheOutArgs(cache, slots, layout=fmt))
    q, sb, rope = flashmla_bytes(fmt, x)
    expect = before.clone()
    written = {int(s): i for i, s in enumerate(slots)}
    for b in range(nb):
        for name, start, length in block_map(fmt, block_size, s0):
            lo = b * s0 + start
            got = storage[lo:lo + length]
            if name == "padding" or name.endswith("reserved"):
                assert torch.equal(got, before[lo:lo + length]), name
                continue
            t = int(name[5:name.index(".")])
            row = written.get(b * block_size + t)
            part = name[name.index(".") + 1:]
            if row is None:
                assert torch.equal(got, before[lo:lo + length]), f"unwritten {name}"
                continue
            want = {"nope": q, "scales": sb, "rope": rope}[part][row]
            assert torch.equal(got, want), f"block {b} {name}"
            expect[lo:lo + length] = want
    assert torch.equal(storage, expect)
