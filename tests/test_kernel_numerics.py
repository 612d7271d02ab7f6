"""The Triton numerics helpers (kvfuse/kernels/numerics.py) against the reference encoders and the
SPEC's formulas, value by value, in Triton's interpreter (tests/conftest.py sets it): the e2m1 and
e4m3 encoders on every bf16 value in range, the rounding midpoints and their neighbours and random
fp32 values; the UE8M0 exponent (computed without a division) on every positive bf16 and random
fp32 amax, and on FMAX * 2^k and its neighbours, against e = ceil(log2(amax / FMAX)) with an IEEE
division (numpy float32)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from kvfuse import reference as R
from kvfuse.kernels import numerics as NUM
from kvfuse.kernels.codes import CAST_E2M1, CAST_E4M3, NATIVE_INTEGER, SF_UE8M0

BLOCK = 1 << 14


@triton.jit
def _encode_kernel(t_ptr, out_ptr, n, CAST: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    t = tl.load(t_ptr + i, mask=m, other=0.0)
    if CAST == CAST_E4M3:
        c = NUM.encode_e4m3(t, NATIVE_INTEGER).to(tl.int32)
    else:
        c = NUM.encode_e2m1(t)
    tl.store(out_ptr + i, c, mask=m)


@triton.jit
def _ue8m0_kernel(a_ptr, out_ptr, n, FMAX: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    amax = tl.load(a_ptr + i, mask=m, other=1.0)
    mult, d, stored = NUM.group_scales(amax, FMAX, SF_UE8M0, NATIVE_INTEGER)
    tl.store(out_ptr + i, stored.to(tl.int32), mask=m)


def _run(kernel, values: np.ndarray, **meta) -> np.ndarray:
    t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    out = torch.empty(t.shape, dtype=torch.int32)
    kernel[(triton.cdiv(t.numel(), BLOCK),)](t, out, t.numel(), BLOCK=BLOCK, **meta)
    return out.numpy()


def _f32(bits) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def _neighbours(points, ulps=3) -> np.ndarray:
    """Each point and its `ulps` fp32 neighbours on both sides, both signs."""
    b = np.asarray(points, dtype=np.float32).view(np.uint32).astype(np.int64)
    near = (b[:, None] + np.arange(-ulps, ulps + 1)[None, :]).reshape(-1)
    v = _f32(near[near > 0])
    return np.concatenate([v, -v])


def _all_bf16(lo: float, hi: float) -> np.ndarray:
    v = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)
    return v[np.isfinite(v) & (np.abs(v) >= lo) & (np.abs(v) <= hi)]


@pytest.mark.parametrize("cast", ["e2m1", "e4m3"])
def test_encoders_equal_the_reference(cast):
    fmax = 6.0 if cast == "e2m1" else 448.0
    grid = R.E2M1_VALUES if cast == "e2m1" else tuple(float(v) for v in
                                                         R.decode_e4m3(torch.arange(0x7F, dtype=torch.uint8)))
    grid = np.array(sorted(set(grid)), dtype=np.float64)
    mids = (grid[1:] + grid[:-1]) / 2
    rng = np.random.default_rng(0)
    values = np.concatenate([
        _all_bf16(0.0, fmax), _neighbours(np.concatenate([mids, grid[1:]])),
        rng.uniform(-fmax, fmax, 1 << 18).astype(np.float32),
        _f32(rng.integers(0, 1 << 23, 4096)), -_f32(rng.integers(0, 1 << 23, 4096)),      # fp32 subnormals
        np.array([0.0, -0.0, fmax, -fmax], dtype=np.float32)])
    got = _run(_encode_kernel, values, CAST=(CAST_E4M3 if cast == "e4m3" else CAST_E2M1).value)
    enc = R.encode_e4m3 if cast == "e4m3" else R.encode_e2m1
    want = enc(torch.from_numpy(values)).numpy().astype(np.int32)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, f"{bad.size} of {values.size} differ, e.g. t={values[bad[:5]]}: {got[bad[:5]]} vs {want[bad[:5]]}"


def test_e2m1_saturates_above_six():
    values = np.array([6.0, 6.5, 7.0, 7.5, 100.0, 3e38, -6.5, -448.0], dtype=np.float32)
    got = _run(_encode_kernel, values, CAST=CAST_E2M1.value)
    assert got.tolist() == [7, 7, 7, 7, 7, 7, 15, 15]


@pytest.mark.parametrize("fmax", [448.0, 6.0])
def test_ue8m0_exponent_without_division(fmax):
    rng = np.random.default_rng(1)
    finite_max = np.float32(3.4028235e38)
    powers = np.float32(fmax) * np.float32(2.0) ** np.arange(-30, 118, dtype=np.float32)
    values = np.concatenate([
        _all_bf16(1e-4, 3e38), _neighbours(powers[(powers >= 1e-4) & (powers <= finite_max)], ulps=4),
        _f32(rng.integers(0x38D1B717, 0x7F7FFFFF, 1 << 18)),          # random fp32 in [1e-4, max]
        np.array([1e-4, finite_max], dtype=np.float32)])
    values = np.abs(values[(np.abs(values) >= np.float32(1e-4)) & np.isfinite(values)])
    got = _run(_ue8m0_kernel, values, FMAX=fmax)
    s = values / np.float32(fmax)                                       # IEEE float32 division
    e = ((s.view(np.int32).astype(np.int64) - 1) >> 23) + 1 - 127
    bad = np.nonzero(got != e + 127)[0]
    assert bad.size == 0, f"{bad.size} of {values.size} differ, e.g. amax={values[bad[:5]]}"
    assert _run(_ue8m0_kernel, np.array([np.inf], dtype=np.float32), FMAX=fmax).tolist() == [255]   # s = inf


def _unary_minus_in_jit_functions(source: str) -> list:
    """Unary minus on a non-constant inside functions decorated with a jit (triton.jit, gluon.jit)."""
    import ast
    found = []
    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in fn.decorator_list):
            found += [f"{fn.name}: {ast.unparse(node)}" for node in ast.walk(fn)
                      if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
                      and not isinstance(node.operand, ast.Constant)]
    return found


def test_kernels_write_no_unary_minus():
    """Triton 3.6 (the GPU's) compiles a float's unary minus as 0 - x, Triton 3.9 (the interpreter's and
    CI's) as a sign flip: they differ on +0, so a kernel whose bytes depend on -(+0) would pass on the CPU
    and differ on the GPU. Kernels write 0 - x (or multiply by -1, or flip the sign bit) instead."""
    from pathlib import Path
    kernels = Path(NUM.__file__).parent
    found = [f"{p.relative_to(kernels)} {hit}" for p in sorted(kernels.rglob("*.py"))
             for hit in _unary_minus_in_jit_functions(p.read_text())]
    assert not found, found
    assert _unary_minus_in_jit_functions("@triton.jit\ndef f(x):\n    return -x\n")     # the check can fail


@triton.jit
def _div_kernel(y_ptr, d_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    y = tl.load(y_ptr + i, mask=m, other=1.0)
    d = tl.load(d_ptr)
    q = NUM.div_rn_by_reciprocal(y, d, tl.div_rn(1.0, d))
    tl.store(out_ptr + i, q.to(tl.int32, bitcast=True), mask=m)


# the divisor's significand: 1, the largest, and random ones; its exponent: 2^-64 .. 2^64 (the range the
# GQA kernel sends this way) in steps that reach both ends
_DIVISORS = [np.float32(m) * np.float32(2.0) ** k for m in (1.0, _f32(0x3FFFFFFF), 1.37109375, 1.9990234, 1.5000001)
             for k in (-64, -40, -17, -3, 0, 1, 9, 31, 64)]


def test_division_by_reciprocal_is_ieee_on_every_bf16():
    """div_rn_by_reciprocal (the GQA kernel's per-tensor cast) against numpy's IEEE fp32 division, bit for
    bit, for every bf16 value (NaN, inf, subnormals, signed zeros) over positive divisors spanning the
    range it serves, wherever |y| >= 2^-100 (its remainder is exact there); below, |y / d| < 2^-36 and the e4m3
    codes (signed zeros) are compared instead. The offline proof (every bf16 significand x every fp32
    divisor significand) is in docs/design.md."""
    y = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)
    yt = torch.from_numpy(y)
    exact = ~np.isfinite(y) | (np.abs(y) >= np.float32(2.0) ** -100) | (y == 0)
    for d in _DIVISORS:
        out = torch.empty(y.shape, dtype=torch.int32)
        _div_kernel[(triton.cdiv(y.size, BLOCK),)](yt, torch.tensor([d]), out, y.size, BLOCK=BLOCK)
        got = out.numpy().view(np.float32)
        with np.errstate(all="ignore"):
            want = y / d
        same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
        assert same[exact].all(), (d, y[exact & ~same][:5], got[exact & ~same][:5], want[exact & ~same][:5])
        codes = [R.encode_e4m3(torch.from_numpy(v[~exact])) for v in (got, want)]
        assert torch.equal(*codes) and (np.abs(got[~exact]) < 2.0 ** -36).all(), d


def test_division_by_reciprocal_needs_its_correction():
    """A control: the uncorrected q0 = y * (1 / d) differs from the IEEE quotient on some bf16 values,
    so the test above can fail."""
    y = (np.arange(1 << 15, dtype=np.uint32) << 16).view(np.float32)[1:0x7F80]   # positive finite
    d = np.float32(1.37109375 * 2.0 ** -3)
    with np.errstate(all="ignore"):
        assert ((y * (np.float32(1.0) / d)).view(np.uint32) != (y / d).view(np.uint32)).any()
