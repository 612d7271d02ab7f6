"""Several calls of the fused operator in one launch: :func:`fused_group`.

A decode step of an MLA layer makes three or four small calls (Q preprocessing, the main KV write,
the indexer's K write and Q quantization), each a launch of a few microseconds at decode sizes,
where the launches, not the bytes, set the time. ``fused_group`` validates every call as its own
call would, checks that no call writes memory another call reads or writes (they run concurrently),
and runs them in one launch of the portable kernel (kvfuse/kernels/grouped.py). Every call's
outputs are byte-equal to its own call's. Past ``kvfuse.dispatch.GROUP_ONE_LAUNCH_MAX_N`` tokens
(1024) the calls run one by one on their own kernels: there the launches cost little beside the
bytes, and a call's own kernel (a Gluon fast path) is faster than the portable one.
"""
from __future__ import annotations

from typing import List, Sequence

import torch

from . import dispatch as _dispatch
from . import ops as _ops
from .args import FusedCall
from .overlap import span_terms, tensors_overlap
from .plan import MAX_GROUP_CALLS, NUM_CALL_TENSORS, OUTPUT_FIELDS, X, argument_names, prepare

__all__ = ["fused_group", "FusedCall", "MAX_GROUP_CALLS"]


def _prepared(calls):
    if not isinstance(calls, (list, tuple)):
        raise TypeError(f"calls must be a list or tuple of FusedCall, got {type(calls).__name__}")
    if not 1 <= len(calls) <= MAX_GROUP_CALLS:
        raise ValueError(f"calls: expected 1 to {MAX_GROUP_CALLS} calls, got {len(calls)}")
    members = []
    for i, call in enumerate(calls):
        if not isinstance(call, FusedCall):
            raise TypeError(f"calls[{i}] must be a FusedCall, got {type(call).__name__}")
        try:
            template, tensors = prepare(call.x, call.norm_args, call.rope_args, call.hadamard_args, call.cast_args,
                                        call.out_args)
            if template.overlap is not None:
                template.overlap(tensors, tensors[X].shape[0])
        except (ValueError, TypeError) as e:
            raise type(e)(f"calls[{i}]: {e}") from None
        if i and template.device != members[0][0].device:
            raise ValueError(f"calls[{i}]: expected every call on {members[0][0].device}, got {template.device}")
        members.append((template, tensors))
    return members


def _caller_tensors(template, tensors, out_args):
    """(argument name, tensor, is an output) of the tensors the caller gave (not the ones the call allocates)."""
    names = argument_names(out_args)
    found = []
    for field, i, _ in template.sources:
        if i < NUM_CALL_TENSORS:
            found.append((names.get(field, field), tensors[i], field in OUTPUT_FIELDS))
    return found


def _span(t):
    terms = span_terms(t, False)
    if terms is None:
        return None
    return t.data_ptr(), t.data_ptr() + terms[0]


def check_no_shared_writes(calls, members) -> None:
    """ValueError when an output of one call shares a byte with any tensor of another call (the calls
    run concurrently in one launch; within a call the operator's own aliasing rules hold)."""
    if members[0][0].device_type == "meta" or torch.compiler.is_compiling():
        return
    lists = [_caller_tensors(t, ts, call.out_args) for (t, ts), call in zip(members, calls)]
    spans = [[_span(t) for _, t, _ in lst] for lst in lists]
    for i, lst in enumerate(lists):
        for name, out, is_out in lst:
            if not is_out:
                continue
            so = _span(out)
            if so is None:
                continue
            for j, other in enumerate(lists):
                if j == i:
                    continue
                for (oname, t, _), st in zip(other, spans[j]):
                    if st is None or st[0] >= so[1] or so[0] >= st[1]:
                        continue
                    if tensors_overlap(out, t):
                        raise ValueError(f"calls[{i}].{name} overlaps calls[{j}].{oname}: the calls of a group run "
                                         "concurrently, so no call may write memory another call reads or writes")


def fused_group(calls: Sequence[FusedCall]) -> List:
    """Run 1 to MAX_GROUP_CALLS calls of :func:`kvfuse.fused_norm_rope_hadamard_cast_store_kvcache`
    in one launch.

    Args:
        calls: FusedCall objects, each holding one call's arguments (x, norm_args, rope_args,
            hadamard_args, cast_args, out_args). The calls may differ in everything (n, heads,
            head_dim, stages, formats, caches) but must be on one device, and no call may write a
            byte that another call reads or writes (shared inputs such as positions and the cos/sin
            table are fine; a call's ``out`` may still be its own x).

    Returns:
        a list with what each call would return on its own (allocated outputs included).

    Every call is validated first, as its own call would be (errors name ``calls[i]``), then the
    group runs as one kernel launch on the Triton backend while its largest call has at most
    ``kvfuse.dispatch.GROUP_ONE_LAUNCH_MAX_N`` (1024) tokens, else call by call on each call's own
    kernel (one call alone always takes its own kernel); call by call on the reference backend. Outputs are byte-equal to the calls made one
    by one. Under torch.compile the group is one custom op, ``kvfuse::fused_group``.
    """
    members = _prepared(calls)
    check_no_shared_writes(calls, members)
    plans = [template.bind(tensors) for template, tensors in members]
    if torch.compiler.is_compiling():
        _ops.execute_group_op(plans)
    else:
        _dispatch.run_group(plans)
    return [template.result(tensors) for template, tensors in members]
