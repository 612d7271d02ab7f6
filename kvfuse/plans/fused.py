"""Validation of the fused operator's arguments (SPEC §1, §2, §6, §7, §9) into a :class:`~.types.PlanTemplate`
(the Plan without its tensors, kept per call signature in the plan cache) and the per-call aliasing
check; ``prepare`` is what every caller runs: validated (or found in the plan cache), the outputs the
call allocates appended to its tensors, the aliasing rules checked (``prepare_keyed``: the same for a
caller that keys the call from its own raw arguments, kvfuse.mla's writes). A rejected call allocates
nothing the caller sees and writes nothing."""
from __future__ import annotations

from typing import Optional

import torch

from ..args import CastArgs, ContiguousOutArgs, HadamardArgs, KVCacheOutArgs, NormArgs
from ..formats import PRESETS, KVCacheFormat, q_dtype, sf_dtype
from ..overlap import INF, OverlapCheck, addresses_known, row_limit, span_terms
from .cache import PLAN_CACHE, norm_args_key, number_key, rope_args_key, rows_key
from .rules import check_cast_args, check_index_vector, check_rope_args, check_tensor, infer_layout, is_real
from .types import (BIAS, COS_SIN, NORM_KINDS, NUM_CALL_TENSORS, OUT_ARG0, OUT_ARG1, OUT_ARG2, OUT_STAGES,
                    POSITIONS, WEIGHT, X, X_TAIL, Plan, PlanTemplate)


def call_tensors(x, norm_args, rope_args, out_args) -> tuple:
    """The tensors of a validated call, in the order above."""
    x, x_tail = x if isinstance(x, tuple) else (x, None)
    w, b = (None, None) if norm_args is None else (norm_args.weight, norm_args.bias)
    pos, cs = (None, None) if rope_args is None else (rope_args.positions, rope_args.cos_sin_cache)
    if isinstance(out_args, KVCacheOutArgs):
        outs = (out_args.kv_cache, out_args.slot_mapping, out_args.out)
    elif isinstance(out_args, ContiguousOutArgs):
        outs = (out_args.out, out_args.sf, None)
    else:
        outs = (out_args, None, None)
    return (x, w, pos, cs) + outs + (b, x_tail)


# =============================================================================== validation
def validate(x, norm_args=None, rope_args=None, hadamard_args=None, cast_args=None, out_args=None) -> PlanTemplate:
    """Check every argument (SPEC §1, §2, §6, §7, §9; ValueError/TypeError naming it) and return the call's template."""
    # ---- x
    x, x_tail, user_shape = _check_x(x)
    dev = x.device
    two_d = x.dim() == 2  # the Plan's tensors get the head axis [n, 1, D]
    n, D = x.shape[0], user_shape[-1]
    H = 1 if two_d else x.shape[1]
    plan = Plan(x=None)
    sources = [("x", X, two_d)]
    if x_tail is not None:
        sources.append(("x_tail", X_TAIL, two_d))

    # ---- a cache whose format disagrees with x: say so first (the norm weight, shaped for the cache's
    # head_dim, would otherwise be blamed for the mismatch)
    if isinstance(out_args, KVCacheOutArgs) and isinstance(out_args.layout, KVCacheFormat) \
            and out_args.layout.head_dim != D:
        raise ValueError(f"out_args.layout {out_args.layout.name} has head_dim {out_args.layout.head_dim}, "
                         f"but x has head_dim {D}")

    # ---- norm
    if norm_args is not None:
        if not isinstance(norm_args, NormArgs):
            raise TypeError(f"norm_args must be a NormArgs or None, got {type(norm_args).__name__}")
        if not isinstance(norm_args.kind, str) or norm_args.kind not in NORM_KINDS:
            raise ValueError(f"norm_args.kind must be one of {NORM_KINDS}, got {norm_args.kind!r}")
        check_tensor(norm_args.weight, "norm_args.weight", (torch.bfloat16, torch.float32), dev)
        if norm_args.weight.dim() != 1 or not 1 <= norm_args.weight.shape[0] <= D:
            raise ValueError(f"norm_args.weight: expected shape (k,) with 1 <= k <= head_dim ({D}) (the norm covers "
                             f"the first k dims), got {tuple(norm_args.weight.shape)}")
        k = norm_args.weight.shape[0]
        # eps > 0: a zero row would otherwise divide by sqrt(0) and write NaN for finite inputs
        if not is_real(norm_args.eps) or norm_args.eps <= 0:
            raise ValueError(f"norm_args.eps must be a finite number > 0, got {norm_args.eps!r}")
        plan.eps = float(norm_args.eps)
        plan.norm_kind = norm_args.kind
        sources.append(("weight", WEIGHT, False))
        if norm_args.bias is not None:
            if norm_args.kind != "layer":
                raise ValueError(f"norm_args.bias needs kind='layer', got kind={norm_args.kind!r}")
            check_tensor(norm_args.bias, "norm_args.bias", (torch.bfloat16, torch.float32), dev, shape=(k,))
            sources.append(("bias", BIAS, False))

    # ---- rope
    if rope_args is not None:
        r, off = check_rope_args(rope_args, D, n, dev, offset_default_tail=True)
        plan.rotary_dim, plan.rope_offset = r, off
        plan.is_neox, plan.conjugate = rope_args.is_neox, rope_args.conjugate
        sources += [("positions", POSITIONS, False), ("cos_sin", COS_SIN, False)]

    # ---- hadamard
    if hadamard_args is not None:
        if not isinstance(hadamard_args, HadamardArgs):
            raise TypeError(f"hadamard_args must be a HadamardArgs or None, got {type(hadamard_args).__name__}")
        if D < 16 or D > 1024 or D & (D - 1):
            raise ValueError(f"hadamard_args: head_dim must be a power of two in [16, 1024], got {D}")
        if not is_real(hadamard_args.scale):
            raise ValueError(f"hadamard_args.scale must be a finite number, got {hadamard_args.scale!r}")
        plan.hadamard_scale = float(hadamard_args.scale)

    # ---- destination
    if cast_args is not None and not isinstance(cast_args, CastArgs):
        raise TypeError(f"cast_args must be a CastArgs or None, got {type(cast_args).__name__}")
    if out_args is not None and not isinstance(out_args, (torch.Tensor, ContiguousOutArgs, KVCacheOutArgs)):
        raise TypeError(f"out_args must be None, a Tensor, ContiguousOutArgs or KVCacheOutArgs, "
                        f"got {type(out_args).__name__}")
    if isinstance(out_args, KVCacheOutArgs):
        allocations, result = _validate_cache(plan, sources, cast_args, out_args, user_shape, (n, H, D), dev,
                                              has_norm=norm_args is not None)
    else:
        allocations, result = _validate_contiguous(plan, sources, cast_args, out_args, user_shape, dev)
    template = PlanTemplate(plan, sources, allocations, dev, result)
    x_arg = x if x_tail is None else (x, x_tail)
    template.overlap = overlap_check(template, call_tensors(x_arg, norm_args, rope_args, out_args), out_args)
    return template


def _check_x(x) -> tuple:
    """(x, x_tail or None, the shape of the rows x stands for) of a valid x: one bf16 tensor [n, D] /
    [n, H, D], or a tuple of two holding its columns apart ([.., d1] and [.., d2], d1 + d2 = D), each
    with stride(-1) == 1; TypeError / ValueError naming x otherwise."""
    pair = isinstance(x, tuple)
    if pair and len(x) != 2:
        raise ValueError(f"x: a tuple must hold two tensors (the columns [0, d1) and [d1, head_dim)), got {len(x)}")
    parts, names = (x, ("x[0]", "x[1]")) if pair else ((x,), ("x",))
    for t, name in zip(parts, names):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor{'' if pair else ' or a tuple of two'}, "
                            f"got {type(t).__name__}")
        if t.dtype != torch.bfloat16:
            raise TypeError(f"{name}: expected dtype torch.bfloat16, got {t.dtype}")
        if t.dim() not in (2, 3):
            raise ValueError(f"{name}: expected [n, head_dim] or [n, num_heads, head_dim], got shape {tuple(t.shape)}")
        if t.dim() == 3 and t.shape[1] == 0:
            raise ValueError(f"{name}: num_heads must be >= 1, got 0")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name}: expected stride(-1) == 1, got {t.stride(-1)}")
    main, tail = parts[0], None
    D = main.shape[-1]
    if pair:
        tail = parts[1]
        if tuple(tail.shape[:-1]) != tuple(main.shape[:-1]):
            raise ValueError(f"x[1]: expected the leading dims of x[0] {tuple(main.shape[:-1])}, got "
                             f"{tuple(tail.shape[:-1])}")
        if tail.device != main.device:
            raise ValueError(f"x[1]: expected device {main.device}, got {tail.device}")
        if main.shape[-1] == 0 or tail.shape[-1] == 0:
            raise ValueError(f"x: each part needs columns, got {main.shape[-1]} and {tail.shape[-1]}")
        D += tail.shape[-1]
    if D % 16 or D == 0:
        raise ValueError(f"x: head_dim must be a positive multiple of 16, got {D}")
    return main, tail, tuple(main.shape[:-1]) + (D,)


def _validate_contiguous(plan, sources, cast_args, out_args, user_shape, dev):
    """Outputs without a cache; returns (allocations, result index)."""
    D = user_shape[-1]
    two_d = len(user_shape) == 2
    allocations = []

    def new_output(shape, dtype):  # allocated per call, after validation (SPEC §2 "new" outputs)
        allocations.append((tuple(shape[1:]), dtype))    # the n rows come from each call's x
        return NUM_CALL_TENSORS + len(allocations) - 1

    out = sf = None
    if isinstance(out_args, torch.Tensor):
        out = out_args
    elif isinstance(out_args, ContiguousOutArgs):
        out, sf = out_args.out, out_args.sf
    out_index, sf_index = OUT_ARG0, OUT_ARG1
    if cast_args is None or cast_args.cast_back:
        if cast_args is not None:
            plan.cast, plan.quant_dim = check_cast_args(cast_args, D), D
        if sf is not None:
            raise ValueError("out_args.sf must be None when the result is a bf16 tensor (no cast, or cast_back)")
        if out is None:
            out_index = new_output(user_shape, torch.bfloat16)
        else:
            check_tensor(out, "out_args.out" if isinstance(out_args, ContiguousOutArgs) else "out_args",
                         (torch.bfloat16,), dev, shape=user_shape)
        sources.append(("out", out_index, two_d))
        plan.out_stage = "cast_back" if cast_args is not None else "transform"
        return allocations, out_index
    spec = plan.cast = check_cast_args(cast_args, D)
    plan.quant_dim = D
    lead = tuple(user_shape[:-1])
    qshape = lead + (D // 2 if spec.cast_fmt == "e2m1" else D,)
    sshape = lead + (D // spec.group,)
    if out is None:
        out_index = new_output(qshape, q_dtype(spec.cast_fmt))
    else:
        check_tensor(out, "out_args.out", (q_dtype(spec.cast_fmt),), dev, shape=qshape)
    if sf is None:
        sf_index = new_output(sshape, sf_dtype(spec.sf_format))
    else:
        check_tensor(sf, "out_args.sf", (sf_dtype(spec.sf_format),), dev, shape=sshape)
    sources += [("q_out", out_index, two_d), ("sf_out", sf_index, two_d)]
    return allocations, (out_index, sf_index)


def _validate_cache(plan, sources, cast_args, oa: KVCacheOutArgs, user_shape, x3_shape, dev, has_norm):
    """A paged-cache destination; returns (allocations, result index)."""
    n, H, D = x3_shape
    fmt = oa.layout
    if fmt is None:
        fmt = infer_layout(oa.kv_cache, cast_args)
    elif not isinstance(fmt, KVCacheFormat):
        raise TypeError(f"out_args.layout must be a KVCacheFormat or None, got {type(fmt).__name__}")
    fmt.check_cache(oa.kv_cache, "out_args.kv_cache")
    if oa.kv_cache.device != dev:
        raise ValueError(f"out_args.kv_cache: expected device {dev}, got {oa.kv_cache.device}")
    if fmt.head_dim != D:
        raise ValueError(f"out_args.layout {fmt.name} has head_dim {fmt.head_dim}, but x has head_dim {D}")
    if oa.kv_cache.shape[2] != H:
        raise ValueError(f"out_args.kv_cache: num_heads must equal x's ({H}), got {oa.kv_cache.shape[2]}")
    if fmt.quantized:
        if cast_args is None:
            raise ValueError(f"cast_args must be {CastArgs.from_cache_format(fmt)} for the {fmt.name} cache, got None")
        plan.cast = check_cast_args(cast_args, fmt.quant_dim)
        if cast_args.cast_back:
            raise ValueError("cast_args.cast_back must be False with a KV cache (use out_stage='cast_back')")
        if cast_args != CastArgs.from_cache_format(fmt):
            raise ValueError(f"cast_args must match the cache format {fmt.name}: expected "
                             f"{CastArgs.from_cache_format(fmt)}, got {cast_args}")
        plan.quant_dim = fmt.quant_dim
    elif cast_args is not None:
        raise ValueError(f"cast_args must be None for the bf16 cache {fmt.name}, got {cast_args}")
    check_index_vector(oa.slot_mapping, "out_args.slot_mapping", n, dev)
    stage = oa.out_stage
    if stage is not None and stage not in OUT_STAGES:
        raise ValueError(f"out_args.out_stage must be one of {OUT_STAGES} or None, got {stage!r}")
    if oa.out is not None:
        if stage is None:
            raise ValueError(f"out_args.out_stage must be one of {OUT_STAGES} when out_args.out is given, got None")
        if stage == "norm" and not has_norm:
            raise ValueError("out_args.out_stage='norm' needs norm_args")
        if stage == "cast_back" and not fmt.quantized:
            raise ValueError(f"out_args.out_stage='cast_back' needs a quantized format, got {fmt.name}")
        check_tensor(oa.out, "out_args.out", (torch.bfloat16,), dev, shape=user_shape)
        sources.append(("out", OUT_ARG2, len(user_shape) == 2))
        plan.out_stage = stage
    sources += [("kv_cache", OUT_ARG0, False), ("slot_mapping", OUT_ARG1, False)]
    plan.fmt = fmt
    plan.addressing = fmt.addressing_for(oa.kv_cache)
    return (), OUT_ARG2  # returns out_args.out (None when not given)


# =============================================================================== aliasing (SPEC §9)
ROW_FIELDS = frozenset(("x", "x_tail", "positions", "slot_mapping", "out", "q_out", "sf_out"))   # validated [n, ...]
OUTPUT_FIELDS = frozenset(Plan.WRITES)
_INPUT_NAMES = {"x": "x", "x_tail": "x[1]", "weight": "norm_args.weight", "bias": "norm_args.bias", "positions": "rope_args.positions",
                "cos_sin": "rope_args.cos_sin_cache"}
_ARGUMENT_NAMES = {  # Plan tensor field -> the call argument it comes from, per kind of out_args
    "tensor": {**_INPUT_NAMES, "out": "out_args", "q_out": "out_args"},
    "contiguous": {**_INPUT_NAMES, "out": "out_args.out", "q_out": "out_args.out", "sf_out": "out_args.sf"},
    "cache": {**_INPUT_NAMES, "out": "out_args.out", "kv_cache": "out_args.kv_cache",
              "slot_mapping": "out_args.slot_mapping"},
}


def argument_names(out_args) -> dict:
    """Plan tensor field -> the name of the call argument it comes from."""
    if isinstance(out_args, KVCacheOutArgs):
        return _ARGUMENT_NAMES["cache"]
    return _ARGUMENT_NAMES["tensor" if isinstance(out_args, torch.Tensor) else "contiguous"]


def overlap_check(template: PlanTemplate, tensors: tuple, out_args) -> Optional[OverlapCheck]:
    """The aliasing rules of a validated call (SPEC §9; see kvfuse.overlap): raises ValueError for an
    output that overlaps itself, and returns the per-call check of the overlaps that depend on data
    pointers (None when the call has no output of the caller's, on meta tensors, or while tracing)."""
    if not addresses_known(template.device):
        return None
    n = tensors[X].shape[0]
    arg_names = argument_names(out_args)
    items, names, outputs = [], [], []
    limit, limit_name, out_pos, x_pos = INF, None, None, None
    for field, i, _ in template.sources:
        if i >= NUM_CALL_TENSORS:
            continue                     # allocated by the call: overlaps nothing
        t = tensors[i]
        rows = field in ROW_FIELDS
        output = field in OUTPUT_FIELDS
        if output and rows:
            rows_ok = row_limit(t, arg_names[field])   # raises when one row overlaps itself
            if rows_ok < limit:
                limit, limit_name = rows_ok, arg_names[field]
        terms = span_terms(t, rows)
        if terms is None:
            continue                     # no bytes
        if output:
            outputs.append(len(items))
            if field == "out":
                out_pos = len(items)
        elif field == "x":
            x_pos = len(items)
        items.append((i,) + terms)
        names.append(arg_names.get(field, field))
    if not outputs and limit == INF:
        return None
    check = OverlapCheck(items, outputs, tuple(names), row_limit_=limit, limit_name=limit_name)
    if out_pos is not None and x_pos is not None:
        check.inplace = (out_pos, x_pos)
        check.inplace_strides = tensors[items[out_pos][0]].stride() == tensors[X].stride()
    if n > limit:
        check(tensors, n)                # raises (the rows of an output overlap at this n)
    return check


# =============================================================================== entry
def prepare(x, norm_args=None, rope_args=None, hadamard_args=None, cast_args=None, out_args=None):
    """(template, tensors) of a call: validated (or found in the plan cache), with the outputs it
    allocates appended to its tensors and the aliasing rules checked (eagerly: not while tracing).
    Raises ValueError/TypeError for a bad call."""
    key = template = None
    if PLAN_CACHE.enabled and not torch.compiler.is_compiling():
        try:        # the key and the call's tensors in one pass over the arguments
            key, pinned, tensors = _key_and_tensors(x, norm_args, rope_args, hadamard_args, cast_args, out_args)
            template = PLAN_CACHE.lookup(key)
        except Exception:  # an argument that cannot be keyed (a wrong type, unhashable): validation says why
            key = None
    if template is None:
        template = validate(x, norm_args, rope_args, hadamard_args, cast_args, out_args)
        if key is not None:
            PLAN_CACHE.store(key, template, pinned)
        tensors = call_tensors(x, norm_args, rope_args, out_args)
    return template, _with_outputs(template, tensors)


def _with_outputs(template, tensors: tuple) -> tuple:
    """The call's tensors with the outputs it allocates, after the aliasing rules: whether outputs overlap
    depends on data pointers, so it is checked on every call (out may be x: the kernels read every x they
    need before writing that part of out)."""
    tensors = template.new_outputs(tensors)
    if template.overlap is not None:
        template.overlap(tensors, tensors[X].shape[0])
    return tensors


def prepare_keyed(key, pinned: tuple, tensors: tuple, make_call):
    """(template, tensors) of a call that a caller keyed from its own raw arguments (kvfuse.mla's writes: no
    argument object built on a hit). ``key`` must determine every value validation and ``call_signature``
    would read of the call ``make_call()`` returns (a FusedCall), and ``tensors`` be that call's tensors in
    call_tensors' order. A miss builds the call (raising what it raises), prepares it as ``prepare`` does
    and stores its template under ``key`` too (``pinned``: the objects ``key`` names by id). The outputs and
    the aliasing rules are checked on every call, as in ``prepare``."""
    try:
        template = PLAN_CACHE.lookup(key)
    except TypeError:      # an unhashable value in the key: validated every time (and rejected when invalid)
        key = template = None
    if template is None:
        call = make_call()
        template, tensors = prepare(call.x, call.norm_args, call.rope_args, call.hadamard_args, call.cast_args,
                                    call.out_args)
        if key is not None:   # the template's own key may pin other objects: it keeps both sets
            PLAN_CACHE.store(key, template, tuple({id(o): o for o in template.pinned + pinned}.values()))
        return template, tensors
    return template, _with_outputs(template, tensors)


def build_plan(x, norm_args=None, rope_args=None, hadamard_args=None, cast_args=None, out_args=None):
    """Validate everything; return (plan, result) where result is what the call returns
    (None, a tensor, or a (q, sf) tuple; new outputs are allocated here)."""
    template, tensors = prepare(x, norm_args, rope_args, hadamard_args, cast_args, out_args)
    return template.bind(tensors), template.result(tensors)


def call_signature(x, norm_args, rope_args, hadamard_args, cast_args, out_args):
    """(key, pinned) of a fused-operator call (see "plan cache" above). Raises for arguments it does not
    key (a wrong type, an argument object of another class: a subclass too): those calls are validated
    every time."""
    key, pinned, _ = _key_and_tensors(x, norm_args, rope_args, hadamard_args, cast_args, out_args)
    return key, pinned


def _key_and_tensors(x, norm_args, rope_args, hadamard_args, cast_args, out_args):
    """(key, pinned, tensors) of a call in one pass over its arguments: its key (see "plan cache" in
    kvfuse.plans.cache) and its tensors in call_tensors' order. Numbers validation takes only when > 0
    (eps) are keyed without their sign; the Hadamard scale, which may be -0.0, with it."""
    if type(x) is tuple:
        x, x_tail = x                   # raises unless two: validation says why
        n = x.shape[0]
        x_key = (tuple, rows_key(x, n), rows_key(x_tail, n))
    else:
        x_tail = None
        n = x.shape[0]
        x_key = rows_key(x, n)
    norm_key, w = norm_args_key(norm_args)
    b = None if norm_args is None else norm_args.bias
    rope_key = rope_args_key(rope_args, n)
    pos, cs = (None, None) if rope_args is None else (rope_args.positions, rope_args.cos_sin_cache)
    if hadamard_args is None:
        hadamard_key = None
    elif type(hadamard_args) is HadamardArgs:
        hadamard_key = number_key(hadamard_args.scale)
    else:
        raise TypeError("not keyed")
    if cast_args is None:
        cast_key = None
    elif type(cast_args) is CastArgs:
        c = cast_args
        cast_key = (type(c.cast_fmt), c.cast_fmt, type(c.num_per_channels), c.num_per_channels, type(c.round_sf),
                    c.round_sf, type(c.sf_format), c.sf_format, type(c.cast_back), c.cast_back,
                    type(c.scale_floor), c.scale_floor)
    else:
        raise TypeError("not keyed")
    pinned = ()
    if out_args is None:
        out_key = None
        outs = (None, None, None)
    elif type(out_args) is KVCacheOutArgs:
        oa, stage, layout = out_args, out_args.out_stage, out_args.layout
        cache, slots, out = oa.kv_cache, oa.slot_mapping, oa.out
        pinned = (layout,) if layout is not None else tuple(PRESETS.values())
        out_key = (KVCacheOutArgs, type(cache), cache.dtype, cache.shape, cache.stride(), cache.device,
                   cache.data_ptr() % 16, rows_key(slots, n), None if out is None else rows_key(out, n),
                   type(stage), stage, layout is None, tuple(map(id, pinned)))
        outs = (cache, slots, out)
    elif type(out_args) is ContiguousOutArgs:
        out, sf = out_args.out, out_args.sf
        out_key = (ContiguousOutArgs, None if out is None else rows_key(out, n),
                   None if sf is None else rows_key(sf, n))
        outs = (out, sf, None)
    elif isinstance(out_args, torch.Tensor):
        out_key = rows_key(out_args, n)
        outs = (out_args, None, None)
    else:
        raise TypeError("not keyed")
    key = ("fused", x_key, norm_key, rope_key, hadamard_key, cast_key, out_key)
    return key, pinned, (x, w, pos, cs) + outs + (b, x_tail)
