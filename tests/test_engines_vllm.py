"""kvfuse.engines.vllm against vLLM 0.33's documented semantics of its cache writers, written here as
small torch loops (never from kvfuse's output): slot -> (block, offset), slot -1 skips, a slot_mapping
shorter than the batch writes only its tokens, fp8 = e4m3(x / scale) saturated to +-448 with round to
nearest even, the indexer's and fp8_ds_mla's power-of-two scales and byte layouts. Every cache sits in
a storage poisoned with 0xAB bytes and the whole storage is compared, so a stray or missing write
shows. Run on the reference backend and in Triton's interpreter; plus the errors for what is not
supported yet, and torch.compile(fullgraph=True)."""
import math
import random

import pytest
import torch

import kvfuse
from kvfuse.engines import vllm
from helpers import assert_bytes_equal, assert_compiled_matches_eager, random_bf16

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
BACKENDS = ["reference", "triton"]
POISON = 0xAB


def _poisoned(nbytes: int) -> torch.Tensor:
    return torch.full((nbytes,), POISON, dtype=torch.uint8)


def _e4m3_div(x: torch.Tensor, scale: float) -> torch.Tensor:
    """vLLM's scaled_convert: e4m3(x / scale), saturating (SATFINITE) to +-448, round to nearest even;
    uint8 codes. torch's own float8 conversion rounds to nearest even; the clamp is the saturation."""
    t = x.float() / torch.tensor(scale, dtype=torch.float32)
    return t.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)


# --------------------------------------------------------------------------- reshape_and_cache_flash
def _flash_caches(storage: torch.Tensor, num_blocks, block_size, num_heads, head_size, physical, dtype):
    """vLLM's test caches: one [num_blocks, 2, ...] allocation, K = [:, 0] and V = [:, 1], logical
    [num_blocks, block_size, num_heads, head_size]; "NHC" physical is that order, "HNC" stores heads
    before tokens and is viewed through strides."""
    t = storage.view(dtype)
    if physical == "NHC":
        kv = t.view(num_blocks, 2, block_size, num_heads, head_size)
    else:
        kv = t.view(num_blocks, 2, num_heads, block_size, head_size).transpose(2, 3)
    return kv[:, 0], kv[:, 1]


def _flash_expected(key, value, kc, vc, slot_mapping, fp8, k_scale, v_scale):
    block_size = kc.shape[1]
    for i, s in enumerate(slot_mapping.tolist()):
        if s < 0:
            continue
        b, o = divmod(s, block_size)
        if fp8:
            kc[b, o] = _e4m3_div(key[i], k_scale)
            vc[b, o] = _e4m3_div(value[i], v_scale)
        else:
            kc[b, o] = key[i]
            vc[b, o] = value[i]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_e4m3"])
@pytest.mark.parametrize("physical", ["NHC", "HNC"])
@pytest.mark.parametrize("head_size,block_size", [(64, 8), (80, 32), (256, 16)])
def test_reshape_and_cache_flash(backend, kv_cache_dtype, physical, head_size, block_size):
    num_heads, num_blocks, num_tokens = 8, 6, 21
    if backend == "triton":
        num_heads, num_tokens = 2, 9
    rnd = random.Random(head_size * 31 + block_size)
    fp8 = kv_cache_dtype != "auto"
    qkv = random_bf16((num_tokens, 3, num_heads, head_size), seed=head_size + block_size)
    _, key, value = qkv.unbind(dim=1)            # strided views, as vLLM's test builds them
    # vLLM pads the batch: the slot mapping covers the first tokens only, some of them padding (-1)
    m = num_tokens - 3
    slots = rnd.sample(range(num_blocks * block_size), m)
    slots[1] = slots[m // 2] = -1
    slot_mapping = torch.tensor(slots, dtype=torch.long)
    cache_dtype = torch.uint8 if fp8 else torch.bfloat16
    nbytes = num_blocks * 2 * block_size * num_heads * head_size * (1 if fp8 else 2)
    k_scale = (key.float().amax() / 64.0).to(torch.float32)
    v_scale = (value.float().amax() / 64.0).to(torch.float32)
    got_storage, want_storage = _poisoned(nbytes), _poisoned(nbytes)
    kc, vc = _flash_caches(got_storage, num_blocks, block_size, num_heads, head_size, physical, cache_dtype)
    with kvfuse.use_backend(backend):
        vllm.reshape_and_cache_flash(key, value, kc, vc, slot_mapping, kv_cache_dtype, k_scale, v_scale)
    ekc, evc = _flash_caches(want_storage, num_blocks, block_size, num_heads, head_size, physical, cache_dtype)
    _flash_expected(key, value, ekc, evc, slot_mapping, fp8, k_scale.item(), v_scale.item())
    assert_bytes_equal(got_storage, want_storage, "cache storage")


def _edge_values():
    """bf16 values whose quotients by the scales below fall on e4m3 ties, on the saturation boundary,
    in e4m3's subnormal range and below it (negative values that round to zero keep the sign: 0x80)."""
    base = [0.0, -0.0, 1.0, 1.0625, 1.1875, 17.0, 19.0, 240.0, 248.0, 440.0, 448.0, 456.0, 464.0, 480.0,
            1000.0, 2.0 ** -9, 1.5 * 2.0 ** -9, 2.0 ** -10, 0.75 * 2.0 ** -9, 2.0 ** -12, 3.0 * 2.0 ** -10]
    vals = base + [-v for v in base]
    return torch.tensor(vals + [0.0] * (-len(vals) % 16), dtype=torch.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale", [1.0, 0.5, 0.1, 3.0, 2.0 ** -6])
def test_reshape_and_cache_flash_fp8_edges(backend, scale):
    """The fp8 rule equals vLLM's on edge values: kvfuse's e4m3(clamp(f(x) / f(scale))) is vLLM's
    e4m3(satfinite(x / scale)), one correctly rounded division, round to nearest even."""
    row = _edge_values() * torch.tensor(scale, dtype=torch.bfloat16) if scale < 1 else _edge_values()
    d = row.numel()
    key = torch.stack([row, row.flip(0)]).view(2, 1, d)
    value = torch.stack([-row, row]).view(2, 1, d)
    got, want = _poisoned(2 * 4 * d * 2), _poisoned(2 * 4 * d * 2)
    s = torch.tensor([scale], dtype=torch.float32)
    kc, vc = _flash_caches(got, 2, 4, 1, d, "NHC", torch.uint8)
    with kvfuse.use_backend(backend):
        vllm.reshape_and_cache_flash(key, value, kc, vc, torch.tensor([5, 2]), "fp8", s, s)
    ekc, evc = _flash_caches(want, 2, 4, 1, d, "NHC", torch.uint8)
    _flash_expected(key, value, ekc, evc, torch.tensor([5, 2]), True, scale, scale)
    assert_bytes_equal(got, want, f"fp8 edges, scale {scale}")
    # the expectation itself is vLLM's rule: spot-check a few codes by hand at scale 1
    if scale == 1.0:
        codes = dict(zip(row.float().tolist(), _e4m3_div(row, 1.0).tolist()))
        assert codes[1.0625] == 0x38 and codes[1.1875] == 0x3A    # ties to even: 1.0, 1.25
        assert codes[464.0] == 0x7E and codes[1000.0] == 0x7E     # saturated to 448
        assert codes[2.0 ** -10] == 0x00 and codes[1.5 * 2.0 ** -9] == 0x02  # subnormal ties to even
        neg = _e4m3_div(torch.tensor([-(2.0 ** -10)], dtype=torch.bfloat16), 1.0)
        assert neg.item() == 0x80                                  # negative zero keeps its sign


def test_reshape_and_cache_flash_float8_cache_and_bf16_scale_shapes():
    """A float8_e4m3fn cache is written like vLLM's uint8 one; scales of shape () and (1,) alike."""
    key = random_bf16((4, 2, 64), seed=3)
    value = random_bf16((4, 2, 64), seed=4)
    slot_mapping = torch.tensor([0, 9, -1, 3])
    a, b = _poisoned(2 * 2 * 8 * 2 * 64), _poisoned(2 * 2 * 8 * 2 * 64)
    ka, va = _flash_caches(a, 2, 8, 2, 64, "NHC", torch.uint8)
    kb, vb = _flash_caches(b, 2, 8, 2, 64, "NHC", torch.uint8)
    with kvfuse.use_backend("reference"):
        vllm.reshape_and_cache_flash(key, value, ka, va, slot_mapping, "fp8", torch.tensor(0.25), torch.tensor(0.5))
        vllm.reshape_and_cache_flash(key, value, kb.view(torch.float8_e4m3fn), vb.view(torch.float8_e4m3fn),
                                     slot_mapping, "fp8_e4m3", torch.tensor([0.25]), torch.tensor([0.5]))
    assert torch.equal(a, b)
    assert not torch.equal(a, _poisoned(a.numel()))


# --------------------------------------------------------------------------- indexer_k_quant_and_cache
def _indexer_expected(k, cache, slot_mapping):
    """vLLM's indexer writer with scale_fmt "ue8m0": per token s = 2^ceil(log2(max(amax, 1e-4) / 448)),
    block b holds block_size * 128 value bytes, then block_size fp32 scales."""
    block_size = cache.shape[1]
    flat = cache.view(cache.shape[0], -1)
    for i, s in enumerate(slot_mapping[:k.shape[0]].tolist()):
        if s < 0:
            continue
        b, o = divmod(s, block_size)
        x = k[i].float()
        sc = torch.maximum(x.abs().amax(), torch.tensor(1e-4, dtype=torch.float32)) / 448.0
        scale = 2.0 ** math.ceil(math.log2(sc.item()))
        flat[b, o * 128:(o + 1) * 128] = _e4m3_div(k[i], scale)
        flat[b, block_size * 128 + 4 * o:block_size * 128 + 4 * o + 4] = \
            torch.tensor([scale], dtype=torch.float32).view(torch.uint8)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [16, 64])
def test_indexer_k_quant_and_cache(backend, block_size):
    num_tokens, num_blocks = (13 if backend == "triton" else 40), 4
    k = random_bf16((num_tokens, 128), seed=block_size)
    k[3] = 0                                                      # amax 0: the 1e-4 floor, scale 2^-22
    k[4] *= torch.tensor(2.0 ** -20, dtype=torch.bfloat16)       # tiny values
    rnd = random.Random(block_size)
    slots = rnd.sample(range(num_blocks * block_size), num_tokens + 2)
    slots[2] = -1
    slot_mapping = torch.tensor(slots, dtype=torch.long)          # longer than k: the rest is not read
    shape = (num_blocks, block_size, 132)
    got, want = _poisoned(math.prod(shape)).view(shape), _poisoned(math.prod(shape)).view(shape)
    with kvfuse.use_backend(backend):
        vllm.indexer_k_quant_and_cache(k, got, slot_mapping, 128, "ue8m0")
    _indexer_expected(k, want, slot_mapping)
    assert_bytes_equal(got, want, "indexer cache")


# --------------------------------------------------------------------------- concat_and_cache_mla
def _mla_expected(kv_c, k_pe, cache, slot_mapping, kind, scale):
    block_size = cache.shape[1]
    rank = kv_c.shape[1]
    for i, s in enumerate(slot_mapping.tolist()):
        if s < 0:
            continue
        b, o = divmod(s, block_size)
        rec = cache[b, o]
        if kind == "auto":
            rec.view(torch.bfloat16)[:] = torch.cat([kv_c[i], k_pe[i]])
        elif kind == "fp8":
            rec[:] = _e4m3_div(torch.cat([kv_c[i], k_pe[i]]), scale)
        else:   # fp8_ds_mla: 4 tiles of 128 e4m3, 4 fp32 scales, then k_pe's bf16 bits
            for t in range(4):
                tile = kv_c[i, 128 * t:128 * (t + 1)]
                amax = tile.float().abs().amax() / 448.0
                sc = 2.0 ** math.ceil(math.log2(max(amax.item(), 1e-4)))
                rec[128 * t:128 * (t + 1)] = _e4m3_div(tile, sc)
                rec[512 + 4 * t:516 + 4 * t] = torch.tensor([sc], dtype=torch.float32).view(torch.uint8)
            rec[528:656] = k_pe[i].contiguous().view(torch.uint8)
    assert rank == kv_c.shape[1]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,rank", [("auto", 256), ("auto", 512), ("fp8", 256), ("fp8", 512),
                                       ("fp8_ds_mla", 512)])
def test_concat_and_cache_mla(backend, kind, rank):
    num_tokens, block_size, num_blocks, pe_dim = (42 if backend == "reference" else 7), 16, 8, 64
    kv_c = random_bf16((num_tokens, rank), seed=rank)
    k_pe = random_bf16((num_tokens, pe_dim), seed=rank + 1)
    if kind == "fp8_ds_mla":
        kv_c[2, :128] = 0                                        # an all-zero tile: scale 2^-13
    rnd = random.Random(rank)
    slots = rnd.sample(range(num_blocks * block_size), num_tokens - 2)   # padded batch
    slots[3] = -1
    slot_mapping = torch.tensor(slots, dtype=torch.long)
    entry = 656 if kind == "fp8_ds_mla" else rank + pe_dim
    elem = 2 if kind == "auto" else 1
    shape = (num_blocks, block_size, entry * elem)
    got, want = _poisoned(math.prod(shape)).view(shape), _poisoned(math.prod(shape)).view(shape)
    cache = got.view(torch.bfloat16) if kind == "auto" else got
    scale = torch.tensor(0.1, dtype=torch.float32)              # vLLM's test's scale
    with kvfuse.use_backend(backend):
        vllm.concat_and_cache_mla(kv_c, k_pe, cache, slot_mapping, kind, scale)
    _mla_expected(kv_c, k_pe, want, slot_mapping, kind, 0.1)
    assert_bytes_equal(got, want, f"mla cache {kind}")


def test_byte_record_caches_as_float8_views():
    """The indexer and fp8_ds_mla caches may come as float8_e4m3fn views of their bytes: same bytes."""
    k = random_bf16((3, 128), seed=20)
    kv_c, k_pe = random_bf16((3, 512), seed=21), random_bf16((3, 64), seed=22)
    slots = torch.tensor([7, -1, 2])
    written = []
    for as_float8 in (False, True):
        index, mla = _poisoned(2 * 16 * 132).view(2, 16, 132), _poisoned(2 * 16 * 656).view(2, 16, 656)
        view = (lambda t: t.view(torch.float8_e4m3fn)) if as_float8 else (lambda t: t)
        with kvfuse.use_backend("reference"):
            vllm.indexer_k_quant_and_cache(k, view(index), slots, 128, "ue8m0")
            vllm.concat_and_cache_mla(kv_c, k_pe, view(mla), slots, "fp8_ds_mla", torch.tensor(1.0))
        written.append((index, mla))
    assert torch.equal(written[0][0], written[1][0]) and torch.equal(written[0][1], written[1][1])
    assert not torch.equal(written[0][0], _poisoned(2 * 16 * 132).view(2, 16, 132))


# --------------------------------------------------------------------------- errors
def _flash_args(**over):
    kw = dict(key=random_bf16((3, 2, 64), seed=1), value=random_bf16((3, 2, 64), seed=2),
              key_cache=torch.full((2, 8, 2, 64), POISON, dtype=torch.uint8),
              value_cache=torch.full((2, 8, 2, 64), POISON, dtype=torch.uint8),
              slot_mapping=torch.tensor([1, 2, 3]), kv_cache_dtype="fp8",
              k_scale=torch.tensor(1.0), v_scale=torch.tensor(1.0))
    kw.update(over)
    return kw


def _index_args(**over):
    kw = dict(k=random_bf16((3, 128), seed=1), kv_cache=torch.full((2, 16, 132), POISON, dtype=torch.uint8),
              slot_mapping=torch.tensor([1, 2, 3]), quant_block_size=128, scale_fmt="ue8m0")
    kw.update(over)
    return kw


def _mla_args(**over):
    kw = dict(kv_c=random_bf16((3, 512), seed=1), k_pe=random_bf16((3, 64), seed=2),
              kv_cache=torch.full((2, 16, 656), POISON, dtype=torch.uint8), slot_mapping=torch.tensor([1, 2, 3]),
              kv_cache_dtype="fp8_ds_mla", scale=torch.tensor(1.0))
    kw.update(over)
    return kw


ERRORS = [
    ("fp16 key", vllm.reshape_and_cache_flash, _flash_args, lambda: dict(key=torch.zeros(3, 2, 64, dtype=torch.half)),
     TypeError, "key: dtype torch.float16 is not supported yet"),
    ("fp32 value", vllm.reshape_and_cache_flash, _flash_args, lambda: dict(value=torch.zeros(3, 2, 64)),
     TypeError, "value: dtype torch.float32 is not supported yet"),
    ("head size 72", vllm.reshape_and_cache_flash, _flash_args,
     lambda: dict(key=torch.zeros(3, 2, 72, dtype=torch.bfloat16), value=torch.zeros(3, 2, 72, dtype=torch.bfloat16)),
     ValueError, "key: head size 72 is not supported yet"),
    ("fp8_e5m2", vllm.reshape_and_cache_flash, _flash_args, lambda: dict(kv_cache_dtype="fp8_e5m2"),
     ValueError, "kv_cache_dtype 'fp8_e5m2' is not supported yet"),
    ("nvfp4", vllm.reshape_and_cache_flash, _flash_args, lambda: dict(kv_cache_dtype="nvfp4"),
     ValueError, "kv_cache_dtype: expected one of"),
    ("per-head scales", vllm.reshape_and_cache_flash, _flash_args, lambda: dict(k_scale=torch.ones(2)),
     ValueError, "k_scale: 2 scales (per-head scales) are not supported yet"),
    ("fp64 scale", vllm.reshape_and_cache_flash, _flash_args, lambda: dict(v_scale=torch.tensor(1.0, dtype=torch.float64)),
     TypeError, "v_scale: expected dtype torch.float32"),
    ("long slot mapping", vllm.reshape_and_cache_flash, _flash_args, lambda: dict(slot_mapping=torch.arange(4)),
     ValueError, "slot_mapping: 4 slots for 3 tokens"),
    ("auto with fp8 cache", vllm.reshape_and_cache_flash, _flash_args, lambda: dict(kv_cache_dtype="auto"),
     TypeError, "key_cache: kv_cache_dtype 'auto' stores the input's dtype"),
    ("cache heads (kvfuse's check, vLLM's name)", vllm.reshape_and_cache_flash, _flash_args,
     lambda: dict(key_cache=torch.full((2, 8, 4, 64), POISON, dtype=torch.uint8)), ValueError, "key_cache: expected"),
    ("fp16 cache for fp8", vllm.reshape_and_cache_flash, _flash_args,
     lambda: dict(value_cache=torch.zeros(2, 8, 2, 64, dtype=torch.half)), TypeError, "value_cache: an fp8 e4m3 cache"),
    ("indexer fp32 scales", vllm.indexer_k_quant_and_cache, _index_args, lambda: dict(scale_fmt=None),
     ValueError, "scale_fmt None is not supported yet"),
    ("indexer quant block 64", vllm.indexer_k_quant_and_cache, _index_args, lambda: dict(quant_block_size=64),
     ValueError, "quant_block_size 64 is not supported yet"),
    ("indexer head 256", vllm.indexer_k_quant_and_cache, _index_args,
     lambda: dict(k=torch.zeros(3, 256, dtype=torch.bfloat16)), ValueError, "k: head_dim 256 is not supported yet"),
    ("indexer fp16 k", vllm.indexer_k_quant_and_cache, _index_args,
     lambda: dict(k=torch.zeros(3, 128, dtype=torch.half)), TypeError, "k: dtype torch.float16 is not supported yet"),
    ("indexer bf16 cache", vllm.indexer_k_quant_and_cache, _index_args,
     lambda: dict(kv_cache=torch.zeros(2, 16, 66, dtype=torch.bfloat16)), TypeError, "kv_cache: expected a uint8 cache"),
    ("indexer short slots", vllm.indexer_k_quant_and_cache, _index_args,
     lambda: dict(slot_mapping=torch.tensor([1, 2])), ValueError, "slot_mapping: 2 slots for 3 tokens"),
    ("ds_mla rank 256", vllm.concat_and_cache_mla, _mla_args, lambda: dict(kv_c=torch.zeros(3, 256, dtype=torch.bfloat16)),
     ValueError, "kv_c, k_pe: fp8_ds_mla needs kv_lora_rank 512"),
    ("ds_mla record size (kvfuse's check, vLLM's name)", vllm.concat_and_cache_mla, _mla_args,
     lambda: dict(kv_cache=torch.full((2, 16, 576), POISON, dtype=torch.uint8)), ValueError, "kv_cache: "),
    ("mla fp16 kv_c", vllm.concat_and_cache_mla, _mla_args, lambda: dict(kv_c=torch.zeros(3, 512, dtype=torch.half)),
     TypeError, "kv_c: dtype torch.float16 is not supported yet"),
    ("mla fp8 per-head scale", vllm.concat_and_cache_mla, _mla_args,
     lambda: dict(kv_cache_dtype="fp8", kv_cache=torch.full((2, 16, 576), POISON, dtype=torch.uint8),
                  scale=torch.ones(2)), ValueError, "scale: 2 scales"),
    ("mla pe 40", vllm.concat_and_cache_mla, _mla_args,
     lambda: dict(kv_cache_dtype="auto", k_pe=torch.zeros(3, 40, dtype=torch.bfloat16),
                  kv_cache=torch.zeros(2, 16, 552, dtype=torch.bfloat16)), ValueError, "k_pe: head size 40 is not supported yet"),
    ("mla auto cache width", vllm.concat_and_cache_mla, _mla_args,
     lambda: dict(kv_cache_dtype="auto", kv_cache=torch.zeros(2, 16, 512, dtype=torch.bfloat16)),
     ValueError, "kv_cache: expected [num_blocks, block_size, 576]"),
]


@pytest.mark.parametrize("label,fn,args,change,exc,match", ERRORS, ids=[e[0] for e in ERRORS])
def test_errors_name_the_argument_and_write_nothing(label, fn, args, change, exc, match):
    kw = args(**change())
    caches = [v for k, v in kw.items() if "cache" in k and isinstance(v, torch.Tensor)]
    before = [c.clone() for c in caches]
    with kvfuse.use_backend("reference"), pytest.raises(exc) as info:
        fn(**kw)
    assert str(info.value).startswith(match), str(info.value)
    for c, b in zip(caches, before):
        assert torch.equal(c, b)


def test_compile_fullgraph():
    """Under torch.compile(fullgraph=True) the adapters trace (kvfuse routes through its custom ops)."""
    key, value = random_bf16((5, 2, 64), seed=8), random_bf16((5, 2, 64), seed=9)
    kv_c, k_pe = random_bf16((5, 512), seed=10), random_bf16((5, 64), seed=11)
    k = random_bf16((5, 128), seed=12)
    slots = torch.tensor([4, -1, 17, 30, 2])

    def step(flash, mla, index):
        vllm.reshape_and_cache_flash(key, value, flash[:, 0], flash[:, 1], slots, "fp8", torch.tensor(0.05),
                                     torch.tensor(0.1))
        vllm.concat_and_cache_mla(kv_c, k_pe, mla, slots, "fp8_ds_mla", torch.tensor(1.0))
        vllm.indexer_k_quant_and_cache(k, index, slots, 128, "ue8m0")
        return flash.sum() + mla.sum() + index.sum()

    def fresh():
        return (_poisoned(4 * 2 * 8 * 2 * 64).view(4, 2, 8, 2, 64), _poisoned(4 * 16 * 656).view(4, 16, 656),
                _poisoned(4 * 16 * 132).view(4, 16, 132))

    assert_compiled_matches_eager(step, fresh)
