"""The engines' own test grids, run against ``kvfuse.engines``.

Each grid below is the parameter grid of one of the engine's own tests of the op an adapter replaces
(its shapes, dtypes, layouts, scale kinds), built the way that test builds its inputs, and checked
with that test's own criterion (its reference and its tolerances, restated here: the engines' test
code is not imported or copied). Where the engine's semantics fix the bytes (a plain copy, an fp8
code e4m3(x / scale)), the check is exact as well. tests/test_engine_grids.py runs every grid on the
CPU (with smaller caches where the engine's test allocates gigabytes: the size of a cache changes
no written byte), tests/gpu/test_gpu_engine_grids.py runs them on the GPU at the engine's sizes.

| grid | engine test (release the adapter follows) | adapter |
|---|---|---|
| ``VLLM_RESHAPE_FLASH`` | vLLM tests/kernels/attention/test_cache.py::test_reshape_and_cache_flash (vLLM 0.33) | ``engines.vllm.reshape_and_cache_flash`` |
| ``VLLM_CONCAT_MLA`` | test_cache.py::test_concat_and_cache_mla | ``engines.vllm.concat_and_cache_mla`` ("auto", "fp8") |
| ``VLLM_CONCAT_DS_MLA`` | test_cache.py::test_concat_and_cache_ds_mla | ``engines.vllm.concat_and_cache_mla`` ("fp8_ds_mla") |
| ``VLLM_FUSED_QK_NORM_ROPE`` | tests/kernels/core/test_fused_qk_norm_rope.py | ``engines.vllm.fused_qk_norm_rope`` |
| ``FLASHINFER_APPEND_PAGED`` | FlashInfer tests/test_page.py::test_append_paged_kv_cache (FlashInfer 0.7.2) | ``engines.flashinfer.append_paged_kv_cache`` |
| ``FLASHINFER_ROPE_QUANTIZE_APPEND`` | tests/attention/test_rope.py::test_generalized_rope_quantize_append_kv_cache | ``engines.flashinfer.rope_quantize_fp8_append_paged_kv_cache`` |
"""
from __future__ import annotations

import itertools
import random

import torch

F8 = torch.float8_e4m3fn


def _grid(**axes):
    names = list(axes)
    return [dict(zip(names, values)) for values in itertools.product(*axes.values())]


def _gen(seed: int, device) -> torch.Generator:
    """A generator on ``device``: the GPU grids draw their gigabyte caches there, not on the host."""
    return torch.Generator(device=device).manual_seed(seed)


def _randn(shape, dtype, seed, device):
    return torch.randn(shape, generator=_gen(seed, device), device=device).to(dtype)


def _random_e4m3_bytes(shape, seed, device) -> torch.Tensor:
    """Finite e4m3 codes (no 0x7F / 0xFF NaNs), as the engines' cache factories fill an fp8 cache."""
    codes = torch.randint(0, 0x7F, shape, generator=_gen(seed, device), dtype=torch.uint8, device=device)
    sign = torch.randint(0, 2, shape, generator=_gen(seed + 1, device), dtype=torch.uint8, device=device) << 7
    return codes | sign


def _e4m3_div(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """vLLM's fp8 cache code: e4m3(x / scale), one IEEE fp32 division, saturated to +-448, nearest even."""
    return (x.float() / scale.float()).clamp(-448.0, 448.0).to(F8).view(torch.uint8)


def _dequant_fp16(codes: torch.Tensor, scale: torch.Tensor, head_dim_axis: int = None) -> torch.Tensor:
    """vLLM's test dequantization: fp8 * scale (per tensor, or per head along ``head_dim_axis``) in fp16."""
    v = codes.view(F8).to(torch.float32)
    s = scale.float()
    if s.numel() > 1:
        shape = [1] * v.dim()
        shape[head_dim_axis] = -1
        s = s.view(shape)
    return (v * s).to(torch.float16)


# =============================================================================== vLLM reshape_and_cache_flash
# test_reshape_and_cache_flash: num_tokens 42 // 2, num_heads 8, head sizes 64 / 80 / 256, block sizes
# 8 / 16 / 32, num_blocks 1024 // 2 and 10000 // 2, bf16 and fp32 activations, "auto" and "fp8",
# NHC and HNC caches, per-tensor ("tensor") and per-head ("attn_head") scales (its CUDA implementation).
VLLM_RESHAPE_FLASH = _grid(head_size=(64, 80, 256), block_size=(8, 16, 32), num_blocks=(512, 5000),
                           dtype=(torch.bfloat16, torch.float32), kv_cache_dtype=("auto", "fp8"),
                           layout=("NHC", "HNC"), scale_type=("tensor", "attn_head"))


def run_vllm_reshape_flash(case: dict, device, max_blocks: int = None) -> None:
    from kvfuse.engines import vllm

    num_tokens, num_heads = 21, 8
    head_size, block_size, dtype = case["head_size"], case["block_size"], case["dtype"]
    num_blocks = case["num_blocks"] if max_blocks is None else min(case["num_blocks"], max_blocks)
    fp8 = case["kv_cache_dtype"] == "fp8"
    seed = head_size * 7 + block_size * 3 + num_blocks
    slots = random.Random(seed).sample(range(num_blocks * block_size), num_tokens)
    slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
    qkv = _randn((num_tokens, 3, num_heads, head_size), dtype, seed, device)
    _, key, value = qkv.unbind(dim=1)
    # vLLM's flashinfer-style factory: one [num_blocks, 2, ...] allocation per layer, K = [:, 0], V = [:, 1];
    # HNC stores heads before tokens and the test hands the kernel the NHD-ordered view
    phys = (num_blocks, 2, block_size, num_heads, head_size) if case["layout"] == "NHC" else \
        (num_blocks, 2, num_heads, block_size, head_size)
    if fp8:
        storage = _random_e4m3_bytes(phys, seed + 5, device)
    else:
        storage = _randn(phys, dtype, seed + 5, device)
    kv = storage if case["layout"] == "NHC" else storage.transpose(2, 3)
    key_cache, value_cache = kv[:, 0], kv[:, 1]
    if case["scale_type"] == "tensor":
        k_scale = (key.amax() / 64.0).to(torch.float32)
        v_scale = (value.amax() / 64.0).to(torch.float32)
    else:
        k_scale = (key.amax(dim=(0, 2)) / 64.0).to(torch.float32)
        v_scale = (value.amax(dim=(0, 2)) / 64.0).to(torch.float32)
    before_k, before_v = key_cache.clone(), value_cache.clone()

    vllm.reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, case["kv_cache_dtype"],
                                 k_scale, v_scale)

    blk = slot_mapping // block_size
    off = slot_mapping % block_size
    # exact: the written records are vLLM's codes (or the bits), nothing else changed
    want_k, want_v = before_k.clone(), before_v.clone()
    if fp8:
        ks = k_scale.view(1, -1, 1) if k_scale.numel() > 1 else k_scale
        vs = v_scale.view(1, -1, 1) if v_scale.numel() > 1 else v_scale
        want_k[blk, off] = _e4m3_div(key, ks)
        want_v[blk, off] = _e4m3_div(value, vs)
    else:
        want_k[blk, off] = key
        want_v[blk, off] = value
    assert torch.equal(key_cache.contiguous().view(torch.uint8), want_k.contiguous().view(torch.uint8)), case
    assert torch.equal(value_cache.contiguous().view(torch.uint8), want_v.contiguous().view(torch.uint8)), case
    # vLLM's own criterion: the dequantized cache against the dequantized original with the tokens written
    if fp8:
        for cache, before, x, s in ((key_cache, before_k, key, k_scale), (value_cache, before_v, value, v_scale)):
            expect = _dequant_fp16(before, s, 2)
            expect[blk, off] = x.to(torch.float16)
            torch.testing.assert_close(_dequant_fp16(cache, s, 2), expect, atol=0.001, rtol=0.1)


# =============================================================================== vLLM concat_and_cache_mla
# test_concat_and_cache_mla: kv_lora_rank 256 / 512, qk_rope_head_dim 64, 42 tokens, block 16, 8 blocks,
# bf16 and fp32, "auto" and "fp8", scale 0.1.
VLLM_CONCAT_MLA = _grid(kv_lora_rank=(256, 512), dtype=(torch.bfloat16, torch.float32),
                        kv_cache_dtype=("auto", "fp8"))


def _mla_inputs(kv_lora_rank, dtype, seed, device, num_tokens=42, num_blocks=8, block_size=16):
    slots = random.Random(seed).sample(range(num_blocks * block_size), num_tokens)
    slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
    kv_c = _randn((num_tokens, kv_lora_rank), dtype, seed + 1, device)
    k_pe = _randn((num_tokens, 64), dtype, seed + 2, device)
    return slot_mapping, kv_c, k_pe


def run_vllm_concat_mla(case: dict, device) -> None:
    from kvfuse.engines import vllm

    rank, dtype, fp8 = case["kv_lora_rank"], case["dtype"], case["kv_cache_dtype"] == "fp8"
    slot_mapping, kv_c, k_pe = _mla_inputs(rank, dtype, rank + (7 if fp8 else 0), device)
    scale = torch.tensor(0.1, dtype=torch.float32, device=device)
    kv_cache = torch.zeros(8, 16, rank + 64, dtype=torch.uint8 if fp8 else dtype, device=device)
    vllm.concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, case["kv_cache_dtype"], scale)

    ref = torch.zeros(8, 16, rank + 64, dtype=dtype, device=device)
    blk, off = slot_mapping // 16, slot_mapping % 16
    ref[blk, off] = torch.cat([kv_c, k_pe], dim=-1)
    if fp8:
        ref_codes = _e4m3_div(ref, scale)
        assert torch.equal(kv_cache, ref_codes), case
        torch.testing.assert_close(_dequant_fp16(kv_cache, scale), _dequant_fp16(ref_codes, scale),
                                   atol=0.001, rtol=0.1)
    else:
        torch.testing.assert_close(kv_cache, ref, atol=0, rtol=0)
        assert torch.equal(kv_cache.view(torch.uint8), ref.view(torch.uint8)), case


# test_concat_and_cache_ds_mla: kv_lora_rank 512 (the only rank it runs), 16-bit inputs (bf16 of its DTYPES),
# a 656-byte uint8 record: per 128 values of kv_c the fp32 scale, the e4m3 codes of x / scale, k_pe's bits.
# vLLM 0.33.0's writer (its released sm_90 code) stores the power-of-two scale 2^ceil(log2(max(amax / 448,
# 1e-4))); the test's tolerances (atol 0.001, rtol 0.1 on codes, scales and k_pe) are checked with it.
VLLM_CONCAT_DS_MLA = _grid(dtype=(torch.bfloat16,))


def run_vllm_concat_ds_mla(case: dict, device) -> None:
    from kvfuse.engines import vllm

    slot_mapping, kv_c, k_pe = _mla_inputs(512, case["dtype"], 11, device)
    kv_cache = torch.zeros(8, 16, 656, dtype=torch.uint8, device=device)
    vllm.concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, "fp8_ds_mla",
                              torch.tensor(1.0, dtype=torch.float32, device=device))
    ref = torch.zeros_like(kv_cache)
    for i, s in enumerate(slot_mapping.tolist()):
        rec = ref[s // 16, s % 16]
        tiles = kv_c[i].float().view(4, 128)
        amax = tiles.abs().amax(dim=1)
        scale = torch.exp2(torch.ceil(torch.log2(torch.clamp(amax / 448.0, min=1e-4))))
        rec[:512] = _e4m3_div(tiles, scale[:, None]).view(512)
        rec[512:528] = scale.to(torch.float32).view(torch.uint8)
        rec[528:] = k_pe[i].contiguous().view(torch.uint8)
    assert torch.equal(kv_cache, ref), case
    for got, want in ((kv_cache[..., :512], ref[..., :512]), (kv_cache[..., 512:528].contiguous().view(torch.float32),
                                                              ref[..., 512:528].contiguous().view(torch.float32)),
                      (kv_cache[..., 528:].contiguous().view(case["dtype"]),
                       ref[..., 528:].contiguous().view(case["dtype"]))):
        torch.testing.assert_close(got, want, atol=0.001, rtol=0.1)


# =============================================================================== vLLM fused_qk_norm_rope
# test_fused_qk_norm_rope_matches_reference: bf16 and fp16, NEOX and GPT-J, eps 1e-5 / 1e-6, rotary
# ratio 1 / 0.5 / 0.25 of head_dim 128; 16 q heads, 4 kv heads, 4 tokens at positions 0..3; RMSNorm
# weights ~ N(1, 0.1) in the activations' dtype; RotaryEmbedding's cos_sin_cache (base 10000, 4096
# positions) in the activations' dtype. Reference: vLLM's native RMSNorm (fp32 statistics, the
# normalized value rounded to the dtype, then times the weight) and native RoPE (in the dtype); atol
# = rtol = 1e-2 for bf16, 2e-3 for fp16. kvfuse's fused numerics are closer to the exact result than
# that reference, and on some draws an element falls outside the tolerance where the reference is the
# one that is off: such an element passes when kvfuse is at least as close to an fp64 chain.
VLLM_FUSED_QK_NORM_ROPE = _grid(dtype=(torch.bfloat16, torch.float16), is_neox=(True, False),
                                eps=(1e-5, 1e-6), rotary_ratio=(1.0, 0.5, 0.25))


def _vllm_cos_sin_cache(rotary_dim: int, max_positions: int, dtype, device) -> torch.Tensor:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
    freqs = torch.einsum("i,j->ij", torch.arange(max_positions, dtype=torch.float), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype).to(device)


def _vllm_native_rmsnorm(x, weight, eps):
    xf = x.float()
    var = xf.pow(2).mean(dim=-1, keepdim=True)
    return (xf * torch.rsqrt(var + eps)).to(x.dtype) * weight


def _vllm_native_rope(x, cos, sin, rotary_dim, is_neox):
    rot, keep = x[..., :rotary_dim], x[..., rotary_dim:]
    cos, sin = cos[:, None, :], sin[:, None, :]
    if is_neox:
        x1, x2 = torch.chunk(rot, 2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = rot[..., ::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((out, keep), dim=-1)


def run_vllm_fused_qk_norm_rope(case: dict, device, seed: int = 13) -> None:
    from kvfuse.engines import vllm

    dtype, is_neox, eps = case["dtype"], case["is_neox"], case["eps"]
    hq, hkv, d, n = 16, 4, 128, 4
    rotary_dim = int(d * case["rotary_ratio"])
    qkv = _randn((n, (hq + 2 * hkv) * d), dtype, seed, device)
    positions = torch.arange(n, dtype=torch.long, device=device)
    q_weight = (1.0 + 0.1 * torch.randn(d, generator=_gen(21, device), device=device)).to(dtype)
    k_weight = (1.0 + 0.1 * torch.randn(d, generator=_gen(22, device), device=device)).to(dtype)
    cos_sin_cache = _vllm_cos_sin_cache(rotary_dim, 4096, dtype, device)

    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    cs = cos_sin_cache[positions]
    cos, sin = cs.chunk(2, dim=-1)
    q_ref = _vllm_native_rope(_vllm_native_rmsnorm(q.view(n, hq, d), q_weight, eps), cos, sin, rotary_dim, is_neox)
    k_ref = _vllm_native_rope(_vllm_native_rmsnorm(k.view(n, hkv, d), k_weight, eps), cos, sin, rotary_dim, is_neox)
    ref = torch.cat([q_ref.reshape(n, -1), k_ref.reshape(n, -1), v], dim=-1)

    fused = qkv.clone()
    vllm.fused_qk_norm_rope(fused, hq, hkv, hkv, d, eps, q_weight, k_weight, cos_sin_cache, is_neox, positions)
    atol = rtol = 2e-3 if dtype == torch.float16 else 1e-2
    assert torch.equal(fused[:, (hq + hkv) * d:], qkv[:, (hq + hkv) * d:]), "v must be untouched"
    # vLLM's criterion; an element outside it must be one where vLLM's reference is the farther of the two
    # from the exact (fp64) result: that reference rounds after the norm and computes RoPE in the dtype
    outside = ~torch.isclose(fused.float(), ref.float(), atol=atol, rtol=rtol)
    if outside.any():
        c64, s64 = (t.double() for t in cs.chunk(2, dim=-1))
        exact = torch.cat([
            _vllm_native_rope(_rmsnorm64(q.view(n, hq, d), q_weight, eps), c64, s64, rotary_dim, is_neox).reshape(n, -1),
            _vllm_native_rope(_rmsnorm64(k.view(n, hkv, d), k_weight, eps), c64, s64, rotary_dim, is_neox).reshape(n, -1),
            v.double()], dim=-1)
        ours, theirs = (fused.double() - exact).abs(), (ref.double() - exact).abs()
        assert bool((ours[outside] <= theirs[outside]).all()), (
            f"{int(outside.sum())} elements outside vLLM's tolerance, not all closer to fp64 than its reference")
        assert int(outside.sum()) <= 4, int(outside.sum())      # a handful at most (2026-12-03: 1 of 12288)
    return int(outside.sum())


def _rmsnorm64(x, weight, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.double()


# =============================================================================== FlashInfer append_paged_kv_cache
# test_append_paged_kv_cache: fp16 append_key / append_value [100, 32, 128] (contiguous, or the K and V
# views of one [100, 2, 32, 128] tensor), four requests appending 45 / 8 / 25 / 22 tokens to 3 / 1 / 2 / 2
# pages of 16 (pages 0..7 of 1000), one NHD [1000, 2, 16, 32, 128] fp16 cache. Its check: the call runs;
# checked here too: every appended token's K and V bits at FlashInfer's (page, offset), nothing else changed.
FLASHINFER_APPEND_PAGED = _grid(contiguous=(True, False))


def run_flashinfer_append_paged(case: dict, device) -> None:
    from kvfuse.engines import flashinfer

    nnz, heads, d, page_size, max_pages = 100, 32, 128, 16, 1000
    if case["contiguous"]:
        k_append = _randn((nnz, heads, d), torch.float16, 1, device)
        v_append = _randn((nnz, heads, d), torch.float16, 2, device)
    else:
        kv = _randn((nnz, 2, heads, d), torch.float16, 3, device)
        k_append, v_append = kv[:, 0], kv[:, 1]
    lengths = [45, 8, 25, 22]
    pages_per_req = [3, 1, 2, 2]
    kv_indptr = torch.tensor([0] + list(itertools.accumulate(pages_per_req)), dtype=torch.int32, device=device)
    kv_indices = torch.arange(8, dtype=torch.int32, device=device)
    kv_last_page_len = torch.tensor([13, 8, 9, 6], dtype=torch.int32, device=device)
    # FlashInfer's get_batch_indices_positions: each request's tokens at positions seq_len - append_len ..
    batch, pos = [], []
    for r, (ln, pages, last) in enumerate(zip(lengths, pages_per_req, [13, 8, 9, 6])):
        seq_len = (pages - 1) * page_size + last
        batch += [r] * ln
        pos += list(range(seq_len - ln, seq_len))
    batch_indices = torch.tensor(batch, dtype=torch.int32, device=device)
    positions = torch.tensor(pos, dtype=torch.int32, device=device)
    cache = _randn((max_pages, 2, page_size, heads, d), torch.float16, 4, device)
    before = cache.clone()
    flashinfer.append_paged_kv_cache(k_append, v_append, batch_indices, positions, cache, kv_indices, kv_indptr,
                                     kv_last_page_len)
    want = before.clone()
    for i in range(nnz):
        page = kv_indices[kv_indptr[batch[i]] + pos[i] // page_size]
        want[page, 0, pos[i] % page_size] = k_append[i]
        want[page, 1, pos[i] % page_size] = v_append[i]
    assert torch.equal(cache.view(torch.int16), want.view(torch.int16)), case


# tests/attention/test_rope.py::test_generalized_rope_quantize_append_kv_cache (FlashInfer 0.7.2): MLA /
# GQA / MHA (heads, rope_dim, no_rope_dim) as listed there, randn inputs, one request of num_tokens tokens
# at positions 0.. (pos_ids arange), pages arange, scales 1.0, GPT-J (is_neox False), the 4096-row fp32
# table of base 10000. Its check: the RoPE in fp32 of the concatenated q / k rounded to the input dtype
# and then to e4m3 is close to q_rope_out / q_nope_out (rtol 0.2, atol 0.01) and to every cache entry
# (rtol 0.25, atol 0.5; V: e4m3(v * 1.0)). e5m2 is not supported yet (a TypeError, tested apart) and
# enable_pdl is not read by kvfuse: both are left out. Checked here too: each appended entry is exactly
# the cast the adapter documents, e4m3(fp32 RoPE * scale), within one code where the table row differs.
FLASHINFER_ROPE_QUANTIZE_APPEND = _grid(
    config=(("mla", 128, 1, 64, 512), ("mla", 64, 1, 128, 256), ("mla", 128, 1, 64, 128), ("mla", 32, 1, 32, 96),
            ("gqa", 32, 8, 64, 64), ("gqa", 64, 16, 128, 128), ("gqa", 24, 6, 32, 96), ("gqa", 32, 8, 128, 0),
            ("gqa", 64, 8, 128, 0), ("gqa", 64, 8, 64, 0), ("mha", 32, 32, 64, 64), ("mha", 16, 16, 128, 128),
            ("mha", 8, 8, 32, 96)),
    num_tokens=(1, 19, 128, 199, 899, 2047), input_dtype=(torch.float16, torch.bfloat16), kv_layout=("NHD", "HND"),
    page_size=(16, 32))


def _flashinfer_table(rope_dim: int, device, max_seq_len: int = 4096) -> torch.Tensor:
    """FlashInfer's test table: fp32 [max_seq_len, rope_dim], cos | sin of t * base^(-2j / rope_dim)."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=device) / rope_dim))
    freqs = torch.arange(max_seq_len, dtype=torch.float32, device=device)[:, None] * inv[None, :]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _gptj_rope32(x: torch.Tensor, cos_sin: torch.Tensor, pos: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """GPT-J RoPE in fp32 on the first rope_dim columns of x [n, H, D]: pairs (2j, 2j + 1) at angle j."""
    y = x.float().clone()
    cs = cos_sin[pos.long()]
    c, s = cs[:, None, :rope_dim // 2], cs[:, None, rope_dim // 2:]
    a, b = y[..., 0:rope_dim:2].clone(), y[..., 1:rope_dim:2].clone()
    y[..., 0:rope_dim:2] = a * c - b * s
    y[..., 1:rope_dim:2] = b * c + a * s
    return y


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float, what) -> None:
    torch.testing.assert_close(got.view(F8).float(), want.view(F8).float(), rtol=rtol, atol=atol, msg=str(what))


def run_flashinfer_rope_quantize_append(case: dict, device) -> None:
    from kvfuse.engines import flashinfer

    kind, hq, hkv, rope_dim, nope = case["config"]
    n, dt, page_size, layout = case["num_tokens"], case["input_dtype"], case["page_size"], case["kv_layout"]
    mla = kind == "mla"
    d = rope_dim + nope
    q_rope = _randn((n, hq, rope_dim), dt, 1, device)
    q_nope = _randn((n, hq, nope), dt, 2, device) if nope else None
    k_rope = _randn((n, rope_dim) if mla else (n, hkv, rope_dim), dt, 3, device)
    k_nope = (_randn((n, nope) if mla else (n, hkv, nope), dt, 4, device)) if nope else None
    v = None if mla else _randn((n, hkv, d), dt, 5, device)
    table = _flashinfer_table(rope_dim, device)
    pos_ids = torch.arange(n, dtype=torch.int32, device=device)
    pages = -(-n // page_size)
    kv_indptr = torch.tensor([0, pages, pages, pages, pages], dtype=torch.int32, device=device)   # 4 requests
    kv_indices = torch.arange(pages, dtype=torch.int32, device=device)
    batch_indices = torch.zeros(n, dtype=torch.int32, device=device)
    positions = torch.arange(n, dtype=torch.int32, device=device)
    if mla:
        caches = (torch.zeros(pages, page_size, nope, dtype=F8, device=device),
                  torch.zeros(pages, page_size, rope_dim, dtype=F8, device=device))
    else:
        shape = (pages, page_size, hkv, d) if layout == "NHD" else (pages, hkv, page_size, d)
        caches = (torch.zeros(shape, dtype=F8, device=device), torch.zeros(shape, dtype=F8, device=device))
    q_rope_out, q_nope_out = flashinfer.rope_quantize_fp8_append_paged_kv_cache(
        q_rope, k_rope, q_nope, k_nope, v, table, pos_ids, caches, kv_indices, kv_indptr, batch_indices, positions,
        is_neox=False, quantize_dtype=F8, quant_scale_q=1.0, quant_scale_kv=1.0, page_size=page_size,
        kv_layout=layout)
    q_in = q_rope if q_nope is None else torch.cat([q_rope, q_nope], -1)
    k_in = k_rope if k_nope is None else torch.cat([k_rope, k_nope], -1)
    k_in = k_in.unsqueeze(1) if mla else k_in
    q32, k32 = _gptj_rope32(q_in, table, pos_ids, rope_dim), _gptj_rope32(k_in, table, pos_ids, rope_dim)
    q_ref, k_ref = (t.to(dt).to(F8).view(torch.uint8) for t in (q32, k32))     # FlashInfer's test reference
    _close(q_rope_out.view(torch.uint8), q_ref[..., :rope_dim], 0.2, 0.01, case)
    _close(q_nope_out.view(torch.uint8), q_ref[..., rope_dim:], 0.2, 0.01, case)
    page, off = positions.long() // page_size, positions.long() % page_size     # pages arange, one request
    if mla:
        entries = torch.cat([caches[1][page, off], caches[0][page, off]], -1).unsqueeze(1)
        v_entries = None
    elif layout == "NHD":
        entries, v_entries = caches[0][page, off], caches[1][page, off]
    else:
        entries, v_entries = caches[0][page, :, off], caches[1][page, :, off]
    _close(entries.view(torch.uint8), k_ref, 0.25, 0.5, case)
    if v_entries is not None:
        _close(v_entries.view(torch.uint8), v.float().to(F8).view(torch.uint8), 0.25, 0.5, case)
    # the adapter's documented bytes: e4m3 of the fp32 RoPE (a product or sum may round differently
    # from FlashInfer's FMA-contracted CUDA; kvfuse rounds each, as _gptj_rope32 does)
    assert torch.equal(entries.view(torch.uint8), k32.clamp(-448.0, 448.0).to(F8).view(torch.uint8)), case
    q_codes = q32.clamp(-448.0, 448.0).to(F8).view(torch.uint8)
    assert torch.equal(torch.cat([q_rope_out.view(torch.uint8), q_nope_out.view(torch.uint8)], -1), q_codes), case


GRIDS = {
    "vllm_reshape_and_cache_flash": (VLLM_RESHAPE_FLASH, run_vllm_reshape_flash),
    "vllm_concat_and_cache_mla": (VLLM_CONCAT_MLA, run_vllm_concat_mla),
    "vllm_concat_and_cache_ds_mla": (VLLM_CONCAT_DS_MLA, run_vllm_concat_ds_mla),
    "vllm_fused_qk_norm_rope": (VLLM_FUSED_QK_NORM_ROPE, run_vllm_fused_qk_norm_rope),
    "flashinfer_append_paged_kv_cache": (FLASHINFER_APPEND_PAGED, run_flashinfer_append_paged),
    "flashinfer_rope_quantize_fp8_append_paged_kv_cache": (FLASHINFER_ROPE_QUANTIZE_APPEND,
                                                           run_flashinfer_rope_quantize_append),
}


def case_id(case: dict) -> str:
    def fmt(v):
        return str(v).replace("torch.", "") if not isinstance(v, float) or v >= 1e-3 else f"{v:.0e}"
    return "-".join(f"{fmt(v)}" for v in case.values())


__all__ = ["GRIDS", "case_id"]
