"""A Gluon fast path for the MAIN_FP4 KV-cache write: RMSNorm -> RoPE (NEOX or GPT-J) on the last 64
dims -> e2m1 with an e4m3 scale per 16 (NVFP4) -> token-interleaved 288-byte records (256 code
bytes, two codes a byte, then 32 scale bytes), byte for byte what the portable kernel writes
(SPEC §6, §7); also the cast alone (no norm, no RoPE).

The kernel is main_latent's (``main_fp4_kernel`` is ``main_fp8_kernel`` launched with FP4=True):
its layout, loads, norm, RoPE and persistent loop, with MAIN_FP4's cast and store
(``main_latent._quantize_store_fp4``). A lane's 16 columns are exactly one NVFP4 group: amax
in-lane, the lane's own e4m3 scale (numerics.group_scales SF_E4M3), 16 e2m1 codes by
``gluon_common.e2m1_nibble`` (one fp32 addition of a per-binade magic number rounds; its host mirror
equals kvfuse.reference.encode_e2m1 on all 2^32 fp32 inputs), one 64-bit code store and one scale
byte per lane. This module holds the host side: ``supports`` / ``eligible`` (head_dim 512, one head,
MAIN_FP4 records, the cache pointer and strides multiples of 8), the launch table and the direct
write entry. Instruction counts and the design: docs/design.md; timings: docs/performance.md.

The module imports without a GPU and under any Triton; ``available()`` says whether this path can
run (Triton 3.6's Gluon API and a CUDA device); ``enabled()``: on there unless KVFUSE_GLUON=0 or
KVFUSE_GLUON_SKIP names "main_latent_fp4".
"""
from __future__ import annotations

from ... import formats as _formats
from . import common as gluon_common
from . import main_latent as main
from .common import allowed_by_env, available, e2m1_nibble_mirror, gl, gluon  # noqa: F401 (re-exported)

HEAD_DIM = 512
DATA_BYTES = 256             # 512 e2m1 codes, two a byte
RECORD_BYTES = 288           # 256 code bytes + 32 e4m3 scale bytes
ROTARY_DIM = 64
GROUP = 16
CACHE_ALIGN = 8              # the codes leave as 64-bit stores


if gluon is not None:
    # the kernel: main_latent's, launched with FP4=True (its FP4 branch: main_latent._quantize_store_fp4)
    from .main_latent import main_fp8_kernel as main_fp4_kernel


# --------------------------------------------------------------------------- host side
# (main_latent's, for this module's MainRecords)
RECORDS = main.MainRecords("MAIN_FP4", ("e2m1", GROUP, "e4m3"), RECORD_BYTES, DATA_BYTES, CACHE_ALIGN, True)


def supports(x, weight, positions, cos_sin, slot_mapping, kv_cache) -> str:
    """'' when this kernel handles the call, else why not (the caller keeps the plain kernel)."""
    return main.supports_records(RECORDS, x, weight, positions, cos_sin, slot_mapping, kv_cache)


def launch_table(n_rows: int):
    """(num_warps, rows_per_warp, pipeline) per batch size, measured on the H200 with
    benchmarks/tune.py --kernel fast (``benchmarks/results/2026-11-29_h200_s5_gluon_tune*``):
    two one-row warps per CTA up to n = 8192 (n = 1: 1.76 us against 1.85 with one warp; n = 4096:
    4.03 us), then one warp without pipeline (n = 16384: 10.5-10.8 us against 10.7-10.9 with two warps;
    n = 262144: 149.9-151.4 us over six sweeps against 153.6-160.9 pipelined: the
    kernel is issue-bound, and the pipeline's register moves cost more than its early loads save)."""
    return gluon_common.table_entry(LAUNCH_TABLE, n_rows)


# (first n_rows, (num_warps, rows_per_warp, pipeline)): see launch_table
LAUNCH_TABLE = ((1, (2, 1, False)), (8193, (1, 1, False)))


def _launch_parts(tensor, n: int, eps: float, x, weight, positions, cos_sin, slot_mapping, kv_cache,
                  num_warps: int, rows_per_warp: int, pipeline: bool, ctas_per_sm=None, sm_count=None, neox=True):
    """main_latent's ``launch_parts_records`` for MAIN_FP4 records (FP4=True)."""
    return main.launch_parts_records(RECORDS, tensor, n, eps, x, weight, positions, cos_sin, slot_mapping, kv_cache,
                                     num_warps, rows_per_warp, pipeline, ctas_per_sm, sm_count, neox)


# --------------------------------------------------------------------------- kvfuse's dispatch
NAME = "main_latent_fp4"   # in KVFUSE_GLUON_SKIP
FORMATS = (_formats.MAIN_FP4,)   # the preset cache formats it writes (its GPU tests' formats)


def enabled() -> bool:
    """The fused entry point uses this kernel for the calls it fits (``eligible``) unless
    KVFUSE_GLUON=0, KVFUSE_GLUON_SKIP (a comma list) names "main_latent_fp4", or ``available()`` is false."""
    return allowed_by_env(NAME) and available()


# faster than the plain kernel at every measured size (n = 1: 1.76 us against 2.11; n = 256: 2.18 against
# 2.50; benchmarks/results/2026-11-29_h200_s4_gluon_tune_fp4_q.txt)
MIN_ROWS = 1
MIN_ROWS_PDL = 1


def eligible(plan) -> bool:
    """Whether a validated plan is the kernel's MAIN_FP4 chain (main_latent's ``eligible_records``:
    e2m1 / e4m3 scales / g16, records of 256 code bytes then 32 scale bytes, the cache pointer and
    strides multiples of 8)."""
    return gluon_common.one_input_whole_norm(plan) and main.eligible_records(RECORDS, plan)


word_aligned = gluon_common.word_aligned      # x and the weight are read as 4-byte words
call_guard = gluon_common.x_weight_guard      # checked per call (the plan cache keys neither pointer)


def plan_launch(plan, tensor, table=None) -> tuple:
    """(kernel name, grid, positional args, keyword args, namespace) of the kernel for an eligible plan
    (main_latent's ``plan_launch_parts`` with this module's table, or ``table``: see
    kvfuse.kernels.router.fast_paths; the name resolves here, to the kernel, so a stand-in put in its
    place sees the launches)."""
    grid, args, kwargs = main.plan_launch_parts(plan, tensor, table or launch_table, _launch_parts)
    return "main_fp4_kernel", grid, args, kwargs, globals()


def main_latent_fp4_write(x, weight, eps, positions, cos_sin, slot_mapping, kv_cache, *, num_warps: int = 1,
                         rows_per_warp: int = 1, pipeline: bool = False, ctas_per_sm: int = None,
                         is_neox: bool = True) -> None:
    """Write MAIN_FP4 records for the rows of x: main_latent_write's contract and launch, for
    ``CastArgs.from_cache_format(MAIN_FP4)`` and MAIN_FP4 caches (a direct entry for any launch
    variant). Raises ValueError outside this kernel's assumptions
    (``supports``)."""
    parts = main.checked_write_parts(RECORDS, "main_latent_fp4_write", _launch_parts, x, weight, eps, positions,
                                     cos_sin, slot_mapping, kv_cache, num_warps, rows_per_warp, pipeline, ctas_per_sm,
                                     is_neox)
    if parts is not None:
        grid, args, kwargs = parts
        main_fp4_kernel[grid](*args, **kwargs)
