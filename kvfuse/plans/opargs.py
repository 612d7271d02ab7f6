"""A plan as a custom op's arguments and back, derived from the plan type's dataclass fields.

Every field of a plan type (:mod:`.types`) becomes op arguments by its annotation: a tensor field
``Tensor`` / ``Tensor?`` (``Tensor(a!)`` when the type's ``WRITES`` names it), ``int`` / ``float`` /
``bool`` / ``str`` (``?`` when Optional) a scalar, and a dataclass field (CastSpec, KVCacheFormat) its
own fields under the field's name, with a ``has_<field>`` flag when it is Optional. Fields marked
``derived`` are left out and recomputed (``plan.derive()``). So an op's schema, its flattening and its
inverse are written once, here, for every plan type; a new field of a plan is a new op argument.

A :class:`~.types.GroupPlan` is one op call for several fused-operator plans: every member's read
tensors as one ``Tensor?[]`` (None where absent), the written tensors that are present as one mutated
``Tensor(a!)[]``, and per member one string holding which written tensors are present and its scalars.
"""
from __future__ import annotations

import dataclasses
import functools
import typing
from typing import NamedTuple

import torch

from ..formats import PRESETS, KVCacheFormat
from .types import GroupPlan, Plan

_SCALARS = {int: "int", float: "float", bool: "bool", str: "str"}
_PLACEHOLDER = {"int": 0, "float": 0.0, "bool": False, "str": ""}   # a required field of an absent dataclass
_CAST = {"int": int, "float": float, "bool": bool}


class Leaf(NamedTuple):
    path: tuple           # attribute names from the plan: ("eps",), ("cast", "group")
    kind: str             # "Tensor" | "int" | "float" | "bool" | "str" | "has" (an Optional dataclass is present)
    optional: bool
    written: bool

    @property
    def name(self) -> str:
        return ("has_" + self.path[0]) if self.kind == "has" else "_".join(self.path)


def _unwrap(hint):
    """(base type, optional) of an annotation."""
    if typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(hint))
    return hint, False


_LEAVES = {}   # plan type -> its leaves (a plain dict: torch.compile traces a lookup, not typing's machinery)


def leaves(cls) -> tuple:
    """The op arguments of a plan type (or of a dataclass field's type, ``path`` relative to it)."""
    found = _LEAVES.get(cls)
    if found is None:
        found = _LEAVES[cls] = _leaves_of(cls)
    return found


def _leaves_of(cls) -> tuple:
    hints = typing.get_type_hints(cls)
    writes = getattr(cls, "WRITES", ())
    out = []
    for f in dataclasses.fields(cls):
        if f.metadata.get("derived"):
            continue
        base, optional = _unwrap(hints[f.name])
        if base is torch.Tensor:
            out.append(Leaf((f.name,), "Tensor", optional, f.name in writes))
        elif base in _SCALARS:
            out.append(Leaf((f.name,), _SCALARS[base], optional, False))
        elif dataclasses.is_dataclass(base):
            if optional:
                out.append(Leaf((f.name,), "has", False, False))
            out += [Leaf((f.name,) + sub.path, sub.kind, sub.optional, False) for sub in leaves(base)]
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: no op argument for the annotation {hints[f.name]!r}")
    return tuple(out)


def schema(cls) -> str:
    """The op schema of a plan type: ``name(args) -> ()``."""
    parts, alias = [], iter("abcdefghijklmnopqrstuvwxyz")
    for leaf in leaves(cls):
        kind = "bool" if leaf.kind == "has" else leaf.kind
        if leaf.written:
            kind += f"({next(alias)}!)"
        parts.append(f"{kind}{'?' if leaf.optional else ''} {leaf.name}")
    return f"{cls.OP}({', '.join(parts)}) -> ()"


def _get(plan, leaf: Leaf):
    v = plan
    for i, attr in enumerate(leaf.path):
        v = getattr(v, attr)
        if v is None and i + 1 < len(leaf.path):      # inside an absent Optional dataclass
            return None if leaf.optional else _PLACEHOLDER[leaf.kind]
    if leaf.kind == "has":
        return v is not None
    if v is None or leaf.kind in ("Tensor", "str"):
        return v
    return _CAST[leaf.kind](v)


def flatten(plan) -> tuple:
    """The positional arguments of ``plan``'s op (its type's leaves computed first: :func:`schema`
    does it for every op at import)."""
    return tuple(_get(plan, leaf) for leaf in _LEAVES[type(plan)])


def canonical_format(fmt: KVCacheFormat) -> KVCacheFormat:
    """The preset object itself when a rebuilt format equals one (kernels may compare by identity)."""
    preset = PRESETS.get(fmt.name)
    return preset if preset == fmt else fmt


@functools.lru_cache(maxsize=256)
def _nested(cls, items: tuple):
    """A dataclass field's value (CastSpec, KVCacheFormat: frozen) from its fields, built once per values:
    an op's implementation runs on every call of a compiled graph."""
    obj = cls(**dict(items))
    return canonical_format(obj) if cls is KVCacheFormat else obj


_RECIPES = {}   # plan type -> (the leaves' targets, the nested fields' types)


def _recipe(cls):
    found = _RECIPES.get(cls)
    if found is None:
        hints = typing.get_type_hints(cls)
        targets = tuple(("has", leaf.path[0], None) if leaf.kind == "has" else
                        ("top", leaf.path[0], None) if len(leaf.path) == 1 else
                        ("nested", leaf.path[0], leaf.path[1]) for leaf in leaves(cls))
        nested = {t[1]: _unwrap(hints[t[1]])[0] for t in targets if t[0] == "nested"}
        found = _RECIPES[cls] = (targets, nested)
    return found


def unflatten(cls, args):
    """The plan of op arguments (inverse of :func:`flatten`), its derived fields recomputed."""
    targets, nested_types = _recipe(cls)
    top, nested, present = {}, {}, {}
    for (kind, name, sub), value in zip(targets, args):
        if kind == "top":
            top[name] = value
        elif kind == "has":
            present[name] = value
        else:
            nested.setdefault(name, []).append((sub, value))
    for name, items in nested.items():
        top[name] = _nested(nested_types[name], tuple(items)) if present.get(name, True) else None
    plan = cls(**top)
    if hasattr(plan, "derive"):
        plan.derive()
    return plan


# --------------------------------------------------------------------------- a group of fused plans
GROUP_SCHEMA = f"{GroupPlan.OP}(Tensor?[] inputs, Tensor(a!)[] outputs, str[] members) -> ()"
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


def flatten_group(group: GroupPlan) -> tuple:
    """(inputs, outputs, members) of the group op."""
    inputs, outputs, members = [], [], []
    for plan in group.members:
        present, scalars = [], []
        for leaf, v in zip(leaves(Plan), flatten(plan)):
            if leaf.kind != "Tensor":
                scalars.append(_token(v))
            elif not leaf.written:
                inputs.append(v)
            else:
                present.append("1" if v is not None else "0")
                if v is not None:
                    outputs.append(v)
        members.append(_SEP.join(["".join(present)] + scalars))
    return inputs, outputs, members


def unflatten_group(inputs, outputs, members) -> GroupPlan:
    plan_leaves = leaves(Plan)
    num_inputs = sum(leaf.kind == "Tensor" and not leaf.written for leaf in plan_leaves)
    plans, at_in, at_out = [], 0, 0
    for record in members:
        head, *tokens = record.split(_SEP)
        present, scalars = iter(c == "1" for c in head), iter(_value(t) for t in tokens)
        args = []
        for leaf in plan_leaves:
            if leaf.kind != "Tensor":
                args.append(next(scalars))
            elif not leaf.written:
                args.append(inputs[at_in])
                at_in += 1
            elif next(present):
                args.append(outputs[at_out])
                at_out += 1
            else:
                args.append(None)
        assert at_in % num_inputs == 0
        plans.append(unflatten(Plan, args))
    return GroupPlan(plans)
