"""The store and load kernels of the paged cache and their host side: ``store`` (kvfuse.store_kv_cache:
a call's data, scales and tail bytes copied into the records of its slots) and ``load``
(kvfuse.load_paged_kv_cache: records gathered as raw bytes, or dequantized to bf16). Their launches
are kept with the call signature's plan-cache entry (kvfuse/kernels/launcher.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .blocks import store_bf16
from .codes import CAST_CODES, CAST_E4M3, CAST_NONE, SF_CODES, SF_E4M3, SF_UE8M0
from .config import DIRECT_LAUNCH, INTERPRET, cdiv, next_pow2
from .launcher import Launch, tensor_arg
from .numerics import decode_e2m1, decode_e4m3, round_bf16


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
                 TB: tl.constexpr, BLOCK_TB: tl.constexpr, ZB: tl.constexpr, BLOCK_ZB: tl.constexpr,
                 BLOCK_M: tl.constexpr):
    """data [rows, QB], sf [rows, SFB], tail [rows, TB] (contiguous bytes) -> the records; ZB > 0: the ZB
    reserved bytes after the scales as zeros (KVCacheFormat.zero_reserved)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < n_rows
    ok, qb, sb, tb = _record_bases(slot_ptr, s_slot, rows, rmask, H, s_blk, data_tok, sf_tok, head_stride,
                                   data_off, sf_off, tail_off, block_size, capacity)
    _copy_bytes(data_ptr, rows * QB, cache_ptr, qb, ok, QB, BLOCK_QB)
    if SFB > 0:
        _copy_bytes(sf_ptr, rows * SFB, cache_ptr, sb, ok, SFB, BLOCK_SFB)
    if ZB > 0:
        z = tl.arange(0, BLOCK_ZB)
        tl.store(cache_ptr + sb[:, None] + SFB + z[None, :], tl.zeros([BLOCK_M, BLOCK_ZB], tl.uint8),
                 mask=ok[:, None] & (z < ZB)[None, :])
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
            # NaN codes decode as NaN (SPEC §7); numerics.decode_e4m3 (shared with the write kernels)
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
        store_bf16(out_ptr, rows[:, None] * D + cols[None, :], val, rmask[:, None] & (cols < D)[None, :])
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
    zb = fmt.zeroed_bytes
    bm = 64 if INTERPRET else 8
    T = tensor_arg
    args = (T("data"), T("sf"), T("tail"), T("slot_mapping"), slot_mapping.stride(0), T("kv_cache"),
            *_cache_geometry(kv_cache, fmt), rows, kv_cache.shape[2])
    options = dict(QB=qb, BLOCK_QB=next_pow2(qb), SFB=sfb, BLOCK_SFB=next_pow2(max(sfb, 1)), TB=tb,
                   BLOCK_TB=next_pow2(max(tb, 1)), ZB=zb, BLOCK_ZB=next_pow2(max(zb, 1)), BLOCK_M=bm, num_warps=4)
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
