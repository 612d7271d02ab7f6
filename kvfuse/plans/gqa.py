"""Validation of :func:`kvfuse.fused_qk_norm_rope_store_kv` (SPEC §11 and §5) into a
:class:`~.types.GQAPlan`, and its aliasing check: q_out, k_out, k_cache and v_cache must not overlap
each other or any input (q_out may be q itself, k_out k itself: in place)."""
from __future__ import annotations

import threading

import torch

from ..overlap import addresses_known, row_limit, same_elements, tensors_overlap
from ..numerics_profiles import ACTIVATION_DTYPES, profile
from .rules import check_index_vector, check_rms_norm, check_rope_args, check_tensor
from .types import GQA_LAYOUTS, GQAPlan

# an unquantized cache holds the activations' dtype
CACHE_DTYPES = ACTIVATION_DTYPES + (torch.float8_e4m3fn,)
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


def _check_cache(cache, name, layout, nb_bs, heads, dim, dev, act=None):
    """act: the activations' dtype (an unquantized cache must hold it), None: any of CACHE_DTYPES."""
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cache).__name__}")
    allowed = CACHE_DTYPES if act is None else (act, torch.float8_e4m3fn)
    if cache.dtype not in allowed:
        raise TypeError(f"{name}: expected dtype {' or '.join(str(d) for d in allowed)}, got {cache.dtype}")
    if cache.device != dev:
        raise ValueError(f"{name}: expected device {dev}, got {cache.device}")
    want = "[num_blocks, block_size, num_kv_heads, head_dim]" if layout == "NHD" else \
        "[num_blocks, num_kv_heads, block_size, head_dim]"
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


def _check_scale(scale, name, fp8, dev, heads):
    if not fp8:
        if scale is not None:
            raise ValueError(f"{name} must be None without a float8_e4m3fn cache, got a {type(scale).__name__}")
        return None
    if scale is None:
        raise ValueError(f"{name}: a float8_e4m3fn cache needs its fp32 scale (one, or one per kv head), got None")
    check_tensor(scale, name, (torch.float32,), dev, last_contiguous=False)
    one = scale.numel() == 1 and scale.dim() <= 1
    if not one and tuple(scale.shape) != (heads,):
        raise ValueError(f"{name}: expected one element (shape () or (1,)) or one per kv head (shape ({heads},)), "
                         f"got shape {tuple(scale.shape)}")
    if not one and scale.stride(0) != 1:
        raise ValueError(f"{name}: a per-head scale must be contiguous (stride 1), got stride {scale.stride(0)}")
    return scale


def validate(q, k, v, k_cache, v_cache, slot_mapping, q_norm_args=None, k_norm_args=None, rope_args=None,
             k_scale=None, v_scale=None, layout="NHD", q_out=None, numerics="staged", k_out=None) -> GQAPlan:
    """Check every argument (SPEC §11 and §5) and return the call's plan (``q_out`` / ``k_out`` as given:
    None when the call allocates them)."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    dev = q.device
    _check_heads(q, "q", dev, min_heads=0)     # no q heads: K and V alone (an engine's cache write)
    act = q.dtype
    n, hq, d = q.shape
    _check_heads(k, "k", dev, n, dtypes=(act,))
    hkv = k.shape[1]
    if k.shape[2] != d:
        raise ValueError(f"k: expected head_dim {d} (q's), got shape {tuple(k.shape)}")
    if v is not None or k_cache is not None or v_cache is not None:     # v may be None without caches
        _check_heads(v, "v", dev, n, dtypes=(act,))
        if v.shape[1] != hkv:
            raise ValueError(f"v: expected {hkv} heads (k's), got shape {tuple(v.shape)}")
    if hq % hkv:
        raise ValueError(f"q: num_heads {hq} must be a multiple of k's num_heads {hkv} (GQA / MHA)")
    if not isinstance(layout, str) or layout not in GQA_LAYOUTS:
        raise ValueError(f"layout must be one of {GQA_LAYOUTS}, got {layout!r}")
    profile(numerics)
    if k_cache is None or v_cache is None:
        if k_cache is not None or v_cache is not None:
            given, missing = ("k_cache", "v_cache") if k_cache is not None else ("v_cache", "k_cache")
            raise ValueError(f"{missing}: None with {given} given; pass both caches, or neither (k written to k_out)")
        for name, t in (("slot_mapping", slot_mapping), ("k_scale", k_scale), ("v_scale", v_scale)):
            if t is not None:
                raise ValueError(f"{name} must be None without caches, got a {type(t).__name__}")
        plan = GQAPlan(q=q, k=k, v=v, k_cache=None, v_cache=None, slot_mapping=None, layout=layout,
                       numerics=numerics)
        if k_out is not None:
            plan.k_out = _check_output(k_out, "k_out", act, dev, (n, hkv, d))
    else:
        if k_out is not None:
            raise ValueError("k_out must be None when k goes to k_cache (k_out receives k only without caches)")
        nb_bs = _check_cache(k_cache, "k_cache", layout, None, hkv, d, dev, act)
        _check_cache(v_cache, "v_cache", layout, nb_bs, hkv, v.shape[2], dev, act)
        if v_cache.dtype != k_cache.dtype:
            raise TypeError(f"v_cache: expected dtype {k_cache.dtype} (k_cache's), got {v_cache.dtype}")
        check_index_vector(slot_mapping, "slot_mapping", n, dev)
        fp8 = k_cache.dtype == torch.float8_e4m3fn
        plan = GQAPlan(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping, layout=layout,
                       k_scale=_check_scale(k_scale, "k_scale", fp8, dev, hkv),
                       v_scale=_check_scale(v_scale, "v_scale", fp8, dev, hkv), numerics=numerics)
    plan.q_weight, plan.q_eps = check_rms_norm(q_norm_args, "q_norm_args", d, dev)
    plan.k_weight, plan.k_eps = check_rms_norm(k_norm_args, "k_norm_args", d, dev)
    if rope_args is not None:
        r, off = check_rope_args(rope_args, d, n, dev, offset_default_tail=False, table_dtypes=COS_SIN_DTYPES)
        cs = rope_args.cos_sin_cache
        plan.positions, plan.cos_sin, plan.rotary_dim, plan.rope_offset = rope_args.positions, cs, r, off
        plan.is_neox, plan.conjugate = rope_args.is_neox, rope_args.conjugate
    if q_out is not None:
        plan.q_out = _check_output(q_out, "q_out", act, dev, (n, hq, d))
    return plan


def _check_output(t, name, act, dev, shape):
    """q_out / k_out: the activations' dtype and the shape given, rows that do not overlap each other."""
    check_tensor(t, name, (act,), dev, shape=shape)
    if shape[0] > row_limit(t, name):
        raise ValueError(f"{name}: its rows overlap in memory for n = {shape[0]} (strides {t.stride()}): an "
                         f"output must not be expanded (stride 0) or otherwise overlap itself")
    return t


def validate_load(k_cache, v_cache, slot_mapping, layout="NHD", k_scale=None, v_scale=None) -> None:
    """Check the arguments of :func:`kvfuse.load_gqa_kv_cache` with the rules of the write (SPEC §11):
    the caches' layout, shapes, dtypes and strides, slot_mapping, and the scales of fp8 caches."""
    if not isinstance(layout, str) or layout not in GQA_LAYOUTS:
        raise ValueError(f"layout must be one of {GQA_LAYOUTS}, got {layout!r}")
    if not isinstance(k_cache, torch.Tensor):
        raise TypeError(f"k_cache must be a torch.Tensor, got {type(k_cache).__name__}")
    dev = k_cache.device
    four_d = k_cache.dim() == 4
    heads = (k_cache.shape[2] if layout == "NHD" else k_cache.shape[1]) if four_d else 0
    nb_bs = _check_cache(k_cache, "k_cache", layout, None, heads, k_cache.shape[3] if four_d else 0, dev)
    v_dim = v_cache.shape[3] if isinstance(v_cache, torch.Tensor) and v_cache.dim() == 4 else 0
    _check_cache(v_cache, "v_cache", layout, nb_bs, heads, v_dim, dev)
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"v_cache: expected dtype {k_cache.dtype} (k_cache's), got {v_cache.dtype}")
    n = slot_mapping.shape[0] if isinstance(slot_mapping, torch.Tensor) and slot_mapping.dim() == 1 else -1
    check_index_vector(slot_mapping, "slot_mapping", n, dev)
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    _check_scale(k_scale, "k_scale", fp8, dev, heads)
    _check_scale(v_scale, "v_scale", fp8, dev, heads)

# =============================================================================== aliasing (SPEC §5)
_NAMES = ("q_out", "k_out", "k_cache", "v_cache", "q", "k", "v", "slot_mapping", "q_norm_args.weight",
          "k_norm_args.weight", "rope_args.positions", "rope_args.cos_sin_cache", "k_scale", "v_scale")
_FIELDS = ("q_out", "k_out", "k_cache", "v_cache", "q", "k", "v", "slot_mapping", "q_weight", "k_weight",
           "positions", "cos_sin", "k_scale", "v_scale")
_OUTPUTS = 4                 # the first four fields are written
_IN_PLACE = {("q_out", "q"), ("k_out", "k")}   # an output that may be its input itself
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
    """SPEC §5 for this entry point: q_out, k_out, k_cache and v_cache must not overlap each other or any
    input; q_out may be q itself and k_out k itself (the same elements: in place). Byte spans first; where two spans meet, the
    elements are compared exactly (vLLM's k and v caches, kv_cache[:, 0] and kv_cache[:, 1], share one
    allocation without sharing an element); a verdict is remembered for the pair's pointers, shapes and
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


def prepare(q, k, v, k_cache, v_cache, slot_mapping, q_norm_args=None, k_norm_args=None, rope_args=None,
            k_scale=None, v_scale=None, layout="NHD", q_out=None, numerics="staged", k_out=None) -> GQAPlan:
    """The call's plan: validated, q_out (and k_out without caches) allocated when not given, the aliasing
    rules checked (eagerly: not on meta tensors or while tracing)."""
    plan = validate(q, k, v, k_cache, v_cache, slot_mapping, q_norm_args, k_norm_args, rope_args, k_scale, v_scale,
                    layout, q_out, numerics, k_out)
    if plan.q_out is None:
        plan.q_out = torch.empty((plan.n,) + tuple(q.shape[1:]), dtype=q.dtype, device=q.device)
    if not plan.has_cache and plan.k_out is None:
        plan.k_out = torch.empty((plan.n,) + tuple(k.shape[1:]), dtype=k.dtype, device=k.device)
    if addresses_known(q.device):
        check_overlap(plan)
    return plan
