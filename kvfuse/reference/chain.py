"""The chains: norm -> RoPE -> Hadamard (``transform``), a validated Plan run stage by stage
(``run_plan``, the "reference" backend), and the GQA / MHA call (SPEC §11)."""
from __future__ import annotations

from typing import Optional

import torch

from ..numerics_profiles import profile
from ..plans.types import CastSpec, Plan
from .numerics import F32
from .stages import dequantize, hadamard, norm, quantize, quantize_per_tensor, rmsnorm, rope
from .cache import store, store_paged


def transform(x, weight=None, eps=1e-6, positions=None, cos_sin=None, rotary_dim=0, rope_offset=None,
              is_neox=True, conjugate=False, hadamard_scale=None, norm_kind="rms", bias=None):
    """norm -> rope -> hadamard on bf16 [n, H, D]; returns (after_norm or None, transform output)."""
    y = x
    normed = None
    if weight is not None:
        y = normed = norm(y, weight, eps, norm_kind, bias)
    if positions is not None:
        y = rope(y, positions, cos_sin, rotary_dim, is_neox, rope_offset, conjugate)
    if hadamard_scale is not None:
        y = hadamard(y, hadamard_scale)
    return normed, y


def run_plan(plan: Plan) -> None:
    """Execute a validated plan with the unfused chain (the "reference" backend)."""
    if plan.n == 0:
        return
    x = plan.x if plan.x_tail is None else torch.cat([plan.x, plan.x_tail], dim=-1)   # one row, two inputs
    normed, y = transform(x, plan.weight, plan.eps, plan.positions, plan.cos_sin, plan.rotary_dim,
                          plan.rope_offset, plan.is_neox, plan.conjugate, plan.hadamard_scale, plan.norm_kind,
                          plan.bias)
    stages = {"norm": normed, "transform": y}
    cast: Optional[CastSpec] = plan.cast
    q = sf = None
    if cast is not None:
        dq = plan.quant_dim
        floor = None if cast.floor_exp is None else 2.0 ** cast.floor_exp
        q, sf = quantize(y[..., :dq], cast.cast_fmt, cast.group, cast.sf_format, floor)
        if plan.out_stage == "cast_back":
            back = dequantize(q, sf, cast.cast_fmt, cast.group, cast.sf_format)
            stages["cast_back"] = torch.cat([back, y[..., dq:]], dim=-1)
    if plan.kv_cache is not None:
        if cast is None:
            store(plan.kv_cache, plan.slot_mapping, plan.fmt, y)
        else:
            store(plan.kv_cache, plan.slot_mapping, plan.fmt, q, sf, y[..., plan.quant_dim:])
    elif plan.q_out is not None:
        plan.q_out.copy_(q)
        plan.sf_out.copy_(sf)
    if plan.out is not None:
        plan.out.copy_(stages[plan.out_stage])


def qk_norm_rope(x: torch.Tensor, weight=None, eps: float = 1e-6, positions=None, cos_sin=None, rotary_dim: int = 0,
                 rope_offset: int = 0, is_neox: bool = True, conjugate: bool = False,
                 numerics: str = "staged") -> torch.Tensor:
    """The Q / K transform of SPEC §11 on [n, H, D] (bf16, fp16 or fp32): per-head :func:`rmsnorm` (weight [D]
    shared by the heads; skipped when ``weight`` is None), then :func:`rope` (skipped when ``positions`` is
    None). "staged" rounds each stage to x's dtype; the fused profiles (kvfuse.numerics_profiles) keep the
    norm's result in fp32 through RoPE and return fp32 values, which the caller rounds once."""
    staged = profile(numerics).round_each_stage
    if weight is not None:
        y = rmsnorm(x, weight, eps, out_dtype=x.dtype if staged else F32)
    else:
        y = x if staged else x.to(F32)          # fused: RoPE's result stays fp32 without a norm too
    if positions is not None:
        y = rope(y, positions, cos_sin, rotary_dim, is_neox, rope_offset, conjugate)
    return y


def qk_norm_rope_store_kv(q, k, v, k_cache, v_cache, slot_mapping, q_out, q_weight=None, q_eps=1e-6, k_weight=None,
                          k_eps=1e-6, positions=None, cos_sin=None, rotary_dim=0, rope_offset=0, is_neox=True,
                          conjugate=False, k_scale=None, v_scale=None, layout="NHD", numerics="staged",
                          k_out=None) -> None:
    """The unfused chain of :func:`kvfuse.fused_qk_norm_rope_store_kv` (validated arguments): q -> norm ->
    RoPE -> q_out; k -> norm -> RoPE -> (e4m3 by k_scale) -> k_cache (or k_out without caches); v -> (e4m3
    by v_scale) -> v_cache. Values are rounded to the activations' dtype (q's) as ``numerics`` says; an
    fp8 cast reads the rounded k, or its fp32 value under "fused_fp32_cast". fp8 caches when the scales
    are given, else caches of the activations' dtype."""
    prof = profile(numerics)
    act = q.dtype
    qy = qk_norm_rope(q, q_weight, q_eps, positions, cos_sin, rotary_dim, rope_offset, is_neox, conjugate,
                      numerics).to(act)
    k32 = qk_norm_rope(k, k_weight, k_eps, positions, cos_sin, rotary_dim, rope_offset, is_neox, conjugate,
                       numerics)
    ky = k32.to(act)
    if k_cache is None:
        k_out.copy_(ky)
    elif k_scale is None:
        store_paged(k_cache, slot_mapping, ky, layout)
        store_paged(v_cache, slot_mapping, v, layout)
    else:
        store_paged(k_cache, slot_mapping, quantize_per_tensor(k32 if prof.cast_reads_fp32 else ky, k_scale), layout)
        store_paged(v_cache, slot_mapping, quantize_per_tensor(v, v_scale), layout)
    q_out.copy_(qy)


def run_gqa_plan(plan) -> None:
    """Execute a validated :class:`kvfuse.plans.types.GQAPlan` with the unfused chain (the "reference" backend)."""
    if plan.n == 0:
        return
    qk_norm_rope_store_kv(plan.q, plan.k, plan.v, plan.k_cache, plan.v_cache, plan.slot_mapping, plan.q_out,
                          plan.q_weight, plan.q_eps, plan.k_weight, plan.k_eps, plan.positions, plan.cos_sin,
                          plan.rotary_dim, plan.rope_offset, plan.is_neox, plan.conjugate, plan.k_scale,
                          plan.v_scale, plan.layout, plan.numerics, plan.k_out)
