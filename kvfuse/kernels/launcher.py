"""Kernel launches kept per call signature, and a direct path into Triton's compiled launcher.

A ``Launch`` is one kernel launch with its tensors left open: everything else (grid, constants,
constexprs, options) is a function of the call signature, computed once and kept in the plan
cache. ``Launch.run(tensors)`` launches it with one call's tensors.

Direct launch. ``kernel[grid](*args, **constexprs)`` costs ~30-35 us of host time per call on
Triton 3.6 (it binds and specializes every one of the ~75 arguments and rebuilds the cache key).
A Launch's arguments other than its tensors are fixed, so the only part of Triton's
specialization that can change between calls is each tensor pointer's 16-byte alignment. After
the first launch through Triton, a Launch keeps the CompiledKernel Triton returned and, on later
calls whose pointers are all 16-byte aligned (the case it was compiled for: Triton specializes
pointers on ``data_ptr() % 16 == 0``), on the same current device, calls its launcher itself,
with the arguments Triton would pass (all parameters in order, constexprs included) and Triton's
launch hooks (while no hook is registered, none is passed: Triton's empty hook chains would be
called for nothing, and the launch metadata built for them). On Triton 3.6, whose CompiledKernel.run
is a Python wrapper around the C launcher, a kernel without scratch memory is launched by the C
launcher itself. Any other call takes Triton's path. The direct path is used only on the Triton
versions it was checked on (``DIRECT_LAUNCH_VERSIONS``; the launcher's calling convention is not
a public API) and can be turned off with ``KVFUSE_DIRECT_LAUNCH=0``.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
import os

import torch
import triton

from ..backend import env_flag

# the launcher convention used below: CompiledKernel.run(gx, gy, gz, stream, function, packed_metadata,
# launch_metadata, enter_hook, exit_hook, *every parameter in order); run on the H200 with 3.6
# (docs/performance.md), read in 3.9's source (JITFunction.run, CudaLauncher.__call__: tests/test_host_launch.py)
DIRECT_LAUNCH_VERSIONS = ("3.6.", "3.9.")
# the versions whose CompiledKernel.run (CudaLauncher.__call__) calls its C launcher as
# launch(gx, gy, gz, stream, function, cooperative_grid, pdl, global_scratch, profile_scratch, packed_metadata,
# launch_metadata, enter_hook, exit_hook, *every parameter in order)
C_LAUNCH_VERSIONS = ("3.6.",)


def direct_launch_supported(interpret: bool) -> bool:
    """Whether Launch may call Triton's compiled launcher directly (never in the interpreter)."""
    if interpret or not env_flag("KVFUSE_DIRECT_LAUNCH", True):
        return False
    return triton.__version__.startswith(DIRECT_LAUNCH_VERSIONS)


def _current_device() -> int:
    return torch._C._cuda_getDevice()


def _current_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


def _runtime_knobs():
    """Triton's runtime knobs (launch hooks), or None where this Triton has none."""
    knobs = getattr(triton, "knobs", None)
    return getattr(knobs, "runtime", None)


@dataclasses.dataclass(frozen=True)
class PlanTensor:
    """In a launch's argument table: the tensor ``field`` (of the plan, or of a store / load call)
    goes here."""
    field: str


@functools.lru_cache(maxsize=None)
def tensor_arg(field: str) -> PlanTensor:
    """PlanTensor(field), made once per field (building a frozen dataclass costs ~0.6 us)."""
    return PlanTensor(field)


def _hook_set(hook) -> bool:
    """Whether a launch hook would do anything: Triton's HookChain with calls in it, or a plain function."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _c_launcher(compiled):
    """(the C launcher, its arguments between the function and the launch metadata) of a CompiledKernel
    whose run is Triton 3.6's CudaLauncher without scratch memory, else (None, ())."""
    if not triton.__version__.startswith(C_LAUNCH_VERSIONS):
        return None, ()
    run = compiled.run
    try:
        if run.global_scratch_size or run.profile_scratch_size:
            return None, ()    # CudaLauncher allocates these per launch
        return run.launch, (run.launch_cooperative_grid, run.launch_pdl, None, None, compiled.packed_metadata)
    except AttributeError:   # not CudaLauncher
        return None, ()


class DirectLaunch:
    """A CompiledKernel of ``kernel`` for one argument signature, launched without Triton's binder.
    Valid while the Launch's kernel object is ``kernel`` (tests swap kernel objects), the current
    device is ``device`` and every tensor pointer is 16-byte aligned."""

    __slots__ = ("kernel", "compiled", "device", "grid", "constexprs", "knobs", "c_launch", "c_head")

    def __init__(self, kernel, compiled, device: int, grid: tuple, constexprs: tuple):
        self.kernel = kernel
        self.compiled = compiled
        self.device = device
        self.grid = (tuple(grid) + (1, 1))[:3]
        self.constexprs = constexprs
        self.knobs = _runtime_knobs()
        self.c_launch, self.c_head = _c_launcher(compiled)

    def launch(self, args: tuple) -> None:
        c = self.compiled
        stream = _current_stream(self.device)
        gx, gy, gz = self.grid
        knobs = self.knobs
        if knobs is None or not (_hook_set(knobs.launch_enter_hook) or _hook_set(knobs.launch_exit_hook)):
            # args and the constexprs unpacked into the call (not joined first: one tuple fewer a launch)
            if self.c_launch is not None:
                self.c_launch(gx, gy, gz, stream, c.function, *self.c_head, None, None, None, *args, *self.constexprs)
            else:
                c.run(gx, gy, gz, stream, c.function, c.packed_metadata, None, None, None, *args, *self.constexprs)
            return
        all_args = args + self.constexprs
        enter, leave = knobs.launch_enter_hook, knobs.launch_exit_hook    # Triton's protocol, as its own launch
        meta = None if enter is None else c.launch_metadata(self.grid, stream, *all_args)
        c.run(gx, gy, gz, stream, c.function, c.packed_metadata, meta, enter, leave, *all_args)


def _all_aligned(args: tuple, at: tuple) -> bool:
    for i in at:
        if args[i].data_ptr() & 15:
            return False
    return True


class Launch:
    """One kernel launch with its tensors left open: the grid, the positional arguments (constants,
    and a PlanTensor where a tensor goes) and the keyword arguments (constexprs, launch options).
    Everything but the tensors is a function of the call signature, so it is computed once and
    kept with the signature's cache entry. ``run(tensors)`` takes the tensors from a tuple of
    ``num_tensors`` whose layout ``tensor_index`` (field -> position) describes; a field it lacks
    gets the tensor of field ``stand_in`` (a pointer the kernel never dereferences). The kernel is
    looked up by name in ``namespace`` at each launch (tests and benchmarks swap kernel objects)."""

    __slots__ = ("kernel_name", "namespace", "grid", "pick", "constants", "options", "tensor_at", "direct",
                 "allow_direct", "guard", "aligned_at")

    def __init__(self, kernel_name: str, grid: tuple, args: tuple, options: dict, tensor_index: dict,
                 num_tensors: int, namespace: dict, stand_in: str = "x", allow_direct: bool = False):
        fallback = tensor_index[stand_in]
        constants, order = [], []
        for a in args:
            if isinstance(a, PlanTensor):
                order.append(tensor_index.get(a.field, fallback))
            else:
                order.append(num_tensors + len(constants))  # the constants follow the tensors
                constants.append(a)
        self.kernel_name = kernel_name
        self.namespace = namespace
        self.grid = grid
        self.pick = operator.itemgetter(*order)  # positional args out of tensors + constants, in C
        self.constants = tuple(constants)
        self.options = options
        self.tensor_at = tuple(i for i, a in enumerate(args) if isinstance(a, PlanTensor))
        # the positions in the call's tensors of those the launch passes, each once (the stand-in fills
        # several parameters): the direct path's alignment check reads each pointer once
        self.aligned_at = tuple(sorted({order[i] for i in self.tensor_at}))
        self.direct = None
        self.allow_direct = allow_direct
        # a per-call precondition weaker than 16-byte pointer alignment (a Gluon fast path reads x and
        # the weight as 4-byte words): (check(*tensors) -> bool, those tensors' positions)
        self.guard = None

    def run(self, tensors: tuple) -> bool:
        """Launch with this call's tensors; False (nothing launched) when the guard rejects them."""
        kernel = self.namespace[self.kernel_name]
        args = self.pick(tensors + self.constants)
        direct = self.direct
        if (direct is not None and direct.kernel is kernel and _all_aligned(tensors, self.aligned_at)
                and _current_device() == direct.device):
            direct.launch(args)        # every pointer 16-byte aligned: the guard holds too
            return True
        guard = self.guard
        if guard is not None and not guard[0](*[tensors[i] for i in guard[1]]):
            return False
        compiled = kernel[self.grid](*args, **self.options)
        if self.allow_direct and direct is None:
            self.direct = self._direct_for(kernel, compiled, args)
        return True

    def _direct_for(self, kernel, compiled, args: tuple):
        """The DirectLaunch for the kernel Triton just compiled or found for ``args``, when those
        were the all-aligned case and the kernel looks like the launcher convention expects."""
        if not all(hasattr(compiled, a) for a in ("run", "function", "packed_metadata", "launch_metadata")):
            return None
        if not _all_aligned(args, self.tensor_at):
            return None
        names = getattr(kernel, "arg_names", None)
        if names is None or any(name not in self.options for name in names[len(args):]):
            return None   # every parameter after the positional ones must be a constexpr given by name
        constexprs = tuple(self.options[name] for name in names[len(args):])
        return DirectLaunch(kernel, compiled, _current_device(), self.grid, constexprs)
