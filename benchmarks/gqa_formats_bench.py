"""GPU time of the GQA entry's write with each cache format of kvfuse.gqa_formats, on one model's call.

The call is ``kvfuse.bench``'s GQA workload (default Qwen3 8B: QK-norm, NEOX RoPE, q_out bf16, paged slots,
vLLM's NHD caches of 64-token blocks), its caches replaced by caches of each preset (K and V in the same
format; static scales 0.125 where the format takes them; fp32 scale caches [blocks, 64, Hkv] for the formats
that store a scale per (token, head), group scale caches [blocks, 64, Hkv, D / group] for the 4-bit ones,
whose static scale is the global one). Per n: GPU us (CUDA-graph replay, kvfuse.bench's timer), the
compulsory DRAM bytes (q, k, v read; q_out, the K / V codes and stored scales written; positions, slots,
one cos/sin row per token, the norm weights), GB/s, % of the measured copy bandwidth, and the ratio to the
fp8_e4m3 (per tensor) write of the same n. Needs a GPU.

    python benchmarks/gqa_formats_bench.py [--workload qwen3_8b_fp8] [--n 1,256,4096,65536] [--json OUT]
    python benchmarks/gqa_formats_bench.py --sweep nvfp4,fp8_per_token_head --n 65536   # launch configurations
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import kvfuse
from kvfuse import bench
from kvfuse.bench.timing import CudaTimer, measure_copy_bandwidth
from kvfuse.gqa_formats import PRESETS

SCALE = 0.125


def format_call(wl, n: int, name: str, device: str = "cuda"):
    """(call, compulsory bytes, outputs) of the workload's GQA call with K and V caches of preset ``name``
    (outputs: the tensors it writes)."""
    fmt = PRESETS[name]
    inp = bench.build_inputs(wl, n, torch.device(device))
    cfg = wl.gqa
    q, k, v = inp.qkv(wl)
    nb, bs, hkv, d = inp.k_cache.shape
    act = q.dtype
    dtype = fmt.dtype_for(act)
    kc = torch.zeros((nb, bs, hkv, d // fmt.values_per_element), dtype=dtype, device=device)
    vc = torch.zeros_like(kc)
    ks = vs = ksc = vsc = None
    if fmt.takes_static_scale:                          # a static scale, or NVFP4's global one
        ks = torch.tensor([SCALE], device=device)
        vs = torch.tensor([SCALE], device=device)
    if fmt.stores_scale:
        ksc = torch.zeros(fmt.scale_cache_shape(kc.shape, d), dtype=fmt.scale_dtype, device=device)
        vsc = torch.zeros_like(ksc)
    qn = kvfuse.NormArgs(inp.weight, cfg.norm_eps) if cfg.qk_norm else None
    kn = kvfuse.NormArgs(inp.k_weight, cfg.norm_eps) if cfg.qk_norm else None
    rope = cfg.rope_args(inp.positions, inp.cos_sin)
    q_out = torch.empty_like(q) if inp.out is None else inp.out
    hq = q.shape[1]
    esize = torch.empty((), dtype=act).element_size()
    nbytes = (n * (hq + 2 * hkv) * d * esize            # q, k, v read
              + n * hq * d * esize                        # q_out
              + 2 * n * hkv * fmt.row_bytes(d, act)       # K and V codes and stored scales
              + n * (d * 4 + 8)                           # one fp32 cos/sin row, position, slot
              + (2 * d * 2 if cfg.qk_norm else 0))

    def call():
        kvfuse.fused_qk_norm_rope_store_kv(q, k, v, kc, vc, inp.slots, qn, kn, rope, ks, vs, "NHD", q_out,
                                           k_format=name, v_format=name, k_scale_cache=ksc, v_scale_cache=vsc)
    return call, nbytes, [t for t in (kc, vc, ksc, vsc, q_out) if t is not None]


SWEEP = [(bm, nw, g) for bm in (1, 2, 4, 8) for nw in (1, 2, 4) for g in (1, 2, 4)]


def sweep(wl, n: int, name: str, timer) -> list:
    """GPU us of each launch configuration (BLOCK_M tokens, num_warps, G heads a program; kernels.config.
    force_config) of one format's call at n, each byte-checked against the default configuration's output."""
    from kvfuse.kernels import config
    call, nbytes, outs = format_call(wl, n, name)

    def run():
        for o in outs:
            o.view(torch.uint8).fill_(0xAB)
        call()
        return [o.view(torch.uint8).clone() for o in outs]
    want = run()
    rows = [dict(n=n, format=name, config="default",
                 gpu_us=timer.measure([call]).gpu_us, bytes_equal=True)]
    for bm, nw, g in SWEEP:
        if bm * g > 8:                                  # up to 1024 elements of 128-d heads a program
            continue
        with config.force_config(bm, nw, None, g):
            same = all(torch.equal(a, b) for a, b in zip(run(), want))
            rows.append(dict(n=n, format=name, config=f"bm={bm} nw={nw} g={g}", gpu_us=timer.measure([call]).gpu_us,
                             bytes_equal=same))
    best = min(rows, key=lambda r: r["gpu_us"])
    print(f"sweep n={n:6d} {name:22s} default {rows[0]['gpu_us']:9.2f} us | best {best['config']} "
          f"{best['gpu_us']:9.2f} us | all bytes equal: {all(r['bytes_equal'] for r in rows)}", flush=True)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", default="qwen3_8b_fp8")
    p.add_argument("--n", default="1,256,4096,65536")
    p.add_argument("--json", default=None)
    p.add_argument("--dry-run", action="store_true", help="CPU: build each format's call at n = 3, run it once")
    p.add_argument("--sweep", default=None, help="formats (a comma list) whose launch configurations to sweep "
                   "at each n instead (kernels.config.force_config; bytes checked against the default)")
    a = p.parse_args(argv)
    wl = bench.WORKLOADS[a.workload]
    if a.dry_run:
        with kvfuse.use_backend("triton"):
            for name in PRESETS:
                format_call(wl, 3, name, "cpu")[0]()
                print("ran", name)
        return
    sizes = [int(s) for s in a.n.split(",")]
    copy = measure_copy_bandwidth(reps=10)["copy_GBps"]     # kvfuse bench's: 2 GiB device to device
    timer = CudaTimer()
    rows = []
    print(f"{a.workload}: copy bandwidth {copy:.0f} GB/s; {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {__import__('triton').__version__}, PDL {kvfuse.pdl_enabled()}, {time.strftime('%Y-%m-%d')}")
    if a.sweep:
        for n in sizes:
            for name in a.sweep.split(","):
                rows += sweep(wl, n, name, timer)
                torch.cuda.empty_cache()
        sizes = []
    for n in sizes:
        base = None
        for name in ["fp8_e4m3"] + [f for f in PRESETS if f != "fp8_e4m3"]:
            call, nbytes, _ = format_call(wl, n, name)
            us = timer.measure([call]).gpu_us
            base = us if name == "fp8_e4m3" else base
            gbps = nbytes / us / 1e3
            row = dict(workload=a.workload, n=n, format=name, gpu_us=us, bytes=nbytes, gbps=gbps,
                       pct_copy=100 * gbps / copy, x_fp8=us / base)
            rows.append(row)
            print(f"n={n:6d} {name:22s} {us:9.2f} us  {gbps:7.0f} GB/s  {row['pct_copy']:5.1f}% of copy  "
                  f"{row['x_fp8']:.2f}x fp8_e4m3", flush=True)
            del call
            torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"copy_GBps": copy, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": __import__("triton").__version__, "pdl": kvfuse.pdl_enabled(),
                       "date": time.strftime("%Y-%m-%d"), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
