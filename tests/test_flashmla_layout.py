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
block viewed as ``[block_size, 1, 584]``. Below, such storages are filled with random bytes and
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
