"""Backend choice, the data-dependent checks and kvfuse's environment switches.

``use_backend(name)`` or ``KVFUSE_BACKEND``: "auto" (the Triton kernel for CUDA tensors, the
reference otherwise), "triton" or "reference". ``use_backend`` works as a plain call (sets the
backend of the calling thread) and as a context manager (restores the thread's previous choice on
exit); an unknown name is a ValueError at once. With ``TRITON_INTERPRET=1``, "triton" runs the
same kernel on CPU tensors through Triton's interpreter.
``set_checks(True)`` or ``KVFUSE_CHECKS=1`` turns on the checks that read data (positions in
range, no duplicate valid slots): they synchronize the device and stay off by default.

Scope: the backend chosen with ``use_backend`` is per thread (a thread that never chose follows
``KVFUSE_BACKEND``); ``set_checks`` and every environment variable are per process.

``set_pdl(True)`` or ``KVFUSE_PDL=1`` launches the kernels with programmatic dependent launch
(Hopper and newer, compiled kernels only; off by default); ``set_pdl(True, early_reads=True)`` or
``KVFUSE_PDL=early`` also reads the slots and positions before the wait (opt-in, SPEC §10).

Boolean environment switches (``KVFUSE_CHECKS``, ``KVFUSE_PDL`` (which also takes "early"), ``KVFUSE_PLAN_CACHE``, ``KVFUSE_GLUON``,
``KVFUSE_DIRECT_LAUNCH``, ``TRITON_INTERPRET``) are read with :func:`env_flag`: 0/1/true/false/
yes/no/on/off in any case, surrounding whitespace ignored, an empty value counts as unset;
anything else is a ValueError naming the variable.
"""
from __future__ import annotations

import os
import threading

BACKENDS = ("auto", "triton", "reference")
_checks_override = None
_pdl_override = None


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


FLAG_WORDS = {"0": False, "1": True, "false": False, "true": True, "no": False, "yes": True, "off": False,
              "on": True}
_FLAG_BYTES = {word.encode(): value for word, value in FLAG_WORDS.items()}  # the exact spellings: one dict read


def parse_flag(name: str, value: str, default: bool = False) -> bool:
    """The boolean that ``value`` (of the environment variable ``name``) spells: 0/1/true/false/yes/no/
    on/off in any case, surrounding whitespace ignored; an empty value is ``default`` (as if unset).
    Anything else is a ValueError naming the variable."""
    word = value.strip().lower()
    if not word:
        return default
    flag = FLAG_WORDS.get(word)
    if flag is None:
        raise ValueError(f"environment variable {name}={value!r}: expected one of 0/1/true/false/yes/no/on/off "
                         f"(any case), or unset")
    return flag


def env_flag(name: str, default: bool = False) -> bool:
    """The boolean environment switch ``name`` (see :func:`parse_flag`); ``default`` when unset.
    Raises ValueError naming the variable for a value that is not a boolean word."""
    if _ENVIRON_BYTES is None:
        value = os.environ.get(name)
        return default if value is None else parse_flag(name, value, default)
    raw = _ENVIRON_BYTES.get(name.encode())
    if raw is None:
        return default
    flag = _FLAG_BYTES.get(raw)
    return flag if flag is not None else parse_flag(name, os.fsdecode(raw), default)


def _check_name(name):
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    return name


def current_backend() -> str:
    name = _state.backend
    if name is None:
        name = _check_name(getenv("KVFUSE_BACKEND", "auto") or "auto")
    return name


class use_backend:  # noqa: N801 - a function in the public API that also works as a context manager
    """Choose the backend of the calling thread: "auto", "triton" or "reference".

    A plain call ``use_backend("reference")`` sets it (until the next choice); ``with
    use_backend("reference"):`` sets it and restores the previous choice on exit (the one in force
    when ``use_backend`` was called). An unknown name raises ValueError at once, changing nothing.
    The choice is per thread: other threads keep theirs (or ``KVFUSE_BACKEND``).
    """

    __slots__ = ("name", "_previous")

    def __init__(self, name: str):
        _check_name(name)
        self.name = name
        self._previous = _state.backend
        _state.backend = name

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        _state.backend = self._previous
        return False

    def __repr__(self):
        return f"use_backend({self.name!r})"


_TRITON_TRUE = ("1", "true", "yes", "on")   # what Triton itself reads as on (triton.knobs, getenv_bool)
_TRITON_TRUE_BYTES = frozenset(v.encode() for w in _TRITON_TRUE for v in (w, w.upper(), w.capitalize()))


def interpreter_enabled() -> bool:
    """Whether TRITON_INTERPRET asks for Triton's interpreter (read with :func:`env_flag`). A value
    that kvfuse reads as on but Triton reads as off (on-words with spaces around them: Triton does not
    strip) is a ValueError: kvfuse and Triton would disagree on whether the kernels are interpreted."""
    if _ENVIRON_BYTES is not None and _ENVIRON_BYTES.get(b"TRITON_INTERPRET") in _TRITON_TRUE_BYTES:
        return True             # the usual spellings: one dict read (resolve_backend asks on every CPU call)
    on = env_flag("TRITON_INTERPRET")
    if on and getenv("TRITON_INTERPRET", "").lower() not in _TRITON_TRUE:
        raise ValueError(f"environment variable TRITON_INTERPRET={getenv('TRITON_INTERPRET', '')!r}: Triton reads "
                         f"this as off (it takes only 1/true/yes/on without surrounding spaces); write it without "
                         f"spaces, or 0")
    return on


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
    """Turn the data-dependent checks on or off for the whole process (overrides KVFUSE_CHECKS)."""
    global _checks_override
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    _checks_override = enabled


def checks_enabled() -> bool:
    if _checks_override is not None:
        return _checks_override
    return env_flag("KVFUSE_CHECKS")


PDL_MODES = ("off", "on", "early")


def set_pdl(enabled: bool, early_reads: bool = False) -> None:
    """Programmatic dependent launch on or off for the whole process (overrides KVFUSE_PDL): each
    kernel may start while the previous kernel on the stream finishes and waits for it (griddepcontrol)
    before its first read of x, the positions or the slots. Bytes unchanged; works in CUDA graphs.
    Takes effect on Hopper and newer GPUs with compiled kernels; elsewhere it changes nothing.

    ``early_reads`` (opt-in, with ``enabled``; ``KVFUSE_PDL=early``): the kernels that support it (SPEC
    §10) also read the slots, the positions and their cos/sin rows before the wait, and only x after it:
    for engines whose slot mapping and positions were written before the previous kernel on the stream
    started (prepared at the start of a step). A producer of those still running would be raced."""
    global _pdl_override
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    if not isinstance(early_reads, bool):
        raise TypeError(f"early_reads must be a bool, got {type(early_reads).__name__}")
    if early_reads and not enabled:
        raise ValueError("early_reads=True needs enabled=True (reads before the wait exist only under PDL)")
    _pdl_override = "early" if early_reads else "on" if enabled else "off"


def pdl_mode() -> str:
    """"off", "on" or "early" (on, with the early reads of :func:`set_pdl`): set_pdl's choice, else
    KVFUSE_PDL (a boolean word, or "early")."""
    if _pdl_override is not None:
        return _pdl_override
    if getenv("KVFUSE_PDL", "").strip().lower() == "early":
        return "early"
    return "on" if env_flag("KVFUSE_PDL") else "off"


def pdl_enabled() -> bool:
    """Whether programmatic dependent launch is on (either mode of :func:`pdl_mode`)."""
    return pdl_mode() != "off"
