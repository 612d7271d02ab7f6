"""The unfused PyTorch pipeline that defines kvfuse's numerics (SPEC §6), one function per stage.

Every stage reads bf16 and returns bf16 (round to nearest even), doing its arithmetic in IEEE
fp32 with each operation rounded on its own; torch ops are chosen so that this holds on the CPU
and on CUDA (divisions by a tensor, never by a Python scalar; sqrt in float64). This package is
the "reference" backend: it runs on CPU and CUDA tensors and the Triton kernel must equal it
byte for byte.

The package: ``numerics`` (narrowing helpers), ``stages`` (one function per stage), ``fp4`` (the 4-bit
GQA cache formats' quantizers and decoders), ``cache`` (records and paged stores), ``chain`` (the chains;
``run_plan`` is the reference backend). Every public name is
here too, as ``kvfuse.reference.<name>``.
"""
from .numerics import (  # noqa: F401
    F32, AMAX_MARGIN, E4M3_SF_MIN, E2M1_VALUES, round_to_bf16, encode_e4m3, encode_e5m2, decode_e4m3, encode_e2m1,
    decode_e2m1, pack_e2m1, unpack_e2m1)
from .stages import (  # noqa: F401
    pairwise_sum, rmsnorm, layernorm, norm, rope, mrope_position_rows, hadamard, group_scales, quantize,
    CANONICAL_NAN_BF16, dequant_scale, dequantize, canonical_nan, quantize_per_tensor, token_head_scales,
    encode_int8_round_half_away, quantize_per_token_head)
from .fp4 import (  # noqa: F401
    group_amax, nvfp4_block_scales, quantize_nvfp4, quantize_mxfp4, dequantize_nvfp4, dequantize_mxfp4)
from .cache import record_addresses, store, load, GQA_LAYOUTS, store_paged, load_paged, load_gqa_kv  # noqa: F401
from .chain import transform, run_plan, qk_norm_rope, qk_norm_rope_store_kv, run_gqa_plan  # noqa: F401
