"""Argument checks shared by the engine adapters: each raises TypeError / ValueError naming the
engine's argument, and says "not supported yet" for what the engine allows and kvfuse does not."""
from __future__ import annotations

import re

import torch

_LEADING_NAME = re.compile(r"^([\w.]+(?:\[\d+\])?)(?=[:\s\[])")


def tensor(t, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def activations(t, name: str, dims: int, dtypes=(torch.bfloat16,)) -> torch.Tensor:
    """An input of one of ``dtypes`` with ``dims`` dimensions (another dtype: "not supported yet")."""
    tensor(t, name)
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: dtype {t.dtype} is not supported yet (kvfuse takes "
                        f"{', '.join(str(d) for d in dtypes)})")
    if t.dim() != dims:
        raise ValueError(f"{name}: expected {dims} dimensions, got shape {tuple(t.shape)}")
    return t


def bf16_input(t, name: str, dims: int) -> torch.Tensor:
    """A bf16 input of ``dims`` dimensions (where kvfuse takes bf16 only)."""
    return activations(t, name, dims)


def head_size(size: int, name: str, multiple: int = 16) -> None:
    if size <= 0 or size % multiple:
        raise ValueError(f"{name}: head size {size} is not supported yet (kvfuse needs a positive multiple of "
                         f"{multiple})")


def slots(slot_mapping, name: str = "slot_mapping") -> torch.Tensor:
    tensor(slot_mapping, name)
    if slot_mapping.dim() != 1:
        raise ValueError(f"{name}: expected shape [num_tokens], got {tuple(slot_mapping.shape)}")
    return slot_mapping


_FP8_NAMES = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}


def fp8_cache(cache, name: str, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    """An fp8 cache as the engine allocates it (uint8, or ``dtype``: float8_e4m3fn or float8_e5m2), viewed as
    ``dtype``."""
    tensor(cache, name)
    if cache.dtype == dtype:
        return cache
    if cache.dtype == torch.uint8:
        return cache.view(dtype)
    raise TypeError(f"{name}: an fp8 {_FP8_NAMES[dtype]} cache must be uint8 or {str(dtype)[6:]}, got {cache.dtype}")


def byte_cache(cache, name: str) -> torch.Tensor:
    """A cache of byte records (per-group formats) as the engine allocates it: uint8, or a float8_e4m3fn
    view of the same bytes, returned as uint8."""
    tensor(cache, name)
    if cache.dtype == torch.float8_e4m3fn:
        return cache.view(torch.uint8)
    if cache.dtype != torch.uint8:
        raise TypeError(f"{name}: expected a uint8 cache of byte records, got {cache.dtype}")
    return cache


def per_tensor_scale(scale, name: str) -> torch.Tensor:
    """One fp32 scale for the whole tensor (per-head scales are not supported yet)."""
    tensor(scale, name)
    if scale.dtype != torch.float32:
        raise TypeError(f"{name}: expected dtype torch.float32, got {scale.dtype}")
    if scale.numel() != 1:
        raise ValueError(f"{name}: {scale.numel()} scales (per-head scales) are not supported yet; "
                         "kvfuse takes one per-tensor scale")
    return scale if scale.dim() == 0 else scale.reshape(())   # a reshape costs host time


def rename(e: Exception, names: dict) -> None:
    """Raise ``e`` (a TypeError / ValueError of a kvfuse entry point) again with the engine's argument
    names: a message that starts with kvfuse's name of an argument (``"k_cache: ..."``) starts with the
    engine's instead; returns where it names none of ``names`` (the caller re-raises ``e`` as it is).
    Called from an ``except`` clause, which costs nothing while no error is raised."""
    msg = str(e)
    m = _LEADING_NAME.match(msg)
    if m is not None and m.group(1) in names:
        raise type(e)(names[m.group(1)] + msg[m.end():]) from e


class engine_names:
    """:func:`rename` as a context manager (~0.2 us of host time a call: the hot adapters call ``rename``
    from an ``except`` clause instead). A class, not contextlib's generator: that costs ~2 us a call."""

    __slots__ = ("names",)

    def __init__(self, names: dict):
        self.names = names

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if kind is not None and issubclass(kind, (TypeError, ValueError)):
            rename(e, self.names)
        return False
