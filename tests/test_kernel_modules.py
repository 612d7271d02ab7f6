"""How kvfuse/kernels is put together, on the CPU: the portable kernel's parameters agree wherever they are
listed (fused_rows, fused_kernel, its launch table fused_args, the grouped launch), and the router's
fast-path registry accepts the registered modules and rejects, by name, a module that lacks a member of
the FastPath protocol or has one of the wrong type."""
from __future__ import annotations

import ast
import inspect
import textwrap
import types

import pytest

import kvfuse
from kvfuse.kernels import grouped, portable, router
from kvfuse.kernels.gluon import main_latent
from kvfuse.kernels.launcher import tensor_arg
from kernel_cases import Case, plan_of


def _params(jit_fn):
    """[(name, is constexpr)] of a @triton.jit function, in order."""
    return [(p.name, p.annotation in ("tl.constexpr",)) for p in inspect.signature(jit_fn.fn).parameters.values()]


def test_fused_kernel_takes_fused_rows_parameters_and_pdl():
    rows = _params(portable.fused_rows)
    assert rows[0] == ("pid", False)
    assert _params(portable.fused_kernel) == rows[1:] + [("PDL", True)]
    assert portable.RUNTIME_NAMES == tuple(name for name, const in rows[1:] if not const)
    assert portable.CONSTEXPR_NAMES == tuple(name for name, const in rows if const)


def test_fused_kernel_passes_every_parameter_to_fused_rows_by_its_own_name():
    tree = ast.parse(textwrap.dedent(inspect.getsource(portable.fused_kernel.fn)))
    calls = [c for c in ast.walk(tree) if isinstance(c, ast.Call) and getattr(c.func, "id", None) == "fused_rows"]
    assert len(calls) == 1 and not calls[0].keywords
    passed = [a.id if isinstance(a, ast.Name) else ast.unparse(a) for a in calls[0].args]
    assert passed == ["tl.program_id(0)"] + [name for name, _ in _params(portable.fused_rows)[1:]]


def test_grouped_member_passes_the_tuples_in_fused_rows_order():
    """_member hands fused_rows A[i] / C[i] by position: its call, read back, names fused_rows's parameters."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(grouped._member.fn)))
    (call,) = [c for c in ast.walk(tree) if isinstance(c, ast.Call) and getattr(c.func, "id", None) == "fused_rows"]
    names = []
    for a in call.args[1:]:
        if isinstance(a, ast.Subscript):
            table = grouped.TUPLE_NAMES if a.value.id == "A" else grouped.CONSTEXPR_NAMES
            names.append(table[a.slice.value])
        else:
            names.append(a.id)
    assert names == list(portable.RUNTIME_NAMES + portable.CONSTEXPR_NAMES)


def test_fused_args_fills_the_kernel_signature():
    plan = plan_of(Case(n=3, heads=2, head_dim=128, fmt=None, cast=kvfuse.CastArgs("e4m3", 128, False, "fp32")))
    grid, args, options = portable.fused_args(plan, tensor_arg)
    assert len(args) == len(portable.RUNTIME_NAMES)
    assert set(portable.CONSTEXPR_NAMES) | {"PDL"} <= set(options)
    named = dict(zip(portable.RUNTIME_NAMES, args))
    assert named["n_rows"] == 6 and named["H"] == 2 and named["x_ptr"] == tensor_arg("x")


def _module_like(source, **changes):
    """A stand-in module with every member of ``source`` the protocol names, then ``changes`` (None: removed)."""
    m = types.ModuleType("kvfuse.kernels.gluon.stand_in")
    for name in list(router._FAST_PATH_CONSTANTS) + list(router._FAST_PATH_FUNCTIONS):
        setattr(m, name, getattr(source, name))
    for name, value in changes.items():
        if value is None:
            delattr(m, name)
        else:
            setattr(m, name, value)
    return m


def test_the_registered_fast_paths_provide_the_protocol():
    assert router.register_fast_paths(*router.FAST_PATH_MODULES) == router.FAST_PATH_MODULES
    assert [m.NAME for m in router.FAST_PATH_MODULES] == ["main_latent", "main_latent_fp4", "flashmla", "indexer"]


@pytest.mark.parametrize("changes, said", [
    (dict(call_guard=None), "call_guard() missing"),
    (dict(MIN_ROWS_PDL=None), "MIN_ROWS_PDL missing"),
    (dict(MIN_ROWS="1"), "MIN_ROWS is str, not int"),
    (dict(LAUNCH_TABLE=[(1, (1, 1, False))]), "LAUNCH_TABLE is list, not tuple"),
    (dict(eligible=True), "eligible() missing"),
    (dict(FORMATS=("MAIN_FP8",)), "FORMATS holds something other than KVCacheFormat"),
])
def test_a_module_without_the_protocol_is_rejected_by_name(changes, said):
    stand_in = _module_like(main_latent, **changes)
    others = [m for m in router.FAST_PATH_MODULES if m is not main_latent]
    with pytest.raises(TypeError, match="kvfuse.kernels.gluon.stand_in") as raised:
        router.register_fast_paths(stand_in, *others)
    assert said in str(raised.value)


def test_fast_path_names_must_be_the_ones_kvfuse_gluon_skip_accepts():
    renamed = _module_like(main_latent, NAME="main_latent_v2")
    others = [m for m in router.FAST_PATH_MODULES if m is not main_latent]
    with pytest.raises(TypeError, match="FAST_PATH_NAMES"):
        router.register_fast_paths(renamed, *others)
    with pytest.raises(TypeError, match="FAST_PATH_NAMES"):
        router.register_fast_paths(*others)           # one left out
