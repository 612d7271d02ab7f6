"""The Gluon fast paths (Triton 3.6 on CUDA), each byte-equal to the portable kernel (SPEC §6), one
module per cache served:

| module | serves |
|---|---|
| ``main_latent`` | the main latent cache: MAIN_FP8 and MAIN_MXFP8 records (norm + RoPE + cast), and the cast alone of those and MAIN_FP4 |
| ``main_latent_fp4`` | MAIN_FP4 records with norm + RoPE (the ``main_latent`` kernel with its FP4 record) |
| ``flashmla`` | FlashMLA's FLASHMLA_V32 and FLASHMLA_MODEL1 records (e4m3 columns + the bf16 RoPE tail) |
| ``indexer`` | the lightning indexer: its 128-d K cache (four formats, the models' chains) and its Q's (q, sf) |

``common`` holds what they share (shuffles, packing, slot addressing, scales, launch grids). What each
module provides (NAME, FORMATS, LAUNCH_TABLE, MIN_ROWS, MIN_ROWS_PDL, enabled, eligible, call_guard,
plan_launch) is the protocol ``kvfuse.kernels.router.FastPath``; the router's ``FAST_PATH_MODULES``
registers them, checked against it at import, in the order ``router.fast_path`` asks them (the first
eligible one takes a plan).
"""
from . import common, flashmla, indexer, main_latent, main_latent_fp4  # noqa: F401
