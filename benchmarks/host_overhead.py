"""Host cost of one eager call of kvfuse's public entry points, plan cache on vs off.

1. kvfuse's own Python per call (validation, plan, launch arguments), with the Triton launches
   replaced by no-ops: the fused write of kvfuse.bench's workloads (MAIN_FP8 into a paged cache,
   the rope-only Q path into a bf16 out, the indexer-Q (q, sf) path), the (q, sf) path with
   outputs allocated by the call, store_kv_cache and load_paged_kv_cache. Runs on the CPU (the
   "triton" backend through TRITON_INTERPRET=1, which is set here when there is no GPU) or on CUDA
   tensors when a GPU is present.
2. With a GPU: the real eager call (launch included), a loop of calls then one synchronize; with
   the plan cache on, launches go straight to Triton's compiled launcher (kvfuse/kernels/launcher.py)
   unless KVFUSE_DIRECT_LAUNCH=0.
3. --breakdown (GPU): where an eager call's time goes, per fast-path workload (MAIN_FP8, MAIN_FP4,
   FlashMLA V32, INDEX_NVFP4): the public call; kvfuse's DirectLaunch.launch with that call's
   arguments; Triton's CompiledKernel.run alone (the C launcher and the driver); each as a loop of
   calls then one synchronize, and the public call followed by a synchronize each time. The
   workloads take turns round by round, so drifts of a shared host hit all alike.

Median (and min) over batches of calls (time.perf_counter_ns). Run against a kvfuse without the
plan cache (PYTHONPATH=<checkout>) it prints the "cache off" column only. Usage:
    python benchmarks/host_overhead.py [--n 16] [--calls 20] [--batches 200] [--profile main_fp8] [--real-only]
                                       [--breakdown]
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import os
import pstats
import statistics
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the kernel objects depend on it

import kvfuse  # noqa: E402
from kvfuse import bench, formats  # noqa: E402

try:
    from kvfuse.plans import cache as kvplan  # noqa: E402
except ImportError:   # a kvfuse from before kvfuse.plans (PYTHONPATH=<older checkout>), for an A/B
    from kvfuse import plan as kvplan  # noqa: E402


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **kwargs)`` does nothing."""

    def __getitem__(self, grid):
        return _no_launch


def _no_launch(*args, **kwargs):
    return None


@contextlib.contextmanager
def launches_mocked():
    from kvfuse.kernels import qkv
    try:
        from kvfuse.kernels import router, store_load
    except ImportError:   # an older kvfuse: one module held the portable, store and load kernels
        from kvfuse.kernels import fused as router
        store_load = router
    saved = router.fused_kernel, store_load.store_kernel, store_load.load_kernel, qkv.qkv_kernel
    router.fused_kernel = store_load.store_kernel = store_load.load_kernel = qkv.qkv_kernel = _NoLaunch()
    try:
        yield
    finally:
        router.fused_kernel, store_load.store_kernel, store_load.load_kernel, qkv.qkv_kernel = saved


def _direct_launch() -> bool:
    try:
        from kvfuse.kernels import config
    except ImportError:   # an older kvfuse (kvfuse.kernels.fused held the switch)
        from kvfuse.kernels import fused as config
    return config.DIRECT_LAUNCH


@contextlib.contextmanager
def plan_cache(enabled: bool):
    """Turn kvfuse's plan cache on or off (a no-op where kvfuse has none: the "before" numbers)."""
    setter = getattr(kvplan, "set_plan_cache", None)
    if setter is None:
        if enabled:
            raise RuntimeError("this kvfuse has no plan cache")
        yield
        return
    prev = kvplan.plan_cache_enabled()
    setter(enabled)
    try:
        yield
    finally:
        setter(prev)


def calls(n: int, device) -> dict:
    """name -> a zero-argument public call (the exact calls of kvfuse.bench.fused_call, plus the
    (q, sf) path with new outputs and the store / load entry points)."""
    out = {}
    for name in ("main_fp8", "q_pre", "index_q", "llama3_8b_fp8", "qwen3_8b_fp8"):   # the last two: GQA entry
        wl = bench.WORKLOADS[name]
        out[name] = bench.fused_call(wl, bench.build_inputs(wl, n, device))
    wl = bench.WORKLOADS["index_q"]
    inp = bench.build_inputs(wl, n, device)
    rope = kvfuse.RopeArgs(inp.positions, inp.cos_sin, wl.rotary_dim, True)
    cast = wl.cast_args
    out["index_q (new q, sf)"] = lambda: kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(
        inp.x, None, rope, None, cast, None)
    fmt = formats.MAIN_FP8
    wl = bench.WORKLOADS["main_fp8"]
    inp = bench.build_inputs(wl, n, device)
    q, sf = inp.q, inp.sf
    out["store_kv_cache MAIN_FP8"] = lambda: kvfuse.store_kv_cache(q, sf, inp.cache, inp.slots, fmt)
    out["load_paged_kv_cache MAIN_FP8"] = lambda: kvfuse.load_paged_kv_cache(inp.cache, inp.slots, fmt)
    return out


def per_call_us(fn, modes, calls_per_batch: int, batches: int) -> dict:
    """mode -> (median, min) over batches of the mean wall time of one call (us). The modes (plan
    cache off / on) alternate batch by batch, so that drifts of a shared machine hit both alike;
    the garbage collector is off while timing (as in timeit)."""
    times = {mode: [] for mode in modes}
    clock = time.perf_counter_ns
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for b in range(batches + 1):
            for mode in modes:
                with plan_cache(mode):
                    t0 = clock()
                    for _ in range(calls_per_batch):
                        fn()
                    if b:  # the first round warms up
                        times[mode].append((clock() - t0) / calls_per_batch)
    finally:
        if gc_was_enabled:
            gc.enable()
    return {mode: (statistics.median(t) / 1e3, min(t) / 1e3) for mode, t in times.items()}


def per_call_us_cuda(fn, count: int, repeats: int = 5) -> float:
    """Eager wall time per call with the real launches: ``count`` calls, then one synchronize."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(count):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter_ns() - t0) / count)
    return statistics.median(times) / 1e3, min(times) / 1e3


BREAKDOWN_WORKLOADS = ("main_fp8", "main_fp4", "flashmla_v32", "index_nvfp4")


def captured_direct_launch(fn):
    """(DirectLaunch, args) of the one direct launch a call of ``fn`` makes, or None (no direct path)."""
    from kvfuse.kernels import launcher
    seen = []
    original = launcher.DirectLaunch.launch

    def recording(self, args):
        seen.append((self, args))
        return original(self, args)
    fn()                                                   # the first call compiles and sets up the direct path
    launcher.DirectLaunch.launch = recording
    try:
        fn()
    finally:
        launcher.DirectLaunch.launch = original
    return seen[0] if len(seen) == 1 else None


def breakdown(n: int, count: int, rounds: int) -> str:
    """The table of --breakdown (module docstring, 3.)."""
    kinds = ("public call", "DirectLaunch.launch", "CompiledKernel.run", "public call + synchronize")
    calls, info = {}, {}                     # workload -> {kind: zero-argument call}; workload -> launch facts
    for name in BREAKDOWN_WORKLOADS:
        wl = bench.WORKLOADS[name]
        fn = bench.fused_call(wl, bench.build_inputs(wl, n, torch.device("cuda")))
        row = {"public call": fn, "public call + synchronize": lambda fn=fn: (fn(), torch.cuda.synchronize())}
        got = captured_direct_launch(fn)
        if got is not None:
            direct, args = got
            c, all_args = direct.compiled, args + direct.constexprs
            stream = torch.cuda.current_stream().cuda_stream
            row["DirectLaunch.launch"] = lambda direct=direct, args=args: direct.launch(args)
            row["CompiledKernel.run"] = lambda c=c, a=all_args, g=direct.grid, s=stream: c.run(
                *g, s, c.function, c.packed_metadata, None, None, None, *a)
            meta = c.metadata
            info[name] = (f"grid {direct.grid}, {meta.num_warps} warps, shared {meta.shared} B, "
                          f"global scratch {getattr(meta, 'global_scratch_size', '?')} B, "
                          f"regs {getattr(c, 'n_regs', '?')}, spills {getattr(c, 'n_spills', '?')}")
        calls[name] = row

    times = {(w, k): [] for w, row in calls.items() for k in row}
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for r in range(rounds + 1):              # the workloads take turns; round 0 warms up
            for w, row in calls.items():
                for k, f in row.items():
                    torch.cuda.synchronize()
                    t0 = time.perf_counter_ns()
                    for _ in range(count):
                        f()
                    torch.cuda.synchronize()
                    if r:
                        times[(w, k)].append((time.perf_counter_ns() - t0) / count / 1e3)
    finally:
        if gc_was_enabled:
            gc.enable()
    lines = [f"eager host time per call, {torch.cuda.get_device_name()}, n={n}: median (min) us over {rounds} "
             f"rounds of {count} calls", f"{'workload':<14}" + "".join(f"{k:>28}" for k in kinds)]
    for w in calls:
        cells = []
        for k in kinds:
            t = times.get((w, k))
            cells.append(f"{statistics.median(t):19.2f} ({min(t):6.2f})" if t else f"{'-':>28}")
        lines.append(f"{w:<14}" + "".join(cells))
    lines += [f"{w}: {text}" for w, text in info.items()]
    return "\n".join(lines)


def has_cache() -> bool:
    return hasattr(kvplan, "set_plan_cache")


def table(title: str, rows) -> str:
    """rows: (call name, (median, min) cache off, (median, min) cache on or None)."""
    lines = [title + ": median (min)", f"{'call':<32} {'cache off':>16} {'cache on':>16} {'speedup':>8}"]
    for name, off, on in rows:
        on_s = f"{on[0]:8.2f} ({on[1]:5.2f})" if on else f"{'-':>16}"
        sp = f"{off[0] / on[0]:7.1f}x" if on else f"{'-':>8}"
        lines.append(f"{name:<32} {off[0]:8.2f} ({off[1]:5.2f}) {on_s} {sp}")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=16, help="tokens per call")
    p.add_argument("--calls", type=int, default=20, help="calls per timed batch")
    p.add_argument("--batches", type=int, default=200, help="timed batches (the median is reported)")
    p.add_argument("--profile", default=None, help="cProfile 20000 cached calls of this call name")
    p.add_argument("--real-only", action="store_true", help="only the real eager calls (GPU)")
    p.add_argument("--breakdown", action="store_true",
                   help="GPU: public call vs kvfuse's direct launch vs Triton's launcher, per fast path")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if args.breakdown:
        if not cuda:
            print("--breakdown needs a CUDA device; none here")
            return
        with kvfuse.use_backend("triton"):
            print(breakdown(args.n, 200, 30))
        return
    device = torch.device("cuda" if cuda else "cpu")
    fns = calls(args.n, device)
    modes = (False, True) if has_cache() else (False,)

    with kvfuse.use_backend("triton"):
        with launches_mocked() if not args.real_only else contextlib.nullcontext():
            rows = []
            for name, fn in fns.items() if not args.real_only else ():
                us = per_call_us(fn, modes, args.calls, args.batches)
                rows.append((name, us[False], us.get(True)))
            if rows:
                print(table(f"kvfuse host cost per call, launches mocked, {device.type}, n={args.n} (us)", rows))
            if args.profile:
                with plan_cache(has_cache()):
                    fn = fns[args.profile]
                    fn()
                    prof = cProfile.Profile()
                    prof.enable()
                    for _ in range(20000):
                        fn()
                    prof.disable()
                    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        if cuda:
            rows = []
            for name, fn in fns.items():
                us = {}
                for on in modes:
                    with plan_cache(on):
                        us[on] = per_call_us_cuda(fn, 1000)
                rows.append((name, us[False], us.get(True)))
            print()
            direct = "on" if _direct_launch() else "off"
            print(table(f"eager wall time per call, real launches, {torch.cuda.get_device_name()}, "
                        f"n={args.n}, direct launch {direct} (us)", rows))


if __name__ == "__main__":
    main()
