"""A Gluon fast path for ONE workload: the MAIN_FP4 KV-cache write (RMSNorm -> NEOX RoPE on the
last 64 dims -> e2m1 with e4m3 scales per 16 (NVFP4) -> token-interleaved 288-byte records), byte
for byte what ``kvfuse.kernels.fused.fused_kernel`` writes (SPEC §2, §4).

Assumptions (``supports`` / ``eligible`` check them; anything else goes to the plain kernel):
head_dim 512, num_heads 1, x bf16 [n, 512] with unit column stride (rows 4-byte aligned: read as
int32 words); RMSNorm weight [512] bf16 or fp32; positions int32/int64 [n]; cos_sin [P, 64] fp32 or
bf16 (cos | sin); slot_mapping int32/int64 [n]; kv_cache uint8 [num_blocks, block_size, 1, 288] in
the MAIN_FP4 layout (record = 256 data bytes: 512 e2m1 codes, two a byte, the even element in the
low nibble | 32 e4m3 scale bytes, one per group of 16), the cache pointer and both strides multiples
of 8 (each lane's codes leave as one 64-bit store; the format makes the strides multiples of 32).

The kernel is gluon_main_fp8's (``main_fp4_kernel`` is ``main_fp8_kernel``, launched with FP4=True):
its layout, loads, ``norm_rope`` and persistent loop; this module gives the cast and the store
(``_quantize_store``, the kernel's FP4 branch). Layout:
- a row (one token) is held by ONE warp: lane l = 4 * d1 + d2 owns the 16 contiguous columns
  16 l .. 16 l + 15 as 8 int32 words (two bf16 each), [R, 8, 4, 8] per CTA of R = ROWS_PER_WARP *
  num_warps rows; RMSNorm's adjacent-pairs tree in-lane then 5 butterflies; y = bf16((x * rstd) * w)
  packed two per word; RoPE on the pair layout with the 128-byte shared-memory hop to lanes 28..31.
- a lane's 16 columns are EXACTLY one NVFP4 group: amax in-lane (no shuffle), and each lane computes
  its group's scale: s = min(max(amax / 6, 2^-9), 448) (div_rn), its e4m3 code by the native
  conversion and the code's exact value d, the multiplier m = 1 / d (div_rn; gluon_index's
  ``_scales``), t = y * m and the 16 e2m1 codes (``_e2m1_nibble``), packed into 8 bytes (byte k:
  column 16 l + 2k in the low nibble, 16 l + 2k + 1 in the high one) = ONE 64-bit store per lane at
  record byte 8 l; the lane's scale byte at record byte 256 + l (the 32 lanes write 32 consecutive
  bytes).
- a persistent grid (at most what is resident at once) walks over the row tiles; the weight is
  loaded once per CTA. PIPELINE=True loads the next tile during this one's arithmetic.

Numerics mirror the plain kernel exactly: fp32 ops rounded one by one (enable_fp_fusion=False: no
FMA; the PTX has no fma / .approx / div.full), div_rn/sqrt_rn, native bf16 rounding (cvt.rn),
NaN-ignoring max (max.f32) for amax floored at 1e-4 (AMAX_MARGIN), numerics.group_scales SF=2 (the
e4m3 scale by cvt.rn.satfinite.e4m3x2.f32, decoded exactly: the signed-zero guard of the plain
kernel's encode cannot fire, s >= 2^-9) -- the arithmetic of INDEX_NVFP4 in gluon_index, proven
byte-equal on the H200. The e2m1 encoder is not the plain kernel's instructions but gives
numerics.encode_e2m1's codes for every fp32 input (NaN aside: SPEC §2 leaves its group free):
``_e2m1_nibble`` rounds with one fp32 addition of a per-binade magic number (8 SASS instructions a
value from t = y * m to the signed nibble; 66 instructions a row fewer than with gluon_index's
``_e2m1``, packing included); its host mirror
``e2m1_nibble_mirror`` was checked against kvfuse.reference.encode_e2m1 on all 2^32 fp32 patterns
(benchmarks/gluon_check_main_fp4.py --prove-encoder; 0 differ). INDEX_NVFP4 (gluon_index) uses the
same encoder.

SASS, offline (sm_90, Triton 3.6, enable_fp_fusion=False; bf16 weight, int32 indices, fp32 cos/sin,
16-byte-aligned pointers; the persistent loop body, IEEE div/sqrt slow paths not counted), warp-
instructions per row: 448 with PIPELINE (one warp; 71 registers), 423 without (63 registers; the same
at four warps, 70 registers); gluon_main_fp8 counted the same way: 318 / 295. With gluon_index's
former ``_e2m1`` (12 instructions a value): 506 / 489. The plain fused_kernel's whole program for MAIN_FP4: ~912
per row (BLOCK_M 2). Per row the loop loads x as two 16-byte loads a lane, the RoPE pair (two
2-byte loads), position, slot and cos/sin (32-bit loads), and stores one 64-bit word and one byte a
lane. Time: the report of benchmarks/gluon_check_main_fp4.py (not yet run on the H200).

The module imports without a GPU and under any Triton; ``available()`` says whether this path can
run (Triton 3.6's Gluon API and a CUDA device); ``enabled()``: on there unless KVFUSE_GLUON=0 or
KVFUSE_GLUON_SKIP names "main_fp4".
"""
from __future__ import annotations

from . import gluon_common
from . import gluon_main_fp8 as main
from .gluon_common import allowed_by_env, available, e2m1_nibble_mirror, gl, gluon  # noqa: F401 (re-exported)

HEAD_DIM = 512
DATA_BYTES = 256             # 512 e2m1 codes, two a byte
RECORD_BYTES = 288           # 256 code bytes + 32 e4m3 scale bytes
ROTARY_DIM = 64
GROUP = 16
CACHE_ALIGN = 8              # the codes leave as 64-bit stores


if gluon is not None:
    # the kernel: gluon_main_fp8's, launched with FP4=True (its FP4 branch: gluon_main_fp8._quantize_store_fp4)
    from .gluon_main_fp8 import main_fp8_kernel as main_fp4_kernel


# --------------------------------------------------------------------------- host side
# (gluon_main_fp8's, for this module's MainRecords)
RECORDS = main.MainRecords("MAIN_FP4", ("e2m1", GROUP, "e4m3"), RECORD_BYTES, DATA_BYTES, CACHE_ALIGN, True)


def supports(x, weight, positions, cos_sin, slot_mapping, kv_cache) -> str:
    """'' when this kernel handles the call, else why not (the caller keeps the plain kernel)."""
    return main.supports_records(RECORDS, x, weight, positions, cos_sin, slot_mapping, kv_cache)


def launch_table(n_rows: int):
    """(num_warps, rows_per_warp, pipeline) per batch size, measured on the H200 with
    benchmarks/gluon_tune.py (``benchmarks/results/2026-11-29_h200_s5_gluon_tune*``):
    two one-row warps per CTA up to n = 8192 (n = 1: 1.76 us against 1.85 with one warp; n = 4096:
    4.03 us), then one warp without pipeline (n = 16384: 10.5-10.8 us against 10.7-10.9 with two warps;
    n = 262144: 149.9-151.4 us over six sweeps against 153.6-160.9 pipelined: the
    kernel is issue-bound, and the pipeline's register moves cost more than its early loads save)."""
    return gluon_common.table_entry(LAUNCH_TABLE, n_rows)


# (first n_rows, (num_warps, rows_per_warp, pipeline)): see launch_table
LAUNCH_TABLE = ((1, (2, 1, False)), (8193, (1, 1, False)))


def _launch_parts(tensor, n: int, eps: float, x, weight, positions, cos_sin, slot_mapping, kv_cache,
                  num_warps: int, rows_per_warp: int, pipeline: bool, ctas_per_sm=None, sm_count=None, neox=True):
    """gluon_main_fp8's ``launch_parts_records`` for MAIN_FP4 records (FP4=True)."""
    return main.launch_parts_records(RECORDS, tensor, n, eps, x, weight, positions, cos_sin, slot_mapping, kv_cache,
                                     num_warps, rows_per_warp, pipeline, ctas_per_sm, sm_count, neox)


# --------------------------------------------------------------------------- kvfuse's dispatch
def enabled() -> bool:
    """The fused entry point uses this kernel for the calls it fits (``eligible``) unless
    KVFUSE_GLUON=0, KVFUSE_GLUON_SKIP (a comma list) names "main_fp4", or ``available()`` is false."""
    return allowed_by_env("main_fp4") and available()


# faster than the plain kernel at every measured size (n = 1: 1.76 us against 2.11; n = 256: 2.18 against
# 2.50; benchmarks/results/2026-11-29_h200_s4_gluon_tune_fp4_q.txt)
MIN_ROWS = 1


def eligible(plan) -> bool:
    """Whether a validated plan is the kernel's MAIN_FP4 chain (gluon_main_fp8's ``eligible_records``:
    e2m1 / e4m3 scales / g16, records of 256 code bytes then 32 scale bytes, the cache pointer and
    strides multiples of 8)."""
    return main.eligible_records(RECORDS, plan)


word_aligned = gluon_common.word_aligned      # x and the weight are read as 4-byte words
call_guard = gluon_common.x_weight_guard      # checked per call (the plan cache keys neither pointer)


def plan_launch(plan, tensor) -> tuple:
    """(kernel name, grid, positional args, keyword args, namespace) of the kernel for an eligible plan
    (gluon_main_fp8's ``plan_launch_parts`` with this module's table; the name resolves here, to the
    kernel, so a stand-in put in its place sees the launches)."""
    grid, args, kwargs = main.plan_launch_parts(plan, tensor, launch_table, _launch_parts)
    return "main_fp4_kernel", grid, args, kwargs, globals()


def gluon_main_fp4_write(x, weight, eps, positions, cos_sin, slot_mapping, kv_cache, *, num_warps: int = 1,
                         rows_per_warp: int = 1, pipeline: bool = False, ctas_per_sm: int = None,
                         is_neox: bool = True) -> None:
    """Write MAIN_FP4 records for the rows of x: gluon_main_fp8_write's contract and launch, for
    ``CastArgs.from_cache_format(MAIN_FP4)`` and MAIN_FP4 caches (the direct entry of
    benchmarks/gluon_check_main_fp4.py). Raises ValueError outside this kernel's assumptions
    (``supports``)."""
    parts = main.checked_write_parts(RECORDS, "gluon_main_fp4_write", _launch_parts, x, weight, eps, positions,
                                     cos_sin, slot_mapping, kv_cache, num_warps, rows_per_warp, pipeline, ctas_per_sm,
                                     is_neox)
    if parts is not None:
        grid, args, kwargs = parts
        main_fp4_kernel[grid](*args, **kwargs)
