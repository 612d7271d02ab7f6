"""The Gluon fast path of the main latent cache: the MAIN_FP8 and MAIN_MXFP8 writes (RMSNorm -> NEOX or
GPT-J RoPE on the last 64 dims -> e4m3 with UE8M0 scales per 32 over all 512 columns -> token-interleaved
532-byte MAIN_FP8 or 528-byte MAIN_MXFP8 records) and the cast alone (CAST_ONLY) of MAIN_FP8, MAIN_MXFP8
and MAIN_FP4 records, byte for byte what ``kvfuse.kernels.portable.fused_kernel`` writes (SPEC §6, §7).

Assumptions (``eligible`` checks them; anything else goes to the portable kernel): head_dim 512,
num_heads 1, x bf16 [n, 512] with unit column stride, the MAIN_FP8 record (512 e4m3 codes | 16 UE8M0
scale bytes | 4 reserved bytes written as zeros) or DeepSeek V4.1's MAIN_MXFP8 (the same codes and scales,
no reserved bytes, the scale floored at 2^-13: the kernel's FLOOR_E) at a token stride that is a
multiple of 4 (records are only 4-byte aligned: every cache store is at most 32 bits wide).

One warp a row (lane l: columns 16 l .. 16 l + 15 as int32 words), the norm's adjacent-pairs tree by
in-lane sums then butterfly shuffles, a 32-column group on two neighbouring lanes, RoPE pairs one per
lane with 128 bytes of shared memory per row to bring the rotated tail home, a persistent grid;
~295 SASS warp-instructions per row against ~565 for the portable kernel. The layout in full:
docs/design.md ("The MAIN kernel").

Numerics mirror the plain kernel exactly: fp32 ops rounded one by one (compile with
enable_fp_fusion=False: no FMA), div_rn/sqrt_rn, native bf16 rounding (cvt.rn), the UE8M0
exponent without division (``group_scales`` SF_UE8M0), the unguarded native e4m3 encode
(cvt.rn.satfinite.e4m3x2.f32; NATIVE_UNGUARDED in portable.py) and NaN-ignoring max (max.f32) for amax.

The kernel also writes main_latent_fp4's MAIN_FP4 records (FP4=True): the same loads, norm, RoPE and
persistent loop, MAIN_FP4's cast and store (``_quantize_store_fp4``, kept here so that the kernel needs
no import of main_latent_fp4, which imports this module).

The module imports without a GPU and under any Triton; ``available()`` says whether this path
can run (Triton 3.6's Gluon API and a CUDA device).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ... import formats as _formats
from . import common as gluon_common
from ..codes import NO_FLOOR, SF_E4M3
from .common import (INT32_LIMIT, allowed_by_env, available, compile_options, early_reads_option, gl, gluon,
                     log2_block, occupancy_grid, table_entry)

HEAD_DIM = 512
RECORD_BYTES = 532           # 512 codes + 16 scales + 4 reserved bytes (written as zeros: ZERO_RESERVED)
ROTARY_DIM = 64


if gluon is not None:
    from ..numerics import ue8m0_exponent  # the portable kernel's scale rule (Gluon calls it as it is)
    from .common import (as_offset, bf16x2, block_and_token, e2m1_nibble, e4m3x4, expand_rows, hi_f32, lane_tree,
                               lo_f32, load_indices, shfl_xor, slot_block, pdl_wait)
    from .common import b64, group_scale

    @gluon.jit
    def _prmt(a, b, sel):
        """Byte permute: byte k of the result is byte (sel >> 4k) & 7 of the pair (b:a) (a = bytes 0..3)."""
        return gl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, sel], dtype=gl.int32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _pairs(v, LPLANE: gl.constexpr):
        """[R] (row slice layout) -> [R, 1, 1, 1] in the pair layout (no data movement)."""
        return gl.expand_dims(gl.convert_layout(expand_rows(v), LPLANE, assert_trivial=True), 3)

    @gluon.jit
    def _load_x(x_ptr, sx_w, rows, n_rows, word, pair_col, LPLANE: gl.constexpr, OFFSETS32: gl.constexpr):
        """x of the rows as int32 words [R, 8, 4, 8] (two bf16 each) and the RoPE pairs' x as fp32
        [R, 8, 4, 2] (x[448 + j], x[480 + j] on lane j)."""
        rmask = rows < n_rows
        x_row = as_offset(rows, OFFSETS32) * sx_w                       # in words
        xw = gl.load(x_ptr.to(gl.pointer_type(gl.int32)) + gl.expand_dims(expand_rows(x_row), 3) + word,
                     mask=gl.expand_dims(expand_rows(rmask), 3), other=0)
        xp = gl.load(x_ptr + _pairs(x_row * 2, LPLANE) + 448 + pair_col, mask=_pairs(rmask, LPLANE), other=0.0)
        return xw, xp.to(gl.float32)

    @gluon.jit
    def _load_cos_sin(cs_ptr, s_cs, P, pos, rows, n_rows, cs_col, LPLANE: gl.constexpr, OFFSETS32: gl.constexpr):
        """(cos_j, sin_j) of each row's position as fp32 [R, 8, 4, 2] on lane j (zeros where the position
        is outside [0, P): such rows are not rotated)."""
        pok = (rows < n_rows) & (pos >= 0) & (pos < P)
        cs_row = as_offset(gl.where(pok, pos, 0), OFFSETS32) * s_cs
        cs = gl.load(cs_ptr + _pairs(cs_row, LPLANE) + cs_col, mask=_pairs(pok, LPLANE), other=0.0)
        return cs.to(gl.float32)

    @gluon.jit
    def _indices(pos_ptr, s_pos, slot_ptr, s_slot, rows, n_rows, OFFSETS32: gl.constexpr, CAST_ONLY: gl.constexpr):
        """(positions, slots) of the rows [R]; CAST_ONLY: the slots only (pos_ptr is a stand-in, never
        read; the returned positions are the slots, a placeholder)."""
        if CAST_ONLY:
            slot = gl.load(slot_ptr + as_offset(rows, OFFSETS32) * s_slot, mask=rows < n_rows, other=-1)
            pos = slot
        else:
            pos, slot = load_indices(pos_ptr, s_pos, slot_ptr, s_slot, rows, n_rows, OFFSETS32)
        return pos, slot

    @gluon.jit
    def _tile_cos_sin(cs_ptr, s_cs, P, pos, rows, n_rows, cs_col, xp, LPLANE: gl.constexpr, OFFSETS32: gl.constexpr,
                      CAST_ONLY: gl.constexpr):
        """``_load_cos_sin``; CAST_ONLY: nothing loaded (xp, of the same shape, is the placeholder)."""
        if CAST_ONLY:
            cs = xp
        else:
            cs = _load_cos_sin(cs_ptr, s_cs, P, pos, rows, n_rows, cs_col, LPLANE, OFFSETS32)
        return cs

    @gluon.jit
    def norm_rope(xw, xp, cs, pok, w_lo, w_hi, w_pair, eps, tail_buf, tail_lane, merge_sel,
                  R: gl.constexpr, LLANE: gl.constexpr, LPLANE: gl.constexpr, LW: gl.constexpr, NEOX: gl.constexpr):
        """RMSNorm -> RoPE of one tile of R rows whose loads are done: y as bf16 pairs [R, 8, 4, 8] in LW
        (lane l: columns 16 l .. 16 l + 15), the rotated tail in place where pok (the position is in
        [0, P) and the row < n_rows). Shared with main_latent_fp4 (the same transform, another cast).
        NEOX: lane j's pair is (448 + j, 480 + j); else (GPT-J) (448 + 2 j, 449 + 2 j), whose rotated
        word is tail word j as it stands."""
        # ---- RMSNorm: p_2i + p_2i+1 inside each word, the tree over the lane's 8 words, 5 shuffles
        x_lo = lo_f32(xw)
        x_hi = hi_f32(xw)
        sq = x_lo * x_lo + x_hi * x_hi
        sq = gl.sum(gl.reshape(sq, [R, 8, 4, 4, 2]), axis=4)
        sq = gl.sum(gl.reshape(sq, [R, 8, 4, 2, 2]), axis=4)
        sq = gl.sum(gl.reshape(sq, [R, 8, 4, 1, 2]), axis=4)
        ss = lane_tree(gl.convert_layout(gl.reshape(sq, [R, 8, 4]), LLANE, assert_trivial=True))
        mean = ss * (1.0 / 512)                                         # exact: a power of two
        rstd = gl.div_rn(gl.full([R, 8, 4], 1.0, gl.float32, LLANE), gl.sqrt_rn(mean + eps))
        rstd4 = gl.expand_dims(rstd, 3)
        yw = bf16x2((x_lo * rstd4) * w_lo, (x_hi * rstd4) * w_hi)        # [R, 8, 4, 8] bf16 pairs

        # ---- RoPE on the pair layout (the norm of the pair recomputed there: same arithmetic, same bits)
        yp = (xp * gl.expand_dims(gl.convert_layout(rstd, LPLANE, assert_trivial=True), 3)) * w_pair
        y0, y1 = gl.split(yp)
        ypw = bf16x2(y0, y1)                                            # (y_i0, y_i1) rounded to bf16
        a = lo_f32(ypw)
        b = hi_f32(ypw)
        c, s = gl.split(cs)
        rot = bf16x2((a * c) - (b * s), (a * s) + (b * c))              # (r0_j, r1_j)
        if NEOX:
            # even lane j: tail word j / 2 = (r0_j, r0_j+1); odd lane j: tail word 16 + j / 2 = (r1_j-1, r1_j)
            rot = _prmt(rot, shfl_xor(rot, 1), merge_sel)
            # through shared memory to lanes 28..31: lane j's word goes to [j & 1][j >> 1] of [R, 2, 16]
            tail_buf.reshape([R, 2, 16]).permute([0, 2, 1]).store(gl.reshape(rot, [R, 16, 2]))
        else:
            # GPT-J: lane j's word is tail word j; through shared memory to lanes 28..31
            tail_buf.store(gl.reshape(rot, [R, 32]))
        gl.thread_barrier()
        tail = tail_buf.reshape([R, 1, 4, 8]).load(LW)                  # lane 28 + d2: tail words 8 d2 .. 8 d2 + 7
        gl.thread_barrier()                                             # the next tile overwrites tail_buf
        return gl.where(tail_lane & gl.expand_dims(expand_rows(pok), 3), tail, yw)

    @gluon.jit
    def _quantize_store(yw, rmask, slot, capacity, cache_ptr, s_blk, tok_stride, block_size, lane, qword,
                        R: gl.constexpr, LQ: gl.constexpr, SLOT32: gl.constexpr, LOG2_BLOCK: gl.constexpr,
                        OFFSETS32: gl.constexpr, ZERO_RESERVED: gl.constexpr, FLOOR_E: gl.constexpr):
        """y (bf16 pairs [R, 8, 4, 8]) of one tile -> UE8M0/e4m3 -> the MAIN_FP8 / MAIN_MXFP8 records (codes at
        byte 0, scales at 512). ZERO_RESERVED: MAIN_FP8's 4 reserved bytes 528..531 written as zeros, by lanes
        1, 3, 5, 7 in the scales' store (a record then fills every DRAM sector it touches; a never-written byte
        costs its sector a read-modify-write on eviction). FLOOR_E: the scale_floor's exponent (MAIN_MXFP8:
        -13), NO_FLOOR without."""
        # ---- the records; an invalid slot (or a row past n_rows) writes nothing
        ok = rmask & (slot >= 0) & (slot < capacity)
        s_ok, blk = slot_block(slot, ok, block_size, SLOT32, LOG2_BLOCK)
        if SLOT32:
            rec = as_offset(blk, OFFSETS32) * s_blk + as_offset(s_ok - blk * block_size, OFFSETS32) * tok_stride
        else:
            rec = blk * s_blk + (s_ok - blk * block_size) * tok_stride

        # ---- UE8M0 scale per 32 columns (two lanes): group_scales(SF_UE8M0, FMAX=448) of numerics.py
        y_lo = lo_f32(yw)
        y_hi = hi_f32(yw)
        amax = gl.max(gl.maximum(gl.abs(y_lo), gl.abs(y_hi)), axis=3)   # NaN-ignoring max, like tl.max
        amax = gl.maximum(gl.maximum(amax, shfl_xor(amax, 1)), 1e-4)
        e, m = ue8m0_exponent(amax, 448.0, FLOOR_E)
        m4 = gl.expand_dims(m, 3)
        # codes of columns 4q .. 4q + 3 = (lo, hi) of words 2q and 2q + 1
        t0, t2 = gl.split(gl.reshape(y_lo * m4, [R, 8, 4, 4, 2]))
        t1, t3 = gl.split(gl.reshape(y_hi * m4, [R, 8, 4, 4, 2]))
        codes = gl.convert_layout(e4m3x4(t0, t1, t2, t3), LQ, assert_trivial=True)    # [R, 8, 4, 4]

        rec3 = expand_rows(rec)
        ok3 = expand_rows(ok)
        rec_q = gl.expand_dims(gl.convert_layout(rec3 >> 2, gl.SliceLayout(3, LQ), assert_trivial=True), 3)
        ok_q = gl.expand_dims(gl.convert_layout(ok3, gl.SliceLayout(3, LQ), assert_trivial=True), 3)
        # records are 4-byte aligned (host check): 32-bit stores of four codes
        gl.store(cache_ptr.to(gl.pointer_type(gl.int32)) + rec_q + qword, codes, mask=ok_q)
        even = (lane & 1) == 0
        if ZERO_RESERVED:
            # even lane 2g: scale byte 512 + g; odd lanes 1, 3, 5, 7: a zero at 528 .. 531, in the same store
            gl.store(cache_ptr + rec3 + 512 + gl.where(even, lane >> 1, 16 + (lane >> 1)),
                     gl.where(even, e + 127, 0).to(gl.uint8), mask=ok3 & (even | (lane < 8)))
        else:
            gl.store(cache_ptr + rec3 + 512 + (lane >> 1), (e + 127).to(gl.uint8), mask=ok3 & even)

    # ---- MAIN_FP4 records (the FP4 branch; main_latent_fp4 holds their host side)
    @gluon.jit
    def _fp4_codes(y_lo, y_hi, m, R: gl.constexpr, LLANE: gl.constexpr):
        """A lane's 16 values (words [R, 8, 4, 8]: y_lo columns 2k, y_hi columns 2k + 1) times its
        multiplier m [R, 8, 4] -> the 16 e2m1 codes as one int64 [R, 8, 4] (byte k: column 2k in the
        low nibble, 2k + 1 in the high one)."""
        m4 = gl.expand_dims(m, 3)
        # the fields never overlap: + is |, and shift-and-add is one instruction (LEA)
        b = e2m1_nibble(y_lo * m4) + (e2m1_nibble(y_hi * m4) << 4)                 # byte k
        b_even, b_odd = gl.split(gl.reshape(b, [R, 8, 4, 4, 2]))                    # bytes 2h, 2h + 1
        h = b_even + (b_odd << 8)                                                   # halves h = 0..3
        h_even, h_odd = gl.split(gl.reshape(h, [R, 8, 4, 2, 2]))
        w = h_even + (h_odd << 16)                                                  # words 0, 1
        w0, w1 = gl.split(w)
        return b64(gl.convert_layout(w0, LLANE, assert_trivial=True),
                    gl.convert_layout(w1, LLANE, assert_trivial=True))

    @gluon.jit
    def _quantize_store_fp4(yw, rmask, slot, capacity, cache_ptr, s_blk, tok_stride, block_size, lane,
                            R: gl.constexpr, LLANE: gl.constexpr, SLOT32: gl.constexpr, LOG2_BLOCK: gl.constexpr,
                            OFFSETS32: gl.constexpr):
        """y (bf16 pairs [R, 8, 4, 8]) of one tile -> NVFP4 (e4m3 scale per 16, e2m1) -> the MAIN_FP4 records."""
        # ---- the lane's group: amax in-lane, numerics.group_scales(SF_E4M3, FMAX=6), 16 e2m1 codes
        y_lo = lo_f32(yw)
        y_hi = hi_f32(yw)
        amax = gl.maximum(gl.max(gl.maximum(gl.abs(y_lo), gl.abs(y_hi)), axis=3), 1e-4)   # NaN-ignoring, like tl.max
        m, stored = group_scale(amax, SF_E4M3, 6.0)
        codes = _fp4_codes(y_lo, y_hi, m, R, LLANE)                                    # [R, 8, 4] int64

        # ---- the records; an invalid slot (or a row past n_rows) writes nothing
        ok = rmask & (slot >= 0) & (slot < capacity)
        blk, tok = block_and_token(slot, ok, block_size, SLOT32, LOG2_BLOCK, OFFSETS32)
        rec = expand_rows(blk * s_blk + tok * tok_stride)                          # [R, 1, 1] bytes, 8-aligned
        ok3 = expand_rows(ok)
        gl.store(cache_ptr.to(gl.pointer_type(gl.int64)) + (rec >> 3) + lane, codes, mask=ok3)
        gl.store(cache_ptr + rec + 256 + lane, stored.to(gl.uint8), mask=ok3)     # scale l at byte 256 + l

    @gluon.jit
    def _write_rows(xw, xp, cs, pos, slot, rows, n_rows, w_lo, w_hi, w_pair, eps, P,
                    cache_ptr, s_blk, tok_stride, block_size, capacity, tail_buf, lane, tail_lane, merge_sel, qword,
                    R: gl.constexpr, LLANE: gl.constexpr, LPLANE: gl.constexpr, LQ: gl.constexpr,
                    LW: gl.constexpr, SLOT32: gl.constexpr, LOG2_BLOCK: gl.constexpr, OFFSETS32: gl.constexpr,
                    FP4: gl.constexpr, NEOX: gl.constexpr, CAST_ONLY: gl.constexpr, ZERO_RESERVED: gl.constexpr,
                    FLOOR_E: gl.constexpr):
        """RMSNorm -> RoPE -> the cast -> the records of one tile of R rows whose loads are done: MAIN_FP8's or
        MAIN_MXFP8's (UE8M0/e4m3), or with FP4 MAIN_FP4's (main_latent_fp4: NVFP4). CAST_ONLY: the cast of x
        itself."""
        rmask = rows < n_rows
        if CAST_ONLY:
            yw = xw
        else:
            pok = rmask & (pos >= 0) & (pos < P)
            yw = norm_rope(xw, xp, cs, pok, w_lo, w_hi, w_pair, eps, tail_buf, tail_lane, merge_sel, R, LLANE, LPLANE,
                           LW, NEOX)
        if FP4:
            _quantize_store_fp4(yw, rmask, slot, capacity, cache_ptr, s_blk, tok_stride, block_size, lane,
                                R, LLANE, SLOT32, LOG2_BLOCK, OFFSETS32)
        else:
            _quantize_store(yw, rmask, slot, capacity, cache_ptr, s_blk, tok_stride, block_size, lane, qword,
                            R, LQ, SLOT32, LOG2_BLOCK, OFFSETS32, ZERO_RESERVED, FLOOR_E)

    @gluon.jit(do_not_specialize=["n_rows", "P", "capacity"])
    def main_fp8_kernel(
        x_ptr, sx_w,                            # x bf16 [n, 512] (read as int32 words); row stride in words
        w_ptr, eps,                             # RMSNorm weight [512] (bf16 or fp32)
        pos_ptr, s_pos, cs_ptr, s_cs, P,        # positions [n]; cos_sin [P, 64] (cos | sin; fp32 or bf16)
        slot_ptr, s_slot,                       # slot_mapping [n]
        cache_ptr, s_blk, tok_stride, block_size, capacity,   # kv_cache uint8 [blocks, block_size, 1, 532 | 528 | 288]
        n_rows,
        W_BF16: gl.constexpr, SLOT32: gl.constexpr, LOG2_BLOCK: gl.constexpr, ROWS_PER_WARP: gl.constexpr,
        PIPELINE: gl.constexpr, OFFSETS32: gl.constexpr, FP4: gl.constexpr, NEOX: gl.constexpr,
        CAST_ONLY: gl.constexpr, PDL: gl.constexpr, ZERO_RESERVED: gl.constexpr, FLOOR_E: gl.constexpr,
        PDL_EARLY: gl.constexpr = False,
    ):
        """A program walks over the tiles pid, pid + num_programs, ... (R = ROWS_PER_WARP * num_warps
        rows each; warp w owns rows w * ROWS_PER_WARP ..). LOG2_BLOCK: log2(block_size) when it is a
        power of two, else -1 (a division). PIPELINE: load tile t + 1 (x, indices; its cos/sin after
        tile t's stores) while tile t computes, instead of loading each tile at its start.
        OFFSETS32: every x, index, cos/sin and cache offset of the launch is below 2**31 (host).
        FP4: write MAIN_FP4 records instead (main_latent_fp4 launches this kernel so). NEOX: the RoPE
        pairs (448 + j, 480 + j), else GPT-J's (448 + 2 j, 449 + 2 j). CAST_ONLY: no norm and no RoPE (the
        cast of x: kvfuse.mla.store_gathered, the CP second pass); w_ptr, pos_ptr and cs_ptr are stand-ins
        (x), never read. ZERO_RESERVED: write each MAIN_FP8 record's 4 reserved bytes as zeros
        (``MainRecords.zero_reserved``). FLOOR_E: the scale_floor's exponent of the UE8M0 records
        (MAIN_MXFP8's -13), NO_FLOOR for MAIN_FP8 (and unused by FP4): that value compiles to the code of before.
        PDL_EARLY (with PDL, never with CAST_ONLY): the first tile's positions, slots and cos/sin rows are read
        before the wait, x after it (kvfuse.set_pdl's early_reads; off: every read after the wait)."""
        NW: gl.constexpr = gl.num_warps()
        R: gl.constexpr = ROWS_PER_WARP * NW
        # words [R, 8, 4, 8]: lane l = 4 * d1 + d2 owns the 8 int32 words (bf16 columns 16 l .. 16 l + 15)
        LW: gl.constexpr = gl.BlockedLayout([ROWS_PER_WARP, 1, 1, 8], [1, 8, 4, 1], [NW, 1, 1, 1], [3, 2, 1, 0])
        # MAIN_FP8's output words [R, 8, 4, 4]: four e4m3 codes each, lane l owns record words 4 l .. 4 l + 3
        LQ: gl.constexpr = gl.BlockedLayout([ROWS_PER_WARP, 1, 1, 4], [1, 8, 4, 1], [NW, 1, 1, 1], [3, 2, 1, 0])
        # RoPE pairs [R, 8, 4, 2]: pair j on lane j, (i0, i1) = (448 + j, 480 + j) in two registers
        LP: gl.constexpr = gl.BlockedLayout([ROWS_PER_WARP, 1, 1, 2], [1, 8, 4, 1], [NW, 1, 1, 1], [3, 2, 1, 0])
        LLANE: gl.constexpr = gl.SliceLayout(3, LW)                     # [R, 8, 4]: one value per lane and row
        LPLANE: gl.constexpr = gl.SliceLayout(3, LP)                    # the same mapping, seen from LP
        LROW: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, LLANE))  # [R]

        # ---- loop-invariant indices and the weight
        r_idx = gl.arange(0, R, layout=LROW)
        d1 = gl.expand_dims(gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, LLANE))), 0), 2)
        d2 = gl.expand_dims(gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, LLANE))), 0), 1)
        lane = d1 * 4 + d2                                              # [1, 8, 4]
        k8 = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LW))))
        word = gl.expand_dims(lane, 3) * 8 + gl.expand_dims(gl.expand_dims(gl.expand_dims(k8, 0), 1), 2)  # [1, 8, 4, 8]
        tail_lane = gl.expand_dims(d1 == 7, 3)                          # lanes 28..31 own columns 448..511
        k4 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LQ))))
        qword = (gl.expand_dims(gl.convert_layout(lane, gl.SliceLayout(3, LQ), assert_trivial=True), 3) * 4
                 + gl.expand_dims(gl.expand_dims(gl.expand_dims(k4, 0), 1), 2))          # [1, 8, 4, 4]
        lane_p = gl.convert_layout(lane, LPLANE, assert_trivial=True)
        half = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, LP))))
        half4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(half, 0), 1), 2)
        cs_col = gl.expand_dims(lane_p, 3) + 32 * half4                # (cos_j, sin_j) of pair j = lane
        if NEOX:
            pair_col = cs_col                                           # x columns 448 + j, 480 + j
        else:
            pair_col = 2 * gl.expand_dims(lane_p, 3) + half4            # x columns 448 + 2 j, 449 + 2 j
        merge_sel = gl.where((lane_p & 1) == 0, 0x5410, 0x3276)        # prmt: (own.lo, other.lo) / (other.hi, own.hi)

        if CAST_ONLY:
            w_lo = gl.zeros([1, 8, 4, 8], gl.float32, LW)             # not used
            w_hi = w_lo
        elif W_BF16:
            w_words = gl.load(w_ptr.to(gl.pointer_type(gl.int32)) + word)
            w_lo = lo_f32(w_words)
            w_hi = hi_f32(w_words)
        else:
            w_lo = gl.load(w_ptr + 2 * word)
            w_hi = gl.load(w_ptr + 2 * word + 1)
        if CAST_ONLY:
            w_pair = gl.zeros([1, 8, 4, 2], gl.float32, LP)
        else:
            w_pair = gl.load(w_ptr + 448 + pair_col).to(gl.float32)     # [1, 8, 4, 2]
        tail_buf = gl.allocate_shared_memory(gl.int32, [R, 32], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))

        if not PDL_EARLY:
            pdl_wait(PDL)                                               # after the weight loads
        pid = gl.program_id(0)
        num_programs = gl.num_programs(0)
        num_tiles = gl.cdiv(n_rows, R)
        if PIPELINE:
            rows = pid * R + r_idx                                      # [R] int32 (n_rows < 2**31 - R: host)
            pos, slot = _indices(pos_ptr, s_pos, slot_ptr, s_slot, rows, n_rows, OFFSETS32, CAST_ONLY)
            if PDL_EARLY:
                cs = _load_cos_sin(cs_ptr, s_cs, P, pos, rows, n_rows, cs_col, LPLANE, OFFSETS32)
                pdl_wait(PDL)                                           # x only after it
                xw, xp = _load_x(x_ptr, sx_w, rows, n_rows, word, pair_col, LPLANE, OFFSETS32)
            else:
                xw, xp = _load_x(x_ptr, sx_w, rows, n_rows, word, pair_col, LPLANE, OFFSETS32)
                cs = _tile_cos_sin(cs_ptr, s_cs, P, pos, rows, n_rows, cs_col, xp, LPLANE, OFFSETS32, CAST_ONLY)
            for tile in range(pid, num_tiles, num_programs):
                rows = tile * R + r_idx
                next_rows = rows + num_programs * R
                next_pos, next_slot = _indices(pos_ptr, s_pos, slot_ptr, s_slot, next_rows, n_rows, OFFSETS32,
                                               CAST_ONLY)
                next_xw, next_xp = _load_x(x_ptr, sx_w, next_rows, n_rows, word, pair_col, LPLANE, OFFSETS32)
                _write_rows(xw, xp, cs, pos, slot, rows, n_rows, w_lo, w_hi, w_pair, eps, P,
                            cache_ptr, s_blk, tok_stride, block_size, capacity, tail_buf, lane, tail_lane, merge_sel,
                            qword, R, LLANE, LPLANE, LQ, LW, SLOT32, LOG2_BLOCK, OFFSETS32, FP4, NEOX, CAST_ONLY,
                            ZERO_RESERVED, FLOOR_E)
                # the next positions arrived while this tile computed
                cs = _tile_cos_sin(cs_ptr, s_cs, P, next_pos, next_rows, n_rows, cs_col, next_xp, LPLANE, OFFSETS32,
                                   CAST_ONLY)
                pos = next_pos
                slot = next_slot
                xw = next_xw
                xp = next_xp
        elif PDL_EARLY:
            # the first tile's indices and cos/sin rows before the wait, its x after it; the later tiles as
            # without (loading them a tile ahead measured slower at 4096 rows). A program past the last
            # tile (none: the grid has at most one per tile) would write nothing: its rows are >= n_rows.
            rows = pid * R + r_idx
            pos, slot = _indices(pos_ptr, s_pos, slot_ptr, s_slot, rows, n_rows, OFFSETS32, CAST_ONLY)
            cs = _load_cos_sin(cs_ptr, s_cs, P, pos, rows, n_rows, cs_col, LPLANE, OFFSETS32)
            pdl_wait(PDL)
            xw, xp = _load_x(x_ptr, sx_w, rows, n_rows, word, pair_col, LPLANE, OFFSETS32)
            _write_rows(xw, xp, cs, pos, slot, rows, n_rows, w_lo, w_hi, w_pair, eps, P,
                        cache_ptr, s_blk, tok_stride, block_size, capacity, tail_buf, lane, tail_lane, merge_sel,
                        qword, R, LLANE, LPLANE, LQ, LW, SLOT32, LOG2_BLOCK, OFFSETS32, FP4, NEOX, CAST_ONLY,
                        ZERO_RESERVED, FLOOR_E)
            for tile in range(pid + num_programs, num_tiles, num_programs):
                rows = tile * R + r_idx
                pos, slot = _indices(pos_ptr, s_pos, slot_ptr, s_slot, rows, n_rows, OFFSETS32, CAST_ONLY)
                xw, xp = _load_x(x_ptr, sx_w, rows, n_rows, word, pair_col, LPLANE, OFFSETS32)
                cs = _tile_cos_sin(cs_ptr, s_cs, P, pos, rows, n_rows, cs_col, xp, LPLANE, OFFSETS32, CAST_ONLY)
                _write_rows(xw, xp, cs, pos, slot, rows, n_rows, w_lo, w_hi, w_pair, eps, P,
                            cache_ptr, s_blk, tok_stride, block_size, capacity, tail_buf, lane, tail_lane, merge_sel,
                            qword, R, LLANE, LPLANE, LQ, LW, SLOT32, LOG2_BLOCK, OFFSETS32, FP4, NEOX, CAST_ONLY,
                            ZERO_RESERVED, FLOOR_E)
        else:
            for tile in range(pid, num_tiles, num_programs):
                rows = tile * R + r_idx
                pos, slot = _indices(pos_ptr, s_pos, slot_ptr, s_slot, rows, n_rows, OFFSETS32, CAST_ONLY)
                xw, xp = _load_x(x_ptr, sx_w, rows, n_rows, word, pair_col, LPLANE, OFFSETS32)
                cs = _tile_cos_sin(cs_ptr, s_cs, P, pos, rows, n_rows, cs_col, xp, LPLANE, OFFSETS32, CAST_ONLY)
                _write_rows(xw, xp, cs, pos, slot, rows, n_rows, w_lo, w_hi, w_pair, eps, P,
                            cache_ptr, s_blk, tok_stride, block_size, capacity, tail_buf, lane, tail_lane, merge_sel,
                            qword, R, LLANE, LPLANE, LQ, LW, SLOT32, LOG2_BLOCK, OFFSETS32, FP4, NEOX, CAST_ONLY,
                            ZERO_RESERVED, FLOOR_E)


# --------------------------------------------------------------------------- host side
# (shared with main_latent_fp4, which launches this kernel with FP4=True: ``MainRecords`` says which)
_resident = {}               # launch key -> CTAs of that compiled variant resident on one SM


@dataclasses.dataclass(frozen=True)
class MainRecords:
    """What the host code of the kernel's two casts differs in."""
    name: str                # the format, in messages
    chain: tuple             # (cast_fmt, group, sf_format) over all 512 columns
    record_bytes: int        # bytes_per_token
    sf_offset: int           # the scales' byte offset in a record
    align: int               # the cache pointer and both strides: multiples of this (the widest code store)
    fp4: bool                # the kernel's FP4 constexpr
    floor_exp: Optional[int] = None   # the cast's scale_floor exponent (the kernel's FLOOR_E), None: no floor
    zero_reserved: bool = False       # the 4 reserved bytes after the scales written as zeros (ZERO_RESERVED)


RECORDS = MainRecords("MAIN_FP8", ("e4m3", 32, "ue8m0"), RECORD_BYTES, 512, 4, False, zero_reserved=True)
# DeepSeek V4.1's record: MAIN_FP8's codes and scales without the reserved bytes, the scale floored at 2^-13
RECORDS_MXFP8 = MainRecords("MAIN_MXFP8", ("e4m3", 32, "ue8m0"), _formats.MAIN_MXFP8.bytes_per_token, 512, 4,
                            False, _formats.scale_floor_exponent(_formats.MAIN_MXFP8.scale_floor))


def supports_records(rec: MainRecords, x, weight, positions, cos_sin, slot_mapping, kv_cache) -> str:
    """'' when the kernel handles the call for ``rec``'s records, else why not."""
    if x.dim() != 2 or x.shape[1] != HEAD_DIM or x.dtype != torch.bfloat16 or x.stride(1) != 1:
        return "x must be bf16 [n, 512] with unit column stride"
    if x.stride(0) % 2 or x.data_ptr() % 4:
        return "x rows must be 4-byte aligned (read as bf16 pairs)"
    if x.shape[0] >= INT32_LIMIT // 2:
        return "n must be < 2**30"
    if weight.shape != (HEAD_DIM,) or weight.dtype not in (torch.bfloat16, torch.float32) or weight.stride(0) != 1:
        return "weight must be a contiguous bf16/fp32 [512]"
    if weight.data_ptr() % 4:
        return "weight must be 4-byte aligned"
    if cos_sin.dim() != 2 or cos_sin.shape[1] != ROTARY_DIM or cos_sin.dtype not in (torch.float32, torch.bfloat16) \
            or cos_sin.stride(1) != 1 or cos_sin.shape[0] < 1:
        return "cos_sin must be fp32/bf16 [P, 64] (P >= 1) with unit column stride"
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        if t.dim() != 1 or t.shape[0] != x.shape[0] or t.dtype not in (torch.int32, torch.int64):
            return f"{name} must be int32/int64 [n]"
    c, k = kv_cache, rec.align
    if c.dtype != torch.uint8 or c.dim() != 4 or c.shape[2] != 1 or c.shape[3] != rec.record_bytes \
            or c.stride(3) != 1:
        return f"kv_cache must be uint8 [num_blocks, block_size, 1, {rec.record_bytes}] ({rec.name})"
    if c.stride(1) % k or c.stride(1) < rec.record_bytes or c.stride(0) % k or c.data_ptr() % k:
        return f"kv_cache records must be {k}-byte aligned (pointer, token and block strides multiples of {k})"
    devs = {t.device for t in (x, weight, positions, cos_sin, slot_mapping, kv_cache)}
    if len(devs) != 1 or next(iter(devs)).type != "cuda":
        return "all tensors must be on one CUDA device"
    return ""


def supports(x, weight, positions, cos_sin, slot_mapping, kv_cache) -> str:
    """'' when this kernel handles the call, else why not (the caller keeps the plain kernel)."""
    return supports_records(RECORDS, x, weight, positions, cos_sin, slot_mapping, kv_cache)


def launch_table(n_rows: int):
    """(num_warps, rows_per_warp, pipeline) per batch size, measured on the H200 with
    benchmarks/tune.py --kernel fast (``benchmarks/results/2026-11-29_h200_s5_gluon_tune*``):
    one one-warp row per CTA up to n = 1024 (n = 1024: 2.23 us against 2.41 with four warps), four
    warps per CTA up to 8192 (n = 4096: 3.44-3.49 us; two warps are within 1-3% either way at 2048 /
    4096 / 8192), one warp without pipeline up to 16384 (8.06 us against 8.45 with four warps), then
    one warp loading its next tile ahead (pipeline; n = 32768: 16.78 us against 17.53, 262144: best
    by 1-3%)."""
    return table_entry(LAUNCH_TABLE, n_rows)


# (first n_rows, (num_warps, rows_per_warp, pipeline)): see launch_table
LAUNCH_TABLE = ((1, (1, 1, False)), (1025, (4, 1, False)), (8193, (1, 1, False)), (16385, (1, 1, True)))


def launch_parts_records(rec: MainRecords, tensor, n: int, eps: float, x, weight, positions, cos_sin, slot_mapping,
                         kv_cache, num_warps: int, rows_per_warp: int, pipeline: bool, ctas_per_sm=None,
                         sm_count=None, neox: bool = True):
    """(grid, args, constexprs, options) of main_fp8_kernel writing ``rec``'s records; ``tensor(name)``
    goes where the tensor ``name`` goes (the tensor itself, or a launcher.PlanTensor), the tensors
    give the strides. ctas_per_sm / sm_count: given, no compilation and no device query (default:
    the compiled variant's occupancy and the SM count of x's device)."""
    block_size = kv_cache.shape[1]
    capacity = kv_cache.shape[0] * block_size
    T = tensor
    cast_only = weight is None           # no norm, no RoPE (``eligible_records``): x stands in for them
    s_pos, s_cs, table_rows = (0, 0, 0) if cast_only else (positions.stride(0), cos_sin.stride(0), cos_sin.shape[0])
    args = (T("x"), x.stride(0) // 2, T("weight"), float(eps), T("positions"), s_pos, T("cos_sin"),
            s_cs, table_rows, T("slot_mapping"), slot_mapping.stride(0),
            T("kv_cache"), kv_cache.stride(0), kv_cache.stride(1), block_size, capacity, n)
    # the largest offset each pointer is indexed with (rows up to one tile per program past n included)
    spans = ((n + 2 ** 20) * x.stride(0), (n + 2 ** 20) * max(s_pos, slot_mapping.stride(0)),
             table_rows * s_cs, kv_cache.shape[0] * kv_cache.stride(0) + rec.record_bytes)
    constexprs = dict(W_BF16=cast_only or weight.dtype == torch.bfloat16, SLOT32=capacity <= INT32_LIMIT,
                      LOG2_BLOCK=log2_block(block_size), ROWS_PER_WARP=rows_per_warp, PIPELINE=bool(pipeline),
                      OFFSETS32=max(spans) < INT32_LIMIT, FP4=rec.fp4, NEOX=bool(neox), CAST_ONLY=cast_only,
                      PDL=False, ZERO_RESERVED=rec.zero_reserved,
                      FLOOR_E=NO_FLOOR.value if rec.floor_exp is None else rec.floor_exp)
    if not cast_only:
        constexprs.update(early_reads_option(n))
    options = compile_options(num_warps)
    tiles = -(-n // (rows_per_warp * num_warps))
    tensors = dict(x=x, weight=weight, positions=positions, cos_sin=cos_sin, slot_mapping=slot_mapping,
                   kv_cache=kv_cache)
    grid = occupancy_grid(main_fp8_kernel, _resident, x, tiles, args, tensors, constexprs, options, ctas_per_sm,
                          sm_count)
    return grid, args, constexprs, options


def _launch_parts(tensor, n: int, eps: float, x, weight, positions, cos_sin, slot_mapping, kv_cache,
                  num_warps: int, rows_per_warp: int, pipeline: bool, ctas_per_sm=None, sm_count=None, neox=True):
    """``launch_parts_records`` for MAIN_FP8 records."""
    return launch_parts_records(RECORDS, tensor, n, eps, x, weight, positions, cos_sin, slot_mapping, kv_cache,
                                num_warps, rows_per_warp, pipeline, ctas_per_sm, sm_count, neox)


def _launch_parts_mxfp8(tensor, n: int, eps: float, x, weight, positions, cos_sin, slot_mapping, kv_cache,
                        num_warps: int, rows_per_warp: int, pipeline: bool, ctas_per_sm=None, sm_count=None,
                        neox=True):
    """``launch_parts_records`` for MAIN_MXFP8 records."""
    return launch_parts_records(RECORDS_MXFP8, tensor, n, eps, x, weight, positions, cos_sin, slot_mapping,
                                kv_cache, num_warps, rows_per_warp, pipeline, ctas_per_sm, sm_count, neox)


def eligible_records(rec: MainRecords, plan) -> bool:
    """Whether a validated kvfuse.plans.types.Plan is exactly the kernel's chain for ``rec``: RMSNorm, NEOX or
    GPT-J RoPE on columns 448..511 (not conjugate), or neither (CAST_ONLY: x's own cast), no Hadamard,
    ``rec.chain`` with ``rec.floor_exp``'s scale floor over all 512 columns, one
    head, records laid out as ``rec``'s (token-interleaved, the codes then the scales at
    ``rec.sf_offset``), no stage copy, and the alignments the kernel reads and writes with (x rows
    and weight as 4-byte words; the cache pointer and strides multiples of ``rec.align``: the
    pointer's alignment is part of the plan-cache key; x's and the weight's are checked per call,
    ``call_guard``)."""
    x, cache, c, f, a = plan.x, plan.kv_cache, plan.cast, plan.fmt, plan.addressing
    if cache is None or c is None or f is None or a is None:
        return False
    cast_only = plan.weight is None and plan.positions is None       # the CAST_ONLY kernel: x's own cast
    if not cast_only and (plan.weight is None or plan.positions is None or plan.norm_kind != "rms"):
        return False
    if plan.slot_mapping is None or plan.hadamard_scale is not None:
        return False
    if plan.out is not None or plan.out_stage is not None:
        return False
    if x.dim() != 3 or x.shape[1:] != (1, HEAD_DIM) or x.stride(2) != 1 or x.stride(0) % 2 \
            or x.shape[0] >= INT32_LIMIT // 2:
        return False
    if not cast_only and (plan.rotary_dim, plan.rope_offset, plan.conjugate) != (ROTARY_DIM, 448, False):
        return False
    if (c.cast_fmt, c.group, c.sf_format) != rec.chain or c.floor_exp != rec.floor_exp or plan.quant_dim != HEAD_DIM:
        return False
    if not f.token_interleaved or f.bytes_per_token != rec.record_bytes or f.bf16_tail \
            or f.zero_reserved != rec.zero_reserved:
        return False
    if cache.dim() != 4 or cache.shape[2] != 1 or cache.shape[3] != rec.record_bytes or cache.stride(3) != 1:
        return False
    if (a.data_offset, a.sf_offset) != (0, rec.sf_offset) \
            or a.data_token_stride != cache.stride(1) or a.sf_token_stride != cache.stride(1):
        return False
    k = rec.align
    if cache.stride(1) % k or cache.stride(0) % k or cache.data_ptr() % k:
        return False
    if cast_only:
        return True
    w, cs = plan.weight, plan.cos_sin
    return w.shape == (HEAD_DIM,) and w.stride(0) == 1 and cs.dim() == 2 and cs.shape[1] == ROTARY_DIM \
        and cs.shape[0] >= 1 and cs.stride(1) == 1


def checked_write_parts(rec: MainRecords, entry: str, launch_parts, x, weight, eps, positions, cos_sin,
                        slot_mapping, kv_cache, num_warps: int, rows_per_warp: int, pipeline: bool, ctas_per_sm,
                        neox: bool = True):
    """A direct write entry's checks (RuntimeError without the Gluon path, ValueError outside the
    kernel's assumptions, naming ``entry``), then its (grid, args, keyword args); None for n = 0."""
    if not available():
        raise RuntimeError(f"{entry}: the Gluon {rec.name} path needs Triton 3.6's Gluon and a CUDA device")
    why = supports_records(rec, x, weight, positions, cos_sin, slot_mapping, kv_cache)
    if num_warps not in (1, 2, 4, 8) or rows_per_warp not in (1, 2, 4):
        why = f"num_warps must be 1/2/4/8 and rows_per_warp 1/2/4 (powers of two), got {num_warps}, {rows_per_warp}"
    if why:
        raise ValueError(f"{entry}: {why}")
    n = x.shape[0]
    if n == 0:
        return None
    tensors = dict(x=x, weight=weight, positions=positions, cos_sin=cos_sin, slot_mapping=slot_mapping,
                   kv_cache=kv_cache)
    grid, args, constexprs, options = launch_parts(tensors.__getitem__, n, eps, x, weight, positions, cos_sin,
                                                   slot_mapping, kv_cache, num_warps, rows_per_warp, pipeline,
                                                   ctas_per_sm, neox=neox)
    return grid, args, {**constexprs, **options}


# --------------------------------------------------------------------------- kvfuse's dispatch
NAME = "main_latent"   # in KVFUSE_GLUON_SKIP
FORMATS = (_formats.MAIN_FP8, _formats.MAIN_MXFP8)   # the preset cache formats it writes (its GPU tests' formats)


def enabled() -> bool:
    """The fused entry point uses this kernel for the calls it fits (``eligible``) unless
    KVFUSE_GLUON=0, KVFUSE_GLUON_SKIP (a comma list) names "main_latent", or ``available()`` is false."""
    return allowed_by_env(NAME) and available()


MIN_ROWS = 1   # faster than the plain kernel at every measured size, n = 1 included
MIN_ROWS_PDL = 1


def records_of(plan) -> Optional[MainRecords]:
    """The records (RECORDS: MAIN_FP8's, RECORDS_MXFP8: MAIN_MXFP8's) whose chain a validated plan is
    (``eligible_records``), or None."""
    if not gluon_common.one_input_whole_norm(plan):
        return None
    for rec in (RECORDS, RECORDS_MXFP8):
        if eligible_records(rec, plan):
            return rec
    return None


def eligible(plan) -> bool:
    """Whether a validated plan is this kernel's MAIN_FP8 or MAIN_MXFP8 chain (``eligible_records``: e4m3 /
    UE8M0 / g32, records of 512 codes then 16 scales, 4-byte aligned; MAIN_MXFP8's scale floored at 2^-13)."""
    return records_of(plan) is not None


word_aligned = gluon_common.word_aligned      # x and the weight are read as 4-byte words
call_guard = gluon_common.x_weight_guard      # checked per call (the plan cache keys neither pointer)


def plan_launch_parts(plan, tensor, table, launch_parts) -> tuple:
    """(grid, positional args, keyword args) of the kernel for an eligible plan, from a module's
    launch table and ``launch_parts``; ``tensor(field)`` goes where the plan's tensor ``field`` goes
    (the tensor, or a launcher.PlanTensor for a Launch kept with the call signature)."""
    x = plan.x[:, 0, :]
    n = x.shape[0]
    nw, rpw, pipe = table(n)
    grid, args, constexprs, options = launch_parts(tensor, n, plan.eps, x, plan.weight, plan.positions, plan.cos_sin,
                                                   plan.slot_mapping, plan.kv_cache, nw, rpw, pipe, neox=plan.is_neox)
    return grid, args, {**constexprs, **options}


def plan_launch(plan, tensor, table=None) -> tuple:
    """(kernel name, grid, positional args, keyword args, namespace) of this kernel for an eligible
    plan (``plan_launch_parts``); ``table`` replaces ``launch_table`` (kvfuse.kernels.router.fast_paths)."""
    parts = _launch_parts_mxfp8 if records_of(plan) is RECORDS_MXFP8 else _launch_parts
    grid, args, kwargs = plan_launch_parts(plan, tensor, table or launch_table, parts)
    return "main_fp8_kernel", grid, args, kwargs, globals()


def main_latent_write(x, weight, eps, positions, cos_sin, slot_mapping, kv_cache, *, num_warps: int = 1,
                         rows_per_warp: int = 1, pipeline: bool = False, ctas_per_sm: int = None,
                         is_neox: bool = True) -> None:
    """Write MAIN_FP8 records for the rows of x: the same bytes as
    ``fused_norm_rope_hadamard_cast_store_kvcache(x, NormArgs(weight, eps), RopeArgs(positions,
    cos_sin, 64, is_neox), None, CastArgs.from_cache_format(MAIN_FP8), KVCacheOutArgs(kv_cache,
    slot_mapping, layout=MAIN_FP8))`` (block_size = kv_cache.shape[1]). kvfuse's fused entry point
    calls this kernel itself for such calls (``eligible``); this direct entry launches any variant
    (router.fast_paths(launch_table=...) does the same through the public call).

    Launch: tiles of rows_per_warp * num_warps rows; one CTA per tile up to what fits on the GPU at
    once (ctas_per_sm per SM: default, the compiled variant's occupancy), then each CTA loops over
    tiles (pipeline: load the next tile while computing this one). No host synchronization: CUDA
    graphs can capture it once it has been compiled (call it once before capturing).
    Raises ValueError outside this kernel's assumptions (see ``supports``)."""
    parts = checked_write_parts(RECORDS, "main_latent_write", _launch_parts, x, weight, eps, positions, cos_sin,
                                slot_mapping, kv_cache, num_warps, rows_per_warp, pipeline, ctas_per_sm, is_neox)
    if parts is not None:
        grid, args, kwargs = parts
        main_fp8_kernel[grid](*args, **kwargs)

