"""GQA writes with one fp8 scale per tensor against one per kv head (GPU): the same call of
``kvfuse.fused_qk_norm_rope_store_kv`` (Llama 3 8B: 32 q / 8 kv heads of 128, no QK-norm; Qwen3 8B: the
same heads with QK-norm; NEOX RoPE; NHD fp8 caches, each token in its own shuffled slot of 16-token
blocks), GPU time per call by CUDA-graph replay (kvfuse.bench.timing.CudaTimer), and a byte check first:
per-head scales that all equal the per-tensor one write the same cache bytes.

    python3 benchmarks/gqa_scales.py [--n 1,256,4096,65536] [--pdl]
"""
from __future__ import annotations

import argparse

import torch

import kvfuse
from kvfuse.bench.timing import CudaTimer
from kvfuse.rope import cos_sin_cache

MODELS = {"llama3_8b": (32, 8, 128, False), "qwen3_8b": (32, 8, 128, True)}


def inputs(n: int, hq: int, hkv: int, d: int, qk_norm: bool, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(n, (hq + 2 * hkv) * d, device="cuda", generator=g).to(torch.bfloat16)
    q, k, v = qkv.view(n, hq + 2 * hkv, d).split([hq, hkv, hkv], dim=1)
    block = 16
    blocks = (n + block - 1) // block + 1
    caches = [torch.empty(blocks, block, hkv, d, dtype=torch.float8_e4m3fn, device="cuda") for _ in range(2)]
    slots = torch.randperm(blocks * block, device="cuda", generator=g)[:n]
    pos = torch.randint(0, 4096, (n,), device="cuda", generator=g)
    rope = kvfuse.RopeArgs(pos, cos_sin_cache(4096, d, device="cuda"), d, True)
    w = torch.ones(d, dtype=torch.bfloat16, device="cuda")
    norm = kvfuse.NormArgs(w, 1e-6) if qk_norm else None
    return dict(q=q, k=k, v=v, k_cache=caches[0], v_cache=caches[1], slot_mapping=slots, q_norm_args=norm,
                k_norm_args=norm, rope_args=rope, q_out=torch.empty_like(q))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", default="1,256,4096,65536")
    p.add_argument("--pdl", action="store_true")
    args = p.parse_args(argv)
    kvfuse.set_pdl(args.pdl)
    timer = CudaTimer()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, PDL {'on' if args.pdl else 'off'}; "
          "GPU us per call (CUDA-graph replay, median)")
    print(f"{'model':<10} {'n':>6} {'per tensor':>11} {'per head':>9} {'ratio':>6}  bytes")
    for name, (hq, hkv, d, qk_norm) in MODELS.items():
        for n in (int(v) for v in args.n.split(",")):
            kw = inputs(n, hq, hkv, d, qk_norm)
            one = torch.tensor([0.37], device="cuda")
            per_head_equal = torch.full((hkv,), 0.37, device="cuda")
            for c in (kw["k_cache"], kw["v_cache"]):      # poisoned: the slots no token takes stay 0xAB
                c.view(torch.uint8).fill_(0xAB)
            kvfuse.fused_qk_norm_rope_store_kv(**kw, k_scale=one, v_scale=one)
            want = [kw["k_cache"].view(torch.uint8).clone(), kw["v_cache"].view(torch.uint8).clone()]
            for c in (kw["k_cache"], kw["v_cache"]):
                c.view(torch.uint8).fill_(0xAB)
            kvfuse.fused_qk_norm_rope_store_kv(**kw, k_scale=per_head_equal, v_scale=per_head_equal)
            same = all(torch.equal(c.view(torch.uint8), w) for c, w in zip((kw["k_cache"], kw["v_cache"]), want))
            per_head = torch.linspace(0.2, 0.6, hkv, device="cuda")
            t1 = timer.measure([lambda: kvfuse.fused_qk_norm_rope_store_kv(**kw, k_scale=one, v_scale=one)])
            t2 = timer.measure([lambda: kvfuse.fused_qk_norm_rope_store_kv(**kw, k_scale=per_head, v_scale=per_head)])
            print(f"{name:<10} {n:>6} {t1.gpu_us:>11.2f} {t2.gpu_us:>9.2f} {t2.gpu_us / t1.gpu_us:>6.3f}  "
                  f"{'equal' if same else 'DIFFER'}")


if __name__ == "__main__":
    main()
