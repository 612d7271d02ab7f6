"""SGLang 0.5.23's DeepSeek KV-cache writers (``sglang.kernels.ops``) with SGLang's signatures, layouts
and slot rules, each one call of :func:`kvfuse.fused_norm_rope_hadamard_cast_store_kvcache`: swap
the import at the call sites of these three functions.

- :func:`fused_k_norm_rope_flashmla` (``attention.dsv4.norm_rope``): DeepSeek V4's main KV, RMSNorm
  + GPT-J RoPE on the last 64 + the layout's cast, into the paged FlashMLA cache of ``layout``:
  "v4" (:data:`V4`), "v41" / "v41_new" (:data:`V41` / :data:`V41_NEW`), "v41_fp4" / "v41_fp4_new"
  (:data:`V41_FP4` / :data:`V41_FP4_NEW`).
- :func:`fused_k_indexer_norm_rope_store` (``attention.dsa.indexer_k``): DeepSeek V3.2's indexer K,
  the indexer chain of ``kvfuse.models.DEEPSEEK_V32_SGLANG`` (LayerNorm, GPT-J RoPE on the first
  64, no Hadamard, e4m3 with an fp32 scale) into the DSA index-K pages.
- :func:`fused_store_index_k_cache` (``kvcache.dsa_fused_store_index_cache``): the same pages, the
  cast alone.

kvfuse computes each chain with its own numerics (SPEC §6: every stage rounded to bf16); where
SGLang's kernels keep fp32 between stages or scale by a differently rounded factor, some bytes differ
(docs/engines.md says which). What SGLang allows beyond kvfuse's domain (fp16 / fp32 inputs, the
UNIFORM_FP8 layout, the ROCm query RoPE) raises TypeError / ValueError saying "not supported yet".
A negative slot writes nothing (SGLang's FlashMLA writer skips it too, its index-K writers write out
of bounds), and so does a slot past the cache (where SGLang's kernels write out of bounds).
"""
from __future__ import annotations

import torch

from ..api import fused_norm_rope_hadamard_cast_store_kvcache
from ..args import CastArgs, KVCacheOutArgs, NormArgs, RopeArgs
from ..formats import INDEX_FP8_FP32, MAIN_FP4, MAIN_MXFP8, KVCacheFormat
from ..models import DEEPSEEK_V32_SGLANG
from . import _checks

__all__ = ["fused_k_norm_rope_flashmla", "fused_k_indexer_norm_rope_store", "fused_store_index_k_cache",
           "V4", "V41", "V41_NEW", "V41_FP4", "V41_FP4_NEW", "LAYOUTS"]

# SGLang's KVLayout records (sgl_kernel/deepseek_v4/kv_layout.cuh) as kvfuse formats. Block-split pages
# ("v4", "v41", "v41_fp4") hold page_size data rows, then page_size scale rows; the _new layouts put
# each token's scales right after its data. V4's scale is ceil-log2 of max(amax, 1e-4) / 448 (no floor
# on the scale); the V4.1 fp8 rows floor the scale at 2^-13 (1e-4, rounded up).
V4 = KVCacheFormat("SGLANG_V4", 512, "e4m3", 64, "ue8m0", False, sf_bytes=8, bf16_tail=64, block_alignment=576)
V41 = KVCacheFormat("SGLANG_V41", 512, "e4m3", 32, "ue8m0", False, block_alignment=512, scale_floor=1e-4)
V41_NEW = MAIN_MXFP8     # 512 e4m3 then 16 ue8m0 scales per token: the same 528-byte record
V41_FP4 = KVCacheFormat("SGLANG_V41_FP4", 512, "e2m1", 16, "e4m3", False, block_alignment=256)
V41_FP4_NEW = MAIN_FP4      # 256 B of e2m1 then 32 e4m3 scales per token: the same 288-byte record

# layout name -> (format, the page stride's alignment: SGLang's kPageAlign)
LAYOUTS = {"v4": (V4, 576), "v41": (V41, 512), "v41_new": (V41_NEW, 528), "v41_fp4": (V41_FP4, 256),
           "v41_fp4_new": (V41_FP4_NEW, 288)}
_NOT_YET = ("uniform_fp8",)
_INDEX_PAGE_TOKEN_BYTES = INDEX_FP8_FP32.bytes_per_token       # 132: 128 e4m3 + one fp32 scale

_FLASHMLA_NAMES = {"x": "kv", "norm_args.weight": "kv_weight", "norm_args.eps": "eps",
                   "rope_args.positions": "positions", "out_args.kv_cache": "kvcache",
                   "out_args.slot_mapping": "out_loc"}
_INDEXER_NAMES = {"x": "k_input", "norm_args.weight": "weight", "norm_args.bias": "bias", "norm_args.eps": "eps",
                  "rope_args.positions": "positions", "rope_args.cos_sin_cache": "cos_sin_cache",
                  "out_args.kv_cache": "cache", "out_args.slot_mapping": "out_cache_loc"}
_STORE_NAMES = {"x": "key", "out_args.kv_cache": "index_k_with_scale", "out_args.slot_mapping": "out_cache_loc"}


def _page_size(page_size) -> int:
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0 or page_size & (page_size - 1):
        raise ValueError(f"page_size: expected a power of two (SGLang's kernels take it as a template), "
                         f"got {page_size!r}")
    return page_size


def _layout(layout) -> str:
    """SGLang's ``KVLayout.parse``: a KVLayout (a str enum) or its value, any case."""
    name = getattr(layout, "value", layout)
    if not isinstance(name, str):
        raise TypeError(f"layout must be a KVLayout or str, got {type(layout).__name__}")
    name = name.lower()
    if name in _NOT_YET:
        raise ValueError(f"layout {name!r} is not supported yet (kvfuse writes {', '.join(LAYOUTS)})")
    if name not in LAYOUTS:
        raise ValueError(f"layout: expected one of {tuple(LAYOUTS) + _NOT_YET}, got {layout!r}")
    return name


def _pages(cache, name: str, fmt: KVCacheFormat, page_size: int, align: int) -> torch.Tensor:
    """SGLang's paged cache, uint8 [num_pages, page_bytes] with strides (page_bytes, 1), page_bytes =
    page_size records rounded up to ``align``, viewed as kvfuse's [num_pages, page_size, 1, record]."""
    cache = _checks.byte_cache(cache, name)
    bpt = fmt.bytes_per_token
    page_bytes = -(-page_size * bpt // align) * align
    if cache.dim() != 2 or cache.shape[1] != page_bytes or cache.stride() != (page_bytes, 1):
        raise ValueError(f"{name}: expected [num_pages, {page_bytes}] with strides ({page_bytes}, 1) "
                         f"({page_size} tokens of {bpt} bytes a page), got shape {tuple(cache.shape)} "
                         f"strides {cache.stride()}")
    return cache[:, :page_size * bpt].unflatten(1, (page_size, 1, bpt))     # the padding after is not touched


def _int_slots(t, name: str, dtype: torch.dtype, num_tokens: int) -> torch.Tensor:
    _checks.slots(t, name)
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype} (SGLang's kernel reads {dtype}), got {t.dtype}")
    if t.shape[0] != num_tokens:
        raise ValueError(f"{name}: expected {num_tokens} slots, one a token, got {t.shape[0]}")
    return t


def _positions(t, num_tokens: int) -> torch.Tensor:
    _checks.tensor(t, "positions")
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"positions: expected dtype torch.int32 or torch.int64, got {t.dtype}")
    if tuple(t.shape) != (num_tokens,):
        raise ValueError(f"positions: expected shape ({num_tokens},), got {tuple(t.shape)}")
    return t


def _fp32_vector(t, name: str, size: int) -> torch.Tensor:
    _checks.tensor(t, name)
    if t.dtype != torch.float32:
        raise TypeError(f"{name}: expected dtype torch.float32 (SGLang's kernel reads fp32), got {t.dtype}")
    if tuple(t.shape) != (size,):
        raise ValueError(f"{name}: expected shape ({size},), got {tuple(t.shape)}")
    return t


def _gathered_cos_sin(freqs_cis: torch.Tensor, positions: torch.Tensor):
    """SGLang's complex table [max_position, 32] (cos + i sin of each pair) -> kvfuse's ``cos | sin``
    rows, gathered for the batch: (cos_sin [n, 64], positions 0..n-1). A position outside the table
    becomes -1, which kvfuse rotates by the identity."""
    table = torch.view_as_real(freqs_cis)                           # [P, 32, 2] (cos, sin)
    p = positions.long()
    inside = (p >= 0) & (p < table.shape[0])
    rows = table[torch.where(inside, p, torch.zeros_like(p))]        # [n, 32, 2]
    cos_sin = rows.transpose(1, 2).reshape(p.shape[0], 2 * table.shape[1])
    local = torch.arange(p.shape[0], device=p.device)
    return cos_sin, torch.where(inside, local, torch.full_like(local, -1))


def fused_k_norm_rope_flashmla(kv, kv_weight, eps, freqs_cis, positions, out_loc, kvcache, page_size,
                               layout="v4", q=None):
    """SGLang's ``fused_k_norm_rope_flashmla``: per token, RMSNorm(kv) * kv_weight, GPT-J RoPE on the
    last 64 dims (pair j = dims 448 + 2j, 449 + 2j, angle ``freqs_cis[positions[i], j]``), then the
    layout's record at slot ``out_loc[i]``: page ``slot // page_size``, row ``slot % page_size``; a
    negative slot skips the token.

    kv: bf16 [num_tokens, 512] (any row stride); kv_weight: bf16 [512]; eps: float; freqs_cis:
    complex64 [max_position, 32]; positions: int32 / int64 [num_tokens]; out_loc: int32
    [num_tokens]; kvcache: uint8 [num_pages, page_bytes], page_bytes = page_size records rounded up to
    SGLang's page alignment; page_size: a power of two. layout (a KVLayout or its name):

    - "v4": 448 e4m3 (ue8m0 scale per 64) + the 64 rotated dims as bf16, 7 scale bytes + 1 not
      written; block-split, page aligned to 576. kvfuse format :data:`V4`.
    - "v41" / "v41_new": 512 e4m3 (the RoPE dims too), 16 ue8m0 scales per 32 (floored at 2^-13);
      block-split (pages aligned to 512) / token-interleaved 528-byte records.
    - "v41_fp4" / "v41_fp4_new": 256 bytes of e2m1 (even element in the low nibble), 32 e4m3 scales
      per 16; block-split (aligned to 256) / interleaved 288-byte records.

    Not supported yet: "uniform_fp8", ``q`` (SGLang's ROCm launch that also ropes the query heads),
    inputs other than bf16.
    """
    name = _layout(layout)
    if q is not None:
        raise ValueError("q: the query RoPE in the same launch (SGLang's ROCm path) is not supported yet; "
                         "pass q=None")
    _checks.bf16_input(kv, "kv", 2)
    if kv.shape[1] != 512:
        raise ValueError(f"kv: SGLang's FlashMLA layouts take 512 dims a token, got {kv.shape[1]}")
    _checks.tensor(kv_weight, "kv_weight")
    if kv_weight.dtype != torch.bfloat16:
        raise TypeError(f"kv_weight: dtype {kv_weight.dtype} is not supported yet (SGLang's kernel reads the "
                        "weight in kv's dtype, bfloat16)")
    if tuple(kv_weight.shape) != (512,):
        # a shorter weight would be kvfuse's norm over the leading dims, not SGLang's norm over the row
        raise ValueError(f"kv_weight: expected shape (512,), got {tuple(kv_weight.shape)}")
    _checks.tensor(freqs_cis, "freqs_cis")
    if freqs_cis.dtype != torch.complex64:
        raise TypeError(f"freqs_cis: expected dtype torch.complex64 (SGLang's freqs_cis), got {freqs_cis.dtype}")
    if freqs_cis.dim() != 2 or freqs_cis.shape[1] != 32 or freqs_cis.shape[0] == 0:
        raise ValueError(f"freqs_cis: expected [max_position >= 1, 32], got shape {tuple(freqs_cis.shape)}")
    n = kv.shape[0]
    positions = _positions(positions, n)
    out_loc = _int_slots(out_loc, "out_loc", torch.int32, n)
    fmt, align = LAYOUTS[name]
    pages = _pages(kvcache, "kvcache", fmt, _page_size(page_size), align)
    cos_sin, local = _gathered_cos_sin(freqs_cis, positions)
    with _checks.engine_names(_FLASHMLA_NAMES):
        fused_norm_rope_hadamard_cast_store_kvcache(
            kv, norm_args=NormArgs(kv_weight, eps), rope_args=RopeArgs(local, cos_sin, 64, False),
            cast_args=CastArgs.from_cache_format(fmt), out_args=KVCacheOutArgs(pages, out_loc, layout=fmt))


def _index_pages(cache, name: str, page_size) -> torch.Tensor:
    """The DSA index-K pages, uint8 [num_pages, 132 * page_size]: every token's 128 e4m3 bytes, then
    every token's fp32 scale (INDEX_FP8_FP32's block-wide record)."""
    page_size = _page_size(page_size)
    if page_size * _INDEX_PAGE_TOKEN_BYTES % INDEX_FP8_FP32.stride_alignment:
        raise ValueError(f"page_size {page_size} is not supported yet: kvfuse needs the page stride "
                         f"{_INDEX_PAGE_TOKEN_BYTES} * page_size to be a multiple of "
                         f"{INDEX_FP8_FP32.stride_alignment} (page_size a multiple of 8; SGLang's CUDA DSA uses 64)")
    return _pages(cache, name, INDEX_FP8_FP32, page_size, _INDEX_PAGE_TOKEN_BYTES)


def fused_k_indexer_norm_rope_store(k_input, cache, out_cache_loc, weight, bias, eps, cos_sin_cache, positions,
                                    page_size):
    """SGLang's ``fused_k_indexer_norm_rope_store`` (DeepSeek V3.2's indexer K): LayerNorm(k_input) *
    weight + bias, GPT-J RoPE on the first 64 dims (pair j = dims 2j, 2j + 1 with
    ``cos_sin_cache[positions[i], j]`` and ``[.., 32 + j]``), no Hadamard, then e4m3 with one fp32 scale
    ``max(amax, 1e-4) / 448`` into page ``slot // page_size``, row ``slot % page_size`` of ``cache``;
    ``kvfuse.models.DEEPSEEK_V32_SGLANG``'s indexer K chain.

    k_input: bf16 [num_tokens, 128] (any row stride); cache: uint8 [num_pages, 132 * page_size];
    out_cache_loc: int64 [num_tokens] (a negative slot skips the token); weight, bias: fp32 [128]; eps:
    float; cos_sin_cache: fp32 [max_position, 64], cosines then sines; positions: int32 / int64
    [num_tokens]; page_size: a power of two.
    """
    cfg = DEEPSEEK_V32_SGLANG
    _checks.bf16_input(k_input, "k_input", 2)
    if k_input.shape[1] != cfg.index_head_dim:
        raise ValueError(f"k_input: SGLang's V3.2 indexer takes {cfg.index_head_dim} dims a token, "
                         f"got {k_input.shape[1]}")
    n = k_input.shape[0]
    out_cache_loc = _int_slots(out_cache_loc, "out_cache_loc", torch.int64, n)
    weight = _fp32_vector(weight, "weight", cfg.index_head_dim)
    bias = _fp32_vector(bias, "bias", cfg.index_head_dim)
    positions = _positions(positions, n)
    _checks.tensor(cos_sin_cache, "cos_sin_cache")
    if cos_sin_cache.dtype != torch.float32:
        raise TypeError(f"cos_sin_cache: expected dtype torch.float32 (SGLang's kernel reads fp32), got "
                        f"{cos_sin_cache.dtype}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != cfg.index_rope_head_dim:
        raise ValueError(f"cos_sin_cache: expected [max_position, {cfg.index_rope_head_dim}], got shape "
                         f"{tuple(cos_sin_cache.shape)}")
    pages = _index_pages(cache, "cache", page_size)
    fmt = cfg.index_format
    with _checks.engine_names(_INDEXER_NAMES):
        fused_norm_rope_hadamard_cast_store_kvcache(
            k_input, norm_args=NormArgs(weight, eps, bias=bias, kind=cfg.index_norm_kind),
            rope_args=cfg.index_rope_args(positions, cos_sin_cache), hadamard_args=cfg.index_hadamard_args,
            cast_args=CastArgs.from_cache_format(fmt), out_args=KVCacheOutArgs(pages, out_cache_loc, layout=fmt))


def fused_store_index_k_cache(key, index_k_with_scale, out_cache_loc, page_size=64):
    """SGLang's ``fused_store_index_k_cache``: key -> e4m3 with one fp32 scale ``max(amax, 1e-4) / 448``
    a token, into page ``slot // page_size``, row ``slot % page_size`` of the DSA index-K pages.

    key: bf16 [num_tokens, 128] (or any shape whose last dim is 128, flattened as SGLang's wrapper
    does); index_k_with_scale: uint8 [num_pages, 132 * page_size]; out_cache_loc: int64 [num_tokens] (a
    negative slot skips the token); page_size: a power of two (SGLang's default 64).
    """
    _checks.tensor(key, "key")
    if key.dim() != 2:
        if key.dim() == 0:
            raise ValueError("key: expected [num_tokens, 128], got a 0-d tensor")
        key = key.reshape(-1, key.shape[-1])
    _checks.bf16_input(key, "key", 2)
    if key.shape[1] != INDEX_FP8_FP32.head_dim:
        raise ValueError(f"key: expected last dim {INDEX_FP8_FP32.head_dim}, got shape {tuple(key.shape)}")
    out_cache_loc = _int_slots(out_cache_loc, "out_cache_loc", torch.int64, key.shape[0])
    pages = _index_pages(index_k_with_scale, "index_k_with_scale", page_size)
    with _checks.engine_names(_STORE_NAMES):
        fused_norm_rope_hadamard_cast_store_kvcache(
            key, cast_args=CastArgs.from_cache_format(INDEX_FP8_FP32),
            out_args=KVCacheOutArgs(pages, out_cache_loc, layout=INDEX_FP8_FP32))
