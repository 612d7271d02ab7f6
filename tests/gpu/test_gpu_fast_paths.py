"""GPU module: every Gluon fast path (kvfuse.kernels.router.FAST_PATH_MODULES) against the portable
kernel on the same device, through the public call. Each call is written twice into copies of one
storage of random bytes (guard bytes before and after the cache, paddings, reserved bytes), once with
only that fast path (at every size: min_rows=1) and once with none (``router.fast_paths``), and the
two storages must be equal byte for byte (torch.equal, the records of rows with inf / NaN inputs
included); the fast path must have run, or, where its eligibility or its per-call guard declines
(a cache or x less aligned than its stores), must not have.

Cases: 1 to 262144 rows (every launch-table entry), SPEC §6 edge values (zero rows, values whose
squares overflow, bf16 subnormals, rounding ties, a group far above the rest, an all-zero group,
e2m1 grid values, signed zeros in the RoPE columns, inf / NaN / -inf), invalid slots (-1, >= the
capacity) and positions (< 0, >= the table), a 3-row cos/sin table, block sizes 1 and 24, int32 /
int64 and strided indices, fp32 weights, bf16 cos/sin, padded token and block strides, caches and x at
2-, 4-, 8- and 16-byte offsets; launch variants outside the launch tables (``launch_table=``); the
indexer Q's contiguous (q, sf) outputs inside padded buffers of random bytes; and the fp32 e2m1
encoder's host mirror on every fp32 input. Launch timing is benchmarks/tune.py's.

    KVFUSE_TEST_GPU=1 python3 -m pytest -q tests/gpu/test_gpu_fast_paths.py

The case tables are checked on the CPU too (``test_*_cases_mean_what_they_say``): each case is
eligible, and passes the per-call guard, exactly when the GPU test expects its fast path to run.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import pytest
import torch

import kvfuse
from kvfuse import CastArgs, ContiguousOutArgs, KVCacheOutArgs, NormArgs, RopeArgs
from kvfuse import formats as F
from kvfuse import reference as ref
from kvfuse.kernels import router
from kvfuse.kernels.gluon import common as gluon_common
from kvfuse.plans.fused import build_plan
from helpers import assert_bytes_equal, cos_sin_cache

needs_gluon = pytest.mark.skipif(
    not torch.cuda.is_available() or kvfuse.backend.interpreter_enabled() or not gluon_common.available(),
    reason="needs CUDA, compiled kernels (KVFUSE_TEST_GPU=1) and Triton 3.6's Gluon")


def short_name(module) -> str:
    return module.__name__.rsplit(".", 1)[1]


MODULES = {short_name(m): m for m in router.FAST_PATH_MODULES}
# the cache formats each fast path writes (its module's FORMATS)
FORMATS = {name: m.FORMATS for name, m in MODULES.items()}
# the fast paths with a contiguous (q, sf) destination (the indexer Q), and their casts
CONTIGUOUS_CASTS = {"indexer": tuple(CastArgs.from_cache_format(f) for f in FORMATS["indexer"])}


def cache_alignment_needed(module_name: str, fmt) -> int:
    """The cache pointer alignment (bytes) of a fast path's widest record store, stated here from the
    kernels' store widths: MAIN_FP4's codes leave as 8-byte stores, the index kernel's e4m3 codes too,
    everything else as 4-byte words. A less aligned cache stays on the portable kernel."""
    if module_name == "main_latent_fp4" or (module_name == "indexer" and fmt.cast_fmt == "e4m3"):
        return 8
    return 4


# ------------------------------------------------------------------------------------ cache writes
@dataclasses.dataclass(frozen=True)
class WriteCase:
    name: str
    n: int
    seed: int
    special: bool = False            # SPEC §6 edge rows (special_rows)
    block_size: int = 64
    token_padding: int = 0           # token-interleaved formats only
    block_padding: int = 0
    cache_offset: int = 0            # bytes: the cache pointer's alignment
    guard: int = 64                  # random bytes after the cache (and 64 before it)
    x_offset: int = 0                # elements: x's pointer alignment is 2 * x_offset bytes
    x_row_pad: int = 0               # elements between x's rows
    w_dtype: torch.dtype = torch.bfloat16
    cs_dtype: torch.dtype = torch.float32
    pos_dtype: torch.dtype = torch.int32
    slot_dtype: torch.dtype = torch.int32
    index_stride: int = 1            # positions and slots every index_stride elements
    invalid_slots: float = 0.05      # fraction of slots -1 or >= the capacity
    bad_positions: float = 0.03      # fraction of positions < 0 or >= max_position
    max_position: int = 4096         # rows of the cos/sin table
    eps: float = 1e-6

    def expect_fast(self, module_name: str, fmt) -> bool:
        """x is read as 4-byte words (a per-call guard), the cache as the module's widest stores."""
        return self.x_offset % 2 == 0 and self.cache_offset % cache_alignment_needed(module_name, fmt) == 0


I64 = torch.int64
WRITE_CASES = [
    WriteCase("n=1", n=1, seed=1),
    WriteCase("n=3,int64-strided-indices,fp32-weight,bf16-cos-sin,block-1", n=3, seed=2, pos_dtype=I64,
              slot_dtype=I64, index_stride=3, w_dtype=torch.float32, cs_dtype=torch.bfloat16, block_size=1,
              invalid_slots=0.3),
    WriteCase("n=300,special,block-24,3-row-table,eps-1e-5", n=300, seed=3, special=True, block_size=24,
              max_position=3, bad_positions=0.2, eps=1e-5),
    WriteCase("n=1000,int32-strided-indices", n=1000, seed=17, index_stride=3),
    WriteCase("n=4097,int64-positions", n=4097, seed=4, pos_dtype=I64),
    WriteCase("n=4097,special", n=4097, seed=5, special=True),
    WriteCase("n=4097,half-invalid-slots-and-positions", n=4097, seed=6, invalid_slots=0.5, bad_positions=0.5),
    WriteCase("n=65536", n=65536, seed=7),
    WriteCase("n=65536,special,int64-indices", n=65536, seed=10, special=True, pos_dtype=I64, slot_dtype=I64),
    WriteCase("n=262144", n=262144, seed=12),
    WriteCase("n=4097,padded-tokens-and-blocks,cache-offset-16,guard-256,x-rows-padded", n=4097, seed=8,
              token_padding=32, block_padding=40, cache_offset=16, guard=256, x_row_pad=8),
    WriteCase("n=777,x-and-cache-4-byte-aligned,odd-token-stride,int64-strided,fp32-weight,bf16-cos-sin,"
              "block-24,special", n=777, seed=14, x_offset=2, x_row_pad=2, token_padding=4, cache_offset=4,
              pos_dtype=I64, slot_dtype=I64, index_stride=3, w_dtype=torch.float32, cs_dtype=torch.bfloat16,
              block_size=24, eps=1e-5, special=True),
    WriteCase("n=300,cache-8-byte-aligned,x-4-byte-aligned", n=300, seed=9, x_offset=2, x_row_pad=2, cache_offset=8),
    WriteCase("n=300,x-2-bytes-off:portable", n=300, seed=15, x_offset=1),
]
# launch variants (num_warps, rows per warp or per thread, pipeline) beyond the tables' own, each on
# one of the module's formats in turn, on special values in padded strides
VARIANTS = [(1, 1, False), (1, 1, True), (1, 2, False), (1, 2, True), (2, 1, False), (4, 1, False), (4, 1, True)]
VARIANT_CASE = WriteCase("n=4097,special,padded,cache-offset-16", n=4097, seed=21, special=True, token_padding=32,
                         block_padding=40, cache_offset=16, x_row_pad=8)


def special_rows(x: torch.Tensor, fmt, g: torch.Generator) -> None:
    """SPEC §6's edge cases, in place, by row k (k % 11): 0 zero, 1-2 huge (1e30, 1e38: the sum of squares
    overflows), 3 bf16 subnormals, 4 rounding ties, 5 a group 2^20 above the rest, 6 small RoPE columns,
    7 a mean dominated by eps, 8 an all-zero group and signed zeros in the RoPE columns, 9 a group at
    2^-40, 10 e2m1 grid values (ties after scaling); and by k % 97: 13 an inf, 14 a NaN (quantized
    columns), 15 a -inf in the RoPE columns (their records are compared too)."""
    n, D = x.shape
    qd, grp, r0 = fmt.quant_dim, fmt.elements_per_sf, D - 64
    k = torch.arange(n, device=x.device)

    def rows(r, mod=11):
        return (k % mod == r).nonzero().flatten()

    def group(j):                     # the j-th quantization group (wrapping: INDEX_FP8_FP32 has one)
        start = (j * grp) % qd
        return slice(start, start + grp)

    def rand(r, scale):
        return (torch.randn(len(rows(r)), D, generator=g, device=x.device) * scale).to(x.dtype)
    x[rows(0)] = 0.0
    x[rows(1)] = rand(1, 1e30)
    x[rows(2)] = rand(2, 1e38)
    x[rows(3)] = (torch.randint(-127, 128, (len(rows(3)), D), generator=g, device=x.device).float()
                  * 2.0 ** -133).to(x.dtype)
    x[rows(4)] = (torch.randint(-64, 65, (len(rows(4)), D), generator=g, device=x.device).float() / 16).to(x.dtype)
    x[rows(5), group(2)] *= 2.0 ** 20
    x[rows(6), r0:] *= 1e-3
    x[rows(7)] = (x[rows(7)].float() * 2.0 ** -120).to(x.dtype)
    signed = rows(8)
    x[signed, group(1)] = 0.0
    x[signed, r0:] = 0.0
    x[signed, r0::3] = -0.0
    x[rows(9), group(3)] *= 2.0 ** -40
    x[rows(10)] = (torch.randint(-96, 97, (len(rows(10)), D), generator=g, device=x.device).float() / 16).to(x.dtype)
    inf, nan = rows(13, 97), rows(14, 97)
    x[inf, (inf * 37) % qd] = float("inf")
    x[nan, (nan * 53) % qd] = float("nan")
    x[rows(15, 97), r0 + 22] = float("-inf")


def strided(t: torch.Tensor, stride: int) -> torch.Tensor:
    """t's values every ``stride`` elements of a larger buffer."""
    if stride == 1:
        return t
    buf = torch.zeros(t.shape[0] * stride, dtype=t.dtype, device=t.device)
    buf[::stride] = t
    return buf[::stride]


class WriteInputs:
    """A case's inputs for a format on a device, and the random bytes the cache's storage starts from."""

    def __init__(self, case: WriteCase, fmt, device):
        g = torch.Generator(device=device).manual_seed(case.seed * 7919 + case.n)
        n, D, dev = case.n, fmt.head_dim, device
        self.case, self.fmt = case, fmt
        row = D + case.x_row_pad
        xbuf = torch.empty(case.x_offset + n * row, dtype=torch.bfloat16, device=dev)
        self.x = torch.as_strided(xbuf, (n, D), (row, 1), case.x_offset)
        scale = torch.exp2(torch.randint(-8, 9, (n, 1), generator=g, device=dev).float())
        self.x.copy_((torch.randn(n, D, generator=g, device=dev) * scale).to(torch.bfloat16))
        if case.special:
            special_rows(self.x, fmt, g)
        self.weight = (torch.randn(D, generator=g, device=dev) * 0.2 + 1.0).to(case.w_dtype)
        P = case.max_position
        self.cos_sin = cos_sin_cache(P, 64).to(device=dev, dtype=case.cs_dtype)
        pos = torch.randint(0, P, (n,), generator=g, device=dev)
        bad = torch.rand(n, generator=g, device=dev) < case.bad_positions
        far = torch.where(torch.rand(n, generator=g, device=dev) < 0.5, -1 - pos, pos + P)
        self.positions = strided(torch.where(bad, far, pos).to(case.pos_dtype), case.index_stride)
        blocks = -(-n // case.block_size) + 2
        capacity = blocks * case.block_size
        slots = torch.randperm(capacity, generator=g, device=dev)[:n]
        bad = torch.rand(n, generator=g, device=dev) < case.invalid_slots
        junk = torch.where(torch.rand(n, generator=g, device=dev) < 0.5, torch.full_like(slots, -1),
                           capacity + torch.randint(0, 1000, (n,), generator=g, device=dev))
        self.slots = strided(torch.where(bad, junk, slots).to(case.slot_dtype), case.index_stride)
        pad = dict(token_padding=case.token_padding) if fmt.token_interleaved else {}
        layout = fmt.allocate(blocks, case.block_size, block_padding=case.block_padding, device="meta", **pad)
        self.shape, self.strides = layout.shape, layout.stride()
        self.cache_start = 64 + case.cache_offset
        nbytes = self.cache_start + blocks * self.strides[0] + case.guard
        self.poison = torch.randint(0, 256, (nbytes,), generator=g, device=dev, dtype=torch.uint8)

    def call_args(self, storage: torch.Tensor) -> dict:
        """The public call's arguments, writing into ``storage`` (a copy of the poison)."""
        cache = torch.as_strided(storage, self.shape, self.strides, self.cache_start)
        return dict(x=self.x, norm_args=NormArgs(self.weight, self.case.eps),
                    rope_args=RopeArgs(self.positions, self.cos_sin, 64, True), hadamard_args=None,
                    cast_args=CastArgs.from_cache_format(self.fmt),
                    out_args=KVCacheOutArgs(cache, self.slots, layout=self.fmt))

    def write(self, **route):
        """(the whole storage after one call routed by ``router.fast_paths(**route)``, how many calls a
        fast path ran)."""
        storage = self.poison.clone()
        with kvfuse.use_backend("triton"), router.fast_paths(**route) as choice:
            kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(**self.call_args(storage))
        torch.cuda.synchronize()
        return storage, choice.fast_calls


def write_params():
    return [pytest.param(name, fmt, case, id=f"{name}-{fmt.name}-{case.name}")
            for name in MODULES for fmt in FORMATS[name] for case in WRITE_CASES]


def variant_params():
    return [pytest.param(name, FORMATS[name][i % len(FORMATS[name])], v,
                         id=f"{name}-{FORMATS[name][i % len(FORMATS[name])].name}-w{v[0]}-r{v[1]}-p{int(v[2])}")
            for name in MODULES for i, v in enumerate(VARIANTS)]


def assert_fast_equals_portable(inputs: WriteInputs, module, expect_fast: bool, launch_table=None):
    portable, calls = inputs.write(only=())
    assert calls == 0
    fast, calls = inputs.write(only=module, min_rows=1, launch_table=launch_table)
    assert calls == int(expect_fast), f"the fast path {'did not run' if expect_fast else 'ran'}"
    assert_bytes_equal(fast, portable, "whole cache storage, fast path against the portable kernel")


@needs_gluon
@pytest.mark.parametrize("module_name,fmt,case", write_params())
def test_cache_write_equals_the_portable_kernel(module_name, fmt, case):
    inputs = WriteInputs(case, fmt, "cuda")
    assert_fast_equals_portable(inputs, MODULES[module_name], case.expect_fast(module_name, fmt))


@needs_gluon
@pytest.mark.parametrize("module_name,fmt,variant", variant_params())
def test_launch_variant_equals_the_portable_kernel(module_name, fmt, variant):
    inputs = WriteInputs(VARIANT_CASE, fmt, "cuda")
    assert_fast_equals_portable(inputs, MODULES[module_name], True, launch_table=lambda n_rows: variant)


# ------------------------------------------------------------------------------------ contiguous (q, sf)
@dataclasses.dataclass(frozen=True)
class ContiguousCase:
    name: str
    n: int
    heads: int
    seed: int
    norm: Optional[torch.dtype] = None   # the RMSNorm weight's dtype (None: no norm, the indexer Q's)
    pos_dtype: torch.dtype = torch.int32
    pos_stride: int = 1
    cs_dtype: torch.dtype = torch.float32
    max_position: int = 4096
    bad_positions: float = 0.0
    special: bool = False
    x_pad: int = 0                       # elements between x's rows
    q_pad: int = 0                       # elements between q's rows
    sf_pad: int = 0                      # elements between sf's rows
    q_offset: int = 0                    # bytes: q's pointer alignment
    x2d: bool = False                    # x [n, 128] (one head)

    def expect_fast(self, cast) -> bool:
        """q's codes leave as 8-byte (e4m3) or 4-byte (e2m1) stores: a less aligned q fails the guard."""
        return self.q_offset % (8 if cast.cast_fmt == "e4m3" else 4) == 0


CONTIGUOUS_CASES = [
    ContiguousCase("64-heads,n=1", n=1, heads=64, seed=1),
    ContiguousCase("64-heads,n=3,norm-bf16,int64-strided-positions,bf16-3-row-table,positions-out-of-range", n=3,
                   heads=64, seed=2, norm=torch.bfloat16, pos_dtype=I64, pos_stride=3, cs_dtype=torch.bfloat16,
                   max_position=3, bad_positions=0.3),
    ContiguousCase("4-heads,n=300,special,norm-fp32,x-q-sf-rows-padded", n=300, heads=4, seed=3, norm=torch.float32,
                   special=True, x_pad=8, q_pad=8, sf_pad=3),
    ContiguousCase("64-heads,n=1000,positions-out-of-range", n=1000, heads=64, seed=4, bad_positions=0.1),
    ContiguousCase("x-2d,n=4097,norm-bf16", n=4097, heads=1, seed=5, norm=torch.bfloat16, x2d=True),
    ContiguousCase("64-heads,n=5,q-2-bytes-off:portable", n=5, heads=64, seed=6, q_offset=2),
]


def padded_rows(n, heads, width, pad, dtype, offset, g, device):
    """A [n, heads, width] view with rows ``width + pad`` elements apart, 64 + ``offset`` bytes into a
    buffer of random bytes that ends 64 bytes after it: (view, the whole buffer)."""
    item = torch.empty(0, dtype=dtype).element_size()
    row = width + pad
    start, size = 64 + offset, n * heads * row * item
    buf = torch.randint(0, 256, (start + size + 64,), generator=g, dtype=torch.uint8).to(device)
    view = torch.as_strided(buf[start:start + size].view(dtype), (n, heads, width), (heads * row, row, 1))
    return view, buf


class ContiguousInputs:
    """A contiguous case's inputs for a cast, and the random bytes q's and sf's buffers start from."""

    def __init__(self, case: ContiguousCase, cast, device):
        g = torch.Generator().manual_seed(case.seed)
        n, H, P = case.n, case.heads, case.max_position
        self.case, self.cast = case, cast
        x = torch.randn(n, H, 128 + case.x_pad, generator=g) * torch.exp2(
            torch.randint(-8, 9, (n, H, 1), generator=g).float())
        if case.special:
            x[::5, :, 64:] *= 1e-3
            x[1::7, :, :32] = 0.0
            x[2::11, 0, 70] = float("inf")
            x[3::13, -1, 5] = float("nan")
        self.x = x.to(torch.bfloat16).to(device)[..., :128]
        if case.x2d:
            self.x = self.x[:, 0]
        ang = torch.rand(P, 32, generator=g) * 6.3
        self.cos_sin = torch.cat([ang.cos(), ang.sin()], 1).to(case.cs_dtype).to(device)
        pos = torch.randint(0, P, (n * case.pos_stride,), generator=g)
        bad = torch.rand(n * case.pos_stride, generator=g) < case.bad_positions
        pos = torch.where(bad, torch.where(torch.rand(n * case.pos_stride, generator=g) < 0.5, -1, P + 5), pos)
        self.positions = pos.to(case.pos_dtype).to(device)[::case.pos_stride]
        self.weight = None if case.norm is None else (torch.rand(128, generator=g) * 2).to(case.norm).to(device)
        e2m1 = cast.cast_fmt == "e2m1"
        self.q_layout = (64 if e2m1 else 128, case.q_pad, torch.uint8 if e2m1 else torch.float8_e4m3fn,
                         case.q_offset)
        sf_dtype = {"ue8m0": torch.uint8, "e4m3": torch.float8_e4m3fn}.get(cast.sf_format, torch.float32)
        self.sf_layout = (128 // cast.num_per_channels, case.sf_pad, sf_dtype, 0)
        self.poison_seed = case.seed + 1000
        self.device = device

    def call_args(self):
        """(the public call's arguments, (q's buffer, sf's buffer)): new buffers of the same random bytes."""
        c, g = self.case, torch.Generator().manual_seed(self.poison_seed)
        q, q_buf = padded_rows(c.n, c.heads, *self.q_layout, g, self.device)
        sf, sf_buf = padded_rows(c.n, c.heads, *self.sf_layout, g, self.device)
        if c.x2d:
            q, sf = q[:, 0], sf[:, 0]
        norm = None if self.weight is None else NormArgs(self.weight, 1e-6)
        args = dict(x=self.x, norm_args=norm, rope_args=RopeArgs(self.positions, self.cos_sin, 64, True),
                    hadamard_args=None, cast_args=self.cast, out_args=ContiguousOutArgs(out=q, sf=sf))
        return args, (q_buf, sf_buf)

    def write(self, **route):
        args, buffers = self.call_args()
        with kvfuse.use_backend("triton"), router.fast_paths(**route) as choice:
            kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(**args)
        torch.cuda.synchronize()
        return buffers, choice.fast_calls


def contiguous_params():
    return [pytest.param(name, cast, case, id=f"{name}-{cast.cast_fmt}-{cast.num_per_channels}-{cast.sf_format}-"
                                              f"{case.name}")
            for name in MODULES for cast in CONTIGUOUS_CASTS.get(name, ()) for case in CONTIGUOUS_CASES]


@needs_gluon
@pytest.mark.parametrize("module_name,cast,case", contiguous_params())
def test_contiguous_outputs_equal_the_portable_kernel(module_name, cast, case):
    inputs = ContiguousInputs(case, cast, "cuda")
    portable, calls = inputs.write(only=())
    assert calls == 0
    fast, calls = inputs.write(only=MODULES[module_name], min_rows=1)
    assert calls == int(case.expect_fast(cast)), "the fast path ran" if calls else "the fast path did not run"
    for what, a, b in zip(("q's buffer", "sf's buffer"), fast, portable):
        assert_bytes_equal(a, b, what + ", fast path against the portable kernel")


# ------------------------------------------------------------------------------------ the e2m1 encoder
@needs_gluon
def test_e2m1_encoder_mirror_on_every_fp32():
    """gluon_common.e2m1_nibble (MAIN_FP4's and INDEX_NVFP4's e2m1 encoder), through its host mirror,
    gives kvfuse.reference.encode_e2m1's code for every fp32 pattern (NaN left out: SPEC §6 leaves its
    group free). Both are torch integer / fp32 operations without multiply-adds, exact on either
    device: here on the GPU, 2^26 patterns at a time (the CPU tests take samples,
    tests/test_gluon_main_latent_fp4.py)."""
    step = 1 << 26
    for start in range(-(1 << 31), 1 << 31, step):
        t = torch.arange(start, start + step, dtype=torch.int64, device="cuda").to(torch.int32).view(torch.float32)
        bad = (gluon_common.e2m1_nibble_mirror(t) != ref.encode_e2m1(t).to(torch.int32)) & ~torch.isnan(t)
        assert not bool(bad.any()), f"patterns {t[bad][:4].view(torch.int32).tolist()} from {start:#x}"


# ------------------------------------------------------------------------------------ the tables (CPU too)
def test_every_fast_path_has_cases():
    assert set(MODULES) == set(FORMATS) and set(CONTIGUOUS_CASTS) <= set(MODULES)
    for name in MODULES:
        assert any(c.expect_fast(name, f) for f in FORMATS[name] for c in WRITE_CASES)
        assert any(not c.expect_fast(name, f) for f in FORMATS[name] for c in WRITE_CASES)


def _runs_fast(module, plan, call_tensors: dict) -> bool:
    """What the dispatch decides for a call: eligible, and its per-call guard passes."""
    if not module.eligible(plan):
        return False
    check, fields = module.call_guard(plan)
    return check(*(call_tensors[f] for f in fields))


@pytest.mark.parametrize("module_name", sorted(FORMATS))
def test_write_cases_mean_what_they_say(module_name):
    """On the CPU: each write case (up to 1000 rows, the rest share their layouts) is eligible for its
    module and passes its guard exactly when the GPU test expects the fast path to run."""
    module = MODULES[module_name]
    for fmt in FORMATS[module_name]:
        for case in [c for c in WRITE_CASES if c.n <= 1000] + [VARIANT_CASE]:
            inputs = WriteInputs(case, fmt, "cpu")
            args = inputs.call_args(inputs.poison.clone())
            plan = build_plan(**args)[0]
            tensors = dict(x=plan.x, weight=plan.weight)
            assert _runs_fast(module, plan, tensors) == case.expect_fast(module_name, fmt), (fmt.name, case.name)


@pytest.mark.parametrize("module_name", sorted(CONTIGUOUS_CASTS))
def test_contiguous_cases_mean_what_they_say(module_name):
    module = MODULES[module_name]
    for cast in CONTIGUOUS_CASTS[module_name]:
        for case in CONTIGUOUS_CASES:
            args, _ = ContiguousInputs(case, cast, "cpu").call_args()
            plan = build_plan(**args)[0]
            tensors = dict(x=plan.x, q_out=plan.q_out, sf_out=plan.sf_out, weight=plan.weight)
            assert _runs_fast(module, plan, tensors) == case.expect_fast(cast), (cast, case.name)
