"""GPU module (KVFUSE_TEST_GPU=1): the compiled numerics helpers over EVERY fp32 bit pattern.

- the native e4m3 encode without its signed-zero guard (NATIVE_UNGUARDED) equals the integer encoder
  (NATIVE_INTEGER, the SPEC's rounding, checked against the reference in tests/test_kernel_numerics.py)
  and the guarded native encode (NATIVE_GUARDED) on every finite fp32 (|t| > 448 saturates in all three);
- encode_e2m1 (bit-pattern rounding) equals the SPEC's midpoint thresholds on every finite fp32;
- the UE8M0 exponent computed without a division equals ceil(log2(RN(amax / FMAX))) with an IEEE
  division (div_rn) for every amax >= 1e-4 (+inf included), FMAX 448 and 6.
Each kernel counts mismatches with an atomic add and records the first mismatching pattern."""
import pytest
import torch
import triton
import triton.language as tl

import kvfuse
from kvfuse.kernels import numerics as NUM
from kvfuse.kernels.codes import NATIVE_GUARDED, NATIVE_INTEGER, NATIVE_UNGUARDED, SF_UE8M0

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or kvfuse.backend.interpreter_enabled(),
                                reason="needs CUDA and compiled kernels (KVFUSE_TEST_GPU=1)")
BLOCK = 1024
PER_PROGRAM = 16 * BLOCK


@triton.jit
def _e2m1_thresholds(t):
    a = tl.abs(t)
    code = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) \
        + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    return code | ((t.to(tl.uint32, bitcast=True) >> 31).to(tl.int32) << 3)


@triton.jit
def _sweep(start, count, bad_ptr, first_ptr, WHAT: tl.constexpr, FMAX: tl.constexpr, BLOCK: tl.constexpr,
           PER_PROGRAM: tl.constexpr):
    """Patterns start + [0, count) (uint32 arithmetic, wrapping): WHAT 0 e4m3, 1 e2m1, 2 ue8m0,
    3 a planted mismatch at +-1.5 (the negative control)."""
    base = start + tl.program_id(0).to(tl.int64) * PER_PROGRAM
    nbad = tl.zeros([BLOCK], tl.int32)
    first = tl.full([BLOCK], -1, tl.int64)
    for k in tl.static_range(PER_PROGRAM // BLOCK):
        i = base + k * BLOCK + tl.arange(0, BLOCK)
        live = i < start + count
        bits = (i & 0xFFFFFFFF).to(tl.uint32)
        t = bits.to(tl.float32, bitcast=True)
        finite = tl.abs(t) < float("inf")
        if WHAT == 0:
            a = NUM.encode_e4m3(t, NATIVE_UNGUARDED).to(tl.int32)
            b = NUM.encode_e4m3(t, NATIVE_INTEGER).to(tl.int32)
            c = NUM.encode_e4m3(t, NATIVE_GUARDED).to(tl.int32)
            wrong = (a != b) | (a != c)
            check = live & finite
        elif WHAT == 1:
            wrong = NUM.encode_e2m1(t) != _e2m1_thresholds(t)
            check = live & finite
        elif WHAT == 3:
            wrong = t == 1.5
            wrong = wrong | (t == -1.5)
            check = live & finite
        else:
            m, d, stored = NUM.group_scales(t, FMAX, SF_UE8M0, NATIVE_GUARDED)
            s = tl.div_rn(t, FMAX)
            e = ((s.to(tl.int32, bitcast=True) - 1) >> 23) + 1 - 127
            wrong = stored.to(tl.int32) != e + 127
            check = live & (t >= 1e-4)                      # +inf included (e = 128)
        hit = check & wrong
        nbad += hit.to(tl.int32)
        first = tl.where(hit & (first < 0), i, first)
    tl.atomic_add(bad_ptr, tl.sum(nbad, axis=0))
    tl.atomic_max(first_ptr, tl.max(first, axis=0))


def _sweep_all(what: int, fmax: float = 448.0, start: int = 0, count: int = 1 << 32):
    bad = torch.zeros(1, dtype=torch.int32, device="cuda")
    first = torch.full((1,), -1, dtype=torch.int64, device="cuda")
    _sweep[(triton.cdiv(count, PER_PROGRAM),)](start, count, bad, first, WHAT=what, FMAX=fmax, BLOCK=BLOCK,
                                               PER_PROGRAM=PER_PROGRAM, enable_fp_fusion=False)
    torch.cuda.synchronize()
    return int(bad.item()), int(first.item())


def test_native_e4m3_without_guard_every_fp32():
    bad, first = _sweep_all(0)
    assert bad == 0, f"{bad} patterns differ, e.g. 0x{first:08x}"


def test_e2m1_bit_rounding_every_fp32():
    bad, first = _sweep_all(1)
    assert bad == 0, f"{bad} patterns differ, e.g. 0x{first:08x}"


@pytest.mark.parametrize("fmax", [448.0, 6.0])
def test_ue8m0_exponent_every_fp32(fmax):
    bad, first = _sweep_all(2, fmax, 0, 1 << 31)          # the positive patterns
    assert bad == 0, f"{bad} patterns differ, e.g. 0x{first:08x}"


def test_sweep_counts_a_planted_mismatch():
    """Negative control: a check that fails exactly at +-1.5 is counted twice, and the largest
    failing pattern is reported (0xBFC00000 = -1.5)."""
    bad, first = _sweep_all(3)
    assert (bad, first) == (2, 0xBFC00000)
