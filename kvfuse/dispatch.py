"""The one room that decides how a validated plan runs: eagerly or through its custom op, and on
which backend.

Every public entry point validates into a plan (:mod:`kvfuse.plans`) and hands it here:

- ``call_fused(template, tensors)``: the fused operator. The hot path (a launchable call on the
  Triton backend, no data checks, not tracing) launches with the parameters kept in the plan cache;
  anything else binds the plan and goes through ``execute``.
- ``call_gqa(template, tensors)``: the GQA entry point, the same way (its launches kept by
  kvfuse.kernels.qkv.run_template).
- ``execute(plan)``: while ``torch.compiler.is_compiling()`` (or inside ``with via_ops():``, which runs
  eager calls through the ops too: their tests, an engine that wants the op path) the plan's custom op
  (``through_op``: one opaque call that writes into buffers it was given), else ``run``.
- ``run(plan)``: the ``KVFUSE_CHECKS`` data checks, then the backend chosen for the plan's device
  (:mod:`kvfuse.backend`): the Triton kernels or the reference chain. The custom ops' implementations
  (:mod:`kvfuse.ops`) end here too, so nothing comes back through the public functions.

Plans: :class:`~kvfuse.plans.types.Plan` (the fused operator), ``GQAPlan``, ``StorePlan``, ``LoadPlan``
and ``GroupPlan``; each kind has one runner per backend below.
"""
from __future__ import annotations

import contextlib
import math
import threading

import torch

from . import backend as _backend
from .plans import cache_io, opargs
from .plans.types import GQAPlan, GroupPlan, LoadPlan, Plan, StorePlan
from .reference import cache as _reference_cache
from .reference import chain as _reference_chain

__all__ = ["call_fused", "call_gqa", "execute", "through_op", "via_ops", "run", "run_data_checks", "kernels",
           "GROUP_ONE_LAUNCH_MAX_N"]

# a group runs as one launch while its largest call has at most this many tokens; above, call by call:
# there the launches cost little beside the bytes, and a call's own kernel (a Gluon fast path) beats the
# portable kernel that the grouped launch runs (H200, DeepSeek V4 layer: one launch 32.3 vs 34.9 us
# call by call at 512 tokens, 62.8 vs 61.7 at 1024, 120.9 vs 106.7 at 2048; docs/performance.md)
GROUP_ONE_LAUNCH_MAX_N = 1024


# =============================================================================== the kernels
class _InterpreterLaunches:
    """The kernels' router with every launch taken under one process-wide lock: Triton's interpreter
    is not thread-safe (it patches triton.language globally and keeps the grid position in a global
    builder while a launch runs), so concurrent calls raised InterpreterError and left partial writes.
    Used only when the kernels run in the interpreter; compiled kernels get the module itself (no lock)."""

    _lock = threading.Lock()  # one for the process (two threads that import the kernels at once build two wrappers)

    def __init__(self, entry_points):
        self._entry_points = entry_points

    def run_template(self, template, tensors):
        with self._lock:
            return self._entry_points.run_template(template, tensors)

    def run_plan(self, plan):
        with self._lock:
            return self._entry_points.run_plan(plan)

    def run_group(self, plans):
        with self._lock:
            return self._entry_points.run_group(plans)

    def run_gqa(self, plan):
        with self._lock:
            return self._entry_points.run_gqa(plan)

    def run_gqa_template(self, template, tensors):
        with self._lock:
            return self._entry_points.run_gqa_template(template, tensors)

    def store(self, *args):
        with self._lock:
            return self._entry_points.store(*args)

    def load(self, *args):
        with self._lock:
            return self._entry_points.load(*args)


_kernels = None


def kernels():
    """The Triton kernels' entry points (run_template, run_plan, run_group, run_gqa, run_gqa_template, store,
    load),
    imported lazily (triton is only needed by the triton backend)."""
    global _kernels
    if _kernels is None:
        from types import SimpleNamespace

        from .kernels import grouped, qkv, router
        entry_points = SimpleNamespace(run_template=router.run_template, run_plan=router.run_plan, store=router.store,
                                       load=router.load, run_group=grouped.run_group, run_gqa=qkv.run,
                                       run_gqa_template=qkv.run_template)
        _kernels = _InterpreterLaunches(entry_points) if router.INTERPRET else entry_points
    return _kernels


# =============================================================================== eager or custom op
class _Route(threading.local):
    ops = False    # a class default: reading it costs no AttributeError in threads that never set it


_route = _Route()


@contextlib.contextmanager
def via_ops():
    """Within the block, eager calls of the calling thread also run through the custom ops."""
    previous, _route.ops = _route.ops, True
    try:
        yield
    finally:
        _route.ops = previous


def call_fused(template, tensors):
    """One validated call of the fused operator (kvfuse.plans.fused.prepare); returns what it returns."""
    if (template.launchable and not torch.compiler.is_compiling() and not _route.ops and not _backend.checks_enabled()
            and _backend.resolve_backend(template.device, template.device_type) == "triton"):
        kernels().run_template(template, tensors)  # the hot path: launch parameters kept with the template
    else:
        execute(template.bind(tensors))
    return template.result(tensors)


def call_gqa(template, tensors):
    """One call of the GQA entry point from its plan-cache template (kvfuse.plans.gqa.prepare_call). The
    hot path (compiled kernels or the interpreter, no data checks, not through the op) launches with the
    launch kept with the template; anything else binds the plan and goes through ``execute``."""
    if (template.device_type != "meta" and tensors[template.rows_at].shape[0] and not torch.compiler.is_compiling()
            and not _route.ops and not _backend.checks_enabled()
            and _backend.resolve_backend(template.device, template.device_type) == "triton"):
        kernels().run_gqa_template(template, tensors)
    else:
        execute(template.bind(tensors))


def execute(plan):
    """Run a validated plan: through its custom op while torch.compile traces, else :func:`run`.
    Returns what the plan's call returns where it returns something (a load's records)."""
    if torch.compiler.is_compiling() or _route.ops:
        return through_op(plan)
    return run(plan)


def through_op(plan):
    """Run a validated plan as one call of its ``kvfuse::`` custom op (registered by kvfuse.ops, imported
    with kvfuse); the outputs a load returns are allocated first."""
    if isinstance(plan, GroupPlan):
        torch.ops.kvfuse.fused_group(*opargs.flatten_group(plan))
        return None
    if isinstance(plan, LoadPlan):
        plan.allocate_outputs()
    getattr(torch.ops.kvfuse, plan.OP)(*opargs.flatten(plan))
    return plan.outputs() if isinstance(plan, LoadPlan) else None


# =============================================================================== the backends
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


def _plan_data_checks(plan) -> None:
    run_data_checks(plan.positions, None if plan.cos_sin is None else plan.cos_sin.shape[0], plan.slot_mapping,
                    plan.capacity)


def _gqa_data_checks(plan: GQAPlan) -> None:
    """Positions in range, no duplicate valid slots (those of a paged append computed first), finite
    positive scales."""
    slots = _reference_chain.gqa_slots(plan) if plan.paged_append and plan.q.device.type != "meta" else \
        plan.slot_mapping
    run_data_checks(plan.positions, None if plan.cos_sin is None else plan.cos_sin.shape[0], slots, plan.capacity)
    for name in ("k_scale", "v_scale", "q_scale"):
        s = getattr(plan, name)
        if s is not None and s.device.type != "meta":
            bad = ~(torch.isfinite(s) & (s > 0))
            if bool(bad.any()):
                raise ValueError(f"{name} must hold finite numbers > 0, got {float(s.reshape(-1)[bad.reshape(-1)][0])}")


def _triton(device) -> bool:
    return _backend.resolve_backend(device) == "triton"


def _run_fused(plan: Plan) -> None:
    if plan.n == 0 or plan.x.device.type == "meta":
        return  # nothing to compute (meta tensors carry no data: shapes were checked by validation)
    if _triton(plan.x.device):
        kernels().run_plan(plan)
    else:
        with torch.inference_mode():  # see run
            _reference_chain.run_plan(plan)


def _run_gqa(plan: GQAPlan) -> None:
    if plan.n == 0 or plan.q.device.type == "meta":
        return
    if _triton(plan.q.device):
        kernels().run_gqa(plan)
    else:
        with torch.inference_mode():  # see run
            _reference_chain.run_gqa_plan(plan)


def _run_store(plan: StorePlan) -> None:
    if plan.entry is None:   # back from op arguments: the plan-cache entry (and the aliasing check) again
        plan = cache_io.validate_store(plan.data, plan.sf, plan.kv_cache, plan.slot_mapping, plan.fmt, plan.tail)
    kv_cache, slots = plan.kv_cache, plan.slot_mapping
    dev = kv_cache.device
    if slots.shape[0] == 0 or dev.type == "meta":
        return
    if _triton(dev):
        kernels().store(kv_cache, slots, plan.fmt, plan.data, plan.sf, plan.tail, plan.entry)
        return

    def heads(t):  # validated: a 2-d payload is [n, ..] of a one-head cache
        return None if t is None else (t.unsqueeze(1) if plan.data.dim() == 2 else t)

    with torch.inference_mode():  # see run
        _reference_cache.store(plan.kv_cache, plan.slot_mapping, plan.fmt, heads(plan.data), heads(plan.sf),
                        heads(plan.tail))


def _run_load(plan: LoadPlan):
    entry = plan.entry
    if entry is None:
        entry = cache_io.validate_load(plan.kv_cache, plan.slot_mapping, plan.fmt, plan.dequantize).entry
    kv_cache, slots, fmt, dequantize = plan.kv_cache, plan.slot_mapping, plan.fmt, plan.dequantize
    if kv_cache.device.type != "meta" and slots.shape[0] and _triton(kv_cache.device):
        got = kernels().load(kv_cache, slots, fmt, dequantize, entry)
    else:
        got = _reference_cache.load(kv_cache, slots, fmt, dequantize)
    if plan.out is not None:              # through the op: written into the outputs allocated before it
        plan.out.copy_(got)
    elif plan.data_out is not None:
        plan.data_out.copy_(got[0])
        plan.sf_out.copy_(got[1])
    return got


def _run_group(group: GroupPlan) -> None:
    """One launch (kvfuse/kernels/grouped.py) while the largest call has at most GROUP_ONE_LAUNCH_MAX_N
    tokens, else (and for a single call) each on its own kernel, fast paths included; one after the
    other on the reference backend."""
    live = [plan for plan in group.members if plan.n and plan.x.device.type != "meta"]
    if not live:
        return
    if not _triton(live[0].x.device):
        with torch.inference_mode():  # see run
            for plan in live:
                _reference_chain.run_plan(plan)
    elif len(live) == 1 or max(plan.n for plan in live) > GROUP_ONE_LAUNCH_MAX_N:
        for plan in live:
            kernels().run_plan(plan)
    else:
        kernels().run_group(live)


def _store_data_checks(plan: StorePlan) -> None:
    run_data_checks(slot_mapping=plan.slot_mapping, capacity=plan.capacity)


_RUNNERS = {Plan: (_plan_data_checks, _run_fused), GQAPlan: (_gqa_data_checks, _run_gqa),
            StorePlan: (_store_data_checks, _run_store), LoadPlan: (None, _run_load),
            GroupPlan: (lambda group: [_plan_data_checks(plan) for plan in group.members], _run_group)}


def run(plan):
    """Run a validated plan on the backend chosen for its device, after the data checks when
    KVFUSE_CHECKS is on (never through the custom op: this is where the op's implementation ends too).

    The reference backend writes under torch.inference_mode(), so that it writes what the kernel
    writes: outputs created under inference mode (engines allocate caches there) are accepted
    outside it too, and an output that requires grad is written like any buffer, with no autograd
    record. Outside inference mode torch checks those in-place writes after each one, so a call
    raised RuntimeError with part of its record written."""
    checks, runner = _RUNNERS[type(plan)]
    if checks is not None and _backend.checks_enabled():
        checks(plan)
    return runner(plan)
