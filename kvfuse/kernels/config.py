"""How this process launches the Triton kernels, read by every kernel's host code (portable.py,
qkv.py, store_load.py, router.py): compiled or interpreted, the direct launcher, native conversions,
the int32 bound of row and slot arithmetic, and the launch configuration tests force.
"""
from __future__ import annotations

import contextlib
import os
import threading

from .. import backend as _backend
from .codes import NATIVE_INTEGER
from .launcher import direct_launch_supported

# triton.jit chose between compiling and interpreting when this module was imported
INTERPRET = _backend.interpreter_enabled()
DIRECT_LAUNCH = direct_launch_supported(INTERPRET)   # see kvfuse/kernels/launcher.py
# 0: integer narrowing helpers on the GPU too (a diagnostic: the bytes must not change); 1: native
# conversions; 2: native, and the e4m3 encode without its signed-zero guard
NATIVE_CASTS = int(os.environ.get("KVFUSE_NATIVE_CASTS", "2"))
# row and slot arithmetic runs in int32 below this bound (tests lower it to exercise the int64 paths;
# read it as config.INT32_LIMIT so that they can)
INT32_LIMIT = 2 ** 31


# the launch path is hot: plain-Python helpers (triton.next_power_of_2 costs microseconds a call)
def next_pow2(v: int) -> int:
    return 1 << max(v - 1, 0).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def native(interpret: bool) -> int:
    """The NATIVE constexpr: native conversions on the GPU (exact there); never in the interpreter
    (wrong there)."""
    return NATIVE_INTEGER.value if interpret else NATIVE_CASTS


class _ForcedConfig(threading.local):
    cfg = None  # a class default: reading it costs no AttributeError in threads that never forced


# this thread's force_config: None, or (block_m, num_warps, vec, heads) with None for "not forced"
FORCED = _ForcedConfig()


@contextlib.contextmanager
def force_config(block_m: int = None, num_warps: int = None, vec: int = None, heads: int = None):
    """Force rows per program / warps per program / vector width, and the GQA kernel's heads per program
    (tests of launch-configuration invariance)."""
    prev = FORCED.cfg
    FORCED.cfg = (block_m, num_warps, vec, heads)
    try:
        yield
    finally:
        FORCED.cfg = prev
