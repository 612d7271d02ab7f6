"""H200 check of the Gluon MAIN_FP4 fast path (kvfuse/kernels/gluon_main_fp4.py) against kvfuse's plain
Triton path (byte-exact to the reference, docs/performance.md), through the PUBLIC API: the fast path is
switched by monkeypatching kvfuse.kernels.fused.FAST_PATHS / GLUON (the plan cache cleared at each
switch), so dispatch, eligibility, the argument table and the launch table are checked too.

(a) correctness: two storages poisoned with the same random bytes (guard bytes around the cache) are
    written, one with the fast path off, one on; the WHOLE storages are compared (torch.equal; else
    the number of differing bytes, where, and whether they all lie in rows holding inf/NaN inputs,
    where SPEC §2 allows any bytes). Cases: n in {1, 3, 300, 4097, 65536} (so every entry of the
    launch table: one-warp rows, four-warp CTAs, the pipelined loop), special values (zero rows,
    huge, bf16 subnormals, rounding ties, an all-zero group, a group far above the rest, one inf,
    one NaN, ...), invalid slots (-1, >= capacity), positions out of range, padded token and block
    strides + guard bytes + a cache offset, block_size 24 (division) and 1, int64 and strided
    indices, fp32 weight / bf16 cos/sin, a 3-row cos/sin table, eps 1e-5, x only 4-byte aligned, and
    a cache only 4-byte aligned (which must stay on the plain kernel: the codes leave as 64-bit
    stores). Each case says whether the fast path ran (a counting wrapper around the kernel).
    --variants adds direct launches (gluon_main_fp4_write) of
    variants outside the launch table (two rows a warp, two warps, four warps pipelined).
(b) timing: CUDA-graph replay medians (kvfuse.bench.CudaTimer) of the public call, fast path off vs
    on, at n = 1, 256, 4096, 65536, 262144 on kvfuse.bench's "main_fp4" inputs, as GPU us and % of the
    device copy bandwidth (kvfuse.bench.measure_copy_bandwidth, 1 GiB; kvfuse.bench.input_bytes); the
    timing inputs written both ways must agree too.
Exceptions are reported per case; a CUDA error (which ends the CUDA context) stops the run and the
report is written. About 40-80 s on an H200 (most of it compiling).

Usage: python3 benchmarks/gluon_check_main_fp4.py --out DIR     (writes DIR/gluon_check_main_fp4.{json,txt})
       python3 benchmarks/gluon_check_main_fp4.py --prove-encoder  (CPU, minutes: the e2m1 encoder's
       host mirror, gluon_common.e2m1_nibble_mirror, against kvfuse.reference.encode_e2m1 on every
       fp32 input)
"""
import os
import time
import traceback

import torch

import gluon_check_common as common  # first: puts the repository root on sys.path
from gluon_check_common import T0, TIMING_SIZES, log, short
from kvfuse import bench
from kvfuse.formats import MAIN_FP4
from kvfuse.kernels import gluon_main_fp4 as G4

KERNEL = "main_fp4_kernel"
LINES = []                   # what the .txt report holds: every line logged


def say(msg):
    log(msg)
    LINES.append(f"[{time.perf_counter() - T0:6.1f}s] {msg}")


# ------------------------------------------------------------------------------------ switching
def fast_path(on: bool) -> None:
    """Route the public entry point's eligible calls to gluon_main_fp4 (on) or keep the plain kernel."""
    common.fast_path(G4, on)


# ------------------------------------------------------------------------------------ inputs
class Case(common.Case):
    """MAIN_FP4 inputs and a poisoned token-interleaved cache storage (guard bytes before and after)."""
    fmt = MAIN_FP4

    def __init__(self, name, n, block_size=64, token_padding=0, block_padding=0, cache_offset=0, guard=64,
                 expect_fast=True, **inputs):
        self.expect_fast = expect_fast
        super().__init__(name, n, 512, block_size=block_size, **inputs)
        bpt = MAIN_FP4.bytes_per_token                                  # 288
        s1 = -(-(bpt + token_padding) // 32) * 32                       # stride_alignment gcd(32, 288) = 32
        s0 = -(-(block_size * s1 + block_padding) // 32) * 32
        self.place_cache((self.blocks, block_size, 1, bpt), (s0, s1, bpt, 1), cache_offset, guard)

    def row_of_byte(self):
        """storage byte -> the row whose record holds it (-1: none), from the valid slots (288 bytes)."""
        rows, blk, tok = self.valid_slots()
        start = self.cache_offset + blk * self.strides[0] + tok * self.strides[1]
        return self.owner_map(rows, [(start, MAIN_FP4.bytes_per_token)])


# special contents (SPEC §2 edge cases): common.special_rows and these
def special_values(c, g):
    k = common.special_rows(c, g)
    x = c.x
    x[k % 11 == 5, 64:80] *= 2.0 ** 20                                             # one group far above the rest
    x[k % 11 == 6, 448:512] *= 1e-3                                                # a small RoPE tail
    x[k % 11 == 8, 16:32] = 0.0                                                    # an all-zero group (amax floor)
    x[k % 11 == 9, 96:112] *= 2.0 ** -40                                           # a group at the 2^-9 scale floor
    x[k % 11 == 10, :] = (torch.randint(-96, 97, (int((k % 11 == 10).sum()), 512), generator=g,
                                        device=x.device).float() / 16).to(x.dtype)  # grid values: ties after scaling
    common.put_nonfinite(x, k, 512, 470)                                           # -inf in the RoPE tail


def correctness_cases():
    """(name, Case keywords). Each distinct dtype / alignment / stride combination compiles both kernels
    once more, so the variations share a few combinations (the time budget)."""
    return common.base_cases(special_values) + [
        ("special values n=65536, int64 indices", dict(n=65536, seed=10, special=special_values,
                                                       pos_dtype=torch.int64, slot_dtype=torch.int64)),
        ("padded tokens/blocks + guard + cache offset 16, x rows padded, n=4097",
         dict(n=4097, seed=8, token_padding=32, block_padding=40, cache_offset=16, guard=256, x_row_pad=8)),
        ("x 4-byte aligned only (offset 2), cache offset 8, n=300",
         dict(n=300, seed=9, x_offset=2, x_row_pad=2, cache_offset=8)),
        ("cache only 4-byte aligned (offset 4): the plain kernel, n=300",
         dict(n=300, seed=11, cache_offset=4, expect_fast=False)),
    ]


# direct launches outside the launch table (--variants): keyword arguments of gluon_main_fp4_write
VARIANTS = {"w1_r2": dict(num_warps=1, rows_per_warp=2), "w2": dict(num_warps=2),
            "w4_pipe": dict(num_warps=4, pipeline=True), "w1_r2_pipe": dict(num_warps=1, rows_per_warp=2,
                                                                              pipeline=True)}
VARIANT_CASES = ("random n=4097", "special values n=4097")


# ------------------------------------------------------------------------------------ (a)
def compare(c):
    """Write both storages (fast path off, then on); the record of the comparison."""
    rec = dict(case=c.name, n=c.n, status="ok")
    flat_a, cache_a = c.new_cache()
    flat_b, cache_b = c.new_cache()
    fast_path(False)
    common.public_write(c, cache_a)
    launches = common.fast_write_launches(G4, KERNEL, lambda: common.public_write(c, cache_b))
    common.note_fast_path(rec, launches, c.expect_fast)
    return _judge(c, rec, flat_a, flat_b, "fast")


def compare_variant(c, vname, variant):
    """The plain path against a direct launch of a Gluon variant."""
    rec = dict(case=c.name, n=c.n, variant=vname, status="ok")
    flat_a, cache_a = c.new_cache()
    flat_b, cache_b = c.new_cache()
    fast_path(False)
    common.public_write(c, cache_a)
    G4.gluon_main_fp4_write(c.x, c.weight, c.eps, c.positions, c.cos_sin, c.slots, cache_b, **variant)
    torch.cuda.synchronize()
    return _judge(c, rec, flat_a, flat_b, "gluon")


def _judge(c, rec, flat_a, flat_b, label):
    return common.judge_storages(c, rec, flat_a, flat_b, c.row_of_byte(), ("plain", label), first=8,
                                 split_tokens=True)


def _log_record(r, name):
    extra = "" if r.get("equal") else f" {r.get('diff_bytes')} bytes differ, first {r.get('first_diffs', [])[:2]}"
    ran = f"fast={'yes' if r.get('fast_path_ran') else 'no '}" if "variant" not in r else f"{r['variant']:10s}"
    say(f"correctness {name:72s} {ran} {r['status']}{extra}")


def run_correctness(deadline, report, variants):
    records = report.setdefault("correctness", [])
    for name, kw in correctness_cases():
        if time.perf_counter() > deadline:
            records.append(dict(case=name, status="skipped: time budget"))
            continue
        started = time.perf_counter()
        try:
            c = Case(name, **kw)
            r = compare(c)
        except Exception as e:
            r = dict(case=name, n=kw.get("n"), status="error", error=short(e), trace=traceback.format_exc()[-1500:])
            records.append(r)
            say(f"correctness {name:72s} ERROR {short(e)}")
            if common.is_cuda_error(e):
                report["stopped"] = f"CUDA error in {name}"
                return False
            continue
        r["seconds"] = round(time.perf_counter() - started, 2)           # compiles included
        records.append(r)
        _log_record(r, name)
        if variants and name in VARIANT_CASES:
            for vname, v in VARIANTS.items():
                if time.perf_counter() > deadline:
                    records.append(dict(case=name, variant=vname, status="skipped: time budget"))
                    continue
                try:
                    rv = compare_variant(c, vname, v)
                except Exception as e:
                    rv = dict(case=name, variant=vname, status="error", error=short(e))
                    if common.is_cuda_error(e):
                        records.append(rv)
                        report["stopped"] = f"CUDA error in {name} / {vname}"
                        return False
                records.append(rv)
                _log_record(rv, name)
        del c
        torch.cuda.empty_cache()
    return True


# ------------------------------------------------------------------------------------ (b)
def run_timing(copy_gbps, deadline, report):
    records = report.setdefault("timing", [])
    timer = bench.CudaTimer(graph_calls=20, target_s=0.03, eager_target_s=0.003, max_reps=30)
    wl = bench.WORKLOADS["main_fp4"]
    for n in TIMING_SIZES:
        if time.perf_counter() > deadline:
            records.append(dict(n=n, status="skipped: time budget"))
            continue
        try:
            inp = bench.build_inputs(wl, n, common.DEVICE)
            nbytes = bench.input_bytes(wl, inp)["total"]
            call = bench.fused_call(wl, inp)
            # the timing inputs written both ways must agree too
            diff_bytes, launches = common.written_both_ways(G4, KERNEL, inp, call)
            if diff_bytes or not launches:
                records.append(dict(n=n, status="MISMATCH on the timing inputs" if diff_bytes else
                                    "FAST PATH NOT TAKEN on the timing inputs", diff_bytes=diff_bytes))
                say(f"timing n={n}: {records[-1]['status']} ({diff_bytes} bytes differ, {launches} Gluon launches)")
            row = dict(n=n, status="ok", bytes=nbytes, launch=G4.launch_table(n),
                       **common.plain_vs_fast(G4, timer, call, nbytes, copy_gbps))
            records.append(row)
            say(f"timing MAIN_FP4 n={n:7d} {common.plain_vs_fast_text(row)}  (launch table {row['launch']})")
            del inp, call
        except Exception as e:
            fast_path(False)
            records.append(dict(n=n, status="error", error=short(e)))
            say(f"timing n={n}: ERROR {short(e)}")
            if common.is_cuda_error(e):
                report["stopped"] = f"CUDA error timing n={n}"
                return False
            bench._recover_cuda()
        torch.cuda.empty_cache()
    return True


# ------------------------------------------------------------------------------------ proof (CPU)
def prove_encoder(report):
    """gluon_check_common.prove_e2m1_nibble: the e2m1 encoder's host mirror against
    kvfuse.reference.encode_e2m1 on every fp32 pattern (NaN left out: SPEC §2 leaves their group free)."""
    bad = report["encoder_differing"] = common.prove_e2m1_nibble(say)
    say(f"e2m1 encoder (e2m1_nibble_mirror): {bad} differing of 2^32 fp32 patterns (NaN left out)")


def main():
    p = common.arg_parser(__doc__, "gluon-check-main-fp4", 110.0)
    p.add_argument("--variants", action="store_true", help="direct launches of variants outside the launch table")
    p.add_argument("--prove-encoder", action="store_true", help="CPU only: the exhaustive encoder proof")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    sizes = (1, 3, 256, 300, 4096, 4097, 65536, 262144)
    report = common.new_report(format=MAIN_FP4.name, min_rows=G4.MIN_ROWS,
                               launch_table={n: G4.launch_table(n) for n in sizes})
    if a.prove_encoder:
        prove_encoder(report)
    elif common.device_ready(report, ", MAIN_FP4"):
        deadline = T0 + a.budget_s
        copy = common.copy_bandwidth(report, nbytes=1 << 30)
        going = True
        if not a.skip_correctness:
            # no correctness case starts after ~65% of the budget: timing must still run
            going = run_correctness(T0 + 0.65 * a.budget_s, report, a.variants)
        if going and not a.skip_timing:
            run_timing(copy.get("copy_GBps"), deadline, report)
        fast_path(False)
        cor = report.get("correctness", [])
        bad = [r for r in cor if r.get("status") != "ok"]
        report["summary"] = dict(
            comparisons=len(cor), equal=sum(1 for r in cor if r.get("equal")),
            fast_path_ran=sum(1 for r in cor if r.get("fast_path_ran")),
            not_ok=[(r.get("case"), r.get("variant"), r.get("status"), r.get("diff_bytes")) for r in bad],
            speedups={f"n={r['n']}": round(r["speedup"], 3) for r in report.get("timing", [])
                      if r.get("status") == "ok"})
        s = report["summary"]
        say(f"summary: {s['equal']} of {s['comparisons']} comparisons byte-equal, fast path ran in "
            f"{s['fast_path_ran']}; not ok: {s['not_ok']}; speedups {s['speedups']}")
    common.write_report(report, a.out, "gluon_check_main_fp4.json")
    meta = report["meta"]
    head = [f"gluon_check_main_fp4: {meta.get('device', 'no device')}, torch {meta['torch']}, triton {meta['triton']}, "
            f"copy {report.get('copy', {}).get('copy_GBps', float('nan')):.0f} GB/s, "
            f"launch table {meta['launch_table']}"]
    with open(os.path.join(a.out, "gluon_check_main_fp4.txt"), "w") as f:
        f.write("\n".join(head + LINES + [f"status: {report.get('status', 'ran')}"]) + "\n")


if __name__ == "__main__":
    main()
