"""K and V of GQA / MHA attention (SPEC §11): :func:`fused_qk_norm_rope_store_kv`.

For the models that are not MLA (Llama, Qwen3, Gemma 3, ...): one call takes the q, k, v heads of a
batch of tokens (views of one packed QKV projection allowed), applies the per-head QK-norm and RoPE to
q and k, writes q back as bf16 and scatters K and V by slot into paged caches of vLLM's layout
("NHD": [num_blocks, block_size, num_kv_heads, head_dim]) or FlashInfer's ("HND": [num_blocks,
num_kv_heads, block_size, head_dim]), bf16 or float8_e4m3fn with one fp32 scale per tensor. One
Triton launch on the GPU; byte for byte the unfused chain of :mod:`kvfuse.reference`
(:func:`kvfuse.reference.qk_norm_rope_store_kv`).

Validation (every rule below raises ValueError / TypeError naming the argument, before anything is
written) produces a :class:`GQAPlan` that every backend executes.
"""
from __future__ import annotations

import dataclasses
import math
import threading
from typing import Optional

import torch

from . import backend as _backend
from .args import NormArgs
from .overlap import row_limit, same_elements, tensors_overlap
from .plan import check_index_vector, check_rope_args, check_tensor

__all__ = ["fused_qk_norm_rope_store_kv", "GQAPlan", "validate", "execute", "LAYOUTS", "CACHE_DTYPES"]

LAYOUTS = ("NHD", "HND")
CACHE_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


@dataclasses.dataclass
class GQAPlan:
    """One validated call. Tensors are the caller's (views, no copies)."""
    q: torch.Tensor                           # bf16 [n, Hq, D], stride(-1) == 1
    k: torch.Tensor                           # bf16 [n, Hkv, D], stride(-1) == 1
    v: torch.Tensor                           # bf16 [n, Hkv, Dv], stride(-1) == 1
    k_cache: torch.Tensor                     # bf16 / float8_e4m3fn, NHD [NB, BS, Hkv, D] or HND [NB, Hkv, BS, D]
    v_cache: torch.Tensor                     # the same dtype and layout, last dim Dv
    slot_mapping: torch.Tensor                # int32 / int64 [n]
    q_out: Optional[torch.Tensor] = None      # bf16 [n, Hq, D], stride(-1) == 1 (may be q itself)
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
    k_scale: Optional[torch.Tensor] = None    # fp32, one element (fp8 caches only)
    v_scale: Optional[torch.Tensor] = None
    layout: str = "NHD"

    @property
    def n(self) -> int:
        return self.q.shape[0]

    @property
    def fp8(self) -> bool:
        return self.k_cache.dtype == torch.float8_e4m3fn

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1] if self.layout == "NHD" else self.k_cache.shape[2]

    @property
    def capacity(self) -> int:
        """Slots of the caches: num_blocks * block_size."""
        return self.k_cache.shape[0] * self.block_size

    def cache_strides(self, cache: torch.Tensor) -> tuple:
        """(block, token, head) strides in elements of ``cache`` under the plan's layout."""
        s = cache.stride()
        return (s[0], s[1], s[2]) if self.layout == "NHD" else (s[0], s[2], s[1])


# =============================================================================== validation
def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_heads(t, name, dev, n=None):
    check_tensor(t, name, (torch.bfloat16,), dev)
    if t.dim() != 3:
        raise ValueError(f"{name}: expected shape [n, num_heads, head_dim], got {tuple(t.shape)}")
    if n is not None and t.shape[0] != n:
        raise ValueError(f"{name}: expected {n} tokens (q's), got shape {tuple(t.shape)}")
    if t.shape[1] < 1:
        raise ValueError(f"{name}: num_heads must be >= 1, got {t.shape[1]}")
    if t.shape[2] % 16 or t.shape[2] == 0:
        raise ValueError(f"{name}: head_dim must be a positive multiple of 16, got {t.shape[2]}")
    if t.shape[2] > 1 and t.stride(2) != 1:
        raise ValueError(f"{name}: expected stride(-1) == 1, got {t.stride(2)}")


def _check_norm(args, name, D, dev):
    if args is None:
        return None, 1e-6
    if not isinstance(args, NormArgs):
        raise TypeError(f"{name} must be a NormArgs or None, got {type(args).__name__}")
    if args.kind != "rms":
        raise ValueError(f"{name}.kind must be 'rms' (the QK-norm is an RMSNorm), got {args.kind!r}")
    if args.bias is not None:
        raise ValueError(f"{name}.bias must be None (RMSNorm has no bias)")
    check_tensor(args.weight, f"{name}.weight", (torch.bfloat16, torch.float32), dev, shape=(D,))
    if not _is_real(args.eps) or args.eps <= 0:
        raise ValueError(f"{name}.eps must be a finite number > 0, got {args.eps!r}")
    return args.weight, float(args.eps)


def _check_cache(cache, name, layout, nb_bs, heads, dim, dev):
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cache).__name__}")
    if cache.dtype not in CACHE_DTYPES:
        raise TypeError(f"{name}: expected dtype torch.bfloat16 or torch.float8_e4m3fn, got {cache.dtype}")
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


def _check_scale(scale, name, fp8, dev):
    if not fp8:
        if scale is not None:
            raise ValueError(f"{name} must be None for a bf16 cache, got a {type(scale).__name__}")
        return None
    if scale is None:
        raise ValueError(f"{name}: a float8_e4m3fn cache needs its per-tensor fp32 scale, got None")
    check_tensor(scale, name, (torch.float32,), dev, last_contiguous=False)
    if scale.numel() != 1 or scale.dim() > 1:
        raise ValueError(f"{name}: expected one element (shape () or (1,)), got shape {tuple(scale.shape)}")
    return scale


def validate(q, k, v, k_cache, v_cache, slot_mapping, q_norm_args=None, k_norm_args=None, rope_args=None,
             k_scale=None, v_scale=None, layout="NHD", q_out=None) -> GQAPlan:
    """Check every argument (SPEC §11 and §5) and return the call's plan (``q_out`` as given: None
    when the call allocates it)."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    dev = q.device
    _check_heads(q, "q", dev)
    n, hq, d = q.shape
    _check_heads(k, "k", dev, n)
    _check_heads(v, "v", dev, n)
    hkv = k.shape[1]
    if k.shape[2] != d:
        raise ValueError(f"k: expected head_dim {d} (q's), got shape {tuple(k.shape)}")
    if v.shape[1] != hkv:
        raise ValueError(f"v: expected {hkv} heads (k's), got shape {tuple(v.shape)}")
    if hq % hkv:
        raise ValueError(f"q: num_heads {hq} must be a multiple of k's num_heads {hkv} (GQA / MHA)")
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    nb_bs = _check_cache(k_cache, "k_cache", layout, None, hkv, d, dev)
    _check_cache(v_cache, "v_cache", layout, nb_bs, hkv, v.shape[2], dev)
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"v_cache: expected dtype {k_cache.dtype} (k_cache's), got {v_cache.dtype}")
    check_index_vector(slot_mapping, "slot_mapping", n, dev)
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    plan = GQAPlan(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping, layout=layout,
                   k_scale=_check_scale(k_scale, "k_scale", fp8, dev),
                   v_scale=_check_scale(v_scale, "v_scale", fp8, dev))
    plan.q_weight, plan.q_eps = _check_norm(q_norm_args, "q_norm_args", d, dev)
    plan.k_weight, plan.k_eps = _check_norm(k_norm_args, "k_norm_args", d, dev)
    if rope_args is not None:
        r, off = check_rope_args(rope_args, d, n, dev, offset_default_tail=False)
        cs = rope_args.cos_sin_cache
        plan.positions, plan.cos_sin, plan.rotary_dim, plan.rope_offset = rope_args.positions, cs, r, off
        plan.is_neox, plan.conjugate = rope_args.is_neox, rope_args.conjugate
    if q_out is not None:
        check_tensor(q_out, "q_out", (torch.bfloat16,), dev, shape=(n, hq, d))
        if n > row_limit(q_out, "q_out"):
            raise ValueError(f"q_out: its rows overlap in memory for n = {n} (strides {q_out.stride()}): an "
                             f"output must not be expanded (stride 0) or otherwise overlap itself")
        plan.q_out = q_out
    return plan


# =============================================================================== aliasing (SPEC §5)
_NAMES = ("q_out", "k_cache", "v_cache", "q", "k", "v", "slot_mapping", "q_norm_args.weight",
          "k_norm_args.weight", "rope_args.positions", "rope_args.cos_sin_cache", "k_scale", "v_scale")
_FIELDS = ("q_out", "k_cache", "v_cache", "q", "k", "v", "slot_mapping", "q_weight", "k_weight", "positions",
           "cos_sin", "k_scale", "v_scale")
_OUTPUTS = 3                 # the first three fields are written
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
    """SPEC §5 for this entry point: q_out, k_cache and v_cache must not overlap each other or any input;
    q_out may be q itself (the same elements: in place). Byte spans first; where two spans meet, the
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
            if i == 0 and _FIELDS[j] == "q" and same_elements(a, b):
                continue                                    # q_out is q: in place
            key = (_key(a), _key(b))
            if key in _VERDICTS:
                continue
            if tensors_overlap(_coalesced(a), _coalesced(b)):
                what = "another output" if j < _OUTPUTS else "an input"
                hint = " (q_out may be q itself, the same view, for an in-place call)" if _FIELDS[j] == "q" else ""
                raise ValueError(f"{_NAMES[i]} overlaps {_NAMES[j]} in memory: an output must not overlap "
                                 f"{what}{hint}")
            with _verdict_lock:
                if len(_VERDICTS) >= _VERDICTS_SIZE:
                    _VERDICTS.clear()
                _VERDICTS[key] = True


# =============================================================================== execution
def run_data_checks(plan: GQAPlan) -> None:
    """KVFUSE_CHECKS: positions in range, no duplicate valid slots, finite positive scales (synchronizes)."""
    from .dispatch import run_data_checks as checks
    checks(plan.positions, None if plan.cos_sin is None else plan.cos_sin.shape[0], plan.slot_mapping,
           plan.capacity)
    for name in ("k_scale", "v_scale"):
        s = getattr(plan, name)
        if s is not None and s.device.type != "meta":
            value = float(s.reshape(()))
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must hold a finite number > 0, got {value}")


def _launch(plan: GQAPlan) -> None:
    from .dispatch import _InterpreterLaunches
    from .kernels import qkv
    if qkv.INTERPRET:
        with _InterpreterLaunches._lock:   # Triton's interpreter is not thread-safe (kvfuse.dispatch)
            qkv.run(plan)
    else:
        qkv.run(plan)


def plan_to_op_args(plan: GQAPlan) -> tuple:
    """The positional arguments of the ``kvfuse::fused_qk_norm_rope_store_kv`` op (kvfuse.ops) for a plan
    (q_out set)."""
    return (plan.q, plan.k, plan.v, plan.k_cache, plan.v_cache, plan.slot_mapping, plan.q_out, plan.q_weight,
            float(plan.q_eps), plan.k_weight, float(plan.k_eps), plan.positions, plan.cos_sin, int(plan.rotary_dim),
            int(plan.rope_offset), bool(plan.is_neox), bool(plan.conjugate), plan.k_scale, plan.v_scale, plan.layout)


def execute(plan: GQAPlan) -> None:
    """Run a validated plan (q_out set): through the custom op while torch.compile traces (registered by
    kvfuse.ops, imported with kvfuse), else :func:`run`."""
    if torch.compiler.is_compiling():
        torch.ops.kvfuse.fused_qk_norm_rope_store_kv(*plan_to_op_args(plan))
        return
    run(plan)


def run(plan: GQAPlan) -> None:
    """Run a validated plan on the backend chosen for its device (the custom op's implementation ends
    here too). The reference backend writes under torch.inference_mode(), as the fused entry point's
    does (kvfuse.dispatch.run)."""
    if _backend.checks_enabled():
        run_data_checks(plan)
    if plan.n == 0 or plan.q.device.type == "meta":
        return
    if _backend.resolve_backend(plan.q.device) == "triton":
        _launch(plan)
    else:
        from . import reference
        with torch.inference_mode():
            reference.run_gqa_plan(plan)


def fused_qk_norm_rope_store_kv(q, k, v, k_cache, v_cache, slot_mapping, q_norm_args=None, k_norm_args=None,
                                rope_args=None, k_scale=None, v_scale=None, layout="NHD", q_out=None):
    """QK-norm -> RoPE on q and k, q written back, K and V scattered into paged caches: one launch.

    Args:
        q: bf16 [n, Hq, D]; k: bf16 [n, Hkv, D]; v: bf16 [n, Hkv, Dv] (stride(-1) == 1, other strides
            free: views of one packed QKV projection [n, (Hq + 2 Hkv) D] are fine). Hq a multiple of Hkv.
        k_cache, v_cache: bf16 or float8_e4m3fn (both the same), ``layout`` "NHD" (vLLM:
            [num_blocks, block_size, Hkv, D]) or "HND" (FlashInfer: [num_blocks, Hkv, block_size, D]);
            v_cache's last dim is Dv. Any strides with stride(-1) == 1 (slices of a larger
            allocation, vLLM's kv_cache[:, 0] / [:, 1]).
        slot_mapping: int32 / int64 [n]; slot s goes to block s // block_size, offset s % block_size;
            a slot < 0 or >= num_blocks * block_size writes nothing.
        q_norm_args, k_norm_args: NormArgs (kind "rms", weight [D] shared by the heads) or None.
        rope_args: RopeArgs or None (offset None means 0 here: RoPE on the first rotary_dim dims).
        k_scale, v_scale: fp32 tensors of one element for float8_e4m3fn caches (None for bf16):
            the cache holds e4m3(clamp(f(x) / f(scale), -448, 448)).
        q_out: bf16 [n, Hq, D] receiving the transformed q; q itself for in place; None allocates it.

    Returns ``q_out`` (the tensor written). Raises ValueError / TypeError naming the argument before
    anything is written.
    """
    plan = validate(q, k, v, k_cache, v_cache, slot_mapping, q_norm_args, k_norm_args, rope_args, k_scale, v_scale,
                    layout, q_out)
    if plan.q_out is None:
        plan.q_out = torch.empty((plan.n,) + tuple(q.shape[1:]), dtype=torch.bfloat16, device=q.device)
    if q.device.type != "meta" and not torch.compiler.is_compiling():
        check_overlap(plan)
    execute(plan)
    return plan.q_out
