"""H200 check of the Gluon INDEXER fast path (kvfuse/kernels/gluon_index.py) against kvfuse's plain
Triton path (byte-exact to the reference, DEVICE_NOTES.md), through the PUBLIC API: the fast path is
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
    copy bandwidth (kvfuse.bench.measure_copy_bandwidth, 1 GiB; kvfuse.bench.moved_bytes).
Only the launch table's variants are compiled. Exceptions are reported per case; a CUDA error (which
ends the CUDA context) stops the run and the report is written. About 60-80 s on an H200.

Usage: python3 benchmarks/gluon_check_index.py --out DIR         (writes DIR/gluon_check_index.json)
       python3 benchmarks/gluon_check_index.py --prove-encoders  (CPU, minutes: the e2m1 encoders'
       host mirrors against kvfuse.reference.encode_e2m1 on every fp32 / bf16 input)
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
from kvfuse import formats as F  # noqa: E402
from kvfuse.kernels import fused  # noqa: E402
from kvfuse.kernels import gluon_index as GI  # noqa: E402

EPS = bench.EPS
DEVICE = "cuda"
FORMATS = {"index_fp8_fp32": F.INDEX_FP8_FP32, "index_mxfp4": F.INDEX_MXFP4, "index_nvfp4": F.INDEX_NVFP4}
TIMING_SIZES = (1, 256, 4096, 65536, 262144)
T0 = time.perf_counter()


def log(msg):
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def short(e, limit=400):
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + "..."


def is_cuda_error(e) -> bool:
    """An error that ends the CUDA context (what follows it would fail too)."""
    text = str(e)
    return any(k in text for k in ("CUDA error", "illegal memory access", "unspecified launch failure",
                                   "device-side assert", "misaligned address"))


# ------------------------------------------------------------------------------------ switching
class CountingKernel:
    """Stands in for gluon_index.index_write_kernel: counts the launches through Triton's path (the
    first launch of every kept Launch; direct launches bypass it)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.arg_names = kernel.arg_names
        self.launches = 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]

    def warmup(self, *args, **kwargs):
        return self.kernel.warmup(*args, **kwargs)


KERNEL = GI.index_write_kernel if hasattr(GI, "index_write_kernel") else None


def fast_path(on: bool) -> None:
    """Route the public entry point's eligible calls to gluon_index (on) or keep the plain kernel."""
    fused.FAST_PATHS = (GI,) if on else ()
    GI.MIN_ROWS = 1                 # every size, decode included (the dispatch's default keeps those plain)
    fused.GLUON = bool(on)
    kvfuse.plan.clear_plan_cache()


# ------------------------------------------------------------------------------------ inputs
class Case:
    """One set of inputs and a poisoned cache storage (guard bytes before and after the cache)."""

    def __init__(self, fmt, name, n, seed=0, block_size=64, extra_blocks=2, block_padding=0, cache_offset=0, guard=64,
                 x_row_pad=0, x_offset=0, w_dtype=torch.bfloat16, cs_dtype=torch.float32, pos_dtype=torch.int32,
                 slot_dtype=torch.int32, index_stride=1, invalid_slots=0.05, bad_positions=0.03,
                 max_position=bench.MAX_POSITION, eps=EPS, special=None, expect_fast=True):
        dev = DEVICE
        g = torch.Generator(device=dev)
        g.manual_seed(seed * 7919 + n)
        self.fmt, self.name, self.n, self.eps, self.expect_fast = fmt, name, n, eps, expect_fast
        # x [n, 128] bf16: normal values at per-row scales 2^-8 .. 2^8, inside a padded / shifted buffer
        row = 128 + x_row_pad
        xbuf = torch.empty(x_offset + n * row, dtype=torch.bfloat16, device=dev)
        self.x = torch.as_strided(xbuf, (n, 128), (row, 1), x_offset)
        scale = torch.exp2(torch.randint(-8, 9, (n, 1), generator=g, device=dev).float())
        self.x.copy_((torch.randn(n, 128, generator=g, device=dev) * scale).to(torch.bfloat16))
        if special is not None:
            special(self, g)
        self.nonfinite_rows = ~torch.isfinite(self.x.float()).all(dim=1)
        self.weight = (torch.randn(128, generator=g, device=dev) * 0.2 + 1.0).to(w_dtype)
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
        # the block-wide cache inside a poisoned storage: guard bytes, then the blocks
        bpt = fmt.bytes_per_token
        s0 = -(-(block_size * bpt + block_padding) // 32) * 32
        self.cache_offset = cache_offset
        self.storage_bytes = cache_offset + blocks * s0 + guard
        self.shape, self.strides = (blocks, block_size, 1, bpt), (s0, bpt, bpt, 1)
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
        """storage byte -> the row whose record holds it (-1: none), from the valid slots."""
        fmt = self.fmt
        owner = torch.full((self.storage_bytes,), -1, dtype=torch.int64, device=self.x.device)
        s = self.slots.long()
        ok = (s >= 0) & (s < self.capacity)
        rows = torch.arange(self.n, device=s.device)[ok]
        s = s[ok]
        bs = self.shape[1]
        base = self.cache_offset + (s // bs) * self.strides[0]
        off = s % bs
        data = base + off * fmt.data_bytes
        owner[(data[:, None] + torch.arange(fmt.data_bytes, device=s.device)).flatten()] = \
            rows.repeat_interleave(fmt.data_bytes)
        sf = base + bs * fmt.data_bytes + off * fmt.sf_bytes
        owner[(sf[:, None] + torch.arange(fmt.sf_bytes, device=s.device)).flatten()] = \
            rows.repeat_interleave(fmt.sf_bytes)
        return owner


def public_write(c, cache):
    kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(
        c.x, kvfuse.NormArgs(c.weight, c.eps), kvfuse.RopeArgs(c.positions, c.cos_sin, 64, True), None,
        kvfuse.CastArgs.from_cache_format(c.fmt), kvfuse.KVCacheOutArgs(cache, c.slots, layout=c.fmt))


# special contents (SPEC §2 edge cases); non-finite rows are found from x afterwards
def special_values(c, g):
    n, x, dev = c.n, c.x, c.x.device
    k = torch.arange(n, device=dev)
    x[k % 11 == 0] = 0.0                                                           # zero rows
    x[k % 11 == 1] = (torch.randn(int((k % 11 == 1).sum()), 128, generator=g, device=dev) * 1e30).to(x.dtype)
    x[k % 11 == 2] = (torch.randn(int((k % 11 == 2).sum()), 128, generator=g, device=dev) * 1e38).to(x.dtype)
    sub = (torch.randint(-127, 128, (int((k % 11 == 3).sum()), 128), generator=g, device=dev).float()
           * 2.0 ** -133).to(x.dtype)                                              # bf16 subnormals
    x[k % 11 == 3] = sub
    ties = torch.randint(-64, 65, (int((k % 11 == 4).sum()), 128), generator=g, device=dev).float() / 16
    x[k % 11 == 4] = ties.to(x.dtype)                                              # rounding ties
    mixed = k % 11 == 5                                                            # one group far above the rest
    x[mixed, 32:48] *= 2.0 ** 20
    x[k % 11 == 6, 64:128] *= 1e-3                                                 # a small RoPE half
    tiny = k % 11 == 7
    x[tiny] = (x[tiny].float() * 2.0 ** -120).to(x.dtype)                          # mean + eps dominated by eps
    x[k % 11 == 8, 16:32] = 0.0                                                    # an all-zero group (amax floor)
    inf_rows = (k % 97 == 9).nonzero().flatten()
    x[inf_rows, (inf_rows * 37) % 128] = float("inf")                              # an inf in one group
    nan_rows = (k % 97 == 10).nonzero().flatten()
    x[nan_rows, (nan_rows * 53) % 128] = float("nan")                              # a NaN in one group
    ninf = (k % 97 == 11).nonzero().flatten()
    x[ninf, 100] = float("-inf")                                                   # -inf in the RoPE half


def correctness_cases(fmt):
    """(name, Case keywords). Each distinct dtype / alignment / stride combination compiles both kernels
    once more, so the variations share a few combinations (the 90-second budget)."""
    e4m3 = fmt.cast_fmt == "e4m3"
    return [
        ("random n=1", dict(n=1, seed=1)),
        ("n=3: int64 indices, strided, fp32 weight, bf16 cos_sin, block_size 1",
         dict(n=3, seed=2, pos_dtype=torch.int64, slot_dtype=torch.int64, index_stride=3, w_dtype=torch.float32,
              cs_dtype=torch.bfloat16, block_size=1, invalid_slots=0.3)),
        ("n=300: special values, block_size 24 (division), P=3, eps 1e-5",
         dict(n=300, seed=3, special=special_values, block_size=24, max_position=3, bad_positions=0.2, eps=1e-5)),
        ("random n=4097", dict(n=4097, seed=4)),
        ("special values n=4097", dict(n=4097, seed=5, special=special_values)),
        ("invalid slots and positions (50%) n=4097", dict(n=4097, seed=6, invalid_slots=0.5, bad_positions=0.5)),
        ("random n=65536", dict(n=65536, seed=7)),
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
    public_write(c, cache_a)
    counting = CountingKernel(KERNEL)
    GI.index_write_kernel = counting
    try:
        fast_path(True)
        public_write(c, cache_b)
    finally:
        GI.index_write_kernel = KERNEL
        fast_path(False)
    torch.cuda.synchronize()
    rec["fast_path_ran"] = counting.launches > 0
    if rec["fast_path_ran"] != c.expect_fast:
        rec["status"] = "FAST PATH " + ("TAKEN, NOT EXPECTED" if counting.launches else "NOT TAKEN")
    if torch.equal(flat_a, flat_b):
        rec.update(equal=True, diff_bytes=0)
        return rec
    diff = (flat_a != flat_b).nonzero().flatten()
    owner = c.row_of_byte()[diff]
    has_row = owner >= 0
    nonfinite = torch.zeros_like(has_row)
    nonfinite[has_row] = c.nonfinite_rows[owner[has_row]]
    where = []
    for off, row in zip(diff[:8].tolist(), owner[:8].tolist()):
        rel = off - c.cache_offset
        if 0 <= rel < c.shape[0] * c.strides[0]:
            blk, byte = divmod(rel, c.strides[0])
            where.append(dict(offset=off, block=blk, byte_in_block=byte, row=row, plain=int(flat_a[off]),
                              fast=int(flat_b[off])))
        else:
            where.append(dict(offset=off, outside_cache=True, plain=int(flat_a[off]), fast=int(flat_b[off])))
    outside = int((~nonfinite).sum())
    rec.update(equal=False, diff_bytes=int(diff.numel()), diff_outside_nonfinite_rows=outside,
               nonfinite_rows=int(c.nonfinite_rows.sum()), first_diffs=where)
    if rec["status"] == "ok":
        rec["status"] = "MISMATCH" if outside else "diff only in inf/NaN rows"
    return rec


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
                if is_cuda_error(e):
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
            nbytes = bench.moved_bytes(wl, n)["total"]
            try:
                inp = bench.build_inputs(wl, n, DEVICE)
                call = bench.fused_call(wl, inp)
                # the timing inputs written both ways must agree too
                fast_path(False)
                inp.cache.fill_(0x5A)
                call()
                want = inp.cache.clone()
                fast_path(True)
                inp.cache.fill_(0x5A)
                call()
                torch.cuda.synchronize()
                if not torch.equal(want, inp.cache):
                    records.append(dict(format=fmt.name, n=n, status="MISMATCH on the timing inputs",
                                        diff_bytes=int((want != inp.cache).sum())))
                    log(f"timing {fmt.name} n={n}: MISMATCH on the timing inputs")
                row = dict(format=fmt.name, n=n, status="ok", bytes=nbytes)
                for label, on in (("plain", False), ("fast", True)):
                    fast_path(on)
                    t = timer.measure([call])
                    gbps = nbytes / (t.gpu_us * 1e-6) / 1e9
                    row[label] = dict(gpu_us=t.gpu_us, method=t.gpu_method, eager_us=t.eager_us, GBps=gbps,
                                      pct_copy=100 * gbps / copy_gbps if copy_gbps else None, note=t.note)
                fast_path(False)
                row["speedup"] = row["plain"]["gpu_us"] / row["fast"]["gpu_us"]
                records.append(row)
                pct = lambda d: f"{d['pct_copy']:5.1f}%" if d["pct_copy"] is not None else "  -  "  # noqa: E731
                log(f"timing {fmt.name:15s} n={n:7d} plain {row['plain']['gpu_us']:8.2f} us {pct(row['plain'])}  "
                    f"fast {row['fast']['gpu_us']:8.2f} us {pct(row['fast'])}  x{row['speedup']:.2f}")
                del inp, call
            except Exception as e:
                fast_path(False)
                records.append(dict(format=fmt.name, n=n, status="error", error=short(e)))
                log(f"timing {fmt.name} n={n}: ERROR {short(e)}")
                if is_cuda_error(e):
                    report["stopped"] = f"CUDA error timing {fmt.name} n={n}"
                    return False
                bench._recover_cuda()
        torch.cuda.empty_cache()
    return True


# ------------------------------------------------------------------------------------ proofs (CPU)
def prove_encoders(report):
    """The e2m1 encoders' host mirrors (gluon_index.e2m1_fp32_mirror / e2m1_bf16_mirror) against
    kvfuse.reference.encode_e2m1: every fp32 pattern (NaN left out), and every bf16 y times every UE8M0
    multiplier the kernel makes (where |y * m| <= 6 or y is infinite)."""
    from kvfuse import reference as ref
    bad, step = 0, 1 << 24
    for start in range(0, 1 << 32, step):
        t = (torch.arange(start, start + step, dtype=torch.int64) - (1 << 31)).to(torch.int32).view(torch.float32)
        keep = ~torch.isnan(t)
        bad += int(((GI.e2m1_fp32_mirror(t) != ref.encode_e2m1(t).to(torch.int32)) & keep).sum())
        if start % (1 << 28) == 0:
            log(f"fp32 encoder: {start >> 24} / 256 chunks, {bad} differing")
    report["fp32_encoder_differing"] = bad
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
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "gluon-check-index"))
    p.add_argument("--budget-s", type=float, default=80.0, help="no new case / point starts after this")
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--skip-correctness", action="store_true")
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
    report = dict(meta=dict(python=platform.python_version(), torch=torch.__version__,
                            triton=getattr(GI.triton, "__version__", None), argv=sys.argv,
                            formats=[f.name for f in formats.values()], gluon_available=GI.available(),
                            packed_e2m1=GI.PACKED_E2M1, launch_table={n: GI.launch_table(n) for n in
                                                                      (1, 3, 256, 300, 4096, 4097, 65536, 262144)}))
    if a.prove_encoders:
        prove_encoders(report)
    elif not torch.cuda.is_available():
        log("no CUDA device: nothing to check")
        report["status"] = "no CUDA"
    elif not GI.available() or KERNEL is None:
        log(f"Gluon path unavailable (triton {report['meta']['triton']}; needs 3.6): nothing to check")
        report["status"] = "gluon unavailable"
    else:
        props = torch.cuda.get_device_properties(0)
        report["meta"].update(device=props.name, sm_count=props.multi_processor_count)
        log(f"{props.name}, torch {torch.__version__}, triton {report['meta']['triton']}, formats {list(formats)}")
        deadline = T0 + a.budget_s
        try:
            copy = bench.measure_copy_bandwidth(nbytes=1 << 30, reps=5)
        except Exception as e:
            copy = dict(copy_error=short(e))
        report["copy"] = copy
        log(f"copy bandwidth {copy.get('copy_GBps', float('nan')):.0f} GB/s")
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
    report["elapsed_s"] = time.perf_counter() - T0
    path = os.path.join(a.out, "gluon_check_index.json")
    with open(path, "w") as f:
        json.dump(bench._json_safe(report), f, indent=1, default=str)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
