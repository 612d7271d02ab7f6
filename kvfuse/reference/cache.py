"""The paged caches of the reference backend: record addresses of a format, store and load of records
(SPEC §7), and the NHD / HND element caches of the GQA entry point (SPEC §3): their store and load."""
from __future__ import annotations

from typing import Optional

import torch

from ..formats import KVCacheFormat, q_dtype, sf_dtype
from .numerics import F32, round_to_bf16
from .stages import canonical_nan, dequantize
from .fp4 import dequantize_block_format


def _storage_bytes(kv_cache: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of the cache's whole storage (addresses are storage offsets)."""
    return kv_cache.as_strided((kv_cache.untyped_storage().nbytes(),), (1,), 0)


def record_addresses(kv_cache: torch.Tensor, fmt: KVCacheFormat, slot_mapping: torch.Tensor):
    """-> (valid [n] bool, data_base [n, H], sf_base [n, H], tail_base [n, H]) storage byte offsets."""
    nb, bs, nh, _ = kv_cache.shape
    a = fmt.addressing_for(kv_cache)
    slots = slot_mapping.long()
    valid = (slots >= 0) & (slots < nb * bs)
    s = torch.where(valid, slots, torch.zeros_like(slots))
    blk, off = s // bs, s % bs
    head = torch.arange(nh, device=kv_cache.device) * a.head_stride
    base = kv_cache.storage_offset() + blk * kv_cache.stride(0)
    data = (base + off * a.data_token_stride)[:, None] + head
    sf = (base + off * a.sf_token_stride)[:, None] + head
    return valid, data + a.data_offset, sf + a.sf_offset, data + a.tail_offset


def scale_record_bytes(fmt: KVCacheFormat, sf: torch.Tensor) -> torch.Tensor:
    """The bytes a write stores from a record's scale offset on: the exact scale bytes of ``sf`` [..,
    num_scales] (the format's scale dtype), then the format's zeroed reserved bytes (``zeroed_bytes``)."""
    b = sf.contiguous().view(torch.uint8)
    if fmt.zeroed_bytes:
        b = torch.cat([b, b.new_zeros(b.shape[:-1] + (fmt.zeroed_bytes,))], -1)
    return b


def store(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, fmt: KVCacheFormat, data: torch.Tensor,
          sf: Optional[torch.Tensor] = None, tail: Optional[torch.Tensor] = None) -> None:
    """Write records: data [n, H, quant_bytes] (bf16 cache: bf16 [n, H, D]), sf [n, H, num_scales]
    (sf dtype of the format), tail bf16 [n, H, bf16_tail]. Invalid slots write nothing; only the
    record's data, exact scale and tail bytes are touched, and its reserved bytes (as zeros) where the
    format says ``zero_reserved``."""
    flat = _storage_bytes(kv_cache)
    valid, dbase, sbase, tbase = record_addresses(kv_cache, fmt, slot_mapping)
    parts = [(dbase, data.contiguous().view(torch.uint8))]
    if fmt.quantized:
        parts.append((sbase, scale_record_bytes(fmt, sf)))
    if fmt.bf16_tail:
        parts.append((tbase, tail.contiguous().view(torch.uint8)))
    for base, payload in parts:
        idx = base[valid][..., None] + torch.arange(payload.shape[-1], device=base.device)
        flat[idx] = payload[valid]


def load(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, fmt: KVCacheFormat, dequantize_: bool = True):
    """Gather the records of the given slots. dequantize_: bf16 [n, H, head_dim] (zeros for invalid
    slots); else the raw bytes (data [n, H, data_bytes] = quantized then tail, sf [n, H, sf_bytes]),
    zeros for invalid slots."""
    flat = _storage_bytes(kv_cache)
    valid, dbase, sbase, tbase = record_addresses(kv_cache, fmt, slot_mapping)
    vmask = valid[:, None, None]

    def gather(base, count):
        idx = base[..., None] + torch.arange(count, device=base.device)
        return torch.where(vmask, flat[torch.where(vmask, idx, torch.zeros_like(idx))], 0).to(torch.uint8)

    qb = gather(dbase, fmt.quant_bytes)
    tb = gather(tbase, 2 * fmt.bf16_tail)
    sb = gather(sbase, fmt.sf_bytes)
    if not dequantize_:
        return torch.cat([qb, tb], dim=-1), sb
    if not fmt.quantized:
        return qb.view(torch.bfloat16)
    sf = sb[..., : fmt.sf_exact_bytes].contiguous().view(sf_dtype(fmt.sf_format))
    q = qb.view(q_dtype(fmt.cast_fmt)) if fmt.cast_fmt == "e4m3" else qb
    # NaN codes decode as NaN (SPEC §7): ue8m0 scale 0xFF, e4m3 0x7F / 0xFF (values and scales), fp32
    # NaN scales; each NaN is written as the canonical bf16 NaN. The raw bf16 tail keeps its bits.
    y = canonical_nan(dequantize(q, sf, fmt.cast_fmt, fmt.elements_per_sf, fmt.sf_format, ue8m0_nan=True))
    if fmt.bf16_tail:
        y = torch.cat([y, tb.view(torch.bfloat16)], dim=-1)
    return y


GQA_LAYOUTS = ("NHD", "HND")
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}   # an element's bits by its size


def paged_append_slots(batch_indices, positions, kv_indptr, kv_indices, block_size: int) -> torch.Tensor:
    """The slots of kvfuse.args.PagedAppend's addressing (int64 [n]): token i goes to page
    kv_indices[kv_indptr[b] + p // block_size], offset p % block_size (b = batch_indices[i], p =
    positions[i]); -1 where b is outside [0, len(kv_indptr) - 1), p < 0, or the index into kv_indices
    is outside it. Each index vector is read only where in bounds."""
    b, p = batch_indices.long(), positions.long()
    live = (b >= 0) & (b < kv_indptr.shape[0] - 1) & (p >= 0)
    start = kv_indptr.long()[torch.where(live, b, 0)] if kv_indptr.shape[0] else torch.zeros_like(b)
    idx = start + torch.div(torch.where(live, p, 0), block_size, rounding_mode="floor")
    live &= (idx >= 0) & (idx < kv_indices.shape[0])
    page = kv_indices.long()[torch.where(live, idx, 0)] if kv_indices.shape[0] else torch.zeros_like(b)
    return torch.where(live, page * block_size + torch.remainder(p, block_size), -1)


def store_paged(cache: torch.Tensor, slot_mapping: torch.Tensor, data: torch.Tensor, layout: str) -> None:
    """Scatter rows into a paged cache of vLLM's layout ``"NHD"`` [num_blocks, block_size, H, D] or
    FlashInfer's ``"HND"`` [num_blocks, H, block_size, D] (any strides): ``data`` [n, H, D] holds
    the elements (of the cache's element size: its values, or their bits as int16 / int32, or uint8 e4m3
    codes). Slot s
    writes (s // block_size, s % block_size); a slot outside [0, num_blocks * block_size) writes
    nothing."""
    nb = cache.shape[0]
    bs = cache.shape[1] if layout == "NHD" else cache.shape[2]
    data = data.view(_BITS[data.element_size()])          # copied as bits: no value is touched
    slots = slot_mapping.long()
    valid = (slots >= 0) & (slots < nb * bs)
    s = slots[valid]
    blk, off = s // bs, s % bs
    elems = cache.view(data.dtype)                         # same element size: bytes, not values
    if layout == "NHD":
        elems[blk, off] = data[valid]
    else:
        elems[blk, :, off] = data[valid]                   # advanced indices around a slice: [m, H, D]


def load_paged(cache: torch.Tensor, slot_mapping: torch.Tensor, layout: str) -> torch.Tensor:
    """Gather the rows of the given slots from an ``"NHD"`` / ``"HND"`` paged cache (any strides):
    [n, H, D] of the cache's dtype, zeros (all bits clear) for a slot outside
    [0, num_blocks * block_size). The inverse of :func:`store_paged`."""
    nb = cache.shape[0]
    bs = cache.shape[1] if layout == "NHD" else cache.shape[2]
    slots = slot_mapping.long()
    valid = (slots >= 0) & (slots < nb * bs)
    s = torch.where(valid, slots, torch.zeros_like(slots))
    blk, off = s // bs, s % bs
    bits = cache.view(_BITS[cache.element_size()])
    rows = bits[blk, off] if layout == "NHD" else bits[blk, :, off]        # [n, H, D] either way
    rows = torch.where(valid[:, None, None], rows, torch.zeros_like(rows))
    return rows.view(cache.dtype)


def load_gqa_kv(k_cache, v_cache, slot_mapping, layout="NHD", k_scale=None, v_scale=None, k_format=None,
                v_format=None, k_scale_cache=None, v_scale_cache=None):
    """K and V of the given slots as [n, Hkv, D] / [n, Hkv, Dv] (validated arguments; formats: GQACacheFormat,
    None for the one the cache's dtype means): an "auto" cache's bits as stored (its dtype); a quantized
    cache dequantized as bf16(f(code) * f(scale)), the scale its static one (one per tensor or head h's) or
    the slot's stored one (SPEC §3's inverse; NaN codes read as the canonical bf16 NaN). Zeros for invalid
    slots."""
    out = []
    for cache, scale, fmt, scale_cache in ((k_cache, k_scale, k_format, k_scale_cache),
                                           (v_cache, v_scale, v_format, v_scale_cache)):
        rows = load_paged(cache, slot_mapping, layout)
        quantized = cache.dtype == torch.float8_e4m3fn if fmt is None else fmt.code != "act"
        if quantized and fmt.scale == "block":     # 4-bit codes and the slot's group scales (zeros: zeros)
            rows = dequantize_block_format(fmt.name, rows, load_paged(scale_cache, slot_mapping, layout), scale)
        elif quantized:
            if fmt.scale == "token_head":
                s = load_paged(scale_cache.unsqueeze(-1), slot_mapping, layout)   # [n, H, 1]: the row's scale
            else:
                s = scale[:, None] if scale.numel() > 1 else scale.reshape(())
            rows = canonical_nan(round_to_bf16(rows.to(F32) * s.to(F32)))
        out.append(rows)
    return out[0], out[1]
