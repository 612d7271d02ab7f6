"""GPU module: calls from several threads at once with the compiled kernels (SPEC §9), each thread on
its own CUDA stream: every thread's whole cache storages, outputs and loads equal the same work done
by one thread alone (tests/test_reliability_threads.py's work). Run with KVFUSE_TEST_GPU=1."""
import pytest
import torch

import kvfuse
from test_reliability_threads import THREADS, run_threads

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or kvfuse.backend.interpreter_enabled(),
                                reason="needs CUDA and compiled kernels (KVFUSE_TEST_GPU=1)")


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_threads_on_their_own_streams(backend):
    run_threads(backend, "cuda", [torch.cuda.Stream() for _ in range(THREADS)])
