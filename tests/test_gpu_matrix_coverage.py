"""The GPU matrix (tests/gpu_matrix.py) covers, by construction, every launch the dispatcher can
pick and every pair of code-changing features: a new launch-table entry or fast path without a
GPU case fails here, on the CPU."""
import collections

import pytest

import gpu_matrix as M
from kvfuse.kernels import router


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


def test_every_fast_path_entry_runs_each_chain_it_serves(built):
    """Every entry of every fast path runs both RoPE styles; the MAIN paths' also the cast alone; the
    indexer's also RoPE at offset 0 and on the tail, LayerNorm (with a bias) and RMSNorm, with and
    without the Hadamard, and every format."""
    fast, _, _ = built
    seen = collections.defaultdict(lambda: collections.defaultdict(set))
    for c in fast:
        if c.fmt is not None:
            got = seen[M.dispatch_of(c)]
            got["neox"].add(c.neox)
            got["offset"].add(c.rope_offset)
            got["norm"].add((c.norm_kind, c.bias))
            got["hadamard"].add(c.hadamard)
            got["format"].add(c.fmt.name)
            got["cast_only"].add(not c.norm and not c.rope)
    for module in router.FAST_PATH_MODULES:
        name = module.__name__.rsplit(".", 1)[1]
        for i in range(len(module.LAUNCH_TABLE)):
            got = seen[f"{name} entry {i}"]
            assert got["neox"] == {True, False}, (name, i, got["neox"])
            if name in ("main_latent", "main_latent_fp4"):
                assert got["cast_only"] == {False, True}, (name, i)
            if name == "indexer":
                assert got["offset"] == {None, 0} and got["hadamard"] == {False, True}, (i, got)
                assert got["norm"] == {("rms", False), ("layer", True), ("layer", False)}, (i, got["norm"])
                assert len(got["format"]) == 5, (i, got["format"])


def test_every_flashmla_entry_runs_two_inputs_and_the_latent_norm(built):
    """Every entry of the FlashMLA fast path runs x as two inputs (both formats, both RoPE styles) and
    V32's norm over the latent only, alone and with two inputs."""
    from kvfuse.kernels.gluon import flashmla
    fast, _, _ = built
    seen = collections.defaultdict(set)
    for c in fast:
        label = M.dispatch_of(c)
        if label.startswith("flashmla "):
            seen[label].add((c.fmt.name, c.neox, c.split is not None, c.norm_dim is not None))
    for i in range(len(flashmla.LAUNCH_TABLE)):
        got = seen[f"flashmla entry {i}"]
        for fmt in ("FLASHMLA_V32", "FLASHMLA_MODEL1"):
            assert {(neox, True) for f, neox, split, _ in got if f == fmt and split} == {(True, True), (False, True)}, \
                (i, fmt, got)
        assert {(split, leading) for f, _, split, leading in got if f == "FLASHMLA_V32" and leading} == \
            {(False, True), (True, True)}, (i, got)


def test_main_fp8_fast_path_writes_the_reserved_bytes_its_format_says():
    """MAIN_FP8's Gluon records write the 4 reserved bytes as zeros, as the format says (the GPU matrix's
    MAIN_FP8 cases compare those bytes); a 532-byte format whose reserved bytes are never written is not
    the fast path's (it stays on the portable kernel)."""
    from kvfuse import formats as F
    from kvfuse.kernels.gluon import main_latent as M8, main_latent_fp4 as M4
    assert M8.RECORDS.zero_reserved and F.MAIN_FP8.zero_reserved and F.MAIN_FP8.reserved_bytes == 4
    assert M8.RECORD_BYTES == F.MAIN_FP8.bytes_per_token and M8.RECORDS.sf_offset + 16 + 4 == M8.RECORD_BYTES
    assert not M8.RECORDS_MXFP8.zero_reserved and not M4.RECORDS.zero_reserved


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


def test_every_gqa_launch_table_entry_has_a_case():
    """The GQA section reaches every entry of qkv.launch_table for each tile width."""
    from kvfuse.kernels import qkv
    from kvfuse.kernels.gluon.common import table_entry
    cases = [c for _, c in M.gqa_cases()]
    for d in (64, 128, 256):
        table = qkv.launch_table(d)
        picked = {table_entry(table, c.n) for c in cases if c.d == d}
        assert picked == {cfg for _, cfg in table}, d
    wide = qkv.launch_table(1024)       # indexed by tokens x heads
    picked = {table_entry(wide, c.n * max(c.hq, c.hkv)) for c in cases if c.d > 512}
    assert picked == {cfg for _, cfg in wide}
    from kvfuse.gqa_formats import PRESETS
    stored = [f.base for _, f in M.gqa_format_cases()
              if any(PRESETS[x].scale == "token_head" for x in (f.k_format, f.v_format) if x) and f.base.hq > 0]
    for d in (64, 128):                 # the stored-scale table: 4-bit caches, per-(token, head) ones with q heads
        table = qkv.launch_table(d, stored_scale=True)
        picked = {table_entry(table, c.n) for c in cases if c.d == d and (c.fp4_k or c.fp4_v)}
        assert picked == {cfg for _, cfg in table}, d          # 4-bit caches
        picked = {table_entry(table, c.n) for c in stored if c.d == d}
        assert picked == {cfg for _, cfg in table}, d          # per-(token, head) caches
