"""Engine adapters: the signatures, argument conventions and semantics of an inference engine's own
KV-cache ops, each a thin layer over one kvfuse entry point (no second kernel), so that swapping the
engine's op is a change of import.

- :mod:`kvfuse.engines.vllm`: vLLM 0.33 (``vllm._custom_ops``): reshape_and_cache_flash,
  indexer_k_quant_and_cache, concat_and_cache_mla.
- :mod:`kvfuse.engines.flashinfer`: FlashInfer 0.7.2 (``flashinfer.page`` / ``flashinfer.rope``):
  append_paged_kv_cache, apply_rope_with_cos_sin_cache(_inplace).
- :mod:`kvfuse.engines.sglang`: SGLang 0.5.23 (``sglang.kernels.ops``): fused_k_norm_rope_flashmla,
  fused_k_indexer_norm_rope_store, fused_store_index_k_cache.

docs/engines.md says what each replaces and what differs.
"""
from . import flashinfer, sglang, vllm

__all__ = ["vllm", "flashinfer", "sglang"]
