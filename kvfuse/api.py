"""The public entry points of the fused operator and the cache store / load: each validates into a
plan (:mod:`kvfuse.plans`) and hands it to :mod:`kvfuse.dispatch`, nothing else."""
from __future__ import annotations

from typing import Optional

import torch

from . import dispatch as _dispatch
from .formats import KVCacheFormat
from .plans import cache_io as _cache_io
from .plans import fused as _fused

__all__ = ["fused_norm_rope_hadamard_cast_store_kvcache", "store_kv_cache", "load_paged_kv_cache"]


def fused_norm_rope_hadamard_cast_store_kvcache(x, norm_args=None, rope_args=None, hadamard_args=None,
                                                cast_args=None, out_args=None):
    """RMSNorm -> RoPE -> Hadamard -> quantize -> paged-cache write, any sub-chain, one launch.

    Args:
        x: bf16 [n, head_dim] or [n, num_heads, head_dim], x.stride(-1) == 1 (any other strides); or a
            tuple (x_main, x_tail) of its columns held apart (as torch.cat(x, -1), read in place).
        norm_args / rope_args / hadamard_args / cast_args: the stages (None switches one off);
            the stages that are on run in that order, each rounding its output to bf16.
        out_args: None | Tensor | ContiguousOutArgs | KVCacheOutArgs (see SPEC §2).

    Returns:
        no cast: bf16 shaped like x (the last stage's output; written into out_args if given);
        cast without cache: (q, sf) (q float8_e4m3fn [..., D] or uint8 [..., D/2] for e2m1;
        sf [..., D/g] uint8 / float8_e4m3fn / float32) or, with cast_back, the dequantized bf16;
        a KV cache: ``out_args.out`` (the bf16 of ``out_stage``) or None.

    Raises ValueError/TypeError, naming the argument, before any launch.
    """
    template, tensors = _fused.prepare(x, norm_args, rope_args, hadamard_args, cast_args, out_args)
    return _dispatch.call_fused(template, tensors)


def call_keyed(key, pinned: tuple, tensors: tuple, make_call):
    """One call of the fused operator that its caller keyed from its own raw arguments (kvfuse.mla's
    writes), the FusedCall built by ``make_call()`` only on a plan-cache miss (kvfuse.plans.fused.prepare_keyed
    says what the key must hold); returns what the call returns."""
    template, tensors = _fused.prepare_keyed(key, pinned, tensors, make_call)
    return _dispatch.call_fused(template, tensors)


def store_kv_cache(data: torch.Tensor, sf: Optional[torch.Tensor], kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, layout: KVCacheFormat, tail: Optional[torch.Tensor] = None) -> None:
    """Scatter already-quantized rows into a paged cache.

    data: [n, quant_bytes] or [n, num_heads, quant_bytes] (float8_e4m3fn for e4m3, uint8 packed for
    e2m1, bf16 [.., head_dim] for a bf16 cache); sf: [.., num_scales] in the format's scale dtype
    (None for a bf16 cache); tail: bf16 [.., bf16_tail] for the FlashMLA formats (else None);
    slot_mapping: int32/int64 [n] (invalid slots skip the row). Writes exactly the record bytes.
    """
    _dispatch.execute(_cache_io.validate_store(data, sf, kv_cache, slot_mapping, layout, tail))


def load_paged_kv_cache(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, layout: KVCacheFormat,
                        dequantize: bool = True):
    """Gather the records of ``slot_mapping`` from a paged cache.

    Returns bf16 [n, num_heads, head_dim] (``bf16(f(q) * d)`` per group, the bf16 tail raw; zeros
    for invalid slots), or with ``dequantize=False`` the raw bytes (data uint8 [n, num_heads,
    data_bytes] = quantized bytes then tail bytes, sf uint8 [n, num_heads, sf_bytes]).
    """
    return _dispatch.execute(_cache_io.validate_load(kv_cache, slot_mapping, layout, dequantize))
