"""What a run prints and draws: the table of every record, the summary against the fused peer, the
producer + call pairs of ``--pdl-pairs``, and the PNG (matplotlib, imported only to draw).
"""
from __future__ import annotations

from typing import Optional, Sequence

from .peers import PEERS
from .records import Record


def _f(v, spec: str) -> str:
    """format(v, spec), or '-' padded to the spec's width when v is None."""
    if v is None:
        width = "".join(ch for ch in spec.split(".")[0] if ch.isdigit())
        return "-".rjust(int(width) if width else 1)
    return format(v, spec)


def format_table(records: Sequence[Record]) -> str:
    """The stdout table: one line per (workload, n, peer); a blank line between workloads."""
    head = (f"{'workload':<16} {'n':>7} {'peer':<9} {'GPU us':>10} {'timing':<6} {'eager us':>10} "
            f"{'GB/s':>8} {'%copy':>6} {'x floor':>8} {'vs fused':>8}  note")
    lines = [head, "-" * len(head)]
    prev = None
    for r in records:
        if prev is not None and r.workload != prev:
            lines.append("")
        prev = r.workload
        note = r.note if r.status == "ok" else f"{r.status.upper()}: {r.note}"
        lines.append(f"{r.workload:<16} {r.n:>7} {r.peer:<9} {_f(r.gpu_us, '10.2f')} {r.gpu_method or '-':<6} "
                     f"{_f(r.eager_us, '10.2f')} {_f(r.gbps, '8.1f')} {_f(r.pct_copy, '6.1f')} "
                     f"{_f(r.x_floor, '8.2f')} {_f(r.fused_speedup, '8.2f')}  {note}".rstrip())
    return "\n".join(lines)


def format_summary(records: Sequence[Record]) -> str:
    """A compact view, one line per (workload, n): the fused kernel and how many times slower the
    other peers are (their GPU time / the fused GPU time)."""
    by = {(r.workload, r.n, r.peer): r for r in records}
    points = list(dict.fromkeys((r.workload, r.n) for r in records))
    head = (f"{'workload':<16} {'n':>7} {'fused us':>9} {'GB/s':>7} {'%copy':>6} {'x floor':>7} "
            f"{'stages x':>8} {'compile x':>9} {'ref x':>7}")
    lines = ["summary (fused GPU time; other peers as multiples of it):", head]
    for wl, n in points:
        f = by.get((wl, n, "fused"))
        if f is None or f.status != "ok":
            lines.append(f"{wl:<16} {n:>7} {'-':>9}  fused {f.status if f else 'not run'}")
            continue
        ratio = [getattr(by.get((wl, n, p)), "fused_speedup", None) for p in ("stages", "compile", "reference")]
        lines.append(f"{wl:<16} {n:>7} {_f(f.gpu_us, '9.2f')} {_f(f.gbps, '7.0f')} {_f(f.pct_copy, '6.1f')} "
                     f"{_f(f.x_floor, '7.2f')} {_f(ratio[0], '8.2f')} {_f(ratio[1], '9.1f')} {_f(ratio[2], '7.1f')}")
    return "\n".join(lines)


def format_pdl_pairs(pairs: Sequence[dict]) -> str:
    lines = ["producer + call pairs (GPU us, CUDA-graph replay; call = pair - producer):",
             f"{'workload':22s} {'n':>6s} {'producer':>9s} {'pair':>8s} {'pair PDL':>9s} {'call':>7s} {'call PDL':>9s}"]
    for r in pairs:
        lines.append(f"{r['workload']:22s} {r['n']:6d} {r['producer_us']:9.2f} {r['pair_us']:8.2f} "
                     f"{r['pair_pdl_us']:9.2f} {r['call_us']:7.2f} {r['call_pdl_us']:9.2f}")
    return "\n".join(lines)


def plot_results(records: Sequence[Record], path: str, copy_gbps: Optional[float] = None,
                 floor_us: Optional[float] = None) -> None:
    """PNG: one row per workload, GPU time vs n (left) and effective bandwidth vs n (right)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wls = list(dict.fromkeys(r.workload for r in records if r.status == "ok" and r.gpu_us))
    if not wls:
        return
    fig, axes = plt.subplots(len(wls), 2, figsize=(13, 3.3 * len(wls)), squeeze=False)
    for row, wl in zip(axes, wls):
        for peer in PEERS:
            pts = sorted((r.n, r.gpu_us, r.gbps) for r in records
                         if r.workload == wl and r.peer == peer and r.status == "ok" and r.gpu_us)
            if pts:
                ns = [p[0] for p in pts]
                row[0].plot(ns, [p[1] for p in pts], marker="o", ms=3, label=peer)
                row[1].plot(ns, [p[2] for p in pts], marker="o", ms=3, label=peer)
        if floor_us:
            row[0].axhline(floor_us, ls=":", color="gray", label="launch floor")
        if copy_gbps:
            row[1].axhline(copy_gbps, ls="--", color="gray", label="copy bandwidth")
        row[0].set(xscale="log", yscale="log", title=f"{wl}: GPU time per call", xlabel="n (tokens)",
                   ylabel="us")
        row[1].set(xscale="log", title=f"{wl}: effective bandwidth", xlabel="n (tokens)", ylabel="GB/s")
        for ax in row:
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
