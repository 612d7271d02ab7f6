"""The public entry points: validate (kvfuse.plan), then run on the chosen backend."""
from __future__ import annotations

from typing import Optional

import torch

from . import backend as _backend
from . import dispatch as _dispatch
from . import ops as _ops
from .formats import KVCacheFormat
from .plan import X, Plan, prepare

__all__ = ["fused_norm_rope_hadamard_cast_store_kvcache", "store_kv_cache", "load_paged_kv_cache"]


def execute(plan: Plan) -> None:
    """Run a validated plan: through the custom op while torch.compile traces (one opaque call), else
    on the backend chosen for its device (:func:`kvfuse.dispatch.run`)."""
    if torch.compiler.is_compiling():
        return _ops.execute_op(plan)  # traced as one custom op (torch.compile / CUDA graphs)
    _dispatch.run(plan)


def fused_norm_rope_hadamard_cast_store_kvcache(x, norm_args=None, rope_args=None, hadamard_args=None,
                                                cast_args=None, out_args=None):
    """RMSNorm -> RoPE -> Hadamard -> quantize -> paged-cache write, any sub-chain, one launch.

    Args:
        x: bf16 [n, head_dim] or [n, num_heads, head_dim], x.stride(-1) == 1 (any other strides).
        norm_args / rope_args / hadamard_args / cast_args: the stages (None switches one off);
            the stages that are on run in that order, each rounding its output to bf16.
        out_args: None | Tensor | ContiguousOutArgs | KVCacheOutArgs (see SPEC §3).

    Returns:
        no cast: bf16 shaped like x (the last stage's output; written into out_args if given);
        cast without cache: (q, sf) (q float8_e4m3fn [..., D] or uint8 [..., D/2] for e2m1;
        sf [..., D/g] uint8 / float8_e4m3fn / float32) or, with cast_back, the dequantized bf16;
        a KV cache: ``out_args.out`` (the bf16 of ``out_stage``) or None.

    Raises ValueError/TypeError, naming the argument, before any launch.
    """
    template, tensors = prepare(x, norm_args, rope_args, hadamard_args, cast_args, out_args)
    # outputs of the caller's: whether they overlap depends on data pointers, so it is checked on every call
    # (out may be x: the kernels read every x they need before writing that part of out)
    if template.overlap is not None:
        template.overlap(tensors, tensors[X].shape[0])
    if (template.launchable and not torch.compiler.is_compiling() and not _backend.checks_enabled()
            and _backend.resolve_backend(template.device, template.device_type) == "triton"):
        _dispatch.kernels().run_template(template, tensors)  # the hot path: launch parameters kept with the template
    else:
        execute(template.bind(tensors))
    return template.result(tensors)


def store_kv_cache(data: torch.Tensor, sf: Optional[torch.Tensor], kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, layout: KVCacheFormat, tail: Optional[torch.Tensor] = None) -> None:
    """Scatter already-quantized rows into a paged cache.

    data: [n, quant_bytes] or [n, num_heads, quant_bytes] (float8_e4m3fn for e4m3, uint8 packed for
    e2m1, bf16 [.., head_dim] for a bf16 cache); sf: [.., num_scales] in the format's scale dtype
    (None for a bf16 cache); tail: bf16 [.., bf16_tail] for the FlashMLA formats (else None);
    slot_mapping: int32/int64 [n] (invalid slots skip the row). Writes exactly the record bytes.
    """
    entry = _dispatch.validate_store(data, sf, kv_cache, slot_mapping, layout, tail)
    if torch.compiler.is_compiling():
        return _ops.store_kv_cache(data, sf, kv_cache, slot_mapping, layout, tail)
    _dispatch.store(entry, data, sf, kv_cache, slot_mapping, layout, tail)


def load_paged_kv_cache(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, layout: KVCacheFormat,
                        dequantize: bool = True):
    """Gather the records of ``slot_mapping`` from a paged cache.

    Returns bf16 [n, num_heads, head_dim] (``bf16(f(q) * d)`` per group, the bf16 tail raw; zeros
    for invalid slots), or with ``dequantize=False`` the raw bytes (data uint8 [n, num_heads,
    data_bytes] = quantized bytes then tail bytes, sf uint8 [n, num_heads, sf_bytes]).
    """
    entry = _dispatch.validate_load(kv_cache, slot_mapping, layout, dequantize)
    if torch.compiler.is_compiling():
        return _ops.load_paged_kv_cache(kv_cache, slot_mapping, layout, dequantize)
    return _dispatch.load(entry, kv_cache, slot_mapping, layout, dequantize)
