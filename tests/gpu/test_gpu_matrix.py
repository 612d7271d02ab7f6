"""The GPU matrix built from the dispatcher's own tables (tests/gpu_matrix.py): every launch the
dispatcher can pick (each fast path's and the portable kernel's launch-table entries, Triton's
launch and then the direct launcher) crossed all-pairs with every feature that changes the
generated code. Each case runs twice on the GPU (the first call launches through Triton, the second
through the direct launcher) and both results are compared byte for byte with the reference on the
GPU over whole poisoned storages. Run with KVFUSE_TEST_GPU=1 on a CUDA machine:

    KVFUSE_TEST_GPU=1 python3 -m pytest -q tests/gpu/test_gpu_matrix.py

KVFUSE_MATRIX_SLICE="a:b" runs cases a..b-1 only (Python slice syntax), to split the matrix over calls.
"""
import json
import os

import pytest
import torch

import kvfuse
from gpu_matrix import gqa_cases, matrix
from gqa_cases import gpu_against_cpu_reference
from kernel_cases import diff_bytes, diff_report, run_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or kvfuse.backend.interpreter_enabled(),
                                reason="needs CUDA and compiled kernels (KVFUSE_TEST_GPU=1)")
MATRIX = matrix() if torch.cuda.is_available() else []
if os.environ.get("KVFUSE_MATRIX_SLICE"):
    MATRIX = MATRIX[slice(*(int(v) if v else None for v in os.environ["KVFUSE_MATRIX_SLICE"].split(":")))]
SUMMARY = {"cases": 0, "runs": 0, "byte_diffs": 0, "failed": []}


@pytest.mark.parametrize("label,case", MATRIX, ids=[label for label, _ in MATRIX])
def test_matrix_case(label, case):
    ref = run_case(case, "reference", "cuda")
    total, reports = 0, []
    for launch in ("triton launch", "direct launch"):
        tri = run_case(case, "triton", "cuda")
        d = diff_bytes(ref, tri)
        SUMMARY["runs"] += 1
        if d:
            reports.append(f"{launch}: " + diff_report(ref, tri))
        total += d
    SUMMARY["cases"] += 1
    SUMMARY["byte_diffs"] += total
    if total:
        SUMMARY["failed"].append(label)
    assert total == 0, label + " :: " + " | ".join(reports)


GQA = gqa_cases() if torch.cuda.is_available() else []


@pytest.mark.parametrize("label,case", GQA, ids=[label for label, _ in GQA])
def test_gqa_matrix_case(label, case):
    """The GQA section: the CPU reference against two GPU launches, every byte it could touch."""
    reports, differing = gpu_against_cpu_reference(case)
    SUMMARY["runs"] += 2
    SUMMARY["cases"] += 1
    SUMMARY["byte_diffs"] += differing
    if reports:
        SUMMARY["failed"].append(label)
    assert not reports, label + " :: " + " | ".join(reports)


def teardown_module(module):
    line = (f"GPU matrix summary: {SUMMARY['cases']} cases, {SUMMARY['runs']} compared runs, "
            f"{SUMMARY['byte_diffs']} differing bytes")
    print("\n" + line)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "gpu_matrix_summary.json"), "w") as f:
            json.dump({**SUMMARY, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": __import__("triton").__version__}, f, indent=1)
