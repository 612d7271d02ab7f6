"""kvfuse.rope's table builders: cos_sin_cache against Python's math on fp64 angles, its layout (cos | sin)
and the re-export kvfuse.mla.make_cos_sin_cache; yarn_cos_sin_cache against a restatement of YaRN's formula
in Python floats, its known properties (factor 1, the extrapolated and interpolated bands, the attention
factor, truncate), GPT-OSS's table against transformers' GptOssRotaryEmbedding; bad arguments."""
import math

import pytest
import torch

from kvfuse import mla, models
from kvfuse.rope import YarnScaling, cos_sin_cache, yarn_attention_factor, yarn_cos_sin_cache


def _expected(p: int, j: int, rotary_dim: int, base: float):
    """(cos, sin) of row p, pair j, computed with Python floats (fp64) and rounded once to fp32."""
    angle = p * (1.0 / base ** (2 * j / rotary_dim))
    return [torch.tensor(v, dtype=torch.float64).float() for v in (math.cos(angle), math.sin(angle))]


@pytest.mark.parametrize("max_position,rotary_dim,base", [(16, 64, 10000.0), (40, 128, 500000.0), (3, 2, 10.0)])
def test_table_is_cos_then_sin_of_fp64_angles(max_position, rotary_dim, base):
    cs = cos_sin_cache(max_position, rotary_dim, base)
    assert cs.dtype == torch.float32 and cs.shape == (max_position, rotary_dim) and cs.device.type == "cpu"
    half = rotary_dim // 2
    assert torch.equal(cs[0], torch.cat([torch.ones(half), torch.zeros(half)]))      # position 0: the identity
    for p in {1, max_position // 2, max_position - 1}:
        for j in {0, half // 2, half - 1}:
            cos, sin = _expected(p, j, rotary_dim, base)
            assert torch.allclose(cs[p, j], cos, rtol=2 ** -23, atol=0) and \
                torch.allclose(cs[p, half + j], sin, rtol=2 ** -23, atol=2 ** -40), (p, j)


def test_mla_and_models_use_the_same_builder():
    assert mla.make_cos_sin_cache is cos_sin_cache and "make_cos_sin_cache" in mla.__all__
    cfg = models.QWEN3_8B
    assert torch.equal(cfg.cos_sin_cache(32), cos_sin_cache(32, cfg.rotary_dim, cfg.rope_theta))
    assert cfg.rope_theta != 10000.0                                 # so that the base really reaches the table


def test_empty_table_and_device_argument():
    assert cos_sin_cache(0, 64).shape == (0, 64)
    assert cos_sin_cache(4, 8, device="meta").device.type == "meta"


@pytest.mark.parametrize("kwargs,name", [
    (dict(max_position=-1), "max_position"), (dict(max_position=2.0), "max_position"),
    (dict(max_position=True), "max_position"), (dict(rotary_dim=63), "rotary_dim"), (dict(rotary_dim=0), "rotary_dim"),
    (dict(rotary_dim=64.0), "rotary_dim"), (dict(base=0.0), "base"), (dict(base=float("inf")), "base"),
    (dict(base="10000"), "base"),
])
def test_bad_arguments_name_the_argument(kwargs, name):
    args = dict(max_position=8, rotary_dim=64)
    args.update(kwargs)
    with pytest.raises(ValueError, match=f"^{name}: "):
        cos_sin_cache(**args)


# ----------------------------------------------------------------------------------------------- YaRN
GPT_OSS = dict(rotary_dim=64, base=150000.0, factor=32.0, original_max_position=4096)


def _yarn_expected(p, j, rotary_dim, base, factor, original_max_position, beta_fast=32.0, beta_slow=1.0,
                   truncate=True, attention=None):
    """(cos, sin) of row p, pair j, from the YaRN formula in Python floats (fp64), rounded once to fp32:
    the frequency blend theta / factor * ramp + theta * (1 - ramp) as transformers writes it."""
    def pair_turning(rotations, rounding):
        """The pair whose wavelength 2 pi base^(2j / d) fits ``rotations`` times into the original length."""
        j_real = rotary_dim / 2 * math.log(original_max_position / (2 * math.pi * rotations), base)
        return rounding(j_real) if truncate else j_real
    lo = max(pair_turning(beta_fast, math.floor), 0)
    hi = min(pair_turning(beta_slow, math.ceil), rotary_dim - 1)
    hi = hi + 0.001 if hi == lo else hi
    ramp = min(max((j - lo) / (hi - lo), 0.0), 1.0)
    theta = base ** (-2 * j / rotary_dim)
    angle = p * (theta / factor * ramp + theta * (1 - ramp))
    a = (0.1 * math.log(factor) + 1.0) if attention is None else attention
    return [torch.tensor(a * v, dtype=torch.float64).float() for v in (math.cos(angle), math.sin(angle))]


@pytest.mark.parametrize("kwargs", [
    dict(GPT_OSS, truncate=False), dict(GPT_OSS, truncate=True),
    dict(rotary_dim=128, base=1e6, factor=4.0, original_max_position=32768, truncate=True),      # Qwen-style
    dict(rotary_dim=64, base=10000.0, factor=40.0, original_max_position=4096, beta_fast=32.0, beta_slow=1.0,
         truncate=True, attention=0.9),
])
def test_yarn_table_against_the_formula(kwargs):
    attention = kwargs.pop("attention", None)
    max_position = 9000
    cs = yarn_cos_sin_cache(max_position, attention_factor=attention, **kwargs)
    rd = kwargs["rotary_dim"]
    half = rd // 2
    assert cs.dtype == torch.float32 and cs.shape == (max_position, rd)
    for p in (0, 1, 77, 4095, 4096, max_position - 1):
        for j in range(half):
            cos, sin = _yarn_expected(p, j, attention=attention, **kwargs)
            # the same fp64 values up to a few fp64 ulps of the angle: at most one fp32 rounding apart
            assert torch.allclose(cs[p, j], cos, rtol=2 ** -23, atol=2 ** -30) and \
                torch.allclose(cs[p, half + j], sin, rtol=2 ** -23, atol=2 ** -30), (p, j)


def test_yarn_factor_one_is_the_plain_table():
    for truncate in (True, False):
        got = yarn_cos_sin_cache(300, 64, 150000.0, 1.0, 4096, truncate=truncate)
        assert torch.equal(got, cos_sin_cache(300, 64, 150000.0))       # frequencies kept, attention factor 1
    assert yarn_attention_factor(1.0) == 1.0 and yarn_attention_factor(0.5) == 1.0


def test_yarn_bands_extrapolated_and_interpolated():
    """GPT-OSS's ramp runs over pairs (8.09, 17.40): pairs up to 8 keep the unscaled frequency, pairs from 18
    on turn factor (32) times slower, the ones between are blended (attention factor 1 to compare)."""
    plain = cos_sin_cache(32 * 64, 64, 150000.0)
    yarn = yarn_cos_sin_cache(32 * 64, attention_factor=1.0, truncate=False, **GPT_OSS)
    fast, slow, blended = list(range(0, 9)), list(range(18, 32)), list(range(9, 18))
    cols = lambda js: js + [32 + j for j in js]                                   # noqa: E731  cos and sin
    assert torch.equal(yarn[:, cols(fast)], plain[:, cols(fast)])
    assert torch.equal(yarn[::32][:, cols(slow)], plain[:64][:, cols(slow)])      # position 32 q turns as q did
    for j in blended:
        assert not torch.equal(yarn[1:, j], plain[1:, j]) and not torch.equal(yarn[::32][1:, j], plain[1:64, j])
    # truncate rounds the ramp's bounds outwards (8, 18): only the blended pairs change
    truncated = yarn_cos_sin_cache(32 * 64, attention_factor=1.0, truncate=True, **GPT_OSS)
    assert torch.equal(truncated[:, cols(fast + slow)], yarn[:, cols(fast + slow)])
    assert all(not torch.equal(truncated[:, j], yarn[:, j]) for j in blended)


def test_yarn_attention_factor():
    a = 0.1 * math.log(32.0) + 1.0
    assert yarn_attention_factor(32.0) == a
    cs = yarn_cos_sin_cache(2, **GPT_OSS)
    assert torch.equal(cs[0], torch.cat([torch.full((32,), a).float(), torch.zeros(32)]))     # cos(0) * a, sin(0) * a
    assert torch.equal(yarn_cos_sin_cache(1, attention_factor=0.75, **GPT_OSS)[0, :32], torch.full((32,), 0.75))
    # DeepSeek's form: m(s, mscale) / m(s, mscale_all_dim), m(s, k) = 0.1 k ln s + 1; equal ones cancel
    assert yarn_attention_factor(40.0, 1.0, 1.0) == 1.0
    assert yarn_attention_factor(40.0, 0.707, 1.0) == (0.0707 * math.log(40.0) + 1.0) / (0.1 * math.log(40.0) + 1.0)
    assert yarn_attention_factor(40.0, 0.707, None) == 0.1 * math.log(40.0) + 1.0             # one alone: ignored
    scaled = yarn_cos_sin_cache(1, 64, 10000.0, 40.0, 4096, mscale=0.707, mscale_all_dim=1.0)
    assert scaled[0, 0] == torch.tensor(yarn_attention_factor(40.0, 0.707, 1.0)).float()


def test_yarn_scaling_spec_and_gpt_oss_config():
    spec = YarnScaling(factor=32.0, original_max_position=4096, truncate=False)
    assert torch.equal(spec.cos_sin_cache(50, 64, 150000.0), yarn_cos_sin_cache(50, truncate=False, **GPT_OSS))
    cfg = models.GPT_OSS_20B
    assert cfg.rope_scaling == spec and cfg.rope_theta == 150000.0 and cfg.rotary_dim == 64
    assert torch.equal(cfg.cos_sin_cache(50), spec.cos_sin_cache(50, 64, 150000.0))
    assert torch.equal(models.GPT_OSS_120B.cos_sin_cache(50), cfg.cos_sin_cache(50))
    assert models.LLAMA3_8B.rope_scaling is None                                      # the others: unscaled


def test_gpt_oss_table_against_transformers():
    """transformers' GptOssRotaryEmbedding (its default GptOssConfig: YaRN, truncate False) computes the
    frequencies and angles in fp32; over the first 4096 positions it stays within the fp32 rounding of an
    angle below 4096 (2^-12 rad) times the attention factor of kvfuse's table; row 0 (the attention factor)
    is equal. A truncated ramp or another factor would be off by far more."""
    tf = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding
    rotary = GptOssRotaryEmbedding(tf.GptOssConfig())
    cos, sin = rotary(torch.zeros(1), torch.arange(4096)[None])
    theirs = torch.cat([cos[0], sin[0]], dim=-1)
    ours = models.GPT_OSS_20B.cos_sin_cache(4096)
    assert torch.equal(ours[0], theirs[0])
    assert (ours - theirs).abs().max() <= 1.35 * 2 ** -12
    assert (models.GPT_OSS_20B.cos_sin_cache(4096) - yarn_cos_sin_cache(4096, truncate=True, **GPT_OSS)).abs().max() > 0.01


@pytest.mark.parametrize("kwargs,name", [
    (dict(max_position=-1), "max_position"), (dict(rotary_dim=63), "rotary_dim"), (dict(base=1.0), "base"),
    (dict(base=float("nan")), "base"), (dict(factor=0.5), "factor"), (dict(factor=float("inf")), "factor"),
    (dict(original_max_position=0), "original_max_position"), (dict(original_max_position=4096.0), "original_max_position"),
    (dict(beta_slow=0.0), "beta_slow"), (dict(beta_fast=1.0), "beta_fast"), (dict(attention_factor=0.0), "attention_factor"),
    (dict(mscale="1"), "mscale"), (dict(mscale_all_dim=float("nan")), "mscale_all_dim"), (dict(truncate=1), "truncate"),
])
def test_yarn_bad_arguments_name_the_argument(kwargs, name):
    args = dict(max_position=8, **GPT_OSS)
    args.update(kwargs)
    with pytest.raises(ValueError, match=f"^{name}: "):
        yarn_cos_sin_cache(**args)
