"""The GPU matrix (tests/gpu_matrix.py) covers, by construction, every launch the dispatcher can
pick and every pair of code-changing features: a new launch-table entry or fast path without a
GPU case fails here, on the CPU."""
import collections

import pytest

import gpu_matrix as M
from kvfuse.kernels import fused


@pytest.fixture(scope="module")
def built():
    fast = M.fast_cases()
    pairs, uncovered = M.pairwise_cases()
    return fast, pairs, uncovered


def test_every_launch_table_entry_has_a_case(built):
    fast, pairs, _ = built
    reached = {M.dispatch_of(c) for c in fast} | {r["launch"] for _, r in pairs}
    missing = M.all_table_entries() - reached
    assert not missing, f"launch-table entries without a GPU case: {sorted(missing)}"


def test_every_fast_path_entry_runs_each_rope_style_it_serves(built):
    fast, _, _ = built
    seen = collections.defaultdict(set)
    for c in fast:
        if c.fmt is not None:
            seen[M.dispatch_of(c)].add(c.neox)
    for module in fused.FAST_PATH_MODULES:
        name = module.__name__.rsplit(".", 1)[1]
        styles = {True} if name == "gluon_index" else {True, False}
        for i in range(len(module.LAUNCH_TABLE)):
            assert seen[f"{name} entry {i}"] == styles, (name, i, seen[f"{name} entry {i}"])


def test_fast_cases_are_taken_by_their_fast_path(built):
    fast, _, _ = built
    assert all(not M.dispatch_of(c).startswith("plain") for c in fast)


def test_all_pairs_of_features_and_launches_are_covered(built):
    _, pairs, uncovered = built
    assert not uncovered, sorted(uncovered)[:10]
    realized = [r for _, r in pairs]
    for factor, levels in M.FACTORS.items():
        if factor == "rows":
            continue
        got = {str(r[factor]) for r in realized}
        assert {str(v) for v in levels} <= got, (factor, {str(v) for v in levels} - got)
    assert len(pairs) < 400     # the whole matrix must run on one H200 in one 10-minute call
