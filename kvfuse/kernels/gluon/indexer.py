"""A Gluon fast path for the 128-d INDEXER writes: norm -> RoPE -> (Hadamard) -> per-group quantization
-> a block-wide cache (every token's codes, then every token's scales), byte for byte what the
portable kernel writes (SPEC §6, §7), for INDEX_FP8_FP32, INDEX_MXFP8, INDEX_MXFP4, INDEX_NVFP4 and
ue8m0_fp32 scales of 128 (one kernel, constexprs CAST, G, SF per format); with CONTIG, the same rows
into contiguous (q, sf) outputs (the indexer Q). Chains: RMSNorm or LayerNorm (bias optional) or
none (Q), RoPE NEOX or GPT-J on columns 64..127 or 0..63 (DeepSeek V4's / V3.2's indexer), the
128-point Hadamard or none; no stage copy, one head for a cache (``eligible`` says exactly which).

Layout: 8 lanes a row, 4 rows a warp; lane l owns chunk A = columns 8l..8l+7 and chunk B = 64 + 8l..
as 4 int32 words each (two bf16 a word). Norm trees: 3 levels in-lane, 3 butterfly shuffles, 1 across
the chunks. RoPE NEOX: the partner is lane l ^ 4 (one shuffle); GPT-J: the word's other half. The
Hadamard keeps SPEC §6's order: distances 1, 2, 4 in-lane, 8, 16, 32 one shuffle and one exact fma
(multiplier +-1) each, 64 between the chunks. Groups of 16 / 32 / 128 columns span 2 / 4 / 8 lanes;
the lanes of a pair split the scale work. e4m3 codes by cvt.rn.satfinite (64-bit stores a chunk),
e2m1 by ``_e2m1x2_bf16`` (UE8M0 groups, two codes an instruction) or ``gluon_common.e2m1_nibble``;
their host mirrors are proven against kvfuse.reference.encode_e2m1 on every input. A persistent grid
walks the row tiles (PIPELINE: the next tile's loads during this one). Numerics: fp32 ops one by one
(enable_fp_fusion=False; the only fma is the Hadamard's exact one), div_rn / sqrt_rn, cvt.rn bf16.
Design notes, instruction counts and measurements: docs/design.md, docs/performance.md.

The module imports without a GPU and under any Triton; ``available()`` says whether this path can
run (Triton 3.6's Gluon API and a CUDA device); ``enabled()``: on there unless KVFUSE_GLUON=0 or
KVFUSE_GLUON_SKIP names "indexer". Proven byte-equal on the H200 by tests/gpu/test_gpu_matrix.py.
"""
from __future__ import annotations

import functools

import torch

from ... import formats as _formats
from . import common as gluon_common
from ..codes import CAST_CODES, CAST_E2M1, CAST_E4M3, SF_CODES, SF_FP32, SF_UE8M0, SF_UE8M0_FP32
from .common import (INT32_LIMIT, allowed_by_env, available, compile_options, early_reads_option, gl, gluon,
                     log2_block, occupancy_grid, plan_tensors)

HEAD_DIM = 128
ROTARY_DIM = 64
ROPE_OFFSETS = (64, 0)           # the tail (DeepSeek V4's indexer, the presets) or the head (V3.2's)
# (cast_fmt, group, sf_format) -> (CAST, SF) constexprs; e4m3 records hold 128 data bytes, e2m1 64
CHAINS = {chain: (CAST_CODES[chain[0]], SF_CODES[chain[2]]) for chain in (
    ("e4m3", 128, "fp32"), ("e4m3", 128, "ue8m0_fp32"), ("e4m3", 32, "ue8m0"), ("e2m1", 32, "ue8m0"),
    ("e2m1", 16, "e4m3"))}
# CAST -> the cache pointer's alignment the code stores need (64-bit stores of e4m3 codes, 32-bit of e2m1)
CACHE_ALIGN = {CAST_E4M3.value: 8, CAST_E2M1.value: 4}


if gluon is not None:
    from .common import (b64, e4m3_scale, group_scale, as_offset, bf16x2, block_and_token, e2m1_nibble, e4m3x4, expand_rows, hi_f32, lo_f32,
                               shfl_xor, pdl_wait)

    @gluon.jit
    def _e2m1x2_bf16(yw, m2):
        """Packed bf16 words yw (two values each) times m2 (bf16x2 of a power of two: the product is exact
        in bf16) -> e2m1 codes in bits 0..3 (low value) and 16..19 (high value), zeros elsewhere: the
        codes ``_e2m1`` gives for the fp32 products (equal to the bf16 ones down to 2^-17; smaller
        products give code 0 with their sign either way). Per half (a = min(|t|, 6) as bf16, NaN -> 6):
        a < 1: a + 64 rounds a to a multiple of 0.5 (the ulp of 64 in bf16), the low bits of 0x4280 +
        RTNE(2a); a >= 1: (a + 0x11F + bit 6 of a) >> 6 = 256 + code (integer RTNE to one mantissa bit;
        the halves' carries never cross: a <= 0x40C0); set.ge.u32.bf16x2 with 1.0 gives the per-half
        mask that picks one; the sign bit of t goes to bit 3 of the code."""
        return gl.inline_asm_elementwise(
            "{ .reg .b32 t, a, k, r, b, big, c6, c64, one; "
            "mov.b32 c6, 0x40C040C0; mov.b32 c64, 0x42804280; mov.b32 one, 0x3F803F80; "
            "mul.rn.bf16x2 t, $1, $2; "
            "and.b32 a, t, 0x7FFF7FFF; "
            "min.bf16x2 a, a, c6; "
            "add.rn.bf16x2 k, a, c64; "
            "shr.b32 b, a, 6; and.b32 b, b, 0x00010001; "
            "add.u32 r, a, 0x011F011F; add.u32 r, r, b; shr.b32 r, r, 6; "
            "set.ge.u32.bf16x2 big, a, one; "
            "and.b32 r, r, big; not.b32 big, big; and.b32 k, k, big; or.b32 r, r, k; "
            "shr.b32 t, t, 12; and.b32 t, t, 0x00080008; "
            "and.b32 r, r, 0x00070007; or.b32 $0, r, t; }",
            "=r,r,r", [yw, m2], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _rows_cs(v, LCROW: gl.constexpr):
        """[R] (row slice layout) -> [R, 1, 1] in the cos/sin layout (no data movement)."""
        return gl.expand_dims(gl.expand_dims(gl.convert_layout(v, LCROW, assert_trivial=True), 1), 2)

    @gluon.jit
    def _chunk_sum(sq, R: gl.constexpr, LL: gl.constexpr):
        """[R, 8, 4] per-word sums (tree level 1) -> [R, 8]: levels 2 and 3 inside the lane's chunk."""
        sq = gl.sum(gl.reshape(sq, [R, 8, 2, 2]), axis=3)
        sq = gl.sum(gl.reshape(sq, [R, 8, 1, 2]), axis=3)
        return gl.convert_layout(gl.reshape(sq, [R, 8]), LL, assert_trivial=True)

    @gluon.jit
    def _tile_indices(pos_ptr, s_pos, slot_ptr, s_slot, rows, n_rows, OFFSETS32: gl.constexpr, CONTIG: gl.constexpr,
                      LOG2_HEADS: gl.constexpr):
        """Positions and slots [R] of ``_load_tile``."""
        r = as_offset(gl.minimum(rows, n_rows - 1), OFFSETS32)
        if CONTIG:
            pos = gl.load(pos_ptr + (r >> LOG2_HEADS) * s_pos)
            slot = pos
        else:
            pos = gl.load(pos_ptr + r * s_pos)
            slot = gl.load(slot_ptr + r * s_slot)
        return pos, slot

    @gluon.jit
    def _tile_x(x_ptr, sx_w, rows, n_rows, word, OFFSETS32: gl.constexpr):
        """x's two chunks [R, 8, 4] of ``_load_tile``."""
        r = as_offset(gl.minimum(rows, n_rows - 1), OFFSETS32)
        xw_ptr = x_ptr.to(gl.pointer_type(gl.int32)) + expand_rows(r * sx_w) + word  # [R, 8, 4]
        xa = gl.load(xw_ptr)                                    # columns 8l .. 8l + 7
        xb = gl.load(xw_ptr + 32)                               # columns 64 + 8l .. 64 + 8l + 7
        return xa, xb

    @gluon.jit
    def _load_tile(x_ptr, sx_w, pos_ptr, s_pos, slot_ptr, s_slot, rows, n_rows, word, OFFSETS32: gl.constexpr,
                   CONTIG: gl.constexpr, LOG2_HEADS: gl.constexpr):
        """Positions and slots [R] and x's two chunks as int32 words [R, 8, 4]. Rows past n_rows load row
        n_rows - 1 (unmasked loads: no zero-fill, no predicates; such rows store nothing). CONTIG: row
        r is head r % 2^LOG2_HEADS of token r >> LOG2_HEADS (the token's position), and there are no
        slots (the returned ``slot`` is a placeholder)."""
        pos, slot = _tile_indices(pos_ptr, s_pos, slot_ptr, s_slot, rows, n_rows, OFFSETS32, CONTIG, LOG2_HEADS)
        xa, xb = _tile_x(x_ptr, sx_w, rows, n_rows, word, OFFSETS32)
        return pos, slot, xa, xb

    @gluon.jit
    def _load_cos_sin(cs_ptr, s_cs, P, pos, cs_col, word, R: gl.constexpr, LW: gl.constexpr,
                      LCROW: gl.constexpr, OFFSETS32: gl.constexpr, NEOX: gl.constexpr):
        """(cos, sin) of the lane's rotated chunk as fp32 [R, 8, 4] word pairs (lo, hi) = columns (2w, 2w + 1)
        of the chunk. NEOX: pair j = 8 (l & 3) + column; GPT-J: both halves of word w form pair 4 l + w
        (lo and hi get the same cos / sin). A position outside [0, P) loads row 0 (P >= 1: host; such
        rows are not rotated): unmasked loads."""
        pok = (pos >= 0) & (pos < P)
        row = as_offset(gl.where(pok, pos, 0), OFFSETS32) * s_cs
        if NEOX:
            cs_row = _rows_cs(row, LCROW)
            c = gl.load(cs_ptr + cs_row + cs_col).to(gl.float32)                             # [R, 8, 8]
            s = gl.load(cs_ptr + cs_row + 32 + cs_col).to(gl.float32)
            c_lo, c_hi = gl.split(gl.reshape(c, [R, 8, 4, 2]))
            s_lo, s_hi = gl.split(gl.reshape(s, [R, 8, 4, 2]))
            c_lo = gl.convert_layout(c_lo, LW, assert_trivial=True)
            c_hi = gl.convert_layout(c_hi, LW, assert_trivial=True)
            s_lo = gl.convert_layout(s_lo, LW, assert_trivial=True)
            s_hi = gl.convert_layout(s_hi, LW, assert_trivial=True)
        else:
            cs_row = expand_rows(row)                                                        # [R, 1, 1]
            c_lo = gl.load(cs_ptr + cs_row + word).to(gl.float32)                            # [R, 8, 4]
            s_lo = gl.load(cs_ptr + cs_row + 32 + word).to(gl.float32)
            c_hi = c_lo
            s_hi = s_lo
        return c_lo, c_hi, s_lo, s_hi

    @gluon.jit
    def _rope_words(y, c_lo, c_hi, s_lo, s_hi, pok, partner_flip, NEOX: gl.constexpr):
        """RoPE on a chunk's bf16 words [R, 8, 4] of the rows whose position is in range: own * c + partner * s
        (SPEC §6's a*c - b*s as a*c + (-b)*s, the same IEEE result). NEOX: the partner is lane l ^ 4's
        same column, negated on first-half lanes (``partner_flip``); GPT-J: the other half of the same
        word, negated in the low half (whose partner is subtracted)."""
        if NEOX:
            partner = shfl_xor(y, 4) ^ partner_flip
        else:
            partner = (((y >> 16) & 0xFFFF) | (y << 16)) ^ 0x8000
        rot = bf16x2((lo_f32(y) * c_lo) + (lo_f32(partner) * s_lo),
                     (hi_f32(y) * c_hi) + (hi_f32(partner) * s_hi))
        return gl.where(expand_rows(pok), rot, y)

    @gluon.jit
    def _words4(y, R: gl.constexpr, LL: gl.constexpr):
        """A chunk's words [R, 8, 4] -> its four words as [R, 8] tensors (registers only)."""
        e, o = gl.split(gl.reshape(y, [R, 8, 2, 2]))                   # words (0, 2), (1, 3)
        w0, w2 = gl.split(e)
        w1, w3 = gl.split(o)
        return (gl.convert_layout(w0, LL, assert_trivial=True), gl.convert_layout(w1, LL, assert_trivial=True),
                gl.convert_layout(w2, LL, assert_trivial=True), gl.convert_layout(w3, LL, assert_trivial=True))

    @gluon.jit
    def _bfly(a, b):
        return a + b, a - b

    @gluon.jit
    def _in_lane8(w0, w1, w2, w3):
        """A chunk's 4 bf16 words -> its 8 fp32 values after the Hadamard levels at distance 1, 2, 4."""
        v0, v1 = _bfly(lo_f32(w0), hi_f32(w0))
        v2, v3 = _bfly(lo_f32(w1), hi_f32(w1))
        v4, v5 = _bfly(lo_f32(w2), hi_f32(w2))
        v6, v7 = _bfly(lo_f32(w3), hi_f32(w3))
        v0, v2 = _bfly(v0, v2)
        v1, v3 = _bfly(v1, v3)
        v4, v6 = _bfly(v4, v6)
        v5, v7 = _bfly(v5, v7)
        v0, v4 = _bfly(v0, v4)
        v1, v5 = _bfly(v1, v5)
        v2, v6 = _bfly(v2, v6)
        v3, v7 = _bfly(v3, v7)
        return v0, v1, v2, v3, v4, v5, v6, v7

    @gluon.jit
    def _across(v, sgn, MASK: gl.constexpr):
        """One Hadamard level across lanes l, l ^ MASK: partner + own (lower lane), partner + (-own) =
        partner - own (upper lane, sgn -1): the pair's a + b and a - b. One fma: v * sgn is exact
        (sgn is +-1), so the fused result is the rounded sum, bit for bit the fp32 addition."""
        return gl.fma(v, sgn, shfl_xor(v, MASK))

    @gluon.jit
    def _across8(v0, v1, v2, v3, v4, v5, v6, v7, sgn, MASK: gl.constexpr):
        return (_across(v0, sgn, MASK), _across(v1, sgn, MASK), _across(v2, sgn, MASK), _across(v3, sgn, MASK),
                _across(v4, sgn, MASK), _across(v5, sgn, MASK), _across(v6, sgn, MASK), _across(v7, sgn, MASK))

    @gluon.jit
    def _hadamard_chunk(a0, a1, a2, a3, a4, a5, a6, a7, sgn1, sgn2, sgn4):
        """The levels at distance 8, 16, 32 (lanes xor 1, 2, 4) of a chunk's 8 values per lane."""
        a0, a1, a2, a3, a4, a5, a6, a7 = _across8(a0, a1, a2, a3, a4, a5, a6, a7, sgn1, 1)
        a0, a1, a2, a3, a4, a5, a6, a7 = _across8(a0, a1, a2, a3, a4, a5, a6, a7, sgn2, 2)
        return _across8(a0, a1, a2, a3, a4, a5, a6, a7, sgn4, 4)

    @gluon.jit
    def _hadamard128(ya, yb, sgn1, sgn2, sgn4, had_scale, R: gl.constexpr, LL: gl.constexpr):
        """The 128-point Hadamard of a row (SPEC §6: distances 1, 2, ..., 64, then * scale, bf16) ->
        its 8 bf16 words per lane: chunk A's (ha0..ha3), chunk B's (hb0..hb3), [R, 8] each."""
        w0, w1, w2, w3 = _words4(ya, R, LL)
        a0, a1, a2, a3, a4, a5, a6, a7 = _in_lane8(w0, w1, w2, w3)
        a0, a1, a2, a3, a4, a5, a6, a7 = _hadamard_chunk(a0, a1, a2, a3, a4, a5, a6, a7, sgn1, sgn2, sgn4)
        w0, w1, w2, w3 = _words4(yb, R, LL)
        b0, b1, b2, b3, b4, b5, b6, b7 = _in_lane8(w0, w1, w2, w3)
        b0, b1, b2, b3, b4, b5, b6, b7 = _hadamard_chunk(b0, b1, b2, b3, b4, b5, b6, b7, sgn1, sgn2, sgn4)
        a0, b0 = _bfly(a0, b0)                                          # distance 64: the lane's two chunks
        a1, b1 = _bfly(a1, b1)
        a2, b2 = _bfly(a2, b2)
        a3, b3 = _bfly(a3, b3)
        a4, b4 = _bfly(a4, b4)
        a5, b5 = _bfly(a5, b5)
        a6, b6 = _bfly(a6, b6)
        a7, b7 = _bfly(a7, b7)
        return (bf16x2(a0 * had_scale, a1 * had_scale), bf16x2(a2 * had_scale, a3 * had_scale),
                bf16x2(a4 * had_scale, a5 * had_scale), bf16x2(a6 * had_scale, a7 * had_scale),
                bf16x2(b0 * had_scale, b1 * had_scale), bf16x2(b2 * had_scale, b3 * had_scale),
                bf16x2(b4 * had_scale, b5 * had_scale), bf16x2(b6 * had_scale, b7 * had_scale))

    @gluon.jit
    def _words_amax(w0, w1, w2, w3):
        """max |y| over a chunk's 4 bf16 words [R, 8], on the packed words (max.bf16x2: exact, NaN-ignoring
        like max.f32 / tl.max)."""
        a = _max_bf16x2(_max_bf16x2(w0 & 0x7FFF7FFF, w1 & 0x7FFF7FFF), _max_bf16x2(w2 & 0x7FFF7FFF, w3 & 0x7FFF7FFF))
        return gl.maximum(lo_f32(a), hi_f32(a))

    @gluon.jit
    def _fp8_words(w0, w1, w2, w3, m):
        """A chunk's 4 bf16 words [R, 8] times m [R, 8] -> its 8 e4m3 codes as one int64 [R, 8]."""
        q0 = e4m3x4(lo_f32(w0) * m, hi_f32(w0) * m, lo_f32(w1) * m, hi_f32(w1) * m)
        q1 = e4m3x4(lo_f32(w2) * m, hi_f32(w2) * m, lo_f32(w3) * m, hi_f32(w3) * m)
        return b64(q0, q1)

    @gluon.jit
    def _bytes_word(b0, b1, b2, b3):
        """Four int32 whose low bytes are bytes 0..3 of a word (garbage above) -> the word (three prmt)."""
        return gl.inline_asm_elementwise(
            "{ .reg .b32 lo, hi; prmt.b32 lo, $1, $2, 0x0040; prmt.b32 hi, $3, $4, 0x0040; "
            "prmt.b32 $0, lo, hi, 0x5410; }", "=r,r,r,r,r", [b0, b1, b2, b3], dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _e2m1_byte(w, m, m2, PACKED: gl.constexpr):
        """A bf16 word's two values times m -> their e2m1 codes in the low byte (low value in bits 0..3)."""
        if PACKED:
            c = _e2m1x2_bf16(w, m2)                                     # codes at bits 0..3, 16..19
            b = c + (c >> 12)
        else:
            b = e2m1_nibble(lo_f32(w) * m) + (e2m1_nibble(hi_f32(w) * m) << 4)
        return b

    @gluon.jit
    def _fp4_words(w0, w1, w2, w3, m, PACKED: gl.constexpr):
        """A chunk's 4 bf16 words [R, 8] times m [R, 8] -> its 8 e2m1 codes as one int32 [R, 8] (byte w:
        columns 2w (low nibble), 2w + 1). PACKED: m is a power of two (UE8M0)."""
        m_bits = m.to(gl.int32, bitcast=True)
        m2 = ((m_bits >> 16) & 0xFFFF) | (m_bits & -65536)             # bf16 of m, twice (exact when PACKED)
        return _bytes_word(_e2m1_byte(w0, m, m2, PACKED), _e2m1_byte(w1, m, m2, PACKED),
                           _e2m1_byte(w2, m, m2, PACKED), _e2m1_byte(w3, m, m2, PACKED))

    @gluon.jit
    def _group_amax(aa, ab, G: gl.constexpr):
        """Per-lane amax of chunks A and B [R, 8] -> the amax of each lane's groups (floored at 1e-4):
        G 16: two lanes (xor 1); 32: four lanes (xor 1, 2); 128: both chunks of all 8 lanes (then aa
        and ab are the same tensor)."""
        if G == 128:
            aa = gl.maximum(aa, ab)
            aa = gl.maximum(aa, shfl_xor(aa, 1))
            aa = gl.maximum(aa, shfl_xor(aa, 2))
            aa = gl.maximum(aa, shfl_xor(aa, 4))
            ab = aa
        else:
            aa = gl.maximum(aa, shfl_xor(aa, 1))
            ab = gl.maximum(ab, shfl_xor(ab, 1))
            if G == 32:
                aa = gl.maximum(aa, shfl_xor(aa, 2))
                ab = gl.maximum(ab, shfl_xor(ab, 2))
        return gl.maximum(aa, 1e-4), gl.maximum(ab, 1e-4)

    @gluon.jit
    def _split_scales(amax_a, amax_b, lane, CAST: gl.constexpr, SF: gl.constexpr):
        """Both lanes of a pair (l, l ^ 1) hold the amax of both groups they touch: the even lane
        computes chunk A's group's scale, the odd lane chunk B's, and one xor-1 shuffle gives each the
        other's multiplier (half the divisions of NVFP4, half the UE8M0 exponent work). G 128: one
        group; the even lanes compute m = FMAX / amax, the odd ones s = amax / FMAX, the same two
        IEEE divisions as group_scales. Returns (m of chunk A, m of chunk B, the stored scale of the
        lane's own group: byte or fp32 bits; for G 128, lane 0's is s)."""
        FMAX: gl.constexpr = 448.0 if CAST == CAST_E4M3 else 6.0
        odd = (lane & 1) == 1
        if SF == SF_FP32:
            amax = amax_a
            fmax = gl.full_like(amax, FMAX)
            q = gl.div_rn(gl.where(odd, amax, fmax), gl.where(odd, fmax, amax))     # even: m, odd: s
            other = shfl_xor(q, 1)
            m_a = gl.where(odd, other, q)
            m_b = m_a
            stored = other.to(gl.int32, bitcast=True)
        else:
            m_own, stored = group_scale(gl.where(odd, amax_b, amax_a), SF, FMAX)
            m_other = shfl_xor(m_own, 1)
            m_a = gl.where(odd, m_other, m_own)
            m_b = gl.where(odd, m_own, m_other)
        return m_a, m_b, stored

    @gluon.jit
    def _fp8_chunk(y, m, R: gl.constexpr, LL: gl.constexpr):
        """A chunk's bf16 words [R, 8, 4] times m [R, 8] -> its 8 e4m3 codes as one int64 [R, 8]."""
        m3 = gl.expand_dims(m, 2)
        lo0, lo1 = gl.split(gl.reshape(lo_f32(y) * m3, [R, 8, 2, 2]))    # columns 4q, 4q + 2
        hi0, hi1 = gl.split(gl.reshape(hi_f32(y) * m3, [R, 8, 2, 2]))    # columns 4q + 1, 4q + 3
        q0, q1 = gl.split(e4m3x4(lo0, hi0, lo1, hi1))                    # codes of columns 0..3, 4..7
        return b64(gl.convert_layout(q0, LL, assert_trivial=True), gl.convert_layout(q1, LL, assert_trivial=True))

    @gluon.jit
    def _word_of_bytes(b, R: gl.constexpr, LL: gl.constexpr):
        """[R, 8, 4] int32 whose low bytes are a chunk's 4 code bytes (garbage above) -> one int32 [R, 8],
        byte w of the word = the low byte of b[..., w] (three prmt)."""
        b02, b13 = gl.split(gl.reshape(b, [R, 8, 2, 2]))               # bytes (0, 2), (1, 3)
        b0, b2 = gl.split(b02)
        b1, b3 = gl.split(b13)
        return gl.convert_layout(_bytes_word(b0, b1, b2, b3), LL, assert_trivial=True)

    @gluon.jit
    def _fp4_chunk(y, m, PACKED: gl.constexpr, R: gl.constexpr, LL: gl.constexpr):
        """A chunk's bf16 words [R, 8, 4] times m [R, 8] -> its 8 e2m1 codes as one int32 [R, 8] (byte w:
        columns 2w (low nibble), 2w + 1). PACKED: m is a power of two (UE8M0): two codes per
        instruction on the bf16 words."""
        if PACKED:
            m_bits = m.to(gl.int32, bitcast=True)
            m2 = gl.expand_dims(((m_bits >> 16) & 0xFFFF) | (m_bits & -65536), 2)   # bf16 of m, twice (exact)
            c = _e2m1x2_bf16(y, m2)                                       # codes at bits 0..3, 16..19
            b = c + (c >> 12)                                             # no overlapping bits: an or
            word = _word_of_bytes(b, R, LL)
        else:
            # the nibbles never overlap: + is |, and shift-and-add is one instruction (LEA)
            m3 = gl.expand_dims(m, 2)
            b = e2m1_nibble(lo_f32(y) * m3) + (e2m1_nibble(hi_f32(y) * m3) << 4)             # byte w
            b02, b13 = gl.split(gl.reshape(b, [R, 8, 2, 2]))
            h = b02 | (b13 << 8)
            h0, h1 = gl.split(h)
            word = gl.convert_layout(h0 | (h1 << 16), LL, assert_trivial=True)
        return word

    @gluon.jit
    def _max_bf16x2(a, b):
        """Per-half max of packed bf16 words (max.bf16x2: NaN-ignoring, like max.f32)."""
        return gl.inline_asm_elementwise("max.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=gl.int32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _chunk_amax_bf16x2(y, R: gl.constexpr):
        """max |y| over a chunk's bf16 words [R, 8, 4] -> [R, 8] fp32, on the packed words: the same value
        as ``_chunk_amax`` (a max of bf16 values is exact; NaN ignored the same way)."""
        a = y & 0x7FFF7FFF
        a0, a1 = gl.split(gl.reshape(a, [R, 8, 2, 2]))
        a = _max_bf16x2(a0, a1)
        a0, a1 = gl.split(a)
        a = _max_bf16x2(a0, a1)
        return gl.maximum(lo_f32(a), hi_f32(a))

    @gluon.jit
    def _chunk_amax(y):
        """max |y| over a chunk's bf16 words [R, 8, 4] -> [R, 8] (NaN-ignoring max.f32, like tl.max)."""
        return gl.max(gl.maximum(gl.abs(lo_f32(y)), gl.abs(hi_f32(y))), axis=2)

    @gluon.jit
    def _write_rows(xa, xb, c_lo, c_hi, s_lo, s_hi, pos, slot, rows, n_rows, wa_lo, wa_hi, wb_lo, wb_hi,
                    ba_lo, ba_hi, bb_lo, bb_hi, eps, had_scale, P,
                    cache_ptr, s_blk, sf_off, sf_tok, block_size, capacity, lane, partner_flip, sgn1, sgn2, sgn4,
                    sf_ptr, q_row, sf_row,
                    R: gl.constexpr, LL: gl.constexpr, CAST: gl.constexpr, G: gl.constexpr, SF: gl.constexpr,
                    PACKED_E2M1: gl.constexpr, SLOT32: gl.constexpr, LOG2_BLOCK: gl.constexpr,
                    OFFSETS32: gl.constexpr, NORM: gl.constexpr, CONTIG: gl.constexpr, LAYER: gl.constexpr,
                    HAS_BIAS: gl.constexpr, NEOX: gl.constexpr, ROPE_A: gl.constexpr, HAD: gl.constexpr):
        """Norm -> RoPE -> (Hadamard) -> quantization -> the records of one tile of R rows whose loads are done
        (CONTIG: the rows of the contiguous q / sf outputs instead of cache records)."""
        rmask = rows < n_rows
        pok = rmask & (pos >= 0) & (pos < P)

        if NORM:
            # ---- the norm's adjacent-pairs trees: levels 1-3 inside each chunk, 4-6 across lanes, 7 the
            # lane's two chunks; LayerNorm: first on x (the mean), then on d = x - mean
            xa_lo = lo_f32(xa)
            xa_hi = hi_f32(xa)
            xb_lo = lo_f32(xb)
            xb_hi = hi_f32(xb)
            if LAYER:
                sa = _chunk_sum(xa_lo + xa_hi, R, LL)
                sb = _chunk_sum(xb_lo + xb_hi, R, LL)
                sa = sa + shfl_xor(sa, 1)
                sb = sb + shfl_xor(sb, 1)
                sa = sa + shfl_xor(sa, 2)
                sb = sb + shfl_xor(sb, 2)
                sa = sa + shfl_xor(sa, 4)
                sb = sb + shfl_xor(sb, 4)
                mu = gl.expand_dims((sa + sb) * (1.0 / 128), 2)        # exact: a power of two
                xa_lo = xa_lo - mu
                xa_hi = xa_hi - mu
                xb_lo = xb_lo - mu
                xb_hi = xb_hi - mu
            ssa = _chunk_sum(xa_lo * xa_lo + xa_hi * xa_hi, R, LL)
            ssb = _chunk_sum(xb_lo * xb_lo + xb_hi * xb_hi, R, LL)
            ssa = ssa + shfl_xor(ssa, 1)
            ssb = ssb + shfl_xor(ssb, 1)
            ssa = ssa + shfl_xor(ssa, 2)
            ssb = ssb + shfl_xor(ssb, 2)
            ssa = ssa + shfl_xor(ssa, 4)
            ssb = ssb + shfl_xor(ssb, 4)
            mean = (ssa + ssb) * (1.0 / 128)                            # exact: a power of two
            rstd = gl.expand_dims(gl.div_rn(gl.full_like(mean, 1.0), gl.sqrt_rn(mean + eps)), 2)
            if HAS_BIAS:
                ya = bf16x2(((xa_lo * rstd) * wa_lo) + ba_lo, ((xa_hi * rstd) * wa_hi) + ba_hi)
                yb = bf16x2(((xb_lo * rstd) * wb_lo) + bb_lo, ((xb_hi * rstd) * wb_hi) + bb_hi)
            else:
                ya = bf16x2((xa_lo * rstd) * wa_lo, (xa_hi * rstd) * wa_hi)  # [R, 8, 4] bf16 pairs
                yb = bf16x2((xb_lo * rstd) * wb_lo, (xb_hi * rstd) * wb_hi)
        else:
            ya = xa                                                     # no norm: RoPE reads x's bf16
            yb = xb

        # ---- RoPE on the rotated chunk (B: the tail, A: offset 0)
        if ROPE_A:
            ya = _rope_words(ya, c_lo, c_hi, s_lo, s_hi, pok, partner_flip, NEOX)
        else:
            yb = _rope_words(yb, c_lo, c_hi, s_lo, s_hi, pok, partner_flip, NEOX)

        # ---- scales per group and codes
        if HAD:
            ha0, ha1, ha2, ha3, hb0, hb1, hb2, hb3 = _hadamard128(ya, yb, sgn1, sgn2, sgn4, had_scale, R, LL)
            amax_a = _words_amax(ha0, ha1, ha2, ha3)
            amax_b = _words_amax(hb0, hb1, hb2, hb3)
        elif PACKED_E2M1 and CAST == CAST_E2M1 and SF == SF_UE8M0:
            amax_a = gl.convert_layout(_chunk_amax_bf16x2(ya, R), LL, assert_trivial=True)
            amax_b = gl.convert_layout(_chunk_amax_bf16x2(yb, R), LL, assert_trivial=True)
        else:
            amax_a = _chunk_amax(ya)
            amax_b = _chunk_amax(yb)
        amax_a, amax_b = _group_amax(amax_a, amax_b, G)
        m_a, m_b, stored = _split_scales(amax_a, amax_b, lane, CAST, SF)
        if HAD:
            if CAST == CAST_E4M3:
                qa = _fp8_words(ha0, ha1, ha2, ha3, m_a)
                qb = _fp8_words(hb0, hb1, hb2, hb3, m_b)
            else:
                qa = _fp4_words(ha0, ha1, ha2, ha3, m_a, PACKED_E2M1 and SF == SF_UE8M0)
                qb = _fp4_words(hb0, hb1, hb2, hb3, m_b, PACKED_E2M1 and SF == SF_UE8M0)
        elif CAST == CAST_E4M3:
            qa = _fp8_chunk(ya, m_a, R, LL)
            qb = _fp8_chunk(yb, m_b, R, LL)
        else:
            qa = _fp4_chunk(ya, m_a, PACKED_E2M1 and SF == SF_UE8M0, R, LL)
            qb = _fp4_chunk(yb, m_b, PACKED_E2M1 and SF == SF_UE8M0, R, LL)

        if CONTIG:
            # ---- the rows of q [rows, q_row bytes] and sf [rows, sf_row bytes]; rows past n_rows write nothing
            ok = rmask
            r = as_offset(rows, OFFSETS32)
            data = gl.expand_dims(r * q_row, 1)                         # [R, 1] bytes (8 / 4-aligned: host)
            sf = gl.expand_dims(r * sf_row, 1)
            sf_base = sf_ptr.to(gl.pointer_type(gl.uint8))                 # fp8 / fp32 scales as bytes
        else:
            # ---- the records; an invalid slot (or a row past n_rows) writes nothing
            ok = rmask & (slot >= 0) & (slot < capacity)
            blk, off = block_and_token(slot, ok, block_size, SLOT32, LOG2_BLOCK, OFFSETS32)
            DATA_BYTES: gl.constexpr = 128 if CAST == CAST_E4M3 else 64
            base = blk * s_blk
            data = gl.expand_dims(base + off * DATA_BYTES, 1)          # [R, 1] bytes (8-aligned: host)
            sf = gl.expand_dims(base + sf_off + off * sf_tok, 1)
            sf_base = cache_ptr
        ok2 = gl.expand_dims(ok, 1)
        if CAST == CAST_E4M3:
            q_ptr = cache_ptr.to(gl.pointer_type(gl.int64)) + (data >> 3) + lane      # [R, 8]: 8 codes a lane
            gl.store(q_ptr, qa, mask=ok2)
            gl.store(q_ptr + 8, qb, mask=ok2)
        else:
            q_ptr = cache_ptr.to(gl.pointer_type(gl.int32)) + (data >> 2) + lane      # [R, 8]: 8 codes a lane
            gl.store(q_ptr, qa, mask=ok2)
            gl.store(q_ptr + 8, qb, mask=ok2)
        # a scale leaves from the lane that computed it (``_split_scales``): chunk A's from even lanes,
        # chunk B's from odd ones; INDEX_FP8_FP32's s from lane 0 (it holds lane 1's quotient)
        if G == 128:
            gl.store(sf_base.to(gl.pointer_type(gl.int32)) + (sf >> 2) + lane * 0, stored, mask=ok2 & (lane == 0))
        elif G == 32:
            gl.store(sf_base + sf + (lane >> 2) + 2 * (lane & 1), stored.to(gl.uint8), mask=ok2 & ((lane & 2) == 0))
        else:
            gl.store(sf_base + sf + (lane >> 1) + 4 * (lane & 1), stored.to(gl.uint8), mask=ok2)

    @gluon.jit(do_not_specialize=["n_rows", "P", "capacity"])
    def index_write_kernel(
        x_ptr, sx_w,                            # x bf16 [n, 128] (read as int32 words); row stride in words
        w_ptr, b_ptr, eps, had_scale,           # norm weight, LayerNorm bias [128] (bf16 or fp32); Hadamard scale
        pos_ptr, s_pos, cs_ptr, s_cs, P,        # positions [n]; cos_sin [P, 64] (cos | sin; fp32 or bf16)
        slot_ptr, s_slot,                       # slot_mapping [n]
        cache_ptr, s_blk, sf_off, sf_tok,       # kv_cache uint8 [blocks, block_size, 1, bytes_per_token], block-wide
        block_size, capacity,
        n_rows,
        sf_ptr, q_row, sf_row,                  # CONTIG: sf uint8 [rows, sf_row]; q (cache_ptr) [rows, q_row] bytes
        CAST: gl.constexpr, G: gl.constexpr, SF: gl.constexpr, W_BF16: gl.constexpr, SLOT32: gl.constexpr,
        LOG2_BLOCK: gl.constexpr, ROWS_PER_THREAD: gl.constexpr, PIPELINE: gl.constexpr, OFFSETS32: gl.constexpr,
        PACKED_E2M1: gl.constexpr, NORM: gl.constexpr, CONTIG: gl.constexpr, LOG2_HEADS: gl.constexpr,
        LAYER: gl.constexpr, HAS_BIAS: gl.constexpr, B_BF16: gl.constexpr, NEOX: gl.constexpr, ROPE_A: gl.constexpr,
        HAD: gl.constexpr, PDL: gl.constexpr, PDL_EARLY: gl.constexpr = False,
    ):
        """A program walks over the tiles pid, pid + num_programs, ... of R = 4 * ROWS_PER_THREAD *
        num_warps rows. CAST: CAST_E4M3 / CAST_E2M1; G the group; SF: one of codes.SF_* (group_scales).
        sf_off: block_size * data bytes (a block's scales); sf_tok: scale bytes per token. LOG2_BLOCK:
        log2(block_size) when it is a power of two, else -1 (a division). PIPELINE: load tile t + 1
        (x, indices; its cos/sin after tile t's stores) while tile t computes. OFFSETS32: every x,
        index, cos/sin and cache offset of the launch is below 2**31 (host). PACKED_E2M1: the e2m1
        codes of UE8M0 groups on packed bf16 words (``_e2m1x2_bf16``), else fp32 (``_e2m1``). NORM:
        the norm on (off: RoPE reads x itself, w_ptr is not read); LAYER: LayerNorm (HAS_BIAS: with the
        bias at b_ptr, B_BF16 its dtype), else RMSNorm. NEOX: the RoPE pairs, else GPT-J's; ROPE_A: RoPE on
        columns 0..63 (chunk A), else 64..127. HAD: the Hadamard (* had_scale) before the cast. CONTIG: contiguous outputs instead of a
        cache (kvfuse's (q, sf) of a cast without a cache: the indexer's Q): row r is head r % 2^LOG2_HEADS
        of token r >> LOG2_HEADS, its codes go to cache_ptr + r * q_row and its scales to sf_ptr + r *
        sf_row (bytes); the slot and cache-geometry arguments are not read. PDL_EARLY (with PDL): the first
        tile's positions, slots and cos/sin rows are read before the wait, x after it (kvfuse.set_pdl's
        early_reads)."""
        NW: gl.constexpr = gl.num_warps()
        R: gl.constexpr = 4 * ROWS_PER_THREAD * NW
        # words [R, 8, 4]: lane l of a row owns 4 int32 words (8 bf16 columns) of each chunk
        LW: gl.constexpr = gl.BlockedLayout([ROWS_PER_THREAD, 1, 4], [4, 8, 1], [NW, 1, 1], [2, 1, 0])
        # cos/sin [R, 8, 8]: the same lanes, the 8 columns of the lane's chunk B in its registers
        LC: gl.constexpr = gl.BlockedLayout([ROWS_PER_THREAD, 1, 8], [4, 8, 1], [NW, 1, 1], [2, 1, 0])
        LCROW: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, LC))
        LL: gl.constexpr = gl.SliceLayout(2, LW)                        # [R, 8]: one value per lane and row
        LROW: gl.constexpr = gl.SliceLayout(1, LL)                      # [R]

        # ---- loop-invariant indices and the weight
        r_idx = gl.arange(0, R, layout=LROW)
        lane = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, LL)), 0)          # [1, 8]
        k4 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, LW)))
        word = gl.expand_dims(lane, 2) * 4 + gl.expand_dims(gl.expand_dims(k4, 0), 1)    # [1, 8, 4]
        # cos/sin column of (lane, column of its chunk B): j = 8 (l & 3) + k
        lane_c = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, LC)))
        k8 = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, LC)))
        cs_col = gl.expand_dims(gl.expand_dims((lane_c & 3) * 8, 0), 2) + gl.expand_dims(gl.expand_dims(k8, 0), 1)
        # first-half lanes (l < 4) negate the partner: sign bits of both bf16 (0x80008000)
        partner_flip = gl.expand_dims(gl.where(lane < 4, -2147450880, 0), 2)             # [1, 8, 1]
        # the Hadamard's levels across lanes: -1 where the lane holds the upper element of the pair
        sgn1 = gl.where((lane & 1) != 0, -1.0, 1.0)
        sgn2 = gl.where((lane & 2) != 0, -1.0, 1.0)
        sgn4 = gl.where((lane & 4) != 0, -1.0, 1.0)

        if not NORM:
            wa_lo = gl.full([1, 8, 4], 0.0, gl.float32, LW)              # not used (w_ptr is a stand-in)
            wa_hi = wa_lo
            wb_lo = wa_lo
            wb_hi = wa_lo
        elif W_BF16:
            w_words = w_ptr.to(gl.pointer_type(gl.int32)) + word
            wa = gl.load(w_words)
            wb = gl.load(w_words + 32)
            wa_lo = lo_f32(wa)
            wa_hi = hi_f32(wa)
            wb_lo = lo_f32(wb)
            wb_hi = hi_f32(wb)
        else:
            wa_lo = gl.load(w_ptr + 2 * word)
            wa_hi = gl.load(w_ptr + 2 * word + 1)
            wb_lo = gl.load(w_ptr + 64 + 2 * word)
            wb_hi = gl.load(w_ptr + 64 + 2 * word + 1)
        if HAS_BIAS:                                                    # per element: no alignment asked
            ba_lo = gl.load(b_ptr + 2 * word).to(gl.float32)
            ba_hi = gl.load(b_ptr + 2 * word + 1).to(gl.float32)
            bb_lo = gl.load(b_ptr + 64 + 2 * word).to(gl.float32)
            bb_hi = gl.load(b_ptr + 64 + 2 * word + 1).to(gl.float32)
        else:
            ba_lo = wa_lo                                               # not used
            ba_hi = wa_lo
            bb_lo = wa_lo
            bb_hi = wa_lo

        if not PDL_EARLY:
            pdl_wait(PDL)                                               # after the weight loads
        pid = gl.program_id(0)
        num_programs = gl.num_programs(0)
        num_tiles = gl.cdiv(n_rows, R)
        if PIPELINE:
            rows = pid * R + r_idx                                      # [R] int32 (n_rows < 2**30: host)
            if PDL_EARLY:
                pos, slot = _tile_indices(pos_ptr, s_pos, slot_ptr, s_slot, rows, n_rows, OFFSETS32, CONTIG,
                                          LOG2_HEADS)
                c_lo, c_hi, s_lo, s_hi = _load_cos_sin(cs_ptr, s_cs, P, pos, cs_col, word, R, LW, LCROW, OFFSETS32,
                                                       NEOX)
                pdl_wait(PDL)                                           # x only after it
                xa, xb = _tile_x(x_ptr, sx_w, rows, n_rows, word, OFFSETS32)
            else:
                pos, slot, xa, xb = _load_tile(x_ptr, sx_w, pos_ptr, s_pos, slot_ptr, s_slot, rows, n_rows, word,
                                               OFFSETS32, CONTIG, LOG2_HEADS)
                c_lo, c_hi, s_lo, s_hi = _load_cos_sin(cs_ptr, s_cs, P, pos, cs_col, word, R, LW, LCROW, OFFSETS32,
                                                       NEOX)
            for tile in range(pid, num_tiles, num_programs):
                rows = tile * R + r_idx
                next_rows = rows + num_programs * R
                next_pos, next_slot, next_xa, next_xb = _load_tile(x_ptr, sx_w, pos_ptr, s_pos, slot_ptr, s_slot,
                                                                   next_rows, n_rows, word, OFFSETS32, CONTIG,
                                                                   LOG2_HEADS)
                _write_rows(xa, xb, c_lo, c_hi, s_lo, s_hi, pos, slot, rows, n_rows, wa_lo, wa_hi, wb_lo, wb_hi,
                            ba_lo, ba_hi, bb_lo, bb_hi, eps, had_scale, P, cache_ptr, s_blk, sf_off, sf_tok,
                            block_size, capacity, lane, partner_flip, sgn1, sgn2, sgn4, sf_ptr, q_row, sf_row,
                            R, LL, CAST, G, SF, PACKED_E2M1, SLOT32, LOG2_BLOCK, OFFSETS32, NORM, CONTIG,
                            LAYER, HAS_BIAS, NEOX, ROPE_A, HAD)
                # the next positions arrived while this tile computed
                c_lo, c_hi, s_lo, s_hi = _load_cos_sin(cs_ptr, s_cs, P, next_pos, cs_col, word, R, LW,
                                                       LCROW, OFFSETS32, NEOX)
                pos = next_pos
                slot = next_slot
                xa = next_xa
                xb = next_xb
        elif PDL_EARLY:
            # the first tile's indices and cos/sin rows before the wait, its x after it; the later tiles as
            # without. A program past the last tile (none: the grid has at most one per tile) would store
            # nothing: its rows are >= n_rows.
            rows = pid * R + r_idx
            pos, slot = _tile_indices(pos_ptr, s_pos, slot_ptr, s_slot, rows, n_rows, OFFSETS32, CONTIG, LOG2_HEADS)
            c_lo, c_hi, s_lo, s_hi = _load_cos_sin(cs_ptr, s_cs, P, pos, cs_col, word, R, LW, LCROW, OFFSETS32, NEOX)
            pdl_wait(PDL)
            xa, xb = _tile_x(x_ptr, sx_w, rows, n_rows, word, OFFSETS32)
            _write_rows(xa, xb, c_lo, c_hi, s_lo, s_hi, pos, slot, rows, n_rows, wa_lo, wa_hi, wb_lo, wb_hi,
                        ba_lo, ba_hi, bb_lo, bb_hi, eps, had_scale, P, cache_ptr, s_blk, sf_off, sf_tok,
                        block_size, capacity, lane, partner_flip, sgn1, sgn2, sgn4, sf_ptr, q_row, sf_row,
                        R, LL, CAST, G, SF, PACKED_E2M1, SLOT32, LOG2_BLOCK, OFFSETS32, NORM, CONTIG,
                        LAYER, HAS_BIAS, NEOX, ROPE_A, HAD)
            for tile in range(pid + num_programs, num_tiles, num_programs):
                rows = tile * R + r_idx
                pos, slot, xa, xb = _load_tile(x_ptr, sx_w, pos_ptr, s_pos, slot_ptr, s_slot, rows, n_rows, word,
                                               OFFSETS32, CONTIG, LOG2_HEADS)
                c_lo, c_hi, s_lo, s_hi = _load_cos_sin(cs_ptr, s_cs, P, pos, cs_col, word, R, LW,
                                                       LCROW, OFFSETS32, NEOX)
                _write_rows(xa, xb, c_lo, c_hi, s_lo, s_hi, pos, slot, rows, n_rows, wa_lo, wa_hi, wb_lo, wb_hi,
                            ba_lo, ba_hi, bb_lo, bb_hi, eps, had_scale, P, cache_ptr, s_blk, sf_off, sf_tok,
                            block_size, capacity, lane, partner_flip, sgn1, sgn2, sgn4, sf_ptr, q_row, sf_row,
                            R, LL, CAST, G, SF, PACKED_E2M1, SLOT32, LOG2_BLOCK, OFFSETS32, NORM, CONTIG,
                            LAYER, HAS_BIAS, NEOX, ROPE_A, HAD)
        else:
            for tile in range(pid, num_tiles, num_programs):
                rows = tile * R + r_idx
                pos, slot, xa, xb = _load_tile(x_ptr, sx_w, pos_ptr, s_pos, slot_ptr, s_slot, rows, n_rows, word,
                                               OFFSETS32, CONTIG, LOG2_HEADS)
                c_lo, c_hi, s_lo, s_hi = _load_cos_sin(cs_ptr, s_cs, P, pos, cs_col, word, R, LW,
                                                       LCROW, OFFSETS32, NEOX)
                _write_rows(xa, xb, c_lo, c_hi, s_lo, s_hi, pos, slot, rows, n_rows, wa_lo, wa_hi, wb_lo, wb_hi,
                            ba_lo, ba_hi, bb_lo, bb_hi, eps, had_scale, P, cache_ptr, s_blk, sf_off, sf_tok,
                            block_size, capacity, lane, partner_flip, sgn1, sgn2, sgn4, sf_ptr, q_row, sf_row,
                            R, LL, CAST, G, SF, PACKED_E2M1, SLOT32, LOG2_BLOCK, OFFSETS32, NORM, CONTIG,
                            LAYER, HAS_BIAS, NEOX, ROPE_A, HAD)


# --------------------------------------------------------------------------- host mirrors
# The packed-bf16 e2m1 encoder restated with torch integer / fp32 ops, step for step (the proofs that it
# gives kvfuse.reference.encode_e2m1's codes run on it: tests/test_gluon_indexer.py on every
# bf16 value times every UE8M0 multiplier the kernel makes). The fp32 encoder's mirror is
# gluon_common.e2m1_nibble_mirror.
def e2m1_bf16_mirror(h: torch.Tensor) -> torch.Tensor:
    """One half of ``_e2m1x2_bf16`` after its multiply: int32 tensor of bf16 patterns (0..0xFFFF) ->
    codes 0..15."""
    a = h & 0x7FFF
    a = torch.where((a > 0x40C0), 0x40C0, a)                     # min.bf16x2 with 6 (NaN patterns too)
    k = ((a << 16).view(torch.float32) + 64.0).to(torch.bfloat16).view(torch.int16).to(torch.int32)
    r = ((a + 0x11F + ((a >> 6) & 1)) >> 6) & 7
    code = torch.where(a >= 0x3F80, r, k & 7)                     # set.ge.u32.bf16x2 with 1.0
    return code | ((h >> 12) & 8)


# --------------------------------------------------------------------------- host side
_resident = {}               # launch key -> CTAs of that compiled variant resident on one SM
# the e2m1 codes of UE8M0 groups (INDEX_MXFP4) on packed bf16 words; False: the fp32 encoder
PACKED_E2M1 = True


def chain_of(plan):
    """(CAST, G, SF) constexprs of the plan's cast, or None when this kernel has no such chain."""
    c = plan.cast
    if c is None or c.floor_exp is not None:      # no scale_floor here (the FlashMLA formats carry it)
        return None
    cast_sf = CHAINS.get((c.cast_fmt, c.group, c.sf_format))
    return None if cast_sf is None else (cast_sf[0], c.group, cast_sf[1])


def launch_table(n_rows: int):
    """(num_warps, rows_per_thread, pipeline) per batch size, from an H200 sweep
    (benchmarks/tune.py --kernel fast; benchmarks/results/2026-11-29_h200_s4_gluon_tune.txt; a warp holds
    4 * rows_per_thread rows): four one-row-per-thread warps up to n = 16384 (best or within 0.05 us
    at n = 256 and 4096 for all three formats), two warps, no pipeline, around n = 65536 (MXFP4
    11.3 us against 12.4 with the earlier table), four warps of two rows per thread loading their
    next tile ahead above (at n = 262144: MXFP4 41.7 us = 88.6% of copy, NVFP4 47.4 us = 78.4%,
    FP8_FP32 33.6 us, against 52.3 / 51.1 / 47.2 us with the earlier table's one pipelined warp).
    The thresholds between the measured sizes (1, 256, 4096, 65536, 262144) are not tuned."""
    return gluon_common.table_entry(LAUNCH_TABLE, n_rows)


# (first n_rows, (num_warps, rows_per_thread, pipeline)): see launch_table
LAUNCH_TABLE = ((1, (4, 1, False)), (16385, (2, 1, False)), (65537, (4, 2, True)))


def row_stride(t: torch.Tensor) -> int:
    """Elements between consecutive (token, head) rows of a [n, H, k] tensor whose rows are evenly
    spaced (``rows_evenly_spaced``)."""
    return t.stride(0) if t.shape[1] == 1 else t.stride(1)


def rows_evenly_spaced(t: torch.Tensor) -> bool:
    """[n, H, k] with unit column stride whose (token, head) rows are one evenly spaced sequence."""
    return t.dim() == 3 and (t.shape[2] == 1 or t.stride(2) == 1) and (
        t.shape[1] == 1 or t.shape[0] == 1 or t.stride(0) == t.shape[1] * t.stride(1))


def launch_args(plan, tensor, num_warps: int, rows_per_thread: int, pipeline: bool):
    """(positional args, constexprs, options) of index_write_kernel for an eligible plan (no device
    query); ``tensor(name)`` goes where the plan's tensor ``name`` goes (the tensor, or a
    launcher.PlanTensor). Every other argument comes from the plan: computed once per signature and n.
    A cache write (one head) or the contiguous (q, sf) of a cast (CONTIG: rows are (token, head))."""
    x, weight, positions, cos_sin = plan.x, plan.weight, plan.positions, plan.cos_sin
    n, heads = x.shape[0], x.shape[1]
    rows = n * heads
    x_row = row_stride(x) // 2                                       # in int32 words
    cast, group, sf = chain_of(plan)
    T = tensor
    contig = plan.kv_cache is None
    had_scale = 1.0 if plan.hadamard_scale is None else float(plan.hadamard_scale)
    if contig:
        q, sfo = plan.q_out, plan.sf_out
        q_row, sf_row = row_stride(q) * q.element_size(), row_stride(sfo) * sfo.element_size()
        # the slot and cache-geometry arguments are not read (x stands in for slot_mapping)
        args = (T("x"), x_row, T("weight"), T("bias"), float(plan.eps), had_scale, T("positions"),
                positions.stride(0), T("cos_sin"), cos_sin.stride(0), cos_sin.shape[0], T("slot_mapping"), 0,
                T("q_out"), 0, 0, 0, 1, 0, rows, T("sf_out"), q_row, sf_row)
        out_span = max(rows * q_row + 128, rows * sf_row + 16)
        slot32, log2_blk = True, 0
    else:
        slots, cache, a = plan.slot_mapping, plan.kv_cache, plan.addressing
        block_size = cache.shape[1]
        capacity = cache.shape[0] * block_size
        args = (T("x"), x_row, T("weight"), T("bias"), float(plan.eps), had_scale, T("positions"),
                positions.stride(0), T("cos_sin"), cos_sin.stride(0), cos_sin.shape[0], T("slot_mapping"),
                slots.stride(0),
                T("kv_cache"), cache.stride(0), a.sf_offset, a.sf_token_stride, block_size, capacity, rows,
                T("kv_cache"), 0, 0)
        out_span = max(rows * slots.stride(0) + 1, cache.shape[0] * cache.stride(0) + a.sf_offset)
        slot32, log2_blk = capacity <= INT32_LIMIT, log2_block(block_size)
    # the largest offset each pointer is indexed with (x in words, the rest in elements / bytes)
    spans = (rows * x_row + 64, n * positions.stride(0) + 1, cos_sin.shape[0] * cos_sin.stride(0) + 64, out_span)
    constexprs = dict(CAST=cast, G=group, SF=sf, W_BF16=weight is None or weight.dtype == torch.bfloat16,
                      SLOT32=slot32, LOG2_BLOCK=log2_blk, ROWS_PER_THREAD=rows_per_thread, PIPELINE=bool(pipeline),
                      OFFSETS32=max(spans) < INT32_LIMIT, PACKED_E2M1=bool(PACKED_E2M1), NORM=weight is not None,
                      CONTIG=contig, LOG2_HEADS=heads.bit_length() - 1, LAYER=plan.norm_kind == "layer",
                      HAS_BIAS=plan.bias is not None,
                      B_BF16=plan.bias is None or plan.bias.dtype == torch.bfloat16, NEOX=bool(plan.is_neox),
                      ROPE_A=plan.rope_offset == 0, HAD=plan.hadamard_scale is not None, PDL=False,
                      **early_reads_option(rows))
    options = compile_options(num_warps)
    return args, constexprs, options


def _grid(plan, args, constexprs: dict, options: dict) -> tuple:
    """The persistent grid (gluon_common.occupancy_grid: one CTA per tile up to what is resident on
    the device at once, the compiled variant's occupancy found once per variant)."""
    x = plan.x
    tiles = -(-(x.shape[0] * x.shape[1]) // (4 * constexprs["ROWS_PER_THREAD"] * options["num_warps"]))
    tensors = {**plan_tensors(plan), "bias": plan.bias, "q_out": plan.q_out, "sf_out": plan.sf_out}
    return occupancy_grid(index_write_kernel, _resident, x, tiles, args, tensors, constexprs, options)


# --------------------------------------------------------------------------- kvfuse's dispatch
NAME = "indexer"   # in KVFUSE_GLUON_SKIP
FORMATS = (_formats.INDEX_FP8_FP32, _formats.INDEX_MXFP8, _formats.INDEX_MXFP4, _formats.INDEX_NVFP4,)   # the preset cache formats it writes (its GPU tests' formats)


def enabled() -> bool:
    """On with Triton 3.6 on CUDA (``available()``; proven byte-equal on the H200, see
    docs/performance.md), unless KVFUSE_GLUON=0 (every Gluon path off) or KVFUSE_GLUON_SKIP (a comma list)
    names "index"."""
    return allowed_by_env(NAME) and available()


# one-row calls: without PDL they stay on the plain kernel's EARLY program, mixed against this kernel there
# (n = 1: plain 1.90 / 1.83 / 2.18 / 1.88 / 1.98 us for MXFP4 / FP8_FP32 / NVFP4 / DeepSeek V3.2's K /
# V4's K, this kernel 2.07 / 1.87 / 1.94 / 1.95 / 2.10); with PDL this kernel, whose weights load before
# the wait (plain 1.49 / 1.51 / 1.86 / 1.75 / 1.58 us, this kernel 1.37 / 1.14 / 1.25 / 1.56 / 1.40;
# benchmarks/results/2026-12-02_h200_indexer_one_row.txt). From two rows this kernel either way (n = 256:
# 2.08 / 1.95 / 2.06 us against the plain kernel's 2.34 / 1.99 / 2.37; 2026-11-29_h200_s4_gluon_tune.txt)
MIN_ROWS = 2
MIN_ROWS_PDL = 1


def _common_chain(plan):
    """The chain both kinds of call share: RoPE (NEOX or GPT-J, not conjugate) on columns 64..127 or
    0..63, RMSNorm or LayerNorm (or no norm), Hadamard or none, no stage copy, one of the casts of
    CHAINS over all 128 columns, x rows as int32 words, a contiguous weight (and bias) if any, cos/sin
    [P, 64]. Returns the (CAST, G, SF) chain or None."""
    x = plan.x
    if plan.positions is None or plan.out is not None or plan.out_stage is not None:
        return None
    if x.dim() != 3 or x.shape[2] != HEAD_DIM or not rows_evenly_spaced(x) or row_stride(x) % 2 \
            or x.shape[0] * x.shape[1] >= 2 ** 30:
        return None
    if plan.rotary_dim != ROTARY_DIM or plan.rope_offset not in ROPE_OFFSETS or plan.conjugate:
        return None
    chain = chain_of(plan)
    if chain is None or plan.quant_dim != HEAD_DIM:
        return None
    w, b, cs = plan.weight, plan.bias, plan.cos_sin
    if w is not None and (w.shape != (HEAD_DIM,) or w.stride(0) != 1):
        return None
    if b is not None and (b.shape != (HEAD_DIM,) or b.stride(0) != 1):
        return None
    if cs.dim() != 2 or cs.shape[1] != ROTARY_DIM or cs.shape[0] < 1 or cs.stride(1) != 1:
        return None
    return chain


def _eligible_write(plan, chain) -> bool:
    """A cache write: RMSNorm on, one head, a block-wide cache laid out as the INDEX presets (data_bytes
    per token from the block's start, then block_size * data_bytes on, sf_bytes per token of scales),
    the cache pointer 8-byte aligned for e4m3 codes, 4 for e2m1 (part of the plan-cache key), the
    block stride a multiple of 8."""
    x, cache, f, a = plan.x, plan.kv_cache, plan.fmt, plan.addressing
    if f is None or a is None or plan.weight is None or plan.slot_mapping is None or x.shape[1] != 1:
        return False
    cast, _, sf = chain
    data_bytes = 128 if cast == CAST_E4M3.value else 64
    if f.token_interleaved or f.bf16_tail or f.head_dim != HEAD_DIM or f.data_bytes != data_bytes or f.zero_reserved:
        return False
    if cache.dim() != 4 or cache.shape[2] != 1 or cache.stride(3) != 1:
        return False
    block_size = cache.shape[1]
    if (a.data_offset, a.data_token_stride, a.sf_offset, a.sf_token_stride) != (
            0, data_bytes, block_size * data_bytes, f.sf_bytes):
        return False
    # an fp32 scale leaves as one 32-bit store
    if sf in (SF_UE8M0_FP32.value, SF_FP32.value) and a.sf_token_stride % 4:
        return False
    return not (cache.data_ptr() % CACHE_ALIGN[cast] or cache.stride(0) % 8)


def _eligible_contig(plan, chain) -> bool:
    """The (q, sf) outputs of a cast without a cache (RMSNorm optional; any power-of-two number of
    heads): q and sf with evenly spaced rows, q's rows a multiple of the code stores' width (8 bytes
    for e4m3, 4 for e2m1) apart. The pointers' alignments are checked per call (``call_guard``)."""
    x, q, sfo = plan.x, plan.q_out, plan.sf_out
    heads = x.shape[1]
    if q is None or sfo is None or heads & (heads - 1):
        return False
    if not (rows_evenly_spaced(q) and rows_evenly_spaced(sfo)):
        return False
    return (row_stride(q) * q.element_size()) % CACHE_ALIGN[chain[0]] == 0


def eligible(plan) -> bool:
    """Whether a validated kvfuse.plans.types.Plan is one of this kernel's chains (``_common_chain``), as a
    cache write (``_eligible_write``) or into contiguous (q, sf) outputs (``_eligible_contig``: the
    indexer's Q). x's (and a bf16 weight's) 4-byte alignment, and the contiguous outputs', are checked
    per call (``call_guard``)."""
    if not gluon_common.one_input_whole_norm(plan):
        return False
    chain = _common_chain(plan)
    if chain is None:
        return False
    return _eligible_write(plan, chain) if plan.kv_cache is not None else _eligible_contig(plan, chain)


word_aligned = gluon_common.word_aligned      # x (and a bf16 weight) are read as 4-byte words


@functools.lru_cache(maxsize=None)
def contig_aligned(q_align: int, with_weight: bool):
    """The per-call check of a contiguous (q, sf) call: x (and the weight) 4-byte aligned (read as
    words), q ``q_align``-byte aligned (its codes leave as 8- or 4-byte stores), sf 4-byte aligned
    (an fp32 scale leaves as one 32-bit store; byte scales are fine anywhere, and 4 costs nothing)."""
    def check(x, q, sf, weight=None) -> bool:
        bad = (x.data_ptr() & 3) | (q.data_ptr() & (q_align - 1))
        if sf.element_size() == 4:
            bad |= sf.data_ptr() & 3
        if with_weight:
            bad |= weight.data_ptr() & 3
        return not bad
    return check


def call_guard(plan):
    """(check, fields): the per-call precondition of an eligible plan, on the call's tensors of those
    fields (kvfuse.kernels.router runs the plain kernel when it fails)."""
    if plan.kv_cache is not None:
        return word_aligned, ("x", "weight")
    with_weight = plan.weight is not None
    check = contig_aligned(CACHE_ALIGN[chain_of(plan)[0]], with_weight)
    return check, ("x", "q_out", "sf_out") + (("weight",) if with_weight else ())


def plan_launch(plan, tensor, table=None) -> tuple:
    """(kernel name, grid, positional args, keyword args, namespace) of this kernel for an eligible
    plan; ``tensor(field)`` goes where the plan's tensor ``field`` goes (the tensor, or a
    launcher.PlanTensor for a Launch kept with the call signature); ``table`` replaces
    ``launch_table`` (kvfuse.kernels.router.fast_paths)."""
    nw, rpt, pipe = (table or launch_table)(plan.x.shape[0] * plan.x.shape[1])
    args, constexprs, options = launch_args(plan, tensor, nw, rpt, pipe)
    return "index_write_kernel", _grid(plan, args, constexprs, options), args, {**constexprs, **options}, globals()
