"""kvfuse.models' GQA / MHA configurations (GQAConfig, SPEC §3): the facts of each model, its source,
frozen, reachable by name; split_qkv gives views; Gemma's (1 + w) maps exactly onto an fp32 weight;
store_kv is one call of the public function; GPT-OSS's write (YaRN table, 64-d heads) equals the reference
chain on both backends and rotates as the model does. The MLA configurations are unchanged
(tests/test_models.py)."""
import dataclasses

import pytest
import torch

import kvfuse
from kvfuse import models as M
from kvfuse.numerics_profiles import NUMERICS
from gqa_cases import GQACase, build

FACTS = {  # name: (Q heads, KV heads, head_dim, QK-norm, eps, norm weight offset, rope_theta)
    "llama-3-8b": (32, 8, 128, False, 1e-5, 0.0, 500000.0),
    "llama-3-70b": (64, 8, 128, False, 1e-5, 0.0, 500000.0),
    "qwen3-8b": (32, 8, 128, True, 1e-6, 0.0, 1e6),
    "qwen3-32b": (64, 8, 128, True, 1e-6, 0.0, 1e6),
    "gemma-3-12b": (16, 8, 256, True, 1e-6, 1.0, 1e6),
    "gpt-oss-20b": (64, 8, 64, False, 1e-5, 0.0, 150000.0),
    "gpt-oss-120b": (64, 8, 64, False, 1e-5, 0.0, 150000.0),
    "qwen2.5-vl-7b": (28, 4, 128, False, 1e-6, 0.0, 1e6),
    "qwen3-vl-8b": (32, 8, 128, True, 1e-6, 0.0, 5e6),
    "gemma-4-31b-sliding": (32, 16, 256, True, 1e-6, 0.0, 1e4),
    "gemma-4-31b-global": (32, 4, 512, True, 1e-6, 0.0, 1e6),
}


@pytest.mark.parametrize("name", list(FACTS))
def test_facts_and_source(name):
    cfg = M.get_gqa(name)
    hq, hkv, d, qk, eps, off, theta = FACTS[name]
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.qk_norm, cfg.norm_eps, cfg.norm_weight_offset,
            cfg.rope_theta) == (hq, hkv, d, qk, eps, off, theta)
    assert cfg.rope_is_neox and cfg.rotary_dim == d          # HF rotate_half: NEOX over the whole head
    assert "modeling_" in cfg.source and "config" in cfg.source
    assert cfg.qkv_width == (hq + 2 * hkv) * d and cfg.kv_bytes_per_token(1) * 2 == cfg.kv_bytes_per_token(2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_heads = 1


def test_lookup():
    assert M.gqa_names() == list(FACTS) and M.get_gqa(" Qwen3-8B ") is M.QWEN3_8B
    with pytest.raises(ValueError, match="unknown GQA model configuration 'llama-2'"):
        M.get_gqa("llama-2")
    with pytest.raises(TypeError, match="name must be a str"):
        M.get_gqa(3)
    assert not set(M.GQA_MODELS) & set(M.MODELS)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        dataclasses.replace(M.LLAMA3_8B, num_heads=12, num_kv_heads=8)


def test_split_qkv_views():
    cfg = M.QWEN3_8B
    qkv = torch.zeros(3, cfg.qkv_width, dtype=torch.bfloat16)
    q, k, v = cfg.split_qkv(qkv)
    assert q.shape == (3, 32, 128) and k.shape == v.shape == (3, 8, 128)
    assert q.data_ptr() == qkv.data_ptr() and v.data_ptr() == qkv.data_ptr() + 2 * 40 * 128
    assert q.stride() == (cfg.qkv_width, 128, 1)


def test_norm_args():
    w = (0.3 * torch.randn(256, generator=torch.Generator().manual_seed(0))).to(torch.bfloat16)
    gemma = M.GEMMA3_12B.norm_args(w)
    assert gemma.weight.dtype == torch.float32 and torch.equal(gemma.weight, 1.0 + w.float())   # Gemma3RMSNorm's sum
    assert gemma.eps == 1e-6 and gemma.kind == "rms"
    assert M.QWEN3_8B.norm_args(w[:128]).weight is not None and M.LLAMA3_8B.norm_args(None) is None
    with pytest.raises(ValueError, match="weight is needed"):
        M.QWEN3_8B.norm_args(None)
    rope = M.QWEN3_8B.rope_args(torch.arange(2), M.QWEN3_8B.cos_sin_cache(4))
    assert (rope.rotary_dim, rope.is_neox, rope.offset) == (128, True, 0)


def test_gemma_weight_is_applied_as_the_model_does():
    """kvfuse's RMSNorm with the fp32 weight 1 + w equals bf16((x * rstd) * (1 + w)) with the same rstd:
    the product by Gemma's fp32 (1 + w), rounded once (Gemma3RMSNorm's order)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 2, 256, generator=g).to(torch.bfloat16)
    w = (0.3 * torch.randn(256, generator=g)).to(torch.bfloat16)
    args = M.GEMMA3_12B.norm_args(w)
    got = kvfuse.reference.rmsnorm(x, args.weight, args.eps)
    xf = x.float()
    ss = kvfuse.reference.pairwise_sum(xf * xf)
    den = torch.sqrt((ss / 256 + torch.tensor(1e-6, dtype=torch.float32)).double()).float()
    rstd = (1.0 / den)[..., None]
    assert torch.equal(got, ((xf * rstd) * (1.0 + w.float())).to(torch.bfloat16))


SMALL_QWEN3 = dataclasses.replace(M.QWEN3_8B, num_heads=4, num_kv_heads=2)   # Qwen3's norm and RoPE, fast on the CPU


DEFAULT = object()


def _store_kv(case: GQACase, numerics=DEFAULT):
    """GQAConfig.store_kv of SMALL_QWEN3 on the packed projection of ``case`` (``numerics`` DEFAULT: not
    passed): q_out and the caches' storages."""
    kw, storages, inputs, _ = build(case)
    rope = kw["rope_args"]
    extra = {} if numerics is DEFAULT else {"numerics": numerics}
    q_out = SMALL_QWEN3.store_kv(inputs[0][:, :SMALL_QWEN3.qkv_width], kw["k_cache"], kw["v_cache"],
                                 kw["slot_mapping"], rope.positions, rope.cos_sin_cache, kw["q_norm_args"].weight,
                                 kw["k_norm_args"].weight, kw["k_scale"], kw["v_scale"], layout=case.layout, **extra)
    return q_out, storages


@pytest.mark.parametrize("numerics", NUMERICS)
def test_store_kv_is_one_call(numerics):
    """GQAConfig.store_kv on a packed projection equals the public function on its views, with each
    numerics profile passed through."""
    case = GQACase(fp8=True, layout="HND", seed=50, numerics=numerics)
    kw1, storages1, inputs1, _ = build(case)
    q_out, storages2 = _store_kv(case, numerics)
    kw1["q_norm_args"] = kvfuse.NormArgs(kw1["q_norm_args"].weight, 1e-6)
    kw1["k_norm_args"] = kvfuse.NormArgs(kw1["k_norm_args"].weight, 1e-6)
    want = kvfuse.fused_qk_norm_rope_store_kv(**kw1)
    assert torch.equal(q_out.view(torch.int16), want.view(torch.int16))
    for a, b in zip(storages1, storages2):
        assert torch.equal(a, b)


def test_store_kv_numerics_default_and_errors():
    """store_kv's default is "staged"; "fused" gives other bytes on this QK-norm model (so the argument
    reaches the call); an unknown profile is a ValueError naming numerics."""
    case = GQACase(fp8=True, layout="HND", seed=51)
    default_q, default_caches = _store_kv(case)
    staged_q, staged_caches = _store_kv(case, "staged")
    fused_q, _ = _store_kv(case, "fused")
    assert torch.equal(default_q.view(torch.int16), staged_q.view(torch.int16))
    assert all(torch.equal(a, b) for a, b in zip(default_caches, staged_caches))
    assert not torch.equal(fused_q.view(torch.int16), staged_q.view(torch.int16))
    for bad in ("stage", None, 1):
        with pytest.raises(ValueError, match="numerics must be one of"):
            _store_kv(case, bad)


def _gpt_oss_write(cfg, fp8: bool, backend: str):
    """GQAConfig.store_kv of ``cfg`` (4 tokens, positions past the original 4096, one invalid slot) on
    ``backend`` and the reference chain on the same inputs: (inputs, kvfuse's outputs, the chain's outputs),
    outputs as (q_out, k_cache, v_cache)."""
    g = torch.Generator().manual_seed(60 + fp8)
    n, block_size, blocks = 4, 16, 2
    qkv = (torch.randn(n, cfg.qkv_width, generator=g) * 3).to(torch.bfloat16)
    positions = torch.tensor([0, 5, 4095, 6000])
    slots = torch.tensor([17, 3, -1, 30])
    cos_sin = cfg.cos_sin_cache(6144)
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    scales = (torch.tensor([0.05]), torch.tensor([0.02])) if fp8 else (None, None)
    shape = (blocks, block_size, cfg.num_kv_heads, cfg.head_dim)

    def caches():
        raw = shape[:-1] + (shape[-1] * dtype.itemsize,)
        return [torch.full(raw, 0x5A, dtype=torch.uint8).view(dtype) for _ in range(2)]
    ours, want = caches(), caches()
    with kvfuse.use_backend(backend):
        q_out = cfg.store_kv(qkv.clone(), *ours, slots, positions, cos_sin, k_scale=scales[0], v_scale=scales[1])
    q, k, v = cfg.split_qkv(qkv)
    q_want = torch.empty_like(q)
    kvfuse.reference.qk_norm_rope_store_kv(q, k, v, *want, slots, q_want, positions=positions, cos_sin=cos_sin,
                                           rotary_dim=cfg.rotary_dim, rope_offset=0, is_neox=cfg.rope_is_neox,
                                           k_scale=scales[0], v_scale=scales[1])
    return (qkv, positions, slots, cos_sin), (q_out, *ours), (q_want, *want)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("name", ["gpt-oss-20b", "gpt-oss-120b"])
def test_gpt_oss_write_equals_reference_chain(name, fp8, backend):
    """A GPT-OSS layer's write (64 Q heads, 8 KV heads of 64, no QK-norm, the YaRN table) on the reference
    backend and on the kernel (the interpreter): q_out and both whole caches byte-equal to the chain."""
    _, ours, want = _gpt_oss_write(M.get_gqa(name), fp8, backend)
    for a, b in zip(ours, want):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_gpt_oss_rotation_is_the_models():
    """The K written is GPT-OSS's rotation (GptOssAttention's _apply_rotary_emb: halves x1, x2 -> x1 cos -
    x2 sin, x2 cos + x1 sin) by its YaRN table's row at each position (cos and sin carrying the attention
    factor, above 1), in fp32 and rounded once to bf16; V is copied; the invalid slot writes nothing."""
    cfg = M.GPT_OSS_20B
    (qkv, positions, slots, cos_sin), (_, k_cache, v_cache), _ = _gpt_oss_write(cfg, False, "reference")
    assert cos_sin[:, 0].max() > 1.3                                 # the attention factor is in the table
    _, k, v = cfg.split_qkv(qkv)
    row = cos_sin[positions][:, None, :]
    c, s = row[..., :32], row[..., 32:]
    x1, x2 = k[..., :32].float(), k[..., 32:].float()
    k_model = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(torch.bfloat16)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        assert torch.equal(k_cache[slot // 16, slot % 16].view(torch.int16), k_model[i].view(torch.int16))
        assert torch.equal(v_cache[slot // 16, slot % 16].view(torch.int16), v[i].view(torch.int16))
    written = torch.zeros(2 * 16, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    untouched = k_cache.view(torch.uint8).flatten(0, 1)[~written]
    assert bool((untouched == 0x5A).all())
