"""kvfuse.engines.flashinfer against FlashInfer 0.7.2's documented semantics, written here as small torch
code (never from kvfuse's output): append_paged_kv_cache's page addressing (entry i at page
kv_indices[kv_indptr[batch_indices[i]] + positions[i] // page_size], offset positions[i] % page_size)
for NHD / HND and the tuple / single-tensor caches, into storages poisoned with 0xAB bytes compared
whole; the cos/sin-cache RoPE against an fp64 RoPE with FlashInfer's own test tolerance (its CUDA
kernel contracts FMAs, so its bytes are not an exact chain's) and byte for byte against
kvfuse.reference.rope. Reference backend and Triton's interpreter; the errors for what is not
supported yet; torch.compile(fullgraph=True)."""
import math

import pytest
import torch

import kvfuse
from kvfuse import reference
from kvfuse.engines import flashinfer
from helpers import assert_bytes_equal, assert_compiled_matches_eager, random_bf16

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
BACKENDS = ["reference", "triton"]
POISON = 0xAB


# --------------------------------------------------------------------------- append_paged_kv_cache
def _batch(append_lens, kv_lens, page_size, max_num_pages, seed):
    """FlashInfer's append metadata for requests with ``kv_lens`` tokens after the append, the last
    ``append_lens`` of them new: pages drawn at random from the pool (kv_indices), kv_indptr,
    kv_last_page_len, and get_batch_indices_positions' batch_indices / positions."""
    g = torch.Generator().manual_seed(seed)
    pages_per_req = [math.ceil(n / page_size) for n in kv_lens]
    kv_indices = torch.randperm(max_num_pages, generator=g)[:sum(pages_per_req)].to(torch.int32)
    kv_indptr = torch.tensor([0] + list(torch.tensor(pages_per_req).cumsum(0)), dtype=torch.int32)
    kv_last_page_len = torch.tensor([n - (p - 1) * page_size for n, p in zip(kv_lens, pages_per_req)],
                                    dtype=torch.int32)
    batch_indices = torch.tensor([b for b, a in enumerate(append_lens) for _ in range(a)], dtype=torch.int32)
    positions = torch.tensor([kv_lens[b] - a + j for b, a in enumerate(append_lens) for j in range(a)],
                             dtype=torch.int32)
    return batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len


def _caches(storage, max_num_pages, page_size, num_kv_heads, head_dim, layout, single, dtype=torch.bfloat16):
    t = storage.view(dtype)
    inner = (page_size, num_kv_heads, head_dim) if layout == "NHD" else (num_kv_heads, page_size, head_dim)
    if single:
        whole = t.view(max_num_pages, 2, *inner)
        return whole, whole[:, 0], whole[:, 1]
    k, v = t.view(2, max_num_pages, *inner).unbind(0)
    return (k, v), k, v


def _append_expected(key, value, k_cache, v_cache, batch_indices, positions, kv_indices, kv_indptr, layout):
    page_size = k_cache.shape[1] if layout == "NHD" else k_cache.shape[2]
    for i, (b, p) in enumerate(zip(batch_indices.tolist(), positions.tolist())):
        page = int(kv_indices[int(kv_indptr[b]) + p // page_size])
        off = p % page_size
        if layout == "NHD":
            k_cache[page, off], v_cache[page, off] = key[i], value[i]
        else:
            k_cache[page, :, off], v_cache[page, :, off] = key[i], value[i]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("single", [False, True], ids=["tuple", "single"])
@pytest.mark.parametrize("page_size,head_dim,num_kv_heads", [(16, 128, 8), (1, 64, 2), (5, 256, 4)])
def test_append_paged_kv_cache(backend, layout, single, page_size, head_dim, num_kv_heads):
    append_lens, kv_lens = [5, 1, 7, 2], [5, 18, 25, 9]         # a prefill, decodes, a chunked prefill
    if backend == "triton":
        append_lens, kv_lens = [3, 1, 2], [3, 9, 6]
    max_num_pages = sum(math.ceil(n / page_size) for n in kv_lens) + 3
    meta = _batch(append_lens, kv_lens, page_size, max_num_pages, seed=page_size + head_dim)
    batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len = meta
    nnz = sum(append_lens)
    qkv = random_bf16((nnz, 2 * num_kv_heads + 4, head_dim), seed=head_dim)
    key, value = qkv[:, 4:4 + num_kv_heads], qkv[:, 4 + num_kv_heads:]     # strided views of a projection
    nbytes = 2 * max_num_pages * page_size * num_kv_heads * head_dim * 2
    got = torch.full((nbytes,), POISON, dtype=torch.uint8)
    want = got.clone()
    paged, _, _ = _caches(got, max_num_pages, page_size, num_kv_heads, head_dim, layout, single)
    with kvfuse.use_backend(backend):
        flashinfer.append_paged_kv_cache(key, value, batch_indices, positions, paged, kv_indices, kv_indptr,
                                         kv_last_page_len, kv_layout=layout)
    _, ek, ev = _caches(want, max_num_pages, page_size, num_kv_heads, head_dim, layout, single)
    _append_expected(key, value, ek, ev, batch_indices, positions, kv_indices, kv_indptr, layout)
    assert_bytes_equal(got, want, f"paged cache {layout}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("head_dim", [72, 128])
def test_append_paged_kv_cache_fp16(backend, layout, head_dim):
    """fp16 entries into fp16 caches (FlashInfer's kernel is templated on the one dtype): their bits at the
    pages and offsets of FlashInfer's addressing; head_dim 72 (a multiple of 8)."""
    meta = _batch([3, 1], [3, 6], 4, 6, seed=head_dim)
    batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len = meta
    g = torch.Generator().manual_seed(head_dim)
    key = (torch.randn(4, 2, head_dim, generator=g) * 5).half()
    value = torch.randn(4, 2, head_dim, generator=g).half()
    nbytes = 2 * 6 * 4 * 2 * head_dim * 2
    got = torch.full((nbytes,), POISON, dtype=torch.uint8)
    want = got.clone()
    paged, _, _ = _caches(got, 6, 4, 2, head_dim, layout, False, torch.float16)
    with kvfuse.use_backend(backend):
        flashinfer.append_paged_kv_cache(key, value, batch_indices, positions, paged, kv_indices, kv_indptr,
                                         kv_last_page_len, kv_layout=layout)
    _, ek, ev = _caches(want, 6, 4, 2, head_dim, layout, False, torch.float16)
    _append_expected(key, value, ek, ev, batch_indices, positions, kv_indices, kv_indptr, layout)
    assert_bytes_equal(got, want, f"fp16 paged cache {layout}")


def test_append_paged_kv_cache_int64_metadata():
    """int64 metadata addresses the same slots as int32 (FlashInfer converts it with .int())."""
    meta = _batch([3, 2], [7, 4], 4, 6, seed=5)
    key, value = random_bf16((5, 2, 64), seed=6), random_bf16((5, 2, 64), seed=7)
    a = torch.full((2 * 6 * 4 * 2 * 64 * 2,), POISON, dtype=torch.uint8)
    b = a.clone()
    pa, _, _ = _caches(a, 6, 4, 2, 64, "NHD", True)
    pb, _, _ = _caches(b, 6, 4, 2, 64, "NHD", True)
    with kvfuse.use_backend("reference"):
        flashinfer.append_paged_kv_cache(key, value, *meta[:2], pa, *meta[2:])
        flashinfer.append_paged_kv_cache(key, value, *(m.long() for m in meta[:2]), pb, *(m.long() for m in meta[2:]))
    assert torch.equal(a, b) and not torch.equal(a, torch.full_like(a, POISON))


# --------------------------------------------------------------------------- RoPE
def _rope_fp64(x, positions, cos_sin, is_neox):
    """The exact rotation of bf16 x [nnz, H, D] (fp64 arithmetic on the fp32 table's values) on the first
    rotary_dim dims, the rest unchanged: what FlashInfer's kernel approximates."""
    rot = cos_sin.shape[1]
    half = rot // 2
    y = x.double().clone()
    row = cos_sin.double()[positions.long()][:, None, :]
    c, s = row[..., :half], row[..., half:]
    j = torch.arange(half)
    i0, i1 = (j, j + half) if is_neox else (2 * j, 2 * j + 1)
    a, b = y[..., i0].clone(), y[..., i1].clone()
    y[..., i0], y[..., i1] = a * c - b * s, a * s + b * c
    return y


# FlashInfer's tests/test_rope.py::test_rope_cos_sin_cache grid (head_size, rotary_dim, max_position, base,
# is_neox, batch_size, seq_len, num_q_heads, num_kv_heads), batches cut for the CPU
ROPE_GRID = [(64, 64, 32, 8000, True, 4, 32, 1, 1), (256, 128, 4096, 10000, True, 2, 40, 4, 2),
             (64, 32, 2048, 8432, True, 2, 19, 4, 1), (64, 64, 32, 8000, False, 4, 32, 1, 1),
             (256, 128, 4096, 9231, False, 3, 23, 4, 2)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("case", ROPE_GRID, ids=[f"d{c[0]}r{c[1]}{'neox' if c[4] else 'gptj'}" for c in ROPE_GRID])
def test_apply_rope_with_cos_sin_cache(backend, inplace, case):
    head_size, rotary_dim, max_pos, base, is_neox, batch, seq_len, hq, hk = case
    if backend == "triton":
        batch, seq_len = 1, 5
    nnz = batch * seq_len
    table = kvfuse.rope.cos_sin_cache(max_pos, rotary_dim, base=base)
    positions = torch.arange(seq_len).repeat(batch)
    qkv = random_bf16((nnz, (hq + 2 * hk) * head_size), seed=head_size + rotary_dim, outliers=False)
    query, key = qkv[:, :hq * head_size], qkv[:, hq * head_size:(hq + hk) * head_size]   # packed views
    q_in, k_in = query.clone(), key.clone()
    with kvfuse.use_backend(backend):
        if inplace:
            before_v = qkv[:, (hq + hk) * head_size:].clone()
            assert flashinfer.apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, table,
                                                                    is_neox) is None
            q_out, k_out = query, key
            assert torch.equal(qkv[:, (hq + hk) * head_size:], before_v)          # V untouched
        else:
            q_out, k_out = flashinfer.apply_rope_with_cos_sin_cache(positions, query, key, head_size, table, is_neox)
            assert torch.equal(query, q_in) and torch.equal(key, k_in)
    for x_in, out, h in ((q_in, q_out, hq), (k_in, k_out, hk)):
        assert out.shape == x_in.shape and out.dtype == torch.bfloat16
        x3 = x_in.view(nnz, h, head_size)
        want = reference.rope(x3, positions, table, rotary_dim, is_neox, offset=0)
        assert_bytes_equal(out.view(nnz, h, head_size), want, "kvfuse.reference.rope")
        torch.testing.assert_close(out.view(nnz, h, head_size).double(), _rope_fp64(x3, positions, table, is_neox),
                                   atol=1e-2, rtol=1e-2)                     # FlashInfer's test tolerance


def test_rope_position_outside_table_is_identity():
    """FlashInfer reads past its table for such a position; kvfuse leaves the token unchanged."""
    table = kvfuse.rope.cos_sin_cache(8, 64)
    q, k = random_bf16((3, 128), seed=1), random_bf16((3, 64), seed=2)
    with kvfuse.use_backend("reference"):
        q_out, k_out = flashinfer.apply_rope_with_cos_sin_cache(torch.tensor([1, 8, 100]), q, k, 64, table)
    assert torch.equal(q_out[1:], q[1:]) and torch.equal(k_out[1:], k[1:])
    assert not torch.equal(q_out[0], q[0])


# --------------------------------------------------------------------------- errors
def _append_args(**over):
    meta = _batch([2, 1], [2, 3], 4, 4, seed=1)
    kw = dict(append_key=random_bf16((3, 2, 64), seed=1), append_value=random_bf16((3, 2, 64), seed=2),
              batch_indices=meta[0], positions=meta[1],
              paged_kv_cache=torch.full((4, 2, 4, 2, 64), 1.5, dtype=torch.bfloat16),
              kv_indices=meta[2], kv_indptr=meta[3], kv_last_page_len=meta[4])
    kw.update(over)
    return kw


def _rope_args(**over):
    kw = dict(positions=torch.arange(3), query=random_bf16((3, 128), seed=1), key=random_bf16((3, 64), seed=2),
              head_size=64, cos_sin_cache=kvfuse.rope.cos_sin_cache(8, 64))
    kw.update(over)
    return kw


ERRORS = [
    ("fp32 key", flashinfer.append_paged_kv_cache, _append_args,
     lambda: dict(append_key=torch.zeros(3, 2, 64)), TypeError,
     "append_key: dtype torch.float32 is not supported yet"),
    ("fp16 key, bf16 value", flashinfer.append_paged_kv_cache, _append_args,
     lambda: dict(append_key=torch.zeros(3, 2, 64, dtype=torch.half)), TypeError,
     "append_value: expected append_key's dtype torch.float16, got torch.bfloat16"),
    ("fp16 entries, bf16 cache", flashinfer.append_paged_kv_cache, _append_args,
     lambda: dict(append_key=torch.zeros(3, 2, 64, dtype=torch.half), append_value=torch.zeros(3, 2, 64, dtype=torch.half)),
     TypeError, "paged_kv_cache: dtype torch.bfloat16 is not supported yet (kvfuse appends torch.float16"),
    ("fp8 cache", flashinfer.append_paged_kv_cache, _append_args,
     lambda: dict(paged_kv_cache=torch.zeros(4, 2, 4, 2, 64, dtype=torch.float8_e4m3fn)), TypeError,
     "paged_kv_cache: dtype torch.float8_e4m3fn is not supported yet"),
    ("head_dim 36", flashinfer.append_paged_kv_cache, _append_args,
     lambda: dict(append_key=torch.zeros(3, 2, 36, dtype=torch.bfloat16),
                  append_value=torch.zeros(3, 2, 36, dtype=torch.bfloat16)), ValueError,
     "append_key: head size 36 is not supported yet"),
    ("layout", flashinfer.append_paged_kv_cache, _append_args, lambda: dict(kv_layout="NDH"), ValueError,
     "kv_layout: expected one of"),
    ("cache not a pair", flashinfer.append_paged_kv_cache, _append_args, lambda: dict(paged_kv_cache=[1, 2, 3]),
     TypeError, "paged_kv_cache must be"),
    ("positions count", flashinfer.append_paged_kv_cache, _append_args,
     lambda: dict(positions=torch.zeros(2, dtype=torch.int32)), ValueError, "positions: expected shape (3,), got (2,)"),
    ("float indices", flashinfer.append_paged_kv_cache, _append_args, lambda: dict(kv_indices=torch.zeros(2)),
     ValueError, "kv_indices: expected a 1-d int32 / int64 tensor"),
    ("cache heads (kvfuse's check, FlashInfer's name)", flashinfer.append_paged_kv_cache, _append_args,
     lambda: dict(paged_kv_cache=torch.full((4, 2, 4, 3, 64), 1.5, dtype=torch.bfloat16)), ValueError,
     "paged_kv_cache: expected"),
    ("bf16 table", flashinfer.apply_rope_with_cos_sin_cache, _rope_args,
     lambda: dict(cos_sin_cache=kvfuse.rope.cos_sin_cache(8, 64).bfloat16()), ValueError,
     "cos_sin_cache should be float32"),
    ("fp16 query", flashinfer.apply_rope_with_cos_sin_cache_inplace, _rope_args,
     lambda: dict(query=torch.zeros(3, 128, dtype=torch.half)), TypeError, "query: dtype torch.float16 is not supported yet"),
    ("head_size 40", flashinfer.apply_rope_with_cos_sin_cache, _rope_args,
     lambda: dict(head_size=40, query=torch.zeros(3, 80, dtype=torch.bfloat16),
                  key=torch.zeros(3, 40, dtype=torch.bfloat16)), ValueError, "head_size: head size 40 is not supported yet"),
    ("key not heads", flashinfer.apply_rope_with_cos_sin_cache, _rope_args,
     lambda: dict(key=torch.zeros(3, 96, dtype=torch.bfloat16)), ValueError, "key: expected [nnz, num_heads * 64]"),
    ("table too wide", flashinfer.apply_rope_with_cos_sin_cache_inplace, _rope_args,
     lambda: dict(cos_sin_cache=kvfuse.rope.cos_sin_cache(8, 128)), ValueError, "cos_sin_cache: rotary_dim 128"),
    ("positions count", flashinfer.apply_rope_with_cos_sin_cache, _rope_args,
     lambda: dict(positions=torch.arange(2)), ValueError, "positions, key: expected 3 tokens"),
    ("float positions (kvfuse's check, FlashInfer's name)", flashinfer.apply_rope_with_cos_sin_cache, _rope_args,
     lambda: dict(positions=torch.arange(3.0)), TypeError, "query: rope_args.positions: expected dtype"),
]


@pytest.mark.parametrize("label,fn,args,change,exc,match", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors_name_the_argument_and_write_nothing(label, fn, args, change, exc, match):
    kw = args(**change())
    written = [v for k, v in kw.items() if k in ("paged_kv_cache", "query", "key") and isinstance(v, torch.Tensor)]
    before = [t.clone() for t in written]
    with kvfuse.use_backend("reference"), pytest.raises(exc) as info:
        fn(**kw)
    assert str(info.value).startswith(match), str(info.value)
    for t, b in zip(written, before):
        assert torch.equal(t.view(torch.uint8), b.view(torch.uint8))


def test_compile_fullgraph():
    """Under torch.compile(fullgraph=True) the adapters trace (kvfuse routes through its custom ops)."""
    meta = _batch([3, 2], [7, 4], 4, 6, seed=5)
    key, value = random_bf16((5, 2, 64), seed=6), random_bf16((5, 2, 64), seed=7)
    table = kvfuse.rope.cos_sin_cache(16, 32)
    positions = torch.tensor([4, 5, 6, 2, 3])

    def step(paged, q, k):
        flashinfer.append_paged_kv_cache(key, value, meta[0], meta[1], paged, *meta[2:], kv_layout="HND")
        q_out, k_out = flashinfer.apply_rope_with_cos_sin_cache(positions, q, k, 64, table, False)
        flashinfer.apply_rope_with_cos_sin_cache_inplace(positions, q, k, 64, table)
        return q_out.float().sum() + k_out.float().sum()

    def fresh():
        return (torch.zeros(6, 2, 2, 4, 64, dtype=torch.bfloat16), random_bf16((5, 128), seed=8),
                random_bf16((5, 64), seed=9))

    assert_compiled_matches_eager(step, fresh)
