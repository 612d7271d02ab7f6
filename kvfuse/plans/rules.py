"""The argument checks the entry points share: tensors (dtype, device, shape, last-dim stride),
index vectors, RoPE arguments, cast arguments, and the cache preset a call's bytes imply. Each raises
TypeError / ValueError naming the argument ("expected X, got Y")."""
from __future__ import annotations

import dataclasses
import math

import torch

from ..args import CastArgs, NormArgs, RopeArgs
from ..formats import PRESETS, KVCacheFormat, check_cast_combination, scale_floor_exponent
from .types import INDEX_DTYPES, CastSpec


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_real(v) -> bool:
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


def check_rope_args(rope_args, head_dim: int, n: int, dev, offset_default_tail: bool = True,
                    table_dtypes=(torch.float32, torch.bfloat16), mrope: bool = False) -> tuple:
    """(rotary_dim, offset) of a valid RopeArgs for rows of ``head_dim`` (offset None: the tail, or 0
    when not ``offset_default_tail``; cos_sin_cache of one of ``table_dtypes``; mRoPE only where
    ``mrope``); TypeError / ValueError naming the field otherwise. Shared by the fused entry point and
    fused_qk_norm_rope_store_kv."""
    if not isinstance(rope_args, RopeArgs):
        raise TypeError(f"rope_args must be a RopeArgs or None, got {type(rope_args).__name__}")
    D = head_dim
    r = rope_args.rotary_dim
    if not is_int(r) or r <= 0 or r % 2 or r > D:
        raise ValueError(f"rope_args.rotary_dim must be an even int in (0, head_dim={D}], got {r!r}")
    off = rope_args.offset if rope_args.offset is not None else (D - r if offset_default_tail else 0)
    if not is_int(off) or off < 0 or off + r > D:
        raise ValueError(f"rope_args.offset must be an int with 0 <= offset and offset + rotary_dim <= "
                         f"head_dim ({D}), got offset={off!r}, rotary_dim={r}")
    for flag in ("is_neox", "conjugate", "mrope_interleaved"):
        if not isinstance(getattr(rope_args, flag), bool):
            raise TypeError(f"rope_args.{flag} must be a bool, got {type(getattr(rope_args, flag)).__name__}")
    if rope_args.mrope_section is None:
        if rope_args.mrope_interleaved:
            raise ValueError("rope_args.mrope_interleaved: True without an mrope_section")
        check_index_vector(rope_args.positions, "rope_args.positions", n, dev)
    else:
        if not mrope:
            raise ValueError("rope_args.mrope_section: mRoPE is not supported by this entry point (only by "
                             "fused_qk_norm_rope_store_kv); pass mrope_section=None")
        check_mrope_section(rope_args.mrope_section, r)
        check_tensor(rope_args.positions, "rope_args.positions", INDEX_DTYPES, dev, last_contiguous=False)
        if tuple(rope_args.positions.shape) != (3, n):
            raise ValueError(f"rope_args.positions: with an mrope_section expected shape (3, {n}) (temporal, "
                             f"height, width rows), got {tuple(rope_args.positions.shape)}")
    cs = rope_args.cos_sin_cache
    check_tensor(cs, "rope_args.cos_sin_cache", table_dtypes, dev)
    if cs.dim() != 2 or cs.shape[1] != r:
        raise ValueError(f"rope_args.cos_sin_cache: expected shape [max_position, rotary_dim={r}], "
                         f"got {tuple(cs.shape)}")
    return r, off


def check_mrope_section(section, rotary_dim: int) -> None:
    """mRoPE's (t, h, w): a tuple or list of three positive ints summing to rotary_dim / 2."""
    if not isinstance(section, (tuple, list)) or len(section) != 3 or not all(is_int(s) and s > 0 for s in section):
        raise ValueError(f"rope_args.mrope_section must be three positive ints (t, h, w), got {section!r}")
    if sum(section) != rotary_dim // 2:
        raise ValueError(f"rope_args.mrope_section must sum to rotary_dim / 2 = {rotary_dim // 2}, got "
                         f"{tuple(section)} (sum {sum(section)})")


def check_index_vector(t, name, n, device):
    check_tensor(t, name, INDEX_DTYPES, device, last_contiguous=False)
    if t.dim() != 1 or t.shape[0] != n:
        raise ValueError(f"{name}: expected shape ({n},), got {tuple(t.shape)}")

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


def check_rms_norm(args, name, D, dev, allow_weightless=False):
    """(weight, eps) of a QK-norm's NormArgs (an RMSNorm without bias; weight bf16, fp16 or fp32: all read
    as fp32 exactly, or None where ``allow_weightless``), (None, 1e-6) for None."""
    if args is None:
        return None, 1e-6
    if not isinstance(args, NormArgs):
        raise TypeError(f"{name} must be a NormArgs or None, got {type(args).__name__}")
    if args.kind != "rms":
        raise ValueError(f"{name}.kind must be 'rms' (the QK-norm is an RMSNorm), got {args.kind!r}")
    if args.bias is not None:
        raise ValueError(f"{name}.bias must be None (RMSNorm has no bias)")
    if args.weight is not None or not allow_weightless:
        check_tensor(args.weight, f"{name}.weight", (torch.bfloat16, torch.float16, torch.float32), dev, shape=(D,))
    if not is_real(args.eps) or args.eps <= 0:
        raise ValueError(f"{name}.eps must be a finite number > 0, got {args.eps!r}")
    return args.weight, float(args.eps)
