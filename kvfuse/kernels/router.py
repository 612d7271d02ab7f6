"""The host router of the fused operator: which kernel takes a validated plan (a Gluon fast path or the
portable kernel), with programmatic dependent launch or not, and its launch kept per call signature
(``run_plan``, ``run_template``); the store / load entry points (store_load.py); and the registry of
fast paths with the protocol each one provides (``FastPath``).

kvfuse.dispatch runs every Triton call through this module. ``force_config`` (the portable kernel's
launch configuration, tests) and ``fast_paths`` (the fast paths a thread's calls may take, tools and
tests) change the routing of the calls inside their block.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Optional, Protocol

import torch

from .. import backend as _backend
from ..formats import KVCacheFormat
from ..plans.types import LAUNCHES_PER_TEMPLATE, X, Plan
from .config import DIRECT_LAUNCH, FORCED, INTERPRET
from .gluon import common as gluon_common
from .gluon import flashmla, indexer, main_latent, main_latent_fp4
from .launcher import Launch, tensor_arg
from .portable import fused_args, fused_kernel
from .store_load import load, store  # noqa: F401 (the store / load entry points)


# --------------------------------------------------------------------------- the fast-path registry
class FastPath(Protocol):
    """What a Gluon fast path provides: a module of kvfuse/kernels/gluon (its module-level constants and
    functions; ``self`` below is the module), byte-equal to the portable kernel (SPEC §6). Adding one:
    write the module, add it to ``FAST_PATH_MODULES`` below (and its NAME to ``gluon.common.FAST_PATH_NAMES``,
    which KVFUSE_GLUON_SKIP is checked against), and its test cases."""

    NAME: str                 # its name in KVFUSE_GLUON_SKIP (a comma list of fast paths to leave off)
    FORMATS: tuple            # the preset cache formats (KVCacheFormat) it writes: its GPU tests' formats
    LAUNCH_TABLE: tuple       # ((first n_rows, (num_warps, rows, pipeline)), ...): its launch_table's entries
    MIN_ROWS: int             # calls with fewer rows (tokens x heads) stay on the portable kernel
    # the same for launches with programmatic dependent launch (the fast path's weights load before the
    # wait, the portable kernel's after it, which moves the decode break-even)
    MIN_ROWS_PDL: int

    def enabled(self) -> bool:
        """On: Gluon available and not switched off (KVFUSE_GLUON=0, KVFUSE_GLUON_SKIP)."""

    def eligible(self, plan: Plan) -> bool:
        """The plan is one this kernel writes."""

    def call_guard(self, plan: Plan) -> tuple[Callable[..., bool], tuple[str, ...]]:
        """(check, fields): a per-call check on the call's tensors of those plan fields (x and the weight
        read as 4-byte words, say); a call that fails it takes the portable kernel."""

    def plan_launch(self, plan: Plan, tensor: Callable[[str], Any],
                    table: Optional[Callable[[int], tuple]] = None) -> tuple[str, tuple, tuple, dict, dict]:
        """(kernel name, grid, args, keyword args, namespace) of the plan's launch; ``tensor(field)`` goes
        where the plan's tensor ``field`` goes; ``table``: n_rows -> (num_warps, rows, pipeline) in place of
        the module's launch_table (``fast_paths``)."""


_FAST_PATH_CONSTANTS = {name: kind for name, kind in FastPath.__annotations__.items()}
_FAST_PATH_FUNCTIONS = ("enabled", "eligible", "call_guard", "plan_launch")
_KINDS = {"str": str, "tuple": tuple, "int": int}


def register_fast_paths(*modules) -> tuple:
    """``modules`` in the order ``fast_path`` asks them (the first eligible one takes a plan), each checked
    against FastPath: TypeError naming the module and what it lacks or has of the wrong type."""
    for module in modules:
        problems = []
        for name, kind in _FAST_PATH_CONSTANTS.items():
            want = _KINDS[kind] if isinstance(kind, str) else kind
            if not hasattr(module, name):
                problems.append(f"{name} missing")
            elif type(getattr(module, name)) is not want:
                problems.append(f"{name} is {type(getattr(module, name)).__name__}, not {want.__name__}")
        for name in _FAST_PATH_FUNCTIONS:
            if not callable(getattr(module, name, None)):
                problems.append(f"{name}() missing")
        if not problems and not all(isinstance(f, KVCacheFormat) for f in module.FORMATS):
            problems.append("FORMATS holds something other than KVCacheFormat")
        if problems:
            raise TypeError(f"fast path {module.__name__} does not provide kvfuse.kernels.router.FastPath: "
                            + "; ".join(problems))
    names = tuple(m.NAME for m in modules)
    if names != gluon_common.FAST_PATH_NAMES:
        raise TypeError(f"the fast paths' NAMEs {names} differ from gluon.common.FAST_PATH_NAMES "
                        f"{gluon_common.FAST_PATH_NAMES} (the names KVFUSE_GLUON_SKIP accepts)")
    return modules


FAST_PATH_MODULES = register_fast_paths(main_latent, main_latent_fp4, flashmla, indexer)
# the fast paths that are on
FAST_PATHS = () if INTERPRET else tuple(m for m in FAST_PATH_MODULES if m.enabled())
GLUON = bool(FAST_PATHS)


# --------------------------------------------------------------------------- routing overrides
class FastPathChoice:
    """What ``fast_paths`` chose for this thread (None fields: the library's own choice), and
    ``fast_calls``: how many calls inside the block a fast path ran (its per-call guard passed)."""

    __slots__ = ("only", "min_rows", "launch_table", "fast_calls")

    def __init__(self, only, min_rows, launch_table):
        self.only, self.min_rows, self.launch_table, self.fast_calls = only, min_rows, launch_table, 0


class _FastPathOverride(threading.local):
    choice = None  # a class default, as config.FORCED's cfg


_fast_override = _FastPathOverride()


@contextlib.contextmanager
def fast_paths(only=None, min_rows: int = None, launch_table=None):
    """Route this thread's calls inside the block (tools and tests; other threads are unaffected):

    - ``only``: a module of FAST_PATH_MODULES or a sequence of them: the fast paths that may take a
      call, in that order, whether or not they are enabled (KVFUSE_GLUON, KVFUSE_GLUON_SKIP); ``()``:
      the portable kernel only. None: the enabled ones, as outside the block.
    - ``min_rows``: replaces every module's MIN_ROWS (1: decode sizes too).
    - ``launch_table``: a function n_rows -> (num_warps, rows, pipeline) that replaces the modules'
      ``launch_table`` (a launch variant under test or being timed).

    Yields a FastPathChoice whose ``fast_calls`` counts the calls a fast path ran. Inside the block
    every launch is computed per call and none is kept for the signature (so a choice never leaks
    into later calls); such launches go through Triton's own launcher, which changes host time,
    not GPU time. force_config still means the portable kernel."""
    if only is not None:
        only = (only,) if only in FAST_PATH_MODULES else only
        if not isinstance(only, (tuple, list)) or any(m not in FAST_PATH_MODULES for m in only):
            raise ValueError(f"fast_paths(only=...) takes modules of FAST_PATH_MODULES, got {only!r}")
        only = tuple(only)
    if min_rows is not None and (type(min_rows) is not int or min_rows < 1):
        raise ValueError(f"fast_paths(min_rows=...) must be an int >= 1, got {min_rows!r}")
    if launch_table is not None and not callable(launch_table):
        raise ValueError(f"fast_paths(launch_table=...) must be a function n_rows -> (num_warps, rows, pipeline), "
                         f"got {launch_table!r}")
    prev = _fast_override.choice
    choice = _fast_override.choice = FastPathChoice(only, min_rows, launch_table)
    try:
        yield choice
    finally:
        _fast_override.choice = prev


# --------------------------------------------------------------------------- routing
def fast_path(plan: Plan, pdl: bool = False):
    """The Gluon fast-path module that takes the plan, or None: the fast paths are on (or chosen by
    ``fast_paths``), one is eligible with at least its MIN_ROWS rows (MIN_ROWS_PDL for a launch with
    programmatic dependent launch, ``pdl``), and no launch configuration of the plain kernel is being
    forced (tests of launch invariance)."""
    if FORCED.cfg is not None:
        return None
    choice = _fast_override.choice
    modules = FAST_PATHS if GLUON else ()
    min_rows = None
    if choice is not None:
        modules = modules if choice.only is None else choice.only
        min_rows = choice.min_rows
    rows = plan.x.shape[0] * plan.x.shape[1]
    for module in modules:
        least = min_rows if min_rows is not None else module.MIN_ROWS_PDL if pdl else module.MIN_ROWS
        if rows >= least and module.eligible(plan):
            return module
    return None


_PDL_CAPABLE = {}       # device index -> compute capability >= 9.0 (griddepcontrol: Hopper and newer)


PDL_OFF, PDL_ON, PDL_EARLY = 0, 1, 2   # pdl_launch's answers


def pdl_launch(x: torch.Tensor) -> int:
    """How this call launches: PDL_OFF, PDL_ON (programmatic dependent launch: kvfuse.set_pdl / KVFUSE_PDL
    on, compiled kernels, x on a Hopper-or-newer GPU) or PDL_EARLY (on, with the opt-in early reads)."""
    if INTERPRET or x.device.type != "cuda":
        return PDL_OFF
    mode = _backend.pdl_mode()
    if mode == "off":
        return PDL_OFF
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    capable = _PDL_CAPABLE.get(index)
    if capable is None:
        capable = _PDL_CAPABLE[index] = torch.cuda.get_device_capability(index)[0] >= 9
    if not capable:
        return PDL_OFF
    return PDL_EARLY if mode == "early" else PDL_ON


def with_pdl(options: dict, pdl: int) -> dict:
    """A kernel's keyword arguments with its PDL constexpr and Triton's launch_pdl option set; under
    PDL_EARLY also its PDL_EARLY constexpr, for the kernels whose options name one (those that read the
    slots and positions before the wait when asked; the others keep every read after it)."""
    if not pdl:
        return options
    out = {**options, "PDL": True, "launch_pdl": True}
    if pdl == PDL_EARLY and "PDL_EARLY" in options:
        out["PDL_EARLY"] = True
    return out


def fused_launch(plan: Plan, tensor_index: dict, num_tensors: int, pdl: bool = False) -> Launch:
    """The fused kernel's launch for ``plan``, its tensors left open (see Launch): a Gluon fast
    path where one applies (whose own precondition, e.g. x and the weight read as 4-byte words, is
    checked per call: ``Launch.guard``), else the plain kernel. ``pdl``: launched with programmatic
    dependent launch."""
    module = fast_path(plan, pdl)
    if module is not None:
        name, grid, args, options, namespace = module.plan_launch(plan, tensor_arg)
        launch = Launch(name, grid, args, with_pdl(options, pdl), tensor_index, num_tensors, namespace,
                        allow_direct=DIRECT_LAUNCH)
        check, fields = module.call_guard(plan)
        x_at = tensor_index["x"]
        launch.guard = (check, tuple(tensor_index.get(f, x_at) for f in fields))
        return launch
    grid, args, options = fused_args(plan, tensor_arg)
    return Launch("fused_kernel", grid, args, with_pdl(options, pdl), tensor_index, num_tensors, globals(),
                  allow_direct=DIRECT_LAUNCH)


def run_plan(plan: Plan, plain: bool = False) -> None:
    """Launch the fused kernel for a validated plan (n >= 1); ``plain``: never a Gluon fast path."""
    x = plan.x

    def tensor(field):  # x stands in for a tensor the plan does not have (never dereferenced)
        t = getattr(plan, field)
        return x if t is None else t

    pdl = pdl_launch(x)
    module = None if plain else fast_path(plan, pdl)
    if module is not None:
        check, fields = module.call_guard(plan)
        if not check(*(tensor(f) for f in fields)):
            module = None
    if module is not None:
        choice = _fast_override.choice
        if choice is None or choice.launch_table is None:
            name, grid, args, options, namespace = module.plan_launch(plan, tensor)
        else:
            name, grid, args, options, namespace = module.plan_launch(plan, tensor, choice.launch_table)
        namespace[name][grid](*args, **with_pdl(options, pdl))
        if choice is not None:
            choice.fast_calls += 1
        return
    grid, args, options = fused_args(plan, tensor)
    fused_kernel[grid](*args, **with_pdl(options, pdl))


def run_template(template, tensors: tuple) -> None:
    """Launch the fused kernel for one call of a validated signature (a kvfuse.plans.types.PlanTemplate):
    its launch parameters are computed on the first launch of each batch size n and kept with the
    template (recomputed, not kept, while force_config is active; inside ``fast_paths`` each call
    is launched as run_plan launches it). n = 0 launches nothing."""
    x = tensors[X]
    n = x.shape[0]
    if n == 0:
        return
    if _fast_override.choice is not None:
        run_plan(template.bind(tensors))
        return
    launches = template.launches
    pdl = pdl_launch(x)
    key = (n, pdl) if pdl else n
    launch = launches.get(key)
    if launch is None or FORCED.cfg is not None:
        launch = fused_launch(template.bind(tensors), template.tensor_index, template.num_tensors, pdl)
        if FORCED.cfg is None:
            if len(launches) >= LAUNCHES_PER_TEMPLATE:
                launches.clear()
            launches[key] = launch
    if not launch.run(tensors):
        # a fast path's guard failed (e.g. x or the weight not 4-byte aligned): the plain kernel, uncached
        run_plan(template.bind(tensors), plain=True)
