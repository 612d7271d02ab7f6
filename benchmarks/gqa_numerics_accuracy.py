"""Accuracy of the GQA entry's numerics profiles (kvfuse.numerics_profiles) against an fp64 chain (CPU,
reference backend; the kernels give the same bytes): for Llama 3 8B and Qwen3 8B heads
(kvfuse.models.get_gqa), bf16 and fp16 activations, each profile's q_out, k (a cache of the activations'
dtype) and k in an fp8 cache (per-tensor scale amax / 448 of the fp64 k) against the fp64 values of the
same chain (RMSNorm with the model's weights, RoPE with the fp32 cos/sin table's values); the computation is
kvfuse.numerics_accuracy's, which `kvfuse demo --gqa` also prints. Errors: max
and mean absolute; ulp error = |got - exact| / ulp(exact) in the output's format (0.5 at most when
correctly rounded): mean, max and the share above 0.5 (results not the correctly rounded fp64 value; for
the fp8 cache: codes other than e4m3(exact / scale), the ulp in units of the scaled value).

    python3 benchmarks/gqa_numerics_accuracy.py [--n 512] [--seed 0]
"""
from __future__ import annotations

import argparse

import torch

from kvfuse.models import get_gqa
from kvfuse.numerics_accuracy import profile_accuracy

MODELS = ("llama-3-8b", "qwen3-8b")
ACT_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


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
            rows = profile_accuracy(get_gqa(model), act, args.n, args.seed)
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
