"""H200 check of the Gluon INDEXER fast path (kvfuse/kernels/gluon_index.py) against kvfuse's plain
Triton path (byte-exact to the reference, docs/performance.md), through the PUBLIC API: the fast path is
switched by monkeypatching kvfuse.kernels.fused.FAST_PATHS / GLUON (the plan cache cleared at each
switch), so dispatch, eligibility, the argument table and the launch table are checked too.

(a) correctness, per format (INDEX_FP8_FP32, INDEX_MXFP4, INDEX_NVFP4; INDEX_MXFP8 with --mxfp8): two
    storages poisoned with the same random bytes (guard bytes around the cache) are written, one with
    the fast path off, one on; the WHOLE storages are compared (torch.equal; else the number of
    differing bytes, where, and whether they all lie in rows holding inf/NaN inputs, where SPEC §2
    allows any bytes). Cases: n in {1, 3, 300, 4097, 65536}, special values (zero rows, huge, bf16
    subnormals, rounding ties, an all-zero group, one inf, one NaN, ...), invalid slots (-1, >=
    capacity), positions out of range, padded block strides + guard bytes + a cache offset,
    block_size 24 (division) and 1, int64 and strided indices, fp32 weight / bf16 cos_sin, a 3-row
    cos/sin table, x and the cache only 4-byte aligned. Each case says whether the fast path ran
    (a counting wrapper around the kernel); a cache only 4-byte aligned must leave e4m3 formats on the
    plain kernel. An INDEX_MXFP4 mismatch is re-run with the fp32 e2m1 encoder (PACKED_E2M1 = False).
(b) timing: CUDA-graph replay medians (kvfuse.bench.CudaTimer) of the public call, fast path off vs
    on, at n = 1, 256, 4096, 65536, 262144 on kvfuse.bench's inputs, as GPU us and % of the device
    copy bandwidth (kvfuse.bench.measure_copy_bandwidth, 1 GiB; kvfuse.bench.input_bytes).
Only the launch table's variants are compiled. Exceptions are reported per case; a CUDA error (which
ends the CUDA context) stops the run and the report is written. About 60-80 s on an H200.

Usage: python3 benchmarks/gluon_check_index.py --out DIR         (writes DIR/gluon_check_index.json)
       python3 benchmarks/gluon_check_index.py --prove-encoders  (CPU, minutes: the e2m1 encoders'
       host mirrors against kvfuse.reference.encode_e2m1 on every fp32 / bf16 input)
"""
import os
import time
import traceback

import torch

import gluon_check_common as common  # first: puts the repository root on sys.path
from gluon_check_common import DEVICE, T0, TIMING_SIZES, log, short
from kvfuse import bench
from kvfuse import formats as F
from kvfuse.kernels import gluon_index as GI

FORMATS = {"index_fp8_fp32": F.INDEX_FP8_FP32, "index_mxfp4": F.INDEX_MXFP4, "index_nvfp4": F.INDEX_NVFP4}


# ------------------------------------------------------------------------------------ switching
def fast_path(on: bool) -> None:
    """Route the public entry point's eligible calls to gluon_index (on) or keep the plain kernel."""
    common.fast_path(GI, on)


# ------------------------------------------------------------------------------------ inputs
class Case(common.Case):
    """One set of inputs and a poisoned block-wide cache storage (guard bytes before and after the cache)."""

    def __init__(self, fmt, name, n, block_size=64, block_padding=0, cache_offset=0, guard=64, expect_fast=True,
                 **inputs):
        self.fmt, self.expect_fast = fmt, expect_fast
        super().__init__(name, n, 128, block_size=block_size, **inputs)
        bpt = fmt.bytes_per_token
        s0 = -(-(block_size * bpt + block_padding) // 32) * 32
        self.place_cache((self.blocks, block_size, 1, bpt), (s0, bpt, bpt, 1), cache_offset, guard)

    def row_of_byte(self):
        """storage byte -> the row whose record holds it (-1: none), from the valid slots."""
        fmt = self.fmt
        rows, blk, off = self.valid_slots()
        base = self.cache_offset + blk * self.strides[0]
        sf = base + self.shape[1] * fmt.data_bytes + off * fmt.sf_bytes
        return self.owner_map(rows, [(base + off * fmt.data_bytes, fmt.data_bytes), (sf, fmt.sf_bytes)])


# special contents (SPEC §2 edge cases): common.special_rows and these
def special_values(c, g):
    k = common.special_rows(c, g)
    x = c.x
    x[k % 11 == 5, 32:48] *= 2.0 ** 20                                            # one group far above the rest
    x[k % 11 == 6, 64:128] *= 1e-3                                                 # a small RoPE half
    x[k % 11 == 8, 16:32] = 0.0                                                    # an all-zero group (amax floor)
    common.put_nonfinite(x, k, 128, 100)                                           # -inf in the RoPE half


def correctness_cases(fmt):
    """(name, Case keywords). Each distinct dtype / alignment / stride combination compiles both kernels
    once more, so the variations share a few combinations (the 90-second budget)."""
    e4m3 = fmt.cast_fmt == "e4m3"
    return common.base_cases(special_values) + [
        ("padded blocks + guard + cache offset 16, x rows padded, n=4097",
         dict(n=4097, seed=8, block_padding=40, cache_offset=16, guard=256, x_row_pad=8)),
        ("x 4-byte aligned only (offset 2), cache offset 4, n=300",
         dict(n=300, seed=9, x_offset=2, x_row_pad=2, cache_offset=4, expect_fast=not e4m3)),
    ]


# ------------------------------------------------------------------------------------ (a)
def compare(c):
    """Write both storages (fast path off, then on); the record of the comparison."""
    rec = dict(format=c.fmt.name, case=c.name, n=c.n, status="ok")
    flat_a, cache_a = c.new_cache()
    flat_b, cache_b = c.new_cache()
    fast_path(False)
    common.public_write(c, cache_a)
    launches = common.fast_write_launches(GI, "index_write_kernel", lambda: common.public_write(c, cache_b))
    common.note_fast_path(rec, launches, c.expect_fast)
    return common.judge_storages(c, rec, flat_a, flat_b, c.row_of_byte(), ("plain", "fast"), first=8)


def run_correctness(formats, deadline, report):
    records = report.setdefault("correctness", [])
    for fname, fmt in formats.items():
        for name, kw in correctness_cases(fmt):
            if time.perf_counter() > deadline:
                records.append(dict(format=fmt.name, case=name, status="skipped: time budget"))
                continue
            started = time.perf_counter()
            try:
                c = Case(fmt, name, **kw)
                r = compare(c)
                if r["status"] == "MISMATCH" and fmt.cast_fmt == "e2m1" and fmt.sf_format == "ue8m0" \
                        and GI.PACKED_E2M1:
                    GI.PACKED_E2M1 = False                 # the fp32 e2m1 encoder: is the packed one at fault?
                    try:
                        again = compare(c)
                    finally:
                        GI.PACKED_E2M1 = True
                    r["with_fp32_e2m1_encoder"] = dict(status=again["status"], diff_bytes=again.get("diff_bytes"))
            except Exception as e:
                r = dict(format=fmt.name, case=name, n=kw.get("n"), status="error", error=short(e),
                         trace=traceback.format_exc()[-1500:])
                records.append(r)
                log(f"correctness {fmt.name:15s} {name:55s} ERROR {short(e)}")
                if common.is_cuda_error(e):
                    report["stopped"] = f"CUDA error in {fmt.name} / {name}"
                    return False
                continue
            r["seconds"] = round(time.perf_counter() - started, 2)       # compiles included
            records.append(r)
            extra = "" if r.get("equal") else \
                f" {r.get('diff_bytes')} bytes differ, first {r.get('first_diffs', [])[:2]}"
            if "with_fp32_e2m1_encoder" in r:
                extra += f"; with the fp32 e2m1 encoder: {r['with_fp32_e2m1_encoder']}"
            log(f"correctness {fmt.name:15s} {name:55s} fast={'yes' if r.get('fast_path_ran') else 'no '} "
                f"{r['status']}{extra}")
            del c
        torch.cuda.empty_cache()
    return True


# ------------------------------------------------------------------------------------ (b)
def run_timing(formats, copy_gbps, deadline, report):
    records = report.setdefault("timing", [])
    timer = bench.CudaTimer(graph_calls=20, target_s=0.03, eager_target_s=0.003, max_reps=30)
    for fname, fmt in formats.items():
        wl = bench.WORKLOADS[fname]
        for n in TIMING_SIZES:
            if time.perf_counter() > deadline:
                records.append(dict(format=fmt.name, n=n, status="skipped: time budget"))
                continue
            try:
                inp = bench.build_inputs(wl, n, DEVICE)
                nbytes = bench.input_bytes(wl, inp)["total"]
                call = bench.fused_call(wl, inp)
                # the timing inputs written both ways must agree too
                diff_bytes, _ = common.written_both_ways(GI, "index_write_kernel", inp, call)
                if diff_bytes:
                    records.append(dict(format=fmt.name, n=n, status="MISMATCH on the timing inputs",
                                        diff_bytes=diff_bytes))
                    log(f"timing {fmt.name} n={n}: MISMATCH on the timing inputs")
                row = dict(format=fmt.name, n=n, status="ok", bytes=nbytes,
                           **common.plain_vs_fast(GI, timer, call, nbytes, copy_gbps))
                records.append(row)
                log(f"timing {fmt.name:15s} n={n:7d} {common.plain_vs_fast_text(row)}")
                del inp, call
            except Exception as e:
                fast_path(False)
                records.append(dict(format=fmt.name, n=n, status="error", error=short(e)))
                log(f"timing {fmt.name} n={n}: ERROR {short(e)}")
                if common.is_cuda_error(e):
                    report["stopped"] = f"CUDA error timing {fmt.name} n={n}"
                    return False
                bench._recover_cuda()
        torch.cuda.empty_cache()
    return True


# ------------------------------------------------------------------------------------ proofs (CPU)
def prove_encoders(report):
    """The e2m1 encoders' host mirrors (gluon_common.e2m1_nibble_mirror / gluon_index.e2m1_bf16_mirror) against
    kvfuse.reference.encode_e2m1: every fp32 pattern (NaN left out), and every bf16 y times every UE8M0
    multiplier the kernel makes (where |y * m| <= 6 or y is infinite)."""
    from kvfuse import reference as ref
    bad = report["fp32_encoder_differing"] = common.prove_e2m1_nibble(log)
    y = torch.arange(1 << 16, dtype=torch.int32)
    yf = (y << 16).view(torch.float32)
    bad16 = 0
    for e in range(-15, 129):
        m = torch.tensor([((127 - e) << 23) if e < 127 else (0x400000 >> (e - 127))], dtype=torch.int32)
        t = yf * m.view(torch.float32)
        got = GI.e2m1_bf16_mirror(t.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF)
        relevant = ~torch.isnan(yf) & ((t.abs() <= 6) | torch.isinf(yf))
        bad16 += int(((got != ref.encode_e2m1(t).to(torch.int32)) & relevant).sum())
    report["bf16_encoder_differing"] = bad16
    log(f"fp32 encoder: {bad} differing of 2^32 (NaN left out); packed bf16 encoder: {bad16} differing")


def main():
    p = common.arg_parser(__doc__, "gluon-check-index", 80.0)
    p.add_argument("--mxfp8", action="store_true", help="INDEX_MXFP8 too (more compiles)")
    p.add_argument("--formats", default="", help="comma list of index_fp8_fp32,index_mxfp4,index_nvfp4,index_mxfp8")
    p.add_argument("--prove-encoders", action="store_true", help="CPU only: the exhaustive encoder proofs")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    formats = dict(FORMATS)
    if a.mxfp8:
        formats["index_mxfp8"] = F.INDEX_MXFP8
    if a.formats:
        everything = {**FORMATS, "index_mxfp8": F.INDEX_MXFP8}
        formats = {k: everything[k] for k in a.formats.split(",")}
    if "index_mxfp8" in formats and "index_mxfp8" not in bench.WORKLOADS:
        bench.WORKLOADS["index_mxfp8"] = bench._write("index_mxfp8", F.INDEX_MXFP8, "indexer K 128")
    sizes = (1, 3, 256, 300, 4096, 4097, 65536, 262144)
    report = common.new_report(formats=[f.name for f in formats.values()], packed_e2m1=GI.PACKED_E2M1,
                               launch_table={n: GI.launch_table(n) for n in sizes})
    if a.prove_encoders:
        prove_encoders(report)
    elif common.device_ready(report, f", formats {list(formats)}"):
        deadline = T0 + a.budget_s
        copy = common.copy_bandwidth(report, nbytes=1 << 30)
        going = True
        if not a.skip_correctness:
            # no correctness case starts after ~70% of the budget: timing must still run
            going = run_correctness(formats, T0 + 0.7 * a.budget_s, report)
        if going and not a.skip_timing:
            run_timing(formats, copy.get("copy_GBps"), deadline, report)
        fast_path(False)
        cor = report.get("correctness", [])
        bad = [r for r in cor if r.get("status") != "ok"]
        report["summary"] = dict(
            comparisons=len(cor), equal=sum(1 for r in cor if r.get("equal")),
            fast_path_ran=sum(1 for r in cor if r.get("fast_path_ran")),
            not_ok=[(r.get("format"), r.get("case"), r.get("status"), r.get("diff_bytes")) for r in bad],
            speedups={f"{r['format']} n={r['n']}": round(r["speedup"], 3) for r in report.get("timing", [])
                      if r.get("status") == "ok"})
        log(f"summary: {report['summary']['equal']} of {report['summary']['comparisons']} comparisons byte-equal, "
            f"fast path ran in {report['summary']['fast_path_ran']}; not ok: {report['summary']['not_ok']}")
    common.write_report(report, a.out, "gluon_check_index.json")


if __name__ == "__main__":
    main()
