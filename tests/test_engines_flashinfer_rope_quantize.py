"""kvfuse.engines.flashinfer's RoPE-quantize calls against FlashInfer 0.7.2's documented semantics
(flashinfer/rope.py and its RopeQuantize / RopeQuantizeAppendPagedKVCache kernels in
include/flashinfer/pos_enc.cuh), restated here as small torch code: RoPE on the rope_dim columns in
fp32 (cosines then sines of the fp32 table at pos_ids; is_neox pairs (j, j + rope_dim / 2), else (2j,
2j + 1) with angle j), every value then multiplied by its scale (quant_scale_q for q,
quant_scale_kv for k and v) and cast to e4m3 with saturation; a K record holds the rope columns then
the nope ones; MLA's kpe / ckv caches hold them apart; entry i at page
kv_indices[kv_indptr[batch_indices[i]] + positions[i] // page_size], offset positions[i] % page_size,
none for batch_indices[i] < 0. Caches poisoned with 0xAB and compared whole. kvfuse's RoPE rounds each
product and the sum (FlashInfer's CUDA contracts FMAs: docs/engines.md), as the restatement does.
Reference backend and Triton's interpreter; errors; torch.compile(fullgraph=True)."""
import pytest
import torch

import kvfuse
from kvfuse.engines import flashinfer
from helpers import assert_compiled_matches_eager

F8 = torch.float8_e4m3fn
POISON = 0xAB
BACKENDS = ["reference"] + (["triton"] if kvfuse.backend.interpreter_enabled() else [])


def _act(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 3).to(dtype)


def _table(rope_dim, rows=64):
    return kvfuse.rope.cos_sin_cache(rows, rope_dim)


def _rope32(x, table, pos, rope_dim, neox):
    y = x.float().clone()
    cs = table[pos.long()]
    c, s = cs[:, None, :rope_dim // 2], cs[:, None, rope_dim // 2:]
    if neox:
        a, b = y[..., :rope_dim // 2].clone(), y[..., rope_dim // 2:rope_dim].clone()
        y[..., :rope_dim // 2], y[..., rope_dim // 2:rope_dim] = a * c - b * s, b * c + a * s
    else:
        a, b = y[..., 0:rope_dim:2].clone(), y[..., 1:rope_dim:2].clone()
        y[..., 0:rope_dim:2], y[..., 1:rope_dim:2] = a * c - b * s, b * c + a * s
    return y


def _codes(x32, scale):
    return (x32 * torch.tensor(scale, dtype=torch.float32)).clamp(-448, 448).to(F8).view(torch.uint8)


def _poisoned(shape):
    return torch.full(shape, POISON, dtype=torch.uint8).view(F8)


def _inputs(kind, n, hq, hkv, rope_dim, nope, dtype, seed=0):
    mla = kind == "mla"
    q_rope, k_rope = _act((n, hq, rope_dim), dtype, seed), _act((n, rope_dim) if mla else (n, hkv, rope_dim), dtype,
                                                                  seed + 1)
    q_nope = _act((n, hq, nope), dtype, seed + 2) if nope else None
    k_nope = _act((n, nope) if mla else (n, hkv, nope), dtype, seed + 3) if nope else None
    return q_rope, k_rope, q_nope, k_nope


def _whole(a, b, mla=False):
    a = a.unsqueeze(1) if mla else a
    if b is None:
        return a
    return torch.cat([a, b.unsqueeze(1) if mla else b], -1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,hq,hkv,rope_dim,nope,neox,dtype", [
    ("gqa", 4, 2, 64, 64, True, torch.bfloat16), ("gqa", 4, 2, 128, 0, False, torch.float16),
    ("mla", 3, 1, 64, 512, False, torch.bfloat16), ("mha", 2, 2, 32, 96, True, torch.float16)])
def test_rope_quantize_fp8(backend, kind, hq, hkv, rope_dim, nope, neox, dtype):
    n = 7
    q_rope, k_rope, q_nope, k_nope = _inputs(kind, n, hq, hkv, rope_dim, nope, dtype)
    table, pos = _table(rope_dim), torch.tensor([0, 5, 63, 1, 17, 2, 40])
    outs = (_poisoned(q_rope.shape), _poisoned(k_rope.shape), _poisoned((n, hq, nope)),
            _poisoned(k_nope.shape if k_nope is not None else k_rope.shape[:-1] + (0,)))
    with kvfuse.use_backend(backend):
        got = flashinfer.rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, table, pos, neox, None, 0.75, 1.5, *outs)
    assert all(g is o for g, o in zip(got, outs))
    mla = kind == "mla"
    q = _codes(_rope32(_whole(q_rope, q_nope), table, pos, rope_dim, neox), 0.75)
    k = _codes(_rope32(_whole(k_rope, k_nope, mla), table, pos, rope_dim, neox), 1.5)
    k = k.squeeze(1) if mla else k
    assert torch.equal(outs[0].view(torch.uint8), q[..., :rope_dim])
    assert torch.equal(outs[2].view(torch.uint8), q[..., rope_dim:])
    assert torch.equal(outs[1].view(torch.uint8), k[..., :rope_dim])
    assert torch.equal(outs[3].view(torch.uint8), k[..., rope_dim:])


def test_mla_rope_quantize_fp8_allocates_like_flashinfer():
    q_rope, k_rope, q_nope, k_nope = _inputs("mla", 3, 2, 1, 64, 128, torch.bfloat16)
    got = flashinfer.mla_rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, _table(64), torch.tensor([1, 2, 3]))
    assert [tuple(t.shape) for t in got] == [(3, 2, 64), (3, 64), (3, 2, 128), (3, 128)]
    assert all(t.dtype == F8 for t in got)


def _append_case(kind, layout, seed=0):
    """Two requests (4 and 3 new tokens after 5 and 0 cached), a padding token (batch index -1), pages
    drawn from a pool of 6 of 4 entries."""
    n, hq, hkv, rope_dim, nope = 8, 4, 1 if kind == "mla" else 2, 64, 64
    q_rope, k_rope, q_nope, k_nope = _inputs(kind, n, hq, hkv, rope_dim, nope, torch.bfloat16, seed)
    v = None if kind == "mla" else _act((n, hkv, rope_dim + nope), torch.bfloat16, seed + 5)
    page_size, pool = 4, 6
    kv_indices = torch.tensor([4, 1, 5, 2], dtype=torch.int32)
    kv_indptr = torch.tensor([0, 3, 4], dtype=torch.int32)
    batch_indices = torch.tensor([0, 0, 0, 0, 1, 1, 1, -1], dtype=torch.int32)
    positions = torch.tensor([5, 6, 7, 8, 0, 1, 2, 0], dtype=torch.int32)
    if kind == "mla":
        caches = (_poisoned((pool, page_size, nope)), _poisoned((pool, page_size, rope_dim)))
    else:
        shape = (pool, page_size, hkv, rope_dim + nope) if layout == "NHD" else (pool, hkv, page_size, rope_dim + nope)
        caches = (_poisoned(shape), _poisoned(shape))
    meta = (kv_indices, kv_indptr, batch_indices, positions)
    return (q_rope, k_rope, q_nope, k_nope, v), caches, meta, page_size


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,layout,neox", [("gqa", "NHD", False), ("gqa", "HND", True), ("mla", "NHD", False)])
def test_rope_quantize_fp8_append_paged_kv_cache(backend, kind, layout, neox):
    (q_rope, k_rope, q_nope, k_nope, v), caches, meta, page_size = _append_case(kind, layout)
    table, pos = _table(64), torch.tensor([5, 6, 7, 8, 0, 1, 2, 9])
    want = [c.view(torch.uint8).clone() for c in caches]
    mla = kind == "mla"
    k = _codes(_rope32(_whole(k_rope, k_nope, mla), table, pos, 64, neox), 0.5)
    vc = None if v is None else _codes(v.float(), 0.5)
    kv_indices, kv_indptr, batch_indices, positions = meta
    for i in range(8):
        b, p = int(batch_indices[i]), int(positions[i])
        if b < 0:
            continue
        page, off = int(kv_indices[int(kv_indptr[b]) + p // page_size]), p % page_size
        if mla:
            want[0][page, off], want[1][page, off] = k[i, 0, 64:], k[i, 0, :64]
        elif layout == "NHD":
            want[0][page, off], want[1][page, off] = k[i], vc[i]
        else:
            want[0][page, :, off], want[1][page, :, off] = k[i], vc[i]
    with kvfuse.use_backend(backend):
        q_rope_out, q_nope_out = flashinfer.rope_quantize_fp8_append_paged_kv_cache(
            q_rope, k_rope, q_nope, k_nope, v, table, pos, caches, *meta, is_neox=neox, quant_scale_q=2.0,
            quant_scale_kv=0.5, page_size=page_size, kv_layout=layout)
    for c, w in zip(caches, want):
        assert torch.equal(c.view(torch.uint8), w)
    q = _codes(_rope32(_whole(q_rope, q_nope), table, pos, 64, neox), 2.0)
    live = batch_indices >= 0          # FlashInfer leaves a padding token's q unwritten; kvfuse writes it
    assert torch.equal(q_rope_out.view(torch.uint8)[live], q[live, :, :64])
    assert torch.equal(q_nope_out.view(torch.uint8)[live], q[live, :, 64:])


def _gqa_append_args(**change):
    (q_rope, k_rope, q_nope, k_nope, v), caches, meta, page_size = _append_case("gqa", "NHD")
    kw = dict(q_rope=q_rope, k_rope=k_rope, q_nope=q_nope, k_nope=k_nope, v=v, cos_sin_cache=_table(64),
              pos_ids=torch.arange(8), paged_kv_cache=caches, kv_indices=meta[0], kv_indptr=meta[1],
              batch_indices=meta[2], positions=meta[3], page_size=page_size)
    kw.update(change)
    return kw


@pytest.mark.parametrize("label,change,exc,match", [
    ("e5m2", dict(quantize_dtype=torch.float8_e5m2), TypeError, "quantize_dtype: torch.float8_e5m2 is not supported yet"),
    ("page size", dict(page_size=8), ValueError, "page_size: 8 differs from the caches' page size 4"),
    ("fp32 table", dict(cos_sin_cache=torch.zeros(64, 64, dtype=torch.bfloat16)), ValueError,
     "cos_sin_cache should be float32"),
    ("no v", dict(v=None), ValueError, "v: GQA/MHA expects a V tensor"),
    ("one cache", dict(paged_kv_cache=torch.zeros(1)), ValueError, "paged_kv_cache must be a tuple of 2 tensors"),
    ("fp32 input", dict(q_rope=torch.zeros(8, 4, 64)), TypeError, "q_rope: dtype torch.float32 is not supported yet"),
    ("nope widths", dict(k_nope=torch.zeros(8, 2, 32, dtype=torch.bfloat16)), ValueError,
     "k_nope: expected no_rope_dim 64"),
    ("rope_dim 12", dict(q_rope=torch.zeros(8, 4, 12, dtype=torch.bfloat16)), ValueError,
     "q_rope: head size 12 is not supported yet"),
])
def test_append_errors_write_nothing(label, change, exc, match):
    kw = _gqa_append_args(**change)
    before = [c.view(torch.uint8).clone() for c in kw["paged_kv_cache"]] if isinstance(kw["paged_kv_cache"], tuple) else []
    with kvfuse.use_backend("reference"), pytest.raises(exc) as info:
        flashinfer.rope_quantize_fp8_append_paged_kv_cache(**kw)
    assert str(info.value).startswith(match), str(info.value)
    for c, b in zip(kw["paged_kv_cache"] if before else (), before):
        assert torch.equal(c.view(torch.uint8), b)


def test_mla_with_v_raises():
    (q_rope, k_rope, q_nope, k_nope, _), caches, meta, page_size = _append_case("mla", "NHD")
    with pytest.raises(ValueError, match="v: MLA should not have V input"):
        flashinfer.rope_quantize_fp8_append_paged_kv_cache(q_rope, k_rope, q_nope, k_nope, q_rope, _table(64),
                                                           torch.arange(8), caches, *meta, page_size=page_size)


def test_compile_fullgraph():
    """Under torch.compile(fullgraph=True) the RoPE-quantize adapters trace (kvfuse's custom op)."""
    (q_rope, k_rope, q_nope, k_nope, _), _, meta, page_size = _append_case("mla", "NHD", seed=3)
    table, pos = _table(64), torch.arange(8)

    def step(ckv, kpe):
        flashinfer.rope_quantize_fp8_append_paged_kv_cache(q_rope, k_rope, q_nope, k_nope, None, table, pos,
                                                           (ckv, kpe), *meta, is_neox=False, quant_scale_kv=0.5,
                                                           page_size=page_size)
        outs = flashinfer.rope_quantize_fp8(q_rope, k_rope, q_nope, k_nope, table, pos, quant_scale_q=4.0)
        return torch.cat([o.view(torch.uint8).flatten() for o in outs]).float().sum()

    def fresh():
        return (torch.zeros(6, 4, 64, dtype=torch.uint8).view(F8), torch.zeros(6, 4, 64, dtype=torch.uint8).view(F8))

    assert_compiled_matches_eager(step, fresh)
