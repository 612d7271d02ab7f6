"""What the H200 checks of the Gluon fast paths share (benchmarks/gluon_check.py,
gluon_check_mla_tail.py, gluon_check_index.py): logging, the command line and the report, the test
case (inputs and a cache inside a storage of random bytes), the special input rows, the record of a
whole-storage comparison, timing records, the fast-path switch and the launch counter.

Importing it puts the repository root (kvfuse) and tests/ (helpers.CountingKernel) on sys.path.
"""
import argparse
import contextlib
import json
import os
import platform
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch  # noqa: E402

import kvfuse  # noqa: E402
from helpers import CountingKernel  # noqa: E402  (tests/helpers.py: the GPU tests' launch counter)
from kvfuse import bench  # noqa: E402
from kvfuse.kernels import fused, gluon_common  # noqa: E402

DEVICE = "cuda"
EPS = bench.EPS
TIMING_SIZES = (1, 256, 4096, 65536, 262144)
T0 = time.perf_counter()


def log(msg):
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def is_cuda_error(e) -> bool:
    """An error that ends the CUDA context (what follows it would fail too)."""
    text = str(e)
    return any(k in text for k in ("CUDA error", "illegal memory access", "unspecified launch failure",
                                   "device-side assert", "misaligned address"))


def short(e, limit=400):
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + "..."


# ------------------------------------------------------------------------------------ command line, report
def arg_parser(doc: str, out_default: str, budget_s: float) -> argparse.ArgumentParser:
    """The options every check takes (a script adds its own)."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", out_default))
    p.add_argument("--budget-s", type=float, default=budget_s, help="no new case / point starts after this")
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--skip-correctness", action="store_true")
    return p


def new_report(**meta) -> dict:
    """The report, its meta holding the versions, the command line and ``meta``."""
    return dict(meta=dict(python=platform.python_version(), torch=torch.__version__,
                          triton=getattr(gluon_common.triton, "__version__", None), argv=sys.argv,
                          gluon_available=gluon_common.available(), **meta))


def device_ready(report: dict, note: str = "") -> bool:
    """True when there is a CUDA device and Triton 3.6's Gluon (the device goes into the report);
    else the report's status says which is missing."""
    if not torch.cuda.is_available():
        log("no CUDA device: nothing to check")
        report["status"] = "no CUDA"
        return False
    if not gluon_common.available():
        log(f"Gluon path unavailable (triton {report['meta']['triton']}; needs 3.6): nothing to check")
        report["status"] = "gluon unavailable"
        return False
    props = torch.cuda.get_device_properties(0)
    report["meta"].update(device=props.name, sm_count=props.multi_processor_count)
    log(f"{props.name}, torch {torch.__version__}, triton {report['meta']['triton']}{note}")
    return True


def copy_bandwidth(report: dict, **kwargs) -> dict:
    """kvfuse.bench.measure_copy_bandwidth (keyword arguments passed on), kept in the report."""
    try:
        copy = bench.measure_copy_bandwidth(reps=5, **kwargs)
    except Exception as e:
        copy = dict(copy_error=short(e))
    report["copy"] = copy
    log(f"copy bandwidth {copy.get('copy_GBps', float('nan')):.0f} GB/s")
    return copy


def write_report(report: dict, out_dir: str, name: str) -> None:
    report["elapsed_s"] = time.perf_counter() - T0
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(bench._json_safe(report), f, indent=1, default=str)
    log(f"wrote {path}")


# ------------------------------------------------------------------------------------ switching
def fast_path(module, on: bool) -> None:
    """Route the public call's eligible calls to the Gluon path ``module`` (on: at every size, decode
    included) or keep the plain kernel (off); the plan cache, which keeps the choice, is cleared."""
    fused.FAST_PATHS = (module,) if on else ()
    module.MIN_ROWS = 1             # the dispatch's default keeps decode sizes plain
    fused.GLUON = bool(on)
    kvfuse.plan.clear_plan_cache()


@contextlib.contextmanager
def counting(module, kernel_name: str):
    """A CountingKernel stands in for ``module.<kernel_name>`` (a Launch looks the kernel up there, by
    name): it counts the launches through Triton's path (the first of every kept Launch)."""
    kernel = getattr(module, kernel_name)
    counter = CountingKernel(kernel)
    setattr(module, kernel_name, counter)
    try:
        yield counter
    finally:
        setattr(module, kernel_name, kernel)


def fast_write_launches(module, kernel_name: str, write) -> int:
    """``write()`` with ``module``'s fast path on (off again afterwards), synchronized: how many times
    it launched ``module.<kernel_name>`` through Triton (``counting``)."""
    with counting(module, kernel_name) as counter:
        try:
            fast_path(module, True)
            write()
        finally:
            fast_path(module, False)
    torch.cuda.synchronize()
    return counter.launches


def note_fast_path(rec: dict, launches: int, expect_fast: bool) -> None:
    """Into a comparison's record: whether the fast path ran, and a status when that was not expected."""
    rec["fast_path_ran"] = launches > 0
    if rec["fast_path_ran"] != expect_fast:
        rec["status"] = "FAST PATH " + ("TAKEN, NOT EXPECTED" if launches else "NOT TAKEN")


# ------------------------------------------------------------------------------------ inputs
class Case:
    """One set of inputs: x [n, head_dim] bf16 at per-row scales 2^-8 .. 2^8 inside a padded /
    shifted buffer, the weight, a cos/sin table, positions (some outside [0, P)) and slots (some
    invalid: -1 or >= capacity), int32/int64 and strided as asked. A script's subclass places its
    cache (``place_cache``) in a storage of random bytes, guard bytes around it."""

    def __init__(self, name, n, head_dim, seed=0, block_size=64, extra_blocks=2, x_row_pad=0, x_offset=0,
                 w_dtype=torch.bfloat16, cs_dtype=torch.float32, pos_dtype=torch.int32, slot_dtype=torch.int32,
                 index_stride=1, invalid_slots=0.05, bad_positions=0.03, max_position=bench.MAX_POSITION, eps=EPS,
                 special=None):
        dev = DEVICE
        g = torch.Generator(device=dev)
        g.manual_seed(seed * 7919 + n)
        self.generator = g
        self.name, self.n, self.eps = name, n, eps
        row = head_dim + x_row_pad
        xbuf = torch.empty(x_offset + n * row, dtype=torch.bfloat16, device=dev)
        self.x = torch.as_strided(xbuf, (n, head_dim), (row, 1), x_offset)
        scale = torch.exp2(torch.randint(-8, 9, (n, 1), generator=g, device=dev).float())
        self.x.copy_((torch.randn(n, head_dim, generator=g, device=dev) * scale).to(torch.bfloat16))
        if special is not None:
            special(self, g)
        self.nonfinite_rows = ~torch.isfinite(self.x.float()).all(dim=1)
        self.weight = (torch.randn(head_dim, generator=g, device=dev) * 0.2 + 1.0).to(w_dtype)
        self.cos_sin = bench.rope_table(max_position, 64, dev).to(cs_dtype)
        pos = torch.randint(0, max_position, (n,), generator=g, device=dev)
        bad = torch.rand(n, generator=g, device=dev) < bad_positions
        pos = torch.where(bad, torch.where(torch.rand(n, generator=g, device=dev) < 0.5, -1 - pos, pos + max_position),
                          pos)
        self.positions = self._strided(pos.to(pos_dtype), index_stride)
        self.blocks = max(1, -(-n // block_size)) + extra_blocks
        self.capacity = self.blocks * block_size
        slots = torch.randperm(self.capacity, generator=g, device=dev)[:n]
        bad = torch.rand(n, generator=g, device=dev) < invalid_slots
        out = torch.where(torch.rand(n, generator=g, device=dev) < 0.5, torch.full_like(slots, -1),
                          self.capacity + torch.randint(0, 1000, (n,), generator=g, device=dev))
        self.slots = self._strided(torch.where(bad, out, slots).to(slot_dtype), index_stride)

    def place_cache(self, shape, strides, cache_offset, guard):
        """The cache (shape, byte strides) cache_offset bytes into a storage of random bytes that ends
        guard bytes after it."""
        self.shape, self.strides, self.cache_offset = tuple(shape), tuple(strides), cache_offset
        self.storage_bytes = cache_offset + self.shape[0] * self.strides[0] + guard
        self.poison = torch.randint(0, 256, (self.storage_bytes,), generator=self.generator, device=DEVICE,
                                    dtype=torch.uint8)

    def valid_slots(self):
        """(the rows whose slot is valid, the slot's block, its token in the block)."""
        s = self.slots.long()
        ok = (s >= 0) & (s < self.capacity)
        rows = torch.arange(self.n, device=s.device)[ok]
        s = s[ok]
        bs = self.shape[1]
        return rows, s // bs, s % bs

    def owner_map(self, rows, regions):
        """storage byte -> the row whose record holds it (-1: none); ``regions``: (first storage byte
        per row, byte count) of each part of the rows' records."""
        owner = torch.full((self.storage_bytes,), -1, dtype=torch.int64, device=self.x.device)
        for start, count in regions:
            idx = start[:, None] + torch.arange(count, device=start.device)
            owner[idx.flatten()] = rows.repeat_interleave(count)
        return owner

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


def public_write(c, cache):
    """The public call for the case's format (``c.fmt``)."""
    kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(
        c.x, kvfuse.NormArgs(c.weight, c.eps), kvfuse.RopeArgs(c.positions, c.cos_sin, 64, True), None,
        kvfuse.CastArgs.from_cache_format(c.fmt), kvfuse.KVCacheOutArgs(cache, c.slots, layout=c.fmt))


def put_nonfinite(x, k, width: int, ninf_col: int, residues=(9, 10, 11)) -> None:
    """The non-finite rows every check writes (their bytes are free by SPEC §2; nothing else may move):
    rows with k % 97 == residues[0] get one inf and residues[1] one NaN, each in one group (column
    (row * 37) or (row * 53) modulo ``width``), and residues[2] a -inf at column ``ninf_col``."""
    inf_rows = (k % 97 == residues[0]).nonzero().flatten()
    x[inf_rows, (inf_rows * 37) % width] = float("inf")
    nan_rows = (k % 97 == residues[1]).nonzero().flatten()
    x[nan_rows, (nan_rows * 53) % width] = float("nan")
    x[(k % 97 == residues[2]).nonzero().flatten(), ninf_col] = float("-inf")


def base_cases(special) -> list:
    """(name, Case keywords) that the format checks share: n = 1, a strided int64 / fp32-weight / bf16
    cos-sin / block-size-1 case, ``special`` values with a division block size and a 3-row table,
    n = 4097 random / special / half invalid, n = 65536."""
    return [
        ("random n=1", dict(n=1, seed=1)),
        ("n=3: int64 indices, strided, fp32 weight, bf16 cos_sin, block_size 1",
         dict(n=3, seed=2, pos_dtype=torch.int64, slot_dtype=torch.int64, index_stride=3, w_dtype=torch.float32,
              cs_dtype=torch.bfloat16, block_size=1, invalid_slots=0.3)),
        ("n=300: special values, block_size 24 (division), P=3, eps 1e-5",
         dict(n=300, seed=3, special=special, block_size=24, max_position=3, bad_positions=0.2, eps=1e-5)),
        ("random n=4097", dict(n=4097, seed=4)),
        ("special values n=4097", dict(n=4097, seed=5, special=special)),
        ("invalid slots and positions (50%) n=4097", dict(n=4097, seed=6, invalid_slots=0.5, bad_positions=0.5)),
        ("random n=65536", dict(n=65536, seed=7)),
    ]


def special_rows(c, g):
    """The SPEC §2 edge cases every check writes, by row (k % 11): 0 zero rows, 1-2 huge values (1e38:
    the sum of squares overflows), 3 bf16 subnormals, 4 rounding ties, 7 mean + eps dominated by
    eps. Returns k (the row numbers) for the script's own rows; non-finite rows are found from x
    afterwards."""
    n, x, dev = c.n, c.x, c.x.device
    D = x.shape[1]
    k = torch.arange(n, device=dev)

    def rows(r):
        return int((k % 11 == r).sum())
    x[k % 11 == 0] = 0.0
    x[k % 11 == 1] = (torch.randn(rows(1), D, generator=g, device=dev) * 1e30).to(x.dtype)
    x[k % 11 == 2] = (torch.randn(rows(2), D, generator=g, device=dev) * 1e38).to(x.dtype)
    x[k % 11 == 3] = (torch.randint(-127, 128, (rows(3), D), generator=g, device=dev).float()
                      * 2.0 ** -133).to(x.dtype)
    x[k % 11 == 4] = (torch.randint(-64, 65, (rows(4), D), generator=g, device=dev).float() / 16).to(x.dtype)
    tiny = k % 11 == 7
    x[tiny] = (x[tiny].float() * 2.0 ** -120).to(x.dtype)
    return k


# ------------------------------------------------------------------------------------ results
def storage_diff(c, flat_a, flat_b, owner_of_byte, labels, first=12, split_tokens=False) -> dict:
    """The record of two storages that differ: how many bytes, how many of them outside the records
    of rows holding inf/NaN inputs (where SPEC §2 allows any bytes), and where the first ``first``
    are (block and byte in it, or token and byte with ``split_tokens``; the two values named by
    ``labels``). ``owner_of_byte``: storage byte -> the row whose record holds it (-1: none)."""
    diff = (flat_a != flat_b).nonzero().flatten()
    owner = owner_of_byte[diff]
    has_row = owner >= 0
    nonfinite = torch.zeros_like(has_row)
    nonfinite[has_row] = c.nonfinite_rows[owner[has_row]]
    where = []
    for off, row in zip(diff[:first].tolist(), owner[:first].tolist()):
        rel = off - c.cache_offset
        if 0 <= rel < c.shape[0] * c.strides[0]:
            blk, byte = divmod(rel, c.strides[0])
            at = dict(offset=off, block=blk)
            if split_tokens:
                tok, byte = divmod(byte, c.strides[1])
                at.update(token=tok, byte=byte)
            else:
                at.update(byte_in_block=byte)
            at.update(row=row)
        else:
            at = dict(offset=off, outside_cache=True)
        at.update({labels[0]: int(flat_a[off]), labels[1]: int(flat_b[off])})
        where.append(at)
    return dict(equal=False, diff_bytes=int(diff.numel()), diff_outside_nonfinite_rows=int((~nonfinite).sum()),
                nonfinite_rows=int(c.nonfinite_rows.sum()), first_diffs=where)


def judge_storages(c, rec: dict, flat_a, flat_b, owner_of_byte, labels, **diff_kw) -> dict:
    """``rec`` with the comparison of two whole storages: equal, or ``storage_diff``'s record (keyword
    arguments passed on) and the status MISMATCH (bytes differ outside the records of rows with inf /
    NaN inputs) or "diff only in inf/NaN rows"; a status already set (not "ok") stays."""
    if torch.equal(flat_a, flat_b):
        rec.update(equal=True, diff_bytes=0)
        return rec
    rec.update(storage_diff(c, flat_a, flat_b, owner_of_byte, labels, **diff_kw))
    if rec["status"] == "ok":
        rec["status"] = "MISMATCH" if rec["diff_outside_nonfinite_rows"] else "diff only in inf/NaN rows"
    return rec


def written_both_ways(module, kernel_name: str, inp, call):
    """The timing inputs' cache written by ``call`` with the fast path off, then on (each time from a
    0x5A fill, which reserved bytes keep): (the bytes that differ, the Gluon launches on the way on)."""
    fast_path(module, False)
    inp.cache.fill_(0x5A)
    call()
    expect = inp.cache.clone()
    fast_path(module, True)
    inp.cache.fill_(0x5A)
    with counting(module, kernel_name) as counter:
        call()
    diff_bytes = 0 if torch.equal(expect, inp.cache) else int((expect != inp.cache).sum())
    return diff_bytes, counter.launches


def timed(timer, fn, nbytes: int, copy_gbps) -> dict:
    """Median GPU time of fn (a kvfuse.bench.CudaTimer) as us and as GB/s, % of the copy bandwidth."""
    t = timer.measure([fn])
    gbps = nbytes / (t.gpu_us * 1e-6) / 1e9
    return dict(gpu_us=t.gpu_us, method=t.gpu_method, eager_us=t.eager_us, GBps=gbps,
                pct_copy=100 * gbps / copy_gbps if copy_gbps else None, note=t.note)


def prove_e2m1_nibble(say=log) -> int:
    """The e2m1 encoder of the fast paths (gluon_common.e2m1_nibble, through its host mirror
    ``e2m1_nibble_mirror``) against kvfuse.reference.encode_e2m1 on every fp32 pattern (NaN left out:
    SPEC §2 leaves their group free): how many differ. CPU, minutes."""
    from kvfuse import reference as ref
    bad, step = 0, 1 << 24
    for start in range(0, 1 << 32, step):
        t = (torch.arange(start, start + step, dtype=torch.int64) - (1 << 31)).to(torch.int32).view(torch.float32)
        keep = ~torch.isnan(t)
        bad += int(((gluon_common.e2m1_nibble_mirror(t) != ref.encode_e2m1(t).to(torch.int32)) & keep).sum())
        if start % (1 << 28) == 0:
            say(f"e2m1 encoder: {start >> 24} / 256 chunks, {bad} differing")
    return bad


def plain_vs_fast(module, timer, call, nbytes: int, copy_gbps) -> dict:
    """``timed`` with ``module``'s fast path off, then on (left off): {"plain", "fast", "speedup"}."""
    row = {}
    for label, on in (("plain", False), ("fast", True)):
        fast_path(module, on)
        row[label] = timed(timer, call, nbytes, copy_gbps)
    fast_path(module, False)
    row["speedup"] = row["plain"]["gpu_us"] / row["fast"]["gpu_us"]
    return row


def plain_vs_fast_text(row: dict) -> str:
    """A ``plain_vs_fast`` row as one log line's tail."""
    p, f = row["plain"], row["fast"]
    return (f"plain {p['gpu_us']:8.2f} us {pct_text(p)}  fast {f['gpu_us']:8.2f} us {pct_text(f)}  "
            f"x{row['speedup']:.2f}")


def pct_text(r: dict) -> str:
    return f"{r['pct_copy']:5.1f}%" if r["pct_copy"] is not None else "  -  "
