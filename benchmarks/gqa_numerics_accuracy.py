"""Accuracy of the GQA entry's numerics profiles (kvfuse.numerics_profiles) against an fp64 chain (CPU,
reference backend; the kernels give the same bytes): for Llama 3 8B and Qwen3 8B heads
(kvfuse.models.get_gqa), bf16 and fp16 activations, each profile's q_out, k (a cache of the activations'
dtype) and k in an fp8 cache (per-tensor scale amax / 448 of the fp64 k) against the fp64 values of the
same chain (RMSNorm with the model's weights, RoPE with the fp32 cos/sin table's values). Errors: max
and mean absolute; ulp error = |got - exact| / ulp(exact) in the output's format (0.5 at most when
correctly rounded): mean, max and the share above 0.5 (results not the correctly rounded fp64 value; for
the fp8 cache: codes other than e4m3(exact / scale), the ulp in units of the scaled value).

    python3 benchmarks/gqa_numerics_accuracy.py [--n 512] [--seed 0]
"""
from __future__ import annotations

import argparse

import torch

import kvfuse
from kvfuse.models import get_gqa
from kvfuse.numerics_profiles import NUMERICS

MODELS = ("llama-3-8b", "qwen3-8b")
ACT_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
MANTISSA = {torch.bfloat16: (7, -126), torch.float16: (10, -14), torch.float8_e4m3fn: (3, -6)}


def inputs(cfg, n: int, seed: int):
    """A packed projection (per-token scale spread, a few outlier channels in k), q / k norm weights
    ~ 1 + 0.1 N(0, 1), positions in [0, 4096) and the model's fp32 cos/sin table."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, cfg.qkv_width, generator=g) * torch.exp(0.5 * torch.randn(n, 1, generator=g))
    kv0 = cfg.num_heads * cfg.head_dim
    ch = kv0 + torch.randperm(cfg.num_kv_heads * cfg.head_dim, generator=g)[:2 * cfg.num_kv_heads]
    x[:, ch] *= 10.0 + 20.0 * torch.rand(ch.numel(), generator=g)
    w = [(1.0 + 0.1 * torch.randn(cfg.head_dim, generator=g)) for _ in range(2)]
    pos = torch.randint(0, 4096, (n,), generator=g)
    return x, w, pos, cfg.cos_sin_cache(4096)


def exact_chain(x, w, eps, pos, cs, cfg):
    """fp64 RMSNorm (w None: none) then RoPE of x [n, H, D] (the model's pairing, offset 0)."""
    y = x.double()
    if w is not None:
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    r, h = cfg.rotary_dim, cfg.rotary_dim // 2
    row = cs.double()[pos][:, None, :]
    c, s = row[..., :h], row[..., h:]
    j = torch.arange(h)
    i0, i1 = (j, j + h) if cfg.rope_is_neox else (2 * j, 2 * j + 1)
    a, b = y[..., i0].clone(), y[..., i1].clone()
    y = y.clone()
    y[..., i0], y[..., i1] = a * c - b * s, a * s + b * c
    return y


def ulp_error(got: torch.Tensor, exact: torch.Tensor, fmt: torch.dtype) -> torch.Tensor:
    man, emin = MANTISSA[fmt]
    e = torch.floor(torch.log2(exact.abs().clamp_min(2.0 ** (emin - 60)))).clamp_min(emin)
    return (got.double() - exact).abs() / torch.exp2(e - man)


def stats(got, exact, fmt) -> dict:
    err = (got.double() - exact).abs()
    ulp = ulp_error(got, exact, fmt)
    return {"max_abs": err.max().item(), "mean_abs": err.mean().item(), "mean_ulp": ulp.mean().item(),
            "max_ulp": ulp.max().item(), "not_rounded": (ulp > 0.5 + 1e-9).double().mean().item()}


def run(model: str, act: torch.dtype, n: int, seed: int):
    cfg = get_gqa(model)
    x, (wq, wk), pos, cs = inputs(cfg, n, seed)
    qkv = x.to(act)
    q, k, v = cfg.split_qkv(qkv)
    wq, wk = (w.to(torch.bfloat16) for w in (wq, wk))
    qn, kn = cfg.norm_args(wq), cfg.norm_args(wk)
    rope = cfg.rope_args(pos, cs)
    q_exact = exact_chain(q, qn and qn.weight, cfg.norm_eps, pos, cs, cfg)
    k_exact = exact_chain(k, kn and kn.weight, cfg.norm_eps, pos, cs, cfg)
    scale = (k_exact.abs().max() / 448.0).float()
    # fp64 -> fp32 (exact enough: 29 more bits than e4m3) -> e4m3, round to nearest even
    k_code_exact = (k_exact / scale.double()).clamp(-448, 448).float().to(torch.float8_e4m3fn)
    slots = torch.arange(n)
    shape = (n, 1, cfg.num_kv_heads, cfg.head_dim)
    rows = []
    for numerics in NUMERICS:
        kc, vc = torch.empty(shape, dtype=act), torch.empty(shape, dtype=act)
        q_out = kvfuse.fused_qk_norm_rope_store_kv(q, k, v, kc, vc, slots, qn, kn, rope, numerics=numerics)
        k8, v8 = (torch.empty(shape, dtype=torch.float8_e4m3fn) for _ in range(2))
        kvfuse.fused_qk_norm_rope_store_kv(q, k, v, k8, v8, slots, qn, kn, rope, scale.reshape(1),
                                           torch.ones(1), numerics=numerics)
        k8 = k8[:, 0]
        rows.append((numerics, "q_out", stats(q_out, q_exact, act)))
        rows.append((numerics, "k", stats(kc[:, 0], k_exact, act)))
        deq = k8.double() * scale.double()
        st = stats(k8.double(), k_exact / scale.double(), torch.float8_e4m3fn)
        st.update(max_abs=(deq - k_exact).abs().max().item(), mean_abs=(deq - k_exact).abs().mean().item())
        # the fp8 rows' last column: codes other than e4m3(exact / scale) (the ulp rule is blind at e4m3's
        # subnormals and saturation)
        st["not_rounded"] = (k8.view(torch.uint8) != k_code_exact.view(torch.uint8)).double().mean().item()
        rows.append((numerics, "k fp8", st))
    return cfg, rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print(f"GQA numerics profiles against an fp64 chain: {args.n} tokens, seed {args.seed}, CPU reference backend, "
          f"torch {torch.__version__}")
    head = f"{'model':12s} {'act':5s} {'profile':16s} {'output':7s} {'max abs':>10s} {'mean abs':>10s} " \
           f"{'mean ulp':>9s} {'max ulp':>10s} {'> 0.5 ulp':>10s}"
    print(head)
    print("-" * len(head))
    for model in MODELS:
        for act in (torch.bfloat16, torch.float16):
            cfg, rows = run(model, act, args.n, args.seed)
            for numerics, what, st in rows:
                print(f"{model:12s} {ACT_NAMES[act]:5s} {numerics:16s} {what:7s} {st['max_abs']:10.3e} "
                      f"{st['mean_abs']:10.3e} {st['mean_ulp']:9.4f} {st['max_ulp']:10.3f} "
                      f"{100 * st['not_rounded']:9.3f}%")
    print("Llama 3 8B has no QK-norm: staged and fused coincide; fused_fp32_cast differs in the fp8 cast. "
          "ulp: of bf16 / fp16, of e4m3 for 'k fp8' (in units of the scaled value; '> 0.5 ulp' there is the share of codes other than e4m3(exact / scale)); max / "
          "mean abs of 'k fp8': the dequantized code against fp64. A large max ulp is a result near zero after "
          "RoPE's cancellation (tiny ulp).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
