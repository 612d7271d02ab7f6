"""The @triton.jit building blocks of the portable kernels (kvfuse/kernels/portable.py, qkv.py,
store_load.py): the norm's adjacent-pairs tree and rstd, the RoPE pairing and rotation, bf16 loads
and stores, and the slot -> (block, offset) and position -> cos/sin row lookups.

Each gives SPEC §6's bits whatever the tile shape, the lane width or the program's row count (see
kvfuse/kernels/numerics.py for the narrowing helpers they build on).
"""
import triton
import triton.language as tl

from .codes import NATIVE_INTEGER
from .numerics import bf16_bits, load_f32, round_bf16


# Tiles. A program owns BLOCK_M rows; a row is held as [NV, VEC] (NV = BLOCK_D / VEC vectors of VEC
# consecutive columns, VEC = 8 or 4): each lane loads whole vectors, the first levels of every tree
# run inside a lane, and the quantized codes of a vector leave in one store as wide as the record's
# alignment allows (a narrower store than the tile's vector would cost a shared-memory relayout).
# Reshapes between [M, NV, VEC] and the group form [M, groups, G / VEC, VEC] move no data.
@triton.jit
def pair_sum(v, AXIS: tl.constexpr, SPLIT: tl.constexpr):
    """v [..., 2] (AXIS: the last axis) -> v[..., 0] + v[..., 1]. SPLIT (the interpreter): by tl.split, because the
    interpreter's tl.sum (numpy's sum along an axis) starts from +0 and turns -0 + -0 into +0; the
    compiled tl.sum of two elements in one thread is the one IEEE add (proven on the H200)."""
    if SPLIT:
        a, b = tl.split(v)
        return a + b
    return tl.sum(v, axis=AXIS)


@triton.jit
def tree_sum(v, BLOCK_M: tl.constexpr, NV: tl.constexpr, LOG2_NV: tl.constexpr, VEC: tl.constexpr,
              LOG2_VEC: tl.constexpr, SPLIT: tl.constexpr):
    """Sum [M, NV, VEC] over each row in the adjacent-pairs order of SPEC §6 (kvfuse.reference.pairwise_sum):
    every level sums a size-2 axis (one add, commutative), so the order is fixed whatever layout the
    compiler picks."""
    for lvl in tl.static_range(LOG2_VEC):
        v = pair_sum(tl.reshape(v, [BLOCK_M, NV, VEC >> (lvl + 1), 2]), 3, SPLIT)
    v = tl.reshape(v, [BLOCK_M, NV])
    for lvl in tl.static_range(LOG2_NV):
        v = pair_sum(tl.reshape(v, [BLOCK_M, NV >> (lvl + 1), 2]), 2, SPLIT)
    return tl.reshape(v, [BLOCK_M])


@triton.jit
def grid3(A: tl.constexpr, B: tl.constexpr, C: tl.constexpr):
    """[A, B, C] int32 holding 0 .. A*B*C - 1 in row-major order."""
    return (tl.arange(0, A) * (B * C))[:, None, None] + (tl.arange(0, B) * C)[None, :, None] + tl.arange(0, C)[None, None, :]


@triton.jit
def rotate(a, b, c, s, CONJ: tl.constexpr):
    """SPEC §6 RoPE of the pair (a, b) = (y_i0, y_i1), each product rounded, then the sum (not yet
    narrowed to bf16): kvfuse.reference.rope's arithmetic."""
    if CONJ:
        return (a * c) + (b * s), (b * c) - (a * s)
    return (a * c) - (b * s), (a * s) + (b * c)


@triton.jit
def reciprocal_std(ss, eps, D: tl.constexpr, BLOCK_M: tl.constexpr):
    """1 / sqrt(ss / D + eps) of rows with sum of squares (or of squared deviations) ss [M]
    (reference.stages: each step rounded)."""
    if (D & (D - 1)) == 0:
        mean = ss * (1.0 / D)                 # exact: the same bits as ss / D for a power of two
    else:
        mean = tl.div_rn(ss, D * 1.0)
    return tl.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), tl.sqrt_rn(mean + eps))


@triton.jit
def normed(v, mu, rstd, w, b, LAYER: tl.constexpr, HAS_BIAS: tl.constexpr, NATIVE: tl.constexpr):
    """SPEC §6 norm of values v (fp32) given the row's statistics (broadcast to v): RMSNorm
    bf16((v * rstd) * w); LayerNorm bf16(((v - mu) * rstd) * w (+ b)) (kvfuse.reference.rmsnorm /
    layernorm). Unused arguments of the other kind are ignored (any tensor)."""
    if LAYER:
        v = v - mu
    t = (v * rstd) * w
    if HAS_BIAS:
        t = t + b
    return round_bf16(t, NATIVE)


@triton.jit
def load_f32_native(ptr, offs, mask, IS_BF16: tl.constexpr, NATIVE: tl.constexpr):
    """load_f32; bf16 with native conversions: two values a 32-bit word widened by a shift and a mask
    (inline PTX), for the compiler extracted the high half first (PRMT) and then shifted it."""
    if IS_BF16 and NATIVE != NATIVE_INTEGER:
        u = tl.load(ptr.to(tl.pointer_type(tl.uint16)) + offs, mask=mask, other=0)
        w = tl.inline_asm_elementwise("shl.b32 $0, $2, 16;\n\tand.b32 $1, $2, 0xFFFF0000;", "=r,=r,r", [u],
                                      dtype=tl.uint32, is_pure=True, pack=2)
        return w.to(tl.float32, bitcast=True)
    return load_f32(ptr, offs, mask, IS_BF16)


@triton.jit
def bf16_out_bits(v, ROUNDED: tl.constexpr):
    """The 16 bits (uint16) of fp32 values v holding bf16 values. ROUNDED (native conversions only): every value
    is an output of round_bf16's native conversion, which converted again gives the same bits (a NaN's
    included: its bf16 bits came out of that conversion); the compiler then reuses the first conversion and
    packs two values an instruction (F2FP), where the bit shift took a conversion, a shift back and a PRMT."""
    if ROUNDED:
        return v.to(tl.bfloat16).to(tl.uint16, bitcast=True)
    return bf16_bits(v)


@triton.jit
def store_bf16(ptr, offs, v, mask, ROUNDED: tl.constexpr = False):
    tl.store(ptr.to(tl.pointer_type(tl.uint16)) + offs, bf16_out_bits(v, ROUNDED), mask=mask)


@triton.jit
def store_bf16_bytes(ptr, base, col, v, mask, ALIGN: tl.constexpr):
    """bf16 values v at ptr + base + 2 * col: 16-bit stores when base is even, else byte pairs (the bits by
    a shift: with bf16_out_bits' conversion the FlashMLA tails took a few instructions more)."""
    bits = bf16_bits(v)
    if ALIGN % 2 == 0:
        tl.store((ptr + base).to(tl.pointer_type(tl.uint16)) + col, bits, mask=mask)
    else:
        b32 = bits.to(tl.uint32)
        tl.store(ptr + base + 2 * col, (b32 & 0xFF).to(tl.uint8), mask=mask)
        tl.store(ptr + base + 2 * col + 1, (b32 >> 8).to(tl.uint8), mask=mask)


@triton.jit
def store_u32_bytes(ptr, addr, v, mask, ALIGN: tl.constexpr):
    """uint32 v at ptr + addr: one 32-bit store when addr is 4-aligned, else 4 bytes (little-endian)."""
    if ALIGN % 4 == 0:
        tl.store(ptr.to(tl.pointer_type(tl.uint32)) + (addr >> 2), v, mask=mask)
    else:
        for i in tl.static_range(4):
            tl.store(ptr + addr + i, ((v >> (8 * i)) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def load_cs_rows(pos_ptr, s_pos, tok, rmask, P, s_cs):
    """(pok [M]: the position is in [0, P) (else RoPE is the identity), csrow [M]: its cos/sin row offset)."""
    pos = tl.load(pos_ptr + tok * s_pos, mask=rmask, other=-1)
    return cs_rows(pos, rmask, P, s_cs)


@triton.jit
def cs_rows(pos, rmask, P, s_cs):
    """load_cs_rows of loaded positions (-1 where not rmask)."""
    pok = rmask & (pos >= 0) & (pos < P)
    return pok, tl.where(pok, pos, 0).to(tl.int64) * s_cs


@triton.jit
def slot_block_offset(slot_ptr, s_slot, tok, rmask, block_size, capacity, SLOT32: tl.constexpr):
    """(ok, block, offset in block) [M] of the tokens' slots: ok where the row is live and its slot in
    [0, capacity), block and offset int64 (0 where not ok); the division in int32 while capacity <= 2**31
    (SLOT32, checked on the host)."""
    slot = tl.load(slot_ptr + tok * s_slot, mask=rmask, other=-1)
    return block_offset_of_slot(slot, rmask, block_size, capacity, SLOT32)


@triton.jit
def block_offset_of_slot(slot, rmask, block_size, capacity, SLOT32: tl.constexpr):
    """slot_block_offset of loaded slots (-1 where not rmask)."""
    ok = rmask & (slot >= 0) & (slot < capacity)
    if SLOT32:
        s32 = tl.where(ok, slot, 0).to(tl.int32)
        blk32 = s32 // block_size
        blk = blk32.to(tl.int64)
        off = (s32 - blk32 * block_size).to(tl.int64)
    else:
        s64 = tl.where(ok, slot, 0).to(tl.int64)
        blk = s64 // block_size
        off = s64 - blk * block_size
    return ok, blk, off


@triton.jit
def rope1_pairing(col, HALF: tl.constexpr, R: tl.constexpr, ROPE_OFF: tl.constexpr, NEOX: tl.constexpr):
    """ROPE 1's pairing of the columns col [NV, VEC]: (first: the pair's first element, in_rope, j: the
    pair's frequency, partner column), j and partner 0 outside the rotated dims."""
    k = col - ROPE_OFF
    in_rope = (k >= 0) & (k < R)
    if NEOX:
        first = k < HALF
        j = tl.where(first, k, k - HALF)
        partner = tl.where(first, col + HALF, col - HALF)
    else:
        first = (k & 1) == 0
        j = k >> 1
        partner = tl.where(first, col + 1, col - 1)
    return first, in_rope, tl.where(in_rope, j, 0), tl.where(in_rope, partner, 0)


@triton.jit
def rope1_pairs(cs_ptr, csrow, pok, col, HALF: tl.constexpr, R: tl.constexpr, ROPE_OFF: tl.constexpr,
                 NEOX: tl.constexpr, CS_BF16: tl.constexpr):
    """ROPE 1's pairing of the columns col [NV, VEC] and the tokens' cos / sin (csrow [M] their rows,
    pok [M] in range): (first, in_rope [NV, VEC], rot_mask [M, NV, VEC], partner column, cos, sin)."""
    first, in_rope, j, partner = rope1_pairing(col, HALF, R, ROPE_OFF, NEOX)
    rot_mask = pok[:, None, None] & in_rope[None, :, :]
    c = load_f32(cs_ptr, csrow[:, None, None] + j[None, :, :], rot_mask, CS_BF16)
    s = load_f32(cs_ptr, csrow[:, None, None] + HALF + j[None, :, :], rot_mask, CS_BF16)
    return first, in_rope, rot_mask, partner, c, s


@triton.jit
def pair_partner(v, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr, VEC: tl.constexpr):
    """v [A, B, C, VEC] (fp32) -> each column's partner in its pair (column ^ 1), moved by its bits (exact, NaN
    payloads and signed zeros too): sums of size-2 axes of integers, one of them zero, and selects."""
    u = tl.reshape(v.to(tl.uint32, bitcast=True), [A, B, C, VEC // 2, 2])
    k = tl.arange(0, 2)[None, None, None, None, :]
    ev = tl.sum(tl.where(k == 0, u, 0), axis=4)
    od = tl.sum(tl.where(k == 1, u, 0), axis=4)
    p = tl.where(k == 0, od[:, :, :, :, None], ev[:, :, :, :, None])
    return tl.reshape(p, [A, B, C, VEC]).to(tl.float32, bitcast=True)


@triton.jit
def pair_dup(v, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr, VEC: tl.constexpr):
    """v [A, B, C, VEC / 2] -> [A, B, C, VEC], each value given to the two columns of its pair."""
    return tl.reshape(tl.broadcast_to(v[:, :, :, :, None], [A, B, C, VEC // 2, 2]), [A, B, C, VEC])


