"""The 4-bit GQA / MHA cache formats (SPEC §3): NVFP4 with a global scale (FlashInfer's rule) and MXFP4.

* the reference (kvfuse/reference/fp4.py) equals a scalar transcription of FlashInfer 0.7.2.post1's
  ``nvfp4_append_quantize_block`` (page.cuh) written here in numpy float32 with IEEE division, and
  hand-worked groups of FlashInfer's documented semantics (ties, saturation, NaN, signed zeros);
* the kernel's device functions (kvfuse/kernels/gqa_fp4.py) equal the reference byte for byte in
  Triton's interpreter, through a small test kernel, on random rows and on the special values;
* the decoders give bf16((e2m1 * sf) * g) and bf16(e2m1 * 2^e);
* kvfuse.fused_qk_norm_rope_store_kv with "nvfp4" / "mxfp4" caches: every preset x layout x a numerics
  subset and the features that change the kernel's code, the interpreter equal to the reference chain
  on the whole poisoned storages (caches, scale caches, guards, padding) and q_out, the records holding
  the quantizer's bytes; the read side; bad input.
"""
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import kvfuse
from kvfuse.gqa_formats import PRESETS
from kvfuse.kernels.gqa_fp4 import FP4_CODES, FP4_GROUPS, store_fp4_rows
from kvfuse.reference import fp4 as ref
from gqa_cases import GQACase, build, diff_report, run_gqa_case

F32 = np.float32
needs_interpreter = pytest.mark.skipif(not kvfuse.backend.interpreter_enabled(), reason="needs TRITON_INTERPRET=1")

# the e2m1 magnitudes by code, and FlashInfer's thresholds (nvfp4_append_quantize_e2m1)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _flashinfer_e2m1(v: F32) -> int:
    """nvfp4_append_quantize_e2m1, transcribed: the if-chain of page.cuh, sign from signbit."""
    sign = 8 if np.signbit(v) else 0
    mag = abs(v)
    if not mag > 0.25:
        code = 0
    elif mag < 0.75:
        code = 1
    elif mag <= 1.25:
        code = 2
    elif mag < 1.75:
        code = 3
    elif mag <= 2.5:
        code = 4
    elif mag < 3.5:
        code = 5
    elif mag <= 5.0:
        code = 6
    else:
        code = 7
    return sign | code


def _e4m3_satfinite(v: F32) -> int:
    """__nv_fp8_e4m3(v): round to nearest even, saturating to 448, NaN -> 0x7F (torch's cast of the clamped value)."""
    if np.isnan(v):
        return 0x7F
    return int(torch.tensor(min(float(v), 448.0), dtype=torch.float32).to(torch.float8_e4m3fn).view(torch.uint8))


def _flashinfer_block(values: np.ndarray, g: F32):
    """nvfp4_append_quantize_block (precise_rounding false) with IEEE fp32 operations: (16 codes, sf byte)."""
    amax = F32(0.0)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for v in values:
            a = abs(v)
            amax = amax if np.isnan(a) else max(amax, a)                     # fmaxf keeps the number
        sf_value = F32(amax / F32(F32(6.0) * g)) if (amax > 0 and g > 0) else F32(0.0)
        sf = _e4m3_satfinite(sf_value)
        sf_rounded = F32(torch.tensor(sf, dtype=torch.uint8).view(torch.float8_e4m3fn).float())
        ok = amax > 0 and sf_rounded > 0 and g > 0
        out_scale = F32(F32(1.0) / F32(sf_rounded * g)) if ok else F32(0.0)
        codes = [_flashinfer_e2m1(F32(v * out_scale)) for v in values]
    return codes, sf


def _special_rows(dtype, d, group):
    """Rows of random values with, per group, zeros, signed zeros, NaN, infinities, huge and tiny values."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(12, d, generator=gen) * torch.logspace(-6, 6, 12)[:, None]
    x[1, :group] = 0.0
    x[2, :group] = -0.0
    x[3, 3] = float("nan")
    x[4, 5] = float("inf")
    x[5, 0] = float("-inf")
    x[6, :] = -x[6, :].abs() * 1e-30                            # tiny: every scale rounds to zero
    x[7, group:] = float("nan")                                  # whole groups of NaN
    x[8, :] = 65504.0 if dtype == torch.float16 else 3e38        # every group at the dtype's top
    x[9, :group] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * (group // 8))  # ties
    return x.to(dtype)


# --------------------------------------------------------------------------- reference vs FlashInfer's rule
@pytest.mark.parametrize("g", [1.0, 0.0123, 3.0e-3, 7.5, 2.0 ** -20])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_nvfp4_reference_is_flashinfer_rule(dtype, g):
    x = _special_rows(dtype, 64, 16)
    codes, sf = ref.quantize_nvfp4(x, g)
    unpacked = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2)
    xs = x.float().numpy()
    for r in range(x.shape[0]):
        for b in range(4):
            want_codes, want_sf = _flashinfer_block(xs[r, 16 * b:16 * (b + 1)], F32(g))
            assert int(sf[r, b].view(torch.uint8)) == want_sf, (r, b)
            assert unpacked[r, 16 * b:16 * (b + 1)].tolist() == want_codes, (r, b)


def test_nvfp4_hand_worked_groups():
    """Groups whose bytes follow from FlashInfer's documented rule by hand (g = 1: sf = e4m3(amax / 6))."""
    row = torch.tensor([6.0, 3.0, -1.5, 0.0, -0.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.5, -6.0, 0.5, 1.0])
    codes, sf = ref.quantize_nvfp4(row[None], 1.0)
    assert sf.view(torch.uint8).tolist() == [[0x38]]         # amax 6 -> sf 1.0; output scale 1
    assert torch.stack((codes & 0xF, codes >> 4), -1).flatten().tolist() == \
        [7, 5, 0xB, 0, 8, 0, 2, 2, 4, 4, 6, 6, 7, 0xF, 1, 2]  # ties to even, -0 keeps its sign
    # amax 0: sf code 0, every code a signed zero; a NaN is left out of the amax and codes as a signed zero
    zero = torch.tensor([[0.0] * 8 + [-0.0] * 8])
    codes, sf = ref.quantize_nvfp4(zero, 1.0)
    assert sf.view(torch.uint8).tolist() == [[0]] and codes.tolist() == [[0] * 4 + [0x88] * 4]
    nan = torch.tensor([[float("nan"), -float("nan"), 12.0] + [0.0] * 13])
    codes, sf = ref.quantize_nvfp4(nan, 1.0)
    assert sf.view(torch.uint8).tolist() == [[0x40]]          # e4m3(12 / 6) = 2.0
    assert codes[0, :2].tolist() == [0x80, 0x07]              # NaN -> 0, -NaN -> 8; 12 / 2 = 6 -> 7
    # an infinite amax saturates the scale at 448 (0x7E); the infinity codes as 6
    inf = torch.tensor([[float("inf"), 1.0] + [0.0] * 14])
    codes, sf = ref.quantize_nvfp4(inf, 1.0)
    assert sf.view(torch.uint8).tolist() == [[0x7E]] and codes[0, 0].item() == 0x07


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_reference_is_spec_rule(dtype):
    """Finite rows give the bytes of SPEC §6's quantizer (kvfuse.reference.quantize, e2m1 / 32 / ue8m0);
    NaN elements are left out of the amax and code as signed zeros."""
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(3)).to(dtype) * 10
    codes, sf = ref.quantize_mxfp4(x)
    want_codes, want_sf = kvfuse.reference.quantize(x.bfloat16() if dtype == torch.bfloat16 else x,
                                                     "e2m1", 32, "ue8m0")
    assert torch.equal(codes, want_codes) and torch.equal(sf, want_sf)
    y = x.clone()
    y[0, 4] = float("nan")
    codes_nan, sf_nan = ref.quantize_mxfp4(y)
    finite = x.clone()
    finite[0, 4] = 0.0
    codes_zero, sf_zero = ref.quantize_mxfp4(finite)
    assert torch.equal(sf_nan, sf_zero) and torch.equal(codes_nan, codes_zero)


def test_decoders():
    codes = torch.tensor([[0x71, 0xF8, 0x32, 0x00, 0, 0, 0, 0]], dtype=torch.uint8)   # 0.5, 6, -0, -6, 1, 1.5, 0 ...
    sf = torch.tensor([[0x40]], dtype=torch.uint8).view(torch.float8_e4m3fn)         # 2.0
    y = ref.dequantize_nvfp4(codes, sf, 0.1)
    want = torch.tensor([0.5, 6.0, -0.0, -6.0, 1.0, 1.5, 0.0, 0.0] + [0.0] * 8) * 2.0
    assert torch.equal(y.view(torch.int16), (want[None] * torch.tensor(0.1)).bfloat16().view(torch.int16))
    nan_sf = torch.tensor([[0x7F]], dtype=torch.uint8).view(torch.float8_e4m3fn)
    assert (ref.dequantize_nvfp4(codes, nan_sf, 1.0).view(torch.int16) == 0x7FC0).all()
    mx = ref.dequantize_mxfp4(codes.repeat(1, 2), torch.tensor([[127 + 3]], dtype=torch.uint8))
    assert mx[0, :2].tolist() == [4.0, 48.0]
    assert (ref.dequantize_mxfp4(codes.repeat(1, 2), torch.tensor([[0xFF]], dtype=torch.uint8))
            .view(torch.int16) == 0x7FC0).all()


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_round_trip_error_is_bounded(fmt):
    """Decoded values lie within half a code step of the input (a real bound, not a tolerance on bytes)."""
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(1)).bfloat16()
    if fmt == "nvfp4":
        g = 0.02
        y = ref.dequantize_nvfp4(*ref.quantize_nvfp4(x, g), g)
        step = ref.group_amax(x, 16) / 6 * 2          # the largest step of e2m1 (4 -> 6) at the group's scale
        step = step.repeat_interleave(16, -1) * 1.07  # e4m3's rounding of the scale, bf16 rounding
    else:
        y = ref.dequantize_mxfp4(*ref.quantize_mxfp4(x))
        step = (2.0 ** torch.ceil(torch.log2(ref.group_amax(x, 32) / 6)) * 2).repeat_interleave(32, -1) * 1.01
    assert ((y.float() - x.float()).abs() <= step / 2).all()


# --------------------------------------------------------------------------- the kernel's device functions
@triton.jit
def _fp4_rows_kernel(x_ptr, q_ptr, s_ptr, g, M: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                     FP4: tl.constexpr, GROUP: tl.constexpr, NATIVE: tl.constexpr):
    """store_fp4_rows on x [M, D] (rows of M; the tile BLOCK_D wide, its columns past D zero)."""
    r = tl.arange(0, M).to(tl.int64)
    col = tl.arange(0, BLOCK_D)
    y = tl.load(x_ptr + r[:, None] * D + col[None, :], mask=(col < D)[None, :], other=0.0)
    store_fp4_rows(q_ptr, r * (D // 2), s_ptr, r * (D // GROUP), y, r >= 0, g, D, BLOCK_D, M, FP4, NATIVE)


def run_fp4_rows(x: torch.Tensor, fmt: str, g: float = 1.0, native: int = 0):
    """store_fp4_rows on the rows of x [M, D] (M a power of two): (codes [M, D / 2], scale bytes [M, D / group])."""
    m, d = x.shape
    code = FP4_CODES[fmt]
    group = FP4_GROUPS[code]
    q = torch.full((m, d // 2), 0xAB, dtype=torch.uint8, device=x.device)
    s = torch.full((m, d // group), 0xAB, dtype=torch.uint8, device=x.device)
    _fp4_rows_kernel[(1,)](x.float().contiguous(), q, s, g, M=m, D=d, BLOCK_D=triton.next_power_of_2(d), FP4=code,
                           GROUP=group, NATIVE=native)
    return q, s


@needs_interpreter
@pytest.mark.parametrize("d", [32, 96, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("fmt,g", [("nvfp4", 1.0), ("nvfp4", 0.0123), ("nvfp4", 2.0 ** -20), ("mxfp4", 1.0)])
def test_fp4_tile_equals_reference(fmt, g, dtype, d):
    x = _special_rows(dtype, d, FP4_GROUPS[FP4_CODES[fmt]])
    x = torch.cat([x, torch.zeros(16 - x.shape[0], d, dtype=dtype)])
    q, s = run_fp4_rows(x, fmt, g)
    if fmt == "nvfp4":
        want_q, want_s = ref.quantize_nvfp4(x, g)
    else:
        want_q, want_s = ref.quantize_mxfp4(x)
    assert torch.equal(q, want_q)
    assert torch.equal(s, want_s.view(torch.uint8))


# --------------------------------------------------------------------------- the GQA entry with 4-bit caches
FP4_PRESETS = [name for name, f in PRESETS.items() if f.code == "e2m1"]


def test_presets():
    assert FP4_PRESETS == ["nvfp4", "mxfp4"]
    nv, mx = PRESETS["nvfp4"], PRESETS["mxfp4"]
    assert (nv.group, nv.scale_dtype, nv.global_scale) == (16, torch.float8_e4m3fn, True)
    assert (mx.group, mx.scale_dtype, mx.global_scale) == (32, torch.uint8, False)
    assert nv.cache_dtype == mx.cache_dtype == torch.uint8 and nv.values_per_element == 2
    assert nv.row_bytes(128) == 64 + 8 and mx.row_bytes(128) == 64 + 4
    assert nv.scale_cache_shape((3, 4, 2, 64), 128) == (3, 4, 2, 8)


def _cross_backends(case):
    ref = run_gqa_case(case, "reference")
    tri = run_gqa_case(case, "triton")
    assert not diff_report(ref, tri), diff_report(ref, tri) + " " + case.describe()
    return ref


def _written_rows_equal_the_quantizer(case):
    """The reference chain's K and V records, read back raw, hold the format's quantizer of the values it
    casts (the chain restated: rows from kvfuse.reference.qk_norm_rope, V as given)."""
    kw, _, _, _ = build(case)
    with kvfuse.use_backend("reference"):
        kvfuse.fused_qk_norm_rope_store_kv(**kw)
    slots = kw["slot_mapping"]
    if isinstance(slots, kvfuse.PagedAppend):
        return
    for which, fmt in (("k", case.fp4_k), ("v", case.fp4_v)):
        if not fmt:
            continue
        cache, sf = kw[which + "_cache"], kw[which + "_scale_cache"]
        codes = kvfuse.reference.load_paged(cache, slots, case.layout)
        scales = kvfuse.reference.load_paged(sf, slots, case.layout)
        if which == "v":
            x = kw["v"]
        else:
            norm, rope = kw["k_norm_args"], kw.get("rope_args")
            k = torch.cat(kw["k"], -1) if isinstance(kw["k"], tuple) else kw["k"]
            x = kvfuse.reference.qk_norm_rope(
                k, None if norm is None else norm.weight, 1e-6 if norm is None else norm.eps,
                None if rope is None else rope.positions, None if rope is None else rope.cos_sin_cache,
                0 if rope is None else rope.rotary_dim, 0 if rope is None else rope.offset or 0,
                True if rope is None else rope.is_neox, False if rope is None else rope.conjugate, case.numerics)
            if case.numerics != "fused_fp32_cast":
                x = x.to(case.act)
        want_codes, want_sf = ref.quantize_block_format(fmt, x, kw.get(which + "_scale"))
        valid = (slots >= 0) & (slots < cache.shape[0] * case.block_size)
        assert torch.equal(codes[valid], want_codes[valid]) and \
            torch.equal(scales[valid].view(torch.uint8), want_sf[valid].view(torch.uint8))


# every preset x layout x a numerics subset, then the features that change the generated code
FP4_CASES = [
    dict(fp4_k=f, fp4_v=f, layout=layout, numerics=numerics, n=n, d=d)
    for f in ["nvfp4", "mxfp4"]
    for layout, numerics, n, d in (("NHD", "staged", 5, 128), ("HND", "fused_fp32_cast", 7, 64),
                                   ("NHD", "fused", 3, 96))
] + [
    dict(fp4_k="nvfp4", fp4_v="nvfp4", dtype="fp16", q_norm="fp16", k_norm="fp16", cos_sin="fp16", layout="HND"),
    dict(fp4_k="mxfp4", fp4_v="mxfp4", dtype="fp32", numerics="fused_fp32_cast", neox=False, idx32=True),
    dict(fp4_k="nvfp4", fp4_v="", fp8=True, rotary_dim=32, rope_offset=16),           # K 4-bit, V e4m3
    dict(fp4_k="", fp4_v="mxfp4", layout="HND", q_norm=None),                         # K bf16, V 4-bit
    dict(fp4_k="mxfp4", fp4_v="nvfp4", dv=64, scales=(2.0 ** -20, 3.0e3)),            # two 4-bit formats
    dict(fp4_k="nvfp4", fp4_v="nvfp4", hq=0, q_norm=None, k_norm=None, rotary_dim=0, paged_append=True,
         scale_numbers=True),                                                         # FlashInfer's append
    dict(fp4_k="nvfp4", fp4_v="nvfp4", d=48, hq=6, hkv=3, packed=False, slots="contiguous", block_size=16),
    dict(fp4_k="mxfp4", fp4_v="nvfp4", split=32, rotary_dim=64, numerics="fused_fp32_cast", layout="HND"),  # pairs
]


@needs_interpreter
@pytest.mark.parametrize("fields", FP4_CASES, ids=lambda f: "_".join(f"{k}={v}" for k, v in f.items()))
def test_fp4_caches_kernel_equals_reference(fields):
    case = GQACase(seed=len(str(fields)), **fields)
    _cross_backends(case)
    _written_rows_equal_the_quantizer(case)


def test_fp4_read_back():
    """load_gqa_kv_cache decodes bf16((e2m1 * f(sf)) * g) (NVFP4) and bf16(e2m1 * 2^(byte - 127)) (MXFP4) for
    the slots' records, zeros for invalid slots."""
    case = GQACase(fp4_k="nvfp4", fp4_v="mxfp4", n=6, d=64, layout="HND")
    kw, _, _, _ = build(case)
    with kvfuse.use_backend("reference"):
        kvfuse.fused_qk_norm_rope_store_kv(**kw)
    slots = kw["slot_mapping"]
    k, v = kvfuse.load_gqa_kv_cache(kw["k_cache"], kw["v_cache"], slots, "HND", kw["k_scale"], None, "nvfp4", "mxfp4",
                                    kw["k_scale_cache"], kw["v_scale_cache"])
    valid = (slots >= 0) & (slots < kw["k_cache"].shape[0] * case.block_size)
    kc = kvfuse.reference.load_paged(kw["k_cache"], slots, "HND")
    ks = kvfuse.reference.load_paged(kw["k_scale_cache"], slots, "HND")
    want_k = ref.dequantize_nvfp4(kc, ks, kw["k_scale"])
    assert torch.equal(k[valid].view(torch.int16), want_k[valid].view(torch.int16))
    assert not k[~valid].view(torch.int16).any() and not v[~valid].view(torch.int16).any()
    # the decoded V is within half a code step of v (the round trip through the quantizer)
    amax = ref.group_amax(kw["v"], 32)
    step = (2.0 ** torch.ceil(torch.log2(torch.clamp(amax, min=1e-4) / 6)) * 2).repeat_interleave(32, -1)
    assert ((v[valid].float() - kw["v"][valid].float()).abs() <= step[valid] / 2 * 1.01).all()


def _fp4_call(**change):
    case = GQACase(fp4_k="nvfp4", fp4_v="nvfp4", n=3, d=64)
    kw, _, _, _ = build(case)
    kw.update(change)
    with kvfuse.use_backend("reference"):
        kvfuse.fused_qk_norm_rope_store_kv(**kw)


@pytest.mark.parametrize("change,exc,match", [
    (dict(k_scale=None), ValueError, "k_scale: k_format 'nvfp4' .*global decode scale.* got None"),
    (dict(v_scale=torch.tensor([1.0, 2.0, 3.0])), ValueError, "v_scale: expected one element"),
    (dict(k_scale=0.0, v_scale=1.0), ValueError, "k_scale must be a finite number > 0"),
    (dict(k_scale_cache=None), ValueError, "k_scale_cache: k_format 'nvfp4' stores its scales"),
    (dict(v_format="mxfp4"), ValueError, "v_scale must be None"),
    (dict(scale_convention="multiply"), ValueError, "scale_convention: k_format 'nvfp4'"),
    (dict(k_format="fp8"), TypeError, "k_cache: expected dtype torch.float8_e4m3fn"),
    (dict(k_format="auto"), TypeError, "k_cache: expected dtype"),
])
def test_fp4_bad_input(change, exc, match):
    with pytest.raises(exc, match=match):
        _fp4_call(**change)


def test_fp4_bad_shapes():
    case = GQACase(fp4_k="nvfp4", fp4_v="mxfp4", n=3, d=64)
    kw, _, _, _ = build(case)
    bad_codes = torch.zeros(kw["k_cache"].shape[:-1] + (64,), dtype=torch.uint8)      # D, not D / 2
    with pytest.raises(ValueError, match=r"k_cache: expected NHD shape .*64 / 2|k_cache: expected NHD shape \[.*, 32\]"):
        kvfuse.fused_qk_norm_rope_store_kv(**{**kw, "k_cache": bad_codes})
    bad_sf = torch.zeros(kw["v_scale_cache"].shape[:-1] + (4,), dtype=torch.uint8)    # 64 / 16, not 64 / 32
    with pytest.raises(ValueError, match="v_scale_cache: expected shape"):
        kvfuse.fused_qk_norm_rope_store_kv(**{**kw, "v_scale_cache": bad_sf})
    wrong_dtype = kw["k_scale_cache"].view(torch.uint8)
    with pytest.raises((TypeError, ValueError), match="k_scale_cache"):
        kvfuse.fused_qk_norm_rope_store_kv(**{**kw, "k_scale_cache": wrong_dtype})
    odd = GQACase(fp4_k="mxfp4", fp4_v="mxfp4", n=2, d=48)          # 48 is not a multiple of 32
    kw, _, _, _ = build(odd)
    with pytest.raises(ValueError, match="k_scale_cache: k_format 'mxfp4' has one scale per 32 values"):
        kvfuse.fused_qk_norm_rope_store_kv(**kw)


def test_fp4_k_cache_pair_rejected():
    case = GQACase(fp4_k="nvfp4", fp4_v="", n=2, d=128, split=64, k_cache_split=True, rotary_dim=64, q_norm=None,
                   k_norm=None)
    kw, _, _, _ = build(case)
    kw["k_cache"] = tuple(torch.zeros(c.shape[:-1] + (c.shape[-1] // 2,), dtype=torch.uint8) for c in kw["k_cache"])
    kw["k_scale_cache"] = torch.zeros(kw["k_cache"][0].shape[:-1] + (8,), dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_cache: a pair of caches is not supported with k_format 'nvfp4'"):
        kvfuse.fused_qk_norm_rope_store_kv(**kw)


# --------------------------------------------------------------------------- the GPU matrix's cover
def test_gpu_matrix_covers_every_fp4_preset():
    """Every 4-bit preset is run on the GPU (tests/gpu_matrix.py's GQA section) as K's and V's format, in
    both layouts, under a profile that casts the fp32 value and one that casts the rounded one, and the
    launches reach each FP4 value of the kernel's K_FP4 / V_FP4 with their scale caches."""
    import gpu_matrix as M
    from kvfuse.kernels import qkv
    from kvfuse.plans import gqa as gqa_plans
    cases = [c for _, c in M.gqa_cases()]
    for name in FP4_PRESETS:
        for side in ("fp4_k", "fp4_v"):
            mine = [c for c in cases if getattr(c, side) == name]
            assert {c.layout for c in mine} == {"NHD", "HND"}, (name, side)
            assert {"staged", "fused_fp32_cast"} <= {c.numerics for c in mine}, (name, side)
        assert any(c.fp4_k == name and (c.fp8 or not c.fp4_v) for c in cases)      # beside another format
    seen = {}
    for case in cases:
        if case.fp4_k or case.fp4_v:
            kw, _, _, _ = build(case)
            _, _, options = qkv.launch_args(gqa_plans.prepare(**kw))
            for key in ("K_FP4", "V_FP4", "ksf_ptr", "vsf_ptr"):
                if key in options:
                    seen.setdefault(key, set()).add(options[key] if isinstance(options[key], int) else "tensor")
    codes = {FP4_CODES[name] for name in FP4_PRESETS}
    assert seen["K_FP4"] == codes and seen["V_FP4"] == codes and seen["ksf_ptr"] == seen["vsf_ptr"] == {"tensor"}


def _gpu_matrix_fp4_cases():
    import gpu_matrix as M
    return [GQACase(n=n, d=d, seed=n * 7 + d, **{"hq": 6, "hkv": 3, **v}) for d, n, v in M.gqa_fp4_cases()]


@needs_interpreter
@pytest.mark.parametrize("case", _gpu_matrix_fp4_cases(), ids=lambda c: c.describe())
def test_gpu_matrix_fp4_cases_in_the_interpreter(case):
    """The GPU matrix's 4-bit cases, here in the interpreter (the GPU runs compare the compiled kernel with
    the CPU reference in the same way)."""
    _cross_backends(case)


def test_fp4_global_scale_tensor_checked_with_data_checks(monkeypatch):
    """A global scale given as a tensor is read by the kernel (no synchronization); the data checks
    (KVFUSE_CHECKS) reject one that is not finite and > 0, before anything is written."""
    monkeypatch.setattr(kvfuse.backend, "_checks_override", None)
    kvfuse.set_checks(True)
    case = GQACase(fp4_k="nvfp4", fp4_v="nvfp4", n=3, d=64, slots="contiguous")
    kw, storages, _, _ = build(case)
    kw["rope_args"] = None
    before = [s.clone() for s in storages]
    for bad in (0.0, float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match="v_scale must hold finite numbers > 0"):
            kvfuse.fused_qk_norm_rope_store_kv(**{**kw, "v_scale": torch.tensor([bad])})
    assert all(torch.equal(a, b) for a, b in zip(before, storages))
