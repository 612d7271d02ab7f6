"""The chains: norm -> RoPE -> Hadamard (``transform``), a validated Plan run stage by stage
(``run_plan``, the "reference" backend), and the GQA / MHA call (SPEC §3)."""
from __future__ import annotations

from typing import Optional

import torch

from .. import gqa_formats
from ..numerics_profiles import profile
from ..plans.types import CastSpec, Plan
from .numerics import F32
from .stages import dequantize, hadamard, norm, quantize, quantize_per_tensor, quantize_per_token_head, rmsnorm, rope
from .cache import paged_append_slots, store, store_paged
from .fp4 import quantize_block_format


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
                 numerics: str = "staged", mrope_section=None, mrope_interleaved: bool = False) -> torch.Tensor:
    """The Q / K transform of SPEC §3 on [n, H, D] (bf16, fp16 or fp32): per-head :func:`rmsnorm` (weight [D]
    shared by the heads; skipped when ``weight`` is None), then :func:`rope` (skipped when ``positions`` is
    None; mRoPE with ``mrope_section``). "staged" rounds each stage to x's dtype; the fused profiles
    (kvfuse.numerics_profiles) keep the norm's result in fp32 through RoPE and return fp32 values, which the
    caller rounds once."""
    staged = profile(numerics).round_each_stage
    if weight is not None:
        y = rmsnorm(x, weight, eps, out_dtype=x.dtype if staged else F32)
    else:
        y = x if staged else x.to(F32)          # fused: RoPE's result stays fp32 without a norm too
    if positions is not None:
        y = rope(y, positions, cos_sin, rotary_dim, is_neox, rope_offset, conjugate, mrope_section, mrope_interleaved)
    return y


def _write(out, tail, rows: torch.Tensor) -> None:
    """rows [n, H, D] (values of the outputs' dtype, or uint8 e4m3 codes) into out, or its first columns
    into out and the rest into tail."""
    parts = [out] if tail is None else [out, tail]
    col = 0
    for t in parts:
        w = t.shape[-1]
        t.view(rows.dtype).copy_(rows[..., col:col + w])
        col += w


def _cast_or_round(y32, rounded, fp8: bool, scale, prof, convention):
    """A Q / K result for its destination: e4m3 codes of the fp32 or the rounded value (the profile says
    which) when ``fp8``, else the rounded value."""
    if not fp8:
        return rounded
    return quantize_per_tensor(y32 if prof.cast_reads_fp32 else rounded, scale, convention)


def _cache_format(fmt, cache, act):
    """A cache's GQACacheFormat: the one given (a name or a format), else the one its dtype means."""
    if fmt is not None:
        return gqa_formats.resolve(fmt, "format")
    return gqa_formats.PRESETS["auto" if cache.dtype == act else "fp8_e4m3"]


def _cache_rows(fmt, y32, rounded, scale, prof, convention):
    """(rows [n, H, D], scales [n, H] or None) a cache of format ``fmt`` receives for the values y32 (fp32) /
    rounded (the activations' dtype): the rounded values ("auto"), or the codes of the fp32 or rounded value
    (the profile says which) by the static scale, or by each row's own scale (returned: the scale cache's)."""
    if fmt.code == "act":
        return rounded, None
    x = y32 if prof.cast_reads_fp32 else rounded
    if fmt.scale == "static" and fmt.code in ("e4m3", "e5m2"):
        return quantize_per_tensor(x, scale, convention, fmt.code), None
    if fmt.scale == "token_head":
        return quantize_per_token_head(x.to(F32), fmt.code)
    raise NotImplementedError(f"the reference has no cast for the GQA cache format {fmt.name!r}")


def _store_block(fmt, x, scale, cache, scale_cache, slot_mapping, layout):
    """A 4-bit format's codes of the values x [n, H, D] into ``cache`` and its group scales into
    ``scale_cache`` (``scale``: the global one where the format takes it)."""
    codes, sf = quantize_block_format(fmt.name, x, scale)
    store_paged(cache, slot_mapping, codes, layout)
    store_paged(scale_cache, slot_mapping, sf, layout)


def qk_norm_rope_store_kv(q, k, v, k_cache, v_cache, slot_mapping, q_out, q_weight=None, q_eps=1e-6, k_weight=None,
                          k_eps=1e-6, positions=None, cos_sin=None, rotary_dim=0, rope_offset=0, is_neox=True,
                          conjugate=False, k_scale=None, v_scale=None, layout="NHD", numerics="staged",
                          k_out=None, q_scale=None, scale_convention="divide", q_out_tail=None, k_out_tail=None,
                          k_cache_tail=None, k_format=None, v_format=None, k_scale_cache=None,
                          v_scale_cache=None, mrope_section=None, mrope_interleaved=False, v_norm=False,
                          v_weight=None, v_eps=1e-6) -> None:
    """The unfused chain of :func:`kvfuse.fused_qk_norm_rope_store_kv` (validated arguments; q and k whole
    [n, H, D]): q -> norm -> RoPE -> q_out (e4m3 by q_scale for an fp8 q_out); k -> norm -> RoPE -> (e4m3
    by k_scale) -> k_cache (or k_out without caches); v -> (e4m3 by v_scale) -> v_cache (none when
    v_cache is None). Values are rounded to the activations' dtype (q's) as ``numerics`` says; an fp8 cast
    reads the rounded value, or the fp32 one under "fused_fp32_cast", and divides by its scale or
    (``scale_convention`` "multiply") multiplies. A ``*_tail`` receives its tensor's columns from
    out.shape[-1] on. Scales: tensors or numbers. k_format, v_format: the caches' formats (names or
    GQACacheFormat; None: the one the cache's dtype means), k_scale_cache / v_scale_cache: where a format
    that stores its scales puts them. mrope_section, mrope_interleaved: mRoPE (positions [3, n]).
    v_norm: v goes through :func:`rmsnorm` first (v_weight [Dv], or None: weightless, y = v * rstd), rounded
    and cast as q and k are."""
    prof = profile(numerics)
    act = q.dtype

    def transformed(x, w, eps):
        y32 = qk_norm_rope(x, w, eps, positions, cos_sin, rotary_dim, rope_offset, is_neox, conjugate, numerics,
                           mrope_section, mrope_interleaved)
        return y32, y32.to(act)

    q32, qy = transformed(q, q_weight, q_eps)
    k32, ky = transformed(k, k_weight, k_eps)
    if k_cache is None:
        _write(k_out, k_out_tail, _cast_or_round(k32, ky, k_out.dtype == torch.float8_e4m3fn, k_scale, prof,
                                                 scale_convention))
    else:
        kf = _cache_format(k_format, k_cache, act)
        if kf.scale == "block":         # 4-bit codes and their group scales (whole heads)
            _store_block(kf, k32 if prof.cast_reads_fp32 else ky, k_scale, k_cache, k_scale_cache, slot_mapping,
                         layout)
        else:
            krows, kscales = _cache_rows(kf, k32, ky, k_scale, prof, scale_convention)
            if kscales is not None:
                store_paged(k_scale_cache.unsqueeze(-1), slot_mapping, kscales[..., None], layout)
            if k_cache_tail is None:
                store_paged(k_cache, slot_mapping, krows, layout)
            else:
                split = k_cache.shape[-1]
                store_paged(k_cache, slot_mapping, krows[..., :split], layout)
                store_paged(k_cache_tail, slot_mapping, krows[..., split:], layout)
        if v_cache is not None:
            vf = _cache_format(v_format, v_cache, act)
            if v_norm:
                w = v_weight if v_weight is not None else torch.ones(v.shape[-1], dtype=F32, device=v.device)
                v32 = rmsnorm(v, w, v_eps, out_dtype=act if prof.round_each_stage else F32)
                v_f32, v_act = v32, v32.to(act)
            else:
                v_f32, v_act = v.to(F32), v
            if vf.scale == "block":
                _store_block(vf, v_f32 if prof.cast_reads_fp32 else v_act, v_scale, v_cache, v_scale_cache,
                             slot_mapping, layout)
            else:
                vrows, vscales = _cache_rows(vf, v_f32, v_act, v_scale, prof, scale_convention)
                store_paged(v_cache, slot_mapping, vrows, layout)
                if vscales is not None:
                    store_paged(v_scale_cache.unsqueeze(-1), slot_mapping, vscales[..., None], layout)
    _write(q_out, q_out_tail, _cast_or_round(q32, qy, q_out.dtype == torch.float8_e4m3fn, q_scale, prof,
                                             scale_convention))


def _whole(first, tail):
    return first if tail is None else torch.cat([first, tail], dim=-1)


def gqa_slots(plan):
    """The plan's slot mapping: its slot_mapping, or the slots of its paged-append addressing."""
    if not plan.paged_append:
        return plan.slot_mapping
    return paged_append_slots(plan.append_batch_indices, plan.append_positions, plan.append_kv_indptr,
                              plan.append_kv_indices, plan.block_size)


def run_gqa_plan(plan) -> None:
    """Execute a validated :class:`kvfuse.plans.types.GQAPlan` with the unfused chain (the "reference" backend)."""
    if plan.n == 0:
        return
    def scale(name):
        value = getattr(plan, name + "_value")
        return getattr(plan, name) if value is None else value

    qk_norm_rope_store_kv(_whole(plan.q, plan.q_tail), _whole(plan.k, plan.k_tail), plan.v, plan.k_cache,
                          plan.v_cache, gqa_slots(plan), plan.q_out, plan.q_weight, plan.q_eps, plan.k_weight,
                          plan.k_eps, plan.positions, plan.cos_sin, plan.rotary_dim, plan.rope_offset, plan.is_neox,
                          plan.conjugate, scale("k_scale"), scale("v_scale"), plan.layout, plan.numerics, plan.k_out,
                          scale("q_scale"), plan.scale_convention, plan.q_out_tail, plan.k_out_tail,
                          plan.k_cache_tail, plan.k_format, plan.v_format, plan.k_scale_cache, plan.v_scale_cache,
                          plan.mrope_section, plan.mrope_interleaved, plan.v_norm, plan.v_weight, plan.v_eps)
