"""K and V of GQA / MHA attention (SPEC §3): :func:`fused_qk_norm_rope_store_kv`.

For the models that are not MLA (Llama, Qwen3, Gemma 3 / 4, Qwen-VL, ...): one call takes the q, k, v heads
of a batch of tokens (views of one packed QKV projection allowed; bf16, fp16 or fp32), applies the per-head
QK-norm and RoPE (or mRoPE) to q and k and the optional V-norm to v, writes q back and scatters K and V by slot into paged caches of vLLM's
layout ("NHD": [num_blocks, block_size, num_kv_heads, head_dim]) or FlashInfer's ("HND": [num_blocks,
num_kv_heads, block_size, head_dim]), each in a format of :mod:`kvfuse.gqa_formats` (the activations'
dtype, or float8_e4m3fn with fp32 scales given per tensor or per kv head, ...); without caches k is written
back like q. ``numerics`` picks where the chain
rounds (:mod:`kvfuse.numerics_profiles`). One Triton launch on the GPU; byte for byte the unfused chain
of :mod:`kvfuse.reference` (:func:`kvfuse.reference.qk_norm_rope_store_kv`). :func:`load_gqa_kv_cache`
reads K and V back by slot, for attention written in PyTorch and for tests.

Validation (:mod:`kvfuse.plans.gqa`: every rule raises ValueError / TypeError naming the argument,
before anything is written) produces a :class:`~kvfuse.plans.types.GQAPlan`, which
:mod:`kvfuse.dispatch` runs; an eager call's validated signature is kept in the plan cache
(:mod:`kvfuse.plans.cache`), so a repeated one skips validation (the aliasing rules are still checked)
and reuses its launch.
"""
from __future__ import annotations

import torch

from . import dispatch as _dispatch
from .reference.cache import load_gqa_kv as _load_gqa_kv
from .plans import gqa as _gqa
from .numerics_profiles import NUMERICS
from .plans.cache import plan_cache_enabled
from .plans.gqa import CACHE_DTYPES
from .plans.types import GQA_LAYOUTS as LAYOUTS, GQAPlan

__all__ = ["fused_qk_norm_rope_store_kv", "load_gqa_kv_cache", "GQAPlan", "LAYOUTS", "CACHE_DTYPES", "NUMERICS"]


def fused_qk_norm_rope_store_kv(q, k, v, k_cache, v_cache, slot_mapping, q_norm_args=None, k_norm_args=None,
                                rope_args=None, k_scale=None, v_scale=None, layout="NHD", q_out=None,
                                numerics="staged", k_out=None, q_scale=None, scale_convention="divide", k_format=None,
                                v_format=None, k_scale_cache=None, v_scale_cache=None, v_norm_args=None):
    """QK-norm -> RoPE on q and k, q written back, K and V (V optionally RMS-normed) scattered into paged caches:
    one launch.

    Args:
        q: bf16, fp16 or fp32 [n, Hq, D]; k: [n, Hkv, D]; v: [n, Hkv, Dv], all three of one dtype (the
            activations'), D and Dv positive multiples of 8 (stride(-1) == 1, other strides free: views of
            one packed QKV projection [n, (Hq + 2 Hkv) D] are fine). Hq a multiple of Hkv, or 0: K and V
            alone (an engine's cache write without q). q and k may each be a pair ``(first, rest)`` of
            [n, H, S] and [n, H, D - S] tensors (an engine's rope / nope parts): the call writes the bytes
            of the same call on ``torch.cat(pair, -1)``; every pair of a call (q, k, q_out, k_out,
            k_cache) splits at the same S, a positive multiple of 8.
        k_cache, v_cache: the activations' dtype or float8_e4m3fn (both the same), ``layout`` "NHD" (vLLM:
            [num_blocks, block_size, Hkv, D]) or "HND" (FlashInfer: [num_blocks, Hkv, block_size, D]);
            v_cache's last dim is Dv. Any strides with stride(-1) == 1 (slices of a larger
            allocation, vLLM's kv_cache[:, 0] / [:, 1]). Both None: no cache is written, k's result goes
            to ``k_out`` and v is not read (it may be None; slot_mapping and v_scale None too). k_cache
            with v and v_cache None: a K cache alone (MLA's latent). k_cache may be a pair of caches
            (its heads' first S columns, the rest: FlashInfer's MLA kpe / ckv caches).
        slot_mapping: int32 / int64 [n], or a :class:`kvfuse.PagedAppend` (FlashInfer's page addressing, read
            by the kernel: SPEC §3); slot s goes to block s // block_size, offset s % block_size;
            a slot < 0 or >= num_blocks * block_size writes nothing.
        q_norm_args, k_norm_args: NormArgs (kind "rms", weight [D] bf16 / fp16 / fp32 shared by the heads) or None.
        rope_args: RopeArgs or None (offset None means 0 here: RoPE on the first rotary_dim dims; cos_sin_cache
            fp32 / bf16 / fp16). Weights and table are read as fp32 (exact). With ``mrope_section`` (mRoPE,
            Qwen2-VL / Qwen2.5-VL / Qwen3-VL) positions are [3, n] and each frequency takes its cos / sin from
            one position row, chunked or interleaved (:class:`kvfuse.RopeArgs`, SPEC §3).
        k_scale, v_scale: for float8_e4m3fn caches (None otherwise; k_scale also for an fp8 k_out): fp32
            tensors of one element or one per kv head ([Hkv], contiguous), or numbers (passed to the
            kernel as fp32 arguments; then every scale of the call is a number): the cache holds
            e4m3(clamp(f(x) / f(scale_h), -448, 448)) for head h, or under ``scale_convention``
            "multiply" e4m3(clamp(f(x) * f(scale_h), -448, 448)) (FlashInfer's convention).
        q_out: [n, Hq, D] of the activations' dtype receiving the transformed q, or float8_e4m3fn (cast by
            ``q_scale`` as the caches are); q itself for in place; a pair like q's; None allocates it
            (like q).
        numerics: "staged" (every stage rounded to the activations' dtype), "fused" (fp32 from the norm's
            input through RoPE, one rounding) or "fused_fp32_cast" (as "fused"; an fp8 cache's cast reads
            the fp32 value): :data:`kvfuse.numerics_profiles.PROFILES`, SPEC §6.
        k_out: without caches, [n, Hkv, D] of the activations' dtype or float8_e4m3fn (by k_scale)
            receiving the transformed k; k itself for in place; a pair like k's; None allocates it (like
            k). Must be None with caches.
        q_scale: the fp32 scale (one element, or a number) of a float8_e4m3fn q_out; None otherwise.
        scale_convention: "divide" (vLLM's: x / scale) or "multiply" (FlashInfer's: x * scale), for every
            cast of the call.
        k_format, v_format: the formats of k_cache and v_cache (K and V may differ): a
            :data:`kvfuse.gqa_formats.PRESETS` name (vLLM's kv_cache_dtype strings: "auto", "fp8_e4m3" or
            its alias "fp8", ...) or a :class:`kvfuse.GQACacheFormat` of them; the cache holds the format's
            dtype. None: the format the cache's dtype means (the activations' dtype: "auto";
            float8_e4m3fn: "fp8_e4m3"); with both None the caches hold one dtype. Without caches k_format
            is None or k_out's (no stored scales), v_format None.
        k_scale_cache, v_scale_cache: the scales a format computes and stores (None for the others): for
            scale "token_head" an fp32 tensor of the cache's shape minus its last dim ([num_blocks,
            block_size, Hkv] under NHD, [num_blocks, Hkv, block_size] under HND), any strides (views
            inside the cache's own allocation, as vLLM keeps them in the heads' padding, are fine when
            they share no element with the cache view).
        v_norm_args: NormArgs (kind "rms") or None: an RMSNorm of each (token, head) row of v before the V cache
            (Gemma 4), rounded as the QK-norm is under ``numerics``; weight [Dv] (bf16 / fp16 / fp32), or None
            for a weightless norm (y = v * rstd). Only with v_cache.

    Returns ``q_out`` (the tensor or pair written); without caches ``(q_out, k_out)``. Raises ValueError /
    TypeError naming the argument before anything is written.
    """
    if not torch.compiler.is_compiling() and plan_cache_enabled():
        template, tensors = _gqa.prepare_call(q, k, v, k_cache, v_cache, slot_mapping, q_norm_args, k_norm_args,
                                              rope_args, k_scale, v_scale, layout, q_out, numerics, k_out, q_scale,
                                              scale_convention, k_format, v_format, k_scale_cache, v_scale_cache,
                                              v_norm_args)
        _dispatch.call_gqa(template, tensors)
        return template.result(tensors)
    plan = _gqa.prepare(q, k, v, k_cache, v_cache, slot_mapping, q_norm_args, k_norm_args, rope_args, k_scale,
                        v_scale, layout, q_out, numerics, k_out, q_scale, scale_convention, k_format, v_format,
                        k_scale_cache, v_scale_cache, v_norm_args)
    _dispatch.execute(plan)
    q_out = plan.q_out if plan.q_out_tail is None else (plan.q_out, plan.q_out_tail)
    if plan.has_cache:
        return q_out
    return q_out, (plan.k_out if plan.k_out_tail is None else (plan.k_out, plan.k_out_tail))


def load_gqa_kv_cache(k_cache, v_cache, slot_mapping, layout="NHD", k_scale=None, v_scale=None, k_format=None,
                      v_format=None, k_scale_cache=None, v_scale_cache=None):
    """K and V of the given slots, read back from the paged caches of :func:`fused_qk_norm_rope_store_kv`.

    Args:
        k_cache, v_cache, layout, k_scale, v_scale, k_format, v_format, k_scale_cache, v_scale_cache: as for
            :func:`fused_qk_norm_rope_store_kv`.
        slot_mapping: int32 / int64 [n]; a slot < 0 or >= num_blocks * block_size reads zeros.

    Returns (k, v): [n, Hkv, D] and [n, Hkv, Dv], new tensors on the caches' device. An "auto" cache gives
    its stored bits (its dtype); a quantized one bf16(f(code) * f(scale)), the scale its static one or the
    slot's stored one (NaN codes as the canonical bf16 NaN). Torch ops on any device. Raises ValueError /
    TypeError naming the argument.
    """
    kf, vf = _gqa.validate_load(k_cache, v_cache, slot_mapping, layout, k_scale, v_scale, k_format, v_format,
                                k_scale_cache, v_scale_cache)
    return _load_gqa_kv(k_cache, v_cache, slot_mapping, layout, k_scale, v_scale, kf, vf, k_scale_cache,
                        v_scale_cache)
