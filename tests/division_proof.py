"""Offline proof of kvfuse.kernels.numerics.div_rn_by_reciprocal (the GQA kernel's per-tensor cast), run
as a script (about 5 minutes on two CPU cores; not a test module): Markstein's quotient
q = fma(fma(q0, d, 0 - y), 0 - r, q0), q0 = RN(y * r), r = RN(1 / d), q0 kept where infinite, against
IEEE fp32 division y / d (numpy) for positive d, fma by Triton's interpreter (one rounding).

1. Every bf16 significand and sign at exponent 0 (256 values) x every fp32 significand of d in [1, 2)
   (2^23 values): the quotients' bits. Both operands scale by powers of two without changing any
   rounding while no step leaves the normal range, so this covers the normal range.
2. Every bf16 y (65536: NaN, inf, subnormals, signed zeros) x d = m * 2^k, k in [-64, 64] (the range
   the kernel sends this way), 64 significands m (1, the largest, 62 random): the quotients' bits
   where |y| >= 2^-100, and the e4m3 codes (kvfuse.reference.encode_e4m3 after the clamp) of all,
   NaN quotients excepted (their sign is not the division's; kvfuse's inputs carry no NaN).

Prints the counts of differences; exits 1 if any."""
import sys
import time

import numpy as np
import torch
from triton._C.libtriton import interpreter as _interp

from kvfuse.reference import encode_e4m3


def markstein(y: np.ndarray, d: np.float32) -> np.ndarray:
    r = np.float32(1.0) / d
    dd, rr = np.full(y.shape, d, np.float32), np.full(y.shape, r, np.float32)
    q0 = y * r
    e = _interp.fma_fp32(q0, dd, np.float32(0.0) - y)
    return np.where(np.isinf(q0), q0, _interp.fma_fp32(e, np.float32(0.0) - rr, q0)).astype(np.float32)


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32)


def main() -> int:
    t0 = time.time()
    sig = (np.arange(128, dtype=np.uint32) << 16) | 0x3F800000
    y1 = np.concatenate([sig, sig | 0x80000000]).view(np.float32)
    diff1 = 0
    chunk = 1 << 14
    with np.errstate(all="ignore"):
        for start in range(0, 1 << 23, chunk):
            dsig = (np.arange(start, start + chunk, dtype=np.uint32) | 0x3F800000).view(np.float32)
            for y in y1:
                yv = np.full(dsig.shape, y, np.float32)
                r = np.float32(1.0) / dsig
                q0 = yv * r
                e = _interp.fma_fp32(q0, dsig, np.float32(0.0) - yv)
                q = np.where(np.isinf(q0), q0, _interp.fma_fp32(e, np.float32(0.0) - r, q0)).astype(np.float32)
                diff1 += int((bits(q) != bits(yv / dsig)).sum())
    print(f"1. 256 bf16 significands x 2^23 divisor significands: {diff1} differing quotients "
          f"({time.time() - t0:.0f} s)", flush=True)
    rng = np.random.default_rng(0)
    y = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)
    exact = np.isfinite(y) & (np.abs(y) >= np.float32(2.0) ** -100)
    mants = np.concatenate([np.float32([1.0]), np.uint32([0x3FFFFFFF]).view(np.float32),
                            (rng.integers(0, 1 << 23, 62, dtype=np.uint32) | 0x3F800000).view(np.float32)])
    diff_q = diff_code = pairs = 0
    with np.errstate(all="ignore"):
        for k in range(-64, 65):
            for m in mants:
                d = np.float32(m * np.float32(2.0) ** k)
                want, got = y / d, markstein(y, d)
                diff_q += int((bits(want) != bits(got))[exact].sum())
                keep = ~np.isnan(want)
                codes = [encode_e4m3(torch.from_numpy(np.clip(v[keep], -448, 448))) for v in (want, got)]
                diff_code += int((codes[0] != codes[1]).sum())
                pairs += y.size
    print(f"2. {pairs} (y, d) pairs, |log2 d| <= 64: {diff_q} differing quotients where |y| >= 2^-100, "
          f"{diff_code} differing e4m3 codes ({time.time() - t0:.0f} s)", flush=True)
    return 1 if diff1 or diff_q or diff_code else 0


if __name__ == "__main__":
    sys.exit(main())
