"""The 4-bit cast of the GQA kernel (kvfuse/kernels/qkv.py, SPEC §3): a [BLOCK_M, BLOCK_D] tile of the
values the cast reads -> packed e2m1 codes [BLOCK_M, BLOCK_D / 2] and one scale per group, as
NVFP4 with a global scale (FlashInfer's rule: groups of 16, e4m3 scales) or MXFP4 (SPEC §6's rule:
groups of 32, ue8m0 scales). The reference is kvfuse/reference/fp4.py; the encoders are the MLA
path's (numerics.py). NaN elements are left out of a group's amax and encoded as signed zeros,
explicitly: the GPU's min / max return the operand that is a number. The tile stays in the kernel's
[BLOCK_M, BLOCK_D / 8, 8] shape: groups are formed from the 8-column vectors' maxima and the pairs packed
by a reduction, so the compiled kernel never reshapes the whole tile into groups or pairs (layouts
and layout conversions of their own, around which the GPU's 4-bit caches differed from the reference).
"""
import triton
import triton.language as tl

from .codes import NATIVE_GUARDED, NATIVE_INTEGER, SF_UE8M0
from .numerics import decode_e4m3, encode_e2m1, encode_e4m3, group_scales

FP4_NVFP4 = tl.constexpr(1)     # the FP4 constexpr of the GQA kernel: which 4-bit format a cast writes
FP4_MXFP4 = tl.constexpr(2)
FP4_CODES = {"nvfp4": FP4_NVFP4.value, "mxfp4": FP4_MXFP4.value}
FP4_GROUPS = {FP4_NVFP4.value: 16, FP4_MXFP4.value: 32}


@triton.jit
def group_amax(y, BLOCK_M: tl.constexpr, NV: tl.constexpr, VEC: tl.constexpr, GROUP: tl.constexpr):
    """max |y| over each GROUP consecutive columns of y [BLOCK_M, NV, VEC] (GROUP a multiple of VEC) ->
    [BLOCK_M, NV * VEC / GROUP]; NaN left out (a zero in its place), infinities count. Only the vectors'
    maxima [BLOCK_M, NV] are regrouped, never the tile."""
    a = tl.max(tl.where(y != y, 0.0, tl.abs(y)), axis=2)
    return tl.max(tl.reshape(a, [BLOCK_M, NV // (GROUP // VEC), GROUP // VEC]), axis=2)


@triton.jit
def to_vectors(v, BLOCK_M: tl.constexpr, NV: tl.constexpr, VEC: tl.constexpr, GROUP: tl.constexpr):
    """A value per group [BLOCK_M, NV * VEC / GROUP] -> the value of each vector's group [BLOCK_M, NV]."""
    GV: tl.constexpr = GROUP // VEC
    return tl.reshape(tl.broadcast_to(v[:, :, None], [BLOCK_M, NV // GV, GV]), [BLOCK_M, NV])


@triton.jit
def nvfp4_scales(amax, g, NATIVE: tl.constexpr):
    """amax and the fp32 global decode scale g -> (e4m3 scale codes uint8, output scale fp32):
    kvfuse.reference.fp4.nvfp4_block_scales (sf = e4m3_satfinite(amax / (6 g)) for amax > 0, the
    output scale 1 / (f(sf) g) where amax and f(sf) are > 0, else 0)."""
    live = amax > 0.0
    s = tl.where(live, tl.div_rn(amax, g * 6.0), 0.0)
    code = encode_e4m3(tl.minimum(s, 448.0), NATIVE_GUARDED if NATIVE else NATIVE_INTEGER)
    code = tl.where(s != s, 0x7F, code).to(tl.uint8)
    sf = decode_e4m3(code)
    return code, tl.where(live & (sf > 0.0), tl.div_rn(tl.zeros_like(sf) + 1.0, sf * g), 0.0)


@triton.jit
def e2m1_nan_zero(t):
    """e2m1 codes (int32) of t: numerics.encode_e2m1 (saturating at 6), a NaN as the signed zero of its
    sign bit."""
    code = encode_e2m1(t)
    return tl.where(t != t, code & 8, code)


@triton.jit
def pack_nibbles(codes, BLOCK_M: tl.constexpr, NV: tl.constexpr, VEC: tl.constexpr):
    """codes [BLOCK_M, NV, VEC] (0..15) -> bytes [BLOCK_M, NV, VEC / 2], the even column in the low nibble:
    each pair summed (disjoint bits) as a reduction over the pair, the shape tree_sum reduces, instead of a
    split, which needs both columns in one thread and so a layout conversion where they are not."""
    shift = (tl.arange(0, VEC) & 1) * 4
    return tl.sum(tl.reshape(codes << shift[None, None, :], [BLOCK_M, NV, VEC // 2, 2]), axis=3).to(tl.uint8)


@triton.jit
def fp4_tile(y, g, BLOCK_M: tl.constexpr, NV: tl.constexpr, VEC: tl.constexpr, FP4: tl.constexpr,
             NATIVE: tl.constexpr):
    """y [BLOCK_M, NV, VEC] fp32 (row order) -> (packed codes uint8 [BLOCK_M, NV, VEC / 2], scale bytes uint8
    [BLOCK_M, NV * VEC / GROUP]) of FP4 (FP4_NVFP4: global decode scale g; FP4_MXFP4: g unused).
    MXFP4 leaves out SPEC §6's clamp to [-6, 6]: the encoder saturates, NaN is handled here. The scales
    are computed per group and spread to the group's vectors, so the tile is never reshaped across
    vectors (such reshapes put the GQA kernel's rows in other layouts, and layout conversions around them)."""
    GROUP: tl.constexpr = 16 if FP4 == FP4_NVFP4 else 32
    amax = group_amax(y, BLOCK_M, NV, VEC, GROUP)
    if FP4 == FP4_NVFP4:
        stored, m = nvfp4_scales(amax, g, NATIVE)
    else:
        m, _, stored = group_scales(tl.maximum(amax, 1e-4), 6.0, SF_UE8M0, NATIVE)
    codes = e2m1_nan_zero(y * to_vectors(m, BLOCK_M, NV, VEC, GROUP)[:, :, None])
    return pack_nibbles(codes, BLOCK_M, NV, VEC), stored.to(tl.uint8)


@triton.jit
def store_fp4_rows(c_ptr, c_row, s_ptr, s_row, y, ok, g, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, FP4: tl.constexpr, NATIVE: tl.constexpr):
    """The cast of BLOCK_M rows y (any shape of BLOCK_M x BLOCK_D elements in row order; columns >= D zero;
    [BLOCK_M, BLOCK_D / 8, 8] as the GQA kernel holds them is used as it is) stored where ok [BLOCK_M]: the
    D / 2 code bytes at c_ptr + c_row[m] and the D / GROUP scale bytes at s_ptr + s_row[m] (byte offsets,
    int64)."""
    GROUP: tl.constexpr = 16 if FP4 == FP4_NVFP4 else 32
    VEC: tl.constexpr = 8
    NV: tl.constexpr = BLOCK_D // VEC
    q, s = fp4_tile(tl.reshape(y, [BLOCK_M, NV, VEC]), g, BLOCK_M, NV, VEC, FP4, NATIVE)
    qc = tl.arange(0, NV)[:, None] * (VEC // 2) + tl.arange(0, VEC // 2)[None, :]     # [NV, VEC / 2]
    tl.store(c_ptr.to(tl.pointer_type(tl.uint8)) + c_row[:, None, None] + qc[None, :, :], q,
             mask=ok[:, None, None] & (qc < D // 2)[None, :, :])
    sc = tl.arange(0, BLOCK_D // GROUP)
    tl.store(s_ptr.to(tl.pointer_type(tl.uint8)) + s_row[:, None] + sc[None, :], s,
             mask=ok[:, None] & (sc < D // GROUP)[None, :])
