"""The plan cache: validated call signatures kept with what validation produced, so that a repeated
call skips validation and, on the Triton backend, reuses its launch parameters; the keys' building
blocks; the switch (``KVFUSE_PLAN_CACHE``, :func:`set_plan_cache`). The fused operator, the store /
load entry points and the GQA entry (kvfuse.plans.gqa: its own key and template, built from these)
share it."""
from __future__ import annotations

import math
import threading
from typing import NamedTuple, Optional

import torch

from ..args import NormArgs, RopeArgs
from ..backend import env_flag
from .types import CacheEntry

# Validated signatures of the fused operator, store_kv_cache and load_paged_kv_cache (and of
# fused_qk_norm_rope_store_kv: kvfuse.plans.gqa says what its key holds) are kept with
# what validation produced. A key holds every value that validation (kvfuse.plans.fused and
# .cache_io, formats.check_cache, formats.addressing_for, check_cast_combination, infer_layout) and
# the launch parameters (the kernels' router) read, and no tensor:
# - per tensor: its type, dtype, shape, strides and device, where a leading dim equal to the call's
#   n (x's leading dim) is written ROWS, so the key holds for every batch size: the rules that read
#   n compare those dims with it, and a dim that differs from n keys its value (a miss, then the
#   error); new outputs get the call's n; the Triton launch is kept per n with the template.
#   check_tensor, check_index_vector,
#   check_cache, addressing_for and the launches read nothing else of a tensor, with one
#   exception: the fused kernel's record alignments (the kernels router's record_alignments) read
#   the cache's data_ptr() % 16, which joins the key. Otherwise a data pointer
#   (storage offset included) is taken from the call's own tensor at every launch;
# - per argument object: its exact class (a subclass is validated on every call) and every field
#   that is not a tensor, each as (type, value): True, 1 and 1.0 compare equal but validate
#   differently, and floats also by sign (-0.0 == 0.0, but scales by them differ), except a number that
#   validation accepts only when > 0 (a norm's eps);
# - the layout by identity (a KVCacheFormat is frozen), or with layout=None the identities of the
#   formats.PRESETS values that infer_layout chooses from (monkeypatching a preset is a miss); the
#   entry pins these objects, so no other object can take their ids while it exists.
# Read on every call instead: the backend, KVFUSE_CHECKS (the data checks), force_config and
# fast_paths (the kernels' router) (the launch parameters are recomputed while one is active) and the tensors' data
# pointers (the entry's
# OverlapCheck compares them on every call: whether outputs overlap inputs or each other depends
# on addresses, which the key does not hold); the cache is bypassed while
# torch.compiler.is_compiling(). The environment that the kernels read at import
# (TRITON_INTERPRET, KVFUSE_NATIVE_CASTS) is constant. Only validated calls are stored: a
# rejected call is validated, and raises, every time.
PLAN_CACHE_SIZE = 512
ROWS = "n"  # in a key: this dim equals the call's n (x's leading dim)


class PlanCacheInfo(NamedTuple):
    hits: int          # keyed calls that skipped validation
    misses: int        # keyed calls that were validated (and stored when valid)
    size: int
    maxsize: int
    enabled: bool


class PlanCache:
    """Key -> CacheEntry, at most ``maxsize`` entries. A lookup is one dict read (atomic: no lock);
    stores and evictions take the lock (the hit/miss counts may miss an increment under
    concurrent calls). Eviction is second-chance (CLOCK): the oldest entry goes unless it was hit
    since it was stored or last spared, an LRU approximation that costs a hit one flag write."""

    def __init__(self, maxsize: int = PLAN_CACHE_SIZE, enabled: bool = True):
        self.maxsize = maxsize
        self.enabled = enabled
        self.hits = self.misses = 0
        self._entries = {}  # insertion-ordered: the oldest first
        self._lock = threading.Lock()

    def lookup(self, key) -> Optional[CacheEntry]:
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
        else:
            entry.recently_used = True
            self.hits += 1
        return entry

    def store(self, key, entry: CacheEntry, pinned: tuple) -> None:
        entry.pinned = pinned
        with self._lock:
            entries = self._entries
            entries[key] = entry
            while len(entries) > self.maxsize:
                oldest = next(iter(entries))
                spared = entries.pop(oldest)
                if spared.recently_used:  # hit since stored or last spared: back to the end of the line
                    spared.recently_used = False
                    entries[oldest] = spared

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0

    def info(self) -> PlanCacheInfo:
        return PlanCacheInfo(self.hits, self.misses, len(self._entries), self.maxsize, self.enabled)


PLAN_CACHE = PlanCache(enabled=env_flag("KVFUSE_PLAN_CACHE", True))


def validated(signature, validate_call, *args) -> CacheEntry:
    """The entry of a call: found by ``signature(*args)`` -> (key, pinned) in the plan cache, or
    ``validate_call(*args)`` (which raises for a bad call) and stored. ``signature`` may raise or
    return key None for arguments it does not key: those calls are validated every time."""
    if not PLAN_CACHE.enabled or torch.compiler.is_compiling():
        return validate_call(*args)
    try:
        key, pinned = signature(*args)
        entry = None if key is None else PLAN_CACHE.lookup(key)
    except Exception:  # an argument that cannot be keyed (a wrong type, unhashable): validation says why
        key = entry = None
    if entry is None:
        entry = validate_call(*args)
        if key is not None:
            PLAN_CACHE.store(key, entry, pinned)
    return entry


def set_plan_cache(enabled: bool) -> None:
    """Turn the plan cache on or off (KVFUSE_PLAN_CACHE=0 at import starts with it off); while off,
    every call is validated and nothing is looked up or stored."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    PLAN_CACHE.enabled = enabled


def plan_cache_enabled() -> bool:
    return PLAN_CACHE.enabled


def clear_plan_cache() -> None:
    """Forget every entry and zero the hit/miss counts."""
    PLAN_CACHE.clear()


def plan_cache_info() -> PlanCacheInfo:
    return PLAN_CACHE.info()


# ---- keys
def tensor_key(t):
    return (type(t), t.dtype, t.shape, t.stride(), t.device)


def rows_key(t, n):
    """tensor_key's values with a leading dim equal to the call's n written as ROWS, the other dims as
    shape[1:]: the key of a call does not depend on its batch size. A tensor whose leading dim is not n
    keys that dim's value (a wrong length is a miss, then validation says why)."""
    shape = t.shape
    return type(t), t.dtype, ROWS if shape[0] == n else shape[0], shape[1:], t.stride(), t.device


def optional_tensor_key(t):
    return None if t is None else tensor_key(t)


def rope_args_key(r, n):
    """Key of a RopeArgs, or None for None: positions as rows, the table, each scalar field with its
    type. Raises TypeError for any other object (a subclass too): its call is validated every time."""
    if r is None:
        return None
    if type(r) is not RopeArgs:
        raise TypeError(f"rope_args of class {type(r).__name__} is not keyed")
    pos = r.positions
    if r.mrope_section is None:
        pos_key, section_key = rows_key(pos, n), None
    else:   # mRoPE: positions [3, n], rows along dim 1 (a row stride of n, a contiguous [3, n], written as
        # ROWS too); the section's values with their types
        rows = pos.dim() == 2 and pos.shape[1] == n
        strides = pos.stride()
        if rows and strides[0] == n:
            strides = (ROWS,) + strides[1:]
        pos_key = (type(pos), pos.dtype, (pos.shape[0], ROWS if rows else tuple(pos.shape[1:])), pos.dim(), strides,
                   pos.device)
        section_key = (type(r.mrope_section),) + tuple((type(v), v) for v in r.mrope_section)
    return (pos_key, tensor_key(r.cos_sin_cache), type(r.rotary_dim), r.rotary_dim,
            type(r.offset), r.offset, type(r.is_neox), r.is_neox, type(r.conjugate), r.conjugate, section_key,
            type(r.mrope_interleaved), r.mrope_interleaved)


def norm_args_key(a):
    """(key, weight) of a NormArgs by field, (None, None) for None: the weight and the bias as tensor keys,
    eps with its type (validation takes eps > 0 only, so its sign needs no key), kind with its type. Raises
    TypeError for any other object (a subclass too), as rope_args_key."""
    if a is None:
        return None, None
    if type(a) is not NormArgs:
        raise TypeError(f"norm args of class {type(a).__name__} are not keyed")
    w, bias, eps = a.weight, a.bias, a.eps
    return (optional_tensor_key(w), type(eps), eps, optional_tensor_key(bias), type(a.kind), a.kind), w


def number_key(v):
    return (type(v), v, math.copysign(1.0, v)) if isinstance(v, float) else (type(v), v)
