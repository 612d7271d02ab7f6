"""Host time of one eager call on a GPU, beside its GPU time: kvfuse's entry points and the engines' adapters.

For each call (n tokens, default 1), with the plan cache on (kvfuse's default) and off:

- "host us": the wall time of the call itself (time.perf_counter_ns around it, no synchronize), median
  over single calls taken between short pauses in which the GPU drains, so the launch queue is never
  full: what an engine running the layer eagerly pays on the host per call, the launch included;
- "loop us": a loop of calls then one synchronize, per call (max(host, GPU) per call);
- "GPU us": CUDA-graph replay of the same call, per call (``kvfuse.bench``'s timer: 20 calls in one graph;
  one graph launch per call would measure the graph launches).

Calls: two floors (torch's add_ on one element, a one-program Triton kernel: what a launch costs on this
host), kvfuse's fused entry (``kvfuse.bench`` workloads: DeepSeek V4 MAIN_FP8, V3 (kv_c, k_pe), the V3.2
indexer K, their argument objects built once), the same three writes through ``kvfuse.mla``
(``write_main_cache``, ``write_indexer_k``: what a model calls), the GQA entry (Llama 3 8B / Qwen3 8B with fp8 caches), and the adapters
``kvfuse.engines.vllm.reshape_and_cache_flash`` (fp8), ``concat_and_cache_mla`` (fp8_ds_mla),
``fused_qk_norm_rope`` and ``kvfuse.engines.flashinfer.rope_quantize_fp8_append_paged_kv_cache``.
Needs a GPU, except ``--cpu``: kvfuse's Python per call on this machine's CPU (CPU tensors, the "triton"
backend through TRITON_INTERPRET=1, every Triton kernel replaced by one whose compiled launcher is a no-op,
which kvfuse's direct launch then calls as on the GPU), the plan cache on: the host time above Triton's C
launcher, median of single calls. Usage:
    python benchmarks/eager_host_time.py [--n 1] [--samples 400] [--json OUT.json]
    python benchmarks/eager_host_time.py --cpu [--n 1] [--samples 20000] [--profile NAME]
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import time

if "--cpu" in sys.argv[1:]:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: the kernel objects depend on it

import torch  # noqa: E402

import kvfuse  # noqa: E402
from kvfuse import bench  # noqa: E402
from kvfuse.bench.timing import CudaTimer  # noqa: E402
from kvfuse.engines import flashinfer as fi  # noqa: E402
from kvfuse.engines import vllm  # noqa: E402

WORKLOADS = ("dsv4_main_fp8", "dsv3_main_kv_c_k_pe", "dsv32_index_k", "llama3_8b_fp8", "qwen3_8b_fp8")


def _workload_call(name: str, n: int, dev: torch.device):
    wl = bench.WORKLOADS[name]
    return bench.fused_call(wl, bench.build_inputs(wl, n, dev))


def _mla_writes(n: int, dev: torch.device) -> dict:
    """kvfuse.mla's writes of the three MLA workloads, on the workloads' inputs: the argument objects built
    by each call (found in the plan cache from the raw arguments)."""
    from kvfuse import mla, models
    v4 = bench.build_inputs(bench.WORKLOADS["dsv4_main_fp8"], n, dev)
    v3 = bench.build_inputs(bench.WORKLOADS["dsv3_main_kv_c_k_pe"], n, dev)
    kv_c_k_pe = (v3.x[:, :512], v3.x[:, 512:])
    v32 = bench.build_inputs(bench.WORKLOADS["dsv32_index_k"], n, dev)
    return {
        "kvfuse.mla.write_main_cache (V4, MAIN_FP8)":
            lambda: mla.write_main_cache(models.DEEPSEEK_V4, v4.x, v4.positions, v4.cos_sin, v4.weight, v4.cache,
                                         v4.slots),
        "kvfuse.mla.write_main_cache (V3, (kv_c, k_pe))":
            lambda: mla.write_main_cache(models.DEEPSEEK_V3, kv_c_k_pe, v3.positions, v3.cos_sin, v3.weight,
                                         v3.cache, v3.slots),
        "kvfuse.mla.write_indexer_k (V3.2)":
            lambda: mla.write_indexer_k(models.DEEPSEEK_V32, v32.x, v32.positions, v32.cos_sin, v32.weight,
                                        v32.cache, v32.slots, v32.bias),
    }


def _adapters(n: int, dev: torch.device) -> dict:
    g = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=dev, dtype=torch.float32, generator=g).to(dtype)

    blocks, bs, hkv, hq, d = 64, 16, 8, 32, 128
    slots = torch.randperm(blocks * bs, device=dev, generator=g)[:n].to(torch.int64)
    k, v = randn(n, hkv, d), randn(n, hkv, d)
    kc = torch.empty(blocks, bs, hkv, d, device=dev, dtype=torch.uint8)
    vc = torch.empty_like(kc)
    one = torch.ones((), device=dev, dtype=torch.float32)
    kv_c, k_pe = randn(n, 512), randn(n, 64)
    mla_cache = torch.empty(blocks, 64, 656, device=dev, dtype=torch.uint8)
    qkv = randn(n, (hq + 2 * hkv) * d)
    wq, wk = randn(d), randn(d)
    cos_sin = randn(4096, d, dtype=torch.float32)
    cos_sin_64 = cos_sin[:, :64].contiguous()
    pos = torch.randint(0, 4096, (n,), device=dev, generator=g)
    # FlashInfer: one request per token, one page each
    q_rope, q_nope = randn(n, hq, 64), randn(n, hq, 64)
    k_rope, k_nope = k[..., :64].contiguous(), k[..., 64:].contiguous()
    fkc = torch.empty(blocks, bs, hkv, d, device=dev, dtype=torch.float8_e4m3fn)
    fvc = torch.empty_like(fkc)
    kv_indices = torch.randperm(blocks, device=dev, generator=g)[:n].to(torch.int32)
    kv_indptr = torch.arange(n + 1, device=dev, dtype=torch.int32)
    batch_indices = torch.arange(n, device=dev, dtype=torch.int32)
    positions = torch.zeros(n, device=dev, dtype=torch.int32)
    q_rope_out = torch.empty(n, hq, 64, device=dev, dtype=torch.float8_e4m3fn)
    q_nope_out = torch.empty_like(q_rope_out)
    return {
        "vllm.reshape_and_cache_flash (fp8, Llama 3 8B heads)":
            lambda: vllm.reshape_and_cache_flash(k, v, kc, vc, slots, "fp8", one, one),
        "vllm.concat_and_cache_mla (fp8_ds_mla)":
            lambda: vllm.concat_and_cache_mla(kv_c, k_pe, mla_cache, slots, "fp8_ds_mla", one),
        "vllm.fused_qk_norm_rope (Qwen3 8B heads)":
            lambda: vllm.fused_qk_norm_rope(qkv, hq, hkv, hkv, d, 1e-6, wq, wk, cos_sin, True, pos),
        "flashinfer.rope_quantize_fp8_append_paged_kv_cache (GQA)":
            lambda: fi.rope_quantize_fp8_append_paged_kv_cache(
                q_rope, k_rope, q_nope, k_nope, v, cos_sin_64, pos, (fkc, fvc), kv_indices, kv_indptr, batch_indices,
                positions, is_neox=True, quantize_dtype=torch.float8_e4m3fn, page_size=bs,
                q_rope_out=q_rope_out, q_nope_out=q_nope_out),
    }


def _floors(dev: torch.device) -> dict:
    """What any launch costs on this host: torch's own add_ on one element, and a one-program Triton kernel
    (kvfuse.bench's launch-floor kernel) launched through Triton's launcher."""
    from kvfuse.bench.timing import _tiny_kernel
    buf = torch.zeros(1, dtype=torch.int32, device=dev)
    return {"floor: torch add_ (one element)": lambda: buf.add_(1),
            "floor: a one-program Triton kernel": lambda: _tiny_kernel[(1,)](buf)}


def host_us(fn, samples: int) -> float:
    """Median wall time of single calls, each after the GPU has drained (no queueing behind earlier work)."""
    times = []
    gc.disable()
    try:
        for _ in range(samples):
            torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            fn()
            times.append(time.perf_counter_ns() - t0)
    finally:
        gc.enable()
    return statistics.median(times) / 1e3


class _NoOpCompiled:
    """What Triton's ``kernel[grid](...)`` returns, its launcher a no-op: a Launch keeps it and calls it
    itself from then on (kvfuse.kernels.launcher.DirectLaunch), as it keeps a compiled kernel on the GPU."""
    function = None
    packed_metadata = None

    def run(self, *args):
        return None

    def launch_metadata(self, *args):
        return None


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **kwargs)`` launches nothing and returns a
    _NoOpCompiled (the kernel's parameter names are the real kernel's: the direct path reads them)."""

    def __init__(self, kernel):
        self.arg_names = kernel.arg_names
        self.compiled = _NoOpCompiled()

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.compiled


# (module, kernel attribute) of every Triton kernel kvfuse's entry points launch
_KERNELS = (("kvfuse.kernels.router", "fused_kernel"), ("kvfuse.kernels.store_load", "store_kernel"),
            ("kvfuse.kernels.store_load", "load_kernel"), ("kvfuse.kernels.qkv", "qkv_kernel"))
# the modules that build Launches, each with its own DIRECT_LAUNCH (False in the interpreter)
_LAUNCHING = ("kvfuse.kernels.router", "kvfuse.kernels.store_load", "kvfuse.kernels.qkv")


@contextlib.contextmanager
def launches_stubbed():
    """Every kernel of _KERNELS replaced by a no-op (kvfuse looks its kernels up by name at each launch),
    and the direct launch on, its device and stream queries answering 0: after its first launch a Launch
    calls the no-op launcher itself, the host path of a compiled kernel's launch on the GPU (Triton's
    C launcher and the driver excepted)."""
    import importlib
    from kvfuse.kernels import launcher
    replaced = [(importlib.import_module(m), name) for m, name in _KERNELS]
    replaced = [(mod, name, _NoLaunch(getattr(mod, name))) for mod, name in replaced]
    replaced += [(importlib.import_module(m), "DIRECT_LAUNCH", True) for m in _LAUNCHING]
    replaced += [(launcher, "_current_device", lambda: 0), (launcher, "_current_stream", lambda device: 0)]
    saved = [(mod, name, getattr(mod, name)) for mod, name, _ in replaced]
    for mod, name, new in replaced:
        setattr(mod, name, new)
    try:
        yield
    finally:
        for mod, name, old in saved:
            setattr(mod, name, old)


def cpu_us(fn, samples: int) -> float:
    """Median wall time of single calls (us), the garbage collector off."""
    clock = time.perf_counter_ns
    times = []
    gc.disable()
    try:
        for _ in range(samples):
            t0 = clock()
            fn()
            times.append(clock() - t0)
    finally:
        gc.enable()
    return statistics.median(times) / 1e3


def profile_calls(calls: dict, pattern: str, sync=None) -> None:
    """cProfile 2000 calls of each call whose name contains ``pattern`` (after 50 warm-up calls), the 22
    functions of most own time; ``sync`` (the GPU's synchronize) every 100 calls."""
    import cProfile
    import pstats
    for name, fn in calls.items():
        if pattern in name:
            for _ in range(50):
                fn()
            prof = cProfile.Profile()
            prof.enable()
            for i in range(2000):
                fn()
                if sync is not None and i % 100 == 99:
                    sync()
            prof.disable()
            print(f"--- {name}")
            pstats.Stats(prof).sort_stats("tottime").print_stats(22)


def cpu_main(calls: dict, a) -> None:
    """--cpu: kvfuse's host time per call with the launches stubbed, plan cache on (and off with --cache-off);
    with --profile, the profile of the calls named instead."""
    rows = []
    if a.profile:
        with kvfuse.use_backend("triton"), launches_stubbed():
            profile_calls({k: v for k, v in calls.items() if not k.startswith("floor: a one-program")}, a.profile)
        return
    with kvfuse.use_backend("triton"), launches_stubbed():
        for name, fn in calls.items():
            if name.startswith("floor: a one-program"):
                continue   # a Triton launch: stubbed, nothing to measure
            row = {"call": name, "n": a.n}
            for cache in (True, False) if a.cache_off else (True,):
                kvfuse.set_plan_cache(cache)
                for _ in range(50):
                    fn()
                row[f"cpu_us_cache_{'on' if cache else 'off'}"] = cpu_us(fn, a.samples if cache else a.samples // 20)
            kvfuse.set_plan_cache(True)
            rows.append(row)
            off = f"  (cache off {row['cpu_us_cache_off']:7.2f})" if a.cache_off else ""
            print(f"{name:62s} {row['cpu_us_cache_on']:6.2f} us{off}", flush=True)
    meta = {"device": "cpu, launches stubbed", "torch": torch.__version__,
            "triton": __import__("triton").__version__, "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(meta))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


def loop_us(fn, calls: int = 500, repeats: int = 5) -> float:
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter_ns() - t0) / calls)
    return statistics.median(out) / 1e3


def graph_us(fn) -> float:
    """GPU us per call: kvfuse.bench's CUDA-graph timer (20 calls in one graph, median over replays)."""
    return CudaTimer().measure([fn]).gpu_us


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--samples", type=int, default=None, help="single calls timed (400 on the GPU, 20000 --cpu)")
    p.add_argument("--json", default=None)
    p.add_argument("--profile", default=None,
                   help="cProfile 2000 eager calls of the calls whose name contains this (--cpu: launches stubbed)")
    p.add_argument("--dry-run", action="store_true", help="CPU: build every call and run it once (TRITON_INTERPRET=1)")
    p.add_argument("--cpu", action="store_true",
                   help="kvfuse's Python per call on the CPU, launches stubbed (TRITON_INTERPRET=1 is set)")
    p.add_argument("--cache-off", action="store_true", help="--cpu: also with the plan cache off")
    a = p.parse_args(argv)
    if a.samples is None:
        a.samples = 20000 if a.cpu else 400
    if a.cpu and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--cpu needs TRITON_INTERPRET=1 when triton is imported (set when --cpu is on the command line)")
    dev = torch.device("cpu" if a.dry_run or a.cpu else "cuda")
    calls = _floors(dev)
    calls.update({f"kvfuse bench {w}": _workload_call(w, a.n, dev) for w in WORKLOADS})
    calls.update(_mla_writes(a.n, dev))
    calls.update(_adapters(a.n, dev))
    if a.cpu:
        cpu_main(calls, a)
        return
    if a.dry_run:
        with kvfuse.use_backend("triton"):
            for name, fn in calls.items():
                fn()
                print("ran", name)
        return
    if a.profile:
        profile_calls(calls, a.profile, torch.cuda.synchronize)
        return
    rows = []
    for name, fn in calls.items():
        row = {"call": name, "n": a.n}
        for cache in (True, False):
            kvfuse.set_plan_cache(cache)
            for _ in range(20):
                fn()
            key = "on" if cache else "off"
            row[f"host_us_cache_{key}"] = host_us(fn, a.samples)
            row[f"loop_us_cache_{key}"] = loop_us(fn)
        kvfuse.set_plan_cache(True)
        row["gpu_us"] = graph_us(fn)
        rows.append(row)
        print(f"{name:62s} host {row['host_us_cache_on']:6.2f} (cache off {row['host_us_cache_off']:6.2f})  "
              f"loop {row['loop_us_cache_on']:6.2f}  GPU {row['gpu_us']:5.2f} us", flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d"),
            "pdl": kvfuse.pdl_enabled()}
    print(json.dumps(meta))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
