"""Validation of the public arguments into a :class:`Plan`: one normalized job that every
backend (the reference chain, the Triton kernel) executes. All checks of SPEC §1-§5 live here
and run before any launch; a rejected call allocates nothing the caller sees and writes nothing.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from .args import CastArgs, ContiguousOutArgs, HadamardArgs, KVCacheOutArgs, NormArgs, RopeArgs
from .formats import PRESETS, KVCacheFormat, RecordAddressing, check_cast_combination

OUT_STAGES = ("norm", "transform", "cast_back")
INDEX_DTYPES = (torch.int32, torch.int64)


@dataclasses.dataclass(frozen=True)
class CastSpec:
    cast_fmt: str           # "e4m3" | "e2m1"
    group: int              # num_per_channels
    sf_format: str          # "ue8m0" | "ue8m0_fp32" | "e4m3" | "fp32"


@dataclasses.dataclass
class Plan:
    """One validated job. Tensors are views of the caller's (no copies)."""
    x: torch.Tensor                          # bf16 [n, H, D], stride(-1) == 1
    weight: Optional[torch.Tensor] = None    # [D] bf16/fp32 contiguous (norm on iff not None)
    eps: float = 0.0
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
                           cast_args.sf_format, quant_dim, what)
    return CastSpec(cast_args.cast_fmt, cast_args.num_per_channels, cast_args.sf_format)


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


def check_bf16_out(out, name, x3_shape, user_shape, device):
    check_tensor(out, name, (torch.bfloat16,), device, shape=user_shape)
    return out.view(x3_shape) if out.dim() == 2 else out


def build_plan(x, norm_args=None, rope_args=None, hadamard_args=None, cast_args=None, out_args=None):
    """Validate everything; return (plan, result) where result is what the call returns
    (None, a tensor, or a (q, sf) tuple; new outputs are allocated here)."""
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
    x3 = x.unsqueeze(1) if x.dim() == 2 else x
    n, H, D = x3.shape
    plan = Plan(x=x3)

    # ---- norm
    if norm_args is not None:
        if not isinstance(norm_args, NormArgs):
            raise TypeError(f"norm_args must be a NormArgs or None, got {type(norm_args).__name__}")
        check_tensor(norm_args.weight, "norm_args.weight", (torch.bfloat16, torch.float32), dev, shape=(D,))
        if not _is_real(norm_args.eps) or norm_args.eps < 0:
            raise ValueError(f"norm_args.eps must be a finite number >= 0, got {norm_args.eps!r}")
        plan.weight, plan.eps = norm_args.weight, float(norm_args.eps)

    # ---- rope
    if rope_args is not None:
        if not isinstance(rope_args, RopeArgs):
            raise TypeError(f"rope_args must be a RopeArgs or None, got {type(rope_args).__name__}")
        r = rope_args.rotary_dim
        if not _is_int(r) or r <= 0 or r % 2 or r > D:
            raise ValueError(f"rope_args.rotary_dim must be an even int in (0, head_dim={D}], got {r!r}")
        off = D - r if rope_args.offset is None else rope_args.offset
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
        plan.positions, plan.cos_sin, plan.rotary_dim, plan.rope_offset = rope_args.positions, cs, r, off
        plan.is_neox, plan.conjugate = rope_args.is_neox, rope_args.conjugate

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
        return _plan_cache(plan, cast_args, out_args, x.shape)
    return _plan_contiguous(plan, cast_args, out_args, x.shape)


def _plan_contiguous(plan, cast_args, out_args, user_shape):
    n, H, D = plan.x.shape
    dev = plan.x.device
    out = sf = None
    if isinstance(out_args, torch.Tensor):
        out = out_args
    elif isinstance(out_args, ContiguousOutArgs):
        out, sf = out_args.out, out_args.sf
    if cast_args is None or cast_args.cast_back:
        if cast_args is not None:
            plan.cast, plan.quant_dim = check_cast_args(cast_args, D), D
        if sf is not None:
            raise ValueError("out_args.sf must be None when the result is a bf16 tensor (no cast, or cast_back)")
        if out is None:
            out = torch.empty(user_shape, dtype=torch.bfloat16, device=dev)
        else:
            check_tensor(out, "out_args.out" if isinstance(out_args, ContiguousOutArgs) else "out_args",
                         (torch.bfloat16,), dev, shape=user_shape)
        plan.out = out.view(plan.x.shape) if out.dim() == 2 else out
        plan.out_stage = "cast_back" if cast_args is not None else "transform"
        return plan, out
    spec = plan.cast = check_cast_args(cast_args, D)
    plan.quant_dim = D
    lead = tuple(user_shape[:-1])
    qshape = lead + (D // 2 if spec.cast_fmt == "e2m1" else D,)
    sshape = lead + (D // spec.group,)
    if out is None:
        out = torch.empty(qshape, dtype=q_dtype(spec.cast_fmt), device=dev)
    else:
        check_tensor(out, "out_args.out", (q_dtype(spec.cast_fmt),), dev, shape=qshape)
    if sf is None:
        sf = torch.empty(sshape, dtype=sf_dtype(spec.sf_format), device=dev)
    else:
        check_tensor(sf, "out_args.sf", (sf_dtype(spec.sf_format),), dev, shape=sshape)
    plan.q_out = out.unsqueeze(1) if out.dim() == 2 else out
    plan.sf_out = sf.unsqueeze(1) if sf.dim() == 2 else sf
    return plan, (out, sf)


def _plan_cache(plan, cast_args, oa: KVCacheOutArgs, user_shape):
    n, H, D = plan.x.shape
    dev = plan.x.device
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
        if stage == "norm" and plan.weight is None:
            raise ValueError("out_args.out_stage='norm' needs norm_args")
        if stage == "cast_back" and not fmt.quantized:
            raise ValueError(f"out_args.out_stage='cast_back' needs a quantized format, got {fmt.name}")
        plan.out = check_bf16_out(oa.out, "out_args.out", plan.x.shape, user_shape, dev)
        plan.out_stage = stage
    plan.kv_cache, plan.slot_mapping, plan.fmt = oa.kv_cache, oa.slot_mapping, fmt
    plan.addressing = fmt.addressing_for(oa.kv_cache)
    return plan, oa.out
