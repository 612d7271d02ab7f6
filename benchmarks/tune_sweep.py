"""GPU sweep of the fused kernel's launch configurations (BLOCK_M, num_warps, and the lane vector
width VEC where it matters): the numbers behind kvfuse.kernels.fused.launch_config. Reuses
kvfuse.bench (workloads, inputs, byte accounting, CUDA-graph timer, copy bandwidth).
Usage: python benchmarks/tune_sweep.py [--out FILE] [--workloads a,b] [--n 1,256,...]"""
import argparse
import json

import torch

from kvfuse import bench
from kvfuse.kernels import qkv
from kvfuse.kernels.fused import force_config, launch_config, next_pow2

WORKLOADS = ("main_fp8", "main_fp4", "flashmla_v32", "flashmla_model1", "index_mxfp4", "index_fp8_fp32",
             "q_pre", "index_q")
SIZES = (1, 256, 65536, 262144)


def configs(name, n, sweep_vec=False):
    """Small n: few rows, several warps; large n: one warp, more rows (earlier sweeps). BLOCK_M 1
    also switches the kernel to its EARLY load order (kvfuse.kernels.fused.fused_args). GQA
    workloads (kvfuse.kernels.qkv; BLOCK_M = tokens of one head a program): every BLOCK_M up to 32
    with 1-8 warps."""
    if bench.WORKLOADS[name].kind == "gqa":
        return [(bm, nw, None) for bm in (1, 2, 4, 8, 16, 32) for nw in (1, 2, 4, 8)]
    vecs = (4, 8) if name == "main_fp8" and sweep_vec else (None,)
    if n <= 512:
        grid = [(bm, nw) for bm in (1, 2) for nw in (1, 2, 4)]
    else:
        grid = [(bm, 1) for bm in (1, 2, 4, 8)] + [(2, 2), (4, 2), (8, 2), (1, 2), (1, 4), (4, 4), (16, 4)]
    return [(bm, nw, v) for bm, nw in grid for v in vecs]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--n", default=",".join(map(str, SIZES)))
    p.add_argument("--vec", action="store_true", help="also sweep VEC (4, 8) for main_fp8")
    p.add_argument("--check", action="store_true", help="compare every config's result with the reference, "
                   "byte for byte (a config that differs is reported and not used)")
    args = p.parse_args()
    copy_gbps = bench.measure_copy_bandwidth()["copy_GBps"]
    timer = bench.CudaTimer()
    rows = []
    print(f"copy bandwidth {copy_gbps / 1e3:.2f} TB/s")
    for name in args.workloads.split(","):
        wl = bench.WORKLOADS[name]
        block_d = next_pow2(wl.head_dim)
        for n in map(int, args.n.split(",")):
            if n * wl.num_heads * wl.head_dim > 1 << 30:
                continue                                   # x over 2 GiB
            inp = bench.build_inputs(wl, n, "cuda")
            call = bench.fused_call(wl, inp)
            want = None
            if args.check:
                ref = bench.build_inputs(wl, n, "cuda")
                with bench.use_backend("reference"):
                    bench.fused_call(wl, ref)()
                want = [t.clone() for t in bench.result_tensors(wl, ref)]
            nbytes = bench.input_bytes(wl, inp)["total"]
            rows_n = n * wl.num_heads
            for bm, nw, vec in configs(name, rows_n, args.vec):
                if bm * block_d > 16384:
                    continue
                with force_config(bm, nw, vec):
                    us = timer.measure([call]).gpu_us
                    diff = None
                    if want is not None:
                        call()
                        torch.cuda.synchronize()
                        diff = sum(int((a.view(torch.uint8) != b.view(torch.uint8)).sum())
                                   for a, b in zip(bench.result_tensors(wl, inp), want))
                        if diff:
                            print(f"  {name} n={n} bm={bm} nw={nw}: {diff} bytes differ", flush=True)
                            continue
                rows.append(dict(workload=name, n=n, bm=bm, nw=nw, vec=vec, us=us, byte_diffs=diff,
                                 pct=100 * nbytes / (us * 1e-6) / (copy_gbps * 1e9)))
            mine = [r for r in rows if r["workload"] == name and r["n"] == n]
            print(f"{name:16s} n={n:7d} " + "  ".join(f"({r['bm']},{r['nw']}) {r['us']:.2f}" for r in mine), flush=True)
            best = min(mine, key=lambda r: r["us"])
            if wl.kind == "gqa":
                dflt = qkv.launch_config(n, block_d, False)
            else:
                dflt = launch_config(rows_n, wl.head_dim, block_d, False,
                                     wl.cast_args.cast_fmt if wl.cast_args else None)
            cur = [r["us"] for r in mine if (r["bm"], r["nw"]) == dflt and r["vec"] in (None, 4)]
            print(f"{name:16s} n={n:7d} best bm={best['bm']} nw={best['nw']} vec={best['vec']} {best['us']:8.2f} us "
                  f"{best['pct']:5.1f}% copy | default {dflt}: {cur[0] if cur else float('nan'):8.2f} us", flush=True)
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(copy_gbps=copy_gbps, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
