"""The RoPE cos/sin table that ``RopeArgs.cos_sin_cache`` takes, built one way for the whole project:
:mod:`kvfuse.mla` (re-exported there as ``make_cos_sin_cache``), :mod:`kvfuse.models`, ``kvfuse bench``,
``kvfuse demo`` and the tests all call :func:`cos_sin_cache`, so they all rotate by the same fp32 values.
"""
from __future__ import annotations

import math
import numbers

import torch

__all__ = ["cos_sin_cache"]


def cos_sin_cache(max_position: int, rotary_dim: int, base: float = 10000.0, device=None) -> torch.Tensor:
    """fp32 ``[max_position, rotary_dim]``: row p holds cos(p * base^(-2j / rotary_dim)) for j in
    [0, rotary_dim / 2), then the sin of the same angles (kvfuse's cos | sin layout, the unscaled RoPE).
    The angles and their cos and sin are computed in fp64 on ``device`` (default: the CPU) and rounded
    once to fp32."""
    if isinstance(max_position, bool) or not isinstance(max_position, numbers.Integral) or max_position < 0:
        raise ValueError(f"max_position: expected an integer >= 0, got {max_position!r}")
    if (isinstance(rotary_dim, bool) or not isinstance(rotary_dim, numbers.Integral) or rotary_dim < 2
            or rotary_dim % 2):
        raise ValueError(f"rotary_dim: expected an even integer >= 2, got {rotary_dim!r}")
    if isinstance(base, bool) or not isinstance(base, numbers.Real) or not math.isfinite(base) or base <= 0:
        raise ValueError(f"base: expected a finite number > 0, got {base!r}")
    inv = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim))
    ang = torch.arange(max_position, dtype=torch.float64, device=device)[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=-1).to(torch.float32)
