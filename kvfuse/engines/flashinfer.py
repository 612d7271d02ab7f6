"""FlashInfer 0.7.2's paged-KV append and cos/sin-cache RoPE with FlashInfer's signatures and
semantics, each one call of a kvfuse entry point: ``import flashinfer`` call sites of these functions
swap to ``from kvfuse.engines import flashinfer``.

- :func:`append_paged_kv_cache` (``flashinfer.page``) -> :func:`kvfuse.fused_qk_norm_rope_store_kv` with
  zero q heads; FlashInfer's page addressing read by the kernel (:class:`kvfuse.PagedAppend`).
- :func:`apply_rope_with_cos_sin_cache` and :func:`apply_rope_with_cos_sin_cache_inplace`
  (``flashinfer.rope``) -> :func:`kvfuse.fused_group`: query and key, one launch.
- :func:`rope_quantize_fp8`, :func:`mla_rope_quantize_fp8` and :func:`rope_quantize_fp8_append_paged_kv_cache`
  (``flashinfer.rope``) -> :func:`kvfuse.fused_qk_norm_rope_store_kv`, one launch: the rope / nope parts
  as pairs of tensors, fp8 q (and k) outputs, FlashInfer's multiply-by-scale convention with its scales
  as numbers, numerics "fused_fp32_cast" (RoPE in fp32, the cast reads the fp32 value), MLA's
  separate ckv / kpe caches as a K cache held as two tensors.
- :func:`nvfp4_quantize_append_paged_kv_cache` and :func:`nvfp4_quantize_append_paged_kv_cache_with_slot_mapping`
  (``flashinfer.page``) -> :func:`kvfuse.fused_qk_norm_rope_store_kv` with zero q heads and the "nvfp4"
  cache format (e2m1 codes, e4m3 block scales in ``kv_cache_sf``, the global scales as k_scale / v_scale).

Numerics: FlashInfer's CUDA RoPE is compiled with FMA contraction (``a * cos + b * sin`` in one rounding
or two, as the compiler chose), so its bytes cannot be reproduced by an exact chain. kvfuse's RoPE rounds
each product and the sum on its own (SPEC §6): its bytes equal :func:`kvfuse.reference.rope`, and it
agrees with an fp64 RoPE within FlashInfer's own test tolerance. The append takes bf16 or fp16 inputs
(caches of their dtype), the RoPE bf16, the RoPE-quantize calls bf16 or fp16; what FlashInfer accepts
beyond kvfuse's domain (fp16 RoPE inputs, fp8 caches in the append, e5m2 outputs, head sizes not a
multiple of 8 in the append and RoPE-quantize, of 16 in the RoPE) raises TypeError / ValueError saying
"not supported yet". docs/engines.md lists the differences.
"""
from __future__ import annotations

import math

import torch

from ..args import FusedCall, PagedAppend, RopeArgs
from ..gqa import fused_qk_norm_rope_store_kv
from ..group import fused_group
from . import _checks

__all__ = ["append_paged_kv_cache", "apply_rope_with_cos_sin_cache", "apply_rope_with_cos_sin_cache_inplace",
           "rope_quantize_fp8", "mla_rope_quantize_fp8", "rope_quantize_fp8_append_paged_kv_cache", "nvfp4_quantize_append_paged_kv_cache",
           "nvfp4_quantize_append_paged_kv_cache_with_slot_mapping", "KV_LAYOUTS"]

KV_LAYOUTS = ("NHD", "HND")
_APPEND_DTYPES = (torch.bfloat16, torch.float16)
_APPEND_NAMES = {"k": "append_key", "v": "append_value", "k_cache": "paged_kv_cache", "v_cache": "paged_kv_cache",
                 "slot_mapping.batch_indices": "batch_indices", "slot_mapping.positions": "positions",
                 "slot_mapping.kv_indptr": "kv_indptr", "slot_mapping.kv_indices": "kv_indices"}
_ROPE_NAMES = {"calls[0]": "query", "calls[1]": "key"}


def _cache_pair(caches, name: str):
    """(k, v) from FlashInfer's (k, v) tuple or its single [num_pages, 2, ...] tensor (its [:, 0] / [:, 1])."""
    if isinstance(caches, torch.Tensor):
        if caches.dim() != 5 or caches.shape[1] != 2:
            raise ValueError(f"{name}: a single tensor must be [max_num_pages, 2, ...], got shape "
                             f"{tuple(caches.shape)}")
        return caches[:, 0], caches[:, 1]
    if isinstance(caches, (tuple, list)) and len(caches) == 2:
        return tuple(_checks.tensor(c, name) for c in caches)
    raise TypeError(f"{name} must be a (k_cache, v_cache) tuple or one 5-d tensor, got {type(caches).__name__}")


def _paged_caches(paged_kv_cache, dtype):
    """(k_cache, v_cache) from FlashInfer's tuple or its single [num_pages, 2, ...] tensor, of the inputs' dtype."""
    k_cache, v_cache = _cache_pair(paged_kv_cache, "paged_kv_cache")
    for c in (k_cache, v_cache):
        if c.dtype != dtype:
            raise TypeError(f"paged_kv_cache: dtype {c.dtype} is not supported yet (kvfuse appends {dtype} "
                            f"inputs into {dtype} caches)")
        if c.dim() != 4:
            raise ValueError(f"paged_kv_cache: expected 4-d k/v caches, got shape {tuple(c.shape)}")
    return k_cache, v_cache


def _int_vector(t, name: str) -> torch.Tensor:
    """A 1-d int32 / int64 index vector, as given (the kernel reads either)."""
    _checks.tensor(t, name)
    if t.dtype not in (torch.int32, torch.int64) or t.dim() != 1:
        raise ValueError(f"{name}: expected a 1-d int32 / int64 tensor, got {t.dtype} {tuple(t.shape)}")
    return t


def append_paged_kv_cache(append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices,
                          kv_indptr, kv_last_page_len, kv_layout="NHD"):
    """FlashInfer's ``append_paged_kv_cache``: entry i is written to page
    ``kv_indices[kv_indptr[batch_indices[i]] + positions[i] // page_size]`` at offset
    ``positions[i] % page_size`` (FlashInfer's AppendPagedKVCacheKernel; ``kv_last_page_len`` is not
    read by the write).

    append_key, append_value: bf16 or fp16 (the same) [nnz, num_kv_heads, head_dim] (head_dim a multiple of 8).
    paged_kv_cache: a (k_cache, v_cache) tuple of the inputs' dtype [max_num_pages, page_size, num_kv_heads, head_dim]
    ("NHD") or [max_num_pages, num_kv_heads, page_size, head_dim] ("HND"), or one
    [max_num_pages, 2, ...] tensor whose [:, 0] / [:, 1] are they. batch_indices, positions, kv_indices,
    kv_indptr: int32 / int64, read by the kernel itself (:class:`kvfuse.PagedAppend`: one launch, no index ops
    before it). The caller has reserved the pages (as FlashInfer requires).
    """
    for t, name in ((append_key, "append_key"), (append_value, "append_value")):
        _checks.activations(t, name, 3, _APPEND_DTYPES)
        _checks.head_size(t.shape[-1], name, 8)
    if append_value.dtype != append_key.dtype:
        raise TypeError(f"append_value: expected append_key's dtype {append_key.dtype}, got {append_value.dtype}")
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout: expected one of {KV_LAYOUTS}, got {kv_layout!r}")
    k_cache, v_cache = _paged_caches(paged_kv_cache, append_key.dtype)
    batch_indices, positions = _int_vector(batch_indices, "batch_indices"), _int_vector(positions, "positions")
    kv_indices, kv_indptr = _int_vector(kv_indices, "kv_indices"), _int_vector(kv_indptr, "kv_indptr")
    _checks.tensor(kv_last_page_len, "kv_last_page_len")
    no_q = append_key[:, :0]
    try:                  # q_out: the empty q itself (nothing to allocate)
        fused_qk_norm_rope_store_kv(no_q, append_key, append_value, k_cache, v_cache,
                                    PagedAppend(kv_indices, kv_indptr, batch_indices, positions), layout=kv_layout,
                                    q_out=no_q)
    except (TypeError, ValueError) as e:
        _checks.rename(e, _APPEND_NAMES)
        raise


def _rope_calls(positions, query, key, head_size, cos_sin_cache, is_neox, query_out, key_out):
    _checks.tensor(positions, "positions")
    _checks.bf16_input(query, "query", 2)
    _checks.bf16_input(key, "key", 2)
    _checks.tensor(cos_sin_cache, "cos_sin_cache")
    if cos_sin_cache.dtype != torch.float32:
        raise ValueError(f"cos_sin_cache should be float32, got {cos_sin_cache.dtype}")
    if cos_sin_cache.dim() != 2:
        raise ValueError(f"cos_sin_cache: expected [max_seq_len, rotary_dim], got shape {tuple(cos_sin_cache.shape)}")
    if isinstance(head_size, bool) or not isinstance(head_size, int) or head_size <= 0:
        raise ValueError(f"head_size: expected a positive int, got {head_size!r}")
    _checks.head_size(head_size, "head_size")
    for t, name in ((query, "query"), (key, "key")):
        if t.shape[1] % head_size:
            raise ValueError(f"{name}: expected [nnz, num_heads * {head_size}], got shape {tuple(t.shape)}")
    rotary_dim = cos_sin_cache.shape[1]
    if rotary_dim % 2 or not 0 < rotary_dim <= head_size:
        raise ValueError(f"cos_sin_cache: rotary_dim {rotary_dim} must be even and in (0, head_size={head_size}]")
    nnz = query.shape[0]
    if positions.shape != (nnz,) or key.shape[0] != nnz:
        raise ValueError(f"positions, key: expected {nnz} tokens like query, got positions {tuple(positions.shape)} "
                         f"and key {tuple(key.shape)}")
    rope = RopeArgs(positions, cos_sin_cache, rotary_dim, is_neox, offset=0)
    return [FusedCall(query.view(nnz, -1, head_size), rope_args=rope, out_args=query_out.view(nnz, -1, head_size)),
            FusedCall(key.view(nnz, -1, head_size), rope_args=rope, out_args=key_out.view(nnz, -1, head_size))]


def apply_rope_with_cos_sin_cache(positions, query, key, head_size, cos_sin_cache, is_neox=True):
    """FlashInfer's ``apply_rope_with_cos_sin_cache``: RoPE on the first ``rotary_dim =
    cos_sin_cache.shape[1]`` dims of every head of query [nnz, num_q_heads * head_size] and key
    [nnz, num_k_heads * head_size] (bf16), the rest copied; cos_sin_cache fp32 [max_seq_len, rotary_dim],
    cosines then sines; ``is_neox`` pairs (j, j + rotary_dim / 2), else (2j, 2j + 1). positions [nnz]
    int32 / int64; a position outside the table leaves its token unchanged (FlashInfer reads out of
    bounds). Returns new (query_out, key_out) shaped like query and key. One launch (:func:`kvfuse.fused_group`).
    """
    _checks.tensor(query, "query")
    _checks.tensor(key, "key")
    query_out, key_out = torch.empty_like(query), torch.empty_like(key)
    calls = _rope_calls(positions, query, key, head_size, cos_sin_cache, is_neox, query_out, key_out)
    with _checks.engine_names(_ROPE_NAMES):
        fused_group(calls)
    return query_out, key_out


def apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache, is_neox=True):
    """FlashInfer's ``apply_rope_with_cos_sin_cache_inplace``: as :func:`apply_rope_with_cos_sin_cache`,
    written back into query and key (they may be views of one packed projection). Returns None."""
    calls = _rope_calls(positions, query, key, head_size, cos_sin_cache, is_neox, query, key)
    with _checks.engine_names(_ROPE_NAMES):
        fused_group(calls)


# --------------------------------------------------------------------------- RoPE + fp8 quantize (+ append)
_QUANT_DTYPES = (torch.bfloat16, torch.float16)


def _quantize_dtype(quantize_dtype, outs):
    """FlashInfer's rule: the given dtype, else the first given output's, else e4m3 (e5m2: not yet)."""
    if quantize_dtype is None:
        quantize_dtype = next((o.dtype for o in outs if o is not None), torch.float8_e4m3fn)
    if quantize_dtype != torch.float8_e4m3fn:
        raise TypeError(f"quantize_dtype: {quantize_dtype} is not supported yet (kvfuse writes torch.float8_e4m3fn)")
    return quantize_dtype


def _scale(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__}")
    return float(value)


def _rope_parts(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, is_neox):
    """The checked inputs as kvfuse sees them: (q, k, rope_args, is_mla, no_rope_dim, q_nope, k_nope; the
    nope parts as given, or created with 0 columns for None); q and k a pair (rope, nope) where the nope
    part has columns, k with a head axis."""
    _checks.activations(q_rope, "q_rope", 3, _QUANT_DTYPES)
    _checks.tensor(k_rope, "k_rope")
    is_mla = k_rope.dim() == 2
    _checks.activations(k_rope, "k_rope", 2 if is_mla else 3, (q_rope.dtype,))
    nnz, hq, rope_dim = q_rope.shape
    _checks.head_size(rope_dim, "q_rope", 8)
    if k_rope.shape[-1] != rope_dim or k_rope.shape[0] != nnz:
        raise ValueError(f"k_rope: expected {nnz} tokens of rope_dim {rope_dim} (q_rope's), got shape "
                         f"{tuple(k_rope.shape)}")
    k3 = k_rope.unsqueeze(1) if is_mla else k_rope
    if q_nope is None:
        q_nope = q_rope.new_empty(nnz, hq, 0)
    if k_nope is None:
        k_nope = k_rope.new_empty((nnz, 0) if is_mla else (nnz, k_rope.shape[1], 0))
    _checks.activations(q_nope, "q_nope", 3, (q_rope.dtype,))
    _checks.activations(k_nope, "k_nope", k_rope.dim(), (q_rope.dtype,))
    kn3 = k_nope.unsqueeze(1) if is_mla else k_nope
    if q_nope.shape[0] != nnz or q_nope.shape[1] != hq or kn3.shape[0] != nnz or kn3.shape[1] != k3.shape[1]:
        raise ValueError(f"q_nope, k_nope: expected q_rope's / k_rope's tokens and heads, got shapes "
                         f"{tuple(q_nope.shape)} and {tuple(k_nope.shape)}")
    if q_nope.shape[-1] != kn3.shape[-1]:
        raise ValueError(f"k_nope: expected no_rope_dim {q_nope.shape[-1]} (q_nope's), got shape {tuple(k_nope.shape)}")
    nope = q_nope.shape[-1]
    if nope:
        _checks.head_size(nope, "q_nope", 8)
    _checks.tensor(cos_sin_cache, "cos_sin_cache")
    if cos_sin_cache.dtype != torch.float32:
        raise ValueError(f"cos_sin_cache should be float32, got {cos_sin_cache.dtype}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != rope_dim:
        raise ValueError(f"cos_sin_cache: expected [max_seq_len, {rope_dim}] (rope_dim), got shape "
                         f"{tuple(cos_sin_cache.shape)}")
    _checks.tensor(pos_ids, "pos_ids")
    rope = RopeArgs(pos_ids, cos_sin_cache, rope_dim, bool(is_neox), offset=0)
    q = (q_rope, q_nope) if nope else q_rope
    k = (k3, kn3) if nope else k3
    return q, k, rope, is_mla, nope, q_nope, k_nope


def _pair(first, tail, nope):
    return (first, tail) if nope else first


_RQ_NAMES = {"q[0]": "q_rope", "q[1]": "q_nope", "k[0]": "k_rope", "k[1]": "k_nope", "q": "q_rope", "k": "k_rope",
             "q_out[0]": "q_rope_out", "q_out[1]": "q_nope_out", "q_out": "q_rope_out", "k_out[0]": "k_rope_out",
             "k_out[1]": "k_nope_out", "k_out": "k_rope_out", "rope_args.positions": "pos_ids",
             "rope_args.cos_sin_cache": "cos_sin_cache", "q_scale": "quant_scale_q", "k_scale": "quant_scale_kv",
             "v_scale": "quant_scale_kv", "v": "v", "k_cache[0]": "paged_kv_cache", "k_cache[1]": "paged_kv_cache",
             "k_cache": "paged_kv_cache", "v_cache": "paged_kv_cache", "slot_mapping.batch_indices": "batch_indices",
             "slot_mapping.positions": "positions", "slot_mapping.kv_indptr": "kv_indptr",
             "slot_mapping.kv_indices": "kv_indices"}


def rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, is_neox=True, quantize_dtype=None,
                      quant_scale_q=1.0, quant_scale_kv=1.0, q_rope_out=None, k_rope_out=None, q_nope_out=None,
                      k_nope_out=None, enable_pdl=False):
    """FlashInfer's ``rope_quantize_fp8``: RoPE on q_rope / k_rope (all their rope_dim columns, angle from
    ``cos_sin_cache[pos_ids]``: cosines then sines, fp32), then every part quantized to e4m3 as
    ``e4m3(clamp(f32 * quant_scale, -448, 448))`` (the RoPE result in fp32, one product: FlashInfer
    multiplies by its scale; q by quant_scale_q, k by quant_scale_kv).

    q_rope [nnz, Hq, rope_dim], q_nope [nnz, Hq, no_rope_dim] (None: none), k_rope / k_nope [nnz, Hkv, dim]
    or, for MLA, [nnz, dim]; bf16 or fp16; rope_dim and no_rope_dim multiples of 8. Outputs allocated
    like the inputs in e4m3 when None. ``enable_pdl``: kvfuse decides programmatic dependent launch
    itself (the flag is accepted and not needed). Returns (q_rope_out, k_rope_out, q_nope_out, k_nope_out).
    One launch of :func:`kvfuse.fused_qk_norm_rope_store_kv` (no caches, k to k_out)."""
    q, k, rope, is_mla, nope, q_nope, k_nope = _rope_parts(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids,
                                                           is_neox)
    dt = _quantize_dtype(quantize_dtype, (q_rope_out, k_rope_out, q_nope_out, k_nope_out))
    outs = [o if o is not None else torch.empty(ref.shape, dtype=dt, device=ref.device)
            for o, ref in ((q_rope_out, q_rope), (k_rope_out, k_rope), (q_nope_out, q_nope), (k_nope_out, k_nope))]
    for o, name in zip(outs, ("q_rope_out", "k_rope_out", "q_nope_out", "k_nope_out")):
        _checks.tensor(o, name)
    k_outs = [o.unsqueeze(1) if is_mla else o for o in outs[1::2]]
    sq, skv = _scale(quant_scale_q, "quant_scale_q"), _scale(quant_scale_kv, "quant_scale_kv")
    with _checks.engine_names(_RQ_NAMES):
        fused_qk_norm_rope_store_kv(q, k, None, None, None, None, rope_args=rope, q_out=_pair(outs[0], outs[2], nope),
                                    k_out=_pair(k_outs[0], k_outs[1], nope), q_scale=sq, k_scale=skv,
                                    numerics="fused_fp32_cast", scale_convention="multiply")
    return tuple(outs)


def mla_rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, is_neox=True, quantize_dtype=None,
                          quant_scale_q=1.0, quant_scale_kv=1.0, q_rope_out=None, k_rope_out=None, q_nope_out=None,
                          k_nope_out=None, enable_pdl=False):
    """FlashInfer's ``mla_rope_quantize_fp8``: :func:`rope_quantize_fp8` with MLA's 2-d k_rope / k_nope."""
    return rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids, is_neox, quantize_dtype,
                             quant_scale_q, quant_scale_kv, q_rope_out, k_rope_out, q_nope_out, k_nope_out, enable_pdl)


def rope_quantize_fp8_append_paged_kv_cache(q_rope, k_rope, q_nope, k_nope, v, cos_sin_cache, pos_ids, paged_kv_cache,
                                            kv_indices, kv_indptr, batch_indices, positions, is_neox=True,
                                            quantize_dtype=None, quant_scale_q=1.0, quant_scale_kv=1.0, page_size=16,
                                            kv_layout="NHD", q_rope_out=None, q_nope_out=None, enable_pdl=False):
    """FlashInfer's ``rope_quantize_fp8_append_paged_kv_cache``: :func:`rope_quantize_fp8`'s q outputs, and
    K (and V) quantized into the paged caches instead of returned.

    GQA / MHA (3-d k_rope): ``paged_kv_cache`` = (k_cache, v_cache), e4m3 [max_pages, page_size, Hkv,
    rope_dim + no_rope_dim] ("NHD") or [max_pages, Hkv, page_size, ...] ("HND"); a K record holds the
    rope columns, then the nope ones; v [nnz, Hkv, rope_dim + no_rope_dim] quantized by quant_scale_kv.
    MLA (2-d k_rope, v None): ``paged_kv_cache`` = (ckv_cache [max_pages, page_size, no_rope_dim],
    kpe_cache [max_pages, page_size, rope_dim]), e4m3 (kv_layout not read). Token i goes to page
    kv_indices[kv_indptr[batch_indices[i]] + positions[i] // page_size], offset positions[i] % page_size
    (int32 or int64 metadata); a token with batch_indices[i] < 0 writes no cache entry (FlashInfer
    also leaves its q outputs unwritten; kvfuse writes them). Returns (q_rope_out, q_nope_out). One
    launch of :func:`kvfuse.fused_qk_norm_rope_store_kv`, which reads the addressing itself
    (:class:`kvfuse.PagedAppend`)."""
    q, k, rope, is_mla, nope, q_nope, _ = _rope_parts(q_rope, k_rope, q_nope, k_nope, cos_sin_cache, pos_ids,
                                                      is_neox)
    dt = _quantize_dtype(quantize_dtype, (q_rope_out, q_nope_out))
    if not isinstance(paged_kv_cache, (tuple, list)) or len(paged_kv_cache) != 2:
        raise ValueError("paged_kv_cache must be a tuple of 2 tensors")
    c0, c1 = _checks.tensor(paged_kv_cache[0], "paged_kv_cache"), _checks.tensor(paged_kv_cache[1], "paged_kv_cache")
    for c in (c0, c1):
        if c.dtype != dt:
            raise ValueError(f"paged_kv_cache: cache dtype mismatch: expected {dt}, got {c.dtype}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size: expected a positive int, got {page_size!r}")
    if is_mla:
        if v is not None:
            raise ValueError("v: MLA should not have V input (pass None)")
        if c0.dim() != 3 or c1.dim() != 3:
            raise ValueError(f"paged_kv_cache: MLA caches must be 3-d (max_pages, page_size, dim), got "
                             f"{tuple(c0.shape)} and {tuple(c1.shape)}")
        k_cache, v_cache, layout = (c1.unsqueeze(2), c0.unsqueeze(2)) if nope else c1.unsqueeze(2), None, "NHD"
        cache_page = c0.shape[1]
    else:
        if v is None:
            raise ValueError("v: GQA/MHA expects a V tensor, got None")
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout: expected one of {KV_LAYOUTS}, got {kv_layout!r}")
        if c0.dim() != 4 or c1.dim() != 4:
            raise ValueError(f"paged_kv_cache: GQA/MHA caches must be 4-d, got {tuple(c0.shape)} and {tuple(c1.shape)}")
        k_cache, v_cache, layout = c0, c1, kv_layout
        cache_page = c0.shape[1] if kv_layout == "NHD" else c0.shape[2]
    if cache_page != page_size:
        raise ValueError(f"page_size: {page_size} differs from the caches' page size {cache_page}")
    q_rope_out = _fp8_output(q_rope_out, q_rope, dt)
    q_nope_out = _fp8_output(q_nope_out, q_nope, dt)
    slots = _paged_append(kv_indices, kv_indptr, batch_indices, positions)
    sq, skv = _scale(quant_scale_q, "quant_scale_q"), _scale(quant_scale_kv, "quant_scale_kv")
    try:
        fused_qk_norm_rope_store_kv(q, k, v, k_cache, v_cache, slots, rope_args=rope, layout=layout,
                                    q_out=_pair(q_rope_out, q_nope_out, nope), q_scale=sq, k_scale=skv,
                                    v_scale=None if v is None else skv, numerics="fused_fp32_cast",
                                    scale_convention="multiply")
    except (TypeError, ValueError) as e:
        _checks.rename(e, _RQ_NAMES)
        raise
    return q_rope_out, q_nope_out


def _fp8_output(out, like, dtype):
    """An output given, or a new one of ``like``'s shape in ``dtype``."""
    return out if out is not None else torch.empty(like.shape, dtype=dtype, device=like.device)


def _paged_append(kv_indices, kv_indptr, batch_indices, positions) -> PagedAppend:
    """FlashInfer's page addressing as the kernel reads it, each vector checked (_int_vector)."""
    return PagedAppend(_int_vector(kv_indices, "kv_indices"), _int_vector(kv_indptr, "kv_indptr"),
                       _int_vector(batch_indices, "batch_indices"), _int_vector(positions, "positions"))


# --------------------------------------------------------------------------- NVFP4 append (codes + e4m3 block scales)
_NVFP4_NAMES = {"k": "append_key", "v": "append_value", "k_cache": "paged_kv_cache", "v_cache": "paged_kv_cache",
                "k_scale_cache": "kv_cache_sf", "v_scale_cache": "kv_cache_sf", "slot_mapping": "slot_mapping",
                "slot_mapping.batch_indices": "batch_indices", "slot_mapping.positions": "positions",
                "slot_mapping.kv_indptr": "kv_indptr", "slot_mapping.kv_indices": "kv_indices"}


def _nvfp4_inputs(append_key, append_value, kv_layout, paged_kv_cache, kv_cache_sf):
    """FlashInfer's checks of the NVFP4 appends (ValueError as FlashInfer's): -> (k_cache, v_cache, k_sf, v_sf)."""
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout: expected one of {KV_LAYOUTS}, got {kv_layout!r}")
    _checks.tensor(append_key, "append_key")
    _checks.tensor(append_value, "append_value")
    if append_key.dtype not in _APPEND_DTYPES:
        raise ValueError(f"append_key must be float16 or bfloat16, got {append_key.dtype}")
    if append_value.dtype != append_key.dtype:
        raise ValueError(f"append_key and append_value must have the same dtype, got {append_key.dtype} and "
                         f"{append_value.dtype}")
    for t, name in ((append_key, "append_key"), (append_value, "append_value")):
        if t.dim() != 3:
            raise ValueError(f"{name}: expected [nnz, num_kv_heads, head_dim], got shape {tuple(t.shape)}")
        _checks.head_size(t.shape[-1], name, 16)
    k_cache, v_cache = _cache_pair(paged_kv_cache, "paged_kv_cache")
    k_sf, v_sf = _cache_pair(kv_cache_sf, "kv_cache_sf")
    if k_cache.dtype != torch.uint8 or v_cache.dtype != torch.uint8:
        raise ValueError("paged_kv_cache: NVFP4 paged K/V cache tensors must have dtype torch.uint8")
    if k_sf.dtype != torch.float8_e4m3fn or v_sf.dtype != torch.float8_e4m3fn:
        raise ValueError("kv_cache_sf: NVFP4 scale cache tensors must have dtype torch.float8_e4m3fn")
    return k_cache, v_cache, k_sf, v_sf


def _global_scale(value, name: str) -> float:
    """A global decode scale as a positive finite number (FlashInfer's float(...) and its check)."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected a float, got bool")
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must have exactly one element, got {value.numel()}")
        if value.dtype != torch.float32:
            raise ValueError(f"{name} must be torch.float32, got {value.dtype}")
    try:
        scale = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a float, got {type(value).__name__}") from None
    if not math.isfinite(scale) or scale <= 0.0:
        raise ValueError(f"{name} must be a positive finite global decode scale, got {scale}")
    return scale


def _global_scales(k_scale, v_scale, device):
    """The slot-mapping variant's k_scale / v_scale: fp32 one-element tensors on the caches' device are
    passed on as they are (read by the kernel, no host synchronization; their values are checked with
    kvfuse's data checks, KVFUSE_CHECKS); otherwise both as numbers, each checked here."""
    if all(isinstance(s, torch.Tensor) and s.device == device for s in (k_scale, v_scale)):
        for s, name in ((k_scale, "k_scale"), (v_scale, "v_scale")):
            if s.numel() != 1:
                raise ValueError(f"{name} must have exactly one element, got {s.numel()}")
            if s.dtype != torch.float32:
                raise ValueError(f"{name} must be torch.float32, got {s.dtype}")
        return k_scale.reshape(1), v_scale.reshape(1)
    return _global_scale(k_scale, "k_scale"), _global_scale(v_scale, "v_scale")


def nvfp4_quantize_append_paged_kv_cache(append_key, append_value, batch_indices, positions, paged_kv_cache,
                                         kv_cache_sf, kv_indices, kv_indptr, kv_last_page_len, k_scale, v_scale,
                                         kv_layout="NHD"):
    """FlashInfer's ``nvfp4_quantize_append_paged_kv_cache``: K and V rows quantized to NVFP4 (e2m1 codes,
    two a byte, the even element in the low nibble; one e4m3 scale per 16 values; ``k_scale`` / ``v_scale``
    the global decode scales: value = e2m1 * scale * global scale) and appended at FlashInfer's page
    addressing (entry i to page ``kv_indices[kv_indptr[batch_indices[i]] + positions[i] // page_size]``,
    offset ``positions[i] % page_size``; ``kv_last_page_len`` is not read by the write).

    append_key, append_value: bf16 or fp16 (the same) [nnz, num_kv_heads, head_dim], head_dim a multiple
    of 16. paged_kv_cache: uint8 (k_cache, v_cache) [max_num_pages, page_size, num_kv_heads, head_dim // 2]
    ("NHD") or [max_num_pages, num_kv_heads, page_size, head_dim // 2] ("HND"), or one 5-d tensor whose
    [:, 0] / [:, 1] are they; kv_cache_sf: float8_e4m3fn the same with last dim head_dim // 16. k_scale,
    v_scale: positive finite numbers. The numerics are FlashInfer's rule with IEEE operations (SPEC §3,
    the "nvfp4" format). One launch of :func:`kvfuse.fused_qk_norm_rope_store_kv` (no q heads)."""
    k_cache, v_cache, k_sf, v_sf = _nvfp4_inputs(append_key, append_value, kv_layout, paged_kv_cache, kv_cache_sf)
    ks, vs = _global_scale(k_scale, "k_scale"), _global_scale(v_scale, "v_scale")
    slots = _paged_append(kv_indices, kv_indptr, batch_indices, positions)
    _checks.tensor(kv_last_page_len, "kv_last_page_len")
    with _checks.engine_names(_NVFP4_NAMES):
        fused_qk_norm_rope_store_kv(append_key[:, :0], append_key, append_value, k_cache, v_cache, slots,
                                    k_scale=ks, v_scale=vs, layout=kv_layout, k_format="nvfp4", v_format="nvfp4",
                                    k_scale_cache=k_sf, v_scale_cache=v_sf)


def nvfp4_quantize_append_paged_kv_cache_with_slot_mapping(append_key, append_value, slot_mapping, paged_kv_cache,
                                                           kv_cache_sf, k_scale, v_scale, kv_layout="NHD"):
    """FlashInfer's ``nvfp4_quantize_append_paged_kv_cache_with_slot_mapping``: as
    :func:`nvfp4_quantize_append_paged_kv_cache`, row i written to slot ``slot_mapping[i]`` (page
    ``slot // page_size``, entry ``slot % page_size``); a negative slot is padding and writes nothing, as
    does one past the cache. Only the first ``slot_mapping.shape[0]`` rows of append_key / append_value
    are read (they may hold more). k_scale, v_scale: positive finite numbers, or fp32 one-element tensors
    (on the caches' device they are read by the kernel: CUDA-graph safe). This is vLLM 0.33.0's NVFP4 cache
    write on SM80 / SM90 / SM120 (vllm/v1/attention/backends/flashinfer.py ``do_kv_cache_update``, its
    pages split by ``_nvfp4_kv_views``). One launch of :func:`kvfuse.fused_qk_norm_rope_store_kv`."""
    k_cache, v_cache, k_sf, v_sf = _nvfp4_inputs(append_key, append_value, kv_layout, paged_kv_cache, kv_cache_sf)
    _checks.slots(slot_mapping)
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    n = slot_mapping.shape[0]
    if append_key.shape[0] < n or append_value.shape[0] < n:
        raise ValueError("append_key and append_value must have at least slot_mapping.shape[0] rows")
    ks, vs = _global_scales(k_scale, v_scale, k_cache.device)
    key, value = append_key[:n], append_value[:n]
    with _checks.engine_names(_NVFP4_NAMES):
        fused_qk_norm_rope_store_kv(key[:, :0], key, value, k_cache, v_cache, slot_mapping, k_scale=ks, v_scale=vs,
                                    layout=kv_layout, k_format="nvfp4", v_format="nvfp4", k_scale_cache=k_sf,
                                    v_scale_cache=v_sf)
