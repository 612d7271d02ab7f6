"""The portable kernel: any sub-chain of RMSNorm -> RoPE -> Hadamard -> cast into any destination
(bf16 out, contiguous (q, sf), cast_back, paged cache + a stage copy), one launch, on every GPU
Triton compiles for and in Triton's interpreter; and its host side: the launch table and the
parameter table (``fused_args``) of a plan.

A program owns BLOCK_M rows of the flattened [n * num_heads] rows (row = (token, head)) and
the whole head (BLOCK_D = next power of two >= head_dim, masked), held as [BLOCK_M, BLOCK_D / VEC,
VEC]; the RoPE columns can live in a sub-tile of their own (ROPE_SUBTILE). Stages and destinations
are constexpr switches of one body, ``fused_rows`` (named in kvfuse/kernels/codes.py), which
``fused_kernel`` and the grouped launch (grouped.py) run. Memory addresses are int64; row and slot
index arithmetic is int32 whenever it fits. Numerics follow SPEC §6 exactly (kvfuse/kernels/numerics.py,
blocks.py); a row's bytes never depend on BLOCK_M, VEC, num_warps, the RoPE mode or other rows.
"""
from __future__ import annotations

import inspect

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from ..formats import FMAX
from ..plans.types import Plan
from . import config
from .blocks import (grid3, load_cs_rows, load_f32_native, normed, pair_dup, pair_partner, reciprocal_std,
                     rope1_pairs, rotate, slot_block_offset, store_bf16, store_bf16_bytes, store_u32_bytes, tree_sum)
from .codes import (CAST_CODES, CAST_E4M3, CAST_NONE, DEST_CACHE, DEST_CONTIGUOUS, DEST_NONE, NATIVE_GUARDED,
                    NATIVE_INTEGER, NATIVE_UNGUARDED, NO_FLOOR, ROPE_NONE, ROPE_SUBTILE, ROPE_TILE, SF_CODES, SF_E4M3,
                    SF_UE8M0, STAGE_CAST_BACK, STAGE_CODES, STAGE_NORM, STAGE_TRANSFORM)
from .config import FORCED, cdiv, native, next_pow2
from .gluon.common import table_entry
from .numerics import decode_e2m1, decode_e4m3, encode_e2m1, encode_e4m3, group_scales, load_f32, round_bf16


# --------------------------------------------------------------------------- the tile's stages
@triton.jit
def _emit(y, tok, head, rmask, ok, qbase, sfbase, tailbase,
          out_ptr, so_n, so_h, q_ptr, sq_n, sq_h, sf_ptr, ss_n, ss_h, cache_ptr,
          C0: tl.constexpr, SKIP0: tl.constexpr, SKIP1: tl.constexpr, BLOCK_M: tl.constexpr, NGR: tl.constexpr, GV: tl.constexpr, VEC: tl.constexpr,
          G: tl.constexpr, D: tl.constexpr, CAST: tl.constexpr, SF: tl.constexpr, FMAX: tl.constexpr, DQ: tl.constexpr,
          OUT_STAGE: tl.constexpr, DEST: tl.constexpr, NATIVE: tl.constexpr,
          QALIGN: tl.constexpr, SFALIGN: tl.constexpr, TALIGN: tl.constexpr, FLOOR_E: tl.constexpr,
          ROUNDED: tl.constexpr):
    """Everything after the transform for a tile in group form: y [M, NGR, GV, VEC] (bf16 values
    in fp32, ROUNDED: all of them outputs of a native round_bf16 (bf16_out_bits); a group is GV * VEC = G
    consecutive columns) holding the consecutive columns C0,
    C0 + 1, ... (C0 a multiple of G); it writes the columns < D outside [SKIP0, SKIP1) and the
    scales of the groups that start outside it (another tile writes the rest). Masks are functions
    of the column index, so that the compiler sees them constant along a vector (vector stores)."""
    # built by broadcasting aranges (not by a reshape) so that every Triton version sees the columns
    # contiguous along VEC and aligned, and vectorizes the stores
    col = C0 + grid3(NGR, GV, VEC)
    gidx = C0 // G + tl.arange(0, NGR)
    own = (col < D) & ((col < SKIP0) | (col >= SKIP1))
    gown = (gidx * G < SKIP0) | (gidx * G >= SKIP1)
    cm = own[None, :, :, :]
    r4 = rmask[:, None, None, None]
    if OUT_STAGE == STAGE_TRANSFORM:
        store_bf16(out_ptr, (tok * so_n + head * so_h)[:, None, None, None] + col[None, :, :, :], y, r4 & cm,
                    ROUNDED)
    if CAST != CAST_NONE:
        amax = tl.maximum(tl.max(tl.max(tl.abs(y), axis=3), axis=2), 1e-4)     # [M, NGR]
        m, d, stored = group_scales(amax, FMAX, SF, NATIVE, FLOOR_E)
        # SPEC §6 clamps t to [-FMAX, FMAX]; both encoders saturate, so the clamp changes no byte for
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
            store_bf16(out_ptr, (tok * so_n + head * so_h)[:, None, None, None] + col[None, :, :, :],
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
            qcol = C0 // 2 + grid3(NGR, GV, VEC // 2)
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
                store_u32_bytes(cache_ptr, sfbase[:, None] + 4 * g1[None, :], stored, ok[:, None] & sm, SFALIGN)
            if DQ < D:
                tm = ok[:, None, None, None] & cm & (col >= DQ)[None, :, :, :]
                store_bf16_bytes(cache_ptr, tailbase[:, None, None, None], tl.maximum(col - DQ, 0)[None, :, :, :],
                                  y, tm, TALIGN)
    elif DEST == DEST_CACHE:
        store_bf16_bytes(cache_ptr, qbase[:, None, None, None], col[None, :, :, :], y,
                          ok[:, None, None, None] & cm, QALIGN)


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
def _load_x(x_ptr, xrow, xt_ptr, xtrow, cols, mask, SPLIT: tl.constexpr, NAT: tl.constexpr):
    """x at the columns ``cols`` of the rows at ``xrow`` (offsets broadcast against each other) as fp32;
    SPLIT > 0: x's columns are held apart, [0, SPLIT) by x_ptr and the rest by xt_ptr (rows at xtrow)."""
    if SPLIT == 0:
        v = load_f32_native(x_ptr, xrow + cols, mask, True, NAT)
    else:
        lead = cols < SPLIT
        main = load_f32_native(x_ptr, xrow + cols, mask & lead, True, NAT)
        tail = load_f32_native(xt_ptr, xtrow + (cols - SPLIT), mask & (cols >= SPLIT), True, NAT)
        v = tl.where(lead, main, tail)
    return v


@triton.jit
def _rope1_loads(x_ptr, xrow, xt_ptr, xtrow, w_ptr, b_ptr, cs_ptr, csrow, pok, col, HALF: tl.constexpr,
                 R: tl.constexpr, ROPE_OFF: tl.constexpr, NEOX: tl.constexpr, HAS_NORM: tl.constexpr,
                 W_BF16: tl.constexpr, HAS_BIAS: tl.constexpr, B_BF16: tl.constexpr, CS_BF16: tl.constexpr,
                 SPLIT: tl.constexpr, NORM_DIM: tl.constexpr):
    """ROPE 1, over the whole tile [M, NV, VEC]: (first: the column is a pair's first element,
    rot_mask: the element rotates, cos, sin, the partner column, the partner's x, the partner's weight
    and bias (x again where there is none; zero where the partner is past a leading-dims norm's NORM_DIM))."""
    first, in_rope, rot_mask, partner, c, s = rope1_pairs(cs_ptr, csrow, pok, col, HALF, R, ROPE_OFF, NEOX, CS_BF16)
    yp = _load_x(x_ptr, xrow[:, None, None], xt_ptr, xtrow[:, None, None], partner[None, :, :], rot_mask, SPLIT,
                 NATIVE_INTEGER)
    wp = yp
    bp = yp
    if HAS_NORM:
        wmask = in_rope
        if NORM_DIM > 0:
            wmask = in_rope & (partner < NORM_DIM)
        wp = load_f32(w_ptr, partner, wmask, W_BF16)
        if HAS_BIAS:
            bp = load_f32(b_ptr, partner, wmask, B_BF16)
    return first, rot_mask, partner, c, s, yp, wp, bp


@triton.jit
def _rope2_loads(x_ptr, xrow, xt_ptr, xtrow, w_ptr, b_ptr, cs_ptr, csrow, pok, rmask, HALF: tl.constexpr,
                 ROPE_OFF: tl.constexpr, NEOX: tl.constexpr, HAS_NORM: tl.constexpr, W_BF16: tl.constexpr,
                 HAS_BIAS: tl.constexpr, B_BF16: tl.constexpr, CS_BF16: tl.constexpr, CAST: tl.constexpr,
                 G: tl.constexpr, DQ: tl.constexpr, VEC: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT: tl.constexpr,
                 NORM_DIM: tl.constexpr):
    """ROPE_SUBTILE, the sub-tile [M, NS, GS / VEC, VEC]: x, weight and bias (x again where there is
    none) of the columns c0 and of their partners c1, and the cos, sin of each c0's rotation index j.
    NEOX: c0 = the first-half columns (j = c0 - ROPE_OFF), c1 = c0 + HALF (NS = HALF / GS groups).
    Interleaved: c0 = ALL R rotated columns in column order (NS = R / GS groups), c1 = c0 ^ 1, j =
    (c0 - ROPE_OFF) >> 1: every column is rotated where it lies, with no tl.join of the pairs
    (interleaving the two halves by tl.join + reshape gave wrong bytes in multi-row programs on the
    H200, Triton 3.6); c1's values are c0's, moved within each pair (pair_partner), and a pair's
    cos / sin are loaded once and given to both its columns (pair_dup). SPLIT: x held apart (_load_x);
    NORM_DIM > 0: the weights (and bias) read as zeros from that column on (the norm covers the columns before)."""
    GS: tl.constexpr = G if (CAST != CAST_NONE and ROPE_OFF < DQ) else 8
    if NEOX:
        jj = grid3(HALF // GS, GS // VEC, VEC)                     # rotation index j
        c0 = ROPE_OFF + jj                                          # first-half columns
        c1 = c0 + HALF
    else:
        kk = grid3(2 * HALF // GS, GS // VEC, VEC)                 # k = column - ROPE_OFF
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
    xa = _load_x(x_ptr, xrow[:, None, None, None], xt_ptr, xtrow[:, None, None, None], c0[None, :, :, :], ld, SPLIT,
                 NATIVE_INTEGER)
    if NEOX:
        xb = _load_x(x_ptr, xrow[:, None, None, None], xt_ptr, xtrow[:, None, None, None], c1[None, :, :, :], ld,
                     SPLIT, NATIVE_INTEGER)
    else:
        # the partners (column ^ 1) are in the lane's own vector: moved there by their bits (a load of c0 ^ 1
        # had a layout of its own, and a shuffle between the two)
        xb = pair_partner(xa, BLOCK_M, NSB, GS // VEC, VEC)
    wa = xa
    wb = xb
    ba = xa
    bb = xb
    if HAS_NORM:   # [M or 1, NSB, GS / VEC, VEC]
        if NORM_DIM > 0:
            wma = c0m < NORM_DIM
            wmb = c1m < NORM_DIM
        else:
            wma = c0m >= 0
            wmb = c1m >= 0
        wa = load_f32(w_ptr, c0m, wma, W_BF16)
        if NEOX:
            wb = load_f32(w_ptr, c1m, wmb, W_BF16)
        else:
            wb = pair_partner(wa, BLOCK_M, NSB, GS // VEC, VEC)
        if HAS_BIAS:
            ba = load_f32(b_ptr, c0m, wma, B_BF16)
            if NEOX:
                bb = load_f32(b_ptr, c1m, wmb, B_BF16)
            else:
                bb = pair_partner(ba, BLOCK_M, NSB, GS // VEC, VEC)
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
        j2 = grid3(2 * HALF // GS, GS // VEC, VEC // 2)
        c = pair_dup(load_f32(cs_ptr, csrow[:, None, None, None] + j2[None, :, :, :], pm, CS_BF16),
                      BLOCK_M, NSB, GS // VEC, VEC)
        s = pair_dup(load_f32(cs_ptr, csrow[:, None, None, None] + HALF + j2[None, :, :, :], pm, CS_BF16),
                      BLOCK_M, NSB, GS // VEC, VEC)
    return xa, xb, wa, wb, ba, bb, c, s


# --------------------------------------------------------------------------- the kernel
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
    xt_ptr, sxt_n, sxt_h,                     # x's columns SPLIT.. held apart [n, H, D - SPLIT] (None: SPLIT 0)
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
    EARLY: tl.constexpr, FLOOR_E: tl.constexpr, SPLIT: tl.constexpr, NORM_DIM: tl.constexpr,
    RESERVED: tl.constexpr, BLOCK_RESERVED: tl.constexpr,
):
    """ROPE: ROPE_NONE off; ROPE_TILE on the whole tile (each rotated element computed from itself
    and its partner, reloaded and renormalized: the same arithmetic gives the same bits); ROPE_SUBTILE
    on a separate sub-tile of the R rotated columns (the main tile skips them; needs the rotated columns
    to be whole quantization groups, or outside the quantized part, and no Hadamard). LAYER: the norm
    is LayerNorm (HAS_BIAS: with a bias), else RMSNorm. A stage copy of the norm (STAGE_NORM) with
    RoPE is stored last, after a barrier, because the RoPE reloads x and `out` may be x (in place).
    SPLIT > 0: x's columns [SPLIT, D) come from xt_ptr (two inputs, one row). NORM_DIM > 0: the norm covers
    the columns [0, NORM_DIM) only (its sums the tree with the other columns as zeros, divided by NORM_DIM);
    the others keep x's values; 0: the whole head. RESERVED > 0 (a cache format's ``zero_reserved``): the
    record's RESERVED bytes after its scales are written as zeros (BLOCK_RESERVED: the next power of two).
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
    xtrow = xrow
    if SPLIT > 0:
        xtrow = tok * sxt_n + head * sxt_h
    # x and the norm weights of the main tile widened by load_f32_native's shift and mask in programs of 2 to 4 rows
    # (Triton 3.6 offline: fewer instructions everywhere, but more registers, past an allocation step, for
    # one-row programs and at 8 rows; likewise for the RoPE sub-tile's loads), and x only where every value
    # goes into arithmetic (a norm or a Hadamard): where some are stored as they are loaded, the compiler
    # folds the plain widening and its narrowing away
    WNAT: tl.constexpr = NATIVE if (BLOCK_M >= 2 and BLOCK_M <= 4) else NATIVE_INTEGER
    XNAT: tl.constexpr = WNAT if (HAS_NORM or HAS_HAD) else NATIVE_INTEGER
    x = _load_x(x_ptr, xrow[:, None, None], xt_ptr, xtrow[:, None, None], col[None, :, :], m3, SPLIT,
                XNAT)                                                     # [M, NV, VEC]
    y = x

    # ---- the loads that do not depend on x's values. EARLY (one-row programs): issued up front, so
    # that their latency (and the positions -> cos/sin chain) overlaps the norm's tree, which halves
    # the time beyond the launch at decode sizes. Else where they are used: issued up front they
    # raise the register count of multi-row programs (104 vs 64 for MAIN_FP8 at BLOCK_M 2), which
    # costs more in occupancy at large n than it saves in latency (docs/performance.md).
    HALF: tl.constexpr = R // 2
    KN: tl.constexpr = NORM_DIM if NORM_DIM > 0 else D          # the columns the norm covers
    wcmask = cmask
    if NORM_DIM > 0:
        wcmask = col < NORM_DIM
    if EARLY:
        if HAS_NORM:
            w = load_f32(w_ptr, col, wcmask, W_BF16)
            bias = w
            if HAS_BIAS:
                bias = load_f32(b_ptr, col, wcmask, B_BF16)
        if ROPE != ROPE_NONE:
            pok, csrow = load_cs_rows(pos_ptr, s_pos, tok, rmask, P, s_cs)
        ok, qbase, sfbase, tailbase = _record_addresses(
            slot_ptr, s_slot, tok, head, rows, rmask, s_blk, data_tok, sf_tok, head_stride, data_off, sf_off,
            tail_off, block_size, capacity, DEST, SLOT32, QALIGN, SFALIGN, TALIGN)
        if ROPE == ROPE_TILE:
            first, rot_mask, partner, c, s, yp, wp, bp = _rope1_loads(
                x_ptr, xrow, xt_ptr, xtrow, w_ptr, b_ptr, cs_ptr, csrow, pok, col, HALF, R, ROPE_OFF, NEOX, HAS_NORM,
                W_BF16, HAS_BIAS, B_BF16, CS_BF16, SPLIT, NORM_DIM)
        if ROPE == ROPE_SUBTILE:
            xa, xb, wa, wb, ba, bb, c, s = _rope2_loads(x_ptr, xrow, xt_ptr, xtrow, w_ptr, b_ptr, cs_ptr, csrow, pok,
                                                        rmask, HALF, ROPE_OFF, NEOX, HAS_NORM, W_BF16, HAS_BIAS,
                                                        B_BF16, CS_BF16, CAST, G, DQ, VEC, BLOCK_M, SPLIT, NORM_DIM)

    # ---- RMSNorm / LayerNorm (mu: the LayerNorm mean; RMSNorm leaves it unused)
    if HAS_NORM:
        nm3 = m3                              # the columns the norm's sums cover (the rest as zeros)
        xs = x
        if NORM_DIM > 0:
            nm3 = m3 & (col < NORM_DIM)[None, :, :]
            xs = tl.where(nm3, x, 0.0)
        if LAYER:
            mu = tree_sum(xs, BLOCK_M, NV, LOG2_BLOCK_D - LOG2_VEC, VEC, LOG2_VEC, NATIVE == NATIVE_INTEGER)
            if (KN & (KN - 1)) == 0:
                mu = mu * (1.0 / KN)          # exact: the same bits as mu / KN for a power of two
            else:
                mu = tl.div_rn(mu, KN * 1.0)
            dev = tl.where(nm3, x - mu[:, None, None], 0.0)   # the tree's zero padding stays zero
            ss = tree_sum(dev * dev, BLOCK_M, NV, LOG2_BLOCK_D - LOG2_VEC, VEC, LOG2_VEC, NATIVE == NATIVE_INTEGER)
        else:
            ss = tree_sum(xs * xs, BLOCK_M, NV, LOG2_BLOCK_D - LOG2_VEC, VEC, LOG2_VEC, NATIVE == NATIVE_INTEGER)
            mu = ss
        rstd = reciprocal_std(ss, eps, KN, BLOCK_M)
        if not EARLY:
            # loaded as the tile [M, NV, VEC] (each row's lanes load the weights; the tile's layout puts rows on
            # lanes first): loaded as [NV, VEC] the compiler spread them over the warp's lanes and shuffled them
            # into the tile's layout
            wcol = tl.broadcast_to(col[None, :, :], [BLOCK_M, NV, VEC])
            wmask = tl.broadcast_to(wcmask[None, :, :], [BLOCK_M, NV, VEC])
            w = load_f32_native(w_ptr, wcol, wmask, W_BF16, WNAT)
            bias = w
            if HAS_BIAS:
                bias = load_f32_native(b_ptr, wcol, wmask, B_BF16, WNAT)
        else:
            w = w[None, :, :]
            bias = bias[None, :, :]
        y = normed(x, mu[:, None, None], rstd[:, None, None], w, bias, LAYER, HAS_BIAS, NATIVE)
        if NORM_DIM > 0:
            y = tl.where((col < NORM_DIM)[None, :, :], y, x)
        if OUT_STAGE == STAGE_NORM:
            if ROPE == ROPE_NONE:
                store_bf16(out_ptr, (tok * so_n + head * so_h)[:, None, None] + col[None, :, :], y, m3,
                            NATIVE != NATIVE_INTEGER)
            else:
                ynorm = y                     # stored last: RoPE reads x again, and out may be x

    if not EARLY:
        if ROPE != ROPE_NONE:
            pok, csrow = load_cs_rows(pos_ptr, s_pos, tok, rmask, P, s_cs)
        if ROPE == ROPE_TILE:
            first, rot_mask, partner, c, s, yp, wp, bp = _rope1_loads(
                x_ptr, xrow, xt_ptr, xtrow, w_ptr, b_ptr, cs_ptr, csrow, pok, col, HALF, R, ROPE_OFF, NEOX, HAS_NORM,
                W_BF16, HAS_BIAS, B_BF16, CS_BF16, SPLIT, NORM_DIM)
    if ROPE == ROPE_TILE:
        if HAS_NORM:
            ypn = normed(yp, mu[:, None, None], rstd[:, None, None], wp[None, :, :], bp[None, :, :], LAYER, HAS_BIAS,
                         NATIVE)
            if NORM_DIM > 0:
                ypn = tl.where((partner < NORM_DIM)[None, :, :], ypn, yp)
            yp = ypn
        firstb = first[None, :, :]
        r0, r1 = rotate(tl.where(firstb, y, yp), tl.where(firstb, yp, y), c, s, CONJ)
        y = tl.where(rot_mask, round_bf16(tl.where(firstb, r0, r1), NATIVE), y)

    # ---- Hadamard: butterflies at distance 1, 2, 4, ...; each level sums a size-2 axis
    if HAS_HAD:
        h = tl.reshape(y, [BLOCK_M, BLOCK_D])
        sgn = tl.where(tl.arange(0, 2) == 0, 1.0, -1.0)[None, None, :, None]
        first2 = (tl.arange(0, 2) == 0)[None, None, :, None]
        for lvl in tl.static_range(LOG2_BLOCK_D):
            v4 = tl.reshape(h, [BLOCK_M, BLOCK_D >> (lvl + 1), 2, 1 << lvl])
            if NATIVE == NATIVE_INTEGER:      # the interpreter: exact signed zeros (see pair_sum)
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

    if DEST == DEST_CACHE and RESERVED > 0:
        # the reserved bytes after the exact scale bytes, as zeros (the record then fills its last sector)
        SF_EXACT: tl.constexpr = (DQ // G) * (1 if (SF == SF_UE8M0 or SF == SF_E4M3) else 4)
        kz = tl.arange(0, BLOCK_RESERVED)
        tl.store(cache_ptr + sfbase[:, None] + SF_EXACT + kz[None, :], tl.zeros([BLOCK_M, BLOCK_RESERVED], tl.uint8),
                 mask=ok[:, None] & (kz < RESERVED)[None, :])

    # ---- outputs: the main tile (without the sub-tile's columns under ROPE_SUBTILE). RND: every value stored
    # as bf16 came out of a native round_bf16 (the norm's, the Hadamard's; the RoPE's where it rotates), so
    # the stores may convert again (bf16_out_bits); without them some columns are x's own bits
    RND: tl.constexpr = NATIVE != NATIVE_INTEGER and ((HAS_NORM and NORM_DIM == 0) or HAS_HAD)
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
            xa, xb, wa, wb, ba, bb, c, s = _rope2_loads(x_ptr, xrow, xt_ptr, xtrow, w_ptr, b_ptr, cs_ptr, csrow, pok,
                                                        rmask, HALF, ROPE_OFF, NEOX, HAS_NORM, W_BF16, HAS_BIAS,
                                                        B_BF16, CS_BF16, CAST, G, DQ, VEC, BLOCK_M, SPLIT, NORM_DIM)
        pm = pok[:, None, None, None]
        a = xa
        b = xb
        if HAS_NORM:
            mu4 = mu[:, None, None, None]
            r4 = rstd[:, None, None, None]
            a = normed(xa, mu4, r4, wa, ba, LAYER, HAS_BIAS, NATIVE)
            b = normed(xb, mu4, r4, wb, bb, LAYER, HAS_BIAS, NATIVE)
            if NORM_DIM > 0:
                # the columns of a and b (NEOX: c0 and c0 + HALF; interleaved: c0 and its partner c0 ^ 1)
                ka = grid3(NS if NEOX else 2 * NS, GSV, VEC)
                ca = ROPE_OFF + ka
                cb = ca + HALF if NEOX else ROPE_OFF + (ka ^ 1)
                a = tl.where((ca < NORM_DIM)[None, :, :, :], a, xa)
                b = tl.where((cb < NORM_DIM)[None, :, :, :], b, xb)
        if NEOX:
            r0, r1 = rotate(a, b, c, s, CONJ)
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
            kk = grid3(NS2, GSV, VEC)
            firstc = ((kk & 1) == 0)[None, :, :, :]
            r0, r1 = rotate(tl.where(firstc, a, b), tl.where(firstc, b, a), c, s, CONJ)
            rr = tl.where(pm, round_bf16(tl.where(firstc, r0, r1), NATIVE), a)
            _emit(rr, tok, head, rmask, ok,
                  qbase, sfbase, tailbase, out_ptr, so_n, so_h, q_ptr, sq_n, sq_h, sf_ptr, ss_n, ss_h, cache_ptr,
                  ROPE_OFF, 0, 0, BLOCK_M, NS2, GSV, VEC, GS, D, CAST, SF, FMAX, DQ, OUT_STAGE, DEST, NATIVE, QALIGN, SFALIGN, TALIGN, FLOOR_E, RND)

    # ---- the norm's stage copy under RoPE: after every read of x (out may be x), all threads past them
    if OUT_STAGE == STAGE_NORM and ROPE != ROPE_NONE:
        tl.debug_barrier()
        store_bf16(out_ptr, (tok * so_n + head * so_h)[:, None, None] + col[None, :, :], ynorm, m3,
                    NATIVE != NATIVE_INTEGER)


# fused_rows's parameters without pid, and PDL: a kernel spells out its own (tests/test_kernel_modules.py
# checks that the two lists and the call below agree)
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
    xt_ptr, sxt_n, sxt_h,                     # x's columns SPLIT.. held apart [n, H, D - SPLIT] (None: SPLIT 0)
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
    EARLY: tl.constexpr, FLOOR_E: tl.constexpr, SPLIT: tl.constexpr, NORM_DIM: tl.constexpr,
    RESERVED: tl.constexpr, BLOCK_RESERVED: tl.constexpr, PDL: tl.constexpr,
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
               capacity, n_rows, H, xt_ptr, sxt_n, sxt_h, D, BLOCK_D, LOG2_BLOCK_D, VEC, BLOCK_M, ONE_HEAD, ROWS32,
               HAS_NORM, W_BF16, LAYER, HAS_BIAS, B_BF16, ROPE, R, ROPE_OFF, NEOX, CONJ, CS_BF16, HAS_HAD, CAST, G, SF,
               FMAX, DQ, OUT_STAGE, DEST, NATIVE, SLOT32, QALIGN, SFALIGN, TALIGN, EARLY, FLOOR_E, SPLIT, NORM_DIM,
               RESERVED, BLOCK_RESERVED)


# --------------------------------------------------------------------------- the signature as data
def _split_params(jit_fn) -> tuple:
    """(runtime parameter names, constexpr parameter names) of a @triton.jit function, each in order."""
    params = inspect.signature(jit_fn.fn).parameters.values()
    const = tuple(p.name for p in params if p.annotation in (tl.constexpr, "tl.constexpr"))
    return tuple(p.name for p in params if p.name not in const), const


# fused_rows's parameters after ``pid``: the runtime ones (fused_kernel's positional arguments, fused_args's
# table) and the constexprs (fused_args's keyword arguments); fused_kernel takes both and PDL
RUNTIME_NAMES, CONSTEXPR_NAMES = _split_params(fused_rows)
RUNTIME_NAMES = RUNTIME_NAMES[1:]


# --------------------------------------------------------------------------- launch configuration
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
    forced = FORCED.cfg
    if interpret:
        bm = min(next_pow2(max(n_rows, 1)), max(1, 16384 // block_d))
        nw = 4
    else:
        bm, nw = table_entry(plain_launch_table(block_d, cast_fmt), n_rows)
    if forced is not None:
        bm = forced[0] or bm
        nw = forced[1] or nw
    return bm, nw


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


# --------------------------------------------------------------------------- the parameter table
def fused_args(plan: Plan, tensor) -> tuple:
    """(grid, positional args, keyword args) of the fused kernel for ``plan``: the kernel's parameter
    table, in its order. ``tensor(field)`` is what goes where the plan's tensor ``field`` goes: the
    tensor itself (run_plan) or a PlanTensor (a Launch kept for the signature)."""
    x = plan.x
    n, H = x.shape[:2]
    D = plan.head_dim
    block_d = next_pow2(D)
    interpret = config.INTERPRET
    bm, nw = launch_config(n * H, D, block_d, interpret, plan.cast.cast_fmt if plan.cast else None)
    cast, a, cache = plan.cast, plan.addressing, plan.kv_cache

    def or_x(t):  # strides of a tensor the plan does not have: x's (x stands in for it)
        return x if t is None else t

    out, q, sf = or_x(plan.out), or_x(plan.q_out), or_x(plan.sf_out)
    qal, sfal, tal = record_alignments(plan)
    forced = FORCED.cfg
    vec = (forced[2] if forced is not None else None) or vec_width(plan, qal)
    cap = cache.shape[0] * cache.shape[1] if cache is not None else 0
    reserved = plan.fmt.zeroed_bytes if cache is not None else 0
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
        # x's second input: None without one (a constexpr None: the variants of one input keep their code)
        *((T("x_tail"), plan.x_tail.stride(0), plan.x_tail.stride(1)) if plan.x_tail is not None else (None,) * 3),
    )
    options = dict(
        D=D, BLOCK_D=block_d, LOG2_BLOCK_D=block_d.bit_length() - 1, VEC=vec, BLOCK_M=bm,
        ONE_HEAD=H == 1, ROWS32=n * H + bm < config.INT32_LIMIT,
        HAS_NORM=plan.weight is not None, W_BF16=plan.weight is not None and plan.weight.dtype == torch.bfloat16,
        LAYER=plan.weight is not None and plan.norm_kind == "layer", HAS_BIAS=plan.bias is not None,
        B_BF16=plan.bias is not None and plan.bias.dtype == torch.bfloat16,
        ROPE=rope_mode(plan), R=plan.rotary_dim, ROPE_OFF=plan.rope_offset, NEOX=plan.is_neox,
        CONJ=plan.conjugate, CS_BF16=plan.cos_sin is not None and plan.cos_sin.dtype == torch.bfloat16,
        HAS_HAD=plan.hadamard_scale is not None,
        CAST=CAST_CODES[cast.cast_fmt if cast else None], G=cast.group if cast else 16,
        SF=SF_CODES[cast.sf_format] if cast else 0, FMAX=FMAX[cast.cast_fmt] if cast else 1.0,
        DQ=plan.quant_dim if cast else D,
        OUT_STAGE=STAGE_CODES[plan.out_stage], DEST=dest, NATIVE=native(interpret),
        SLOT32=cap < config.INT32_LIMIT, QALIGN=qal, SFALIGN=sfal, TALIGN=tal, EARLY=bm == 1,
        FLOOR_E=NO_FLOOR.value if cast is None or cast.floor_exp is None else cast.floor_exp,
        SPLIT=plan.split, NORM_DIM=plan.norm_dim if plan.norm_dim < D else 0, RESERVED=reserved,
        BLOCK_RESERVED=next_pow2(max(reserved, 1)), PDL=False,
        num_warps=nw, num_stages=1, enable_fp_fusion=False,
    )
    return (cdiv(n * H, bm),), args, options
