"""GPU sweep of launch configurations, timed through the public call (CUDA-graph replay, kvfuse.bench's
timer, inputs and byte accounting): the numbers behind the launch tables. Every configuration is
checked byte for byte before it is timed; one that differs (or, for a fast path, that the fast path
did not take) is reported and not timed.

  --kernel portable  the portable kernel's (BLOCK_M, num_warps; VEC too with --vec) through
                     kvfuse.kernels.config.force_config, and the GQA kernel's (kvfuse.kernels.qkv): behind
                     portable.plain_launch_table and qkv.launch_table. Checked against the reference backend.
  --kernel fast      each Gluon fast path's (num_warps, rows per warp or per thread, pipeline) through
                     kvfuse.kernels.router.fast_paths(only=module, min_rows=1, launch_table=...): behind each
                     module's launch_table, with the portable kernel's time and the module's own table's
                     beside them. Checked against the portable kernel.
  --kernel all       both (the default).

Usage (on the device, repo root):
  python benchmarks/tune.py [--kernel portable|fast|all] [--out DIR] [--workloads a,b] [--n 1,256,...]
      [--budget-s S] [--vec] [--gqa-grid 4x2x1,...] [--rows 1,2] [--set indexer.PACKED_E2M1=0 ...]
--workloads and --n default to each sweep's own lists; --set assigns a fast-path module's integer
switch before anything runs (an A/B of a kernel variant in one device call: one run per setting). Writes DIR/tune.json (the
device, copy bandwidth, every timed configuration and the text) and DIR/tune.txt (the text).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvfuse import bench, use_backend  # noqa: E402
from kvfuse.kernels import config, portable, qkv, router  # noqa: E402
from kvfuse.kernels.router import FAST_PATH_MODULES  # noqa: E402

PORTABLE_WORKLOADS = ("main_fp8", "main_fp4", "flashmla_v32", "flashmla_model1", "index_mxfp4", "index_fp8_fp32",
                      "q_pre", "index_q")
PORTABLE_SIZES = (1, 256, 65536, 262144)
# the workloads swept with --kernel fast, each with the fast path that writes its format (its FORMATS)
FAST_DEFAULT = ("main_fp8", "main_fp8_cast", "main_fp4", "flashmla_v32", "flashmla_model1", "index_fp8_fp32",
                "index_mxfp4", "index_nvfp4", "index_q")


def fast_module(name: str):
    """The fast path whose FORMATS hold the workload's cache format (a model's write workload too:
    dsv32_index_k's INDEX_FP8_FP32, say), or None."""
    fmt = bench.WORKLOADS[name].fmt
    return next((m for m in FAST_PATH_MODULES if fmt is not None and fmt in m.FORMATS), None)


FAST_WORKLOADS = {name: module for name in bench.WORKLOADS if (module := fast_module(name)) is not None}
FAST_SIZES = (1, 256, 4096, 65536, 262144)
MAX_X_ELEMENTS = 1 << 30                 # larger inputs (x over 2 GiB) are left out


class Log:
    """The text report: each line printed as it comes and kept for tune.txt."""

    def __init__(self):
        self.lines = []

    def __call__(self, line: str) -> None:
        print(line, flush=True)
        self.lines.append(line)


# ------------------------------------------------------------------------------------ checks
def poison(tensors, seed: int = 1) -> None:
    """Fill the outputs with fixed random bytes, so a configuration that skips a byte cannot pass on
    what an earlier one wrote."""
    g = torch.Generator(device=tensors[0].device).manual_seed(seed)
    for t in tensors:
        b = t.view(torch.uint8)
        b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, device=b.device, generator=g))


def written_bytes(call, outputs) -> torch.Tensor:
    """Every byte of ``outputs`` after one call from the poison, flat."""
    poison(outputs)
    call()
    torch.cuda.synchronize()
    return torch.cat([t.view(torch.uint8).flatten() for t in outputs])


def differing(a: torch.Tensor, b: torch.Tensor) -> int:
    return 0 if torch.equal(a, b) else int((a != b).sum())


def pct_of_copy(nbytes: int, us: float, copy_gbps: float) -> float:
    return 100 * nbytes / (us * 1e-6) / (copy_gbps * 1e9)


# ------------------------------------------------------------------------------------ portable kernel
def portable_configs(name: str, rows: int, sweep_vec: bool, gqa_grid=None):
    """Small n: few rows, several warps; large n: one warp, more rows (earlier sweeps). BLOCK_M 1 also
    switches the kernel to its EARLY load order (kvfuse.kernels.portable.fused_args). GQA workloads
    (kvfuse.kernels.qkv; BLOCK_M tokens of G heads a program): BLOCK_M 1-8 x G 1-8 x 1-2 warps.
    (bm, nw, vec, heads): None where the kernel has no such choice. ``gqa_grid``: (bm, g, nw) triples
    instead of the GQA grid (--gqa-grid)."""
    if bench.WORKLOADS[name].kind == "gqa":
        if gqa_grid:
            return [(bm, nw, None, g) for bm, g, nw in gqa_grid]
        return [(bm, nw, None, g) for bm in (1, 2, 4, 8) for g in (1, 2, 4, 8) for nw in (1, 2)]
    vecs = (4, 8) if name == "main_fp8" and sweep_vec else (None,)
    if rows <= 512:
        grid = [(bm, nw) for bm in (1, 2) for nw in (1, 2, 4)]
    else:
        grid = [(bm, 1) for bm in (1, 2, 4, 8)] + [(2, 2), (4, 2), (8, 2), (1, 2), (1, 4), (4, 4), (16, 4)]
    return [(bm, nw, v, None) for bm, nw in grid for v in vecs]


def sweep_portable(names, sizes, sweep_vec, copy_gbps, deadline, log, rows, gqa_grid=None):
    timer = bench.CudaTimer()
    for name in names:
        wl = bench.WORKLOADS[name]
        block_d = config.next_pow2(wl.head_dim)
        for n in sizes:
            if n * wl.num_heads * wl.head_dim > MAX_X_ELEMENTS:
                log(f"{name} n={n}: skipped (x over 2 GiB)")
                continue
            if time.perf_counter() > deadline:
                log(f"{name} n={n}: skipped (time budget)")
                continue
            try:
                inp = bench.build_inputs(wl, n, "cuda")
                call, outputs = bench.fused_call(wl, inp), bench.result_tensors(wl, inp)
                with use_backend("reference"):
                    want = written_bytes(call, outputs)
                nbytes = bench.input_bytes(wl, inp)["total"]
                rows_n = n * wl.num_heads
                mine = []
                for bm, nw, vec, g in portable_configs(name, rows_n, sweep_vec, gqa_grid):
                    if bm * block_d > 16384:
                        continue
                    with config.force_config(bm, nw, vec, g):
                        diff = differing(written_bytes(call, outputs), want)
                        if diff:
                            log(f"  {name} n={n} bm={bm} nw={nw} vec={vec} g={g}: {diff} bytes differ from the "
                                f"reference")
                            continue
                        us = timer.measure([call]).gpu_us
                    mine.append(dict(workload=name, n=n, bm=bm, nw=nw, vec=vec, g=g, us=us, byte_diffs=0,
                                     pct=pct_of_copy(nbytes, us, copy_gbps)))
                rows += mine
                log(f"{name:16s} n={n:7d} " + "  ".join(
                    f"({r['bm']},{r['nw']}{'' if r['g'] is None else ',g' + str(r['g'])}) {r['us']:.2f}" for r in mine))
                if mine:
                    best = min(mine, key=lambda r: r["us"])
                    if wl.kind == "gqa":
                        bm0, g0, nw0 = qkv.launch_config(n, block_d, max(wl.gqa.num_heads, wl.gqa.num_kv_heads),
                                                         interpret=False)
                        dflt = (bm0, nw0, g0)
                    else:
                        dflt = portable.launch_config(rows_n, wl.head_dim, block_d, False,
                                                   wl.cast_args.cast_fmt if wl.cast_args else None) + (None,)
                    cur = [r["us"] for r in mine if (r["bm"], r["nw"], r["g"]) == dflt and r["vec"] in (None, 4)]
                    log(f"{name:16s} n={n:7d} best bm={best['bm']} nw={best['nw']} vec={best['vec']} g={best['g']} "
                        f"{best['us']:8.2f} us {best['pct']:5.1f}% copy | default {dflt}: "
                        f"{cur[0] if cur else float('nan'):8.2f} us")
                del inp, call, outputs, want
            except Exception as e:
                log(f"{name} n={n}: ERROR {type(e).__name__}: {e}".replace("\n", " ")[:400])
                bench.recover_cuda()
            torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------ fast paths
def fast_variants(rows: int, rows_per=(1, 2)):
    """Decode sizes: 1/2/4 warps of 1 or 2 rows, no pipeline (one tile per CTA); larger n: every
    warps x rows x pipeline mix."""
    if rows <= 512:
        return [(nw, r, False) for nw in (1, 2, 4) for r in (1, 2) if r == 1 or rows > 1]
    return [(nw, r, p) for nw in (1, 2, 4) for r in rows_per for p in (False, True)]


def checked_time(timer, call, outputs, want, route: dict):
    """(GPU us, None) of ``call`` routed by router.fast_paths(**route) once its bytes equal ``want`` and, for
    a fast path, it ran; else (None, why not)."""
    with router.fast_paths(**route) as choice:
        got = written_bytes(call, outputs)
        if route.get("only") != () and choice.fast_calls == 0:
            return None, "FAST PATH NOT TAKEN"
        diff = differing(got, want)
        if diff:
            return None, f"MISMATCH ({diff} bytes differ from the portable kernel)"
        return timer.measure([call]).gpu_us, None


def sweep_fast(names, sizes, rows_per, copy_gbps, deadline, log, rows, points):
    timer = bench.CudaTimer(graph_calls=20, target_s=0.03, eager_target_s=0.003, max_reps=30)
    for name in names:
        module, wl = FAST_WORKLOADS[name], bench.WORKLOADS[name]
        for n in sizes:
            if time.perf_counter() > deadline:
                log(f"{name} n={n}: skipped (time budget)")
                continue
            try:
                inp = bench.build_inputs(wl, n, "cuda")
                call, outputs = bench.fused_call(wl, inp), bench.result_tensors(wl, inp)
                nbytes = bench.input_bytes(wl, inp)["total"]
                with router.fast_paths(only=()):
                    plain = written_bytes(call, outputs)
                plain_us, _ = checked_time(timer, call, outputs, plain, dict(only=()))
                rows_n = n * wl.num_heads                     # the launch tables count (token, head) rows
                default = module.launch_table(rows_n)
                table_us, why = checked_time(timer, call, outputs, plain, dict(only=module, min_rows=1))
                if why:
                    log(f"{name} n={n} own table {default}: {why}")
                point = []
                for v in fast_variants(rows_n, rows_per):
                    us, why = checked_time(timer, call, outputs, plain,
                                           dict(only=module, min_rows=1, launch_table=lambda _n, v=v: v))
                    if why:
                        log(f"{name} n={n} {v}: {why}")
                        continue
                    point.append(dict(workload=name, n=n, nw=v[0], rows=v[1], pipeline=v[2], us=us,
                                      pct=pct_of_copy(nbytes, us, copy_gbps), default=v == default))
                rows += point
                points.append(dict(workload=name, n=n, module=module.__name__, plain_us=plain_us, table=default,
                                   table_us=table_us, speedup=plain_us / table_us if plain_us and table_us else None))
                if point:
                    best = min(point, key=lambda r: r["us"])
                    ranked = " ".join(f"{r['nw']}/{r['rows']}/{int(r['pipeline'])}:{r['us']:.2f}"
                                      for r in sorted(point, key=lambda r: r["us"])[:5])
                    own = f"{table_us:8.2f} us (x{plain_us / table_us:.2f})" if plain_us and table_us else "-"
                    log(f"{name:16s} n={n:7d} plain {plain_us or float('nan'):8.2f} | default {default}: {own} | best "
                        f"{best['nw']}/{best['rows']}/{int(best['pipeline'])} {best['us']:8.2f} us {best['pct']:5.1f}% "
                        f"| top {ranked}")
                del inp, call, outputs, plain
            except Exception as e:
                log(f"{name} n={n}: ERROR {type(e).__name__}: {e}".replace("\n", " ")[:400])
                bench.recover_cuda()
            torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------ command line
def csv(text: str):
    return [v for v in text.split(",") if v]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kernel", choices=("portable", "fast", "all"), default="all")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="where tune.json and tune.txt go")
    p.add_argument("--workloads", default="", help="comma list (default: each sweep's own)")
    p.add_argument("--n", default="", help="comma list of token counts (default: each sweep's own)")
    p.add_argument("--budget-s", type=float, default=400.0, help="no new (workload, n) point starts after this")
    p.add_argument("--vec", action="store_true", help="portable: also sweep VEC (4, 8) for main_fp8")
    p.add_argument("--gqa-grid", default="", metavar="BMxGxW,...",
                   help="portable: the GQA configurations to try (tokens x heads x warps a program), instead of "
                        "BLOCK_M 1-8 x G 1-8 x 1-2 warps")
    p.add_argument("--rows", default="1,2", help="fast: rows per warp (per thread for the index kernel) to try")
    p.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=INT",
                   help="fast: set a fast-path module's integer switch before the sweep")
    a = p.parse_args(argv)
    try:
        a.n = [int(v) for v in csv(a.n)]
        a.rows = tuple(int(v) for v in csv(a.rows))
        a.gqa_grid = [tuple(int(v) for v in t.split("x")) for t in csv(a.gqa_grid)]
    except ValueError as e:
        p.error(f"--n, --rows and --gqa-grid take comma lists of integers ({e})")
    if any(len(t) != 3 or min(t) < 1 for t in a.gqa_grid):
        p.error(f"--gqa-grid: expected BMxGxW triples of positive integers, got {a.gqa_grid}")
    if any(v < 1 for v in a.n + list(a.rows)):
        p.error("--n and --rows take positive integers")
    names = csv(a.workloads)
    unknown = [w for w in names if w not in bench.WORKLOADS]
    if unknown:
        p.error(f"unknown workloads {unknown}; kvfuse.bench.WORKLOADS has {sorted(bench.WORKLOADS)}")
    if a.kernel == "fast" and any(w not in FAST_WORKLOADS for w in names):
        p.error(f"--kernel fast sweeps {sorted(FAST_WORKLOADS)}; no fast path for "
                f"{[w for w in names if w not in FAST_WORKLOADS]}")
    a.portable = (names or list(PORTABLE_WORKLOADS)) if a.kernel in ("portable", "all") else []
    a.fast = ([w for w in names if w in FAST_WORKLOADS] if names else list(FAST_DEFAULT)) \
        if a.kernel in ("fast", "all") else []
    modules = {m.__name__.rsplit(".", 1)[1]: m for m in router.FAST_PATH_MODULES}
    a.switches = []
    for assignment in a.set:
        target, _, value = assignment.partition("=")
        module_name, _, attr = target.partition(".")
        switch = getattr(modules.get(module_name), attr, None)
        if not isinstance(switch, int) or not value.lstrip("-").isdigit():
            p.error(f"--set {assignment!r}: expected MODULE.NAME=INT with MODULE one of {sorted(modules)} "
                    f"and NAME one of its integer (or bool) switches")
        a.switches.append((modules[module_name], attr, int(value)))
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/tune.py needs a CUDA device: nothing to time")
        return 0
    for module, attr, value in a.switches:           # a kernel variant's switch, for this process
        setattr(module, attr, type(getattr(module, attr))(value))
    t0 = time.perf_counter()
    log = Log()
    copy_gbps = bench.measure_copy_bandwidth()["copy_GBps"]
    log(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, copy {copy_gbps:.0f} GB/s"
        + (f", set {' '.join(a.set)}" if a.set else ""))
    portable, fast, points = [], [], []
    deadline = t0 + a.budget_s
    if a.portable:
        sweep_portable(a.portable, a.n or PORTABLE_SIZES, a.vec, copy_gbps, deadline, log, portable, a.gqa_grid)
    if a.fast:
        sweep_fast(a.fast, a.n or FAST_SIZES, a.rows, copy_gbps, deadline, log, fast, points)
    os.makedirs(a.out, exist_ok=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(), argv=sys.argv if argv is None else list(argv))
    with open(os.path.join(a.out, "tune.json"), "w") as f:
        json.dump(dict(meta=meta, copy_gbps=copy_gbps, portable=portable, fast=fast, fast_points=points,
                       lines=log.lines), f, indent=1)
    with open(os.path.join(a.out, "tune.txt"), "w") as f:
        f.write("\n".join(log.lines) + "\n")
    print(f"wrote {os.path.join(a.out, 'tune.json')} and tune.txt")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
