"""Reliability of kvfuse's switches (SPEC §10 backends, §9 errors and safety): environment switches,
``use_backend``, ``set_checks`` with meta tensors.

- Boolean environment switches are read by one helper, ``kvfuse.backend.env_flag``: 0/1/true/false/
  yes/no/on/off in any case, whitespace around them ignored, empty = unset; any other value is a
  ValueError naming the variable, raised before anything is written. No kvfuse module reads a boolean
  variable any other way.
- ``use_backend`` sets the calling thread's backend as a plain call, restores the previous one when
  used with ``with``, and rejects an unknown name at once.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import kvfuse
from kvfuse import CastArgs, KVCacheOutArgs, RopeArgs, formats
from kvfuse import backend as kv_backend
from helpers import cos_sin_cache, guarded_cache, random_bf16

fused = kvfuse.fused_norm_rope_hadamard_cast_store_kvcache
KVFUSE_DIR = Path(kvfuse.__file__).parent
BOOLEAN_SWITCHES = ("KVFUSE_CHECKS", "KVFUSE_PDL", "KVFUSE_PLAN_CACHE", "KVFUSE_GLUON", "KVFUSE_DIRECT_LAUNCH", "TRITON_INTERPRET")


@pytest.fixture
def switches(monkeypatch):
    """Checks override and backend choice restored after the test (env through monkeypatch)."""
    monkeypatch.setattr(kv_backend, "_checks_override", None)
    monkeypatch.delenv("KVFUSE_CHECKS", raising=False)
    saved = kv_backend._state.backend
    yield monkeypatch
    kv_backend._state.backend = saved


# =========================================================================== environment switches
ON = ["1", "true", "TRUE", "True", "yes", "YES", "on", "On", " 1", "true\n", "\tyes ", " ON "]
OFF = ["0", "false", "FALSE", "False", "no", "No", "off", "OFF", " 0", "false ", "\tno", " Off\n"]
BAD = ["2", "-1", "maybe", "tru", "y", "n", "1 0", "enable", "00", "0x1", "none"]


@pytest.mark.parametrize("value", ON + OFF)
def test_env_flag_words(value, monkeypatch):
    monkeypatch.setenv("KVFUSE_SOME_SWITCH", value)
    expected = value in ON
    assert kv_backend.env_flag("KVFUSE_SOME_SWITCH") is expected
    assert kv_backend.env_flag("KVFUSE_SOME_SWITCH", True) is expected   # the default only for unset / empty


@pytest.mark.parametrize("default", [False, True])
def test_env_flag_unset_or_empty_is_the_default(default, monkeypatch):
    monkeypatch.delenv("KVFUSE_SOME_SWITCH", raising=False)
    assert kv_backend.env_flag("KVFUSE_SOME_SWITCH", default) is default
    for empty in ("", "  "):
        monkeypatch.setenv("KVFUSE_SOME_SWITCH", empty)
        assert kv_backend.env_flag("KVFUSE_SOME_SWITCH", default) is default


@pytest.mark.parametrize("value", BAD)
def test_env_flag_rejects_other_values_by_name(value, monkeypatch):
    monkeypatch.setenv("KVFUSE_SOME_SWITCH", value)
    with pytest.raises(ValueError, match="KVFUSE_SOME_SWITCH"):
        kv_backend.env_flag("KVFUSE_SOME_SWITCH")


def _dup_slot_call(backend):
    """A call whose slots hold a duplicate valid slot: rejected iff the data checks are on.
    Returns (exception or None, cache storage before, after)."""
    fmt = formats.INDEX_MXFP8
    cache, storage = guarded_cache(fmt, 2, 4, seed=1)
    before = storage.clone()
    try:
        with kvfuse.use_backend(backend):
            fused(random_bf16((3, 128), seed=2), cast_args=CastArgs.from_cache_format(fmt),
                  out_args=KVCacheOutArgs(cache, torch.tensor([4, 1, 4]), layout=fmt))
    except ValueError as e:
        return e, before, storage
    return None, before, storage


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("value", ["false", "no", " 0", "OFF", "0"])
def test_kvfuse_checks_off_words_turn_checks_off(backend, value, switches):
    """Regression: KVFUSE_CHECKS=false / no / " 0" turned the checks ON (anything but "" and "0" was on)."""
    switches.setenv("KVFUSE_CHECKS", value)
    assert not kvfuse.checks_enabled()
    err, _, _ = _dup_slot_call(backend)
    assert err is None


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("value", ["true", "YES", " on ", "1"])
def test_kvfuse_checks_on_words_turn_checks_on(backend, value, switches):
    switches.setenv("KVFUSE_CHECKS", value)
    assert kvfuse.checks_enabled()
    err, before, after = _dup_slot_call(backend)
    assert err is not None and "slot" in str(err)
    assert torch.equal(before, after)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_bad_kvfuse_checks_value_is_a_value_error_before_any_write(backend, switches):
    switches.setenv("KVFUSE_CHECKS", "maybe")
    with pytest.raises(ValueError, match="KVFUSE_CHECKS"):
        kvfuse.checks_enabled()
    err, before, after = _dup_slot_call(backend)
    assert err is not None and "KVFUSE_CHECKS" in str(err)
    assert torch.equal(before, after)


def test_gluon_and_direct_launch_switches_take_the_words(monkeypatch):
    from kvfuse.kernels import launcher
    from kvfuse.kernels.gluon import common as gluon_common
    for value, on in (("off", False), ("FALSE", False), (" no ", False), ("0", False), ("yes", True), ("1", True)):
        monkeypatch.setenv("KVFUSE_GLUON", value)
        assert gluon_common.allowed_by_env("main_latent") is on, value
        monkeypatch.setenv("KVFUSE_DIRECT_LAUNCH", value)
        if not on:
            assert launcher.direct_launch_supported(False) is False, value
    monkeypatch.delenv("KVFUSE_GLUON")
    assert gluon_common.allowed_by_env("main_latent") is True                  # default: on
    for name, read in (("KVFUSE_GLUON", lambda: gluon_common.allowed_by_env("main_latent")),
                       ("KVFUSE_DIRECT_LAUNCH", lambda: launcher.direct_launch_supported(False))):
        monkeypatch.setenv(name, "enabled")
        with pytest.raises(ValueError, match=name):
            read()
        monkeypatch.delenv(name)


@pytest.mark.parametrize("value", ["false", "no", "off", "0"])
def test_triton_interpret_off_words_give_the_documented_error(value, switches):
    """Regression: TRITON_INTERPRET=false counted as on, so kvfuse sent CPU tensors to a compiled kernel
    (RuntimeError: 0 active drivers) instead of raising the documented ValueError."""
    switches.setenv("TRITON_INTERPRET", value)
    assert not kv_backend.interpreter_enabled()
    cache, storage = guarded_cache(formats.INDEX_BF16, 1, 4, seed=0)
    before = storage.clone()
    with pytest.raises(ValueError, match="backend 'triton' needs CUDA tensors"), kvfuse.use_backend("triton"):
        fused(random_bf16((2, 128), seed=0), out_args=KVCacheOutArgs(cache, torch.tensor([0, 1]),
                                                                      layout=formats.INDEX_BF16))
    assert torch.equal(storage, before)


@pytest.mark.parametrize("value", [" 1", "yes ", "maybe", "2"])
def test_triton_interpret_values_triton_would_read_differently_are_rejected(value, switches):
    """Triton reads TRITON_INTERPRET itself (1/true/yes/on, nothing around them): a value that kvfuse
    would read as on but Triton as off, or that is no boolean word, is a ValueError naming it."""
    switches.setenv("TRITON_INTERPRET", value)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        kv_backend.interpreter_enabled()


def test_triton_interpret_false_in_a_fresh_process():
    """The whole story in a fresh process (the kernels module imported with TRITON_INTERPRET=false):
    the triton backend on CPU tensors raises the documented ValueError, not Triton's RuntimeError."""
    code = ("import torch, kvfuse\n"
            "try:\n"
            "    with kvfuse.use_backend('triton'):\n"
            "        kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(torch.zeros(2, 64, dtype=torch.bfloat16))\n"
            "    print('accepted')\n"
            "except ValueError as e:\n"
            "    print('ValueError:', e)\n")
    env = dict(os.environ, TRITON_INTERPRET="false", PYTHONPATH=str(KVFUSE_DIR.parent))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "ValueError: backend 'triton' needs CUDA tensors" in run.stdout, run.stdout + run.stderr[-2000:]


def test_every_boolean_switch_is_read_through_env_flag():
    """No kvfuse module reads a boolean environment variable except through env_flag (the variables
    read otherwise are not booleans: a backend name, an integer mode, a list, a path)."""
    not_boolean = {"KVFUSE_BACKEND", "KVFUSE_NATIVE_CASTS", "KVFUSE_GLUON_SKIP", "OUT"}
    not_boolean |= {"KVFUSE_PDL"}   # a boolean word through env_flag, or "early" (compared first, raw)
    reads = re.compile(r"""(?:os\.environ\.get|os\.getenv|getenv|os\.environ\[)\(?\s*["']([A-Z_]+)["']""")
    found = {}
    for path in KVFUSE_DIR.rglob("*.py"):
        for name in reads.findall(path.read_text()):
            found.setdefault(name, set()).add(path.name)
    found.pop("TRITON_INTERPRET", None)  # its raw text is also compared with Triton's own reading (interpreter_enabled)
    assert set(found) - not_boolean == set(), f"read without env_flag: {found}"
    flagged = set()
    for path in KVFUSE_DIR.rglob("*.py"):
        flagged |= set(re.findall(r"""env_flag\(\s*["']([A-Z_]+)["']""", path.read_text()))
    assert flagged == set(BOOLEAN_SWITCHES), flagged


# =========================================================================== set_pdl
@pytest.fixture
def pdl_restored(monkeypatch):
    monkeypatch.setattr(kv_backend, "_pdl_override", None)
    monkeypatch.delenv("KVFUSE_PDL", raising=False)
    yield monkeypatch


@pytest.mark.parametrize("value,mode", [(None, "off"), ("0", "off"), ("1", "on"), (" yes", "on"), ("early", "early"),
                                        ("EARLY ", "early")])
def test_pdl_mode_follows_the_variable(pdl_restored, value, mode):
    if value is not None:
        pdl_restored.setenv("KVFUSE_PDL", value)
    assert kvfuse.pdl_mode() == mode
    assert kvfuse.pdl_enabled() is (mode != "off")


def test_pdl_variable_rejects_other_words_by_name(pdl_restored):
    pdl_restored.setenv("KVFUSE_PDL", "earliest")
    with pytest.raises(ValueError, match="KVFUSE_PDL"):
        kvfuse.pdl_mode()


def test_set_pdl_modes_and_errors(pdl_restored):
    pdl_restored.setenv("KVFUSE_PDL", "early")
    kvfuse.set_pdl(False)                                  # overrides the variable
    assert kvfuse.pdl_mode() == "off" and not kvfuse.pdl_enabled()
    kvfuse.set_pdl(True)
    assert kvfuse.pdl_mode() == "on"
    kvfuse.set_pdl(True, early_reads=True)
    assert kvfuse.pdl_mode() == "early" and kvfuse.pdl_enabled()
    with pytest.raises(ValueError, match="early_reads"):
        kvfuse.set_pdl(False, early_reads=True)
    with pytest.raises(TypeError, match="early_reads"):
        kvfuse.set_pdl(True, early_reads=1)
    with pytest.raises(TypeError, match="enabled"):
        kvfuse.set_pdl("early")
    assert kvfuse.pdl_mode() == "early"                    # the rejected calls changed nothing


def test_with_pdl_names_early_reads_only_where_the_kernel_has_them():
    from kvfuse.kernels import router
    assert router.with_pdl({"A": 1}, router.PDL_OFF) == {"A": 1}
    assert router.with_pdl({"A": 1}, router.PDL_EARLY) == {"A": 1, "PDL": True, "launch_pdl": True}
    assert router.with_pdl({"PDL_EARLY": False}, router.PDL_ON) == {"PDL_EARLY": False, "PDL": True,
                                                                     "launch_pdl": True}
    assert router.with_pdl({"PDL_EARLY": False}, router.PDL_EARLY)["PDL_EARLY"] is True


def test_pdl_launch_is_off_on_the_cpu_in_every_mode(pdl_restored):
    from kvfuse.kernels import router
    for early in (False, True):
        kvfuse.set_pdl(True, early_reads=early)
        assert router.pdl_launch(torch.zeros(1)) == router.PDL_OFF


# =========================================================================== use_backend
def test_use_backend_plain_call_sets_the_backend(switches):
    """Regression: a plain call ``kvfuse.use_backend("reference")`` did nothing (a generator-based
    context manager only acts inside ``with``)."""
    switches.delenv("KVFUSE_BACKEND", raising=False)
    kv_backend._state.backend = None
    assert kvfuse.current_backend() == "auto"
    kvfuse.use_backend("reference")
    assert kvfuse.current_backend() == "reference"
    kvfuse.use_backend("triton")
    assert kvfuse.current_backend() == "triton"
    kvfuse.use_backend("auto")
    assert kvfuse.current_backend() == "auto"


def test_use_backend_with_restores_the_previous_choice(switches):
    kvfuse.use_backend("triton")
    with kvfuse.use_backend("reference") as choice:
        assert kvfuse.current_backend() == "reference" and choice.name == "reference"
        with kvfuse.use_backend("auto"):
            assert kvfuse.current_backend() == "auto"
        assert kvfuse.current_backend() == "reference"
    assert kvfuse.current_backend() == "triton"
    with pytest.raises(RuntimeError, match="boom"):
        with kvfuse.use_backend("reference"):
            raise RuntimeError("boom")
    assert kvfuse.current_backend() == "triton"                  # restored on an exception too
    # a thread that never chose follows KVFUSE_BACKEND again once its choices are undone
    kv_backend._state.backend = None
    switches.setenv("KVFUSE_BACKEND", "reference")
    with kvfuse.use_backend("triton"):
        assert kvfuse.current_backend() == "triton"
    assert kvfuse.current_backend() == "reference"


@pytest.mark.parametrize("name", ["bogus", "cuda", "Triton", "", None, 1])
def test_use_backend_unknown_name_is_a_value_error_at_once(name, switches):
    """Regression: use_backend("bogus") as a plain call raised nothing (the check ran only on ``with``)."""
    kvfuse.use_backend("reference")
    with pytest.raises(ValueError, match="backend must be one of"):
        kvfuse.use_backend(name)
    assert kvfuse.current_backend() == "reference"                # unchanged


def test_use_backend_is_per_thread_and_set_checks_per_process(switches):
    kvfuse.use_backend("reference")
    seen = {}

    def other():
        seen["before"] = kvfuse.current_backend()
        kvfuse.use_backend("triton")
        seen["after"] = kvfuse.current_backend()
        seen["checks"] = kvfuse.checks_enabled()

    kvfuse.set_checks(True)
    switches.setenv("KVFUSE_BACKEND", "auto")
    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen == {"before": "auto", "after": "triton", "checks": True}
    assert kvfuse.current_backend() == "reference"               # this thread's choice is untouched


# =========================================================================== set_checks with meta tensors
def _meta(t):
    return torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device="meta")


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("how", ["set_checks", "env"])
def test_checks_skip_meta_tensors(backend, how, switches):
    """Regression: with the data checks on, meta tensors crashed (item() on meta, nonzero has no meta
    kernel) in the fused call and in store_kv_cache. Data-dependent checks are skipped for meta
    tensors; the shape checks still run."""
    if how == "set_checks":
        kvfuse.set_checks(True)
    else:
        switches.setenv("KVFUSE_CHECKS", "1")
    assert kvfuse.checks_enabled()
    fmt = formats.INDEX_MXFP8
    cache = _meta(fmt.allocate(2, 4))
    slots = torch.empty(3, dtype=torch.int64, device="meta")
    pos = torch.empty(3, dtype=torch.int32, device="meta")
    cs = _meta(cos_sin_cache(16, 32))
    x = torch.empty((3, 128), dtype=torch.bfloat16, device="meta")
    out = torch.empty((3, 128), dtype=torch.bfloat16, device="meta")
    with kvfuse.use_backend(backend):
        res = fused(x, rope_args=RopeArgs(pos, cs, 32, True), cast_args=CastArgs.from_cache_format(fmt),
                    out_args=KVCacheOutArgs(cache, slots, out=out, out_stage="transform", layout=fmt))
        assert res is out
        q, sf = fused(x, rope_args=RopeArgs(pos, cs, 32, True), cast_args=CastArgs.from_cache_format(fmt))
        assert q.device.type == "meta" and q.shape == (3, 128) and sf.shape == (3, 4)
        kvfuse.store_kv_cache(torch.empty((3, 128), dtype=torch.float8_e4m3fn, device="meta"),
                              torch.empty((3, 4), dtype=torch.uint8, device="meta"), cache, slots, fmt)
        # shape checks still run on meta tensors
        with pytest.raises(ValueError, match="data: expected shape"):
            kvfuse.store_kv_cache(torch.empty((3, 128), dtype=torch.float8_e4m3fn, device="meta"),
                                  torch.empty((3, 4), dtype=torch.uint8, device="meta"), cache, slots[:2], fmt)
