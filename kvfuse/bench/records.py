"""The bench's results: one :class:`Record` per (workload, n, peer), its derived columns (GB/s, % of
copy, multiples of the launch floor and of the fused time), and the JSON report a run writes
(:func:`build_report`, :func:`write_json`), which benchmarks/ renders into the documents.
"""
from __future__ import annotations

import dataclasses
import json
import math
from typing import Dict, Optional, Sequence

from .byte_model import ACCOUNTING, moved_bytes
from .inputs import BLOCK_SIZE, DECODE_MAX_N, MAX_POSITION, PREFILL_SEQ_LEN
from .workloads import WORKLOADS


@dataclasses.dataclass
class Record:
    workload: str
    n: int
    peer: str
    rows: int = 0
    bytes: int = 0
    status: str = "ok"               # "ok" | "skipped" | "error"
    gpu_us: Optional[float] = None
    gpu_method: Optional[str] = None
    eager_us: Optional[float] = None
    gbps: Optional[float] = None
    pct_copy: Optional[float] = None
    x_floor: Optional[float] = None
    fused_speedup: Optional[float] = None   # this peer's GPU time / the fused GPU time, same point
    note: str = ""
    regime: str = ""                 # the inputs' regime (input_regime): "decode" | "prefill" | "uniform"
    slots: str = ""                  # writes: the slot pattern of the inputs
    bytes_detail: Optional[Dict[str, int]] = None   # input_bytes by component (None: no inputs built)


def finalize(rec: Record, copy_gbps: Optional[float], floor_us: Optional[float]) -> Record:
    """Derived columns of one record from its GPU time."""
    if rec.gpu_us and rec.gpu_us > 0:
        rec.gbps = rec.bytes / (rec.gpu_us * 1e-6) / 1e9
        rec.pct_copy = 100.0 * rec.gbps / copy_gbps if copy_gbps else None
        rec.x_floor = rec.gpu_us / floor_us if floor_us else None
    return rec


def add_speedups(records: Sequence[Record]) -> None:
    fused = {(r.workload, r.n): r.gpu_us for r in records if r.peer == "fused" and r.status == "ok" and r.gpu_us}
    for r in records:
        f = fused.get((r.workload, r.n))
        if f and r.status == "ok" and r.gpu_us:
            r.fused_speedup = r.gpu_us / f


def _json_safe(v):
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {str(k): _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return v


def build_report(cfg, info: dict, device: dict, records: Sequence[Record], targets: Sequence[dict],
                 elapsed_s: float, pdl_pairs: Sequence[dict] = ()) -> dict:
    """The run's JSON report: ``cfg`` (the run's :class:`kvfuse.bench.run.Config`) and ``info`` as its meta,
    the device ceilings, the workloads, the inputs, the byte accounting, the records and the targets."""
    return _json_safe({
        "meta": dict(info, elapsed_s=elapsed_s, config=dataclasses.asdict(cfg)),
        "device": device,
        "workloads": {w: dict(kind=WORKLOADS[w].kind, head_dim=WORKLOADS[w].head_dim,
                              num_heads=WORKLOADS[w].num_heads, format=getattr(WORKLOADS[w].fmt, "name", None),
                              description=WORKLOADS[w].description,
                              bytes_per_token=moved_bytes(WORKLOADS[w], 1))
                      for w in cfg.workloads},
        "inputs": dict(regime=cfg.regime, slots=cfg.slots, decode_max_n=DECODE_MAX_N,
                       prefill_seq_len=list(PREFILL_SEQ_LEN), max_position=MAX_POSITION, block_size=BLOCK_SIZE),
        "accounting": ACCOUNTING,
        "results": [dataclasses.asdict(r) for r in records],
        "targets": list(targets),
        "pdl_pairs": list(pdl_pairs),
    })


def write_json(path: str, report: dict) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=1, allow_nan=False)
