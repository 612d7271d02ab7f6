"""Validation of :func:`kvfuse.fused_qk_norm_rope_store_kv` (SPEC §3 and §9) into a
:class:`~.types.GQAPlan` (the caches checked against their formats, :mod:`kvfuse.gqa_formats`), and its
aliasing check: q_out, k_out, k_cache, v_cache and the scale caches must not overlap each other or any
input (q_out may be q itself, k_out k itself: in place). ``prepare`` validates a
call; ``prepare_call`` (an eager call) finds its signature's :class:`GQATemplate` in the plan cache,
or validates and stores one, and still checks what depends on the call's pointers and n."""
from __future__ import annotations

import dataclasses
import math
import operator
import threading

import torch

from ..overlap import INF, addresses_known, row_limit, same_elements, span_terms, tensors_overlap
from ..numerics_profiles import ACTIVATION_DTYPES, profile
from ..args import PagedAppend
from .cache import PLAN_CACHE, ROWS, norm_args_key, rope_args_key, tensor_key
from .rules import INDEX_DTYPES, check_index_vector, check_rms_norm, check_rope_args, check_tensor
from .types import GQA_LAYOUTS, CacheEntry, GQAPlan
from .. import gqa_formats

# an unquantized cache holds the activations' dtype; a quantized one its format's code dtype
CACHE_DTYPES = ACTIVATION_DTYPES + tuple(dict.fromkeys(f.cache_dtype for f in gqa_formats.PRESETS.values()
                                                       if f.cache_dtype is not None))
# a cache whose format is not named (None): the format its dtype meant before formats were named
_INFERRED = {torch.float8_e4m3fn: gqa_formats.PRESETS["fp8_e4m3"]}
# the cos / sin table: every one read as fp32 exactly (the fused entry point's Gluon paths take fp32 / bf16)
COS_SIN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_heads(t, name, dev, n=None, min_heads=1, dtypes=ACTIVATION_DTYPES):
    check_tensor(t, name, dtypes, dev)
    if t.dim() != 3:
        raise ValueError(f"{name}: expected shape [n, num_heads, head_dim], got {tuple(t.shape)}")
    if n is not None and t.shape[0] != n:
        raise ValueError(f"{name}: expected {n} tokens (q's), got shape {tuple(t.shape)}")
    if t.shape[1] < min_heads:
        raise ValueError(f"{name}: num_heads must be >= {min_heads}, got {t.shape[1]}")
    if t.shape[2] % 8 or t.shape[2] == 0:
        raise ValueError(f"{name}: head_dim must be a positive multiple of 8, got {t.shape[2]}")
    if t.shape[2] > 1 and t.stride(2) != 1:
        raise ValueError(f"{name}: expected stride(-1) == 1, got {t.stride(2)}")


def _check_cache(cache, name, layout, nb_bs, heads, dim, dev, act=None, fmt=None, fmt_name=""):
    """act: the activations' dtype (an unquantized cache must hold it), None: any of CACHE_DTYPES; fmt: the
    format named by the argument ``fmt_name`` (the cache must hold its dtype), None: a dtype a format is
    inferred from (the activations' or float8_e4m3fn)."""
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cache).__name__}")
    if fmt is not None:
        want = fmt.dtype_for(act) if act is not None else fmt.cache_dtype
        if (cache.dtype not in ACTIVATION_DTYPES) if want is None else (cache.dtype != want):
            what = ' or '.join(map(str, ACTIVATION_DTYPES)) if want is None else str(want)
            raise TypeError(f"{name}: expected dtype {what} ({fmt_name} {fmt.name!r}), got {cache.dtype}")
    allowed = (cache.dtype,) if fmt is not None else (ACTIVATION_DTYPES if act is None else (act,)) + tuple(_INFERRED)
    if cache.dtype not in allowed:
        raise TypeError(f"{name}: expected dtype {' or '.join(str(d) for d in allowed)}, got {cache.dtype}")
    if cache.device != dev:
        raise ValueError(f"{name}: expected device {dev}, got {cache.device}")
    per = 1 if fmt is None else fmt.values_per_element      # e2m1: two codes a byte, last dim head_dim / 2
    dim //= per
    last = "head_dim" if per == 1 else f"head_dim / {per}"
    want = f"[num_blocks, block_size, num_kv_heads, {last}]" if layout == "NHD" else \
        f"[num_blocks, num_kv_heads, block_size, {last}]"
    if cache.dim() != 4:
        raise ValueError(f"{name}: expected {layout} shape {want}, got {tuple(cache.shape)}")
    nb = cache.shape[0]
    bs, h = (cache.shape[1], cache.shape[2]) if layout == "NHD" else (cache.shape[2], cache.shape[1])
    if h != heads or cache.shape[3] != dim or (nb_bs is not None and (nb, bs) != nb_bs):
        b0, b1 = ("num_blocks", "block_size") if nb_bs is None else nb_bs
        exp = f"[{b0}, {b1}, {heads}, {dim}]" if layout == "NHD" else f"[{b0}, {heads}, {b1}, {dim}]"
        raise ValueError(f"{name}: expected {layout} shape {exp} ({want}), got {tuple(cache.shape)}")
    if nb < 1 or bs < 1:
        raise ValueError(f"{name}: num_blocks and block_size must be >= 1, got shape {tuple(cache.shape)}")
    if dim > 1 and cache.stride(3) != 1:
        raise ValueError(f"{name}: expected stride(-1) == 1, got {cache.stride(3)}")
    if row_limit(cache, name) < nb:   # raises when the elements of one block overlap
        raise ValueError(f"{name}: its blocks overlap in memory (strides {cache.stride()}): a cache must not "
                         f"be expanded (stride 0) or otherwise overlap itself")
    return nb, bs


SCALE_CONVENTIONS = ("divide", "multiply")


def _parts(x, name):
    """(first, tail) of a tensor given whole or as a pair (its heads' first columns, the rest); tail None
    for a whole tensor."""
    if isinstance(x, (tuple, list)) and len(x) == 2:
        return x[0], x[1]
    return x, None         # anything else: the tensor checks name it


def _check_pair(first, tail, name, dev, n, min_heads, dtypes):
    """A whole [n, H, D] tensor, or a pair of [n, H, S] and [n, H, D - S] of one dtype: returns D."""
    if tail is None:
        _check_heads(first, name, dev, n, min_heads, dtypes)
        return first.shape[2]
    _check_heads(first, f"{name}[0]", dev, n, min_heads, dtypes)
    _check_heads(tail, f"{name}[1]", dev, first.shape[0], min_heads, (first.dtype,))
    if tail.shape[1] != first.shape[1]:
        raise ValueError(f"{name}[1]: expected {first.shape[1]} heads ({name}[0]'s), got shape {tuple(tail.shape)}")
    return first.shape[2] + tail.shape[2]


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_scale(scale, name, fp8, dev, heads, what="a float8_e4m3fn cache"):
    """A cast's scale: None without fp8, else a number (finite > 0) or an fp32 tensor of one element or
    (heads not None) one per kv head. Returns (tensor or None, number or None)."""
    if not fp8:
        if scale is not None:
            raise ValueError(f"{name} must be None without {what}, got a {type(scale).__name__}")
        return None, None
    if scale is None:
        per_head = " (one, or one per kv head)" if heads is not None else ""
        raise ValueError(f"{name}: {what} needs its fp32 scale{per_head}, got None")
    if _is_number(scale):
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {scale!r}")
        return None, float(scale)
    check_tensor(scale, name, (torch.float32,), dev, last_contiguous=False)
    one = scale.numel() == 1 and scale.dim() <= 1
    if not one and (heads is None or tuple(scale.shape) != (heads,)):
        per_head = f" or one per kv head (shape ({heads},))" if heads is not None else ""
        raise ValueError(f"{name}: expected one element (shape () or (1,)){per_head}, got shape {tuple(scale.shape)}")
    if not one and scale.stride(0) != 1:
        raise ValueError(f"{name}: a per-head scale must be contiguous (stride 1), got stride {scale.stride(0)}")
    return scale, None


def _given_format(fmt, name):
    """The preset of a format argument (a name or a GQACacheFormat), None for None."""
    return None if fmt is None else gqa_formats.resolve(fmt, name)


def _format_of(fmt, cache, act):
    """A cache's format: the one given, else the one its dtype means (the activations': "auto";
    float8_e4m3fn: "fp8_e4m3", a static scale). _check_cache has checked the dtype against both."""
    if fmt is not None:
        return fmt
    return gqa_formats.PRESETS["auto"] if cache.dtype == act else _INFERRED[cache.dtype]


def _static_scale(scale, name, fmt, fmt_name, dev, heads):
    """The static scale a format takes (None for the others): _check_scale's (tensor, number); a global
    scale (NVFP4's) is one element."""
    if fmt.global_scale:
        return _check_scale(scale, name, True, dev, None, f"{fmt_name} {fmt.name!r} (its global decode scale)")
    if fmt.scale == "static":
        what = f"a {str(fmt.cache_dtype).removeprefix('torch.')} cache"
    else:
        what = f"a static-scale {fmt_name} ({fmt.name!r} here)"
    return _check_scale(scale, name, fmt.scale == "static", dev, heads, what)


def _check_scale_cache(sc, name, fmt, fmt_name, cache, cache_name, head_dim, dev):
    """The scale cache of a format that stores its scales (None otherwise): its scale_dtype, the shape
    GQACacheFormat.scale_cache_shape gives for ``cache``, any strides, no element shared by two scales."""
    if fmt is None or not fmt.stores_scale:
        if sc is not None:
            have = "no " + cache_name if fmt is None else f"{fmt_name} {fmt.name!r}"
            raise ValueError(f"{name} must be None without a format that stores its scales ({have}), got a "
                             f"{type(sc).__name__}")
        return None
    if fmt.scale == "block" and head_dim % fmt.group:
        raise ValueError(f"{name}: {fmt_name} {fmt.name!r} has one scale per {fmt.group} values: the head dim must be "
                         f"a multiple of {fmt.group}, got {head_dim}")
    shape = fmt.scale_cache_shape(cache.shape, head_dim)
    if sc is None:
        raise ValueError(f"{name}: {fmt_name} {fmt.name!r} stores its scales: expected a {fmt.scale_dtype} tensor "
                         f"of shape {shape}, got None")
    check_tensor(sc, name, (fmt.scale_dtype,), dev, last_contiguous=False)
    if tuple(sc.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape} ({cache_name} {tuple(cache.shape)} under {fmt_name} "
                         f"{fmt.name!r}), got {tuple(sc.shape)}")
    if sc.numel() and row_limit(sc, name) < shape[0]:   # raises when the scales of one block overlap
        raise ValueError(f"{name}: its blocks overlap in memory (strides {sc.stride()}): a scale cache must not "
                         f"be expanded (stride 0) or otherwise overlap itself")
    return sc


def _check_output(t, name, act, dev, shape, fp8_ok=False):
    """q_out / k_out (or one part of a pair): the activations' dtype (or float8_e4m3fn where a scale may
    be given) and the shape given, rows that do not overlap each other."""
    check_tensor(t, name, (act, torch.float8_e4m3fn) if fp8_ok else (act,), dev, shape=shape)
    if shape[0] > row_limit(t, name):
        raise ValueError(f"{name}: its rows overlap in memory for n = {shape[0]} (strides {t.stride()}): an "
                         f"output must not be expanded (stride 0) or otherwise overlap itself")
    return t


def _width(t, dims):
    """The last dim of a tensor of ``dims`` dimensions, else -1 (for the messages of a bad pair)."""
    return t.shape[-1] if isinstance(t, torch.Tensor) and t.dim() == dims else -1


def _describe(t):
    return tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__


def _check_split(first, name, width, split, d):
    """The first part of a pair is ``width`` columns wide: those of the call's other pairs (split), and
    0 < width < head_dim."""
    if (split and width != split) or not 0 < width < d:
        want = f"{split} columns (the call's other pairs split there)" if split else \
            f"a last dim S with 0 < S < head_dim ({d})"
        raise ValueError(f"{name}[0]: expected {want}, got {_describe(first)}")
    return width


def _check_out_pair(out, name, act, dev, n, heads, d, split):
    """q_out / k_out given whole or as a pair split like the call's other pairs: (first, tail)."""
    first, tail = _parts(out, name)
    if tail is None:
        return _check_output(first, name, act, dev, (n, heads, d), True), None
    w = _check_split(first, name, _width(first, 3), split, d)
    _check_output(first, f"{name}[0]", act, dev, (n, heads, w), True)
    _check_output(tail, f"{name}[1]", first.dtype, dev, (n, heads, d - w))
    return first, tail


def _check_paged_append(pa: PagedAppend, n: int, dev):
    """The four index vectors of a PagedAppend given as slot_mapping: (batch_indices, positions, kv_indptr,
    kv_indices)."""
    check_index_vector(pa.batch_indices, "slot_mapping.batch_indices", n, dev)
    check_index_vector(pa.positions, "slot_mapping.positions", n, dev)
    for name in ("kv_indptr", "kv_indices"):
        t = getattr(pa, name)
        check_tensor(t, f"slot_mapping.{name}", INDEX_DTYPES, dev, last_contiguous=False)
        if t.dim() != 1:
            raise ValueError(f"slot_mapping.{name}: expected a 1-d tensor, got shape {tuple(t.shape)}")
    if pa.kv_indptr.shape[0] < 1:
        raise ValueError("slot_mapping.kv_indptr: expected num_requests + 1 >= 1 entries, got 0")
    for name in ("batch_indices", "positions", "kv_indptr", "kv_indices"):
        t = getattr(pa, name)
        if t.shape[0] > 1 and t.stride(0) != 1:     # the kernel reads each as a dense vector
            raise ValueError(f"slot_mapping.{name}: expected a contiguous vector (stride 1), got stride {t.stride(0)}")
    return pa.batch_indices, pa.positions, pa.kv_indptr, pa.kv_indices


def validate(q, k, v, k_cache, v_cache, slot_mapping, q_norm_args=None, k_norm_args=None, rope_args=None,
             k_scale=None, v_scale=None, layout="NHD", q_out=None, numerics="staged", k_out=None, q_scale=None,
             scale_convention="divide", k_format=None, v_format=None, k_scale_cache=None,
             v_scale_cache=None, v_norm_args=None) -> GQAPlan:
    """Check every argument (SPEC §3 and §9) and return the call's plan (``q_out`` / ``k_out`` as given:
    None when the call allocates them)."""
    q, q_tail = _parts(q, "q")
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor (or a pair of them), got {type(q).__name__}")
    dev = q.device
    d = _check_pair(q, q_tail, "q", dev, None, 0, ACTIVATION_DTYPES)   # no q heads: K and V alone
    act = q.dtype
    n, hq = q.shape[0], q.shape[1]
    k, k_tail = _parts(k, "k")
    if _check_pair(k, k_tail, "k", dev, n, 1, (act,)) != d:
        raise ValueError(f"k: expected head_dim {d} (q's), got {_describe(k)}"
                         + ("" if k_tail is None else f" and {_describe(k_tail)}"))
    hkv = k.shape[1]
    split = 0
    for first, tail, name in ((q, q_tail, "q"), (k, k_tail, "k")):
        if tail is not None:
            split = _check_split(first, name, first.shape[2], split, d)
    if hq % hkv:
        raise ValueError(f"q: num_heads {hq} must be a multiple of k's num_heads {hkv} (GQA / MHA)")
    if not isinstance(layout, str) or layout not in GQA_LAYOUTS:
        raise ValueError(f"layout must be one of {GQA_LAYOUTS}, got {layout!r}")
    profile(numerics)
    if not isinstance(scale_convention, str) or scale_convention not in SCALE_CONVENTIONS:
        raise ValueError(f"scale_convention must be one of {SCALE_CONVENTIONS}, got {scale_convention!r}")
    scales = (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale))
    numbers = [name for name, x in scales if _is_number(x)]
    tensors = [name for name, x in scales if isinstance(x, torch.Tensor)]
    if numbers and tensors:
        raise TypeError(f"{numbers[0]}: a number with {tensors[0]} a tensor; pass every scale of a call as a "
                        "number or every one as a tensor")
    if k_cache is None:
        if v_cache is not None:
            raise ValueError("k_cache: None with v_cache given; pass both caches, k_cache alone (no V), or neither "
                             "(k written to k_out)")
        for name, t in (("slot_mapping", slot_mapping), ("v_scale", v_scale), ("v_format", v_format),
                        ("k_scale_cache", k_scale_cache), ("v_scale_cache", v_scale_cache)):
            if t is not None:
                raise ValueError(f"{name} must be None without caches, got a {type(t).__name__}")
        plan = GQAPlan(q=q, k=k, v=v, k_cache=None, v_cache=None, slot_mapping=None, layout=layout,
                       numerics=numerics)
        if k_out is not None:
            plan.k_out, plan.k_out_tail = _check_out_pair(k_out, "k_out", act, dev, n, hkv, d, split)
            split = split or _width(plan.k_out, 3) * (plan.k_out_tail is not None)
        out_dtype = act if plan.k_out is None else plan.k_out.dtype
        kf = _given_format(k_format, "k_format")
        if kf is not None and (kf.stores_scale or kf.dtype_for(act) != out_dtype):
            raise ValueError(f"k_format: without caches k goes to k_out ({out_dtype}): expected None or a format of "
                             f"that dtype without stored scales, got {kf.name!r}")
        plan.k_format = _format_of(kf, plan.k_out if plan.k_out is not None else k, act).name
        plan.k_scale, plan.k_scale_value = _check_scale(k_scale, "k_scale", plan.k_fp8, dev, None,
                                                        "a float8_e4m3fn k_out")
    else:
        if k_out is not None:
            raise ValueError("k_out must be None when k goes to k_cache (k_out receives k only without caches)")
        kc, kc_tail = _parts(k_cache, "k_cache")
        if v_cache is None and v is not None:
            raise ValueError("v: given without v_cache; pass v_cache too, or v=None for a K cache alone")
        kf, vf = _given_format(k_format, "k_format"), _given_format(v_format, "v_format")
        if kc_tail is not None and kf is not None and kf.scale == "block":
            raise ValueError(f"k_cache: a pair of caches is not supported with k_format {kf.name!r} (whole heads)")
        if kc_tail is None:
            nb_bs = _check_cache(kc, "k_cache", layout, None, hkv, d, dev, act, kf, "k_format")
        else:
            split = _check_split(kc, "k_cache", _width(kc, 4), split, d)
            nb_bs = _check_cache(kc, "k_cache[0]", layout, None, hkv, split, dev, act, kf, "k_format")
            _check_cache(kc_tail, "k_cache[1]", layout, nb_bs, hkv, d - split, dev, act, kf, "k_format")
            if kc_tail.dtype != kc.dtype:
                raise TypeError(f"k_cache[1]: expected dtype {kc.dtype} (k_cache[0]'s), got {kc_tail.dtype}")
        kf = _format_of(kf, kc, act)
        if v_cache is not None:
            _check_heads(v, "v", dev, n, dtypes=(act,))
            if v.shape[1] != hkv:
                raise ValueError(f"v: expected {hkv} heads (k's), got shape {tuple(v.shape)}")
            _check_cache(v_cache, "v_cache", layout, nb_bs, hkv, v.shape[2], dev, act, vf, "v_format")
            if k_format is None and v_format is None and v_cache.dtype != kc.dtype:
                raise TypeError(f"v_cache: expected dtype {kc.dtype} (k_cache's), got {v_cache.dtype} (name k_format "
                                "and v_format for caches of two formats)")
            vf = _format_of(vf, v_cache, act)
        else:
            for name, t in (("v_scale", v_scale), ("v_format", v_format), ("v_scale_cache", v_scale_cache)):
                if t is not None:
                    raise ValueError(f"{name} must be None without v_cache, got a {type(t).__name__}")
        append = _check_paged_append(slot_mapping, n, dev) if isinstance(slot_mapping, PagedAppend) else None
        if append is None:
            check_index_vector(slot_mapping, "slot_mapping", n, dev)
        plan = GQAPlan(q=q, k=k, v=v, k_cache=kc, v_cache=v_cache, slot_mapping=None if append else slot_mapping,
                       layout=layout, numerics=numerics, k_cache_tail=kc_tail, k_format=kf.name)
        if append is not None:
            (plan.append_batch_indices, plan.append_positions, plan.append_kv_indptr,
             plan.append_kv_indices) = append
        plan.k_scale, plan.k_scale_value = _static_scale(k_scale, "k_scale", kf, "k_format", dev, hkv)
        plan.k_scale_cache = _check_scale_cache(k_scale_cache, "k_scale_cache", kf, "k_format", kc,
                                                "k_cache" if kc_tail is None else "k_cache[0]", d, dev)
        if v_cache is not None:
            plan.v_format = vf.name
            plan.v_scale, plan.v_scale_value = _static_scale(v_scale, "v_scale", vf, "v_format", dev, hkv)
            plan.v_scale_cache = _check_scale_cache(v_scale_cache, "v_scale_cache", vf, "v_format", v_cache,
                                                    "v_cache", v.shape[2], dev)
    if plan.has_cache:
        _check_global_scales(plan, scale_convention)
    plan.q_tail, plan.k_tail, plan.scale_convention = q_tail, k_tail, scale_convention
    plan.q_weight, plan.q_eps = check_rms_norm(q_norm_args, "q_norm_args", d, dev)
    plan.k_weight, plan.k_eps = check_rms_norm(k_norm_args, "k_norm_args", d, dev)
    if rope_args is not None:
        r, off = check_rope_args(rope_args, d, n, dev, offset_default_tail=False, table_dtypes=COS_SIN_DTYPES,
                                 mrope=True)
        cs = rope_args.cos_sin_cache
        plan.positions, plan.cos_sin, plan.rotary_dim, plan.rope_offset = rope_args.positions, cs, r, off
        plan.is_neox, plan.conjugate = rope_args.is_neox, rope_args.conjugate
        if rope_args.mrope_section is not None:
            plan.mrope_t, plan.mrope_h, plan.mrope_w = (int(x) for x in rope_args.mrope_section)
            plan.mrope_interleaved = rope_args.mrope_interleaved
    if v_norm_args is not None:
        if not plan.has_v:
            raise ValueError("v_norm_args must be None when no V is written (v_cache None), got a "
                             f"{type(v_norm_args).__name__}")
        plan.v_weight, plan.v_eps = check_rms_norm(v_norm_args, "v_norm_args", v.shape[2], dev, allow_weightless=True)
        plan.v_norm = True
    if q_out is not None:
        plan.q_out, plan.q_out_tail = _check_out_pair(q_out, "q_out", act, dev, n, hq, d, split)
    plan.q_scale, plan.q_scale_value = _check_scale(q_scale, "q_scale", plan.q_fp8, dev, None,
                                                    "a float8_e4m3fn q_out")
    return plan


def _check_global_scales(plan, scale_convention):
    """A format with a global decode scale (NVFP4's) takes the divide convention (SPEC §3)."""
    for fmt, fmt_name in ((plan.k_fmt, "k_format"), (plan.v_fmt, "v_format")):
        if fmt.global_scale and scale_convention != "divide":
            raise ValueError(f"scale_convention: {fmt_name} {fmt.name!r} takes a global decode scale: expected "
                             f"'divide', got {scale_convention!r}")


def validate_load(k_cache, v_cache, slot_mapping, layout="NHD", k_scale=None, v_scale=None, k_format=None,
                  v_format=None, k_scale_cache=None, v_scale_cache=None) -> tuple:
    """Check the arguments of :func:`kvfuse.load_gqa_kv_cache` with the rules of the write (SPEC §3):
    the caches' layout, shapes, dtypes and strides, slot_mapping, the formats, their static scales and
    scale caches. Returns the two caches' formats (GQACacheFormat)."""
    if not isinstance(layout, str) or layout not in GQA_LAYOUTS:
        raise ValueError(f"layout must be one of {GQA_LAYOUTS}, got {layout!r}")
    if not isinstance(k_cache, torch.Tensor):
        raise TypeError(f"k_cache must be a torch.Tensor, got {type(k_cache).__name__}")
    dev = k_cache.device
    four_d = k_cache.dim() == 4
    heads = (k_cache.shape[2] if layout == "NHD" else k_cache.shape[1]) if four_d else 0
    kf, vf = _given_format(k_format, "k_format"), _given_format(v_format, "v_format")
    k_dim = k_cache.shape[3] * (1 if kf is None else kf.values_per_element) if four_d else 0
    nb_bs = _check_cache(k_cache, "k_cache", layout, None, heads, k_dim, dev, None, kf, "k_format")
    v_dim = v_cache.shape[3] * (1 if vf is None else vf.values_per_element) \
        if isinstance(v_cache, torch.Tensor) and v_cache.dim() == 4 else 0
    _check_cache(v_cache, "v_cache", layout, nb_bs, heads, v_dim, dev, None, vf, "v_format")
    if k_format is None and v_format is None and v_cache.dtype != k_cache.dtype:
        raise TypeError(f"v_cache: expected dtype {k_cache.dtype} (k_cache's), got {v_cache.dtype} (name k_format "
                        "and v_format for caches of two formats)")
    n = slot_mapping.shape[0] if isinstance(slot_mapping, torch.Tensor) and slot_mapping.dim() == 1 else -1
    check_index_vector(slot_mapping, "slot_mapping", n, dev)
    kf = kf or _format_of(None, k_cache, k_cache.dtype if k_cache.dtype in ACTIVATION_DTYPES else None)
    vf = vf or _format_of(None, v_cache, v_cache.dtype if v_cache.dtype in ACTIVATION_DTYPES else None)
    _static_scale(k_scale, "k_scale", kf, "k_format", dev, heads)
    _static_scale(v_scale, "v_scale", vf, "v_format", dev, heads)
    _check_scale_cache(k_scale_cache, "k_scale_cache", kf, "k_format", k_cache, "k_cache", k_dim, dev)
    _check_scale_cache(v_scale_cache, "v_scale_cache", vf, "v_format", v_cache, "v_cache", v_dim, dev)
    return kf, vf

# =============================================================================== aliasing (SPEC §9)
_NAMES = ("q_out", "k_out", "k_cache", "v_cache", "q_out[1]", "k_out[1]", "k_cache[1]", "k_scale_cache",
          "v_scale_cache", "q", "k", "v", "q[1]",
          "k[1]", "slot_mapping", "q_norm_args.weight", "k_norm_args.weight", "rope_args.positions",
          "rope_args.cos_sin_cache", "k_scale", "v_scale", "q_scale", "slot_mapping.batch_indices",
          "slot_mapping.positions", "slot_mapping.kv_indptr", "slot_mapping.kv_indices", "v_norm_args.weight")
_FIELDS = ("q_out", "k_out", "k_cache", "v_cache", "q_out_tail", "k_out_tail", "k_cache_tail", "k_scale_cache",
           "v_scale_cache", "q", "k", "v",
           "q_tail", "k_tail", "slot_mapping", "q_weight", "k_weight", "positions", "cos_sin", "k_scale", "v_scale",
           "q_scale", "append_batch_indices", "append_positions", "append_kv_indptr", "append_kv_indices", "v_weight")
_OUTPUTS = 9                 # the first nine fields are written
_IN_PLACE = {("q_out", "q"), ("k_out", "k"), ("q_out_tail", "q_tail"), ("k_out_tail", "k_tail")}   # an output that may be its input itself
_VERDICTS = {}               # (tensor keys of a pair whose byte spans meet) -> True: their elements are disjoint
_VERDICTS_SIZE = 256
_verdict_lock = threading.Lock()


def _span(t: torch.Tensor):
    """[start, end) bytes of t's elements, None when it has none (strides are >= 0 in torch)."""
    if t.numel() == 0:
        return None
    extent = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    start = t.data_ptr()
    return start, start + extent * t.element_size()


def _coalesced(t: torch.Tensor) -> torch.Tensor:
    """t with adjacent dims merged where its strides allow (the same elements, fewer runs to compare:
    a vLLM cache view kv_cache[:, 0] becomes [num_blocks, block_bytes])."""
    dims = [(s, st) for s, st in zip(t.shape, t.stride()) if s != 1]
    out = []
    for s, st in reversed(dims):
        if out and out[-1][1] * out[-1][0] == st:
            out[-1] = (out[-1][0] * s, out[-1][1])
        else:
            out.append((s, st))
    out.reverse()
    if not out:
        out = [(1, 1)]
    return t.as_strided([s for s, _ in out], [st for _, st in out])


def _key(t):
    return t.data_ptr(), tuple(t.shape), t.stride(), t.element_size()


def check_overlap(plan: GQAPlan) -> None:
    """SPEC §9 for this entry point: q_out, k_out, k_cache, v_cache and the scale caches must not overlap
    each other or any input; q_out may be q itself and k_out k itself (the same elements: in place; each
    part of a pair its input's part). Byte spans first; where two spans meet, the
    elements are compared exactly (vLLM's k and v caches, kv_cache[:, 0] and kv_cache[:, 1], share one
    allocation without sharing an element, as do its per-token-head scales in the heads' padding); a verdict is remembered for the pair's pointers, shapes and
    strides. Meta tensors are not checked."""
    tensors = [getattr(plan, f) for f in _FIELDS]
    spans = [None if t is None else _span(t) for t in tensors]
    for i in range(_OUTPUTS):
        si = spans[i]
        if si is None:
            continue
        for j in range(len(tensors)):
            sj = spans[j]
            if j == i or sj is None or (j < _OUTPUTS and j < i) or not (sj[0] < si[1] and si[0] < sj[1]):
                continue
            a, b = tensors[i], tensors[j]
            if (_FIELDS[i], _FIELDS[j]) in _IN_PLACE and same_elements(a, b):
                continue                                    # in place
            key = (_key(a), _key(b))
            if key in _VERDICTS:
                continue
            if tensors_overlap(_coalesced(a), _coalesced(b)):
                what = "another output" if j < _OUTPUTS else "an input"
                hint = f" ({_NAMES[i]} may be {_NAMES[j]} itself, the same view, for an in-place call)" \
                    if (_FIELDS[i], _FIELDS[j]) in _IN_PLACE else ""
                raise ValueError(f"{_NAMES[i]} overlaps {_NAMES[j]} in memory: an output must not overlap "
                                 f"{what}{hint}")
            with _verdict_lock:
                if len(_VERDICTS) >= _VERDICTS_SIZE:
                    _VERDICTS.clear()
                _VERDICTS[key] = True


def _like(t):
    """A new contiguous tensor of t's shape, dtype and device (None for None)."""
    return None if t is None else torch.empty(t.shape, dtype=t.dtype, device=t.device)


def prepare(q, k, v, k_cache, v_cache, slot_mapping, q_norm_args=None, k_norm_args=None, rope_args=None,
            k_scale=None, v_scale=None, layout="NHD", q_out=None, numerics="staged", k_out=None, q_scale=None,
            scale_convention="divide", k_format=None, v_format=None, k_scale_cache=None,
            v_scale_cache=None, v_norm_args=None) -> GQAPlan:
    """The call's plan: validated, q_out (and k_out without caches) allocated when not given (like q and
    k: a pair for a pair), the aliasing rules checked (eagerly: not on meta tensors or while tracing)."""
    plan = validate(q, k, v, k_cache, v_cache, slot_mapping, q_norm_args, k_norm_args, rope_args, k_scale, v_scale,
                    layout, q_out, numerics, k_out, q_scale, scale_convention, k_format, v_format, k_scale_cache,
                    v_scale_cache, v_norm_args)
    if plan.q_out is None:
        plan.q_out, plan.q_out_tail = _like(plan.q), _like(plan.q_tail)
    if not plan.has_cache and plan.k_out is None:
        plan.k_out, plan.k_out_tail = _like(plan.k), _like(plan.k_tail)
    if addresses_known(plan.device):
        check_overlap(plan)
    return plan


# =============================================================================== the plan cache
# A validated signature of this entry point keeps a GQATemplate in the plan cache (kvfuse.plans.cache: the
# switch, the size, what a key holds). The key (call_signature) holds every value validate reads: per
# tensor its type, dtype, shape, strides and device, a leading dim equal to the call's n (q's) written
# ROWS for the tensors whose rows are tokens (q, k, v, q_out, k_out, their tails, slot_mapping,
# rope_args.positions, a PagedAppend's batch_indices and positions); a PagedAppend's kv_indptr and
# kv_indices without their lengths (validation reads only whether kv_indptr is empty; the kernel takes
# both lengths as arguments, so its launches are kept per length too); a pair (a head held as two
# tensors) as its type and both tensors; argument objects by exact class and field (each value with its
# type); scales given as numbers by value (fp32 kernel arguments); layout, numerics, scale_convention
# and the formats (a name or a GQACacheFormat) with their types. The numbers of this entry (eps, scales)
# must be finite and > 0, so unlike kvfuse.plans.cache.number_key a float's sign is not keyed (0.0 and
# -0.0 are both rejected). q, k, v, q_out and k_out are keyed as 3-d tensors, one flat tuple each (the
# cheapest key on the host: it is built on every call); a call with one of other dims is not keyed
# (validation rejects it, except a v that no cache reads). Read on every call instead: whether the rows of a
# q_out / k_out given overlap at this n (a signature keeps the largest n for which they do not), and the
# aliasing rules (_Aliasing: byte spans from the data pointers, then check_overlap where two meet).
_ROWS_FIELDS = frozenset(("q_out", "k_out", "q_out_tail", "k_out_tail", "q", "k", "v", "q_tail", "k_tail",
                          "slot_mapping", "positions", "append_batch_indices", "append_positions"))
_OWN_LENGTH_FIELDS = frozenset(("append_kv_indptr", "append_kv_indices"))   # lengths not in the key
_AT = {field: i for i, field in enumerate(_FIELDS)}
_Q, _Q_OUT, _K_OUT = _AT["q"], _AT["q_out"], _AT["k_out"]
_ALIASING_MEMO_SIZE = 64
_CODE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)   # written by the kernel as bytes


def _pair(x):
    """(first, tail) of a validated argument that may be a pair; (x, None) otherwise."""
    return (x[0], x[1]) if isinstance(x, (tuple, list)) else (x, None)


_PAIR_TYPES = (tuple, list)


def _heads_key(t, n):
    """Key of a 3-d tensor whose rows are tokens (q, k, v, q_out, k_out or a part of a pair): one flat tuple,
    the leading dim written ROWS where it is n. Raises for any other number of dims (validation rejects
    those, except a v that no cache reads: such a call is validated every time)."""
    a, b, c = t.shape
    return type(t), t.dtype, ROWS if a == n else a, b, c, t.stride(), t.device


def _vector_key(t, n):
    """Key of a 1-d tensor whose entries are tokens (slot_mapping, RoPE's positions, a PagedAppend's
    batch_indices and positions); raises for any other number of dims (validation rejects those)."""
    a, = t.shape
    return type(t), t.dtype, ROWS if a == n else a, t.stride(), t.device


def _pair_key(x, n):
    """(key, first, tail) of a pair of [n, H, S] and [n, H, D - S] tensors; raises unless x has two items."""
    first, tail = x
    return (type(x), _heads_key(first, n), _heads_key(tail, n)), first, tail


def _output_key(x, n):
    """(key, first, tail) of q_out / k_out: None, a tensor (tail None) or a pair."""
    if x is None:
        return None, None, None
    if type(x) in _PAIR_TYPES:
        return _pair_key(x, n)
    return _heads_key(x, n), x, None


def _index_key(t):
    """Key of a PagedAppend's kv_indptr / kv_indices: its length left out (see above)."""
    return (type(t), t.dtype, t.dim(), t.stride(), t.device, t.numel() == 0)


def _scale_key(s):
    """Key of q_scale / k_scale / v_scale: None, a tensor, or a number with its type (a number must be
    finite and > 0, so its sign needs no key)."""
    if s is None:
        return None
    if isinstance(s, torch.Tensor):
        return type(s), s.dtype, s.shape, s.stride(), s.device
    return type(s), s


def _key_and_tensors(q, k, v, k_cache, v_cache, slot_mapping, q_norm_args, k_norm_args, rope_args, k_scale,
                     v_scale, layout, q_out, numerics, k_out, q_scale, scale_convention, k_format, v_format,
                     k_scale_cache, v_scale_cache, v_norm_args):
    """(key, tensors) of a call in one pass over its arguments: the key (see "the plan cache" above) and
    the call's tensors by GQAPlan field in _FIELDS' order (a list, None where absent; the outputs the
    call allocates still None). Raises for arguments it does not key: such a call is validated every
    time (and rejected when invalid)."""
    if type(q) in _PAIR_TYPES:
        n = q[0].shape[0]
        q_key, q, q_tail = _pair_key(q, n)
    else:
        n = q.shape[0]
        q_key, q_tail = _heads_key(q, n), None
    if type(k) in _PAIR_TYPES:
        k_key, k, k_tail = _pair_key(k, n)
    else:
        k_key, k_tail = _heads_key(k, n), None
    v_key = None if v is None else _heads_key(v, n)
    q_out_key, q_out, q_out_tail = _output_key(q_out, n)
    k_out_key, k_out, k_out_tail = _output_key(k_out, n)
    k_cache_tail = None
    if k_cache is None:
        k_cache_key = None
    elif type(k_cache) in _PAIR_TYPES:
        pair_type = type(k_cache)
        k_cache, k_cache_tail = k_cache
        k_cache_key = (pair_type, tensor_key(k_cache), tensor_key(k_cache_tail))
    else:
        k_cache_key = (type(k_cache), k_cache.dtype, k_cache.shape, k_cache.stride(), k_cache.device)
    v_cache_key = None if v_cache is None else \
        (type(v_cache), v_cache.dtype, v_cache.shape, v_cache.stride(), v_cache.device)
    batch_indices = append_positions = kv_indptr = kv_indices = None
    if slot_mapping is None:
        slots_key = None
    elif type(slot_mapping) is PagedAppend:
        pa = slot_mapping
        batch_indices, append_positions, kv_indptr, kv_indices = pa.batch_indices, pa.positions, pa.kv_indptr, \
            pa.kv_indices
        slots_key = (PagedAppend, _vector_key(batch_indices, n), _vector_key(append_positions, n),
                     _index_key(kv_indptr), _index_key(kv_indices))
        slot_mapping = None
    else:
        slots_key = _vector_key(slot_mapping, n)
    q_norm_key, q_weight = norm_args_key(q_norm_args)
    k_norm_key, k_weight = norm_args_key(k_norm_args)
    v_norm_key, v_weight = norm_args_key(v_norm_args)
    rope_key = rope_args_key(rope_args, n)       # raises for a class it does not key
    positions, cos_sin = (None, None) if rope_args is None else (rope_args.positions, rope_args.cos_sin_cache)
    k_scale_key, v_scale_key, q_scale_key = _scale_key(k_scale), _scale_key(v_scale), _scale_key(q_scale)
    key = ("gqa", q_key, k_key, v_key, k_cache_key, v_cache_key, slots_key, q_norm_key, k_norm_key, rope_key,
           k_scale_key, v_scale_key, type(layout), layout, q_out_key, type(numerics), numerics, k_out_key,
           q_scale_key, type(scale_convention), scale_convention, type(k_format), k_format, type(v_format), v_format,
           None if k_scale_cache is None else tensor_key(k_scale_cache),
           None if v_scale_cache is None else tensor_key(v_scale_cache), v_norm_key)
    tensor = torch.Tensor
    tensors = [q_out, k_out, k_cache, v_cache, q_out_tail, k_out_tail, k_cache_tail, k_scale_cache, v_scale_cache, q,
               k, v, q_tail, k_tail, slot_mapping, q_weight, k_weight, positions, cos_sin,
               k_scale if isinstance(k_scale, tensor) else None, v_scale if isinstance(v_scale, tensor) else None,
               q_scale if isinstance(q_scale, tensor) else None, batch_indices, append_positions, kv_indptr,
               kv_indices, v_weight]
    return key, tensors


def call_signature(q, k, v, k_cache, v_cache, slot_mapping, q_norm_args=None, k_norm_args=None, rope_args=None,
                   k_scale=None, v_scale=None, layout="NHD", q_out=None, numerics="staged", k_out=None, q_scale=None,
                   scale_convention="divide", k_format=None, v_format=None, k_scale_cache=None, v_scale_cache=None,
                   v_norm_args=None):
    """(key, pinned) of a call (see "the plan cache" above); may raise for arguments it cannot key, which
    are then validated (and rejected) on every call."""
    return _key_and_tensors(q, k, v, k_cache, v_cache, slot_mapping, q_norm_args, k_norm_args, rope_args, k_scale,
                            v_scale, layout, q_out, numerics, k_out, q_scale, scale_convention, k_format, v_format,
                            k_scale_cache, v_scale_cache, v_norm_args)[0], ()


def _call_tensors(q, k, v, k_cache, v_cache, slot_mapping, q_norm_args, k_norm_args, rope_args, k_scale, v_scale,
                  q_out, k_out, q_scale, k_scale_cache, v_scale_cache, v_norm_args) -> list:
    """The tensors of a validated call by GQAPlan field, in _FIELDS' order (None where absent), for a call
    that _key_and_tensors does not key."""
    q, q_tail = _pair(q)
    k, k_tail = _pair(k)
    kc, kc_tail = _pair(k_cache)
    qo, qo_tail = _pair(q_out)
    ko, ko_tail = _pair(k_out)
    if isinstance(slot_mapping, PagedAppend):
        pa = slot_mapping
        slots, append = None, (pa.batch_indices, pa.positions, pa.kv_indptr, pa.kv_indices)
    else:
        slots, append = slot_mapping, (None, None, None, None)
    pos, cs = (None, None) if rope_args is None else (rope_args.positions, rope_args.cos_sin_cache)
    return [qo, ko, kc, v_cache, qo_tail, ko_tail, kc_tail, k_scale_cache, v_scale_cache, q, k, v, q_tail, k_tail,
            slots,
            None if q_norm_args is None else q_norm_args.weight, None if k_norm_args is None else k_norm_args.weight,
            pos, cs, _tensor_or_none(k_scale), _tensor_or_none(v_scale), _tensor_or_none(q_scale), *append,
            None if v_norm_args is None else v_norm_args.weight]


def _tensor_or_none(s):
    return s if isinstance(s, torch.Tensor) else None     # a scale given as a number is in the template


def _mrope_position_terms(t: torch.Tensor, n: int):
    """span_terms of mRoPE's positions [3, n] (a token per column): (fixed bytes, bytes per token) of
    [data_ptr, data_ptr + es * (1 + 2 stride(0) + (n - 1) stride(1))), stride(0) itself n where it is n
    (the key holds it as the call's n then, kvfuse.plans.cache.rope_args_key); None when it holds no bytes."""
    if t.numel() == 0:
        return None
    es, (s0, s1) = t.element_size(), t.stride()
    if s0 == n:
        return es * (1 - s1), es * (2 + s1)
    return es * (1 + 2 * s0 - s1), es * s1


_data_ptr = torch.Tensor.data_ptr


def _picker(at: tuple):
    """A function of a sequence: its items at the positions ``at``, as a tuple (operator.itemgetter, which
    returns a lone item bare)."""
    if len(at) >= 2:
        return operator.itemgetter(*at)
    return lambda items: tuple(items[i] for i in at)


class _Aliasing:
    """SPEC §9 on every call of one signature, cheaply: each tensor's byte span [data_ptr, data_ptr +
    fixed + per_row * rows) (rows: n, or a PagedAppend vector's own length) for every output / other pair
    of check_overlap's; a pair whose spans meet passes when it is an output and its input in place (the
    same pointer, and strides equal: the key holds them), or when a call with the same pair at the same
    distance and span sizes passed; any other meeting runs check_overlap on the call (exact; its errors).
The spans are a function of the pointers, n and the own lengths, so a call with those of the last call
that passed passes (``last``: one tuple compare in place of the pairs, the case of a decode loop)."""

    __slots__ = ("at", "terms", "own", "pairs", "passed", "last", "pick", "own_at")

    def __init__(self, plan: GQAPlan, allocated: frozenset):
        at, terms, own = [], [], []
        for i, field in enumerate(_FIELDS):
            t = getattr(plan, field)
            if t is None or field in allocated:
                continue                        # absent, or allocated by the call: overlaps nothing
            # rows: a token per row (v without caches is not validated: rows only where it has n of them)
            rows = field in _OWN_LENGTH_FIELDS or (field in _ROWS_FIELDS and t.dim() > 0 and t.shape[0] == plan.n)
            if field == "positions" and plan.mrope_section is not None:
                found = _mrope_position_terms(t, plan.n)
            else:
                found = span_terms(t, rows)
            if found is None:
                continue                        # no bytes at any n
            at.append(i)
            terms.append(found)
            own.append(field in _OWN_LENGTH_FIELDS)
        pairs = []
        for kk, i in enumerate(at):
            if i >= _OUTPUTS:
                break
            for jj, j in enumerate(at):
                if j == i or (j < _OUTPUTS and j < i):
                    continue
                a, b = getattr(plan, _FIELDS[i]), getattr(plan, _FIELDS[j])
                in_place = None
                if (_FIELDS[i], _FIELDS[j]) in _IN_PLACE and a.dtype == b.dtype and a.shape[1:] == b.shape[1:] and \
                        all(x == y for x, y, size in zip(a.stride()[1:], b.stride()[1:], a.shape[1:]) if size > 1):
                    in_place = a.stride(0) == b.stride(0)   # True: the same elements at every n, False: at n = 1
                pairs.append((kk, jj, in_place))
        self.at, self.terms, self.own, self.pairs = tuple(at), tuple(terms), tuple(own), tuple(pairs)
        self.pick = _picker(self.at)            # the call's tensors at ``at``, as a tuple
        self.own_at = tuple(i for i, own in zip(at, own) if own)
        self.passed = {}                        # (pair, distance, span sizes) of calls that passed
        self.last = None                        # (n, pointers, own lengths) of the last call that passed

    def __call__(self, tensors, n: int, template: "GQATemplate") -> None:
        if n == 0:
            check_overlap(template.bind(tensors))
            return
        ptrs = tuple(map(_data_ptr, self.pick(tensors)))
        state = (n, ptrs, tuple(tensors[i].shape[0] for i in self.own_at)) if self.own_at else (n, ptrs)
        if state == self.last:
            return
        sizes = []
        for i, (fixed, per_row), own in zip(self.at, self.terms, self.own):
            rows = tensors[i].shape[0] if own else n
            sizes.append(fixed + per_row * rows if rows else 0)
        meeting = None
        for kk, jj, in_place in self.pairs:
            pk, pj = ptrs[kk], ptrs[jj]
            if pj < pk + sizes[kk] and pk < pj + sizes[jj]:
                if in_place is not None and pk == pj and (in_place or n == 1):
                    continue                    # the output is its input itself
                key = (kk, jj, pj - pk, sizes[kk], sizes[jj])
                if key not in self.passed:
                    meeting = (meeting or []) + [key]
        if meeting is not None:
            check_overlap(template.bind(tensors))   # raises with the error of an uncached call
            passed = self.passed
            if len(passed) + len(meeting) > _ALIASING_MEMO_SIZE:
                passed.clear()
            passed.update(dict.fromkeys(meeting, True))
        self.last = state


class GQATemplate(CacheEntry):
    """A validated signature of :func:`kvfuse.fused_qk_norm_rope_store_kv`: its GQAPlan without tensors.
    A call's tensors are a tuple by GQAPlan field in _FIELDS' order (``tensors``); ``bind`` makes them
    the call's plan, ``result`` what the call returns. ``launches``: the Triton launches kept per batch
    size (kvfuse.kernels.qkv.run_template)."""

    __slots__ = ("plan", "allocate", "plain_outputs", "row_limit", "aliasing", "device", "device_type", "has_cache",
                 "q_pair", "k_out_pair", "codes_at", "lengths_at", "launches")
    rows_at = _Q                               # q: its leading dim is the call's n
    tensor_index = _AT

    def __init__(self, plan: GQAPlan, allocate: tuple):
        super().__init__()
        given_outputs = [getattr(plan, f) for f in ("q_out", "q_out_tail", "k_out", "k_out_tail")
                         if f not in allocate and getattr(plan, f) is not None]
        self.row_limit = min((row_limit(t, "") for t in given_outputs), default=INF)
        allocated = frozenset(f for f, _ in allocate)
        self.aliasing = _Aliasing(plan, allocated) if addresses_known(plan.device) else None
        self.plan = dataclasses.replace(plan, **{f: None for f in _FIELDS})
        self.allocate = tuple((_AT[f], _AT[like]) for f, like in allocate)   # (output, the tensor it is shaped like)
        # an output shaped like a plain torch.Tensor (the key holds the type) is allocated by empty_like (a
        # third of torch.empty's host time), contiguous: the tensor prepare allocates
        self.plain_outputs = all(type(getattr(plan, like)) is torch.Tensor for _, like in allocate)
        self.device, self.device_type = plan.device, plan.device.type
        self.has_cache = plan.has_cache
        self.q_pair = plan.q_out_tail is not None or "q_out_tail" in allocated      # q_out returned as a pair
        self.k_out_pair = plan.k_out_tail is not None or "k_out_tail" in allocated
        self.codes_at = tuple(i for i, f in enumerate(_FIELDS) if getattr(plan, f) is not None
                              and getattr(plan, f).dtype in _CODE_DTYPES)
        self.lengths_at = (_AT["append_kv_indptr"], _AT["append_kv_indices"]) if plan.paged_append else None
        self.launches = {}

    def bind(self, tensors) -> GQAPlan:
        plan = GQAPlan.__new__(GQAPlan)      # a shallow copy of the template's plan (copy.copy costs more)
        plan.__dict__.update(self.plan.__dict__)
        plan.__dict__.update(zip(_FIELDS, tensors))
        return plan

    def kernel_tensors(self, tensors) -> tuple:
        """The tensors as the kernel takes them: a cache of codes (e4m3, e5m2, int8) as bytes."""
        if not self.codes_at:
            return tensors
        out = list(tensors)
        for i in self.codes_at:
            out[i] = out[i].view(torch.uint8)
        return tuple(out)

    def result(self, tensors):
        """What the call returns: q_out (a pair for a pair), and without caches k_out too."""
        q_out = (tensors[_Q_OUT], tensors[_AT["q_out_tail"]]) if self.q_pair else tensors[_Q_OUT]
        if self.has_cache:
            return q_out
        return q_out, ((tensors[_K_OUT], tensors[_AT["k_out_tail"]]) if self.k_out_pair else tensors[_K_OUT])


def _new_template(*args) -> GQATemplate:
    plan = validate(*args)
    allocate = []
    if plan.q_out is None:
        allocate += [("q_out", "q")] + ([("q_out_tail", "q_tail")] if plan.q_tail is not None else [])
    if not plan.has_cache and plan.k_out is None:
        allocate += [("k_out", "k")] + ([("k_out_tail", "k_tail")] if plan.k_tail is not None else [])
    return GQATemplate(plan, tuple(allocate))


def prepare_call(q, k, v, k_cache, v_cache, slot_mapping, q_norm_args=None, k_norm_args=None, rope_args=None,
                 k_scale=None, v_scale=None, layout="NHD", q_out=None, numerics="staged", k_out=None, q_scale=None,
                 scale_convention="divide", k_format=None, v_format=None, k_scale_cache=None, v_scale_cache=None,
                 v_norm_args=None):
    """(template, tensors) of an eager call (not while torch.compile traces): its signature's template
    (found in the plan cache, or validated and stored; validated alone while the cache is off), the call's
    tensors with the outputs it allocates, the aliasing rules checked. Raises what ``prepare`` raises."""
    args = (q, k, v, k_cache, v_cache, slot_mapping, q_norm_args, k_norm_args, rope_args, k_scale, v_scale, layout,
            q_out, numerics, k_out, q_scale, scale_convention, k_format, v_format, k_scale_cache, v_scale_cache,
            v_norm_args)
    key = template = None
    if PLAN_CACHE.enabled:
        try:
            key, tensors = _key_and_tensors(*args)
            template = PLAN_CACHE.lookup(key)
        except Exception:  # an argument that cannot be keyed (a wrong type, unhashable): validation says why
            key = None
    if template is None:
        template = _new_template(*args)     # raises for a bad call
        if key is not None:
            PLAN_CACHE.store(key, template, ())
        else:
            tensors = _call_tensors(q, k, v, k_cache, v_cache, slot_mapping, q_norm_args, k_norm_args, rope_args,
                                    k_scale, v_scale, q_out, k_out, q_scale, k_scale_cache, v_scale_cache, v_norm_args)
    n = tensors[_Q].shape[0]
    if n > template.row_limit:
        validate(*args)    # raises: a q_out / k_out whose rows overlap at this n (the error of an uncached call)
    for i, like in template.allocate:
        t = tensors[like]
        tensors[i] = torch.empty_like(t, memory_format=torch.contiguous_format) if template.plain_outputs else \
            torch.empty(t.shape, dtype=t.dtype, device=t.device)
    if template.aliasing is not None:
        template.aliasing(tensors, n, template)
    return template, tuple(tensors)
