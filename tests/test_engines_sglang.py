"""kvfuse.engines.sglang against SGLang 0.5.23's semantics of its DeepSeek cache writers, restated here:
the page geometry of each KVLayout (block-split pages of page_size data rows then page_size scale
rows, padded to the layout's alignment; interleaved records; the DSA index-K pages), the slot ->
(page, row) rule, negative slots skipped, the complex freqs_cis table and GPT-J pairs, the scale
rules (V4's unfloored ue8m0, V4.1's floor at 2^-13, e4m3 scales of the fp4 rows, the fp32 index
scale max(amax, 1e-4) / 448). Records are packed explicitly from kvfuse.reference's stage functions
(kvfuse's numerics, SPEC §6); where SGLang's arithmetic differs (the index cast's reciprocal) a
restatement of SGLang's formula bounds the difference. Every cache sits in storage poisoned with
0xAB and the whole storage is compared, so a stray or missing write shows. Reference backend and
Triton's interpreter; the errors; torch.compile(fullgraph=True)."""
import random
import re

import pytest
import torch

import kvfuse
from kvfuse import mla
from kvfuse import models as M
from kvfuse import reference as ref
from kvfuse.engines import sglang
from helpers import assert_bytes_equal, assert_compiled_matches_eager, cos_sin_cache, random_bf16

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
BACKENDS = ["reference", "triton"]
POISON = 0xAB
EPS = 1e-6

# SGLang's kv_layout.py / kv_layout.cuh, restated: (data bytes, scale bytes, interleaved, page alignment)
GEOMETRY = {"v4": (576, 8, False, 576), "v41": (512, 16, False, 512), "v41_new": (512, 16, True, 528),
            "v41_fp4": (256, 32, False, 256), "v41_fp4_new": (256, 32, True, 288)}


def _page_bytes(layout, page_size):
    data, scale, _, align = GEOMETRY[layout]
    return -(-page_size * (data + scale) // align) * align


def _poisoned(shape) -> torch.Tensor:
    return torch.full(shape, POISON, dtype=torch.uint8)


def _freqs_cis(max_position: int) -> torch.Tensor:
    """SGLang's precompute_freqs_cis shape: complex64 [max_position, 32], the pair-j angle p * theta_j."""
    cs = cos_sin_cache(max_position, 64)
    return torch.complex(cs[:, :32], cs[:, 32:])


def _row_offsets(layout, page_size, slot):
    """(data offset, scale offset) of ``slot`` in the flat cache (SGLang's PagedKV::row)."""
    data, scale, interleaved, _ = GEOMETRY[layout]
    page, row = divmod(slot, page_size)
    base = page * _page_bytes(layout, page_size)
    if interleaved:
        return base + row * (data + scale), base + row * (data + scale) + data
    return base + row * data, base + page_size * data + row * scale


def _flashmla_expected(flat, kv, weight, freqs_cis, positions, out_loc, page_size, layout):
    cs = torch.cat([freqs_cis.real, freqs_cis.imag], dim=-1)        # cos of pair j, then its sin
    y = ref.rope(ref.rmsnorm(kv, weight, EPS), positions, cs, 64, False)   # GPT-J on dims 448..511
    capacity = flat.numel() // _page_bytes(layout, page_size) * page_size
    for i, s in enumerate(out_loc.tolist()):
        if not 0 <= s < capacity:
            continue
        d, c = _row_offsets(layout, page_size, s)
        if layout == "v4":
            q, sf = ref.quantize(y[i, :448], "e4m3", 64, "ue8m0")
            flat[d:d + 448] = q.view(torch.uint8)
            flat[d + 448:d + 576] = y[i, 448:].contiguous().view(torch.uint8)
            flat[c:c + 7] = sf                                       # byte 8 of the scale row: not written
        elif GEOMETRY[layout][0] == 512:
            q, sf = ref.quantize(y[i], "e4m3", 32, "ue8m0", scale_floor=1e-4)
            flat[d:d + 512] = q.view(torch.uint8)
            flat[c:c + 16] = sf
        else:
            q, sf = ref.quantize(y[i], "e2m1", 16, "e4m3")
            flat[d:d + 256] = q
            flat[c:c + 32] = sf.view(torch.uint8)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", list(GEOMETRY))
@pytest.mark.parametrize("page_size", [1, 16])
def test_fused_k_norm_rope_flashmla(backend, layout, page_size):
    num_tokens, num_pages, max_position = (9 if backend == "triton" else 24), 5, 300
    rnd = random.Random(page_size * 7 + len(layout))
    kv = random_bf16((num_tokens, 640), seed=page_size + len(layout))[:, 64:576]   # SGLang's strided slice
    kv[1] = 0                                       # amax 0: V4 scale 2^-22, V4.1 floored at 2^-13
    weight = (1.0 + 0.2 * random_bf16((512,), seed=3, outliers=False).float()).to(torch.bfloat16)
    freqs_cis = _freqs_cis(max_position)
    positions = torch.tensor([rnd.randrange(max_position) for _ in range(num_tokens)])
    positions[2] = max_position + 4                 # outside the table: identity rotation in kvfuse
    capacity = num_pages * page_size
    slots = rnd.sample(range(capacity), min(num_tokens, capacity))
    slots += [-1] * (num_tokens - len(slots))
    slots[0], slots[3] = -1, capacity + 2           # padding, and a slot past the cache
    out_loc = torch.tensor(slots, dtype=torch.int32)
    shape = (num_pages, _page_bytes(layout, page_size))
    got, want = _poisoned(shape), _poisoned(shape)
    with kvfuse.use_backend(backend):
        sglang.fused_k_norm_rope_flashmla(kv, weight, EPS, freqs_cis, positions.int(), out_loc, got, page_size,
                                          layout)
    _flashmla_expected(want.view(-1), kv, weight, freqs_cis, positions, out_loc, page_size, layout)
    assert_bytes_equal(got, want, f"{layout} pages")
    # the all-zero token's scales, by SGLang's rules
    _, c = _row_offsets(layout, page_size, slots[1])
    scales = got.view(-1)[c:c + GEOMETRY[layout][1]]
    if layout == "v4":        # cast_to_ue8m0(max(0, 1e-4) / 448) = 2^-21: byte 106; the pad byte untouched
        assert scales[:7].tolist() == [105] * 7 and scales[7] == POISON
    elif GEOMETRY[layout][0] == 512:                # store_row_fp8: exponent max(.., 114) = 2^-13
        assert scales.tolist() == [114] * 16
    else:                                           # store_row_fp4: e4m3(clamp(0 / 6, 2^-9, 448)) = 2^-9
        assert scales.tolist() == [0x01] * 32


def test_flashmla_layout_enum_and_names():
    """SGLang's KVLayout is a str enum: the adapter takes it (via .value) or its name in any case."""
    class KVLayout(str):                            # the shape of SGLang's enum member: a str with .value
        value = "v41_new"
    kv = random_bf16((3, 512), seed=5)
    weight = torch.ones(512, dtype=torch.bfloat16)
    out_loc = torch.tensor([4, -1, 0], dtype=torch.int32)
    written = []
    for layout in ("v41_new", "V41_NEW", KVLayout("KVLayout.V41_NEW")):
        cache = _poisoned((2, _page_bytes("v41_new", 8)))
        with kvfuse.use_backend("reference"):
            sglang.fused_k_norm_rope_flashmla(kv, weight, EPS, _freqs_cis(8), torch.tensor([0, 1, 7]), out_loc,
                                              cache, 8, layout=layout)
        written.append(cache)
    assert torch.equal(written[0], written[1]) and torch.equal(written[0], written[2])
    assert not torch.equal(written[0], _poisoned((2, _page_bytes("v41_new", 8))))


# --------------------------------------------------------------------------- V3.2 indexer K
def _index_expected(flat, y, out_loc, page_size):
    """The DSA index-K page: page_size rows of 128 e4m3 bytes, then page_size fp32 scales."""
    page_bytes = 132 * page_size
    capacity = flat.numel() // page_bytes * page_size
    q, sf = ref.quantize(y, "e4m3", 128, "fp32")
    for i, s in enumerate(out_loc.tolist()):
        if not 0 <= s < capacity:
            continue
        page, row = divmod(s, page_size)
        base = page * page_bytes
        flat[base + 128 * row:base + 128 * (row + 1)] = q[i].view(torch.uint8)
        flat[base + 128 * page_size + 4 * row:base + 128 * page_size + 4 * (row + 1)] = sf[i].view(torch.uint8)


def _index_inputs(num_tokens, num_pages, page_size, seed):
    rnd = random.Random(seed)
    k = random_bf16((num_tokens, 256), seed=seed)[:, :128]          # the wk slice: row stride 256
    k[2] = 0
    weight = 1.0 + 0.2 * torch.randn(128, generator=torch.Generator().manual_seed(seed))
    bias = 0.1 * torch.randn(128, generator=torch.Generator().manual_seed(seed + 1))
    capacity = num_pages * page_size
    slots = rnd.sample(range(capacity), num_tokens)
    slots[1], slots[4] = -1, capacity + 3
    return k, weight, bias, torch.tensor(slots, dtype=torch.int64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [8, 64])
def test_fused_k_indexer_norm_rope_store(backend, page_size):
    num_tokens, num_pages, max_position = (9 if backend == "triton" else 30), 40 // page_size + 2, 200
    k, weight, bias, out_cache_loc = _index_inputs(num_tokens, num_pages, page_size, seed=page_size)
    cs = cos_sin_cache(max_position, 64)
    positions = torch.randint(0, max_position, (num_tokens,), generator=torch.Generator().manual_seed(4))
    positions[3] = -5                                               # outside the table: identity
    shape = (num_pages, 132 * page_size)
    got, want = _poisoned(shape), _poisoned(shape)
    with kvfuse.use_backend(backend):
        sglang.fused_k_indexer_norm_rope_store(k, got, out_cache_loc, weight, bias, EPS, cs, positions, page_size)
    # LayerNorm(w, b) -> GPT-J pairs (2j, 2j + 1) on the FIRST 64 dims -> no Hadamard -> e4m3 / fp32 scale
    y = ref.rope(ref.layernorm(k, weight, bias, EPS), positions, cs, 64, False, offset=0)
    _index_expected(want.view(-1), y, out_cache_loc, page_size)
    assert_bytes_equal(got, want, "index-K pages")
    # the model configuration's indexer call writes the same bytes into kvfuse's view of the pages
    again = _poisoned(shape)
    with kvfuse.use_backend(backend):
        mla.write_indexer_k(M.DEEPSEEK_V32_SGLANG, k, positions, cs, weight, again.view(num_pages, page_size, 1, 132),
                            out_cache_loc, norm_bias=bias)
    assert_bytes_equal(again, got, "deepseek-v3.2-sglang write_indexer_k")


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_store_index_k_cache(backend):
    num_tokens, page_size = (11 if backend == "triton" else 48), 64
    k, _, _, out_cache_loc = _index_inputs(num_tokens, 2, page_size, seed=9)
    shape = (2, 132 * page_size)
    got, want = _poisoned(shape), _poisoned(shape)
    with kvfuse.use_backend(backend):
        sglang.fused_store_index_k_cache(k.unsqueeze(1), got, out_cache_loc)   # [n, 1, 128]: flattened, page 64
    _index_expected(want.view(-1), k, out_cache_loc, page_size)
    assert_bytes_equal(got, want, "index-K pages")


def test_store_index_k_cache_against_sglang_formula():
    """SGLang's fused_store_indexer_cache: scale = max(1e-4, amax) / 448 (fp32), values
    e4m3(clip(x * (1 / scale))). kvfuse multiplies by 448 / amax (SPEC §6): the scale bytes are the
    same; a value differs, by one code, only where the two fp32 multipliers (one ulp apart at most)
    put x on different sides of an e4m3 rounding boundary."""
    n = 512
    key = random_bf16((n, 128), seed=31)
    key[5] = 0
    out_cache_loc = torch.arange(n, dtype=torch.int64)
    cache = _poisoned((n // 64, 132 * 64))
    with kvfuse.use_backend("reference"):
        sglang.fused_store_index_k_cache(key, cache, out_cache_loc)
    pages = cache.view(n // 64, 132 * 64)
    values = pages[:, :128 * 64].reshape(n, 128)
    scales = pages[:, 128 * 64:].reshape(n, 4).contiguous().view(torch.float32).view(n)
    x = key.float()
    sgl_scale = torch.clamp(x.abs().amax(dim=1), min=1e-4) / 448.0
    sgl_inv = 1.0 / sgl_scale
    sgl_values = (x * sgl_inv[:, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(scales.view(torch.int32), sgl_scale.view(torch.int32))
    differ = values != sgl_values
    assert differ.float().mean() < 0.01, differ.float().mean()
    step = (values.to(torch.int16) - sgl_values.to(torch.int16)).abs()[differ]
    assert (step == 1).all()                      # same sign byte, neighbouring codes


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch_writes_nothing(backend):
    """SGLang's launchers return at once for zero tokens; so do the adapters."""
    pages, index = _poisoned((2, _page_bytes("v41_fp4", 8))), _poisoned((2, 132 * 8))
    none32, none64 = torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int64)
    with kvfuse.use_backend(backend):
        sglang.fused_k_norm_rope_flashmla(torch.zeros(0, 512, dtype=torch.bfloat16),
                                          torch.ones(512, dtype=torch.bfloat16), EPS, _freqs_cis(4), none32, none32,
                                          pages, 8, "v41_fp4")
        sglang.fused_k_indexer_norm_rope_store(torch.zeros(0, 128, dtype=torch.bfloat16), index, none64,
                                               torch.ones(128), torch.zeros(128), EPS, cos_sin_cache(4, 64), none64, 8)
        sglang.fused_store_index_k_cache(torch.zeros(0, 128, dtype=torch.bfloat16), index, none64, 8)
    assert bool((pages == POISON).all()) and bool((index == POISON).all())


# --------------------------------------------------------------------------- errors
def _flashmla_args(**over):
    kw = dict(kv=random_bf16((3, 512), seed=1), kv_weight=torch.ones(512, dtype=torch.bfloat16), eps=EPS,
              freqs_cis=_freqs_cis(16), positions=torch.tensor([0, 1, 2]),
              out_loc=torch.tensor([1, 2, 3], dtype=torch.int32),
              kvcache=_poisoned((2, _page_bytes("v4", 4))), page_size=4, layout="v4")
    kw.update(over)
    return kw


def _indexer_args(**over):
    kw = dict(k_input=random_bf16((3, 128), seed=1), cache=_poisoned((2, 132 * 8)),
              out_cache_loc=torch.tensor([1, 2, 3]), weight=torch.ones(128), bias=torch.zeros(128), eps=EPS,
              cos_sin_cache=cos_sin_cache(16, 64), positions=torch.tensor([0, 1, 2]), page_size=8)
    kw.update(over)
    return kw


def _store_args(**over):
    kw = dict(key=random_bf16((3, 128), seed=1), index_k_with_scale=_poisoned((2, 132 * 64)),
              out_cache_loc=torch.tensor([1, 2, 3]))
    kw.update(over)
    return kw


F, I, S = sglang.fused_k_norm_rope_flashmla, sglang.fused_k_indexer_norm_rope_store, sglang.fused_store_index_k_cache
ERRORS = [
    ("uniform_fp8", F, _flashmla_args, lambda: dict(layout="uniform_fp8"), ValueError,
     "layout 'uniform_fp8' is not supported yet"),
    ("unknown layout", F, _flashmla_args, lambda: dict(layout="v5"), ValueError, "layout: expected one of"),
    ("rocm q rope", F, _flashmla_args, lambda: dict(q=torch.zeros(3, 2, 512, dtype=torch.bfloat16)), ValueError,
     "q: the query RoPE in the same launch (SGLang's ROCm path) is not supported yet"),
    ("fp16 kv", F, _flashmla_args, lambda: dict(kv=torch.zeros(3, 512, dtype=torch.half)), TypeError,
     "kv: dtype torch.float16 is not supported yet"),
    ("kv 576", F, _flashmla_args, lambda: dict(kv=torch.zeros(3, 576, dtype=torch.bfloat16)), ValueError,
     "kv: SGLang's FlashMLA layouts take 512 dims"),
    ("fp32 kv_weight", F, _flashmla_args, lambda: dict(kv_weight=torch.ones(512)), TypeError,
     "kv_weight: dtype torch.float32 is not supported yet"),
    ("kv_weight shape", F, _flashmla_args,
     lambda: dict(kv_weight=torch.ones(256, dtype=torch.bfloat16)), ValueError, "kv_weight"),
    ("eps 0 (kvfuse's check, SGLang's name)", F, _flashmla_args, lambda: dict(eps=0.0), ValueError, "eps"),
    ("real freqs", F, _flashmla_args, lambda: dict(freqs_cis=torch.zeros(16, 64)), TypeError,
     "freqs_cis: expected dtype torch.complex64"),
    ("empty freqs", F, _flashmla_args, lambda: dict(freqs_cis=_freqs_cis(0)), ValueError,
     "freqs_cis: expected [max_position >= 1, 32]"),
    ("int64 out_loc", F, _flashmla_args, lambda: dict(out_loc=torch.tensor([1, 2, 3])), TypeError,
     "out_loc: expected dtype torch.int32"),
    ("short out_loc", F, _flashmla_args, lambda: dict(out_loc=torch.tensor([1, 2], dtype=torch.int32)), ValueError,
     "out_loc: expected 3 slots"),
    ("float positions", F, _flashmla_args, lambda: dict(positions=torch.zeros(3)), TypeError,
     "positions: expected dtype torch.int32 or torch.int64"),
    ("2-d positions", F, _flashmla_args, lambda: dict(positions=torch.zeros(3, 1, dtype=torch.int32)), ValueError,
     "positions: expected shape (3,)"),
    ("page size 3", F, _flashmla_args, lambda: dict(page_size=3), ValueError, "page_size: expected a power of two"),
    ("page bytes of another layout", F, _flashmla_args, lambda: dict(layout="v41"), ValueError,
     "kvcache: expected [num_pages, 2560]"),
    ("strided pages", F, _flashmla_args, lambda: dict(kvcache=_poisoned((4, _page_bytes("v4", 4)))[::2]),
     ValueError, "kvcache: expected [num_pages, 2880] with strides (2880, 1)"),
    ("bf16 pages", F, _flashmla_args, lambda: dict(kvcache=torch.zeros(2, 1440, dtype=torch.bfloat16)), TypeError,
     "kvcache: expected a uint8 cache"),
    ("indexer fp16 k", I, _indexer_args, lambda: dict(k_input=torch.zeros(3, 128, dtype=torch.half)), TypeError,
     "k_input: dtype torch.float16 is not supported yet"),
    ("indexer head 64", I, _indexer_args, lambda: dict(k_input=torch.zeros(3, 64, dtype=torch.bfloat16)),
     ValueError, "k_input: SGLang's V3.2 indexer takes 128 dims"),
    ("indexer bf16 weight", I, _indexer_args, lambda: dict(weight=torch.ones(128, dtype=torch.bfloat16)), TypeError,
     "weight: expected dtype torch.float32"),
    ("indexer bias shape", I, _indexer_args, lambda: dict(bias=torch.zeros(64)), ValueError,
     "bias: expected shape (128,)"),
    ("indexer int32 slots", I, _indexer_args, lambda: dict(out_cache_loc=torch.tensor([1, 2, 3], dtype=torch.int32)),
     TypeError, "out_cache_loc: expected dtype torch.int64"),
    ("indexer table width", I, _indexer_args, lambda: dict(cos_sin_cache=cos_sin_cache(16, 128)), ValueError,
     "cos_sin_cache: expected [max_position, 64]"),
    ("indexer bf16 table", I, _indexer_args, lambda: dict(cos_sin_cache=cos_sin_cache(16, 64, torch.bfloat16)),
     TypeError, "cos_sin_cache: expected dtype torch.float32"),
    ("indexer page bytes", I, _indexer_args, lambda: dict(page_size=16), ValueError,
     "cache: expected [num_pages, 2112]"),
    ("indexer page size 4", I, _indexer_args, lambda: dict(page_size=4, cache=_poisoned((2, 132 * 4))), ValueError,
     "page_size 4 is not supported yet"),
    ("indexer eps nan (kvfuse's check, SGLang's name)", I, _indexer_args, lambda: dict(eps=float("nan")), ValueError,
     "eps"),
    ("store key 256", S, _store_args, lambda: dict(key=torch.zeros(3, 256, dtype=torch.bfloat16)), ValueError,
     "key: expected last dim 128"),
    ("store fp32 key", S, _store_args, lambda: dict(key=torch.zeros(3, 128)), TypeError,
     "key: dtype torch.float32 is not supported yet"),
    ("store long slots", S, _store_args, lambda: dict(out_cache_loc=torch.arange(4)), ValueError,
     "out_cache_loc: expected 3 slots"),
    ("store pages of 32", S, _store_args, lambda: dict(index_k_with_scale=_poisoned((2, 132 * 32))), ValueError,
     "index_k_with_scale: expected [num_pages, 8448]"),
]


PAGE_ARGS = ("kvcache", "cache", "index_k_with_scale")


@pytest.mark.parametrize("label,fn,args,change,exc,match", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors_name_the_argument_and_write_nothing(label, fn, args, change, exc, match):
    """Each error is raised before any write, its message starting with SGLang's argument name."""
    kw = args(**change())
    pages_before = {name: kw[name].clone() for name in PAGE_ARGS if name in kw}
    with kvfuse.use_backend("reference"):
        with pytest.raises(exc, match="^" + re.escape(match)):
            fn(**kw)
    untouched = [torch.equal(kw[name], before) for name, before in pages_before.items()]
    assert untouched and all(untouched), label


def test_compile_fullgraph():
    """Under torch.compile(fullgraph=True) the adapters trace (kvfuse routes through its custom ops)."""
    kv, k = random_bf16((5, 512), seed=8), random_bf16((5, 128), seed=9)
    weight = torch.ones(512, dtype=torch.bfloat16)
    freqs_cis, cs = _freqs_cis(64), cos_sin_cache(64, 64)
    positions = torch.tensor([3, 0, 63, 70, 9])
    out_loc = torch.tensor([4, -1, 17, 30, 2], dtype=torch.int32)

    def step(flashmla, index):
        sglang.fused_k_norm_rope_flashmla(kv, weight, EPS, freqs_cis, positions, out_loc, flashmla, 16, "v41_new")
        sglang.fused_k_indexer_norm_rope_store(k, index, out_loc.long(), torch.ones(128), torch.zeros(128), EPS, cs,
                                               positions, 16)
        sglang.fused_store_index_k_cache(k, index, out_loc.long() + 1, 16)
        return flashmla.sum() + index.sum()

    def fresh():
        return _poisoned((2, _page_bytes("v41_new", 16))), _poisoned((3, 132 * 16))

    assert_compiled_matches_eager(step, fresh)


def test_page_geometry_matches_kvfuse_formats():
    """The layouts' kvfuse formats carry SGLang's record sizes (KVLayout.bytes_per_token)."""
    for name, (data, scale, interleaved, _) in GEOMETRY.items():
        fmt, _ = sglang.LAYOUTS[name]
        assert fmt.bytes_per_token == data + scale and fmt.token_interleaved == interleaved, name
