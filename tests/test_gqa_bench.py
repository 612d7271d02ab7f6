"""kvfuse bench's GQA workloads (kind "gqa", kvfuse/bench.py) without a GPU: the byte model by hand, the
inputs (packed projection, model weights, decode and prefill positions, caches and scales) and the
fused call on the interpreter equal to the reference peer. (tests/test_bench.py runs every workload's
peers against the reference, GQA included.)"""
import pytest
import torch

import kvfuse
from kvfuse import bench, use_backend


def test_gqa_workloads_cover_the_models():
    names = {w.gqa.name for w in bench.WORKLOADS.values() if w.kind == "gqa"}
    assert names == set(kvfuse.models.GQA_MODELS)
    for w in bench.WORKLOADS.values():
        if w.kind == "gqa":
            assert w.num_heads == w.gqa.num_heads + 2 * w.gqa.num_kv_heads and w.fmt is None


def test_moved_bytes_by_hand():
    wl = bench.WORKLOADS["qwen3_8b_fp8"]          # 32 Q heads, 8 KV heads of 128, QK-norm, fp8 caches
    per_token = (32 + 8 + 8) * 128 * 2 + 32 * 128 * 2 + 2 * 8 * 128 + 128 * 4 + 4 + 4
    assert bench.moved_bytes(wl, 1) == {"q": 8192, "k": 2048, "v": 2048, "norm_weights": 512, "cos_sin": 512,
                                        "positions": 4, "slots": 4, "q_out": 8192, "k_cache": 1024,
                                        "v_cache": 1024, "total": per_token + 512}
    # the cos/sin rows of distinct positions count once: at most MAX_POSITION of them
    big = bench.moved_bytes(wl, 65536)
    assert big["cos_sin"] == bench.MAX_POSITION * 128 * 4
    assert big["total"] == 65536 * (per_token - 512) + bench.MAX_POSITION * 512 + 512
    llama = bench.moved_bytes(bench.WORKLOADS["llama3_8b_bf16"], 1)
    assert "norm_weights" not in llama and llama["k_cache"] == 8 * 128 * 2
    gemma = bench.moved_bytes(bench.WORKLOADS["gemma3_12b_bf16"], 1)
    assert gemma["norm_weights"] == 2 * 256 * 4                     # Gemma's 1 + w: fp32 weights


def test_inputs_decode_and_prefill():
    wl = bench.WORKLOADS["gemma3_12b_fp8"]
    dec = bench.build_inputs(wl, 64, "cpu")
    q, k, v = dec.qkv(wl)
    assert q.shape == (64, 16, 256) and k.shape == v.shape == (64, 8, 256) and q.data_ptr() == dec.x.data_ptr()
    assert dec.positions.unique().numel() == 64                        # one token of each of 64 sequences
    assert dec.weight.dtype == torch.float32 and dec.k_weight.dtype == torch.float32    # 1 + w
    assert dec.k_cache.dtype == torch.float8_e4m3fn and dec.k_cache.shape[1:] == (bench.BLOCK_SIZE, 8, 256)
    assert dec.k_scale.numel() == 1 and dec.v_scale.numel() == 1
    assert len(set((dec.slots // bench.BLOCK_SIZE).tolist())) == 64                    # each in its own block
    pre = bench.build_inputs(wl, 300, "cpu")                    # prefill: the layout every workload of n gets
    positions, slots, _ = bench.token_layout(300, "prefill", "paged", torch.Generator().manual_seed(300))
    assert torch.equal(pre.positions, positions) and torch.equal(pre.slots, slots)
    assert torch.equal(pre.positions[1:10] - pre.positions[:9], torch.ones(9, dtype=pre.positions.dtype))
    llama = bench.build_inputs(bench.WORKLOADS["llama3_8b_bf16"], 3, "cpu")
    assert llama.weight is None and llama.k_scale is None and llama.k_cache.dtype == torch.bfloat16


def test_inputs_use_the_models_table():
    """Each GQA workload rotates by its model's own table: base rope_theta, and GPT-OSS's YaRN scaling."""
    for name in ("gpt_oss_20b_fp8", "llama3_8b_bf16"):
        wl = bench.WORKLOADS[name]
        table = bench.build_inputs(wl, 2, "cpu").cos_sin
        assert torch.equal(table, wl.gqa.cos_sin_cache(bench.MAX_POSITION))
    gpt_oss = bench.build_inputs(bench.WORKLOADS["gpt_oss_20b_bf16"], 2, "cpu").cos_sin
    assert gpt_oss[0, 0] > 1.3 and "YaRN" in bench.WORKLOADS["gpt_oss_20b_bf16"].description    # attention factor


@pytest.mark.skipif(not kvfuse.backend.interpreter_enabled(), reason="needs TRITON_INTERPRET=1")
def test_fused_peer_equals_reference_peer_on_the_interpreter():
    """The fused peer (the kernel through the interpreter) writes what the reference peer writes; a small
    slice of Llama 3 8B (its shapes are too big for the interpreter) with 2 tokens."""
    import dataclasses
    cfg = dataclasses.replace(kvfuse.models.LLAMA3_8B, num_heads=4, num_kv_heads=1)
    wl = dataclasses.replace(bench.WORKLOADS["llama3_8b_fp8"], gqa=cfg, num_heads=6)
    inp = bench.build_inputs(wl, 2, "cpu", seed=3)
    outs = {}
    for backend in ("reference", "triton"):
        for t in bench.result_tensors(wl, inp):
            t.view(torch.uint8).fill_(0xAB)
        with use_backend(backend):
            bench.make_peer("fused", wl, inp)()
        outs[backend] = [t.view(torch.uint8).clone() for t in bench.result_tensors(wl, inp)]
    assert all(torch.equal(a, b) for a, b in zip(outs["reference"], outs["triton"]))
    assert int((outs["reference"][1] != 0xAB).sum()) >= 2 * 128 - 8      # both tokens' K records written
