"""The call sites of a DeepSeek-style MLA layer, each one call of the one entry point.

This is the table of the article (DeepInfer's ``fused_transform``) written against kvfuse:

| call site | norm | RoPE | Hadamard | cast | destination | shape |
|---|---|---|---|---|---|---|
| :func:`q_preprocess` | optional | tail 64, offset qk_head_dim - 64 | - | - | bf16 | n x num_heads x 512 |
| :func:`write_main_cache` | yes | NEOX, tail 64 | - | the cache's | main cache (MAIN_FP8 / MAIN_FP4 / FLASHMLA_MODEL1) | n x 512 |
| :func:`cp_local_kv` (context parallel) | yes | tail 64 | - | the cache's, cast_back | bf16 for all_gather | n x 512 |
| :func:`write_main_cache_gathered` (CP, 2nd pass) | - | - | - | the cache's | main cache | n x 512 |
| :func:`write_draft_kv` (DFlash draft) | yes | tail 64 | - | draft format | main cache, draft slots | n x 512 |
| :func:`write_compressed_kv` | yes | tail | - | from_cache_format | index cache + pre-RoPE latent (out_stage="norm") | n x 128 |
| :func:`write_indexer_k` | yes | tail | optional | from_cache_format | index cache | n x 128 |
| :func:`quantize_indexer_q` | - | tail | same as K | from_cache_format (same format as K) | (q, sf) | n x heads x 128 |
| :func:`write_flashmla_v32` | (caller) | tail 64 | - | FLASHMLA_V32 | 576 = 512 e4m3 + 64 bf16 | n x 576 |

Context parallelism. Each rank computes K for its shard of tokens, then every rank writes the
whole cache. :func:`cp_local_kv` (quantize -> dequantize locally, ``cast_back=True``) +
``all_gather`` of bf16 + :func:`write_main_cache_gathered` (cast only) gives every rank the same
cache bytes, whatever the number of ranks, and the same *dequantized values* as quantizing the
gathered raw K in one pass. The cache *bytes* equal that one-pass write only for formats whose
quantization is idempotent on its own dequantized output: e4m3 and fp32 scales are; UE8M0 scales
are not (when a group's amax rounds down to 224 * 2^e (e4m3) or 3 * 2^e (e2m1), the requantized
group takes scale 2^(e-1) and doubled codes: same values, other bytes). :func:`cp_local_kv_quantized`
+ all_gather of the (q, sf) bytes + :func:`store_gathered` is the byte-exact recipe for every
format (and moves fewer bytes: 532 per token for MAIN_FP8 instead of 1024).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

import torch

from .api import fused_norm_rope_hadamard_cast_store_kvcache as _fused
from .api import store_kv_cache
from .args import CastArgs, ContiguousOutArgs, HadamardArgs, KVCacheOutArgs, NormArgs, RopeArgs
from .formats import FLASHMLA_MODEL1, FLASHMLA_V32, INDEX_MXFP8, MAIN_FP8, KVCacheFormat

__all__ = [
    "MLAConfig", "make_cos_sin_cache", "q_preprocess", "write_main_cache", "cp_local_kv",
    "write_main_cache_gathered", "cp_local_kv_quantized", "store_gathered", "write_draft_kv",
    "write_compressed_kv", "write_indexer_k", "quantize_indexer_q", "write_flashmla_v32",
    "write_flashmla_model1",
]


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Shapes and cache formats of a DeepSeek-like MLA layer (V3.2 / V4 style).

    kv_lora_rank: the compressed latent (the V3.2 FlashMLA record is kv_lora_rank + qk_rope_head_dim).
    qk_head_dim: the Q head and main-cache record width; RoPE covers its last qk_rope_head_dim
        dims (offset = qk_head_dim - qk_rope_head_dim).
    num_heads: attention heads of Q.
    index_head_dim / index_num_heads / index_rope_head_dim: the lightning indexer's K/Q; its RoPE
        sits at ``index_rope_offset`` (None: the tail, as in DeepInfer; DeepSeek V3.2's reference
        code puts it at 0).
    main_format / draft_format: the main cache (head_dim == qk_head_dim); index_format: the
        indexer K cache and its Q quantization; compressed_format: the cache of compressed KV.
    index_hadamard: rotate indexer K and Q by the orthonormal Hadamard (scale index_head_dim**-0.5)
        before quantizing (both sides, always together).
    """
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_head_dim: int = 512
    num_heads: int = 64
    index_head_dim: int = 128
    index_num_heads: int = 64
    index_rope_head_dim: int = 64
    index_rope_offset: Optional[int] = None
    rope_is_neox: bool = True
    index_rope_is_neox: bool = True
    norm_eps: float = 1e-6
    main_format: KVCacheFormat = MAIN_FP8
    draft_format: KVCacheFormat = MAIN_FP8
    index_format: KVCacheFormat = INDEX_MXFP8
    compressed_format: KVCacheFormat = INDEX_MXFP8
    index_hadamard: bool = True

    def __post_init__(self):
        for name in ("main_format", "draft_format"):
            f = getattr(self, name)
            if f.head_dim != self.qk_head_dim:
                raise ValueError(f"MLAConfig.{name} ({f.name}) has head_dim {f.head_dim}, expected qk_head_dim "
                                 f"{self.qk_head_dim}")
        for name in ("index_format", "compressed_format"):
            f = getattr(self, name)
            if f.head_dim != self.index_head_dim:
                raise ValueError(f"MLAConfig.{name} ({f.name}) has head_dim {f.head_dim}, expected index_head_dim "
                                 f"{self.index_head_dim}")
        if not 0 < self.qk_rope_head_dim <= self.qk_head_dim:
            raise ValueError(f"MLAConfig.qk_rope_head_dim must be in (0, qk_head_dim], got {self.qk_rope_head_dim}")
        off = self.index_rope_offset
        if off is not None and not 0 <= off <= self.index_head_dim - self.index_rope_head_dim:
            raise ValueError(f"MLAConfig.index_rope_offset must be in [0, index_head_dim - index_rope_head_dim], "
                             f"got {off}")

    # ---- the argument objects each call site uses
    @property
    def rope_offset(self) -> int:
        return self.qk_head_dim - self.qk_rope_head_dim

    def rope_args(self, positions, cos_sin) -> RopeArgs:
        return RopeArgs(positions, cos_sin, self.qk_rope_head_dim, self.rope_is_neox, offset=self.rope_offset)

    def index_rope_args(self, positions, cos_sin) -> RopeArgs:
        return RopeArgs(positions, cos_sin, self.index_rope_head_dim, self.index_rope_is_neox,
                        offset=self.index_rope_offset)

    @property
    def index_hadamard_args(self) -> Optional[HadamardArgs]:
        """The one HadamardArgs of the indexer: K and Q must share it (same basis)."""
        return HadamardArgs(1.0 / math.sqrt(self.index_head_dim)) if self.index_hadamard else None

    def norm_args(self, weight) -> Optional[NormArgs]:
        return None if weight is None else NormArgs(weight, self.norm_eps)


def make_cos_sin_cache(max_position: int, rotary_dim: int, base: float = 10000.0, device=None) -> torch.Tensor:
    """fp32 [max_position, rotary_dim]: cos(p * base^(-2j/rotary_dim)) then sin (kvfuse's layout)."""
    inv = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim))
    ang = torch.arange(max_position, dtype=torch.float64, device=device)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=-1).to(torch.float32)


def _fmt(fmt: Optional[KVCacheFormat], default: KVCacheFormat) -> KVCacheFormat:
    return default if fmt is None else fmt


# --------------------------------------------------------------------------- Q
def q_preprocess(cfg: MLAConfig, q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                 q_norm_weight: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """attn.py Q preprocessing: optional RMSNorm, RoPE on the last qk_rope_head_dim dims of every
    head; q bf16 [n, num_heads, qk_head_dim] -> bf16 of the same shape (into ``out`` if given)."""
    return _fused(q, norm_args=cfg.norm_args(q_norm_weight), rope_args=cfg.rope_args(positions, cos_sin),
                  out_args=out)


# --------------------------------------------------------------------------- main cache
def write_main_cache(cfg: MLAConfig, kv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                     norm_weight: Optional[torch.Tensor], kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     fmt: Optional[KVCacheFormat] = None, out: Optional[torch.Tensor] = None,
                     out_stage: Optional[str] = None) -> Optional[torch.Tensor]:
    """attn.py SWA / main cache write: RMSNorm -> RoPE (tail) -> the cache format's cast -> pages.

    kv bf16 [n, qk_head_dim]; ``fmt`` defaults to cfg.main_format (MAIN_FP8: e4m3 values, UE8M0
    scales per 32; MAIN_FP4; FLASHMLA_MODEL1 keeps the RoPE tail in bf16). Returns ``out`` (the
    bf16 of ``out_stage``) or None."""
    fmt = _fmt(fmt, cfg.main_format)
    return _fused(kv, norm_args=cfg.norm_args(norm_weight), rope_args=cfg.rope_args(positions, cos_sin),
                  cast_args=CastArgs.from_cache_format(fmt),
                  out_args=KVCacheOutArgs(kv_cache, slot_mapping, out=out, out_stage=out_stage, layout=fmt))


def cp_local_kv(cfg: MLAConfig, kv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                norm_weight: Optional[torch.Tensor], fmt: Optional[KVCacheFormat] = None,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Context parallelism, first pass (on each rank's shard): norm -> RoPE -> quantize ->
    dequantize (``cast_back=True``); returns bf16 [n, qk_head_dim] to all_gather. Formats with a
    bf16 tail are not supported here (a contiguous cast covers the whole head)."""
    fmt = _fmt(fmt, cfg.main_format)
    if fmt.bf16_tail or not fmt.quantized:
        raise ValueError(f"cp_local_kv needs a quantized format without a bf16 tail, got {fmt.name}")
    cast = dataclasses.replace(CastArgs.from_cache_format(fmt), cast_back=True)
    return _fused(kv, norm_args=cfg.norm_args(norm_weight), rope_args=cfg.rope_args(positions, cos_sin),
                  cast_args=cast, out_args=out)


def write_main_cache_gathered(cfg: MLAConfig, kv_gathered: torch.Tensor, kv_cache: torch.Tensor,
                              slot_mapping: torch.Tensor, fmt: Optional[KVCacheFormat] = None) -> None:
    """Context parallelism, second pass (every rank, all tokens): norm and RoPE already ran on the
    owning rank, so only the cast and the page write run."""
    fmt = _fmt(fmt, cfg.main_format)
    _fused(kv_gathered, cast_args=CastArgs.from_cache_format(fmt),
           out_args=KVCacheOutArgs(kv_cache, slot_mapping, layout=fmt))


def cp_local_kv_quantized(cfg: MLAConfig, kv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                          norm_weight: Optional[torch.Tensor],
                          fmt: Optional[KVCacheFormat] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Byte-exact context parallelism, first pass: norm -> RoPE -> quantize to (q, sf) in the
    cache's format; all_gather those bytes, then :func:`store_gathered`."""
    fmt = _fmt(fmt, cfg.main_format)
    if fmt.bf16_tail or not fmt.quantized:
        raise ValueError(f"cp_local_kv_quantized needs a quantized format without a bf16 tail, got {fmt.name}")
    return _fused(kv, norm_args=cfg.norm_args(norm_weight), rope_args=cfg.rope_args(positions, cos_sin),
                  cast_args=CastArgs.from_cache_format(fmt))


def store_gathered(cfg: MLAConfig, q: torch.Tensor, sf: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, fmt: Optional[KVCacheFormat] = None) -> None:
    """Byte-exact context parallelism, second pass: scatter the gathered (q, sf) into the pages."""
    store_kv_cache(q, sf, kv_cache, slot_mapping, _fmt(fmt, cfg.main_format))


def write_draft_kv(cfg: MLAConfig, kv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                   norm_weight: Optional[torch.Tensor], kv_cache: torch.Tensor,
                   draft_slot_mapping: torch.Tensor) -> None:
    """DFlash-style draft model KV: the main-cache chain in cfg.draft_format, at the draft's own
    slots (``dflash_newx_slot_mapping_store`` in the article)."""
    write_main_cache(cfg, kv, positions, cos_sin, norm_weight, kv_cache, draft_slot_mapping, fmt=cfg.draft_format)


# --------------------------------------------------------------------------- compressed KV and indexer
def write_compressed_kv(cfg: MLAConfig, kv_compressed: torch.Tensor, positions: torch.Tensor,
                        cos_sin: torch.Tensor, norm_weight: torch.Tensor, kv_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, pre_rope_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """compress.py: RMSNorm -> RoPE -> cast of cfg.compressed_format -> index cache, and in the
    same launch the normalized, pre-RoPE latent (``out_stage="norm"``), which the indexer's key
    projection consumes. kv_compressed bf16 [n, index_head_dim]; returns the latent (bf16, same shape)."""
    fmt = cfg.compressed_format
    if pre_rope_out is None:
        pre_rope_out = torch.empty_like(kv_compressed)
    return _fused(kv_compressed, norm_args=NormArgs(norm_weight, cfg.norm_eps),
                  rope_args=cfg.index_rope_args(positions, cos_sin), cast_args=CastArgs.from_cache_format(fmt),
                  out_args=KVCacheOutArgs(kv_cache, slot_mapping, out=pre_rope_out, out_stage="norm", layout=fmt))


def write_indexer_k(cfg: MLAConfig, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                    norm_weight: Optional[torch.Tensor], kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """index_attn.py indexer K: RMSNorm -> RoPE -> Hadamard (cfg.index_hadamard) -> the cast of
    cfg.index_format -> the index cache. k bf16 [n, index_head_dim]."""
    fmt = cfg.index_format
    _fused(k, norm_args=cfg.norm_args(norm_weight), rope_args=cfg.index_rope_args(positions, cos_sin),
           hadamard_args=cfg.index_hadamard_args, cast_args=CastArgs.from_cache_format(fmt),
           out_args=KVCacheOutArgs(kv_cache, slot_mapping, layout=fmt))


def quantize_indexer_q(cfg: MLAConfig, q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                       out: Optional[torch.Tensor] = None,
                       sf: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """index_attn.py _quantize_q: RoPE -> Hadamard -> quantize, returning (q, sf). The cast is
    ``CastArgs.from_cache_format(cfg.index_format)`` and the Hadamard cfg.index_hadamard_args: the
    very objects the K side uses, so Q and K share grid, scales and basis (a bf16 index format
    returns (bf16 q, None)).
    q bf16 [n, index_num_heads, index_head_dim]; ``out``/``sf`` optional preallocated outputs."""
    cast = CastArgs.from_cache_format(cfg.index_format)
    res = _fused(q, rope_args=cfg.index_rope_args(positions, cos_sin), hadamard_args=cfg.index_hadamard_args,
                 cast_args=cast, out_args=None if out is None and sf is None else ContiguousOutArgs(out, sf))
    if cast is None:   # a bf16 index cache: Q stays bf16
        return res, None
    return res


# --------------------------------------------------------------------------- FlashMLA formats
def write_flashmla_v32(cfg: MLAConfig, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, positions: torch.Tensor,
                       cos_sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """DeepSeek V3.2 FlashMLA cache (FLASHMLA_V32, 656 bytes/token): the record is the normalized
    latent (kv_lora_rank = 512, quantized e4m3, fp32 power-of-two scales per 128) followed by the
    rotated k_pe (64 dims, raw bf16). As in ``concat_and_cache_mla`` the latent arrives already
    normalized (V3.2's RMSNorm covers the latent only, not k_pe); RoPE on the tail and the cast run
    fused. kv_c_normed bf16 [n, kv_lora_rank], k_pe bf16 [n, qk_rope_head_dim]."""
    fmt = FLASHMLA_V32
    if kv_c_normed.shape[-1] + k_pe.shape[-1] != fmt.head_dim:
        raise ValueError(f"kv_c_normed and k_pe must concatenate to {fmt.head_dim} dims, got "
                         f"{kv_c_normed.shape[-1]} + {k_pe.shape[-1]}")
    x = torch.cat([kv_c_normed, k_pe], dim=-1)
    _fused(x, rope_args=RopeArgs(positions, cos_sin, k_pe.shape[-1], cfg.rope_is_neox),
           cast_args=CastArgs.from_cache_format(fmt), out_args=KVCacheOutArgs(kv_cache, slot_mapping, layout=fmt))


def write_flashmla_model1(cfg: MLAConfig, kv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                          norm_weight: Optional[torch.Tensor], kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
    """DeepSeek V4 FlashMLA "MODEL1" cache (584 bytes/token, block-wide): the main-cache chain on
    a 512-d head whose last 64 (the RoPE dims) stay bf16; 448 dims e4m3 with UE8M0 scales per 64."""
    write_main_cache(cfg, kv, positions, cos_sin, norm_weight, kv_cache, slot_mapping, fmt=FLASHMLA_MODEL1)
