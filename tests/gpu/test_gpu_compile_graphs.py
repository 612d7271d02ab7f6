"""GPU module (skipped without CUDA; KVFUSE_TEST_GPU=1): the public entry points under
CUDA-graph capture/replay with preallocated outputs, under torch.compile(fullgraph=True), and both
together; bytes compared with direct eager calls. (Written 2026-11-29 after the session's device
time was spent: not yet run on a GPU.)"""
import pytest
import torch

import kvfuse
from kvfuse import CastArgs, ContiguousOutArgs, KVCacheOutArgs, NormArgs, RopeArgs, formats

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or kvfuse.backend.interpreter_enabled(),
                                reason="needs CUDA and compiled kernels (KVFUSE_TEST_GPU=1)")
FMT = formats.MAIN_FP8
N = 96


def make_inputs(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(N, 512, generator=g, device="cuda") * 3).to(torch.bfloat16)
    w = torch.rand(512, generator=g, device="cuda").to(torch.bfloat16)
    ang = torch.rand(1024, 32, generator=g, device="cuda") * 6
    cs = torch.cat([ang.cos(), ang.sin()], 1)
    pos = torch.randint(0, 1024, (N,), generator=g, device="cuda")
    slots = torch.randperm(4 * 64, generator=g, device="cuda")[:N]
    return x, w, cs, pos, slots


def write(x, w, cs, pos, slots, cache, out):
    return kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(
        x, NormArgs(w), RopeArgs(pos, cs, 64, True), None, CastArgs.from_cache_format(FMT),
        KVCacheOutArgs(cache, slots, out=out, out_stage="cast_back", layout=FMT))


def index_q(x, cs, pos, q, sf):
    return kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(
        x, rope_args=RopeArgs(pos, cs, 64, True), cast_args=CastArgs.from_cache_format(formats.INDEX_MXFP4),
        out_args=ContiguousOutArgs(q, sf))


def fresh_buffers():
    cache = FMT.allocate(4, 64, device="cuda")
    flat = cache.as_strided((cache.untyped_storage().nbytes(),), (1,), 0)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, device="cuda"))
    out = torch.full((N, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    return cache, flat, out


def expected(inputs):
    cache, flat, out = fresh_buffers()
    write(*inputs, cache, out)
    return flat, out


def test_cuda_graph_capture_and_replay():
    static = make_inputs(0)
    cache, flat, out = fresh_buffers()
    initial = flat.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        write(*static, cache, out)                      # warm-up (compiles the kernel)
    torch.cuda.current_stream().wait_stream(s)
    flat.copy_(initial)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write(*static, cache, out)
    for seed in (1, 2, 3):
        new = make_inputs(seed)
        for dst, src in zip(static, new):
            dst.copy_(src)
        flat.copy_(initial)
        graph.replay()
        torch.cuda.synchronize()
        want_flat, want_out = expected(new)
        # the expected cache started from other random bytes: compare the written records + out
        got = kvfuse.load_paged_kv_cache(cache, new[4], FMT, dequantize=False)
        want = kvfuse.load_paged_kv_cache(_cache_of(want_flat), new[4], FMT, dequantize=False)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1][..., :16], want[1][..., :16])
        assert torch.equal(out.view(torch.int16), want_out.view(torch.int16))
        untouched = torch.ones_like(flat, dtype=torch.bool)
        _mark_records(untouched, cache, new[4])
        assert torch.equal(flat[untouched], initial[untouched])


def _cache_of(flat):
    shape = FMT.allocate(4, 64, device="meta")
    return torch.as_strided(flat, shape.shape, shape.stride(), 0)


def _mark_records(mask, cache, slots):
    s0, s1 = cache.stride(0), cache.stride(1)
    for s in slots.tolist():
        base = (s // 64) * s0 + (s % 64) * s1
        mask[base:base + 532] = False                   # 512 data + 16 scales + the 4 reserved (zeros)


def test_compile_fullgraph_inductor_equals_eager():
    inputs = make_inputs(4)
    cache_a, flat_a, out_a = fresh_buffers()
    cache_b = torch.as_strided(flat_a.clone(), cache_a.shape, cache_a.stride(), 0)
    flat_b = cache_b.as_strided((cache_b.untyped_storage().nbytes(),), (1,), 0)
    out_b = out_a.clone()
    write(*inputs, cache_a, out_a)
    torch.compile(write, fullgraph=True)(*inputs, cache_b, out_b)
    torch.cuda.synchronize()
    assert torch.equal(flat_a, flat_b) and torch.equal(out_a.view(torch.int16), out_b.view(torch.int16))
    x, w, cs, pos, slots = make_inputs(5)
    qa, sa = torch.empty(N, 64, dtype=torch.uint8, device="cuda"), torch.empty(N, 4, dtype=torch.uint8, device="cuda")
    qb, sb = qa.clone(), sa.clone()
    xq = x[:, :128].contiguous()
    index_q(xq, cs, pos, qa, sa)
    torch.compile(index_q, fullgraph=True)(xq, cs, pos, qb, sb)
    torch.cuda.synchronize()
    assert torch.equal(qa, qb) and torch.equal(sa, sb)


def test_compiled_function_inside_a_cuda_graph():
    static = make_inputs(6)
    cache, flat, out = fresh_buffers()
    compiled = torch.compile(write, fullgraph=True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        compiled(*static, cache, out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        compiled(*static, cache, out)
    new = make_inputs(7)
    for dst, src in zip(static, new):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    _, want_out = expected(new)
    assert torch.equal(out.view(torch.int16), want_out.view(torch.int16))
