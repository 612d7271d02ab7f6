"""The compulsory-byte model: the DRAM bytes one call must move at least (:func:`moved_bytes`, by
component), applied to a point's actual inputs by :func:`input_bytes` (a cos/sin row once per distinct
in-range position, the weight once, nothing for a token whose slot is invalid). Effective bandwidth is
these bytes over the GPU time; every peer of a point is charged the same bytes.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import torch

from .inputs import MAX_POSITION, Inputs
from .workloads import WORKLOADS, Workload

ACCOUNTING = ("compulsory DRAM bytes per call, computed from the inputs: x, positions and slots read once, "
              "records / outputs written once, the norm weight (and bias) once, one cos/sin row per distinct "
              "in-range position")


def moved_bytes(wl: Workload, n: int, index_bytes: int = 4, cos_sin_bytes: int = 4,
                weight_bytes: int = 2, cos_sin_rows: Optional[int] = None, written: Optional[int] = None,
                slot_bytes: Optional[int] = None) -> Dict[str, int]:
    """Compulsory DRAM bytes of one call (the effective-bandwidth numerator), by component.

    Every byte that must cross DRAM at least once, counted once per call:

    - read: x (bf16) of the tokens processed, their positions and, for a write, the whole
      slot_mapping; the norm weight (and bias) once; ``cos_sin_rows`` rows of the cos/sin table
      (``rotary_dim * cos_sin_bytes`` each): one per DISTINCT in-range position of the call, however
      many tokens share it (:func:`cos_sin_rows`; ``None``: every token at its own position, at most
      MAX_POSITION rows);
    - written: the cache record bytes a write touches (quantized data + exact scales + bf16 tail;
      reserved bytes, even where a format writes them as zeros, and padding excluded), the bf16 out, or
      (q, sf);
    - GQA (:func:`_gqa_bytes`): q, k, v read and q written (bf16), the K and V cache elements
      written, the two norm weights once, the cos/sin rows as above, positions and slots (the fp8
      scales' 8 bytes left out).

    ``written``: for a write, the tokens with a valid slot (default n); a token whose slot is invalid
    writes nothing and needs no x, position or cos/sin row, only its slot. Intermediates of unfused
    peers are not counted: every peer of a point is charged the same bytes. :func:`input_bytes`
    applies this model to actual inputs.
    """
    if wl.kind == "gqa":
        return _gqa_bytes(wl, n, index_bytes, cos_sin_bytes, weight_bytes, cos_sin_rows, slot_bytes)
    if wl.kind == "group":      # as _group_bytes: the members', the positions and cos/sin rows they share once
        b = {}
        for i, name in enumerate(wl.members):
            part = moved_bytes(WORKLOADS[name], n, index_bytes, cos_sin_bytes, weight_bytes, cos_sin_rows,
                               slot_bytes=slot_bytes)
            b.update((f"{name}.{k}", v) for k, v in part.items() if k != "total"
                     and not (i and k in ("positions", "cos_sin")))
        b["total"] = sum(b.values())
        return b
    tokens = n if wl.kind != "write" or written is None else written
    rows = tokens * wl.num_heads
    if cos_sin_rows is None:
        cos_sin_rows = min(tokens, MAX_POSITION)
    b = {"x": rows * wl.head_dim * 2}
    if wl.norm:
        b["norm_weight"] = wl.norm_width * weight_bytes * (2 if wl.norm_bias else 1)
    if wl.rope:
        b["cos_sin"] = cos_sin_rows * wl.rotary_dim * cos_sin_bytes
        b["positions"] = tokens * index_bytes
    if wl.kind == "write":
        b["slots"] = n * (index_bytes if slot_bytes is None else slot_bytes)
        b["cache_data"] = rows * wl.fmt.quant_bytes
        b["cache_scales"] = rows * wl.fmt.sf_exact_bytes
        if wl.fmt.bf16_tail:
            b["cache_tail"] = rows * 2 * wl.fmt.bf16_tail
    elif wl.kind == "q_pre":
        b["out"] = rows * wl.head_dim * 2
    else:
        b["q"] = rows * wl.fmt.quant_bytes
        b["sf"] = rows * wl.fmt.sf_exact_bytes
    b["total"] = sum(b.values())
    return b


def cos_sin_rows(positions: torch.Tensor, table_rows: int) -> int:
    """The cos/sin rows a call must read: its distinct positions inside [0, table_rows) (a position
    outside the table rotates by the identity and reads no row)."""
    p = positions.reshape(-1)
    return int(p[(p >= 0) & (p < table_rows)].unique().numel())


def input_bytes(wl: Workload, inp: "Inputs") -> Dict[str, int]:
    """:func:`moved_bytes` of one call on these inputs: the distinct positions, the valid slots and
    the element sizes of the actual tensors."""
    if wl.kind == "group":
        return _group_bytes(wl, inp)
    positions, written = inp.positions, None
    if wl.kind == "write":
        capacity = inp.cache.shape[0] * inp.cache.shape[1]
        valid = (inp.slots >= 0) & (inp.slots < capacity)
        written = int(valid.sum())
        positions = positions[valid]
    return moved_bytes(wl, inp.n, index_bytes=inp.positions.element_size(),
                       cos_sin_bytes=inp.cos_sin.element_size(),
                       weight_bytes=inp.weight.element_size() if inp.weight is not None else 2,
                       cos_sin_rows=cos_sin_rows(positions, inp.cos_sin.shape[0]), written=written,
                       slot_bytes=inp.slots.element_size() if inp.slots is not None else None)


def _group_bytes(wl: Workload, inp: "Inputs") -> Dict[str, int]:
    """The members' bytes, by member, with the positions and cos/sin rows they share counted once."""
    b = {}
    for i, (name, m) in enumerate(zip(wl.members, inp.members)):
        for k, v in input_bytes(WORKLOADS[name], m).items():
            if k == "total" or (i and k in ("positions", "cos_sin")):
                continue
            b[f"{name}.{k}"] = v
    b["total"] = sum(b.values())
    return b


def mean_bytes(details: Sequence[Dict[str, int]]) -> Dict[str, int]:
    """Per-component mean (rounded) over input sets timed together (--cold-l2 cycles through them)."""
    keys = [k for k in dict.fromkeys(k for d in details for k in d) if k != "total"]
    b = {k: round(sum(d.get(k, 0) for d in details) / len(details)) for k in keys}
    b["total"] = sum(b.values())
    return b


def _gqa_bytes(wl: Workload, n: int, index_bytes: int, cos_sin_bytes: int, weight_bytes: int,
               cos_sin_rows: Optional[int] = None, slot_bytes: Optional[int] = None) -> Dict[str, int]:
    cfg = wl.gqa
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    elem = 1 if wl.cache_fp8 else 2
    w_bytes = 4 if cfg.norm_weight_offset else weight_bytes       # Gemma's 1 + w is an fp32 weight
    b = {"q": n * hq * d * 2, "k": n * hkv * d * 2, "v": n * hkv * d * 2}
    if cfg.qk_norm:
        b["norm_weights"] = 2 * d * w_bytes
    rows = min(n, MAX_POSITION) if cos_sin_rows is None else cos_sin_rows
    b["cos_sin"] = rows * wl.rotary_dim * cos_sin_bytes
    b["positions"] = n * index_bytes * (1 if cfg.mrope_section is None else 3)     # mRoPE: [3, n]
    b["slots"] = n * (index_bytes if slot_bytes is None else slot_bytes)
    b["q_out"] = n * hq * d * 2
    b["k_cache"] = n * hkv * d * elem
    b["v_cache"] = n * hkv * d * elem
    b["total"] = sum(b.values())
    return b
