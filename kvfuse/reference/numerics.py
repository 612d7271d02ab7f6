"""The narrowing helpers of kvfuse's numerics (SPEC §6): bf16 rounding, the e4m3 and e2m1 encoders
and decoders (bit-exact, branch-free torch code), e2m1 packing, and the constants they share."""
from __future__ import annotations

import torch


F32 = torch.float32


AMAX_MARGIN = 1e-4


E4M3_SF_MIN = 2.0 ** -9


# e2m1 magnitudes of codes 0..7
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _f32(v, like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(v, dtype=F32, device=like.device)


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


def encode_e5m2(t: torch.Tensor) -> torch.Tensor:
    """fp32 with |t| <= 57344 -> e5m2 bytes (uint8), round to nearest even, sign kept (a negative value that
    rounds to zero gives 0x80), NaN 0x7f with its sign: encode_e4m3's scheme with 2 mantissa bits."""
    u = t.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    sign = (u >> 24) & 0x80
    ax = t.abs()
    au = ax.view(torch.int32).to(torch.int64)
    normal = ((au + 0xFFFFF + ((au >> 21) & 1)) >> 21) - 448      # rebias 127 -> 15, keep 2 mantissa bits
    subnormal = torch.round(ax * 65536.0).to(torch.int64)            # multiples of 2^-16; round() is half-even
    code = torch.where(ax < 2.0 ** -14, subnormal, normal)
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
