"""H200 check of the Gluon MAIN_FP8 fast path (kvfuse/kernels/gluon_main_fp8.py) against kvfuse's
plain Triton path, which is byte-exact to the reference (DEVICE_NOTES.md).

(a) correctness: for each case, two caches poisoned with the same random bytes (guard bytes around
    the cache included) are written, one by the public kvfuse call (Triton backend), one by the
    Gluon kernel; the WHOLE storages are compared (number of differing bytes, where they are, and
    whether they all lie in rows holding inf/NaN inputs, where SPEC §2 allows any bytes);
(b) timing: CUDA-graph replay (kvfuse.bench.CudaTimer, median per call) of the plain path and of
    several Gluon launch variants on kvfuse.bench's MAIN_FP8 inputs, as GPU us and % of the
    device-to-device copy bandwidth (kvfuse.bench.measure_copy_bandwidth / moved_bytes).
A failing case or variant is reported and the run goes on (an illegal memory access, though, ends
the CUDA context: what follows it errors too). About 2-4 minutes (most of it compiling variants).
Usage: python3 benchmarks/gluon_check.py --out DIR   (writes DIR/gluon_check.json)
"""
import argparse
import json
import os
import platform
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import kvfuse  # noqa: E402
from kvfuse import bench  # noqa: E402
from kvfuse.formats import MAIN_FP8  # noqa: E402
from kvfuse.kernels import gluon_main_fp8 as gluon_fp8  # noqa: E402

EPS = bench.EPS
# Gluon launch variants (keyword arguments of gluon_main_fp8_write)
VARIANTS = {
    "w1": dict(num_warps=1),
    "w1_pipe": dict(num_warps=1, pipeline=True),
    "w1_r2": dict(num_warps=1, rows_per_warp=2),
    "w2": dict(num_warps=2),
    "w4": dict(num_warps=4),
    "w4_pipe": dict(num_warps=4, pipeline=True),
}
DEVICE = "cuda"
TIMING_SIZES = (1, 256, 4096, 65536, 262144)
CORRECTNESS_SIZES = (1, 3, 256, 4097, 65536, 262144)
T0 = time.perf_counter()


def log(msg):
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def short(e, limit=400):
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + "..."


# ------------------------------------------------------------------------------------------ inputs
class Case:
    """One set of inputs and a poisoned cache storage (with guard bytes before and after the cache)."""

    def __init__(self, name, n, seed=0, block_size=64, extra_blocks=2, token_padding=0, block_padding=0,
                 cache_offset=0, guard=64, x_row_pad=0, x_offset=0, w_dtype=torch.bfloat16,
                 cs_dtype=torch.float32, pos_dtype=torch.int32, slot_dtype=torch.int32, index_stride=1,
                 invalid_slots=0.05, bad_positions=0.03, max_position=bench.MAX_POSITION, eps=EPS, special=None):
        dev = DEVICE
        g = torch.Generator(device=dev)
        g.manual_seed(seed * 7919 + n)
        self.name, self.n, self.eps = name, n, eps
        # x [n, 512] bf16: normal values at per-row scales 2^-8 .. 2^8, inside a padded / shifted buffer
        row = 512 + x_row_pad
        xbuf = torch.empty(x_offset + n * row, dtype=torch.bfloat16, device=dev)
        self.x = torch.as_strided(xbuf, (n, 512), (row, 1), x_offset)
        scale = torch.exp2(torch.randint(-8, 9, (n, 1), generator=g, device=dev).float())
        self.x.copy_((torch.randn(n, 512, generator=g, device=dev) * scale).to(torch.bfloat16))
        self.nonfinite_rows = torch.zeros(n, dtype=torch.bool, device=dev)
        if special is not None:
            special(self, g)
        self.nonfinite_rows |= ~torch.isfinite(self.x.float()).all(dim=1)
        self.weight = (torch.randn(512, generator=g, device=dev) * 0.2 + 1.0).to(w_dtype)
        self.cos_sin = bench.rope_table(max_position, 64, dev).to(cs_dtype)
        pos = torch.randint(0, max_position, (n,), generator=g, device=dev)
        bad = torch.rand(n, generator=g, device=dev) < bad_positions
        pos = torch.where(bad, torch.where(torch.rand(n, generator=g, device=dev) < 0.5, -1 - pos, pos + max_position),
                          pos)
        self.positions = self._strided(pos.to(pos_dtype), index_stride)
        blocks = max(1, -(-n // block_size)) + extra_blocks
        self.capacity = blocks * block_size
        slots = torch.randperm(self.capacity, generator=g, device=dev)[:n]
        bad = torch.rand(n, generator=g, device=dev) < invalid_slots
        out = torch.where(torch.rand(n, generator=g, device=dev) < 0.5, torch.full_like(slots, -1),
                          self.capacity + torch.randint(0, 1000, (n,), generator=g, device=dev))
        self.slots = self._strided(torch.where(bad, out, slots).to(slot_dtype), index_stride)
        # the cache inside a poisoned storage: guard bytes, then the records (4-byte aligned at least)
        s1 = -(-(532 + token_padding) // 4) * 4
        s0 = -(-(block_size * s1 + block_padding) // 32) * 32
        self.cache_offset = cache_offset
        self.storage_bytes = cache_offset + blocks * s0 + guard
        self.shape, self.strides = (blocks, block_size, 1, 532), (s0, s1, 532, 1)
        self.poison = torch.randint(0, 256, (self.storage_bytes,), generator=g, device=dev, dtype=torch.uint8)

    @staticmethod
    def _strided(t, stride):
        if stride == 1:
            return t
        buf = torch.zeros(t.shape[0] * stride, dtype=t.dtype, device=t.device)
        view = buf[::stride]
        view.copy_(t)
        return view

    def new_cache(self):
        """(flat storage, cache view) holding the poison."""
        flat = self.poison.clone()
        return flat, torch.as_strided(flat, self.shape, self.strides, self.cache_offset)

    def row_of_byte(self):
        """storage byte -> the row that owns it (-1: no row), from the valid slots."""
        owner = torch.full((self.storage_bytes,), -1, dtype=torch.int64, device=self.x.device)
        s = self.slots.long()
        ok = (s >= 0) & (s < self.capacity)
        rows = torch.arange(self.n, device=s.device)[ok]
        s = s[ok]
        bs = self.shape[1]
        base = self.cache_offset + (s // bs) * self.strides[0] + (s % bs) * self.strides[1]
        idx = base[:, None] + torch.arange(528, device=s.device)
        owner[idx.flatten()] = rows.repeat_interleave(528)
        return owner


def plain_write(c, cache):
    kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(
        c.x, kvfuse.NormArgs(c.weight, c.eps), kvfuse.RopeArgs(c.positions, c.cos_sin, 64, True), None,
        kvfuse.CastArgs.from_cache_format(MAIN_FP8), kvfuse.KVCacheOutArgs(cache, c.slots, layout=MAIN_FP8))


def gluon_write(c, cache, variant):
    gluon_fp8.gluon_main_fp8_write(c.x, c.weight, c.eps, c.positions, c.cos_sin, c.slots, cache, **variant)


# special contents (SPEC §2 edge cases); each marks nothing itself: non-finite rows are found from x
def special_values(c, g):
    n, x, dev = c.n, c.x, c.x.device
    k = torch.arange(n, device=dev)
    x[k % 11 == 0] = 0.0                                                           # zero rows
    x[k % 11 == 1] = (torch.randn(int((k % 11 == 1).sum()), 512, generator=g, device=dev) * 1e30).to(x.dtype)
    x[k % 11 == 2] = (torch.randn(int((k % 11 == 2).sum()), 512, generator=g, device=dev) * 1e38).to(x.dtype)
    sub = (torch.randint(-127, 128, (int((k % 11 == 3).sum()), 512), generator=g, device=dev).float()
           * 2.0 ** -133).to(x.dtype)                                              # bf16 subnormals
    x[k % 11 == 3] = sub
    ties = torch.randint(-64, 65, (int((k % 11 == 4).sum()), 512), generator=g, device=dev).float() / 16
    x[k % 11 == 4] = ties.to(x.dtype)                                              # e4m3 rounding ties
    mixed = k % 11 == 5                                                            # one group far above the rest
    x[mixed, 64:96] *= 2.0 ** 20
    x[k % 11 == 6, 448:512] *= 1e-3                                                # a small RoPE tail
    tiny = k % 11 == 7
    x[tiny] = (x[tiny].float() * 2.0 ** -120).to(x.dtype)                          # mean + eps dominated by eps
    inf_rows = (k % 97 == 8).nonzero().flatten()
    x[inf_rows, (inf_rows * 37) % 512] = float("inf")                              # an inf in one group
    nan_rows = (k % 97 == 9).nonzero().flatten()
    x[nan_rows, (nan_rows * 53) % 512] = float("nan")                              # a NaN in one group
    ninf = (k % 97 == 10).nonzero().flatten()
    x[ninf, 470] = float("-inf")                                                   # -inf in the RoPE tail


# ------------------------------------------------------------------------------------------ (a)
def compare(c, variant_name, variant):
    """Write both caches; return the record of the comparison."""
    rec = dict(case=c.name, n=c.n, variant=variant_name, status="ok")
    flat_a, cache_a = c.new_cache()
    flat_b, cache_b = c.new_cache()
    plain_write(c, cache_a)
    gluon_write(c, cache_b, variant)
    torch.cuda.synchronize()
    if torch.equal(flat_a, flat_b):
        rec.update(equal=True, diff_bytes=0)
        return rec
    diff = (flat_a != flat_b).nonzero().flatten()
    owner = c.row_of_byte()[diff]
    nonfinite = torch.zeros_like(owner, dtype=torch.bool)
    has_row = owner >= 0
    nonfinite[has_row] = c.nonfinite_rows[owner[has_row]]
    where = []
    for off, row in zip(diff[:12].tolist(), owner[:12].tolist()):
        rel = off - c.cache_offset
        if 0 <= rel < c.shape[0] * c.strides[0]:
            blk, r = divmod(rel, c.strides[0])
            tok, byte = divmod(r, c.strides[1])
            where.append(dict(offset=off, block=blk, token=tok, byte=byte, row=row,
                              plain=int(flat_a[off]), gluon=int(flat_b[off])))
        else:
            where.append(dict(offset=off, outside_cache=True, plain=int(flat_a[off]), gluon=int(flat_b[off])))
    rec.update(equal=False, diff_bytes=int(diff.numel()), diff_outside_nonfinite_rows=int((~nonfinite).sum()),
               nonfinite_rows=int(c.nonfinite_rows.sum()), first_diffs=where)
    if rec["diff_outside_nonfinite_rows"]:
        rec["status"] = "MISMATCH"
    else:
        rec["status"] = "diff only in inf/NaN rows"
    return rec


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
        nbytes = bench.moved_bytes(wl, n)["total"]
        try:
            inp = bench.build_inputs(wl, n, "cuda")
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
                t = timer.measure([fn])
                gbps = nbytes / (t.gpu_us * 1e-6) / 1e9
                r = dict(n=n, peer=peer, status="ok", gpu_us=t.gpu_us, method=t.gpu_method, eager_us=t.eager_us,
                         bytes=nbytes, GBps=gbps, pct_copy=100 * gbps / copy_gbps if copy_gbps else None, note=t.note)
            except Exception as e:
                r = dict(n=n, peer=peer, status="error", error=short(e))
                bench._recover_cuda()
            records.append(r)
            if r["status"] == "ok":
                pct = f"{r['pct_copy']:5.1f}%" if r["pct_copy"] is not None else "  -  "
                log(f"timing n={n:7d} {peer:14s} {r['gpu_us']:9.2f} us  {pct} of copy  ({r['method']})")
            else:
                log(f"timing n={n:7d} {peer:14s} {r['status']} {r.get('error', '')}")
        del inp, peers, plain
        torch.cuda.empty_cache()
    return records


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "gluon-check"))
    p.add_argument("--budget-s", type=float, default=200.0, help="no new case / point starts after this")
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--skip-correctness", action="store_true")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    report = dict(meta=dict(python=platform.python_version(), torch=torch.__version__,
                            triton=getattr(gluon_fp8.triton, "__version__", None), argv=sys.argv,
                            variants=VARIANTS, gluon_available=gluon_fp8.available()))
    if not torch.cuda.is_available():
        log("no CUDA device: nothing to check")
        report["status"] = "no CUDA"
    elif not gluon_fp8.available():
        log(f"Gluon path unavailable (triton {report['meta']['triton']}; needs 3.6): nothing to check")
        report["status"] = "gluon unavailable"
    else:
        props = torch.cuda.get_device_properties(0)
        report["meta"].update(device=props.name, sm_count=props.multi_processor_count)
        log(f"{props.name}, torch {torch.__version__}, triton {report['meta']['triton']}")
        deadline = T0 + a.budget_s
        try:
            copy = bench.measure_copy_bandwidth(reps=5)
        except Exception as e:
            copy = dict(copy_error=short(e))
        report["copy"] = copy
        log(f"copy bandwidth {copy.get('copy_GBps', float('nan')):.0f} GB/s")
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
    report["elapsed_s"] = time.perf_counter() - T0

    path = os.path.join(a.out, "gluon_check.json")
    with open(path, "w") as f:
        json.dump(bench._json_safe(report), f, indent=1, default=str)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
