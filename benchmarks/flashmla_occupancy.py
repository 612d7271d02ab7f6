"""GPU A/B of the Gluon FlashMLA path's persistent grid: the CTAs resident per SM it launches with.

The path sizes its grid by the compiled variant's occupancy (kvfuse.kernels.gluon.common.occupancy_grid):
the variant without a norm (NO_NORM, 48 registers a thread for sm_90 with Triton 3.6) fits twice the CTAs
of the normed ones (92-96 registers) and runs slower at n = 65536 (2026-12-03). This times the DeepSeek V3
writes at fixed CTAs per SM (every point byte-checked against the portable kernel), CUDA-graph replay.
Run on the H200 on 2026-12-04: benchmarks/results/2026-12-04_h200_flashmla_occupancy.txt.

  python benchmarks/flashmla_occupancy.py [--workloads a,b] [--n 65536,262144] [--ctas 0,6,8,10,12,16]
(--ctas 0: the occupancy the path computes.) Prints one line per (workload, n).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kvfuse import bench  # noqa: E402
from kvfuse.kernels import router  # noqa: E402
from kvfuse.kernels.gluon import flashmla  # noqa: E402
from tune import differing, pct_of_copy, written_bytes  # noqa: E402


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--workloads", default="dsv3_main_kv_c_k_pe_nonorm,dsv3_main_kv_c_k_pe,dsv3_main_v32")
    p.add_argument("--n", default="65536,262144")
    p.add_argument("--ctas", default="0,6,8,10,12,16")
    a = p.parse_args(argv)
    copy = bench.measure_copy_bandwidth()["copy_GBps"]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy {copy:.0f} GB/s")
    timer = bench.CudaTimer(graph_calls=20, target_s=0.03, eager_target_s=0.003, max_reps=30)
    original = flashmla.occupancy_grid
    for name in a.workloads.split(","):
        wl = bench.WORKLOADS[name]
        for n in (int(v) for v in a.n.split(",")):
            inp = bench.build_inputs(wl, n, "cuda")
            call, outputs = bench.fused_call(wl, inp), bench.result_tensors(wl, inp)
            nbytes = bench.input_bytes(wl, inp)["total"]
            with router.fast_paths(only=()):
                want = written_bytes(call, outputs)
            cells = []
            for ctas in (int(v) for v in a.ctas.split(",")):
                def grid(kernel, known, x, tiles, args, tensors, constexprs, options, ctas_per_sm=None,
                         sm_count=None, _c=ctas):
                    return original(kernel, known, x, tiles, args, tensors, constexprs, options,
                                    _c or ctas_per_sm, sm_count)
                flashmla.occupancy_grid = grid
                try:
                    with router.fast_paths(only=flashmla, min_rows=1) as choice:
                        got = written_bytes(call, outputs)
                        if choice.fast_calls == 0 or differing(got, want):
                            cells.append(f"{ctas or 'auto'}: NOT TAKEN OR DIFFERS")
                            continue
                        us = timer.measure([call]).gpu_us
                    cells.append(f"{ctas or 'auto'}: {us:.2f} us ({pct_of_copy(nbytes, us, copy):.1f}%)")
                finally:
                    flashmla.occupancy_grid = original
            print(f"{name:28s} n={n:7d} | " + " | ".join(cells), flush=True)
            del inp, call, outputs, want
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
