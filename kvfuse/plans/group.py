"""Validation of :func:`kvfuse.fused_group`: every call validated as its own call would be (errors
name ``calls[i]``), on one device, and no call writing a byte another call reads or writes (the
calls run concurrently in one launch). Ends in a :class:`~.types.GroupPlan`."""
from __future__ import annotations

from ..args import FusedCall
from ..overlap import addresses_known, span_terms, tensors_overlap
from .fused import OUTPUT_FIELDS, argument_names, prepare as prepare_call
from .types import MAX_GROUP_CALLS, NUM_CALL_TENSORS, GroupPlan


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
            template, tensors = prepare_call(call.x, call.norm_args, call.rope_args, call.hadamard_args,
                                             call.cast_args, call.out_args)
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
    if not addresses_known(members[0][0].device):
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


def prepare(calls):
    """(group plan, members) of validated calls; members: each call's (template, tensors), whose
    ``template.result(tensors)`` is what that call returns."""
    members = _prepared(calls)
    check_no_shared_writes(calls, members)
    return GroupPlan([template.bind(tensors) for template, tensors in members]), members
