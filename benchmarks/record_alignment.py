"""What MAIN_FP8's 532-byte record costs a write: the same codes and scales written as MAIN_FP8 records
(512 codes + 16 scales + 4 reserved bytes written as zeros: records 4-byte aligned, sectors shared by
neighbours, every byte written), as the same records with the reserved bytes never written (in every
record a 32-byte DRAM sector stays partly written), as 528-byte records (no reserved bytes), as 544-byte
records (16 reserved bytes, never written: every record starts a sector, and its last sector stays half
written) and in FlashInfer's DeepSeek page layout (a page's 512-byte code rows, then its 16-byte scale
rows).

Each format is timed with the cast alone (`main_fp8_cast`) and with the model's whole write (norm +
GPT-J RoPE, `main_fp8_gptj`) on kvfuse.bench's inputs (prefill sequences, paged slots by default),
CUDA-graph replay; % of copy uses kvfuse.bench's compulsory bytes of each call (codes and exact scales:
every layout is charged the same bytes). Only MAIN_FP8 (its reserved bytes written as zeros) has a Gluon
fast path: run once as is and once with KVFUSE_GLUON=0 to compare the layouts on one kernel.

Usage (on the device, repo root):
    python3 benchmarks/record_alignment.py [--n 65536,262144] [--slots paged]
    KVFUSE_GLUON=0 python3 benchmarks/record_alignment.py
    KVFUSE_GLUON=0 ncu --clock-control none --kernel-name fused_kernel --metrics \\
        dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \\
        python3 benchmarks/record_alignment.py --profile --n 262144
        (two untimed calls a variant, for a profiler: the DRAM bytes each layout moves)
"""
import argparse
import dataclasses
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvfuse import bench  # noqa: E402


def variants(names):
    for name in names:
        base = bench.WORKLOADS[name]
        for label, fmt in bench.RECORD_LAYOUTS:
            yield label, dataclasses.replace(base, name=f"{name}[{fmt.name}]", fmt=fmt)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="main_fp8_cast,main_fp8_gptj")
    p.add_argument("--n", default="65536,262144", help="sizes, a comma list")
    p.add_argument("--slots", choices=bench.SLOT_PATTERNS, default="paged")
    p.add_argument("--device", default="cuda", help="cpu: one call per variant, no timing (a smoke run)")
    p.add_argument("--profile", action="store_true", help="two calls a variant, no timing (under a profiler)")
    a = p.parse_args()
    timing = a.device == "cuda" and not a.profile
    if timing:
        copy = bench.measure_copy_bandwidth()["copy_GBps"]
        timer = bench.CudaTimer(graph_calls=20, target_s=0.05, eager_target_s=0.003, max_reps=50)
        print(f"{torch.cuda.get_device_name()}, copy {copy:.0f} GB/s, KVFUSE_GLUON={os.environ.get('KVFUSE_GLUON', '')!r}, "
              f"{a.slots} slots", flush=True)
    for n in (int(v) for v in a.n.split(",")):
        for label, wl in variants(a.workloads.split(",")):
            inp = bench.build_inputs(wl, n, a.device, slots=a.slots)
            call = bench.fused_call(wl, inp)
            call()
            if a.profile:
                call()
                if a.device == "cuda":
                    torch.cuda.synchronize()
            moved = bench.input_bytes(wl, inp)["total"]
            if timing:
                us = timer.measure([call]).gpu_us
                pct = 100 * moved / (us * 1e-6) / (copy * 1e9)
                print(f"{wl.name:34s} n={n:7d} {label:27s} {us:9.2f} us {pct:5.1f}% of copy", flush=True)
            else:
                print(f"{wl.name:34s} n={n:7d} {label:27s} ran, {moved} bytes", flush=True)
            del inp, call
            if timing:
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
