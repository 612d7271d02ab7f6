"""The GQA / MHA kernel of :func:`kvfuse.fused_qk_norm_rope_store_kv` (SPEC §3): q, k and v of a
batch of tokens in one launch.

A program owns BLOCK_M tokens of G heads of one kind: the 1-d grid walks the head groups [q | k | v]
fastest (neighbouring programs read neighbouring heads of a packed QKV row and write neighbouring
records of an NHD cache). Which kind a program is follows from its group index, a runtime branch
uniform over the program; its G heads are unrolled, their rows all loaded before the first store,
and what depends only on the token (position, cos / sin, norm weights, slot, the cast's scale and
reciprocal) is loaded once for them:

* q: RMSNorm (optional) -> RoPE (optional; mRoPE: each frequency's position from one of three rows,
  MROPE_*) -> q_out (which may be q itself);
* k: the same with k's weight -> the cache record of the token's slot (the activations' dtype, or e4m3
  by k_scale), or without caches (KV_CACHE False) k_out (which may be k itself);
* v: copied (a cache of the activations' dtype: the bits) or quantized by v_scale into its record; under
  V_NORM first RMS-normed as q and k are (with or without a weight).

ACT (bf16 / fp16 / fp32 activations) and NUMERICS (the profile: where values are rounded to ACT) come
from kvfuse.numerics_profiles; their defaults (bf16, "staged") compile to the same code as before they
existed. The norm weights and the cos / sin table are read as fp32 (exact): bf16 by its bits
(QW_BF16 / KW_BF16 / CS_BF16), fp16 and fp32 by their pointers' element type, which the compiled
kernel's signature holds (an fp16 table is its own compile, the others' code unchanged).

A q / k row with NEOX RoPE over all of it goes as its two halves (a pair in one thread); any other as
[BLOCK_D / VEC, VEC] with each rotated element's partner reloaded. The norm's adjacent-pairs tree, the
rotation and the narrowing helpers are the portable kernel's (kvfuse/kernels/blocks.py, numerics.py),
so a row's bytes are those of SPEC §6 whatever BLOCK_M, G or the head. The cast divides by the
scale's reciprocal with Markstein's exact correction (numerics.div_rn_by_reciprocal). Addresses are
int64; the slot -> (block, offset) division runs in int32 while the caches hold fewer than 2^31 slots.
docs/design.md has the reasons and proofs.
"""
from __future__ import annotations

import functools
import inspect

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from . import config
from .blocks import (block_offset_of_slot, cs_rows, reciprocal_std, rope1_pairing, rope1_pairs, rotate, store_bf16,
                     tree_sum)
from .codes import NATIVE_INTEGER, PTH_CODES, PTH_E4M3, PTH_INT8
from ..numerics_profiles import ACTIVATION_CODES, PROFILES
from ..plans.types import LAUNCHES_PER_TEMPLATE
from .config import DIRECT_LAUNCH, FORCED, INTERPRET, cdiv, native, next_pow2
from .launcher import Launch, tensor_arg
from .router import pdl_launch, with_pdl
from .gluon.common import table_entry
from .gqa_fp4 import FP4_CODES, FP4_GROUPS, FP4_NVFP4, store_fp4_rows
from .numerics import (div_rn_by_reciprocal, encode_e4m3, encode_e5m2, encode_int8_rhaz, load_f32, round_bf16,
                       row_amax, token_head_scale)

__all__ = ["qkv_kernel", "launch_table", "launch_config", "launch_args", "run", "template_launch", "run_template",
           "INTERPRET"]

# the ACT and NUMERICS constexprs, from kvfuse.numerics_profiles' table
ACT_BF16 = tl.constexpr(ACTIVATION_CODES[torch.bfloat16])
ACT_FP16 = tl.constexpr(ACTIVATION_CODES[torch.float16])
ACT_FP32 = tl.constexpr(ACTIVATION_CODES[torch.float32])
NUMERICS_STAGED = tl.constexpr(PROFILES["staged"].code)
NUMERICS_FP32_CAST = tl.constexpr(PROFILES["fused_fp32_cast"].code)


@triton.jit
def _load_act(ptr, offs, mask, ACT: tl.constexpr):
    """Activations of dtype ACT (ACT_BF16 / ACT_FP16 / ACT_FP32) -> fp32 (exact)."""
    if ACT == ACT_BF16:
        v = load_f32(ptr, offs, mask, True)
    else:
        v = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return v


@triton.jit
def _round_act(v, ACT: tl.constexpr, NATIVE: tl.constexpr):
    """fp32 -> the nearest-even value of the activations' dtype, as fp32 (fp32: v itself)."""
    if ACT == ACT_BF16:
        r = round_bf16(v, NATIVE)
    elif ACT == ACT_FP16:
        r = v.to(tl.float16, fp_downcast_rounding="rtne").to(tl.float32)
    else:
        r = v
    return r


@triton.jit
def _load_cols(x_ptr, addr, x2_ptr, x2row, col, mask, SPLIT: tl.constexpr, ACT: tl.constexpr):
    """Columns ``col`` [NV, VEC] of BLOCK_M rows (live where mask [M, NV, VEC]) as fp32: at x_ptr + addr, or,
    for a head held as two tensors (x2_ptr not None), columns < SPLIT there and the others at
    x2_ptr + x2row + col - SPLIT."""
    if x2_ptr is None:
        x = _load_act(x_ptr, addr, mask, ACT)
    else:
        lo = (col < SPLIT)[None, :, :]
        a = _load_act(x_ptr, addr, mask & lo, ACT)
        b = _load_act(x2_ptr, x2row[:, None, None] + (col - SPLIT)[None, :, :], mask & (col >= SPLIT)[None, :, :],
                      ACT)
        x = tl.where(lo, a, b)
    return x


@triton.jit
def _qk_row_loads(x_ptr, xrow, rm, col, cmask, rot_mask, partner, ROPE: tl.constexpr, ACT: tl.constexpr = 0,
                  x2_ptr=None, x2row=None, SPLIT: tl.constexpr = 0):
    """The whole-row form's loads of BLOCK_M rows at x_ptr + xrow (live where rm): the row [M, NV, VEC]
    and, for RoPE, each rotated element's partner (the same row, reloaded at column ``partner``). A head
    held as two tensors (x2_ptr, x2row: its columns from SPLIT on) is read from both (_load_cols)."""
    x = _load_cols(x_ptr, xrow[:, None, None] + col[None, :, :], x2_ptr, x2row, col,
                   rm[:, None, None] & cmask[None, :, :], SPLIT, ACT)
    xp = x
    if ROPE:
        xp = _load_cols(x_ptr, xrow[:, None, None] + partner[None, :, :], x2_ptr, x2row, partner,
                        rot_mask & rm[:, None, None], SPLIT, ACT)
    return x, xp


@triton.jit
def _normed_act(v, r3, w, ACT: tl.constexpr, NUMERICS: tl.constexpr, NATIVE: tl.constexpr):
    """The RMSNorm of values v given the rows' 1 / std r3: (v * r3) * w, rounded to the activations' dtype
    under the staged profile, kept in fp32 under the fused ones (SPEC §6)."""
    y = (v * r3) * w
    if NUMERICS == NUMERICS_STAGED:
        y = _round_act(y, ACT, NATIVE)
    return y


@triton.jit
def _rope_round(v, ACT: tl.constexpr, NUMERICS: tl.constexpr, NATIVE: tl.constexpr):
    """RoPE's result: rounded to the activations' dtype under the staged profile (the fused ones round once,
    in _finish)."""
    if NUMERICS == NUMERICS_STAGED:
        v = _round_act(v, ACT, NATIVE)
    return v


@triton.jit
def _finish(y, ACT: tl.constexpr, NUMERICS: tl.constexpr, KEEP_F32: tl.constexpr, NATIVE: tl.constexpr):
    """The fused profiles' one rounding to the activations' dtype, left out where the fp8 cast reads the fp32
    value (KEEP_F32: "fused_fp32_cast" into an fp8 cache); staged values are already rounded."""
    if NUMERICS != NUMERICS_STAGED and not KEEP_F32:
        y = _round_act(y, ACT, NATIVE)
    return y


@triton.jit
def _qk_row(x, xp, rm, w, wp, eps, first, rot_mask, c, s, D: tl.constexpr, BLOCK_D: tl.constexpr,
            LOG2_BLOCK_D: tl.constexpr, VEC: tl.constexpr, BLOCK_M: tl.constexpr, HAS_NORM: tl.constexpr,
            ROPE: tl.constexpr, CONJ: tl.constexpr, NATIVE: tl.constexpr, ACT: tl.constexpr = 0,
            NUMERICS: tl.constexpr = 0, KEEP_F32: tl.constexpr = False):
    """RMSNorm -> RoPE of the rows x [M, NV, VEC] (live where rm; _qk_row_loads), each rotated element
    from itself and its renormalized partner xp (the same arithmetic gives the same bits). w, wp: the
    weight at each column and at its partner's; first .. s: rope1_pairs. ACT, NUMERICS, KEEP_F32: where the
    values are rounded (_normed_act, _rope_round, _finish)."""
    LOG2_VEC: tl.constexpr = 3 if VEC == 8 else 2
    NV: tl.constexpr = BLOCK_D // VEC
    y = x
    if HAS_NORM:
        ss = tree_sum(x * x, BLOCK_M, NV, LOG2_BLOCK_D - LOG2_VEC, VEC, LOG2_VEC, NATIVE == NATIVE_INTEGER)
        r3 = reciprocal_std(ss, eps, D, BLOCK_M)[:, None, None]
        y = _normed_act(x, r3, w[None, :, :], ACT, NUMERICS, NATIVE)
    if ROPE:
        rmk = rot_mask & rm[:, None, None]
        yp = xp
        if HAS_NORM:
            yp = _normed_act(xp, r3, wp[None, :, :], ACT, NUMERICS, NATIVE)
        firstb = first[None, :, :]
        r0, r1 = rotate(tl.where(firstb, y, yp), tl.where(firstb, yp, y), c, s, CONJ)
        y = tl.where(rmk, _rope_round(tl.where(firstb, r0, r1), ACT, NUMERICS, NATIVE), y)
    return _finish(y, ACT, NUMERICS, KEEP_F32, NATIVE)


@triton.jit
def _halves_loads(x_ptr, xrow, rm, jj, HALF: tl.constexpr, ACT: tl.constexpr = 0):
    """The halves form's loads of BLOCK_M rows at x_ptr + xrow (live where rm): columns jj and HALF + jj."""
    row = xrow[:, None, None] + jj[None, :, :]
    ld = rm[:, None, None] & (jj >= 0)[None, :, :]
    return _load_act(x_ptr, row, ld, ACT), _load_act(x_ptr, row + HALF, ld, ACT)


@triton.jit
def _qk_halves(a, b, wa, wb, eps, pm, c, s, D: tl.constexpr, LOG2_BLOCK_D: tl.constexpr, VEC: tl.constexpr,
               BLOCK_M: tl.constexpr, HAS_NORM: tl.constexpr, CONJ: tl.constexpr, NATIVE: tl.constexpr,
               ACT: tl.constexpr = 0, NUMERICS: tl.constexpr = 0, KEEP_F32: tl.constexpr = False):
    """HALVES (NEOX RoPE over the whole row, D a power of two): RMSNorm -> RoPE of BLOCK_M rows held as
    their two halves a = columns jj, b = columns D / 2 + jj, each [M, D / 2 / VEC, VEC] in one layout, so
    a pair sits in one thread: no partner reload. The norm's adjacent-pairs tree over the row is
    tree(a) + tree(b) (its last level). wa, wb: the halves' weights; pm [M, .., ..]: the token's position
    is in range. ACT, NUMERICS, KEEP_F32: as in _qk_row."""
    NH: tl.constexpr = D // 2 // VEC
    LOG2_VEC: tl.constexpr = 3 if VEC == 8 else 2
    if HAS_NORM:
        split: tl.constexpr = NATIVE == NATIVE_INTEGER
        ss = tree_sum(a * a, BLOCK_M, NH, LOG2_BLOCK_D - 1 - LOG2_VEC, VEC, LOG2_VEC, split) + \
            tree_sum(b * b, BLOCK_M, NH, LOG2_BLOCK_D - 1 - LOG2_VEC, VEC, LOG2_VEC, split)
        r3 = reciprocal_std(ss, eps, D, BLOCK_M)[:, None, None]
        a = _normed_act(a, r3, wa[None, :, :], ACT, NUMERICS, NATIVE)
        b = _normed_act(b, r3, wb[None, :, :], ACT, NUMERICS, NATIVE)
    r0, r1 = rotate(a, b, c, s, CONJ)
    ya = tl.where(pm, _rope_round(r0, ACT, NUMERICS, NATIVE), a)
    yb = tl.where(pm, _rope_round(r1, ACT, NUMERICS, NATIVE), b)
    return _finish(ya, ACT, NUMERICS, KEEP_F32, NATIVE), _finish(yb, ACT, NUMERICS, KEEP_F32, NATIVE)


@triton.jit
def _load_slots(slot_ptr, s_slot, tok, rmask, block_size, pa_b=None, pa_p=None, pa_indptr=None, pa_idx=None,
                pa_nreq=None, pa_nidx=None):
    """The tokens' slots (-1 where not rmask): slot_ptr[tok], or (pa_b not None: FlashInfer's append
    addressing, kvfuse.args.PagedAppend) pa_idx[pa_indptr[b] + p // block_size] * block_size + p % block_size
    for b = pa_b[tok], p = pa_p[tok], -1 where b is outside [0, pa_nreq), p < 0 or the index outside
    [0, pa_nidx); every load is masked to its vector's bounds."""
    if pa_b is None:
        slot = tl.load(slot_ptr + tok * s_slot, mask=rmask, other=-1)
    else:
        b = tl.load(pa_b + tok, mask=rmask, other=-1).to(tl.int64)
        p = tl.load(pa_p + tok, mask=rmask, other=-1).to(tl.int64)
        live = rmask & (b >= 0) & (b < pa_nreq) & (p >= 0)
        start = tl.load(pa_indptr + tl.where(live, b, 0), mask=live, other=0).to(tl.int64)
        idx = start + p // block_size
        live = live & (idx >= 0) & (idx < pa_nidx)
        page = tl.load(pa_idx + tl.where(live, idx, 0), mask=live, other=0).to(tl.int64)
        slot = tl.where(live, page * block_size + p % block_size, -1)
    return slot


@triton.jit
def _scale_rcp(sc):
    """Of a per-tensor scale read once per program: (1 / scale correctly rounded, whether the reciprocal
    path serves it: 2^-64 <= scale <= 2^64, else each value is divided)."""
    fast = (sc >= 5.421010862427522e-20) & (sc <= 1.8446744073709552e19)
    return tl.div_rn(1.0, tl.where(fast, sc, 1.0)), fast


@triton.jit
def _head_scales(scale_ptr, h0, H, G: tl.constexpr):
    """The scales of heads h0 .. h0 + G - 1, one per head (a head past H reads head H - 1's: its values
    are never stored)."""
    scs = ()
    for g in tl.static_range(G):
        scs = scs + (tl.load(scale_ptr + tl.minimum(h0 + g, H - 1)),)
    return scs


@triton.jit
def _record(slot, rmask, c_blk, c_tok, block_size, capacity, SLOT32: tl.constexpr):
    """(ok [M]: the token's loaded slot is valid, the element offset of its head-0 record, int64)."""
    ok, blk, off = block_offset_of_slot(slot, rmask, block_size, capacity, SLOT32)
    return ok, blk * c_blk + off * c_tok


@triton.jit
def _store_record(c_ptr, addr, y, mask, sc, rcp, fast, FP8: tl.constexpr, NATIVE: tl.constexpr,
                  ACT: tl.constexpr = 0, SCALE_MUL: tl.constexpr = False, E5M2: tl.constexpr = False):
    """Values y of the activations' dtype ACT (in fp32) at element offsets addr: their bits (bf16; fp16 /
    fp32 converted exactly), or (FP8; c_ptr a byte pointer)
    e4m3(f(y) / f(scale)) with the division's bits (sc, rcp, fast: _scale), or under SCALE_MUL (the
    multiply convention) e4m3(f(y) * f(scale)), one fp32 product. Both encoders saturate at
    448, so the clamp of SPEC §3 changes no byte of a finite input and is left out (as in the portable
    kernel). E5M2: e5m2 codes instead (encode_e5m2 saturates at 57344)."""
    if FP8:
        if SCALE_MUL:
            t = y * sc
        elif fast:
            t = div_rn_by_reciprocal(y, sc, rcp)
        else:
            t = tl.div_rn(y, tl.zeros_like(y) + sc)
        if E5M2:
            tl.store(c_ptr + addr, encode_e5m2(t, NATIVE), mask=mask)
        else:
            tl.store(c_ptr + addr, encode_e4m3(t, NATIVE), mask=mask)
    elif ACT == ACT_BF16:
        store_bf16(c_ptr, addr, y, mask)
    elif ACT == ACT_FP16:
        tl.store(c_ptr + addr, y.to(tl.float16), mask=mask)
    else:
        tl.store(c_ptr + addr, y, mask=mask)


@triton.jit
def _store_row(dst_ptr, addr, dst2_ptr, addr2, col, mask, y, sc, rcp, fast, FP8: tl.constexpr,
               NATIVE: tl.constexpr, ACT: tl.constexpr, SCALE_MUL: tl.constexpr, SPLIT: tl.constexpr,
               E5M2: tl.constexpr = False):
    """_store_record of the rows y [M, NV, VEC] (columns col) at dst_ptr + addr, or, for a destination held
    as two tensors (dst2_ptr not None), columns < SPLIT there and the others at dst2_ptr + addr2."""
    if dst2_ptr is None:
        _store_record(dst_ptr, addr, y, mask, sc, rcp, fast, FP8, NATIVE, ACT, SCALE_MUL, E5M2)
    else:
        _store_record(dst_ptr, addr, y, mask & (col < SPLIT)[None, :, :], sc, rcp, fast, FP8, NATIVE, ACT, SCALE_MUL,
                      E5M2)
        _store_record(dst2_ptr, addr2, y, mask & (col >= SPLIT)[None, :, :], sc, rcp, fast, FP8, NATIVE, ACT,
                      SCALE_MUL, E5M2)


@triton.jit
def _pth_scale(amax, PTH: tl.constexpr):
    """(scale, 1 / scale) [M] of rows quantized per (token, head) from their amax: token_head_scale with the
    code's QMAX (448 for e4m3, 127 for int8)."""
    if PTH == PTH_E4M3:
        QMAX: tl.constexpr = 448.0
    else:
        QMAX: tl.constexpr = 127.0
    return token_head_scale(amax, QMAX)


@triton.jit
def _nan_max(a, b):
    """max(a, b) that is NaN where either is (tl.maximum leaves NaN unspecified)."""
    return tl.where(a != a, a, tl.where(b != b, b, tl.maximum(a, b)))


@triton.jit
def _pth_codes(y, r, PTH: tl.constexpr, NATIVE: tl.constexpr):
    """The per-(token, head) codes of rows y [M, ., .] by their scales' reciprocals r [M]: t = y * r (one
    rounding), then e4m3 (PTH_E4M3, saturating at 448; NaN 0x7f whatever its sign) or vLLM's int8 rounding
    (PTH_INT8), as bytes."""
    t = y * r[:, None, None]
    if PTH == PTH_E4M3:
        c = tl.where(t != t, 0x7F, encode_e4m3(t, NATIVE))
    else:
        c = encode_int8_rhaz(t).to(tl.uint8)
    return c


@triton.jit
def _store_pth_row(dst_ptr, addr, dst2_ptr, addr2, col, mask, y, amax, sc_ptr, sc_addr, sc_mask, PTH: tl.constexpr,
                   NATIVE: tl.constexpr, SPLIT: tl.constexpr):
    """Rows y [M, NV, VEC] quantized per (token, head) (their amax [M]: row_amax) to byte codes at dst_ptr + addr
    (a destination held as two: _store_row's split), and their scales [M] at sc_ptr + sc_addr where sc_mask."""
    s, r = _pth_scale(amax, PTH)
    c = _pth_codes(y, r, PTH, NATIVE)
    if dst2_ptr is None:
        tl.store(dst_ptr + addr, c, mask=mask)
    else:
        tl.store(dst_ptr + addr, c, mask=mask & (col < SPLIT)[None, :, :])
        tl.store(dst2_ptr + addr2, c, mask=mask & (col >= SPLIT)[None, :, :])
    tl.store(sc_ptr + sc_addr, s, mask=sc_mask)


@triton.jit
def _mrope_rows(pos_t, pos_h, pos_w, rmask, P, s_cs, j, MROPE_T: tl.constexpr, MROPE_H: tl.constexpr,
                MROPE_W: tl.constexpr, MROPE_INTERLEAVED: tl.constexpr):
    """mRoPE's cos / sin rows (SPEC §3): frequency j [NV, VEC] of each token takes the position of row
    t / h / w (pos_* [M], -1 where not rmask); chunked, j < T -> t, j < T + H -> h, else w; interleaved,
    h where j % 3 == 1 and j < 3H, w where j % 3 == 2 and j < 3W, else t. (ok [M, NV, VEC]: that
    position is in [0, P), its table row's element offset [M, NV, VEC], int64)."""
    if MROPE_INTERLEAVED:
        take_h = ((j % 3) == 1) & (j < 3 * MROPE_H)
        take_w = ((j % 3) == 2) & (j < 3 * MROPE_W)
    else:
        take_h = (j >= MROPE_T) & (j < MROPE_T + MROPE_H)
        take_w = j >= MROPE_T + MROPE_H
    p = tl.where(take_h[None, :, :], pos_h[:, None, None],
                 tl.where(take_w[None, :, :], pos_w[:, None, None], pos_t[:, None, None]))
    ok = rmask[:, None, None] & (p >= 0) & (p < P)
    return ok, tl.where(ok, p, 0).to(tl.int64) * s_cs


@triton.jit
def _mrope_pairs(cs_ptr, pos_t, pos_h, pos_w, rmask, P, s_cs, col, HALF: tl.constexpr, R: tl.constexpr,
                 ROPE_OFF: tl.constexpr, NEOX: tl.constexpr, CS_BF16: tl.constexpr, MROPE_T: tl.constexpr,
                 MROPE_H: tl.constexpr, MROPE_W: tl.constexpr, MROPE_INTERLEAVED: tl.constexpr):
    """rope1_pairs under mRoPE: the same pairing of the columns col [NV, VEC], each pair's cos / sin from
    its own position row (_mrope_rows), so rot_mask is per pair: (first, in_rope, rot_mask, partner, cos, sin)."""
    first, in_rope, freq, partner = rope1_pairing(col, HALF, R, ROPE_OFF, NEOX)
    ok, csrow = _mrope_rows(pos_t, pos_h, pos_w, rmask, P, s_cs, freq, MROPE_T, MROPE_H, MROPE_W, MROPE_INTERLEAVED)
    rot_mask = ok & in_rope[None, :, :]
    c = load_f32(cs_ptr, csrow + freq[None, :, :], rot_mask, CS_BF16)
    s = load_f32(cs_ptr, csrow + HALF + freq[None, :, :], rot_mask, CS_BF16)
    return first, in_rope, rot_mask, partner, c, s


@triton.jit
def _qk_heads(x_ptr, s_n, s_h, h0, H, w_ptr, eps, pos_ptr, s_pos, cs_ptr, s_cs, P, tok, rmask,
              dst_ptr, dst_n, dst_h, slot_ptr, s_slot, c_blk, block_size, capacity, scale_ptr,
              D: tl.constexpr, BLOCK_D: tl.constexpr, LOG2_BLOCK_D: tl.constexpr, VEC: tl.constexpr,
              BLOCK_M: tl.constexpr, G: tl.constexpr, HAS_NORM: tl.constexpr, W_BF16: tl.constexpr,
              ROPE: tl.constexpr, R: tl.constexpr, ROPE_OFF: tl.constexpr, NEOX: tl.constexpr, CONJ: tl.constexpr,
              CS_BF16: tl.constexpr, HALVES: tl.constexpr, TO_CACHE: tl.constexpr, STORE_FP8: tl.constexpr,
              SLOT32: tl.constexpr, NATIVE: tl.constexpr, SCALE_PER_HEAD: tl.constexpr = False,
              ACT: tl.constexpr = 0, NUMERICS: tl.constexpr = 0, x2_ptr=None, s2_n=None, s2_h=None,
              dst2_ptr=None, dst2_n=None, dst2_h=None, c2_blk=None, SPLIT: tl.constexpr = 0,
              SCALE_MUL: tl.constexpr = False, SCALE_BY_VALUE: tl.constexpr = False, pa_b=None, pa_p=None,
              pa_indptr=None, pa_idx=None, pa_nreq=None, pa_nidx=None, E5M2: tl.constexpr = False,
              PTH: tl.constexpr = 0, sc_ptr=None, sc_blk=None, sc_tok=None, sc_head=None, s_pos3=None,
              MROPE_T: tl.constexpr = 0, MROPE_H: tl.constexpr = 0, MROPE_W: tl.constexpr = 0,
              MROPE_INTERLEAVED: tl.constexpr = False, FP4: tl.constexpr = 0, sf_ptr=None, sf_blk=None, sf_tok=None,
              sf_head=None):
    """Heads h0 .. h0 + G - 1 (those < H) of q or k for BLOCK_M tokens: norm -> RoPE -> the row at dst_ptr:
    q_out (bf16; token stride dst_n, which may be q itself), or (TO_CACHE) the record of the token's slot
    in a cache of (block, token) strides (c_blk, dst_n), bf16 or e4m3 by the scale. Every load that waits
    on nothing (position, slot, scale, every head's rows) is issued before the
    first instruction that waits on a load: a warp issues in order, so each dependent step placed
    earlier would cost a DRAM round trip of its own. The positions, cos / sin and weights are loaded
    once for the G heads. SCALE_PER_HEAD: the e4m3 scale is scale_ptr[h] for head h (one per head, read
    with the other early loads; its reciprocal per head), else scale_ptr[0] for every head. ACT: the
    activations' dtype (of x and of a destination that is not fp8); NUMERICS: the profile's code
    (kvfuse.numerics_profiles). A head held as two tensors (the whole-row form only): x2_ptr (token / head
    strides s2_n, s2_h) holds its columns from SPLIT on, and a destination held as two, dst2_ptr (strides
    c2_blk, dst2_n, dst2_h as dst_ptr's), the same columns. SCALE_BY_VALUE: scale_ptr is the scale itself
    (an fp32 argument); SCALE_MUL: the cast multiplies by it (_store_record). pa_*: the slots from
    FlashInfer's append addressing (_load_slots). E5M2: the static cast writes e5m2 codes. PTH (STORE_FP8
    False; kvfuse/kernels/codes.py): each row quantized by its own scale (_pth_scale of its amax over the
    whole head), the codes as bytes at dst_ptr, the scale at sc_ptr (the scale cache: (block, token, head)
    strides sc_blk, sc_tok, sc_head). MROPE_T > 0: mRoPE, positions [3, n] (row stride s_pos3, token stride
    s_pos), each frequency's cos / sin from the row MROPE_T / _H / _W and MROPE_INTERLEAVED give it
    (_mrope_rows). FP4 (kvfuse/kernels/gqa_fp4.py; in the halves form each half cast as its own row of
    whole groups, halves_mode): the record holds e2m1 codes
    (dst_ptr bytes, D / 2 a row) and its group scales go to sf_ptr ((block, token, head) strides sf_blk,
    sf_tok, sf_head); an NVFP4 global scale is read as the e4m3 scale is."""
    KEEP_F32: tl.constexpr = (STORE_FP8 or PTH != 0 or FP4 != 0) and NUMERICS == NUMERICS_FP32_CAST
    MROPE: tl.constexpr = MROPE_T > 0
    pos = tok
    pos_h = tok
    pos_w = tok
    slot = tok
    sc = eps
    scs = ()
    if ROPE:
        pos = tl.load(pos_ptr + tok * s_pos, mask=rmask, other=-1)
        if MROPE:
            pos_h = tl.load(pos_ptr + s_pos3 + tok * s_pos, mask=rmask, other=-1)
            pos_w = tl.load(pos_ptr + 2 * s_pos3 + tok * s_pos, mask=rmask, other=-1)
    if TO_CACHE:
        slot = _load_slots(slot_ptr, s_slot, tok, rmask, block_size, pa_b, pa_p, pa_indptr, pa_idx, pa_nreq,
                           pa_nidx)
    if STORE_FP8:
        if SCALE_PER_HEAD:
            scs = _head_scales(scale_ptr, h0, H, G)
        elif SCALE_BY_VALUE:
            sc = scale_ptr
        else:
            sc = tl.load(scale_ptr)
    if FP4 == FP4_NVFP4:
        if SCALE_BY_VALUE:
            sc = scale_ptr
        else:
            sc = tl.load(scale_ptr)
    if HALVES:
        HALF: tl.constexpr = D // 2
        NH: tl.constexpr = HALF // VEC
        jj = tl.arange(0, NH)[:, None] * VEC + tl.arange(0, VEC)[None, :]               # [NH, VEC]
        # every head's loads before any store: the compiler cannot tell that a store (q_out may be q, the
        # cache may be anywhere) leaves the next head's row alone, and would wait for each head in turn
        xa = ()
        xb = ()
        for g in tl.static_range(G):
            a, b = _halves_loads(x_ptr, tok * s_n + (h0 + g).to(tl.int64) * s_h, tl.where(h0 + g < H, rmask, False),
                                 jj, HALF, ACT)
            xa = xa + (a,)
            xb = xb + (b,)
        wa = tl.zeros([NH, VEC], tl.float32)
        wb = wa
        if HAS_NORM:
            wa = load_f32(w_ptr, jj, jj >= 0, W_BF16)
            wb = load_f32(w_ptr, HALF + jj, jj >= 0, W_BF16)
        if MROPE:
            pm, csrow3 = _mrope_rows(pos, pos_h, pos_w, rmask, P, s_cs, jj, MROPE_T, MROPE_H, MROPE_W,
                                     MROPE_INTERLEAVED)
        else:
            pok, csrow = cs_rows(pos, rmask, P, s_cs)
            pm = pok[:, None, None] & (jj >= 0)[None, :, :]
            csrow3 = csrow[:, None, None]
        c = load_f32(cs_ptr, csrow3 + jj[None, :, :], pm, CS_BF16)
        s = load_f32(cs_ptr, csrow3 + HALF + jj[None, :, :], pm, CS_BF16)
        rcp, fast, ok, dst_tok = _destination(sc, slot, tok, rmask, dst_n, c_blk, block_size, capacity, TO_CACHE,
                                              STORE_FP8, SLOT32)
        sc_tok_addr = dst_tok
        if PTH:
            _, sc_tok_addr = _record(slot, rmask, sc_blk, sc_tok, block_size, capacity, SLOT32)
        sf_row = dst_tok
        if FP4 != 0:
            _, sf_row = _record(slot, rmask, sf_blk, sf_tok, block_size, capacity, SLOT32)
        FP4_GROUP: tl.constexpr = 16 if FP4 == FP4_NVFP4 else 32
        for g in tl.static_range(G):
            h = h0 + g
            rm = tl.where(h < H, rmask, False)     # (rmask & scalar: int32 in the interpreter)
            a = xa[g]
            b = xb[g]
            ya, yb = _qk_halves(a, b, wa, wb, eps, pm, c, s, D, LOG2_BLOCK_D, VEC, BLOCK_M, HAS_NORM, CONJ,
                                NATIVE, ACT, NUMERICS, KEEP_F32)
            # no barrier even in place: the value stored at an address is computed from the value loaded
            # from it (a pair's partner is its own other half, not a reload)
            dst = (dst_tok + h.to(tl.int64) * dst_h)[:, None, None] + jj[None, :, :]
            mk = (ok & rm)[:, None, None] & (jj >= 0)[None, :, :]
            if PTH:
                s_row, r_row = _pth_scale(_nan_max(row_amax(ya, mk), row_amax(yb, mk)), PTH)
                tl.store(dst_ptr + dst, _pth_codes(ya, r_row, PTH, NATIVE), mask=mk)
                tl.store(dst_ptr + dst + HALF, _pth_codes(yb, r_row, PTH, NATIVE), mask=mk)
                tl.store(sc_ptr + sc_tok_addr + h.to(tl.int64) * sc_head, s_row, mask=ok & rm)
            elif FP4 != 0:
                # each half holds whole groups (halves_mode): its codes and scales are the row's first or
                # second half of bytes, computed from its own columns as the whole-row form computes them
                c_row = dst_tok + h.to(tl.int64) * dst_h
                s_row = sf_row + h.to(tl.int64) * sf_head
                store_fp4_rows(dst_ptr, c_row, sf_ptr, s_row, ya, ok & rm, sc, HALF, HALF, BLOCK_M, FP4, NATIVE)
                store_fp4_rows(dst_ptr, c_row + HALF // 2, sf_ptr, s_row + HALF // FP4_GROUP, yb, ok & rm, sc, HALF,
                               HALF, BLOCK_M, FP4, NATIVE)
            elif STORE_FP8 and SCALE_PER_HEAD:
                sch = scs[g]
                rch, fsh = _scale_rcp(sch)
                _store_record(dst_ptr, dst, ya, mk, sch, rch, fsh, STORE_FP8, NATIVE, ACT, SCALE_MUL, E5M2)
                _store_record(dst_ptr, dst + HALF, yb, mk, sch, rch, fsh, STORE_FP8, NATIVE, ACT, SCALE_MUL, E5M2)
            else:
                _store_record(dst_ptr, dst, ya, mk, sc, rcp, fast, STORE_FP8, NATIVE, ACT, SCALE_MUL, E5M2)
                _store_record(dst_ptr, dst + HALF, yb, mk, sc, rcp, fast, STORE_FP8, NATIVE, ACT, SCALE_MUL, E5M2)
    else:
        NV: tl.constexpr = BLOCK_D // VEC
        col = tl.arange(0, NV)[:, None] * VEC + tl.arange(0, VEC)[None, :]              # [NV, VEC]
        cmask = col < D
        first = cmask
        rot_mask = cmask[None, :, :]
        c = tl.zeros([BLOCK_M, NV, VEC], tl.float32)
        s = c
        partner = col
        w = c
        wp = c
        if ROPE:
            if MROPE:
                first, in_rope, rot_mask, partner, c, s = _mrope_pairs(cs_ptr, pos, pos_h, pos_w, rmask, P, s_cs, col,
                                                                        R // 2, R, ROPE_OFF, NEOX, CS_BF16, MROPE_T,
                                                                        MROPE_H, MROPE_W, MROPE_INTERLEAVED)
            else:
                pok, csrow = cs_rows(pos, rmask, P, s_cs)
                first, in_rope, rot_mask, partner, c, s = rope1_pairs(cs_ptr, csrow, pok, col, R // 2, R, ROPE_OFF,
                                                                       NEOX, CS_BF16)
            if HAS_NORM:
                wp = load_f32(w_ptr, partner, in_rope, W_BF16)
        if HAS_NORM:
            w = load_f32(w_ptr, col, cmask, W_BF16)
        xs = ()                                    # every head's loads first, as in the halves form
        xps = ()
        for g in tl.static_range(G):
            x2row = tok
            if x2_ptr is not None:
                x2row = tok * s2_n + (h0 + g).to(tl.int64) * s2_h
            x, xp = _qk_row_loads(x_ptr, tok * s_n + (h0 + g).to(tl.int64) * s_h, tl.where(h0 + g < H, rmask, False),
                                  col, cmask, rot_mask, partner, ROPE, ACT, x2_ptr, x2row, SPLIT)
            xs = xs + (x,)
            xps = xps + (xp,)
        in_place_safe: tl.constexpr = ROPE and not TO_CACHE      # q_out may be q
        if in_place_safe:
            tl.debug_barrier()     # every read of the rows (the partner reloads) comes before the stores
        rcp, fast, ok, dst_tok = _destination(sc, slot, tok, rmask, dst_n, c_blk, block_size, capacity, TO_CACHE,
                                              STORE_FP8, SLOT32)
        sc_tok_addr = dst_tok
        if PTH:
            _, sc_tok_addr = _record(slot, rmask, sc_blk, sc_tok, block_size, capacity, SLOT32)
        dst2_tok = dst_tok
        if dst2_ptr is not None:
            if TO_CACHE:
                _, dst2_tok = _record(slot, rmask, c2_blk, dst2_n, block_size, capacity, SLOT32)
            else:
                dst2_tok = tok * dst2_n
        sf_row = dst_tok
        if FP4 != 0:
            _, sf_row = _record(slot, rmask, sf_blk, sf_tok, block_size, capacity, SLOT32)
        for g in tl.static_range(G):
            h = h0 + g
            rm = tl.where(h < H, rmask, False)     # (rmask & scalar: int32 in the interpreter)
            x = xs[g]
            xp = xps[g]
            y = _qk_row(x, xp, rm, w, wp, eps, first, rot_mask, c, s, D, BLOCK_D, LOG2_BLOCK_D, VEC, BLOCK_M,
                        HAS_NORM, ROPE, CONJ, NATIVE, ACT, NUMERICS, KEEP_F32)
            dst = (dst_tok + h.to(tl.int64) * dst_h)[:, None, None] + col[None, :, :]
            dst2 = dst
            if dst2_ptr is not None:
                dst2 = (dst2_tok + h.to(tl.int64) * dst2_h)[:, None, None] + (col - SPLIT)[None, :, :]
            if PTH:
                mk = (ok & rm)[:, None, None] & cmask[None, :, :]
                _store_pth_row(dst_ptr, dst, dst2_ptr, dst2, col, mk, y, row_amax(y, mk), sc_ptr,
                               sc_tok_addr + h.to(tl.int64) * sc_head, ok & rm, PTH, NATIVE, SPLIT)
            elif FP4 != 0:
                store_fp4_rows(dst_ptr, dst_tok + h.to(tl.int64) * dst_h, sf_ptr, sf_row + h.to(tl.int64) * sf_head,
                               y, ok & rm, sc, D, BLOCK_D, BLOCK_M, FP4, NATIVE)
            elif STORE_FP8 and SCALE_PER_HEAD:
                sch = scs[g]
                rch, fsh = _scale_rcp(sch)
                _store_row(dst_ptr, dst, dst2_ptr, dst2, col, (ok & rm)[:, None, None] & cmask[None, :, :], y, sch,
                           rch, fsh, STORE_FP8, NATIVE, ACT, SCALE_MUL, SPLIT, E5M2)
            else:
                _store_row(dst_ptr, dst, dst2_ptr, dst2, col, (ok & rm)[:, None, None] & cmask[None, :, :], y, sc,
                           rcp, fast, STORE_FP8, NATIVE, ACT, SCALE_MUL, SPLIT, E5M2)


@triton.jit
def _destination(sc, slot, tok, rmask, dst_n, c_blk, block_size, capacity, TO_CACHE: tl.constexpr,
                 STORE_FP8: tl.constexpr, SLOT32: tl.constexpr):
    """What the stores need from the loaded scale and slots, computed once the loads are issued: (1 /
    scale, whether the reciprocal path serves it, ok [M], the element offset of each token's head-0 row
    at the destination: its cache record (TO_CACHE; dst_n the cache's token stride), else tok * dst_n)."""
    rcp = sc
    fast = rmask
    if STORE_FP8:
        rcp, fast = _scale_rcp(sc)
    if TO_CACHE:
        ok, dst_tok = _record(slot, rmask, c_blk, dst_n, block_size, capacity, SLOT32)
    else:
        ok = rmask
        dst_tok = tok * dst_n
    return rcp, fast, ok, dst_tok


@triton.jit
def _v_heads(v_ptr, sv_n, sv_h, h0, H, tok, rmask, vc_ptr, c_blk, c_tok, dst_h, slot_ptr, s_slot, block_size,
             capacity, vs_ptr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, VEC: tl.constexpr, G: tl.constexpr,
             FP8: tl.constexpr, SLOT32: tl.constexpr, NATIVE: tl.constexpr, SCALE_PER_HEAD: tl.constexpr = False,
             ACT: tl.constexpr = 0, SCALE_MUL: tl.constexpr = False, SCALE_BY_VALUE: tl.constexpr = False,
             pa_b=None, pa_p=None, pa_indptr=None, pa_idx=None, pa_nreq=None, pa_nidx=None,
             E5M2: tl.constexpr = False, PTH: tl.constexpr = 0, sc_ptr=None, sc_blk=None, sc_tok=None, sc_head=None,
             vw_ptr=None, v_eps=None, V_NORM: tl.constexpr = False, VW_BF16: tl.constexpr = False,
             LOG2_BLOCK_DV: tl.constexpr = 0, BLOCK_M: tl.constexpr = 1, NUMERICS: tl.constexpr = 0,
             FP4: tl.constexpr = 0, sf_ptr=None, sf_blk=None, sf_tok=None, sf_head=None):
    """Heads h0 .. h0 + G - 1 (those < H) of v: copied (bf16 cache: the bits) or cast by v_scale into the
    records of the tokens' slots in vc_ptr ((block, token, head) strides c_blk, c_tok, dst_h). The slot,
    the scale and every head's values are loaded before anything waits on a load
    (_qk_heads); the values of a token whose slot is invalid are loaded and not stored. SCALE_MUL,
    SCALE_BY_VALUE, E5M2, PTH and the scale cache sc_*, FP4 (BLOCK_M tokens) and sf_*: as in _qk_heads.
    V_NORM: each row is RMS-normed first (eps v_eps; weight vw_ptr [DV], or none for vw_ptr None), rounded as
    the QK-norm is under NUMERICS (_normed_act, _finish)."""
    if PTH != 0 or FP4 != 0:
        VALUES: tl.constexpr = True        # loaded as fp32 values (else as FP8 and V_NORM say: values or bits)
    else:
        VALUES: tl.constexpr = FP8 or V_NORM
    NVV: tl.constexpr = BLOCK_DV // VEC
    colv = tl.arange(0, NVV)[:, None] * VEC + tl.arange(0, VEC)[None, :]               # [NVV, VEC]
    vmask = colv < DV
    slot = _load_slots(slot_ptr, s_slot, tok, rmask, block_size, pa_b, pa_p, pa_indptr, pa_idx, pa_nreq, pa_nidx)
    sc = 1.0
    scs = ()
    if FP8:
        if SCALE_PER_HEAD:
            scs = _head_scales(vs_ptr, h0, H, G)
        elif SCALE_BY_VALUE:
            sc = vs_ptr
        else:
            sc = tl.load(vs_ptr)
    if FP4 == FP4_NVFP4:
        if SCALE_BY_VALUE:
            sc = vs_ptr
        else:
            sc = tl.load(vs_ptr)
    vals = ()                                      # every head's loads before any store
    for g in tl.static_range(G):
        vals = vals + (_v_load(v_ptr, sv_n, sv_h, h0 + g, H, tok, rmask, colv, vmask, VALUES, ACT),)
    w = tl.full([NVV, VEC], 1.0, tl.float32)       # weightless: (v * rstd) * 1.0 is v * rstd exactly
    if V_NORM and vw_ptr is not None:
        w = load_f32(vw_ptr, colv, vmask, VW_BF16)
    rcp, fast, ok, dst_tok = _destination(sc, slot, tok, rmask, c_tok, c_blk, block_size, capacity, True, FP8,
                                          SLOT32)
    sc_tok_addr = dst_tok
    if PTH:
        _, sc_tok_addr = _record(slot, rmask, sc_blk, sc_tok, block_size, capacity, SLOT32)
    sf_row = dst_tok
    if FP4 != 0:
        _, sf_row = _record(slot, rmask, sf_blk, sf_tok, block_size, capacity, SLOT32)
    for g in tl.static_range(G):
        h = h0 + g
        val = vals[g]
        if V_NORM:
            val = _v_normed(val, w, v_eps, DV, NVV, LOG2_BLOCK_DV, VEC, BLOCK_M, ACT, NUMERICS,
                            (FP8 or PTH != 0 or FP4 != 0) and NUMERICS == NUMERICS_FP32_CAST, NATIVE)
        dst = (dst_tok + h.to(tl.int64) * dst_h)[:, None, None] + colv[None, :, :]
        okm = tl.where(h < H, ok, False)[:, None, None] & vmask[None, :, :]
        if PTH:
            _store_pth_row(vc_ptr, dst, None, dst, colv, okm, val, row_amax(val, okm), sc_ptr,
                           sc_tok_addr + h.to(tl.int64) * sc_head, tl.where(h < H, ok, False), PTH, NATIVE, 0)
        elif FP4 != 0:
            store_fp4_rows(vc_ptr, dst_tok + h.to(tl.int64) * dst_h, sf_ptr, sf_row + h.to(tl.int64) * sf_head, val,
                           tl.where(h < H, ok, False), sc, DV, BLOCK_DV, BLOCK_M, FP4, NATIVE)
        elif FP8:
            if SCALE_PER_HEAD:
                sch = scs[g]
                rch, fsh = _scale_rcp(sch)
                _store_record(vc_ptr, dst, val, okm, sch, rch, fsh, FP8, NATIVE, ACT, SCALE_MUL, E5M2)
            else:
                _store_record(vc_ptr, dst, val, okm, sc, rcp, fast, FP8, NATIVE, ACT, SCALE_MUL, E5M2)
        elif V_NORM:
            _store_record(vc_ptr, dst, val, okm, sc, rcp, fast, False, NATIVE, ACT)
        elif ACT == ACT_FP32:
            tl.store(vc_ptr.to(tl.pointer_type(tl.uint32)) + dst, val, mask=okm)
        else:
            tl.store(vc_ptr.to(tl.pointer_type(tl.uint16)) + dst, val, mask=okm)


@triton.jit
def _v_normed(v, w, eps, DV: tl.constexpr, NVV: tl.constexpr, LOG2_BLOCK_DV: tl.constexpr, VEC: tl.constexpr,
              BLOCK_M: tl.constexpr, ACT: tl.constexpr, NUMERICS: tl.constexpr, KEEP_F32: tl.constexpr,
              NATIVE: tl.constexpr):
    """The V-norm of rows v [M, NVV, VEC] (fp32, zeros past DV): the QK-norm's RMSNorm (adjacent-pairs sum of
    squares over DV, (v * rstd) * w) and its rounding to the activations' dtype, none where the fp8 cast
    reads the fp32 value (KEEP_F32)."""
    LOG2_VEC: tl.constexpr = 3 if VEC == 8 else 2
    ss = tree_sum(v * v, BLOCK_M, NVV, LOG2_BLOCK_DV - LOG2_VEC, VEC, LOG2_VEC, NATIVE == NATIVE_INTEGER)
    r3 = reciprocal_std(ss, eps, DV, BLOCK_M)[:, None, None]
    return _finish(_normed_act(v, r3, w[None, :, :], ACT, NUMERICS, NATIVE), ACT, NUMERICS, KEEP_F32, NATIVE)


@triton.jit
def _v_load(v_ptr, sv_n, sv_h, h, H, tok, rmask, colv, vmask, FP8: tl.constexpr, ACT: tl.constexpr = 0):
    """Head h of v for the program's tokens (live where rmask and h < H): fp32 values (FP8: a cast reads
    them), else the bits
    (32 of them for fp32 activations)."""
    src = (tok * sv_n + h.to(tl.int64) * sv_h)[:, None, None] + colv[None, :, :]
    okm = tl.where(h < H, rmask, False)[:, None, None] & vmask[None, :, :]
    if FP8:
        val = _load_act(v_ptr, src, okm, ACT)
    elif ACT == ACT_FP32:
        val = tl.load(v_ptr.to(tl.pointer_type(tl.uint32)) + src, mask=okm, other=0)
    else:
        val = tl.load(v_ptr.to(tl.pointer_type(tl.uint16)) + src, mask=okm, other=0)
    return val


@triton.jit(do_not_specialize=["n", "P", "capacity", "pa_nreq", "pa_nidx"])
def qkv_kernel(
    q_ptr, sq_n, sq_h,                      # q bf16 [n, HQ, D], stride(-1) == 1
    k_ptr, sk_n, sk_h,                      # k bf16 [n, HKV, D]
    v_ptr, sv_n, sv_h,                      # v bf16 [n, HKV, DV]
    qo_ptr, so_n, so_h,                     # q_out bf16 [n, HQ, D] (may be q)
    qw_ptr, q_eps, kw_ptr, k_eps,           # q / k norm weights [D] (bf16, fp16 or fp32)
    pos_ptr, s_pos, cs_ptr, s_cs, P,        # positions [n]; cos_sin [P, R] (fp32, bf16 or fp16)
    slot_ptr, s_slot,                       # slot_mapping [n]
    kc_ptr, kc_blk, kc_tok, kc_head,        # k_cache: bf16, or uint8 (e4m3 codes); strides in elements
    vc_ptr, vc_blk, vc_tok, vc_head,        # v_cache: the same, last dim DV
    ks_ptr, vs_ptr,                         # k_scale, v_scale: fp32 [1], or [HKV] (K_/V_SCALE_PER_HEAD) (FP8)
    block_size, capacity, n, HQ, HKV,
    QG, KG,                                 # head groups of G: cdiv(HQ, G), cdiv(HKV, G)
    D: tl.constexpr, BLOCK_D: tl.constexpr, LOG2_BLOCK_D: tl.constexpr, DV: tl.constexpr,
    BLOCK_DV: tl.constexpr, VEC: tl.constexpr, BLOCK_M: tl.constexpr, G: tl.constexpr,
    Q_NORM: tl.constexpr, QW_BF16: tl.constexpr, K_NORM: tl.constexpr, KW_BF16: tl.constexpr,
    ROPE: tl.constexpr, R: tl.constexpr, ROPE_OFF: tl.constexpr, NEOX: tl.constexpr, CONJ: tl.constexpr,
    CS_BF16: tl.constexpr, FP8: tl.constexpr, SLOT32: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr,
    HALVES: tl.constexpr, K_SCALE_PER_HEAD: tl.constexpr, V_SCALE_PER_HEAD: tl.constexpr,
    ACT: tl.constexpr = 0, NUMERICS: tl.constexpr = 0, KV_CACHE: tl.constexpr = True,
    # heads held as two tensors (None: one), SPLIT their first part's width: q's, k's, q_out's and k's
    # destination's (k_cache's or k_out's) columns from SPLIT on, with their own strides
    q2_ptr=None, sq2_n=None, sq2_h=None, k2_ptr=None, sk2_n=None, sk2_h=None,
    qo2_ptr=None, so2_n=None, so2_h=None, kd2_ptr=None, kd2_blk=None, kd2_tok=None, kd2_head=None,
    qs_ptr=None,                            # q_out's e4m3 scale (Q_FP8)
    # FlashInfer's append addressing instead of slot_ptr (kvfuse.args.PagedAppend): batch_indices,
    # positions, kv_indptr, kv_indices, num_requests (len(kv_indptr) - 1), len(kv_indices)
    pa_b=None, pa_p=None, pa_indptr=None, pa_idx=None, pa_nreq=None, pa_nidx=None,
    s_pos3=None,                            # mRoPE: positions [3, n]'s row stride (s_pos: its token stride)
    vw_ptr=None, v_eps=None,                # V-norm: its weight [DV] (None: weightless) and eps
    SPLIT: tl.constexpr = 0, Q_FP8: tl.constexpr = False, SCALE_MUL: tl.constexpr = False,
    SCALE_BY_VALUE: tl.constexpr = False, HAS_V: tl.constexpr = True,
    V_FP8: tl.constexpr = None,             # v_cache cast by v_scale (None: as FP8 says; caches of two formats)
    # the caches' other formats (kvfuse.gqa_formats): the static casts' codes e5m2 instead of e4m3; a cache
    # quantized per (token, head) (PTH, kvfuse/kernels/codes.py) with its scale cache's pointer and (block,
    # token, head) strides
    K_E5M2: tl.constexpr = False, V_E5M2: tl.constexpr = False, K_PTH: tl.constexpr = 0, V_PTH: tl.constexpr = 0,
    ksc_ptr=None, ksc_blk=None, ksc_tok=None, ksc_head=None, vsc_ptr=None, vsc_blk=None, vsc_tok=None,
    vsc_head=None,
    MROPE_T: tl.constexpr = 0, MROPE_H: tl.constexpr = 0, MROPE_W: tl.constexpr = 0,
    MROPE_INTERLEAVED: tl.constexpr = False,
    V_NORM: tl.constexpr = False, VW_BF16: tl.constexpr = False, LOG2_BLOCK_DV: tl.constexpr = 0,
    # 4-bit caches (kvfuse/kernels/gqa_fp4.py FP4_*; 0: none): k's and v's records hold e2m1 codes, their
    # group scales go to ksf_ptr / vsf_ptr ((block, token, head) strides in bytes); ks_ptr / vs_ptr: the
    # NVFP4 global decode scales
    K_FP4: tl.constexpr = 0, V_FP4: tl.constexpr = 0, ksf_ptr=None, ksf_blk=None, ksf_tok=None, ksf_head=None,
    vsf_ptr=None, vsf_blk=None, vsf_tok=None, vsf_head=None,
):
    """One program: BLOCK_M tokens of G heads of one kind (see the module docstring). PDL (programmatic
    dependent launch): wait for the previous kernel before the first read. No early launch_dependents:
    with thousands of small programs, dependents scheduled early take SMs from this kernel's later
    waves (measured: 5.3 -> 7.7 us at n = 256); the implicit trigger at exit remains. ACT: the activations'
    dtype (ACT_BF16 / ACT_FP16 / ACT_FP32); NUMERICS: the profile (NUMERICS_STAGED / _FUSED / _FP32_CAST);
    not KV_CACHE: no caches, k's programs write k_out (passed as kc_ptr, token / head strides kc_tok /
    kc_head) and no program reads v; not HAS_V: a K cache alone (MLA's latent). FP8: k's destination (and
    v's) holds e4m3 codes, Q_FP8: q_out does (scale qs_ptr); SCALE_BY_VALUE: ks_ptr, vs_ptr, qs_ptr are
    the scales themselves (fp32 arguments); SCALE_MUL: the casts multiply by the scale (FlashInfer's
    convention) instead of dividing. MROPE_T / _H / _W (MROPE_T > 0: mRoPE, positions [3, n]) and
    MROPE_INTERLEAVED: the mRoPE section and its order (_mrope_rows); V_NORM: v is RMS-normed before its
    cache (_v_normed)."""
    if PDL:
        gdc_wait()
    pid = tl.program_id(0)
    if KV_CACHE and HAS_V:
        groups = QG + 2 * KG
    else:
        groups = QG + KG
    tb = pid // groups
    grp = pid - tb * groups
    tok = tb.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = tok < n
    if grp < QG:
        _qk_heads(q_ptr, sq_n, sq_h, grp * G, HQ, qw_ptr, q_eps, pos_ptr, s_pos, cs_ptr, s_cs, P, tok, rmask,
                  qo_ptr, so_n, so_h, slot_ptr, s_slot, kc_blk, block_size, capacity, qs_ptr,
                  D, BLOCK_D, LOG2_BLOCK_D, VEC, BLOCK_M, G, Q_NORM, QW_BF16, ROPE, R, ROPE_OFF, NEOX, CONJ, CS_BF16,
                  HALVES, False, Q_FP8, SLOT32, NATIVE, False, ACT, NUMERICS, q2_ptr, sq2_n, sq2_h,
                  qo2_ptr, so2_n, so2_h, None, SPLIT, SCALE_MUL, SCALE_BY_VALUE, s_pos3=s_pos3, MROPE_T=MROPE_T,
                  MROPE_H=MROPE_H, MROPE_W=MROPE_W, MROPE_INTERLEAVED=MROPE_INTERLEAVED)
    elif grp < QG + KG:
        _qk_heads(k_ptr, sk_n, sk_h, (grp - QG) * G, HKV, kw_ptr, k_eps, pos_ptr, s_pos, cs_ptr, s_cs, P, tok, rmask,
                  kc_ptr, kc_tok, kc_head, slot_ptr, s_slot, kc_blk, block_size, capacity, ks_ptr,
                  D, BLOCK_D, LOG2_BLOCK_D, VEC, BLOCK_M, G, K_NORM, KW_BF16, ROPE, R, ROPE_OFF, NEOX, CONJ, CS_BF16,
                  HALVES, KV_CACHE, FP8, SLOT32, NATIVE, K_SCALE_PER_HEAD, ACT, NUMERICS, k2_ptr, sk2_n, sk2_h,
                  kd2_ptr, kd2_tok, kd2_head, kd2_blk, SPLIT, SCALE_MUL, SCALE_BY_VALUE, pa_b, pa_p, pa_indptr,
                  pa_idx, pa_nreq, pa_nidx, K_E5M2, K_PTH, ksc_ptr, ksc_blk, ksc_tok, ksc_head, s_pos3, MROPE_T,
                  MROPE_H, MROPE_W, MROPE_INTERLEAVED, K_FP4, ksf_ptr, ksf_blk, ksf_tok, ksf_head)
    elif KV_CACHE and HAS_V:
        if V_FP8 is None:       # V's cache of K's format
            v_fp8: tl.constexpr = FP8
        else:
            v_fp8: tl.constexpr = V_FP8
        _v_heads(v_ptr, sv_n, sv_h, (grp - QG - KG) * G, HKV, tok, rmask, vc_ptr, vc_blk, vc_tok, vc_head, slot_ptr,
                 s_slot, block_size, capacity, vs_ptr, DV, BLOCK_DV, VEC, G, v_fp8, SLOT32, NATIVE, V_SCALE_PER_HEAD,
                 ACT, SCALE_MUL, SCALE_BY_VALUE, pa_b, pa_p, pa_indptr, pa_idx, pa_nreq, pa_nidx, V_E5M2, V_PTH,
                 vsc_ptr, vsc_blk, vsc_tok, vsc_head, vw_ptr, v_eps, V_NORM, VW_BF16, LOG2_BLOCK_DV, BLOCK_M, NUMERICS,
                 V_FP4, vsf_ptr, vsf_blk, vsf_tok, vsf_head)


# --------------------------------------------------------------------------- launch configuration
WIDE_TILE = 512     # from this tile width on, the launch table is indexed by tokens x heads


def launch_table(block_d: int, stored_scale: bool = False) -> tuple:
    """The compiled kernel's launch table for a tile width: ((first n, (BLOCK_M, G, num_warps)), ...),
    read by gluon.common.table_entry: BLOCK_M tokens of G heads of one kind a program, one warp. From
    the H200 sweep with programmatic dependent launch (benchmarks/tune.py --kernel portable, Llama 3 8B
    and Qwen3 8B fp8 at 128-d heads, Gemma 3 12B fp8 at 256-d;
    benchmarks/results/2026-12-02_h200_gqa_loads_first_sweep.txt): one token of one head at n = 1; from
    two tokens a program of ~512 elements (2 heads of 128, 1 of 256); from 192 tokens ~1024
    elements for heads up to 128 wide (4 heads of 128: Llama 3 8B fp8 at 65536 tokens 372.9 us against
    414.6 with the earlier table, Qwen3 474.0 against 525.7), still one head of 256 (Gemma 3's 2 heads
    of 256: 711.9 us against 642.3). 64-d heads (not measured) get the same element counts.

    Tiles of WIDE_TILE (512) and more (MLA's 576-d heads through FlashInfer's RoPE-quantize calls) are
    indexed by rows = tokens x the call's heads instead: one row a program below 1024 rows, then 4 rows,
    one head, one warp (H200 sweep, benchmarks/rope_quantize_sweep.py, 2026-12-04: one K head of 576 at
    65536 tokens 35.35 us against 42.74 with 2 rows, at 256 tokens 2.45 against 2.77; with 128 q heads
    4 rows from 256 tokens; 1024 itself lies between the points measured, 256 and 4096 rows).

    stored_scale (a K or V cache whose scales the kernel computes and stores: a 4-bit cache,
    kernels/gqa_fp4.py, or a per-(token, head) one in a call with q heads; ``launch_args``): from 192 tokens
    4 tokens of one head a program at heads up to 128 wide, the row's amax (and the e2m1 encoder) holding
    more registers. A per-(token, head) cache write alone keeps the default table: vLLM's writer's call
    (Llama 3 8B, K and V only) took 161.2 us at 65536 tokens with this one against 133.1 (side-by-side
    harness, group H, 2026-12-04). H200 sweeps,
    2026-12-04, Qwen3 8B, every configuration byte-equal: nvfp4 at 65536 tokens 608.8 us against 1219.3
    with 2 tokens of 4 heads in the halves form, 1190.7 against 1681.0 in the whole-row form
    (benchmarks/gqa_formats_bench.py --sweep); int8 per (token, head) 3.89 / 36.39 / 532.31 us at 256 /
    4096 / 65536 against 4.69 / 39.40 / 569.37, fp8 per (token, head) 4.06 / 35.93 / 526.13 against 4.67 /
    36.58 / 527.13 (benchmarks/results/2026-12-04d_h200_gqa_sweep_token_head.json; fp8 per tensor is
    fastest with the table's own entry there: 32.87 / 468.91 us at 4096 / 65536 against 34.91 / 508.68)."""
    if block_d >= WIDE_TILE:
        return ((1, (1, 1, 1)), (1024, (4, 1, 1)))
    g_small = max(1, 256 // block_d)
    g_large = max(1, 512 // block_d) if block_d <= 128 else 1
    if stored_scale and block_d <= 128:
        return ((1, (1, 1, 1)), (2, (2, g_small, 1)), (192, (4, 1, 1)))
    return ((1, (1, 1, 1)), (2, (2, g_small, 1)), (192, (2, g_large, 1)))


def launch_config(n: int, block_d: int, heads: int = 1, interpret: bool = INTERPRET, stored_scale: bool = False):
    """(BLOCK_M, G, num_warps): the launch table on the GPU; in the interpreter (which pays per program)
    as many tokens per program as a 16K-element tile holds, and the heads in groups of up to 4.
    ``kvfuse.kernels.config.force_config`` overrides any of them (tests of launch invariance). ``heads``:
    the call's largest head count (G never exceeds its power of two); stored_scale: the table of a cache
    whose scales the kernel computes (4-bit, per (token, head))."""
    if interpret:
        bm, g, nw = min(next_pow2(max(n, 1)), max(1, 16384 // block_d)), 4, 4
    else:
        bm, g, nw = table_entry(launch_table(block_d, stored_scale), n * max(heads, 1) if block_d >= WIDE_TILE else n)
    g = min(g, next_pow2(max(heads, 1)))
    forced = FORCED.cfg
    if forced is not None:
        bm = forced[0] or bm
        nw = forced[1] or nw
        g = forced[3] or g
    return bm, g, nw


def halves_mode(plan, d: int, block_d: int) -> bool:
    """The q and k rows go as their two halves (``_qk_halves_row``): NEOX RoPE over the whole row
    (rotary_dim == head_dim, a power of two, offset 0), whose halves are whole 8-column vectors, and no
    head held as two tensors; a 4-bit K cache's halves whole groups of its format (each half is cast as a
    row of its own: the same groups, codes and scales as the whole row's)."""
    fp4 = FP4_CODES.get(plan.k_format)
    return (plan.positions is not None and plan.is_neox and plan.rotary_dim == d == block_d
            and plan.rope_offset == 0 and (d // 2) % 8 == 0 and plan.split == 0
            and (fp4 is None or (d // 2) % FP4_GROUPS[fp4] == 0))


_TAIL_PARAMS = ("q2_ptr", "sq2_n", "sq2_h", "k2_ptr", "sk2_n", "sk2_h", "qo2_ptr", "so2_n", "so2_h",
                "kd2_ptr", "kd2_blk", "kd2_tok", "kd2_head")


def _per_head(scale) -> bool:
    return scale is not None and scale.numel() > 1


BYTE_CODE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)   # passed to the kernel as bytes


def _codes(t):
    """A cache of codes (e4m3, e5m2, int8) as the bytes the kernel writes, others as they are."""
    return t.view(torch.uint8) if t is not None and t.dtype in BYTE_CODE_DTYPES else t


def _kernel_tensor(plan, field):
    """The plan's tensor ``field`` as the kernel takes it: an fp8 one as its e4m3 codes (bytes)."""
    return _codes(getattr(plan, field))


def launch_args(plan, tensor=None):
    """(grid, positional args, keyword args) of qkv_kernel for a validated kvfuse.gqa.GQAPlan.
    ``tensor(field)`` is what goes where the plan's tensor ``field`` goes (default: that tensor, an
    fp8 one as its codes); it is asked only for the fields the plan has (a launch kept for a call
    signature passes placeholders, kvfuse.kernels.launcher.tensor_arg)."""
    if tensor is None:
        tensor = functools.partial(_kernel_tensor, plan)
    q, k = plan.q, plan.k
    n, hq, hkv, d = plan.n, q.shape[1], k.shape[1], plan.head_dim
    dv = d if plan.v is None else plan.v.shape[2]
    block_d, block_dv = next_pow2(d), next_pow2(dv)
    # the stored-scale table for a 4-bit cache, and for a per-(token, head) one in a call with q heads; a
    # per-(token, head) cache write alone (vLLM's writer, hq = 0) keeps the default one (launch_table)
    four_bit = plan.k_format in FP4_CODES or plan.v_format in FP4_CODES
    token_head = plan.k_fmt.scale == "token_head" or plan.v_fmt.scale == "token_head"
    bm, g, nw = launch_config(n, block_d, max(hq, hkv), stored_scale=four_bit or (token_head and hq > 0))
    qg, kg = cdiv(hq, g), cdiv(hkv, g)
    kf, vf = plan.k_fmt, plan.v_fmt
    fp8 = kf.scale == "static"            # k's destination cast by k_scale (e4m3, or e5m2: K_E5M2)
    rope = plan.positions is not None
    by_value = plan.scales_by_value

    def given(field, stand_in="q"):   # the stand-in for a tensor the call does not have (never dereferenced)
        return tensor(stand_in if getattr(plan, field) is None else field)

    def tail(field, cache_strides=None):
        """A second part's arguments: (tensor, token stride, head stride), or for a cache (tensor, block,
        token, head strides); Nones for a head held whole (the kernel's one-tensor code)."""
        t = getattr(plan, field)
        if t is None:
            return (None,) * (3 if cache_strides is None else 4)
        return (tensor(field), *(cache_strides(t) if cache_strides is not None else (t.stride(0), t.stride(1))))

    v = plan.k if plan.v is None else plan.v   # without caches (or V) v is not read: k stands in
    if plan.has_cache:
        k_dst = (tensor("k_cache"), *plan.cache_strides(plan.k_cache))   # e4m3 codes written as bytes
        v_dst = (given("v_cache"), *(plan.cache_strides(plan.v_cache) if plan.has_v else (0, 0, 0)))
        k_dst_tail = tail("k_cache_tail", plan.cache_strides)
        slots = (tensor("q"), 0) if plan.paged_append else (tensor("slot_mapping"), plan.slot_mapping.stride(0))
        cap = plan.capacity
    else:          # k's programs write k_out (token and head strides in the cache's token and head slots)
        k_dst = (tensor("k_out"), 0, plan.k_out.stride(0), plan.k_out.stride(1))
        v_dst = (tensor("q"), 0, 0, 0)
        t = plan.k_out_tail
        k_dst_tail = (None,) * 4 if t is None else (tensor("k_out_tail"), None, t.stride(0), t.stride(1))
        slots = (tensor("q"), 0)
        cap = 0
    if by_value:       # the scales themselves (fp32 arguments)
        k_sc, v_sc, q_sc = plan.k_scale_value, plan.v_scale_value, plan.q_scale_value
    else:
        k_sc, v_sc = given("k_scale"), given("v_scale")
        q_sc = None if plan.q_scale is None else tensor("q_scale")
    args = (
        tensor("q"), q.stride(0), q.stride(1), tensor("k"), k.stride(0), k.stride(1),
        given("v", "k"), v.stride(0), v.stride(1),
        tensor("q_out"), plan.q_out.stride(0), plan.q_out.stride(1),
        given("q_weight"), plan.q_eps, given("k_weight"), plan.k_eps,
        given("positions"), plan.positions.stride(-1) if rope else 0, given("cos_sin"),
        plan.cos_sin.stride(0) if rope else 0, plan.cos_sin.shape[0] if rope else 0,
        *slots, *k_dst, *v_dst,
        k_sc, v_sc,
        max(plan.block_size, 1), cap, n, hq, hkv, qg, kg,
    )
    options = dict(
        D=d, BLOCK_D=block_d, LOG2_BLOCK_D=block_d.bit_length() - 1, DV=dv, BLOCK_DV=block_dv, VEC=8, BLOCK_M=bm,
        G=g, Q_NORM=plan.q_weight is not None,
        QW_BF16=plan.q_weight is not None and plan.q_weight.dtype == torch.bfloat16,
        K_NORM=plan.k_weight is not None, KW_BF16=plan.k_weight is not None and plan.k_weight.dtype == torch.bfloat16,
        ROPE=rope, R=plan.rotary_dim if rope else 2, ROPE_OFF=plan.rope_offset if rope else 0,
        NEOX=plan.is_neox, CONJ=plan.conjugate, CS_BF16=rope and plan.cos_sin.dtype == torch.bfloat16,
        FP8=fp8, SLOT32=cap < config.INT32_LIMIT, NATIVE=native(INTERPRET), PDL=False,
        HALVES=halves_mode(plan, d, block_d),
        K_SCALE_PER_HEAD=_per_head(plan.k_scale), V_SCALE_PER_HEAD=_per_head(plan.v_scale),
        num_warps=nw, num_stages=1,
        enable_fp_fusion=False,
    )
    # the defaults of the kernel (bf16, staged, caches) are left out: those launches keep their cache keys
    act, profile = ACTIVATION_CODES[q.dtype], PROFILES[plan.numerics].code
    if act != ACT_BF16.value:
        options["ACT"] = act
    if profile != NUMERICS_STAGED.value:
        options["NUMERICS"] = profile
    if not plan.has_cache:
        options["KV_CACHE"] = False
    # the newer arguments only where a call uses them (their defaults, None, are compile-time constants)
    if plan.split:
        options["SPLIT"] = plan.split
        tails = (*tail("q_tail"), *tail("k_tail"), *tail("q_out_tail"), *k_dst_tail)
        options.update(zip(_TAIL_PARAMS, tails))
    if plan.q_fp8:
        options["Q_FP8"] = True
        options["qs_ptr"] = q_sc
    if plan.scale_convention == "multiply":
        options["SCALE_MUL"] = True
    if by_value:
        options["SCALE_BY_VALUE"] = True
    if plan.paged_append:
        options.update(pa_b=tensor("append_batch_indices"), pa_p=tensor("append_positions"),
                       pa_indptr=tensor("append_kv_indptr"), pa_idx=tensor("append_kv_indices"),
                       pa_nreq=plan.append_kv_indptr.shape[0] - 1, pa_nidx=plan.append_kv_indices.shape[0])
    if not plan.has_v and plan.has_cache:
        options["HAS_V"] = False
    elif plan.has_v and (vf.scale == "static") != fp8:    # caches of two formats
        options["V_FP8"] = vf.scale == "static"
    for which, fmt, scale_cache in (("K", kf, plan.k_scale_cache),
                                    ("V", vf if plan.has_v else None, plan.v_scale_cache)):
        if fmt is None:
            continue
        if fmt.code == "e5m2":
            options[which + "_E5M2"] = True
        if fmt.scale == "token_head":
            options[which + "_PTH"] = PTH_CODES[fmt.name]
            field = which.lower() + "_scale_cache"
            options.update(zip((f"{which.lower()}sc_ptr", f"{which.lower()}sc_blk", f"{which.lower()}sc_tok",
                                f"{which.lower()}sc_head"), (tensor(field), *plan.cache_strides(scale_cache))))
    # 4-bit caches: the format's code and its scale cache (pointer, then block / token / head strides in bytes)
    for side, prefix in (("k", "K"), ("v", "V")):
        fp4 = FP4_CODES.get(getattr(plan, side + "_format")) if plan.has_cache else None
        if fp4 is not None:
            field = side + "_scale_cache"
            options[prefix + "_FP4"] = fp4
            options.update(zip((side + "sf_ptr", side + "sf_blk", side + "sf_tok", side + "sf_head"),
                               (tensor(field), *plan.cache_strides(getattr(plan, field)))))
    if plan.mrope_section is not None:
        options.update(s_pos3=plan.positions.stride(0), MROPE_T=plan.mrope_section[0],
                       MROPE_H=plan.mrope_section[1], MROPE_W=plan.mrope_section[2],
                       MROPE_INTERLEAVED=plan.mrope_interleaved)
    if plan.v_norm:
        options.update(vw_ptr=None if plan.v_weight is None else tensor("v_weight"), v_eps=plan.v_eps, V_NORM=True,
                       VW_BF16=plan.v_weight is not None and plan.v_weight.dtype == torch.bfloat16,
                       LOG2_BLOCK_DV=block_dv.bit_length() - 1)
    groups = qg + (2 * kg if plan.has_cache and plan.has_v else kg)
    return (cdiv(n, bm) * groups,), args, options


def run(plan) -> None:
    """Launch qkv_kernel for a validated plan with n >= 1 (q_out set)."""
    grid, args, options = launch_args(plan)
    qkv_kernel[grid](*args, **with_pdl(options, pdl_launch(plan.q)))


# --------------------------------------------------------------------------- launches kept per call signature
_PARAMS = tuple(inspect.signature(qkv_kernel.fn).parameters.values())
# every parameter up to the last one that is not a constexpr goes positionally in a kept launch, the
# constexprs after it by name (kvfuse.kernels.launcher.Launch substitutes tensors in positional arguments
# only, and its direct launch needs every later parameter among the keyword arguments)
_POSITIONAL = 1 + max(i for i, p in enumerate(_PARAMS) if "constexpr" not in str(p.annotation))


def _all_parameters(args: tuple, options: dict) -> tuple:
    """launch_args' (args, options) as (every parameter up to _POSITIONAL in order, the remaining
    constexprs and the launch options by name), defaults written out: the same bound arguments."""
    named = dict(options)
    positional = list(args)
    for p in _PARAMS[len(args):_POSITIONAL]:
        positional.append(named.pop(p.name) if p.name in named else p.default)
    for p in _PARAMS[_POSITIONAL:]:
        named.setdefault(p.name, p.default)
    return tuple(positional), named


def template_launch(plan, tensor_index: dict, num_tensors: int, pdl: bool) -> Launch:
    """The launch of ``plan`` with its tensors left open (kvfuse.kernels.launcher.Launch): ``tensor_index``
    maps each GQAPlan tensor field to its position in the call's tensors (as the kernel takes them)."""
    grid, args, options = launch_args(plan, tensor_arg)
    args, named = _all_parameters(args, with_pdl(options, pdl))
    return Launch("qkv_kernel", grid, args, named, tensor_index, num_tensors, globals(), stand_in="q",
                  allow_direct=DIRECT_LAUNCH)


def run_template(template, tensors: tuple) -> None:
    """Launch qkv_kernel for one call of a validated signature (kvfuse.plans.gqa.GQATemplate; ``tensors``:
    the call's, by GQAPlan field): its launch is built on the first call of each batch size n (and, with
    a PagedAppend, each num_requests and number of pages: kernel arguments) and kept with the template
    (built and not kept while force_config is active). n = 0 launches nothing."""
    q = tensors[template.rows_at]
    n = q.shape[0]
    if n == 0:
        return
    pdl = pdl_launch(q)
    key = (n, pdl) if template.lengths_at is None else \
        (n, pdl) + tuple(tensors[i].shape[0] for i in template.lengths_at)
    launches = template.launches
    launch = launches.get(key)
    if launch is None or FORCED.cfg is not None:
        launch = template_launch(template.bind(tensors), template.tensor_index, len(tensors), pdl)
        if FORCED.cfg is None:
            if len(launches) >= LAUNCHES_PER_TEMPLATE:
                launches.clear()
            launches[key] = launch
    launch.run(template.kernel_tensors(tensors))
