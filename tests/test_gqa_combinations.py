"""The GQA entry's features crossed with each other (kvfuse.fused_qk_norm_rope_store_kv): the cache formats
(kvfuse.gqa_formats: static e5m2, per-(token, head) e4m3 / int8, NVFP4 / MXFP4) with mRoPE and the V-norm,
under the profiles that change where a cast reads its value. Each case: Triton's interpreter byte-equal to
the reference chain on every byte the call may touch (the poisoned, guarded cache storages, scale caches,
q_out). The features' own tests (test_gqa_formats, test_gqa_fp4, test_gqa_mrope) cover each alone; the
GPU matrix crosses them again on the device (tests/gpu_matrix.py)."""
import pytest

import kvfuse
from gqa_cases import GQACase, diff_report, run_gqa_case
from gqa_format_cases import FormatCase, run_format_case

needs_interpreter = pytest.mark.skipif(not kvfuse.backend.interpreter_enabled(), reason="needs TRITON_INTERPRET=1")

FP4_CASES = [
    GQACase(n=5, fp4_k="nvfp4", fp4_v="nvfp4", v_norm="bf16", seed=101),
    GQACase(n=7, fp4_k="mxfp4", fp4_v="mxfp4", v_norm="none", numerics="fused_fp32_cast", mrope="interleaved",
            seed=102),
    GQACase(n=4, fp4_v="nvfp4", fp8=True, mrope="chunked", layout="HND", v_norm="fp32", seed=103),
    GQACase(n=6, fp4_k="nvfp4", mrope="interleaved", numerics="fused", dtype="fp16", q_norm="fp16", k_norm="fp16",
            cos_sin="fp16", seed=104),
]

FORMAT_CASES = [
    FormatCase(GQACase(n=5, v_norm="fp32", mrope="interleaved", seed=111), "fp8_per_token_head", "int8_per_token_head"),
    FormatCase(GQACase(n=6, v_norm="none", numerics="fused_fp32_cast", layout="HND", seed=112), "fp8_e5m2",
               "fp8_per_token_head"),
    FormatCase(GQACase(n=4, v_norm="bf16", mrope="chunked", numerics="fused", seed=113), "int8_per_token_head",
               "fp8_e5m2"),
]


@needs_interpreter
@pytest.mark.parametrize("case", FP4_CASES, ids=[c.describe() for c in FP4_CASES])
def test_fp4_caches_with_mrope_and_the_v_norm(case):
    ref = run_gqa_case(case, "reference")
    got = run_gqa_case(case, "triton")
    assert not diff_report(ref, got), case.describe() + " :: " + diff_report(ref, got)


@needs_interpreter
@pytest.mark.parametrize("fc", FORMAT_CASES, ids=[fc.describe() for fc in FORMAT_CASES])
def test_formats_with_mrope_and_the_v_norm(fc):
    ref = run_format_case(fc, "reference")
    got = run_format_case(fc, "triton")
    assert not diff_report(ref, got), fc.describe() + " :: " + diff_report(ref, got)
