"""GPU module for the GQA entry's cache formats (kvfuse.gqa_formats, SPEC §3): the compiled kernel
against the reference chain computed on the CPU, bytes compared over whole storages (code caches and
scale caches with guards and block padding, vLLM's inline scales, the NaN-poisoned q_out buffer, the
packed QKV input). The cases are the GPU matrix's format section (tests/gpu_matrix.py
``gqa_format_cases``, derived from PRESETS), and the native e5m2 / e4m3 conversions on every bf16 value.
Each case runs twice on the GPU (the second launch reuses the compiled kernel). Run with
KVFUSE_TEST_GPU=1 on a CUDA machine:

    KVFUSE_TEST_GPU=1 python3 -m pytest -q tests/gpu/test_gpu_gqa_formats.py
"""
import pytest
import torch

import kvfuse
from gpu_matrix import gqa_format_cases
from gqa_cases import GQACase, diff_report
from gqa_format_cases import EVERY_BF16_FORMATS, every_bf16_run, format_gpu_against_cpu_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or kvfuse.backend.interpreter_enabled(),
                                reason="needs CUDA and compiled kernels (KVFUSE_TEST_GPU=1)")

CASES = gqa_format_cases()


@pytest.mark.parametrize("label,fc", CASES, ids=[label for label, _ in CASES])
def test_gqa_format_case(label, fc):
    reports = [r for r in format_gpu_against_cpu_reference(fc) if r]
    assert not reports, fc.describe() + " :: " + " | ".join(reports)


@pytest.mark.parametrize("fmt,scale", EVERY_BF16_FORMATS)
def test_every_bf16_value_through_v(fmt, scale):
    """V carries every bf16 value (infinities, subnormals, ties of every code) into each format: the GPU's
    native conversions give the reference's bytes."""
    ref = every_bf16_run(fmt, scale, "reference", "cpu")
    got = every_bf16_run(fmt, scale, "triton", "cuda")
    assert not diff_report(ref, got), diff_report(ref, got)
