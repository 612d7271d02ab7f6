"""Named, frozen configurations of the real models whose write-KV paths kvfuse serves (SPEC §5, §3).

The GQA / MHA models (Llama 3, Qwen3, Gemma 3, GPT-OSS, Qwen2.5-VL / Qwen3-VL with mRoPE, Gemma 4 with its
V-norm) are :class:`GQAConfig` objects in :data:`GQA_MODELS`
(:func:`get_gqa`), served by :func:`kvfuse.fused_qk_norm_rope_store_kv`; the rest of this docstring is
about the MLA models below.

Each one is a :class:`kvfuse.mla.MLAConfig` (frozen dataclass): pass it to the call sites of
:mod:`kvfuse.mla` and they run the model's real calls (RoPE style and offsets, norm kinds,
Hadamard, cache formats). ``config.source`` cites the public code it follows; the notes below say
what was read in that code and what is inferred.

| name | Q head / RoPE | main record | main RoPE | index K norm | index RoPE | Hadamard | index format |
|---|---|---|---|---|---|---|---|
| deepseek-v3 (V3.1) | 128 x 192, offset 128, GPT-J | FLASHMLA_V32 576 = latent 512 (RMSNorm) + k_pe 64 | GPT-J, tail | - | - | - | - |
| deepseek-v3.2 | as V3 | as V3 | as V3 | LayerNorm (weight, bias) | first 64, NEOX | yes | INDEX_FP8_FP32 |
| deepseek-v3.2-ue8m0 | as V3 | as V3 | as V3 | as V3.2 | as V3.2 | yes | INDEX_FP8_UE8M0_FP32 |
| deepseek-v3.2-sglang | as V3 | as V3 | as V3 | as V3.2 | first 64, GPT-J | no | INDEX_FP8_FP32 |
| deepseek-v4 | 64 x 512 (weightless RMSNorm), offset 448, GPT-J | MAIN_FP8 512 (RMSNorm) | GPT-J, tail | RMSNorm | tail 64, GPT-J | yes | INDEX_MXFP8 (also compressed KV) |
| deepseek-v4-fp4 | as V4 | MAIN_FP4 | as V4 | as V4 | as V4 | yes | INDEX_MXFP4 (also compressed KV) |
| deepseek-v4-flashmla | as V4 | FLASHMLA_MODEL1 | as V4 | as V4 | as V4 | yes | INDEX_FP8_FP32 (also compressed KV) |
| deepseek-v4.1 | as V4 | MAIN_MXFP8 528 (RMSNorm) | as V4 | as V4 | as V4 | yes | INDEX_MXFP8 (also compressed KV) |

The sources read for each configuration, and what is inferred rather than read: docs/models.md.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Optional

import torch

from .args import NormArgs, RopeArgs
from .formats import (FLASHMLA_MODEL1, FLASHMLA_V32, INDEX_FP8_FP32, INDEX_MXFP4, INDEX_MXFP8, MAIN_FP4, MAIN_FP8,
                      MAIN_MXFP8, KVCacheFormat)
from .mla import MLAConfig
from .rope import YarnScaling, cos_sin_cache, mrope_text_positions, proportional_cos_sin_cache

__all__ = [
    "DEEPSEEK_V3", "DEEPSEEK_V32", "DEEPSEEK_V32_UE8M0", "DEEPSEEK_V32_SGLANG", "DEEPSEEK_V4", "DEEPSEEK_V4_FP4",
    "DEEPSEEK_V4_FLASHMLA", "DEEPSEEK_V41",
    "INDEX_FP8_UE8M0_FP32", "MODELS", "ALIASES", "get", "names",
    "GQAConfig", "LLAMA3_8B", "LLAMA3_70B", "QWEN3_8B", "QWEN3_32B", "GEMMA3_12B", "GPT_OSS_20B", "GPT_OSS_120B",
    "QWEN25_VL_7B", "QWEN3_VL_8B", "GEMMA4_31B_SLIDING", "GEMMA4_31B_GLOBAL",
    "GQA_MODELS", "gqa_names", "get_gqa",
]

# DeepSeek V3.2's indexer cache as the shipped config runs it (scale_fmt "ue8m0"): e4m3 values,
# one power-of-two scale per 128 stored as fp32; the same 132-byte block-wide record as INDEX_FP8_FP32.
INDEX_FP8_UE8M0_FP32 = KVCacheFormat("INDEX_FP8_UE8M0_FP32", 128, "e4m3", 128, "ue8m0_fp32", False)

_V3_SOURCE = (
    "DeepSeek-V3 inference/model.py (MLA.forward: q split [qk_nope 128 | qk_rope 64], kv_norm = "
    "RMSNorm(kv_lora_rank) on the latent only; apply_rotary_emb: view_as_complex pairs (2j, 2j+1) = GPT-J) and "
    "inference/configs/config_671B.json, config_v3.1.json; vLLM vllm/model_executor/models/deepseek_v2.py "
    "(DeepseekV2MLAAttention: get_rope(..., is_neox_style=False), kv_a_layernorm = RMSNorm(kv_lora_rank))")

DEEPSEEK_V3 = MLAConfig(
    name="deepseek-v3", source=_V3_SOURCE,
    kv_lora_rank=512, qk_rope_head_dim=64, qk_head_dim=192, num_heads=128,
    rope_is_neox=False, norm_eps=1e-6,
    main_format=FLASHMLA_V32, draft_format=FLASHMLA_V32,
    index_format=None, compressed_format=None, index_hadamard=False,
)
"""DeepSeek V3 / V3.1: MLA latent 512 with RMSNorm (eps 1e-6), RoPE 64 GPT-J style
(is_neox=False) on the tail of the 576-d K record (512 latent + 64 k_pe) and at offset 128 of the
192-d Q heads (128 heads); main cache FLASHMLA_V32; no indexer, no compressed KV."""

DEEPSEEK_V32 = dataclasses.replace(
    DEEPSEEK_V3, name="deepseek-v3.2",
    source=_V3_SOURCE + "; DeepSeek-V3.2-Exp inference/model.py (Indexer.__init__: k_norm = LayerNorm(head_dim), "
    "index_n_heads 64, index_head_dim 128; Indexer.forward: RoPE on the first 64 dims, apply_rotary_emb(..., "
    "False) = not interleaved in the corrected revision, rotate_activation = Hadamard * 128**-0.5, act_quant "
    "block 128 with an fp32 scale) and inference/kernel.py (act_quant); vLLM deepseek_v2.py "
    "(indexer_rope_emb: is_neox_style=not indexer_rope_interleave; Indexer: LayerNorm(head_dim, eps=1e-6), "
    "quant_block_size 128)",
    index_head_dim=128, index_num_heads=64, index_rope_head_dim=64, index_rope_offset=0,
    index_rope_is_neox=True, index_norm_kind="layer", index_hadamard=True,
    index_format=INDEX_FP8_FP32,
)
"""DeepSeek V3.2: V3 plus the lightning indexer. Index K: LayerNorm (weight and bias) -> RoPE on
the FIRST 64 dims (offset 0, NEOX) -> Hadamard (128**-0.5) -> e4m3 with one fp32 scale per 128
(INDEX_FP8_FP32); index Q: 64 heads x 128, the same RoPE, Hadamard and cast."""

DEEPSEEK_V32_UE8M0 = dataclasses.replace(
    DEEPSEEK_V32, name="deepseek-v3.2-ue8m0", index_format=INDEX_FP8_UE8M0_FP32,
    source=DEEPSEEK_V32.source + "; scale_fmt 'ue8m0' of DeepSeek-V3.2-Exp inference/config_671B_v3.2.json "
    "(act_quant: fast_round_scale) and of vLLM's Indexer (scale_fmt = 'ue8m0')",
)
"""DeepSeek V3.2 with the indexer's scales rounded up to powers of two (stored as fp32), as the
shipped config (scale_fmt "ue8m0") and vLLM run it."""

DEEPSEEK_V32_SGLANG = dataclasses.replace(
    DEEPSEEK_V32, name="deepseek-v3.2-sglang", index_rope_is_neox=False, index_hadamard=False,
    source=DEEPSEEK_V32.source + "; SGLang 0.5.23 (wheel) sglang/kernels/jit/csrc/deepseek_v32/indexer_k.cuh "
    "(FusedKIndexerNormRopeStoreKernel: LayerNorm with fp32 weight and bias over 128, RoPE on the FIRST 64 dims "
    "with adjacent (real, imag) pairs = GPT-J (load_rope_first_cos_sin: dims 2j, 2j+1 take cos_sin[j], "
    "cos_sin[32 + j]), no Hadamard ('V3.2 drops the Hadamard incoherence rotation'), e4m3 with one fp32 scale "
    "max(amax, 1e-4) / 448 per token), sglang/kernels/ops/attention/dsa/indexer_q.py "
    "(fused_q_indexer_rope_first_quant: kRopeFirst=true, kHadamard=false) and "
    "sglang/srt/layers/attention/dsa/dsa_indexer.py (Indexer: k_norm = LayerNorm(head_dim, fp32); "
    "use_dsa_indexer_fusion, the fused K path, only when not is_neox_style)",
)
"""DeepSeek V3.2's indexer as SGLang's fused CUDA path runs it: K LayerNorm (weight and bias) ->
RoPE on the first 64 dims, GPT-J pairs -> no Hadamard -> INDEX_FP8_FP32; Q the same RoPE, no
Hadamard. Main cache and Q heads as V3.2. ``kvfuse.engines.sglang.fused_k_indexer_norm_rope_store``
runs this configuration's indexer K chain."""

_V4_SOURCE = (
    "SGLang python/sglang/jit_kernel/csrc/deepseek_v4/main_norm_rope.cuh (FusedKNormRopeFlashMLAKernel: RMSNorm "
    "with weight over 512, RoPE on the last 64 with adjacent (real, imag) pairs = GPT-J, FlashMLA MODEL1 record; "
    "FusedQNormRopeKernel: weightless RMSNorm then the same RoPE on the Q tail; "
    "fused_q_indexer_rope_hadamard_quant: indexer Q RoPE on the trailing 64, Hadamard * 128**-0.5) and "
    "fused_norm_rope_v2.cuh (fused_norm_rope_indexer / _fp4: RMSNorm, tail RoPE, Hadamard, e4m3 with an fp32 "
    "scale per 128 or e2m1 with UE8M0 per 32); the DeepInfer article (attn.py Q: 64 heads x 512, offset "
    "qk_head_dim - qk_rope_head_dim; main caches MAIN_FP8 / MAIN_FP4; MXFP8 index KV)")

DEEPSEEK_V4 = MLAConfig(
    name="deepseek-v4", source=_V4_SOURCE,
    kv_lora_rank=512, qk_rope_head_dim=64, qk_head_dim=512, num_heads=64,
    rope_is_neox=False, q_norm=True, norm_eps=1e-6,
    index_head_dim=128, index_num_heads=64, index_rope_head_dim=64, index_rope_offset=None,
    index_rope_is_neox=False, index_norm_kind="rms", index_hadamard=True,
    main_format=MAIN_FP8, draft_format=MAIN_FP8, index_format=INDEX_MXFP8, compressed_format=INDEX_MXFP8,
)
"""DeepSeek V4 as the DeepInfer article and SGLang's DSV4 kernels run it: the 512-d latent with
RMSNorm and GPT-J RoPE on its tail 64 (offset 448), Q 64 heads x 512 with a weightless RMSNorm and
the same RoPE, main cache MAIN_FP8; indexer (K RMSNorm, tail RoPE 64 GPT-J, Hadamard) in
INDEX_MXFP8. Other main formats: :meth:`MLAConfig.with_main_format` (or the variants below)."""

DEEPSEEK_V4_FP4 = dataclasses.replace(DEEPSEEK_V4, name="deepseek-v4-fp4", main_format=MAIN_FP4,
                                      index_format=INDEX_MXFP4, compressed_format=INDEX_MXFP4)
"""DeepSeek V4 with FP4 caches: MAIN_FP4 (e2m1, e4m3 scale per 16) and INDEX_MXFP4 for the indexer
and the compressed KV (SGLang's ``fused_norm_rope_indexer_fp4`` /
``fused_q_indexer_rope_hadamard_fp4_quant``)."""

DEEPSEEK_V4_FLASHMLA = dataclasses.replace(DEEPSEEK_V4, name="deepseek-v4-flashmla", main_format=FLASHMLA_MODEL1,
                                           index_format=INDEX_FP8_FP32, compressed_format=INDEX_FP8_FP32)
"""DeepSeek V4 as SGLang's DSV4 kernels write it: FlashMLA MODEL1 main cache
(``fused_norm_rope_flashmla``) and e4m3 with an fp32 scale per 128 for the indexer and the
compressed KV (``fused_norm_rope_indexer``)."""

DEEPSEEK_V41 = dataclasses.replace(
    DEEPSEEK_V4, name="deepseek-v4.1", main_format=MAIN_MXFP8, draft_format=MAIN_MXFP8,
    source="SGLang 0.5.23 (wheel) sglang/kernels/jit/include/sgl_kernel/deepseek_v4/kv_layout.cuh (KVLayout "
    "V41 / V41_NEW: 512 e4m3, the RoPE dims quantized too, 16 ue8m0 scales per token; store_row_fp8) and "
    "sglang_jit csrc/deepseek_v4/store.cuh (fused_store_flashmla_cache_v41: RoPE on the last 64 with adjacent "
    "(real, imag) pairs = GPT-J, rounded to the input dtype, then store_row_fp8 over all 512) and main_norm_rope.cuh "
    "(fused_k_norm_rope_flashmla_v41: RMSNorm before that RoPE); FlashMLA csrc/cuda_kernels/kv_cache_format.h "
    "(KVCacheFormat<V41>, 528 bytes a token); Q, indexer and compressed KV as deepseek-v4 (" + _V4_SOURCE + ")",
)
"""DeepSeek V4.1: V4's chain (RMSNorm over the 512-d latent, GPT-J RoPE on its tail 64 at offset 448,
Q 64 heads x 512), with the main cache MAIN_MXFP8: all 512 columns, the rotated tail included, cast to
e4m3 with a UE8M0 scale per 32 (floored at 2^-13) into 528-byte records. Indexer and compressed KV are
V4's (INDEX_MXFP8): V4.1's own index path was not read."""

MODELS: Dict[str, MLAConfig] = {c.name: c for c in (DEEPSEEK_V3, DEEPSEEK_V32, DEEPSEEK_V32_UE8M0,
                                                    DEEPSEEK_V32_SGLANG, DEEPSEEK_V4, DEEPSEEK_V4_FP4,
                                                    DEEPSEEK_V4_FLASHMLA, DEEPSEEK_V41)}
"""Every named configuration, by name."""

ALIASES: Dict[str, str] = {"deepseek-v3.1": "deepseek-v3"}
"""Other names of the same configurations (V3.1 has V3's attention and caches)."""


def names():
    """Every name :func:`get` accepts (configurations, then aliases)."""
    return list(MODELS) + list(ALIASES)


def get(name: str) -> MLAConfig:
    """The configuration called ``name`` (case-insensitive; aliases accepted). An unknown name is a
    ValueError that names the argument and lists the known ones."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    key = name.strip().lower()
    key = ALIASES.get(key, key)
    if key not in MODELS:
        raise ValueError(f"name: unknown model configuration {name!r}; known: {', '.join(names())}")
    return MODELS[key]


# =============================================================================== GQA / MHA models (SPEC §3)
@dataclasses.dataclass(frozen=True)
class GQAConfig:
    """The attention shapes, RoPE style and QK-norm of a GQA / MHA model, as
    :func:`kvfuse.fused_qk_norm_rope_store_kv` takes them.

    num_heads / num_kv_heads / head_dim: Q heads, K and V heads, their width (V's too).
    rotary_dim: the rotated dims, at offset 0 (the whole head in these models); rope_is_neox: the
        pairing (HF's ``rotate_half`` is NEOX: pairs (j, j + rotary_dim / 2)); rope_theta: the base of the
        model's table (:meth:`cos_sin_cache`).
    rope_scaling: the model's YaRN parameters (:class:`kvfuse.rope.YarnScaling`), which
        :meth:`cos_sin_cache` applies; None: the unscaled table. (Other scalings, e.g. Llama 3.1's "llama3"
        or Gemma 3's linear factor, are not built here: the caller passes its own table, kvfuse takes any.)
    qk_norm: per-head RMSNorm of q and k (one weight [head_dim] each, shared by the heads) before RoPE;
        norm_eps: its eps (the model's rms_norm_eps).
    norm_weight_offset: the model scales by (offset + w) (Gemma: 1.0); :meth:`norm_args` passes
        ``offset + w.float()`` as an fp32 weight, the model's own fp32 sum.
    mrope_section / mrope_interleaved: mRoPE (Qwen-VL): the (t, h, w) frequencies of the three position
        rows, chunked or interleaved (:class:`kvfuse.RopeArgs`); None: plain RoPE, positions [n].
    rope_rotated: "proportional" RoPE (Gemma 4's global layers): only the first rope_rotated of the
        rotary_dim / 2 frequencies turn (:func:`kvfuse.rope.proportional_cos_sin_cache`); None: all.
    v_norm: a weightless RMSNorm (eps norm_eps) of each v row before the V cache (Gemma 4).
    name / source: a label and the public sources the values come from.
    """
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_is_neox: bool
    rope_theta: float
    qk_norm: bool
    norm_eps: float
    norm_weight_offset: float = 0.0
    rope_scaling: Optional[YarnScaling] = None
    source: str = dataclasses.field(default="", repr=False)
    mrope_section: Optional[tuple] = None
    mrope_interleaved: bool = False
    rope_rotated: Optional[int] = None
    v_norm: bool = False

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"GQAConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ValueError(f"GQAConfig.rotary_dim must be even and in (0, head_dim], got {self.rotary_dim}")
        if self.mrope_section is not None and (len(self.mrope_section) != 3
                                               or sum(self.mrope_section) != self.rotary_dim // 2):
            raise ValueError(f"GQAConfig.mrope_section must be three ints summing to rotary_dim / 2 "
                             f"({self.rotary_dim // 2}), got {self.mrope_section}")
        if self.rope_rotated is not None and not 0 <= self.rope_rotated <= self.rotary_dim // 2:
            raise ValueError(f"GQAConfig.rope_rotated must be in [0, rotary_dim / 2], got {self.rope_rotated}")

    @property
    def qkv_width(self) -> int:
        """Columns of the packed QKV projection output: (num_heads + 2 num_kv_heads) * head_dim."""
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def kv_bytes_per_token(self, element_size: int) -> int:
        """K and V cache bytes of one token in one layer (element_size 2 for bf16, 1 for fp8)."""
        return 2 * self.num_kv_heads * self.head_dim * element_size

    def split_qkv(self, qkv: torch.Tensor):
        """Views q [n, Hq, D], k [n, Hkv, D], v [n, Hkv, D] of a packed projection [n, qkv_width]
        (stride(-1) == 1): no copies. A tensor of another shape is a ValueError naming the q / k / v widths."""
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if not isinstance(qkv, torch.Tensor):
            raise TypeError(f"GQAConfig.split_qkv: qkv must be a torch.Tensor, got {type(qkv).__name__}")
        if qkv.dim() != 2 or qkv.shape[1] != self.qkv_width:
            raise ValueError(f"GQAConfig.split_qkv: qkv of {self.name}: expected [n, {self.qkv_width}] "
                             f"(q {hq * d} + k {hkv * d} + v {hkv * d} columns), got {list(qkv.shape)}")
        q = qkv[:, :hq * d].unflatten(1, (hq, d))
        k = qkv[:, hq * d:(hq + hkv) * d].unflatten(1, (hkv, d))
        v = qkv[:, (hq + hkv) * d:(hq + 2 * hkv) * d].unflatten(1, (hkv, d))
        return q, k, v

    def norm_args(self, weight: Optional[torch.Tensor]) -> Optional[NormArgs]:
        """The NormArgs of a q_norm / k_norm weight as the model applies it (None without QK-norm):
        the weight itself, or for Gemma ``offset + w.float()`` (fp32: the model's own fp32 sum, kept
        unrounded; kvfuse multiplies by the fp32 weight and rounds once, as Gemma3RMSNorm does)."""
        if not self.qk_norm:
            return None
        if weight is None:
            raise ValueError(f"{self.name} has a QK-norm: its weight is needed, got None")
        w = weight if not self.norm_weight_offset else self.norm_weight_offset + weight.float()
        return NormArgs(w, eps=self.norm_eps)

    def rope_args(self, positions: torch.Tensor, cos_sin: torch.Tensor) -> RopeArgs:
        """The RopeArgs of a call: positions [n], or [3, n] for an mRoPE model (:meth:`text_positions`)."""
        return RopeArgs(positions, cos_sin, self.rotary_dim, self.rope_is_neox, offset=0,
                        mrope_section=self.mrope_section, mrope_interleaved=self.mrope_interleaved)

    def text_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """The positions a text-only batch passes: ``positions`` [n] itself, or for an mRoPE model its three
        equal rows [3, n] (:func:`kvfuse.rope.mrope_text_positions`; images: :func:`kvfuse.rope.mrope_grid_positions`)."""
        return positions if self.mrope_section is None else mrope_text_positions(positions)

    def v_norm_args(self) -> Optional[NormArgs]:
        """The V-norm's NormArgs (weightless, eps norm_eps), None for a model without one."""
        return NormArgs(None, eps=self.norm_eps) if self.v_norm else None

    def cos_sin_cache(self, max_position: int, device=None) -> torch.Tensor:
        """fp32 [max_position, rotary_dim] of the model's RoPE with base rope_theta: YaRN-scaled when
        rope_scaling is set (:func:`kvfuse.rope.yarn_cos_sin_cache`), proportional when rope_rotated is
        (:func:`kvfuse.rope.proportional_cos_sin_cache`), else unscaled. mRoPE models use the same table."""
        if self.rope_scaling is not None:
            return self.rope_scaling.cos_sin_cache(max_position, self.rotary_dim, self.rope_theta, device)
        if self.rope_rotated is not None:
            return proportional_cos_sin_cache(max_position, self.rotary_dim, self.rope_rotated, self.rope_theta, device)
        return cos_sin_cache(max_position, self.rotary_dim, self.rope_theta, device)

    def store_kv(self, qkv, k_cache, v_cache, slot_mapping, positions, cos_sin, q_norm_weight=None,
                 k_norm_weight=None, k_scale=None, v_scale=None, layout="NHD", q_out=None, numerics="staged"):
        """One layer's call: the packed projection qkv [n, qkv_width] -> q_out (returned), K and V (V-normed
        for a model with v_norm) into the paged caches (see :func:`kvfuse.fused_qk_norm_rope_store_kv`;
        positions [n], or [3, n] for an mRoPE model; ``numerics``: its profile, "staged", "fused" or
        "fused_fp32_cast", :mod:`kvfuse.numerics_profiles`)."""
        from .gqa import fused_qk_norm_rope_store_kv
        q, k, v = self.split_qkv(qkv)
        return fused_qk_norm_rope_store_kv(q, k, v, k_cache, v_cache, slot_mapping, self.norm_args(q_norm_weight),
                                           self.norm_args(k_norm_weight), self.rope_args(positions, cos_sin),
                                           k_scale, v_scale, layout, q_out, numerics=numerics,
                                           v_norm_args=self.v_norm_args())


# Read in stored public snapshots: transformers' modeling_gemma3.py (Gemma3RMSNorm, Gemma3Attention,
# rotate_half) and Gemma 3 12B's text_config. The Llama 3 and Qwen3 values are those of the models' published
# config.json files and modeling files (LlamaAttention, Qwen3Attention / Qwen3RMSNorm), not re-read here.
_HF = "huggingface/transformers src/transformers/models"
LLAMA3_8B = GQAConfig(
    name="llama-3-8b", num_heads=32, num_kv_heads=8, head_dim=128, rotary_dim=128, rope_is_neox=True,
    rope_theta=500000.0, qk_norm=False, norm_eps=1e-5,
    source=f"{_HF}/llama/modeling_llama.py (LlamaAttention: no QK-norm; apply_rotary_pos_emb with rotate_half = "
           "NEOX pairs over the whole head); meta-llama/Meta-Llama-3-8B config.json: hidden_size 4096, "
           "num_attention_heads 32, num_key_value_heads 8 (head_dim 4096 / 32 = 128), rope_theta 500000, "
           "rms_norm_eps 1e-5 (Llama 3.1 adds rope_scaling 'llama3', a property of the cos/sin table)")
"""Llama 3 / 3.1 8B: 32 Q heads, 8 KV heads of 128, NEOX RoPE over the whole head, no QK-norm."""

LLAMA3_70B = dataclasses.replace(
    LLAMA3_8B, name="llama-3-70b", num_heads=64,
    source=LLAMA3_8B.source.replace("Meta-Llama-3-8B config.json: hidden_size 4096, num_attention_heads 32",
                                    "Meta-Llama-3-70B config.json: hidden_size 8192, num_attention_heads 64")
    .replace("4096 / 32", "8192 / 64"))
"""Llama 3 / 3.1 70B: 64 Q heads, 8 KV heads of 128, NEOX RoPE over the whole head, no QK-norm."""

QWEN3_8B = GQAConfig(
    name="qwen3-8b", num_heads=32, num_kv_heads=8, head_dim=128, rotary_dim=128, rope_is_neox=True,
    rope_theta=1000000.0, qk_norm=True, norm_eps=1e-6,
    source=f"{_HF}/qwen3/modeling_qwen3.py (Qwen3Attention: q_norm / k_norm = Qwen3RMSNorm(head_dim) on each "
           "head before apply_rotary_pos_emb, rotate_half = NEOX); Qwen/Qwen3-8B config.json: num_attention_heads "
           "32, num_key_value_heads 8, head_dim 128, rms_norm_eps 1e-6, rope_theta 1000000")
"""Qwen3-8B: 32 Q heads, 8 KV heads of 128, per-head RMSNorm of q and k (weight [128]), NEOX RoPE.
HF's Qwen3RMSNorm rounds x * rstd to bf16 before multiplying by the weight; kvfuse rounds once (SPEC §6),
so its q / k may differ from HF's eager path by one bf16 rounding (vLLM's fused kernels differ from
both in their own ways)."""

QWEN3_32B = dataclasses.replace(
    QWEN3_8B, name="qwen3-32b", num_heads=64,
    source=QWEN3_8B.source.replace("Qwen/Qwen3-8B config.json: num_attention_heads 32",
                                   "Qwen/Qwen3-32B config.json: num_attention_heads 64"))
"""Qwen3-32B: 64 Q heads, 8 KV heads of 128, as Qwen3-8B otherwise."""

GEMMA3_12B = GQAConfig(
    name="gemma-3-12b", num_heads=16, num_kv_heads=8, head_dim=256, rotary_dim=256, rope_is_neox=True,
    rope_theta=1000000.0, qk_norm=True, norm_eps=1e-6, norm_weight_offset=1.0,
    source=f"{_HF}/gemma3/modeling_gemma3.py (Gemma3Attention: q_norm / k_norm = Gemma3RMSNorm(head_dim), "
           "applied per head before apply_rotary_pos_emb, rotate_half = NEOX; Gemma3RMSNorm: x.float() * "
           "rsqrt(mean(x^2) + eps) * (1.0 + weight.float()), rounded once to the input dtype); "
           "google/gemma-3-12b text_config: num_attention_heads 16, num_key_value_heads 8, head_dim 256, "
           "rms_norm_eps 1e-6, rope_theta 1000000 (global layers, linear scaling factor 8), "
           "rope_local_base_freq 10000 (sliding-window layers)")
"""Gemma 3 12B: 16 Q heads, 8 KV heads of 256, per-head RMSNorm with (1 + w) scaling, NEOX RoPE
(two tables: base 1e6 with linear scaling 8 on the global layers, 10000 on the local ones; the table is
the caller's). The (1 + w) maps onto kvfuse's RMSNorm exactly by passing the fp32 weight 1.0 + w.float()
(:meth:`GQAConfig.norm_args`): the model computes that sum in fp32 and rounds the product once, as
kvfuse does."""

# Read in stored public snapshots: transformers 5.25.0 models/gpt_oss/configuration_gpt_oss.py and
# modeling_gpt_oss.py, modeling_rope_utils.py (_compute_yarn_parameters), openai/gpt-oss gpt_oss/torch/model.py
# and vLLM vllm/model_executor/models/gpt_oss.py. The hub config.json files themselves were not read here.
_GPT_OSS_YARN = YarnScaling(factor=32.0, original_max_position=4096, beta_fast=32.0, beta_slow=1.0, truncate=False)
GPT_OSS_20B = GQAConfig(
    name="gpt-oss-20b", num_heads=64, num_kv_heads=8, head_dim=64, rotary_dim=64, rope_is_neox=True,
    rope_theta=150000.0, qk_norm=False, norm_eps=1e-5, rope_scaling=_GPT_OSS_YARN,
    source=f"{_HF}/gpt_oss/modeling_gpt_oss.py (GptOssAttention: q / k / v projections with bias, no QK-norm, "
           "apply_rotary_pos_emb with _apply_rotary_emb = halves (x1, x2) = NEOX over the whole head; "
           "GptOssRotaryEmbedding: cos and sin times attention_scaling; sinks and the sliding window are "
           "arguments of the attention function) and gpt_oss/configuration_gpt_oss.py (GptOssConfig defaults: "
           "head_dim 64, num_attention_heads 64, num_key_value_heads 8, rms_norm_eps 1e-5, default_theta 150000, "
           "rope_parameters {rope_type yarn, factor 32, beta_fast 32, beta_slow 1, truncate False, "
           "original_max_position_embeddings 4096}, sliding_window 128 on alternate layers); "
           "huggingface/transformers src/transformers/modeling_rope_utils.py (_compute_yarn_parameters); "
           "openai/gpt-oss gpt_oss/torch/model.py (ModelConfig: head_dim 64, 64 / 8 heads, rope_theta 150000, "
           "rope_scaling_factor 32, rope_ntk_alpha 1, rope_ntk_beta 32, initial_context_length 4096; "
           "RotaryEmbedding: unrounded ramp bounds); vLLM vllm/model_executor/models/gpt_oss.py (OAIAttention: "
           "get_rope(..., is_neox_style=True) with rope_type yarn and the config's truncate); "
           "gpt-oss-20b: 24 layers, 32 experts (the model card's figures, as NVIDIA Megatron-Bridge's GPT OSS page "
           "quotes them; the attention is the same in every layer)")
"""GPT-OSS 20B: 64 Q heads, 8 KV heads of 64, no QK-norm, NEOX RoPE over the whole head with a YaRN table
(base 150000, factor 32 over 4096 positions, beta 32 / 1, unrounded ramp bounds, cos and sin times
0.1 ln 32 + 1). Attention sinks and the 128-token sliding window of alternate layers act when attention
reads the cache, not on the K / V written."""

GPT_OSS_120B = dataclasses.replace(
    GPT_OSS_20B, name="gpt-oss-120b",
    source=GPT_OSS_20B.source.replace("gpt-oss-20b: 24 layers, 32 experts", "gpt-oss-120b: 36 layers, 128 experts"))
"""GPT-OSS 120B: the attention of GPT-OSS 20B (more layers and experts, the same per-layer KV write)."""

# mRoPE models. Read: vLLM 0.33.0 vllm/model_executor/layers/rotary_embedding/mrope.py
# (MRotaryEmbedding.forward_native, apply_interleaved_rope, _triton_mrope_forward) and its models/qwen3_vl.py
# (Qwen3LLMModel on Qwen3's attention), qwen3.py / qwen2.py; transformers' apply_multimodal_rotary_pos_emb
# (modeling_qwen2_vl.py: cos / sin split by mrope_section * 2, chunk i from row i % 3) and
# Qwen3VLTextRotaryEmbedding.apply_interleaved_mrope (modeling_qwen3_vl.py: row 1 at j % 3 == 1, j < 3 h, row 2
# at j % 3 == 2, j < 3 w, else row 0) as stored copies of those files show them. The hub config.json files
# were not read here: their values below are as third-party copies quote them.
QWEN25_VL_7B = GQAConfig(
    name="qwen2.5-vl-7b", num_heads=28, num_kv_heads=4, head_dim=128, rotary_dim=128, rope_is_neox=True,
    rope_theta=1000000.0, qk_norm=False, norm_eps=1e-6, mrope_section=(16, 24, 24), mrope_interleaved=False,
    source=f"{_HF}/qwen2_5_vl/modeling_qwen2_5_vl.py and {_HF}/qwen2_vl/modeling_qwen2_vl.py (the text attention: "
           "q / k / v with bias, no QK-norm; apply_multimodal_rotary_pos_emb: rotate_half = NEOX over the whole "
           "head, cos / sin chunks of mrope_section [16, 24, 24] from the t, h, w position rows); vLLM "
           "vllm/model_executor/layers/rotary_embedding/mrope.py (MRotaryEmbedding, chunked) and "
           "vllm/model_executor/models/qwen2_5_vl.py; Qwen/Qwen2.5-VL-7B-Instruct config.json: hidden_size 3584, "
           "num_attention_heads 28, num_key_value_heads 4 (head_dim 128), rope_theta 1000000, rms_norm_eps 1e-6, "
           "rope_scaling {type mrope, mrope_section [16, 24, 24]}")
"""Qwen2.5-VL 7B: 28 Q heads, 4 KV heads of 128, no QK-norm, NEOX mRoPE over the whole head with chunked
sections (16, 24, 24): frequencies 0..15 from the temporal row, 16..39 from the height row, 40..63 from
the width row (Qwen2-VL 7B has the same attention)."""

QWEN3_VL_8B = dataclasses.replace(
    QWEN3_8B, name="qwen3-vl-8b", rope_theta=5000000.0, mrope_section=(24, 20, 20), mrope_interleaved=True,
    source=f"{_HF}/qwen3_vl/modeling_qwen3_vl.py (Qwen3VLTextAttention: q_norm / k_norm = Qwen3VLTextRMSNorm("
           "head_dim) per head before RoPE, rotate_half = NEOX; Qwen3VLTextRotaryEmbedding.apply_interleaved_mrope: "
           "frequencies interleaved t, h, w for mrope_section [24, 20, 20]); vLLM "
           "vllm/model_executor/layers/rotary_embedding/mrope.py (mrope_interleaved) and "
           "vllm/model_executor/models/qwen3_vl.py (Qwen3LLMModel: Qwen3's attention with q_norm / k_norm); "
           "Qwen/Qwen3-VL-8B-Instruct text_config: hidden_size 4096, num_attention_heads 32, num_key_value_heads 8, "
           "head_dim 128, rope_theta 5000000, rms_norm_eps 1e-6, rope_scaling {mrope_interleaved true, "
           "mrope_section [24, 20, 20]} (as NVIDIA Megatron-Bridge's Qwen3VLModelProvider and third-party "
           "test configurations quote them)")
"""Qwen3-VL 8B: 32 Q heads, 8 KV heads of 128, Qwen3's per-head QK-norm, NEOX mRoPE over the whole head
with interleaved sections (24, 20, 20): frequency j from the height row for j % 3 == 1 (j < 60), the width
row for j % 3 == 2 (j < 60), else the temporal row."""

# Gemma 4. Read in stored public snapshots: transformers' modeling_gemma4.py (Gemma4RMSNorm: fp32, x *
# pow(mean(x^2) + eps, -0.5), times weight.float() unless with_scale=False, rounded once; the text attention:
# q_norm, k_norm with weights, v_norm = Gemma4RMSNorm(head_dim, eps=rms_norm_eps, with_scale=False),
# attention_k_eq_v: v = the raw k projection on the global layers), configuration_gemma4.py (rms_norm_eps 1e-6;
# rope_parameters: sliding {default, theta 10000}, full {proportional, partial_rotary_factor 0.25, theta 1e6};
# global_head_dim 512) and modeling_rope_utils.py (_compute_proportional_rope_parameters); vLLM 0.33.0
# vllm/model_executor/models/gemma4.py (Gemma4Attention: q_norm / k_norm = RMSNorm(head_dim), v_norm =
# RMSNorm(head_dim, has_weight=False), get_rope(is_neox_style=True)) and rotary_embedding/gemma4_rope.py
# (Gemma4RotaryEmbedding: rotary_dim = head_size, zero frequencies past the rotated ones). Gemma 4 31B's head
# counts (32 Q heads; 16 KV heads of 256 on sliding layers, 4 of 512 on global ones, k_eq_v) are as the
# vllm-metal tests and a Core AI conversion's model card quote its config.json, which was not read here.
_GEMMA4_SOURCE = (
    f"{_HF}/gemma4/modeling_gemma4.py (Gemma4RMSNorm with / without scale; q_norm, k_norm, v_norm before RoPE "
    f"and the cache), {_HF}/gemma4/configuration_gemma4.py (rms_norm_eps 1e-6, per-layer-type rope_parameters, "
    "global_head_dim 512), src/transformers/modeling_rope_utils.py (_compute_proportional_rope_parameters); "
    "vLLM vllm/model_executor/models/gemma4.py (Gemma4Attention: RMSNorm q_norm / k_norm, v_norm has_weight=False) "
    "and vllm/model_executor/layers/rotary_embedding/gemma4_rope.py; google/gemma-4-31B: 32 Q heads, "
    "num_key_value_heads 16 (head_dim 256), num_global_key_value_heads 4 (global_head_dim 512), "
    "attention_k_eq_v on the global layers (as quoted by vllm-project/vllm-metal's tests and a Core AI "
    "conversion's model card)")
GEMMA4_31B_SLIDING = GQAConfig(
    name="gemma-4-31b-sliding", num_heads=32, num_kv_heads=16, head_dim=256, rotary_dim=256, rope_is_neox=True,
    rope_theta=10000.0, qk_norm=True, norm_eps=1e-6, v_norm=True, source=_GEMMA4_SOURCE)
"""Gemma 4 31B's sliding-window layers: 32 Q heads, 16 KV heads of 256, QK-norm (weights used as they are,
no 1 + w), NEOX RoPE over the whole head (base 10000), a weightless RMSNorm of V."""

GEMMA4_31B_GLOBAL = dataclasses.replace(
    GEMMA4_31B_SLIDING, name="gemma-4-31b-global", num_kv_heads=4, head_dim=512, rotary_dim=512, rope_theta=1000000.0,
    rope_rotated=64)
"""Gemma 4 31B's global layers: 32 Q heads, 4 KV heads of 512, QK-norm, "proportional" NEOX RoPE over the
whole 512-d head (pairs (j, j + 256); only the first 64 frequencies turn, base 1e6 over 512), a weightless
RMSNorm of V. With attention_k_eq_v the model's v is its raw k projection: pass the same tensor as k and v."""

GQA_MODELS: Dict[str, GQAConfig] = {c.name: c for c in (LLAMA3_8B, LLAMA3_70B, QWEN3_8B, QWEN3_32B, GEMMA3_12B,
                                                        GPT_OSS_20B, GPT_OSS_120B, QWEN25_VL_7B, QWEN3_VL_8B,
                                                        GEMMA4_31B_SLIDING, GEMMA4_31B_GLOBAL)}
"""The GQA / MHA configurations, by name (separate from the MLA configurations of :data:`MODELS`)."""


def gqa_names():
    return list(GQA_MODELS)


def get_gqa(name: str) -> GQAConfig:
    """The GQA configuration called ``name`` (case-insensitive). ValueError for an unknown name."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    key = name.strip().lower()
    if key not in GQA_MODELS:
        raise ValueError(f"name: unknown GQA model configuration {name!r}; known: {', '.join(GQA_MODELS)}")
    return GQA_MODELS[key]
