"""The public entry points: validate (kvfuse.plan), then run on the chosen backend."""
from __future__ import annotations

import threading
from typing import Optional

import torch

from . import backend as _backend
from . import ops as _ops
from . import reference
from .formats import KVCacheFormat
from .overlap import OverlapCheck, span_terms
from .plan import (INDEX_DTYPES, X, CacheEntry, Plan, check_tensor, optional_tensor_key, prepare, q_dtype, sf_dtype,
                   tensor_key, validated)

__all__ = ["fused_norm_rope_hadamard_cast_store_kvcache", "store_kv_cache", "load_paged_kv_cache"]

_fused_module = None


class _InterpreterLaunches:
    """kvfuse.kernels.fused with every launch taken under one process-wide lock: Triton's interpreter
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

    def store(self, *args):
        with self._lock:
            return self._module.store(*args)

    def load(self, *args):
        with self._lock:
            return self._module.load(*args)


def _kernels():
    global _fused_module
    if _fused_module is None:
        from .kernels import fused  # imported lazily: triton is only needed by the triton backend
        _fused_module = _InterpreterLaunches(fused) if fused.INTERPRET else fused
    return _fused_module


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


def execute(plan: Plan) -> None:
    """Run a validated plan on the backend chosen for its device.

    The reference backend writes under torch.inference_mode(), so that it writes what the kernel
    writes: outputs created under inference mode (engines allocate caches there) are accepted
    outside it too, and an output that requires grad is written like any buffer, with no autograd
    record. Outside inference mode torch checks those in-place writes after each one, so a call
    raised RuntimeError with part of its record written."""
    if torch.compiler.is_compiling():
        return _ops.execute_op(plan)  # traced as one custom op (torch.compile / CUDA graphs)
    if _backend.checks_enabled():
        cap = None if plan.kv_cache is None else plan.kv_cache.shape[0] * plan.kv_cache.shape[1]
        run_data_checks(plan.positions, None if plan.cos_sin is None else plan.cos_sin.shape[0],
                        plan.slot_mapping, cap)
    if plan.n == 0 or plan.x.device.type == "meta":
        return  # nothing to compute (meta tensors carry no data: shapes were checked above)
    if _backend.resolve_backend(plan.x.device) == "triton":
        _kernels().run_plan(plan)
    else:
        with torch.inference_mode():  # see the docstring
            reference.run_plan(plan)


def fused_norm_rope_hadamard_cast_store_kvcache(x, norm_args=None, rope_args=None, hadamard_args=None,
                                                cast_args=None, out_args=None):
    """RMSNorm -> RoPE -> Hadamard -> quantize -> paged-cache write, any sub-chain, one launch.

    Args:
        x: bf16 [n, head_dim] or [n, num_heads, head_dim], x.stride(-1) == 1 (any other strides).
        norm_args / rope_args / hadamard_args / cast_args: the stages (None switches one off);
            the stages that are on run in that order, each rounding its output to bf16.
        out_args: None | Tensor | ContiguousOutArgs | KVCacheOutArgs (see SPEC §3).

    Returns:
        no cast: bf16 shaped like x (the last stage's output; written into out_args if given);
        cast without cache: (q, sf) (q float8_e4m3fn [..., D] or uint8 [..., D/2] for e2m1;
        sf [..., D/g] uint8 / float8_e4m3fn / float32) or, with cast_back, the dequantized bf16;
        a KV cache: ``out_args.out`` (the bf16 of ``out_stage``) or None.

    Raises ValueError/TypeError, naming the argument, before any launch.
    """
    template, tensors = prepare(x, norm_args, rope_args, hadamard_args, cast_args, out_args)
    # outputs of the caller's: whether they overlap depends on data pointers, so it is checked on every call
    # (out may be x: the kernels read every x they need before writing that part of out)
    if template.overlap is not None:
        template.overlap(tensors, tensors[X].shape[0])
    if (template.launchable and not torch.compiler.is_compiling() and not _backend.checks_enabled()
            and _backend.resolve_backend(template.device, template.device_type) == "triton"):
        _kernels().run_template(template, tensors)  # the hot path: launch parameters kept with the template
    else:
        execute(template.bind(tensors))
    return template.result(tensors)


def _check_cache_args(kv_cache, slot_mapping, layout, what):
    if not isinstance(layout, KVCacheFormat):
        raise TypeError(f"{what}: layout must be a KVCacheFormat, got {type(layout).__name__}")
    layout.check_cache(kv_cache, f"{what}: kv_cache")
    check_tensor(slot_mapping, f"{what}: slot_mapping", INDEX_DTYPES, kv_cache.device, last_contiguous=False)
    if slot_mapping.dim() != 1:
        raise ValueError(f"{what}: slot_mapping: expected shape (n,), got {tuple(slot_mapping.shape)}")


def _validate_store(data, sf, kv_cache, slot_mapping, layout, tail) -> CacheEntry:
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


def store_kv_cache(data: torch.Tensor, sf: Optional[torch.Tensor], kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, layout: KVCacheFormat, tail: Optional[torch.Tensor] = None) -> None:
    """Scatter already-quantized rows into a paged cache.

    data: [n, quant_bytes] or [n, num_heads, quant_bytes] (float8_e4m3fn for e4m3, uint8 packed for
    e2m1, bf16 [.., head_dim] for a bf16 cache); sf: [.., num_scales] in the format's scale dtype
    (None for a bf16 cache); tail: bf16 [.., bf16_tail] for the FlashMLA formats (else None);
    slot_mapping: int32/int64 [n] (invalid slots skip the row). Writes exactly the record bytes.
    """
    entry = validated(_store_signature, _validate_store, data, sf, kv_cache, slot_mapping, layout, tail)
    if torch.compiler.is_compiling():
        return _ops.store_kv_cache(data, sf, kv_cache, slot_mapping, layout, tail)
    if entry.overlap is not None:
        entry.overlap((data, sf, tail, slot_mapping, kv_cache), slot_mapping.shape[0])
    if _backend.checks_enabled():
        run_data_checks(slot_mapping=slot_mapping, capacity=kv_cache.shape[0] * kv_cache.shape[1])
    dev = kv_cache.device
    if slot_mapping.shape[0] == 0 or dev.type == "meta":
        return
    if _backend.resolve_backend(dev) == "triton":
        _kernels().store(kv_cache, slot_mapping, layout, data, sf, tail, entry)
        return

    def heads(t):  # validated: a 2-d payload is [n, ..] of a one-head cache
        return None if t is None else (t.unsqueeze(1) if data.dim() == 2 else t)

    with torch.inference_mode():  # see execute
        reference.store(kv_cache, slot_mapping, layout, heads(data), heads(sf), heads(tail))


def _validate_load(kv_cache, slot_mapping, layout, dequantize) -> CacheEntry:
    _check_cache_args(kv_cache, slot_mapping, layout, "load_paged_kv_cache")
    if not isinstance(dequantize, bool):
        raise TypeError(f"dequantize must be a bool, got {type(dequantize).__name__}")
    return CacheEntry()


def _load_signature(kv_cache, slot_mapping, layout, dequantize):
    """Plan-cache key of a load_paged_kv_cache call (what _validate_load and kernels.load read)."""
    return ("load", tensor_key(kv_cache), tensor_key(slot_mapping), id(layout), type(dequantize), dequantize), (layout,)


def load_paged_kv_cache(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, layout: KVCacheFormat,
                        dequantize: bool = True):
    """Gather the records of ``slot_mapping`` from a paged cache.

    Returns bf16 [n, num_heads, head_dim] (``bf16(f(q) * d)`` per group, the bf16 tail raw; zeros
    for invalid slots), or with ``dequantize=False`` the raw bytes (data uint8 [n, num_heads,
    data_bytes] = quantized bytes then tail bytes, sf uint8 [n, num_heads, sf_bytes]).
    """
    entry = validated(_load_signature, _validate_load, kv_cache, slot_mapping, layout, dequantize)
    if torch.compiler.is_compiling():
        return _ops.load_paged_kv_cache(kv_cache, slot_mapping, layout, dequantize)
    if kv_cache.device.type == "meta":
        return reference.load(kv_cache, slot_mapping, layout, dequantize)
    if slot_mapping.shape[0] and _backend.resolve_backend(kv_cache.device) == "triton":
        return _kernels().load(kv_cache, slot_mapping, layout, dequantize, entry)
    return reference.load(kv_cache, slot_mapping, layout, dequantize)
