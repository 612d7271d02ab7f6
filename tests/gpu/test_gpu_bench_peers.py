"""GPU module for the GQA peers of ``kvfuse bench`` (kvfuse/bench.py): ``stages`` and ``two_launch`` at the
models' real shapes run without a host synchronization (CUDA's sync debug mode set to "error", as the
bench's timer checks), replay from a CUDA graph, and write the fused call's bytes (q_out and both caches,
compared whole after poisoning). The CPU tests (tests/test_bench.py) check the bytes on the interpreter
with few heads; this checks what the bench's timer needs on the device. Run with KVFUSE_TEST_GPU=1:

    KVFUSE_TEST_GPU=1 python3 -m pytest -q tests/gpu/test_gpu_bench_peers.py
"""
import pytest
import torch

import kvfuse
from kvfuse import bench

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or kvfuse.backend.interpreter_enabled(),
                                reason="needs CUDA and compiled kernels (KVFUSE_TEST_GPU=1)")


def _poison(wl, inp):
    for t in bench.result_tensors(wl, inp):
        t.view(torch.uint8).fill_(0xAB)


@pytest.mark.parametrize("n", [1, 300])
@pytest.mark.parametrize("name", ["llama3_8b_bf16", "llama3_8b_fp8", "qwen3_8b_fp8", "gemma3_12b_fp8", "qwen3_vl_8b_fp8",
                                  "gemma4_31b_sliding_bf16", "gemma4_31b_global_fp8"])
def test_gqa_peers_capture_and_write_the_fused_bytes(name, n):
    wl = bench.WORKLOADS[name]
    inp = bench.build_inputs(wl, n, "cuda", seed=3)
    outs = {}
    with kvfuse.use_backend("triton"):
        for peer in ("fused", "stages", "two_launch"):
            fn = bench.make_peer(peer, wl, inp)
            fn()                                            # compile outside the capture
            torch.cuda.synchronize()
            assert bench.CudaTimer._host_sync(fn) == "", peer
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            _poison(wl, inp)
            graph.replay()
            torch.cuda.synchronize()
            outs[peer] = [t.view(torch.uint8).clone() for t in bench.result_tensors(wl, inp)]
            del graph
    for peer in ("stages", "two_launch"):
        for what, a, b in zip(("q_out", "k_cache", "v_cache"), outs[peer], outs["fused"]):
            assert torch.equal(a, b), f"{name} n={n} {peer}: {what} differs from the fused call's"
