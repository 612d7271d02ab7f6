"""H200 check of the Gluon FlashMLA fast path (kvfuse/kernels/gluon_mla_tail.py) through kvfuse's
public call, against the plain Triton path (byte-exact to the reference: DEVICE_NOTES.md).

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
    device-to-device copy bandwidth (kvfuse.bench.measure_copy_bandwidth on 1 GiB, moved_bytes).
Few compiled variants (the launch table's configurations and one alignment variant): about a
minute on the H200. A CUDA error (an illegal address ends the context) stops the run; the report
is written anyway. Usage: python3 benchmarks/gluon_check_mla_tail.py --out DIR
(writes DIR/gluon_check_mla_tail.json).
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
from kvfuse.formats import FLASHMLA_MODEL1, FLASHMLA_V32  # noqa: E402
from kvfuse.kernels import fused  # noqa: E402
from kvfuse.kernels import gluon_mla_tail as mla  # noqa: E402

FORMATS = {"FLASHMLA_V32": (FLASHMLA_V32, "flashmla_v32"), "FLASHMLA_MODEL1": (FLASHMLA_MODEL1, "flashmla_model1")}
DEVICE = "cuda"
EPS = bench.EPS
TIMING_SIZES = (1, 256, 4096, 65536, 262144)
T0 = time.perf_counter()


def log(msg):
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def short(e, limit=400):
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + "..."


def cuda_alive() -> bool:
    """False once the CUDA context is lost (an illegal address): nothing more can run."""
    try:
        torch.cuda.synchronize()
        return True
    except Exception:
        return False


# ------------------------------------------------------------------------------------------ switching
class CountingKernel:
    """The Gluon kernel, counting the launches that go through Triton's own path (the first launch of
    every fresh plan-cache entry does; later direct launches bypass it)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.arg_names = kernel.arg_names
        self.launches = 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]

    def warmup(self, *args, **kwargs):
        return self.kernel.warmup(*args, **kwargs)


def fast_path(on: bool) -> None:
    """Route the public call to the Gluon FlashMLA path (on) or the plain kernel (off)."""
    if on:
        fused.FAST_PATHS = (mla,)
        mla.MIN_ROWS = 1            # every size, decode included (the dispatch's default keeps those plain)
    fused.GLUON = on
    kvfuse.plan.clear_plan_cache()


# ------------------------------------------------------------------------------------------ inputs
class Case:
    """One set of inputs for a format and a poisoned cache storage (guard bytes before and after)."""

    def __init__(self, fmt, name, n, seed=0, block_size=64, extra_blocks=2, token_padding=0, block_padding=0,
                 cache_offset=0, guard=64, x_row_pad=0, x_offset=0, w_dtype=torch.bfloat16,
                 cs_dtype=torch.float32, pos_dtype=torch.int32, slot_dtype=torch.int32, index_stride=1,
                 invalid_slots=0.05, bad_positions=0.03, max_position=bench.MAX_POSITION, eps=EPS, special=None):
        dev = DEVICE
        g = torch.Generator(device=dev)
        g.manual_seed(seed * 7919 + n)
        self.fmt, self.name, self.n, self.eps = fmt, name, n, eps
        D = fmt.head_dim
        # x [n, D] bf16: normal values at per-row scales 2^-8 .. 2^8, inside a padded / shifted buffer
        row = D + x_row_pad
        xbuf = torch.empty(x_offset + n * row, dtype=torch.bfloat16, device=dev)
        self.x = torch.as_strided(xbuf, (n, D), (row, 1), x_offset)
        scale = torch.exp2(torch.randint(-8, 9, (n, 1), generator=g, device=dev).float())
        self.x.copy_((torch.randn(n, D, generator=g, device=dev) * scale).to(torch.bfloat16))
        if special is not None:
            special(self, g)
        self.nonfinite_rows = ~torch.isfinite(self.x.float()).all(dim=1)
        self.weight = (torch.randn(D, generator=g, device=dev) * 0.2 + 1.0).to(w_dtype)
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
        # the cache's geometry as kvfuse allocates it, placed inside a poisoned storage
        pad = dict(token_padding=token_padding) if fmt.token_interleaved else {}
        meta = fmt.allocate(blocks, block_size, block_padding=block_padding, device="meta", **pad)
        self.shape, self.strides = tuple(meta.shape), tuple(meta.stride())
        self.cache_offset = cache_offset
        self.storage_bytes = cache_offset + blocks * self.strides[0] + guard
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

    def row_of_byte(self, cache):
        """storage byte -> the row whose record owns it (-1: no row): data, exact scales and tail of
        the valid slots."""
        fmt = self.fmt
        owner = torch.full((self.storage_bytes,), -1, dtype=torch.int64, device=self.x.device)
        a = fmt.addressing_for(cache)
        s = self.slots.long()
        ok = (s >= 0) & (s < self.capacity)
        rows = torch.arange(self.n, device=s.device)[ok]
        s = s[ok]
        bs = self.shape[1]
        base = self.cache_offset + (s // bs) * self.strides[0]
        data = base + (s % bs) * a.data_token_stride + a.data_offset
        sf = base + (s % bs) * a.sf_token_stride + a.sf_offset
        for start, count in ((data, fmt.quant_bytes), (sf, fmt.sf_exact_bytes),
                             (data - a.data_offset + a.tail_offset, 2 * fmt.bf16_tail)):
            idx = start[:, None] + torch.arange(count, device=s.device)
            owner[idx.flatten()] = rows.repeat_interleave(count)
        return owner


def public_write(c, cache):
    kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(
        c.x, kvfuse.NormArgs(c.weight, c.eps), kvfuse.RopeArgs(c.positions, c.cos_sin, 64, True), None,
        kvfuse.CastArgs.from_cache_format(c.fmt), kvfuse.KVCacheOutArgs(cache, c.slots, layout=c.fmt))


# special contents (SPEC §2 edge cases); non-finite rows are found from x afterwards
def special_values(c, g):
    n, x, dev = c.n, c.x, c.x.device
    D = x.shape[1]
    qd = D - 64                                                                    # the tail = RoPE columns
    k = torch.arange(n, device=dev)

    def rows(r):
        return int((k % 11 == r).sum())
    x[k % 11 == 0] = 0.0                                                           # zero rows
    x[k % 11 == 1] = (torch.randn(rows(1), D, generator=g, device=dev) * 1e30).to(x.dtype)
    x[k % 11 == 2] = (torch.randn(rows(2), D, generator=g, device=dev) * 1e38).to(x.dtype)   # ss overflows
    x[k % 11 == 3] = (torch.randint(-127, 128, (rows(3), D), generator=g, device=dev).float()
                      * 2.0 ** -133).to(x.dtype)                                   # bf16 subnormals
    x[k % 11 == 4] = (torch.randint(-64, 65, (rows(4), D), generator=g, device=dev).float() / 16).to(x.dtype)
    mixed = k % 11 == 5                                                            # one group far above the rest
    x[mixed, 64:96] *= 2.0 ** 20
    x[k % 11 == 6, qd:] *= 1e-3                                                    # a small RoPE tail
    tiny = k % 11 == 7
    x[tiny] = (x[tiny].float() * 2.0 ** -120).to(x.dtype)                          # mean + eps dominated by eps
    signed = k % 11 == 8
    x[signed, qd:] = 0.0
    x[signed, qd::3] = -0.0                                                        # signed zeros in the tail
    inf_rows = (k % 97 == 9).nonzero().flatten()
    x[inf_rows, (inf_rows * 37) % qd] = float("inf")                               # an inf in one group
    nan_rows = (k % 97 == 10).nonzero().flatten()
    x[nan_rows, (nan_rows * 53) % qd] = float("nan")                               # a NaN in one group
    ninf = (k % 97 == 20).nonzero().flatten()
    x[ninf, qd + 22] = float("-inf")                                               # -inf in the RoPE tail


# ------------------------------------------------------------------------------------------ (a)
def compare(c, counter):
    """Write both storages (fast path off, on); return the record of the comparison."""
    rec = dict(format=c.fmt.name, case=c.name, n=c.n, status="ok")
    flat_a, cache_a = c.new_cache()
    flat_b, cache_b = c.new_cache()
    fast_path(False)
    public_write(c, cache_a)
    fast_path(True)
    before = counter.launches
    public_write(c, cache_b)
    torch.cuda.synchronize()
    rec["gluon_launches"] = counter.launches - before
    if torch.equal(flat_a, flat_b):
        rec.update(equal=True, diff_bytes=0)
    else:
        diff = (flat_a != flat_b).nonzero().flatten()
        owner = c.row_of_byte(cache_a)[diff]
        nonfinite = torch.zeros_like(owner, dtype=torch.bool)
        has_row = owner >= 0
        nonfinite[has_row] = c.nonfinite_rows[owner[has_row]]
        where = []
        for off, row in zip(diff[:12].tolist(), owner[:12].tolist()):
            rel = off - c.cache_offset
            if 0 <= rel < c.shape[0] * c.strides[0]:
                blk, r = divmod(rel, c.strides[0])
                where.append(dict(offset=off, block=blk, byte_in_block=r, row=row, off=int(flat_a[off]),
                                  on=int(flat_b[off])))
            else:
                where.append(dict(offset=off, outside_cache=True, off=int(flat_a[off]), on=int(flat_b[off])))
        rec.update(equal=False, diff_bytes=int(diff.numel()), diff_outside_nonfinite_rows=int((~nonfinite).sum()),
                   nonfinite_rows=int(c.nonfinite_rows.sum()), first_diffs=where)
        rec["status"] = "MISMATCH" if rec["diff_outside_nonfinite_rows"] else "diff only in inf/NaN rows"
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
def run_timing(copy_gbps, deadline, state, counter):
    """Graph-replay medians of the public call, fast path off and on; ``counter`` wraps the Gluon
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
            nbytes = bench.moved_bytes(wl, n)["total"]
            try:
                inp = bench.build_inputs(wl, n, DEVICE)
                call = bench.fused_call(wl, inp)
                # the timing inputs written both ways must agree as well (reserved bytes keep the fill)
                fast_path(False)
                inp.cache.fill_(0x5A)
                call()
                expect = inp.cache.clone()
                fast_path(True)
                inp.cache.fill_(0x5A)
                before = counter.launches
                mla.mla_tail_kernel = counter
                try:
                    call()
                finally:
                    mla.mla_tail_kernel = counter.kernel
                taken = counter.launches > before
                if not taken:
                    records.append(dict(format=fname, n=n, peer="gluon", status="FAST PATH NOT TAKEN"))
                    log(f"timing {fname} n={n}: FAST PATH NOT TAKEN")
                if not torch.equal(expect, inp.cache):
                    records.append(dict(format=fname, n=n, peer="gluon", status="MISMATCH on the timing inputs",
                                        diff_bytes=int((expect != inp.cache).sum())))
                    log(f"timing {fname} n={n}: MISMATCH on the timing inputs")
                del expect
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
                    t = timer.measure([call])
                    gbps = nbytes / (t.gpu_us * 1e-6) / 1e9
                    r = dict(format=fname, n=n, peer=peer, status="ok", gpu_us=t.gpu_us, method=t.gpu_method,
                             eager_us=t.eager_us, bytes=nbytes, GBps=gbps,
                             pct_copy=100 * gbps / copy_gbps if copy_gbps else None, note=t.note)
                except Exception as e:
                    r = dict(format=fname, n=n, peer=peer, status="error", error=short(e))
                    state["dead"] = not cuda_alive()
                records.append(r)
                if r["status"] == "ok":
                    pct = f"{r['pct_copy']:5.1f}%" if r["pct_copy"] is not None else "  -  "
                    log(f"timing {fname:15s} n={n:7d} {peer:6s} {r['gpu_us']:9.2f} us  {pct} of copy ({r['method']})")
                else:
                    log(f"timing {fname:15s} n={n:7d} {peer:6s} {r['status']} {r.get('error', '')}")
                if state["dead"]:
                    break
            del inp, call
            if not state["dead"]:
                torch.cuda.empty_cache()
    return records


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "gluon-check"))
    p.add_argument("--budget-s", type=float, default=70.0, help="no new case / point starts after this")
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--skip-correctness", action="store_true")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    report = dict(meta=dict(python=platform.python_version(), torch=torch.__version__,
                            triton=getattr(mla.triton, "__version__", None), argv=sys.argv,
                            launch_table={n: mla.launch_table(n) for n in (1, 3, 300, 4097, 65536, 262144)},
                            gluon_available=mla.available()))
    saved = (fused.FAST_PATHS, fused.GLUON, mla.mla_tail_kernel if mla.gl is not None else None)
    if not torch.cuda.is_available():
        log("no CUDA device: nothing to check")
        report["status"] = "no CUDA"
    elif not mla.available():
        log(f"Gluon path unavailable (triton {report['meta']['triton']}; needs 3.6): nothing to check")
        report["status"] = "gluon unavailable"
    else:
        props = torch.cuda.get_device_properties(0)
        report["meta"].update(device=props.name, sm_count=props.multi_processor_count)
        log(f"{props.name}, torch {torch.__version__}, triton {report['meta']['triton']}")
        state = dict(dead=False)
        try:
            copy = bench.measure_copy_bandwidth(nbytes=1 << 30, reps=5)
        except Exception as e:
            copy = dict(copy_error=short(e))
        report["copy"] = copy
        log(f"copy bandwidth {copy.get('copy_GBps', float('nan')):.0f} GB/s")
        counter = CountingKernel(saved[2])
        mla.mla_tail_kernel = counter                # the Launch looks the kernel up in the module, by name
        try:
            if not a.skip_correctness:
                # correctness starts no case after 60% of the budget: timing must still run
                report["correctness"] = run_correctness(counter, T0 + 0.6 * a.budget_s, state)
        finally:
            mla.mla_tail_kernel = saved[2]           # timing runs the kernel itself (direct launches)
        try:
            if not a.skip_timing and not state["dead"]:
                report["timing"] = run_timing(copy.get("copy_GBps"), T0 + a.budget_s, state, counter)
        finally:
            fused.FAST_PATHS, fused.GLUON = saved[0], saved[1]
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
    report["elapsed_s"] = time.perf_counter() - T0
    path = os.path.join(a.out, "gluon_check_mla_tail.json")
    with open(path, "w") as f:
        json.dump(bench._json_safe(report), f, indent=1, default=str)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
