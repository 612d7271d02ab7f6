"""The bench's workloads: :class:`Workload` (one call site of the fused operator, a GQA model's
``fused_qk_norm_rope_store_kv`` call, or a layer's calls as one ``fused_group`` launch) and the table
:data:`WORKLOADS` of them by name; also the formats only the bench uses (the page layout and the
record-layout study's records, :data:`RECORD_LAYOUTS`, for benchmarks/record_alignment.py).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional, Tuple

from ..args import CastArgs, HadamardArgs
from ..formats import (FLASHMLA_MODEL1, FLASHMLA_V32, INDEX_FP8_FP32, INDEX_MXFP4, INDEX_MXFP8, INDEX_NVFP4, MAIN_FP4,
                       MAIN_FP8, MAIN_MXFP8, KVCacheFormat)
from ..models import GQA_MODELS, GQAConfig

ROTARY_DIM = 64


@dataclasses.dataclass(frozen=True)
class Workload:
    """One call site. kind "write": norm + rope + cast into a paged cache of ``fmt``; "q_pre": norm +
    rope into a preallocated bf16 out; "index_q": rope + cast of ``fmt`` into preallocated (q, sf);
    "gqa": :func:`kvfuse.fused_qk_norm_rope_store_kv` of the model ``gqa`` (packed QKV [n, (Hq + 2 Hkv) D],
    QK-norm if the model has one, RoPE, q_out, K and V into NHD caches, fp8 with per-tensor scales when
    ``cache_fp8``); num_heads is then Hq + 2 Hkv (the rows a call reads); "group": the ``members``
    workloads (same n, positions and cos/sin table) in one :func:`kvfuse.fused_group` launch, head_dim
    and num_heads those of its largest member."""
    name: str
    kind: str
    head_dim: int
    fmt: Optional[KVCacheFormat] = None
    num_heads: int = 1
    norm: bool = True
    rotary_dim: int = ROTARY_DIM
    description: str = ""
    is_neox: bool = True                 # RoPE style (False: GPT-J, interleaved pairs)
    rope_offset: Optional[int] = None    # None: the tail
    norm_kind: str = "rms"               # "rms" | "layer" (LayerNorm, with a bias when norm_bias)
    norm_bias: bool = False
    hadamard: bool = False               # the orthonormal Hadamard (scale head_dim ** -0.5) after RoPE
    rope: bool = True                    # False: no RoPE (with norm=False: the cast alone)
    gqa: Optional[GQAConfig] = None      # kind "gqa": the model
    cache_fp8: bool = False              # kind "gqa": float8_e4m3fn caches with per-tensor scales (else bf16)
    members: Tuple[str, ...] = ()        # kind "group": the workloads run as one kvfuse.fused_group launch
    split: Optional[int] = None          # x passed as two inputs, its columns [0, split) and the rest: two
                                         # column views of one projection output (DeepSeek V3's kv_c, k_pe)
    norm_dim: Optional[int] = None       # the norm over the first norm_dim dims only (V3: the latent)

    @property
    def norm_width(self) -> int:
        """The norm weight's length: the dims the norm covers."""
        return self.head_dim if self.norm_dim is None else self.norm_dim

    @property
    def hadamard_args(self) -> Optional[HadamardArgs]:
        return HadamardArgs(self.head_dim ** -0.5) if self.hadamard else None

    @property
    def cast_args(self) -> Optional[CastArgs]:
        return None if self.fmt is None else CastArgs.from_cache_format(self.fmt)


def _gqa(name, model, fp8):
    cfg = GQA_MODELS[model]
    norm = "QK-norm + " if cfg.qk_norm else ""
    rope = "NEOX rope (YaRN table)" if cfg.rope_scaling else "NEOX rope (proportional table)" if cfg.rope_rotated \
        else "NEOX rope"
    if cfg.mrope_section is not None:
        rope = f"NEOX {'interleaved' if cfg.mrope_interleaved else 'chunked'} mRoPE {list(cfg.mrope_section)} " \
               "(text positions [3, n])"
    v = "V-norm, " if cfg.v_norm else ""
    return Workload(name, "gqa", cfg.head_dim, None, num_heads=cfg.num_heads + 2 * cfg.num_kv_heads, norm=cfg.qk_norm,
                    rotary_dim=cfg.rotary_dim, rope_offset=0, is_neox=cfg.rope_is_neox, gqa=cfg, cache_fp8=fp8,
                    description=f"{model} q/k/v: {norm}{rope} -> q_out, {v}K/V into {'fp8' if fp8 else 'bf16'} NHD "
                                f"caches ({cfg.num_heads}/{cfg.num_kv_heads} heads of {cfg.head_dim})")


# MAIN_FP8's codes and UE8M0 scales without the token-interleaved record: FlashInfer's DeepSeek cache page
MAIN_FP8_PAGEWISE = KVCacheFormat("MAIN_FP8_PAGEWISE", 512, "e4m3", 32, "ue8m0", False)
# MAIN_FP8's record with its 4 reserved bytes never written, with its exact 16 scale bytes (528 bytes: no
# reserved bytes) and with 32 (544 bytes, 16 reserved, never written): what the reserved bytes cost a write
# (benchmarks/record_alignment.py)
MAIN_FP8_RESERVED_UNWRITTEN = KVCacheFormat("MAIN_FP8_532_UNWRITTEN", 512, "e4m3", 32, "ue8m0", True, sf_bytes=20)
MAIN_FP8_NO_RESERVED = KVCacheFormat("MAIN_FP8_528", 512, "e4m3", 32, "ue8m0", True, sf_bytes=16)
MAIN_FP8_SECTOR_ALIGNED = KVCacheFormat("MAIN_FP8_544", 512, "e4m3", 32, "ue8m0", True, sf_bytes=32)
# (label, format) of the record-layout study: the same codes and scales in each
RECORD_LAYOUTS = (("MAIN_FP8 (532 B, zeros)", MAIN_FP8), ("532 B, reserved unwritten", MAIN_FP8_RESERVED_UNWRITTEN),
                  ("528-B records", MAIN_FP8_NO_RESERVED), ("544-B records", MAIN_FP8_SECTOR_ALIGNED),
                  ("page layout", MAIN_FP8_PAGEWISE))


def _write(name, fmt, what, is_neox=True):
    style = "NEOX" if is_neox else "GPT-J"
    return Workload(name, "write", fmt.head_dim, fmt, is_neox=is_neox,
                    description=f"{what}: norm + {style} rope (last 64) -> {fmt.name}")


WORKLOADS: Dict[str, Workload] = {w.name: w for w in (
    _write("main_fp8", MAIN_FP8, "main KV 512"),
    _write("main_fp4", MAIN_FP4, "main KV 512"),
    _write("flashmla_v32", FLASHMLA_V32, "FlashMLA V3.2 KV 576"),
    _write("flashmla_model1", FLASHMLA_MODEL1, "FlashMLA MODEL1 KV 512"),
    _write("index_mxfp4", INDEX_MXFP4, "indexer K 128"),
    _write("index_nvfp4", INDEX_NVFP4, "indexer K 128"),
    _write("index_fp8_fp32", INDEX_FP8_FP32, "indexer K 128"),
    Workload("main_fp8_cast", "write", 512, MAIN_FP8, norm=False, rope=False,
             description="the MAIN_FP8 cast alone (no norm, no RoPE: the CP second pass, store_gathered)"),
    Workload("main_fp8_pagewise_cast", "write", 512, MAIN_FP8_PAGEWISE, norm=False, rope=False,
             description="main_fp8_cast's codes and scales in FlashInfer's DeepSeek page layout (a page: its "
                         "tokens' 512-B code rows, then their 16-B scale rows): the layout's cost (the portable kernel: no fast "
                         "path writes this layout)"),
    _write("main_fp8_gptj", MAIN_FP8, "main KV 512", is_neox=False),
    _write("main_fp4_gptj", MAIN_FP4, "main KV 512", is_neox=False),
    _write("flashmla_v32_gptj", FLASHMLA_V32, "FlashMLA V3.2 KV 576", is_neox=False),
    _write("flashmla_model1_gptj", FLASHMLA_MODEL1, "FlashMLA MODEL1 KV 512", is_neox=False),
    _write("index_mxfp8_gptj", INDEX_MXFP8, "indexer K 128", is_neox=False),
    Workload("index_fp8_fp32_off0", "write", 128, INDEX_FP8_FP32, rope_offset=0,
             description="indexer K 128: norm + NEOX rope (first 64) -> INDEX_FP8_FP32"),
    # the models' own calls (kvfuse.models): DeepSeek V3 / V3.1 / V3.2 main cache, the V3.2 indexer K,
    # the V4 main caches and indexer K
    _write("dsv3_main_v32", FLASHMLA_V32, "DeepSeek V3 main KV 576 (latent normalized)", is_neox=False),
    # DeepSeek V3's main write as engines hold it: kv_c [n, 512] and k_pe [n, 64], column views of one
    # [n, 576] projection output, in one launch (kvfuse.mla.write_main_cache((kv_c, k_pe), ...))
    Workload("dsv3_main_kv_c_k_pe", "write", 576, FLASHMLA_V32, is_neox=False, split=512, norm_dim=512,
             description="DeepSeek V3 main KV from (kv_c [n, 512], k_pe [n, 64]) views of one projection: "
                         "RMSNorm over the latent only + GPT-J rope on k_pe -> FLASHMLA_V32, one launch"),
    Workload("dsv3_main_kv_c_k_pe_nonorm", "write", 576, FLASHMLA_V32, is_neox=False, split=512, norm=False,
             description="DeepSeek V3 main KV from (kv_c, k_pe) with kv_c normalized already (FlashInfer's MLA "
                         "rope + fp8 append): GPT-J rope on k_pe -> FLASHMLA_V32, one launch"),
    Workload("dsv32_index_k", "write", 128, INDEX_FP8_FP32, rope_offset=0, norm_kind="layer", norm_bias=True,
             hadamard=True, description="DeepSeek V3.2 indexer K: LayerNorm + bias, NEOX rope (first 64), "
                                         "Hadamard -> INDEX_FP8_FP32"),
    _write("dsv4_main_fp8", MAIN_FP8, "DeepSeek V4 main KV 512", is_neox=False),
    _write("dsv4_main_fp4", MAIN_FP4, "DeepSeek V4 main KV 512", is_neox=False),
    _write("dsv4_main_model1", FLASHMLA_MODEL1, "DeepSeek V4 main KV 512", is_neox=False),
    _write("dsv41_main_mxfp8", MAIN_MXFP8, "DeepSeek V4.1 main KV 512", is_neox=False),
    Workload("dsv4_index_k", "write", 128, INDEX_MXFP8, is_neox=False, hadamard=True,
             description="DeepSeek V4 indexer K: norm + GPT-J rope (last 64), Hadamard -> INDEX_MXFP8"),
    Workload("q_pre", "q_pre", 512, None, num_heads=64,
             description="Q preprocessing: x [n, 64, 512], norm + NEOX rope (last 64) -> bf16 out"),
    Workload("index_q", "index_q", 128, INDEX_MXFP4, num_heads=64, norm=False,
             description="indexer Q: x [n, 64, 128], NEOX rope (last 64) + INDEX_MXFP4 cast -> (q, sf)"),
    # the models' Q calls (q_preprocess, quantize_indexer_q), members of the layer groups below
    Workload("dsv4_q", "q_pre", 512, None, num_heads=64, is_neox=False,
             description="DeepSeek V4 Q: x [n, 64, 512], RMSNorm + GPT-J rope (last 64) -> bf16 out"),
    Workload("dsv4_index_q", "index_q", 128, INDEX_MXFP8, num_heads=64, norm=False, is_neox=False, hadamard=True,
             description="DeepSeek V4 indexer Q: x [n, 64, 128], GPT-J rope (last 64), Hadamard -> INDEX_MXFP8 (q, sf)"),
    Workload("dsv32_q", "q_pre", 192, None, num_heads=128, norm=False, is_neox=False,
             description="DeepSeek V3.2 Q: x [n, 128, 192], GPT-J rope (last 64) -> bf16 out"),
    Workload("dsv32_index_q", "index_q", 128, INDEX_FP8_FP32, num_heads=64, norm=False, rope_offset=0,
             hadamard=True, description="DeepSeek V3.2 indexer Q: x [n, 64, 128], NEOX rope (first 64), Hadamard "
                                        "-> INDEX_FP8_FP32 (q, sf)"),
    # GQA / MHA models (kvfuse.models.GQA_MODELS): one fused_qk_norm_rope_store_kv call per layer
    _gqa("llama3_8b_bf16", "llama-3-8b", False),
    _gqa("llama3_8b_fp8", "llama-3-8b", True),
    _gqa("llama3_70b_fp8", "llama-3-70b", True),
    _gqa("qwen3_8b_bf16", "qwen3-8b", False),
    _gqa("qwen3_8b_fp8", "qwen3-8b", True),
    _gqa("qwen3_32b_fp8", "qwen3-32b", True),
    _gqa("gemma3_12b_bf16", "gemma-3-12b", False),
    _gqa("gemma3_12b_fp8", "gemma-3-12b", True),
    _gqa("gpt_oss_20b_bf16", "gpt-oss-20b", False),
    _gqa("gpt_oss_20b_fp8", "gpt-oss-20b", True),
    _gqa("gpt_oss_120b_fp8", "gpt-oss-120b", True),
    _gqa("qwen25_vl_7b_bf16", "qwen2.5-vl-7b", False),
    _gqa("qwen25_vl_7b_fp8", "qwen2.5-vl-7b", True),
    _gqa("qwen3_vl_8b_fp8", "qwen3-vl-8b", True),
    _gqa("gemma4_31b_sliding_bf16", "gemma-4-31b-sliding", False),
    _gqa("gemma4_31b_sliding_fp8", "gemma-4-31b-sliding", True),
    _gqa("gemma4_31b_global_fp8", "gemma-4-31b-global", True),
)}


def _group(name, members, description):
    widest = max((WORKLOADS[m] for m in members), key=lambda w: w.num_heads * w.head_dim)
    return Workload(name, "group", widest.head_dim, None, num_heads=widest.num_heads, members=tuple(members),
                    description=description)


# an MLA layer's calls in one launch (kvfuse.fused_group / kvfuse.mla.write_layer)
WORKLOADS.update({w.name: w for w in (
    _group("group_dsv4_q_kv", ("dsv4_q", "dsv4_main_fp8"), "DeepSeek V4 Q (64 heads) + main KV MAIN_FP8, one launch"),
    _group("group_dsv4_layer", ("dsv4_q", "dsv4_main_fp8", "dsv4_index_k", "dsv4_index_q"),
           "DeepSeek V4 layer: Q, main KV, indexer K, indexer Q, one launch"),
    _group("group_dsv32_layer", ("dsv32_q", "dsv3_main_v32", "dsv32_index_k", "dsv32_index_q"),
           "DeepSeek V3.2 layer: Q (128 heads), FlashMLA KV, indexer K, indexer Q, one launch"),
)})
