"""The Gluon fast paths (Triton 3.6 on CUDA), each byte-equal to the portable kernel (SPEC §8), one
module per cache served:

| module | serves |
|---|---|
| ``main_latent`` | the main latent cache: MAIN_FP8 records (norm + RoPE + cast), and the cast alone of MAIN_FP8 / MAIN_FP4 |
| ``main_latent_fp4`` | MAIN_FP4 records with norm + RoPE (the ``main_latent`` kernel with its FP4 record) |
| ``flashmla`` | FlashMLA's FLASHMLA_V32 and FLASHMLA_MODEL1 records (e4m3 columns + the bf16 RoPE tail) |
| ``indexer`` | the lightning indexer: its 128-d K cache (four formats, the models' chains) and its Q's (q, sf) |

``common`` holds what they share (shuffles, packing, slot addressing, scales, launch grids). The
protocol, one function or constant per module:

- ``NAME``: the module's name in ``KVFUSE_GLUON_SKIP`` (a comma list of fast paths to leave off;
  ``KVFUSE_GLUON=0`` turns them all off);
- ``enabled() -> bool``: on (Gluon available, not switched off);
- ``MIN_ROWS``: calls with fewer rows (tokens x heads) stay on the portable kernel;
- ``MIN_ROWS_PDL``: the same for calls launched with programmatic dependent launch (the fast path's
  weights load before the wait, the portable kernel's after it, which moves the decode break-even);
- ``eligible(plan) -> bool``: the plan is one this kernel writes;
- ``call_guard(plan) -> (check, fields)``: a per-call check on the call's tensors of those plan fields
  (x and the weight read as 4-byte words, say); a call that fails it takes the portable kernel;
- ``plan_launch(plan, tensor, table=None) -> (kernel name, grid, args, keyword args, namespace)``:
  the launch (``table``: n_rows -> (num_warps, rows, pipeline) in place of the module's
  ``launch_table``; see ``kvfuse.kernels.fused.fast_paths``).

``FAST_PATH_MODULES`` is the order in which ``kvfuse.kernels.fused.fast_path`` asks them: the first
eligible one takes a plan. A new fast path: a module here, its entry in that tuple and in
``common.FAST_PATH_NAMES``, and its test cases (the GPU tests read ``LAUNCH_TABLE`` and ``FORMATS``).
"""
from . import common, flashmla, indexer, main_latent, main_latent_fp4

FAST_PATH_MODULES = (main_latent, main_latent_fp4, flashmla, indexer)
assert tuple(m.NAME for m in FAST_PATH_MODULES) == common.FAST_PATH_NAMES
