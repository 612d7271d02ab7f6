"""One function per stage of the chain (SPEC §6): the norms (RMSNorm, LayerNorm) with their adjacent-pairs
sums, RoPE, the Hadamard transform, per-group quantization and its inverse, and the per-tensor cast of
the GQA caches (SPEC §3). Each reads bf16 and returns bf16, rounding every fp32 operation on its own."""
from __future__ import annotations

from typing import Optional

import torch

from ..formats import FMAX, SCALE_FORMATS, scale_floor_exponent
from .numerics import (AMAX_MARGIN, E4M3_SF_MIN, F32, _f32, decode_e2m1, decode_e4m3, encode_e2m1, encode_e4m3,
                       encode_e5m2, pack_e2m1, round_to_bf16, unpack_e2m1)


def pairwise_sum(p: torch.Tensor) -> torch.Tensor:
    """The adjacent-pairs tree over the last dim (zero-padded to a power of two)."""
    d = p.shape[-1]
    width = 1 << max(d - 1, 0).bit_length()
    if width != d:
        p = torch.cat([p, p.new_zeros(p.shape[:-1] + (width - d,))], dim=-1)
    while p.shape[-1] > 1:
        p = p[..., 0::2] + p[..., 1::2]
    return p[..., 0]


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
            out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """bf16 [..., D] -> bf16: y = bf16((f(x) * rstd) * f(w)), rstd = 1 / sqrt(tree(x^2) / D + eps).
    x may be fp16 / fp32 too; ``out_dtype`` is the rounding of y (torch.float32: none, the fused profiles)."""
    xf = x.to(F32)
    ss = pairwise_sum(xf * xf)
    mean = torch.div(ss, _f32(x.shape[-1], x))
    den = torch.sqrt((mean + _f32(eps, x)).to(torch.float64)).to(F32)   # correctly rounded fp32 sqrt
    rstd = torch.div(torch.ones_like(den), den)
    return ((xf * rstd[..., None]) * weight.to(F32)).to(out_dtype)


def layernorm(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
              eps: float = 1e-6) -> torch.Tensor:
    """bf16 [..., D] -> bf16: d = f(x) - tree(x) / D, rstd = 1 / sqrt(tree(d^2) / D + eps),
    y = bf16(((d * rstd) * f(w)) + f(b)) (no ``+ f(b)`` without a bias). SPEC §6 "LayerNorm"."""
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
    """The norm stage: :func:`rmsnorm` (kind "rms") or :func:`layernorm` (kind "layer") over the first
    k = weight.shape[0] dims of x [..., D]; the other dims keep their bits (a norm over the leading
    dims, SPEC §6: its sums are the head's tree with the dims >= k as zeros, divided by k)."""
    k, D = weight.shape[-1], x.shape[-1]
    if k < D:
        return torch.cat([_leading_norm(x, weight, eps, kind, bias), x[..., k:]], dim=-1)
    if kind == "layer":
        return layernorm(x, weight, bias, eps)
    return rmsnorm(x, weight, eps)


def _leading_norm(x, weight, eps, kind, bias):
    """The normalized first k dims of x [..., D] (k = weight.shape[0] < D): SPEC §6's sums over the
    head's tree (width next_pow2(D)) with the dims >= k as zeros, the means divided by k."""
    k = weight.shape[-1]
    xf = x.to(F32)
    keep = torch.arange(x.shape[-1], device=x.device) < k
    zero = xf.new_zeros(())
    dim = _f32(k, x)
    if kind == "layer":
        mean = torch.div(pairwise_sum(torch.where(keep, xf, zero)), dim)
        d = xf[..., :k] - mean[..., None]
        sq = torch.where(keep, torch.cat([d, xf[..., k:]], dim=-1), zero)
        var = torch.div(pairwise_sum(sq * sq), dim)
    else:
        d = xf[..., :k]
        var = torch.div(pairwise_sum(torch.where(keep, xf * xf, zero)), dim)
    den = torch.sqrt((var + _f32(eps, x)).to(torch.float64)).to(F32)   # correctly rounded fp32 sqrt
    rstd = torch.div(torch.ones_like(den), den)
    y = (d * rstd[..., None]) * weight.to(F32)
    if kind == "layer" and bias is not None:
        y = y + bias.to(F32)
    return round_to_bf16(y)


def mrope_position_rows(half: int, mrope_section, interleaved: bool) -> torch.Tensor:
    """int64 [half]: the row of mRoPE's positions [3, n] (0 temporal, 1 height, 2 width) each frequency j
    takes (SPEC §3): chunked, j < t -> 0, j < t + h -> 1, else 2; interleaved, 1 where j % 3 == 1 and
    j < 3h, 2 where j % 3 == 2 and j < 3w, else 0."""
    t, h, w = mrope_section
    j = torch.arange(half)
    if interleaved:
        return torch.where((j % 3 == 1) & (j < 3 * h), 1, torch.where((j % 3 == 2) & (j < 3 * w), 2, 0))
    return (j >= t).long() + (j >= t + h).long()


def _cos_sin_rows(positions, cos_sin_cache, half, mrope_section, interleaved):
    """(ok, cos, sin) [n, half] of each token's pairs: the table row of its position (of the pair's
    position row under mRoPE), ok where that position is in [0, max_position)."""
    pos = positions.long()
    if mrope_section is None:
        pos = pos[:, None].expand(-1, half)
    else:
        pos = pos[mrope_position_rows(half, mrope_section, interleaved).to(pos.device)].t()
    ok = (pos >= 0) & (pos < cos_sin_cache.shape[0])
    j = torch.arange(half, device=pos.device)
    p = torch.where(ok, pos, torch.zeros_like(pos))
    return ok, cos_sin_cache[p, j].to(F32), cos_sin_cache[p, half + j].to(F32)


def rope(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, rotary_dim: int,
         is_neox: bool, offset: Optional[int] = None, conjugate: bool = False, mrope_section=None,
         mrope_interleaved: bool = False) -> torch.Tensor:
    """bf16 [n, D] or [n, H, D] -> bf16; rotates pairs of dims in [offset, offset + rotary_dim).
    A position outside [0, max_position) leaves the token unchanged. fp16 / fp32 x: the rotated values
    are rounded to x's dtype (fp32: not narrowed). mRoPE (``mrope_section``; positions [3, n]): pair j
    rotates by the row of positions[mrope_position_rows(j)], and only the pairs whose position is out of
    range are left unchanged."""
    x3 = x.unsqueeze(1) if x.dim() == 2 else x
    if cos_sin_cache.shape[0] == 0:
        return x.clone()  # no position is in range: identity
    d = x3.shape[-1]
    off = d - rotary_dim if offset is None else offset
    half = rotary_dim // 2
    j = torch.arange(half, device=x.device)
    i0 = off + (j if is_neox else 2 * j)
    i1 = off + (j + half if is_neox else 2 * j + 1)
    ok, c, s = _cos_sin_rows(positions, cos_sin_cache, half, mrope_section, mrope_interleaved)
    c, s = c[:, None, :], s[:, None, :]
    a, b = x3[..., i0].to(F32), x3[..., i1].to(F32)
    if conjugate:
        y0, y1 = (a * c) + (b * s), (b * c) - (a * s)
    else:
        y0, y1 = (a * c) - (b * s), (a * s) + (b * c)
    keep = ~ok[:, None, :]
    y = x3.clone()
    y[..., i0] = torch.where(keep, x3[..., i0], y0.to(x.dtype))
    y[..., i1] = torch.where(keep, x3[..., i1], y1.to(x.dtype))
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
    dequant scale d), SPEC §6. floor_exp: ceil(log2(scale_floor)) of a power-of-two format's
    scale_floor (the exponent is at least that), or None."""
    fmax = _f32(FMAX[cast_fmt], amax)
    if SCALE_FORMATS[sf_format].power_of_two:
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
    (ue8m0 kinds): the scale is 2^ceil(log2(max(amax / fmax, scale_floor))) (SPEC §6)."""
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
    """Stored scales -> the fp32 dequant multiplier d. ``ue8m0_nan`` (the read side, SPEC §7): a
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
    :func:`dequant_scale` (the cast_back stage keeps d = 2^e, SPEC §6; the read side sets it)."""
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


def quantize_per_tensor(x: torch.Tensor, scale, convention: str = "divide", code: str = "e4m3") -> torch.Tensor:
    """bf16 / fp16 / fp32 [..., H, D] -> e4m3 codes (uint8) with one fp32 scale for the whole tensor or one per head:
    e4m3(clamp(f(x) / f(scale), -448, 448)), a correctly rounded division (by a tensor, also on CUDA),
    round to nearest even; ``convention`` "multiply": e4m3(clamp(f(x) * f(scale), -448, 448)), one fp32
    product (FlashInfer's). ``scale``: fp32 with one element, or [H] (head h's), or a number (its fp32).
    ``code`` "e5m2": e5m2 codes, clamped to [-57344, 57344]."""
    if not isinstance(scale, torch.Tensor):
        scale = torch.tensor(float(scale), dtype=F32, device=x.device)
    s = (scale[:, None] if scale.numel() > 1 else scale.reshape(())).to(F32)
    t = x.to(F32) * s if convention == "multiply" else torch.div(x.to(F32), s)
    if code == "e5m2":
        return encode_e5m2(torch.clamp(t, -E5M2_MAX, E5M2_MAX))
    return encode_e4m3(torch.clamp(t, -FMAX["e4m3"], FMAX["e4m3"]))


E5M2_MAX = 57344.0
# vLLM's per-(token, head) quantization: (QMAX, the smallest scale)
TOKEN_HEAD_QMAX = {"e4m3": 448.0, "int8": 127.0}
TOKEN_HEAD_MIN_SCALE = 1e-6


def token_head_scales(x: torch.Tensor, qmax: float) -> torch.Tensor:
    """fp32 [..., D] -> the scale of each row [...]: max(amax / qmax, 1e-6), amax = max |x| over the row (NaN
    when the row holds one: the canonical NaN 0x7fc00000), a correctly rounded fp32 division, the bound 1e-6
    as fp32 (vLLM's _reshape_cache_per_token_head, SPEC §3)."""
    amax = x.abs().amax(-1)
    s = torch.div(amax, _f32(qmax, x))
    return torch.where(torch.isnan(s), _f32(float("nan"), x), torch.maximum(s, _f32(TOKEN_HEAD_MIN_SCALE, x)))


def encode_int8_round_half_away(t: torch.Tensor) -> torch.Tensor:
    """fp32 -> int8 codes as vLLM's int8 cache writer: t + 0.5 for t >= 0, else t - 0.5 (one fp32 rounding),
    clamped to [-128, 127], truncated toward zero (the store); NaN -> 0."""
    u = torch.where(t >= 0, t + _f32(0.5, t), t - _f32(0.5, t))
    u = torch.where(torch.isnan(t), torch.zeros_like(u), torch.clamp(u, -128.0, 127.0))
    return u.to(torch.int32).to(torch.int8)


def quantize_per_token_head(x: torch.Tensor, code: str):
    """fp32 [n, H, D] -> (codes [n, H, D] as uint8 bytes, scales fp32 [n, H]): each (token, head) row by its own
    scale s (:func:`token_head_scales`), t = x * (1 / s) (the reciprocal and the product each rounded once),
    then e4m3(clamp(t, -448, 448)) (``code`` "e4m3") or :func:`encode_int8_round_half_away` ("int8")."""
    x = x.to(F32)
    s = token_head_scales(x, TOKEN_HEAD_QMAX[code])
    r = torch.div(torch.ones_like(s), s)
    t = x * r[..., None]
    if code == "e4m3":
        codes = encode_e4m3(torch.clamp(t, -FMAX["e4m3"], FMAX["e4m3"]))
        codes = torch.where(torch.isnan(t), torch.full_like(codes, 0x7F), codes)     # NaN 0x7f, whatever its sign
    else:
        codes = encode_int8_round_half_away(t).view(torch.uint8)
    return codes, s
