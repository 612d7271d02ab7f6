"""The comparison helpers of the H200 check scripts (benchmarks/gluon_check_common.py) on the CPU:
the status rules of a whole-storage comparison, and the scripts' plain-vs-fast ``compare`` end to
end through the interpreter (there the fast path cannot run, so it must say so and the two
storages must be equal)."""
import os
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import gluon_check_common as common  # noqa: E402
from kvfuse import formats as F  # noqa: E402
from kvfuse.kernels import fused, gluon_common  # noqa: E402


def _case(nonfinite_rows):
    """What storage_diff reads of a case: one block of 4 tokens of 8 bytes, 16 bytes in."""
    return types.SimpleNamespace(nonfinite_rows=torch.tensor(nonfinite_rows), cache_offset=16,
                                 shape=(1, 4, 1, 8), strides=(32, 8, 8, 1))


def test_judge_storages_status_rules():
    flat = torch.zeros(64, dtype=torch.uint8)
    owner = torch.full((64,), -1)
    owner[16:48] = torch.arange(32) // 8                             # token t's record: bytes 16 + 8 t ..
    rec = common.judge_storages(_case([False] * 4), dict(status="ok"), flat, flat.clone(), owner, ("a", "b"))
    assert rec == dict(status="ok", equal=True, diff_bytes=0)
    other = flat.clone()
    other[17] = 1                                                    # token 0, a finite row
    rec = common.judge_storages(_case([False] * 4), dict(status="ok"), flat, other, owner, ("a", "b"))
    assert rec["status"] == "MISMATCH" and rec["diff_bytes"] == 1 and rec["diff_outside_nonfinite_rows"] == 1
    assert rec["first_diffs"] == [dict(offset=17, block=0, byte_in_block=1, row=0, a=0, b=1)]
    rec = common.judge_storages(_case([True, False, False, False]), dict(status="ok"), flat, other, owner,
                                ("a", "b"), split_tokens=True)
    assert rec["status"] == "diff only in inf/NaN rows" and rec["diff_outside_nonfinite_rows"] == 0
    assert rec["first_diffs"][0]["token"] == 0 and rec["first_diffs"][0]["byte"] == 1
    rec = common.judge_storages(_case([False] * 4), dict(status="FAST PATH NOT TAKEN"), flat, other, owner,
                                ("a", "b"))
    assert rec["status"] == "FAST PATH NOT TAKEN" and rec["diff_bytes"] == 1     # an earlier status stays


def test_note_fast_path():
    for launches, expect, status in ((1, True, "ok"), (0, False, "ok"), (0, True, "FAST PATH NOT TAKEN"),
                                     (2, False, "FAST PATH TAKEN, NOT EXPECTED")):
        rec = dict(status="ok")
        common.note_fast_path(rec, launches, expect)
        assert rec == dict(status=status, fast_path_ran=launches > 0)


@pytest.fixture
def on_the_cpu(monkeypatch):
    monkeypatch.setattr(common, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    saved = fused.FAST_PATHS, fused.GLUON
    yield
    fused.FAST_PATHS, fused.GLUON = saved


@pytest.mark.parametrize("script", ["gluon_check_index", "gluon_check_main_fp4"])
def test_compare_runs_both_paths(script, on_the_cpu):
    mod = __import__(script)
    if script == "gluon_check_index":
        c = mod.Case(F.INDEX_NVFP4, "n=3", n=3, seed=2, invalid_slots=0.3)
        module, kernel = mod.GI, "index_write_kernel"
    else:
        c = mod.Case("n=3", n=3, seed=2, invalid_slots=0.3)
        module, kernel = mod.G4, mod.KERNEL
    min_rows, original = module.MIN_ROWS, getattr(module, kernel)
    try:
        rec = mod.compare(c)
    finally:
        module.MIN_ROWS = min_rows
    assert rec["equal"] and rec["diff_bytes"] == 0
    ran = gluon_common.available()                                 # never on the CPU
    assert rec["fast_path_ran"] is ran and rec["status"] == ("ok" if ran else "FAST PATH NOT TAKEN")
    assert getattr(module, kernel) is original and fused.FAST_PATHS == ()   # the launch counter and fast path undone
