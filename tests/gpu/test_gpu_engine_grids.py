"""The engines' own test grids (tests/engine_grids.py) against kvfuse.engines on the GPU, at the engines'
sizes: every case of every grid, the Triton kernels (and whatever fast path the dispatcher picks)."""
import pytest
import torch

import kvfuse
from engine_grids import GRIDS, case_id

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or kvfuse.backend.interpreter_enabled(),
                                reason="needs CUDA and compiled kernels (KVFUSE_TEST_GPU=1)")

CASES = [(name, case) for name, (grid, _) in GRIDS.items() for case in grid]


@pytest.mark.parametrize("name,case", CASES, ids=[f"{n}[{case_id(c)}]" for n, c in CASES])
def test_engine_grid_gpu(name, case):
    GRIDS[name][1](case, "cuda")
    torch.cuda.synchronize()
