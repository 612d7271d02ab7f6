"""The numerics profiles and activation dtypes of :func:`kvfuse.fused_qk_norm_rope_store_kv` (SPEC §6, §3).

A profile says where the Q / K chain (RMSNorm -> RoPE) rounds to the activations' dtype and what an fp8
cache's cast reads. This table is the one place that defines them: validation (:mod:`kvfuse.plans.gqa`),
the reference chain (:mod:`kvfuse.reference.chain`), the kernel's NUMERICS / ACT constexprs
(:mod:`kvfuse.kernels.qkv`) and the GPU cases (tests/gqa_cases.py) all read it.
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class NumericsProfile:
    name: str
    code: int                  # the kernel's NUMERICS constexpr
    round_each_stage: bool     # the norm's output is rounded to the activations' dtype before RoPE
    cast_reads_fp32: bool      # an fp8 cache's cast reads the unrounded fp32 result
    summary: str


PROFILES = {p.name: p for p in (
    NumericsProfile("staged", 0, True, False,
                    "every stage rounded to the activations' dtype (kvfuse's default)"),
    NumericsProfile("fused", 1, False, False,
                    "fp32 from the norm's input through RoPE, one rounding to the activations' dtype; an fp8 "
                    "cast reads that rounded value (vLLM's fused_qk_norm_rope, then reshape_and_cache_flash)"),
    NumericsProfile("fused_fp32_cast", 2, False, True,
                    "as 'fused', but an fp8 cast reads the fp32 value before the rounding (FlashInfer's fp8 "
                    "RoPE-quantize); q_out and an unquantized cache get the rounded value"),
)}
NUMERICS = tuple(PROFILES)

# activation dtypes of the GQA entry -> the kernel's ACT constexpr
ACTIVATION_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
ACTIVATION_DTYPES = tuple(ACTIVATION_CODES)


def profile(name, arg: str = "numerics") -> NumericsProfile:
    """The profile called ``name``; ValueError naming ``arg`` otherwise."""
    if not isinstance(name, str) or name not in PROFILES:
        raise ValueError(f"{arg} must be one of {NUMERICS}, got {name!r}")
    return PROFILES[name]
