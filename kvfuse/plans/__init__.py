"""Validation into plans: the one shape of every entry point is validate -> plan -> dispatch.

- :mod:`.types`: the plan types (one validated job per entry point; the reference chain and the
  kernels import only this module), and the template a signature's validation leaves in the plan cache.
- :mod:`.rules`: the argument checks the entry points share (tensors, RoPE, casts, index vectors).
- :mod:`.fused`, :mod:`.gqa`, :mod:`.cache_io`, :mod:`.group`: each entry point's validation, ending
  in its plan (the fused operator, the GQA / MHA entry, store_kv_cache / load_paged_kv_cache, a group).
- :mod:`.cache`: the plan cache (validated signatures, their keys, the on/off switch).
- :mod:`.opargs`: a plan as a custom op's arguments and back, derived from the plan type's fields.

What runs a plan is :mod:`kvfuse.dispatch`.
"""
