"""H200 check of the Gluon MAIN_FP8 fast path (kvfuse/kernels/gluon_main_fp8.py) against kvfuse's
plain Triton path, which is byte-exact to the reference (docs/performance.md).

(a) correctness: for each case, two caches poisoned with the same random bytes (guard bytes around
    the cache included) are written, one by the public kvfuse call (Triton backend), one by the
    Gluon kernel; the WHOLE storages are compared (number of differing bytes, where they are, and
    whether they all lie in rows holding inf/NaN inputs, where SPEC §2 allows any bytes);
(b) timing: CUDA-graph replay (kvfuse.bench.CudaTimer, median per call) of the plain path and of
    several Gluon launch variants on kvfuse.bench's MAIN_FP8 inputs, as GPU us and % of the
    device-to-device copy bandwidth (kvfuse.bench.measure_copy_bandwidth / input_bytes).
A failing case or variant is reported and the run goes on (an illegal memory access, though, ends
the CUDA context: what follows it errors too). About 2-4 minutes (most of it compiling variants).
Usage: python3 benchmarks/gluon_check.py --out DIR   (writes DIR/gluon_check.json)
"""
import os
import time
import traceback

import torch

import gluon_check_common as common  # first: puts the repository root on sys.path
from gluon_check_common import EPS, T0, TIMING_SIZES, log, short
from kvfuse import bench
from kvfuse.formats import MAIN_FP8
from kvfuse.kernels import gluon_main_fp8 as gluon_fp8

# Gluon launch variants (keyword arguments of gluon_main_fp8_write)
VARIANTS = {
    "w1": dict(num_warps=1),
    "w1_pipe": dict(num_warps=1, pipeline=True),
    "w1_r2": dict(num_warps=1, rows_per_warp=2),
    "w2": dict(num_warps=2),
    "w4": dict(num_warps=4),
    "w4_pipe": dict(num_warps=4, pipeline=True),
}
CORRECTNESS_SIZES = (1, 3, 256, 4097, 65536, 262144)


# ------------------------------------------------------------------------------------------ inputs
class Case(common.Case):
    """MAIN_FP8 inputs and a poisoned cache storage (guard bytes before and after the cache)."""
    fmt = MAIN_FP8

    def __init__(self, name, n, block_size=64, token_padding=0, block_padding=0, cache_offset=0, guard=64, **inputs):
        super().__init__(name, n, 512, block_size=block_size, **inputs)
        # the records 4-byte aligned at least
        s1 = -(-(532 + token_padding) // 4) * 4
        s0 = -(-(block_size * s1 + block_padding) // 32) * 32
        self.place_cache((self.blocks, block_size, 1, 532), (s0, s1, 532, 1), cache_offset, guard)

    def row_of_byte(self):
        """storage byte -> the row that owns it (-1: no row), from the valid slots (528 record bytes)."""
        rows, blk, tok = self.valid_slots()
        return self.owner_map(rows, [(self.cache_offset + blk * self.strides[0] + tok * self.strides[1], 528)])


def gluon_write(c, cache, variant):
    gluon_fp8.gluon_main_fp8_write(c.x, c.weight, c.eps, c.positions, c.cos_sin, c.slots, cache, **variant)


# special contents (SPEC §2 edge cases): common.special_rows and these
def special_values(c, g):
    k = common.special_rows(c, g)
    x = c.x
    x[k % 11 == 5, 64:96] *= 2.0 ** 20                                            # one group far above the rest
    x[k % 11 == 6, 448:512] *= 1e-3                                                # a small RoPE tail
    common.put_nonfinite(x, k, 512, 470, (8, 9, 10))                              # -inf in the RoPE tail


# ------------------------------------------------------------------------------------------ (a)
def compare(c, variant_name, variant):
    """Write both caches; return the record of the comparison."""
    rec = dict(case=c.name, n=c.n, variant=variant_name, status="ok")
    flat_a, cache_a = c.new_cache()
    flat_b, cache_b = c.new_cache()
    common.public_write(c, cache_a)
    gluon_write(c, cache_b, variant)
    torch.cuda.synchronize()
    return common.judge_storages(c, rec, flat_a, flat_b, c.row_of_byte(), ("plain", "gluon"), split_tokens=True)


def correctness_cases():
    cases = []
    for i, n in enumerate(CORRECTNESS_SIZES):
        cases.append((f"random n={n}", dict(n=n, seed=i, pos_dtype=torch.int64 if i % 2 else torch.int32,
                                            slot_dtype=torch.int64 if i % 3 == 0 else torch.int32)))
    cases += [
        ("special values", dict(n=4097, seed=11, special=special_values)),
        ("special values, fp32 weight, bf16 cos_sin", dict(n=1500, seed=12, special=special_values,
                                                          w_dtype=torch.float32, cs_dtype=torch.bfloat16)),
        ("padded strides + guard bytes", dict(n=4097, seed=13, token_padding=12, block_padding=40, cache_offset=4,
                                              guard=256, x_row_pad=8, x_offset=2)),
        ("x 4-byte aligned only, odd token stride/16", dict(n=777, seed=14, x_row_pad=2, x_offset=2, token_padding=4,
                                                           cache_offset=36)),
        ("block_size 24 (division), int64 indices", dict(n=3000, seed=15, block_size=24, pos_dtype=torch.int64,
                                                         slot_dtype=torch.int64)),
        ("block_size 1", dict(n=257, seed=16, block_size=1)),
        ("strided positions/slots, eps 1e-5", dict(n=1000, seed=17, index_stride=3, eps=1e-5)),
        ("many invalid slots and positions", dict(n=2048, seed=18, invalid_slots=0.5, bad_positions=0.5)),
        ("tiny cos/sin table (P=3)", dict(n=500, seed=19, max_position=3, bad_positions=0.0)),
    ]
    return cases


# the launch variants each case runs (all variants on a few cases; compiling every one costs time)
ALL_VARIANT_CASES = ("random n=65536", "special values", "padded strides + guard bytes")


def run_correctness(deadline):
    records = []
    for name, kw in correctness_cases():
        if time.perf_counter() > deadline:
            records.append(dict(case=name, status="skipped: time budget"))
            continue
        try:
            c = Case(name, **kw)
        except Exception as e:
            records.append(dict(case=name, status="error building inputs", error=short(e)))
            log(f"correctness {name}: error building inputs {short(e)}")
            continue
        names = VARIANTS if name in ALL_VARIANT_CASES else ("w1", "w1_pipe")
        for vname in names:
            try:
                r = compare(c, vname, VARIANTS[vname])
            except Exception as e:
                r = dict(case=name, n=c.n, variant=vname, status="error", error=short(e),
                         trace=traceback.format_exc()[-1500:])
                torch.cuda.synchronize()
            records.append(r)
            extra = "" if r.get("equal") else f" {r.get('diff_bytes', '')} bytes differ {r.get('first_diffs', '')[:2] if r.get('first_diffs') else ''} {r.get('error', '')}"
            log(f"correctness {name:45s} {vname:8s} {r['status']}{extra}")
        del c
        torch.cuda.empty_cache()
    return records


# ------------------------------------------------------------------------------------------ (b)
def gluon_call(inp, variant):
    """One Gluon write of kvfuse.bench's inputs (what the fused peer computes)."""
    def call():
        gluon_fp8.gluon_main_fp8_write(inp.x, inp.weight, EPS, inp.positions, inp.cos_sin, inp.slots, inp.cache,
                                       **variant)
    return call


def run_timing(copy_gbps, deadline):
    wl = bench.WORKLOADS["main_fp8"]
    timer = bench.CudaTimer(graph_calls=20, target_s=0.03, eager_target_s=0.003, max_reps=30)
    records = []
    for n in TIMING_SIZES:
        if time.perf_counter() > deadline:
            records.append(dict(n=n, status="skipped: time budget"))
            continue
        try:
            inp = bench.build_inputs(wl, n, "cuda")
            nbytes = bench.input_bytes(wl, inp)["total"]
        except Exception as e:
            records.append(dict(n=n, status="error building inputs", error=short(e)))
            continue
        plain = bench.fused_call(wl, inp)
        peers = [("plain", plain)]
        for vname, v in VARIANTS.items():
            peers.append((f"gluon_{vname}", gluon_call(inp, v)))
        # the timing inputs written by both paths must agree as well
        try:
            inp.cache.fill_(0x5A)                      # reserved bytes and padding keep it
            plain()
            ref = inp.cache.clone()
            for vname, v in VARIANTS.items():
                inp.cache.fill_(0x5A)
                gluon_call(inp, v)()
                if not torch.equal(ref, inp.cache):
                    records.append(dict(n=n, peer=f"gluon_{vname}", status="MISMATCH on the timing inputs",
                                        diff_bytes=int((ref != inp.cache).sum())))
                    log(f"timing n={n} gluon_{vname}: MISMATCH on the timing inputs")
        except Exception as e:
            log(f"timing n={n}: equality pre-check failed: {short(e)}")
        for peer, fn in peers:
            if time.perf_counter() > deadline:
                records.append(dict(n=n, peer=peer, status="skipped: time budget"))
                continue
            try:
                r = dict(n=n, peer=peer, status="ok", bytes=nbytes, **common.timed(timer, fn, nbytes, copy_gbps))
            except Exception as e:
                r = dict(n=n, peer=peer, status="error", error=short(e))
                bench._recover_cuda()
            records.append(r)
            if r["status"] == "ok":
                log(f"timing n={n:7d} {peer:14s} {r['gpu_us']:9.2f} us  {common.pct_text(r)} of copy  ({r['method']})")
            else:
                log(f"timing n={n:7d} {peer:14s} {r['status']} {r.get('error', '')}")
        del inp, peers, plain
        torch.cuda.empty_cache()
    return records


def main():
    a = common.arg_parser(__doc__, "gluon-check", 200.0).parse_args()
    os.makedirs(a.out, exist_ok=True)
    report = common.new_report(variants=VARIANTS)
    if common.device_ready(report):
        deadline = T0 + a.budget_s
        copy = common.copy_bandwidth(report)
        if not a.skip_correctness:
            # correctness starts no case after ~65% of the budget: timing must still run
            report["correctness"] = run_correctness(T0 + 0.65 * a.budget_s)
        if not a.skip_timing:
            report["timing"] = run_timing(copy.get("copy_GBps"), deadline)
        bad = [r for r in report.get("correctness", []) if r.get("status") not in ("ok",)]
        report["summary"] = dict(
            cases=len(report.get("correctness", [])),
            equal=sum(1 for r in report.get("correctness", []) if r.get("equal")),
            not_equal_or_error=[(r.get("case"), r.get("variant"), r.get("status"), r.get("diff_bytes"))
                                for r in bad])
        log(f"summary: {report['summary']['equal']} of {report['summary']['cases']} comparisons byte-equal; "
            f"others: {report['summary']['not_equal_or_error']}")
        best = {}
        for r in report.get("timing", []):
            if r.get("status") == "ok":
                key = (r["n"], "plain" if r["peer"] == "plain" else "gluon")
                if key not in best or r["gpu_us"] < best[key]["gpu_us"]:
                    best[key] = r
        for n in TIMING_SIZES:
            pl, gl = best.get((n, "plain")), best.get((n, "gluon"))
            if pl and gl:
                log(f"n={n:7d}: plain {pl['gpu_us']:8.2f} us; best gluon {gl['peer']} {gl['gpu_us']:8.2f} us "
                    f"({pl['gpu_us'] / gl['gpu_us']:.2f}x, {gl['pct_copy'] or 0:.1f}% of copy)")
    common.write_report(report, a.out, "gluon_check.json")


if __name__ == "__main__":
    main()
