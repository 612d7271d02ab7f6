"""The RoPE cos/sin tables that ``RopeArgs.cos_sin_cache`` takes, built one way for the whole project:
:func:`cos_sin_cache` (the unscaled RoPE), :func:`yarn_cos_sin_cache` (YaRN-scaled, GPT-OSS's) and
:func:`proportional_cos_sin_cache` (Gemma 4's "proportional" RoPE), with :class:`YarnScaling` holding a
model's YaRN parameters; and mRoPE's positions [3, n] (:func:`mrope_text_positions`,
:func:`mrope_grid_positions`). :mod:`kvfuse.mla` (re-exported there as
``make_cos_sin_cache``), :mod:`kvfuse.models`, ``kvfuse bench``, ``kvfuse demo`` and the tests all call
these, so they all rotate by the same fp32 values: angles, cosines and sines in fp64, rounded once.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Optional

import torch

__all__ = ["cos_sin_cache", "yarn_cos_sin_cache", "yarn_attention_factor", "YarnScaling", "proportional_cos_sin_cache",
           "mrope_text_positions", "mrope_grid_positions"]


def _integer(value, name: str, minimum: int):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")


def _rotary_dim(rotary_dim):
    if (isinstance(rotary_dim, bool) or not isinstance(rotary_dim, numbers.Integral) or rotary_dim < 2
            or rotary_dim % 2):
        raise ValueError(f"rotary_dim: expected an even integer >= 2, got {rotary_dim!r}")


def _real(value, name: str, minimum: float, inclusive: bool):
    ok = not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
    if not ok or value < minimum or (value == minimum and not inclusive):
        bound = ">=" if inclusive else ">"
        raise ValueError(f"{name}: expected a finite number {bound} {minimum:g}, got {value!r}")


def _inverse_frequencies(rotary_dim: int, base: float, device) -> torch.Tensor:
    """fp64 base^(-2j / rotary_dim) for j in [0, rotary_dim / 2): the unscaled RoPE's frequencies."""
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim))


def _table(max_position: int, inv: torch.Tensor, scale: float) -> torch.Tensor:
    """Row p: cos(p * inv_j) * scale for every j, then the sines likewise; fp64, rounded once to fp32."""
    ang = torch.arange(max_position, dtype=torch.float64, device=inv.device)[:, None] * inv[None, :]
    return (torch.cat([ang.cos(), ang.sin()], dim=-1) * scale).to(torch.float32)


def cos_sin_cache(max_position: int, rotary_dim: int, base: float = 10000.0, device=None) -> torch.Tensor:
    """fp32 ``[max_position, rotary_dim]``: row p holds cos(p * base^(-2j / rotary_dim)) for j in
    [0, rotary_dim / 2), then the sin of the same angles (kvfuse's cos | sin layout, the unscaled RoPE).
    The angles and their cos and sin are computed in fp64 on ``device`` (default: the CPU) and rounded
    once to fp32."""
    _integer(max_position, "max_position", 0)
    _rotary_dim(rotary_dim)
    _real(base, "base", 0.0, inclusive=False)
    return _table(max_position, _inverse_frequencies(rotary_dim, base, device), 1.0)


def proportional_cos_sin_cache(max_position: int, rotary_dim: int, rotated: int, base: float = 10000.0,
                               device=None) -> torch.Tensor:
    """fp32 ``[max_position, rotary_dim]`` of "proportional" RoPE (Gemma 4's global layers; transformers'
    ``_compute_proportional_rope_parameters``, vLLM's ``Gemma4RotaryEmbedding``): frequency j is
    base^(-2j / rotary_dim) for j < ``rotated`` and 0 for the others (cos 1, sin 0), so the rotation
    spans the whole rotary_dim (pairs (j, j + rotary_dim / 2) under NEOX) while only the first
    ``rotated`` pairs turn. Gemma 4: rotary_dim = head_dim = 512, rotated = 0.25 * 512 / 2 = 64.
    Computed as :func:`cos_sin_cache` (fp64, rounded once)."""
    _integer(max_position, "max_position", 0)
    _rotary_dim(rotary_dim)
    _real(base, "base", 0.0, inclusive=False)
    if isinstance(rotated, bool) or not isinstance(rotated, numbers.Integral) or not 0 <= rotated <= rotary_dim // 2:
        raise ValueError(f"rotated: expected an integer in [0, rotary_dim / 2 = {rotary_dim // 2}], got {rotated!r}")
    inv = _inverse_frequencies(rotary_dim, base, device)
    inv[rotated:] = 0.0
    return _table(max_position, inv, 1.0)


def mrope_text_positions(positions: torch.Tensor) -> torch.Tensor:
    """mRoPE's positions [3, n] of text tokens: the three rows (temporal, height, width) all ``positions``
    [n] (Qwen2-VL's ``get_rope_index`` for text, where mRoPE rotates exactly as plain RoPE). A new
    contiguous tensor of the same dtype and device."""
    if not isinstance(positions, torch.Tensor) or positions.dim() != 1:
        raise ValueError(f"positions: expected a 1-d tensor, got {getattr(positions, 'shape', type(positions))}")
    return positions.unsqueeze(0).expand(3, -1).contiguous()


def mrope_grid_positions(start: int, grid_t: int, grid_h: int, grid_w: int, dtype=torch.int64,
                         device=None) -> torch.Tensor:
    """mRoPE's positions [3, grid_t * grid_h * grid_w] of an image or video's tokens in the language model,
    as Qwen2-VL's ``get_rope_index`` lays them out: tokens in (t, h, w) order, rows ``start + t``,
    ``start + h``, ``start + w``. The grid is the language model's (the vision encoder's patch grid after
    its spatial merge); Qwen2.5-VL / Qwen3-VL's scaling of video time is the caller's. The text after
    the grid continues at ``max + 1`` of these positions."""
    for name, v in (("start", start), ("grid_t", grid_t), ("grid_h", grid_h), ("grid_w", grid_w)):
        _integer(v, name, 0 if name == "start" else 1)
    t, h, w = torch.meshgrid(torch.arange(grid_t, device=device), torch.arange(grid_h, device=device),
                             torch.arange(grid_w, device=device), indexing="ij")
    return (torch.stack([t.reshape(-1), h.reshape(-1), w.reshape(-1)]) + start).to(dtype)


def yarn_attention_factor(factor: float, mscale: Optional[float] = None,
                          mscale_all_dim: Optional[float] = None) -> float:
    """YaRN's magnitude factor for the cos and sin: m(factor) = 0.1 ln(factor) + 1 (1 for factor <= 1),
    or m(factor, mscale) / m(factor, mscale_all_dim) with m(s, k) = 0.1 k ln(s) + 1 when both are given
    and non-zero (DeepSeek's form): transformers' ``_compute_yarn_parameters`` without an explicit
    ``attention_factor``."""
    def m(s, k=1.0):
        return 1.0 if s <= 1 else 0.1 * k * math.log(s) + 1.0
    if mscale and mscale_all_dim:
        return m(factor, mscale) / m(factor, mscale_all_dim)
    return m(factor)


def yarn_cos_sin_cache(max_position: int, rotary_dim: int, base: float, factor: float, original_max_position: int,
                       beta_fast: float = 32.0, beta_slow: float = 1.0, attention_factor: Optional[float] = None,
                       mscale: Optional[float] = None, mscale_all_dim: Optional[float] = None, truncate: bool = True,
                       device=None) -> torch.Tensor:
    """fp32 ``[max_position, rotary_dim]`` of YaRN-scaled RoPE (Peng et al. 2023, arXiv 2309.00071) in
    kvfuse's cos | sin layout: row p holds a * cos(p * w_j) for j in [0, rotary_dim / 2), then a * sin of
    the same angles.

    With d = rotary_dim, L = original_max_position and theta_j = base^(-2j / d) (the unscaled
    frequencies):

    - the dims where a rotation over L turns r times: c(r) = d ln(L / (2 pi r)) / (2 ln base); the
      ramp runs from lo = c(beta_fast) to hi = c(beta_slow) (``truncate``: lo floored and hi ceiled),
      clamped to lo >= 0 and hi <= d - 1, and hi += 0.001 if they meet;
    - ramp_j = clamp((j - lo) / (hi - lo), 0, 1): 0 below lo (fast dims, kept: extrapolated), 1 above hi
      (slow dims, interpolated: divided by ``factor``);
    - w_j = theta_j * ((1 - ramp_j) + ramp_j / factor), the blend theta_j / factor * ramp_j + theta_j *
      (1 - ramp_j) of transformers written so that factor 1 gives theta_j exactly;
    - a = ``attention_factor``, or :func:`yarn_attention_factor` (factor, mscale, mscale_all_dim).

    Sources: huggingface/transformers 5.25.0 src/transformers/modeling_rope_utils.py
    (``_compute_yarn_parameters``, ``yarn_get_mscale``: the formula above, ``truncate`` defaulting to
    True) and src/transformers/models/gpt_oss/modeling_gpt_oss.py (GptOssRotaryEmbedding: cos and sin
    times ``attention_scaling``); openai/gpt-oss gpt_oss/torch/model.py (RotaryEmbedding: the same ramp
    with unrounded bounds, i.e. truncate False, concentration 0.1 ln(factor) + 1); vLLM
    vllm/model_executor/layers/rotary_embedding/yarn_scaling_rope.py (YaRNScalingRotaryEmbedding: the
    same, with a ``truncate`` argument defaulting to True that vllm/model_executor/models/gpt_oss.py
    sets from the model's config). Those three compute the frequencies, angles, cos and sin in fp32 (vLLM
    its table over ceil(original_max_position * factor) rows); here every step is fp64 on ``device``
    (default: the CPU), rounded once to fp32, so an entry may differ from theirs in its last bits.
    """
    _integer(max_position, "max_position", 0)
    _rotary_dim(rotary_dim)
    _real(base, "base", 1.0, inclusive=False)
    _real(factor, "factor", 1.0, inclusive=True)
    _integer(original_max_position, "original_max_position", 1)
    _real(beta_slow, "beta_slow", 0.0, inclusive=False)
    _real(beta_fast, "beta_fast", beta_slow, inclusive=False)
    if attention_factor is not None:
        _real(attention_factor, "attention_factor", 0.0, inclusive=False)
    for value, name in ((mscale, "mscale"), (mscale_all_dim, "mscale_all_dim")):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)
                                  or not math.isfinite(value)):
            raise ValueError(f"{name}: expected a finite number or None, got {value!r}")
    if not isinstance(truncate, bool):
        raise ValueError(f"truncate: expected a bool, got {truncate!r}")

    def correction_dim(rotations):
        return rotary_dim * math.log(original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, rotary_dim - 1)
    if lo == hi:
        hi += 0.001
    j = torch.arange(rotary_dim // 2, dtype=torch.float64, device=device)
    ramp = ((j - lo) / (hi - lo)).clamp(0.0, 1.0)
    inv = _inverse_frequencies(rotary_dim, base, device) * ((1.0 - ramp) + ramp / factor)
    scale = yarn_attention_factor(factor, mscale, mscale_all_dim) if attention_factor is None else attention_factor
    return _table(max_position, inv, float(scale))


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """A model's YaRN parameters (its config's ``rope_scaling`` / ``rope_parameters`` of rope_type "yarn"),
    the arguments of :func:`yarn_cos_sin_cache` other than the table's size, width and base."""
    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: Optional[float] = None
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    truncate: bool = True

    def cos_sin_cache(self, max_position: int, rotary_dim: int, base: float, device=None) -> torch.Tensor:
        """:func:`yarn_cos_sin_cache` with these parameters."""
        return yarn_cos_sin_cache(max_position, rotary_dim, base, device=device, **dataclasses.asdict(self))
