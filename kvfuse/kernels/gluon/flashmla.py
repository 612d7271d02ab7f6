"""A Gluon fast path for the two FlashMLA KV-cache writes (SPEC §8): RMSNorm -> NEOX RoPE on the
64-column bf16 tail -> e4m3 with UE8M0 scales on the quantized part -> the FlashMLA records, byte
for byte what ``kvfuse.kernels.portable.fused_kernel`` writes for these chains (SPEC §6, §7, §8).

The two chains (``eligible`` checks every field; anything else goes to the plain kernel):
- FLASHMLA_V32: head_dim 576 = 512 quantized (groups of 128, scale stored as the fp32 value 2^e,
  ``ue8m0_fp32``) + 64 bf16 tail columns 512..575, which are the RoPE columns (pairs (512 + j,
  544 + j)); token-interleaved record [512 codes | 4 fp32 scales | 128 tail bytes] = 656 bytes.
- FLASHMLA_MODEL1: head_dim 512 = 448 quantized (groups of 64, one UE8M0 byte each: 7 bytes and one
  reserved byte never written) + 64 bf16 tail columns 448..511 = the RoPE columns (pairs (448 + j,
  480 + j)); block-wide: inside a block, every token's [448 codes | 128 tail bytes], then every
  token's 8 scale bytes.
Both: num_heads 1, x bf16 [n, D] with an even row stride (read as int32 words), or x as two inputs
held apart at the quantized part ([n, QUANT_DIM] and the tail [n, 64], each with an even row stride);
V32 also with the norm over the 512 quantized columns only (DeepSeek V3's kv_norm: the tail's tree
is not added, mean = ss / 512, the tail words go into RoPE as they came); no Hadamard, no
stage copy; every data / tail / fp32-scale address a multiple of 4 (``eligible``), so codes and
the tail leave as 32-bit words, or 16-byte vectors where Triton's 16-divisibility specialization
proves it (the launcher and the plan cache key by ``data_ptr() % 16``).

One warp a row (lane l: columns 16 l .. 16 l + 15 as int32 words, and tail columns 2 l, 2 l + 1),
the norm's adjacent-pairs tree by in-lane sums then butterfly shuffles, groups of 8 (V32) or 4
(MODEL1) lanes for the scales, RoPE by one xor-16 shuffle on the tail words, a persistent grid.
Numerics mirror the plain kernel exactly (fp32 ops rounded one by one, div_rn / sqrt_rn, native
bf16 rounding, the UE8M0 exponent without division, the unguarded native e4m3 encode). The layout
and its instruction counts: docs/design.md ("The FlashMLA kernel").

The module imports without a GPU and under any Triton; ``available()`` says whether this path can
run (Triton 3.6's Gluon API and a CUDA device); ``enabled()``: on there unless KVFUSE_GLUON=0 or
KVFUSE_GLUON_SKIP names "flashmla"; proven byte-equal on the H200 by the GPU matrix.
"""
from __future__ import annotations

import torch

from ... import formats as _formats
from . import common as gluon_common
from ..codes import NO_FLOOR
from .common import (INT32_LIMIT, allowed_by_env, available, compile_options, early_reads_option, gl, gluon,
                     log2_block, occupancy_grid, plan_tensors)

ROTARY_DIM = 64
TAIL_DIM = 64                 # the bf16 tail = the RoPE columns

# The record layouts this path takes: the format fields that fix a record (name and
# block_alignment are free: "custom formats with the same records"), and the kernel's constexprs.
SUPPORTED_RECORDS = {
    # (head_dim, token_interleaved, cast_fmt, group, sf_format, sf_bytes, bf16_tail): format constexprs
    (576, True, "e4m3", 128, "ue8m0_fp32", 16, 64): dict(QUANT_DIM=512, GROUP=128, SF_FP32=True),
    (512, False, "e4m3", 64, "ue8m0", 8, 64): dict(QUANT_DIM=448, GROUP=64, SF_FP32=False),
}


if gluon is not None:
    from ..numerics import ue8m0_exponent  # the portable kernel's scale rule (Gluon calls it as it is)
    from .common import (as_offset, bf16x2, block_and_token, e4m3x4, hi_f32, lane_tree, lo_f32, load_indices,
                               shfl_xor, pdl_wait)

    ROPE_HALF_C = gl.constexpr(ROTARY_DIM // 2)     # the kernels read module globals only as constexprs
    TAIL_DIM_C = gl.constexpr(TAIL_DIM)

    @gluon.jit
    def _load_x(x_ptr, sx_w, xt_ptr, sxt_w, rows, n_rows, word, lane, TAIL_WORD0: gl.constexpr,
                OFFSETS32: gl.constexpr, SPLIT_X: gl.constexpr):
        """x of the rows: columns 0..511 as int32 words [R, 32, 8] (two bf16 each) and the tail
        columns as one word per lane [R, 32] (tail columns 2 l, 2 l + 1 on lane l); SPLIT_X: x_ptr holds
        the quantized columns and xt_ptr (row stride sxt_w words) the tail, which the word tile also
        reads where it covers the tail (MODEL1: columns 448..511, lanes 28..31, the norm's)."""
        rmask = gl.expand_dims(rows < n_rows, 1)                        # [R, 1]
        x_row = gl.expand_dims(as_offset(rows, OFFSETS32) * sx_w, 1)    # [R, 1] in words
        x_words = x_ptr.to(gl.pointer_type(gl.int32))
        if SPLIT_X:
            xt_words = xt_ptr.to(gl.pointer_type(gl.int32))
            xt_row = gl.expand_dims(as_offset(rows, OFFSETS32) * sxt_w, 1)
            rmask3 = gl.expand_dims(rmask, 2)
            if TAIL_WORD0 < 256:
                lead = word < TAIL_WORD0
                xw_lead = gl.load(x_words + gl.expand_dims(x_row, 2) + word, mask=rmask3 & lead, other=0)
                xw_tail = gl.load(xt_words + gl.expand_dims(xt_row, 2) + (word - TAIL_WORD0),
                                  mask=rmask3 & (word >= TAIL_WORD0), other=0)
                xw = gl.where(lead, xw_lead, xw_tail)
            else:
                xw = gl.load(x_words + gl.expand_dims(x_row, 2) + word, mask=rmask3, other=0)
            xt = gl.load(xt_words + xt_row + lane, mask=rmask, other=0)
        else:
            xw = gl.load(x_words + gl.expand_dims(x_row, 2) + word, mask=gl.expand_dims(rmask, 2), other=0)
            xt = gl.load(x_words + x_row + TAIL_WORD0 + lane, mask=rmask, other=0)
        return xw, xt

    @gluon.jit
    def _load_cos_sin(cs_ptr, s_cs, P, pos, rows, n_rows, pair_col, LP: gl.constexpr, OFFSETS32: gl.constexpr,
                      NEOX: gl.constexpr):
        """NEOX: (cos, sin) of each row's position for the lane's two rotation indices j = 2 (l % 16) +
        {0, 1}, fp32 [R, 32, 2] each; GPT-J: (cos_l, sin_l) of the lane's one index j = l as one [R, 32, 2]
        tensor, returned twice (``pair_col`` is then l + 32 k). Zeros where the position is outside
        [0, P): such rows are not rotated."""
        pok = (rows < n_rows) & (pos >= 0) & (pos < P)
        cs_row = as_offset(gl.where(pok, pos, 0), OFFSETS32) * s_cs
        cs_row3 = gl.expand_dims(gl.expand_dims(gl.convert_layout(cs_row, gl.SliceLayout(1, gl.SliceLayout(2, LP)),
                                                                  assert_trivial=True), 1), 2)
        pok3 = gl.expand_dims(gl.expand_dims(gl.convert_layout(pok, gl.SliceLayout(1, gl.SliceLayout(2, LP)),
                                                               assert_trivial=True), 1), 2)
        cos = gl.load(cs_ptr + cs_row3 + pair_col, mask=pok3, other=0.0).to(gl.float32)
        if NEOX:
            sin = gl.load(cs_ptr + cs_row3 + ROPE_HALF_C + pair_col, mask=pok3, other=0.0).to(gl.float32)
        else:
            sin = cos
        return cos, sin

    @gluon.jit
    def _row_indices(pos_ptr, s_pos, slot_ptr, s_slot, rows, n_rows, OFFSETS32: gl.constexpr, NO_ROPE: gl.constexpr):
        """(positions, slots) of the rows; NO_ROPE: the slots only (returned as the positions too, unread)."""
        if NO_ROPE:
            slot = gl.load(slot_ptr + as_offset(rows, OFFSETS32) * s_slot, mask=rows < n_rows, other=-1)
            return slot, slot
        else:
            return load_indices(pos_ptr, s_pos, slot_ptr, s_slot, rows, n_rows, OFFSETS32)

    @gluon.jit
    def _row_cos_sin(cs_ptr, s_cs, P, pos, rows, n_rows, pair_col, LP: gl.constexpr, OFFSETS32: gl.constexpr,
                     NEOX: gl.constexpr, NO_ROPE: gl.constexpr):
        """_load_cos_sin, or nothing loaded with NO_ROPE (``pair_col`` stands in, unread)."""
        if NO_ROPE:
            return pair_col, pair_col
        else:
            return _load_cos_sin(cs_ptr, s_cs, P, pos, rows, n_rows, pair_col, LP, OFFSETS32, NEOX)

    @gluon.jit
    def _rmsnorm(xw, xt, w_lo, w_hi, wt_lo, wt_hi, eps, R: gl.constexpr, LLANE: gl.constexpr,
                 QUANT_DIM: gl.constexpr, LATENT_NORM: gl.constexpr):
        """RMSNorm of the rows' words (pair in each word, the tree over the lane's 8 words, 5 shuffles):
        the normalized bf16 words of the quantized columns and of the tail (the tail as it came with
        LATENT_NORM)."""
        HEAD_DIM: gl.constexpr = QUANT_DIM + TAIL_DIM_C
        x_lo = lo_f32(xw)
        x_hi = hi_f32(xw)
        sq = x_lo * x_lo + x_hi * x_hi
        sq = gl.sum(gl.reshape(sq, [R, 32, 4, 2]), axis=3)
        sq = gl.sum(gl.reshape(sq, [R, 32, 2, 2]), axis=3)
        sq = gl.sum(gl.reshape(sq, [R, 32, 1, 2]), axis=3)
        ss = lane_tree(gl.convert_layout(gl.reshape(sq, [R, 32]), LLANE, assert_trivial=True))    # tree(0..511)
        xt_lo = lo_f32(xt)
        xt_hi = hi_f32(xt)
        NORM_COLS: gl.constexpr = QUANT_DIM if LATENT_NORM else HEAD_DIM
        if QUANT_DIM == 512 and not LATENT_NORM:
            # V32: the tail's own tree (columns 512..575), added at the root of the zero-padded tree
            ss = ss + lane_tree(xt_lo * xt_lo + xt_hi * xt_hi)
        if (NORM_COLS & (NORM_COLS - 1)) == 0:
            mean = ss * (1.0 / NORM_COLS)                               # exact: a power of two
        else:
            mean = gl.div_rn(ss, gl.full([R, 32], NORM_COLS * 1.0, gl.float32, LLANE))
        rstd = gl.div_rn(gl.full([R, 32], 1.0, gl.float32, LLANE), gl.sqrt_rn(mean + eps))   # [R, 32]
        rstd3 = gl.expand_dims(rstd, 2)
        yw = bf16x2((x_lo * rstd3) * w_lo, (x_hi * rstd3) * w_hi)        # [R, 32, 8] bf16 pairs

        if LATENT_NORM:
            yt = xt                                                     # the tail as it came (its bits)
        else:
            yt = bf16x2((xt_lo * rstd) * wt_lo, (xt_hi * rstd) * wt_hi)  # [R, 32] normalized tail
        return yw, yt

    @gluon.jit
    def _write_rows(xw, xt, cos, sin, pos, slot, rows, n_rows, w_lo, w_hi, wt_lo, wt_hi, sin_flip, eps, P,
                    cache_ptr, s_blk, data_tok, sf_tok, sf_off, tail_off, block_size, capacity, lane, qword,
                    R: gl.constexpr, LLANE: gl.constexpr, LQ: gl.constexpr,
                    QUANT_DIM: gl.constexpr, GROUP: gl.constexpr, SF_FP32: gl.constexpr,
                    SLOT32: gl.constexpr, LOG2_BLOCK: gl.constexpr, OFFSETS32: gl.constexpr, NEOX: gl.constexpr,
                    FLOOR_E: gl.constexpr, LATENT_NORM: gl.constexpr, NO_NORM: gl.constexpr,
                    NO_ROPE: gl.constexpr):
        """RMSNorm -> RoPE (tail) -> UE8M0 / e4m3 -> the records of one tile of R rows whose loads are done.
        NEOX: pairs (j, 32 + j) of the tail; else GPT-J's (2 j, 2 j + 1), which is tail word j = l.
        LATENT_NORM (V32): the norm covers the QUANT_DIM quantized columns only; the tail words pass
        through it (wt_lo / wt_hi unread). NO_NORM: no norm, the words go on as they came (the weights
        unread). NO_ROPE: no RoPE, the tail stored as the norm left it (cos, sin, pos unread)."""
        HEAD_DIM: gl.constexpr = QUANT_DIM + TAIL_DIM_C
        CODE_LANES: gl.constexpr = QUANT_DIM // 16                      # lanes owning quantized columns
        GROUP_LANES: gl.constexpr = GROUP // 16
        rmask = rows < n_rows
        pok = rmask & (pos >= 0) & (pos < P)

        if NO_NORM:
            yw = xw                                                     # the bits as they came
            yt = xt
        else:
            yw, yt = _rmsnorm(xw, xt, w_lo, w_hi, wt_lo, wt_hi, eps, R, LLANE, QUANT_DIM, LATENT_NORM)
        if NO_ROPE:
            tail = yt
        else:
            if NEOX:
                # ---- RoPE on the tail words: own word and the partner's (lane ^ 16)
                partner = shfl_xor(yt, 16)
                c0, c1 = gl.split(cos)
                s0, s1 = gl.split(sin)
                c0 = gl.convert_layout(c0, LLANE, assert_trivial=True)
                c1 = gl.convert_layout(c1, LLANE, assert_trivial=True)
                # first-half lanes rotate with -s: flipped as a bit (0 - s would turn -0 into +0)
                s0 = (gl.convert_layout(s0, LLANE, assert_trivial=True).to(gl.int32, bitcast=True) ^ sin_flip).to(
                    gl.float32, bitcast=True)
                s1 = (gl.convert_layout(s1, LLANE, assert_trivial=True).to(gl.int32, bitcast=True) ^ sin_flip).to(
                    gl.float32, bitcast=True)
                rot = bf16x2((lo_f32(yt) * c0) + (lo_f32(partner) * s0), (hi_f32(yt) * c1) + (hi_f32(partner) * s1))
            else:
                # ---- GPT-J: the lane's word is the pair (a, b) = (y_2l, y_2l+1); SPEC §6's products and sums
                c, s = gl.split(cos)
                c = gl.convert_layout(c, LLANE, assert_trivial=True)
                s = gl.convert_layout(s, LLANE, assert_trivial=True)
                a = lo_f32(yt)
                b = hi_f32(yt)
                rot = bf16x2((a * c) - (b * s), (a * s) + (b * c))
            tail = gl.where(gl.expand_dims(pok, 1), rot, yt)

        # ---- UE8M0 scale per group of GROUP_LANES lanes: numerics.group_scales(SF_UE8M0(_FP32), FMAX=448)
        y_lo = lo_f32(yw)
        y_hi = hi_f32(yw)
        amax = gl.max(gl.maximum(gl.abs(y_lo), gl.abs(y_hi)), axis=2)   # NaN-ignoring max, like tl.max
        amax = gl.maximum(amax, shfl_xor(amax, 1))
        amax = gl.maximum(amax, shfl_xor(amax, 2))
        if GROUP_LANES == 8:
            amax = gl.maximum(amax, shfl_xor(amax, 4))
        amax = gl.maximum(amax, 1e-4)
        e, m = ue8m0_exponent(amax, 448.0, FLOOR_E)
        m3 = gl.expand_dims(m, 2)
        # codes of columns 4q .. 4q + 3 = (lo, hi) of words 2q and 2q + 1
        t0, t2 = gl.split(gl.reshape(y_lo * m3, [R, 32, 4, 2]))
        t1, t3 = gl.split(gl.reshape(y_hi * m3, [R, 32, 4, 2]))
        codes = gl.convert_layout(e4m3x4(t0, t1, t2, t3), LQ, assert_trivial=True)    # [R, 32, 4]

        # ---- the record addresses; an invalid slot (or a row past n_rows) writes nothing
        ok = rmask & (slot >= 0) & (slot < capacity)
        blk, tok = block_and_token(slot, ok, block_size, SLOT32, LOG2_BLOCK, OFFSETS32)
        base = blk * s_blk
        data = base + tok * data_tok                                    # [R] bytes (data_offset 0)
        sf = base + tok * sf_tok + sf_off
        tail_at = data + tail_off
        ok2 = gl.expand_dims(ok, 1)                                     # [R, 1]
        words = cache_ptr.to(gl.pointer_type(gl.int32))

        # codes: four 32-bit words per lane (lanes < CODE_LANES), 4-byte aligned records (host)
        data_q = gl.expand_dims(gl.expand_dims(gl.convert_layout(data >> 2, gl.SliceLayout(1, gl.SliceLayout(2, LQ)),
                                                                 assert_trivial=True), 1), 2)
        ok_q = gl.expand_dims(gl.expand_dims(gl.convert_layout(ok, gl.SliceLayout(1, gl.SliceLayout(2, LQ)),
                                                               assert_trivial=True), 1), 2)
        if CODE_LANES < 32:
            ok_q = ok_q & (qword < QUANT_DIM // 4)
        gl.store(words + data_q + qword, codes, mask=ok_q)
        # scales: the first lane of each group
        first = ok2 & ((lane & (GROUP_LANES - 1)) == 0)
        if CODE_LANES < 32:
            first = first & (lane < CODE_LANES)
        if SF_FP32:
            gl.store(words + gl.expand_dims(sf >> 2, 1) + lane // GROUP_LANES, (e + 127) << 23, mask=first)
        else:
            gl.store(cache_ptr + gl.expand_dims(sf, 1) + lane // GROUP_LANES, (e + 127).to(gl.uint8), mask=first)
        # the tail: one 32-bit word per lane
        gl.store(words + gl.expand_dims(tail_at >> 2, 1) + lane, tail, mask=ok2)

    @gluon.jit(do_not_specialize=["n_rows", "P", "capacity"])
    def mla_tail_kernel(
        x_ptr, sx_w,                            # x bf16 [n, QUANT_DIM + 64] (read as int32 words); row stride in words
        w_ptr, eps,                             # RMSNorm weight [QUANT_DIM + 64] (bf16 or fp32)
        pos_ptr, s_pos, cs_ptr, s_cs, P,        # positions [n]; cos_sin [P, 64] (cos | sin; fp32 or bf16)
        slot_ptr, s_slot,                       # slot_mapping [n]
        cache_ptr, s_blk, data_tok, sf_tok, sf_off, tail_off, block_size, capacity,   # kv_cache uint8 (plan addressing)
        n_rows,
        xt_ptr, sxt_w,                          # SPLIT_X: the tail columns' own input [n, 64] (None without)
        QUANT_DIM: gl.constexpr, GROUP: gl.constexpr, SF_FP32: gl.constexpr,
        W_BF16: gl.constexpr, SLOT32: gl.constexpr, LOG2_BLOCK: gl.constexpr, ROWS_PER_WARP: gl.constexpr,
        PIPELINE: gl.constexpr, OFFSETS32: gl.constexpr, NEOX: gl.constexpr, FLOOR_E: gl.constexpr,
        PDL: gl.constexpr, SPLIT_X: gl.constexpr = False, LATENT_NORM: gl.constexpr = False,
        NO_NORM: gl.constexpr = False, NO_ROPE: gl.constexpr = False, PDL_EARLY: gl.constexpr = False,
    ):
        """A program walks over the tiles pid, pid + num_programs, ... (R = ROWS_PER_WARP * num_warps
        rows each; warp w owns rows w * ROWS_PER_WARP ..). QUANT_DIM / GROUP / SF_FP32: the format
        (512 / 128 / True: FLASHMLA_V32; 448 / 64 / False: FLASHMLA_MODEL1). LOG2_BLOCK:
        log2(block_size) when it is a power of two, else -1 (a division). PIPELINE: load tile t + 1
        (x, indices; its cos/sin after tile t's stores) while tile t computes. OFFSETS32: every x,
        index, cos/sin and cache offset of the launch is below 2**31 (host). NEOX: NEOX RoPE pairs on the
        tail, else GPT-J's. FLOOR_E: the scale_floor's exponent (FlashMLA's presets: -13), NO_FLOOR without.
        SPLIT_X: x_ptr holds the QUANT_DIM quantized columns and xt_ptr the tail (two inputs, one row).
        LATENT_NORM (V32): the RMSNorm covers the quantized columns only (weight [QUANT_DIM]); the tail
        goes into RoPE as it came. NO_NORM: no norm (w_ptr None; engines hand the latent normalized).
        NO_ROPE: no RoPE (pos_ptr, cs_ptr None: vLLM's concat_and_cache_mla, the context-parallel second
        pass). All four default off (a launch without them names none). PDL_EARLY (with PDL): the first tile's
        positions, slots and cos/sin rows are read before the wait, x after it (kvfuse.set_pdl's early_reads)."""
        NW: gl.constexpr = gl.num_warps()
        R: gl.constexpr = ROWS_PER_WARP * NW
        TAIL_WORD0: gl.constexpr = QUANT_DIM // 2                       # the tail's first word in x's row
        # words [R, 32, 8]: lane l owns the 8 int32 words of bf16 columns 16 l .. 16 l + 15
        LW: gl.constexpr = gl.BlockedLayout([ROWS_PER_WARP, 1, 8], [1, 32, 1], [NW, 1, 1], [2, 1, 0])
        # code words [R, 32, 4]: four e4m3 codes each, lane l owns record words 4 l .. 4 l + 3
        LQ: gl.constexpr = gl.BlockedLayout([ROWS_PER_WARP, 1, 4], [1, 32, 1], [NW, 1, 1], [2, 1, 0])
        # cos / sin [R, 32, 2]: lane l holds rotation indices 2 (l % 16), 2 (l % 16) + 1
        LP: gl.constexpr = gl.BlockedLayout([ROWS_PER_WARP, 1, 2], [1, 32, 1], [NW, 1, 1], [2, 1, 0])
        LLANE: gl.constexpr = gl.SliceLayout(2, LW)                     # [R, 32]: one value per lane and row
        LROW: gl.constexpr = gl.SliceLayout(1, LLANE)                   # [R]

        # ---- loop-invariant indices and the weight
        r_idx = gl.arange(0, R, layout=LROW)
        lane = gl.expand_dims(gl.arange(0, 32, layout=gl.SliceLayout(0, LLANE)), 0)            # [1, 32]
        k8 = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, LW)))
        word = gl.expand_dims(lane, 2) * 8 + gl.expand_dims(gl.expand_dims(k8, 0), 1)           # [1, 32, 8]
        k4 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, LQ)))
        qword = (gl.expand_dims(gl.convert_layout(lane, gl.SliceLayout(2, LQ), assert_trivial=True), 2) * 4
                 + gl.expand_dims(gl.expand_dims(k4, 0), 1))                                    # [1, 32, 4]
        k2 = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, LP)))
        if NEOX:
            pair_col = (gl.expand_dims(gl.convert_layout((lane & 15) * 2, gl.SliceLayout(2, LP), assert_trivial=True), 2)
                        + gl.expand_dims(gl.expand_dims(k2, 0), 1))                             # [1, 32, 2]
        else:
            pair_col = (gl.expand_dims(gl.convert_layout(lane, gl.SliceLayout(2, LP), assert_trivial=True), 2)
                        + ROPE_HALF_C * gl.expand_dims(gl.expand_dims(k2, 0), 1))               # cos_l, sin_l
        sin_flip = gl.where(lane < 16, -2147483648, 0)                  # the fp32 sign bit on first-half lanes

        if NO_NORM:
            w_lo = word.to(gl.float32)                                  # stand-ins, never read
            w_hi = w_lo
            wt_lo = lane.to(gl.float32)
            wt_hi = wt_lo
        elif W_BF16:
            w_words = w_ptr.to(gl.pointer_type(gl.int32))
            ww = gl.load(w_words + word)
            w_lo = lo_f32(ww)
            w_hi = hi_f32(ww)
            if LATENT_NORM:
                wt_lo = w_lo                                            # not read (the weight has no tail)
                wt_hi = w_hi
            else:
                wt = gl.load(w_words + TAIL_WORD0 + lane)
                wt_lo = lo_f32(wt)
                wt_hi = hi_f32(wt)
        else:
            w_lo = gl.load(w_ptr + 2 * word)
            w_hi = gl.load(w_ptr + 2 * word + 1)
            if LATENT_NORM:
                wt_lo = w_lo
                wt_hi = w_hi
            else:
                wt_lo = gl.load(w_ptr + QUANT_DIM + 2 * lane)
                wt_hi = gl.load(w_ptr + QUANT_DIM + 2 * lane + 1)

        if not PDL_EARLY:
            pdl_wait(PDL)                                               # after the weight loads
        pid = gl.program_id(0)
        num_programs = gl.num_programs(0)
        num_tiles = gl.cdiv(n_rows, R)
        if PIPELINE:
            rows = pid * R + r_idx                                      # [R] int32 (n_rows < 2**30: host)
            pos, slot = _row_indices(pos_ptr, s_pos, slot_ptr, s_slot, rows, n_rows, OFFSETS32, NO_ROPE)
            if PDL_EARLY:
                cos, sin = _row_cos_sin(cs_ptr, s_cs, P, pos, rows, n_rows, pair_col, LP, OFFSETS32, NEOX, NO_ROPE)
                pdl_wait(PDL)                                           # x only after it
                xw, xt = _load_x(x_ptr, sx_w, xt_ptr, sxt_w, rows, n_rows, word, lane, TAIL_WORD0, OFFSETS32,
                                 SPLIT_X)
            else:
                xw, xt = _load_x(x_ptr, sx_w, xt_ptr, sxt_w, rows, n_rows, word, lane, TAIL_WORD0, OFFSETS32,
                                 SPLIT_X)
                cos, sin = _row_cos_sin(cs_ptr, s_cs, P, pos, rows, n_rows, pair_col, LP, OFFSETS32, NEOX, NO_ROPE)
            for tile in range(pid, num_tiles, num_programs):
                rows = tile * R + r_idx
                next_rows = rows + num_programs * R
                next_pos, next_slot = _row_indices(pos_ptr, s_pos, slot_ptr, s_slot, next_rows, n_rows, OFFSETS32,
                                                   NO_ROPE)
                next_xw, next_xt = _load_x(x_ptr, sx_w, xt_ptr, sxt_w, next_rows, n_rows, word, lane, TAIL_WORD0,
                                           OFFSETS32, SPLIT_X)
                _write_rows(xw, xt, cos, sin, pos, slot, rows, n_rows, w_lo, w_hi, wt_lo, wt_hi, sin_flip, eps, P,
                            cache_ptr, s_blk, data_tok, sf_tok, sf_off, tail_off, block_size, capacity, lane, qword,
                            R, LLANE, LQ, QUANT_DIM, GROUP, SF_FP32, SLOT32, LOG2_BLOCK, OFFSETS32, NEOX, FLOOR_E,
                            LATENT_NORM, NO_NORM, NO_ROPE)
                # the next positions arrived while this tile computed
                cos, sin = _row_cos_sin(cs_ptr, s_cs, P, next_pos, next_rows, n_rows, pair_col, LP, OFFSETS32, NEOX,
                                        NO_ROPE)
                pos = next_pos
                slot = next_slot
                xw = next_xw
                xt = next_xt
        elif PDL_EARLY:
            # the first tile's indices and cos/sin rows before the wait, its x after it; the later tiles as
            # without (loading them a tile ahead measured slower at 4096 rows). A program past the last
            # tile (none: the grid has at most one per tile) would write nothing: its rows are >= n_rows.
            rows = pid * R + r_idx
            pos, slot = _row_indices(pos_ptr, s_pos, slot_ptr, s_slot, rows, n_rows, OFFSETS32, NO_ROPE)
            cos, sin = _row_cos_sin(cs_ptr, s_cs, P, pos, rows, n_rows, pair_col, LP, OFFSETS32, NEOX, NO_ROPE)
            pdl_wait(PDL)
            xw, xt = _load_x(x_ptr, sx_w, xt_ptr, sxt_w, rows, n_rows, word, lane, TAIL_WORD0, OFFSETS32, SPLIT_X)
            _write_rows(xw, xt, cos, sin, pos, slot, rows, n_rows, w_lo, w_hi, wt_lo, wt_hi, sin_flip, eps, P,
                        cache_ptr, s_blk, data_tok, sf_tok, sf_off, tail_off, block_size, capacity, lane, qword,
                        R, LLANE, LQ, QUANT_DIM, GROUP, SF_FP32, SLOT32, LOG2_BLOCK, OFFSETS32, NEOX, FLOOR_E,
                        LATENT_NORM, NO_NORM, NO_ROPE)
            for tile in range(pid + num_programs, num_tiles, num_programs):
                rows = tile * R + r_idx
                pos, slot = _row_indices(pos_ptr, s_pos, slot_ptr, s_slot, rows, n_rows, OFFSETS32, NO_ROPE)
                xw, xt = _load_x(x_ptr, sx_w, xt_ptr, sxt_w, rows, n_rows, word, lane, TAIL_WORD0, OFFSETS32, SPLIT_X)
                cos, sin = _row_cos_sin(cs_ptr, s_cs, P, pos, rows, n_rows, pair_col, LP, OFFSETS32, NEOX, NO_ROPE)
                _write_rows(xw, xt, cos, sin, pos, slot, rows, n_rows, w_lo, w_hi, wt_lo, wt_hi, sin_flip, eps, P,
                            cache_ptr, s_blk, data_tok, sf_tok, sf_off, tail_off, block_size, capacity, lane, qword,
                            R, LLANE, LQ, QUANT_DIM, GROUP, SF_FP32, SLOT32, LOG2_BLOCK, OFFSETS32, NEOX, FLOOR_E,
                            LATENT_NORM, NO_NORM, NO_ROPE)
        else:
            for tile in range(pid, num_tiles, num_programs):
                rows = tile * R + r_idx
                pos, slot = _row_indices(pos_ptr, s_pos, slot_ptr, s_slot, rows, n_rows, OFFSETS32, NO_ROPE)
                xw, xt = _load_x(x_ptr, sx_w, xt_ptr, sxt_w, rows, n_rows, word, lane, TAIL_WORD0, OFFSETS32, SPLIT_X)
                cos, sin = _row_cos_sin(cs_ptr, s_cs, P, pos, rows, n_rows, pair_col, LP, OFFSETS32, NEOX, NO_ROPE)
                _write_rows(xw, xt, cos, sin, pos, slot, rows, n_rows, w_lo, w_hi, wt_lo, wt_hi, sin_flip, eps, P,
                            cache_ptr, s_blk, data_tok, sf_tok, sf_off, tail_off, block_size, capacity, lane, qword,
                            R, LLANE, LQ, QUANT_DIM, GROUP, SF_FP32, SLOT32, LOG2_BLOCK, OFFSETS32, NEOX, FLOOR_E,
                            LATENT_NORM, NO_NORM, NO_ROPE)


# --------------------------------------------------------------------------- host side
_resident = {}               # launch key -> CTAs of that compiled variant resident on one SM


def record_key(fmt) -> tuple:
    """The format fields that fix a record's layout and numerics (SUPPORTED_RECORDS' keys)."""
    return (fmt.head_dim, fmt.token_interleaved, fmt.cast_fmt, fmt.elements_per_sf, fmt.sf_format, fmt.sf_bytes,
            fmt.bf16_tail)


def format_constexprs(fmt):
    """The kernel's format constexprs (QUANT_DIM, GROUP, SF_FP32) for a supported record, else None (a
    format whose reserved bytes are written as zeros included: the kernel never writes them)."""
    return None if fmt.zero_reserved else SUPPORTED_RECORDS.get(record_key(fmt))


def launch_table(n_rows: int):
    """(num_warps, rows_per_warp, pipeline) per batch size, measured on the H200 with
    benchmarks/tune.py --kernel fast (``benchmarks/results/2026-11-29_h200_s*_gluon_tune*``):
    two one-row warps per CTA up to n = 16384 (n = 1: 1.70 / 1.73 us for V32 / MODEL1 against 1.76 /
    1.84 with one warp; n = 8192: 5.12 / 4.90 us against 5.24 / 5.08 with four warps; n = 4096: within
    1% of four warps), two warps of two rows each, no pipeline, above (V32 at n = 262144: 145.1 us =
    89.7% of copy, against 195.8 us with the earlier table's one pipelined warp; MODEL1 128.2 us)."""
    return gluon_common.table_entry(LAUNCH_TABLE, n_rows)


# (first n_rows, (num_warps, rows_per_warp, pipeline)): see launch_table
LAUNCH_TABLE = ((1, (2, 1, False)), (16385, (2, 2, False)))


def launch_parts(plan, tensor, num_warps: int, rows_per_warp: int, pipeline: bool, ctas_per_sm: int = None,
                 sm_count: int = None):
    """(grid, positional args, constexprs, options) of mla_tail_kernel for an eligible plan.
    ``tensor(field)`` goes where the plan's tensor ``field`` goes; the plan's tensors give strides.
    ctas_per_sm / sm_count: given, no compilation and no device query (default: the compiled
    variant's occupancy on the plan's device)."""
    x = plan.x[:, 0, :]                                   # [n, D], or the quantized columns of two inputs
    n = x.shape[0]
    cache, a = plan.kv_cache, plan.addressing
    block_size = cache.shape[1]
    capacity = cache.shape[0] * block_size
    xt = None if plan.x_tail is None else plan.x_tail[:, 0, :]
    T = tensor
    args = (T("x"), x.stride(0) // 2, None if plan.weight is None else T("weight"), float(plan.eps),
            *((None, 0, None, 0, 0) if plan.positions is None else
              (T("positions"), plan.positions.stride(0), T("cos_sin"), plan.cos_sin.stride(0), plan.cos_sin.shape[0])),
            T("slot_mapping"), plan.slot_mapping.stride(0),
            T("kv_cache"), cache.stride(0), a.data_token_stride, a.sf_token_stride, a.sf_offset, a.tail_offset,
            block_size, capacity, n,
            *((None, None) if xt is None else (T("x_tail"), xt.stride(0) // 2)))
    # the largest offset each pointer is indexed with (rows up to one tile per program past n included)
    rope = plan.positions is not None
    spans = ((n + 2 ** 20) * max(x.stride(0), 0 if xt is None else xt.stride(0)),
             (n + 2 ** 20) * max(plan.positions.stride(0) if rope else 0, plan.slot_mapping.stride(0)),
             (plan.cos_sin.shape[0] + 1) * plan.cos_sin.stride(0) if rope else 0, (cache.shape[0] + 1) * cache.stride(0))
    constexprs = dict(format_constexprs(plan.fmt),
                      W_BF16=plan.weight is not None and plan.weight.dtype == torch.bfloat16,
                      SLOT32=capacity <= INT32_LIMIT, LOG2_BLOCK=log2_block(block_size),
                      ROWS_PER_WARP=rows_per_warp, PIPELINE=bool(pipeline), OFFSETS32=max(spans) < INT32_LIMIT,
                      NEOX=bool(plan.is_neox) if plan.positions is not None else True,
                      FLOOR_E=NO_FLOOR.value if plan.cast.floor_exp is None else plan.cast.floor_exp,
                      PDL=False, **input_constexprs(plan), **early_reads_option(n))
    options = compile_options(num_warps)
    tiles = -(-n // (rows_per_warp * num_warps))
    grid = occupancy_grid(mla_tail_kernel, _resident, x, tiles, args, {**plan_tensors(plan), "x_tail": plan.x_tail},
                          constexprs, options, ctas_per_sm, sm_count)
    return grid, args, constexprs, options


def input_constexprs(plan) -> dict:
    """SPLIT_X (two inputs), LATENT_NORM (the norm over the quantized columns only), NO_NORM and NO_ROPE
    where they are on; off they are left to the kernel's defaults, so that a launch of one input and a
    whole-record norm is spelled as before they existed."""
    found = {}
    if plan.x_tail is not None:
        found["SPLIT_X"] = True
    if plan.weight is None:
        found["NO_NORM"] = True
    elif plan.norm_dim != plan.head_dim:
        found["LATENT_NORM"] = True
    if plan.positions is None:
        found["NO_ROPE"] = True
    return found


# --------------------------------------------------------------------------- kvfuse's dispatch
NAME = "flashmla"   # in KVFUSE_GLUON_SKIP
FORMATS = (_formats.FLASHMLA_V32, _formats.FLASHMLA_MODEL1,)   # the preset cache formats it writes (its GPU tests' formats)


def enabled() -> bool:
    """On with Triton 3.6 on CUDA (``available()``; proven byte-equal on the H200, see
    docs/performance.md), unless KVFUSE_GLUON=0 (every Gluon path off) or KVFUSE_GLUON_SKIP (a comma list)
    names "mla_tail"."""
    return allowed_by_env(NAME) and available()


# faster than (or within 0.02 us of) the plain kernel at every measured size with the tuned
# table (n = 1: V32 1.70 vs 1.87 us, MODEL1 1.73 vs 1.75; n = 256: V32 2.15 vs 2.30, MODEL1 1.96 vs
# 1.94; benchmarks/results/2026-11-29_h200_s4_gluon_tune.txt)
MIN_ROWS = 1
MIN_ROWS_PDL = 1


def eligible(plan) -> bool:
    """Whether a validated kvfuse.plans.types.Plan is exactly one of this kernel's chains: no norm or RMSNorm
    (over the whole record, or for V32 over the 512 quantized columns only), no RoPE or NEOX or GPT-J RoPE
    (not conjugate) on the 64 tail columns, no Hadamard, no stage copy, one head, x one input or two
    split at the quantized part (the quantized columns and the tail, each with an even row stride),
    a cache whose records are FLASHMLA_V32's or FLASHMLA_MODEL1's (any name: ``SUPPORTED_RECORDS``)
    with the matching cast, and the alignments the kernel writes with: the cache pointer, the block
    stride and every record offset / stride of the data, tail (and fp32 scales) multiples of 4 (the
    cache pointer's alignment is part of the plan-cache key; x's and the weight's 4-byte alignment
    is checked per call, ``word_aligned``)."""
    x, cache, c, f, a = plan.x, plan.kv_cache, plan.cast, plan.fmt, plan.addressing
    if cache is None or c is None or f is None or a is None:
        return False
    if plan.weight is not None and plan.norm_kind != "rms":
        return False
    if plan.slot_mapping is None or plan.hadamard_scale is not None or plan.out is not None or plan.out_stage is not None:
        return False
    consts = format_constexprs(f)
    if consts is None:
        return False
    D = f.head_dim
    quant_dim = consts["QUANT_DIM"]
    xt = plan.x_tail
    if xt is None:
        if x.dim() != 3 or tuple(x.shape[1:]) != (1, D) or x.stride(2) != 1 or x.stride(0) % 2:
            return False
    else:   # two inputs: the quantized columns and the tail, each read as int32 words
        if tuple(x.shape[1:]) != (1, quant_dim) or tuple(xt.shape[1:]) != (1, D - quant_dim):
            return False
        if x.stride(2) != 1 or xt.stride(2) != 1 or x.stride(0) % 2 or xt.stride(0) % 2:
            return False
    # the norm: none, the whole record, or (V32) the quantized columns only
    if plan.weight is not None and plan.norm_dim not in (D, quant_dim if quant_dim == 512 else D):
        return False
    if x.shape[0] >= INT32_LIMIT // 2:
        return False
    if plan.positions is not None and (plan.rotary_dim, plan.rope_offset, plan.conjugate) != (
            ROTARY_DIM, quant_dim, False):
        return False
    if (c.cast_fmt, c.group, c.sf_format, plan.quant_dim) != (f.cast_fmt, f.elements_per_sf, f.sf_format, quant_dim):
        return False
    if cache.dim() != 4 or cache.shape[2] != 1 or a.data_offset != 0:
        return False
    word_addressed = [cache.data_ptr(), cache.stride(0), a.data_token_stride, a.tail_offset]
    if consts["SF_FP32"]:
        word_addressed += [a.sf_token_stride, a.sf_offset]
    if any(v % 4 for v in word_addressed):
        return False
    w, cs = plan.weight, plan.cos_sin
    return ((w is None or (w.dim() == 1 and w.stride(0) == 1))
            and (plan.positions is None or (cs.dim() == 2 and cs.shape[1] == ROTARY_DIM and cs.stride(1) == 1)))


word_aligned = gluon_common.word_aligned      # x and the weight are read as 4-byte words


def inputs_word_aligned(x, weight, x_tail) -> bool:
    """Two inputs: x, its tail input and the weight are read as 4-byte words."""
    return not ((x.data_ptr() | weight.data_ptr() | x_tail.data_ptr()) & 3)


def x_word_aligned(x, x_tail) -> bool:
    """Without a norm: x and its tail input (x twice for one input) are read as 4-byte words."""
    return not ((x.data_ptr() | x_tail.data_ptr()) & 3)


def call_guard(plan) -> tuple:
    """(check, plan fields) run per call (the plan cache keys none of these pointers)."""
    if plan.weight is None:
        return x_word_aligned, ("x", "x" if plan.x_tail is None else "x_tail")
    if plan.x_tail is None:
        return gluon_common.x_weight_guard(plan)
    return inputs_word_aligned, ("x", "weight", "x_tail")


def plan_launch(plan, tensor, table=None) -> tuple:
    """(kernel name, grid, positional args, keyword args, namespace) of this kernel for an eligible
    plan; ``tensor(field)`` goes where the plan's tensor ``field`` goes (the tensor, or a
    launcher.PlanTensor for a Launch kept with the call signature); ``table`` replaces
    ``launch_table`` (kvfuse.kernels.router.fast_paths). Everything but the tensors is a function of
    the plan's signature and n."""
    num_warps, rows_per_warp, pipeline = (table or launch_table)(plan.x.shape[0])
    grid, args, constexprs, options = launch_parts(plan, tensor, num_warps, rows_per_warp, pipeline)
    # the defaulted constexprs named too: kernels.launcher's direct launch takes every constexpr by name
    defaults = {"SPLIT_X": False, "LATENT_NORM": False, "NO_NORM": False, "NO_ROPE": False}
    return "mla_tail_kernel", grid, args, {**defaults, **constexprs, **options}, globals()
