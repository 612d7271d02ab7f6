"""FlashInfer 0.7.2's paged-KV append and cos/sin-cache RoPE with FlashInfer's signatures and
semantics, each one call of a kvfuse entry point: ``import flashinfer`` call sites of these functions
swap to ``from kvfuse.engines import flashinfer``.

- :func:`append_paged_kv_cache` (``flashinfer.page``) -> :func:`kvfuse.fused_qk_norm_rope_store_kv` with
  zero q heads; FlashInfer's page addressing becomes a slot mapping (a few small torch index ops).
- :func:`apply_rope_with_cos_sin_cache` and :func:`apply_rope_with_cos_sin_cache_inplace`
  (``flashinfer.rope``) -> :func:`kvfuse.fused_group`: query and key, one launch.

Numerics: FlashInfer's CUDA RoPE is compiled with FMA contraction (``a * cos + b * sin`` in one rounding
or two, as the compiler chose), so its bytes cannot be reproduced by an exact chain. kvfuse's RoPE rounds
each product and the sum on its own (SPEC §2): its bytes equal :func:`kvfuse.reference.rope`, and it
agrees with an fp64 RoPE within FlashInfer's own test tolerance. The append takes bf16 or fp16 inputs
(caches of their dtype), the RoPE bf16; what FlashInfer accepts beyond kvfuse's domain (fp16 RoPE
inputs, fp8 caches, head sizes not a multiple of 8 in the append, of 16 in the RoPE) raises TypeError /
ValueError saying "not supported yet". docs/engines.md lists the differences.
"""
from __future__ import annotations

import torch

from ..args import FusedCall, RopeArgs
from ..gqa import fused_qk_norm_rope_store_kv
from ..group import fused_group
from . import _checks

__all__ = ["append_paged_kv_cache", "apply_rope_with_cos_sin_cache", "apply_rope_with_cos_sin_cache_inplace",
           "KV_LAYOUTS"]

KV_LAYOUTS = ("NHD", "HND")
_APPEND_DTYPES = (torch.bfloat16, torch.float16)
_APPEND_NAMES = {"k": "append_key", "v": "append_value", "k_cache": "paged_kv_cache", "v_cache": "paged_kv_cache"}
_ROPE_NAMES = {"calls[0]": "query", "calls[1]": "key"}


def _paged_caches(paged_kv_cache, kv_layout, dtype):
    """(k_cache, v_cache) from FlashInfer's tuple or its single [num_pages, 2, ...] tensor, of the inputs' dtype."""
    if isinstance(paged_kv_cache, torch.Tensor):
        if paged_kv_cache.dim() != 5 or paged_kv_cache.shape[1] != 2:
            raise ValueError(f"paged_kv_cache: a single tensor must be [max_num_pages, 2, ...] ({kv_layout}), "
                             f"got shape {tuple(paged_kv_cache.shape)}")
        k_cache, v_cache = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    elif isinstance(paged_kv_cache, (tuple, list)) and len(paged_kv_cache) == 2:
        k_cache, v_cache = (_checks.tensor(c, "paged_kv_cache") for c in paged_kv_cache)
    else:
        raise TypeError("paged_kv_cache must be a (k_cache, v_cache) tuple or one 5-d tensor, got "
                        f"{type(paged_kv_cache).__name__}")
    for c in (k_cache, v_cache):
        if c.dtype != dtype:
            raise TypeError(f"paged_kv_cache: dtype {c.dtype} is not supported yet (kvfuse appends {dtype} "
                            f"inputs into {dtype} caches)")
        if c.dim() != 4:
            raise ValueError(f"paged_kv_cache: expected 4-d k/v caches, got shape {tuple(c.shape)}")
    return k_cache, v_cache


def _int_vector(t, name: str) -> torch.Tensor:
    _checks.tensor(t, name)
    if t.dtype not in (torch.int32, torch.int64) or t.dim() != 1:
        raise ValueError(f"{name}: expected a 1-d int32 / int64 tensor, got {t.dtype} {tuple(t.shape)}")
    return t.long()


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
    kv_indptr: int32 / int64. The caller has reserved the pages (as FlashInfer requires).
    """
    for t, name in ((append_key, "append_key"), (append_value, "append_value")):
        _checks.activations(t, name, 3, _APPEND_DTYPES)
        _checks.head_size(t.shape[-1], name, 8)
    if append_value.dtype != append_key.dtype:
        raise TypeError(f"append_value: expected append_key's dtype {append_key.dtype}, got {append_value.dtype}")
    if kv_layout not in KV_LAYOUTS:
        raise ValueError(f"kv_layout: expected one of {KV_LAYOUTS}, got {kv_layout!r}")
    k_cache, v_cache = _paged_caches(paged_kv_cache, kv_layout, append_key.dtype)
    batch_indices, positions = _int_vector(batch_indices, "batch_indices"), _int_vector(positions, "positions")
    kv_indices, kv_indptr = _int_vector(kv_indices, "kv_indices"), _int_vector(kv_indptr, "kv_indptr")
    _checks.tensor(kv_last_page_len, "kv_last_page_len")
    nnz = append_key.shape[0]
    for t, name in ((batch_indices, "batch_indices"), (positions, "positions")):
        if t.shape[0] != nnz:
            raise ValueError(f"{name}: expected {nnz} entries like append_key, got {t.shape[0]}")
    page_size = k_cache.shape[1] if kv_layout == "NHD" else k_cache.shape[2]
    page = kv_indices[kv_indptr[batch_indices] + torch.div(positions, page_size, rounding_mode="floor")]
    slot_mapping = page * page_size + torch.remainder(positions, page_size)
    with _checks.engine_names(_APPEND_NAMES):
        fused_qk_norm_rope_store_kv(append_key[:, :0], append_key, append_value, k_cache, v_cache, slot_mapping,
                                    layout=kv_layout)


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
