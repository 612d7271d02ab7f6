"""H200 check of the Gluon index kernel's CONTIGUOUS path (kvfuse/kernels/gluon_index.py, CONTIG: the
(q, sf) outputs of a cast without a cache, e.g. the indexer's Q: x [n, H, 128], RoPE on columns
64..127, optional RMSNorm) against kvfuse's plain Triton path, through the PUBLIC API (the fast path
switched by kvfuse.kernels.fused.FAST_PATHS, the plan cache cleared at each switch).

(a) correctness, per cast (the four index chains): q and sf live inside larger buffers of random
    bytes (guard bytes around, padded rows); both buffers are written with the fast path off, then
    on, from the same poison, and compared WHOLE (torch.equal; else the differing bytes, and whether
    they all lie in rows holding inf/NaN inputs, where SPEC §2 allows any bytes). Cases: 64 heads at
    n = 1, 3 and 1000, 4 heads with special values, one head as x [n, 128], norm on (bf16 / fp32
    weight) and off, int64 and strided positions, positions out of range, a 3-row bf16 cos/sin table,
    padded x / q / sf rows, and q not aligned for its stores (the plain kernel must take it).
(b) timing: CUDA-graph replay medians of kvfuse.bench's "index_q" workload (64 heads, INDEX_MXFP4
    cast, no norm) fast path off vs on, after checking that both write the same q and sf bytes.
About 40-60 s on an H200. Usage: python3 benchmarks/gluon_check_index_q.py --out DIR
"""
import os
import time

import torch

import gluon_check_common as common  # first: puts the repository root on sys.path
from gluon_check_common import DEVICE, T0, log, short
import kvfuse
from kvfuse import CastArgs, ContiguousOutArgs, NormArgs, RopeArgs, bench
from kvfuse import formats as F
from kvfuse.kernels import gluon_index as GI

CASTS = {f.name: CastArgs.from_cache_format(f) for f in (F.INDEX_FP8_FP32, F.INDEX_MXFP8, F.INDEX_MXFP4,
                                                          F.INDEX_NVFP4)}
TIMING_N = (1, 16, 256, 4096, 16384, 65536)


def fast_path(on: bool) -> None:
    common.fast_path(GI, on)


def padded_rows(n, heads, width, pad, dtype, offset, gen, guard=64):
    """A [n, heads, width] view with rows ``width + pad`` elements apart, ``offset`` bytes into a buffer
    of random bytes with ``guard`` bytes after it: (view, whole byte buffer)."""
    item = torch.empty(0, dtype=dtype).element_size()
    row = width + pad
    nbytes = offset + n * heads * row * item + guard
    buf = torch.randint(0, 256, (nbytes,), generator=gen, dtype=torch.uint8).to(DEVICE)
    view = torch.as_strided(buf[offset:offset + n * heads * row * item].view(dtype), (n, heads, width),
                            (heads * row, row, 1))
    return view, buf


def build(cast, n, heads, seed, norm=None, pos_dtype=torch.int32, pos_stride=1, cs_dtype=torch.float32, P=4096,
          bad_positions=0.0, special=False, x_pad=0, q_pad=0, sf_pad=0, q_offset=0, x2d=False):
    """Inputs and poisoned outputs of one case; returns (call, buffers, nonfinite row mask [n * heads])."""
    g = torch.Generator().manual_seed(seed)
    x_full = torch.randn(n, heads, 128 + x_pad, generator=g) * torch.exp2(torch.randint(-8, 9, (n, heads, 1),
                                                                                        generator=g).float())
    nonfinite = torch.zeros(n, heads, dtype=torch.bool)
    if special:
        x_full[::5, :, 64:] *= 1e-3
        x_full[1::7, :, :32] = 0.0
        x_full[2::11, 0, 70] = float("inf")
        x_full[3::13, -1, 5] = float("nan")
        nonfinite[2::11, 0] = True
        nonfinite[3::13, -1] = True
    x = x_full.to(torch.bfloat16).to(DEVICE)[..., :128]
    if x2d:
        x = x[:, 0]
    ang = torch.rand(P, 32, generator=g) * 6.3
    cs = torch.cat([ang.cos(), ang.sin()], 1).to(cs_dtype).to(DEVICE)
    pos = torch.randint(0, P, (n * pos_stride,), generator=g)
    if bad_positions:
        bad = torch.rand(n * pos_stride, generator=g) < bad_positions
        pos = torch.where(bad, torch.where(torch.rand(n * pos_stride, generator=g) < 0.5, -1, P + 5), pos)
    pos = pos.to(pos_dtype).to(DEVICE)[::pos_stride]
    qd = 64 if cast.cast_fmt == "e2m1" else 128
    qt = torch.uint8 if cast.cast_fmt == "e2m1" else torch.float8_e4m3fn
    st = {"ue8m0": torch.uint8, "e4m3": torch.float8_e4m3fn}.get(cast.sf_format, torch.float32)
    ng = 128 // cast.num_per_channels
    q, q_buf = padded_rows(n, heads, qd, q_pad, qt, q_offset, g)
    sf, sf_buf = padded_rows(n, heads, ng, sf_pad, st, 0, g)
    if x2d:
        q, sf = q[:, 0], sf[:, 0]
    norm_args = None
    if norm is not None:
        norm_args = NormArgs((torch.rand(128, generator=g) * 2).to(norm).to(DEVICE), 1e-6)
    rope = RopeArgs(pos, cs, 64, True)
    out = ContiguousOutArgs(out=q, sf=sf)

    def call():
        kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(x, norm_args, rope, None, cast, out)
    return call, (q_buf, sf_buf), nonfinite.flatten()


def cases():
    return [
        ("64 heads n=1", dict(n=1, heads=64, seed=1)),
        ("64 heads n=3, norm bf16, int64 strided positions, bf16 cos_sin P=3, positions out of range",
         dict(n=3, heads=64, seed=2, norm=torch.bfloat16, pos_dtype=torch.int64, pos_stride=3,
              cs_dtype=torch.bfloat16, P=3, bad_positions=0.3)),
        ("4 heads n=300, special values, norm fp32, x/q/sf rows padded",
         dict(n=300, heads=4, seed=3, norm=torch.float32, special=True, x_pad=8, q_pad=8, sf_pad=3)),
        ("64 heads n=1000", dict(n=1000, heads=64, seed=4, bad_positions=0.1)),
        ("x [n, 128] n=4097, norm bf16", dict(n=4097, heads=1, seed=5, norm=torch.bfloat16, x2d=True)),
        ("q misaligned for its stores (offset 2), 64 heads n=5", dict(n=5, heads=64, seed=6, q_offset=2)),
    ]


def compare(cast_name, name, kw):
    cast = CASTS[cast_name]
    rec = dict(cast=cast_name, case=name, status="ok")
    expect_fast = kw.get("q_offset", 0) == 0
    call_a, bufs_a, nonfinite = build(cast, **kw)
    call_b, bufs_b, _ = build(cast, **kw)          # the same seed: the same inputs and poison
    fast_path(False)
    call_a()
    common.note_fast_path(rec, common.fast_write_launches(GI, "index_write_kernel", call_b), expect_fast)
    diff = sum(int((a != b).sum()) for a, b in zip(bufs_a, bufs_b))
    rec.update(equal=diff == 0, diff_bytes=diff)
    if diff and rec["status"] == "ok":
        rec["status"] = "MISMATCH" if not nonfinite.any() else "differs (rows with inf/NaN inputs present: check)"
    return rec


def run_correctness(report, deadline):
    out = report.setdefault("correctness", [])
    for cast_name in CASTS:
        for name, kw in cases():
            if time.perf_counter() > deadline:
                out.append(dict(cast=cast_name, case=name, status="skipped: time budget"))
                continue
            try:
                rec = compare(cast_name, name, kw)
            except Exception as e:
                fast_path(False)
                rec = dict(cast=cast_name, case=name, status="error", error=short(e))
                if common.is_cuda_error(e):
                    out.append(rec)
                    report["stopped"] = f"CUDA error in {cast_name} {name}"
                    return False
            out.append(rec)
            log(f"correctness {cast_name:15s} {name:90s} fast={'yes' if rec.get('fast_path_ran') else 'no '} "
                f"{rec['status']}" + (f" ({rec.get('diff_bytes')} bytes)" if rec.get("diff_bytes") else ""))
    return True


def run_timing(report, copy_gbps, deadline):
    wl = bench.WORKLOADS["index_q"]
    timer = bench.CudaTimer(graph_calls=20, target_s=0.03, eager_target_s=0.003, max_reps=30)
    out = report.setdefault("timing", [])
    for n in TIMING_N:
        if time.perf_counter() > deadline:
            out.append(dict(n=n, status="skipped: time budget"))
            continue
        inp = bench.build_inputs(wl, n, DEVICE)
        call = bench.fused_call(wl, inp)
        nbytes = bench.input_bytes(wl, inp)["total"]
        got = {}
        for label, on in (("plain", False), ("fast", True)):
            fast_path(on)
            inp.q.view(torch.uint8).fill_(0x5A)
            inp.sf.view(torch.uint8).fill_(0x5A)
            call()
            torch.cuda.synchronize()
            got[label] = (inp.q.view(torch.uint8).clone(), inp.sf.view(torch.uint8).clone())
        fast_path(False)
        same = all(torch.equal(a, b) for a, b in zip(got["plain"], got["fast"]))
        row = dict(n=n, status="ok" if same else "MISMATCH on the timing inputs", bytes=nbytes,
                   **common.plain_vs_fast(GI, timer, call, nbytes, copy_gbps))
        out.append(row)
        log(f"timing index_q n={n:6d} {common.plain_vs_fast_text(row)}  {row['status']}")
        del inp, call, got
        torch.cuda.empty_cache()


def main():
    p = common.arg_parser(__doc__, "gluon-check-index-q", 90.0)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    report = common.new_report(casts=list(CASTS), launch_table={n: GI.launch_table(n) for n in (64, 16384, 1 << 20)})
    if common.device_ready(report, ", contiguous (q, sf) path"):
        copy = common.copy_bandwidth(report, nbytes=1 << 30)
        going = True
        if not a.skip_correctness:
            going = run_correctness(report, T0 + 0.6 * a.budget_s)
        if going and not a.skip_timing:
            run_timing(report, copy.get("copy_GBps"), T0 + a.budget_s)
        fast_path(False)
        cor = report.get("correctness", [])
        bad = [(r["cast"], r["case"], r["status"], r.get("diff_bytes")) for r in cor if r.get("status") != "ok"]
        tim = [r for r in report.get("timing", []) if r.get("status") != "ok"]
        report["summary"] = dict(comparisons=len(cor), equal=sum(1 for r in cor if r.get("equal")),
                                 fast_path_ran=sum(1 for r in cor if r.get("fast_path_ran")), not_ok=bad,
                                 timing_not_ok=[(r["n"], r["status"]) for r in tim])
        s = report["summary"]
        log(f"summary: {s['equal']} of {s['comparisons']} comparisons byte-equal, fast path ran in "
            f"{s['fast_path_ran']}; not ok: {bad}; timing not ok: {s['timing_not_ok']}")
    common.write_report(report, a.out, "gluon_check_index_q.json")


if __name__ == "__main__":
    main()
