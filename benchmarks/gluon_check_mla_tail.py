"""H200 check of the Gluon FlashMLA fast path (kvfuse/kernels/gluon_mla_tail.py) through kvfuse's
public call, against the plain Triton path (byte-exact to the reference: docs/performance.md).

The fast path is switched by monkeypatching ``kvfuse.kernels.fused.FAST_PATHS = (gluon_mla_tail,)``
and ``GLUON = True`` (off: ``GLUON = False``), the plan cache cleared at every switch.
(a) correctness, per format (FLASHMLA_V32, FLASHMLA_MODEL1): for each case two storages poisoned
    with the same random bytes (guard bytes before and after the cache) are written through the
    public call, fast path off and on; the WHOLE storages are compared (torch.equal; else the number
    of differing bytes, where they are, and whether they all lie in records of rows holding inf/NaN
    inputs, where SPEC §2 allows any bytes). A launch counter on the Gluon kernel says whether the
    fast path really ran. Cases: n 1, 3, 300, 4097, 65536; special values (zero rows, huge, bf16
    subnormals, e4m3 ties, one inf, one NaN, -inf in the RoPE tail); invalid slots (-1, >= capacity)
    and positions outside [0, P); padded token / block strides; guard bytes; a 4-byte-aligned-only
    case (x and cache pointers, int64 and strided indices, fp32 weight, bf16 cos/sin, block size 24).
(b) timing: CUDA-graph replay medians (kvfuse.bench.CudaTimer) of the public call, fast path off and
    on, at n = 1, 256, 4096, 65536, 262144 on kvfuse.bench's inputs, as GPU us and % of the
    device-to-device copy bandwidth (kvfuse.bench.measure_copy_bandwidth on 1 GiB, input_bytes).
Few compiled variants (the launch table's configurations and one alignment variant): about a
minute on the H200. A CUDA error (an illegal address ends the context) stops the run; the report
is written anyway. Usage: python3 benchmarks/gluon_check_mla_tail.py --out DIR
(writes DIR/gluon_check_mla_tail.json).
"""
import os
import time
import traceback

import torch

import gluon_check_common as common  # first: puts the repository root on sys.path
from gluon_check_common import DEVICE, T0, TIMING_SIZES, log, short
import kvfuse
from kvfuse import bench
from kvfuse.formats import FLASHMLA_MODEL1, FLASHMLA_V32
from kvfuse.kernels import fused
from kvfuse.kernels import gluon_mla_tail as mla

FORMATS = {"FLASHMLA_V32": (FLASHMLA_V32, "flashmla_v32"), "FLASHMLA_MODEL1": (FLASHMLA_MODEL1, "flashmla_model1")}


def cuda_alive() -> bool:
    """False once the CUDA context is lost (an illegal address): nothing more can run."""
    try:
        torch.cuda.synchronize()
        return True
    except Exception:
        return False


# ------------------------------------------------------------------------------------------ switching
def fast_path(on: bool) -> None:
    """Route the public call to the Gluon FlashMLA path (on) or the plain kernel (off)."""
    common.fast_path(mla, on)


# ------------------------------------------------------------------------------------------ inputs
class Case(common.Case):
    """One set of inputs for a format and a poisoned cache storage (guard bytes before and after)."""

    def __init__(self, fmt, name, n, block_size=64, token_padding=0, block_padding=0, cache_offset=0, guard=64,
                 **inputs):
        self.fmt = fmt
        super().__init__(name, n, fmt.head_dim, block_size=block_size, **inputs)
        # the cache's geometry as kvfuse allocates it
        pad = dict(token_padding=token_padding) if fmt.token_interleaved else {}
        meta = fmt.allocate(self.blocks, block_size, block_padding=block_padding, device="meta", **pad)
        self.place_cache(meta.shape, meta.stride(), cache_offset, guard)

    def row_of_byte(self, cache):
        """storage byte -> the row whose record owns it (-1: no row): data, exact scales and tail of
        the valid slots."""
        fmt = self.fmt
        a = fmt.addressing_for(cache)
        rows, blk, tok = self.valid_slots()
        base = self.cache_offset + blk * self.strides[0]
        data = base + tok * a.data_token_stride + a.data_offset
        sf = base + tok * a.sf_token_stride + a.sf_offset
        return self.owner_map(rows, [(data, fmt.quant_bytes), (sf, fmt.sf_exact_bytes),
                                     (data - a.data_offset + a.tail_offset, 2 * fmt.bf16_tail)])


# special contents (SPEC §2 edge cases): common.special_rows and these
def special_values(c, g):
    k = common.special_rows(c, g)
    x = c.x
    qd = x.shape[1] - 64                                                           # the tail = RoPE columns
    x[k % 11 == 5, 64:96] *= 2.0 ** 20                                            # one group far above the rest
    x[k % 11 == 6, qd:] *= 1e-3                                                    # a small RoPE tail
    signed = k % 11 == 8
    x[signed, qd:] = 0.0
    x[signed, qd::3] = -0.0                                                        # signed zeros in the tail
    common.put_nonfinite(x, k, qd, qd + 22, (9, 10, 20))                           # -inf in the RoPE tail


# ------------------------------------------------------------------------------------------ (a)
def compare(c, counter):
    """Write both storages (fast path off, on); return the record of the comparison."""
    rec = dict(format=c.fmt.name, case=c.name, n=c.n, status="ok")
    flat_a, cache_a = c.new_cache()
    flat_b, cache_b = c.new_cache()
    fast_path(False)
    common.public_write(c, cache_a)
    fast_path(True)
    before = counter.launches
    common.public_write(c, cache_b)
    torch.cuda.synchronize()
    rec["gluon_launches"] = counter.launches - before
    common.judge_storages(c, rec, flat_a, flat_b, c.row_of_byte(cache_a), ("off", "on"))
    if rec["gluon_launches"] == 0:
        rec["status"] = "FAST PATH NOT TAKEN" if rec["status"] == "ok" else rec["status"] + "; FAST PATH NOT TAKEN"
    return rec


def correctness_cases():
    """(name, Case keyword arguments): the launch table's three configurations (n <= 512, <= 16384,
    above) on the benchmark's dtypes, plus one 4-byte-alignment variant."""
    return [
        ("n=1", dict(n=1, seed=1)),
        ("n=3", dict(n=3, seed=2)),
        ("n=300, half the slots invalid, half the positions out of range, P=3",
         dict(n=300, seed=3, invalid_slots=0.5, bad_positions=0.5, max_position=3)),
        ("n=4097 special values", dict(n=4097, seed=4, special=special_values)),
        ("n=4097 padded strides + guard bytes", dict(n=4097, seed=5, token_padding=16, block_padding=96,
                                                     cache_offset=16, guard=256, x_row_pad=32)),
        ("n=65536", dict(n=65536, seed=6)),
        ("n=777 4-byte alignment only, int64 strided indices, fp32 weight, bf16 cos/sin, block 24, special",
         dict(n=777, seed=7, x_row_pad=2, x_offset=2, cache_offset=4, pos_dtype=torch.int64,
              slot_dtype=torch.int64, index_stride=3, w_dtype=torch.float32, cs_dtype=torch.bfloat16,
              block_size=24, eps=1e-5, special=special_values)),
    ]


def run_correctness(counter, deadline, state):
    records = []
    for name, kw in correctness_cases():           # formats inside: a time cut leaves both formats covered
        for fname, (fmt, _) in FORMATS.items():
            if state["dead"]:
                records.append(dict(format=fname, case=name, status="skipped: CUDA context lost"))
                continue
            if time.perf_counter() > deadline:
                records.append(dict(format=fname, case=name, status="skipped: time budget"))
                continue
            try:
                c = Case(fmt, name, **kw)
                r = compare(c, counter)
            except Exception as e:
                r = dict(format=fname, case=name, status="error", error=short(e), trace=traceback.format_exc()[-1500:])
                state["dead"] = not cuda_alive()
            records.append(r)
            extra = "" if r.get("equal") else (f" {r.get('diff_bytes', '')} bytes differ "
                                               f"{(r.get('first_diffs') or [])[:2]} {r.get('error', '')}")
            log(f"correctness {fname:15s} {name[:60]:60s} {r['status']} (gluon launches "
                f"{r.get('gluon_launches', '-')}){extra}")
            c = None
            if not state["dead"]:
                torch.cuda.empty_cache()
    return records


# ------------------------------------------------------------------------------------------ (b)
def run_timing(copy_gbps, deadline, state):
    """Graph-replay medians of the public call, fast path off and on; a launch counter wraps the Gluon
    kernel during the equality pre-check only (the timed calls launch the kernel itself)."""
    timer = bench.CudaTimer(graph_calls=20, target_s=0.02, eager_target_s=0.002, max_reps=25)
    records = []
    for n in TIMING_SIZES:                         # formats inside: a time cut leaves both formats covered
        for fname, (fmt, wl_name) in FORMATS.items():
            wl = bench.WORKLOADS[wl_name]
            if state["dead"] or time.perf_counter() > deadline:
                records.append(dict(format=fname, n=n, status="skipped: " + ("CUDA context lost" if state["dead"]
                                                                           else "time budget")))
                continue
            try:
                inp = bench.build_inputs(wl, n, DEVICE)
                nbytes = bench.input_bytes(wl, inp)["total"]
                call = bench.fused_call(wl, inp)
                # the timing inputs written both ways must agree as well
                diff_bytes, launches = common.written_both_ways(mla, "mla_tail_kernel", inp, call)
                if not launches:
                    records.append(dict(format=fname, n=n, peer="gluon", status="FAST PATH NOT TAKEN"))
                    log(f"timing {fname} n={n}: FAST PATH NOT TAKEN")
                if diff_bytes:
                    records.append(dict(format=fname, n=n, peer="gluon", status="MISMATCH on the timing inputs",
                                        diff_bytes=diff_bytes))
                    log(f"timing {fname} n={n}: MISMATCH on the timing inputs")
            except Exception as e:
                records.append(dict(format=fname, n=n, status="error before timing", error=short(e)))
                log(f"timing {fname} n={n}: {short(e)}")
                state["dead"] = not cuda_alive()
                continue
            for peer, on in (("plain", False), ("gluon", True)):
                if time.perf_counter() > deadline + 5:      # the pair may finish a little past the budget
                    records.append(dict(format=fname, n=n, peer=peer, status="skipped: time budget"))
                    continue
                try:
                    fast_path(on)
                    r = dict(format=fname, n=n, peer=peer, status="ok", bytes=nbytes,
                             **common.timed(timer, call, nbytes, copy_gbps))
                except Exception as e:
                    r = dict(format=fname, n=n, peer=peer, status="error", error=short(e))
                    state["dead"] = not cuda_alive()
                records.append(r)
                if r["status"] == "ok":
                    log(f"timing {fname:15s} n={n:7d} {peer:6s} {r['gpu_us']:9.2f} us  {common.pct_text(r)} of copy "
                        f"({r['method']})")
                else:
                    log(f"timing {fname:15s} n={n:7d} {peer:6s} {r['status']} {r.get('error', '')}")
                if state["dead"]:
                    break
            del inp, call
            if not state["dead"]:
                torch.cuda.empty_cache()
    return records


def main():
    a = common.arg_parser(__doc__, "gluon-check", 70.0).parse_args()
    os.makedirs(a.out, exist_ok=True)
    report = common.new_report(launch_table={n: mla.launch_table(n) for n in (1, 3, 300, 4097, 65536, 262144)})
    saved = (fused.FAST_PATHS, fused.GLUON)
    if common.device_ready(report):
        state = dict(dead=False)
        copy = common.copy_bandwidth(report, nbytes=1 << 30)
        if not a.skip_correctness:
            # correctness starts no case after 60% of the budget: timing must still run
            with common.counting(mla, "mla_tail_kernel") as counter:   # timing runs the kernel itself
                report["correctness"] = run_correctness(counter, T0 + 0.6 * a.budget_s, state)
        try:
            if not a.skip_timing and not state["dead"]:
                report["timing"] = run_timing(copy.get("copy_GBps"), T0 + a.budget_s, state)
        finally:
            fused.FAST_PATHS, fused.GLUON = saved
            kvfuse.plan.clear_plan_cache()
        report["cuda_context_lost"] = state["dead"]
        corr = report.get("correctness", [])
        bad = [r for r in corr if r.get("status") != "ok"]
        report["summary"] = dict(
            comparisons=len(corr), equal=sum(1 for r in corr if r.get("equal")),
            fast_path_taken=sum(1 for r in corr if r.get("gluon_launches")),
            not_ok=[(r.get("format"), r.get("case"), r.get("status"), r.get("diff_bytes")) for r in bad])
        log(f"summary: {report['summary']['equal']} of {report['summary']['comparisons']} whole-storage comparisons "
            f"byte-equal, fast path taken in {report['summary']['fast_path_taken']}; others: "
            f"{report['summary']['not_ok']}")
        times = {(r["format"], r["n"], r["peer"]): r for r in report.get("timing", []) if r.get("status") == "ok"}
        for fname in FORMATS:
            for n in TIMING_SIZES:
                pl, gl = times.get((fname, n, "plain")), times.get((fname, n, "gluon"))
                if pl and gl:
                    log(f"{fname:15s} n={n:7d}: plain {pl['gpu_us']:8.2f} us ({pl['pct_copy'] or 0:5.1f}%), gluon "
                        f"{gl['gpu_us']:8.2f} us ({gl['pct_copy'] or 0:5.1f}%): {pl['gpu_us'] / gl['gpu_us']:.2f}x")
    common.write_report(report, a.out, "gluon_check_mla_tail.json")


if __name__ == "__main__":
    main()
