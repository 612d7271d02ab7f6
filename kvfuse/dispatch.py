"""The one backend choice of kvfuse's entry points, and what runs after validation.

:mod:`kvfuse.api` (the public functions) and :mod:`kvfuse.ops` (the custom ops' implementations)
both end here; neither calls the other's way back. ``run(plan)`` runs a validated
:class:`kvfuse.plan.Plan` on the backend chosen for its device (the Triton kernels or the reference
chain), after the ``KVFUSE_CHECKS`` data checks; ``validate_store`` / ``store`` and ``validate_load`` /
``load`` do the same for store_kv_cache and load_paged_kv_cache. ``kernels()`` is
:mod:`kvfuse.kernels.router`, behind a process-wide lock when Triton's interpreter runs it.
"""
from __future__ import annotations

import threading

import torch

from . import backend as _backend
from . import reference
from .formats import KVCacheFormat
from .overlap import OverlapCheck, span_terms
from .plan import (INDEX_DTYPES, CacheEntry, Plan, check_tensor, optional_tensor_key, q_dtype, sf_dtype, tensor_key,
                   validated)

__all__ = ["run", "run_group", "kernels", "run_data_checks", "validate_store", "store", "validate_load", "load"]

_fused_module = None


class _InterpreterLaunches:
    """kvfuse.kernels.router with every launch taken under one process-wide lock: Triton's interpreter
    is not thread-safe (it patches triton.language globally and keeps the grid position in a global
    builder while a launch runs), so concurrent calls raised InterpreterError and left partial writes.
    Used only when the kernels run in the interpreter; compiled kernels get the module itself (no lock)."""

    _lock = threading.Lock()  # one for the process (two threads that import the kernels at once build two wrappers)

    def __init__(self, module):
        self._module = module

    def run_template(self, template, tensors):
        with self._lock:
            return self._module.run_template(template, tensors)

    def run_plan(self, plan):
        with self._lock:
            return self._module.run_plan(plan)

    def run_group(self, plans):
        from .kernels import grouped
        with self._lock:
            return grouped.run_group(plans)

    def store(self, *args):
        with self._lock:
            return self._module.store(*args)

    def load(self, *args):
        with self._lock:
            return self._module.load(*args)


def kernels():
    global _fused_module
    if _fused_module is None:
        from .kernels import router  # imported lazily: triton is only needed by the triton backend
        _fused_module = _InterpreterLaunches(router) if router.INTERPRET else router
    return _fused_module


def _run_group_kernel(plans) -> None:
    k = kernels()
    if isinstance(k, _InterpreterLaunches):
        k.run_group(plans)
    else:
        from .kernels import grouped
        grouped.run_group(plans)


def run_data_checks(positions=None, max_position=None, slot_mapping=None, capacity=None) -> None:
    """KVFUSE_CHECKS: positions in [0, max_position) and no duplicate valid slots (synchronizes).
    Skipped for meta tensors (no data to read; validation already checked their shapes)."""
    if positions is not None and positions.device.type == "meta" or (
            slot_mapping is not None and slot_mapping.device.type == "meta"):
        return
    if positions is not None and positions.numel():
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= max_position:
            raise ValueError(f"rope_args.positions must lie in [0, {max_position}), got values in [{lo}, {hi}]")
    if slot_mapping is not None and slot_mapping.numel():
        s = slot_mapping.long()
        valid = s[(s >= 0) & (s < capacity)]
        if valid.numel() != torch.unique(valid).numel():
            raise ValueError("slot_mapping holds duplicate valid slots")


def run(plan: Plan) -> None:
    """Run a validated plan on the backend chosen for its device (never through the custom op: this
    is where the op's implementation ends too).

    The reference backend writes under torch.inference_mode(), so that it writes what the kernel
    writes: outputs created under inference mode (engines allocate caches there) are accepted
    outside it too, and an output that requires grad is written like any buffer, with no autograd
    record. Outside inference mode torch checks those in-place writes after each one, so a call
    raised RuntimeError with part of its record written."""
    if _backend.checks_enabled():
        cap = None if plan.kv_cache is None else plan.kv_cache.shape[0] * plan.kv_cache.shape[1]
        run_data_checks(plan.positions, None if plan.cos_sin is None else plan.cos_sin.shape[0],
                        plan.slot_mapping, cap)
    if plan.n == 0 or plan.x.device.type == "meta":
        return  # nothing to compute (meta tensors carry no data: shapes were checked above)
    if _backend.resolve_backend(plan.x.device) == "triton":
        kernels().run_plan(plan)
    else:
        with torch.inference_mode():  # see the docstring
            reference.run_plan(plan)


# a group runs as one launch while its largest call has at most this many tokens; above, call by call:
# there the launches cost little beside the bytes, and a call's own kernel (a Gluon fast path) beats the
# portable kernel that the grouped launch runs (H200, DeepSeek V4 layer: one launch 32.3 vs 34.9 us
# call by call at 512 tokens, 62.8 vs 61.7 at 1024, 120.9 vs 106.7 at 2048; docs/performance.md)
GROUP_ONE_LAUNCH_MAX_N = 1024


def run_group(plans) -> None:
    """Run validated plans that touch no common output (kvfuse.group checked) on the Triton backend as
    one launch (kvfuse/kernels/grouped.py) while the largest has at most GROUP_ONE_LAUNCH_MAX_N tokens,
    else (and for a single plan) each on its own kernel, fast paths included; one after the other on
    the reference backend."""
    if _backend.checks_enabled():
        for plan in plans:
            cap = None if plan.kv_cache is None else plan.kv_cache.shape[0] * plan.kv_cache.shape[1]
            run_data_checks(plan.positions, None if plan.cos_sin is None else plan.cos_sin.shape[0],
                            plan.slot_mapping, cap)
    live = [plan for plan in plans if plan.n and plan.x.device.type != "meta"]
    if not live:
        return
    if _backend.resolve_backend(live[0].x.device) != "triton":
        with torch.inference_mode():  # see run
            for plan in live:
                reference.run_plan(plan)
    elif len(live) == 1 or max(plan.n for plan in live) > GROUP_ONE_LAUNCH_MAX_N:
        for plan in live:
            kernels().run_plan(plan)
    else:
        _run_group_kernel(live)


# --------------------------------------------------------------------------- store_kv_cache
def _check_cache_args(kv_cache, slot_mapping, layout, what):
    if not isinstance(layout, KVCacheFormat):
        raise TypeError(f"{what}: layout must be a KVCacheFormat, got {type(layout).__name__}")
    layout.check_cache(kv_cache, f"{what}: kv_cache")
    check_tensor(slot_mapping, f"{what}: slot_mapping", INDEX_DTYPES, kv_cache.device, last_contiguous=False)
    if slot_mapping.dim() != 1:
        raise ValueError(f"{what}: slot_mapping: expected shape (n,), got {tuple(slot_mapping.shape)}")


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
    if dev.type != "meta" and not torch.compiler.is_compiling():
        entry.overlap = _store_overlap_check(data, sf, kv_cache, slot_mapping, tail)
    return entry


STORE_TENSOR_NAMES = ("data", "sf", "tail", "slot_mapping", "kv_cache")   # the order of store_kv_cache's check


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
    """Plan-cache key of a store_kv_cache call (what _validate_store and kernels.store read; see kvfuse.plan)."""
    return (("store", tensor_key(data), optional_tensor_key(sf), tensor_key(kv_cache), tensor_key(slot_mapping),
             optional_tensor_key(tail), id(layout)), (layout,))


def validate_store(data, sf, kv_cache, slot_mapping, layout, tail) -> CacheEntry:
    """store_kv_cache's validation (plan-cached per signature): its CacheEntry, or TypeError /
    ValueError naming the argument."""
    return validated(_store_signature, _validate_store_entry, data, sf, kv_cache, slot_mapping, layout, tail)


def store(entry: CacheEntry, data, sf, kv_cache, slot_mapping, layout, tail) -> None:
    """A validated store_kv_cache call: the per-call aliasing check, the data checks, the write."""
    if entry.overlap is not None:
        entry.overlap((data, sf, tail, slot_mapping, kv_cache), slot_mapping.shape[0])
    if _backend.checks_enabled():
        run_data_checks(slot_mapping=slot_mapping, capacity=kv_cache.shape[0] * kv_cache.shape[1])
    dev = kv_cache.device
    if slot_mapping.shape[0] == 0 or dev.type == "meta":
        return
    if _backend.resolve_backend(dev) == "triton":
        kernels().store(kv_cache, slot_mapping, layout, data, sf, tail, entry)
        return

    def heads(t):  # validated: a 2-d payload is [n, ..] of a one-head cache
        return None if t is None else (t.unsqueeze(1) if data.dim() == 2 else t)

    with torch.inference_mode():  # see run
        reference.store(kv_cache, slot_mapping, layout, heads(data), heads(sf), heads(tail))


# --------------------------------------------------------------------------- load_paged_kv_cache
def _validate_load_entry(kv_cache, slot_mapping, layout, dequantize) -> CacheEntry:
    _check_cache_args(kv_cache, slot_mapping, layout, "load_paged_kv_cache")
    if not isinstance(dequantize, bool):
        raise TypeError(f"dequantize must be a bool, got {type(dequantize).__name__}")
    return CacheEntry()


def _load_signature(kv_cache, slot_mapping, layout, dequantize):
    """Plan-cache key of a load_paged_kv_cache call (what _validate_load and kernels.load read)."""
    return ("load", tensor_key(kv_cache), tensor_key(slot_mapping), id(layout), type(dequantize), dequantize), (layout,)


def validate_load(kv_cache, slot_mapping, layout, dequantize) -> CacheEntry:
    """load_paged_kv_cache's validation (plan-cached per signature)."""
    return validated(_load_signature, _validate_load_entry, kv_cache, slot_mapping, layout, dequantize)


def load(entry: CacheEntry, kv_cache, slot_mapping, layout, dequantize):
    """A validated load_paged_kv_cache call: the gathered records (see kvfuse.api)."""
    if kv_cache.device.type == "meta":
        return reference.load(kv_cache, slot_mapping, layout, dequantize)
    if slot_mapping.shape[0] and _backend.resolve_backend(kv_cache.device) == "triton":
        return kernels().load(kv_cache, slot_mapping, layout, dequantize, entry)
    return reference.load(kv_cache, slot_mapping, layout, dequantize)
