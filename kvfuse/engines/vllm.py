"""vLLM 0.33's KV-cache writers and QK-norm RoPE (``vllm._custom_ops``) with vLLM's signatures and
semantics, each one call of a kvfuse entry point: swap ``from vllm import _custom_ops as ops`` for
``from kvfuse.engines import vllm as ops`` at the call sites of these functions.

- :func:`reshape_and_cache_flash`: the flash-layout K/V cache write -> :func:`kvfuse.fused_qk_norm_rope_store_kv`
  with zero q heads (no norm, no RoPE); bf16 / fp16 / fp32 inputs, per-tensor or per-head scales.
- :func:`fused_qk_norm_rope`: per-head RMSNorm and RoPE of q and k in place on the packed QKV ->
  :func:`kvfuse.fused_qk_norm_rope_store_kv` without caches, ``numerics="fused"``.
- :func:`indexer_k_quant_and_cache`: DeepSeek V3.2's indexer K store, scale_fmt "ue8m0" ->
  :func:`kvfuse.fused_norm_rope_hadamard_cast_store_kvcache` into ``models.INDEX_FP8_UE8M0_FP32``.
- :func:`concat_and_cache_mla`: the MLA [kv_c | k_pe] record: "auto" and "fp8" -> the GQA entry (kv_c
  and k_pe as K and V of one head, written into the two column ranges of the record); "fp8_ds_mla" ->
  the fused entry into ``formats.FLASHMLA_V32``.
- :func:`triton_reshape_and_cache_flash_per_token_head_quant`: the fp8 / int8 per-(token, head) caches ->
  the GQA entry with k_format / v_format and the scale caches (vllm.v1.attention.ops, not _custom_ops).

What vLLM accepts beyond kvfuse's domain (head sizes not a multiple of 8 in reshape_and_cache_flash, and
for the MLA and indexer writers fp16 / fp32 inputs, per-head scales, head sizes not a multiple of 16, fp32
indexer scales) raises TypeError / ValueError saying "not supported yet". Where vLLM's kernels read or write out of bounds (a slot past the cache) kvfuse
writes nothing. docs/engines.md lists the differences.
"""
from __future__ import annotations

import torch

from ..api import fused_norm_rope_hadamard_cast_store_kvcache
from ..args import CastArgs, KVCacheOutArgs, NormArgs, RopeArgs
from ..formats import FLASHMLA_V32
from ..gqa import fused_qk_norm_rope_store_kv
from ..models import INDEX_FP8_UE8M0_FP32
from . import _checks

__all__ = ["reshape_and_cache_flash", "fused_qk_norm_rope", "indexer_k_quant_and_cache", "concat_and_cache_mla",
           "triton_reshape_and_cache_flash_per_token_head_quant", "FP8_KV_CACHE_DTYPES"]

# vLLM's names of the e4m3 cache dtype (both select e4m3 in its DISPATCH_BY_KV_CACHE_DTYPE)
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3")
FP8_E5M2 = "fp8_e5m2"
_GQA_NAMES = {"k": "key", "v": "value", "k_cache": "key_cache", "v_cache": "value_cache",
              "k_scale": "k_scale", "v_scale": "v_scale", "slot_mapping": "slot_mapping",
              "k_scale_cache": "k_scale_cache", "v_scale_cache": "v_scale_cache"}
# vLLM's KVQuantMode names of the per-(token, head) caches -> kvfuse.gqa_formats presets
PER_TOKEN_HEAD_MODES = {"FP8_PER_TOKEN_HEAD": "fp8_per_token_head", "INT8_PER_TOKEN_HEAD": "int8_per_token_head"}
_MLA_NAMES = {"k": "kv_c", "v": "k_pe", "k_cache": "kv_cache", "v_cache": "kv_cache", "k_scale": "scale",
              "v_scale": "scale", "x": "kv_c", "out_args.kv_cache": "kv_cache",
              "out_args.slot_mapping": "slot_mapping"}
_DS_MLA_NAMES = {**_MLA_NAMES, "x[0]": "kv_c", "x[1]": "k_pe"}
_DS_MLA_CAST = CastArgs.from_cache_format(FLASHMLA_V32)     # frozen: one object serves every call
_INDEXER_NAMES = {"x": "k", "out_args.kv_cache": "kv_cache", "out_args.slot_mapping": "slot_mapping"}
_QK_NORM_ROPE_NAMES = {"q": "qkv", "k": "qkv", "q_out": "qkv", "k_out": "qkv", "q_norm_args.weight": "q_weight",
                       "k_norm_args.weight": "k_weight", "q_norm_args.eps": "eps", "k_norm_args.eps": "eps",
                       "rope_args.positions": "position_ids", "rope_args.cos_sin_cache": "cos_sin_cache"}
# reshape_and_cache_flash's key / value dtypes ("auto": caches of the same dtype)
_FLASH_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# reshape_and_cache_flash's kv_cache_dtype (and _cache_dtype's kind of it) -> (the caches' GQA format, the
# dtype _checks.fp8_cache views an fp8 cache as): format and dtype picked in one lookup
_FLASH_FORMATS = {"auto": ("auto", None), "fp8": ("fp8_e4m3", torch.float8_e4m3fn),
                  "fp8_e4m3": ("fp8_e4m3", torch.float8_e4m3fn), FP8_E5M2: ("fp8_e5m2", torch.float8_e5m2)}


def _cache_dtype(kv_cache_dtype, allowed) -> str:
    if not isinstance(kv_cache_dtype, str):
        raise TypeError(f"kv_cache_dtype must be a str, got {type(kv_cache_dtype).__name__}")
    if kv_cache_dtype.startswith("fp8") and kv_cache_dtype not in allowed:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported yet (kvfuse writes "
                         f"{', '.join(repr(a) for a in allowed)})")
    if kv_cache_dtype not in allowed:
        raise ValueError(f"kv_cache_dtype: expected one of {allowed}, got {kv_cache_dtype!r}")
    return "fp8" if kv_cache_dtype in FP8_KV_CACHE_DTYPES else kv_cache_dtype


def _leading_tokens(slot_mapping: torch.Tensor, num_tokens: int, what: str) -> int:
    """vLLM writes the first slot_mapping.size(0) tokens (the batch may be padded past them)."""
    m = slot_mapping.shape[0]
    if m > num_tokens:
        raise ValueError(f"slot_mapping: {m} slots for {num_tokens} tokens of {what}; vLLM writes the first "
                         "slot_mapping.size(0) tokens, so it cannot be longer")
    return m


def _leading(slot_mapping, first, second, what: str = "key"):
    """first and second cut to the slots' tokens (_leading_tokens); as they are when they have as many."""
    m = _leading_tokens(slot_mapping, first.shape[0], what)
    if m == first.shape[0] and m == second.shape[0]:
        return first, second      # slicing costs host time and changes nothing
    return first[:m], second[:m]


def _auto_cache(cache, name: str, dtype: torch.dtype) -> torch.Tensor:
    _checks.tensor(cache, name)
    if cache.dtype != dtype:
        raise TypeError(f"{name}: kv_cache_dtype 'auto' stores the input's dtype ({dtype}), got {cache.dtype}")
    return cache


def _flash_scale(scale, name: str, num_heads: int) -> None:
    _checks.tensor(scale, name)
    if scale.dtype != torch.float32:
        raise TypeError(f"{name}: expected dtype torch.float32, got {scale.dtype}")
    if scale.numel() not in (1, num_heads):
        raise ValueError(f"{name}: expected one value or one per head ({num_heads}), got {scale.numel()}")


def _flash_scales(k_scale, v_scale, num_heads: int):
    """vLLM's k_scale / v_scale of an fp8 cache: fp32, the same shape, one element or one per kv head
    (``numel() == num_heads``: head h divided by scale[h]); reshaped only where the entry would not take
    them as they are (one element of shape () or (1,), or a 1-d per-head vector: a reshape costs host time)."""
    _flash_scale(k_scale, "k_scale", num_heads)
    _flash_scale(v_scale, "v_scale", num_heads)
    if k_scale.shape != v_scale.shape:
        raise ValueError(f"v_scale: expected k_scale's shape {tuple(k_scale.shape)}, got {tuple(v_scale.shape)}")
    if k_scale.dim() <= 1:
        return k_scale, v_scale
    if k_scale.numel() == 1:
        return k_scale.reshape(()), v_scale.reshape(())
    return k_scale.reshape(-1), v_scale.reshape(-1)


def reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
    """vLLM's ``reshape_and_cache_flash``: token i < slot_mapping.size(0) goes to block
    ``slot // block_size``, offset ``slot % block_size`` of both caches (all heads); slot -1 skips it.

    key, value: bf16, fp16 or fp32 (the same) [num_tokens, num_heads, head_size] (head_size a multiple of
    8). key_cache, value_cache: [num_blocks, block_size, num_heads, head_size] with any strides whose last
    is 1 (vLLM's ``kv_cache[:, 0]`` views and its HND-backed views). kv_cache_dtype "auto": caches of the
    input's dtype, the bits of key and value; "fp8" / "fp8_e4m3": uint8 or float8_e4m3fn caches holding
    ``e4m3(x / scale)`` (saturated to +-448, round to nearest even); "fp8_e5m2": uint8 or float8_e5m2
    caches holding ``e5m2(x / scale)`` (saturated to +-57344); both with k_scale / v_scale fp32 tensors of
    one shape, one element (per tensor) or num_heads elements (head h divided by scale[h], as vLLM's
    kernel reads ``k_scale[head]`` when ``k_scale.numel() > 1``); the scales are ignored for "auto".
    """
    _flash_key_value(key, value, slot_mapping)
    picked = _FLASH_FORMATS.get(kv_cache_dtype) if type(kv_cache_dtype) is str else None
    if picked is None:    # raises, or returns the kind of a str subclass
        picked = _FLASH_FORMATS[str(_cache_dtype(kv_cache_dtype, tuple(_FLASH_FORMATS)))]
    fmt, dtype = picked
    if fmt == "auto":
        key_cache = _auto_cache(key_cache, "key_cache", key.dtype)
        value_cache = _auto_cache(value_cache, "value_cache", key.dtype)
        k_scale = v_scale = None
    else:
        key_cache = _checks.fp8_cache(key_cache, "key_cache", dtype)
        value_cache = _checks.fp8_cache(value_cache, "value_cache", dtype)
        k_scale, v_scale = _flash_scales(k_scale, v_scale, key.shape[1])
    key, value = _leading(slot_mapping, key, value)
    no_q = key[:, :0]
    try:                  # q_out: the empty q itself (nothing to allocate)
        fused_qk_norm_rope_store_kv(no_q, key, value, key_cache, value_cache, slot_mapping, k_scale=k_scale,
                                    v_scale=v_scale, layout="NHD", q_out=no_q, k_format=fmt, v_format=fmt)
    except (TypeError, ValueError) as e:
        _checks.rename(e, _GQA_NAMES)
        raise


def _flash_key_value(key, value, slot_mapping) -> None:
    """The flash writers' key [num_tokens, num_heads, head_size] and value (key's dtype, bf16 / fp16 / fp32,
    head sizes a multiple of 8, as many tokens) and slot_mapping, with vLLM's argument names."""
    _checks.activations(key, "key", 3, _FLASH_DTYPES)
    _checks.tensor(value, "value")
    if value.dtype != key.dtype:
        raise TypeError(f"value: expected key's dtype {key.dtype}, got {value.dtype}")
    _checks.activations(value, "value", 3, _FLASH_DTYPES)
    _checks.slots(slot_mapping)
    _checks.head_size(key.shape[-1], "key", 8)
    _checks.head_size(value.shape[-1], "value", 8)
    if value.shape[0] != key.shape[0]:
        raise ValueError(f"value: expected {key.shape[0]} tokens like key, got {value.shape[0]}")


def triton_reshape_and_cache_flash_per_token_head_quant(key, value, key_cache, value_cache, k_scale_cache,
                                                        v_scale_cache, slot_mapping, kv_quant_mode):
    """vLLM 0.33's ``triton_reshape_and_cache_flash_per_token_head_quant``
    (vllm/v1/attention/ops/triton_reshape_and_cache_flash.py): ``key`` [num_tokens, num_heads, head_size] and
    ``value`` [num_tokens, num_heads, head_size_v] (bf16, fp16 or fp32, one dtype) into NHD caches quantized per
    (token, head), each row's fp32 scale max(amax / QMAX, 1e-6) stored at [block, offset, head] of
    ``k_scale_cache`` / ``v_scale_cache`` ([num_blocks, block_size, num_heads], any strides: vLLM's views of
    the caches' padding). ``kv_quant_mode``: vLLM's KVQuantMode (read by its name) or that name,
    "FP8_PER_TOKEN_HEAD" (caches float8_e4m3fn, or uint8 as vLLM allocates them) or "INT8_PER_TOKEN_HEAD"
    (int8 caches); INT4_PER_TOKEN_HEAD is not supported. Caches wider than the heads (vLLM passes rows with
    their scale padding) get their first head_size columns written. A slot -1 writes nothing. The numerics
    are SPEC §3's (vLLM's rule in IEEE operations; vLLM's own division is approximate: docs/engines.md).
    """
    mode = getattr(kv_quant_mode, "name", kv_quant_mode)
    if not isinstance(mode, str) or mode.upper() not in PER_TOKEN_HEAD_MODES:
        raise ValueError(f"kv_quant_mode: expected one of {tuple(PER_TOKEN_HEAD_MODES)} (vLLM's KVQuantMode), "
                         f"got {kv_quant_mode!r}")
    fmt = PER_TOKEN_HEAD_MODES[mode.upper()]
    _flash_key_value(key, value, slot_mapping)
    caches = []
    for cache, name, width in ((key_cache, "key_cache", key.shape[-1]), (value_cache, "value_cache", value.shape[-1])):
        if fmt == "fp8_per_token_head":
            cache = _checks.fp8_cache(cache, name)
        else:
            _checks.tensor(cache, name)
            if cache.dtype != torch.int8:
                raise TypeError(f"{name}: expected dtype torch.int8 for {mode}, got {cache.dtype}")
        if cache.dim() == 4 and cache.shape[-1] > width:
            cache = cache[..., :width]         # the row's codes, its scale padding left alone
        caches.append(cache)
    key, value = _leading(slot_mapping, key, value)
    no_q = key[:, :0]
    try:
        fused_qk_norm_rope_store_kv(no_q, key, value, caches[0], caches[1], slot_mapping, layout="NHD", q_out=no_q,
                                    k_format=fmt, v_format=fmt, k_scale_cache=k_scale_cache,
                                    v_scale_cache=v_scale_cache)
    except (TypeError, ValueError) as e:
        _checks.rename(e, _GQA_NAMES)
        raise


def _head_counts(num_heads_q, num_heads_k, num_heads_v, head_dim) -> None:
    for name, v in (("num_heads_q", num_heads_q), ("num_heads_k", num_heads_k), ("num_heads_v", num_heads_v),
                    ("head_dim", head_dim)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "num_heads_v" else 1):
            raise ValueError(f"{name}: expected a positive int, got {v!r}")


def _qk_norm_weight(w, name: str, dtype: torch.dtype) -> None:
    _checks.tensor(w, name)
    if w.dtype != dtype:
        raise TypeError(f"{name}: expected qkv's dtype {dtype}, got {w.dtype}")


def _packed_heads(qkv, hq: int, hk: int, d: int):
    """The q and k heads of the packed qkv: qkv[:, :hq * d].unflatten(1, (hq, d)) and the next hk * d
    columns as [n, hk, d]; made eagerly by as_strided (half the host time of slicing and unflatten), which
    torch.compile does not trace (it reads the storage offset)."""
    if torch.compiler.is_compiling():
        return qkv[:, :hq * d].unflatten(1, (hq, d)), qkv[:, hq * d:(hq + hk) * d].unflatten(1, (hk, d))
    row, col = qkv.stride()
    start = qkv.storage_offset()
    return (qkv.as_strided((qkv.shape[0], hq, d), (row, d * col, col), start),
            qkv.as_strided((qkv.shape[0], hk, d), (row, d * col, col), start + hq * d * col))


def fused_qk_norm_rope(qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight, cos_sin_cache,
                       is_neox, position_ids):
    """vLLM's ``fused_qk_norm_rope``: in place on the packed ``qkv`` [num_tokens, (num_heads_q + num_heads_k +
    num_heads_v) * head_dim] (bf16 or fp16, stride(-1) == 1), each q and k head gets RMSNorm (``q_weight`` /
    ``k_weight`` [head_dim] of qkv's dtype, ``eps``) then RoPE on its first rotary_dim dims, where
    ``cos_sin_cache`` [max_position, rotary_dim] (fp32, fp16 or bf16; rotary_dim even, <= head_dim) holds
    cos | sin per position; ``is_neox`` pairs (i, i + rotary_dim / 2), else (2i, 2i + 1); ``position_ids``
    int64 [num_tokens]. The v heads are neither read nor written.

    Numerics "fused" (SPEC §6): fp32 from the norm's input through RoPE, one rounding to qkv's dtype, each
    fp32 operation rounded on its own (kvfuse's order, so not vLLM kernel's bits: its warp-shuffle sum and
    rsqrtf differ in the last bits; docs/engines.md). One launch, no copies: the weights and the table go to
    the kernel as they are (each read as fp32, exact). num_heads_q must be a multiple of num_heads_k;
    a position outside [0, max_position) leaves the token's rotation out (vLLM reads past the table).
    """
    _checks.activations(qkv, "qkv", 2, (torch.bfloat16, torch.float16))
    if not (type(num_heads_q) is int and type(num_heads_k) is int and type(num_heads_v) is int
            and type(head_dim) is int and num_heads_q >= 1 and num_heads_k >= 1 and num_heads_v >= 0 and head_dim >= 1):
        _head_counts(num_heads_q, num_heads_k, num_heads_v, head_dim)   # int subclasses pass; the rest raise
    _checks.head_size(head_dim, "head_dim", 8)
    hq, hk, d = num_heads_q, num_heads_k, head_dim
    if qkv.shape[1] != (hq + hk + num_heads_v) * d:
        raise ValueError(f"qkv: expected {(hq + hk + num_heads_v) * d} columns ((num_heads_q + num_heads_k + "
                         f"num_heads_v) * head_dim), got shape {tuple(qkv.shape)}")
    _qk_norm_weight(q_weight, "q_weight", qkv.dtype)
    _qk_norm_weight(k_weight, "k_weight", qkv.dtype)
    _checks.tensor(cos_sin_cache, "cos_sin_cache")
    if cos_sin_cache.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"cos_sin_cache: expected dtype torch.float32, torch.float16 or torch.bfloat16, got "
                        f"{cos_sin_cache.dtype}")
    if cos_sin_cache.dim() != 2:
        raise ValueError(f"cos_sin_cache: expected shape [max_position, rotary_dim], got {tuple(cos_sin_cache.shape)}")
    rotary_dim = cos_sin_cache.shape[1]
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"cos_sin_cache: its rotary_dim (size(1)) must be even and in (0, head_dim={head_dim}], "
                         f"got {rotary_dim}")
    _checks.tensor(position_ids, "position_ids")
    if position_ids.dtype != torch.int64:
        raise TypeError(f"position_ids: expected dtype torch.int64, got {position_ids.dtype}")
    if not isinstance(is_neox, bool):
        raise TypeError(f"is_neox must be a bool, got {type(is_neox).__name__}")
    q, k = _packed_heads(qkv, hq, hk, d)
    try:
        fused_qk_norm_rope_store_kv(
            q, k, None, None, None, None, NormArgs(q_weight, eps=eps), NormArgs(k_weight, eps=eps),
            RopeArgs(position_ids, cos_sin_cache, rotary_dim, is_neox, offset=0), q_out=q, numerics="fused",
            k_out=k)
    except (TypeError, ValueError) as e:
        _checks.rename(e, _QK_NORM_ROPE_NAMES)
        raise


def indexer_k_quant_and_cache(k, kv_cache, slot_mapping, quant_block_size, scale_fmt):
    """vLLM's ``indexer_k_quant_and_cache`` (DeepSeek V3.2's indexer K) with ``scale_fmt="ue8m0"``: per
    token, s = 2^ceil(log2(max(amax, 1e-4) / 448)) stored as fp32, values ``e4m3(x / s)``.

    k: bf16 [num_tokens, 128]; kv_cache: uint8 [num_blocks, block_size, 132] (or a float8_e4m3fn view of
    it), each block every token's 128 value bytes, then every token's 4 scale bytes; slot_mapping:
    [>= num_tokens] (token i uses slot i; -1 skips it); quant_block_size: 128. scale_fmt None (scale amax / 448 as fp32, values divided by it)
    is not supported yet: kvfuse's fp32-scale cast multiplies by 448 / amax, which differs in the last bit
    of some values (docs/engines.md).
    """
    _checks.bf16_input(k, "k", 2)
    _checks.slots(slot_mapping)
    kv_cache = _checks.byte_cache(kv_cache, "kv_cache")
    if scale_fmt != "ue8m0":
        raise ValueError(f"scale_fmt {scale_fmt!r} is not supported yet: only 'ue8m0' (power-of-two scales) "
                         "is written byte for byte as vLLM writes it")
    if isinstance(quant_block_size, bool) or quant_block_size != 128:
        raise ValueError(f"quant_block_size {quant_block_size!r} is not supported yet (kvfuse writes 128)")
    if k.shape[1] != INDEX_FP8_UE8M0_FP32.head_dim:
        raise ValueError(f"k: head_dim {k.shape[1]} is not supported yet (kvfuse's indexer format has "
                         f"{INDEX_FP8_UE8M0_FP32.head_dim})")
    if kv_cache.dim() != 3:
        raise ValueError(f"kv_cache: expected [num_blocks, block_size, 132], got shape {tuple(kv_cache.shape)}")
    n = k.shape[0]
    if slot_mapping.shape[0] < n:
        raise ValueError(f"slot_mapping: {slot_mapping.shape[0]} slots for {n} tokens of k")
    out = KVCacheOutArgs(kv_cache.unsqueeze(2), slot_mapping[:n], layout=INDEX_FP8_UE8M0_FP32)
    with _checks.engine_names(_INDEXER_NAMES):
        fused_norm_rope_hadamard_cast_store_kvcache(
            k, cast_args=CastArgs.from_cache_format(INDEX_FP8_UE8M0_FP32), out_args=out)


def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale):
    """vLLM's ``concat_and_cache_mla``: token i < slot_mapping.size(0) writes the record [kv_c | k_pe] at
    block ``slot // block_size``, offset ``slot % block_size``; slot -1 skips it.

    kv_c: [num_tokens, kv_lora_rank]; k_pe: [num_tokens, pe_dim], of one dtype: bf16, fp16 or fp32 for
    "auto" and "fp8" (kv_lora_rank and pe_dim multiples of 8), bf16 for "fp8_ds_mla". kv_cache_dtype:

    - "auto": kv_cache of the inputs' dtype [num_blocks, block_size, kv_lora_rank + pe_dim], the bits of
      kv_c and k_pe;
    - "fp8" / "fp8_e4m3": kv_cache uint8 (or float8_e4m3fn) of the same shape, every element
      ``e4m3(x / scale)`` with ``scale`` one fp32 value;
    - "fp8_ds_mla" (kv_lora_rank 512, pe_dim 64): kv_cache uint8 [num_blocks, block_size, 656] (or a
      float8_e4m3fn view of it), the
      FlashMLA record of ``formats.FLASHMLA_V32``: per 128 values of kv_c the scale
      2^ceil(log2(max(amax / 448, 1e-4))) (fp32), values ``e4m3(x / scale)``, then k_pe's bf16 bits;
      ``scale`` is not read. One launch reads kv_c and k_pe where they are (no concatenation).
    """
    kind = _cache_dtype(kv_cache_dtype, ("auto",) + FP8_KV_CACHE_DTYPES + ("fp8_ds_mla",))
    if kind == "fp8_ds_mla":
        _checks.bf16_input(kv_c, "kv_c", 2)
        _checks.bf16_input(k_pe, "k_pe", 2)
    else:
        _checks.activations(kv_c, "kv_c", 2, _FLASH_DTYPES)
        _checks.activations(k_pe, "k_pe", 2, _FLASH_DTYPES)
        if k_pe.dtype != kv_c.dtype:
            raise TypeError(f"k_pe: expected kv_c's dtype {kv_c.dtype}, got {k_pe.dtype}")
    _checks.slots(slot_mapping)
    if k_pe.shape[0] != kv_c.shape[0]:
        raise ValueError(f"k_pe: expected {kv_c.shape[0]} tokens like kv_c, got {k_pe.shape[0]}")
    kv_c, k_pe = _leading(slot_mapping, kv_c, k_pe, "kv_c")
    rank, pe_dim = kv_c.shape[1], k_pe.shape[1]
    if kind == "fp8_ds_mla":
        if rank != 512 or pe_dim != 64:
            raise ValueError(f"kv_c, k_pe: fp8_ds_mla needs kv_lora_rank 512 and pe_dim 64, got {rank} and {pe_dim}")
        kv_cache = _checks.byte_cache(kv_cache, "kv_cache")
        if kv_cache.dim() != 3:
            raise ValueError(f"kv_cache: expected [num_blocks, block_size, 656], got shape {tuple(kv_cache.shape)}")
        out = KVCacheOutArgs(kv_cache.unsqueeze(2), slot_mapping, layout=FLASHMLA_V32)
        try:
            fused_norm_rope_hadamard_cast_store_kvcache((kv_c, k_pe), cast_args=_DS_MLA_CAST, out_args=out)
        except (TypeError, ValueError) as e:
            _checks.rename(e, _DS_MLA_NAMES)
            raise
        return
    _checks.head_size(rank, "kv_c", 8)
    _checks.head_size(pe_dim, "k_pe", 8)
    if kind == "auto":
        kv_cache, scale = _auto_cache(kv_cache, "kv_cache", kv_c.dtype), None
    else:
        kv_cache, scale = _checks.fp8_cache(kv_cache, "kv_cache"), _checks.per_tensor_scale(scale, "scale")
    if kv_cache.dim() != 3 or kv_cache.shape[2] != rank + pe_dim:
        raise ValueError(f"kv_cache: expected [num_blocks, block_size, {rank + pe_dim}], got shape "
                         f"{tuple(kv_cache.shape)}")
    # the record's two column ranges as the K and V caches of one head: one launch, no concatenation
    latent_cache, pe_cache = kv_cache[..., :rank].unsqueeze(2), kv_cache[..., rank:].unsqueeze(2)
    kv_c3, k_pe3 = kv_c.unsqueeze(1), k_pe.unsqueeze(1)
    no_q = kv_c3[:, :0]
    try:                  # q_out: the empty q itself (nothing to allocate)
        fused_qk_norm_rope_store_kv(no_q, kv_c3, k_pe3, latent_cache, pe_cache, slot_mapping, k_scale=scale,
                                    v_scale=scale, layout="NHD", q_out=no_q)
    except (TypeError, ValueError) as e:
        _checks.rename(e, _MLA_NAMES)
        raise
