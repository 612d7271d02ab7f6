"""README.md's performance summary, rendered from a ``kvfuse bench`` result (its JSON), so that the
README quotes exactly what was measured.

    python benchmarks/perf_summary.py            # print the block
    python benchmarks/perf_summary.py --write    # replace the block in README.md

tests/test_perf_summary.py (which imports this file with benchmarks/ on its path) fails when README.md
and the result disagree.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the result the README quotes, relative to the repository root
SOURCE = "benchmarks/results/2026-12-04d_h200_full_bench.json"
BEGIN, END = "<!-- perf-summary:begin (benchmarks/perf_summary.py) -->", "<!-- perf-summary:end -->"
# (model call, the bench workloads that make it: the first one the run measured is quoted; runs before
# 2026-12-02 named the V4 main writes dsv4_main_*, the full run names them by their preset)
ROWS = (
    ("DeepSeek V3 / V3.1 / V3.2 main cache (FLASHMLA_V32, GPT-J)", ("dsv3_main_v32",)),
    ("DeepSeek V4 main cache (MAIN_FP8, GPT-J)", ("main_fp8_gptj", "dsv4_main_fp8")),
    ("DeepSeek V4 main cache (MAIN_FP4, GPT-J)", ("dsv4_main_fp4",)),
    ("DeepSeek V4 main cache (FLASHMLA_MODEL1, GPT-J)", ("flashmla_model1_gptj", "dsv4_main_model1")),
    ("DeepSeek V3.2 indexer K (LayerNorm + bias, RoPE at 0, Hadamard, INDEX_FP8_FP32)", ("dsv32_index_k",)),
    ("DeepSeek V4 indexer K (GPT-J, Hadamard, INDEX_MXFP8)", ("dsv4_index_k",)),
    ("DeepSeek V4 Q (64 heads of 512, RMSNorm, GPT-J, bf16 out)", ("dsv4_q",)),
    ("DeepSeek V4 Q + main cache, one launch (`kvfuse.fused_group`)", ("group_dsv4_q_kv",)),
)


def inputs_text(report: dict) -> str:
    """The inputs of a run, from its JSON: the slot pattern and, for runs that record one, the input
    regime (earlier runs used uniform positions and have no regime), and PDL when the run used it."""
    cfg = report["meta"].get("config", {})
    slots, regime = cfg.get("slots", "random"), cfg.get("regime")
    pdl = ", programmatic dependent launch" if cfg.get("pdl") else ""
    if regime is None:
        return f"{slots} slots{pdl}"
    if regime == "auto":
        limit = report.get("inputs", {}).get("decode_max_n", 256)
        return f"{slots} slots, decode inputs for n <= {limit} and prefill inputs above{pdl}"
    return f"{slots} slots, {regime} inputs{pdl}"


def _measured(report: dict, names) -> str:
    """The first of ``names`` the run measured (fused peer), or None."""
    done = {r["workload"] for r in report["results"] if r["peer"] == "fused" and r["status"] == "ok"}
    return next((w for w in names if w in done), None)


def render(report: dict, source: str = SOURCE) -> str:
    """The README block for a result ``report`` read from ``source`` (the path the block cites): GPU us
    of each model call at every size of the run ("-" where not measured), % of copy at the largest."""
    meta, dev = report["meta"], report["device"]
    fused = {(r["workload"], r["n"]): r for r in report["results"] if r["peer"] == "fused" and r["status"] == "ok"}
    sizes = sorted({n for _, n in fused})

    def cells(wl):
        us = [f"{fused[(wl, n)]['gpu_us']:.2f}" if (wl, n) in fused else "-" for n in sizes]
        big = [fused[(wl, n)] for n in sizes if (wl, n) in fused]
        pct = f"{big[-1]['pct_copy']:.1f}% at {big[-1]['n']}" if big and big[-1].get("pct_copy") else "-"
        return " / ".join(us), pct

    lines = [BEGIN,
             f"GPU us per call at n = {' / '.join(map(str, sizes))} tokens (CUDA-graph replay, median, "
             f"{inputs_text(report)}), "
             f"{meta['device']}, torch {meta['torch']}, Triton {meta['triton']}, {meta['date'][:10]} "
             f"(copy bandwidth {dev['copy_GBps'] / 1e3:.2f} TB/s, launch floor {dev['floor_us']:.2f} us; "
             f"`{source}`); % of copy: compulsory DRAM bytes / time against the copy bandwidth, at the largest "
             f"size measured:",
             "",
             "| model call | workload | GPU us | % of copy |",
             "|---|---|---|---|"]
    for label, names in ROWS:
        wl = _measured(report, names)
        us, pct = cells(wl) if wl else (" / ".join("-" for _ in sizes), "-")
        lines.append(f"| {label} | {f'`{wl}`' if wl else '-'} | {us} | {pct} |")
    lines.append(END)
    return "\n".join(lines)


def readme_block(text: str) -> str:
    """The summary block of README.md's text (markers included)."""
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    return text[start:stop]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="replace the block in README.md")
    args = p.parse_args(argv)
    block = render(json.loads((ROOT / SOURCE).read_text()))
    if args.write:
        readme = ROOT / "README.md"
        text = readme.read_text()
        readme.write_text(text.replace(readme_block(text), block))
    else:
        print(block)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
