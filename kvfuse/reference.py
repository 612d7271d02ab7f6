"""The unfused PyTorch pipeline that defines kvfuse's numerics (SPEC §2), one function per stage.

Every stage reads bf16 and returns bf16 (round to nearest even), doing its arithmetic in IEEE
fp32 with each operation rounded on its own; torch ops are chosen so that this holds on the CPU
and on CUDA (divisions by a tensor, never by a Python scalar; sqrt in float64). This module is
the "reference" backend: it runs on CPU and CUDA tensors and the Triton kernel must equal it
byte for byte.
"""
from __future__ import annotations

from typing import Optional

import torch

from .formats import FMAX, KVCacheFormat, scale_floor_exponent
from .plan import CastSpec, Plan, q_dtype, sf_dtype

F32 = torch.float32
AMAX_MARGIN = 1e-4
E4M3_SF_MIN = 2.0 ** -9
# e2m1 magnitudes of codes 0..7
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _f32(v, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(v, dtype=F32, device=like.device)


# --------------------------------------------------------------------------- narrowing helpers
def round_to_bf16(v: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16, round to nearest even (torch's cast is exact RTNE on CPU and CUDA)."""
    return v.to(torch.bfloat16)


def encode_e4m3(t: torch.Tensor) -> torch.Tensor:
    """fp32 with |t| <= 448 -> e4m3fn bytes (uint8), round to nearest even, sign kept
    (a negative value that rounds to zero gives 0x80). Integer arithmetic on the bit pattern."""
    u = t.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    sign = (u >> 24) & 0x80
    ax = t.abs()
    au = ax.view(torch.int32).to(torch.int64)
    normal = ((au + 0x7FFFF + ((au >> 20) & 1)) >> 20) - 960      # rebias 127 -> 7, keep 3 mantissa bits
    subnormal = torch.round(ax * 512.0).to(torch.int64)              # multiples of 2^-9; round() is half-even
    code = torch.where(ax < 2.0 ** -6, subnormal, normal)
    code = torch.where(torch.isnan(t), torch.full_like(code, 0x7F), code)
    return (code | sign).to(torch.uint8)


def decode_e4m3(b: torch.Tensor) -> torch.Tensor:
    """e4m3fn bytes (uint8 or float8_e4m3fn) -> fp32 (exact)."""
    return b.view(torch.float8_e4m3fn).to(F32)


def encode_e2m1(t: torch.Tensor) -> torch.Tensor:
    """fp32 with |t| <= 6 -> e2m1 codes 0..15 (uint8, one per element), round to nearest even:
    the thresholds are the midpoints, ties (0.25, 1.25, 2.5, 5 strictly; 0.75, 1.75, 3.5 inclusive)
    go to the even code. Sign in bit 3, kept for values that round to zero."""
    a = t.abs()
    code = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5) + (a > 5.0))
    sign = (t.contiguous().view(torch.int32) < 0).to(torch.uint8) << 3
    return code.to(torch.uint8) | sign


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes 0..15 (uint8, one per element) -> fp32."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=F32, device=codes.device)
    return table[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[..., 2k] codes -> [..., k] bytes, the even element in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    lo = packed & 0xF
    hi = packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


# --------------------------------------------------------------------------- stages
def pairwise_sum(p: torch.Tensor) -> torch.Tensor:
    """The adjacent-pairs tree over the last dim (zero-padded to a power of two)."""
    d = p.shape[-1]
    width = 1 << max(d - 1, 0).bit_length()
    if width != d:
        p = torch.cat([p, p.new_zeros(p.shape[:-1] + (width - d,))], dim=-1)
    while p.shape[-1] > 1:
        p = p[..., 0::2] + p[..., 1::2]
    return p[..., 0]


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """bf16 [..., D] -> bf16: y = bf16((f(x) * rstd) * f(w)), rstd = 1 / sqrt(tree(x^2) / D + eps)."""
    xf = x.to(F32)
    ss = pairwise_sum(xf * xf)
    mean = torch.div(ss, _f32(x.shape[-1], x))
    den = torch.sqrt((mean + _f32(eps, x)).to(torch.float64)).to(F32)   # correctly rounded fp32 sqrt
    rstd = torch.div(torch.ones_like(den), den)
    return round_to_bf16((xf * rstd[..., None]) * weight.to(F32))


def layernorm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
              eps: float = 1e-6) -> torch.Tensor:
    """bf16 [..., D] -> bf16: d = f(x) - tree(x) / D, rstd = 1 / sqrt(tree(d^2) / D + eps),
    y = bf16(((d * rstd) * f(w)) + f(b)) (no ``+ f(b)`` without a bias). SPEC §2 "LayerNorm"."""
    xf = x.to(F32)
    dim = _f32(x.shape[-1], x)
    mean = torch.div(pairwise_sum(xf), dim)
    d = xf - mean[..., None]
    var = torch.div(pairwise_sum(d * d), dim)
    den = torch.sqrt((var + _f32(eps, x)).to(torch.float64)).to(F32)    # correctly rounded fp32 sqrt
    rstd = torch.div(torch.ones_like(den), den)
    y = (d * rstd[..., None]) * weight.to(F32)
    if bias is not None:
        y = y + bias.to(F32)
    return round_to_bf16(y)


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, kind: str = "rms",
         bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The norm stage: :func:`rmsnorm` (kind "rms") or :func:`layernorm` (kind "layer")."""
    if kind == "layer":
        return layernorm(x, weight, bias, eps)
    return rmsnorm(x, weight, eps)


def rope(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, rotary_dim: int,
         is_neox: bool, offset: Optional[int] = None, conjugate: bool = False) -> torch.Tensor:
    """bf16 [n, D] or [n, H, D] -> bf16; rotates pairs of dims in [offset, offset + rotary_dim).
    A position outside [0, max_position) leaves the token unchanged."""
    x3 = x.unsqueeze(1) if x.dim() == 2 else x
    if cos_sin_cache.shape[0] == 0:
        return x.clone()  # no position is in range: identity
    d = x3.shape[-1]
    off = d - rotary_dim if offset is None else offset
    half = rotary_dim // 2
    j = torch.arange(half, device=x.device)
    i0 = off + (j if is_neox else 2 * j)
    i1 = off + (j + half if is_neox else 2 * j + 1)
    pos = positions.long()
    ok = (pos >= 0) & (pos < cos_sin_cache.shape[0])
    row = cos_sin_cache[torch.where(ok, pos, torch.zeros_like(pos))].to(F32)      # [n, rotary_dim]
    c, s = row[:, None, :half], row[:, None, half:]
    a, b = x3[..., i0].to(F32), x3[..., i1].to(F32)
    if conjugate:
        y0, y1 = (a * c) + (b * s), (b * c) - (a * s)
    else:
        y0, y1 = (a * c) - (b * s), (a * s) + (b * c)
    keep = ~ok[:, None, None]
    y = x3.clone()
    y[..., i0] = torch.where(keep, x3[..., i0], round_to_bf16(y0))
    y[..., i1] = torch.where(keep, x3[..., i1], round_to_bf16(y1))
    return y.view(x.shape)


def hadamard(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """bf16 [..., D] (D a power of two) -> bf16: butterflies at distance 1, 2, 4, ... then * scale."""
    d = x.shape[-1]
    h = x.to(F32)
    dist = 1
    while dist < d:
        v = h.reshape(h.shape[:-1] + (d // (2 * dist), 2, dist))
        a, b = v[..., 0, :], v[..., 1, :]
        h = torch.stack((a + b, a - b), dim=-2).reshape(h.shape)
        dist *= 2
    return round_to_bf16(h * _f32(scale, x))


def group_scales(amax: torch.Tensor, cast_fmt: str, sf_format: str, floor_exp: Optional[int] = None):
    """amax [...] fp32 (already floored at AMAX_MARGIN) -> (stored scale tensor, multiplier m,
    dequant scale d), SPEC §2. floor_exp: ceil(log2(scale_floor)) of a power-of-two format's
    scale_floor (the exponent is at least that), or None."""
    fmax = _f32(FMAX[cast_fmt], amax)
    if sf_format in ("ue8m0", "ue8m0_fp32"):
        s = torch.div(amax, fmax)
        e = ((s.view(torch.int32) - 1) >> 23) + 1 - 127                    # ceil(log2 s)
        if floor_exp is not None:
            e = torch.clamp(e, min=floor_exp)
        # m = 2^-e; e reaches 127..128 only for a non-finite or near-max amax: subnormal 2^-127, 2^-128
        m = torch.where(e >= 127, 0x400000 >> (e - 127).clamp(0, 31), (127 - e) << 23).view(F32)
        d = ((e + 127) << 23).view(F32)
        stored = (e + 127).to(torch.uint8) if sf_format == "ue8m0" else d
        return stored, m, d
    if sf_format == "e4m3":
        s = torch.clamp(torch.div(amax, fmax), min=E4M3_SF_MIN, max=448.0)
        code = encode_e4m3(s)
        d = decode_e4m3(code)
        return code.view(torch.float8_e4m3fn), torch.div(torch.ones_like(d), d), d
    if sf_format == "fp32":
        s = torch.div(amax, fmax)
        return s, torch.div(fmax.expand_as(amax), amax), s
    raise ValueError(f"unknown sf_format {sf_format!r}")


def quantize(x: torch.Tensor, cast_fmt: str, num_per_channels: int, sf_format: str,
             scale_floor: Optional[float] = None):
    """bf16 [..., D] -> (q, sf): q float8_e4m3fn [..., D] or uint8 [..., D/2] (e2m1 packed);
    sf [..., D/g] uint8 (ue8m0) / float8_e4m3fn (e4m3) / float32 (fp32, ue8m0_fp32). scale_floor
    (ue8m0 kinds): the scale is 2^ceil(log2(max(amax / fmax, scale_floor))) (SPEC §2)."""
    d = x.shape[-1]
    g = num_per_channels
    v = x.to(F32).reshape(x.shape[:-1] + (d // g, g))
    amax = torch.maximum(v.abs().amax(dim=-1), _f32(AMAX_MARGIN, x))
    floor_exp = None if scale_floor is None else scale_floor_exponent(scale_floor, "scale_floor")
    stored, m, _ = group_scales(amax, cast_fmt, sf_format, floor_exp)
    fmax = FMAX[cast_fmt]
    t = torch.clamp(v * m[..., None], -fmax, fmax).reshape(x.shape)
    if cast_fmt == "e4m3":
        q = encode_e4m3(t).view(torch.float8_e4m3fn)
    else:
        q = pack_e2m1(encode_e2m1(t))
    return q, stored


# the bf16 NaN the read side writes for every NaN it decodes (torch's canonical bf16 NaN)
CANONICAL_NAN_BF16 = 0x7FC0


def dequant_scale(sf: torch.Tensor, sf_format: str, ue8m0_nan: bool = False) -> torch.Tensor:
    """Stored scales -> the fp32 dequant multiplier d. ``ue8m0_nan`` (the read side, SPEC §4): a
    ue8m0 byte 0xFF is NaN (OCP MX, torch's float8_e8m0fnu) rather than 2^128 = inf. e4m3 scale
    bytes 0x7F / 0xFF and fp32 NaN patterns decode as NaN either way."""
    if sf_format == "ue8m0":
        e = sf.view(torch.uint8).to(torch.int32)
        # byte 0 is 2^-127, an fp32 subnormal (quantize never writes it; stored bytes may hold it)
        d = torch.where(e == 0, 0x400000, e << 23).view(F32)
        if ue8m0_nan:
            d = torch.where(e == 0xFF, torch.full_like(d, float("nan")), d)
        return d
    if sf_format == "e4m3":
        return decode_e4m3(sf)
    return sf.view(F32)


def dequantize(q: torch.Tensor, sf: torch.Tensor, cast_fmt: str, num_per_channels: int,
               sf_format: str, ue8m0_nan: bool = False) -> torch.Tensor:
    """(q, sf) of :func:`quantize` -> bf16 [..., D]: bf16(f(q_i) * d_group). ``ue8m0_nan``: see
    :func:`dequant_scale` (the cast_back stage keeps d = 2^e, SPEC §2; the read side sets it)."""
    if cast_fmt == "e4m3":
        qf = decode_e4m3(q)
    else:
        qf = decode_e2m1(unpack_e2m1(q.view(torch.uint8)))
    d = qf.shape[-1]
    g = num_per_channels
    scale = dequant_scale(sf, sf_format, ue8m0_nan)
    y = qf.reshape(qf.shape[:-1] + (d // g, g)) * scale[..., None]
    return round_to_bf16(y.reshape(qf.shape))


def canonical_nan(y: torch.Tensor) -> torch.Tensor:
    """bf16 y with every NaN replaced by CANONICAL_NAN_BF16 (NaN payloads and signs from the CPU's
    or GPU's arithmetic differ; the read side's bytes do not)."""
    nan = torch.tensor(CANONICAL_NAN_BF16, dtype=torch.int16, device=y.device).view(torch.bfloat16)
    return torch.where(torch.isnan(y), nan, y)


# --------------------------------------------------------------------------- paged cache
def _storage_bytes(kv_cache: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of the cache's whole storage (addresses are storage offsets)."""
    return kv_cache.as_strided((kv_cache.untyped_storage().nbytes(),), (1,), 0)


def record_addresses(kv_cache: torch.Tensor, fmt: KVCacheFormat, slot_mapping: torch.Tensor):
    """-> (valid [n] bool, data_base [n, H], sf_base [n, H], tail_base [n, H]) storage byte offsets."""
    nb, bs, nh, _ = kv_cache.shape
    a = fmt.addressing_for(kv_cache)
    slots = slot_mapping.long()
    valid = (slots >= 0) & (slots < nb * bs)
    s = torch.where(valid, slots, torch.zeros_like(slots))
    blk, off = s // bs, s % bs
    head = torch.arange(nh, device=kv_cache.device) * a.head_stride
    base = kv_cache.storage_offset() + blk * kv_cache.stride(0)
    data = (base + off * a.data_token_stride)[:, None] + head
    sf = (base + off * a.sf_token_stride)[:, None] + head
    return valid, data + a.data_offset, sf + a.sf_offset, data + a.tail_offset


def store(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, fmt: KVCacheFormat, data: torch.Tensor,
          sf: Optional[torch.Tensor] = None, tail: Optional[torch.Tensor] = None) -> None:
    """Write records: data [n, H, quant_bytes] (bf16 cache: bf16 [n, H, D]), sf [n, H, num_scales]
    (sf dtype of the format), tail bf16 [n, H, bf16_tail]. Invalid slots write nothing; only the
    record's data, exact scale and tail bytes are touched."""
    flat = _storage_bytes(kv_cache)
    valid, dbase, sbase, tbase = record_addresses(kv_cache, fmt, slot_mapping)
    parts = [(dbase, data.contiguous().view(torch.uint8))]
    if fmt.quantized:
        parts.append((sbase, sf.contiguous().view(torch.uint8)))
    if fmt.bf16_tail:
        parts.append((tbase, tail.contiguous().view(torch.uint8)))
    for base, payload in parts:
        idx = base[valid][..., None] + torch.arange(payload.shape[-1], device=base.device)
        flat[idx] = payload[valid]


def load(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, fmt: KVCacheFormat, dequantize_: bool = True):
    """Gather the records of the given slots. dequantize_: bf16 [n, H, head_dim] (zeros for invalid
    slots); else the raw bytes (data [n, H, data_bytes] = quantized then tail, sf [n, H, sf_bytes]),
    zeros for invalid slots."""
    flat = _storage_bytes(kv_cache)
    valid, dbase, sbase, tbase = record_addresses(kv_cache, fmt, slot_mapping)
    vmask = valid[:, None, None]

    def gather(base, count):
        idx = base[..., None] + torch.arange(count, device=base.device)
        return torch.where(vmask, flat[torch.where(vmask, idx, torch.zeros_like(idx))], 0).to(torch.uint8)

    qb = gather(dbase, fmt.quant_bytes)
    tb = gather(tbase, 2 * fmt.bf16_tail)
    sb = gather(sbase, fmt.sf_bytes)
    if not dequantize_:
        return torch.cat([qb, tb], dim=-1), sb
    if not fmt.quantized:
        return qb.view(torch.bfloat16)
    sf = sb[..., : fmt.sf_exact_bytes].contiguous().view(sf_dtype(fmt.sf_format))
    q = qb.view(q_dtype(fmt.cast_fmt)) if fmt.cast_fmt == "e4m3" else qb
    # NaN codes decode as NaN (SPEC §4): ue8m0 scale 0xFF, e4m3 0x7F / 0xFF (values and scales), fp32
    # NaN scales; each NaN is written as the canonical bf16 NaN. The raw bf16 tail keeps its bits.
    y = canonical_nan(dequantize(q, sf, fmt.cast_fmt, fmt.elements_per_sf, fmt.sf_format, ue8m0_nan=True))
    if fmt.bf16_tail:
        y = torch.cat([y, tb.view(torch.bfloat16)], dim=-1)
    return y


# --------------------------------------------------------------------------- the chain
def transform(x, weight=None, eps=1e-6, positions=None, cos_sin=None, rotary_dim=0, rope_offset=None,
              is_neox=True, conjugate=False, hadamard_scale=None, norm_kind="rms", bias=None):
    """norm -> rope -> hadamard on bf16 [n, H, D]; returns (after_norm or None, transform output)."""
    y = x
    normed = None
    if weight is not None:
        y = normed = norm(y, weight, eps, norm_kind, bias)
    if positions is not None:
        y = rope(y, positions, cos_sin, rotary_dim, is_neox, rope_offset, conjugate)
    if hadamard_scale is not None:
        y = hadamard(y, hadamard_scale)
    return normed, y


def run_plan(plan: Plan) -> None:
    """Execute a validated plan with the unfused chain (the "reference" backend)."""
    if plan.n == 0:
        return
    normed, y = transform(plan.x, plan.weight, plan.eps, plan.positions, plan.cos_sin, plan.rotary_dim,
                          plan.rope_offset, plan.is_neox, plan.conjugate, plan.hadamard_scale, plan.norm_kind,
                          plan.bias)
    stages = {"norm": normed, "transform": y}
    cast: Optional[CastSpec] = plan.cast
    q = sf = None
    if cast is not None:
        dq = plan.quant_dim
        floor = None if cast.floor_exp is None else 2.0 ** cast.floor_exp
        q, sf = quantize(y[..., :dq], cast.cast_fmt, cast.group, cast.sf_format, floor)
        if plan.out_stage == "cast_back":
            back = dequantize(q, sf, cast.cast_fmt, cast.group, cast.sf_format)
            stages["cast_back"] = torch.cat([back, y[..., dq:]], dim=-1)
    if plan.kv_cache is not None:
        if cast is None:
            store(plan.kv_cache, plan.slot_mapping, plan.fmt, y)
        else:
            store(plan.kv_cache, plan.slot_mapping, plan.fmt, q, sf, y[..., plan.quant_dim:])
    elif plan.q_out is not None:
        plan.q_out.copy_(q)
        plan.sf_out.copy_(sf)
    if plan.out is not None:
        plan.out.copy_(stages[plan.out_stage])


# --------------------------------------------------------------------------- GQA / MHA K and V (SPEC §11)
GQA_LAYOUTS = ("NHD", "HND")


def quantize_per_tensor(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """bf16 [...] -> e4m3 codes (uint8) with one fp32 scale for the whole tensor:
    e4m3(clamp(f(x) / f(scale), -448, 448)), a correctly rounded division (by a tensor, also on CUDA),
    round to nearest even. ``scale``: fp32 with one element."""
    t = torch.div(x.to(F32), scale.reshape(()).to(F32))
    return encode_e4m3(torch.clamp(t, -FMAX["e4m3"], FMAX["e4m3"]))


def store_paged(cache: torch.Tensor, slot_mapping: torch.Tensor, data: torch.Tensor, layout: str) -> None:
    """Scatter rows into a paged cache of vLLM's layout ``"NHD"`` [num_blocks, block_size, H, D] or
    FlashInfer's ``"HND"`` [num_blocks, H, block_size, D] (any strides): ``data`` [n, H, D] holds
    the elements' bytes (int16 bf16 bits or uint8 e4m3 codes, the element size of the cache). Slot s
    writes (s // block_size, s % block_size); a slot outside [0, num_blocks * block_size) writes
    nothing."""
    nb = cache.shape[0]
    bs = cache.shape[1] if layout == "NHD" else cache.shape[2]
    slots = slot_mapping.long()
    valid = (slots >= 0) & (slots < nb * bs)
    s = slots[valid]
    blk, off = s // bs, s % bs
    elems = cache.view(data.dtype)                         # same element size: bytes, not values
    if layout == "NHD":
        elems[blk, off] = data[valid]
    else:
        elems[blk, :, off] = data[valid]                   # advanced indices around a slice: [m, H, D]


def qk_norm_rope(x: torch.Tensor, weight=None, eps: float = 1e-6, positions=None, cos_sin=None, rotary_dim: int = 0,
                 rope_offset: int = 0, is_neox: bool = True, conjugate: bool = False) -> torch.Tensor:
    """The Q / K transform of SPEC §11 on bf16 [n, H, D]: per-head :func:`rmsnorm` (weight [D] shared by
    the heads; skipped when ``weight`` is None), then :func:`rope` (skipped when ``positions`` is None)."""
    y = x if weight is None else rmsnorm(x, weight, eps)
    if positions is not None:
        y = rope(y, positions, cos_sin, rotary_dim, is_neox, rope_offset, conjugate)
    return y


def qk_norm_rope_store_kv(q, k, v, k_cache, v_cache, slot_mapping, q_out, q_weight=None, q_eps=1e-6, k_weight=None,
                          k_eps=1e-6, positions=None, cos_sin=None, rotary_dim=0, rope_offset=0, is_neox=True,
                          conjugate=False, k_scale=None, v_scale=None, layout="NHD") -> None:
    """The unfused chain of :func:`kvfuse.fused_qk_norm_rope_store_kv` (validated arguments): q -> norm ->
    RoPE -> q_out (bf16); k -> norm -> RoPE -> (e4m3 by k_scale) -> k_cache; v -> (e4m3 by v_scale) ->
    v_cache. fp8 caches when the scales are given, else bf16 caches."""
    qy = qk_norm_rope(q, q_weight, q_eps, positions, cos_sin, rotary_dim, rope_offset, is_neox, conjugate)
    ky = qk_norm_rope(k, k_weight, k_eps, positions, cos_sin, rotary_dim, rope_offset, is_neox, conjugate)
    if k_scale is None:
        kb, vb = ky.view(torch.int16), v.view(torch.int16)
    else:
        kb, vb = quantize_per_tensor(ky, k_scale), quantize_per_tensor(v, v_scale)
    store_paged(k_cache, slot_mapping, kb, layout)
    store_paged(v_cache, slot_mapping, vb, layout)
    q_out.copy_(qy)


def run_gqa_plan(plan) -> None:
    """Execute a validated :class:`kvfuse.gqa.GQAPlan` with the unfused chain (the "reference" backend)."""
    if plan.n == 0:
        return
    qk_norm_rope_store_kv(plan.q, plan.k, plan.v, plan.k_cache, plan.v_cache, plan.slot_mapping, plan.q_out,
                          plan.q_weight, plan.q_eps, plan.k_weight, plan.k_eps, plan.positions, plan.cos_sin,
                          plan.rotary_dim, plan.rope_offset, plan.is_neox, plan.conjugate, plan.k_scale,
                          plan.v_scale, plan.layout)
