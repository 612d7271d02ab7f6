"""Cases of kvfuse.fused_group (an MLA layer's calls in one launch) shared by the CPU tests (the
interpreter) and tests/gpu/test_gpu_group.py (not a test module itself).

A case is a model configuration, a batch size and how Q is written (in place, or into a given
buffer). :func:`run_layer` builds the case's inputs from its seed on the CPU, moves them to the
device and either runs the layer's calls as one group (``kvfuse.mla.write_layer``) or one by one
(``q_preprocess``, ``write_main_cache``, ``write_indexer_k``, ``quantize_indexer_q``); it returns every
byte the calls could have touched, as CPU uint8 tensors: the whole storages of both caches (random
bytes, with guards around the cache views), q's buffer (written in place or left alone), the
NaN-poisoned q_out, and the index Q's (q, sf). The two ways must return equal bytes.

:func:`gpu_cases` derives the GPU cases from the portable kernel's launch table: for every member of
every layer, the batch sizes at which its rows reach each table entry, and one below.
"""
from __future__ import annotations

import dataclasses
import math

import torch

import kvfuse
from kvfuse import models
from helpers import cos_sin_cache, guarded_cache, random_bf16

MAX_POS = 64
BLOCK_SIZE = 16
LAYERS = {cfg.name: cfg for cfg in (models.DEEPSEEK_V4, models.DEEPSEEK_V4_FP4, models.DEEPSEEK_V4_FLASHMLA,
                                    models.DEEPSEEK_V32, models.DEEPSEEK_V32_UE8M0)}


@dataclasses.dataclass(frozen=True)
class LayerCase:
    model: str = "deepseek-v4"
    n: int = 3
    q_heads: int = 0            # 0: the model's num_heads
    index_heads: int = 0        # 0: the model's index_num_heads
    q_in_place: bool = True     # q_out = q, else a separate NaN-poisoned buffer
    members: tuple = ("q", "kv", "index_k", "index_q")
    seed: int = 0

    @property
    def cfg(self):
        return LAYERS[self.model]


def _slots(n: int, capacity: int, g: torch.Generator) -> torch.Tensor:
    """Distinct valid slots with every fifth token skipped (-1, from the fifth on), as a padded decode batch."""
    slots = torch.randperm(capacity, generator=g)[:n]
    slots[4::5] = -1
    return slots


def inputs(case: LayerCase):
    """The case's inputs on the CPU (caches as (view, storage) of random bytes), the same for every call."""
    cfg, n, g = case.cfg, case.n, torch.Generator().manual_seed(case.seed)
    hq = case.q_heads or cfg.num_heads
    hi = case.index_heads or cfg.index_num_heads
    blocks = max(2, math.ceil(n / BLOCK_SIZE) + 1)
    main = cfg.main_format
    kv_dim = main.head_dim
    # V3 / V3.2's [latent | k_pe] record: the engine hands the FlashMLA write a normalized latent (no norm)
    kv_norm = None if cfg.splits_k_pe() else (1 + 0.1 * torch.randn(kv_dim, generator=g)).bfloat16()
    q_norm = (1 + 0.1 * torch.randn(cfg.qk_head_dim, generator=g)).bfloat16() if cfg.q_norm else None
    inputs = dict(
        positions=torch.randint(0, MAX_POS, (n,), generator=g),
        cos_sin=cos_sin_cache(MAX_POS, cfg.qk_rope_head_dim),
        q=random_bf16((n, hq, cfg.qk_head_dim), case.seed + 1),
        q_norm_weight=q_norm,
        kv=random_bf16((n, kv_dim), case.seed + 2),
        kv_norm_weight=kv_norm,
        kv_cache=guarded_cache(main, blocks, BLOCK_SIZE, seed=case.seed + 3),
        slot_mapping=_slots(n, blocks * BLOCK_SIZE, g),
    )
    if cfg.index_format is not None:
        inputs.update(
            index_k=random_bf16((n, cfg.index_head_dim), case.seed + 4),
            index_norm_weight=(1 + 0.1 * torch.randn(cfg.index_head_dim, generator=g)).bfloat16(),
            index_norm_bias=(0.1 * torch.randn(cfg.index_head_dim, generator=g)).bfloat16()
            if cfg.index_norm_kind == "layer" else None,
            index_cache=guarded_cache(cfg.index_format, blocks, BLOCK_SIZE, seed=case.seed + 5),
            index_slot_mapping=_slots(n, blocks * BLOCK_SIZE, g),
            index_q=random_bf16((n, hi, cfg.index_head_dim), case.seed + 6),
        )
    return inputs


def run_layer(case: LayerCase, device, grouped: bool) -> dict:
    """Every byte the case's calls could touch (CPU uint8), run as one group or one call at a time."""
    cfg = case.cfg
    raw = inputs(case)
    dev = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in raw.items()
           if k not in ("kv_cache", "index_cache")}
    kv_cache, kv_storage = raw["kv_cache"]
    kv_storage = kv_storage.to(device)
    kv_cache = torch.as_strided(kv_storage, kv_cache.shape, kv_cache.stride(), kv_cache.storage_offset())
    q = dev["q"]
    q_out = q if case.q_in_place else torch.full_like(q, float("nan"))
    found = {}
    args = dict(q=q, q_norm_weight=dev["q_norm_weight"], q_out=q_out, kv=dev["kv"],
                kv_norm_weight=dev["kv_norm_weight"], kv_cache=kv_cache, slot_mapping=dev["slot_mapping"])
    if cfg.index_format is not None:
        index_cache, index_storage = raw["index_cache"]
        index_storage = index_storage.to(device)
        index_cache = torch.as_strided(index_storage, index_cache.shape, index_cache.stride(),
                                       index_cache.storage_offset())
        args.update(index_k=dev["index_k"], index_norm_weight=dev["index_norm_weight"],
                    index_norm_bias=dev["index_norm_bias"], index_cache=index_cache,
                    index_slot_mapping=dev["index_slot_mapping"], index_q=dev["index_q"])
        found["index_storage"] = index_storage
    keep = {"q": ("q", "q_norm_weight", "q_out"), "kv": ("kv", "kv_norm_weight", "kv_cache", "slot_mapping"),
            "index_k": ("index_k", "index_norm_weight", "index_norm_bias", "index_cache", "index_slot_mapping"),
            "index_q": ("index_q",)}
    chosen = {k: v for k, v in args.items() if any(k in keep[m] for m in case.members)}
    pos, cs = dev["positions"], dev["cos_sin"]
    if grouped:
        res = kvfuse.mla.write_layer(cfg, pos, cs, **chosen)
    else:
        res = {}
        if "q" in case.members:
            res["q"] = kvfuse.mla.q_preprocess(cfg, q, pos, cs, chosen["q_norm_weight"], out=q_out)
        if "kv" in case.members:
            kvfuse.mla.write_main_cache(cfg, dev["kv"], pos, cs, chosen["kv_norm_weight"], kv_cache,
                                        dev["slot_mapping"])
        if "index_k" in case.members:
            kvfuse.mla.write_indexer_k(cfg, dev["index_k"], pos, cs, chosen["index_norm_weight"], index_cache,
                                       dev["index_slot_mapping"], chosen["index_norm_bias"])
        if "index_q" in case.members:
            res["index_q"] = kvfuse.mla.quantize_indexer_q(cfg, dev["index_q"], pos, cs)
    found.update(kv_storage=kv_storage, q=q, q_out=q_out)
    if "q" in res:
        found["q_result"] = res["q"]
    if "index_q" in res:
        found["index_q"], found["index_sf"] = res["index_q"]
    return {k: v.detach().cpu().contiguous().view(torch.uint8) if v.dtype != torch.uint8 else v.detach().cpu()
            for k, v in found.items() if v is not None}


def member_rows(case: LayerCase) -> dict:
    """member -> (rows per token, head_dim, cast_fmt) of its portable-kernel launch."""
    cfg = case.cfg
    rows = {"q": (case.q_heads or cfg.num_heads, cfg.qk_head_dim, None),
            "kv": (1, cfg.main_format.head_dim, cfg.main_format.cast_fmt)}
    if cfg.index_format is not None:
        rows["index_k"] = (1, cfg.index_head_dim, cfg.index_format.cast_fmt)
        rows["index_q"] = (case.index_heads or cfg.index_num_heads, cfg.index_head_dim, cfg.index_format.cast_fmt)
    return {m: rows[m] for m in case.members if m in rows}


def table_sizes(case: LayerCase, max_n: int) -> list:
    """Batch sizes at which some member's rows reach an entry of the portable kernel's launch table
    (kvfuse.kernels.portable.plain_launch_table, the table its own call uses), and one token fewer."""
    from kvfuse.kernels.portable import next_pow2, plain_launch_table

    sizes = set()
    for heads, head_dim, cast in member_rows(case).values():
        for first_rows, _ in plain_launch_table(next_pow2(head_dim), cast):
            n = -(-first_rows // heads)
            sizes.update(v for v in (n - 1, n) if 1 <= v <= max_n)
    return sorted(sizes)


def gpu_cases() -> list:
    """(case, pdl) of the GPU test: every layer at every table size the one-launch path can meet (up to
    kvfuse.dispatch.GROUP_ONE_LAUNCH_MAX_N tokens), Q in place and not, PDL on at the decode sizes (a
    launch attribute: the bytes must not change); one size past the limit (the calls one by one)."""
    from kvfuse.dispatch import GROUP_ONE_LAUNCH_MAX_N as limit

    cases = []
    for model in LAYERS:
        base = LayerCase(model=model)
        for n in table_sizes(base, limit) + [limit]:
            cases.append((dataclasses.replace(base, n=n, seed=n), False))
            if n <= 256:
                cases.append((dataclasses.replace(base, n=n, seed=n + 1, q_in_place=False), True))
    cfg = LAYERS["deepseek-v4"]
    # two- and three-member groups (the slots past NUM unused), and past the one-launch limit (Q: 8 heads)
    cases.append((LayerCase(model=cfg.name, n=7, members=("q", "kv")), False))
    cases.append((LayerCase(model=cfg.name, n=7, members=("kv", "index_k", "index_q")), True))
    cases.append((LayerCase(model=cfg.name, n=limit + 1, q_heads=8, seed=5), False))
    return sorted(set(cases), key=lambda c: (c[0].model, c[0].n, c[1]))
