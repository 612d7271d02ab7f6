"""GPU sweep of the Gluon fast paths' launch tables: (num_warps, rows per warp or per thread,
pipeline) per workload and n, timed through the public call (CUDA-graph replay, kvfuse.bench's
timer, inputs and byte accounting). The numbers behind each module's ``launch_table``.

Every variant runs through kvfuse's own dispatch: the module's ``launch_table`` is replaced by one
returning the variant, its MIN_ROWS set to 1 (decode sizes too), the plan cache cleared. Before
timing, each (workload, n) checks that the fast path's cache bytes equal the plain kernel's on the
timing inputs (whole storage); a mismatch is reported and that point is not timed.

Usage (on the device, repo root): python benchmarks/gluon_tune.py [--out DIR] [--workloads a,b]
[--n 1,256,...] [--budget-s S] [--set gluon_index.PACKED_E2M1=0 ...] (a kernel module's switch, set
before anything runs: an A/B of a kernel variant in one run)
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gluon_check_common as common  # noqa: E402
from kvfuse import bench  # noqa: E402
from kvfuse.kernels import gluon_index, gluon_main_fp4, gluon_main_fp8, gluon_mla_tail  # noqa: E402

MODULES = {"main_fp8": gluon_main_fp8, "main_fp8_cast": gluon_main_fp8, "main_fp4": gluon_main_fp4, "flashmla_v32": gluon_mla_tail,
           "flashmla_model1": gluon_mla_tail, "index_fp8_fp32": gluon_index, "index_mxfp4": gluon_index,
           "index_nvfp4": gluon_index, "index_q": gluon_index}
SIZES = (1, 256, 4096, 65536, 262144)


def variants(n: int, rows=(1, 2)):
    """Decode sizes: 1/2/4 warps of 1 or 2 rows, no pipeline (one tile per CTA); larger n: every
    warps x rows x pipeline mix."""
    if n <= 512:
        return [(nw, r, False) for nw in (1, 2, 4) for r in (1, 2) if r == 1 or n > 1]
    return [(nw, r, p) for nw in (1, 2, 4) for r in rows for p in (False, True)]


def route(module, table) -> None:
    """Send eligible calls to ``module`` with launch table ``table`` (None: the plain kernel)."""
    if table is not None:
        module.launch_table = table
    common.fast_path(module, table is not None)       # at every size; clears the plan cache


def written_bytes(call, inp) -> torch.Tensor:
    """What one call writes (the cache, or the contiguous q and sf), poisoned first with fixed random bytes."""
    outs = [inp.cache] if inp.cache is not None else [inp.q, inp.sf]
    g = torch.Generator(device=inp.x.device).manual_seed(1)
    for t in outs:
        b = t.view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, device=b.device, generator=g))
    call()
    torch.cuda.synchronize()
    return torch.cat([t.view(torch.uint8).flatten() for t in outs])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--workloads", default=",".join(MODULES))
    p.add_argument("--n", default=",".join(map(str, SIZES)))
    p.add_argument("--rows", default="1,2", help="rows per warp (per thread for the index kernel) to try")
    p.add_argument("--budget-s", type=float, default=400.0, help="no new point starts after this")
    p.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=INT",
                   help="set a kernel module's switch (an int) before the sweep")
    args = p.parse_args()
    for assignment in args.set:
        target, value = assignment.split("=")
        module_name, attr = target.split(".")
        module = {m.__name__.rsplit(".", 1)[-1]: m for m in MODULES.values()}[module_name]
        if not hasattr(module, attr):
            raise SystemExit(f"--set: {module_name} has no {attr}")
        setattr(module, attr, type(getattr(module, attr))(int(value)))
    t0 = time.perf_counter()
    copy_gbps = bench.measure_copy_bandwidth()["copy_GBps"]
    timer = bench.CudaTimer(graph_calls=20, target_s=0.03, eager_target_s=0.003, max_reps=30)
    originals = {m: m.launch_table for m in set(MODULES.values())}
    rows, lines = [], [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy {copy_gbps:.0f} GB/s"
                       + (f", set {' '.join(args.set)}" if args.set else "")]
    print(lines[0], flush=True)
    for name in args.workloads.split(","):
        module, wl = MODULES[name], bench.WORKLOADS[name]
        for n in map(int, args.n.split(",")):
            if time.perf_counter() - t0 > args.budget_s:
                lines.append(f"{name} n={n}: skipped (time budget)")
                continue
            inp = bench.build_inputs(wl, n, "cuda")
            call = bench.fused_call(wl, inp)
            nbytes = bench.input_bytes(wl, inp)["total"]
            route(module, None)
            plain = written_bytes(call, inp)
            plain_us = timer.measure([call]).gpu_us
            rows_n = n * wl.num_heads                     # the launch tables count (token, head) rows
            default = originals[module](rows_n)
            point = []
            for v in variants(rows_n, tuple(map(int, args.rows.split(",")))):
                route(module, lambda _n, v=v: v)
                got = written_bytes(call, inp)
                if not torch.equal(got, plain):
                    diff = int((got != plain).sum())
                    lines.append(f"{name} n={n} {v}: MISMATCH ({diff} bytes differ from the plain kernel)")
                    print(lines[-1], flush=True)
                    continue
                us = timer.measure([call]).gpu_us
                point.append(dict(workload=name, n=n, nw=v[0], rows=v[1], pipeline=v[2], us=us,
                                  pct=100 * nbytes / (us * 1e-6) / (copy_gbps * 1e9), default=v == default))
            route(module, originals[module])
            rows += point
            if point:
                best = min(point, key=lambda r: r["us"])
                cur = [r["us"] for r in point if r["default"]]
                ranked = " ".join(f"{r['nw']}/{r['rows']}/{int(r['pipeline'])}:{r['us']:.2f}"
                                  for r in sorted(point, key=lambda r: r["us"])[:5])
                lines.append(f"{name:16s} n={n:7d} plain {plain_us:8.2f} | default {default}: "
                             f"{cur[0] if cur else float('nan'):8.2f} us | best {best['nw']}/{best['rows']}/"
                             f"{int(best['pipeline'])} {best['us']:8.2f} us {best['pct']:5.1f}% | top {ranked}")
                print(lines[-1], flush=True)
            del inp, call, plain
            torch.cuda.empty_cache()
    for m, t in originals.items():
        m.launch_table = t
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gluon_tune.json"), "w") as f:
        json.dump(dict(copy_gbps=copy_gbps, rows=rows, lines=lines), f, indent=1)
    with open(os.path.join(args.out, "gluon_tune.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
