"""Calls of kvfuse's fused write on kvfuse.bench's inputs, for Nsight Compute or a slot-pattern timing.

--slots: kvfuse.bench.token_layout's patterns (paged: each sequence's tokens in its own blocks, random:
every record scattered, contiguous) on the bench's default inputs (decode for n <= 256, else prefill);
--time times all three, to tell what the scattered records cost against what the kernel costs.

Usage (on the device, repo root):
    ncu --clock-control none --kernel-name regex:"main_fp8_kernel|mla_tail_kernel|index_write_kernel" \\
        --launch-skip 1 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables \\
        python3 benchmarks/ncu_probe.py --workloads main_fp8 --n 262144 [--slots contiguous]
    python3 benchmarks/ncu_probe.py --workloads main_fp8,flashmla_v32 --n 262144 --time
        (CUDA-graph GPU time and % of copy bandwidth per slot pattern)
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvfuse import bench  # noqa: E402


def inputs(name: str, n: int, slots: str):
    wl = bench.WORKLOADS[name]
    return wl, bench.build_inputs(wl, n, "cuda", slots=slots)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="main_fp8")
    p.add_argument("--n", default="262144", help="sizes, a comma list")
    p.add_argument("--calls", type=int, default=2)
    p.add_argument("--slots", choices=bench.SLOT_PATTERNS, default="random")
    p.add_argument("--time", action="store_true", help="time both slot patterns instead (no profiler)")
    a = p.parse_args()
    if a.time:
        copy = bench.measure_copy_bandwidth()["copy_GBps"]
        timer = bench.CudaTimer(graph_calls=20, target_s=0.05, eager_target_s=0.003, max_reps=50)
        print(f"{torch.cuda.get_device_name()}, copy {copy:.0f} GB/s", flush=True)
    for name, n in ((w, int(n)) for w in a.workloads.split(",") for n in a.n.split(",")):
        for slots in (bench.SLOT_PATTERNS if a.time else (a.slots,)):
            wl, inp = inputs(name, n, slots)
            call = bench.fused_call(wl, inp)
            for _ in range(a.calls):
                call()
            torch.cuda.synchronize()
            if a.time:
                us = timer.measure([call]).gpu_us
                pct = 100 * bench.input_bytes(wl, inp)["total"] / (us * 1e-6) / (copy * 1e9)
                print(f"{name:16s} n={n:7d} slots {slots:10s} {us:9.2f} us {pct:5.1f}% of copy", flush=True)
            else:
                print(f"{name} n={n} slots {slots}: {a.calls} calls", flush=True)
            del inp, call
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
