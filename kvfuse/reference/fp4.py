"""The 4-bit GQA / MHA cache formats of SPEC §3, one function per stage: NVFP4 with a global scale
(FlashInfer's rule: e2m1 codes, one e4m3 scale per 16 values, one fp32 global decode scale) and MXFP4
(SPEC §6's e2m1 / ue8m0 rule over groups of 32), their decoders, and the group amax they share.

Each works on the last dim of [..., D] values (the fp32 values the cast reads; bf16, fp16 or fp32
tensors are widened exactly) and returns packed codes (uint8 [..., D / 2], the even element in the
low nibble) and the scales; every fp32 operation is IEEE and rounded on its own.
"""
from __future__ import annotations

import torch

from .numerics import F32, _f32, decode_e4m3, decode_e2m1, encode_e2m1, encode_e4m3, pack_e2m1, unpack_e2m1
from .stages import AMAX_MARGIN, canonical_nan, dequantize, group_scales

NVFP4_GROUP = 16
MXFP4_GROUP = 32
E2M1_MAX = 6.0
E4M3_MAX = 448.0


def global_scale_f32(global_scale, like: torch.Tensor) -> torch.Tensor:
    """A global scale (a number or a one-element tensor) as an fp32 scalar tensor on ``like``'s device."""
    if isinstance(global_scale, torch.Tensor):
        return global_scale.reshape(()).to(device=like.device, dtype=F32)
    return _f32(float(global_scale), like)


def group_amax(x: torch.Tensor, group: int) -> torch.Tensor:
    """max |f(x_i)| over each group of ``group`` consecutive elements ([..., D] -> [..., D / group]);
    NaN elements are left out (CUDA's fmaxf: the running maximum keeps the number), infinities count."""
    a = x.to(F32).abs()
    a = torch.where(torch.isnan(a), torch.zeros_like(a), a)
    return a.reshape(x.shape[:-1] + (x.shape[-1] // group, group)).amax(dim=-1)


def nvfp4_block_scales(amax: torch.Tensor, global_scale: torch.Tensor):
    """amax [...] and the fp32 global decode scale g -> (e4m3 scale codes uint8, output scale fp32):
    sf = e4m3_satfinite(amax / (6 g)) for amax > 0, else code 0 (6 g one fp32 product, the division
    IEEE; saturating: a quotient past 448, infinite included, is 448; a NaN quotient is 0x7F); the
    output scale is 1 / (f(sf) g) where amax > 0 and f(sf) > 0, else 0 (every code then a signed zero)."""
    s = torch.div(amax, global_scale * _f32(E2M1_MAX, amax))
    live = amax > 0
    s = torch.where(live, s, torch.zeros_like(s))
    code = encode_e4m3(torch.clamp(s, max=E4M3_MAX))
    code = torch.where(torch.isnan(s), torch.full_like(code, 0x7F), code)
    sf = decode_e4m3(code)
    denom = sf * global_scale
    out = torch.div(torch.ones_like(denom), denom)
    return code, torch.where(live & (sf > 0), out, torch.zeros_like(out))


def quantize_nvfp4(x: torch.Tensor, global_scale):
    """[..., D] (D a multiple of 16) -> (codes uint8 [..., D / 2], scales float8_e4m3fn [..., D / 16]):
    FlashInfer's nvfp4_append_quantize_block with IEEE operations; code_i = e2m1(f(x_i) * output scale),
    one fp32 product (:func:`nvfp4_block_scales`), encoded at FlashInfer's thresholds (ties to even,
    saturating at 6, infinities included; sign in bit 3, kept for values that round to zero; a NaN
    is the signed zero of its sign bit)."""
    g = global_scale_f32(global_scale, x)
    amax = group_amax(x, NVFP4_GROUP)
    code, out_scale = nvfp4_block_scales(amax, g)
    xf = x.to(F32)
    t = xf.reshape(amax.shape + (NVFP4_GROUP,)) * out_scale[..., None]
    return pack_e2m1(encode_e2m1(t).reshape(x.shape)), code.view(torch.float8_e4m3fn)


def quantize_mxfp4(x: torch.Tensor):
    """[..., D] (D a multiple of 32) -> (codes uint8 [..., D / 2], ue8m0 scale bytes uint8 [..., D / 32]):
    SPEC §6's e2m1 / ue8m0 rule (amax floored at 1e-4, scale 2^ceil(log2(amax / 6)), t clamped to
    [-6, 6]) with NaN elements left out of the amax and encoded as signed zeros."""
    amax = torch.maximum(group_amax(x, MXFP4_GROUP), _f32(AMAX_MARGIN, x))
    stored, m, _ = group_scales(amax, "e2m1", "ue8m0")
    t = torch.clamp(x.to(F32).reshape(amax.shape + (MXFP4_GROUP,)) * m[..., None], -E2M1_MAX, E2M1_MAX)
    return pack_e2m1(encode_e2m1(t).reshape(x.shape)), stored


def dequantize_nvfp4(codes: torch.Tensor, sf: torch.Tensor, global_scale) -> torch.Tensor:
    """(codes, scales) of :func:`quantize_nvfp4` -> bf16 [..., D]: bf16((e2m1_i * f(sf)) * g), the first
    product exact, one rounding to fp32 and one to bf16; NaN scale codes give the canonical bf16 NaN."""
    g = global_scale_f32(global_scale, codes)
    values = decode_e2m1(unpack_e2m1(codes.view(torch.uint8)))
    scale = decode_e4m3(sf.view(torch.uint8))
    y = values.reshape(scale.shape + (NVFP4_GROUP,)) * scale[..., None]
    return canonical_nan((y * g).reshape(values.shape).to(torch.bfloat16))


def dequantize_mxfp4(codes: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """(codes, scales) of :func:`quantize_mxfp4` -> bf16 [..., D]: bf16(e2m1_i * 2^(byte - 127)), a
    scale byte 0xFF as NaN (OCP MX; the canonical bf16 NaN)."""
    return canonical_nan(dequantize(codes.view(torch.uint8), sf.view(torch.uint8), "e2m1", MXFP4_GROUP, "ue8m0",
                                    ue8m0_nan=True))


def quantize_block_format(name: str, x: torch.Tensor, global_scale=None):
    """The cast of a 4-bit GQA cache format (kvfuse.gqa_formats, "nvfp4" with its global scale, or "mxfp4")
    of x [..., D]: (codes, scales)."""
    if name == "nvfp4":
        return quantize_nvfp4(x, global_scale)
    if name == "mxfp4":
        return quantize_mxfp4(x)
    raise ValueError(f"name: expected a 4-bit GQA cache format ('nvfp4', 'mxfp4'), got {name!r}")


def dequantize_block_format(name: str, codes: torch.Tensor, sf: torch.Tensor, global_scale=None) -> torch.Tensor:
    """The inverse of :func:`quantize_block_format`: bf16 [..., D]."""
    if name == "nvfp4":
        return dequantize_nvfp4(codes, sf, global_scale)
    if name == "mxfp4":
        return dequantize_mxfp4(codes, sf)
    raise ValueError(f"name: expected a 4-bit GQA cache format ('nvfp4', 'mxfp4'), got {name!r}")
