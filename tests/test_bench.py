"""kvfuse bench without a GPU: the no-CUDA exit, the byte model, the peers' outputs (through the
reference backend), the orchestration with an injected fake timer, and the report (table, targets,
JSON, PNG). No timing is asserted."""
import json
import subprocess
import sys

import pytest
import torch

import kvfuse
from kvfuse import bench, use_backend
from kvfuse.bench import Record


class FakeTimer:
    """Returns made-up timings per peer without running anything (fused 10 us, stages 30 us...)."""
    GPU = {"reference": 400.0, "compile": 120.0, "stages": 30.0, "two_launch": 20.0, "calls": 20.0, "fused": 10.0}

    def __init__(self):
        self.labels = []

    def measure(self, fns, label=None):
        assert fns and all(callable(f) for f in fns)
        self.labels.append(label)
        peer = label[2]
        return bench.Timing(self.GPU[peer], "events" if peer == "reference" else "graph", 2 * self.GPU[peer])


def fake_device(quick):
    return {"copy_GBps": 4000.0, "floor_us": 1.0}


# ----------------------------------------------------------------------------- entry point
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_main_without_cuda_returns_0_and_says_so(capsys):
    assert bench.main([]) == 0
    assert "needs a CUDA device" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_cli_routes_bench(capsys):
    from kvfuse.cli import main as cli_main
    assert cli_main(["bench", "--quick"]) == 0
    assert "needs a CUDA device" in capsys.readouterr().out


def test_python_m_kvfuse_bench_runs_the_cli():
    """``python -m kvfuse.bench`` is ``kvfuse bench`` (the package's __main__): a bad option exits 2 and says why."""
    done = subprocess.run([sys.executable, "-m", "kvfuse.bench", "--workloads", "nope"], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2 and "kvfuse bench: --workloads: unknown ['nope']" in done.stderr


def test_bad_options_return_2(capsys):
    assert bench.main(["--workloads", "nope"]) == 2
    assert bench.main(["--peers", "fused,bogus"]) == 2
    assert bench.main(["--n", "1,x"]) == 2
    assert "kvfuse bench:" in capsys.readouterr().err


def test_parse_config_defaults_and_quick():
    cfg = bench.parse_config([])
    assert cfg.workloads == list(bench.WORKLOADS) and cfg.sizes == list(bench.DEFAULT_SIZES)
    assert cfg.peers == list(bench.PEERS) and cfg.peer_max_n == 65536 and not cfg.cold_l2
    q = bench.parse_config(["--quick"])
    assert q.workloads == list(bench.QUICK_WORKLOADS) and q.sizes == list(bench.QUICK_SIZES)
    assert q.budget_s < cfg.budget_s
    c = bench.parse_config(["--n", "8,2", "--workloads", "index_q", "--peers", "fused,stages", "--cold-l2"])
    assert c.sizes == [8, 2] and c.workloads == ["index_q"] and c.peers == ["stages", "fused"] and c.cold_l2


def test_parse_config_pdl_modes():
    assert bench.parse_config([]).pdl is False
    assert bench.parse_config(["--pdl"]).pdl is True
    assert bench.parse_config(["--pdl", "--pdl-early"]).pdl == "early"
    with pytest.raises(ValueError, match="--pdl-early"):
        bench.parse_config(["--pdl-early"])


# ----------------------------------------------------------------------------- byte model
def test_moved_bytes_main_fp8_by_hand():
    wl = bench.WORKLOADS["main_fp8"]
    # per token: x 512*2 + cos/sin row 64*4 + position 4 + slot 4 + record 512 data + 16 scales
    per_token = 1024 + 256 + 4 + 4 + 512 + 16
    weight = 512 * 2
    b1 = bench.moved_bytes(wl, 1)
    assert b1["total"] == per_token + weight == 2840
    assert b1 == {"x": 1024, "norm_weight": 1024, "cos_sin": 256, "positions": 4, "slots": 4,
                  "cache_data": 512, "cache_scales": 16, "total": 2840}
    assert bench.moved_bytes(wl, 1024)["total"] == 1024 * 1816 + 1024 == 1860608


@pytest.mark.parametrize("name,total", [
    ("main_fp4", 1024 + 1024 + 256 + 8 + 256 + 32),
    ("flashmla_v32", 1152 + 1152 + 256 + 8 + 512 + 16 + 128),     # 4 fp32 scales, 64-dim bf16 tail
    ("flashmla_model1", 1024 + 1024 + 256 + 8 + 448 + 7 + 128),   # 7 exact scales (the 8th byte is reserved)
    ("index_mxfp4", 256 + 256 + 256 + 8 + 64 + 4),
    ("index_nvfp4", 256 + 256 + 256 + 8 + 64 + 8),
    ("index_fp8_fp32", 256 + 256 + 256 + 8 + 128 + 4),
    ("q_pre", 64 * 512 * 2 + 1024 + 256 + 4 + 64 * 512 * 2),     # no slots; bf16 out
    ("index_q", 64 * 128 * 2 + 256 + 4 + 64 * 64 + 64 * 4),      # no norm; (q, sf) out
])
def test_moved_bytes_per_workload_n1(name, total):
    assert bench.moved_bytes(bench.WORKLOADS[name], 1)["total"] == total


def _index_inputs(positions, slots=None, name="index_fp8_fp32"):
    """8 tokens of a 128-d indexer write with the given positions (and slots)."""
    wl = bench.WORKLOADS[name]
    inp = bench.build_inputs(wl, 8, "cpu")
    inp.positions = torch.tensor(positions, dtype=torch.int32)
    if slots is not None:
        inp.slots = torch.tensor(slots, dtype=torch.int32)
    return wl, inp


# INDEX_FP8_FP32, per token: x 256 + position 4 + slot 4 + record 128 data + 4 scale bytes; once: weight 256
INDEX_TOKEN, INDEX_WEIGHT, ROW = 256 + 4 + 4 + 128 + 4, 256, 64 * 4


def test_input_bytes_tokens_at_one_position_count_one_cos_sin_row():
    wl, inp = _index_inputs([5] * 8)
    b = bench.input_bytes(wl, inp)
    assert b["cos_sin"] == ROW and b["norm_weight"] == INDEX_WEIGHT
    assert b == {"x": 8 * 256, "norm_weight": 256, "cos_sin": 256, "positions": 32, "slots": 32,
                 "cache_data": 8 * 128, "cache_scales": 8 * 4, "total": 8 * INDEX_TOKEN + INDEX_WEIGHT + ROW}


@pytest.mark.parametrize("positions,rows", [
    (list(range(8)), 8),                       # distinct: one row each
    ([3, 3, 7, 7, 7, 1, 1, 1], 3),             # repeats count once
    ([0, 8191, 0, 8191, 2, 2, 2, 2], 3),       # the table's first and last rows
    ([-1, 8192, 9000, -5, 4, 4, 6, 6], 2),     # out of [0, 8192): identity rotation, no row read
    ([-1] * 8, 0),
])
def test_input_bytes_count_distinct_in_range_positions(positions, rows):
    wl, inp = _index_inputs(positions)
    assert bench.cos_sin_rows(inp.positions, bench.MAX_POSITION) == rows
    b = bench.input_bytes(wl, inp)
    assert b["cos_sin"] == rows * ROW and b["total"] == 8 * INDEX_TOKEN + INDEX_WEIGHT + rows * ROW


def test_input_bytes_invalid_slots_write_and_read_nothing_but_the_slot():
    """Tokens 2 and 5 have invalid slots (-1, past the cache): only their slots are read; the cos/sin
    rows are those of the written tokens (position 9 appears only on an invalid one)."""
    wl, inp = _index_inputs([1, 1, 9, 2, 2, 2, 3, 3], slots=None)
    capacity = inp.cache.shape[0] * inp.cache.shape[1]
    slots = inp.slots.clone()
    slots[2], slots[5] = -1, capacity
    inp.slots = slots
    b = bench.input_bytes(wl, inp)
    assert b["x"] == 6 * 256 and b["positions"] == 6 * 4 and b["slots"] == 8 * 4
    assert b["cache_data"] == 6 * 128 and b["cache_scales"] == 6 * 4 and b["cos_sin"] == 3 * ROW


def test_input_bytes_weight_bias_and_table_dtypes_once_per_call():
    wl = bench.WORKLOADS["dsv32_index_k"]         # LayerNorm: weight + bias, 128 bf16 each
    for n in (1, 300):
        b = bench.input_bytes(wl, bench.build_inputs(wl, n, "cpu"))
        assert b["norm_weight"] == 2 * 128 * 2
    wl, inp = _index_inputs([0, 1, 2, 3, 0, 1, 2, 3])
    inp.cos_sin = inp.cos_sin.to(torch.bfloat16)  # a bf16 table: 128 bytes a row
    inp.positions = inp.positions.long()           # int64 positions: 8 bytes each
    b = bench.input_bytes(wl, inp)
    assert b["cos_sin"] == 4 * 64 * 2 and b["positions"] == 8 * 8 and b["slots"] == 8 * 4


def test_input_bytes_q_workloads_count_each_head_and_each_row_once():
    wl = bench.WORKLOADS["q_pre"]                 # 64 heads of 512, bf16 out, no slots
    inp = bench.build_inputs(wl, 3, "cpu")
    inp.positions = torch.tensor([7, 7, 100], dtype=torch.int32)
    b = bench.input_bytes(wl, inp)
    assert b == {"x": 3 * 64 * 1024, "norm_weight": 1024, "cos_sin": 2 * ROW, "positions": 12,
                 "out": 3 * 64 * 1024, "total": 2 * 3 * 64 * 1024 + 1024 + 2 * ROW + 12}


def test_moved_bytes_model_and_mean_over_input_sets():
    wl = bench.WORKLOADS["main_fp8"]
    # without positions: every token at its own position, at most the table's rows
    assert bench.moved_bytes(wl, 100)["cos_sin"] == 100 * ROW
    assert bench.moved_bytes(wl, 65536)["cos_sin"] == bench.MAX_POSITION * ROW
    assert bench.moved_bytes(wl, 65536, cos_sin_rows=4096)["total"] == 65536 * 1560 + 1024 + 4096 * ROW
    a, b = bench.moved_bytes(wl, 10, cos_sin_rows=3), bench.moved_bytes(wl, 10, cos_sin_rows=6)
    m = bench.mean_bytes([a, b])
    assert m["cos_sin"] == round(4.5 * ROW) and m["total"] == sum(v for k, v in m.items() if k != "total")


def test_index_fp8_fp32_prefill_bytes_no_longer_charge_a_row_per_token():
    """The 128-d INDEX_FP8_FP32 write of a prefill: the cos/sin rows are those of the longest sequence
    (at most 4096 here), not one per token (which once put it above 100% of copy bandwidth)."""
    wl = bench.WORKLOADS["index_fp8_fp32"]
    inp = bench.build_inputs(wl, 20000, "cpu")
    b = bench.input_bytes(wl, inp)
    assert b["cos_sin"] == (int(inp.positions.max()) + 1) * ROW <= bench.PREFILL_SEQ_LEN[1] * ROW
    assert b["total"] == 20000 * INDEX_TOKEN + INDEX_WEIGHT + b["cos_sin"]


# ----------------------------------------------------------------------------- input regimes
def test_input_regime_by_n_or_option():
    assert [bench.input_regime(n) for n in (1, 256, 257, 262144)] == ["decode", "decode", "prefill", "prefill"]
    assert bench.input_regime(1, "prefill") == "prefill" and bench.input_regime(4096, "decode") == "decode"
    with pytest.raises(ValueError, match="regime"):
        bench.input_regime(1, "chunked")


@pytest.mark.parametrize("n", [1, 7, 256])
def test_decode_layout_one_token_per_sequence_in_distinct_blocks(n):
    g = torch.Generator().manual_seed(n)
    pos, slots, blocks = bench.token_layout(n, "decode", "paged", g)
    assert pos.dtype == slots.dtype == torch.int32 and blocks == n
    assert int(pos.min()) >= 0 and int(pos.max()) < bench.MAX_POSITION
    assert (slots // bench.BLOCK_SIZE).unique().numel() == n                # one block per sequence
    assert torch.equal(slots % bench.BLOCK_SIZE, pos % bench.BLOCK_SIZE)    # at the position's offset
    if n == 256:
        assert pos.unique().numel() > 200                                   # spread context lengths
    pos_r, rnd, blocks_r = bench.token_layout(n, "decode", "random", torch.Generator().manual_seed(n))
    assert torch.equal(pos_r, pos) and blocks_r == n and rnd.unique().numel() == n
    assert int(rnd.max()) < n * bench.BLOCK_SIZE


def _sequences(pos):
    starts = (pos == 0).nonzero().flatten().tolist() + [pos.numel()]
    return [(a, b) for a, b in zip(starts, starts[1:])]


@pytest.mark.parametrize("n", [257, 4096, 20000])
def test_prefill_layout_whole_sequences_in_their_own_consecutive_blocks(n):
    pos, slots, blocks = bench.token_layout(n, "prefill", "paged", torch.Generator().manual_seed(n))
    seqs = _sequences(pos)
    lo, hi = bench.PREFILL_SEQ_LEN
    for i, (a, b) in enumerate(seqs):
        assert torch.equal(pos[a:b], torch.arange(b - a, dtype=torch.int32))    # positions 0..len-1
        assert b - a <= hi and (b - a >= lo or i == len(seqs) - 1 or n < lo)
        first = int(slots[a]) // bench.BLOCK_SIZE
        assert int(slots[a]) % bench.BLOCK_SIZE == 0
        assert torch.equal(slots[a:b], first * bench.BLOCK_SIZE + torch.arange(b - a, dtype=torch.int32))
    assert blocks == sum(-(-(b - a) // bench.BLOCK_SIZE) for a, b in seqs)
    assert slots.unique().numel() == n and int(slots.max()) < blocks * bench.BLOCK_SIZE
    # random slots: the same sequences, every record scattered over the same cache
    pos_r, rnd, blocks_r = bench.token_layout(n, "prefill", "random", torch.Generator().manual_seed(n))
    assert torch.equal(pos_r, pos) and blocks_r == blocks
    assert rnd.unique().numel() == n and int(rnd.max()) < blocks * bench.BLOCK_SIZE
    with pytest.raises(ValueError, match="slots"):
        bench.token_layout(n, "prefill", "sorted", torch.Generator())


def test_build_inputs_use_the_regime_and_record_it():
    wl = bench.WORKLOADS["dsv4_main_fp8"]
    dec = bench.build_inputs(wl, 64, "cpu")
    assert dec.regime == "decode" and dec.slot_pattern == "paged" and dec.cache.shape[0] == 64
    pre = bench.build_inputs(wl, 5000, "cpu", slots="random")
    assert pre.regime == "prefill" and pre.slot_pattern == "random" and int((pre.positions == 0).sum()) >= 2
    # every workload of a size gets the same layout
    other = bench.build_inputs(bench.WORKLOADS["index_mxfp4"], 5000, "cpu", slots="random")
    assert torch.equal(other.positions, pre.positions) and torch.equal(other.slots, pre.slots)
    uni = bench.build_inputs(wl, 5000, "cpu", regime="uniform")
    assert uni.regime == "uniform" and uni.cache.shape[0] == -(-5000 // bench.BLOCK_SIZE)


# ----------------------------------------------------------------------------- peers
def _snapshot(wl, inp):
    if wl.kind == "write":
        return [torch.as_strided(inp.cache, (inp.cache.untyped_storage().nbytes(),), (1,), 0).clone()]
    return [t.view(torch.uint8).clone() for t in bench.result_tensors(wl, inp)]


def _poison(wl, inp):
    if wl.kind == "write":
        torch.as_strided(inp.cache, (inp.cache.untyped_storage().nbytes(),), (1,), 0).fill_(0xAB)
    for t in bench.result_tensors(wl, inp):
        t.view(torch.uint8).fill_(0xAB)


def test_group_workload_inputs_and_bytes():
    """A group's members share one positions tensor and cos/sin table, counted once in its bytes; the
    grouped call (the interpreter's grouped kernel) writes what its calls write one by one."""
    wl = bench.WORKLOADS["group_dsv4_layer"]
    inp = bench.build_inputs(wl, 3, "cpu", seed=2)
    assert [m.x.shape for m in inp.members] == [(3, 64, 512), (3, 512), (3, 128), (3, 64, 128)]
    assert all(m.positions is inp.positions and m.cos_sin is inp.cos_sin for m in inp.members)
    detail = bench.input_bytes(wl, inp)
    parts = [bench.input_bytes(bench.WORKLOADS[m], mi) for m, mi in zip(wl.members, inp.members)]
    shared = parts[0]["positions"] + parts[0]["cos_sin"]
    assert detail["total"] == sum(p["total"] for p in parts) - (len(parts) - 1) * shared
    # the byte model per token (the JSON's workloads section) follows the same rule
    assert inp.positions.unique().numel() == 3                  # decode: 3 distinct positions, valid slots
    assert bench.moved_bytes(wl, 3) == detail
    report = bench.build_report(bench.parse_config(["--workloads", wl.name]), {}, {}, [], [], 0.0)
    assert report["workloads"][wl.name]["bytes_per_token"] == bench.moved_bytes(wl, 1)
    with use_backend("triton"):
        _poison(wl, inp)
        bench.make_peer("calls", wl, inp)()
        want = _snapshot(wl, inp)
        _poison(wl, inp)
        bench.make_peer("fused", wl, inp)()
        got = _snapshot(wl, inp)
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and len(got) == 5


@pytest.mark.parametrize("name", list(bench.WORKLOADS))
def test_peers_produce_the_reference_output(name):
    """Every peer (the stage chain and the compile chain run eagerly, all through the reference
    backend) writes exactly what the reference writes: the peers do the same work."""
    wl = bench.WORKLOADS[name]
    inp = bench.build_inputs(wl, 5, "cpu", seed=1)
    outs = {}
    peers = [p for p in bench.PEERS if not bench.peer_not_applicable(p, wl)]
    assert ("calls" in peers) == (wl.kind == "group") and ("compile" in peers) == (wl.kind != "group")
    assert ("two_launch" in peers) == (wl.kind == "gqa")
    with use_backend("reference"):
        for peer in peers:
            _poison(wl, inp)
            bench.make_peer(peer, wl, inp)()
            outs[peer] = _snapshot(wl, inp)
    for peer in peers:
        assert all(torch.equal(a, b) for a, b in zip(outs[peer], outs["reference"])), peer
    if wl.kind == "write":   # the records were written (each slot is valid)
        assert int((outs["reference"][0] != 0xAB).sum()) > 4 * wl.fmt.quant_bytes


def _small_gqa(name, num_heads=4, num_kv_heads=2):
    """A GQA workload with the model's head width, norm and RoPE but few heads (the interpreter's size)."""
    import dataclasses
    wl = bench.WORKLOADS[name]
    cfg = dataclasses.replace(wl.gqa, num_heads=num_heads, num_kv_heads=num_kv_heads)
    return dataclasses.replace(wl, gqa=cfg, num_heads=num_heads + 2 * num_kv_heads)


@pytest.mark.skipif(not kvfuse.backend.interpreter_enabled(), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("name", ["llama3_8b_fp8", "qwen3_8b_fp8", "qwen3_8b_bf16", "gemma3_12b_fp8", "qwen3_vl_8b_fp8",
                                  "qwen25_vl_7b_bf16", "gemma4_31b_sliding_fp8"])
def test_gqa_stages_and_two_launch_write_the_fused_bytes_on_the_interpreter(name):
    """The GQA stage chain (fused operator on q, on k, the per-tensor cast, store_kv_cache) and the two-launch
    peer (kvfuse's GQA kernel for q/k, then for the K/V scatter) run through Triton's interpreter and write
    exactly the fused call's q_out and cache bytes (every byte of the poisoned outputs, the untouched cache
    records included), without changing their inputs: no QK-norm (Llama), QK-norm (Qwen3), fp32 1 + w
    weights and 256-wide heads (Gemma 3), mRoPE text positions (Qwen-VL), the V-norm (Gemma 4), fp8 and bf16
    caches."""
    wl = _small_gqa(name)
    inp = bench.build_inputs(wl, 5, "cpu", seed=4)
    before = [t.clone() for t in (inp.x, inp.positions, inp.slots)]
    outs = {}
    with use_backend("triton"):
        for peer in ("fused", "stages", "two_launch"):
            _poison(wl, inp)
            bench.make_peer(peer, wl, inp)()
            outs[peer] = _snapshot(wl, inp)
    for peer in ("stages", "two_launch"):
        assert all(torch.equal(a, b) for a, b in zip(outs[peer], outs["fused"])), peer
    assert all(torch.equal(a, b) for a, b in zip(before, (inp.x, inp.positions, inp.slots)))
    q_out, k_cache, v_cache = outs["fused"]
    assert not torch.equal(q_out, torch.full_like(q_out, 0xAB))
    record = wl.head_dim * (1 if wl.cache_fp8 else 2)
    for cache in (k_cache, v_cache):                     # 5 tokens x 2 KV heads written, the rest untouched
        assert int((cache != 0xAB).sum()) > 5 * 2 * record * 0.9
        assert int((cache == 0xAB).sum()) >= cache.numel() - 5 * 2 * record


def test_gqa_stage_chain_stores_through_store_kv_cache(monkeypatch):
    """The GQA stage chain scatters K and V with kvfuse.store_kv_cache (no boolean-mask indexing, which
    synchronizes the host): the reference's store_paged is never called."""
    def no_store_paged(*a, **k):
        raise AssertionError("store_paged (boolean-mask indexing) in the stage chain")

    calls = []
    real_store = kvfuse.api.store_kv_cache

    def counting_store(*a, **k):
        calls.append(a[4].name)
        return real_store(*a, **k)

    wl = bench.WORKLOADS["qwen3_8b_fp8"]
    inp = bench.build_inputs(wl, 3, "cpu", seed=2)
    monkeypatch.setattr(kvfuse.reference, "store_paged", no_store_paged)
    monkeypatch.setattr(kvfuse.api, "store_kv_cache", counting_store)
    chain = bench.make_peer("stages", wl, inp)
    with use_backend("reference"):
        chain()
    assert calls == ["GQA_NHD_128B", "GQA_NHD_128B"]          # K and V, 128 e4m3 bytes per (token, head)


def test_two_launch_is_a_gqa_peer_skipped_elsewhere():
    cfg = bench.parse_config(["--n", "1", "--workloads", "main_fp8,llama3_8b_fp8", "--peers", "two_launch,fused",
                              "--no-progress"])
    assert cfg.peers == ["two_launch", "fused"]
    records = bench.run_suite(cfg, "cpu", FakeTimer(), kernel_backend="reference", compiler=lambda f: f,
                              log=lambda *a: None)
    by = {(r.workload, r.peer): r for r in records}
    skipped = by[("main_fp8", "two_launch")]
    assert skipped.status == "skipped" and "GQA workloads only" in skipped.note
    assert by[("main_fp8", "fused")].status == "ok"
    r = by[("llama3_8b_fp8", "two_launch")]
    assert r.status == "ok" and r.fused_speedup == pytest.approx(2.0)
    with pytest.raises(ValueError, match="GQA workloads only"):
        bench.make_peer("two_launch", bench.WORKLOADS["main_fp8"], bench.build_inputs(bench.WORKLOADS["main_fp8"], 1,
                                                                                     "cpu"))


def test_inputs_shapes_and_slots():
    wl = bench.WORKLOADS["index_q"]
    inp = bench.build_inputs(wl, 3, "cpu")
    assert inp.x.shape == (3, 64, 128) and inp.x.dtype == torch.bfloat16
    assert inp.q.shape == (3, 64, 64) and inp.sf.shape == (3, 64, 4)
    w = bench.WORKLOADS["main_fp8"]
    inp = bench.build_inputs(w, 100, "cpu")
    cap = inp.cache.shape[0] * inp.cache.shape[1]
    assert cap >= 100 and inp.slots.unique().numel() == 100 and int(inp.slots.max()) < cap
    assert int(inp.positions.min()) >= 0 and int(inp.positions.max()) < bench.MAX_POSITION
    sets = bench.build_input_sets(w, 4, "cpu", cold_l2=True)
    assert 1 < len(sets) <= 16


def test_slot_patterns():
    """paged: whole blocks in a random order; contiguous: slot i; random: a permutation of all slots;
    every pattern gives distinct slots inside the cache."""
    g = torch.Generator().manual_seed(0)
    paged = bench.slot_mapping(130, 3, "paged", g, "cpu")
    blocks = paged // bench.BLOCK_SIZE
    assert sorted(blocks[::bench.BLOCK_SIZE].tolist()) == [0, 1, 2]
    assert torch.equal(paged % bench.BLOCK_SIZE, torch.arange(130) % bench.BLOCK_SIZE)
    assert torch.equal(bench.slot_mapping(130, 3, "contiguous", g, "cpu"), torch.arange(130, dtype=torch.int32))
    rnd = bench.slot_mapping(130, 3, "random", g, "cpu")
    for s in (paged, rnd):
        assert s.dtype == torch.int32 and s.unique().numel() == 130 and int(s.max()) < 3 * bench.BLOCK_SIZE
    inp = bench.build_inputs(bench.WORKLOADS["main_fp8"], 100, "cpu", slots="paged", regime="uniform")
    assert torch.equal(inp.slots % bench.BLOCK_SIZE, torch.arange(100, dtype=torch.int32) % bench.BLOCK_SIZE)
    with pytest.raises(ValueError, match="slots"):
        bench.slot_mapping(4, 1, "sorted", g, "cpu")
    assert bench.parse_config(["--slots", "paged"]).slots == "paged"


# ----------------------------------------------------------------------------- orchestration
def test_run_suite_with_fake_timer():
    cfg = bench.parse_config(["--n", "1,4", "--peer-max-n", "1", "--no-progress"])
    timer = FakeTimer()
    records = bench.run_suite(cfg, "cpu", timer, copy_gbps=4000.0, floor_us=1.0, kernel_backend="reference",
                              compiler=lambda f: f, log=lambda *a: None)
    assert len(records) == len(cfg.workloads) * 2 * len(bench.PEERS)
    by = {(r.workload, r.n, r.peer): r for r in records}
    # n*heads > --peer-max-n skips the reference and compile peers
    assert by[("main_fp8", 4, "reference")].status == "skipped"
    assert "peer-max-n" in by[("main_fp8", 4, "compile")].note
    assert by[("q_pre", 1, "reference")].status == "skipped"          # 64 rows
    r = by[("main_fp8", 1, "reference")]
    assert r.status == "ok" and r.gpu_method == "events"
    f = by[("main_fp8", 4, "fused")]
    assert f.status == "ok" and f.gpu_us == 10.0 and f.eager_us == 20.0 and f.fused_speedup == 1.0
    assert f.bytes == bench.moved_bytes(bench.WORKLOADS["main_fp8"], 4)["total"]
    assert f.gbps == pytest.approx(f.bytes / 10e-6 / 1e9)
    assert f.pct_copy == pytest.approx(100 * f.gbps / 4000.0) and f.x_floor == pytest.approx(10.0)
    assert by[("main_fp8", 4, "stages")].fused_speedup == pytest.approx(3.0)
    assert len(timer.labels) == sum(r.status == "ok" for r in records)
    # bytes from the inputs measured (the layout depends on (seed, n) only: rebuilt identically here)
    wl = bench.WORKLOADS["main_fp8"]
    want = bench.input_bytes(wl, bench.build_inputs(wl, 4, "cpu", cfg.seed, cfg.slots, cfg.regime))
    assert f.bytes_detail == want and f.bytes == want["total"]
    assert (f.regime, f.slots) == ("decode", "paged") and by[("q_pre", 4, "fused")].slots == ""


def test_cli_regime_and_slots_reach_the_records_and_the_json(tmp_path):
    cfg = bench.parse_config(["--n", "300", "--workloads", "index_mxfp4", "--peers", "fused", "--slots", "random",
                              "--regime", "auto", "--out", str(tmp_path), "--no-progress", "--no-plot"])
    assert (cfg.slots, cfg.regime) == ("random", "auto")
    assert bench.parse_config([]).slots == "paged" and bench.parse_config([]).regime == "auto"
    assert bench.parse_config(["--regime", "uniform"]).regime == "uniform"
    assert bench.run_on_device(cfg, device="cpu", timer=FakeTimer(), measure=fake_device,
                               kernel_backend="reference", compiler=lambda f: f) == 0
    data = json.loads((tmp_path / "kvfuse_bench.json").read_text())
    assert data["inputs"]["slots"] == "random" and data["inputs"]["regime"] == "auto"
    assert data["meta"]["config"]["regime"] == "auto" and "distinct" in data["accounting"]
    (r,) = data["results"]
    assert (r["regime"], r["slots"]) == ("prefill", "random") and r["bytes"] == r["bytes_detail"]["total"]
    assert r["bytes_detail"]["cos_sin"] == 300 * 64 * 4                  # one sequence of 300 tokens


def test_run_suite_records_errors_and_goes_on():
    class Failing(FakeTimer):
        def measure(self, fns, label=None):
            if label[2] == "compile":
                raise RuntimeError("inductor exploded")
            return super().measure(fns, label)

    cfg = bench.parse_config(["--n", "1,4", "--workloads", "index_mxfp4,main_fp8"])
    records = bench.run_suite(cfg, "cpu", Failing(), kernel_backend="reference", compiler=lambda f: f,
                              log=lambda *a: None)
    by = {(r.workload, r.n, r.peer): r for r in records}
    assert by[("index_mxfp4", 1, "compile")].status == "error"
    assert "inductor exploded" in by[("index_mxfp4", 1, "compile")].note
    assert "failed earlier" in by[("index_mxfp4", 4, "compile")].note   # not retried for this workload
    assert by[("main_fp8", 1, "compile")].status == "error"             # other workloads still try
    assert all(by[(w, n, "fused")].status == "ok" for w in ("index_mxfp4", "main_fp8") for n in (1, 4))


def test_size_cap_and_time_budget_skip():
    cfg = bench.parse_config(["--n", "2", "--workloads", "q_pre", "--max-x-elems", "1000"])
    records = bench.run_suite(cfg, "cpu", FakeTimer(), kernel_backend="reference", compiler=lambda f: f)
    assert all(r.status == "skipped" and "max-x-elems" in r.note for r in records)
    cfg = bench.parse_config(["--n", "2", "--workloads", "main_fp8", "--budget-s", "-1"])
    records = bench.run_suite(cfg, "cpu", FakeTimer(), kernel_backend="reference", compiler=lambda f: f)
    assert all(r.status == "skipped" and "budget" in r.note for r in records)


# ----------------------------------------------------------------------------- report
def _fake_records():
    recs = []
    for wl in ("main_fp8", "index_mxfp4"):
        for n in (1, 256, 4096, 65536, 262144):
            fused = 1.5 if n <= 256 else n * 1e-3
            detail = bench.moved_bytes(bench.WORKLOADS[wl], n, cos_sin_rows=1)   # every token at one position
            for peer, t in (("stages", 3.0 * fused), ("fused", fused)):
                recs.append(Record(workload=wl, n=n, peer=peer, rows=n, gpu_us=t, gpu_method="graph",
                                   eager_us=t + 20, bytes=detail["total"], bytes_detail=detail))
    recs.append(Record(workload="main_fp8", n=262144, peer="reference", status="skipped", note="too big"))
    for r in recs:
        bench.finalize(r, 4000.0, 1.0)
    bench.add_speedups(recs)
    return recs


def test_format_table():
    text = bench.format_table(_fake_records())
    lines = text.splitlines()
    for col in ("workload", "GPU us", "eager us", "GB/s", "%copy", "x floor", "vs fused"):
        assert col in lines[0]
    assert any(line.startswith("main_fp8") and " stages " in line and "3.00" in line for line in lines)
    assert any("SKIPPED: too big" in line for line in lines)
    assert "" in lines                                    # blank line between workloads


FLOOR = "fused GPU time / launch floor at n in {1, 256} (worst), with programmatic dependent launch"


def _pct_record(wl, pct, slots=""):
    """A fused record at n=262144 with this % of copy (check_targets reads the derived columns)."""
    return Record(workload=wl, n=262144, peer="fused", gpu_us=100.0, gpu_method="graph", pct_copy=pct, slots=slots)


def test_targets():
    recs = _fake_records()
    targets = {t["target"]: t for t in bench.check_targets(recs)}
    # 262144 tokens in 262.144 us: 1560 B/token (+ one cos/sin row and the weight) -> ~1560 GB/s -> 39% of 4000;
    # the records say no slot pattern (old runs): paged
    main = targets["main_fp8 fused % copy at n=262144 (paged slots)"]
    total = 262144 * 1560 + 256 + 1024
    assert main["value"] == pytest.approx(100 * total / 262.144e-6 / 1e9 / 4000)
    assert (main["status"], main["op"], main["threshold"]) == ("MISS", ">=", 85.0)
    index = targets["index_mxfp4 fused % copy at n=262144 (paged slots)"]
    assert (index["status"], index["threshold"]) == ("MISS", 85.0)
    # decode: 1.5 us at n = 1 and 256 against a 1.0 us floor -> 1.5x > 1.3x
    floor = targets["main_fp8 " + FLOOR]
    assert (floor["status"], floor["value"], floor["op"], floor["threshold"], floor["detail"]) == \
        ("MISS", pytest.approx(1.5), "<=", 1.3, "at n=256")
    assert targets["index_mxfp4 " + FLOOR]["status"] == "MISS"
    assert targets["main_fp8 fused vs stage chain, n<=4096 (least)"]["status"] == "PASS"
    assert targets["index_mxfp4 fused vs stage chain at n=65536"]["value"] == pytest.approx(3.0)
    # the old targets are gone
    assert not any("n=65536" in name and "% copy" in name or "n<=256" in name for name in targets)
    assert len(targets) == 8
    text = bench.format_targets(bench.check_targets(recs))
    assert "PASS" in text and "MISS" in text and "(target <= 1.3)" in text and "(target >= 85)" in text
    only = [Record(workload="main_fp8", n=1, peer="fused", status="error", note="boom")]
    assert all(t["status"] == "N/A" for t in bench.check_targets(only))


def test_targets_pct_copy_by_format_and_slot_pattern():
    """% of copy at n=262144: MAIN_FP8 >= 85 on paged / contiguous slots, >= 80 on random; MAIN_FP4 >= 80;
    every other format >= 85. The name says the slot pattern."""
    def target(wl, pct, slots=""):
        (t,) = [t for t in bench.check_targets([_pct_record(wl, pct, slots)]) if "% copy" in t["target"]]
        return t["target"], t["threshold"], t["status"]
    assert bench.WORKLOADS["main_fp8"].fmt.name == "MAIN_FP8"
    assert target("main_fp8", 82.0, "random") == ("main_fp8 fused % copy at n=262144 (random slots)", 80.0, "PASS")
    assert target("main_fp8", 79.9, "random") == ("main_fp8 fused % copy at n=262144 (random slots)", 80.0, "MISS")
    assert target("main_fp8", 82.0, "paged") == ("main_fp8 fused % copy at n=262144 (paged slots)", 85.0, "MISS")
    assert target("main_fp8", 85.0, "paged") == ("main_fp8 fused % copy at n=262144 (paged slots)", 85.0, "PASS")
    assert target("main_fp8", 84.9, "contiguous") == \
        ("main_fp8 fused % copy at n=262144 (contiguous slots)", 85.0, "MISS")
    assert target("main_fp8", 82.0) == ("main_fp8 fused % copy at n=262144 (paged slots)", 85.0, "MISS")
    # the same format under another workload: the format decides
    assert target("main_fp8_gptj", 81.0, "random") == \
        ("main_fp8_gptj fused % copy at n=262144 (random slots)", 80.0, "PASS")
    fp4 = [w for w, d in bench.WORKLOADS.items() if d.kind == "write" and d.fmt.name == "MAIN_FP4"]
    assert "main_fp4" in fp4
    for wl in fp4:
        for slots in ("paged", "random", "contiguous"):
            assert target(wl, 80.0, slots) == (f"{wl} fused % copy at n=262144 ({slots} slots)", 80.0, "PASS")
            assert target(wl, 79.9, slots)[1:] == (80.0, "MISS")
    others = [w for w, d in bench.WORKLOADS.items() if d.kind == "write" and d.fmt.name not in ("MAIN_FP8", "MAIN_FP4")]
    assert {"index_mxfp4", "flashmla_model1", "index_fp8_fp32", "main_fp8_pagewise_cast"} <= set(others)
    for wl in others:
        for slots in ("paged", "random"):
            assert target(wl, 84.9, slots) == (f"{wl} fused % copy at n=262144 ({slots} slots)", 85.0, "MISS")
            assert target(wl, 85.0, slots)[1:] == (85.0, "PASS")
    # not measured: N/A, still named with the records' slot pattern
    other_n = Record(workload="main_fp8", n=4096, peer="fused", gpu_us=5.0, pct_copy=90.0, slots="random")
    (t,) = [t for t in bench.check_targets([other_n]) if "% copy" in t["target"]]
    assert (t["target"], t["threshold"], t["status"], t["value"]) == \
        ("main_fp8 fused % copy at n=262144 (random slots)", 80.0, "N/A", None)
    # no % copy target for what is not a cache write
    for wl in ("q_pre", "index_q", "llama3_8b_fp8", "group_dsv4_q_kv"):
        assert not [t for t in bench.check_targets([_pct_record(wl, 99.0)]) if "% copy" in t["target"]]


def test_targets_decode_at_the_launch_floor_with_pdl():
    """The worst fused x_floor at n = 1 and 256 only, <= 1.3, for the writes, q_pre and index_q; N/A
    ("needs a --pdl run") when the run had no PDL; none for GQA or grouped workloads."""
    def recs(us):
        out = []
        for wl in ("main_fp8", "q_pre", "index_q", "llama3_8b_fp8", "group_dsv4_q_kv"):
            for n, t in ((1, us[0]), (64, 9.0), (256, us[1]), (4096, 50.0)):
                out.append(bench.finalize(Record(workload=wl, n=n, peer="fused", bytes=1000, gpu_us=t,
                                                 gpu_method="graph"), 4000.0, 1.0))
        return out

    def floors(records, **kw):
        return {t["target"]: t for t in bench.check_targets(records, **kw) if "launch floor" in t["target"]}
    # 1.2 / 1.3 us against a 1.0 us floor: the worst is 1.3 at n = 256 (n = 64's 9x is not one of the sizes)
    got = floors(recs((1.2, 1.3)))
    assert set(got) == {f"{wl} {FLOOR}" for wl in ("main_fp8", "q_pre", "index_q")}
    for t in got.values():
        assert (t["status"], t["value"], t["op"], t["threshold"], t["detail"]) == \
            ("PASS", pytest.approx(1.3), "<=", 1.3, "at n=256")
    got = floors(recs((1.31, 1.1)))
    for t in got.values():
        assert (t["status"], t["value"], t["detail"]) == ("MISS", pytest.approx(1.31), "at n=1")
    # without PDL: N/A whatever was measured
    got = floors(recs((1.0, 1.0)), pdl=False)
    assert len(got) == 3
    for t in got.values():
        assert (t["status"], t["value"], t["threshold"], t["detail"]) == ("N/A", None, 1.3, "needs a --pdl run")
    text = bench.format_targets(bench.check_targets(recs((1.0, 1.0)), pdl=False))
    assert f"N/A   main_fp8 {FLOOR}: not measured (needs a --pdl run) (target <= 1.3)" in text
    # measured at neither size: N/A without a detail
    only64 = [r for r in recs((1.0, 1.0)) if r.n == 64]
    got = floors(only64)
    assert len(got) == 3 and all((t["status"], t["detail"]) == ("N/A", "") for t in got.values())
    # the stage-chain targets stay for every workload
    names = [t["target"] for t in bench.check_targets(recs((1.0, 1.0)))]
    assert "llama3_8b_fp8 fused vs stage chain, n<=4096 (least)" in names
    assert "group_dsv4_q_kv fused vs stage chain at n=65536" in names


def test_json_report(tmp_path):
    cfg = bench.parse_config(["--quick"])
    recs = _fake_records()
    recs[0].gbps = float("nan")
    report = bench.build_report(cfg, {"device": "fake"}, {"copy_GBps": 4000.0, "floor_us": 1.0}, recs,
                                bench.check_targets(recs), 1.5)
    path = tmp_path / "r.json"
    bench.write_json(str(path), report)
    back = json.loads(path.read_text())
    assert back["device"]["copy_GBps"] == 4000.0 and back["meta"]["device"] == "fake"
    assert len(back["results"]) == len(recs) and back["results"][0]["gbps"] is None
    assert back["results"][1]["bytes_detail"]["total"] == recs[1].bytes
    assert back["meta"]["config"]["quick"] is True and back["targets"]


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "p.png"
    bench.plot_results(_fake_records(), str(path), 4000.0, 1.0)
    assert path.stat().st_size > 1000


def test_whole_run_with_fakes(tmp_path, capsys):
    """run_on_device end to end on the CPU with a fake timer and fake device ceilings: table, targets,
    JSON, text and PNG under --out."""
    cfg = bench.parse_config(["--n", "1,4", "--workloads", "main_fp8,index_q", "--out", str(tmp_path),
                              "--no-progress"])
    rc = bench.run_on_device(cfg, device="cpu", timer=FakeTimer(), measure=fake_device,
                             kernel_backend="reference", compiler=lambda f: f)
    assert rc == 0
    out = capsys.readouterr().out
    assert "targets (reporting, not asserting):" in out and "main_fp8" in out
    data = json.loads((tmp_path / "kvfuse_bench.json").read_text())
    assert {r["peer"] for r in data["results"]} == set(bench.PEERS)
    assert (tmp_path / "kvfuse_bench.txt").exists()


# ----------------------------------------------------------------------------- the CUDA timer's logic
class _FakeCuda:
    """Just enough of torch.cuda, on the host clock, to run CudaTimer's code paths on the CPU."""

    def __init__(self, fail_capture=False):
        self.mode, self.fail_capture, self.captures, self.replays = 0, fail_capture, 0, 0
        timer_self = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self):
                import time
                self.t = time.perf_counter()

            def elapsed_time(self, end):
                return (end.t - self.t) * 1e3

        class CUDAGraph:
            def replay(self):
                timer_self.replays += 1

        class graph:
            def __init__(self, g, pool=None, stream=None, capture_error_mode="global"):
                assert capture_error_mode in ("global", "thread_local", "relaxed")

            def __enter__(self):
                timer_self.captures += 1
                if timer_self.fail_capture:
                    raise RuntimeError("capture failed")

            def __exit__(self, *exc):
                return False

        self.Event, self.CUDAGraph, self.graph = Event, CUDAGraph, graph

    def synchronize(self):
        pass

    def current_stream(self):
        return "stream0"

    def set_stream(self, stream):
        self.stream = stream

    def get_sync_debug_mode(self):
        return self.mode

    def set_sync_debug_mode(self, mode):
        self.mode = {"default": 0, "warn": 1, "error": 2}.get(mode, mode)


def _patch_cuda(monkeypatch, fake):
    for name in ("Event", "CUDAGraph", "graph", "synchronize", "get_sync_debug_mode", "set_sync_debug_mode",
                 "current_stream", "set_stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))


def test_cuda_timer_graph_path(monkeypatch):
    fake = _FakeCuda()
    _patch_cuda(monkeypatch, fake)
    calls = []
    t = bench.CudaTimer(graph_calls=5, target_s=0.001, eager_target_s=0.001, max_reps=4)
    res = t.measure([lambda: calls.append(1), lambda: calls.append(2)])
    assert res.gpu_method == "graph" and res.gpu_us >= 0 and res.eager_us > 0 and res.note == ""
    assert fake.captures == 1 and fake.replays >= 3 + 3 and 1 in calls and 2 in calls


def test_cuda_timer_host_sync_falls_back_to_events(monkeypatch):
    fake = _FakeCuda()
    _patch_cuda(monkeypatch, fake)

    def syncing():
        if fake.mode == 2:
            raise RuntimeError("called a synchronizing CUDA operation")

    res = bench.CudaTimer(target_s=0.001, eager_target_s=0.001).measure([syncing])
    assert res.gpu_method == "events" and "synchronizing" in res.note and fake.captures == 0
    assert fake.mode == 0                       # the debug mode is restored


def test_cuda_timer_failed_capture_falls_back_to_events(monkeypatch):
    fake = _FakeCuda(fail_capture=True)
    _patch_cuda(monkeypatch, fake)
    res = bench.CudaTimer(target_s=0.001, eager_target_s=0.001).measure([lambda: None])
    assert res.gpu_method == "events" and "capture failed" in res.note and fake.stream == "stream0"


@pytest.mark.parametrize("name", ["main_fp8_cast", "main_fp8_gptj"])
def test_the_record_layouts_hold_the_same_codes_and_scales(name):
    """benchmarks/record_alignment.py times one call into each of bench.RECORD_LAYOUTS: only the layout may
    differ, so every layout must hold the same codes and scales of the same inputs (a prefill into
    consecutive blocks, the case the study is about), and the bench charges each the same bytes."""
    import dataclasses
    got = []
    for label, fmt in bench.RECORD_LAYOUTS:
        wl = dataclasses.replace(bench.WORKLOADS[name], fmt=fmt)
        inp = bench.build_inputs(wl, 300, "cpu")
        with use_backend("reference"):
            bench.fused_call(wl, inp)()
            data, sf = kvfuse.load_paged_kv_cache(inp.cache, inp.slots, fmt, dequantize=False)
        got.append((label, data, sf[..., :16], bench.input_bytes(wl, inp)["total"]))
    first = got[0]
    assert first[1].shape == (300, 1, 512) and first[2].shape == (300, 1, 16)
    for label, data, sf, moved in got[1:]:
        assert torch.equal(data, first[1]), label
        assert torch.equal(sf, first[2]), label
        assert moved == first[3], label
    assert [fmt.bytes_per_token for _, fmt in bench.RECORD_LAYOUTS[:4]] == [532, 532, 528, 544]
    assert [fmt.zero_reserved for _, fmt in bench.RECORD_LAYOUTS[:2]] == [True, False]


def test_dsv3_kv_c_k_pe_workloads_pass_two_views_of_one_projection(monkeypatch):
    """DeepSeek V3's main write from (kv_c, k_pe): the fused call takes two column views of x (no copy) and
    the norm weight covers the latent only (512 dims in the byte model too)."""
    wl = bench.WORKLOADS["dsv3_main_kv_c_k_pe"]
    inp = bench.build_inputs(wl, 7, "cpu", seed=3)
    seen = []
    real = kvfuse.api.fused_norm_rope_hadamard_cast_store_kvcache

    def spy(x, *args):
        seen.append(x)
        return real(x, *args)
    monkeypatch.setattr(kvfuse.api, "fused_norm_rope_hadamard_cast_store_kvcache", spy)
    with use_backend("reference"):
        bench.make_peer("fused", wl, inp)()
    kv_c, k_pe = seen[0]
    assert kv_c.data_ptr() == inp.x.data_ptr() and k_pe.data_ptr() == inp.x[:, 512:].data_ptr()
    assert tuple(inp.weight.shape) == (512,)
    assert bench.moved_bytes(wl, 1)["norm_weight"] == 512 * 2
    assert bench.moved_bytes(bench.WORKLOADS["dsv3_main_kv_c_k_pe_nonorm"], 1)["total"] == \
        bench.moved_bytes(wl, 1)["total"] - 512 * 2
