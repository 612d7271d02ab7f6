"""Triton helpers that give SPEC §6's bits on the GPU and in the interpreter alike.

NATIVE (constexpr, kvfuse/kernels/codes.py: NATIVE_INTEGER, NATIVE_GUARDED, NATIVE_UNGUARDED; a
bool in the load kernel) selects the GPU's native conversions (exact there: cvt.rn for bf16,
cvt.rn.satfinite for e4m3); the interpreter's native conversions are wrong (truncation, ties
away from zero, bad subnormals), so there NATIVE_INTEGER narrows with integer round-to-nearest-even
on the bit patterns. All arithmetic is fp32 with explicit IEEE division/sqrt; kernels launch with
enable_fp_fusion=False so no multiply-add is contracted.
"""
import triton
import triton.language as tl

from .codes import NATIVE_GUARDED, NATIVE_INTEGER, NO_FLOOR, SF_E4M3, SF_UE8M0, SF_UE8M0_FP32


@triton.jit
def load_f32(ptr, offs, mask, IS_BF16: tl.constexpr):
    """Load bf16 (as raw bits, shifted: exact for subnormals in the interpreter too) or fp32 -> fp32."""
    if IS_BF16:
        u = tl.load(ptr.to(tl.pointer_type(tl.uint16)) + offs, mask=mask, other=0)
        v = (u.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        v = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return v


@triton.jit
def round_bf16(v, NATIVE: tl.constexpr):
    """fp32 -> the nearest-even bf16 value, returned as fp32 (kvfuse.reference.round_to_bf16)."""
    if NATIVE:
        r = v.to(tl.bfloat16).to(tl.float32)
    else:
        u = v.to(tl.uint32, bitcast=True)
        q = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
        r = tl.where(v != v, v, q.to(tl.float32, bitcast=True))
    return r


@triton.jit
def bf16_bits(v):
    """fp32 holding an exact bf16 value -> its 16 bits (uint16)."""
    return (v.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16)


@triton.jit
def encode_e4m3(t, NATIVE: tl.constexpr):
    """fp32 with |t| <= 448 -> e4m3fn code (uint8), RTNE, sign kept (-0 -> 0x80) (kvfuse.reference.encode_e4m3)."""
    if NATIVE:
        c = t.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        if NATIVE == NATIVE_GUARDED:
            # |t| <= 2^-10 rounds to a signed zero; said explicitly in case the conversion flushes fp32
            # subnormals without their sign (NATIVE_UNGUARDED trusts the conversion: tests/gpu/test_gpu_numerics.py)
            neg_zero = ((t.to(tl.uint32, bitcast=True) >> 24) & 0x80).to(tl.uint8)
            c = tl.where(tl.abs(t) <= 0.0009765625, neg_zero, c)
    else:
        u = t.to(tl.uint32, bitcast=True)
        sign = (u >> 24) & 0x80
        ax = tl.minimum(tl.abs(t), 448.0)
        au = ax.to(tl.uint32, bitcast=True)
        code_n = ((au + 0x7FFFF + ((au >> 20) & 1)) >> 20) - 960
        # subnormals are multiples of 2^-9: ax*512 (exact) + 2^23 rounds to the integer k (RTNE)
        code_s = (ax * 512.0 + 8388608.0).to(tl.uint32, bitcast=True) - 0x4B000000
        code = tl.where(ax < 0.015625, code_s, code_n)
        code = tl.where(t != t, 0x7F, code)
        c = (code | sign).to(tl.uint8)
    return c


@triton.jit
def encode_e5m2(t, NATIVE: tl.constexpr):
    """fp32 -> e5m2 code (uint8), RTNE, saturating at 57344 (the clamp of SPEC §3), sign kept (-0 -> 0x80), NaN
    0x7f with its sign (kvfuse.reference.encode_e5m2): encode_e4m3's scheme with 2 mantissa bits."""
    if NATIVE:
        c = t.to(tl.float8e5, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
        if NATIVE == NATIVE_GUARDED:
            # |t| <= 2^-17 (half the smallest subnormal, a tie to even) rounds to a signed zero
            neg_zero = ((t.to(tl.uint32, bitcast=True) >> 24) & 0x80).to(tl.uint8)
            c = tl.where(tl.abs(t) <= 7.62939453125e-06, neg_zero, c)
    else:
        u = t.to(tl.uint32, bitcast=True)
        sign = (u >> 24) & 0x80
        ax = tl.minimum(tl.abs(t), 57344.0)
        au = ax.to(tl.uint32, bitcast=True)
        code_n = ((au + 0xFFFFF + ((au >> 21) & 1)) >> 21) - 448      # rebias 127 -> 15, keep 2 mantissa bits
        # subnormals are multiples of 2^-16: ax*65536 (exact) + 2^23 rounds to the integer k (RTNE)
        code_s = (ax * 65536.0 + 8388608.0).to(tl.uint32, bitcast=True) - 0x4B000000
        code = tl.where(ax < 6.103515625e-05, code_s, code_n)
        code = tl.where(t != t, 0x7F, code)
        c = (code | sign).to(tl.uint8)
    return c


@triton.jit
def row_amax(a, mask):
    """The largest |a| over the last two axes of a [M, ., .] where mask, NaN where any of those is NaN
    (tl.max alone ignores NaN on the GPU and not in the interpreter); 0 for a row without live values."""
    live = tl.where(mask, a, 0.0)
    amax = tl.max(tl.max(tl.abs(live), axis=2), axis=1)
    nan = tl.max(tl.max((live != live).to(tl.int32), axis=2), axis=1)
    return tl.where(nan > 0, float("nan"), amax)


@triton.jit
def token_head_scale(amax, QMAX: tl.constexpr):
    """vLLM's per-(token, head) scale, IEEE: max(amax / QMAX, 1e-6) (a NaN amax gives the canonical NaN
    0x7fc00000: the GPU's NaN bits differ from the CPU's) and its reciprocal 1 / s, each correctly rounded."""
    zero = tl.zeros_like(amax)
    s = tl.div_rn(amax, zero + QMAX)
    s = tl.where(s != s, float("nan"), tl.maximum(s, 1e-6))
    return s, tl.div_rn(zero + 1.0, s)


@triton.jit
def encode_int8_rhaz(t):
    """fp32 -> int8 (int32 in [-128, 127]) as vLLM's int8 cache writer: t + 0.5 (t >= 0) or t - 0.5 rounded
    once, clamped to [-128, 127], truncated toward zero; NaN -> 0."""
    u = tl.where(t >= 0, t + 0.5, t - 0.5)
    u = tl.where(t != t, 0.0, tl.minimum(tl.maximum(u, -128.0), 127.0))
    return u.to(tl.int32)


@triton.jit
def div_rn_by_reciprocal(y, d, r):
    """y / d for one divisor 2^-64 <= d <= 2^64 and r = div_rn(1, d): Markstein's correction of q0 = y * r
    by its exact remainder, q = fma(fma(q0, d, 0 - y), 0 - r, q0), three instructions instead of a
    division per element. The bits of tl.div_rn(y, d) wherever |y| >= 2^-100 (the remainder is exact);
    below, |y / d| < 2^-36 and its e4m3 code (a signed zero) is still the division's. A zero remainder
    is +0 and adds -0 * r, which leaves q0 and its sign; q0 is kept where infinite (y infinite, or y / d
    past the fp32 range); a NaN y gives a NaN. Negations are written 0 - v: Triton 3.6 compiles unary
    minus so, 3.9 as a sign flip, and they differ on +0 (the choice here is immaterial: 0 - y only
    meets a zero product, and r is not 0). Proven against IEEE division (tests/division_proof.py,
    docs/design.md); the caller checks the range of d."""
    zero = tl.zeros_like(y)
    q0 = y * r
    e = tl.fma(q0, zero + d, zero - y)               # q0 * d - y, exact
    return tl.where(tl.abs(q0) == float("inf"), q0, tl.fma(e, zero - r, q0))


@triton.jit
def decode_e4m3(c):
    """e4m3fn code (integer) -> fp32, exact (integer arithmetic: same on GPU and interpreter)."""
    c = c.to(tl.uint32)
    e = (c >> 3) & 0xF
    m = c & 7
    normal = ((e + 120) << 23) | (m << 20)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal.to(tl.float32, bitcast=True))
    # the sign goes in as a bit: Triton's unary minus is 0 - x on the GPU, which turns -0 into +0
    return (mag.to(tl.uint32, bitcast=True) | ((c & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def encode_e2m1(t):
    """fp32 -> e2m1 code 0..15 (int32), RTNE, saturating at 6, sign in bit 3 (kvfuse.reference.encode_e2m1).
    |t| < 1: 2|t| rounded to an integer (0, 1, 2 = the codes of 0, 0.5, 1) by adding 2^23;
    |t| >= 1: the bit pattern rounded to one mantissa bit (integer RTNE, the carry goes into the
    exponent), then (exponent, bit) - (126, 0) is the code (1.0 -> 2, ..., 6.0 -> 7)."""
    a = tl.abs(t)
    sub = (a * 2.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000
    u = a.to(tl.uint32, bitcast=True)                     # sign clear: no overflow below
    nrm = tl.minimum(((u + 0x1FFFFF + ((u >> 22) & 1)) >> 22).to(tl.int32) - 252, 7)
    code = tl.where(a < 1.0, sub, nrm)
    neg = (t.to(tl.uint32, bitcast=True) >> 31).to(tl.int32)
    return code | (neg << 3)


@triton.jit
def decode_e2m1(c):
    """e2m1 code 0..15 -> fp32 (magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6)."""
    c = c.to(tl.uint32)
    k = c & 7
    bits = tl.where(k >= 2, (((k >> 1) + 126) << 23) | ((k & 1) << 22), tl.where(k == 1, 0x3F000000, 0))
    return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def pow2(e):
    """2^e as fp32 for an int32 e in the normal range."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def ue8m0_exponent(amax, FMAX: tl.constexpr, FLOOR_E: tl.constexpr = NO_FLOOR):
    """The power-of-two scale of SPEC §6 for FMAX 448 (e4m3) or 6 (e2m1), amax > 0: (e = ceil(log2(RN(amax /
    FMAX))), at least FLOOR_E (a scale_floor's exponent; NO_FLOOR: none), the multiplier 2^-e as fp32).
    group_scales' SF_UE8M0 / SF_UE8M0_FP32 and the Gluon fast paths call it (a @gluon.jit function may call
    a @triton.jit one on Triton 3.6: their kernels compile to the same code as with a Gluon copy of it).

    Without the division: FMAX = 1.f * 2^p (448 = 1.75 * 2^8, 6 = 1.5 * 2^2): RN(amax / FMAX) <= 2^k exactly
    when amax <= FMAX * 2^k, because no fp32 lies between FMAX * 2^k and FMAX * 2^k * (1 + 2^-24), the
    rounding midpoint above 2^k (the ulp of amax there is 2^(k+p-23) > FMAX * 2^(k-24)). So e is amax's
    exponent minus p, plus one when amax's significand exceeds 1.f. Exact for every finite amax >= 1e-4
    (both amax and the scale are normal); an infinite amax gives the SPEC's e = 128 (scale inf; stored
    byte 255) explicitly."""
    P: tl.constexpr = 8 if FMAX == 448.0 else 2
    FRAC: tl.constexpr = 0x600000 if FMAX == 448.0 else 0x400000
    bits = amax.to(tl.int32, bitcast=True)
    e = ((bits >> 23) - (127 + P)) + ((bits & 0x7FFFFF) > FRAC).to(tl.int32)
    e = tl.where((bits >> 23) == 255, 128, e)
    if FLOOR_E != NO_FLOOR:
        e = tl.maximum(e, FLOOR_E)
    m = tl.where(e >= 127, 0x400000 >> tl.maximum(e - 127, 0), (127 - e) << 23).to(tl.float32, bitcast=True)
    return e, m


@triton.jit
def group_scales(amax, FMAX: tl.constexpr, SF: tl.constexpr, NATIVE: tl.constexpr,
                 FLOOR_E: tl.constexpr = NO_FLOOR):
    """amax (floored) -> (multiplier m, dequant scale d, stored: the scale byte or the fp32 bits, uint32):
    kvfuse.reference.group_scales.
    FMAX 448 (e4m3) or 6 (e2m1); SF one of codes.SF_*. FLOOR_E (SF_UE8M0 / SF_UE8M0_FP32): the
    scale_floor's exponent, e = max(e, FLOOR_E) (SPEC §6); NO_FLOOR: none."""
    if SF == SF_UE8M0 or SF == SF_UE8M0_FP32:
        e, m = ue8m0_exponent(amax, FMAX, FLOOR_E)
        d = pow2(e)
        if SF == SF_UE8M0:
            stored = (e + 127).to(tl.uint32)
        else:
            stored = d.to(tl.uint32, bitcast=True)
    elif SF == SF_E4M3:
        s = tl.minimum(tl.maximum(tl.div_rn(amax, FMAX), 0.001953125), 448.0)
        code = encode_e4m3(s, NATIVE_GUARDED if NATIVE else NATIVE_INTEGER)   # decoded below: the guarded encode
        d = decode_e4m3(code)
        m = tl.div_rn(1.0, d)
        stored = code.to(tl.uint32)
    else:
        s = tl.div_rn(amax, FMAX)
        m = tl.div_rn(tl.zeros_like(amax) + FMAX, amax)
        d = s
        stored = s.to(tl.uint32, bitcast=True)
    return m, d, stored
