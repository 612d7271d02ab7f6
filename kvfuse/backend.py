"""Backend choice and data-dependent checks.

``use_backend(name)`` (a context manager) or ``KVFUSE_BACKEND``: "auto" (the Triton kernel for
CUDA tensors, the reference otherwise), "triton" or "reference". With ``TRITON_INTERPRET=1``,
"triton" runs the same kernel on CPU tensors through Triton's interpreter.
``set_checks(True)`` or ``KVFUSE_CHECKS=1`` turns on the checks that read data (positions in
range, no duplicate valid slots): they synchronize the device and stay off by default.
"""
from __future__ import annotations

import contextlib
import os
import threading

BACKENDS = ("auto", "triton", "reference")
_state = threading.local()
_checks_override = None


def _check_name(name):
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    return name


def current_backend() -> str:
    name = getattr(_state, "backend", None)
    if name is None:
        name = _check_name(os.environ.get("KVFUSE_BACKEND", "auto") or "auto")
    return name


@contextlib.contextmanager
def use_backend(name: str):
    """Run the enclosed calls with backend ``name`` ("auto", "triton" or "reference")."""
    _check_name(name)
    prev = getattr(_state, "backend", None)
    _state.backend = name
    try:
        yield
    finally:
        _state.backend = prev


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_backend(device) -> str:
    """"triton" or "reference" for tensors on ``device``."""
    name = current_backend()
    if name == "auto":
        return "triton" if device.type == "cuda" else "reference"
    if name == "triton" and device.type != "cuda" and not interpreter_enabled():
        raise ValueError(f"backend 'triton' needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors), "
                         f"got tensors on {device}")
    return name


def set_checks(enabled: bool) -> None:
    """Turn the data-dependent checks on or off (overrides KVFUSE_CHECKS)."""
    global _checks_override
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    _checks_override = enabled


def checks_enabled() -> bool:
    if _checks_override is not None:
        return _checks_override
    return os.environ.get("KVFUSE_CHECKS", "0") not in ("", "0")
