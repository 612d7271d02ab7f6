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

from . import dispatch as _dispatch
from .args import FusedCall
from .plans import group as _group
from .plans.types import MAX_GROUP_CALLS

__all__ = ["fused_group", "FusedCall", "MAX_GROUP_CALLS"]


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
    group, members = _group.prepare(calls)
    _dispatch.execute(group)
    return [template.result(tensors) for template, tensors in members]
