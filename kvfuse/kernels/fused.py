"""The fused kernel: any sub-chain of RMSNorm -> RoPE -> Hadamard -> cast into any destination
(bf16 out, contiguous (q, sf), cast_back, paged cache + a stage copy), one launch; plus the
store and load kernels of the paged cache.

A program owns BLOCK_M rows of the flattened [n * num_heads] rows (row = (token, head)) and
the whole head (BLOCK_D = next power of two >= head_dim, masked). Stages and destinations are
constexpr flags of one body. Addresses are int64. Numerics follow SPEC §2 exactly (see
kvfuse/kernels/numerics.py); a row's bytes never depend on BLOCK_M, num_warps or other rows.
"""
from __future__ import annotations

import contextlib
import os
import threading

import torch
import triton
import triton.language as tl

from .. import backend as _backend
from ..formats import FMAX
from ..plan import Plan
from .numerics import (bf16_bits, decode_e2m1, decode_e4m3, encode_e2m1, encode_e4m3, group_scales, load_f32,
                       round_bf16)

SF_CODES = {"ue8m0": 0, "ue8m0_fp32": 1, "e4m3": 2, "fp32": 3}
CAST_CODES = {None: 0, "e4m3": 1, "e2m1": 2}
STAGE_CODES = {None: 0, "norm": 1, "transform": 2, "cast_back": 3}
DEST_NONE, DEST_CONTIGUOUS, DEST_CACHE = 0, 1, 2


# --------------------------------------------------------------------------- helpers
@triton.jit
def _tree_sum(v, BLOCK_M: tl.constexpr, LOG2_BLOCK_D: tl.constexpr):
    """The adjacent-pairs tree over axis 1: each level sums a size-2 axis (one add, commutative),
    so the order is fixed whatever layout the compiler picks."""
    for lvl in tl.static_range(LOG2_BLOCK_D):
        v = tl.sum(tl.reshape(v, [BLOCK_M, (1 << LOG2_BLOCK_D) >> (lvl + 1), 2]), axis=2)
    return tl.reshape(v, [BLOCK_M])


@triton.jit
def _store_bf16(ptr, offs, v, mask):
    tl.store(ptr.to(tl.pointer_type(tl.uint16)) + offs, bf16_bits(v), mask=mask)


@triton.jit
def _store_bf16_bytes(ptr, base, v, ncols: tl.constexpr, mask, BLOCK_M: tl.constexpr):
    """Store bf16 values v [M, ncols] as little-endian byte pairs at ptr + base + 2*col (any alignment)."""
    bits = bf16_bits(v).to(tl.uint32)
    pair = tl.join(bits & 0xFF, bits >> 8).to(tl.uint8)                   # [M, ncols, 2]
    b = tl.reshape(pair, [BLOCK_M, 2 * ncols])
    bcol = tl.arange(0, 2 * ncols)
    bmask = tl.reshape(tl.join(mask, mask), [BLOCK_M, 2 * ncols])
    tl.store(ptr + base[:, None] + bcol[None, :], b, mask=bmask)


@triton.jit
def _store_u32_bytes(ptr, addr, v, mask):
    """Store uint32 v as 4 little-endian bytes at ptr + addr (any alignment)."""
    for i in tl.static_range(4):
        tl.store(ptr + addr + i, ((v >> (8 * i)) & 0xFF).to(tl.uint8), mask=mask)


@triton.jit
def _quantize(y, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, CAST: tl.constexpr, G: tl.constexpr,
              SF: tl.constexpr, FMAX: tl.constexpr, NATIVE: tl.constexpr):
    """y [M, BLOCK_D] (bf16 values in fp32) -> (codes [M, BLOCK_D] (uint8 e4m3 / int32 e2m1),
    stored scales [M, BLOCK_D // G] uint32, dequantized bf16 values [M, BLOCK_D])."""
    v = tl.reshape(y, [BLOCK_M, BLOCK_D // G, G])
    amax = tl.maximum(tl.max(tl.abs(v), axis=2), 1e-4)
    m, d, stored = group_scales(amax, FMAX, SF, NATIVE)
    t = tl.minimum(tl.maximum(v * m[:, :, None], -FMAX), FMAX)
    if CAST == 1:
        code = encode_e4m3(t, NATIVE)
        qf = decode_e4m3(code)
    else:
        code = encode_e2m1(t)
        qf = decode_e2m1(code)
    back = round_bf16(qf * d[:, :, None], NATIVE)
    return tl.reshape(code, [BLOCK_M, BLOCK_D]), stored, tl.reshape(back, [BLOCK_M, BLOCK_D])


@triton.jit
def _pack_e2m1(code, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """codes [M, BLOCK_D] int32 -> bytes [M, BLOCK_D // 2], the even element in the low nibble."""
    pairs = tl.reshape(code, [BLOCK_M, BLOCK_D // 2, 2])
    weight = tl.where(tl.arange(0, 2) == 0, 1, 16)
    return tl.sum(pairs * weight[None, None, :], axis=2).to(tl.uint8)


# --------------------------------------------------------------------------- the fused kernel
@triton.jit(do_not_specialize=["n_rows", "P", "capacity"])
def fused_kernel(
    x_ptr, sx_n, sx_h,                        # x bf16 [n, H, D], stride(-1) == 1
    w_ptr, eps,                               # RMSNorm weight [D] (bf16 or fp32)
    pos_ptr, s_pos, cs_ptr, s_cs, P,          # positions [n]; cos_sin [P, R]
    had_scale,
    out_ptr, so_n, so_h,                      # bf16 [n, H, D] (stage copy / result)
    q_ptr, sq_n, sq_h, sf_ptr, ss_n, ss_h,    # contiguous q [n, H, qbytes], sf [n, H, DQ / G]
    slot_ptr, s_slot,                         # slot_mapping [n]
    cache_ptr, s_blk, data_tok, sf_tok, head_stride, data_off, sf_off, tail_off, block_size, capacity,
    n_rows, H,
    D: tl.constexpr, BLOCK_D: tl.constexpr, LOG2_BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    HAS_NORM: tl.constexpr, W_BF16: tl.constexpr,
    HAS_ROPE: tl.constexpr, R: tl.constexpr, ROPE_OFF: tl.constexpr, NEOX: tl.constexpr, CONJ: tl.constexpr,
    CS_BF16: tl.constexpr,
    HAS_HAD: tl.constexpr,
    CAST: tl.constexpr, G: tl.constexpr, SF: tl.constexpr, FMAX: tl.constexpr, DQ: tl.constexpr,
    OUT_STAGE: tl.constexpr, DEST: tl.constexpr, NATIVE: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < n_rows
    tok = rows // H
    head = rows - tok * H
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    m2 = rmask[:, None] & cmask[None, :]
    xrow = tok * sx_n + head * sx_h
    x = load_f32(x_ptr, xrow[:, None] + cols[None, :], m2, True)
    y = x

    # ---- RMSNorm
    if HAS_NORM:
        ss = _tree_sum(x * x, BLOCK_M, LOG2_BLOCK_D)
        rstd = tl.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), tl.sqrt_rn(tl.div_rn(ss, D * 1.0) + eps))
        w = load_f32(w_ptr, cols, cmask, W_BF16)
        y = round_bf16((x * rstd[:, None]) * w[None, :], NATIVE)
        if OUT_STAGE == 1:
            _store_bf16(out_ptr, (tok * so_n + head * so_h)[:, None] + cols[None, :], y, m2)

    # ---- RoPE: every rotated element is computed from itself and its partner (reloaded and
    # renormalized: the same arithmetic gives the same bits)
    if HAS_ROPE:
        HALF: tl.constexpr = R // 2
        k = cols - ROPE_OFF
        in_rope = (k >= 0) & (k < R)
        if NEOX:
            first = k < HALF
            j = tl.where(first, k, k - HALF)
            partner = tl.where(first, cols + HALF, cols - HALF)
        else:
            first = (k & 1) == 0
            j = k >> 1
            partner = tl.where(first, cols + 1, cols - 1)
        j = tl.where(in_rope, j, 0)
        partner = tl.where(in_rope, partner, 0)
        pos = tl.load(pos_ptr + tok * s_pos, mask=rmask, other=-1).to(tl.int64)
        pok = rmask & (pos >= 0) & (pos < P)
        rot_mask = pok[:, None] & in_rope[None, :]
        csrow = tl.where(pok, pos, 0) * s_cs
        c = load_f32(cs_ptr, csrow[:, None] + j[None, :], rot_mask, CS_BF16)
        s = load_f32(cs_ptr, csrow[:, None] + HALF + j[None, :], rot_mask, CS_BF16)
        yp = load_f32(x_ptr, xrow[:, None] + partner[None, :], rot_mask, True)
        if HAS_NORM:
            wp = load_f32(w_ptr, partner, in_rope, W_BF16)
            yp = round_bf16((yp * rstd[:, None]) * wp[None, :], NATIVE)
        firstb = first[None, :]
        a = tl.where(firstb, y, yp)
        b = tl.where(firstb, yp, y)
        if CONJ:
            r0 = (a * c) + (b * s)
            r1 = (b * c) - (a * s)
        else:
            r0 = (a * c) - (b * s)
            r1 = (a * s) + (b * c)
        y = tl.where(rot_mask, round_bf16(tl.where(firstb, r0, r1), NATIVE), y)

    # ---- Hadamard: butterflies at distance 1, 2, 4, ...; each level sums a size-2 axis
    if HAS_HAD:
        h = y
        sgn = tl.where(tl.arange(0, 2) == 0, 1.0, -1.0)[None, None, :, None]
        first2 = (tl.arange(0, 2) == 0)[None, None, :, None]
        for lvl in tl.static_range(LOG2_BLOCK_D):
            v4 = tl.reshape(h, [BLOCK_M, BLOCK_D >> (lvl + 1), 2, 1 << lvl])
            plus = tl.sum(v4, axis=2)
            minus = tl.sum(v4 * sgn, axis=2)
            h = tl.reshape(tl.where(first2, plus[:, :, None, :], minus[:, :, None, :]), [BLOCK_M, BLOCK_D])
        y = round_bf16(h * had_scale, NATIVE)

    if OUT_STAGE == 2:
        _store_bf16(out_ptr, (tok * so_n + head * so_h)[:, None] + cols[None, :], y, m2)

    # ---- cast and destinations
    if DEST == 2:
        slot = tl.load(slot_ptr + tok * s_slot, mask=rmask, other=-1).to(tl.int64)
        ok = rmask & (slot >= 0) & (slot < capacity)
        slot = tl.where(ok, slot, 0)
        blk = slot // block_size
        base = blk * s_blk + head * head_stride
        qbase = base + (slot - blk * block_size) * data_tok
        sfbase = base + (slot - blk * block_size) * sf_tok + sf_off
        tailbase = qbase + tail_off
        qbase = qbase + data_off
    if CAST != 0:
        code, stored, back = _quantize(y, BLOCK_M, BLOCK_D, CAST, G, SF, FMAX, NATIVE)
        if OUT_STAGE == 3:
            _store_bf16(out_ptr, (tok * so_n + head * so_h)[:, None] + cols[None, :],
                        tl.where((cols < DQ)[None, :], back, y), m2)
        gi = tl.arange(0, BLOCK_D // G)
        gmask = (gi < DQ // G)[None, :]
        if CAST == 1:
            qb = code
            qcols = cols
            QB: tl.constexpr = DQ
        else:
            qb = _pack_e2m1(code, BLOCK_M, BLOCK_D)
            qcols = tl.arange(0, BLOCK_D // 2)
            QB: tl.constexpr = DQ // 2
        if DEST == 1:
            qrow = tok * sq_n + head * sq_h
            tl.store(q_ptr.to(tl.pointer_type(tl.uint8)) + qrow[:, None] + qcols[None, :], qb.to(tl.uint8),
                     mask=rmask[:, None] & (qcols < QB)[None, :])
            srow = (tok * ss_n + head * ss_h)[:, None] + gi[None, :]
            smask = rmask[:, None] & gmask
            if SF == 0 or SF == 2:
                tl.store(sf_ptr.to(tl.pointer_type(tl.uint8)) + srow, stored.to(tl.uint8), mask=smask)
            else:
                tl.store(sf_ptr.to(tl.pointer_type(tl.uint32)) + srow, stored, mask=smask)
        if DEST == 2:
            okm = ok[:, None]
            tl.store(cache_ptr + qbase[:, None] + qcols[None, :], qb.to(tl.uint8), mask=okm & (qcols < QB)[None, :])
            if SF == 0 or SF == 2:
                tl.store(cache_ptr + sfbase[:, None] + gi[None, :], stored.to(tl.uint8), mask=okm & gmask)
            else:
                _store_u32_bytes(cache_ptr, sfbase[:, None] + 4 * gi[None, :], stored, okm & gmask)
            if DQ < D:
                tail = (cols >= DQ) & cmask
                tcol = tl.where(tail, cols - DQ, 0)
                bits = bf16_bits(y).to(tl.uint32)
                tm = okm & tail[None, :]
                tl.store(cache_ptr + tailbase[:, None] + 2 * tcol[None, :], (bits & 0xFF).to(tl.uint8), mask=tm)
                tl.store(cache_ptr + tailbase[:, None] + 2 * tcol[None, :] + 1, (bits >> 8).to(tl.uint8), mask=tm)
    elif DEST == 2:
        _store_bf16_bytes(cache_ptr, qbase, y, BLOCK_D, ok[:, None] & cmask[None, :], BLOCK_M)


# --------------------------------------------------------------------------- launch configuration
# triton.jit chose between compiling and interpreting when this module was imported
INTERPRET = _backend.interpreter_enabled()
# the launch path is hot: plain-Python helpers (triton.next_power_of_2 costs microseconds a call)
_NATIVE_CASTS = os.environ.get("KVFUSE_NATIVE_CASTS", "1") != "0"


def next_pow2(v: int) -> int:
    return 1 << max(v - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)

_force = threading.local()


@contextlib.contextmanager
def force_config(block_m: int = None, num_warps: int = None):
    """Force rows per program / warps per program (tests of launch-configuration invariance)."""
    prev = getattr(_force, "cfg", None)
    _force.cfg = (block_m, num_warps)
    try:
        yield
    finally:
        _force.cfg = prev


def launch_config(n_rows: int, head_dim: int, block_d: int, interpret: bool):
    """(BLOCK_M, num_warps) from a small table measured on the H200 (benchmarks/tune_sweep.py):
    one row per program and 4 warps at decode sizes, ~1-2K elements per one-warp program above;
    the interpreter pays per program, so it takes many rows at once."""
    forced = getattr(_force, "cfg", None)
    if interpret:
        bm = min(next_pow2(max(n_rows, 1)), max(1, 16384 // block_d))
        nw = 4
    elif n_rows <= 512:
        bm, nw = 1, 4          # decode sizes: as many programs as rows (H200 sweep, BENCHMARKS.md)
    else:
        bm = max(1, next_pow2(1152 // head_dim + 1) // 2)  # ~1-2K elements per program, one warp
        nw = 1
    if forced is not None:
        bm = forced[0] or bm
        nw = forced[1] or nw
    return bm, nw


def _native(interpret: bool) -> bool:
    """Native conversions on the GPU (exact there); KVFUSE_NATIVE_CASTS=0 (read at import) forces the
    integer helpers (a diagnostic: both must give the same bytes)."""
    return not interpret and _NATIVE_CASTS


def run_plan(plan: Plan) -> None:
    """Launch the fused kernel for a validated plan (n >= 1)."""
    x = plan.x
    n, H, D = x.shape
    block_d = next_pow2(D)
    interpret = INTERPRET
    bm, nw = launch_config(n * H, D, block_d, interpret)
    dummy = x
    cast = plan.cast
    out = plan.out if plan.out is not None else dummy
    if plan.kv_cache is not None:
        dest = DEST_CACHE
    elif plan.q_out is not None:
        dest = DEST_CONTIGUOUS
    else:
        dest = DEST_NONE
    q = plan.q_out if plan.q_out is not None else dummy
    sf = plan.sf_out if plan.sf_out is not None else dummy
    cache = plan.kv_cache if plan.kv_cache is not None else dummy
    a = plan.addressing
    cap = cache.shape[0] * cache.shape[1] if plan.kv_cache is not None else 0
    w = plan.weight if plan.weight is not None else dummy
    pos = plan.positions if plan.positions is not None else dummy
    cs = plan.cos_sin if plan.cos_sin is not None else dummy
    grid = (cdiv(n * H, bm),)
    fused_kernel[grid](
        x, x.stride(0), x.stride(1),
        w, plan.eps,
        pos, pos.stride(0) if plan.positions is not None else 0, cs,
        cs.stride(0) if plan.cos_sin is not None else 0, cs.shape[0] if plan.cos_sin is not None else 0,
        plan.hadamard_scale if plan.hadamard_scale is not None else 1.0,
        out, out.stride(0), out.stride(1),
        q, q.stride(0), q.stride(1), sf, sf.stride(0), sf.stride(1),
        plan.slot_mapping if plan.slot_mapping is not None else dummy,
        plan.slot_mapping.stride(0) if plan.slot_mapping is not None else 0,
        cache, cache.stride(0),
        a.data_token_stride if a else 0, a.sf_token_stride if a else 0, a.head_stride if a else 0,
        a.data_offset if a else 0, a.sf_offset if a else 0,
        (a.tail_offset - a.data_offset) if a else 0,
        cache.shape[1] if plan.kv_cache is not None else 1, cap,
        n * H, H,
        D=D, BLOCK_D=block_d, LOG2_BLOCK_D=block_d.bit_length() - 1, BLOCK_M=bm,
        HAS_NORM=plan.weight is not None, W_BF16=plan.weight is not None and plan.weight.dtype == torch.bfloat16,
        HAS_ROPE=plan.positions is not None, R=plan.rotary_dim, ROPE_OFF=plan.rope_offset, NEOX=plan.is_neox,
        CONJ=plan.conjugate, CS_BF16=plan.cos_sin is not None and plan.cos_sin.dtype == torch.bfloat16,
        HAS_HAD=plan.hadamard_scale is not None,
        CAST=CAST_CODES[cast.cast_fmt if cast else None], G=cast.group if cast else 16,
        SF=SF_CODES[cast.sf_format] if cast else 0, FMAX=FMAX[cast.cast_fmt] if cast else 1.0,
        DQ=plan.quant_dim if cast else D,
        OUT_STAGE=STAGE_CODES[plan.out_stage], DEST=dest, NATIVE=_native(interpret),
        num_warps=nw, num_stages=1, enable_fp_fusion=False,
    )


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
        if CAST == 0:
            lo = tl.load(cache_ptr + qb[:, None] + 2 * cols[None, :], mask=okm & (cols < D)[None, :], other=0)
            hi = tl.load(cache_ptr + qb[:, None] + 2 * cols[None, :] + 1, mask=okm & (cols < D)[None, :], other=0)
            val = ((lo.to(tl.uint32) | (hi.to(tl.uint32) << 8)) << 16).to(tl.float32, bitcast=True)
        else:
            qmask = okm & (cols < DQ)[None, :]
            if CAST == 1:
                code = tl.load(cache_ptr + qb[:, None] + cols[None, :], mask=qmask, other=0)
                qf = decode_e4m3(code)
            else:
                byte = tl.load(cache_ptr + qb[:, None] + (cols >> 1)[None, :], mask=qmask, other=0).to(tl.uint32)
                qf = decode_e2m1(tl.where((cols & 1)[None, :] == 0, byte & 0xF, byte >> 4))
            gi = tl.arange(0, BLOCK_D // G)
            gm = okm & (gi < DQ // G)[None, :]
            if SF == 0:
                e = tl.load(cache_ptr + sb[:, None] + gi[None, :], mask=gm, other=127).to(tl.int32)
                d = tl.where(e == 0, 0x400000, e << 23).to(tl.float32, bitcast=True)   # byte 0: 2^-127
            elif SF == 2:
                d = decode_e4m3(tl.load(cache_ptr + sb[:, None] + gi[None, :], mask=gm, other=0x38))
            else:
                u = tl.zeros([BLOCK_M, BLOCK_D // G], tl.uint32)
                for i in tl.static_range(4):
                    bt = tl.load(cache_ptr + sb[:, None] + 4 * gi[None, :] + i, mask=gm, other=0)
                    u = u | (bt.to(tl.uint32) << (8 * i))
                d = u.to(tl.float32, bitcast=True)
            v = tl.reshape(qf, [BLOCK_M, BLOCK_D // G, G]) * d[:, :, None]
            val = tl.reshape(round_bf16(v, NATIVE), [BLOCK_M, BLOCK_D])
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


def _bytes_rows(t, rows):
    return t.contiguous().view(torch.uint8).reshape(rows, -1)


def store(kv_cache, slot_mapping, fmt, data, sf=None, tail=None) -> None:
    """Triton store_kv_cache: data [n, H, ..] (+ sf, tail) -> records (validated by the caller)."""
    n, H = data.shape[0], data.shape[1]
    rows = n * H
    d = _bytes_rows(data, rows)
    s = _bytes_rows(sf, rows) if fmt.quantized else d
    t = _bytes_rows(tail, rows) if fmt.bf16_tail else d
    qb, sfb, tb = d.shape[1], (s.shape[1] if fmt.quantized else 0), (t.shape[1] if fmt.bf16_tail else 0)
    bm = 64 if INTERPRET else 8
    np2 = next_pow2
    store_kernel[(cdiv(rows, bm),)](
        d, s, t, slot_mapping, slot_mapping.stride(0), kv_cache, *_cache_geometry(kv_cache, fmt), rows, H,
        QB=qb, BLOCK_QB=np2(qb), SFB=sfb, BLOCK_SFB=np2(max(sfb, 1)), TB=tb, BLOCK_TB=np2(max(tb, 1)),
        BLOCK_M=bm, num_warps=4)


def load(kv_cache, slot_mapping, fmt, dequantize: bool):
    """Triton load_paged_kv_cache (see kvfuse.api.load_paged_kv_cache)."""
    n = slot_mapping.shape[0]
    H = kv_cache.shape[2]
    rows = n * H
    dev = kv_cache.device
    interpret = INTERPRET
    D = fmt.head_dim
    block_d = next_pow2(D)
    if dequantize:
        out = torch.empty((n, H, D), dtype=torch.bfloat16, device=dev)
        sf_out = out
    else:
        out = torch.empty((n, H, fmt.data_bytes), dtype=torch.uint8, device=dev)
        sf_out = torch.empty((n, H, fmt.sf_bytes), dtype=torch.uint8, device=dev)
    bm = min(next_pow2(max(rows, 1)), max(1, 16384 // block_d)) if interpret else max(1, 2048 // block_d)
    np2 = next_pow2
    load_kernel[(cdiv(rows, bm),)](
        slot_mapping, slot_mapping.stride(0), kv_cache, *_cache_geometry(kv_cache, fmt), rows, H, out,
        sf_out if sf_out.numel() else out,
        D=D, BLOCK_D=block_d, DQ=fmt.quant_dim, CAST=CAST_CODES[fmt.cast_fmt], G=fmt.elements_per_sf or 16,
        SF=SF_CODES.get(fmt.sf_format, 0), QB=fmt.quant_bytes, DATA_B=fmt.data_bytes,
        BLOCK_DATA_B=np2(fmt.data_bytes), SFB=fmt.sf_bytes, BLOCK_SFB=np2(max(fmt.sf_bytes, 1)),
        DEQUANT=dequantize, BLOCK_M=bm, NATIVE=not interpret, num_warps=4, enable_fp_fusion=False)
    return out if dequantize else (out, sf_out)
