"""README.md's performance summary, rendered from a ``kvfuse bench`` result (its JSON), so that the
README quotes exactly what was measured. ``benchmarks/perf_summary.py`` prints it or writes it into
README.md; tests/test_perf_summary.py fails when README.md and the result disagree.
"""
from __future__ import annotations

# the result the README quotes, relative to the repository root
SOURCE = "benchmarks/results/2026-12-01_h200_models_paged_bench.json"
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


def render(report: dict, source: str = SOURCE) -> str:
    """The README block for a result ``report`` read from ``source`` (the path the block cites)."""
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
             f"`{source}`):",
             "",
             "| model call | GPU us | NEOX preset (same format, RoPE on the tail) |",
             "|---|---|---|"]
    lines += [f"| {label} | {cell(wl)} | {cell(preset)} |" for label, wl, preset in ROWS]
    lines.append(END)
    return "\n".join(lines)


def readme_block(text: str) -> str:
    """The summary block of README.md's text (markers included)."""
    start, stop = text.index(BEGIN), text.index(END) + len(END)
    return text[start:stop]
