"""kvfuse.engines.vllm against vLLM 0.33's documented semantics of its cache writers and QK-norm RoPE,
written here as small torch loops (never from kvfuse's output): slot -> (block, offset), slot -1 skips,
a slot_mapping shorter than the batch writes only its tokens, fp8 = e4m3(x / scale) saturated to +-448
with round to nearest even (per tensor or per head), "auto" caches of the input's dtype (bf16 / fp16 /
fp32), the indexer's and fp8_ds_mla's power-of-two scales and byte layouts; fused_qk_norm_rope in fp32
with one rounding, against vLLM's own test reference within its tolerance. Every cache sits in
a storage poisoned with 0xAB bytes and the whole storage is compared, so a stray or missing write
shows. Run on the reference backend and in Triton's interpreter; plus the errors for what is not
supported yet, and torch.compile(fullgraph=True)."""
import math
import random

import pytest
import torch

import kvfuse
from kvfuse.engines import vllm
from helpers import assert_bytes_equal, assert_compiled_matches_eager, random_bf16

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
BACKENDS = ["reference", "triton"]
POISON = 0xAB


def _poisoned(nbytes: int) -> torch.Tensor:
    return torch.full((nbytes,), POISON, dtype=torch.uint8)


def _e4m3_div(x: torch.Tensor, scale: float) -> torch.Tensor:
    """vLLM's scaled_convert: e4m3(x / scale), saturating (SATFINITE) to +-448, round to nearest even;
    uint8 codes. torch's own float8 conversion rounds to nearest even; the clamp is the saturation."""
    t = x.float() / torch.tensor(scale, dtype=torch.float32)
    return t.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)


def _e5m2_div(x: torch.Tensor, scale: float) -> torch.Tensor:
    """vLLM's scaled_convert for kv_cache_dtype "fp8_e5m2": e5m2(x / scale) with __NV_SATFINITE (saturating
    to +-57344, infinities included), round to nearest even; uint8 codes."""
    t = x.float() / torch.tensor(scale, dtype=torch.float32)
    return t.clamp(-57344.0, 57344.0).to(torch.float8_e5m2).view(torch.uint8)


CODES = {"fp8": _e4m3_div, "fp8_e4m3": _e4m3_div, "fp8_e5m2": _e5m2_div}


# --------------------------------------------------------------------------- reshape_and_cache_flash
def _flash_caches(storage: torch.Tensor, num_blocks, block_size, num_heads, head_size, physical, dtype):
    """vLLM's test caches: one [num_blocks, 2, ...] allocation, K = [:, 0] and V = [:, 1], logical
    [num_blocks, block_size, num_heads, head_size]; "NHC" physical is that order, "HNC" stores heads
    before tokens and is viewed through strides."""
    t = storage.view(dtype)
    if physical == "NHC":
        kv = t.view(num_blocks, 2, block_size, num_heads, head_size)
    else:
        kv = t.view(num_blocks, 2, num_heads, block_size, head_size).transpose(2, 3)
    return kv[:, 0], kv[:, 1]


def _flash_expected(key, value, kc, vc, slot_mapping, fp8, k_scale, v_scale, code=_e4m3_div):
    block_size = kc.shape[1]
    for i, s in enumerate(slot_mapping.tolist()):
        if s < 0:
            continue
        b, o = divmod(s, block_size)
        if fp8:
            kc[b, o] = code(key[i], k_scale)
            vc[b, o] = code(value[i], v_scale)
        else:
            kc[b, o] = key[i]
            vc[b, o] = value[i]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("physical", ["NHC", "HNC"])
@pytest.mark.parametrize("head_size,block_size", [(64, 8), (80, 32), (256, 16)])
def test_reshape_and_cache_flash(backend, kv_cache_dtype, physical, head_size, block_size):
    num_heads, num_blocks, num_tokens = 8, 6, 21
    if backend == "triton":
        num_heads, num_tokens = 2, 9
    rnd = random.Random(head_size * 31 + block_size)
    fp8 = kv_cache_dtype != "auto"
    qkv = random_bf16((num_tokens, 3, num_heads, head_size), seed=head_size + block_size)
    _, key, value = qkv.unbind(dim=1)            # strided views, as vLLM's test builds them
    # vLLM pads the batch: the slot mapping covers the first tokens only, some of them padding (-1)
    m = num_tokens - 3
    slots = rnd.sample(range(num_blocks * block_size), m)
    slots[1] = slots[m // 2] = -1
    slot_mapping = torch.tensor(slots, dtype=torch.long)
    cache_dtype = torch.uint8 if fp8 else torch.bfloat16
    nbytes = num_blocks * 2 * block_size * num_heads * head_size * (1 if fp8 else 2)
    k_scale = (key.float().amax() / 64.0).to(torch.float32)
    v_scale = (value.float().amax() / 64.0).to(torch.float32)
    got_storage, want_storage = _poisoned(nbytes), _poisoned(nbytes)
    kc, vc = _flash_caches(got_storage, num_blocks, block_size, num_heads, head_size, physical, cache_dtype)
    with kvfuse.use_backend(backend):
        vllm.reshape_and_cache_flash(key, value, kc, vc, slot_mapping, kv_cache_dtype, k_scale, v_scale)
    ekc, evc = _flash_caches(want_storage, num_blocks, block_size, num_heads, head_size, physical, cache_dtype)
    _flash_expected(key, value, ekc, evc, slot_mapping, fp8, k_scale.item(), v_scale.item(), CODES.get(kv_cache_dtype))
    assert_bytes_equal(got_storage, want_storage, "cache storage")


def _edge_values():
    """bf16 values whose quotients by the scales below fall on e4m3 ties, on the saturation boundary,
    in e4m3's subnormal range and below it (negative values that round to zero keep the sign: 0x80)."""
    base = [0.0, -0.0, 1.0, 1.0625, 1.1875, 17.0, 19.0, 240.0, 248.0, 440.0, 448.0, 456.0, 464.0, 480.0,
            1000.0, 2.0 ** -9, 1.5 * 2.0 ** -9, 2.0 ** -10, 0.75 * 2.0 ** -9, 2.0 ** -12, 3.0 * 2.0 ** -10]
    vals = base + [-v for v in base]
    return torch.tensor(vals + [0.0] * (-len(vals) % 16), dtype=torch.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [1.0, 0.5, 0.1, 3.0, 2.0 ** -6])
def test_reshape_and_cache_flash_fp8_edges(backend, scale):
    """The fp8 rule equals vLLM's on edge values: kvfuse's e4m3(clamp(f(x) / f(scale))) is vLLM's
    e4m3(satfinite(x / scale)), one correctly rounded division, round to nearest even."""
    row = _edge_values() * torch.tensor(scale, dtype=torch.bfloat16) if scale < 1 else _edge_values()
    d = row.numel()
    key = torch.stack([row, row.flip(0)]).view(2, 1, d)
    value = torch.stack([-row, row]).view(2, 1, d)
    got, want = _poisoned(2 * 4 * d * 2), _poisoned(2 * 4 * d * 2)
    s = torch.tensor([scale], dtype=torch.float32)
    kc, vc = _flash_caches(got, 2, 4, 1, d, "NHC", torch.uint8)
    with kvfuse.use_backend(backend):
        vllm.reshape_and_cache_flash(key, value, kc, vc, torch.tensor([5, 2]), "fp8", s, s)
    ekc, evc = _flash_caches(want, 2, 4, 1, d, "NHC", torch.uint8)
    _flash_expected(key, value, ekc, evc, torch.tensor([5, 2]), True, scale, scale)
    assert_bytes_equal(got, want, f"fp8 edges, scale {scale}")
    # the expectation itself is vLLM's rule: spot-check a few codes by hand at scale 1
    if scale == 1.0:
        codes = dict(zip(row.float().tolist(), _e4m3_div(row, 1.0).tolist()))
        assert codes[1.0625] == 0x38 and codes[1.1875] == 0x3A    # ties to even: 1.0, 1.25
        assert codes[464.0] == 0x7E and codes[1000.0] == 0x7E     # saturated to 448
        assert codes[2.0 ** -10] == 0x00 and codes[1.5 * 2.0 ** -9] == 0x02  # subnormal ties to even
        neg = _e4m3_div(torch.tensor([-(2.0 ** -10)], dtype=torch.bfloat16), 1.0)
        assert neg.item() == 0x80                                  # negative zero keeps its sign


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16], ids=["fp16", "fp32", "bf16"])
@pytest.mark.parametrize("kind", ["auto", "fp8_per_tensor", "fp8_per_head"])
@pytest.mark.parametrize("head_size", [8, 72, 120])
def test_reshape_and_cache_flash_dtypes_scales_head_sizes(backend, dtype, kind, head_size):
    """vLLM's template over the input type: "auto" stores the input's dtype (its bits); fp8 divides each
    head by its scale, ``k_scale[head]`` when the scales hold one value per head, else the one value."""
    num_heads, num_blocks, block_size, num_tokens = 3, 3, 4, 7
    g = torch.Generator().manual_seed(head_size + len(kind))
    key = (torch.randn(num_tokens, num_heads, head_size, generator=g) * 7).to(dtype)
    value = (torch.randn(num_tokens, num_heads, head_size, generator=g) * 3).to(dtype)
    slot_mapping = torch.tensor([5, -1, 0, 11, 3, 8, -1])
    fp8 = kind != "auto"
    cache_dtype = torch.uint8 if fp8 else dtype
    esize = 1 if fp8 else dtype.itemsize
    nbytes = num_blocks * 2 * block_size * num_heads * head_size * esize
    per_head = kind == "fp8_per_head"
    k_scale = torch.tensor([0.05, 0.2, 1.5] if per_head else [0.07])
    v_scale = torch.tensor([0.5, 0.01, 0.03] if per_head else [0.02])
    got, want = _poisoned(nbytes), _poisoned(nbytes)
    kc, vc = _flash_caches(got, num_blocks, block_size, num_heads, head_size, "NHC", cache_dtype)
    with kvfuse.use_backend(backend):
        vllm.reshape_and_cache_flash(key, value, kc, vc, slot_mapping, "fp8" if fp8 else "auto", k_scale, v_scale)
    ekc, evc = _flash_caches(want, num_blocks, block_size, num_heads, head_size, "NHC", cache_dtype)
    for i, s in enumerate(slot_mapping.tolist()):
        if s < 0:
            continue
        b, o = divmod(s, block_size)
        for h in range(num_heads):
            ks, vs = (k_scale[h], v_scale[h]) if per_head else (k_scale[0], v_scale[0])
            if fp8:
                ekc[b, o, h] = _e4m3_div(key[i, h], ks.item())
                evc[b, o, h] = _e4m3_div(value[i, h], vs.item())
            else:
                ekc[b, o, h] = key[i, h]
                evc[b, o, h] = value[i, h]
    assert_bytes_equal(got, want, f"{kind} {dtype} head_size {head_size}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_reshape_and_cache_flash_e5m2_edges(backend):
    """kv_cache_dtype "fp8_e5m2" on edge values: ties to even, saturation at 57344 (infinities too), e5m2's
    subnormals, signed zeros; the codes spot-checked by hand against the e5m2 encoding."""
    vals = [0.0, -0.0, 1.0, 1.125, 1.375, 57344.0, 61440.0, 1e6, float("inf"), 2.0 ** -16, 1.5 * 2.0 ** -16,
            2.0 ** -17, 3.0 * 2.0 ** -17]
    row = torch.tensor(vals + [-v for v in vals] + [0.0] * (-2 * len(vals) % 8), dtype=torch.bfloat16)
    d = row.numel()
    key, value = row.view(1, 1, d), (-row).view(1, 1, d)
    got, want = _poisoned(2 * 4 * d * 2), _poisoned(2 * 4 * d * 2)
    s = torch.tensor([1.0], dtype=torch.float32)
    kc, vc = _flash_caches(got, 2, 4, 1, d, "NHC", torch.uint8)
    with kvfuse.use_backend(backend):
        vllm.reshape_and_cache_flash(key, value, kc, vc, torch.tensor([6]), "fp8_e5m2", s, s)
    ekc, evc = _flash_caches(want, 2, 4, 1, d, "NHC", torch.uint8)
    _flash_expected(key, value, ekc, evc, torch.tensor([6]), True, 1.0, 1.0, _e5m2_div)
    assert_bytes_equal(got, want, "fp8_e5m2 edges")
    codes = dict(zip(vals, _e5m2_div(row[:len(vals)], 1.0).tolist()))
    assert codes[1.0] == 0x3C and codes[1.125] == 0x3C and codes[1.375] == 0x3E    # ties to even
    assert codes[61440.0] == codes[1e6] == codes[float("inf")] == 0x7B             # saturated to 57344
    assert codes[2.0 ** -16] == 0x01 and codes[1.5 * 2.0 ** -16] == 0x02 and codes[2.0 ** -17] == 0x00
    assert _e5m2_div(torch.tensor([-0.0], dtype=torch.bfloat16), 1.0).item() == 0x80


def test_reshape_and_cache_flash_float8_cache_and_bf16_scale_shapes():
    """A float8_e4m3fn cache is written like vLLM's uint8 one; scales of shape () and (1,) alike."""
    key = random_bf16((4, 2, 64), seed=3)
    value = random_bf16((4, 2, 64), seed=4)
    slot_mapping = torch.tensor([0, 9, -1, 3])
    a, b = _poisoned(2 * 2 * 8 * 2 * 64), _poisoned(2 * 2 * 8 * 2 * 64)
    ka, va = _flash_caches(a, 2, 8, 2, 64, "NHC", torch.uint8)
    kb, vb = _flash_caches(b, 2, 8, 2, 64, "NHC", torch.uint8)
    with kvfuse.use_backend("reference"):
        vllm.reshape_and_cache_flash(key, value, ka, va, slot_mapping, "fp8", torch.tensor(0.25), torch.tensor(0.5))
        vllm.reshape_and_cache_flash(key, value, kb.view(torch.float8_e4m3fn), vb.view(torch.float8_e4m3fn),
                                     slot_mapping, "fp8_e4m3", torch.tensor([0.25]), torch.tensor([0.5]))
    assert torch.equal(a, b)
    assert not torch.equal(a, _poisoned(a.numel()))


# --------------------------------------------------------------------------- fused_qk_norm_rope
def _f32_tree(p: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim in adjacent pairs (zero-padded to a power of two), fp32 adds one by one."""
    width = 1 << (p.shape[-1] - 1).bit_length()
    p = torch.cat([p, p.new_zeros(p.shape[:-1] + (width - p.shape[-1],))], dim=-1)
    while p.shape[-1] > 1:
        p = p[..., 0::2] + p[..., 1::2]
    return p[..., 0]


def _qk_norm_rope_fused(x, w, eps, cos, sin, rotary_dim, is_neox):
    """One token's heads x [H, D] under the semantics kvfuse documents for vLLM's op (numerics "fused"): RMSNorm
    in fp32 (pairwise sum of squares, / D, + eps, correctly rounded sqrt, 1 / that, (x * rstd) * w), RoPE in
    fp32 on the first rotary_dim dims, one rounding to x's dtype."""
    xf = x.float()
    den = torch.sqrt((_f32_tree(xf * xf) / torch.tensor(float(x.shape[-1])) + torch.tensor(eps, dtype=torch.float32))
                     .double()).float()
    y = (xf * (torch.ones_like(den) / den)[:, None]) * w.float()
    return _rotated(y, cos, sin, rotary_dim, is_neox).to(x.dtype)


def _rotated(y, c, s, rotary_dim, is_neox):
    """y [H, D] with its first rotary_dim dims rotated in y's dtype: pairs (i, i + rotary_dim / 2) (NEOX) or
    (2i, 2i + 1), y0 = a c - b s, y1 = a s + b c."""
    h = rotary_dim // 2
    idx0 = torch.arange(h) if is_neox else 2 * torch.arange(h)
    idx1 = idx0 + h if is_neox else idx0 + 1
    a, b = y[:, idx0].clone(), y[:, idx1].clone()
    y[:, idx0] = a * c - b * s
    y[:, idx1] = a * s + b * c
    return y


def _vllm_native_reference(x, w, eps, cos, sin, rotary_dim, is_neox):
    """vLLM's own test reference (RMSNorm.forward_native, RotaryEmbedding.forward_native): the norm in fp32
    rounded to x's dtype before the weight, the rotation in x's dtype."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w
    return _rotated(y, cos.to(x.dtype), sin.to(x.dtype), rotary_dim, is_neox)


def _within_vllm_tolerance_or_closer(got, x, w, eps, cos, sin, rotary_dim, is_neox, tol):
    """vLLM's test: got within (atol, rtol) of its reference; that reference rounds after each bf16 / fp16 op,
    so where got misses the tolerance (a few elements of cancelling products), got must be the closer of
    the two to the fp64 chain."""
    native = _vllm_native_reference(x, w, eps, cos, sin, rotary_dim, is_neox).double()
    xd = x.double()
    exact = _vllm_native_reference(xd, w.double(), eps, cos.double(), sin.double(), rotary_dim, is_neox)
    g = got.double()
    miss = (g - native).abs() > tol["atol"] + tol["rtol"] * native.abs()
    assert miss.sum() <= max(1, got.numel() // 500), int(miss.sum())
    assert ((g - exact).abs()[miss] < (native - exact).abs()[miss]).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("rotary_ratio,cs_dtype", [(1.0, None), (0.5, None), (0.25, None), (1.0, torch.float32),
                                                   (0.5, torch.float16)],
                         ids=["full", "half", "quarter", "full_fp32_table_far", "half_fp16_table_far"])
def test_fused_qk_norm_rope(backend, dtype, is_neox, rotary_ratio, cs_dtype):
    """vLLM's test's shapes (16 q, 4 k, 4 v heads of 128, 4 tokens, weights ~ N(1, 0.1), base 10000): in place,
    v untouched, q and k byte-equal to the fused semantics restated here. With vLLM's test's table (qkv's
    dtype) and positions (0..3), also within its tolerance of its own reference; the other tables are
    read at a far position too (3000), where that reference's rounded cos / sin are no yardstick."""
    num_heads, num_kv_heads, head_dim, num_tokens, eps = 16, 4, 128, 4, 1e-6
    g = torch.Generator().manual_seed(13)
    total = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, total, generator=g).to(dtype)
    before = qkv.clone()
    q_weight = (1.0 + 0.1 * torch.randn(head_dim, generator=g)).to(dtype)
    k_weight = (1.0 + 0.1 * torch.randn(head_dim, generator=g)).to(dtype)
    rotary_dim = int(head_dim * rotary_ratio)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
    freqs = torch.outer(torch.arange(4096, dtype=torch.float), inv_freq)
    cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(cs_dtype or dtype)
    vllm_test = cs_dtype is None
    positions = torch.tensor([0, 1, 2, 3] if vllm_test else [0, 1, 2, 3000])
    with kvfuse.use_backend(backend):
        assert vllm.fused_qk_norm_rope(qkv, num_heads, num_kv_heads, num_kv_heads, head_dim, eps, q_weight, k_weight,
                                       cos_sin_cache, is_neox, positions) is None
    qs, ks = num_heads * head_dim, num_kv_heads * head_dim
    assert torch.equal(qkv[:, qs + ks:], before[:, qs + ks:])                       # v
    tol = dict(atol=2e-3, rtol=2e-3) if dtype == torch.float16 else dict(atol=1e-2, rtol=1e-2)
    for t in range(num_tokens):
        row = cos_sin_cache[positions[t]].float()
        cos, sin = row[:rotary_dim // 2], row[rotary_dim // 2:]
        for lo, heads, w in ((0, num_heads, q_weight), (qs, num_kv_heads, k_weight)):
            x = before[t, lo:lo + heads * head_dim].view(heads, head_dim)
            got = qkv[t, lo:lo + heads * head_dim].view(heads, head_dim)
            want = _qk_norm_rope_fused(x, w, eps, cos, sin, rotary_dim, is_neox)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (t, lo)
            if vllm_test:
                _within_vllm_tolerance_or_closer(got, x, w, eps, cos, sin, rotary_dim, is_neox, tol)


@pytest.mark.parametrize("rows,row_stride,start", [(3, 6 * 64, 0), (3, 7 * 64 + 8, 40), (1, 6 * 64, 8)],
                         ids=["packed", "padded_offset", "one_token"])
def test_fused_qk_norm_rope_heads_are_the_sliced_views(monkeypatch, rows, row_stride, start):
    """The q and k heads reach the entry as the views qkv[:, :hq * d].unflatten(1, (hq, d)) and the next
    hk * d columns (built eagerly by as_strided): the same elements of the same storage, also for a qkv
    whose rows are padded and which starts inside its buffer."""
    seen = {}

    def gqa_entry(q, k, v, k_cache, v_cache, slot_mapping, q_norm_args, k_norm_args, rope_args, **kw):
        seen.update(q=q, k=k, q_out=kw["q_out"], k_out=kw["k_out"])

    monkeypatch.setattr(vllm, "fused_qk_norm_rope_store_kv", gqa_entry)
    buf = torch.zeros(start + rows * row_stride, dtype=torch.bfloat16)
    qkv = buf[start:].as_strided((rows, 6 * 64), (row_stride, 1))
    w, table = torch.ones(64, dtype=torch.bfloat16), torch.ones(16, 32)
    vllm.fused_qk_norm_rope(qkv, 4, 1, 1, 64, 1e-6, w, w, table, True, torch.zeros(rows, dtype=torch.int64))
    for name, want in (("q", qkv[:, :4 * 64].unflatten(1, (4, 64))), ("k", qkv[:, 4 * 64:5 * 64].unflatten(1, (1, 64)))):
        got = seen[name]
        assert got is seen[f"{name}_out"]
        assert (got.shape, got.storage_offset()) == (want.shape, want.storage_offset())
        # the same elements: equal strides where a dim has more than one index (torch's view restrides a
        # dim of size 1, which holds one index whatever its stride)
        assert all(a == b for a, b, size in zip(got.stride(), want.stride(), got.shape) if size > 1)
        assert got.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()


def test_reshape_and_cache_flash_scales_reach_the_entry_as_given(monkeypatch):
    """Scales the entry takes as they are (one element of shape () or (1,), a 1-d per-head vector) reach it
    unreshaped; others ([1, 1], [1, H]) as shape () or [H]."""
    seen = []

    def gqa_entry(q, k, v, k_cache, v_cache, slot_mapping, **kw):
        seen.append((kw["k_scale"], kw["v_scale"]))

    monkeypatch.setattr(vllm, "fused_qk_norm_rope_store_kv", gqa_entry)
    key = value = torch.zeros(2, 4, 64, dtype=torch.bfloat16)
    cache = torch.zeros(3, 8, 4, 64, dtype=torch.uint8)
    for shape, want in (((), ()), ((1,), (1,)), ((4,), (4,)), ((1, 1), ()), ((1, 4), (4,))):
        k_scale, v_scale = torch.ones(shape), torch.full(shape, 2.0)
        vllm.reshape_and_cache_flash(key, value, cache, cache.clone(), torch.tensor([0, 1]), "fp8", k_scale, v_scale)
        got_k, got_v = seen[-1]
        assert got_k.shape == got_v.shape == want and torch.equal(got_v, torch.full(want, 2.0))
        assert (got_k is k_scale) == (len(shape) == len(want))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fused_qk_norm_rope_hands_weights_and_table_over_uncopied(monkeypatch, dtype):
    """The weights and cos_sin_cache reach kvfuse's GQA entry as the tensors vLLM gave (fp16 ones too: the
    entry reads them as fp32 itself), so a call makes no copy of them."""
    seen = {}

    def gqa_entry(q, k, v, k_cache, v_cache, slot_mapping, q_norm_args, k_norm_args, rope_args, **kw):
        seen.update(q_weight=q_norm_args.weight, k_weight=k_norm_args.weight, table=rope_args.cos_sin_cache)

    monkeypatch.setattr(vllm, "fused_qk_norm_rope_store_kv", gqa_entry)
    qkv = torch.zeros(2, 6 * 64, dtype=dtype)
    q_weight, k_weight = torch.ones(64, dtype=dtype), torch.full((64,), 2.0, dtype=dtype)
    table = torch.ones(16, 32, dtype=torch.float16)
    vllm.fused_qk_norm_rope(qkv, 4, 1, 1, 64, 1e-6, q_weight, k_weight, table, True, torch.tensor([1, 5]))
    assert seen["q_weight"] is q_weight and seen["k_weight"] is k_weight and seen["table"] is table


def test_fused_qk_norm_rope_fused_is_closer_than_staged():
    """The reason for the fused profile: against an fp64 chain, vLLM's semantics (one rounding) err less than
    kvfuse's staged chain on the same inputs (bf16, vLLM's test's shapes)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 8, 128, generator=g).to(torch.bfloat16)
    w = (1.0 + 0.1 * torch.randn(128, generator=g)).to(torch.bfloat16)
    pos = torch.arange(64) * 37
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    freqs = torch.outer(torch.arange(4096, dtype=torch.float64), inv_freq)
    cs = torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()
    xd, wd, csd = x.double(), w.double(), cs.double()[pos][:, None, :]
    y = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * wd
    c, s = csd[..., :64], csd[..., 64:]
    exact = torch.cat([y[..., :64] * c - y[..., 64:] * s, y[..., :64] * s + y[..., 64:] * c], dim=-1)
    errs = {}
    for numerics in ("staged", "fused"):
        out = kvfuse.fused_qk_norm_rope_store_kv(x, x[:, :1], None, None, None, None, kvfuse.NormArgs(w),
                                                 kvfuse.NormArgs(w), kvfuse.RopeArgs(pos, cs, 128, True),
                                                 numerics=numerics)[0]
        errs[numerics] = (out.double() - exact).abs().mean().item()
    assert errs["fused"] < errs["staged"], errs


# --------------------------------------------------------------------------- indexer_k_quant_and_cache
def _indexer_expected(k, cache, slot_mapping):
    """vLLM's indexer writer with scale_fmt "ue8m0": per token s = 2^ceil(log2(max(amax, 1e-4) / 448)),
    block b holds block_size * 128 value bytes, then block_size fp32 scales."""
    block_size = cache.shape[1]
    flat = cache.view(cache.shape[0], -1)
    for i, s in enumerate(slot_mapping[:k.shape[0]].tolist()):
        if s < 0:
            continue
        b, o = divmod(s, block_size)
        x = k[i].float()
        sc = torch.maximum(x.abs().amax(), torch.tensor(1e-4, dtype=torch.float32)) / 448.0
        scale = 2.0 ** math.ceil(math.log2(sc.item()))
        flat[b, o * 128:(o + 1) * 128] = _e4m3_div(k[i], scale)
        flat[b, block_size * 128 + 4 * o:block_size * 128 + 4 * o + 4] = \
            torch.tensor([scale], dtype=torch.float32).view(torch.uint8)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [16, 64])
def test_indexer_k_quant_and_cache(backend, block_size):
    num_tokens, num_blocks = (13 if backend == "triton" else 40), 4
    k = random_bf16((num_tokens, 128), seed=block_size)
    k[3] = 0                                                      # amax 0: the 1e-4 floor, scale 2^-22
    k[4] *= torch.tensor(2.0 ** -20, dtype=torch.bfloat16)       # tiny values
    rnd = random.Random(block_size)
    slots = rnd.sample(range(num_blocks * block_size), num_tokens + 2)
    slots[2] = -1
    slot_mapping = torch.tensor(slots, dtype=torch.long)          # longer than k: the rest is not read
    shape = (num_blocks, block_size, 132)
    got, want = _poisoned(math.prod(shape)).view(shape), _poisoned(math.prod(shape)).view(shape)
    with kvfuse.use_backend(backend):
        vllm.indexer_k_quant_and_cache(k, got, slot_mapping, 128, "ue8m0")
    _indexer_expected(k, want, slot_mapping)
    assert_bytes_equal(got, want, "indexer cache")


# --------------------------------------------------------------------------- concat_and_cache_mla
def _mla_expected(kv_c, k_pe, cache, slot_mapping, kind, scale):
    block_size = cache.shape[1]
    rank = kv_c.shape[1]
    for i, s in enumerate(slot_mapping.tolist()):
        if s < 0:
            continue
        b, o = divmod(s, block_size)
        rec = cache[b, o]
        if kind == "auto":
            rec.view(torch.bfloat16)[:] = torch.cat([kv_c[i], k_pe[i]])
        elif kind == "fp8":
            rec[:] = _e4m3_div(torch.cat([kv_c[i], k_pe[i]]), scale)
        else:   # fp8_ds_mla: 4 tiles of 128 e4m3, 4 fp32 scales, then k_pe's bf16 bits
            for t in range(4):
                tile = kv_c[i, 128 * t:128 * (t + 1)]
                amax = tile.float().abs().amax() / 448.0
                sc = 2.0 ** math.ceil(math.log2(max(amax.item(), 1e-4)))
                rec[128 * t:128 * (t + 1)] = _e4m3_div(tile, sc)
                rec[512 + 4 * t:516 + 4 * t] = torch.tensor([sc], dtype=torch.float32).view(torch.uint8)
            rec[528:656] = k_pe[i].contiguous().view(torch.uint8)
    assert rank == kv_c.shape[1]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,rank", [("auto", 256), ("auto", 512), ("fp8", 256), ("fp8", 512),
                                       ("fp8_ds_mla", 512)])
def test_concat_and_cache_mla(backend, kind, rank):
    num_tokens, block_size, num_blocks, pe_dim = (42 if backend == "reference" else 7), 16, 8, 64
    kv_c = random_bf16((num_tokens, rank), seed=rank)
    k_pe = random_bf16((num_tokens, pe_dim), seed=rank + 1)
    if kind == "fp8_ds_mla":
        kv_c[2, :128] = 0                                        # an all-zero tile: scale 2^-13
    rnd = random.Random(rank)
    slots = rnd.sample(range(num_blocks * block_size), num_tokens - 2)   # padded batch
    slots[3] = -1
    slot_mapping = torch.tensor(slots, dtype=torch.long)
    entry = 656 if kind == "fp8_ds_mla" else rank + pe_dim
    elem = 2 if kind == "auto" else 1
    shape = (num_blocks, block_size, entry * elem)
    got, want = _poisoned(math.prod(shape)).view(shape), _poisoned(math.prod(shape)).view(shape)
    cache = got.view(torch.bfloat16) if kind == "auto" else got
    scale = torch.tensor(0.1, dtype=torch.float32)              # vLLM's test's scale
    with kvfuse.use_backend(backend):
        vllm.concat_and_cache_mla(kv_c, k_pe, cache, slot_mapping, kind, scale)
    _mla_expected(kv_c, k_pe, want, slot_mapping, kind, 0.1)
    assert_bytes_equal(got, want, f"mla cache {kind}")


def test_byte_record_caches_as_float8_views():
    """The indexer and fp8_ds_mla caches may come as float8_e4m3fn views of their bytes: same bytes."""
    k = random_bf16((3, 128), seed=20)
    kv_c, k_pe = random_bf16((3, 512), seed=21), random_bf16((3, 64), seed=22)
    slots = torch.tensor([7, -1, 2])
    written = []
    for as_float8 in (False, True):
        index, mla = _poisoned(2 * 16 * 132).view(2, 16, 132), _poisoned(2 * 16 * 656).view(2, 16, 656)
        view = (lambda t: t.view(torch.float8_e4m3fn)) if as_float8 else (lambda t: t)
        with kvfuse.use_backend("reference"):
            vllm.indexer_k_quant_and_cache(k, view(index), slots, 128, "ue8m0")
            vllm.concat_and_cache_mla(kv_c, k_pe, view(mla), slots, "fp8_ds_mla", torch.tensor(1.0))
        written.append((index, mla))
    assert torch.equal(written[0][0], written[1][0]) and torch.equal(written[0][1], written[1][1])
    assert not torch.equal(written[0][0], _poisoned(2 * 16 * 132).view(2, 16, 132))


# --------------------------------------------------------------------------- errors
def _flash_args(**over):
    kw = dict(key=random_bf16((3, 2, 64), seed=1), value=random_bf16((3, 2, 64), seed=2),
              key_cache=torch.full((2, 8, 2, 64), POISON, dtype=torch.uint8),
              value_cache=torch.full((2, 8, 2, 64), POISON, dtype=torch.uint8),
              slot_mapping=torch.tensor([1, 2, 3]), kv_cache_dtype="fp8",
              k_scale=torch.tensor(1.0), v_scale=torch.tensor(1.0))
    kw.update(over)
    return kw


def _index_args(**over):
    kw = dict(k=random_bf16((3, 128), seed=1), kv_cache=torch.full((2, 16, 132), POISON, dtype=torch.uint8),
              slot_mapping=torch.tensor([1, 2, 3]), quant_block_size=128, scale_fmt="ue8m0")
    kw.update(over)
    return kw


def _qk_args(**over):
    kw = dict(qkv=random_bf16((3, 6 * 64), seed=5), num_heads_q=4, num_heads_k=1, num_heads_v=1, head_dim=64,
              eps=1e-6, q_weight=torch.ones(64, dtype=torch.bfloat16), k_weight=torch.ones(64, dtype=torch.bfloat16),
              cos_sin_cache=torch.zeros(16, 64), is_neox=True, position_ids=torch.arange(3))
    kw.update(over)
    return kw


def _mla_args(**over):
    kw = dict(kv_c=random_bf16((3, 512), seed=1), k_pe=random_bf16((3, 64), seed=2),
              kv_cache=torch.full((2, 16, 656), POISON, dtype=torch.uint8), slot_mapping=torch.tensor([1, 2, 3]),
              kv_cache_dtype="fp8_ds_mla", scale=torch.tensor(1.0))
    kw.update(over)
    return kw


ERRORS = [
    ("fp64 key", vllm.reshape_and_cache_flash, _flash_args, lambda: dict(key=torch.zeros(3, 2, 64, dtype=torch.double)),
     TypeError, "key: dtype torch.float64 is not supported yet"),
    ("fp32 value, bf16 key", vllm.reshape_and_cache_flash, _flash_args, lambda: dict(value=torch.zeros(3, 2, 64)),
     TypeError, "value: expected key's dtype torch.bfloat16, got torch.float32"),
    ("head size 20", vllm.reshape_and_cache_flash, _flash_args,
     lambda: dict(key=torch.zeros(3, 2, 20, dtype=torch.bfloat16), value=torch.zeros(3, 2, 20, dtype=torch.bfloat16)),
     ValueError, "key: head size 20 is not supported yet"),
    ("auto fp16 key, bf16 cache", vllm.reshape_and_cache_flash, _flash_args,
     lambda: dict(key=torch.zeros(3, 2, 64, dtype=torch.half), value=torch.zeros(3, 2, 64, dtype=torch.half),
                  kv_cache_dtype="auto", key_cache=torch.zeros(2, 8, 2, 64, dtype=torch.bfloat16)),
     TypeError, "key_cache: kv_cache_dtype 'auto' stores the input's dtype (torch.float16)"),
    ("fp8_inc", vllm.reshape_and_cache_flash, _flash_args, lambda: dict(kv_cache_dtype="fp8_inc"),
     ValueError, "kv_cache_dtype 'fp8_inc' is not supported yet"),
    ("e5m2 cache dtype", vllm.reshape_and_cache_flash, _flash_args,
     lambda: dict(kv_cache_dtype="fp8_e5m2", key_cache=torch.zeros(2, 8, 2, 64, dtype=torch.float8_e4m3fn)),
     TypeError, "key_cache: an fp8 e5m2 cache must be uint8 or float8_e5m2"),
    ("nvfp4", vllm.reshape_and_cache_flash, _flash_args, lambda: dict(kv_cache_dtype="nvfp4"),
     ValueError, "kv_cache_dtype: expected one of"),
    ("three scales for two heads", vllm.reshape_and_cache_flash, _flash_args, lambda: dict(k_scale=torch.ones(3)),
     ValueError, "k_scale: expected one value or one per head (2), got 3"),
    ("k_scale per head, v_scale per tensor", vllm.reshape_and_cache_flash, _flash_args,
     lambda: dict(k_scale=torch.ones(2)), ValueError, "v_scale: expected k_scale's shape (2,), got ()"),
    ("fp64 scale", vllm.reshape_and_cache_flash, _flash_args, lambda: dict(v_scale=torch.tensor(1.0, dtype=torch.float64)),
     TypeError, "v_scale: expected dtype torch.float32"),
    ("long slot mapping", vllm.reshape_and_cache_flash, _flash_args, lambda: dict(slot_mapping=torch.arange(4)),
     ValueError, "slot_mapping: 4 slots for 3 tokens"),
    ("auto with fp8 cache", vllm.reshape_and_cache_flash, _flash_args, lambda: dict(kv_cache_dtype="auto"),
     TypeError, "key_cache: kv_cache_dtype 'auto' stores the input's dtype"),
    ("cache heads (kvfuse's check, vLLM's name)", vllm.reshape_and_cache_flash, _flash_args,
     lambda: dict(key_cache=torch.full((2, 8, 4, 64), POISON, dtype=torch.uint8)), ValueError, "key_cache: expected"),
    ("fp16 cache for fp8", vllm.reshape_and_cache_flash, _flash_args,
     lambda: dict(value_cache=torch.zeros(2, 8, 2, 64, dtype=torch.half)), TypeError, "value_cache: an fp8 e4m3 cache"),
    ("indexer fp32 scales", vllm.indexer_k_quant_and_cache, _index_args, lambda: dict(scale_fmt=None),
     ValueError, "scale_fmt None is not supported yet"),
    ("indexer quant block 64", vllm.indexer_k_quant_and_cache, _index_args, lambda: dict(quant_block_size=64),
     ValueError, "quant_block_size 64 is not supported yet"),
    ("indexer head 256", vllm.indexer_k_quant_and_cache, _index_args,
     lambda: dict(k=torch.zeros(3, 256, dtype=torch.bfloat16)), ValueError, "k: head_dim 256 is not supported yet"),
    ("indexer fp16 k", vllm.indexer_k_quant_and_cache, _index_args,
     lambda: dict(k=torch.zeros(3, 128, dtype=torch.half)), TypeError, "k: dtype torch.float16 is not supported yet"),
    ("indexer bf16 cache", vllm.indexer_k_quant_and_cache, _index_args,
     lambda: dict(kv_cache=torch.zeros(2, 16, 66, dtype=torch.bfloat16)), TypeError, "kv_cache: expected a uint8 cache"),
    ("indexer short slots", vllm.indexer_k_quant_and_cache, _index_args,
     lambda: dict(slot_mapping=torch.tensor([1, 2])), ValueError, "slot_mapping: 2 slots for 3 tokens"),
    ("ds_mla rank 256", vllm.concat_and_cache_mla, _mla_args, lambda: dict(kv_c=torch.zeros(3, 256, dtype=torch.bfloat16)),
     ValueError, "kv_c, k_pe: fp8_ds_mla needs kv_lora_rank 512"),
    ("ds_mla record size (kvfuse's check, vLLM's name)", vllm.concat_and_cache_mla, _mla_args,
     lambda: dict(kv_cache=torch.full((2, 16, 576), POISON, dtype=torch.uint8)), ValueError, "kv_cache: "),
    ("mla fp16 kv_c", vllm.concat_and_cache_mla, _mla_args, lambda: dict(kv_c=torch.zeros(3, 512, dtype=torch.half)),
     TypeError, "kv_c: dtype torch.float16 is not supported yet"),
    ("mla fp8 per-head scale", vllm.concat_and_cache_mla, _mla_args,
     lambda: dict(kv_cache_dtype="fp8", kv_cache=torch.full((2, 16, 576), POISON, dtype=torch.uint8),
                  scale=torch.ones(2)), ValueError, "scale: 2 scales"),
    ("mla pe 36", vllm.concat_and_cache_mla, _mla_args,
     lambda: dict(kv_cache_dtype="auto", k_pe=torch.zeros(3, 36, dtype=torch.bfloat16),
                  kv_cache=torch.zeros(2, 16, 548, dtype=torch.bfloat16)), ValueError, "k_pe: head size 36 is not supported yet"),
    ("mla k_pe dtype", vllm.concat_and_cache_mla, _mla_args,
     lambda: dict(kv_cache_dtype="auto", k_pe=torch.zeros(3, 64, dtype=torch.half),
                  kv_cache=torch.zeros(2, 16, 576, dtype=torch.bfloat16)), TypeError, "k_pe: expected kv_c's dtype"),
    ("qk fp32 qkv", vllm.fused_qk_norm_rope, _qk_args, lambda: dict(qkv=torch.zeros(3, 6 * 64)), TypeError,
     "qkv: dtype torch.float32 is not supported yet"),
    ("qk columns", vllm.fused_qk_norm_rope, _qk_args, lambda: dict(num_heads_v=2), ValueError,
     "qkv: expected 448 columns"),
    ("qk weight dtype", vllm.fused_qk_norm_rope, _qk_args, lambda: dict(k_weight=torch.ones(64)), TypeError,
     "k_weight: expected qkv's dtype torch.bfloat16, got torch.float32"),
    ("qk weight shape (kvfuse's check, vLLM's name)", vllm.fused_qk_norm_rope, _qk_args,
     lambda: dict(q_weight=torch.ones(32, dtype=torch.bfloat16)), ValueError, "q_weight: expected shape (64,)"),
    ("qk eps", vllm.fused_qk_norm_rope, _qk_args, lambda: dict(eps=0.0), ValueError, "eps must be a finite number > 0"),
    ("qk rotary odd", vllm.fused_qk_norm_rope, _qk_args, lambda: dict(cos_sin_cache=torch.zeros(16, 7)), ValueError,
     "cos_sin_cache: its rotary_dim (size(1)) must be even and in (0, head_dim=64], got 7"),
    ("qk rotary wide", vllm.fused_qk_norm_rope, _qk_args, lambda: dict(cos_sin_cache=torch.zeros(16, 80)),
     ValueError, "cos_sin_cache: its rotary_dim (size(1)) must be even and in (0, head_dim=64], got 80"),
    ("qk positions int32", vllm.fused_qk_norm_rope, _qk_args,
     lambda: dict(position_ids=torch.arange(3, dtype=torch.int32)), TypeError, "position_ids: expected dtype torch.int64"),
    ("qk positions count", vllm.fused_qk_norm_rope, _qk_args, lambda: dict(position_ids=torch.arange(2)), ValueError,
     "position_ids: expected shape (3,)"),
    ("qk head_dim 12", vllm.fused_qk_norm_rope, _qk_args,
     lambda: dict(head_dim=12, qkv=torch.zeros(3, 6 * 12, dtype=torch.bfloat16), q_weight=torch.ones(12, dtype=torch.bfloat16)),
     ValueError, "head_dim: head size 12 is not supported yet"),
    ("qk gqa ratio", vllm.fused_qk_norm_rope, _qk_args, lambda: dict(num_heads_q=3, num_heads_k=2, num_heads_v=1),
     ValueError, "qkv: num_heads 3 must be a multiple of k's num_heads 2"),
    ("qk is_neox", vllm.fused_qk_norm_rope, _qk_args, lambda: dict(is_neox=1), TypeError, "is_neox must be a bool"),
    ("mla auto cache width", vllm.concat_and_cache_mla, _mla_args,
     lambda: dict(kv_cache_dtype="auto", kv_cache=torch.zeros(2, 16, 512, dtype=torch.bfloat16)),
     ValueError, "kv_cache: expected [num_blocks, block_size, 576]"),
]


@pytest.mark.parametrize("label,fn,args,change,exc,match", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors_name_the_argument_and_write_nothing(label, fn, args, change, exc, match):
    kw = args(**change())
    caches = [v for k, v in kw.items() if ("cache" in k or k == "qkv") and isinstance(v, torch.Tensor)]
    before = [c.clone() for c in caches]
    with kvfuse.use_backend("reference"), pytest.raises(exc) as info:
        fn(**kw)
    assert str(info.value).startswith(match), str(info.value)
    for c, b in zip(caches, before):
        assert torch.equal(c, b)


def test_compile_fullgraph():
    """Under torch.compile(fullgraph=True) the adapters trace (kvfuse routes through its custom ops)."""
    key, value = random_bf16((5, 2, 64), seed=8), random_bf16((5, 2, 64), seed=9)
    kv_c, k_pe = random_bf16((5, 512), seed=10), random_bf16((5, 64), seed=11)
    k = random_bf16((5, 128), seed=12)
    slots = torch.tensor([4, -1, 17, 30, 2])

    def step(flash, mla, index):
        vllm.reshape_and_cache_flash(key, value, flash[:, 0], flash[:, 1], slots, "fp8", torch.tensor(0.05),
                                     torch.tensor(0.1))
        vllm.concat_and_cache_mla(kv_c, k_pe, mla, slots, "fp8_ds_mla", torch.tensor(1.0))
        vllm.indexer_k_quant_and_cache(k, index, slots, 128, "ue8m0")
        return flash.sum() + mla.sum() + index.sum()

    def fresh():
        return (_poisoned(4 * 2 * 8 * 2 * 64).view(4, 2, 8, 2, 64), _poisoned(4 * 16 * 656).view(4, 16, 656),
                _poisoned(4 * 16 * 132).view(4, 16, 132))

    assert_compiled_matches_eager(step, fresh)


def test_compile_fullgraph_fused_qk_norm_rope():
    """fused_qk_norm_rope in place on the packed qkv under torch.compile(fullgraph=True): q and k are both
    the op's inputs and (q_out, k_out) its mutated outputs, views of the one buffer."""
    w = torch.full((64,), 1.125, dtype=torch.bfloat16)
    cs = torch.randn(16, 64, generator=torch.Generator().manual_seed(2))
    pos = torch.tensor([1, 5, 9])

    def step(qkv):
        vllm.fused_qk_norm_rope(qkv, 4, 1, 1, 64, 1e-6, w, w, cs, True, pos)
        return qkv.float().sum()

    assert_compiled_matches_eager(step, lambda: (random_bf16((3, 6 * 64), seed=3),))
