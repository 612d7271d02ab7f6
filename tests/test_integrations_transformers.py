"""kvfuse.load_gqa_kv_cache, and kvfuse.integrations.transformers on tiny random transformers models (CPU):
a PagedCache run gives logits bit-identical to transformers' DynamicCache run with kvfuse's q / k numerics,
for every supported attention class, on the reference backend and the Triton interpreter."""
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import kvfuse
from kvfuse.reference import encode_e4m3

ROOT = pathlib.Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------ load_gqa_kv_cache (no transformers)
def _written(layout, dtype, scale=None):
    torch.manual_seed(1)
    n, hkv, d, dv = 6, 2, 32, 48
    q, k, v = torch.randn(n, 4, d).bfloat16(), torch.randn(n, hkv, d).bfloat16(), torch.randn(n, hkv, dv).bfloat16()
    shape = (3, 4, hkv) if layout == "NHD" else (3, hkv, 4)
    k_cache = torch.zeros(shape + (d,), dtype=dtype)
    v_cache = torch.zeros(shape + (dv,), dtype=dtype)
    slots = torch.tensor([5, 0, -1, 11, 7, 12])            # -1 and 12 (= num_blocks * block_size) write nothing
    kvfuse.fused_qk_norm_rope_store_kv(q, k, v, k_cache, v_cache, slots, k_scale=scale, v_scale=scale, layout=layout)
    return k, v, k_cache, v_cache, slots


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_load_gqa_kv_cache_bf16_returns_the_written_rows(layout):
    k, v, k_cache, v_cache, slots = _written(layout, torch.bfloat16)
    k_out, v_out = kvfuse.load_gqa_kv_cache(k_cache, v_cache, slots, layout)
    valid = torch.tensor([True, True, False, True, True, False])
    assert k_out.dtype == v_out.dtype == torch.bfloat16 and v_out.shape == (6, 2, 48)
    assert torch.equal(k_out[valid].view(torch.int16), k[valid].view(torch.int16))
    assert torch.equal(v_out[valid].view(torch.int16), v[valid].view(torch.int16))
    assert not k_out[~valid].view(torch.int16).any() and not v_out[~valid].view(torch.int16).any()


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_load_gqa_kv_cache_fp8_dequantizes_with_the_scale(layout):
    scale = torch.tensor(0.0125)
    k, v, k_cache, v_cache, slots = _written(layout, torch.float8_e4m3fn, scale)
    _, v_out = kvfuse.load_gqa_kv_cache(k_cache, v_cache, slots, layout, scale, scale)
    valid = torch.tensor([True, True, False, True, True, False])
    codes = encode_e4m3(torch.clamp(v[valid].float() / scale, -448, 448)).view(torch.float8_e4m3fn)
    assert torch.equal(v_out[valid], (codes.float() * scale).bfloat16())
    assert not v_out[~valid].view(torch.int16).any()


def test_load_gqa_kv_cache_errors_name_the_argument():
    _, _, k_cache, v_cache, slots = _written("NHD", torch.float8_e4m3fn, torch.tensor(1.0))
    one = torch.tensor(1.0)
    with pytest.raises(TypeError, match="slot_mapping"):
        kvfuse.load_gqa_kv_cache(k_cache, v_cache, slots.float(), "NHD", one, one)
    with pytest.raises(ValueError, match="v_scale"):
        kvfuse.load_gqa_kv_cache(k_cache, v_cache, slots, "NHD", one, None)
    with pytest.raises(ValueError, match="layout"):
        kvfuse.load_gqa_kv_cache(k_cache, v_cache, slots, "NDH", one, one)
    with pytest.raises(ValueError, match="v_cache"):
        kvfuse.load_gqa_kv_cache(k_cache, v_cache[:2], slots, "NHD", one, one)
    with pytest.raises(TypeError, match="v_cache"):
        kvfuse.load_gqa_kv_cache(k_cache, v_cache.view(torch.uint8), slots, "NHD", one, one)
    with pytest.raises(ValueError, match="k_scale"):
        kvfuse.load_gqa_kv_cache(k_cache.to(torch.bfloat16), v_cache.to(torch.bfloat16), slots, "NHD", one)


# ------------------------------------------------------------------------ the transformers adapter
tf = pytest.importorskip("transformers")
from kvfuse.integrations.transformers import PagedCache, install, uninstall  # noqa: E402

ARCHS = {   # config class, model class
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}
GEN = dict(max_new_tokens=3, do_sample=False, return_dict_in_generate=True, output_logits=True, pad_token_id=0)


def tiny_model(arch, attn="sdpa"):
    """2 layers, hidden 128, 4 q / 2 kv heads of 32, bf16; norm weights drawn at random (Gemma's around 0: it
    scales by 1 + w), so that the QK-norm weights matter."""
    config_cls, model_cls = (getattr(tf, name) for name in ARCHS[arch])
    config = config_cls(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
                        initializer_range=0.1, attn_implementation=attn)
    torch.manual_seed(0)
    model = model_cls(config).to(torch.bfloat16)
    centre = 0.0 if arch == "gemma3" else 1.0
    norms = {k: centre + 0.3 * torch.randn(v.shape) for k, v in model.state_dict().items() if "norm" in k}
    model.load_state_dict(norms, strict=False)
    return model.eval()


def prompt(batch):
    """Token ids [batch, 6] and their mask; the second row is left-padded by 2."""
    torch.manual_seed(2)
    ids = torch.randint(3, 128, (batch, 6))
    mask = torch.ones_like(ids)
    if batch > 1:
        ids[1, :2], mask[1, :2] = 0, 0
    return ids, mask


def generate(model, batch, cache=None):
    ids, mask = prompt(batch)
    extra = {} if cache is None else {"cache": cache}
    return model.generate(ids, attention_mask=mask, **GEN, **extra)


def assert_equal_runs(a, b):
    assert torch.equal(a.sequences, b.sequences)
    assert len(a.logits) == GEN["max_new_tokens"]
    for step, (x, y) in enumerate(zip(a.logits, b.logits)):
        assert torch.equal(x, y), f"step {step}: max |diff| {(x.float() - y.float()).abs().max().item()}"


CASES = [(arch, "reference", "sdpa", batch) for arch in ARCHS for batch in (1, 2)]
CASES += [("qwen3", "reference", "eager", 2), ("llama", "reference", "eager", 2), ("gemma3", "reference", "eager", 1)]
CASES += [(arch, "triton", "sdpa", 2) for arch in ARCHS] + [("qwen3", "triton", "eager", 1)]


@pytest.mark.parametrize("arch,backend,attn,batch", CASES)
def test_paged_cache_logits_equal_dynamic_cache(arch, backend, attn, batch):
    """generate with a bf16 PagedCache (shuffled blocks of 4) == generate with transformers' DynamicCache,
    both with kvfuse's q / k numerics: every step's logits bit for bit."""
    model = tiny_model(arch, attn)
    with install(model), kvfuse.use_backend(backend):
        dynamic = generate(model, batch)
        cache = PagedCache(model, 8, 4, block_shuffle_seed=3)
        paged = generate(model, batch, cache)
    assert_equal_runs(dynamic, paged)
    handed_out = [blk for row in range(batch) for blk in cache.block_table(row)]
    assert handed_out != list(range(len(handed_out)))           # shuffled: not blocks 0, 1, 2, ... in order


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "llama"])
def test_numerics_profiles_paged_equal_dynamic(arch):
    """install(model, numerics="fused"): the bf16 PagedCache run equals the DynamicCache run of the same
    profile bit for bit; with a QK-norm the fused profile changes the logits (one rounding instead of
    one per stage), without one (Llama) it gives staged's; the default is "staged"."""
    model = tiny_model(arch)
    runs = {}
    for numerics in (None, "staged", "fused"):
        with install(model, **({} if numerics is None else {"numerics": numerics})) as m:
            runs[numerics] = generate(m, 2), generate(m, 2, PagedCache(m, 8, 4, block_shuffle_seed=3))
        assert_equal_runs(*runs[numerics])
    assert_equal_runs(runs[None][1], runs["staged"][1])
    same = all(torch.equal(x, y) for x, y in zip(runs["staged"][1].logits, runs["fused"][1].logits))
    assert same == (arch == "llama")


def test_fused_fp32_cast_changes_only_the_fp8_cast():
    """"fused" and "fused_fp32_cast" give the same bf16 paged run; with fp8 caches the second's cast reads
    the fp32 k, so layer 0's K codes of the prompt (same inputs in both runs) differ in some elements,
    and V (no norm, no RoPE) in none."""
    model = tiny_model("qwen3")
    bf16, fp8 = {}, {}
    for numerics in ("fused", "fused_fp32_cast"):
        with install(model, numerics=numerics):
            bf16[numerics] = generate(model, 2, PagedCache(model, 8, 4))
            fp8[numerics] = PagedCache(model, 8, 4, torch.float8_e4m3fn, 0.01, 0.01)
            generate(model, 2, fp8[numerics])
    assert_equal_runs(bf16["fused"], bf16["fused_fp32_cast"])
    a, b = fp8["fused"].layers[0], fp8["fused_fp32_cast"].layers[0]
    prompt_slots = fp8["fused"]._columns_host[:, :6]
    slots = prompt_slots[prompt_slots >= 0]
    k_a, k_b = (layer.k_cache.flatten(0, 1)[slots].view(torch.uint8) for layer in (a, b))
    v_a, v_b = (layer.v_cache.flatten(0, 1)[slots].view(torch.uint8) for layer in (a, b))
    assert torch.equal(v_a, v_b)
    assert (k_a != k_b).any()
    assert (k_a != k_b).float().mean() < 0.1          # one rounding of a few values, not another chain


def test_prefill_forward_logits_and_key_value_equal_dynamic_cache():
    """A direct forward (prefill, then one decode step): the logits of every real token equal the
    DynamicCache run's, and key_value gives each sequence's K / V as the DynamicCache holds them."""
    model = tiny_model("qwen3")
    ids, mask = prompt(2)
    nxt = torch.tensor([[5], [9]])
    pos = mask.cumsum(-1) - 1
    runs = []
    with install(model), torch.no_grad():
        for cache in (tf.DynamicCache(config=model.config), PagedCache(model, 8, 4, block_shuffle_seed=5)):
            first = model(ids, attention_mask=mask, position_ids=pos.clamp(min=0), cache=cache).logits
            mask2 = torch.cat([mask, torch.ones_like(nxt)], 1)
            second = model(nxt, attention_mask=mask2, position_ids=pos[:, -1:] + 1, cache=cache).logits
            runs.append((first, second, cache))
    (f0, s0, dyn), (f1, s1, paged) = runs
    assert torch.equal(f0[mask.bool()], f1[mask.bool()]) and torch.equal(s0, s1)
    valid = torch.cat([mask, torch.ones_like(nxt)], 1).bool()
    for layer in range(2):
        for b in range(2):
            k, v = paged.key_value(layer, b)
            assert k.shape == (2, int(valid[b].sum()), 32)
            assert torch.equal(k, dyn.layers[layer].keys[b][:, valid[b]])
            assert torch.equal(v, dyn.layers[layer].values[b][:, valid[b]])


def test_fp8_paged_cache_close_to_bf16_and_key_value_dequantizes():
    """fp8 caches with scales calibrated on the bf16 run (amax / 448): each step's logits within
    0.125 * max |logit| of the bf16 paged run while the tokens agree (measured: 0.05 to 0.1), and
    key_value returns bf16(f(e4m3(x / scale)) * scale) of the bf16 cache's K and V."""
    model = tiny_model("qwen3")
    with install(model):
        bf16 = PagedCache(model, 8, 4)
        ref = generate(model, 2, bf16)
        amax = [max(bf16.key_value(layer, b)[i].float().abs().max() for layer in range(2) for b in range(2)) / 448
                for i in (0, 1)]
        fp8 = PagedCache(model, 8, 4, torch.float8_e4m3fn, amax[0], amax[1])
        out = generate(model, 2, fp8)
    bound = 0.125 * ref.logits[0].float().abs().max()
    for step, (x, y) in enumerate(zip(ref.logits, out.logits)):
        assert (x.float() - y.float()).abs().max() <= bound
        if not torch.equal(ref.sequences[:, 6 + step], out.sequences[:, 6 + step]):
            break
    # layer 0's K and V of the prompt come from the same inputs in both runs (layer 1's do not: layer 0's
    # attention read fp8 K / V); row 1's prompt has 4 real tokens
    for b, length in ((0, 6), (1, 4)):
        for i, scale in ((0, fp8.k_scale), (1, fp8.v_scale)):
            x16 = bf16.key_value(0, b)[i][:, :length]
            x8 = fp8.key_value(0, b)[i][:, :length]
            codes = encode_e4m3(torch.clamp(x16.float() / scale, -448, 448)).view(torch.float8_e4m3fn)
            assert torch.equal(x8, (codes.float() * scale).bfloat16())


def test_install_uninstall_restores_the_model():
    model = tiny_model("llama")
    attn = [m for m in model.modules() if type(m).__name__ == "LlamaAttention"]
    stock = generate(model, 2)
    with install(model):
        assert all("forward" in m.__dict__ for m in attn)
        assert len(model.model._forward_pre_hooks) == 1
    assert all("forward" not in m.__dict__ and m.forward.__func__ is type(m).forward for m in attn)
    assert not model.model._forward_pre_hooks and not hasattr(model, "_kvfuse_installation")
    assert_equal_runs(stock, generate(model, 2))
    handle = install(model)
    with pytest.raises(ValueError, match="already installed"):
        install(model)
    handle.uninstall()
    with pytest.raises(ValueError, match="not installed"):
        uninstall(model)


def test_rejections():
    model = tiny_model("qwen3")
    for bad in ("fast", "stage", None):
        with pytest.raises(ValueError, match=r"numerics must be one of \('staged', 'fused', 'fused_fp32_cast'\)"):
            install(model, numerics=bad)
    with pytest.raises(TypeError, match="install"):       # a PagedCache on a model without install()
        generate(model, 1, PagedCache(model, 8, 4))
    with pytest.raises(ValueError, match="k_scale"):
        PagedCache(model, 8, 4, k_scale=1.0)
    with pytest.raises(TypeError, match="kv_dtype"):
        PagedCache(model, 8, 4, kv_dtype=torch.float16)
    with install(model):
        with pytest.raises(ValueError, match="out of blocks"):
            generate(model, 2, PagedCache(model, 2, 4))
        with pytest.raises(NotImplementedError, match="reorder_cache"):
            PagedCache(model, 8, 4).reorder_cache(torch.tensor([0]))
        used = PagedCache(model, 8, 4)
        generate(model, 1, used)
        with pytest.raises(ValueError, match="one batch per cache"):
            generate(model, 2, used)
        with pytest.raises(NotImplementedError, match="static cache"):
            generate(model, 1, tf.StaticCache(config=model.config, max_cache_len=16))

    class OwnAttention(type(model.model.layers[0].self_attn)):
        pass

    model.model.layers[1].self_attn.__class__ = OwnAttention
    with pytest.raises(TypeError, match="OwnAttention"):
        install(model)
    with pytest.raises(TypeError, match="bf16"):
        install(tiny_model("llama").float())
    dynamic = tiny_model("llama")
    dynamic.model.rotary_emb.rope_type = "dynamic"
    with pytest.raises(ValueError, match="dynamic"):
        install(dynamic)


def test_example_generate_hf_runs():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "generate_hf.py"), "--new-tokens", "4",
                          "--repeats", "1"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    bf16 = next(line for line in lines if line.startswith("kvfuse paged bf16"))
    assert "bit-identical to DynamicCache with kvfuse numerics: yes" in out.stdout
    assert "kvfuse paged fp8" in out.stdout and bf16
