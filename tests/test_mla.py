"""kvfuse.mla: every call site of the article's table against the unfused reference chain
(kvfuse.reference's stage functions composed by hand) and the SPEC's byte layout (helpers.record_regions,
independent of kvfuse's own addressing). Bytes compared exactly: results with torch.equal on raw
bytes, caches as their WHOLE guarded storage (records, reserved bytes, padding, guards).

Each test runs on the reference backend and on the Triton kernel (Triton's interpreter on CPU).
"""
import dataclasses
import math

import pytest
import torch

import kvfuse
from kvfuse import formats as F
from kvfuse import mla
from kvfuse import models as M
from kvfuse import reference as R

from helpers import assert_bytes_equal, byte_view, cache_strides, cos_sin_cache, guarded_cache, random_bf16, \
    record_regions

BACKENDS = ["reference", "triton"]
N = 7
BLOCK_SIZE = 4
NUM_BLOCKS = 3
GUARD = 64
# 7 tokens: valid slots in scrambled order, one -1 and one past the end (both skip the token)
SLOTS = [5, 0, -1, 11, 2, NUM_BLOCKS * BLOCK_SIZE, 8]

# small shapes (the interpreter is slow); MLAConfig's defaults are checked on their own below
CFG = mla.MLAConfig(num_heads=4, index_num_heads=3)


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param == "triton" and not kvfuse.backend.interpreter_enabled():
        pytest.skip("CPU tensors through the Triton kernel need TRITON_INTERPRET=1")
    with kvfuse.use_backend(request.param):
        yield request.param


def _positions(n=N, max_pos=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, max_pos, (n,), generator=g)


def _weight(d, seed):
    g = torch.Generator().manual_seed(seed)
    return (1.0 + 0.25 * torch.randn(d, generator=g)).to(torch.bfloat16)


class Guarded:
    """A guarded cache of fmt plus a frozen copy of its random initial storage."""

    def __init__(self, fmt, seed=0, block_padding=32):
        self.fmt = fmt
        self.cache, self.storage = guarded_cache(fmt, NUM_BLOCKS, BLOCK_SIZE, block_padding=block_padding,
                                                 guard=GUARD, seed=seed)
        self.s0, self.s1 = cache_strides(fmt, BLOCK_SIZE, block_padding=block_padding)
        self.expected = self.storage.clone()

    def expect(self, slots, q, sf=None, tail=None):
        """Write the records of ``slots`` into ``self.expected`` per SPEC §7/§8: q [n, quant] (fp8,
        packed e2m1 uint8, or bf16 for a bf16 cache), sf [n, num_scales], tail bf16 [n, bf16_tail]."""
        n = len(slots)
        parts = {"quant": q.contiguous().view(torch.uint8).reshape(n, -1)}
        if sf is not None:
            parts["sf"] = sf.contiguous().view(torch.uint8).reshape(n, -1)
        if tail is not None and tail.shape[-1]:
            parts["tail"] = tail.contiguous().view(torch.uint8).reshape(n, -1)
        for i, s in enumerate(slots):
            if not 0 <= s < NUM_BLOCKS * BLOCK_SIZE:
                continue
            reg = record_regions(self.fmt, BLOCK_SIZE, self.s0, self.s1, GUARD, s // BLOCK_SIZE, s % BLOCK_SIZE)
            for key, payload in parts.items():
                start, length = reg[key]
                assert payload.shape[1] == length, (key, payload.shape, length)
                self.expected[start:start + length] = payload[i]
            start, length = reg["reserved"]                 # zeros where the format writes them (zero_reserved)
            self.expected[start:start + length] = 0

    def check(self, what):
        assert_bytes_equal(self.storage, self.expected, what)


def _quantize_for(fmt, y):
    """The reference cast of the cache format on the transform output y [n, head_dim]:
    (q, sf, tail) of the quantized part and the bf16 tail."""
    qd = fmt.head_dim - fmt.bf16_tail
    if not fmt.quantized:
        return y, None, None
    q, sf = R.quantize(y[..., :qd], fmt.cast_fmt, fmt.elements_per_sf, fmt.sf_format, fmt.scale_floor)
    return q, sf, y[..., qd:]


# --------------------------------------------------------------------------- config
def test_config_defaults_and_validation():
    cfg = mla.MLAConfig()
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_head_dim, cfg.index_head_dim) == (512, 64, 512, 128)
    assert cfg.rope_offset == 448
    assert cfg.main_format is F.MAIN_FP8 and cfg.index_format is F.INDEX_MXFP8
    assert cfg.index_hadamard_args == kvfuse.HadamardArgs(1.0 / math.sqrt(128))
    assert kvfuse.CastArgs.from_cache_format(cfg.main_format) == kvfuse.CastArgs("e4m3", 32, True, "ue8m0")
    with pytest.raises(ValueError, match="main_format"):
        mla.MLAConfig(main_format=F.INDEX_MXFP8)
    with pytest.raises(ValueError, match="index_format"):
        mla.MLAConfig(index_format=F.MAIN_FP8)
    with pytest.raises(ValueError, match="index_rope_offset"):
        mla.MLAConfig(index_rope_offset=100)
    cs = mla.make_cos_sin_cache(16, 64)            # kvfuse.rope's builder (tests/test_rope.py)
    assert cs.dtype == torch.float32 and cs.shape == (16, 64)


# --------------------------------------------------------------------------- Q
@pytest.mark.parametrize("with_norm", [False, True])
def test_q_preprocess(backend, with_norm):
    cfg = CFG
    q = random_bf16((N, cfg.num_heads, cfg.qk_head_dim), seed=1)
    pos, cs = _positions(), cos_sin_cache(64, cfg.qk_rope_head_dim)
    w = _weight(cfg.qk_head_dim, 2) if with_norm else None
    got = mla.q_preprocess(cfg, q, pos, cs, q_norm_weight=w)
    y = R.rmsnorm(q, w, cfg.norm_eps) if with_norm else q
    y = R.rope(y, pos, cs, 64, True, offset=448)
    assert_bytes_equal(got, y, "q_preprocess")
    # into a preallocated output (CUDA graphs)
    out = torch.empty_like(q)
    assert mla.q_preprocess(cfg, q, pos, cs, q_norm_weight=w, out=out) is out
    assert_bytes_equal(out, y, "q_preprocess out=")


# --------------------------------------------------------------------------- main cache
@pytest.mark.parametrize("fmt", [F.MAIN_FP8, F.MAIN_FP4, F.FLASHMLA_MODEL1], ids=lambda f: f.name)
def test_write_main_cache(backend, fmt):
    cfg = CFG
    kv = random_bf16((N, 512), seed=3)
    w, pos, cs = _weight(512, 4), _positions(seed=5), cos_sin_cache(64, 64)
    g = Guarded(fmt)
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    out = torch.empty_like(kv)
    assert mla.write_main_cache(cfg, kv, pos, cs, w, g.cache, slots, fmt=fmt, out=out, out_stage="transform") is out
    y = R.rope(R.rmsnorm(kv, w, cfg.norm_eps), pos, cs, 64, True, offset=448)
    assert_bytes_equal(out, y, "out_stage=transform")
    g.expect(SLOTS, *_quantize_for(fmt, y))
    g.check(f"{fmt.name} cache")


def test_context_parallel_cast_back(backend):
    """CP first pass = quantize->dequantize of the chain; second pass = cast only."""
    cfg = CFG
    kv = random_bf16((N, 512), seed=6)
    w, pos, cs = _weight(512, 7), _positions(seed=8), cos_sin_cache(64, 64)
    local = mla.cp_local_kv(cfg, kv, pos, cs, w)
    y = R.rope(R.rmsnorm(kv, w, cfg.norm_eps), pos, cs, 64, True, offset=448)
    q, sf = R.quantize(y, "e4m3", 32, "ue8m0")
    back = R.dequantize(q, sf, "e4m3", 32, "ue8m0")
    assert_bytes_equal(local, back, "cast_back")
    g = Guarded(F.MAIN_FP8)
    mla.write_main_cache_gathered(cfg, local, g.cache, torch.tensor(SLOTS))
    q2, sf2 = R.quantize(back, "e4m3", 32, "ue8m0")
    g.expect(SLOTS, q2, sf2)
    g.check("CP second pass")
    # the values read back equal those of the one-pass write (bytes may differ: UE8M0 scales)
    one = Guarded(F.MAIN_FP8)
    mla.write_main_cache(cfg, kv, pos, cs, w, one.cache, torch.tensor(SLOTS))
    slots = torch.tensor([s for s in SLOTS if 0 <= s < NUM_BLOCKS * BLOCK_SIZE])
    assert_bytes_equal(kvfuse.load_paged_kv_cache(g.cache, slots, F.MAIN_FP8),
                       kvfuse.load_paged_kv_cache(one.cache, slots, F.MAIN_FP8), "CP vs one pass, values")


def test_context_parallel_quantized_gather(backend):
    """The byte-exact CP recipe: (q, sf) per shard, gathered, stored: equals the one-pass write."""
    cfg = CFG
    kv = random_bf16((N, 512), seed=9)
    w, pos, cs = _weight(512, 10), _positions(seed=11), cos_sin_cache(64, 64)
    shards = [(0, 3), (3, N)]
    parts = [mla.cp_local_kv_quantized(cfg, kv[a:b], pos[a:b], cs, w) for a, b in shards]
    q = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    g = Guarded(F.MAIN_FP8)
    mla.store_gathered(cfg, q[0], q[1], g.cache, torch.tensor(SLOTS))
    one = Guarded(F.MAIN_FP8)
    mla.write_main_cache(cfg, kv, pos, cs, w, one.cache, torch.tensor(SLOTS))
    assert_bytes_equal(g.storage, one.storage, "quantized gather vs one pass")
    assert not torch.equal(one.storage, Guarded(F.MAIN_FP8).storage)  # something was written
    with pytest.raises(ValueError, match="bf16 tail"):
        mla.cp_local_kv_quantized(cfg, kv, pos, cs, w, fmt=F.FLASHMLA_MODEL1)


def test_ue8m0_requantization_is_not_byte_idempotent():
    """Why the bf16 CP recipe can change cache bytes: a group whose amax lies in (224, 232] * 2^e
    quantizes its max to 224 * 2^e; requantized, it takes the scale 2^(e-1) and doubled codes."""
    v = torch.zeros(1, 32, dtype=torch.bfloat16)
    v[0, 0], v[0, 1] = 228.0, 3.0      # amax 228: s = 228/448 -> e = 0, code(228) = 224
    q, sf = R.quantize(v, "e4m3", 32, "ue8m0")
    back = R.dequantize(q, sf, "e4m3", 32, "ue8m0")
    q2, sf2 = R.quantize(back, "e4m3", 32, "ue8m0")
    assert int(sf.view(torch.uint8)) == 127 and int(sf2.view(torch.uint8)) == 126
    assert not torch.equal(byte_view(q), byte_view(q2))
    assert_bytes_equal(R.dequantize(q2, sf2, "e4m3", 32, "ue8m0"), back, "same values")
    # e4m3 scales (MAIN_FP4) are idempotent on their own dequantized output
    x = random_bf16((16, 512), seed=12)
    qa, sa = R.quantize(x, "e2m1", 16, "e4m3")
    qb, sb = R.quantize(R.dequantize(qa, sa, "e2m1", 16, "e4m3"), "e2m1", 16, "e4m3")
    assert_bytes_equal(qa, qb, "MAIN_FP4 codes")
    assert_bytes_equal(sa, sb, "MAIN_FP4 scales")


def test_write_draft_kv(backend):
    """DFlash: the target's KV and the draft's KV land in one main cache through two slot maps."""
    cfg = dataclasses.replace(CFG, draft_format=F.MAIN_FP8)
    kv, kv_draft = random_bf16((N, 512), seed=13), random_bf16((3, 512), seed=14)
    w, w_draft, cs = _weight(512, 15), _weight(512, 16), cos_sin_cache(64, 64)
    pos, pos_draft = _positions(seed=17), torch.tensor([20, 21, 22])
    target_slots = [0, 1, 2, 3, -1, 5, 6]
    draft_slots = [8, 9, 10]
    g = Guarded(F.MAIN_FP8)
    mla.write_main_cache(cfg, kv, pos, cs, w, g.cache, torch.tensor(target_slots))
    mla.write_draft_kv(cfg, kv_draft, pos_draft, cs, w_draft, g.cache, torch.tensor(draft_slots, dtype=torch.int32))
    for x, wt, p, sl in ((kv, w, pos, target_slots), (kv_draft, w_draft, pos_draft, draft_slots)):
        y = R.rope(R.rmsnorm(x, wt, cfg.norm_eps), p, cs, 64, True, offset=448)
        g.expect(sl, *_quantize_for(F.MAIN_FP8, y))
    g.check("main + draft")


# --------------------------------------------------------------------------- compressed KV and indexer
def test_write_compressed_kv(backend):
    cfg = dataclasses.replace(CFG, compressed_format=F.INDEX_MXFP4)
    x = random_bf16((N, 128), seed=18)
    w, pos, cs = _weight(128, 19), _positions(seed=20), cos_sin_cache(64, 64)
    g = Guarded(F.INDEX_MXFP4)
    latent = mla.write_compressed_kv(cfg, x, pos, cs, w, g.cache, torch.tensor(SLOTS))
    normed = R.rmsnorm(x, w, cfg.norm_eps)
    assert_bytes_equal(latent, normed, "pre-RoPE latent (out_stage='norm')")
    g.expect(SLOTS, *_quantize_for(F.INDEX_MXFP4, R.rope(normed, pos, cs, 64, True)))
    g.check("compressed KV cache")


INDEX_FORMATS = [F.INDEX_MXFP8, F.INDEX_FP8_FP32, F.INDEX_MXFP4, F.INDEX_NVFP4, F.INDEX_BF16]


@pytest.mark.parametrize("hadamard", [False, True], ids=["noH", "H"])
@pytest.mark.parametrize("fmt", INDEX_FORMATS, ids=lambda f: f.name)
def test_indexer_k_and_q(backend, fmt, hadamard):
    cfg = dataclasses.replace(CFG, index_format=fmt, index_hadamard=hadamard)
    k = random_bf16((N, 128), seed=21)
    q = random_bf16((N, cfg.index_num_heads, 128), seed=22)
    w, pos, cs = _weight(128, 23), _positions(seed=24), cos_sin_cache(64, 64)
    g = Guarded(fmt)
    mla.write_indexer_k(cfg, k, pos, cs, w, g.cache, torch.tensor(SLOTS, dtype=torch.int64))
    had = (lambda y: R.hadamard(y, 1.0 / math.sqrt(128))) if hadamard else (lambda y: y)
    yk = had(R.rope(R.rmsnorm(k, w, cfg.norm_eps), pos, cs, 64, True))
    g.expect(SLOTS, *_quantize_for(fmt, yk))
    g.check(f"indexer K {fmt.name}")

    yq = had(R.rope(q, pos, cs, 64, True))
    got_q, got_sf = mla.quantize_indexer_q(cfg, q, pos, cs)
    if fmt.quantized:
        eq, esf = R.quantize(yq, fmt.cast_fmt, fmt.elements_per_sf, fmt.sf_format, fmt.scale_floor)
        assert_bytes_equal(got_q, eq, "indexer Q values")
        assert_bytes_equal(got_sf, esf, "indexer Q scales")
        # preallocated outputs
        out, sf = torch.empty_like(got_q), torch.empty_like(got_sf)
        res = mla.quantize_indexer_q(cfg, q, pos, cs, out=out, sf=sf)
        assert res[0] is out and res[1] is sf
        assert_bytes_equal(out, eq, "indexer Q out=")
    else:
        assert got_sf is None
        assert_bytes_equal(got_q, yq, "indexer Q (bf16 index format)")


@pytest.mark.parametrize("fmt", [F.INDEX_MXFP4, F.INDEX_NVFP4], ids=lambda f: f.name)
def test_indexer_q_and_k_share_format_and_basis(backend, fmt):
    """A Q row quantized by quantize_indexer_q has exactly the bytes the same row gets when written
    as an indexer K (norm off): same CastArgs (from the one KVCacheFormat), same HadamardArgs."""
    cfg = dataclasses.replace(CFG, index_format=fmt, index_hadamard=True)
    H = cfg.index_num_heads
    q = random_bf16((4, H, 128), seed=25)
    pos, cs = _positions(4, seed=26), cos_sin_cache(64, 64)
    got_q, got_sf = mla.quantize_indexer_q(cfg, q, pos, cs)
    g = Guarded(fmt)
    slots = torch.arange(4 * H)
    mla.write_indexer_k(cfg, q.reshape(4 * H, 128), pos.repeat_interleave(H), cs, None, g.cache, slots)
    data, sf = kvfuse.load_paged_kv_cache(g.cache, slots, fmt, dequantize=False)
    assert_bytes_equal(data.reshape(4, H, -1), byte_view(got_q).reshape(4, H, -1), "Q vs K values")
    assert_bytes_equal(sf[..., :fmt.sf_exact_bytes].reshape(4, H, -1), byte_view(got_sf).reshape(4, H, -1),
                       "Q vs K scales")


# --------------------------------------------------------------------------- FlashMLA formats
@pytest.mark.parametrize("neox", [False, True], ids=["interleaved", "neox"])
def test_write_flashmla_v32(backend, neox):
    cfg = dataclasses.replace(CFG, rope_is_neox=neox)
    latent = R.rmsnorm(random_bf16((N, 512), seed=27), _weight(512, 28))   # kv_a_layernorm ran before
    k_pe = random_bf16((N, 64), seed=29)
    pos, cs = _positions(seed=30), cos_sin_cache(64, 64)
    g = Guarded(F.FLASHMLA_V32)
    mla.write_flashmla_v32(cfg, latent, k_pe, pos, cs, g.cache, torch.tensor(SLOTS))
    y = R.rope(torch.cat([latent, k_pe], dim=-1), pos, cs, 64, neox, offset=512)
    q, sf, tail = _quantize_for(F.FLASHMLA_V32, y)
    assert sf.dtype == torch.float32 and sf.shape == (N, 4)            # 2^e stored as fp32, per 128
    g.expect(SLOTS, q, sf, tail)
    g.check("FLASHMLA_V32 cache")
    # the dequantized read-back keeps the rotated k_pe exactly
    valid = torch.tensor([s for s in SLOTS if 0 <= s < NUM_BLOCKS * BLOCK_SIZE])
    back = kvfuse.load_paged_kv_cache(g.cache, valid, F.FLASHMLA_V32)
    rows = torch.tensor([i for i, s in enumerate(SLOTS) if 0 <= s < NUM_BLOCKS * BLOCK_SIZE])
    assert_bytes_equal(back[:, 0, 512:], y[rows, 512:], "tail read back")
    with pytest.raises(ValueError, match="concatenate"):
        mla.write_flashmla_v32(cfg, latent[:, :448], k_pe, pos, cs, g.cache, torch.tensor(SLOTS))


def test_write_flashmla_model1(backend):
    cfg = CFG
    kv = random_bf16((N, 512), seed=31)
    w, pos, cs = _weight(512, 32), _positions(seed=33), cos_sin_cache(64, 64)
    g = Guarded(F.FLASHMLA_MODEL1, block_padding=0)
    mla.write_flashmla_model1(cfg, kv, pos, cs, w, g.cache, torch.tensor(SLOTS))
    y = R.rope(R.rmsnorm(kv, w, cfg.norm_eps), pos, cs, 64, True, offset=448)
    q, sf, tail = _quantize_for(F.FLASHMLA_MODEL1, y)
    assert q.shape == (N, 448) and sf.shape == (N, 7) and tail.shape == (N, 64)
    g.expect(SLOTS, q, sf, tail)
    g.check("FLASHMLA_MODEL1 cache")
    assert g.s0 % 576 == 0


# --------------------------------------------------------------------------- the named model configurations
# Every configuration of kvfuse.models drives the call sites; each call must equal the reference
# chain built from the configuration's RoPE style / offsets, norm kind, Hadamard and formats.
# (The configurations' facts themselves are pinned in tests/test_models.py.) Fewer heads than the
# real models: the interpreter is slow, and heads do not change a row's bytes (SPEC §6).
def _small(cfg):
    return dataclasses.replace(cfg, num_heads=4, index_num_heads=3)


MODEL_CFGS = [_small(c) for c in M.MODELS.values()]
INDEX_CFGS = [c for c in MODEL_CFGS if c.index_format is not None]
COMPRESSED_CFGS = [c for c in MODEL_CFGS if c.compressed_format is not None]


def _name(cfg):
    return cfg.name


def _bias(d, seed):
    g = torch.Generator().manual_seed(seed)
    return (0.5 * torch.randn(d, generator=g)).to(torch.bfloat16)


def _index_norm(cfg, k, w, b):
    """The indexer K's norm of the reference chain: LayerNorm (weight, bias) or RMSNorm."""
    if cfg.index_norm_kind == "layer":
        return R.layernorm(k, w, b, cfg.norm_eps)
    return R.rmsnorm(k, w, cfg.norm_eps)


@pytest.mark.parametrize("cfg", MODEL_CFGS, ids=_name)
def test_model_q_preprocess(backend, cfg):
    """Q heads: (weightless RMSNorm when the model has one) -> RoPE at qk_nope_head_dim."""
    q = random_bf16((N, cfg.num_heads, cfg.qk_head_dim), seed=40)
    pos, cs = _positions(seed=41), cos_sin_cache(64, cfg.qk_rope_head_dim)
    got = mla.q_preprocess(cfg, q, pos, cs)
    y = R.rmsnorm(q, torch.ones(cfg.qk_head_dim, dtype=torch.bfloat16), cfg.norm_eps) if cfg.q_norm else q
    y = R.rope(y, pos, cs, cfg.qk_rope_head_dim, cfg.rope_is_neox, offset=cfg.qk_head_dim - cfg.qk_rope_head_dim)
    assert_bytes_equal(got, y, f"{cfg.name} q_preprocess")
    if cfg.q_norm:   # the weightless norm is bf16(x * rstd): a weight of ones changes no byte
        w = _weight(cfg.qk_head_dim, 42)
        y = R.rope(R.rmsnorm(q, w, cfg.norm_eps), pos, cs, 64, cfg.rope_is_neox, offset=cfg.rope_offset)
        assert_bytes_equal(mla.q_preprocess(cfg, q, pos, cs, q_norm_weight=w), y, f"{cfg.name} q with a weight")


@pytest.mark.parametrize("cfg", MODEL_CFGS, ids=_name)
def test_model_main_cache(backend, cfg):
    """The main cache of the model: RMSNorm (on the latent only for a [latent | k_pe] record) ->
    RoPE on the record's tail in the model's style -> the format's cast -> pages; the draft slots
    take the same chain in cfg.draft_format."""
    fmt = cfg.main_format
    kv = random_bf16((N, fmt.head_dim), seed=43)
    norm_dim = cfg.kv_lora_rank if cfg.splits_k_pe() else fmt.head_dim
    w, pos, cs = _weight(norm_dim, 44), _positions(seed=45), cos_sin_cache(64, 64)
    g = Guarded(fmt)
    out = torch.empty_like(kv)
    assert mla.write_main_cache(cfg, kv, pos, cs, w, g.cache, torch.tensor(SLOTS), out=out,
                                out_stage="transform") is out
    if cfg.splits_k_pe():
        y = torch.cat([R.rmsnorm(kv[:, :cfg.kv_lora_rank], w, cfg.norm_eps), kv[:, cfg.kv_lora_rank:]], dim=-1)
    else:
        y = R.rmsnorm(kv, w, cfg.norm_eps)
    y = R.rope(y, pos, cs, 64, cfg.rope_is_neox, offset=fmt.head_dim - 64)
    assert_bytes_equal(out, y, f"{cfg.name} transform")
    g.expect(SLOTS, *_quantize_for(fmt, y))
    g.check(f"{cfg.name} main cache {fmt.name}")

    d = Guarded(cfg.draft_format, seed=1)
    kv_d = random_bf16((N, cfg.draft_format.head_dim), seed=46)
    w_d = _weight(cfg.kv_lora_rank if cfg.splits_k_pe(cfg.draft_format) else cfg.draft_format.head_dim, 47)
    mla.write_draft_kv(cfg, kv_d, pos, cs, w_d, d.cache, torch.tensor(SLOTS))
    if cfg.splits_k_pe(cfg.draft_format):
        y_d = torch.cat([R.rmsnorm(kv_d[:, :cfg.kv_lora_rank], w_d, cfg.norm_eps), kv_d[:, cfg.kv_lora_rank:]], -1)
    else:
        y_d = R.rmsnorm(kv_d, w_d, cfg.norm_eps)
    y_d = R.rope(y_d, pos, cs, 64, cfg.rope_is_neox, offset=cfg.draft_format.head_dim - 64)
    d.expect(SLOTS, *_quantize_for(cfg.draft_format, y_d))
    d.check(f"{cfg.name} draft cache {cfg.draft_format.name}")


@pytest.mark.parametrize("cfg", INDEX_CFGS, ids=_name)
def test_model_indexer_k_and_q(backend, cfg):
    """The lightning indexer of the model: K = norm (V3.2: LayerNorm with weight and bias) -> RoPE
    (V3.2: first 64 dims, NEOX; V4: tail, GPT-J) -> Hadamard -> the index format's cast; Q = the
    same RoPE, Hadamard and cast."""
    fmt = cfg.index_format
    k = random_bf16((N, cfg.index_head_dim), seed=48)
    q = random_bf16((N, cfg.index_num_heads, cfg.index_head_dim), seed=49)
    w, pos, cs = _weight(cfg.index_head_dim, 50), _positions(seed=51), cos_sin_cache(64, cfg.index_rope_head_dim)
    b = _bias(cfg.index_head_dim, 52) if cfg.index_norm_kind == "layer" else None

    def transform(y):
        y = R.rope(y, pos, cs, cfg.index_rope_head_dim, cfg.index_rope_is_neox, offset=cfg.index_rope_offset)
        return R.hadamard(y, cfg.index_head_dim ** -0.5) if cfg.index_hadamard else y

    g = Guarded(fmt)
    out = torch.empty_like(k)
    assert mla.write_indexer_k(cfg, k, pos, cs, w, g.cache, torch.tensor(SLOTS), norm_bias=b, out=out,
                               out_stage="transform") is out
    yk = transform(_index_norm(cfg, k, w, b))
    assert_bytes_equal(out, yk, f"{cfg.name} indexer K transform")
    g.expect(SLOTS, *_quantize_for(fmt, yk))
    g.check(f"{cfg.name} indexer K {fmt.name}")

    got_q, got_sf = mla.quantize_indexer_q(cfg, q, pos, cs)
    eq, esf = R.quantize(transform(q), fmt.cast_fmt, fmt.elements_per_sf, fmt.sf_format, fmt.scale_floor)
    assert_bytes_equal(got_q, eq, f"{cfg.name} indexer Q values")
    assert_bytes_equal(got_sf, esf, f"{cfg.name} indexer Q scales")


@pytest.mark.parametrize("cfg", COMPRESSED_CFGS, ids=_name)
def test_model_compressed_kv(backend, cfg):
    """Compressed KV: RMSNorm -> the indexer's RoPE -> cast of cfg.compressed_format, and the
    pre-RoPE latent."""
    fmt = cfg.compressed_format
    x = random_bf16((N, cfg.index_head_dim), seed=53)
    w, pos, cs = _weight(cfg.index_head_dim, 54), _positions(seed=55), cos_sin_cache(64, cfg.index_rope_head_dim)
    g = Guarded(fmt)
    latent = mla.write_compressed_kv(cfg, x, pos, cs, w, g.cache, torch.tensor(SLOTS))
    normed = R.rmsnorm(x, w, cfg.norm_eps)
    assert_bytes_equal(latent, normed, f"{cfg.name} pre-RoPE latent")
    y = R.rope(normed, pos, cs, cfg.index_rope_head_dim, cfg.index_rope_is_neox, offset=cfg.index_rope_offset)
    g.expect(SLOTS, *_quantize_for(fmt, y))
    g.check(f"{cfg.name} compressed KV {fmt.name}")


def test_model_flashmla_v32_two_entry_points(backend):
    """V3's main write from the raw [latent | k_pe] record equals write_flashmla_v32 of the same
    latent normalized there (norm_weight) and of the latent normalized beforehand."""
    cfg = _small(M.DEEPSEEK_V3)
    kv = random_bf16((N, 576), seed=56)
    w, pos, cs = _weight(512, 57), _positions(seed=58), cos_sin_cache(64, 64)
    a, b, c = Guarded(F.FLASHMLA_V32), Guarded(F.FLASHMLA_V32), Guarded(F.FLASHMLA_V32)
    mla.write_main_cache(cfg, kv, pos, cs, w, a.cache, torch.tensor(SLOTS))
    mla.write_flashmla_v32(cfg, kv[:, :512], kv[:, 512:], pos, cs, b.cache, torch.tensor(SLOTS), norm_weight=w)
    mla.write_flashmla_v32(cfg, R.rmsnorm(kv[:, :512], w, cfg.norm_eps), kv[:, 512:], pos, cs, c.cache,
                           torch.tensor(SLOTS))
    assert_bytes_equal(a.storage, b.storage, "write_main_cache vs write_flashmla_v32(norm_weight=)")
    assert_bytes_equal(a.storage, c.storage, "write_main_cache vs write_flashmla_v32(normalized latent)")


def test_model_call_errors(backend):
    """A model without an indexer / compressed KV, a bias without a LayerNorm, and out_stage="norm"
    on a [latent | k_pe] record are ValueErrors that write nothing."""
    v3, v32, v4 = _small(M.DEEPSEEK_V3), _small(M.DEEPSEEK_V32), _small(M.DEEPSEEK_V4)
    k = random_bf16((N, 128), seed=59)
    w, pos, cs = _weight(128, 60), _positions(seed=61), cos_sin_cache(64, 64)
    g = Guarded(F.INDEX_MXFP8)
    with pytest.raises(ValueError, match="no index_format"):
        mla.write_indexer_k(v3, k, pos, cs, w, g.cache, torch.tensor(SLOTS))
    with pytest.raises(ValueError, match="no index_format"):
        mla.quantize_indexer_q(v3, k[:, None], pos, cs)
    with pytest.raises(ValueError, match="no compressed_format"):
        mla.write_compressed_kv(v32, k, pos, cs, w, g.cache, torch.tensor(SLOTS))
    with pytest.raises(ValueError, match="norm_bias"):
        mla.write_indexer_k(v4, k, pos, cs, w, g.cache, torch.tensor(SLOTS), norm_bias=_bias(128, 62))
    with pytest.raises(ValueError, match="norm_bias needs norm_weight"):
        mla.write_indexer_k(v4, k, pos, cs, None, g.cache, torch.tensor(SLOTS), norm_bias=_bias(128, 62))
    g.check("nothing written")
    v = Guarded(F.FLASHMLA_V32)
    kv = random_bf16((N, 576), seed=63)
    with pytest.raises(ValueError, match=r"norm_weight: expected shape \(512,\) for FLASHMLA_V32 \(the latent"):
        mla.write_main_cache(v3, kv, pos, cs, _weight(576, 64), v.cache, torch.tensor(SLOTS))
    with pytest.raises(ValueError, match=r"norm_weight: expected shape \(512,\) \(the norm covers the latent"):
        mla.write_flashmla_v32(v3, kv[:, :512], kv[:, 512:], pos, cs, v.cache, torch.tensor(SLOTS), _weight(576, 64))
    with pytest.raises(ValueError, match="576"):
        mla.write_main_cache(v3, kv[:, :512].contiguous(), pos, cs, _weight(512, 64), v.cache, torch.tensor(SLOTS))
    with pytest.raises(ValueError, match="bf16 tail"):
        mla.cp_local_kv(v3, kv, pos, cs, _weight(512, 64))
    v.check("nothing written (FLASHMLA_V32)")
