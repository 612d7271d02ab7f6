"""Shared test utilities (imported by the test modules; not a test module itself).

- :func:`guarded_cache`: a paged cache viewed inside a larger uint8 buffer of random bytes, so a
  test can compare the WHOLE buffer (guards before/after, padding, reserved bytes, other slots)
  byte for byte after a write.
- :func:`random_bf16`: random bf16 inputs with outlier channels, tiny/subnormal values, zeros.
- :func:`cos_sin_cache`: a standard RoPE table ``[max_pos, rotary_dim]`` (cos | sin).
- :func:`assert_bytes_equal`: raw-byte comparison (never a tolerance).
- :func:`poison_like`: NaN / random garbage of a tensor's shape and dtype.
- :func:`record_regions`: the storage byte offsets of a record's data / scale / tail bytes,
  computed from the SPEC's layout description (§7, §8), independently of kvfuse.
"""
from __future__ import annotations

import math

import torch

import kvfuse
from kvfuse.formats import KVCacheFormat
from kvfuse.rope import cos_sin_cache as rope_table


def _round_up(v: int, m: int) -> int:
    return -(-v // m) * m


def cache_strides(fmt: KVCacheFormat, block_size: int, num_heads: int = 1, token_padding: int = 0,
                  block_padding: int = 0):
    """(stride(0), stride(1)) in bytes of a cache of ``fmt``, computed from the SPEC (§7):
    token-interleaved: stride(1) = num_heads*bytes_per_token + token_padding rounded up to
    gcd(32, bytes_per_token); block-wide: stride(1) = bytes_per_token (a dense block).
    stride(0) = the block's bytes + block_padding rounded up to lcm(stride_alignment, block_alignment)
    (stride_alignment: gcd(32, bytes_per_token) token-interleaved, 32 block-wide)."""
    bpt = fmt.data_bytes + fmt.sf_bytes
    if fmt.token_interleaved:
        align = math.gcd(32, bpt)
        s1 = _round_up(num_heads * bpt + token_padding, align)
        block = block_size * s1
    else:
        assert num_heads == 1 and token_padding == 0
        align = 32
        s1 = bpt
        block = block_size * bpt
    s0 = _round_up(block + block_padding, math.lcm(align, fmt.block_alignment))
    return s0, s1


def guarded_cache(fmt: KVCacheFormat, num_blocks: int, block_size: int, num_heads: int = 1,
                  token_padding: int = 0, block_padding: int = 0, guard: int = 64, seed: int = 0):
    """A cache of ``fmt`` as a ``torch.as_strided`` view into a random uint8 buffer.

    Returns ``(cache_view, storage)``: ``storage`` is uint8 [guard + num_blocks*stride(0) + guard],
    every byte random (the cache's whole extent too: records, reserved scale bytes, padding between
    tokens and blocks); the cache starts at byte ``guard``.
    """
    s0, s1 = cache_strides(fmt, block_size, num_heads, token_padding, block_padding)
    g = torch.Generator().manual_seed(seed)
    storage = torch.randint(0, 256, (guard + num_blocks * s0 + guard,), dtype=torch.uint8, generator=g)
    bpt = fmt.data_bytes + fmt.sf_bytes
    cache = torch.as_strided(storage, (num_blocks, block_size, num_heads, bpt), (s0, s1, bpt, 1), guard)
    return cache, storage


def random_bf16(shape, seed: int, outliers: bool = True) -> torch.Tensor:
    """Random bf16 (normal(0, 1)) with, if ``outliers``, a few outlier channels (x30..x300 along the
    last dim), a few tiny values (bf16 subnormals and values near the 1e-4 floor), exact zeros and
    negative zeros. Never NaN or inf."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(shape, generator=g, dtype=torch.float32)
    if outliers and v.numel():
        d = shape[-1]
        nout = max(1, d // 32)
        ch = torch.randperm(d, generator=g)[:nout]
        mult = 30.0 + 270.0 * torch.rand(nout, generator=g)
        v[..., ch] *= mult
        flat = v.view(-1)
        k = max(1, flat.numel() // 50)
        # distinct indices: with a repeated index, which value an index_put leaves depends on the CPU's
        # threads, and two calls with one seed must give the same bytes
        idx = torch.unique(torch.randint(0, flat.numel(), (k,), generator=g))
        tiny = torch.tensor([1e-39, -3e-40, 9.2e-41, 2e-38, -1e-5, 3e-6, 0.0, -0.0], dtype=torch.float32)
        flat[idx] = tiny[torch.randint(0, len(tiny), (idx.numel(),), generator=g)]
    out = v.to(torch.bfloat16)
    assert torch.isfinite(out.float()).all()
    return out


def cos_sin_cache(max_pos: int, rotary_dim: int, dtype=torch.float32, base: float = 10000.0) -> torch.Tensor:
    """kvfuse.rope's fp32 table [max_pos, rotary_dim] (cos | sin) on the CPU, converted to ``dtype`` (the
    tests also feed the kernels bf16 tables)."""
    return rope_table(max_pos, rotary_dim, base).to(dtype)


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 copy of t's bytes (logical element order)."""
    t = t.contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    return t.view(torch.uint8).reshape(-1)


def assert_bytes_equal(a: torch.Tensor, b: torch.Tensor, what: str = "", check_dtype: bool = True) -> None:
    """Assert a and b hold the same raw bytes (no tolerance): compares flat uint8 views of the contiguous
    tensors. With ``check_dtype`` (default) the dtypes and shapes must match too; without it only the
    byte strings are compared (e.g. a float8 tensor against its expected uint8 codes)."""
    if check_dtype:
        assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
        assert tuple(a.shape) == tuple(b.shape), f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    ab, bb = byte_view(a), byte_view(b)
    assert ab.numel() == bb.numel(), f"{what}: {ab.numel()} bytes != {bb.numel()} bytes"
    if not torch.equal(ab, bb):
        bad = (ab != bb).nonzero().flatten()
        i = int(bad[0])
        raise AssertionError(f"{what}: {bad.numel()} of {ab.numel()} bytes differ; first at byte {i}: "
                             f"{int(ab[i]):#04x} != {int(bb[i]):#04x}")


def poison_like(t: torch.Tensor, seed: int = 1234) -> torch.Tensor:
    """A tensor shaped and typed like t: NaN for floating dtypes (including fp8), random for ints."""
    if t.dtype == torch.float8_e4m3fn:
        return torch.full(t.shape, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)
    if t.is_floating_point():
        return torch.full(t.shape, float("nan"), dtype=t.dtype)
    g = torch.Generator().manual_seed(seed)
    if t.dtype == torch.bool:
        return torch.randint(0, 2, t.shape, generator=g).bool()
    info = torch.iinfo(t.dtype)
    lo, hi = max(info.min, -(2 ** 31)), min(info.max, 2 ** 31 - 1)
    return torch.randint(lo, hi, t.shape, generator=g, dtype=torch.int64).to(t.dtype)


def record_regions(fmt: KVCacheFormat, block_size: int, s0: int, s1: int, base: int, block: int, offset: int,
                   head: int = 0):
    """Storage byte ranges (start, length) of the record (block, offset, head), from the SPEC:

    token-interleaved: record at base + block*s0 + offset*s1 + head*bytes_per_token:
        [quantized | scales (+reserved) | bf16 tail]
    block-wide: inside the block, per token [quantized | bf16 tail] (data_bytes each), then per
        token [scales (+reserved)] (sf_bytes each).
    Returns dict quant=(start, len), sf=(start, exact scale bytes), tail=(start, len), reserved=(start, the
    reserved bytes a write writes: all of them as zeros where the format has zero_reserved, else none)."""
    qb = fmt.head_dim * 2 if fmt.cast_fmt is None else (
        (fmt.head_dim - fmt.bf16_tail) // 2 if fmt.cast_fmt == "e2m1" else fmt.head_dim - fmt.bf16_tail)
    tail_bytes = 2 * fmt.bf16_tail
    data_bytes = qb + tail_bytes
    if fmt.cast_fmt is None:
        sf_exact = 0
    else:
        item = {"ue8m0": 1, "e4m3": 1, "fp32": 4, "ue8m0_fp32": 4}[fmt.sf_format]
        sf_exact = (fmt.head_dim - fmt.bf16_tail) // fmt.elements_per_sf * item
    bpt = data_bytes + fmt.sf_bytes
    zeroed = fmt.sf_bytes - sf_exact if fmt.zero_reserved else 0
    if fmt.token_interleaved:
        r = base + block * s0 + offset * s1 + head * bpt
        return {"quant": (r, qb), "sf": (r + qb, sf_exact), "tail": (r + qb + fmt.sf_bytes, tail_bytes),
                "reserved": (r + qb + sf_exact, zeroed)}
    b = base + block * s0
    d = b + offset * data_bytes
    sf_start = b + block_size * data_bytes + offset * fmt.sf_bytes
    return {"quant": (d, qb), "tail": (d + qb, tail_bytes), "sf": (sf_start, sf_exact),
            "reserved": (sf_start + sf_exact, zeroed)}


def write_records(expect: torch.Tensor, fmt: KVCacheFormat, block_size: int, num_blocks: int, s0: int, s1: int,
                  base: int, slots: torch.Tensor, quant: torch.Tensor, sf=None, tail=None) -> torch.Tensor:
    """Write the expected record bytes of every valid slot into ``expect`` (a flat uint8 copy of the
    storage) at the addresses :func:`record_regions` describes (vectorized). ``quant`` uint8
    [n, H, quantized bytes] (a bf16 cache: the bf16 data's bytes), ``sf`` uint8 [n, H, exact scale bytes],
    ``tail`` uint8 [n, H, 2*bf16_tail]; a format with ``zero_reserved`` writes its reserved bytes after the
    scales as zeros. Slots outside [0, num_blocks*block_size) write nothing. Returns ``expect``."""
    s = slots.to(torch.int64)
    valid = (s >= 0) & (s < num_blocks * block_size)
    s = s[valid]
    blk, off = s // block_size, s % block_size
    n, H = quant.shape[0], quant.shape[1]
    heads = torch.arange(H, dtype=torch.int64)
    qb = quant.shape[-1]
    tb = 0 if tail is None else tail.shape[-1]
    data_bytes = qb + tb
    bpt = data_bytes + fmt.sf_bytes
    if fmt.token_interleaved:
        rec = (base + blk * s0 + off * s1)[:, None] + heads[None, :] * bpt
        starts = {"quant": rec, "sf": rec + qb, "tail": rec + qb + fmt.sf_bytes}
    else:
        assert H == 1
        d = (base + blk * s0 + off * data_bytes)[:, None]
        starts = {"quant": d, "tail": d + qb, "sf": (base + blk * s0 + block_size * data_bytes + off * fmt.sf_bytes)[:, None]}
    if sf is not None and fmt.zero_reserved:
        sf = torch.cat([sf, sf.new_zeros(sf.shape[:-1] + (fmt.reserved_bytes,))], -1)
    for key, payload in (("quant", quant), ("sf", sf), ("tail", tail)):
        if payload is None or payload.shape[-1] == 0:
            continue
        payload = payload[valid]
        idx = starts[key][..., None] + torch.arange(payload.shape[-1], dtype=torch.int64)
        expect[idx.reshape(-1)] = payload.reshape(-1)
    return expect


class CountingKernel:
    """Wraps a Triton JITFunction: counts the launches that go through Triton's own path
    (``kernel[grid](...)``; direct launches, kvfuse/kernels/launcher.py, bypass it)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.arg_names = kernel.arg_names
        self.launches = 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]

    def warmup(self, *args, **kwargs):
        return self.kernel.warmup(*args, **kwargs)


def cache_at(fmt: KVCacheFormat, byte_offset: int, num_blocks: int = 4, block_size: int = 16) -> torch.Tensor:
    """A zeroed cache of ``fmt`` starting ``byte_offset`` bytes into its storage."""
    dense = fmt.allocate(num_blocks, block_size)
    storage = torch.zeros(dense.untyped_storage().nbytes() + 64, dtype=torch.uint8)
    return torch.as_strided(storage, dense.shape, dense.stride(), byte_offset)


def assert_compiled_matches_eager(step, fresh) -> None:
    """torch.compile(step, fullgraph=True) on one set of ``fresh()`` buffers writes and returns what the eager
    ``step`` does on another (reference backend), and the eager step changed the first buffer."""
    torch._dynamo.reset()
    eager, compiled = fresh(), fresh()
    with kvfuse.use_backend("reference"):
        want = step(*eager)
        got = torch.compile(step, fullgraph=True, backend="aot_eager")(*compiled)
    assert torch.equal(want, got)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
    assert not torch.equal(eager[0], fresh()[0])
