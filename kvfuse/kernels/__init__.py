"""The Triton kernels of kvfuse and their host code, by room:

- ``router``: which kernel takes a call (a Gluon fast path or the portable kernel), PDL, the launches kept
  per call signature (run_plan, run_template), the store / load entry points, the fast-path registry
  (``FastPath``, ``FAST_PATH_MODULES``) and the ``fast_paths`` override. kvfuse.dispatch calls it.
- ``portable``: the portable kernel (``fused_kernel``, its body ``fused_rows``), its launch table and the
  parameter table of a plan (``fused_args``); ``grouped``: several calls of it in one launch; ``qkv``: the
  GQA / MHA kernel; ``store_load``: the paged cache's store and load kernels.
- ``blocks`` (the @triton.jit building blocks those kernels share), ``numerics`` (SPEC §6's exact
  narrowing, encodes and scales), ``codes`` (the constexpr switches' names).
- ``config`` (interpreter or compiled, native conversions, force_config), ``launcher`` (a launch kept
  for a signature, the direct launcher).
- ``gluon``: the Gluon fast paths (Triton 3.6 on CUDA), byte-equal to the portable kernel.
"""
