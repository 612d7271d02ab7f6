"""The configurations real models run, through the kernel (Triton's interpreter on the CPU) and the
reference: GPT-J RoPE in multi-row programs, RoPE at offset 0, LayerNorm (with and without a bias),
and the norm's stage copy written in place into x. Whole storages are compared byte for byte."""
import dataclasses

import pytest
import torch

import kvfuse
from kvfuse import formats
from kernel_cases import Case, diff_bytes, diff_report, run_case

BACKENDS = ("reference", "triton")


def _same(case):
    ref = run_case(case, "reference", "cpu")
    tri = run_case(case, "triton", "cpu")
    assert diff_bytes(ref, tri) == 0, case.describe() + " :: " + diff_report(ref, tri)
    return ref


@pytest.mark.parametrize("fmt", [formats.INDEX_MXFP8, formats.MAIN_FP8, formats.INDEX_MXFP4, formats.FLASHMLA_V32],
                         ids=lambda f: f.name)
@pytest.mark.parametrize("conjugate", [False, True])
def test_gptj_rope_multi_row_programs(fmt, conjugate):
    """GPT-J pairs on the RoPE sub-tile, many rows per program (the interpreter's table)."""
    _same(Case(n=37, heads=1, head_dim=fmt.head_dim, fmt=fmt, neox=False, conjugate=conjugate, seed=7,
               out_stage="transform"))


@pytest.mark.parametrize("fmt", [formats.INDEX_MXFP8, formats.MAIN_FP8, formats.FLASHMLA_MODEL1],
                         ids=lambda f: f.name)
@pytest.mark.parametrize("neox", [True, False])
def test_norm_copy_in_place_equals_a_separate_out(fmt, neox):
    """out = x with out_stage="norm": the cache and the copy equal those of a separate out (SPEC §9),
    on both backends (the kernel used to store the copy into x before RoPE read x again)."""
    base = Case(n=9, heads=1, head_dim=fmt.head_dim, fmt=fmt, neox=neox, seed=11, out_stage="norm")
    separate = {b: run_case(base, b, "cpu") for b in BACKENDS}
    in_place = {b: run_case(dataclasses.replace(base, in_place=True), b, "cpu") for b in BACKENDS}
    for b in BACKENDS:
        assert diff_bytes(separate[b], in_place[b]) == 0, (b, diff_report(separate[b], in_place[b]))
    assert diff_bytes(separate["reference"], in_place["triton"]) == 0


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("head_dim,fmt", [(128, formats.INDEX_FP8_FP32), (192, None), (512, formats.MAIN_FP4)])
def test_layernorm_through_the_kernel(bias, head_dim, fmt):
    """LayerNorm (DeepSeek V3.2's indexer K: weight and bias, RoPE on the first 64, Hadamard) and
    other shapes; a non-power-of-two head_dim pads the trees with zeros."""
    had = head_dim & (head_dim - 1) == 0
    _same(Case(n=13, heads=1, head_dim=head_dim, fmt=fmt, norm_kind="layer", bias=bias, rope_offset=0,
               hadamard=had, seed=3 + bias, w_fp32=bias, out_stage="norm" if fmt is not None else None))


def test_layernorm_equals_the_reference_stage():
    """The fused call with only the norm on returns reference.layernorm's bytes, bias or not."""
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(6, 3, 80, generator=g) * 4).to(torch.bfloat16)
    w = torch.rand(80, generator=g).to(torch.bfloat16)
    b = torch.randn(80, generator=g).to(torch.float32)
    for bias in (None, b):
        want = kvfuse.reference.layernorm(x, w, bias, 1e-5)
        for backend in BACKENDS:
            with kvfuse.use_backend(backend):
                got = kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(
                    x, norm_args=kvfuse.NormArgs(w, 1e-5, bias=bias, kind="layer"))
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), backend


@pytest.mark.parametrize("bad,err", [
    (dict(kind="group"), "norm_args.kind"),
    (dict(kind="rms", bias=torch.zeros(64)), "norm_args.bias"),
    (dict(kind="layer", bias=torch.zeros(32)), "norm_args.bias"),
    (dict(eps=0.0), "norm_args.eps"),
    (dict(eps=-1e-6), "norm_args.eps"),
])
def test_bad_norm_args_name_the_argument(bad, err):
    x = torch.randn(4, 64).to(torch.bfloat16)
    args = dict(weight=torch.ones(64), eps=1e-6)
    args.update(bad)
    with pytest.raises((ValueError, TypeError), match=err):
        kvfuse.fused_norm_rope_hadamard_cast_store_kvcache(x, norm_args=kvfuse.NormArgs(**args))
