"""GPU sweep of the fused kernel's launch configurations (BLOCK_M, num_warps): the numbers behind
kvfuse.kernels.fused.launch_config. Reuses kvfuse.bench (workloads, inputs, byte accounting,
CUDA-graph timer, copy bandwidth). Usage: python benchmarks/tune_sweep.py [--out FILE]"""
import argparse
import json

import torch

from kvfuse import bench
from kvfuse.kernels.fused import force_config, launch_config, next_pow2

WORKLOADS = ("main_fp8", "index_mxfp4", "flashmla_v32")
SIZES = (1, 256, 4096, 65536, 262144)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    args = p.parse_args()
    copy_gbps = bench.measure_copy_bandwidth()["copy_GBps"]
    timer = bench.CudaTimer()
    rows = []
    print(f"copy bandwidth {copy_gbps / 1e3:.2f} TB/s")
    for name in WORKLOADS:
        wl = bench.WORKLOADS[name]
        block_d = next_pow2(wl.head_dim)
        for n in SIZES:
            call = bench.fused_call(wl, bench.build_inputs(wl, n, "cuda"))
            nbytes = bench.moved_bytes(wl, n)["total"]
            for bm in (1, 2, 4, 8, 16):
                for nw in (1, 2, 4, 8):
                    if bm * block_d > 16384:
                        continue
                    with force_config(bm, nw):
                        us = timer.measure([call]).gpu_us
                    rows.append(dict(workload=name, n=n, bm=bm, nw=nw, us=us,
                                     pct=100 * nbytes / (us * 1e-6) / (copy_gbps * 1e9)))
            mine = [r for r in rows if r["workload"] == name and r["n"] == n]
            best = min(mine, key=lambda r: r["us"])
            dflt = launch_config(n, wl.head_dim, block_d, False)
            cur = [r["us"] for r in mine if (r["bm"], r["nw"]) == dflt]
            print(f"{name:16s} n={n:7d} best bm={best['bm']} nw={best['nw']} {best['us']:8.2f} us "
                  f"{best['pct']:5.1f}% copy | default {dflt}: {cur[0] if cur else float('nan'):8.2f} us")
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(copy_gbps=copy_gbps, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
