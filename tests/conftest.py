"""Test setup. Without a GPU, the Triton kernels run in Triton's interpreter on CPU tensors:
TRITON_INTERPRET must be set before triton is imported, so it is set here, first.
Set KVFUSE_TEST_GPU=1 to run the kernels compiled on a CUDA device instead (tests/gpu)."""
import os

if os.environ.get("KVFUSE_TEST_GPU", "0") in ("", "0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

# shared case builders (tests/kernel_cases.py, tests/helpers.py) importable from tests/gpu too
sys.path.insert(0, str(Path(__file__).parent))
