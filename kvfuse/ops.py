"""kvfuse's entry points as ``torch.library`` custom ops (namespace ``kvfuse``), SPEC §8.

One op per plan type (:mod:`kvfuse.plans.types`), each wrapping :func:`kvfuse.dispatch.run` of its
plan: ``fused_norm_rope_hadamard_cast_store`` (Plan), ``fused_qk_norm_rope_store_kv`` (GQAPlan),
``store_kv_cache`` (StorePlan), ``load_paged_kv_cache`` (LoadPlan) and ``fused_group`` (GroupPlan).
Schemas and the plan <-> argument conversions are derived from the plan types' fields
(:mod:`kvfuse.plans.opargs`); writes are marked in the schema (``Tensor(a!)``). Each op has a fake
(meta) implementation. None allocates or returns a tensor: outputs are allocated before the op
(kvfuse.dispatch.through_op), so a compiled graph or a CUDA graph holds one opaque call that writes
into buffers it was given. Validation reads only shapes, dtypes, strides and Python objects, so the
public functions trace under ``torch.compile(fullgraph=True)``; kvfuse.dispatch routes through
these ops only while ``torch.compiler.is_compiling()``.

The ops are defined with torch.library.Library and an explicit schema (not @torch.library.custom_op):
custom_op wraps every call in Python ADInplaceOrView/autograd layers whose cost grows with the square
of the argument count (torch/_library/utils.py fill_defaults re-reads schema.arguments per argument):
~330 us per call for the fused op's schema on the CPU, against ~9 us of dispatch here. There is no
ADInplaceOrView kernel, so the ops do not bump version counters: they are inference ops (autograd
through the written tensors is not supported, as with the direct path).
"""
from __future__ import annotations

import torch

from . import dispatch
from .plans import opargs
from .plans.types import GQAPlan, LoadPlan, Plan, StorePlan

__all__ = ["SCHEMAS"]

_lib = torch.library.Library("kvfuse", "FRAGMENT")
SCHEMAS = {cls.OP: opargs.schema(cls) for cls in (Plan, StorePlan, LoadPlan, GQAPlan)}
SCHEMAS["fused_group"] = opargs.GROUP_SCHEMA


def _register(name, impl):
    _lib.define(SCHEMAS[name])
    _lib.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"kvfuse::{name}", lambda *args, **kwargs: None, lib=_lib)


def _plan_op(cls):
    def impl(*args) -> None:
        dispatch.run(opargs.unflatten(cls, args))
    impl.__name__ = impl.__qualname__ = cls.OP
    impl.__doc__ = f"``kvfuse::{cls.OP}``: one validated {cls.__name__}, flattened (kvfuse.plans.opargs)."
    return impl


for _cls in (Plan, StorePlan, LoadPlan, GQAPlan):
    _register(_cls.OP, _plan_op(_cls))


def _group_op(inputs, outputs, members) -> None:
    """``kvfuse::fused_group``: validated fused plans, flattened (kvfuse.plans.opargs.flatten_group)."""
    dispatch.run(opargs.unflatten_group(inputs, outputs, members))


_register("fused_group", _group_op)
