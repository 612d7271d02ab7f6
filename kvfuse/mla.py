"""The call sites of a DeepSeek-style MLA layer, each one call of the one entry point.

This is the table of the article (DeepInfer's ``fused_transform``) written against kvfuse. Every
function takes an :class:`MLAConfig`, which fixes the RoPE style and offsets, the norms, the
Hadamard and the cache formats; :mod:`kvfuse.models` holds the named configurations of the real
models (DeepSeek V3 / V3.1, V3.2, V4).

| call site | norm | RoPE (style: the config's) | Hadamard | cast | destination | shape |
|---|---|---|---|---|---|---|
| :func:`q_preprocess` | optional (cfg.q_norm) | offset qk_head_dim - qk_rope_head_dim | - | - | bf16 | n x num_heads x qk_head_dim |
| :func:`write_main_cache` | RMSNorm (latent only for a [latent, k_pe] record) | tail | - | the cache's | main cache (MAIN_FP8 / MAIN_FP4 / FLASHMLA_MODEL1 / FLASHMLA_V32) | n x record, or (kv_c, k_pe) |
| :func:`cp_local_kv` (context parallel) | yes | tail 64 | - | the cache's, cast_back | bf16 for all_gather | n x 512 |
| :func:`write_main_cache_gathered` (CP, 2nd pass) | - | - | - | the cache's | main cache | n x 512 |
| :func:`write_draft_kv` (DFlash draft) | yes | tail | - | draft format | main cache, draft slots | n x record |
| :func:`write_compressed_kv` | RMSNorm | index RoPE | - | from_cache_format | index cache + pre-RoPE latent (out_stage="norm") | n x 128 |
| :func:`write_indexer_k` | cfg.index_norm_kind (V3.2: LayerNorm with bias) | index RoPE (V3.2: first 64) | cfg.index_hadamard | from_cache_format | index cache | n x 128 |
| :func:`quantize_indexer_q` | - | index RoPE | same as K | from_cache_format (same format as K) | (q, sf) | n x heads x 128 |
| :func:`write_layer` | the calls above that are given: Q, main cache, indexer K, indexer Q | | | | | one launch (:func:`kvfuse.fused_group`) |
| :func:`write_flashmla_v32` | optional (latent only) | tail 64 | - | FLASHMLA_V32 | 576 = 512 e4m3 + 64 bf16 | (n x 512, n x 64) |

Each row is one launch, a [latent | k_pe] record too: its norm covers the latent only (a norm over
the leading dims, SPEC §6) and kv_c / k_pe may be two tensors (the entry point's x as a pair).

Context parallelism: :func:`cp_local_kv_quantized` + all_gather of the (q, sf) bytes +
:func:`store_gathered` is the byte-exact recipe for every format; the cast_back recipe
(:func:`cp_local_kv`, :func:`write_main_cache_gathered`) is byte-exact only for e4m3 / fp32 scales
(docs/design.md, "Context parallelism").

Host time: :func:`write_main_cache` and :func:`write_indexer_k` find a repeated call's launch in the plan
cache from their raw arguments, without building its argument objects (a first call builds them and is
validated as any other).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple

import torch

from .api import fused_norm_rope_hadamard_cast_store_kvcache as _fused
from .api import call_keyed as _call_keyed
from .api import store_kv_cache
from .args import CastArgs, ContiguousOutArgs, FusedCall, HadamardArgs, KVCacheOutArgs, NormArgs, RopeArgs
from .group import fused_group
from .formats import FLASHMLA_MODEL1, FLASHMLA_V32, INDEX_MXFP8, MAIN_FP8, KVCacheFormat
from .plans.cache import PLAN_CACHE, rows_key, tensor_key
# the RoPE table of the call sites: kvfuse.rope's builder, public here under the name it has always had
from .rope import cos_sin_cache as make_cos_sin_cache

__all__ = [
    "MLAConfig", "make_cos_sin_cache", "q_preprocess", "write_main_cache", "cp_local_kv",
    "write_main_cache_gathered", "cp_local_kv_quantized", "store_gathered", "write_draft_kv",
    "write_compressed_kv", "write_indexer_k", "quantize_indexer_q", "write_flashmla_v32",
    "write_flashmla_model1", "write_layer", "q_preprocess_call", "main_cache_call", "indexer_k_call",
    "indexer_q_call",
]

NORM_KINDS = ("rms", "layer")


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Shapes, RoPE style, norms and cache formats of a DeepSeek-like MLA layer.

    The defaults are the article's (DeepInfer) layer; :mod:`kvfuse.models` holds the named
    configurations of the real models.

    kv_lora_rank: the compressed latent. A main-cache record is either the latent with its RoPE
        dims inside (head_dim == qk_head_dim: V4 and the article, 512 = 448 + 64 rope) or the
        latent followed by k_pe (head_dim == kv_lora_rank + qk_rope_head_dim: DeepSeek V3 / V3.2's
        576 = 512 + 64, where the RMSNorm covers the latent only).
    qk_rope_head_dim: the rotated dims of a Q head and of a main-cache record (their tail).
    qk_head_dim: the Q head width; RoPE covers its last qk_rope_head_dim dims (offset
        qk_head_dim - qk_rope_head_dim = qk_nope_head_dim: 128 in V3's 192-d heads, 448 in V4's).
    num_heads: attention heads of Q.
    rope_is_neox: the RoPE pairing of Q and of the main cache (False: GPT-J, interleaved pairs).
    q_norm: Q heads take an RMSNorm over qk_head_dim before RoPE (V4); :func:`q_preprocess` uses
        the weight it is given, or a weight of ones (a weightless RMSNorm: multiplying by 1.0 is
        exact, so the bytes equal ``bf16(x * rstd)``).
    index_head_dim / index_num_heads / index_rope_head_dim: the lightning indexer's K/Q; its RoPE
        sits at ``index_rope_offset`` (None: the tail, as in DeepInfer and V4; DeepSeek V3.2 puts
        it at 0) with pairing ``index_rope_is_neox``.
    index_norm_kind: the indexer K's norm, "rms" or "layer" (V3.2's LayerNorm; its bias is a
        call argument of :func:`write_indexer_k`, not part of the configuration).
    norm_eps: eps of every norm (1e-6 in the DeepSeek models).
    main_format / draft_format: the main cache; index_format: the indexer K cache and its Q
        quantization (None: the model has no indexer); compressed_format: the cache of compressed
        KV (None: the model has none).
    index_hadamard: rotate indexer K and Q by the orthonormal Hadamard (scale index_head_dim**-0.5)
        before quantizing (both sides, always together).
    name / source: a label and the public sources the configuration follows.
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
    index_format: Optional[KVCacheFormat] = INDEX_MXFP8
    compressed_format: Optional[KVCacheFormat] = INDEX_MXFP8
    index_hadamard: bool = True
    q_norm: bool = False
    index_norm_kind: str = "rms"
    name: str = "custom"
    source: str = dataclasses.field(default="", repr=False)

    def __post_init__(self):
        if not 0 < self.qk_rope_head_dim <= self.qk_head_dim:
            raise ValueError(f"MLAConfig.qk_rope_head_dim must be in (0, qk_head_dim], got {self.qk_rope_head_dim}")
        records = (self.qk_head_dim, self.kv_lora_rank + self.qk_rope_head_dim)
        for name in ("main_format", "draft_format"):
            f = getattr(self, name)
            if f.head_dim not in records:
                raise ValueError(f"MLAConfig.{name} ({f.name}) has head_dim {f.head_dim}, expected qk_head_dim "
                                 f"{self.qk_head_dim} or kv_lora_rank + qk_rope_head_dim {records[1]}")
        for name in ("index_format", "compressed_format"):
            f = getattr(self, name)
            if f is not None and f.head_dim != self.index_head_dim:
                raise ValueError(f"MLAConfig.{name} ({f.name}) has head_dim {f.head_dim}, expected index_head_dim "
                                 f"{self.index_head_dim}")
        off = self.index_rope_offset
        if off is not None and not 0 <= off <= self.index_head_dim - self.index_rope_head_dim:
            raise ValueError(f"MLAConfig.index_rope_offset must be in [0, index_head_dim - index_rope_head_dim], "
                             f"got {off}")
        if self.index_norm_kind not in NORM_KINDS:
            raise ValueError(f"MLAConfig.index_norm_kind must be one of {NORM_KINDS}, got {self.index_norm_kind!r}")

    # ---- derived shapes
    @property
    def rope_offset(self) -> int:
        """Offset of the RoPE dims in a Q head (= qk_nope_head_dim)."""
        return self.qk_head_dim - self.qk_rope_head_dim

    @property
    def qk_nope_head_dim(self) -> int:
        return self.qk_head_dim - self.qk_rope_head_dim

    def splits_k_pe(self, fmt: Optional[KVCacheFormat] = None) -> bool:
        """True when a record of ``fmt`` (default: the main format) is [latent | k_pe] with the
        RMSNorm on the latent only (V3 / V3.2), False when the whole record is normalized."""
        d = _fmt(fmt, self.main_format).head_dim
        return d != self.qk_head_dim and d == self.kv_lora_rank + self.qk_rope_head_dim

    def with_main_format(self, fmt: KVCacheFormat, name: Optional[str] = None) -> "MLAConfig":
        """The same configuration with another main cache format."""
        return dataclasses.replace(self, main_format=fmt, name=self.name if name is None else name)

    def with_index_format(self, fmt: Optional[KVCacheFormat], name: Optional[str] = None) -> "MLAConfig":
        """The same configuration with another indexer format (K cache and Q cast)."""
        return dataclasses.replace(self, index_format=fmt, name=self.name if name is None else name)

    # ---- the argument objects each call site uses
    def rope_args(self, positions, cos_sin) -> RopeArgs:
        """RoPE of the Q heads (offset qk_head_dim - qk_rope_head_dim)."""
        return RopeArgs(positions, cos_sin, self.qk_rope_head_dim, self.rope_is_neox, offset=self.rope_offset)

    def main_rope_args(self, positions, cos_sin, fmt: Optional[KVCacheFormat] = None) -> RopeArgs:
        """RoPE of a main-cache record: its last qk_rope_head_dim dims."""
        d = _fmt(fmt, self.main_format).head_dim
        return RopeArgs(positions, cos_sin, self.qk_rope_head_dim, self.rope_is_neox,
                        offset=d - self.qk_rope_head_dim)

    def index_rope_args(self, positions, cos_sin) -> RopeArgs:
        return RopeArgs(positions, cos_sin, self.index_rope_head_dim, self.index_rope_is_neox,
                        offset=self.index_rope_offset)

    @property
    def index_hadamard_args(self) -> Optional[HadamardArgs]:
        """The one HadamardArgs of the indexer: K and Q must share it (same basis)."""
        return HadamardArgs(1.0 / math.sqrt(self.index_head_dim)) if self.index_hadamard else None

    def norm_args(self, weight) -> Optional[NormArgs]:
        """RMSNorm (main cache, compressed KV, Q)."""
        return None if weight is None else NormArgs(weight, self.norm_eps)

    def index_norm_args(self, weight, bias=None) -> Optional[NormArgs]:
        """The indexer K's norm: ``index_norm_kind`` with ``weight`` (and, for "layer", ``bias``)."""
        if weight is None:
            if bias is not None:
                raise ValueError("norm_bias needs norm_weight (the indexer K's norm is off without a weight)")
            return None
        if bias is not None and self.index_norm_kind != "layer":
            raise ValueError(f"norm_bias is only for a LayerNorm (index_norm_kind 'layer'); {self.name} has "
                             f"index_norm_kind {self.index_norm_kind!r}")
        return NormArgs(weight, self.norm_eps, bias=bias, kind=self.index_norm_kind)

    def _need(self, field: str) -> KVCacheFormat:
        f = getattr(self, field)
        if f is None:
            raise ValueError(f"MLAConfig {self.name!r} has no {field} (the model has no "
                             f"{'indexer' if field == 'index_format' else 'compressed KV'})")
        return f


_ONES: dict = {}


def _ones(dim: int, device) -> torch.Tensor:
    """A bf16 weight of ones (a weightless RMSNorm), one per (dim, device)."""
    key = (dim, str(device))
    w = _ONES.get(key)
    if w is None:
        w = _ONES[key] = torch.ones(dim, dtype=torch.bfloat16, device=device)
    return w


def _run(call: FusedCall):
    """One call of the fused operator with a FusedCall's arguments."""
    return _fused(call.x, call.norm_args, call.rope_args, call.hadamard_args, call.cast_args, call.out_args)


def _fmt(fmt: Optional[KVCacheFormat], default: KVCacheFormat) -> KVCacheFormat:
    return default if fmt is None else fmt


# ---- the cache writes' plan-cache keys, from their raw arguments: a repeated call finds its launch without
# building its argument objects (kvfuse.plans.fused.prepare_keyed). A key holds what the FusedCall built from
# the arguments would be keyed by (kvfuse.plans.cache): each tensor's type, dtype, shape (a leading dim equal
# to n written ROWS), strides and device, the cache's data_ptr() % 16, the format by identity (pinned), and
# the configuration's fields the call reads, each with its type where it becomes an argument object's field.
# Only an MLAConfig itself is keyed (a subclass may compute its argument objects otherwise).
def _keyed(cfg) -> bool:
    return type(cfg) is MLAConfig and PLAN_CACHE.enabled and not torch.compiler.is_compiling()


def _x_part(x):
    """(key, n, x, x_tail) of a write's x: a tensor, or its columns as a tuple / list of two."""
    if type(x) in (tuple, list):
        x, tail = x           # raises for another length: validation says why
        n = x.shape[0]
        return (tuple, rows_key(x, n), rows_key(tail, n)), n, x, tail
    n = x.shape[0]
    return rows_key(x, n), n, x, None


def _main_cache_key(cfg, kv, positions, cos_sin, norm_weight, kv_cache, slot_mapping, fmt, out, out_stage):
    """(key, tensors in call_tensors' order, the format) of a write_main_cache call."""
    fmt = cfg.main_format if fmt is None else fmt
    x_key, n, x, tail = _x_part(kv)
    eps, rope, neox = cfg.norm_eps, cfg.qk_rope_head_dim, cfg.rope_is_neox
    key = ("mla.write_main_cache", id(fmt), x_key, None if norm_weight is None else tensor_key(norm_weight),
           type(eps), eps, cfg.kv_lora_rank, cfg.qk_head_dim, type(rope), rope, type(neox), neox,
           rows_key(positions, n), tensor_key(cos_sin), tensor_key(kv_cache), kv_cache.data_ptr() % 16,
           rows_key(slot_mapping, n), None if out is None else rows_key(out, n), type(out_stage), out_stage)
    return key, (x, norm_weight, positions, cos_sin, kv_cache, slot_mapping, out, None, tail), fmt


def _indexer_k_key(cfg, k, positions, cos_sin, norm_weight, kv_cache, slot_mapping, norm_bias, out, out_stage):
    """(key, tensors in call_tensors' order, the format) of a write_indexer_k call; raises without an indexer."""
    fmt = cfg.index_format
    if fmt is None:
        raise ValueError("no indexer")     # not keyed: the call says why
    n = k.shape[0]
    eps, kind, rope, neox, offset = (cfg.norm_eps, cfg.index_norm_kind, cfg.index_rope_head_dim,
                                     cfg.index_rope_is_neox, cfg.index_rope_offset)
    hadamard, dim = cfg.index_hadamard, cfg.index_head_dim
    key = ("mla.write_indexer_k", id(fmt), rows_key(k, n), None if norm_weight is None else tensor_key(norm_weight),
           None if norm_bias is None else tensor_key(norm_bias), type(eps), eps, type(kind), kind, type(rope), rope,
           type(neox), neox, type(offset), offset, not hadamard, type(dim), dim, rows_key(positions, n),
           tensor_key(cos_sin), tensor_key(kv_cache), kv_cache.data_ptr() % 16, rows_key(slot_mapping, n),
           None if out is None else rows_key(out, n), type(out_stage), out_stage)
    return key, (k, norm_weight, positions, cos_sin, kv_cache, slot_mapping, out, norm_bias, None), fmt


# --------------------------------------------------------------------------- Q
def q_preprocess(cfg: MLAConfig, q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                 q_norm_weight: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """attn.py Q preprocessing: RMSNorm (with ``q_norm_weight``, or weightless when cfg.q_norm),
    then RoPE on the last qk_rope_head_dim dims of every head (offset cfg.rope_offset, pairing
    cfg.rope_is_neox); q bf16 [n, num_heads, qk_head_dim] -> bf16 of the same shape (into ``out``
    if given)."""
    return _run(q_preprocess_call(cfg, q, positions, cos_sin, q_norm_weight, out))


def q_preprocess_call(cfg: MLAConfig, q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                      q_norm_weight: Optional[torch.Tensor] = None,
                      out: Optional[torch.Tensor] = None) -> FusedCall:
    """The call of :func:`q_preprocess` (for :func:`write_layer` / :func:`kvfuse.fused_group`)."""
    w = q_norm_weight
    if w is None and cfg.q_norm:
        w = _ones(q.shape[-1], q.device)
    return FusedCall(q, norm_args=cfg.norm_args(w), rope_args=cfg.rope_args(positions, cos_sin), out_args=out)


# --------------------------------------------------------------------------- main cache
def write_main_cache(cfg: MLAConfig, kv, positions: torch.Tensor, cos_sin: torch.Tensor,
                     norm_weight: Optional[torch.Tensor], kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     fmt: Optional[KVCacheFormat] = None, out: Optional[torch.Tensor] = None,
                     out_stage: Optional[str] = None) -> Optional[torch.Tensor]:
    """attn.py SWA / main cache write: RMSNorm -> RoPE (tail, cfg.rope_is_neox) -> the cache
    format's cast -> pages, one launch.

    kv bf16 [n, record] with record = fmt.head_dim, or the record's columns as two tensors (kv_c [n, d1],
    k_pe [n, record - d1]: e.g. the two column views of one projection output, no copy); ``fmt``
    defaults to cfg.main_format (MAIN_FP8: e4m3 values, UE8M0 scales per 32; MAIN_FP4; FLASHMLA_MODEL1
    keeps the RoPE tail in bf16). When the record is [latent | k_pe] (:meth:`MLAConfig.splits_k_pe`,
    FLASHMLA_V32 in V3 / V3.2) the RMSNorm covers the kv_lora_rank latent only (DeepSeek's ``kv_norm``
    / vLLM's ``kv_a_layernorm``; norm_weight [kv_lora_rank]): k_pe passes through it into RoPE, and
    out_stage "norm" is the normalized latent followed by k_pe as it came. Returns ``out`` (the bf16 of
    ``out_stage``) or None."""
    if _keyed(cfg):
        try:
            key, tensors, layout = _main_cache_key(cfg, kv, positions, cos_sin, norm_weight, kv_cache, slot_mapping,
                                                   fmt, out, out_stage)
        except Exception:   # an argument that cannot be keyed: the call below says what is wrong with it
            pass
        else:
            return _call_keyed(key, (layout,), tensors, lambda: main_cache_call(
                cfg, kv, positions, cos_sin, norm_weight, kv_cache, slot_mapping, fmt, out, out_stage))
    return _run(main_cache_call(cfg, kv, positions, cos_sin, norm_weight, kv_cache, slot_mapping, fmt, out,
                                out_stage))


def main_cache_call(cfg: MLAConfig, kv, positions: torch.Tensor, cos_sin: torch.Tensor,
                    norm_weight: Optional[torch.Tensor], kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    fmt: Optional[KVCacheFormat] = None, out: Optional[torch.Tensor] = None,
                    out_stage: Optional[str] = None) -> FusedCall:
    """The call of :func:`write_main_cache` (kv one tensor or the pair (kv_c, k_pe)). The norm weight
    is [kv_lora_rank] for a [latent | k_pe] record (:meth:`MLAConfig.splits_k_pe`), else [record]."""
    fmt = _fmt(fmt, cfg.main_format)
    if norm_weight is not None:
        k = cfg.kv_lora_rank if cfg.splits_k_pe(fmt) else fmt.head_dim
        if not isinstance(norm_weight, torch.Tensor):
            raise TypeError(f"norm_weight must be a torch.Tensor or None, got {type(norm_weight).__name__}")
        if tuple(norm_weight.shape) != (k,):
            what = "the latent: the norm covers it only" if k != fmt.head_dim else "the record"
            raise ValueError(f"norm_weight: expected shape ({k},) for {fmt.name} ({what}), got "
                             f"{tuple(norm_weight.shape)}")
    if isinstance(kv, list):
        kv = tuple(kv)
    return FusedCall(kv, norm_args=cfg.norm_args(norm_weight), rope_args=cfg.main_rope_args(positions, cos_sin, fmt),
                     cast_args=CastArgs.from_cache_format(fmt),
                     out_args=KVCacheOutArgs(kv_cache, slot_mapping, out=out, out_stage=out_stage, layout=fmt))


def _check_cp(cfg: MLAConfig, fmt: KVCacheFormat, what: str) -> None:
    if fmt.bf16_tail or not fmt.quantized or cfg.splits_k_pe(fmt):
        raise ValueError(f"{what} needs a quantized format without a bf16 tail (and a whole-record norm), "
                         f"got {fmt.name}")


def cp_local_kv(cfg: MLAConfig, kv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                norm_weight: Optional[torch.Tensor], fmt: Optional[KVCacheFormat] = None,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Context parallelism, first pass (on each rank's shard): norm -> RoPE -> quantize ->
    dequantize (``cast_back=True``); returns bf16 [n, record] to all_gather. Formats with a
    bf16 tail are not supported here (a contiguous cast covers the whole head)."""
    fmt = _fmt(fmt, cfg.main_format)
    _check_cp(cfg, fmt, "cp_local_kv")
    cast = dataclasses.replace(CastArgs.from_cache_format(fmt), cast_back=True)
    return _fused(kv, norm_args=cfg.norm_args(norm_weight), rope_args=cfg.main_rope_args(positions, cos_sin, fmt),
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
    _check_cp(cfg, fmt, "cp_local_kv_quantized")
    return _fused(kv, norm_args=cfg.norm_args(norm_weight), rope_args=cfg.main_rope_args(positions, cos_sin, fmt),
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
    """compress.py: RMSNorm -> RoPE (the indexer's: cfg.index_rope_*) -> cast of
    cfg.compressed_format -> index cache, and in the same launch the normalized, pre-RoPE latent
    (``out_stage="norm"``), which the indexer's key projection consumes. kv_compressed bf16
    [n, index_head_dim]; returns the latent (bf16, same shape). ValueError when the model has no
    compressed KV (compressed_format None)."""
    fmt = cfg._need("compressed_format")
    if pre_rope_out is None:
        pre_rope_out = torch.empty_like(kv_compressed)
    return _fused(kv_compressed, norm_args=NormArgs(norm_weight, cfg.norm_eps),
                  rope_args=cfg.index_rope_args(positions, cos_sin), cast_args=CastArgs.from_cache_format(fmt),
                  out_args=KVCacheOutArgs(kv_cache, slot_mapping, out=pre_rope_out, out_stage="norm", layout=fmt))


def write_indexer_k(cfg: MLAConfig, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                    norm_weight: Optional[torch.Tensor], kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    norm_bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                    out_stage: Optional[str] = None) -> Optional[torch.Tensor]:
    """index_attn.py indexer K: norm (cfg.index_norm_kind: RMSNorm, or V3.2's LayerNorm with
    ``norm_bias``) -> RoPE (cfg.index_rope_offset / index_rope_is_neox) -> Hadamard
    (cfg.index_hadamard) -> the cast of cfg.index_format -> the index cache. k bf16
    [n, index_head_dim]; ``out`` / ``out_stage`` as in :class:`kvfuse.KVCacheOutArgs`. ValueError
    when the model has no indexer (index_format None)."""
    if _keyed(cfg):
        try:
            key, tensors, layout = _indexer_k_key(cfg, k, positions, cos_sin, norm_weight, kv_cache, slot_mapping,
                                                  norm_bias, out, out_stage)
        except Exception:   # an argument that cannot be keyed, or no indexer: the call below says why
            pass
        else:
            return _call_keyed(key, (layout,), tensors, lambda: indexer_k_call(
                cfg, k, positions, cos_sin, norm_weight, kv_cache, slot_mapping, norm_bias, out, out_stage))
    return _run(indexer_k_call(cfg, k, positions, cos_sin, norm_weight, kv_cache, slot_mapping, norm_bias, out,
                               out_stage))


def indexer_k_call(cfg: MLAConfig, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                   norm_weight: Optional[torch.Tensor], kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   norm_bias: Optional[torch.Tensor] = None, out: Optional[torch.Tensor] = None,
                   out_stage: Optional[str] = None) -> FusedCall:
    """The call of :func:`write_indexer_k`."""
    fmt = cfg._need("index_format")
    return FusedCall(k, norm_args=cfg.index_norm_args(norm_weight, norm_bias),
                     rope_args=cfg.index_rope_args(positions, cos_sin), hadamard_args=cfg.index_hadamard_args,
                     cast_args=CastArgs.from_cache_format(fmt),
                     out_args=KVCacheOutArgs(kv_cache, slot_mapping, out=out, out_stage=out_stage, layout=fmt))


def quantize_indexer_q(cfg: MLAConfig, q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                       out: Optional[torch.Tensor] = None,
                       sf: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """index_attn.py _quantize_q: RoPE -> Hadamard -> quantize, returning (q, sf). The cast is
    ``CastArgs.from_cache_format(cfg.index_format)`` and the Hadamard cfg.index_hadamard_args: the
    very objects the K side uses, so Q and K share grid, scales and basis (a bf16 index format
    returns (bf16 q, None)).
    q bf16 [n, index_num_heads, index_head_dim]; ``out``/``sf`` optional preallocated outputs."""
    call = indexer_q_call(cfg, q, positions, cos_sin, out, sf)
    return _indexer_q_result(call, _run(call))


def indexer_q_call(cfg: MLAConfig, q: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                   out: Optional[torch.Tensor] = None, sf: Optional[torch.Tensor] = None) -> FusedCall:
    """The call of :func:`quantize_indexer_q`."""
    cast = CastArgs.from_cache_format(cfg._need("index_format"))
    return FusedCall(q, rope_args=cfg.index_rope_args(positions, cos_sin), hadamard_args=cfg.index_hadamard_args,
                     cast_args=cast, out_args=None if out is None and sf is None else ContiguousOutArgs(out, sf))


def _indexer_q_result(call: FusedCall, res):
    return (res, None) if call.cast_args is None else res   # a bf16 index cache: Q stays bf16


# --------------------------------------------------------------------------- a layer's calls, one launch
def write_layer(cfg: MLAConfig, positions: torch.Tensor, cos_sin: torch.Tensor, *,
                q: Optional[torch.Tensor] = None, q_norm_weight: Optional[torch.Tensor] = None,
                q_out: Optional[torch.Tensor] = None,
                kv: Optional[torch.Tensor] = None, kv_norm_weight: Optional[torch.Tensor] = None,
                kv_cache: Optional[torch.Tensor] = None, slot_mapping: Optional[torch.Tensor] = None,
                index_k: Optional[torch.Tensor] = None, index_norm_weight: Optional[torch.Tensor] = None,
                index_norm_bias: Optional[torch.Tensor] = None, index_cache: Optional[torch.Tensor] = None,
                index_slot_mapping: Optional[torch.Tensor] = None,
                index_q: Optional[torch.Tensor] = None, index_q_out: Optional[torch.Tensor] = None,
                index_sf_out: Optional[torch.Tensor] = None) -> dict:
    """The layer's calls that are given, in ONE launch (:func:`kvfuse.fused_group`): Q preprocessing
    (``q``: :func:`q_preprocess`), the main cache write (``kv``: :func:`write_main_cache`, one tensor or
    the pair (kv_c, k_pe)), the indexer K write (``index_k``: :func:`write_indexer_k`) and the indexer Q
    quantization (``index_q``: :func:`quantize_indexer_q`); same arguments as those functions, all
    at the same ``positions`` (``index_slot_mapping`` defaults to ``slot_mapping``). Returns
    {"q": bf16, "index_q": (q, sf)} for the calls made (the cache writes return nothing), each
    byte-equal to its own function's result. At least one call; q_out may be q (in place)."""
    calls, keys = [], []
    if q is not None:
        calls.append(q_preprocess_call(cfg, q, positions, cos_sin, q_norm_weight, q_out))
        keys.append("q")
    if kv is not None:
        calls.append(main_cache_call(cfg, kv, positions, cos_sin, kv_norm_weight, kv_cache, slot_mapping))
        keys.append("kv")
    if index_k is not None:
        slots = slot_mapping if index_slot_mapping is None else index_slot_mapping
        calls.append(indexer_k_call(cfg, index_k, positions, cos_sin, index_norm_weight, index_cache, slots,
                                    index_norm_bias))
        keys.append("index_k")
    if index_q is not None:
        calls.append(indexer_q_call(cfg, index_q, positions, cos_sin, index_q_out, index_sf_out))
        keys.append("index_q")
    if not calls:
        raise ValueError("write_layer: expected at least one of q, kv, index_k, index_q")
    results = fused_group(calls)
    found = {}
    for key, call, res in zip(keys, calls, results):
        if key == "q":
            found["q"] = res
        elif key == "index_q":
            found["index_q"] = _indexer_q_result(call, res)
    return found


# --------------------------------------------------------------------------- FlashMLA formats
def write_flashmla_v32(cfg: MLAConfig, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, positions: torch.Tensor,
                       cos_sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       norm_weight: Optional[torch.Tensor] = None) -> None:
    """DeepSeek V3.2 FlashMLA cache (FLASHMLA_V32, 656 bytes/token): the record is the normalized
    latent (kv_lora_rank = 512, quantized e4m3, fp32 power-of-two scales per 128) followed by the
    rotated k_pe (64 dims, raw bf16, pairing cfg.rope_is_neox). As in ``concat_and_cache_mla`` the
    latent arrives already normalized (V3.2's RMSNorm covers the latent only, not k_pe); with
    ``norm_weight`` [kv_lora_rank] it is normalized here. One launch from the two tensors (no
    concatenation). kv_c_normed bf16 [n, kv_lora_rank], k_pe bf16 [n, qk_rope_head_dim]."""
    fmt = FLASHMLA_V32
    if kv_c_normed.shape[-1] + k_pe.shape[-1] != fmt.head_dim:
        raise ValueError(f"kv_c_normed and k_pe must concatenate to {fmt.head_dim} dims, got "
                         f"{kv_c_normed.shape[-1]} + {k_pe.shape[-1]}")
    if norm_weight is not None and tuple(norm_weight.shape) != (kv_c_normed.shape[-1],):
        raise ValueError(f"norm_weight: expected shape ({kv_c_normed.shape[-1]},) (the norm covers the latent "
                         f"only), got {tuple(norm_weight.shape)}")
    _fused((kv_c_normed, k_pe), norm_args=cfg.norm_args(norm_weight),
           rope_args=RopeArgs(positions, cos_sin, k_pe.shape[-1], cfg.rope_is_neox),
           cast_args=CastArgs.from_cache_format(fmt), out_args=KVCacheOutArgs(kv_cache, slot_mapping, layout=fmt))


def write_flashmla_model1(cfg: MLAConfig, kv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                          norm_weight: Optional[torch.Tensor], kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
    """DeepSeek V4 FlashMLA "MODEL1" cache (584 bytes/token, block-wide): the main-cache chain on
    a 512-d head whose last 64 (the RoPE dims) stay bf16; 448 dims e4m3 with UE8M0 scales per 64."""
    write_main_cache(cfg, kv, positions, cos_sin, norm_weight, kv_cache, slot_mapping, fmt=FLASHMLA_MODEL1)
