"""Quick GPU sweep of the fused kernel's launch configurations (BLOCK_M, num_warps) on the MAIN_FP8
write and a 128-d index write, CUDA-graph timing; the numbers behind launch_config's table.
Usage: python benchmarks/tune_sweep.py [--out FILE]"""
import argparse
import json
import statistics

import torch
import triton

import kvfuse
from kvfuse import CastArgs, KVCacheOutArgs, NormArgs, RopeArgs, formats
from kvfuse.kernels.fused import force_config


def graph_time_us(fn, calls=20, reps=30):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
        with torch.cuda.graph(g):
            for _ in range(calls):
                fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1000 / calls)
    return statistics.median(ts)


def copy_bw():
    a = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    t = triton.testing.do_bench(lambda: b.copy_(a), return_mode="median")
    return 2 * a.numel() / (t * 1e-3) / 1e12


def workload(fmt, n, rdim=64):
    D = fmt.head_dim
    x = torch.randn(n, D, device="cuda").to(torch.bfloat16)
    w = torch.rand(D, device="cuda").to(torch.bfloat16)
    P = 8192
    ang = torch.rand(P, rdim // 2, device="cuda") * 6
    cs = torch.cat([ang.cos(), ang.sin()], 1)
    pos = torch.randint(0, P, (n,), device="cuda")
    bs = 64
    cache = fmt.allocate((n + bs - 1) // bs, bs, device="cuda")
    slots = torch.randperm(cache.shape[0] * bs, device="cuda")[:n]
    args = (x, NormArgs(w), RopeArgs(pos, cs, rdim, True), None, CastArgs.from_cache_format(fmt),
            KVCacheOutArgs(cache, slots, layout=fmt))
    nbytes = n * (2 * D + rdim * 4 + 8 + 8 + fmt.quant_bytes + fmt.sf_exact_bytes + 2 * fmt.bf16_tail) + 2 * D
    return (lambda: kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(*args)), nbytes


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()
    bw = copy_bw()
    rows = []
    print(f"copy bandwidth {bw:.2f} TB/s")
    for fmt in (formats.MAIN_FP8, formats.INDEX_MXFP4, formats.FLASHMLA_V32):
        for n in (1, 256, 4096, 65536, 262144):
            fn, nbytes = workload(fmt, n)
            for bm in (1, 2, 4, 8, 16):
                for nw in (1, 2, 4, 8):
                    if bm * triton.next_power_of_2(fmt.head_dim) > 16384:
                        continue
                    with force_config(bm, nw):
                        us = graph_time_us(fn)
                    rows.append(dict(fmt=fmt.name, n=n, bm=bm, nw=nw, us=us, pct=100 * nbytes / (us * 1e-6) / (bw * 1e12)))
            best = min((r for r in rows if r["fmt"] == fmt.name and r["n"] == n), key=lambda r: r["us"])
            dflt = kvfuse.kernels.fused.launch_config(n, fmt.head_dim, triton.next_power_of_2(fmt.head_dim), False)
            cur = [r for r in rows if r["fmt"] == fmt.name and r["n"] == n and (r["bm"], r["nw"]) == dflt]
            print(f"{fmt.name:16s} n={n:7d} best bm={best['bm']} nw={best['nw']} {best['us']:8.2f} us "
                  f"{best['pct']:5.1f}% copy | default {dflt}: {cur[0]['us'] if cur else float('nan'):8.2f} us")
    if args.out:
        json.dump(dict(copy_tbs=bw, rows=rows), open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
