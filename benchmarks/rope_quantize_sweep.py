"""FlashInfer's RoPE-quantize calls through kvfuse.engines.flashinfer on one CUDA device: GPU time of
each launch configuration of the GQA kernel (BLOCK_M tokens x G heads a program, warps), every one
byte-checked against the default configuration's output, for DeepSeek's MLA shape (128 or 0 q heads, one
K head of 64 + 512, kpe / ckv caches) and Llama 3 8B (32 / 8 heads of 128, fp8 caches).

    python benchmarks/rope_quantize_sweep.py [--n 1,256,4096,65536] [--out DIR]

Prints one line per (shape, n): the default's time and the best configuration's; writes
rope_quantize_sweep.json under --out."""
from __future__ import annotations

import argparse
import json
import os

import torch

import kvfuse
from kvfuse import bench
from kvfuse.engines import flashinfer
from kvfuse.kernels import config, qkv

PAGE = 64
F8 = torch.float8_e4m3fn
SHAPES = {"mla_k_only": (0, 1, 64, 512), "mla_q128": (128, 1, 64, 512), "llama3_8b": (32, 8, 128, 0)}


def make_call(shape: str, n: int):
    hq, hkv, rope, nope = SHAPES[shape]
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(n)
    mla = shape.startswith("mla")

    def rnd(*s):
        return torch.randn(s, generator=g, device=dev).to(torch.bfloat16)
    q_rope, q_nope = rnd(n, hq, rope), (rnd(n, hq, nope) if nope else None)
    k_rope = rnd(n, rope) if mla else rnd(n, hkv, rope)
    k_nope = (rnd(n, nope) if mla else rnd(n, hkv, nope)) if nope else None
    v = None if mla else rnd(n, hkv, rope + nope)
    pages = n // PAGE + 2
    perm = torch.randperm(pages * PAGE, generator=g, device=dev)[:n]
    meta = (perm // PAGE).int(), torch.arange(n + 1, dtype=torch.int32, device=dev), \
        torch.arange(n, dtype=torch.int32, device=dev), (perm % PAGE).int()
    if mla:
        caches = (torch.zeros(pages, PAGE, nope, dtype=torch.uint8, device=dev).view(F8),
                  torch.zeros(pages, PAGE, rope, dtype=torch.uint8, device=dev).view(F8))
    else:
        shape4 = (pages, PAGE, hkv, rope + nope)
        caches = (torch.zeros(shape4, dtype=torch.uint8, device=dev).view(F8),
                  torch.zeros(shape4, dtype=torch.uint8, device=dev).view(F8))
    table = kvfuse.rope.cos_sin_cache(max(n, 2), rope, device=dev)
    pos = torch.arange(n, device=dev, dtype=torch.int32)
    q_outs = (torch.empty(n, hq, rope, dtype=torch.uint8, device=dev).view(F8),
              torch.empty(n, hq, nope, dtype=torch.uint8, device=dev).view(F8))

    def call():
        flashinfer.rope_quantize_fp8_append_paged_kv_cache(
            q_rope, k_rope, q_nope, k_nope, v, table, pos, caches, *meta, is_neox=not mla, quant_scale_kv=0.5,
            page_size=PAGE, q_rope_out=q_outs[0], q_nope_out=q_outs[1])
    return call, list(caches) + list(q_outs), 576 if mla else 128, max(hq, hkv)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", default="1,256,4096,65536")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args(argv)
    timer = bench.CudaTimer()
    rows = []
    for shape in SHAPES:
        for n in (int(s) for s in args.n.split(",")):
            call, outs, d, heads = make_call(shape, n)
            for o in outs:
                o.view(torch.uint8).fill_(0xAB)
            call()
            want = [o.view(torch.uint8).clone() for o in outs]
            dflt = qkv.launch_config(n, config.next_pow2(d), heads, interpret=False)
            found = []
            for bm in (1, 2, 4, 8):
                for nw in (1, 2, 4):
                    for gh in (1, 2, 4):
                        if bm * config.next_pow2(d) * gh > 32768 or (gh > 1 and heads < 2):
                            continue
                        with config.force_config(bm, nw, None, gh):
                            for o in outs:
                                o.view(torch.uint8).fill_(0xAB)
                            call()
                            same = all(torch.equal(o.view(torch.uint8), w) for o, w in zip(outs, want))
                            us = timer.measure([call]).gpu_us
                        found.append(dict(shape=shape, n=n, bm=bm, nw=nw, g=gh, us=us, bytes_equal=same,
                                          default=(bm, gh, nw) == tuple(dflt)))
            rows += found
            best = min(found, key=lambda r: r["us"])
            cur = [r for r in found if r["default"]]
            print(f"{shape:11s} n={n:6d} default {dflt} {cur[0]['us'] if cur else float('nan'):8.2f} us | best "
                  f"bm={best['bm']} g={best['g']} nw={best['nw']} {best['us']:8.2f} us | all bytes equal: "
                  f"{all(r['bytes_equal'] for r in found)}", flush=True)
            del call, outs
            torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "rope_quantize_sweep.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
