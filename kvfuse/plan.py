"""Validation of the public arguments into a :class:`Plan`: one normalized job that every
backend (the reference chain, the Triton kernel) executes. All checks of SPEC §1-§5 live here
and run before any launch; a rejected call allocates nothing the caller sees and writes nothing.

Validation produces a :class:`PlanTemplate` (the Plan without its tensors); ``template.bind``
makes one call's Plan from that call's tensors. Templates are kept per call signature in the
plan cache (see "plan cache" below): a repeated call skips validation and, on the Triton
backend, reuses its launch parameters.
"""
from __future__ import annotations

import dataclasses
import math
import operator
import threading
from typing import NamedTuple, Optional

import torch

from .args import CastArgs, ContiguousOutArgs, HadamardArgs, KVCacheOutArgs, NormArgs, RopeArgs
from .backend import env_flag
from .formats import PRESETS, KVCacheFormat, RecordAddressing, check_cast_combination, scale_floor_exponent
from .overlap import INF, OverlapCheck, row_limit, span_terms

OUT_STAGES = ("norm", "transform", "cast_back")
NORM_KINDS = ("rms", "layer")
INDEX_DTYPES = (torch.int32, torch.int64)


@dataclasses.dataclass(frozen=True)
class CastSpec:
    cast_fmt: str           # "e4m3" | "e2m1"
    group: int              # num_per_channels
    sf_format: str          # "ue8m0" | "ue8m0_fp32" | "e4m3" | "fp32"
    floor_exp: Optional[int] = None   # scale_floor as ceil(log2): the smallest scale 2^floor_exp (ue8m0 kinds)


@dataclasses.dataclass
class Plan:
    """One validated job. Tensors are views of the caller's (no copies)."""
    x: torch.Tensor                          # bf16 [n, H, D], stride(-1) == 1
    weight: Optional[torch.Tensor] = None    # [D] bf16/fp32 contiguous (norm on iff not None)
    eps: float = 0.0
    norm_kind: str = "rms"                   # "rms" | "layer" (NORM_KINDS)
    bias: Optional[torch.Tensor] = None      # [D] bf16/fp32 contiguous (LayerNorm only)
    positions: Optional[torch.Tensor] = None  # int32/int64 [n] (rope on iff not None)
    cos_sin: Optional[torch.Tensor] = None   # [P, rotary_dim] fp32/bf16, stride(-1) == 1
    rotary_dim: int = 0
    rope_offset: int = 0
    is_neox: bool = True
    conjugate: bool = False
    hadamard_scale: Optional[float] = None   # hadamard on iff not None
    cast: Optional[CastSpec] = None
    quant_dim: int = 0                       # dims covered by the cast (D - bf16 tail)
    out: Optional[torch.Tensor] = None       # bf16 [n, H, D], stride(-1) == 1
    out_stage: Optional[str] = None          # which stage `out` receives (OUT_STAGES)
    q_out: Optional[torch.Tensor] = None     # [n, H, quant bytes]: float8_e4m3fn, or uint8 (e2m1 packed)
    sf_out: Optional[torch.Tensor] = None    # [n, H, quant_dim / g]: uint8 / float8_e4m3fn / float32
    kv_cache: Optional[torch.Tensor] = None  # uint8 [NB, BS, H, bytes_per_token]
    slot_mapping: Optional[torch.Tensor] = None  # int32/int64 [n]
    fmt: Optional[KVCacheFormat] = None
    addressing: Optional[RecordAddressing] = None

    @property
    def n(self) -> int:
        return self.x.shape[0]

    @property
    def num_heads(self) -> int:
        return self.x.shape[1]

    @property
    def head_dim(self) -> int:
        return self.x.shape[2]


PLAN_FIELDS = tuple(f.name for f in dataclasses.fields(Plan))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def check_tensor(t, name, dtypes, device, shape=None, last_contiguous=True):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if last_contiguous and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name}: expected stride(-1) == 1, got {t.stride(-1)}")


def check_rope_args(rope_args, head_dim: int, n: int, dev, offset_default_tail: bool = True) -> tuple:
    """(rotary_dim, offset) of a valid RopeArgs for rows of ``head_dim`` (offset None: the tail, or 0
    when not ``offset_default_tail``); TypeError / ValueError naming the field otherwise. Shared by the
    fused entry point and fused_qk_norm_rope_store_kv."""
    if not isinstance(rope_args, RopeArgs):
        raise TypeError(f"rope_args must be a RopeArgs or None, got {type(rope_args).__name__}")
    D = head_dim
    r = rope_args.rotary_dim
    if not _is_int(r) or r <= 0 or r % 2 or r > D:
        raise ValueError(f"rope_args.rotary_dim must be an even int in (0, head_dim={D}], got {r!r}")
    off = rope_args.offset if rope_args.offset is not None else (D - r if offset_default_tail else 0)
    if not _is_int(off) or off < 0 or off + r > D:
        raise ValueError(f"rope_args.offset must be an int with 0 <= offset and offset + rotary_dim <= "
                         f"head_dim ({D}), got offset={off!r}, rotary_dim={r}")
    for flag in ("is_neox", "conjugate"):
        if not isinstance(getattr(rope_args, flag), bool):
            raise TypeError(f"rope_args.{flag} must be a bool, got {type(getattr(rope_args, flag)).__name__}")
    check_index_vector(rope_args.positions, "rope_args.positions", n, dev)
    cs = rope_args.cos_sin_cache
    check_tensor(cs, "rope_args.cos_sin_cache", (torch.float32, torch.bfloat16), dev)
    if cs.dim() != 2 or cs.shape[1] != r:
        raise ValueError(f"rope_args.cos_sin_cache: expected shape [max_position, rotary_dim={r}], "
                         f"got {tuple(cs.shape)}")
    return r, off


def check_index_vector(t, name, n, device):
    check_tensor(t, name, INDEX_DTYPES, device, last_contiguous=False)
    if t.dim() != 1 or t.shape[0] != n:
        raise ValueError(f"{name}: expected shape ({n},), got {tuple(t.shape)}")


def q_dtype(cast_fmt: str) -> torch.dtype:
    return torch.float8_e4m3fn if cast_fmt == "e4m3" else torch.uint8


def sf_dtype(sf_format: str) -> torch.dtype:
    return {"ue8m0": torch.uint8, "e4m3": torch.float8_e4m3fn}.get(sf_format, torch.float32)


def check_cast_args(cast_args, quant_dim, what="cast_args") -> CastSpec:
    if not isinstance(cast_args, CastArgs):
        raise TypeError(f"{what} must be a CastArgs or None, got {type(cast_args).__name__}")
    if not isinstance(cast_args.cast_back, bool):
        raise TypeError(f"{what}.cast_back must be a bool, got {type(cast_args.cast_back).__name__}")
    check_cast_combination(cast_args.cast_fmt, cast_args.num_per_channels, cast_args.round_sf,
                           cast_args.sf_format, quant_dim, what, cast_args.scale_floor)
    floor = cast_args.scale_floor
    return CastSpec(cast_args.cast_fmt, cast_args.num_per_channels, cast_args.sf_format,
                    None if floor is None else scale_floor_exponent(floor))


def infer_layout(kv_cache: torch.Tensor, cast_args) -> KVCacheFormat:
    """The one preset whose bytes_per_token equals kv_cache's last dim and whose cast equals cast_args."""
    if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() == 0:
        raise TypeError(f"out_args.kv_cache must be a 4-d torch.Tensor, got {type(kv_cache).__name__}")
    want = None if cast_args is None else dataclasses.replace(cast_args, cast_back=False)
    hits = [f for f in PRESETS.values()
            if f.bytes_per_token == kv_cache.shape[-1] and CastArgs.from_cache_format(f) == want]
    if len(hits) != 1:
        raise ValueError(f"out_args.layout is None and {len(hits)} presets match bytes_per_token="
                         f"{kv_cache.shape[-1]} with cast {want}: {[f.name for f in hits]}; pass layout=")
    return hits[0]


# =============================================================================== call tensors
# The tensors of one call, by position: x, the norm weight, positions, cos_sin, then out_args'
# tensors (a Tensor: itself; ContiguousOutArgs: out, sf; KVCacheOutArgs: kv_cache, slot_mapping,
# out), then the norm bias; None where absent. The outputs a call allocates follow them.
X, WEIGHT, POSITIONS, COS_SIN, OUT_ARG0, OUT_ARG1, OUT_ARG2, BIAS = range(8)
NUM_CALL_TENSORS = 8
MAX_GROUP_CALLS = 4   # calls of one kvfuse.fused_group launch (kvfuse/kernels/grouped.py holds four members)


def call_tensors(x, norm_args, rope_args, out_args) -> tuple:
    """The tensors of a validated call, in the order above."""
    w, b = (None, None) if norm_args is None else (norm_args.weight, norm_args.bias)
    pos, cs = (None, None) if rope_args is None else (rope_args.positions, rope_args.cos_sin_cache)
    if isinstance(out_args, KVCacheOutArgs):
        outs = (out_args.kv_cache, out_args.slot_mapping, out_args.out)
    elif isinstance(out_args, ContiguousOutArgs):
        outs = (out_args.out, out_args.sf, None)
    else:
        outs = (out_args, None, None)
    return (x, w, pos, cs) + outs + (b,)


class CacheEntry:
    """What the plan cache keeps for one validated signature (never a tensor: a cache entry keeps
    no caller memory alive). ``launch``: the Triton launch parameters, filled by
    kvfuse.kernels.router on the first launch."""

    __slots__ = ("launch", "pinned", "recently_used", "overlap")

    def __init__(self):
        self.launch = None
        self.overlap = None          # the per-call kvfuse.overlap.OverlapCheck, None when no output can overlap
        self.pinned = ()             # the objects the key names by id: held, so no other object takes their id
        self.recently_used = False   # PlanCache's eviction bookkeeping


class PlanTemplate(CacheEntry):
    """A validated call signature of the fused operator: its Plan without the tensors.

    ``new_outputs(tensors)`` appends the outputs the call allocates to its :func:`call_tensors`;
    ``bind(tensors)`` is then the call's Plan and ``result(tensors)`` what the call returns.
    """

    __slots__ = ("plan", "sources", "tensor_index", "num_tensors", "allocations", "device", "device_type", "result",
                 "launchable", "launches")

    def __init__(self, plan: Plan, sources, allocations, device, result_index):
        super().__init__()
        self.plan = plan                         # every tensor field None
        self.sources = tuple(sources)            # (Plan field, index in the tensors, insert the head axis)
        self.tensor_index = {field: i for field, i, _ in self.sources}
        self.allocations = tuple(allocations)    # (shape without its n rows, dtype) of each output the call allocates
        self.num_tensors = NUM_CALL_TENSORS + len(self.allocations)
        self.device = device
        self.device_type = device.type
        # what the call returns: one of its tensors (None for a cache without out) or the (q, sf) pair
        self.result = operator.itemgetter(*result_index) if isinstance(result_index, tuple) \
            else operator.itemgetter(result_index)
        self.launchable = self.device_type != "meta"   # and n > 0, a property of the call
        # the key leaves n out (see call_signature): Triton launch parameters per n, filled by
        # kvfuse.kernels.router (a few sizes recur in an engine; the dict is emptied past LAUNCHES_PER_TEMPLATE)
        self.launches = {}

    def new_outputs(self, tensors: tuple) -> tuple:
        if not self.allocations:
            return tensors
        dev, n = self.device, tensors[X].shape[0]
        return tensors + tuple(torch.empty((n,) + tail, dtype=dtype, device=dev) for tail, dtype in self.allocations)

    def bind(self, tensors: tuple) -> Plan:
        if torch.compiler.is_compiling():
            # dynamo (torch 2.11) cannot trace __dict__.update: a plain constructor call instead
            plan = Plan(**{name: getattr(self.plan, name) for name in PLAN_FIELDS})
        else:
            plan = Plan.__new__(Plan)  # a shallow copy of the template plan (copy.copy costs 3x more)
            plan.__dict__.update(self.plan.__dict__)
        for field, i, add_heads in self.sources:
            t = tensors[i]
            setattr(plan, field, t.unsqueeze(1) if add_heads else t)
        return plan


# =============================================================================== validation
def validate(x, norm_args=None, rope_args=None, hadamard_args=None, cast_args=None, out_args=None) -> PlanTemplate:
    """Check every argument (SPEC §1-§5; ValueError/TypeError naming it) and return the call's template."""
    # ---- x
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"x: expected dtype torch.bfloat16, got {x.dtype}")
    if x.dim() not in (2, 3):
        raise ValueError(f"x: expected [n, head_dim] or [n, num_heads, head_dim], got shape {tuple(x.shape)}")
    if x.shape[-1] % 16 or x.shape[-1] == 0:
        raise ValueError(f"x: head_dim must be a positive multiple of 16, got {x.shape[-1]}")
    if x.dim() == 3 and x.shape[1] == 0:
        raise ValueError("x: num_heads must be >= 1, got 0")
    if x.stride(-1) != 1:
        raise ValueError(f"x: expected stride(-1) == 1, got {x.stride(-1)}")
    dev = x.device
    two_d = x.dim() == 2  # the Plan's tensors get the head axis [n, 1, D]
    n, D = x.shape[0], x.shape[-1]
    H = 1 if two_d else x.shape[1]
    plan = Plan(x=None)
    sources = [("x", X, two_d)]

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
        check_tensor(norm_args.weight, "norm_args.weight", (torch.bfloat16, torch.float32), dev, shape=(D,))
        # eps > 0: a zero row would otherwise divide by sqrt(0) and write NaN for finite inputs
        if not _is_real(norm_args.eps) or norm_args.eps <= 0:
            raise ValueError(f"norm_args.eps must be a finite number > 0, got {norm_args.eps!r}")
        plan.eps = float(norm_args.eps)
        plan.norm_kind = norm_args.kind
        sources.append(("weight", WEIGHT, False))
        if norm_args.bias is not None:
            if norm_args.kind != "layer":
                raise ValueError(f"norm_args.bias needs kind='layer', got kind={norm_args.kind!r}")
            check_tensor(norm_args.bias, "norm_args.bias", (torch.bfloat16, torch.float32), dev, shape=(D,))
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
        if not _is_real(hadamard_args.scale):
            raise ValueError(f"hadamard_args.scale must be a finite number, got {hadamard_args.scale!r}")
        plan.hadamard_scale = float(hadamard_args.scale)

    # ---- destination
    if cast_args is not None and not isinstance(cast_args, CastArgs):
        raise TypeError(f"cast_args must be a CastArgs or None, got {type(cast_args).__name__}")
    if out_args is not None and not isinstance(out_args, (torch.Tensor, ContiguousOutArgs, KVCacheOutArgs)):
        raise TypeError(f"out_args must be None, a Tensor, ContiguousOutArgs or KVCacheOutArgs, "
                        f"got {type(out_args).__name__}")
    if isinstance(out_args, KVCacheOutArgs):
        allocations, result = _validate_cache(plan, sources, cast_args, out_args, x.shape, (n, H, D), dev,
                                              has_norm=norm_args is not None)
    else:
        allocations, result = _validate_contiguous(plan, sources, cast_args, out_args, x.shape, dev)
    template = PlanTemplate(plan, sources, allocations, dev, result)
    template.overlap = overlap_check(template, call_tensors(x, norm_args, rope_args, out_args), out_args)
    return template


def _validate_contiguous(plan, sources, cast_args, out_args, user_shape, dev):
    """Outputs without a cache; returns (allocations, result index)."""
    D = user_shape[-1]
    two_d = len(user_shape) == 2
    allocations = []

    def new_output(shape, dtype):  # allocated per call, after validation (SPEC §3 "new" outputs)
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


# =============================================================================== aliasing (SPEC §5)
ROW_FIELDS = frozenset(("x", "positions", "slot_mapping", "out", "q_out", "sf_out"))   # validated [n, ...]
OUTPUT_FIELDS = frozenset(("out", "q_out", "sf_out", "kv_cache"))
_INPUT_NAMES = {"x": "x", "weight": "norm_args.weight", "bias": "norm_args.bias", "positions": "rope_args.positions",
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
    """The aliasing rules of a validated call (SPEC §5; see kvfuse.overlap): raises ValueError for an
    output that overlaps itself, and returns the per-call check of the overlaps that depend on data
    pointers (None when the call has no output of the caller's, on meta tensors, or while tracing)."""
    if template.device_type == "meta" or torch.compiler.is_compiling():
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
    allocates appended to its tensors. Raises ValueError/TypeError for a bad call."""
    template = validated(call_signature, validate, x, norm_args, rope_args, hadamard_args, cast_args, out_args)
    return template, template.new_outputs(call_tensors(x, norm_args, rope_args, out_args))


def build_plan(x, norm_args=None, rope_args=None, hadamard_args=None, cast_args=None, out_args=None):
    """Validate everything; return (plan, result) where result is what the call returns
    (None, a tensor, or a (q, sf) tuple; new outputs are allocated here)."""
    template, tensors = prepare(x, norm_args, rope_args, hadamard_args, cast_args, out_args)
    if template.overlap is not None:   # eager calls of kvfuse.ops (None while tracing): the aliasing rules
        template.overlap(tensors, tensors[X].shape[0])
    return template.bind(tensors), template.result(tensors)


# =============================================================================== plan cache
# Validated signatures of the fused operator, store_kv_cache and load_paged_kv_cache (kvfuse.api)
# are kept with what validation produced, so that a repeated call skips validation and, on the
# Triton backend, reuses its launch parameters. A key holds every value that validation (above,
# formats.check_cache, formats.addressing_for, check_cast_combination, infer_layout, the checks of
# kvfuse.api) and the launch parameters (kvfuse.kernels.portable) read, and no tensor:
# - per tensor: its type, dtype, shape, strides and device, where a leading dim equal to the call's
#   n (x's leading dim) is written ROWS, so the key holds for every batch size: the rules that read
#   n compare those dims with it, and a dim that differs from n keys its value (a miss, then the
#   error); new outputs get the call's n; the Triton launch is kept per n with the template.
#   check_tensor, check_index_vector,
#   check_cache, addressing_for and the launches read nothing else of a tensor, with one
#   exception: the fused kernel's record alignments (kvfuse.kernels.portable.record_alignments) read
#   the cache's data_ptr() % 16, which joins the key (tensor_alignment). Otherwise a data pointer
#   (storage offset included) is taken from the call's own tensor at every launch;
# - per argument object: its exact class (a subclass is validated on every call) and every field
#   that is not a tensor, each as (type, value): True, 1 and 1.0 compare equal but validate
#   differently, and floats also by sign (-0.0 == 0.0, but scales by them differ);
# - the layout by identity (a KVCacheFormat is frozen), or with layout=None the identities of the
#   formats.PRESETS values that infer_layout chooses from (monkeypatching a preset is a miss); the
#   entry pins these objects, so no other object can take their ids while it exists.
# Read on every call instead: the backend, KVFUSE_CHECKS (the data checks), force_config and
# router.fast_paths (the launch parameters are recomputed while one is active) and the tensors' data
# pointers (the entry's
# OverlapCheck compares them on every call: whether outputs overlap inputs or each other depends
# on addresses, which the key does not hold); the cache is bypassed while
# torch.compiler.is_compiling(). The environment that kvfuse.kernels.config reads at import
# (TRITON_INTERPRET, KVFUSE_NATIVE_CASTS) is constant. Only validated calls are stored: a
# rejected call is validated, and raises, every time.
PLAN_CACHE_SIZE = 512
LAUNCHES_PER_TEMPLATE = 64
ROWS = "n"  # in a key: this dim equals the call's n (x's leading dim)


class PlanCacheInfo(NamedTuple):
    hits: int          # keyed calls that skipped validation
    misses: int        # keyed calls that were validated (and stored when valid)
    size: int
    maxsize: int
    enabled: bool


class PlanCache:
    """Key -> CacheEntry, at most ``maxsize`` entries. A lookup is one dict read (atomic: no lock);
    stores and evictions take the lock (the hit/miss counts may miss an increment under
    concurrent calls). Eviction is second-chance (CLOCK): the oldest entry goes unless it was hit
    since it was stored or last spared, an LRU approximation that costs a hit one flag write."""

    def __init__(self, maxsize: int = PLAN_CACHE_SIZE, enabled: bool = True):
        self.maxsize = maxsize
        self.enabled = enabled
        self.hits = self.misses = 0
        self._entries = {}  # insertion-ordered: the oldest first
        self._lock = threading.Lock()

    def lookup(self, key) -> Optional[CacheEntry]:
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
        else:
            entry.recently_used = True
            self.hits += 1
        return entry

    def store(self, key, entry: CacheEntry, pinned: tuple) -> None:
        entry.pinned = pinned
        with self._lock:
            entries = self._entries
            entries[key] = entry
            while len(entries) > self.maxsize:
                oldest = next(iter(entries))
                spared = entries.pop(oldest)
                if spared.recently_used:  # hit since stored or last spared: back to the end of the line
                    spared.recently_used = False
                    entries[oldest] = spared

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0

    def info(self) -> PlanCacheInfo:
        return PlanCacheInfo(self.hits, self.misses, len(self._entries), self.maxsize, self.enabled)


PLAN_CACHE = PlanCache(enabled=env_flag("KVFUSE_PLAN_CACHE", True))


def validated(signature, validate_call, *args) -> CacheEntry:
    """The entry of a call: found by ``signature(*args)`` -> (key, pinned) in the plan cache, or
    ``validate_call(*args)`` (which raises for a bad call) and stored. ``signature`` may raise or
    return key None for arguments it does not key: those calls are validated every time."""
    if not PLAN_CACHE.enabled or torch.compiler.is_compiling():
        return validate_call(*args)
    try:
        key, pinned = signature(*args)
        entry = None if key is None else PLAN_CACHE.lookup(key)
    except Exception:  # an argument that cannot be keyed (a wrong type, unhashable): validation says why
        key = entry = None
    if entry is None:
        entry = validate_call(*args)
        if key is not None:
            PLAN_CACHE.store(key, entry, pinned)
    return entry


def set_plan_cache(enabled: bool) -> None:
    """Turn the plan cache on or off (KVFUSE_PLAN_CACHE=0 at import starts with it off); while off,
    every call is validated and nothing is looked up or stored."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    PLAN_CACHE.enabled = enabled


def plan_cache_enabled() -> bool:
    return PLAN_CACHE.enabled


def clear_plan_cache() -> None:
    """Forget every entry and zero the hit/miss counts."""
    PLAN_CACHE.clear()


def plan_cache_info() -> PlanCacheInfo:
    return PLAN_CACHE.info()


# ---- keys
def tensor_key(t):
    return (type(t), t.dtype, t.shape, t.stride(), t.device)


def tensor_alignment(t):
    """data_ptr() % 16 (the fused kernel's record-alignment hints depend on it; a meta tensor's is 0;
    a tensor whose data_ptr() raises leaves its call unkeyed, see validated)."""
    return t.data_ptr() % 16


def rows_key(t, n):
    """tensor_key with a leading dim equal to the call's n written as ROWS: the key of a call does not
    depend on its batch size. A tensor whose leading dim is not n keys that dim's value (a wrong
    length is a miss, then validation says why)."""
    shape = t.shape
    return (type(t), t.dtype, (ROWS if shape[0] == n else shape[0],) + tuple(shape[1:]), t.stride(), t.device)


def optional_rows_key(t, n):
    return None if t is None else rows_key(t, n)


def optional_tensor_key(t):
    return None if t is None else tensor_key(t)


def number_key(v):
    return (type(v), v, math.copysign(1.0, v)) if isinstance(v, float) else (type(v), v)


_NO_KEY = (None, ())


def call_signature(x, norm_args, rope_args, hadamard_args, cast_args, out_args):
    """(key, pinned) of a fused-operator call (see "plan cache" above); key None for an argument
    object of a class kvfuse does not key. May raise for arguments of the wrong types."""
    n = x.shape[0]
    if norm_args is None:
        norm_key = None
    elif type(norm_args) is NormArgs:
        norm_key = (tensor_key(norm_args.weight), number_key(norm_args.eps), optional_tensor_key(norm_args.bias),
                    type(norm_args.kind), norm_args.kind)
    else:
        return _NO_KEY
    if rope_args is None:
        rope_key = None
    elif type(rope_args) is RopeArgs:
        r = rope_args
        rope_key = (rows_key(r.positions, n), tensor_key(r.cos_sin_cache), type(r.rotary_dim), r.rotary_dim,
                    type(r.offset), r.offset, type(r.is_neox), r.is_neox, type(r.conjugate), r.conjugate)
    else:
        return _NO_KEY
    if hadamard_args is None:
        hadamard_key = None
    elif type(hadamard_args) is HadamardArgs:
        hadamard_key = number_key(hadamard_args.scale)
    else:
        return _NO_KEY
    if cast_args is None:
        cast_key = None
    elif type(cast_args) is CastArgs:
        c = cast_args
        cast_key = (type(c.cast_fmt), c.cast_fmt, type(c.num_per_channels), c.num_per_channels, type(c.round_sf),
                    c.round_sf, type(c.sf_format), c.sf_format, type(c.cast_back), c.cast_back,
                    type(c.scale_floor), c.scale_floor)
    else:
        return _NO_KEY
    pinned = ()
    if out_args is None:
        out_key = None
    elif type(out_args) is KVCacheOutArgs:
        oa, stage, layout = out_args, out_args.out_stage, out_args.layout
        pinned = (layout,) if layout is not None else tuple(PRESETS.values())
        out_key = (KVCacheOutArgs, tensor_key(oa.kv_cache), tensor_alignment(oa.kv_cache), rows_key(oa.slot_mapping, n),
                   optional_rows_key(oa.out, n), type(stage), stage, layout is None, tuple(map(id, pinned)))
    elif type(out_args) is ContiguousOutArgs:
        out_key = (ContiguousOutArgs, optional_rows_key(out_args.out, n), optional_rows_key(out_args.sf, n))
    elif isinstance(out_args, torch.Tensor):
        out_key = rows_key(out_args, n)
    else:
        return _NO_KEY
    return ("fused", rows_key(x, n), norm_key, rope_key, hadamard_key, cast_key, out_key), pinned
