"""The plan types: one validated job per entry point, the only thing the backends read.

Each plan is a dataclass of the caller's tensors (views, no copies) and the scalars validation
derived. Its custom op (:mod:`kvfuse.ops`) is derived from its fields (:mod:`kvfuse.plans.opargs`):
``OP`` names the op, ``WRITES`` the tensor fields the op mutates, and fields marked ``derived`` are
recomputed from the others rather than passed. The reference chain (:mod:`kvfuse.reference`) and the
kernels (:mod:`kvfuse.kernels`) import this module and nothing else of validation.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import ClassVar, List, Optional

import torch

from ..formats import KVCacheFormat, RecordAddressing
from .. import gqa_formats

OUT_STAGES = ("norm", "transform", "cast_back")
NORM_KINDS = ("rms", "layer")
INDEX_DTYPES = (torch.int32, torch.int64)
GQA_LAYOUTS = ("NHD", "HND")
MAX_GROUP_CALLS = 4   # calls of one kvfuse.fused_group launch (kvfuse/kernels/grouped.py holds four members)

DERIVED = {"derived": True}   # field metadata: recomputed after a plan comes back from op arguments


@dataclasses.dataclass(frozen=True)
class CastSpec:
    cast_fmt: str           # "e4m3" | "e2m1"
    group: int              # num_per_channels
    sf_format: str          # "ue8m0" | "ue8m0_fp32" | "e4m3" | "fp32"
    floor_exp: Optional[int] = None   # scale_floor as ceil(log2): the smallest scale 2^floor_exp (ue8m0 kinds)


@dataclasses.dataclass
class Plan:
    """One validated call of the fused operator. Tensors are views of the caller's (no copies)."""
    OP: ClassVar[str] = "fused_norm_rope_hadamard_cast_store"
    WRITES: ClassVar[tuple] = ("out", "q_out", "sf_out", "kv_cache")

    x: torch.Tensor                          # bf16 [n, H, D] (or its first d1 columns), stride(-1) == 1
    x_tail: Optional[torch.Tensor] = None    # bf16 [n, H, D - d1]: x's columns d1.. held apart (two inputs)
    weight: Optional[torch.Tensor] = None    # [k] bf16/fp32 contiguous, k <= D (norm on iff not None)
    eps: float = 0.0
    norm_kind: str = "rms"                   # "rms" | "layer" (NORM_KINDS)
    bias: Optional[torch.Tensor] = None      # [k] bf16/fp32 contiguous (LayerNorm only)
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
    addressing: Optional[RecordAddressing] = dataclasses.field(default=None, metadata=DERIVED)

    def derive(self) -> None:
        self.addressing = None if self.kv_cache is None else self.fmt.addressing_for(self.kv_cache)

    @property
    def n(self) -> int:
        return self.x.shape[0]

    @property
    def num_heads(self) -> int:
        return self.x.shape[1]

    @property
    def head_dim(self) -> int:
        return self.x.shape[2] + (0 if self.x_tail is None else self.x_tail.shape[2])

    @property
    def paged_append(self) -> bool:
        return self.append_batch_indices is not None

    @property
    def split(self) -> int:
        """The columns x holds when a second input holds the rest (x_tail), else 0."""
        return 0 if self.x_tail is None else self.x.shape[2]

    @property
    def norm_dim(self) -> int:
        """The leading dims the norm covers (the others pass through it), 0 without a norm."""
        return 0 if self.weight is None else self.weight.shape[0]

    @property
    def device(self) -> torch.device:
        return self.x.device

    @property
    def capacity(self) -> Optional[int]:
        return None if self.kv_cache is None else self.kv_cache.shape[0] * self.kv_cache.shape[1]


PLAN_FIELDS = tuple(f.name for f in dataclasses.fields(Plan))


@dataclasses.dataclass
class GQAPlan:
    """One validated call of :func:`kvfuse.fused_qk_norm_rope_store_kv`. Tensors are the caller's."""
    OP: ClassVar[str] = "fused_qk_norm_rope_store_kv"
    WRITES: ClassVar[tuple] = ("k_cache", "v_cache", "q_out", "k_out", "q_out_tail", "k_out_tail", "k_cache_tail",
                               "k_scale_cache", "v_scale_cache")

    q: torch.Tensor                           # bf16 / fp16 / fp32 [n, Hq, D], stride(-1) == 1
    k: torch.Tensor                           # q's dtype [n, Hkv, D], stride(-1) == 1
    v: Optional[torch.Tensor]                 # q's dtype [n, Hkv, Dv], stride(-1) == 1 (without caches: not read, may be None)
    k_cache: Optional[torch.Tensor]           # q's dtype / float8_e4m3fn, NHD [NB, BS, Hkv, D] or HND [NB, Hkv, BS, D]
    v_cache: Optional[torch.Tensor]           # the same dtype and layout, last dim Dv (both None: no cache write)
    slot_mapping: Optional[torch.Tensor]      # int32 / int64 [n] (None without caches)
    q_out: Optional[torch.Tensor] = None      # q's dtype [n, Hq, D], stride(-1) == 1 (may be q itself)
    q_weight: Optional[torch.Tensor] = None   # [D] bf16 / fp32 (q norm on iff given)
    q_eps: float = 1e-6
    k_weight: Optional[torch.Tensor] = None   # [D] bf16 / fp32 (k norm on iff given)
    k_eps: float = 1e-6
    positions: Optional[torch.Tensor] = None  # int32 / int64 [n] (RoPE on iff given)
    cos_sin: Optional[torch.Tensor] = None    # [P, rotary_dim] fp32 / bf16, stride(-1) == 1
    rotary_dim: int = 0
    rope_offset: int = 0
    is_neox: bool = True
    conjugate: bool = False
    k_scale: Optional[torch.Tensor] = None    # fp32, one element or [Hkv] (fp8 caches only)
    v_scale: Optional[torch.Tensor] = None
    layout: str = "NHD"
    numerics: str = "staged"                  # a kvfuse.numerics_profiles.PROFILES name
    k_out: Optional[torch.Tensor] = None      # without caches: q's dtype / float8_e4m3fn [n, Hkv, D] receiving k (may be k)
    # a head held as two tensors: q, k, q_out, k_out, k_cache above hold its first ``split`` columns and
    # these the rest (None: the tensor above holds the whole head)
    q_tail: Optional[torch.Tensor] = None
    k_tail: Optional[torch.Tensor] = None
    q_out_tail: Optional[torch.Tensor] = None
    k_out_tail: Optional[torch.Tensor] = None
    k_cache_tail: Optional[torch.Tensor] = None
    q_scale: Optional[torch.Tensor] = None    # fp32, one element (float8_e4m3fn q_out only)
    # the scales given as numbers (then every scale of the call is one, and the tensor fields are None)
    q_scale_value: Optional[float] = None
    k_scale_value: Optional[float] = None
    v_scale_value: Optional[float] = None
    scale_convention: str = "divide"          # "divide": e4m3(x / scale) (vLLM); "multiply": e4m3(x * scale) (FlashInfer)
    # FlashInfer's append addressing instead of slot_mapping (kvfuse.args.PagedAppend; all four or none)
    append_batch_indices: Optional[torch.Tensor] = None
    append_positions: Optional[torch.Tensor] = None
    append_kv_indptr: Optional[torch.Tensor] = None
    append_kv_indices: Optional[torch.Tensor] = None
    # the formats of k's destination and of v_cache (kvfuse.gqa_formats preset names), and the scale
    # caches a stored-scale format writes (fp32, the cache's shape minus its last dim for "token_head")
    k_format: str = "auto"
    v_format: str = "auto"
    k_scale_cache: Optional[torch.Tensor] = None
    v_scale_cache: Optional[torch.Tensor] = None

    @property
    def n(self) -> int:
        return self.q.shape[0]

    @property
    def k_fmt(self) -> "gqa_formats.GQACacheFormat":
        return gqa_formats.PRESETS[self.k_format]

    @property
    def v_fmt(self) -> "gqa_formats.GQACacheFormat":
        return gqa_formats.PRESETS[self.v_format]

    @property
    def paged_append(self) -> bool:
        return self.append_batch_indices is not None

    @property
    def split(self) -> int:
        """The first part's width of the heads held as two tensors (0: none is)."""
        for first, tail in ((self.q, self.q_tail), (self.k, self.k_tail), (self.q_out, self.q_out_tail),
                            (self.k_out, self.k_out_tail), (self.k_cache, self.k_cache_tail)):
            if tail is not None:
                return first.shape[-1]
        return 0

    @property
    def head_dim(self) -> int:
        return self.k.shape[2] + (0 if self.k_tail is None else self.k_tail.shape[2])

    @property
    def has_v(self) -> bool:
        """V is written (with caches: v and v_cache given; a K cache alone otherwise)."""
        return self.v_cache is not None

    @property
    def k_fp8(self) -> bool:
        """k's destination (k_cache, or k_out without caches) holds e4m3 codes."""
        dst = self.k_cache if self.k_cache is not None else self.k_out
        return dst is not None and dst.dtype == torch.float8_e4m3fn

    @property
    def q_fp8(self) -> bool:
        return self.q_out is not None and self.q_out.dtype == torch.float8_e4m3fn

    @property
    def scales_by_value(self) -> bool:
        return any(v is not None for v in (self.q_scale_value, self.k_scale_value, self.v_scale_value))

    @property
    def device(self) -> torch.device:
        return self.q.device

    @property
    def has_cache(self) -> bool:
        return self.k_cache is not None

    @property
    def fp8(self) -> bool:
        return self.k_cache is not None and self.k_cache.dtype == torch.float8_e4m3fn

    @property
    def block_size(self) -> int:
        if self.k_cache is None:
            return 0
        return self.k_cache.shape[1] if self.layout == "NHD" else self.k_cache.shape[2]

    @property
    def capacity(self) -> Optional[int]:
        """Slots of the caches: num_blocks * block_size (None without caches)."""
        return None if self.k_cache is None else self.k_cache.shape[0] * self.block_size

    def cache_strides(self, cache: torch.Tensor) -> tuple:
        """(block, token, head) strides in elements of ``cache`` under the plan's layout."""
        s = cache.stride()
        return (s[0], s[1], s[2]) if self.layout == "NHD" else (s[0], s[2], s[1])


class _SlotsPlan:
    """What the cache store and load plans share: n is the slots' count, the device the cache's."""

    __slots__ = ()

    @property
    def n(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def device(self) -> torch.device:
        return self.kv_cache.device

    @property
    def capacity(self) -> int:
        return self.kv_cache.shape[0] * self.kv_cache.shape[1]


@dataclasses.dataclass(slots=True)
class StorePlan(_SlotsPlan):
    """One validated call of :func:`kvfuse.store_kv_cache` (``entry``: its plan-cache entry, where the
    Triton launch parameters are kept; looked up again when the plan comes back from op arguments)."""
    OP: ClassVar[str] = "store_kv_cache"
    WRITES: ClassVar[tuple] = ("kv_cache",)

    data: torch.Tensor
    sf: Optional[torch.Tensor]
    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    tail: Optional[torch.Tensor]
    fmt: KVCacheFormat
    entry: Optional["CacheEntry"] = dataclasses.field(default=None, metadata=DERIVED)


@dataclasses.dataclass(slots=True)
class LoadPlan(_SlotsPlan):
    """One validated call of :func:`kvfuse.load_paged_kv_cache`. Through the custom op the outputs
    are allocated first (``out`` when dequantizing, else ``data_out`` and ``sf_out``) and the op
    writes them; an eager call returns what the backend allocated."""
    OP: ClassVar[str] = "load_paged_kv_cache"
    WRITES: ClassVar[tuple] = ("out", "data_out", "sf_out")

    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    fmt: KVCacheFormat
    dequantize: bool = True
    out: Optional[torch.Tensor] = None
    data_out: Optional[torch.Tensor] = None
    sf_out: Optional[torch.Tensor] = None
    entry: Optional["CacheEntry"] = dataclasses.field(default=None, metadata=DERIVED)

    def allocate_outputs(self) -> None:
        n, nh, dev = self.slot_mapping.shape[0], self.kv_cache.shape[2], self.kv_cache.device
        if self.dequantize:
            self.out = torch.empty((n, nh, self.fmt.head_dim), dtype=torch.bfloat16, device=dev)
        else:
            self.data_out = torch.empty((n, nh, self.fmt.data_bytes), dtype=torch.uint8, device=dev)
            self.sf_out = torch.empty((n, nh, self.fmt.sf_bytes), dtype=torch.uint8, device=dev)

    def outputs(self):
        return self.out if self.dequantize else (self.data_out, self.sf_out)


@dataclasses.dataclass
class GroupPlan:
    """Validated calls of the fused operator that touch no common output (:func:`kvfuse.fused_group`)."""
    OP: ClassVar[str] = "fused_group"
    members: List[Plan]

    @property
    def device(self) -> torch.device:
        return self.members[0].x.device


# =============================================================================== the plan cache's entries
# The tensors of one fused-operator call, by position: x (its first input when x is a pair), the norm
# weight, positions, cos_sin, then out_args' tensors (a Tensor: itself; ContiguousOutArgs: out, sf;
# KVCacheOutArgs: kv_cache, slot_mapping, out), then the norm bias, then x's second input; None where
# absent. The outputs a call allocates follow them.
X, WEIGHT, POSITIONS, COS_SIN, OUT_ARG0, OUT_ARG1, OUT_ARG2, BIAS, X_TAIL = range(9)
NUM_CALL_TENSORS = 9
LAUNCHES_PER_TEMPLATE = 64


class CacheEntry:
    """What the plan cache keeps for one validated signature (never a tensor: a cache entry keeps
    no caller memory alive). ``launch``: the Triton launch parameters, filled by the kernels' router
    on the first launch."""

    __slots__ = ("launch", "pinned", "recently_used", "overlap")

    def __init__(self):
        self.launch = None
        self.overlap = None          # the per-call kvfuse.overlap.OverlapCheck, None when no output can overlap
        self.pinned = ()             # the objects the key names by id: held, so no other object takes their id
        self.recently_used = False   # PlanCache's eviction bookkeeping


class PlanTemplate(CacheEntry):
    """A validated call signature of the fused operator: its Plan without the tensors.

    ``new_outputs(tensors)`` appends the outputs the call allocates to its call tensors;
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
        # the key leaves n out (see kvfuse.plans.cache): Triton launch parameters per n, filled by the
        # kernels' router (a few sizes recur in an engine; the dict is emptied past LAUNCHES_PER_TEMPLATE)
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
