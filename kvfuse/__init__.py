"""kvfuse: RMSNorm -> RoPE -> Hadamard -> FP8/FP4 quantization -> paged KV-cache write in one
Triton launch, byte-equal to the unfused PyTorch chain (:mod:`kvfuse.reference`)."""
from . import formats, gqa_formats, reference
from . import ops  # noqa: F401  (registers the kvfuse:: custom ops that kvfuse.dispatch calls while tracing)
from .api import fused_norm_rope_hadamard_cast_store_kvcache, load_paged_kv_cache, store_kv_cache
from .args import CastArgs, ContiguousOutArgs, FusedCall, HadamardArgs, KVCacheOutArgs, NormArgs, PagedAppend, RopeArgs
from .backend import checks_enabled, current_backend, pdl_enabled, set_checks, set_pdl, use_backend
from .formats import KVCacheFormat, allocate_kv_cache
from .gqa_formats import GQACacheFormat
from .gqa import fused_qk_norm_rope_store_kv, load_gqa_kv_cache
from .group import fused_group
from .plans.cache import clear_plan_cache, plan_cache_enabled, plan_cache_info, set_plan_cache
from . import mla, models  # noqa: E402  (after the api: mla builds on it; models on mla)

__version__ = "0.1.0"
__all__ = [
    "fused_norm_rope_hadamard_cast_store_kvcache", "store_kv_cache", "load_paged_kv_cache", "fused_qk_norm_rope_store_kv",
    "load_gqa_kv_cache", "fused_group", "FusedCall", "NormArgs", "PagedAppend", "RopeArgs", "HadamardArgs", "CastArgs", "ContiguousOutArgs", "KVCacheOutArgs",
    "KVCacheFormat", "allocate_kv_cache", "formats", "GQACacheFormat", "gqa_formats", "reference", "use_backend", "set_checks",
    "current_backend", "checks_enabled", "set_pdl", "pdl_enabled", "mla", "models", "set_plan_cache",
    "plan_cache_enabled", "clear_plan_cache", "plan_cache_info",
]
