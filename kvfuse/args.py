"""Argument objects of :func:`kvfuse.fused_norm_rope_hadamard_cast_store_kvcache` (SPEC §1).

They only hold values: every check runs when the operator is called, before any launch, so a
bad object raises ValueError/TypeError there with the argument's name.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from .formats import POWER_OF_TWO_SF_FORMATS, KVCacheFormat


@dataclasses.dataclass(frozen=True, eq=False)
class NormArgs:
    """A norm over head_dim, or over its first k dims (SPEC §6), of each (token, head) row.

    kind "rms" (RMSNorm): ``y = bf16((x * rstd) * w)``, ``rstd = 1 / sqrt(mean(x^2) + eps)``.
    kind "layer" (LayerNorm, DeepSeek V3.2's indexer K): ``d = x - mean(x)``,
    ``y = bf16(((d * rstd) * w) + b)``, ``rstd = 1 / sqrt(mean(d^2) + eps)``; without a bias the
    ``+ b`` is left out. Sums use the adjacent-pairs tree.

    weight (and bias): [k], 1 <= k <= head_dim, bf16 or fp32 (fp16 too for the GQA entry, which takes
    [head_dim] only), contiguous: the norm covers the first k
    dims, the others pass through it unchanged (k = head_dim: the whole row). eps: a finite float > 0
    (used as fp32). bias: only with kind "layer". weight None: a weightless RMSNorm ``y = x * rstd``
    (Gemma 4's V-norm), accepted only as the GQA entry's ``v_norm_args``.
    """
    weight: Optional[torch.Tensor]
    eps: float = 1e-6
    bias: Optional[torch.Tensor] = None
    kind: str = "rms"


@dataclasses.dataclass(frozen=True, eq=False)
class RopeArgs:
    """Rotary embedding on dims [offset, offset + rotary_dim) of every head.

    positions: int32/int64 [n], one per token (shared by its heads); a position outside
    [0, max_position) rotates by the identity. cos_sin_cache: [max_position, rotary_dim] fp32
    (bf16 accepted; fp16 too for the GQA entry), cos in the first rotary_dim/2 columns, sin in the last; last dim contiguous.
    is_neox: pairs (offset + j, offset + half + j); else interleaved pairs (offset + 2j, offset + 2j + 1).
    offset: defaults to head_dim - rotary_dim (the tail). conjugate: rotate by -angle.

    mRoPE (Qwen2-VL / Qwen2.5-VL / Qwen3-VL; the GQA entry only): ``mrope_section`` (t, h, w), three
    positive ints summing to rotary_dim / 2, and positions int32/int64 [3, n] (rows: temporal, height,
    width). Frequency j (pair j) takes its cos / sin from the table row of positions[row(j), token]:
    chunked (``mrope_interleaved`` False, Qwen2/2.5-VL) row(j) = 0 for j < t, 1 for t <= j < t + h, 2
    after; interleaved (Qwen3-VL) row(j) = 1 when j % 3 == 1 and j < 3h, 2 when j % 3 == 2 and j < 3w,
    else 0. A pair whose own position is outside [0, max_position) is left unchanged (SPEC §3).
    """
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    rotary_dim: int
    is_neox: bool
    offset: Optional[int] = None
    conjugate: bool = False
    mrope_section: Optional[tuple] = None
    mrope_interleaved: bool = False


@dataclasses.dataclass(frozen=True, eq=False)
class PagedAppend:
    """Where each token of a call goes, as FlashInfer addresses an append (``append_paged_kv_cache``,
    ``rope_quantize_fp8_append_paged_kv_cache``): token i goes to the page
    ``kv_indices[kv_indptr[batch_indices[i]] + positions[i] // block_size]``, offset
    ``positions[i] % block_size``. Given as the GQA entry's ``slot_mapping``, the kernel computes each
    token's slot itself (no index ops before the launch).

    batch_indices, positions: int32 / int64 [n] (a token's request, its position in the request);
    kv_indptr: int32 / int64 [num_requests + 1]; kv_indices: int32 / int64 [num_pages_used], the pages.
    A token writes nothing when batch_indices[i] < 0 (FlashInfer's padding) or outside
    [0, num_requests), when positions[i] < 0, when its index into kv_indices is outside it, or when the
    page is outside the cache (each of these is read only where it is in bounds).
    """
    kv_indices: torch.Tensor
    kv_indptr: torch.Tensor
    batch_indices: torch.Tensor
    positions: torch.Tensor


@dataclasses.dataclass(frozen=True)
class HadamardArgs:
    """Unnormalized Walsh-Hadamard transform over head_dim (a power of two, 16..1024), then
    ``y = bf16(h * scale)``; scale 1/sqrt(head_dim) makes it orthonormal."""
    scale: float = 1.0


@dataclasses.dataclass(frozen=True)
class CastArgs:
    """Per-group quantization of each (token, head) row.

    cast_fmt: "e4m3" (values float8_e4m3fn) or "e2m1" (FP4, two codes per uint8, even element in
    the low nibble). num_per_channels: group size g in {16, 32, 64, 128}. round_sf: True exactly
    for the power-of-two scales ("ue8m0", "ue8m0_fp32"). sf_format: "ue8m0" (uint8 exponent,
    scale 2^(byte-127)), "ue8m0_fp32" (the same scale stored as fp32), "e4m3" (float8_e4m3fn
    scale) or "fp32". Dequant: ``bf16(float32(q) * scale)``. cast_back: return the dequantized
    bf16 instead of (q, sf). scale_floor: the smallest power-of-two scale (ue8m0 / ue8m0_fp32 only):
    the scale is 2^ceil(log2(max(amax / fmax, scale_floor))), FlashMLA's rule (its formats carry 1e-4).
    """
    cast_fmt: str
    num_per_channels: int
    round_sf: bool
    sf_format: str
    cast_back: bool = False
    scale_floor: Optional[float] = None

    @classmethod
    def from_cache_format(cls, fmt: "KVCacheFormat") -> Optional["CastArgs"]:
        """The cast a cache format stores (None for a bf16 cache)."""
        if fmt.cast_fmt is None:
            return None
        return cls(fmt.cast_fmt, fmt.elements_per_sf, fmt.sf_format in POWER_OF_TWO_SF_FORMATS, fmt.sf_format,
                   scale_floor=fmt.scale_floor)


@dataclasses.dataclass(frozen=True, eq=False)
class ContiguousOutArgs:
    """Preallocated outputs (for CUDA graphs): ``out`` bf16 shaped like x (no cast, or cast_back),
    or ``out`` the quantized values and ``sf`` the scales of a cast; last dim contiguous."""
    out: Optional[torch.Tensor] = None
    sf: Optional[torch.Tensor] = None


@dataclasses.dataclass(frozen=True, eq=False)
class KVCacheOutArgs:
    """Write into a paged cache: ``kv_cache`` uint8 [num_blocks, block_size, num_heads,
    bytes_per_token]; ``slot_mapping`` int32/int64 [n] (a negative or too large slot skips the
    token). ``out`` (optional, bf16 shaped like x) receives the value of ``out_stage``: "norm",
    "transform" (the cast's input) or "cast_back". ``layout`` is the cache's KVCacheFormat, or None
    to infer it from the presets."""
    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor
    out: Optional[torch.Tensor] = None
    out_stage: Optional[str] = None
    layout: Optional["KVCacheFormat"] = None


@dataclasses.dataclass(frozen=True, eq=False)
class FusedCall:
    """The arguments of one :func:`kvfuse.fused_norm_rope_hadamard_cast_store_kvcache` call, for
    :func:`kvfuse.fused_group` (several calls, one launch). Same fields, same meaning."""
    x: torch.Tensor
    norm_args: Optional[NormArgs] = None
    rope_args: Optional[RopeArgs] = None
    hadamard_args: Optional[HadamardArgs] = None
    cast_args: Optional[CastArgs] = None
    out_args: object = None
