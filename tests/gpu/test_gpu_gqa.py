"""GPU module for fused_qk_norm_rope_store_kv (kvfuse/kernels/qkv.py, SPEC §3): the compiled kernel
against the reference chain computed on the CPU, bytes compared over whole storages (caches with guards
and block padding, the NaN-poisoned q_out buffer, the packed QKV input).

The launch-table cases are the GPU matrix's GQA section (tests/gpu_matrix.py ``gqa_cases``, run by
tests/gpu/test_gpu_matrix.py); here: the int64 slot path and the real model shapes. Each case runs twice on the GPU (the second launch reuses the compiled
kernel) and both results must equal the CPU reference. Run with KVFUSE_TEST_GPU=1 on a CUDA machine:

    KVFUSE_TEST_GPU=1 python3 -m pytest -q tests/gpu/test_gpu_gqa.py
"""
import pytest
import torch

import kvfuse
from kvfuse.kernels import config
from gqa_cases import GQACase, gpu_against_cpu_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or kvfuse.backend.interpreter_enabled(),
                                reason="needs CUDA and compiled kernels (KVFUSE_TEST_GPU=1)")

SUMMARY = {"cases": 0, "runs": 0, "byte_diffs": 0}


def check(case: GQACase):
    reports, _ = gpu_against_cpu_reference(case)
    SUMMARY["runs"] += 2
    SUMMARY["cases"] += 1
    SUMMARY["byte_diffs"] += len(reports)
    assert not reports, case.describe() + " :: " + " | ".join(reports)


def test_int64_slot_path(monkeypatch):
    monkeypatch.setattr(config, "INT32_LIMIT", 4)
    check(GQACase(n=300, fp8=True, layout="HND", seed=1))
    check(GQACase(n=3, neox=False, seed=2))


@pytest.mark.parametrize("scales", [(2.0 ** -64, 2.0 ** 64), (-3.0e-20, 2.5e19), (1.0, -0.75), (7.1e-4, 1.0e6)])
def test_fp8_scales_both_division_paths(scales):
    """The cast's two branches on the GPU (the matrix's cases take the reciprocal one): the bounds of the
    reciprocal's range, a negative scale and scales just past a bound (element by element), decode and
    a multi-token launch, against the CPU reference."""
    check(GQACase(n=6, hq=4, hkv=2, fp8=True, scales=scales, seed=40))
    check(GQACase(n=300, hq=8, hkv=2, fp8=True, layout="HND", scales=scales, seed=41))


@pytest.mark.parametrize("name", ["llama-3-8b", "qwen3-8b", "gemma-3-12b", "gpt-oss-20b", "qwen2.5-vl-7b",
                                  "qwen3-vl-8b", "gemma-4-31b-sliding", "gemma-4-31b-global"])
def test_model_shapes(name):
    """The models' real head counts and widths (decode and a prefill block), NHD fp8 and HND bf16, with
    their mRoPE sections and V-norm."""
    cfg = kvfuse.models.get_gqa(name)
    base = dict(hq=cfg.num_heads, hkv=cfg.num_kv_heads, d=cfg.head_dim, q_norm="fp32" if cfg.norm_weight_offset
                else "bf16", k_norm=("fp32" if cfg.norm_weight_offset else "bf16") if cfg.qk_norm else None)
    if not cfg.qk_norm:
        base["q_norm"] = None
    if cfg.mrope_section is not None:
        base.update(mrope="interleaved" if cfg.mrope_interleaved else "chunked", mrope_section=cfg.mrope_section)
    if cfg.v_norm:
        base["v_norm"] = "none"
    check(GQACase(n=7, fp8=True, seed=3, **base))
    check(GQACase(n=257, layout="HND", inplace=True, block_size=16, seed=4, **base))


def test_zz_summary():
    print(f"\nGQA GPU summary: {torch.cuda.get_device_name()} torch {torch.__version__} triton "
          f"{__import__('triton').__version__}: {SUMMARY['cases']} cases, {SUMMARY['runs']} GPU runs vs the CPU "
          f"reference, {SUMMARY['byte_diffs']} runs with differing bytes")
    assert SUMMARY["cases"] > 0 and SUMMARY["byte_diffs"] == 0
