"""Validation of :func:`kvfuse.store_kv_cache` and :func:`kvfuse.load_paged_kv_cache` into a
:class:`~.types.StorePlan` / :class:`~.types.LoadPlan` (plan-cached per signature), with the store's
aliasing check (the cache must not overlap data, sf, tail or slot_mapping)."""
from __future__ import annotations

import torch

from ..formats import KVCacheFormat, q_dtype, sf_dtype
from ..overlap import OverlapCheck, addresses_known, span_terms
from .cache import optional_tensor_key, tensor_key, validated
from .rules import check_tensor
from .types import INDEX_DTYPES, CacheEntry, LoadPlan, StorePlan

STORE_TENSOR_NAMES = ("data", "sf", "tail", "slot_mapping", "kv_cache")   # the order of store_kv_cache's check


def _check_cache_args(kv_cache, slot_mapping, layout, what):
    if not isinstance(layout, KVCacheFormat):
        raise TypeError(f"{what}: layout must be a KVCacheFormat, got {type(layout).__name__}")
    layout.check_cache(kv_cache, f"{what}: kv_cache")
    check_tensor(slot_mapping, f"{what}: slot_mapping", INDEX_DTYPES, kv_cache.device, last_contiguous=False)
    if slot_mapping.dim() != 1:
        raise ValueError(f"{what}: slot_mapping: expected shape (n,), got {tuple(slot_mapping.shape)}")


# --------------------------------------------------------------------------- store_kv_cache
def _validate_store_entry(data, sf, kv_cache, slot_mapping, layout, tail) -> CacheEntry:
    _check_cache_args(kv_cache, slot_mapping, layout, "store_kv_cache")
    n = slot_mapping.shape[0]
    nh = kv_cache.shape[2]
    dev = kv_cache.device
    lead = (n,) if nh == 1 and isinstance(data, torch.Tensor) and data.dim() == 2 else (n, nh)
    if layout.quantized:
        check_tensor(data, "data", (q_dtype(layout.cast_fmt),), dev, shape=lead + (layout.quant_bytes,))
        check_tensor(sf, "sf", (sf_dtype(layout.sf_format),), dev, shape=lead + (layout.num_scales,))
    else:
        check_tensor(data, "data", (torch.bfloat16,), dev, shape=lead + (layout.head_dim,))
        if sf is not None:
            raise ValueError(f"sf must be None for the bf16 cache {layout.name}")
    if layout.bf16_tail:
        check_tensor(tail, "tail", (torch.bfloat16,), dev, shape=lead + (layout.bf16_tail,))
    elif tail is not None:
        raise ValueError(f"tail must be None for {layout.name} (no bf16 tail)")
    entry = CacheEntry()
    if addresses_known(dev):
        entry.overlap = _store_overlap_check(data, sf, kv_cache, slot_mapping, tail)
    return entry


def _store_overlap_check(data, sf, kv_cache, slot_mapping, tail) -> OverlapCheck:
    """store_kv_cache's per-call aliasing check: the cache must not overlap data, sf, tail or slot_mapping."""
    items, names = [], []
    for i, (name, t) in enumerate(zip(STORE_TENSOR_NAMES, (data, sf, tail, slot_mapping, kv_cache))):
        terms = None if t is None else span_terms(t, rows=name != "kv_cache")
        if terms is not None:
            items.append((i,) + terms)
            names.append(name)
    return OverlapCheck(items, (len(items) - 1,), tuple(names))  # the cache comes last and always holds bytes


def _store_signature(data, sf, kv_cache, slot_mapping, layout, tail):
    """Plan-cache key of a store_kv_cache call (what the store's validation and launch read)."""
    return (("store", tensor_key(data), optional_tensor_key(sf), tensor_key(kv_cache), tensor_key(slot_mapping),
             optional_tensor_key(tail), id(layout)), (layout,))


def validate_store(data, sf, kv_cache, slot_mapping, layout, tail=None) -> StorePlan:
    """store_kv_cache's plan (validation plan-cached per signature; the per-call aliasing check run),
    or TypeError / ValueError naming the argument."""
    entry = validated(_store_signature, _validate_store_entry, data, sf, kv_cache, slot_mapping, layout, tail)
    if entry.overlap is not None:
        entry.overlap((data, sf, tail, slot_mapping, kv_cache), slot_mapping.shape[0])
    return StorePlan(data, sf, kv_cache, slot_mapping, tail, layout, entry)


# --------------------------------------------------------------------------- load_paged_kv_cache
def _validate_load_entry(kv_cache, slot_mapping, layout, dequantize) -> CacheEntry:
    _check_cache_args(kv_cache, slot_mapping, layout, "load_paged_kv_cache")
    if not isinstance(dequantize, bool):
        raise TypeError(f"dequantize must be a bool, got {type(dequantize).__name__}")
    return CacheEntry()


def _load_signature(kv_cache, slot_mapping, layout, dequantize):
    """Plan-cache key of a load_paged_kv_cache call (what the load's validation and launch read)."""
    return ("load", tensor_key(kv_cache), tensor_key(slot_mapping), id(layout), type(dequantize), dequantize), (layout,)


def validate_load(kv_cache, slot_mapping, layout, dequantize=True) -> LoadPlan:
    """load_paged_kv_cache's plan (validation plan-cached per signature)."""
    entry = validated(_load_signature, _validate_load_entry, kv_cache, slot_mapping, layout, dequantize)
    return LoadPlan(kv_cache, slot_mapping, layout, dequantize, entry=entry)
