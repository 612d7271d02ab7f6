"""The GQA / MHA kernel of :func:`kvfuse.fused_qk_norm_rope_store_kv` (SPEC §11): q, k and v of a
batch of tokens in one launch.

A program owns BLOCK_M tokens of one head of the concatenated head list [q heads | k heads | v heads]
(HQ + 2 * HKV heads; the 1-d grid walks the heads fastest, so neighbouring programs read neighbouring
heads of a packed QKV row and write neighbouring records of an NHD cache). Which of the three a program
is follows from its head index, a runtime branch that is uniform over the program:

* q: RMSNorm (optional) -> RoPE (optional) -> bf16 into q_out (which may be q itself);
* k: the same with k's weight -> the cache record of the token's slot (bf16, or e4m3 by k_scale);
* v: copied (bf16 cache: the bits) or quantized by v_scale into its record.

A row is held as [BLOCK_D / VEC, VEC] (16-byte bf16 vectors). The norm's adjacent-pairs tree, the RoPE
(each rotated element from itself and its reloaded, renormalized partner: the same arithmetic gives the
same bits) and the narrowing helpers are the portable kernel's (kvfuse/kernels/fused.py, numerics.py),
so a row's bytes are those of SPEC §2 whatever BLOCK_M or the head. Addresses are int64; the slot ->
(block, offset) division runs in int32 while the caches hold fewer than 2^31 slots.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from . import fused as _fused
from .codes import NATIVE_INTEGER
from .fused import (INTERPRET, _force, _native, _normed, _positions, _rope1_loads, _rotate, _store_bf16,
                    _tree_sum, cdiv, next_pow2, slot_block_offset)
from .gluon.common import table_entry
from .numerics import encode_e4m3, load_f32, round_bf16

__all__ = ["qkv_kernel", "launch_table", "launch_config", "launch_args", "run", "INTERPRET"]


@triton.jit
def _qk_rows(x_ptr, xrow, w_ptr, eps, pos_ptr, s_pos, cs_ptr, s_cs, P, tok, rmask, col, cmask,
             D: tl.constexpr, BLOCK_D: tl.constexpr, LOG2_BLOCK_D: tl.constexpr, VEC: tl.constexpr,
             BLOCK_M: tl.constexpr, HAS_NORM: tl.constexpr, W_BF16: tl.constexpr, ROPE: tl.constexpr,
             R: tl.constexpr, ROPE_OFF: tl.constexpr, NEOX: tl.constexpr, CONJ: tl.constexpr,
             CS_BF16: tl.constexpr, NATIVE: tl.constexpr):
    """RMSNorm -> RoPE of BLOCK_M rows starting at x_ptr + xrow (x [.., D] bf16): y [M, NV, VEC],
    bf16 values held in fp32 (SPEC §2)."""
    LOG2_VEC: tl.constexpr = 3 if VEC == 8 else 2
    NV: tl.constexpr = BLOCK_D // VEC
    m3 = rmask[:, None, None] & cmask[None, :, :]
    x = load_f32(x_ptr, xrow[:, None, None] + col[None, :, :], m3, True)         # [M, NV, VEC]
    y = x
    if HAS_NORM:
        ss = _tree_sum(x * x, BLOCK_M, NV, LOG2_BLOCK_D - LOG2_VEC, VEC, LOG2_VEC, NATIVE == NATIVE_INTEGER)
        if (D & (D - 1)) == 0:
            mean = ss * (1.0 / D)             # exact: the same bits as ss / D for a power of two
        else:
            mean = tl.div_rn(ss, D * 1.0)
        rstd = tl.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), tl.sqrt_rn(mean + eps))
        w = load_f32(w_ptr, col, cmask, W_BF16)
        y = _normed(x, rstd[:, None, None], rstd[:, None, None], w[None, :, :], w[None, :, :], False, False, NATIVE)
    if ROPE:
        HALF: tl.constexpr = R // 2
        pok, csrow = _positions(pos_ptr, s_pos, tok, rmask, P, s_cs)
        first, rot_mask, c, s, yp, wp, bp = _rope1_loads(x_ptr, xrow, w_ptr, w_ptr, cs_ptr, csrow, pok, col, HALF, R,
                                                         ROPE_OFF, NEOX, HAS_NORM, W_BF16, False, True, CS_BF16)
        if HAS_NORM:
            yp = _normed(yp, rstd[:, None, None], rstd[:, None, None], wp[None, :, :], wp[None, :, :], False, False,
                         NATIVE)
        firstb = first[None, :, :]
        r0, r1 = _rotate(tl.where(firstb, y, yp), tl.where(firstb, yp, y), c, s, CONJ)
        y = tl.where(rot_mask, round_bf16(tl.where(firstb, r0, r1), NATIVE), y)
    return y


@triton.jit
def _qk_halves(x_ptr, xrow, w_ptr, eps, pos_ptr, s_pos, cs_ptr, s_cs, P, tok, rmask, D: tl.constexpr,
               LOG2_BLOCK_D: tl.constexpr, VEC: tl.constexpr, BLOCK_M: tl.constexpr, HAS_NORM: tl.constexpr, W_BF16: tl.constexpr,
               R: tl.constexpr, CONJ: tl.constexpr, CS_BF16: tl.constexpr, NATIVE: tl.constexpr):
    """HALVES (NEOX RoPE over the whole row: R == D, a power of two): RMSNorm -> RoPE of BLOCK_M rows as
    their two halves a = columns j, b = columns HALF + j, each [M, HALF / VEC, VEC] in one layout, so a
    pair sits in one thread and rotates with no partner reload. The norm's adjacent-pairs tree over
    the row is tree(a) + tree(b) (its last level). Returns (rotated a, rotated b, j)."""
    HALF: tl.constexpr = R // 2
    NH: tl.constexpr = HALF // VEC
    LOG2_VEC: tl.constexpr = 3 if VEC == 8 else 2
    LOG2_NH: tl.constexpr = LOG2_BLOCK_D - 1 - LOG2_VEC                              # R == D == BLOCK_D
    jj = tl.arange(0, NH)[:, None] * VEC + tl.arange(0, VEC)[None, :]               # [NH, VEC]
    ld = rmask[:, None, None] & (jj >= 0)[None, :, :]
    a = load_f32(x_ptr, xrow[:, None, None] + jj[None, :, :], ld, True)
    b = load_f32(x_ptr, xrow[:, None, None] + HALF + jj[None, :, :], ld, True)
    if HAS_NORM:
        split = NATIVE == NATIVE_INTEGER
        ss = _tree_sum(a * a, BLOCK_M, NH, LOG2_NH, VEC, LOG2_VEC, split) + \
            _tree_sum(b * b, BLOCK_M, NH, LOG2_NH, VEC, LOG2_VEC, split)
        mean = ss * (1.0 / D)                 # exact: D is a power of two
        rstd = tl.div_rn(tl.full([BLOCK_M], 1.0, tl.float32), tl.sqrt_rn(mean + eps))
        wa = load_f32(w_ptr, jj, jj >= 0, W_BF16)
        wb = load_f32(w_ptr, HALF + jj, jj >= 0, W_BF16)
        r3 = rstd[:, None, None]
        a = _normed(a, r3, r3, wa[None, :, :], wa[None, :, :], False, False, NATIVE)
        b = _normed(b, r3, r3, wb[None, :, :], wb[None, :, :], False, False, NATIVE)
    pok, csrow = _positions(pos_ptr, s_pos, tok, rmask, P, s_cs)
    pm = pok[:, None, None] & (jj >= 0)[None, :, :]
    c = load_f32(cs_ptr, csrow[:, None, None] + jj[None, :, :], pm, CS_BF16)
    s = load_f32(cs_ptr, csrow[:, None, None] + HALF + jj[None, :, :], pm, CS_BF16)
    r0, r1 = _rotate(a, b, c, s, CONJ)
    return tl.where(pm, round_bf16(r0, NATIVE), a), tl.where(pm, round_bf16(r1, NATIVE), b), jj


@triton.jit
def _record_rows(slot_ptr, s_slot, tok, rmask, head, c_blk, c_tok, c_head, block_size, capacity,
                 SLOT32: tl.constexpr):
    """(ok [M]: the token's slot is valid, base [M]: its record's element offset in the cache, int64)."""
    ok, blk, off = slot_block_offset(slot_ptr, s_slot, tok, rmask, block_size, capacity, SLOT32)
    return ok, blk * c_blk + off * c_tok + head * c_head


@triton.jit
def _store_record(c_ptr, addr, y, mask, scale_ptr, FP8: tl.constexpr, NATIVE: tl.constexpr):
    """bf16 values y (in fp32) into the cache at element offsets addr: their bits (bf16 cache), or
    e4m3(f(y) / f(scale)) (FP8; c_ptr a byte pointer). Both encoders saturate at 448, so the clamp of
    SPEC §11 changes no byte of a finite input and is left out (as in the portable kernel)."""
    if FP8:
        sc = tl.load(scale_ptr)
        code = encode_e4m3(tl.div_rn(y, tl.zeros_like(y) + sc), NATIVE)
        tl.store(c_ptr + addr, code, mask=mask)
    else:
        _store_bf16(c_ptr, addr, y, mask)


@triton.jit
def _v_rows(v_ptr, sv_n, sv_h, vc_ptr, vc_blk, vc_tok, vc_head, vs_ptr, slot_ptr, s_slot, block_size, capacity,
            tok, rmask, hv, DV: tl.constexpr, BLOCK_DV: tl.constexpr, VEC: tl.constexpr, FP8: tl.constexpr,
            SLOT32: tl.constexpr, NATIVE: tl.constexpr):
    """A v program: its rows copied (bf16 cache: the bits) or cast by v_scale into their records."""
    NVV: tl.constexpr = BLOCK_DV // VEC
    colv = tl.arange(0, NVV)[:, None] * VEC + tl.arange(0, VEC)[None, :]           # [NVV, VEC]
    vmask = colv < DV
    src = (tok * sv_n + hv * sv_h)[:, None, None] + colv[None, :, :]
    ok, base = _record_rows(slot_ptr, s_slot, tok, rmask, hv, vc_blk, vc_tok, vc_head, block_size, capacity,
                            SLOT32)
    dst = base[:, None, None] + colv[None, :, :]
    okm = ok[:, None, None] & vmask[None, :, :]
    if FP8:
        vv = load_f32(v_ptr, src, okm, True)
        _store_record(vc_ptr, dst, vv, okm, vs_ptr, FP8, NATIVE)
    else:
        bits = tl.load(v_ptr.to(tl.pointer_type(tl.uint16)) + src, mask=okm, other=0)
        tl.store(vc_ptr.to(tl.pointer_type(tl.uint16)) + dst, bits, mask=okm)


@triton.jit(do_not_specialize=["n", "P", "capacity"])
def qkv_kernel(
    q_ptr, sq_n, sq_h,                      # q bf16 [n, HQ, D], stride(-1) == 1
    k_ptr, sk_n, sk_h,                      # k bf16 [n, HKV, D]
    v_ptr, sv_n, sv_h,                      # v bf16 [n, HKV, DV]
    qo_ptr, so_n, so_h,                     # q_out bf16 [n, HQ, D] (may be q)
    qw_ptr, q_eps, kw_ptr, k_eps,           # q / k norm weights [D] (bf16 or fp32)
    pos_ptr, s_pos, cs_ptr, s_cs, P,        # positions [n]; cos_sin [P, R]
    slot_ptr, s_slot,                       # slot_mapping [n]
    kc_ptr, kc_blk, kc_tok, kc_head,        # k_cache: bf16, or uint8 (e4m3 codes); strides in elements
    vc_ptr, vc_blk, vc_tok, vc_head,        # v_cache: the same, last dim DV
    ks_ptr, vs_ptr,                         # k_scale, v_scale: fp32 [1] (FP8)
    block_size, capacity, n, HQ, HKV,
    D: tl.constexpr, BLOCK_D: tl.constexpr, LOG2_BLOCK_D: tl.constexpr, DV: tl.constexpr,
    BLOCK_DV: tl.constexpr, VEC: tl.constexpr, BLOCK_M: tl.constexpr,
    Q_NORM: tl.constexpr, QW_BF16: tl.constexpr, K_NORM: tl.constexpr, KW_BF16: tl.constexpr,
    ROPE: tl.constexpr, R: tl.constexpr, ROPE_OFF: tl.constexpr, NEOX: tl.constexpr, CONJ: tl.constexpr,
    CS_BF16: tl.constexpr, FP8: tl.constexpr, SLOT32: tl.constexpr, NATIVE: tl.constexpr, PDL: tl.constexpr,
    HALVES: tl.constexpr = False,
):
    """One program: BLOCK_M tokens of head h of [q heads | k heads | v heads] (see the module docstring).
    PDL (programmatic dependent launch): wait for the previous kernel before the first read. No early
    launch_dependents: with thousands of small programs, dependents scheduled early take SMs from this
    kernel's later waves (measured: 5.3 -> 7.7 us at n = 256); the implicit trigger at exit remains."""
    if PDL:
        gdc_wait()
    pid = tl.program_id(0)
    heads = HQ + 2 * HKV
    h = pid % heads
    tok = (pid // heads).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = tok < n
    NV: tl.constexpr = BLOCK_D // VEC
    col = tl.arange(0, NV)[:, None] * VEC + tl.arange(0, VEC)[None, :]              # [NV, VEC]
    cmask = col < D
    if HALVES:
        if h < HQ + HKV:
            is_q = h < HQ
            hh = tl.where(is_q, h, h - HQ).to(tl.int64)
            if is_q:
                ya, yb, jj = _qk_halves(q_ptr, tok * sq_n + hh * sq_h, qw_ptr, q_eps, pos_ptr, s_pos, cs_ptr, s_cs, P,
                                        tok, rmask, D, LOG2_BLOCK_D, VEC, BLOCK_M, Q_NORM, QW_BF16, R, CONJ, CS_BF16,
                                        NATIVE)
                tl.debug_barrier()     # q_out may be q: every read of these rows comes first
                dst = (tok * so_n + hh * so_h)[:, None, None] + jj[None, :, :]
                mk = rmask[:, None, None] & (jj >= 0)[None, :, :]
                _store_bf16(qo_ptr, dst, ya, mk)
                _store_bf16(qo_ptr, dst + R // 2, yb, mk)
            else:
                ya, yb, jj = _qk_halves(k_ptr, tok * sk_n + hh * sk_h, kw_ptr, k_eps, pos_ptr, s_pos, cs_ptr, s_cs, P,
                                        tok, rmask, D, LOG2_BLOCK_D, VEC, BLOCK_M, K_NORM, KW_BF16, R, CONJ, CS_BF16,
                                        NATIVE)
                ok, base = _record_rows(slot_ptr, s_slot, tok, rmask, hh, kc_blk, kc_tok, kc_head, block_size,
                                        capacity, SLOT32)
                dst = base[:, None, None] + jj[None, :, :]
                okm = ok[:, None, None] & (jj >= 0)[None, :, :]
                _store_record(kc_ptr, dst, ya, okm, ks_ptr, FP8, NATIVE)
                _store_record(kc_ptr, dst + R // 2, yb, okm, ks_ptr, FP8, NATIVE)
        else:
            _v_rows(v_ptr, sv_n, sv_h, vc_ptr, vc_blk, vc_tok, vc_head, vs_ptr, slot_ptr, s_slot, block_size, capacity,
                    tok, rmask, (h - HQ - HKV).to(tl.int64), DV, BLOCK_DV, VEC, FP8, SLOT32, NATIVE)
    elif h < HQ:
        hq = h.to(tl.int64)
        y = _qk_rows(q_ptr, tok * sq_n + hq * sq_h, qw_ptr, q_eps, pos_ptr, s_pos, cs_ptr, s_cs, P, tok, rmask, col,
                     cmask, D, BLOCK_D, LOG2_BLOCK_D, VEC, BLOCK_M, Q_NORM, QW_BF16, ROPE, R, ROPE_OFF, NEOX, CONJ,
                     CS_BF16, NATIVE)
        if ROPE:
            tl.debug_barrier()     # q_out may be q: every read of these rows (RoPE reloads them) comes first
        _store_bf16(qo_ptr, (tok * so_n + hq * so_h)[:, None, None] + col[None, :, :], y,
                    rmask[:, None, None] & cmask[None, :, :])
    elif h < HQ + HKV:
        hk = (h - HQ).to(tl.int64)
        y = _qk_rows(k_ptr, tok * sk_n + hk * sk_h, kw_ptr, k_eps, pos_ptr, s_pos, cs_ptr, s_cs, P, tok, rmask, col,
                     cmask, D, BLOCK_D, LOG2_BLOCK_D, VEC, BLOCK_M, K_NORM, KW_BF16, ROPE, R, ROPE_OFF, NEOX, CONJ,
                     CS_BF16, NATIVE)
        ok, base = _record_rows(slot_ptr, s_slot, tok, rmask, hk, kc_blk, kc_tok, kc_head, block_size, capacity,
                                SLOT32)
        _store_record(kc_ptr, base[:, None, None] + col[None, :, :], y, ok[:, None, None] & cmask[None, :, :], ks_ptr,
                      FP8, NATIVE)
    else:
        _v_rows(v_ptr, sv_n, sv_h, vc_ptr, vc_blk, vc_tok, vc_head, vs_ptr, slot_ptr, s_slot, block_size, capacity,
                tok, rmask, (h - HQ - HKV).to(tl.int64), DV, BLOCK_DV, VEC, FP8, SLOT32, NATIVE)


# --------------------------------------------------------------------------- launch configuration
def launch_table(block_d: int) -> tuple:
    """The compiled kernel's launch table for a tile width: ((first n, (BLOCK_M, num_warps)), ...),
    read by gluon.common.table_entry. One token per one-warp program at n = 1; from two tokens,
    one-warp programs of ~256 elements (2 tokens of 128, 1 of 256, 4 of 64). H200 sweep of head_dim
    128 (Llama 3 8B / Qwen3 8B, bf16 and fp8 caches; benchmarks/tune.py --kernel portable,
    benchmarks/results/2026-12-01_h200_gqa_sweep.json): 2 tokens a one-warp program is the fastest of
    BLOCK_M 1-32 x 1-8 warps at n = 64, 256 and 4096 (61.8 us at 4096 against 96.7 with 8 tokens);
    the 64 and 256 widths follow the same element count, unmeasured."""
    multi = max(1, 256 // block_d)
    return ((1, (1, 1)), (2, (multi, 1)))


def launch_config(n: int, block_d: int, interpret: bool = INTERPRET):
    """(BLOCK_M, num_warps): the launch table on the GPU; in the interpreter (which pays per program)
    as many tokens per program as a 16K-element tile holds. ``kvfuse.kernels.fused.force_config``
    overrides either (tests of launch invariance)."""
    if interpret:
        bm, nw = min(next_pow2(max(n, 1)), max(1, 16384 // block_d)), 4
    else:
        bm, nw = table_entry(launch_table(block_d), n)
    forced = _force.cfg
    if forced is not None:
        bm = forced[0] or bm
        nw = forced[1] or nw
    return bm, nw


def halves_mode(plan, d: int, block_d: int) -> bool:
    """The q and k rows go as their two halves (``_qk_halves``): NEOX RoPE over the whole row (rotary_dim
    == head_dim, a power of two, offset 0), whose halves are whole 8-column vectors."""
    return (plan.positions is not None and plan.is_neox and plan.rotary_dim == d == block_d
            and plan.rope_offset == 0 and (d // 2) % 8 == 0)


def launch_args(plan):
    """(grid, positional args, keyword args) of qkv_kernel for a validated kvfuse.gqa.GQAPlan."""
    q, k, v = plan.q, plan.k, plan.v
    n, hq, d = q.shape
    hkv, dv = k.shape[1], v.shape[2]
    block_d, block_dv = next_pow2(d), next_pow2(dv)
    bm, nw = launch_config(n, block_d)
    fp8 = plan.fp8
    kc = plan.k_cache.view(torch.uint8) if fp8 else plan.k_cache   # e4m3 codes written as bytes
    vc = plan.v_cache.view(torch.uint8) if fp8 else plan.v_cache
    rope = plan.positions is not None

    def or_q(t):   # q stands in for a tensor the call does not have (never dereferenced)
        return q if t is None else t

    cap = plan.capacity
    args = (
        q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        plan.q_out, plan.q_out.stride(0), plan.q_out.stride(1),
        or_q(plan.q_weight), plan.q_eps, or_q(plan.k_weight), plan.k_eps,
        or_q(plan.positions), plan.positions.stride(0) if rope else 0, or_q(plan.cos_sin),
        plan.cos_sin.stride(0) if rope else 0, plan.cos_sin.shape[0] if rope else 0,
        plan.slot_mapping, plan.slot_mapping.stride(0),
        kc, *plan.cache_strides(plan.k_cache), vc, *plan.cache_strides(plan.v_cache),
        or_q(plan.k_scale), or_q(plan.v_scale),
        plan.block_size, cap, n, hq, hkv,
    )
    options = dict(
        D=d, BLOCK_D=block_d, LOG2_BLOCK_D=block_d.bit_length() - 1, DV=dv, BLOCK_DV=block_dv, VEC=8, BLOCK_M=bm,
        Q_NORM=plan.q_weight is not None, QW_BF16=plan.q_weight is not None and plan.q_weight.dtype == torch.bfloat16,
        K_NORM=plan.k_weight is not None, KW_BF16=plan.k_weight is not None and plan.k_weight.dtype == torch.bfloat16,
        ROPE=rope, R=plan.rotary_dim if rope else 2, ROPE_OFF=plan.rope_offset if rope else 0,
        NEOX=plan.is_neox, CONJ=plan.conjugate, CS_BF16=rope and plan.cos_sin.dtype == torch.bfloat16,
        FP8=fp8, SLOT32=cap < _fused._INT32_LIMIT, NATIVE=_native(INTERPRET), PDL=False,
        num_warps=nw, num_stages=1, enable_fp_fusion=False,
    )
    if halves_mode(plan, d, block_d):
        options["HALVES"] = True
    return (cdiv(n, bm) * (hq + 2 * hkv),), args, options


def run(plan) -> None:
    """Launch qkv_kernel for a validated plan with n >= 1 (q_out set)."""
    grid, args, options = launch_args(plan)
    qkv_kernel[grid](*args, **_fused.with_pdl(options, _fused.pdl_launch(plan.q)))
