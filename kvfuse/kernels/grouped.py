"""Several calls of the fused operator in one launch (:func:`kvfuse.fused_group`).

Each member is a validated :class:`kvfuse.plans.types.Plan` run by the portable kernel's own program body,
:func:`kvfuse.kernels.portable.fused_rows`, with the launch parameters a call of its own would get on
the portable kernel (``portable.fused_args``: rows per program, lane width, every constexpr). The grid
is the members' grids end to end; program ``pid`` runs member i for ``E[i-1] <= pid < E[i]``, so
every member writes the bytes its own call writes (the body's bytes do not depend on which program
or launch runs a row: SPEC §6). The members must not write what another member reads or writes:
:func:`kvfuse.group.fused_group` checks that before any launch.

A member's runtime arguments travel as one tuple and its constexprs as another (Triton >= 3.2
takes tuples as kernel arguments; a constexpr tuple specializes the kernel on every value in it).
The row count, the cos/sin table's rows and the cache capacity travel apart, unspecialized, as in
``fused_kernel``, so a new batch size does not compile a new kernel. The Gluon fast paths are not
used here: one launch holds one dialect.
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from ..plans.types import MAX_GROUP_CALLS as MAX_CALLS
from .portable import CONSTEXPR_NAMES, RUNTIME_NAMES, fused_args, fused_rows
from .router import pdl_launch, with_pdl

assert MAX_CALLS == 4, "grouped_kernel has four member slots"
# fused_kernel's runtime parameters (portable.RUNTIME_NAMES) travel in the member's tuple A in their order,
# except the three passed on their own (unspecialized); the constexprs in C in fused_rows's order
SEPARATE = ("P", "capacity", "n_rows")
TUPLE_NAMES = tuple(name for name in RUNTIME_NAMES if name not in SEPARATE)
# _member passes A and C by position
assert RUNTIME_NAMES[10] == "P" and RUNTIME_NAMES[32:34] == ("capacity", "n_rows") and len(TUPLE_NAMES) == 35
assert len(CONSTEXPR_NAMES) == 37


@triton.jit
def _member(pid, A, C: tl.constexpr, n_rows, P, capacity):
    """fused_rows for program ``pid`` of one member: A = its TUPLE_NAMES values, C = its CONSTEXPR_NAMES."""
    fused_rows(pid, A[0], A[1], A[2], A[3], A[4], A[5], A[6], A[7], A[8], A[9], P, A[10], A[11], A[12], A[13],
               A[14], A[15], A[16], A[17], A[18], A[19], A[20], A[21], A[22], A[23], A[24], A[25], A[26],
               A[27], A[28], A[29], A[30], capacity, n_rows, A[31], A[32], A[33], A[34], C[0], C[1], C[2], C[3],
               C[4], C[5], C[6], C[7], C[8], C[9], C[10], C[11], C[12], C[13], C[14], C[15], C[16], C[17], C[18],
               C[19], C[20], C[21], C[22], C[23], C[24], C[25], C[26], C[27], C[28], C[29], C[30], C[31], C[32],
               C[33], C[34], C[35], C[36])


@triton.jit(do_not_specialize=["N0", "P0", "CAP0", "N1", "P1", "CAP1", "N2", "P2", "CAP2", "N3", "P3", "CAP3",
                               "E0", "E1", "E2"])
def grouped_kernel(A0, C0: tl.constexpr, N0, P0, CAP0,
                   A1, C1: tl.constexpr, N1, P1, CAP1,
                   A2, C2: tl.constexpr, N2, P2, CAP2,
                   A3, C3: tl.constexpr, N3, P3, CAP3,
                   E0, E1, E2, NUM: tl.constexpr, PDL: tl.constexpr):
    """Programs [0, E0) run member 0, [E0, E1) member 1, [E1, E2) member 2, [E2, grid) member 3;
    members past NUM are None (not compiled). PDL: one wait before any member reads."""
    if PDL:
        gdc_wait()
    pid = tl.program_id(0)
    if pid < E0:
        _member(pid, A0, C0, N0, P0, CAP0)
    else:
        if NUM > 1:
            if pid < E1:
                _member(pid - E0, A1, C1, N1, P1, CAP1)
            else:
                if NUM > 2:
                    if pid < E2:
                        _member(pid - E1, A2, C2, N2, P2, CAP2)
                    else:
                        if NUM > 3:
                            _member(pid - E2, A3, C3, N3, P3, CAP3)


def member_launch(plan, tensor) -> tuple:
    """(programs, A, C, n_rows, P, capacity, num_warps) of one member: its own call's portable-kernel
    launch (portable.fused_args), split the way grouped_kernel takes it."""
    grid, args, options = fused_args(plan, tensor)
    named = dict(zip(RUNTIME_NAMES, args))
    return (grid[0], tuple(named[k] for k in TUPLE_NAMES), tuple(options[k] for k in CONSTEXPR_NAMES),
            named["n_rows"], named["P"], named["capacity"], options["num_warps"])


def run_group(plans) -> None:
    """Launch validated plans (2..MAX_CALLS, each n >= 1, one device) as one grouped_kernel launch."""
    if not 2 <= len(plans) <= MAX_CALLS:
        raise ValueError(f"run_group: expected 2 to {MAX_CALLS} plans, got {len(plans)}")
    kwargs, ends, total, warps = {}, [], 0, 1
    for i, plan in enumerate(plans):
        x = plan.x

        def tensor(field, plan=plan, x=x):  # x stands in for a tensor the plan does not have (never read)
            t = getattr(plan, field)
            return x if t is None else t

        programs, a, c, n_rows, p, cap, nw = member_launch(plan, tensor)
        kwargs.update({f"A{i}": a, f"C{i}": c, f"N{i}": n_rows, f"P{i}": p, f"CAP{i}": cap})
        total += programs
        ends.append(total)
        warps = max(warps, nw)
    for i in range(len(plans), MAX_CALLS):
        kwargs.update({f"A{i}": None, f"C{i}": None, f"N{i}": 0, f"P{i}": 0, f"CAP{i}": 0})
    ends += [total] * (MAX_CALLS - len(ends))
    pdl = pdl_launch(plans[0].x)
    grouped_kernel[(total,)](**kwargs, E0=ends[0], E1=ends[1], E2=ends[2], NUM=len(plans),
                             **with_pdl({"PDL": False}, pdl), num_warps=warps, num_stages=1,
                             enable_fp_fusion=False)
