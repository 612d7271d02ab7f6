"""Named, frozen configurations of the real models whose write-KV paths kvfuse serves (SPEC §10).

Each one is a :class:`kvfuse.mla.MLAConfig` (frozen dataclass): pass it to the call sites of
:mod:`kvfuse.mla` and they run the model's real calls (RoPE style and offsets, norm kinds,
Hadamard, cache formats). ``config.source`` cites the public code it follows; the notes below say
what was read in that code and what is inferred.

| name | Q head / RoPE | main record | main RoPE | index K norm | index RoPE | Hadamard | index format |
|---|---|---|---|---|---|---|---|
| deepseek-v3 (V3.1) | 128 x 192, offset 128, GPT-J | FLASHMLA_V32 576 = latent 512 (RMSNorm) + k_pe 64 | GPT-J, tail | - | - | - | - |
| deepseek-v3.2 | as V3 | as V3 | as V3 | LayerNorm (weight, bias) | first 64, NEOX | yes | INDEX_FP8_FP32 |
| deepseek-v3.2-ue8m0 | as V3 | as V3 | as V3 | as V3.2 | as V3.2 | yes | INDEX_FP8_UE8M0_FP32 |
| deepseek-v4 | 64 x 512 (weightless RMSNorm), offset 448, GPT-J | MAIN_FP8 512 (RMSNorm) | GPT-J, tail | RMSNorm | tail 64, GPT-J | yes | INDEX_MXFP8 (also compressed KV) |
| deepseek-v4-fp4 | as V4 | MAIN_FP4 | as V4 | as V4 | as V4 | yes | INDEX_MXFP4 (also compressed KV) |
| deepseek-v4-flashmla | as V4 | FLASHMLA_MODEL1 | as V4 | as V4 | as V4 | yes | INDEX_FP8_FP32 (also compressed KV) |

Sources read (stored public snapshots) and what they show:

* DeepSeek-V3 ``inference/model.py`` (``MLA.forward``, ``apply_rotary_emb``, ``RMSNorm``) and
  ``inference/configs/config_671B.json`` / ``config_v3.1.json``: q head = [q_nope 128 | q_pe 64]
  (``torch.split(q, [qk_nope_head_dim, qk_rope_head_dim])``), the latent [kv 512 | k_pe 64] with
  ``kv_norm = RMSNorm(kv_lora_rank)`` (eps 1e-6) on the latent only, and RoPE by
  ``torch.view_as_complex(x.view(..., -1, 2))``: adjacent pairs (2j, 2j+1), i.e. GPT-J /
  ``is_neox=False``. n_heads 128. vLLM ``vllm/model_executor/models/deepseek_v2.py``
  (``DeepseekV2MLAAttention.__init__``): ``get_rope(qk_rope_head_dim, ..., is_neox_style=False)``,
  ``kv_a_layernorm = RMSNorm(kv_lora_rank)``.
* DeepSeek-V3.2-Exp ``inference/model.py`` (``Indexer.__init__`` / ``Indexer.forward``,
  ``LayerNorm``, ``rotate_activation``) and ``inference/kernel.py`` (``act_quant``):
  ``k_norm = LayerNorm(head_dim)`` (weight and bias, eps 1e-6); q and k split as
  [rope 64 | nope 64] (RoPE on the FIRST 64 dims); ``rotate_activation`` = Hadamard with scale
  hidden_size**-0.5 = 128**-0.5 on q and k; ``act_quant(x, 128, scale_fmt)``: e4m3, one fp32
  scale per 128, amax floored at 1e-4; index_n_heads 64, index_head_dim 128.
  RoPE pairing of the indexer: the release snapshot (Sept./Oct. 2025) calls
  ``apply_rotary_emb(q_pe, freqs_cis)`` (interleaved); a later revision (commit 87e509a, as
  cited and copied by MaxText's ``check_deepseek32_vs_reference`` test) gives
  ``apply_rotary_emb`` an ``interleaved`` flag and calls it with ``False`` in the indexer
  ("rope in indexer is not interleaved": pairs (j, j + 32), NEOX). vLLM's
  ``DeepseekV2MLAAttention.__init__`` builds ``indexer_rope_emb = get_rope(...,
  is_neox_style=not getattr(config, "indexer_rope_interleave", False))``: NEOX unless the model
  config says interleave. kvfuse follows the corrected reference and vLLM: NEOX.
  The scale: ``config_671B_v3.2.json`` sets ``"scale_fmt": "ue8m0"``, with which ``act_quant``
  rounds each scale up to a power of two (``fast_round_scale``), and vLLM's ``Indexer`` uses
  ``scale_fmt = "ue8m0"``: that is kvfuse's sf_format "ue8m0_fp32" (``deepseek-v3.2-ue8m0``,
  format :data:`INDEX_FP8_UE8M0_FP32`). ``act_quant`` with ``scale_fmt=None`` (its default) and
  SGLang's DSV4 fp8 indexer kernels keep the scale amax / 448 unrounded: INDEX_FP8_FP32
  (``deepseek-v3.2``, the SPEC's choice). Both store one fp32 per 128 values (132 bytes/token).
* SGLang ``python/sglang/jit_kernel/csrc/deepseek_v4/main_norm_rope.cuh``
  (``FusedKNormRopeFlashMLAKernel``, ``FusedQNormRopeKernel``,
  ``fused_q_indexer_rope_hadamard_quant``) and ``fused_norm_rope_v2.cuh``
  (``fused_norm_rope_indexer``, ``fused_norm_rope_indexer_fp4``, ``fused_norm_rope_flashmla``):
  V4 main K = RMSNorm with weight over 512, RoPE on the last 64 with adjacent (real, imag) pairs
  (GPT-J), FlashMLA MODEL1 record (448 e4m3 with a UE8M0 scale per 64 + 64 bf16); V4 Q =
  "rmsnorm-self" (no weight) over the head, then the same RoPE on its tail; V4 indexer K/Q:
  RMSNorm (K) -> RoPE on the trailing 64 dims, adjacent pairs -> 128-point Hadamard scaled by
  128**-0.5 -> e4m3 with one unrounded fp32 scale per 128 (INDEX_FP8_FP32, 132 bytes/token) or
  e2m1 with a UE8M0 scale per 32 (INDEX_MXFP4, 68 bytes/token).
* The DeepInfer article (the project's seed; ``attn.py``, ``compress.py``, ``index_attn.py`` call
  sites): Q 64 heads x 512, main caches MAIN_FP8 (e4m3, UE8M0 per 32) and MAIN_FP4 (e2m1, e4m3 per
  16), MXFP8 index KV (INDEX_MXFP8).

Inferred, not read: V4's head counts (64 Q heads from the article; 64 indexer heads as in
V3.2); ``index_hadamard=True`` for V4 follows SGLang's kernels (the article's DeepInfer call sites
pass no Hadamard; both sides share it, so logits are unchanged up to quantization); the SGLang
kernel file's V3.2 indexer-Q path (``kRopeFirst``) pairs adjacent elements, which kvfuse does not
follow (it may rely on permuted weights; not checked); V3 / V3.1 use FLASHMLA_V32 as the main
format as SPEC §10 asks (the FP8 sparse record V3.2's FlashMLA decode reads; dense V3
deployments also run a bf16 576-d cache).
"""
from __future__ import annotations

import dataclasses
from typing import Dict

from .formats import (FLASHMLA_MODEL1, FLASHMLA_V32, INDEX_FP8_FP32, INDEX_MXFP4, INDEX_MXFP8, MAIN_FP4, MAIN_FP8,
                      KVCacheFormat)
from .mla import MLAConfig

__all__ = [
    "DEEPSEEK_V3", "DEEPSEEK_V32", "DEEPSEEK_V32_UE8M0", "DEEPSEEK_V4", "DEEPSEEK_V4_FP4", "DEEPSEEK_V4_FLASHMLA",
    "INDEX_FP8_UE8M0_FP32", "MODELS", "ALIASES", "get", "names",
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

MODELS: Dict[str, MLAConfig] = {c.name: c for c in (DEEPSEEK_V3, DEEPSEEK_V32, DEEPSEEK_V32_UE8M0, DEEPSEEK_V4,
                                                    DEEPSEEK_V4_FP4, DEEPSEEK_V4_FLASHMLA)}
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
