"""Accuracy of the GQA entry's numerics profiles (:mod:`kvfuse.numerics_profiles`) against an fp64 chain.

For a GQA model (:class:`kvfuse.models.GQAConfig`) and an activation dtype, each profile's q_out, k (a
cache of the activations' dtype) and k in an fp8 cache (per-tensor scale amax / 448 of the fp64 k) are
compared with the fp64 values of the same chain (RMSNorm with the model's weights, RoPE with the fp32
cos/sin table's values), on the CPU with the reference backend (the kernels give the same bytes).
``kvfuse demo --gqa`` and benchmarks/gqa_numerics_accuracy.py print these figures.
"""
from __future__ import annotations

from typing import List, Tuple

import torch

from .backend import use_backend
from .gqa import fused_qk_norm_rope_store_kv
from .numerics_profiles import NUMERICS

OUTPUTS = ("q_out", "k", "k fp8")
# format -> (explicit mantissa bits, minimum normal exponent)
MANTISSA = {torch.bfloat16: (7, -126), torch.float16: (10, -14), torch.float8_e4m3fn: (3, -6)}


def accuracy_inputs(cfg, n: int, seed: int):
    """fp32 inputs: a packed projection [n, qkv_width] (per-token scale spread, a few outlier channels in
    k), the raw q / k norm weights (~ 1 + 0.1 N(0, 1) as the model applies them; Gemma's stored weights
    ~ 0.1 N(0, 1)), positions in [0, 4096) and the model's fp32 cos/sin table."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, cfg.qkv_width, generator=g) * torch.exp(0.5 * torch.randn(n, 1, generator=g))
    kv0 = cfg.num_heads * cfg.head_dim
    ch = kv0 + torch.randperm(cfg.num_kv_heads * cfg.head_dim, generator=g)[:2 * cfg.num_kv_heads]
    x[:, ch] *= 10.0 + 20.0 * torch.rand(ch.numel(), generator=g)
    base = 0.0 if cfg.norm_weight_offset else 1.0
    w = [(base + 0.1 * torch.randn(cfg.head_dim, generator=g)) for _ in range(2)]
    pos = torch.randint(0, 4096, (n,), generator=g)
    return x, w, pos, cfg.cos_sin_cache(4096)


def exact_chain(x, weight, eps, pos, cos_sin, cfg) -> torch.Tensor:
    """fp64 RMSNorm (``weight`` None: none) then RoPE of x [n, H, D] (the model's pairing, offset 0)."""
    y = x.double()
    if weight is not None:
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * weight.double()
    h = cfg.rotary_dim // 2
    row = cos_sin.double()[pos][:, None, :]
    c, s = row[..., :h], row[..., h:]
    j = torch.arange(h)
    i0, i1 = (j, j + h) if cfg.rope_is_neox else (2 * j, 2 * j + 1)
    a, b = y[..., i0].clone(), y[..., i1].clone()
    y = y.clone()
    y[..., i0], y[..., i1] = a * c - b * s, a * s + b * c
    return y


def ulp_error(got: torch.Tensor, exact: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    """|got - exact| in units of the last place of ``exact`` in ``fmt`` (at most 0.5 when correctly rounded)."""
    man, emin = MANTISSA[fmt]
    e = torch.floor(torch.log2(exact.abs().clamp_min(2.0 ** (emin - 60)))).clamp_min(emin)
    return (got.double() - exact).abs() / torch.exp2(e - man)


def error_stats(got, exact, fmt) -> dict:
    """max / mean absolute error, mean / max ulp error and the share of elements above 0.5 ulp
    ("not_rounded": results other than the correctly rounded fp64 value)."""
    err = (got.double() - exact).abs()
    ulp = ulp_error(got, exact, fmt)
    return {"max_abs": err.max().item(), "mean_abs": err.mean().item(), "mean_ulp": ulp.mean().item(),
            "max_ulp": ulp.max().item(), "not_rounded": (ulp > 0.5 + 1e-9).double().mean().item()}


def profile_accuracy(cfg, act: torch.dtype, n: int, seed: int) -> List[Tuple[str, str, dict]]:
    """[(profile, output, error_stats)] for every profile and output of :data:`OUTPUTS`, ``n`` tokens of
    :func:`accuracy_inputs` in ``act`` (bf16 / fp16). For "k fp8" the ulp is of e4m3 in units of the
    scaled value, max / mean abs are of the dequantized code, and "not_rounded" is the share of codes
    other than e4m3(exact / scale) (the ulp rule is blind at e4m3's subnormals and saturation)."""
    x, (wq, wk), pos, cs = accuracy_inputs(cfg, n, seed)
    q, k, v = cfg.split_qkv(x.to(act))
    qn, kn = cfg.norm_args(wq.to(torch.bfloat16)), cfg.norm_args(wk.to(torch.bfloat16))
    rope = cfg.rope_args(cfg.text_positions(pos), cs)      # mRoPE models: the text positions [3, n]
    q_exact = exact_chain(q, qn and qn.weight, cfg.norm_eps, pos, cs, cfg)
    k_exact = exact_chain(k, kn and kn.weight, cfg.norm_eps, pos, cs, cfg)
    scale = (k_exact.abs().max() / 448.0).float()
    # fp64 -> fp32 (29 more bits than e4m3: no double rounding in practice) -> e4m3, round to nearest even
    k_code_exact = (k_exact / scale.double()).clamp(-448, 448).float().to(torch.float8_e4m3fn)
    slots = torch.arange(n)
    shape = (n, 1, cfg.num_kv_heads, cfg.head_dim)
    rows = []
    with use_backend("reference"):
        for numerics in NUMERICS:
            kc, vc = torch.empty(shape, dtype=act), torch.empty(shape, dtype=act)
            q_out = fused_qk_norm_rope_store_kv(q, k, v, kc, vc, slots, qn, kn, rope, numerics=numerics)
            k8, v8 = (torch.empty(shape, dtype=torch.float8_e4m3fn) for _ in range(2))
            fused_qk_norm_rope_store_kv(q, k, v, k8, v8, slots, qn, kn, rope, scale.reshape(1), torch.ones(1),
                                        numerics=numerics)
            k8 = k8[:, 0]
            rows.append((numerics, "q_out", error_stats(q_out, q_exact, act)))
            rows.append((numerics, "k", error_stats(kc[:, 0], k_exact, act)))
            deq = k8.double() * scale.double()
            st = error_stats(k8.double(), k_exact / scale.double(), torch.float8_e4m3fn)
            st.update(max_abs=(deq - k_exact).abs().max().item(), mean_abs=(deq - k_exact).abs().mean().item())
            st["not_rounded"] = (k8.view(torch.uint8) != k_code_exact.view(torch.uint8)).double().mean().item()
            rows.append((numerics, "k fp8", st))
    return rows
