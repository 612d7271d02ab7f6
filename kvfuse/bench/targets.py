"""The project's performance targets (docs/performance.md, "Targets") checked against a run's records:
PASS / MISS / N/A entries that the run prints and stores in its JSON; reporting, never asserting. Also the
thresholds of the targets BENCHMARKS.md checks beside the engines' kernels and on the host.
"""
from __future__ import annotations

from typing import List, Sequence

from .records import Record
from .workloads import WORKLOADS


# The project's targets (docs/performance.md, "Targets"): % of copy at PCT_COPY_N of every cache write, by
# cache format and slot pattern; decode at most FLOOR_TARGET times the launch floor at FLOOR_SIZES with
# programmatic dependent launch, for the writes, q_pre and index_q.
PCT_COPY_N = 262144
PCT_COPY_TARGET = 85.0                                      # every format but those below
PCT_COPY_TARGETS = {("MAIN_FP8", "random"): 80.0, ("MAIN_FP4", None): 80.0}   # (format, slots or None: any)
FLOOR_SIZES = (1, 256)
FLOOR_TARGET = 1.3
FLOOR_KINDS = ("write", "q_pre", "index_q")
# GPU us of an engine's kernel doing the same work at n tokens, from the latest committed side-by-side run
# (benchmarks/results/2026-12-03_h200_peers_summary_table.md, NVIDIA H200): kvfuse's call, its norm included,
# at or under the engine's time at every n (the worst ratio is the entry's value).
ENGINE_TIME_TARGETS = {
    "dsv3_main_kv_c_k_pe": ("FlashInfer 0.7.2 MLA rope_quantize_fp8_append_paged_kv_cache (no norm)",
                            {1: 1.95, 256: 2.20, 4096: 3.24, 65536: 36.29}),
}


# The targets BENCHMARKS.md checks beside the engines' kernels and on the host (benchmarks/benchmarks_md.py,
# "Targets beside the engines and on the host"), from the committed runs' JSON.
ENGINE_DECODE_SIZES = (1, 256)         # kvfuse's PDL call at or under the fastest engine kernel doing its work
DECODE_FLOOR_N = 1                     # every cache write (MLA and GQA) within FLOOR_TARGET x the launch floor
GQA_QK_NORM_PCT_COPY = (65536, 85.0)   # the GQA writes of models with a q / k norm: (n, % of copy)
HOST_US_TARGET = 8.0                   # host time of an eager call at n = 1, its launch included


def pct_copy_target(fmt_name: str, slots: str) -> float:
    """The % of copy target of a write of cache format ``fmt_name`` on ``slots`` ("" : paged)."""
    slots = slots or "paged"
    return PCT_COPY_TARGETS.get((fmt_name, slots), PCT_COPY_TARGETS.get((fmt_name, None), PCT_COPY_TARGET))


TARGET_KINDS = ("pct_copy", "floor", "stages", "stages_65536", "engine")     # an entry's "kind", in the order of each workload's


def check_targets(records: Sequence[Record], pdl: bool = True) -> List[dict]:
    """The performance targets as PASS / MISS / N/A (not measured) entries (target, status, value, op,
    threshold, detail, workload, kind: one of TARGET_KINDS); reporting only. ``pdl``: the run had
    programmatic dependent launch (the launch-floor target needs it: N/A without)."""
    ok = {(r.workload, r.n, r.peer): r for r in records if r.status == "ok" and r.gpu_us}
    present = list(dict.fromkeys(r.workload for r in records))
    out = []

    def add(name, value, op, target, detail="", *, workload, kind):
        if value is None:
            status = "N/A"
        else:
            status = "PASS" if (value >= target if op == ">=" else value <= target) else "MISS"
        out.append(dict(target=name, status=status, value=value, op=op, threshold=target, detail=detail,
                        workload=workload, kind=kind))

    def fused(wl, n, attr):
        r = ok.get((wl, n, "fused"))
        return None if r is None else getattr(r, attr)

    def slot_pattern(wl):
        """The slots of the fused record at PCT_COPY_N, else of any record of ``wl``; "" (old runs): paged."""
        r = ok.get((wl, PCT_COPY_N, "fused"))
        slots = r.slots if r is not None and r.slots else next((q.slots for q in records if q.workload == wl
                                                                 and q.slots), "")
        return slots or "paged"

    sizes = ", ".join(map(str, FLOOR_SIZES))
    for wl in present:
        w = WORKLOADS.get(wl)
        if w is not None and w.kind == "write":
            slots = slot_pattern(wl)
            add(f"{wl} fused % copy at n={PCT_COPY_N} ({slots} slots)", fused(wl, PCT_COPY_N, "pct_copy"), ">=",
                pct_copy_target(w.fmt.name, slots), workload=wl, kind="pct_copy")
        if w is not None and w.kind in FLOOR_KINDS:
            name = f"{wl} fused GPU time / launch floor at n in {{{sizes}}} (worst), with programmatic dependent launch"
            floors = [(r.x_floor, n) for (q, n, p), r in ok.items() if q == wl and p == "fused" and n in FLOOR_SIZES
                      and r.x_floor is not None]
            if not pdl:
                add(name, None, "<=", FLOOR_TARGET, "needs a --pdl run", workload=wl, kind="floor")
            else:
                worst = max(floors) if floors else (None, None)
                add(name, worst[0], "<=", FLOOR_TARGET, f"at n={worst[1]}" if floors else "", workload=wl, kind="floor")
        sp = [(r.fused_speedup, n) for (q, n, p), r in ok.items() if q == wl and p == "stages" and n <= 4096
              and r.fused_speedup is not None]
        least = min(sp) if sp else (None, None)
        add(f"{wl} fused vs stage chain, n<=4096 (least)", least[0], ">=", 2.0, f"at n={least[1]}" if sp else "",
            workload=wl, kind="stages")
        r = ok.get((wl, 65536, "stages"))
        add(f"{wl} fused vs stage chain at n=65536", None if r is None else r.fused_speedup, ">=", 1.8,
            workload=wl, kind="stages_65536")
        if wl in ENGINE_TIME_TARGETS:
            engine, times = ENGINE_TIME_TARGETS[wl]
            ratios = [(us / times[n], n) for n in times if (us := fused(wl, n, "gpu_us")) is not None]
            worst = max(ratios) if ratios else (None, None)
            add(f"{wl} fused GPU time / {engine} (worst over n in {sorted(times)})", worst[0], "<=", 1.0,
                f"at n={worst[1]}" if ratios else "", workload=wl, kind="engine")
    return out


def format_targets(targets: Sequence[dict]) -> str:
    lines = ["targets (reporting, not asserting):"]
    for t in targets:
        value = "not measured" if t["value"] is None else f"{t['value']:.2f}"
        detail = "" if not t["detail"] else f" ({t['detail']})" if t["value"] is None else f" {t['detail']}"
        lines.append(f"  {t['status']:<4}  {t['target']}: {value}{detail} (target {t['op']} {t['threshold']:g})")
    return "\n".join(lines)
