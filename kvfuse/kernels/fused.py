"""The fused kernel: any sub-chain of RMSNorm -> RoPE -> Hadamard -> cast into any destination
(bf16 out, contiguous (q, sf), cast_back, paged cache + a stage copy), one launch; plus the
store and load kernels of the paged cache.

A program owns BLOCK_M rows of the flattened [n * num_heads] rows (row = (token, head)) and
the whole head (BLOCK_D = next power of two >= head_dim, masked), held as [BLOCK_M, BLOCK_D / VEC,
VEC]; the RoPE columns can live in a sub-tile of their own (ROPE_SUBTILE). Stages and destinations
are constexpr switches of one body (named in kvfuse/kernels/codes.py). Memory addresses are int64;
row and slot index arithmetic is int32 whenever it fits. Numerics follow SPEC §2 exactly (see kvfuse/kernels/numerics.py); a row's
bytes never depend on BLOCK_M, VEC, num_warps, the RoPE mode or other rows.
"""
from __future__ import annotations

import contextlib
import os
import threading

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from .. import backend as _backend
from ..formats import FMAX
from ..plans.types import LAUNCHES_PER_TEMPLATE, X, Plan
from .gluon import FAST_PATH_MODULES
from .codes import (CAST_CODES, CAST_E4M3, CAST_NONE, DEST_CACHE, DEST_CONTIGUOUS, DEST_NONE, NATIVE_GUARDED,
                    NATIVE_INTEGER, NATIVE_UNGUARDED, NO_FLOOR, ROPE_NONE, ROPE_SUBTILE, ROPE_TILE, SF_CODES, SF_E4M3,
                    SF_UE8M0, STAGE_CAST_BACK, STAGE_CODES, STAGE_NORM, STAGE_TRANSFORM)
from .gluon.common import table_entry
from .launcher import Launch, direct_launch_supported, tensor_arg
from .numerics import (bf16_bits, decode_e2m1, decode_e4m3, encode_e2m1, encode_e4m3, group_scales, load_f32,
                       round_bf16)


# --------------------------------------------------------------------------- helpers
# Tiles. A program owns BLOCK_M rows; a row is held as [NV, VEC] (NV = BLOCK_D / VEC vectors of VEC
# consecutive columns, VEC = 8 or 4): each lane loads whole vectors, the first levels of every tree
# run inside a lane, and the quantized codes of a vector leave in one store as wide as the record's
# alignment allows (a narrower store than the tile's vector would cost a shared-memory relayout).
# Reshapes between [M, NV, VEC] and the group form [M, groups, G / VEC, VEC] move no data.
@triton.jit
def _pair_sum(v, AXIS: tl.constexpr, SPLIT: tl.constexpr):
    """v [..., 2] (AXIS: the last axis) -> v[..., 0] + v[..., 1]. SPLIT (the interpreter): by tl.split, because the
    interpreter's tl.sum (numpy's sum along an axis) starts from +0 and turns -0 + -0 into +0; the
    compiled tl.sum of two elements in one thread is the one IEEE add (proven on the H200)."""
    if SPLIT:
        a, b = tl.split(v)
        return a + b
    return tl.sum(v, axis=AXIS)


@triton.jit
def _tree_sum(v, BLOCK_M: tl.constexpr, NV: tl.constexpr, LOG2_NV: tl.constexpr, VEC: tl.constexpr,
              LOG2_VEC: tl.constexpr, SPLIT: tl.constexpr):
    """Sum [M, NV, VEC] over each row in the adjacent-pairs order of SPEC §2 (kvfuse.reference.pairwise_sum):
    every level sums a size-2 axis (one add, commutative), so the order is fixed whatever layout the
    compiler picks."""
    for lvl in tl.static_range(LOG2_VEC):
        v = _pair_sum(tl.reshape(v, [BLOCK_M, NV, VEC >> (lvl + 1), 2]), 3, SPLIT)
    v = tl.reshape(v, [BLOCK_M, NV])
    for lvl in tl.static_range(LOG2_NV):
        v = _pair_sum(tl.reshape(v, [BLOCK_M, NV >> (lvl + 1), 2]), 2, SPLIT)
    return tl.reshape(v, [BLOCK_M])


@triton.jit
def _grid3(A: tl.constexpr, B: tl.constexpr, C: tl.constexpr):
    """[A, B, C] int32 holding 0 .. A*B*C - 1 in row-major order."""
    return (tl.arange(0, A) * (B * C))[:, None, None] + (tl.arange(0, B) * C)[None, :, None] + tl.arange(0, C)[None, None, :]


@triton.jit
def _rotate(a, b, c, s, CONJ: tl.constexpr):
    """SPEC §2 RoPE of the pair (a, b) = (y_i0, y_i1), each product rounded, then the sum (not yet
    narrowed to bf16): kvfuse.reference.rope's arithmetic."""
    if CONJ:
        return (a * c) + (b * s), (b * c) - (a * s)
    return (a * c) - (b * s), (a * s) + (b * c)


@triton.jit
def _rstd(ss, eps, D: tl.constexpr, BLOCK_M: tl.constexpr):
    """1 / sqrt(ss / D + eps) of rows with sum of squares (or of squared deviations) ss [M]
    (reference.stages: each step rounded)."""
    if (D & (D - 1)) == 0:
        mean = ss * (1.0 / D)                 # exact: the same bits as ss / D for a power of two
    else:
        mean = tl.div_rn(ss, D * 1.0)
    return tl.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), tl.sqrt_rn(mean + eps))


@triton.jit
def _normed(v, mu, rstd, w, b, LAYER: tl.constexpr, HAS_BIAS: tl.constexpr, NATIVE: tl.constexpr):
    """SPEC §2 norm of values v (fp32) given the row's statistics (broadcast to v): RMSNorm
    bf16((v * rstd) * w); LayerNorm bf16(((v - mu) * rstd) * w (+ b)) (kvfuse.reference.rmsnorm /
    layernorm). Unused arguments of the other kind are ignored (any tensor)."""
    if LAYER:
        v = v - mu
    t = (v * rstd) * w
    if HAS_BIAS:
        t = t + b
    return round_bf16(t, NATIVE)


@triton.jit
def _load_f32(ptr, offs, mask, IS_BF16: tl.constexpr, NATIVE: tl.constexpr):
    """load_f32; bf16 with native conversions: two values a 32-bit word widened by a shift and a mask
    (inline PTX), for the compiler extracted the high half first (PRMT) and then shifted it."""
    if IS_BF16 and NATIVE != NATIVE_INTEGER:
        u = tl.load(ptr.to(tl.pointer_type(tl.uint16)) + offs, mask=mask, other=0)
        w = tl.inline_asm_elementwise("shl.b32 $0, $2, 16;\n\tand.b32 $1, $2, 0xFFFF0000;", "=r,=r,r", [u],
                                      dtype=tl.uint32, is_pure=True, pack=2)
        return w.to(tl.float32, bitcast=True)
    return load_f32(ptr, offs, mask, IS_BF16)


@triton.jit
def _bf16_out_bits(v, ROUNDED: tl.constexpr):
    """The 16 bits (uint16) of fp32 values v holding bf16 values. ROUNDED (native conversions only): every value
    is an output of round_bf16's native conversion, which converted again gives the same bits (a NaN's
    included: its bf16 bits came out of that conversion); the compiler then reuses the first conversion and
    packs two values an instruction (F2FP), where the bit shift took a conversion, a shift back and a PRMT."""
    if ROUNDED:
        return v.to(tl.bfloat16).to(tl.uint16, bitcast=True)
    return bf16_bits(v)


@triton.jit
def _store_bf16(ptr, offs, v, mask, ROUNDED: tl.constexpr = False):
    tl.store(ptr.to(tl.pointer_type(tl.uint16)) + offs, _bf16_out_bits(v, ROUNDED), mask=mask)


@triton.jit
def _store_bf16_bytes(ptr, base, col, v, mask, ALIGN: tl.constexpr):
    """bf16 values v at ptr + base + 2 * col: 16-bit stores when base is even, else byte pairs (the bits by
    a shift: with _bf16_out_bits' conversion the FlashMLA tails took a few instructions more)."""
    bits = bf16_bits(v)
    if ALIGN % 2 == 0:
        tl.store((ptr + base).to(tl.pointer_type(tl.uint16)) + col, bits, mask=mask)
    else:
        b32 = bits.to(tl.uint32)
        tl.store(ptr + base + 2 * col, (b32 & 0xFF).to(tl.uint8), mask=mask)
        tl.store(ptr + base + 2 * col + 1, (b32 >> 8).to(tl.uint8), mask=mask)


@triton.jit
def _store_u32_bytes(ptr, addr, v, mask, ALIGN: tl.constexpr):
    """uint32 v at ptr + addr: one 32-bit store when addr is 4-aligned, else 4 bytes (little-endian)."""
    if ALIGN % 4 == 0:
        tl.store(ptr.to(tl.pointer_type(tl.uint32)) + (addr >> 2), v, mask=mask)
    else:
        for i in tl.static_range(4):
            tl.store(ptr + addr + i, ((v >> (8 * i)) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def _emit(y, tok, head, rmask, ok, qbase, sfbase, tailbase,
          out_ptr, so_n, so_h, q_ptr, sq_n, sq_h, sf_ptr, ss_n, ss_h, cache_ptr,
          C0: tl.constexpr, SKIP0: tl.constexpr, SKIP1: tl.constexpr, BLOCK_M: tl.constexpr, NGR: tl.constexpr, GV: tl.constexpr, VEC: tl.constexpr,
          G: tl.constexpr, D: tl.constexpr, CAST: tl.constexpr, SF: tl.constexpr, FMAX: tl.constexpr, DQ: tl.constexpr,
          OUT_STAGE: tl.constexpr, DEST: tl.constexpr, NATIVE: tl.constexpr,
          QALIGN: tl.constexpr, SFALIGN: tl.constexpr, TALIGN: tl.constexpr, FLOOR_E: tl.constexpr,
          ROUNDED: tl.constexpr):
    """Everything after the transform for a tile in group form: y [M, NGR, GV, VEC] (bf16 values
    in fp32, ROUNDED: all of them outputs of a native round_bf16 (_bf16_out_bits); a group is GV * VEC = G
    consecutive columns) holding the consecutive columns C0,
    C0 + 1, ... (C0 a multiple of G); it writes the columns < D outside [SKIP0, SKIP1) and the
    scales of the groups that start outside it (another tile writes the rest). Masks are functions
    of the column index, so that the compiler sees them constant along a vector (vector stores)."""
    # built by broadcasting aranges (not by a reshape) so that every Triton version sees the columns
    # contiguous along VEC and aligned, and vectorizes the stores
    col = C0 + _grid3(NGR, GV, VEC)
    gidx = C0 // G + tl.arange(0, NGR)
    own = (col < D) & ((col < SKIP0) | (col >= SKIP1))
    gown = (gidx * G < SKIP0) | (gidx * G >= SKIP1)
    cm = own[None, :, :, :]
    r4 = rmask[:, None, None, None]
    if OUT_STAGE == STAGE_TRANSFORM:
        _store_bf16(out_ptr, (tok * so_n + head * so_h)[:, None, None, None] + col[None, :, :, :], y, r4 & cm,
                    ROUNDED)
    if CAST != CAST_NONE:
        amax = tl.maximum(tl.max(tl.max(tl.abs(y), axis=3), axis=2), 1e-4)     # [M, NGR]
        m, d, stored = group_scales(amax, FMAX, SF, NATIVE, FLOOR_E)
        # SPEC §2 clamps t to [-FMAX, FMAX]; both encoders saturate, so the clamp changes no byte for
        # finite inputs (non-finite inputs may give any values in their own group) and is left out
        t = y * m[:, :, None, None]
        if CAST == CAST_E4M3:
            # the unguarded native encode only where the codes are just stored: decoded again for
            # cast_back it gave wrong bf16 values on the H200 (Triton 3.6; docs/design.md)
            ENC: tl.constexpr = (NATIVE_GUARDED if (NATIVE == NATIVE_UNGUARDED and OUT_STAGE == STAGE_CAST_BACK)
                                 else NATIVE)
            code = encode_e4m3(t, ENC)
            if OUT_STAGE == STAGE_CAST_BACK:
                qf = decode_e4m3(code)
        else:
            code = encode_e2m1(t)
            if OUT_STAGE == STAGE_CAST_BACK:
                qf = decode_e2m1(code)
        if OUT_STAGE == STAGE_CAST_BACK:
            back = round_bf16(qf * d[:, :, None, None], NATIVE)
            _store_bf16(out_ptr, (tok * so_n + head * so_h)[:, None, None, None] + col[None, :, :, :],
                        tl.where((col < DQ)[None, :, :, :], back, y), r4 & cm, ROUNDED)
        qown = own & (col < DQ)                                      # [NGR, GV, VEC]
        g1 = gidx
        sm = (gown & (g1 < DQ // G))[None, :]
        if CAST == CAST_E4M3:
            qb = code
            qcol = col
            qm = qown[None, :, :, :]
        else:
            # two codes per byte, the even column in the low nibble
            lo, hi = tl.split(tl.reshape(code, [BLOCK_M, NGR, GV, VEC // 2, 2]))
            qb = (lo | (hi << 4)).to(tl.uint8)
            qcol = C0 // 2 + _grid3(NGR, GV, VEC // 2)
            # the pair's first column 2 * qcol tested as qcol against halved (even) bounds
            qm = ((qcol < D // 2) & (qcol < DQ // 2) & ((qcol < SKIP0 // 2) | (qcol >= SKIP1 // 2)))[None, :, :, :]
        if DEST == DEST_CONTIGUOUS:
            tl.store(q_ptr.to(tl.pointer_type(tl.uint8)) + (tok * sq_n + head * sq_h)[:, None, None, None]
                     + qcol[None, :, :, :], qb.to(tl.uint8), mask=r4 & qm)
            srow = (tok * ss_n + head * ss_h)[:, None] + g1[None, :]
            if SF == SF_UE8M0 or SF == SF_E4M3:
                tl.store(sf_ptr.to(tl.pointer_type(tl.uint8)) + srow, stored.to(tl.uint8), mask=rmask[:, None] & sm)
            else:
                tl.store(sf_ptr.to(tl.pointer_type(tl.uint32)) + srow, stored, mask=rmask[:, None] & sm)
        if DEST == DEST_CACHE:
            tl.store(cache_ptr + qbase[:, None, None, None] + qcol[None, :, :, :], qb.to(tl.uint8),
                     mask=ok[:, None, None, None] & qm)
            if SF == SF_UE8M0 or SF == SF_E4M3:
                tl.store(cache_ptr + sfbase[:, None] + g1[None, :], stored.to(tl.uint8), mask=ok[:, None] & sm)
            else:
                _store_u32_bytes(cache_ptr, sfbase[:, None] + 4 * g1[None, :], stored, ok[:, None] & sm, SFALIGN)
            if DQ < D:
                tm = ok[:, None, None, None] & cm & (col >= DQ)[None, :, :, :]
                _store_bf16_bytes(cache_ptr, tailbase[:, None, None, None], tl.maximum(col - DQ, 0)[None, :, :, :],
                                  y, tm, TALIGN)
    elif DEST == DEST_CACHE:
        _store_bf16_bytes(cache_ptr, qbase[:, None, None, None], col[None, :, :, :], y,
                          ok[:, None, None, None] & cm, QALIGN)


@triton.jit
def _positions(pos_ptr, s_pos, tok, rmask, P, s_cs):
    """(pok [M]: the position is in [0, P) (else RoPE is the identity), csrow [M]: its cos/sin row offset)."""
    pos = tl.load(pos_ptr + tok * s_pos, mask=rmask, other=-1)
    return cs_rows(pos, rmask, P, s_cs)


@triton.jit
def cs_rows(pos, rmask, P, s_cs):
    """_positions of loaded positions (-1 where not rmask)."""
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
def _record_addresses(slot_ptr, s_slot, tok, head, rows, rmask, s_blk, data_tok, sf_tok, head_stride, data_off,
                      sf_off, tail_off, block_size, capacity, DEST: tl.constexpr, SLOT32: tl.constexpr,
                      QALIGN: tl.constexpr, SFALIGN: tl.constexpr, TALIGN: tl.constexpr):
    """(ok [M]: the row writes its record, and the byte offsets in the cache of its data, scales and
    bf16 tail); without a cache (DEST != DEST_CACHE): (rmask, rows, rows, rows), never dereferenced."""
    ok = rmask
    qbase = rows
    sfbase = rows
    tailbase = rows
    if DEST == DEST_CACHE:
        ok, blk, off = slot_block_offset(slot_ptr, s_slot, tok, rmask, block_size, capacity, SLOT32)
        base = blk * s_blk + head * head_stride
        qbase = tl.multiple_of(base + off * data_tok + data_off, QALIGN)
        sfbase = tl.multiple_of(base + off * sf_tok + sf_off, SFALIGN)
        tailbase = tl.multiple_of(base + off * data_tok + tail_off, TALIGN)
    return ok, qbase, sfbase, tailbase


@triton.jit
def _rope1_loads(x_ptr, xrow, w_ptr, b_ptr, cs_ptr, csrow, pok, col, HALF: tl.constexpr, R: tl.constexpr,
                 ROPE_OFF: tl.constexpr, NEOX: tl.constexpr, HAS_NORM: tl.constexpr, W_BF16: tl.constexpr,
                 HAS_BIAS: tl.constexpr, B_BF16: tl.constexpr, CS_BF16: tl.constexpr):
    """ROPE 1, over the whole tile [M, NV, VEC]: (first: the column is a pair's first element,
    rot_mask: the element rotates, cos, sin, the partner's x, the partner's weight and bias (x again
    where there is none))."""
    first, in_rope, rot_mask, partner, c, s = _rope1_pairs(cs_ptr, csrow, pok, col, HALF, R, ROPE_OFF, NEOX, CS_BF16)
    yp = load_f32(x_ptr, xrow[:, None, None] + partner[None, :, :], rot_mask, True)
    wp = yp
    bp = yp
    if HAS_NORM:
        wp = load_f32(w_ptr, partner, in_rope, W_BF16)
        if HAS_BIAS:
            bp = load_f32(b_ptr, partner, in_rope, B_BF16)
    return first, rot_mask, c, s, yp, wp, bp


@triton.jit
def _rope1_pairs(cs_ptr, csrow, pok, col, HALF: tl.constexpr, R: tl.constexpr, ROPE_OFF: tl.constexpr,
                 NEOX: tl.constexpr, CS_BF16: tl.constexpr):
    """ROPE 1's pairing of the columns col [NV, VEC] and the tokens' cos / sin (csrow [M] their rows,
    pok [M] in range): (first, in_rope [NV, VEC], rot_mask [M, NV, VEC], partner column, cos, sin)."""
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
    j = tl.where(in_rope, j, 0)
    partner = tl.where(in_rope, partner, 0)
    rot_mask = pok[:, None, None] & in_rope[None, :, :]
    c = load_f32(cs_ptr, csrow[:, None, None] + j[None, :, :], rot_mask, CS_BF16)
    s = load_f32(cs_ptr, csrow[:, None, None] + HALF + j[None, :, :], rot_mask, CS_BF16)
    return first, in_rope, rot_mask, partner, c, s


@triton.jit
def _pair_partner(v, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr, VEC: tl.constexpr):
    """v [A, B, C, VEC] (fp32) -> each column's partner in its pair (column ^ 1), moved by its bits (exact, NaN
    payloads and signed zeros too): sums of size-2 axes of integers, one of them zero, and selects."""
    u = tl.reshape(v.to(tl.uint32, bitcast=True), [A, B, C, VEC // 2, 2])
    k = tl.arange(0, 2)[None, None, None, None, :]
    ev = tl.sum(tl.where(k == 0, u, 0), axis=4)
    od = tl.sum(tl.where(k == 1, u, 0), axis=4)
    p = tl.where(k == 0, od[:, :, :, :, None], ev[:, :, :, :, None])
    return tl.reshape(p, [A, B, C, VEC]).to(tl.float32, bitcast=True)


@triton.jit
def _pair_dup(v, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr, VEC: tl.constexpr):
    """v [A, B, C, VEC / 2] -> [A, B, C, VEC], each value given to the two columns of its pair."""
    return tl.reshape(tl.broadcast_to(v[:, :, :, :, None], [A, B, C, VEC // 2, 2]), [A, B, C, VEC])


@triton.jit
def _rope2_loads(x_ptr, xrow, w_ptr, b_ptr, cs_ptr, csrow, pok, rmask, HALF: tl.constexpr, ROPE_OFF: tl.constexpr,
                 NEOX: tl.constexpr, HAS_NORM: tl.constexpr, W_BF16: tl.constexpr, HAS_BIAS: tl.constexpr,
                 B_BF16: tl.constexpr, CS_BF16: tl.constexpr, CAST: tl.constexpr, G: tl.constexpr, DQ: tl.constexpr,
                 VEC: tl.constexpr, BLOCK_M: tl.constexpr):
    """ROPE_SUBTILE, the sub-tile [M, NS, GS / VEC, VEC]: x, weight and bias (x again where there is
    none) of the columns c0 and of their partners c1, and the cos, sin of each c0's rotation index j.
    NEOX: c0 = the first-half columns (j = c0 - ROPE_OFF), c1 = c0 + HALF (NS = HALF / GS groups).
    Interleaved: c0 = ALL R rotated columns in column order (NS = R / GS groups), c1 = c0 ^ 1, j =
    (c0 - ROPE_OFF) >> 1: every column is rotated where it lies, with no tl.join of the pairs
    (interleaving the two halves by tl.join + reshape gave wrong bytes in multi-row programs on the
    H200, Triton 3.6); c1's values are c0's, moved within each pair (_pair_partner), and a pair's
    cos / sin are loaded once and given to both its columns (_pair_dup)."""
    GS: tl.constexpr = G if (CAST != CAST_NONE and ROPE_OFF < DQ) else 8
    if NEOX:
        jj = _grid3(HALF // GS, GS // VEC, VEC)                     # rotation index j
        c0 = ROPE_OFF + jj                                          # first-half columns
        c1 = c0 + HALF
    else:
        kk = _grid3(2 * HALF // GS, GS // VEC, VEC)                 # k = column - ROPE_OFF
        jj = kk >> 1
        c0 = ROPE_OFF + kk
        c1 = ROPE_OFF + (kk ^ 1)                                    # ROPE_OFF is even (a multiple of GS)
    ld = rmask[:, None, None, None]
    # the weights (and bias) as the x sub-tile [M, ..] (each row's lanes load them): loaded as [.., VEC] the
    # compiler spread them over the warp's lanes and shuffled them into the sub-tile's layout. Not for NEOX
    # at 8 rows a program (INDEX_MXFP4 / NVFP4 at large n): there it took 8 more registers (Triton 3.6)
    NSB: tl.constexpr = (HALF // GS) if NEOX else (2 * HALF // GS)
    WTILE: tl.constexpr = (not NEOX) or BLOCK_M <= 4
    if WTILE:
        c0m = tl.broadcast_to(c0[None, :, :, :], [BLOCK_M, NSB, GS // VEC, VEC])
        c1m = tl.broadcast_to(c1[None, :, :, :], [BLOCK_M, NSB, GS // VEC, VEC])
    else:
        c0m = c0
        c1m = c1
    xa = load_f32(x_ptr, xrow[:, None, None, None] + c0[None, :, :, :], ld, True)
    if NEOX:
        xb = load_f32(x_ptr, xrow[:, None, None, None] + c1[None, :, :, :], ld, True)
    else:
        # the partners (column ^ 1) are in the lane's own vector: moved there by their bits (a load of c0 ^ 1
        # had a layout of its own, and a shuffle between the two)
        xb = _pair_partner(xa, BLOCK_M, NSB, GS // VEC, VEC)
    wa = xa
    wb = xb
    ba = xa
    bb = xb
    if HAS_NORM:   # [M or 1, NSB, GS / VEC, VEC]
        wa = load_f32(w_ptr, c0m, c0m >= 0, W_BF16)
        if NEOX:
            wb = load_f32(w_ptr, c1m, c1m >= 0, W_BF16)
        else:
            wb = _pair_partner(wa, BLOCK_M, NSB, GS // VEC, VEC)
        if HAS_BIAS:
            ba = load_f32(b_ptr, c0m, c0m >= 0, B_BF16)
            if NEOX:
                bb = load_f32(b_ptr, c1m, c1m >= 0, B_BF16)
            else:
                bb = _pair_partner(ba, BLOCK_M, NSB, GS // VEC, VEC)
        if not WTILE:
            wa = wa[None, :, :, :]
            wb = wb[None, :, :, :]
            if HAS_BIAS:
                ba = ba[None, :, :, :]
                bb = bb[None, :, :, :]
    pm = pok[:, None, None, None]
    if NEOX:
        c = load_f32(cs_ptr, csrow[:, None, None, None] + jj[None, :, :, :], pm, CS_BF16)
        s = load_f32(cs_ptr, csrow[:, None, None, None] + HALF + jj[None, :, :, :], pm, CS_BF16)
    else:
        # a pair's cos / sin loaded once (VEC / 2 consecutive values, the layout of the pairs of the lane's
        # vector) and given to both columns: loaded per column (jj = kk >> 1, no two consecutive) they had a
        # layout of their own and the rotation a shuffle into it and out
        j2 = _grid3(2 * HALF // GS, GS // VEC, VEC // 2)
        c = _pair_dup(load_f32(cs_ptr, csrow[:, None, None, None] + j2[None, :, :, :], pm, CS_BF16),
                      BLOCK_M, NSB, GS // VEC, VEC)
        s = _pair_dup(load_f32(cs_ptr, csrow[:, None, None, None] + HALF + j2[None, :, :, :], pm, CS_BF16),
                      BLOCK_M, NSB, GS // VEC, VEC)
    return xa, xb, wa, wb, ba, bb, c, s


# --------------------------------------------------------------------------- the fused kernel
@triton.jit
def fused_rows(
    pid,                                      # the program's index among this call's programs
    x_ptr, sx_n, sx_h,                        # x bf16 [n, H, D], stride(-1) == 1
    w_ptr, b_ptr, eps,                        # norm weight, LayerNorm bias [D] (bf16 or fp32)
    pos_ptr, s_pos, cs_ptr, s_cs, P,          # positions [n]; cos_sin [P, R]
    had_scale,
    out_ptr, so_n, so_h,                      # bf16 [n, H, D] (stage copy / result)
    q_ptr, sq_n, sq_h, sf_ptr, ss_n, ss_h,    # contiguous q [n, H, qbytes], sf [n, H, DQ / G]
    slot_ptr, s_slot,                         # slot_mapping [n]
    cache_ptr, s_blk, data_tok, sf_tok, head_stride, data_off, sf_off, tail_off, block_size, capacity,
    n_rows, H,
    D: tl.constexpr, BLOCK_D: tl.constexpr, LOG2_BLOCK_D: tl.constexpr, VEC: tl.constexpr, BLOCK_M: tl.constexpr,
    ONE_HEAD: tl.constexpr, ROWS32: tl.constexpr,
    HAS_NORM: tl.constexpr, W_BF16: tl.constexpr, LAYER: tl.constexpr, HAS_BIAS: tl.constexpr,
    B_BF16: tl.constexpr,
    ROPE: tl.constexpr, R: tl.constexpr, ROPE_OFF: tl.constexpr, NEOX: tl.constexpr, CONJ: tl.constexpr,
    CS_BF16: tl.constexpr,
    HAS_HAD: tl.constexpr,
    CAST: tl.constexpr, G: tl.constexpr, SF: tl.constexpr, FMAX: tl.constexpr, DQ: tl.constexpr,
    OUT_STAGE: tl.constexpr, DEST: tl.constexpr, NATIVE: tl.constexpr,
    SLOT32: tl.constexpr, QALIGN: tl.constexpr, SFALIGN: tl.constexpr, TALIGN: tl.constexpr,
    EARLY: tl.constexpr, FLOOR_E: tl.constexpr,
):
    """ROPE: ROPE_NONE off; ROPE_TILE on the whole tile (each rotated element computed from itself
    and its partner, reloaded and renormalized: the same arithmetic gives the same bits); ROPE_SUBTILE
    on a separate sub-tile of the R rotated columns (the main tile skips them; needs the rotated columns
    to be whole quantization groups, or outside the quantized part, and no Hadamard). LAYER: the norm
    is LayerNorm (HAS_BIAS: with a bias), else RMSNorm. A stage copy of the norm (STAGE_NORM) with
    RoPE is stored last, after a barrier, because the RoPE reloads x and `out` may be x (in place).
    The rows of program ``pid``: rows [pid * BLOCK_M, (pid + 1) * BLOCK_M) of the n * H rows (fused_kernel,
    and each member of kvfuse/kernels/grouped.py)."""
    LOG2_VEC: tl.constexpr = 3 if VEC == 8 else 2
    NV: tl.constexpr = BLOCK_D // VEC
    rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < n_rows
    if ONE_HEAD:
        tok = rows
        head = rows * 0
    elif ROWS32:
        r32 = rows.to(tl.int32)                 # n_rows < 2**31 (chosen on the host)
        tok32 = r32 // H
        tok = tok32.to(tl.int64)
        head = (r32 - tok32 * H).to(tl.int64)
    else:
        tok = rows // H
        head = rows - tok * H
    col = tl.arange(0, NV)[:, None] * VEC + tl.arange(0, VEC)[None, :]       # [NV, VEC]
    cmask = col < D
    m3 = rmask[:, None, None] & cmask[None, :, :]
    xrow = tok * sx_n + head * sx_h
    # x and the norm weights of the main tile widened by _load_f32's shift and mask in programs of 2 to 4 rows
    # (Triton 3.6 offline: fewer instructions everywhere, but more registers, past an allocation step, for
    # one-row programs and at 8 rows; likewise for the RoPE sub-tile's loads), and x only where every value
    # goes into arithmetic (a norm or a Hadamard): where some are stored as they are loaded, the compiler
    # folds the plain widening and its narrowing away
    WNAT: tl.constexpr = NATIVE if (BLOCK_M >= 2 and BLOCK_M <= 4) else NATIVE_INTEGER
    XNAT: tl.constexpr = WNAT if (HAS_NORM or HAS_HAD) else NATIVE_INTEGER
    x = _load_f32(x_ptr, xrow[:, None, None] + col[None, :, :], m3, True, XNAT)    # [M, NV, VEC]
    y = x

    # ---- the loads that do not depend on x's values. EARLY (one-row programs): issued up front, so
    # that their latency (and the positions -> cos/sin chain) overlaps the norm's tree, which halves
    # the time beyond the launch at decode sizes. Else where they are used: issued up front they
    # raise the register count of multi-row programs (104 vs 64 for MAIN_FP8 at BLOCK_M 2), which
    # costs more in occupancy at large n than it saves in latency (docs/performance.md).
    HALF: tl.constexpr = R // 2
    if EARLY:
        if HAS_NORM:
            w = load_f32(w_ptr, col, cmask, W_BF16)
            bias = w
            if HAS_BIAS:
                bias = load_f32(b_ptr, col, cmask, B_BF16)
        if ROPE != ROPE_NONE:
            pok, csrow = _positions(pos_ptr, s_pos, tok, rmask, P, s_cs)
        ok, qbase, sfbase, tailbase = _record_addresses(
            slot_ptr, s_slot, tok, head, rows, rmask, s_blk, data_tok, sf_tok, head_stride, data_off, sf_off,
            tail_off, block_size, capacity, DEST, SLOT32, QALIGN, SFALIGN, TALIGN)
        if ROPE == ROPE_TILE:
            first, rot_mask, c, s, yp, wp, bp = _rope1_loads(x_ptr, xrow, w_ptr, b_ptr, cs_ptr, csrow, pok, col, HALF,
                                                             R, ROPE_OFF, NEOX, HAS_NORM, W_BF16, HAS_BIAS, B_BF16,
                                                             CS_BF16)
        if ROPE == ROPE_SUBTILE:
            xa, xb, wa, wb, ba, bb, c, s = _rope2_loads(x_ptr, xrow, w_ptr, b_ptr, cs_ptr, csrow, pok, rmask, HALF,
                                                        ROPE_OFF, NEOX, HAS_NORM, W_BF16, HAS_BIAS, B_BF16, CS_BF16,
                                                        CAST, G, DQ, VEC, BLOCK_M)

    # ---- RMSNorm / LayerNorm (mu: the LayerNorm mean; RMSNorm leaves it unused)
    if HAS_NORM:
        if LAYER:
            mu = _tree_sum(x, BLOCK_M, NV, LOG2_BLOCK_D - LOG2_VEC, VEC, LOG2_VEC, NATIVE == NATIVE_INTEGER)
            if (D & (D - 1)) == 0:
                mu = mu * (1.0 / D)           # exact: the same bits as mu / D for a power of two
            else:
                mu = tl.div_rn(mu, D * 1.0)
            dev = tl.where(m3, x - mu[:, None, None], 0.0)   # the tree's zero padding stays zero
            ss = _tree_sum(dev * dev, BLOCK_M, NV, LOG2_BLOCK_D - LOG2_VEC, VEC, LOG2_VEC, NATIVE == NATIVE_INTEGER)
        else:
            ss = _tree_sum(x * x, BLOCK_M, NV, LOG2_BLOCK_D - LOG2_VEC, VEC, LOG2_VEC, NATIVE == NATIVE_INTEGER)
            mu = ss
        rstd = _rstd(ss, eps, D, BLOCK_M)
        if not EARLY:
            # loaded as the tile [M, NV, VEC] (each row's lanes load the weights; the tile's layout puts rows on
            # lanes first): loaded as [NV, VEC] the compiler spread them over the warp's lanes and shuffled them
            # into the tile's layout
            wcol = tl.broadcast_to(col[None, :, :], [BLOCK_M, NV, VEC])
            wmask = tl.broadcast_to(cmask[None, :, :], [BLOCK_M, NV, VEC])
            w = _load_f32(w_ptr, wcol, wmask, W_BF16, WNAT)
            bias = w
            if HAS_BIAS:
                bias = _load_f32(b_ptr, wcol, wmask, B_BF16, WNAT)
        else:
            w = w[None, :, :]
            bias = bias[None, :, :]
        y = _normed(x, mu[:, None, None], rstd[:, None, None], w, bias, LAYER, HAS_BIAS, NATIVE)
        if OUT_STAGE == STAGE_NORM:
            if ROPE == ROPE_NONE:
                _store_bf16(out_ptr, (tok * so_n + head * so_h)[:, None, None] + col[None, :, :], y, m3,
                            NATIVE != NATIVE_INTEGER)
            else:
                ynorm = y                     # stored last: RoPE reads x again, and out may be x

    if not EARLY:
        if ROPE != ROPE_NONE:
            pok, csrow = _positions(pos_ptr, s_pos, tok, rmask, P, s_cs)
        if ROPE == ROPE_TILE:
            first, rot_mask, c, s, yp, wp, bp = _rope1_loads(x_ptr, xrow, w_ptr, b_ptr, cs_ptr, csrow, pok, col, HALF,
                                                             R, ROPE_OFF, NEOX, HAS_NORM, W_BF16, HAS_BIAS, B_BF16,
                                                             CS_BF16)
    if ROPE == ROPE_TILE:
        if HAS_NORM:
            yp = _normed(yp, mu[:, None, None], rstd[:, None, None], wp[None, :, :], bp[None, :, :], LAYER, HAS_BIAS,
                         NATIVE)
        firstb = first[None, :, :]
        r0, r1 = _rotate(tl.where(firstb, y, yp), tl.where(firstb, yp, y), c, s, CONJ)
        y = tl.where(rot_mask, round_bf16(tl.where(firstb, r0, r1), NATIVE), y)

    # ---- Hadamard: butterflies at distance 1, 2, 4, ...; each level sums a size-2 axis
    if HAS_HAD:
        h = tl.reshape(y, [BLOCK_M, BLOCK_D])
        sgn = tl.where(tl.arange(0, 2) == 0, 1.0, -1.0)[None, None, :, None]
        first2 = (tl.arange(0, 2) == 0)[None, None, :, None]
        for lvl in tl.static_range(LOG2_BLOCK_D):
            v4 = tl.reshape(h, [BLOCK_M, BLOCK_D >> (lvl + 1), 2, 1 << lvl])
            if NATIVE == NATIVE_INTEGER:      # the interpreter: exact signed zeros (see _pair_sum)
                a, b = tl.split(tl.permute(v4, (0, 1, 3, 2)))
                plus = a + b
                minus = a - b
            else:
                plus = tl.sum(v4, axis=2)
                minus = tl.sum(v4 * sgn, axis=2)
            h = tl.reshape(tl.where(first2, plus[:, :, None, :], minus[:, :, None, :]), [BLOCK_M, BLOCK_D])
        y = tl.reshape(round_bf16(h * had_scale, NATIVE), [BLOCK_M, NV, VEC])

    if not EARLY:
        ok, qbase, sfbase, tailbase = _record_addresses(
            slot_ptr, s_slot, tok, head, rows, rmask, s_blk, data_tok, sf_tok, head_stride, data_off, sf_off,
            tail_off, block_size, capacity, DEST, SLOT32, QALIGN, SFALIGN, TALIGN)

    # ---- outputs: the main tile (without the sub-tile's columns under ROPE_SUBTILE). RND: every value stored
    # as bf16 came out of a native round_bf16 (the norm's, the Hadamard's; the RoPE's where it rotates), so
    # the stores may convert again (_bf16_out_bits); without them some columns are x's own bits
    RND: tl.constexpr = NATIVE != NATIVE_INTEGER and (HAS_NORM or HAS_HAD)
    # without a cast the group is the lane's vector: a wider group would make the store's layout hold
    # G / VEC vectors a lane, a shuffle of the whole tile from the one the values are computed in
    GE: tl.constexpr = G if CAST != CAST_NONE else VEC
    NG: tl.constexpr = BLOCK_D // GE
    GV: tl.constexpr = GE // VEC
    SKIP0: tl.constexpr = ROPE_OFF if ROPE == ROPE_SUBTILE else 0
    SKIP1: tl.constexpr = ROPE_OFF + R if ROPE == ROPE_SUBTILE else 0
    _emit(tl.reshape(y, [BLOCK_M, NG, GV, VEC]), tok, head, rmask, ok, qbase,
          sfbase, tailbase, out_ptr, so_n, so_h, q_ptr, sq_n, sq_h, sf_ptr, ss_n, ss_h, cache_ptr,
          0, SKIP0, SKIP1, BLOCK_M, NG, GV, VEC, GE, D, CAST, SF, FMAX, DQ, OUT_STAGE, DEST, NATIVE, QALIGN, SFALIGN, TALIGN, FLOOR_E, RND)

    # ---- ROPE_SUBTILE: the R rotated columns as their own tile [M, R / GS, GS / VEC, VEC] (two halves for NEOX)
    if ROPE == ROPE_SUBTILE:
        GS: tl.constexpr = G if (CAST != CAST_NONE and ROPE_OFF < DQ) else 8
        NS: tl.constexpr = HALF // GS
        GSV: tl.constexpr = GS // VEC
        if not EARLY:
            xa, xb, wa, wb, ba, bb, c, s = _rope2_loads(x_ptr, xrow, w_ptr, b_ptr, cs_ptr, csrow, pok, rmask, HALF,
                                                        ROPE_OFF, NEOX, HAS_NORM, W_BF16, HAS_BIAS, B_BF16, CS_BF16,
                                                        CAST, G, DQ,VEC, BLOCK_M)
        pm = pok[:, None, None, None]
        a = xa
        b = xb
        if HAS_NORM:
            mu4 = mu[:, None, None, None]
            r4 = rstd[:, None, None, None]
            a = _normed(a, mu4, r4, wa, ba, LAYER, HAS_BIAS, NATIVE)
            b = _normed(b, mu4, r4, wb, bb, LAYER, HAS_BIAS, NATIVE)
        if NEOX:
            r0, r1 = _rotate(a, b, c, s, CONJ)
            r0 = tl.where(pm, round_bf16(r0, NATIVE), a)
            r1 = tl.where(pm, round_bf16(r1, NATIVE), b)
            _emit(r0, tok, head, rmask, ok, qbase, sfbase,
                  tailbase, out_ptr, so_n, so_h, q_ptr, sq_n, sq_h, sf_ptr, ss_n, ss_h, cache_ptr,
                  ROPE_OFF, 0, 0, BLOCK_M, NS, GSV, VEC, GS, D, CAST, SF, FMAX, DQ, OUT_STAGE, DEST, NATIVE, QALIGN, SFALIGN, TALIGN, FLOOR_E, RND)
            _emit(r1, tok, head, rmask, ok, qbase,
                  sfbase, tailbase, out_ptr, so_n, so_h, q_ptr, sq_n, sq_h, sf_ptr, ss_n, ss_h, cache_ptr,
                  ROPE_OFF + HALF, 0, 0, BLOCK_M, NS, GSV, VEC, GS, D, CAST, SF, FMAX, DQ, OUT_STAGE, DEST, NATIVE, QALIGN, SFALIGN, TALIGN, FLOOR_E, RND)
        else:
            # every rotated column where it lies: a = its own value, b = its partner's (c0 ^ 1)
            NS2: tl.constexpr = 2 * NS
            kk = _grid3(NS2, GSV, VEC)
            firstc = ((kk & 1) == 0)[None, :, :, :]
            r0, r1 = _rotate(tl.where(firstc, a, b), tl.where(firstc, b, a), c, s, CONJ)
            rr = tl.where(pm, round_bf16(tl.where(firstc, r0, r1), NATIVE), a)
            _emit(rr, tok, head, rmask, ok,
                  qbase, sfbase, tailbase, out_ptr, so_n, so_h, q_ptr, sq_n, sq_h, sf_ptr, ss_n, ss_h, cache_ptr,
                  ROPE_OFF, 0, 0, BLOCK_M, NS2, GSV, VEC, GS, D, CAST, SF, FMAX, DQ, OUT_STAGE, DEST, NATIVE, QALIGN, SFALIGN, TALIGN, FLOOR_E, RND)

    # ---- the norm's stage copy under RoPE: after every read of x (out may be x), all threads past them
    if OUT_STAGE == STAGE_NORM and ROPE != ROPE_NONE:
        tl.debug_barrier()
        _store_bf16(out_ptr, (tok * so_n + head * so_h)[:, None, None] + col[None, :, :], ynorm, m3,
                    NATIVE != NATIVE_INTEGER)



@triton.jit(do_not_specialize=["n_rows", "P", "capacity"])
def fused_kernel(
    x_ptr, sx_n, sx_h,                        # x bf16 [n, H, D], stride(-1) == 1
    w_ptr, b_ptr, eps,                        # norm weight, LayerNorm bias [D] (bf16 or fp32)
    pos_ptr, s_pos, cs_ptr, s_cs, P,          # positions [n]; cos_sin [P, R]
    had_scale,
    out_ptr, so_n, so_h,                      # bf16 [n, H, D] (stage copy / result)
    q_ptr, sq_n, sq_h, sf_ptr, ss_n, ss_h,    # contiguous q [n, H, qbytes], sf [n, H, DQ / G]
    slot_ptr, s_slot,                         # slot_mapping [n]
    cache_ptr, s_blk, data_tok, sf_tok, head_stride, data_off, sf_off, tail_off, block_size, capacity,
    n_rows, H,
    D: tl.constexpr, BLOCK_D: tl.constexpr, LOG2_BLOCK_D: tl.constexpr, VEC: tl.constexpr, BLOCK_M: tl.constexpr,
    ONE_HEAD: tl.constexpr, ROWS32: tl.constexpr,
    HAS_NORM: tl.constexpr, W_BF16: tl.constexpr, LAYER: tl.constexpr, HAS_BIAS: tl.constexpr,
    B_BF16: tl.constexpr,
    ROPE: tl.constexpr, R: tl.constexpr, ROPE_OFF: tl.constexpr, NEOX: tl.constexpr, CONJ: tl.constexpr,
    CS_BF16: tl.constexpr,
    HAS_HAD: tl.constexpr,
    CAST: tl.constexpr, G: tl.constexpr, SF: tl.constexpr, FMAX: tl.constexpr, DQ: tl.constexpr,
    OUT_STAGE: tl.constexpr, DEST: tl.constexpr, NATIVE: tl.constexpr,
    SLOT32: tl.constexpr, QALIGN: tl.constexpr, SFALIGN: tl.constexpr, TALIGN: tl.constexpr,
    EARLY: tl.constexpr, FLOOR_E: tl.constexpr, PDL: tl.constexpr,
):
    """One program per BLOCK_M rows of x's n * H (token, head) rows (fused_rows). PDL (launched with
    programmatic dependent launch): wait for the previous kernel on the stream before the first
    read. No early launch_dependents (a grid of many programs would hand SMs to the next kernel
    before its own later waves run; see kvfuse/kernels/qkv.py); the trigger at exit remains."""
    if PDL:
        gdc_wait()
    fused_rows(tl.program_id(0), x_ptr, sx_n, sx_h, w_ptr, b_ptr, eps, pos_ptr, s_pos, cs_ptr, s_cs, P,
               had_scale, out_ptr, so_n, so_h, q_ptr, sq_n, sq_h, sf_ptr, ss_n, ss_h, slot_ptr, s_slot,
               cache_ptr, s_blk, data_tok, sf_tok, head_stride, data_off, sf_off, tail_off, block_size,
               capacity, n_rows, H, D, BLOCK_D, LOG2_BLOCK_D, VEC, BLOCK_M, ONE_HEAD, ROWS32, HAS_NORM, W_BF16,
               LAYER, HAS_BIAS, B_BF16, ROPE, R, ROPE_OFF, NEOX, CONJ, CS_BF16, HAS_HAD, CAST, G, SF, FMAX, DQ,
               OUT_STAGE, DEST, NATIVE, SLOT32, QALIGN, SFALIGN, TALIGN, EARLY, FLOOR_E)


# --------------------------------------------------------------------------- launch configuration
# triton.jit chose between compiling and interpreting when this module was imported
INTERPRET = _backend.interpreter_enabled()
DIRECT_LAUNCH = direct_launch_supported(INTERPRET)   # see kvfuse/kernels/launcher.py
# the Gluon fast paths that are on (kvfuse/kernels/gluon/__init__.py: the registry and the protocol)
FAST_PATHS = () if INTERPRET else tuple(m for m in FAST_PATH_MODULES if m.enabled())
GLUON = bool(FAST_PATHS)
# the launch path is hot: plain-Python helpers (triton.next_power_of_2 costs microseconds a call)
# 0: integer narrowing helpers on the GPU too (a diagnostic: the bytes must not change); 1: native
# conversions; 2: native, and the e4m3 encode without its signed-zero guard
_NATIVE_CASTS = int(os.environ.get("KVFUSE_NATIVE_CASTS", "2"))


def next_pow2(v: int) -> int:
    return 1 << max(v - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)

class _ForcedConfig(threading.local):
    cfg = None  # a class default: reading it costs no AttributeError in threads that never forced


_force = _ForcedConfig()
# row and slot arithmetic runs in int32 below this bound (tests lower it to exercise the int64 paths)
_INT32_LIMIT = 2 ** 31


@contextlib.contextmanager
def force_config(block_m: int = None, num_warps: int = None, vec: int = None, heads: int = None):
    """Force rows per program / warps per program / vector width, and the GQA kernel's heads per program
    (tests of launch-configuration invariance)."""
    prev = _force.cfg
    _force.cfg = (block_m, num_warps, vec, heads)
    try:
        yield
    finally:
        _force.cfg = prev


class FastPathChoice:
    """What ``fast_paths`` chose for this thread (None fields: the library's own choice), and
    ``fast_calls``: how many calls inside the block a fast path ran (its per-call guard passed)."""

    __slots__ = ("only", "min_rows", "launch_table", "fast_calls")

    def __init__(self, only, min_rows, launch_table):
        self.only, self.min_rows, self.launch_table, self.fast_calls = only, min_rows, launch_table, 0


class _FastPathOverride(threading.local):
    choice = None  # a class default, as _ForcedConfig.cfg


_fast_override = _FastPathOverride()


@contextlib.contextmanager
def fast_paths(only=None, min_rows: int = None, launch_table=None):
    """Route this thread's calls inside the block (tools and tests; other threads are unaffected):

    - ``only``: a module of FAST_PATH_MODULES or a sequence of them: the fast paths that may take a
      call, in that order, whether or not they are enabled (KVFUSE_GLUON, KVFUSE_GLUON_SKIP); ``()``:
      the portable kernel only. None: the enabled ones, as outside the block.
    - ``min_rows``: replaces every module's MIN_ROWS (1: decode sizes too).
    - ``launch_table``: a function n_rows -> (num_warps, rows, pipeline) that replaces the modules'
      ``launch_table`` (a launch variant under test or being timed).

    Yields a FastPathChoice whose ``fast_calls`` counts the calls a fast path ran. Inside the block
    every launch is computed per call and none is kept for the signature (so a choice never leaks
    into later calls); such launches go through Triton's own launcher, which changes host time,
    not GPU time. force_config still means the portable kernel."""
    if only is not None:
        only = (only,) if only in FAST_PATH_MODULES else only
        if not isinstance(only, (tuple, list)) or any(m not in FAST_PATH_MODULES for m in only):
            raise ValueError(f"fast_paths(only=...) takes modules of FAST_PATH_MODULES, got {only!r}")
        only = tuple(only)
    if min_rows is not None and (type(min_rows) is not int or min_rows < 1):
        raise ValueError(f"fast_paths(min_rows=...) must be an int >= 1, got {min_rows!r}")
    if launch_table is not None and not callable(launch_table):
        raise ValueError(f"fast_paths(launch_table=...) must be a function n_rows -> (num_warps, rows, pipeline), "
                         f"got {launch_table!r}")
    prev = _fast_override.choice
    choice = _fast_override.choice = FastPathChoice(only, min_rows, launch_table)
    try:
        yield choice
    finally:
        _fast_override.choice = prev


def plain_launch_table(block_d: int, cast_fmt=None) -> tuple:
    """The compiled kernel's launch table for a tile width: ((first n_rows, (BLOCK_M, num_warps)), ...)
    (see launch_config; gluon.common.table_entry reads it)."""
    multi = min(4, max(1, 1024 // block_d))    # ~1K elements per one-warp program: 2 rows of 512, 4 of 128
    table = ((1, (1, 1)), (513, (multi, 1)))   # decode sizes: as many one-warp programs as rows
    if cast_fmt == "e2m1" and block_d <= 128:
        table += ((16384, (8, 1)),)            # at 4096 rows 8 left too few programs: 4.4 vs 4.0 us (INDEX_MXFP4)
    return table


def launch_config(n_rows: int, head_dim: int, block_d: int, interpret: bool, cast_fmt=None):
    """(BLOCK_M, num_warps) from a small table measured on the H200 (benchmarks/tune.py --kernel portable,
    docs/performance.md): one row per one-warp program at decode sizes; above, one-warp programs of
    ~1K elements (2 rows of 512, 1 of 576), 4 rows of 128, 8 for e2m1 from 16384 rows (whose
    encode and nibble packing leave more room between memory accesses: 8 rows measured 15-20%
    faster for INDEX_MXFP4 and INDEX_NVFP4 at n >= 65536, while 8 rows of INDEX_FP8_FP32 were 35%
    slower than 4, and at 4096 rows 8 left too few programs). The
    interpreter pays per program, so it takes many rows at once."""
    forced = _force.cfg
    if interpret:
        bm = min(next_pow2(max(n_rows, 1)), max(1, 16384 // block_d))
        nw = 4
    else:
        bm, nw = table_entry(plain_launch_table(block_d, cast_fmt), n_rows)
    if forced is not None:
        bm = forced[0] or bm
        nw = forced[1] or nw
    return bm, nw


def _native(interpret: bool) -> int:
    """Native conversions on the GPU (exact there); never in the interpreter (wrong there)."""
    return NATIVE_INTEGER.value if interpret else _NATIVE_CASTS


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def rope_mode(plan: Plan) -> int:
    """ROPE_NONE without RoPE; ROPE_SUBTILE (the rotated columns as a separate sub-tile) when they are
    whole quantization groups (or outside the quantized part, or there is no cast) and no Hadamard
    follows; else ROPE_TILE (rotation on the whole tile). As the int the launch passes."""
    if plan.positions is None:
        return ROPE_NONE.value
    if plan.hadamard_scale is not None:
        return ROPE_TILE.value
    off, half = plan.rope_offset, plan.rotary_dim // 2
    quantized = plan.cast is not None and off < plan.quant_dim
    gs = plan.cast.group if quantized else 8
    fits = half % gs == 0 and _pow2(half // gs) and off % gs == 0
    if quantized and off + plan.rotary_dim > plan.quant_dim:
        fits = False
    return ROPE_SUBTILE.value if fits else ROPE_TILE.value


def vec_width(plan: Plan, data_align: int) -> int:
    """Columns per lane vector: 8 (16-byte bf16 loads), or 4 when the cache's data records are only
    4-byte aligned and 8 codes would not leave in one store."""
    if plan.kv_cache is None:
        return 8
    bytes_per_8 = 16 if plan.cast is None else (8 if plan.cast.cast_fmt == "e4m3" else 4)
    return 8 if data_align >= bytes_per_8 else 4


def _align(*vals: int) -> int:
    """The largest power of two <= 16 dividing every value (0 divides by anything)."""
    a = 16
    for v in vals:
        while v % a:
            a //= 2
    return a


def record_alignments(plan: Plan) -> tuple:
    """(data, scales, tail) byte alignments of every record address of the plan's cache: the base
    pointer and every stride and offset an address is built from (1, 1, 1 without a cache). The
    kernel tells the compiler (tl.multiple_of) and widens its stores to match. The pointer's part
    makes the launch depend on data_ptr() % 16, which kvfuse.plans.cache keys the plan cache by."""
    cache, a = plan.kv_cache, plan.addressing
    if cache is None:
        return 1, 1, 1
    base = (cache.data_ptr() % 16, cache.stride(0), a.head_stride if cache.shape[2] > 1 else 0)
    return (_align(*base, a.data_token_stride, a.data_offset), _align(*base, a.sf_token_stride, a.sf_offset),
            _align(*base, a.data_token_stride, a.tail_offset))


# --------------------------------------------------------------------------- launches
def fused_args(plan: Plan, tensor) -> tuple:
    """(grid, positional args, keyword args) of the fused kernel for ``plan``: the kernel's parameter
    table, in its order. ``tensor(field)`` is what goes where the plan's tensor ``field`` goes: the
    tensor itself (run_plan) or a PlanTensor (a Launch kept for the signature)."""
    x = plan.x
    n, H, D = x.shape
    block_d = next_pow2(D)
    interpret = INTERPRET
    bm, nw = launch_config(n * H, D, block_d, interpret, plan.cast.cast_fmt if plan.cast else None)
    cast, a, cache = plan.cast, plan.addressing, plan.kv_cache

    def or_x(t):  # strides of a tensor the plan does not have: x's (x stands in for it)
        return x if t is None else t

    out, q, sf = or_x(plan.out), or_x(plan.q_out), or_x(plan.sf_out)
    qal, sfal, tal = record_alignments(plan)
    forced = _force.cfg
    vec = (forced[2] if forced is not None else None) or vec_width(plan, qal)
    cap = cache.shape[0] * cache.shape[1] if cache is not None else 0
    if cache is not None:
        dest = DEST_CACHE.value
    elif plan.q_out is not None:
        dest = DEST_CONTIGUOUS.value
    else:
        dest = DEST_NONE.value
    T = tensor
    args = (
        T("x"), x.stride(0), x.stride(1),
        T("weight"), T("bias"), plan.eps,
        T("positions"), plan.positions.stride(0) if plan.positions is not None else 0,
        T("cos_sin"), plan.cos_sin.stride(0) if plan.cos_sin is not None else 0,
        plan.cos_sin.shape[0] if plan.cos_sin is not None else 0,
        plan.hadamard_scale if plan.hadamard_scale is not None else 1.0,
        T("out"), out.stride(0), out.stride(1),
        T("q_out"), q.stride(0), q.stride(1), T("sf_out"), sf.stride(0), sf.stride(1),
        T("slot_mapping"), plan.slot_mapping.stride(0) if plan.slot_mapping is not None else 0,
        T("kv_cache"), or_x(cache).stride(0),
        a.data_token_stride if a else 0, a.sf_token_stride if a else 0, a.head_stride if a else 0,
        a.data_offset if a else 0, a.sf_offset if a else 0, a.tail_offset if a else 0,
        cache.shape[1] if cache is not None else 1, cap,
        n * H, H,
    )
    options = dict(
        D=D, BLOCK_D=block_d, LOG2_BLOCK_D=block_d.bit_length() - 1, VEC=vec, BLOCK_M=bm,
        ONE_HEAD=H == 1, ROWS32=n * H + bm < _INT32_LIMIT,
        HAS_NORM=plan.weight is not None, W_BF16=plan.weight is not None and plan.weight.dtype == torch.bfloat16,
        LAYER=plan.weight is not None and plan.norm_kind == "layer", HAS_BIAS=plan.bias is not None,
        B_BF16=plan.bias is not None and plan.bias.dtype == torch.bfloat16,
        ROPE=rope_mode(plan), R=plan.rotary_dim, ROPE_OFF=plan.rope_offset, NEOX=plan.is_neox,
        CONJ=plan.conjugate, CS_BF16=plan.cos_sin is not None and plan.cos_sin.dtype == torch.bfloat16,
        HAS_HAD=plan.hadamard_scale is not None,
        CAST=CAST_CODES[cast.cast_fmt if cast else None], G=cast.group if cast else 16,
        SF=SF_CODES[cast.sf_format] if cast else 0, FMAX=FMAX[cast.cast_fmt] if cast else 1.0,
        DQ=plan.quant_dim if cast else D,
        OUT_STAGE=STAGE_CODES[plan.out_stage], DEST=dest, NATIVE=_native(interpret),
        SLOT32=cap < _INT32_LIMIT, QALIGN=qal, SFALIGN=sfal, TALIGN=tal, EARLY=bm == 1,
        FLOOR_E=NO_FLOOR.value if cast is None or cast.floor_exp is None else cast.floor_exp, PDL=False,
        num_warps=nw, num_stages=1, enable_fp_fusion=False,
    )
    return (cdiv(n * H, bm),), args, options


def fast_path(plan: Plan, pdl: bool = False):
    """The Gluon fast-path module that takes the plan, or None: the fast paths are on (or chosen by
    ``fast_paths``), one is eligible with at least its MIN_ROWS rows (MIN_ROWS_PDL for a launch with
    programmatic dependent launch, ``pdl``), and no launch configuration of the plain kernel is being
    forced (tests of launch invariance)."""
    if _force.cfg is not None:
        return None
    choice = _fast_override.choice
    modules = FAST_PATHS if GLUON else ()
    min_rows = None
    if choice is not None:
        modules = modules if choice.only is None else choice.only
        min_rows = choice.min_rows
    rows = plan.x.shape[0] * plan.x.shape[1]
    for module in modules:
        least = min_rows if min_rows is not None else module.MIN_ROWS_PDL if pdl else module.MIN_ROWS
        if rows >= least and module.eligible(plan):
            return module
    return None


_PDL_CAPABLE = {}       # device index -> compute capability >= 9.0 (griddepcontrol: Hopper and newer)


def pdl_launch(x: torch.Tensor) -> bool:
    """Whether this call launches with programmatic dependent launch: kvfuse.set_pdl / KVFUSE_PDL on,
    compiled kernels, and x on a Hopper-or-newer GPU."""
    if INTERPRET or not _backend.pdl_enabled() or x.device.type != "cuda":
        return False
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    capable = _PDL_CAPABLE.get(index)
    if capable is None:
        capable = _PDL_CAPABLE[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return capable


def with_pdl(options: dict, pdl: bool) -> dict:
    """A kernel's keyword arguments with its PDL constexpr and Triton's launch_pdl option set."""
    return {**options, "PDL": True, "launch_pdl": True} if pdl else options


def fused_launch(plan: Plan, tensor_index: dict, num_tensors: int, pdl: bool = False) -> Launch:
    """The fused kernel's launch for ``plan``, its tensors left open (see Launch): a Gluon fast
    path where one applies (whose own precondition, e.g. x and the weight read as 4-byte words, is
    checked per call: ``Launch.guard``), else the plain kernel. ``pdl``: launched with programmatic
    dependent launch."""
    module = fast_path(plan, pdl)
    if module is not None:
        name, grid, args, options, namespace = module.plan_launch(plan, tensor_arg)
        launch = Launch(name, grid, args, with_pdl(options, pdl), tensor_index, num_tensors, namespace,
                        allow_direct=DIRECT_LAUNCH)
        check, fields = module.call_guard(plan)
        x_at = tensor_index["x"]
        launch.guard = (check, tuple(tensor_index.get(f, x_at) for f in fields))
        return launch
    grid, args, options = fused_args(plan, tensor_arg)
    return Launch("fused_kernel", grid, args, with_pdl(options, pdl), tensor_index, num_tensors, globals(),
                  allow_direct=DIRECT_LAUNCH)


def run_plan(plan: Plan, plain: bool = False) -> None:
    """Launch the fused kernel for a validated plan (n >= 1); ``plain``: never a Gluon fast path."""
    x = plan.x

    def tensor(field):  # x stands in for a tensor the plan does not have (never dereferenced)
        t = getattr(plan, field)
        return x if t is None else t

    pdl = pdl_launch(x)
    module = None if plain else fast_path(plan, pdl)
    if module is not None:
        check, fields = module.call_guard(plan)
        if not check(*(tensor(f) for f in fields)):
            module = None
    if module is not None:
        choice = _fast_override.choice
        if choice is None or choice.launch_table is None:
            name, grid, args, options, namespace = module.plan_launch(plan, tensor)
        else:
            name, grid, args, options, namespace = module.plan_launch(plan, tensor, choice.launch_table)
        namespace[name][grid](*args, **with_pdl(options, pdl))
        if choice is not None:
            choice.fast_calls += 1
        return
    grid, args, options = fused_args(plan, tensor)
    fused_kernel[grid](*args, **with_pdl(options, pdl))


def run_template(template, tensors: tuple) -> None:
    """Launch the fused kernel for one call of a validated signature (a kvfuse.plans.types.PlanTemplate):
    its launch parameters are computed on the first launch of each batch size n and kept with the
    template (recomputed, not kept, while force_config is active; inside ``fast_paths`` each call
    is launched as run_plan launches it). n = 0 launches nothing."""
    x = tensors[X]
    n = x.shape[0]
    if n == 0:
        return
    if _fast_override.choice is not None:
        run_plan(template.bind(tensors))
        return
    launches = template.launches
    pdl = pdl_launch(x)
    key = (n, True) if pdl else n
    launch = launches.get(key)
    if launch is None or _force.cfg is not None:
        launch = fused_launch(template.bind(tensors), template.tensor_index, template.num_tensors, pdl)
        if _force.cfg is None:
            if len(launches) >= LAUNCHES_PER_TEMPLATE:
                launches.clear()
            launches[key] = launch
    if not launch.run(tensors):
        # a fast path's guard failed (e.g. x or the weight not 4-byte aligned): the plain kernel, uncached
        run_plan(template.bind(tensors), plain=True)


# --------------------------------------------------------------------------- store / load
@triton.jit
def _copy_bytes(src_ptr, src_off, dst_ptr, dst_off, mask_rows, NB: tl.constexpr, BLOCK_B: tl.constexpr):
    """Copy NB bytes per row: src_ptr + src_off[m] + i -> dst_ptr + dst_off[m] + i."""
    i = tl.arange(0, BLOCK_B)
    m = mask_rows[:, None] & (i < NB)[None, :]
    v = tl.load(src_ptr + src_off[:, None] + i[None, :], mask=m, other=0)
    tl.store(dst_ptr + dst_off[:, None] + i[None, :], v, mask=m)


@triton.jit
def _record_bases(slot_ptr, s_slot, rows, rmask, H, s_blk, data_tok, sf_tok, head_stride, data_off, sf_off,
                  tail_off, block_size, capacity):
    tok = rows // H
    head = rows - tok * H
    slot = tl.load(slot_ptr + tok * s_slot, mask=rmask, other=-1).to(tl.int64)
    ok = rmask & (slot >= 0) & (slot < capacity)
    slot = tl.where(ok, slot, 0)
    blk = slot // block_size
    off = slot - blk * block_size
    base = blk * s_blk + head * head_stride
    return ok, base + off * data_tok + data_off, base + off * sf_tok + sf_off, base + off * data_tok + tail_off


@triton.jit(do_not_specialize=["n_rows", "capacity"])
def store_kernel(data_ptr, sf_ptr, tail_ptr, slot_ptr, s_slot,
                 cache_ptr, s_blk, data_tok, sf_tok, head_stride, data_off, sf_off, tail_off, block_size, capacity,
                 n_rows, H,
                 QB: tl.constexpr, BLOCK_QB: tl.constexpr, SFB: tl.constexpr, BLOCK_SFB: tl.constexpr,
                 TB: tl.constexpr, BLOCK_TB: tl.constexpr, BLOCK_M: tl.constexpr):
    """data [rows, QB], sf [rows, SFB], tail [rows, TB] (contiguous bytes) -> the records."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < n_rows
    ok, qb, sb, tb = _record_bases(slot_ptr, s_slot, rows, rmask, H, s_blk, data_tok, sf_tok, head_stride,
                                   data_off, sf_off, tail_off, block_size, capacity)
    _copy_bytes(data_ptr, rows * QB, cache_ptr, qb, ok, QB, BLOCK_QB)
    if SFB > 0:
        _copy_bytes(sf_ptr, rows * SFB, cache_ptr, sb, ok, SFB, BLOCK_SFB)
    if TB > 0:
        _copy_bytes(tail_ptr, rows * TB, cache_ptr, tb, ok, TB, BLOCK_TB)


@triton.jit(do_not_specialize=["n_rows", "capacity"])
def load_kernel(slot_ptr, s_slot, cache_ptr, s_blk, data_tok, sf_tok, head_stride, data_off, sf_off, tail_off,
                block_size, capacity, n_rows, H, out_ptr, sf_out_ptr,
                D: tl.constexpr, BLOCK_D: tl.constexpr, DQ: tl.constexpr, CAST: tl.constexpr, G: tl.constexpr,
                SF: tl.constexpr, QB: tl.constexpr, DATA_B: tl.constexpr, BLOCK_DATA_B: tl.constexpr,
                SFB: tl.constexpr, BLOCK_SFB: tl.constexpr, DEQUANT: tl.constexpr, BLOCK_M: tl.constexpr,
                NATIVE: tl.constexpr):
    """Gather records. DEQUANT: bf16 out [rows, D] (zeros for invalid slots); else raw bytes:
    out [rows, DATA_B] (quantized then tail), sf_out [rows, SFB] (zeros for invalid slots)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < n_rows
    ok, qb, sb, tb = _record_bases(slot_ptr, s_slot, rows, rmask, H, s_blk, data_tok, sf_tok, head_stride,
                                   data_off, sf_off, tail_off, block_size, capacity)
    okm = ok[:, None]
    if DEQUANT:
        cols = tl.arange(0, BLOCK_D)
        if CAST == CAST_NONE:
            lo = tl.load(cache_ptr + qb[:, None] + 2 * cols[None, :], mask=okm & (cols < D)[None, :], other=0)
            hi = tl.load(cache_ptr + qb[:, None] + 2 * cols[None, :] + 1, mask=okm & (cols < D)[None, :], other=0)
            val = ((lo.to(tl.uint32) | (hi.to(tl.uint32) << 8)) << 16).to(tl.float32, bitcast=True)
        else:
            qmask = okm & (cols < DQ)[None, :]
            # NaN codes decode as NaN (SPEC §4); numerics.decode_e4m3 (shared with the write kernels)
            # maps 0x7F / 0xFF to +-480, so the NaN is selected here
            nan = tl.full([BLOCK_M, BLOCK_D], 0x7FC00000, tl.uint32).to(tl.float32, bitcast=True)
            if CAST == CAST_E4M3:
                code = tl.load(cache_ptr + qb[:, None] + cols[None, :], mask=qmask, other=0)
                qf = tl.where((code & 0x7F) == 0x7F, nan, decode_e4m3(code))
            else:
                byte = tl.load(cache_ptr + qb[:, None] + (cols >> 1)[None, :], mask=qmask, other=0).to(tl.uint32)
                qf = decode_e2m1(tl.where((cols & 1)[None, :] == 0, byte & 0xF, byte >> 4))
            gi = tl.arange(0, BLOCK_D // G)
            gm = okm & (gi < DQ // G)[None, :]
            if SF == SF_UE8M0:
                e = tl.load(cache_ptr + sb[:, None] + gi[None, :], mask=gm, other=127).to(tl.int32)
                # byte 0: 2^-127; byte 0xFF: NaN (OCP MX), not 2^128
                d = tl.where(e == 0, 0x400000, tl.where(e == 0xFF, 0x7FC00000, e << 23)).to(tl.float32, bitcast=True)
            elif SF == SF_E4M3:
                sc = tl.load(cache_ptr + sb[:, None] + gi[None, :], mask=gm, other=0x38)
                d = tl.where((sc & 0x7F) == 0x7F, 0x7FC00000, decode_e4m3(sc).to(tl.uint32, bitcast=True))
                d = d.to(tl.float32, bitcast=True)
            else:
                u = tl.zeros([BLOCK_M, BLOCK_D // G], tl.uint32)
                for i in tl.static_range(4):
                    bt = tl.load(cache_ptr + sb[:, None] + 4 * gi[None, :] + i, mask=gm, other=0)
                    u = u | (bt.to(tl.uint32) << (8 * i))
                d = u.to(tl.float32, bitcast=True)
            v = tl.reshape(qf, [BLOCK_M, BLOCK_D // G, G]) * d[:, :, None]
            val = tl.reshape(round_bf16(v, NATIVE), [BLOCK_M, BLOCK_D])
            val = tl.where(val != val, nan, val)          # one NaN pattern (bf16 0x7FC0) on every backend
            if DQ < D:
                tail = (cols >= DQ) & (cols < D)
                tcol = tl.where(tail, cols - DQ, 0)
                lo = tl.load(cache_ptr + tb[:, None] + 2 * tcol[None, :], mask=okm & tail[None, :], other=0)
                hi = tl.load(cache_ptr + tb[:, None] + 2 * tcol[None, :] + 1, mask=okm & tail[None, :], other=0)
                tv = ((lo.to(tl.uint32) | (hi.to(tl.uint32) << 8)) << 16).to(tl.float32, bitcast=True)
                val = tl.where(tail[None, :], tv, val)
        val = tl.where(okm, val, 0.0)
        _store_bf16(out_ptr, rows[:, None] * D + cols[None, :], val, rmask[:, None] & (cols < D)[None, :])
    else:
        i = tl.arange(0, BLOCK_DATA_B)
        qpart = i < QB
        src = tl.where(qpart, qb[:, None] + i[None, :], tb[:, None] + (i - QB)[None, :])
        v = tl.load(cache_ptr + src, mask=okm & (i < DATA_B)[None, :], other=0)
        tl.store(out_ptr + rows[:, None] * DATA_B + i[None, :], v, mask=rmask[:, None] & (i < DATA_B)[None, :])
        if SFB > 0:
            k = tl.arange(0, BLOCK_SFB)
            sv = tl.load(cache_ptr + sb[:, None] + k[None, :], mask=okm & (k < SFB)[None, :], other=0)
            tl.store(sf_out_ptr + rows[:, None] * SFB + k[None, :], sv, mask=rmask[:, None] & (k < SFB)[None, :])


def _cache_geometry(kv_cache, fmt):
    a = fmt.addressing_for(kv_cache)
    return (kv_cache.stride(0), a.data_token_stride, a.sf_token_stride, a.head_stride, a.data_offset, a.sf_offset,
            a.tail_offset, kv_cache.shape[1], kv_cache.shape[0] * kv_cache.shape[1])


def _dense_bytes(t):
    """t's bytes as a dense uint8 tensor (a view when t is contiguous): the store kernel copies bytes."""
    t = t.contiguous()
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def store_launch(kv_cache, slot_mapping, fmt, payloads) -> Launch:
    """store_kernel's launch; ``payloads``: (data, sf, tail) as dense bytes, None where absent."""
    rows = slot_mapping.shape[0] * kv_cache.shape[2]
    qb, sfb, tb = (0 if p is None else p.numel() // rows for p in payloads)
    bm = 64 if INTERPRET else 8
    T = tensor_arg
    args = (T("data"), T("sf"), T("tail"), T("slot_mapping"), slot_mapping.stride(0), T("kv_cache"),
            *_cache_geometry(kv_cache, fmt), rows, kv_cache.shape[2])
    options = dict(QB=qb, BLOCK_QB=next_pow2(qb), SFB=sfb, BLOCK_SFB=next_pow2(max(sfb, 1)), TB=tb,
                   BLOCK_TB=next_pow2(max(tb, 1)), BLOCK_M=bm, num_warps=4)
    index = {name: i for i, (name, p) in enumerate(zip(("data", "sf", "tail"), payloads)) if p is not None}
    index.update(slot_mapping=3, kv_cache=4)
    return Launch("store_kernel", (cdiv(rows, bm),), args, options, index, 5, globals(), stand_in="data",
                  allow_direct=DIRECT_LAUNCH)


def store(kv_cache, slot_mapping, fmt, data, sf=None, tail=None, entry=None) -> None:
    """Triton store_kv_cache: data [n(, H), ..] (+ sf, tail) -> records (validated by the caller).
    ``entry``: the call signature's plan-cache entry, where the launch parameters are kept."""
    payloads = (_dense_bytes(data), _dense_bytes(sf) if fmt.quantized else None,
                _dense_bytes(tail) if fmt.bf16_tail else None)
    launch = None if entry is None else entry.launch
    if launch is None:
        launch = store_launch(kv_cache, slot_mapping, fmt, payloads)
        if entry is not None:
            entry.launch = launch
    launch.run(payloads + (slot_mapping, kv_cache))


def load_outputs(kv_cache, slot_mapping, fmt, dequantize: bool):
    """The new outputs of a load: (out, sf_out); sf_out is out when dequantizing."""
    n, H, dev = slot_mapping.shape[0], kv_cache.shape[2], kv_cache.device
    if dequantize:
        out = torch.empty((n, H, fmt.head_dim), dtype=torch.bfloat16, device=dev)
        return out, out
    return (torch.empty((n, H, fmt.data_bytes), dtype=torch.uint8, device=dev),
            torch.empty((n, H, fmt.sf_bytes), dtype=torch.uint8, device=dev))


def load_launch(kv_cache, slot_mapping, fmt, dequantize: bool) -> Launch:
    """load_kernel's launch; its tensors: (slot_mapping, kv_cache, out, sf_out)."""
    rows = slot_mapping.shape[0] * kv_cache.shape[2]
    interpret = INTERPRET
    D = fmt.head_dim
    block_d = next_pow2(D)
    bm = min(next_pow2(max(rows, 1)), max(1, 16384 // block_d)) if interpret else max(1, 2048 // block_d)
    np2 = next_pow2
    T = tensor_arg
    sf_out = T("sf_out") if fmt.sf_bytes else T("out")  # no scale bytes, no sf_out bytes: out stands in
    args = (T("slot_mapping"), slot_mapping.stride(0), T("kv_cache"), *_cache_geometry(kv_cache, fmt), rows,
            kv_cache.shape[2], T("out"), sf_out)
    options = dict(
        D=D, BLOCK_D=block_d, DQ=fmt.quant_dim, CAST=CAST_CODES[fmt.cast_fmt], G=fmt.elements_per_sf or 16,
        SF=SF_CODES.get(fmt.sf_format, 0), QB=fmt.quant_bytes, DATA_B=fmt.data_bytes,
        BLOCK_DATA_B=np2(fmt.data_bytes), SFB=fmt.sf_bytes, BLOCK_SFB=np2(max(fmt.sf_bytes, 1)),
        DEQUANT=dequantize, BLOCK_M=bm, NATIVE=not interpret, num_warps=4, enable_fp_fusion=False)
    index = {"slot_mapping": 0, "kv_cache": 1, "out": 2, "sf_out": 3}
    return Launch("load_kernel", (cdiv(rows, bm),), args, options, index, 4, globals(), stand_in="out",
                  allow_direct=DIRECT_LAUNCH)


def load(kv_cache, slot_mapping, fmt, dequantize: bool, entry=None):
    """Triton load_paged_kv_cache (see kvfuse.api.load_paged_kv_cache). ``entry``: the call
    signature's plan-cache entry, where the launch parameters are kept."""
    out, sf_out = load_outputs(kv_cache, slot_mapping, fmt, dequantize)
    launch = None if entry is None else entry.launch
    if launch is None:
        launch = load_launch(kv_cache, slot_mapping, fmt, dequantize)
        if entry is not None:
            entry.launch = launch
    launch.run((slot_mapping, kv_cache, out, sf_out))
    return out if dequantize else (out, sf_out)
