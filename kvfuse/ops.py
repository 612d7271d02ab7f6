"""kvfuse's entry points as ``torch.library`` custom ops (namespace ``kvfuse``), SPEC §9.

Five ops, each with a fake (meta) implementation and its writes marked in the schema
(``Tensor(a!)``): ``fused_norm_rope_hadamard_cast_store`` (a validated :class:`kvfuse.plan.Plan`
flattened into tensors and scalars), ``store_kv_cache``, ``load_paged_kv_cache``,
``fused_qk_norm_rope_store_kv`` (a :class:`kvfuse.gqa.GQAPlan`) and ``fused_group`` (the plans of
:func:`kvfuse.fused_group`: every member's inputs as ``Tensor?[]``, the outputs given as one mutated
``Tensor(a!)[]``, one string of scalars per member). None allocates or returns a tensor: the Python
wrappers below allocate before the op, so a compiled graph or a CUDA graph holds one opaque call
that writes into buffers it was given. The implementations end in :mod:`kvfuse.dispatch` (backend
choice, ``KVFUSE_CHECKS``, launch), never back through :mod:`kvfuse.api`.

Validation (:func:`kvfuse.plan.build_plan`) reads only shapes, dtypes, strides and Python objects,
so it traces under ``torch.compile(fullgraph=True)``. Eager code should call :mod:`kvfuse.api`
directly (no dispatcher cost); :mod:`kvfuse.api` routes through these ops only while
``torch.compiler.is_compiling()``.
"""
from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import dispatch
from .formats import PRESETS, KVCacheFormat
from .plan import CastSpec, Plan, build_plan

__all__ = [
    "execute_op", "fused_norm_rope_hadamard_cast_store_kvcache", "store_kv_cache", "load_paged_kv_cache",
    "fused_op", "store_op", "load_op", "format_fields", "format_from_fields", "gqa_op", "gqa_plan_to_op_args",
    "execute_gqa_op", "fused_qk_norm_rope_store_kv", "op_args_to_plan", "group_op", "execute_group_op",
    "group_plans_to_op_args", "group_op_args_to_plans",
]


# --------------------------------------------------------------------------- formats as scalars
def format_fields(fmt: Optional[KVCacheFormat]) -> Tuple:
    """A KVCacheFormat as the op's scalar arguments (name, head_dim, cast_fmt, elements_per_sf,
    sf_format, token_interleaved, sf_bytes, bf16_tail, block_alignment, scale_floor); ``None`` -> name None."""
    if fmt is None:
        return (None, 0, None, 0, None, False, 0, 0, 32, None)
    return (fmt.name, fmt.head_dim, fmt.cast_fmt, fmt.elements_per_sf or 0, fmt.sf_format,
            fmt.token_interleaved, fmt.sf_bytes, fmt.bf16_tail, fmt.block_alignment, fmt.scale_floor)


@functools.lru_cache(maxsize=256)
def format_from_fields(name, head_dim, cast_fmt, elements_per_sf, sf_format, token_interleaved, sf_bytes,
                       bf16_tail, block_alignment, scale_floor) -> Optional[KVCacheFormat]:
    """Inverse of :func:`format_fields` (cached; the preset object itself when the fields match one)."""
    if name is None:
        return None
    fmt = KVCacheFormat(name, head_dim, cast_fmt, elements_per_sf if cast_fmt is not None else None, sf_format,
                        token_interleaved, sf_bytes, bf16_tail, block_alignment, scale_floor)
    preset = PRESETS.get(name)
    return preset if preset == fmt else fmt


# --------------------------------------------------------------------------- registration
# The ops are defined with torch.library.Library + an explicit schema (not @torch.library.custom_op):
# custom_op wraps every call in Python ADInplaceOrView/autograd layers whose cost grows with the
# square of the argument count (torch/_library/utils.py fill_defaults re-reads schema.arguments per
# argument): ~330 us per call for this 29-argument schema on the CPU, against ~9 us of dispatch here
# (+ ~5 us to rebuild the Plan). The schema's ``Tensor(a!)`` annotations are the mutates_args that
# torch.compile's functionalization reads. There is no ADInplaceOrView kernel, so the ops do not
# bump version counters: they are inference ops (autograd through the written tensors is not
# supported, as with the direct path).
_lib = torch.library.Library("kvfuse", "FRAGMENT")
_FORMAT_SCHEMA = ("str? fmt_name, int fmt_head_dim, str? fmt_cast_fmt, int fmt_elements_per_sf, str? fmt_sf_format, "
                  "bool fmt_token_interleaved, int fmt_sf_bytes, int fmt_bf16_tail, int fmt_block_alignment, "
                  "float? fmt_scale_floor")
FUSED_SCHEMA = (
    "fused_norm_rope_hadamard_cast_store(Tensor x, Tensor? weight, Tensor? positions, Tensor? cos_sin, "
    "Tensor(a!)? out, Tensor(b!)? q_out, Tensor(c!)? sf_out, Tensor(d!)? kv_cache, Tensor? slot_mapping, "
    "Tensor? bias, float eps, str norm_kind, int rotary_dim, int rope_offset, bool is_neox, bool conjugate, float? hadamard_scale, "
    "str? cast_fmt, int group, str? sf_format, int? floor_exp, int quant_dim, str? out_stage, " + _FORMAT_SCHEMA
    + ") -> ()")
STORE_SCHEMA = ("store_kv_cache(Tensor data, Tensor? sf, Tensor(a!) kv_cache, Tensor slot_mapping, Tensor? tail, "
                + _FORMAT_SCHEMA + ") -> ()")
LOAD_SCHEMA = ("load_paged_kv_cache(Tensor kv_cache, Tensor slot_mapping, Tensor(a!)? out, Tensor(b!)? data_out, "
               "Tensor(c!)? sf_out, " + _FORMAT_SCHEMA + ") -> ()")
GQA_SCHEMA = ("fused_qk_norm_rope_store_kv(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
              "Tensor slot_mapping, Tensor(c!) q_out, Tensor? q_weight, float q_eps, Tensor? k_weight, float k_eps, "
              "Tensor? positions, Tensor? cos_sin, int rotary_dim, int rope_offset, bool is_neox, bool conjugate, "
              "Tensor? k_scale, Tensor? v_scale, str layout) -> ()")
_lib.define(FUSED_SCHEMA)
_lib.define(STORE_SCHEMA)
_lib.define(LOAD_SCHEMA)
GROUP_SCHEMA = "fused_group(Tensor?[] inputs, Tensor(a!)[] outputs, str[] members) -> ()"
_lib.define(GQA_SCHEMA)
_lib.define(GROUP_SCHEMA)


def _impl(name):
    def deco(fn):
        _lib.impl(name, fn, "CompositeExplicitAutograd")
        torch.library.register_fake(f"kvfuse::{name}", lambda *args, **kwargs: None, lib=_lib)
        return fn
    return deco


# --------------------------------------------------------------------------- the fused op
@_impl("fused_norm_rope_hadamard_cast_store")
def fused_op(*args) -> None:
    """One validated Plan, flattened (see :func:`execute_op`)."""
    dispatch.run(op_args_to_plan(*args))


def op_args_to_plan(x, weight, positions, cos_sin, out, q_out, sf_out, kv_cache, slot_mapping, bias, eps, norm_kind,
                    rotary_dim, rope_offset, is_neox, conjugate, hadamard_scale, cast_fmt, group, sf_format,
                    floor_exp, quant_dim, out_stage, *fmt_fields) -> Plan:
    """The Plan of :data:`fused_op`'s arguments (inverse of :func:`plan_to_op_args`). Norm is on iff
    ``weight`` is given, RoPE iff ``positions`` is, Hadamard iff ``hadamard_scale`` is, the cast iff
    ``cast_fmt`` is."""
    fmt = format_from_fields(*fmt_fields)
    return Plan(x=x, weight=weight, eps=eps, norm_kind=norm_kind, bias=bias, positions=positions, cos_sin=cos_sin,
                rotary_dim=rotary_dim, rope_offset=rope_offset, is_neox=is_neox, conjugate=conjugate,
                hadamard_scale=hadamard_scale,
                cast=None if cast_fmt is None else CastSpec(cast_fmt, group, sf_format, floor_exp), quant_dim=quant_dim,
                out=out, out_stage=out_stage, q_out=q_out, sf_out=sf_out, kv_cache=kv_cache,
                slot_mapping=slot_mapping, fmt=fmt,
                addressing=None if kv_cache is None else fmt.addressing_for(kv_cache))


def plan_to_op_args(plan: Plan) -> tuple:
    """The positional arguments of :data:`fused_op` for ``plan``."""
    c = plan.cast
    return (plan.x, plan.weight, plan.positions, plan.cos_sin, plan.out, plan.q_out, plan.sf_out,
            plan.kv_cache, plan.slot_mapping, plan.bias, float(plan.eps), plan.norm_kind, int(plan.rotary_dim),
            int(plan.rope_offset), bool(plan.is_neox), bool(plan.conjugate), plan.hadamard_scale,
            None if c is None else c.cast_fmt, 0 if c is None else c.group, None if c is None else c.sf_format,
            None if c is None else c.floor_exp,
            int(plan.quant_dim), plan.out_stage) + format_fields(plan.fmt)


def execute_op(plan: Plan) -> None:
    """Run a validated plan through the ``kvfuse::fused_norm_rope_hadamard_cast_store`` op."""
    torch.ops.kvfuse.fused_norm_rope_hadamard_cast_store(*plan_to_op_args(plan))


def fused_norm_rope_hadamard_cast_store_kvcache(x, norm_args=None, rope_args=None, hadamard_args=None,
                                                cast_args=None, out_args=None):
    """:func:`kvfuse.fused_norm_rope_hadamard_cast_store_kvcache` through the custom op: validate,
    allocate the outputs in Python, then one op call. Same arguments, results and errors."""
    plan, result = build_plan(x, norm_args, rope_args, hadamard_args, cast_args, out_args)
    execute_op(plan)
    return result


# --------------------------------------------------------------------------- a group of calls, one launch
# A member's plan_to_op_args: tensors at INPUT_AT (read) and OUTPUT_AT (written), scalars from SCALARS_FROM on.
# In the op, a member's inputs are its INPUT_AT tensors (None where absent), its outputs only the present
# ones, and its string member record says which are present and holds the scalars (see _encode_member).
INPUT_AT = (0, 1, 2, 3, 8, 9)
OUTPUT_AT = (4, 5, 6, 7)
SCALARS_FROM = 10


_SEP = "\x1f"   # between the tokens of a member record (no format name or option holds it)


def _token(v) -> str:
    """One scalar as text that torch.compile can build while tracing: N (None), T / F (bools), i<int>,
    f<repr(float)> (repr round-trips every float exactly), s<str>."""
    if v is None:
        return "N"
    if isinstance(v, bool):
        return "T" if v else "F"
    if isinstance(v, int):
        return "i" + str(v)
    if isinstance(v, float):
        return "f" + repr(v)
    if _SEP in v:
        raise ValueError(f"a format name or option of a grouped call may not contain \\x1f, got {v!r}")
    return "s" + v


def _value(token: str):
    kind, text = token[0], token[1:]
    if kind == "N":
        return None
    if kind in "TF":
        return kind == "T"
    if kind == "i":
        return int(text)
    if kind == "f":
        return float(text)
    return text


def _encode_member(present, scalars) -> str:
    return _SEP.join(["".join("1" if p else "0" for p in present)] + [_token(v) for v in scalars])


def _decode_member(record: str):
    head, *tokens = record.split(_SEP)
    return [c == "1" for c in head], [_value(t) for t in tokens]


@_impl("fused_group")
def group_op(inputs, outputs, members) -> None:
    """Validated plans, flattened (see :func:`execute_group_op`), run as one group (kvfuse.dispatch.run_group)."""
    dispatch.run_group(group_op_args_to_plans(inputs, outputs, members))


def group_op_args_to_plans(inputs, outputs, members) -> list:
    plans, at_out = [], 0
    for m, record in enumerate(members):
        present, scalars = _decode_member(record)
        args = [None] * SCALARS_FROM
        for k, pos in enumerate(INPUT_AT):
            args[pos] = inputs[m * len(INPUT_AT) + k]
        for has, pos in zip(present, OUTPUT_AT):
            if has:
                args[pos] = outputs[at_out]
                at_out += 1
        plans.append(op_args_to_plan(*args, *scalars))
    return plans


def group_plans_to_op_args(plans) -> tuple:
    """(inputs, outputs, members) of :data:`group_op` for validated plans."""
    inputs, outputs, members = [], [], []
    for plan in plans:
        args = plan_to_op_args(plan)
        inputs += [args[pos] for pos in INPUT_AT]
        present = [args[pos] is not None for pos in OUTPUT_AT]
        outputs += [args[pos] for pos in OUTPUT_AT if args[pos] is not None]
        members.append(_encode_member(present, args[SCALARS_FROM:]))
    return inputs, outputs, members


def execute_group_op(plans) -> None:
    """Run validated plans through the ``kvfuse::fused_group`` op (one launch on the Triton backend)."""
    torch.ops.kvfuse.fused_group(*group_plans_to_op_args(plans))


# --------------------------------------------------------------------------- store
@_impl("store_kv_cache")
def store_op(data, sf, kv_cache, slot_mapping, tail, *fmt_fields) -> None:
    """:func:`kvfuse.store_kv_cache` (validates again, eagerly, then writes)."""
    fmt = format_from_fields(*fmt_fields)
    entry = dispatch.validate_store(data, sf, kv_cache, slot_mapping, fmt, tail)
    dispatch.store(entry, data, sf, kv_cache, slot_mapping, fmt, tail)


def store_kv_cache(data: Tensor, sf: Optional[Tensor], kv_cache: Tensor, slot_mapping: Tensor,
                   layout: KVCacheFormat, tail: Optional[Tensor] = None) -> None:
    """:func:`kvfuse.store_kv_cache` through the ``kvfuse::store_kv_cache`` op."""
    if not isinstance(layout, KVCacheFormat):
        raise TypeError(f"layout must be a KVCacheFormat, got {type(layout).__name__}")
    torch.ops.kvfuse.store_kv_cache(data, sf, kv_cache, slot_mapping, tail, *format_fields(layout))


# --------------------------------------------------------------------------- load
@_impl("load_paged_kv_cache")
def load_op(kv_cache, slot_mapping, out, data_out, sf_out, *fmt_fields) -> None:
    """:func:`kvfuse.load_paged_kv_cache` into preallocated outputs: ``out`` bf16 [n, H, head_dim]
    (dequantize) or ``data_out`` uint8 [n, H, data_bytes] and ``sf_out`` uint8 [n, H, sf_bytes]."""
    fmt = format_from_fields(*fmt_fields)
    dequantize = out is not None
    got = dispatch.load(dispatch.validate_load(kv_cache, slot_mapping, fmt, dequantize), kv_cache, slot_mapping, fmt,
                        dequantize)
    if dequantize:
        out.copy_(got)
    else:
        data, sf = got
        data_out.copy_(data)
        sf_out.copy_(sf)


def load_paged_kv_cache(kv_cache: Tensor, slot_mapping: Tensor, layout: KVCacheFormat, dequantize: bool = True):
    """:func:`kvfuse.load_paged_kv_cache` through the ``kvfuse::load_paged_kv_cache`` op (outputs
    allocated here, before the op)."""
    if not isinstance(layout, KVCacheFormat):
        raise TypeError(f"layout must be a KVCacheFormat, got {type(layout).__name__}")
    if not isinstance(dequantize, bool):
        raise TypeError(f"dequantize must be a bool, got {type(dequantize).__name__}")
    layout.check_cache(kv_cache, "kv_cache")
    n, nh = slot_mapping.shape[0], kv_cache.shape[2]
    dev = kv_cache.device
    if dequantize:
        out = torch.empty((n, nh, layout.head_dim), dtype=torch.bfloat16, device=dev)
        torch.ops.kvfuse.load_paged_kv_cache(kv_cache, slot_mapping, out, None, None, *format_fields(layout))
        return out
    data = torch.empty((n, nh, layout.data_bytes), dtype=torch.uint8, device=dev)
    sf = torch.empty((n, nh, layout.sf_bytes), dtype=torch.uint8, device=dev)
    torch.ops.kvfuse.load_paged_kv_cache(kv_cache, slot_mapping, None, data, sf, *format_fields(layout))
    return data, sf



# --------------------------------------------------------------------------- GQA / MHA (SPEC §11)
@_impl("fused_qk_norm_rope_store_kv")
def gqa_op(q, k, v, k_cache, v_cache, slot_mapping, q_out, q_weight, q_eps, k_weight, k_eps, positions, cos_sin,
           rotary_dim, rope_offset, is_neox, conjugate, k_scale, v_scale, layout) -> None:
    """One validated :class:`kvfuse.gqa.GQAPlan`, flattened (see :func:`execute_gqa_op`). The norms are on
    iff their weights are given, RoPE iff ``positions`` is, fp8 caches take the scales."""
    from . import gqa

    gqa.run(gqa.GQAPlan(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping, q_out=q_out,
                        q_weight=q_weight, q_eps=q_eps, k_weight=k_weight, k_eps=k_eps, positions=positions,
                        cos_sin=cos_sin, rotary_dim=rotary_dim, rope_offset=rope_offset, is_neox=is_neox,
                        conjugate=conjugate, k_scale=k_scale, v_scale=v_scale, layout=layout))


def gqa_plan_to_op_args(plan) -> tuple:
    """The positional arguments of :data:`gqa_op` for a GQAPlan (q_out set): kvfuse.gqa.plan_to_op_args."""
    from . import gqa

    return gqa.plan_to_op_args(plan)


def execute_gqa_op(plan) -> None:
    """Run a validated GQAPlan through the ``kvfuse::fused_qk_norm_rope_store_kv`` op."""
    torch.ops.kvfuse.fused_qk_norm_rope_store_kv(*gqa_plan_to_op_args(plan))


def fused_qk_norm_rope_store_kv(q, k, v, k_cache, v_cache, slot_mapping, q_norm_args=None, k_norm_args=None,
                                rope_args=None, k_scale=None, v_scale=None, layout="NHD", q_out=None):
    """:func:`kvfuse.fused_qk_norm_rope_store_kv` through the custom op: validate, allocate q_out in
    Python when it is not given, check aliasing (eagerly), then one op call. Same arguments, result
    and errors."""
    from . import gqa

    plan = gqa.validate(q, k, v, k_cache, v_cache, slot_mapping, q_norm_args, k_norm_args, rope_args, k_scale,
                        v_scale, layout, q_out)
    if plan.q_out is None:
        plan.q_out = torch.empty(tuple(q.shape), dtype=torch.bfloat16, device=q.device)
    if q.device.type != "meta" and not torch.compiler.is_compiling():
        gqa.check_overlap(plan)
    execute_gqa_op(plan)
    return plan.q_out
