"""kvfuse.engines.flashinfer's NVFP4 appends against FlashInfer 0.7.2.post1's documented semantics
(flashinfer/page.py ``nvfp4_quantize_append_paged_kv_cache[_with_slot_mapping]`` and the page.cuh kernels):

* the bytes: every written (page, entry, head) record holds quantize_nvfp4 of its row (the quantizer
  itself is checked against a transcription of FlashInfer's block in tests/test_gqa_fp4.py), every other
  byte of the poisoned caches and scale caches is untouched; NHD and HND; tuple and stacked 5-d caches;
* addressing: negative slots skipped, slots past the cache skipped, extra padded rows not read; the page
  addressing of the first variant (batch_indices, positions, kv_indptr, kv_indices);
* vLLM 0.33.0's page views (``_nvfp4_kv_views``: K codes | K scales | V codes | V scales per page);
* the checks: dtypes, layouts, scales (ValueError as FlashInfer's, naming its arguments).
"""
import pytest
import torch

import kvfuse
from kvfuse.engines import flashinfer as fi
from kvfuse.reference.fp4 import quantize_nvfp4

LAYOUTS = ["NHD", "HND"]
BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.skipif(
    not kvfuse.backend.interpreter_enabled(), reason="needs TRITON_INTERPRET=1"))]


def _inputs(n, heads, d, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k = (torch.randn(n, heads, d, generator=gen) * 3).to(dtype)
    v = (torch.randn(n, heads, d, generator=gen) * 0.01).to(dtype)
    return k, v


def _poisoned(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).view(dtype)


def _caches(pages, page_size, heads, d, layout, stacked=False):
    shape = (pages, page_size, heads) if layout == "NHD" else (pages, heads, page_size)
    if stacked:
        codes = _poisoned((pages, 2) + shape[1:] + (d // 2,), torch.uint8, 1)
        sf = _poisoned((pages, 2) + shape[1:] + (d // 16,), torch.float8_e4m3fn, 2)
        return codes, sf, (codes[:, 0], codes[:, 1]), (sf[:, 0], sf[:, 1])
    kc, vc = _poisoned(shape + (d // 2,), torch.uint8, 3), _poisoned(shape + (d // 2,), torch.uint8, 4)
    ks, vs = _poisoned(shape + (d // 16,), torch.float8_e4m3fn, 5), _poisoned(shape + (d // 16,), torch.float8_e4m3fn, 6)
    return (kc, vc), (ks, vs), (kc, vc), (ks, vs)


def _record(cache, page, entry, layout):
    """[heads, last] of one (page, entry) in a 4-d cache of the layout."""
    return cache[page, entry] if layout == "NHD" else cache[page, :, entry]


def _expected(caches, sfs, rows, slots, page_size, layout, k_scale, v_scale):
    """The caches after FlashInfer's write, restated: a clone with each valid slot's records replaced."""
    out = [c.clone() for c in caches], [s.clone() for s in sfs]
    pages = caches[0].shape[0]
    for i, slot in enumerate(slots):
        if slot < 0 or slot >= pages * page_size:
            continue
        page, entry = divmod(slot, page_size)
        for side, (x, g) in enumerate(zip(rows, (k_scale, v_scale))):
            codes, sf = quantize_nvfp4(x[i], g)
            _record(out[0][side], page, entry, layout).copy_(codes)
            _record(out[1][side], page, entry, layout).view(torch.uint8).copy_(sf.view(torch.uint8))
    return out


def _assert_same(got, want):
    for g, w in zip(got, want):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_slot_mapping_writes_flashinfer_records(layout, stacked, backend):
    pages, page_size, heads, d = 5, 4, 2, 64
    k, v = _inputs(9, heads, d)
    slots = [0, 7, -1, 19, 20, 3, -5, 12]          # -1 / -5 padding, 20 past the cache: nothing written
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    paged, sf, kv, kv_sf = _caches(pages, page_size, heads, d, layout, stacked)
    want = _expected(kv, kv_sf, (k, v), slots, page_size, layout, 0.05, 0.002)
    # 9 rows, 8 slots: the ninth row is padding and is not read
    with kvfuse.use_backend(backend):
        fi.nvfp4_quantize_append_paged_kv_cache_with_slot_mapping(k, v, slot_mapping, paged, sf, 0.05, 0.002,
                                                                  kv_layout=layout)
    _assert_same(kv, want[0])
    _assert_same(kv_sf, want[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_slot_mapping_scale_tensors_and_int32_slots(backend):
    pages, page_size, heads, d = 3, 2, 1, 32
    k, v = _inputs(4, heads, d, torch.float16, seed=1)
    slots = [5, 0, 2, -1]
    paged, sf, kv, kv_sf = _caches(pages, page_size, heads, d, "NHD")
    want = _expected(kv, kv_sf, (k, v), slots, page_size, "NHD", 0.25, 3.0)
    with kvfuse.use_backend(backend):
        fi.nvfp4_quantize_append_paged_kv_cache_with_slot_mapping(
            k, v, torch.tensor(slots, dtype=torch.int32), paged, sf, torch.tensor([0.25]), torch.tensor(3.0))
    _assert_same(kv, want[0])
    _assert_same(kv_sf, want[1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_page_addressing_writes_flashinfer_records(layout, backend):
    """Entry i goes to page kv_indices[kv_indptr[b] + p // page_size], offset p % page_size."""
    pages, page_size, heads, d = 6, 4, 2, 48
    k, v = _inputs(5, heads, d, seed=2)
    kv_indices = torch.tensor([4, 1, 5, 0, 2], dtype=torch.int32)
    kv_indptr = torch.tensor([0, 2, 5], dtype=torch.int32)      # request 0: pages 4, 1; request 1: 5, 0, 2
    batch = torch.tensor([0, 0, 1, 1, 1], dtype=torch.int32)
    pos = torch.tensor([0, 5, 3, 4, 9], dtype=torch.int32)
    slots = []
    for b, p in zip(batch.tolist(), pos.tolist()):
        page = kv_indices[kv_indptr[b] + p // page_size].item()
        slots.append(page * page_size + p % page_size)
    paged, sf, kv, kv_sf = _caches(pages, page_size, heads, d, layout)
    want = _expected(kv, kv_sf, (k, v), slots, page_size, layout, 1.5, 0.75)
    with kvfuse.use_backend(backend):
        fi.nvfp4_quantize_append_paged_kv_cache(k, v, batch, pos, paged, sf, kv_indices, kv_indptr,
                                                torch.tensor([2, 2], dtype=torch.int32), 1.5, 0.75, kv_layout=layout)
    _assert_same(kv, want[0])
    _assert_same(kv_sf, want[1])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_vllm_page_views(layout, backend):
    """vLLM 0.33.0's nvfp4 pages: [num_blocks, 2 * Hkv, block_size, full_dim] uint8 (full_dim = D/2 + D/16);
    each page holds K's codes, K's scales, V's codes, V's scales, each dense in the layout's order
    (vllm/v1/attention/backends/flashinfer.py ``_nvfp4_kv_views``, vllm/utils/torch_utils.py
    ``nvfp4_split_data_scale``), restated here with as_strided."""
    blocks, block_size, heads, d = 3, 4, 2, 64
    data, scale = d // 2, d // 16
    full = data + scale
    side = heads * block_size * full
    page = _poisoned((blocks, 2 * side), torch.uint8, 9)
    dims = (block_size, heads) if layout == "NHD" else (heads, block_size)

    def region(offset, last):
        return page.as_strided((blocks, *dims, last), (2 * side, dims[1] * last, last, 1), offset)

    kc, ks = region(0, data), region(heads * block_size * data, scale).view(torch.float8_e4m3fn)
    vc, vs = region(side, data), region(side + heads * block_size * data, scale).view(torch.float8_e4m3fn)
    k, v = _inputs(6, heads, d, seed=3)
    slots = [11, 0, 4, -1, 7, 5]
    before = page.clone()
    with kvfuse.use_backend(backend):
        fi.nvfp4_quantize_append_paged_kv_cache_with_slot_mapping(k, v, torch.tensor(slots), (kc, vc), (ks, vs), 0.1,
                                                                  0.2, kv_layout=layout)
    after = page.clone()
    page.copy_(before)
    want = _expected((kc, vc), (ks, vs), (k, v), slots, block_size, layout, 0.1, 0.2)
    for view, w in zip((kc, vc, ks, vs), want[0] + want[1]):
        view.view(torch.uint8).copy_(w.view(torch.uint8))
    assert torch.equal(after, page)


def _good_call(**change):
    k, v = _inputs(2, 1, 32)
    paged, sf, _, _ = _caches(2, 2, 1, 32, "NHD")
    args = dict(append_key=k, append_value=v, slot_mapping=torch.tensor([0, 1]), paged_kv_cache=paged,
                kv_cache_sf=sf, k_scale=1.0, v_scale=1.0, kv_layout="NHD")
    args.update(change)
    fi.nvfp4_quantize_append_paged_kv_cache_with_slot_mapping(**args)


@pytest.mark.parametrize("change,exc,words", [
    (dict(kv_layout="NDH"), ValueError, "kv_layout"),
    (dict(append_key=torch.zeros(2, 1, 32)), ValueError, "append_key must be float16 or bfloat16"),
    (dict(append_value=torch.zeros(2, 1, 32, dtype=torch.float16)), ValueError, "same dtype"),
    (dict(append_key=torch.zeros(2, 1, 24, dtype=torch.bfloat16),
          append_value=torch.zeros(2, 1, 24, dtype=torch.bfloat16)), ValueError, "append_key"),
    (dict(slot_mapping=torch.tensor([0.0, 1.0])), ValueError, "slot_mapping must be int32 or int64"),
    (dict(slot_mapping=torch.tensor([0, 1, 2])), ValueError, "at least slot_mapping.shape[0] rows"),
    (dict(paged_kv_cache=(torch.zeros(2, 2, 1, 16, dtype=torch.int8),) * 2), ValueError, "torch.uint8"),
    (dict(kv_cache_sf=(torch.zeros(2, 2, 1, 2, dtype=torch.uint8),) * 2), ValueError, "float8_e4m3fn"),
    (dict(paged_kv_cache=torch.zeros(2, 3, 2, 1, 16, dtype=torch.uint8)), ValueError, "paged_kv_cache"),
    (dict(paged_kv_cache=[torch.zeros(1)]), TypeError, "paged_kv_cache"),
    (dict(k_scale=0.0), ValueError, "k_scale must be a positive finite"),
    (dict(v_scale=float("inf")), ValueError, "v_scale must be a positive finite"),
    (dict(k_scale=-1.0), ValueError, "k_scale"),
    (dict(k_scale=torch.tensor([1.0, 2.0])), ValueError, "exactly one element"),
    (dict(v_scale=torch.tensor(1.0, dtype=torch.float64)), ValueError, "torch.float32"),
    (dict(k_scale=[1.0]), TypeError, "k_scale"),
])
def test_bad_input(change, exc, words):
    with pytest.raises(exc, match=words.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        _good_call(**change)


def test_bad_input_writes_nothing_and_names_flashinfer_arguments():
    """A scale cache of the wrong shape is caught by kvfuse's entry and reported under FlashInfer's name."""
    k, v = _inputs(2, 1, 32)
    paged, _, _, _ = _caches(2, 2, 1, 32, "NHD")
    bad_sf = (torch.zeros(2, 2, 1, 4, dtype=torch.float8_e4m3fn),) * 2     # last dim 4, not 32 // 16
    before = [c.clone() for c in paged]
    with pytest.raises(ValueError, match="kv_cache_sf"):
        fi.nvfp4_quantize_append_paged_kv_cache_with_slot_mapping(k, v, torch.tensor([0, 1]), paged, bad_sf, 1.0, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(before, paged))


def test_page_addressing_bad_scales():
    k, v = _inputs(1, 1, 32)
    paged, sf, _, _ = _caches(1, 2, 1, 32, "NHD")
    idx = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(ValueError, match="v_scale must be a positive finite"):
        fi.nvfp4_quantize_append_paged_kv_cache(k, v, idx, idx, paged, sf, idx, torch.tensor([0, 1], dtype=torch.int32),
                                                idx, 1.0, float("nan"))
