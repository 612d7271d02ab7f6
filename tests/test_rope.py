"""kvfuse.rope.cos_sin_cache, the one RoPE table builder: its values against Python's math on fp64
angles, its layout (cos | sin), the re-export kvfuse.mla.make_cos_sin_cache, and bad arguments."""
import math

import pytest
import torch

from kvfuse import mla, models
from kvfuse.rope import cos_sin_cache


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
