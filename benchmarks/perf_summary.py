"""Render README.md's performance summary from the latest benchmark result (a JSON written by
``kvfuse bench``), so that the README quotes exactly what was measured.

    python benchmarks/perf_summary.py            # print the block
    python benchmarks/perf_summary.py --write    # replace the block in README.md

tests/test_perf_summary.py fails when README.md and the JSON disagree.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LATEST = ROOT / "benchmarks" / "results" / "2026-12-01_h200_models_paged_bench.json"
BEGIN, END = "<!-- perf-summary:begin (benchmarks/perf_summary.py) -->", "<!-- perf-summary:end -->"
# (model call, its workload, the NEOX-on-the-tail preset it is compared with)
ROWS = (
    ("DeepSeek V3 / V3.1 / V3.2 main cache (FLASHMLA_V32, GPT-J)", "dsv3_main_v32", "flashmla_v32"),
    ("DeepSeek V4 main cache (MAIN_FP8, GPT-J)", "dsv4_main_fp8", "main_fp8"),
    ("DeepSeek V4 main cache (MAIN_FP4, GPT-J)", "dsv4_main_fp4", "main_fp4"),
    ("DeepSeek V4 main cache (FLASHMLA_MODEL1, GPT-J)", "dsv4_main_model1", "flashmla_model1"),
    ("DeepSeek V3.2 indexer K (LayerNorm + bias, RoPE at 0, Hadamard, INDEX_FP8_FP32)", "dsv32_index_k",
     "index_fp8_fp32"),
    ("DeepSeek V4 indexer K (GPT-J, Hadamard, INDEX_MXFP8)", "dsv4_index_k", None),
)


def inputs_text(report: dict) -> str:
    """The inputs of a run, from its JSON: the slot pattern and, for runs that record one, the input
    regime (earlier runs used uniform positions and have no regime)."""
    cfg = report["meta"].get("config", {})
    slots, regime = cfg.get("slots", "random"), cfg.get("regime")
    if regime is None:
        return f"{slots} slots"
    if regime == "auto":
        limit = report.get("inputs", {}).get("decode_max_n", 256)
        return f"{slots} slots, decode inputs for n <= {limit} and prefill inputs above"
    return f"{slots} slots, {regime} inputs"


def render(report: dict) -> str:
    meta, dev = report["meta"], report["device"]
    us = {(r["workload"], r["n"]): r["gpu_us"] for r in report["results"] if r["peer"] == "fused" and r["status"] == "ok"}
    sizes = sorted({n for _, n in us})

    def cell(wl):
        return " / ".join(f"{us[(wl, n)]:.2f}" for n in sizes) if wl else "-"

    lines = [BEGIN,
             f"GPU us per call at n = {' / '.join(map(str, sizes))} tokens (CUDA-graph replay, median, "
             f"{inputs_text(report)}), "
             f"{meta['device']}, torch {meta['torch']}, Triton {meta['triton']}, {meta['date'][:10]} "
             f"(copy bandwidth {dev['copy_GBps'] / 1e3:.2f} TB/s, launch floor {dev['floor_us']:.2f} us; "
             f"`{LATEST.relative_to(ROOT)}`):",
             "",
             "| model call | GPU us | NEOX preset (same format, RoPE on the tail) |",
             "|---|---|---|"]
    lines += [f"| {label} | {cell(wl)} | {cell(preset)} |" for label, wl, preset in ROWS]
    lines.append(END)
    return "\n".join(lines)


def readme_block(text: str) -> str:
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    return text[start:stop]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="replace the block in README.md")
    args = p.parse_args(argv)
    block = render(json.loads(LATEST.read_text()))
    if args.write:
        readme = ROOT / "README.md"
        text = readme.read_text()
        readme.write_text(text.replace(readme_block(text), block))
    else:
        print(block)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
