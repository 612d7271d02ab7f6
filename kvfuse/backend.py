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
_checks_override = None


class _BackendState(threading.local):
    backend = None  # a class default: reading it costs no AttributeError in threads that never set it


_state = _BackendState()

# os.environ.get costs ~1 us (three Python frames) and every call reads up to three variables here.
# On POSIX, CPython keeps os.environ's live contents as bytes in os.environ._data (every write
# through os.environ, monkeypatch.setenv included, updates it): read that, else os.environ.get.
_ENVIRON_BYTES = getattr(os.environ, "_data", None) if os.name == "posix" else None
if not isinstance(_ENVIRON_BYTES, dict):
    _ENVIRON_BYTES = None


def getenv(name: str, default: str) -> str:
    """``os.environ.get(name, default)``, fast."""
    if _ENVIRON_BYTES is None:
        return os.environ.get(name, default)
    value = _ENVIRON_BYTES.get(name.encode())
    return default if value is None else os.fsdecode(value)


def env_flag(name: str) -> bool:
    """Whether environment variable ``name`` is set to something other than "" or "0"."""
    if _ENVIRON_BYTES is None:
        return os.environ.get(name, "0") not in ("", "0")
    return _ENVIRON_BYTES.get(name.encode(), b"0") not in (b"", b"0")


def _check_name(name):
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    return name


def current_backend() -> str:
    name = _state.backend
    if name is None:
        name = _check_name(getenv("KVFUSE_BACKEND", "auto") or "auto")
    return name


@contextlib.contextmanager
def use_backend(name: str):
    """Run the enclosed calls with backend ``name`` ("auto", "triton" or "reference")."""
    _check_name(name)
    prev = _state.backend
    _state.backend = name
    try:
        yield
    finally:
        _state.backend = prev


def interpreter_enabled() -> bool:
    return env_flag("TRITON_INTERPRET")


def resolve_backend(device, device_type: str = None) -> str:
    """"triton" or "reference" for tensors on ``device``; ``device_type``: device.type, when the
    caller has it at hand (reading it costs ~0.4 us)."""
    if device_type is None:
        device_type = device.type
    name = current_backend()
    if name == "auto":
        return "triton" if device_type == "cuda" else "reference"
    if name == "triton" and device_type != "cuda" and not interpreter_enabled():
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
    return env_flag("KVFUSE_CHECKS")
