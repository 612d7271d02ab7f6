"""BENCHMARKS.md (repository root) from ONE ``kvfuse bench`` result JSON (:func:`kvfuse.bench.write_json`):
kvfuse's figures from that run beside the engines' kernels.

    python benchmarks/benchmarks_md.py RESULT.json            # write BENCHMARKS.md
    python benchmarks/benchmarks_md.py RESULT.json --stdout   # print it instead
    python benchmarks/benchmarks_md.py RESULT.json --check    # exit 1 when BENCHMARKS.md differs
    python benchmarks/benchmarks_md.py RESULT.json --gqa GQA.json   # the GQA / MHA section from a later run
    python benchmarks/benchmarks_md.py RESULT.json --group G.json   # the Grouped section from a later run

Without RESULT.json: the latest H200 result under benchmarks/results/ (DEFAULT below).

Every kvfuse figure comes from that JSON: its device, software, date, copy bandwidth, launch floor and
byte accounting, and the GPU time of each (workload, n, peer). The engines' figures are constants here
(:data:`ENGINE_FIGURES`, cited as :data:`ENGINE_SOURCE`), each tied to the kvfuse workloads that do the
same work; a figure no kvfuse workload matches is listed under "Not measured here", and a section
whose workloads the run lacks says which command produces them. The Targets section recomputes the
project's targets (:func:`kvfuse.bench.check_targets`, as it stands) from the run's records.
:func:`render` does the work; tests/test_benchmarks_md.py imports this file with benchmarks/ on its path.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvfuse.bench import (FLOOR_SIZES, FLOOR_TARGET, GQA_PEERS, PCT_COPY_N, TARGET_KINDS, WORKLOADS,  # noqa: E402
                          Record, Workload, check_targets)
from kvfuse.dispatch import GROUP_ONE_LAUNCH_MAX_N  # noqa: E402
from kvfuse.formats import INDEX_FP8_FP32  # noqa: E402

__all__ = ["ENGINE_SOURCE", "ENGINE_FIGURES", "EngineFigure", "TIE", "render", "candidates", "resolve",
           "verdict", "cast_only"]

ENGINE_SOURCE = ("engines' kernels, measured beside kvfuse on one H200 (FlashInfer 0.7.2, SGLang 0.5.23, "
                 "vLLM 0.33), CUDA-graph replay, median")
TIE = 0.03                   # kvfuse / engine within 1 +- TIE: "even"
DECODE_MAX = 256             # the decode table: n <= this
PREFILL_MIN = 4096           # the prefill table: n >= this
SIZES = "1,256,4096,65536"   # the sizes the suggested commands measure
GQA_SIZES = "1,64,256,4096,65536"
FULL_SIZES = GQA_SIZES + ",262144"   # the full run: the writes' large-n targets too (larger inputs skip themselves)
GROUP_PREFIX = "group_"


def _index_cast_only(w: Workload) -> bool:
    """A 128-d fp8 index write of the cast alone (no norm, no RoPE, no Hadamard)."""
    return w.kind == "write" and w.fmt == INDEX_FP8_FP32 and not (w.norm or w.rope or w.hadamard)


@dataclasses.dataclass(frozen=True)
class EngineFigure:
    """GPU us of one engine kernel (strings: cited as measured) for one call, and the kvfuse workloads that
    do the same work: ``workloads`` by name (identical definitions; the first one the run has is used) and
    any workload of :data:`kvfuse.bench.WORKLOADS` for which ``match`` holds. ``pdl``: the engine ran with
    programmatic dependent launch (True), without (False), or as it runs by default (None). ``section``:
    "write" (the decode and prefill tables), "cast" or "group". ``note``: what differs, or why no kvfuse
    workload matches."""
    call: str
    engine: str
    us: Tuple[Tuple[int, str], ...]
    section: str = "write"
    pdl: Optional[bool] = None
    workloads: Tuple[str, ...] = ()
    match: Optional[Callable[[Workload], bool]] = None
    note: str = ""

    @property
    def label(self) -> str:
        return self.engine + {True: " (PDL)", False: " (no PDL)", None: ""}[self.pdl]


_MAIN = "MAIN_FP8 write, norm + GPT-J RoPE"
_MODEL1 = "FLASHMLA_MODEL1 write, norm + GPT-J RoPE"
_INDEX = "128-d fp8 index write, V3.2 style (RoPE at offset 0)"
_INDEX_NOTE = ("kvfuse's dsv32_index_k is the model's whole chain: LayerNorm + bias, NEOX RoPE on the first 64, "
               "Hadamard, INDEX_FP8_FP32")
_CAST_MAIN = "the cast alone, MAIN_FP8 record"
_FLASHINFER_LAYOUT = ("FlashInfer's kernel writes its own page layout, not the MAIN_FP8 record: each 64-token page "
                      "holds 64 code rows of 512 B, then 64 scale rows of 16 B (528 B a token, no reserved bytes); "
                      "the slot pattern of its figure is not recorded")
_PAGEWISE, _PAGEWISE_OF, _PAGEWISE_N = "main_fp8_pagewise_cast", "main_fp8_cast", 65536   # that layout, the record
_FLASHINFER_CAST_NOTE = (_FLASHINFER_LAYOUT + ". In that layout kvfuse's portable kernel writes the same codes in "
                         "26.11 us at 65536 tokens against 31.28 us as MAIN_FP8 records (H200, 2026-12-01, "
                         "`main_fp8_pagewise_cast`; docs/performance.md)")   # a run without both: measured then
_CAST_INDEX = "the cast alone, 128-d fp8 index write"

ENGINE_FIGURES: Tuple[EngineFigure, ...] = (
    EngineFigure(_MAIN, "SGLang DeepSeek V4 JIT kernel", (((1, "1.06"), (4096, "3.13"), (65536, "37.6"))), pdl=True,
                 workloads=("main_fp8_gptj", "dsv4_main_fp8")),
    EngineFigure(_MAIN, "SGLang DeepSeek V4 JIT kernel", (((1, "1.50"), (4096, "3.80"), (65536, "38.8"))), pdl=False,
                 workloads=("main_fp8_gptj", "dsv4_main_fp8")),
    EngineFigure(_MODEL1, "SGLang DeepSeek V4 kernel", ((1, "1.10"),), pdl=True,
                 workloads=("flashmla_model1_gptj", "dsv4_main_model1")),
    EngineFigure(_MODEL1, "SGLang DeepSeek V4 kernel", ((1, "1.46"),), pdl=False,
                 workloads=("flashmla_model1_gptj", "dsv4_main_model1")),
    EngineFigure(_MODEL1, "vLLM DeepSeek V4 kernel", ((1, "2.12"), (4096, "4.89"), (65536, "51.0")),
                 workloads=("flashmla_model1_gptj", "dsv4_main_model1")),
    EngineFigure(_INDEX, "SGLang V3.2 indexer kernel with LayerNorm", ((1, "1.30"), (4096, "2.48"), (65536, "21.1")),
                 pdl=True, workloads=("dsv32_index_k",), note=_INDEX_NOTE),
    EngineFigure(_INDEX, "SGLang V3.2 indexer kernel with LayerNorm", ((65536, "15.7"),), pdl=False,
                 workloads=("dsv32_index_k",), note=_INDEX_NOTE),
    EngineFigure(_CAST_MAIN, "FlashInfer DeepSeek Triton `quantize_cache`", ((1, "1.52"), (4096, "2.64"),
                                                                            (65536, "26.2")),
                 section="cast", workloads=("main_fp8_cast",), note=_FLASHINFER_CAST_NOTE),
    EngineFigure(_CAST_INDEX, "SGLang `fused_store_index_k_cache`", ((1, "1.03"),), section="cast", pdl=True,
                 match=_index_cast_only),
    EngineFigure(_CAST_INDEX, "SGLang `fused_store_index_k_cache`", ((4096, "2.02"), (65536, "11.2")),
                 section="cast", match=_index_cast_only),
    EngineFigure("Q of 64 heads + the KV write, one launch (DeepSeek V4)", "vLLM DeepSeek V4 fused Q + KV kernel",
                 ((1, "2.26"), (4096, "149")), section="group", workloads=("group_dsv4_q_kv",),
                 note="kvfuse's group_dsv4_q_kv writes the KV as a MAIN_FP8 record (528 bytes) where vLLM's DeepSeek "
                      "V4 cache holds FLASHMLA_MODEL1 records (584 bytes); Q (64 heads of 512, bf16 read and written: "
                      "128 KiB per token) is most of the bytes either way"),
    EngineFigure("576-d RoPE + quantization", "FlashInfer `rope_quantize_fp8_append_paged_kv_cache`", ((256, "2.70"),),
                 note="The 576-d workloads of kvfuse (flashmla_v32, dsv3_main_v32) add an RMSNorm and write "
                      "FLASHMLA_V32 records (an fp32 scale per 128 dims and a bf16 RoPE tail); FlashInfer's kernel "
                      "quantizes with per-tensor scales and quantizes Q too: not the same work"),
)


# =============================================================================== reading the JSON
def candidates(fig: EngineFigure) -> List[str]:
    """The kvfuse workloads that do ``fig``'s work: its names, then the matching workloads of the bench."""
    names = list(fig.workloads)
    if fig.match is not None:
        names += [name for name, w in WORKLOADS.items() if fig.match(w) and name not in names]
    return names


def _fused(report: dict) -> Dict[Tuple[str, int], dict]:
    return {(r["workload"], r["n"]): r for r in report["results"] if r["peer"] == "fused" and r["status"] == "ok"
            and r.get("gpu_us")}


def _run_workloads(report: dict) -> List[str]:
    """The run's workloads, in its order."""
    names = list(report.get("workloads", {}))
    return names + [w for w in dict.fromkeys(r["workload"] for r in report["results"]) if w not in names]


def resolve(fig: EngineFigure, report: dict) -> Optional[str]:
    """The first of :func:`candidates` that the run measured (a fused figure at some n), else None."""
    measured = {w for w, _ in _fused(report)}
    return next((w for w in candidates(fig) if w in measured), None)


def verdict(kvfuse_us: float, engine_us: float) -> str:
    """kvfuse "wins" (its time below the engine's by more than TIE), "loses" (above by more) or is "even"."""
    ratio = kvfuse_us / engine_us
    if ratio < 1 - TIE:
        return "wins"
    if ratio > 1 + TIE:
        return "loses"
    return "even"


def _kind(report: dict, name: str) -> str:
    w = WORKLOADS.get(name)
    if w is not None:
        return w.kind
    return report.get("workloads", {}).get(name, {}).get("kind", "write")


def cast_only(name: str) -> bool:
    """A workload of the cast alone (no norm, no RoPE, no Hadamard)."""
    w = WORKLOADS.get(name)
    if w is None:
        return name.endswith("_cast")
    return w.kind == "write" and not (w.norm or w.rope or w.hadamard)


def _category(report: dict, name: str) -> str:
    if name.startswith(GROUP_PREFIX):
        return "group"
    kind = _kind(report, name)
    if kind == "gqa":
        return "gqa"
    return "cast" if cast_only(name) else "write"


# =============================================================================== formatting
def _us(v: Optional[float]) -> str:
    if v is None:
        return "-"
    return f"{v:.2f}" if v < 100 else f"{v:.1f}"


def _pct(rec: Optional[dict]) -> str:
    v = None if rec is None else rec.get("pct_copy")
    return "-" if v is None else f"{v:.1f}%"


def _note(fig: EngineFigure, report: dict) -> str:
    """``fig.note``; FlashInfer's cast note quotes the run's own figures of the page layout and of the MAIN_FP8
    record (:data:`_PAGEWISE`, :data:`_PAGEWISE_OF` at :data:`_PAGEWISE_N`) when it has both."""
    fused = _fused(report)
    page, rec = fused.get((_PAGEWISE, _PAGEWISE_N)), fused.get((_PAGEWISE_OF, _PAGEWISE_N))
    if fig.note != _FLASHINFER_CAST_NOTE or page is None or rec is None:
        return fig.note
    return (f"{_FLASHINFER_LAYOUT}. In that layout kvfuse writes the same codes in this run in {_us(page['gpu_us'])} "
            f"us at {_PAGEWISE_N} tokens against {_us(rec['gpu_us'])} us as MAIN_FP8 records (`{_PAGEWISE}` against "
            f"`{_PAGEWISE_OF}`; docs/performance.md)")


def _mark(v: str) -> str:
    return f"**{v}**" if v == "wins" else v


def _cmd(workloads: Sequence[str], sizes: str = SIZES, peers: str = "fused") -> str:
    return (f"`python -m kvfuse.cli bench --workloads {','.join(workloads)} --n {sizes} --peers {peers} "
            f"--out bench-out`")


def _command_of_run(meta: dict) -> str:
    argv = list(meta.get("argv") or [])
    if not argv:
        return "not recorded"
    if argv[0].endswith("cli.py"):
        argv = ["python", "-m", "kvfuse.cli"] + argv[1:]
    elif argv[0].endswith(("bench.py", "bench/__main__.py")):     # python -m kvfuse.bench, module or package
        argv = ["python", "-m", "kvfuse.bench"] + argv[1:]
    return "`" + " ".join(shlex.quote(a) for a in argv) + "`"


def _date(text: Optional[str]) -> str:
    if not text:
        return "not recorded"
    try:
        d = datetime.datetime.fromisoformat(text).astimezone(datetime.timezone.utc)
    except ValueError:
        return text
    return d.strftime("%Y-%m-%d %H:%M UTC")


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> List[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


# =============================================================================== sections
def _measured(report: dict, source: str) -> List[str]:
    meta, dev = report.get("meta", {}), report.get("device", {})
    cfg = meta.get("config", {})
    inputs = report.get("inputs", {})
    hw = meta.get("device", "not recorded")
    extra = [f"{meta['sm_count']} SMs" if meta.get("sm_count") else "",
             f"compute capability {meta['capability']}" if meta.get("capability") else "",
             f"{meta['memory_GiB']} GiB" if meta.get("memory_GiB") else ""]
    extra = ", ".join(e for e in extra if e)
    software = ", ".join(p for p in (
        f"torch {meta['torch']}" + (f" (CUDA {meta['torch_cuda']})" if meta.get("torch_cuda") else "")
        if meta.get("torch") else "",
        f"Triton {meta['triton']}" if meta.get("triton") else "",
        f"Python {meta['python']}" if meta.get("python") else "",
        f"kvfuse {meta['kvfuse']}" if meta.get("kvfuse") else "") if p) or "not recorded"
    copy = dev.get("copy_GBps")
    copy_text = "not measured" if copy is None else (
        f"{copy / 1e3:.2f} TB/s ({(dev.get('copy_bytes') or 2 << 31) / 2 / 2 ** 30:.0f} GiB device-to-device "
        f"copy, bytes read + written / median time)")
    floor = dev.get("floor_us")
    floor_text = "not measured" if floor is None else (
        f"{floor:.2f} us (GPU time of one tiny {dev.get('floor_kernel', 'Triton')} kernel, "
        f"{dev.get('floor_launches_per_graph', 100)} launches per CUDA graph, median)")
    if inputs:
        regime = inputs.get("regime", "auto")
        lo, hi = inputs.get("prefill_seq_len", (1024, 4096))
        block = inputs.get("block_size", 64)
        if regime == "auto":
            regime_text = (f"decode inputs for n <= {inputs.get('decode_max_n', 256)} (one token per sequence at "
                           f"positions spread over [0, {inputs.get('max_position', 8192)}), each in its own "
                           f"{block}-token block), prefill inputs above (whole sequences of {lo}-{hi} tokens at "
                           f"positions 0..len-1)")
        else:
            regime_text = f"{regime} inputs for every n"
        inputs_text = f"{inputs.get('slots', 'paged')} slots; {regime_text}"
    else:
        inputs_text = f"{cfg.get('slots', 'random')} slots, positions uniform (the run predates the input regimes)"
    pdl = "on (`--pdl`)" if cfg.get("pdl") else "off"
    lines = [
        "## How it was measured",
        "",
        f"- Source: `{source}`, one `kvfuse bench` run; command {_command_of_run(meta)}.",
        f"- Device: {hw}" + (f" ({extra})" if extra else "") + f"; {software}.",
        f"- Date: {_date(meta.get('date'))}.",
        f"- Copy bandwidth: {copy_text}. Launch floor: {floor_text}.",
        "- kvfuse's time: GPU us per call, CUDA-graph replay of several calls, median per call over replays "
        "(a figure timed otherwise is marked). " + f"PDL {pdl}; {'cold' if cfg.get('cold_l2') else 'warm'} L2.",
        f"- Inputs: {inputs_text}.",
        f"- Byte accounting (GB/s and % of copy): {report.get('accounting', 'not recorded')}; GB/s = those bytes / "
        "GPU time, % of copy = GB/s / copy bandwidth. Every peer of a point is charged the same bytes.",
        f"- Engines' figures: {ENGINE_SOURCE}. They are constants of the generator (`benchmarks/benchmarks_md.py`), "
        "each beside the kvfuse workload that does the same work; PDL as marked.",
        f"- Verdicts: kvfuse **wins** when its time is below the engine's by more than {TIE:.0%}, loses when "
        f"above by more than {TIE:.0%}, and is even otherwise.",
    ]
    return lines


def _engine_rows(report: dict, figs: Sequence[EngineFigure], keep: Callable[[int], bool], with_copy: bool):
    fused = _fused(report)
    calls = list(dict.fromkeys(f.call for f in ENGINE_FIGURES))
    keyed, missing, wins, total = [], [], 0, 0
    for rank, fig in enumerate(figs):
        names = candidates(fig)
        if not names:
            continue
        wl = resolve(fig, report)
        for n, engine in fig.us:
            if not keep(n):
                continue
            if wl is None:
                missing.append((names[0], fig, n, engine))
                continue
            rec = fused.get((wl, n))
            if rec is None:
                ratio, mark, kv = "-", f"not in this run at n = {n}", "-"
            else:
                r = rec["gpu_us"] / float(engine)
                mark = verdict(rec["gpu_us"], float(engine))
                ratio, kv = f"{r:.2f}", _us(rec["gpu_us"]) + ("" if rec.get("gpu_method") == "graph" else " (events)")
                wins += mark == "wins"
                total += 1
            row = [fig.call, f"`{wl}`", str(n), kv]
            if with_copy:
                row.append(_pct(rec))
            row += [fig.label, engine, ratio, _mark(mark)]
            keyed.append(((calls.index(fig.call), n, rank), row))
    rows = [row for _, row in sorted(keyed, key=lambda kr: kr[0])]
    return rows, missing, wins, total


def _comparison(report: dict, section: str, keep: Callable[[int], bool], with_copy: bool,
                command: bool = True) -> List[str]:
    """The engine figures of ``section`` at the sizes ``keep`` selects beside the run's figures; the figures
    whose kvfuse workload the run lacks are listed with (``command``) the command that measures it."""
    figs = [f for f in ENGINE_FIGURES if f.section == section]
    rows, missing, wins, total = _engine_rows(report, figs, keep, with_copy)
    out = []
    if rows:
        head = ["call", "kvfuse workload", "n", "kvfuse us"] + (["kvfuse % of copy"] if with_copy else []) + \
               ["engine kernel", "engine us", "kvfuse / engine", "kvfuse"]
        out += _table(head, rows)
        out += ["", f"kvfuse wins {wins} of these {total} comparisons."]
        notes = list(dict.fromkeys(_note(f, report) for f in figs if f.note and candidates(f) and resolve(f, report)))
        out += [f"- {note}." for note in notes]
        if not report.get("meta", {}).get("config", {}).get("pdl") and any("(PDL)" in r[-4] for r in rows):
            out.append("- kvfuse ran without PDL here: the engines' \"(no PDL)\" rows compare like with like "
                       "(`kvfuse bench --pdl` times kvfuse with it).")
    if missing:
        names = list(dict.fromkeys(m[0] for m in missing))
        out += ["", "Engine figures whose kvfuse workload is not in this run" +
                (f" ({_cmd(names)} measures " + ", ".join(f"`{w}`" for w in names) + "):" if command else ":"), ""]
        waiting: Dict[Tuple[str, str], List[str]] = {}
        for w, fig, n, engine in missing:
            waiting.setdefault((w, f"{fig.call}: {fig.engine}"), []).append(
                f"{engine} us at n = {n}" + {True: " (PDL)", False: " (no PDL)", None: ""}[fig.pdl])
        out += [f"- `{w}` ({what}): {', '.join(figures)}" for (w, what), figures in waiting.items()]
    return out


def _alone(report: dict, names: Sequence[str], keep: Callable[[int], bool], with_copy: bool) -> List[str]:
    fused = _fused(report)
    sizes = sorted({n for w, n in fused if w in names and keep(n)})
    if not sizes:
        return []
    descr = report.get("workloads", {})
    rows = []
    for w in names:
        cells = []
        for n in sizes:
            rec = fused.get((w, n))
            cell = _us(None if rec is None else rec["gpu_us"])
            if with_copy and rec is not None and rec.get("pct_copy") is not None:
                cell += f" ({rec['pct_copy']:.0f}%)"
            cells.append(cell)
        if any(c != "-" for c in cells):
            rows.append([f"`{w}`", descr.get(w, {}).get("description", "")] + cells)
    head = ["workload", "call"] + [f"n = {n}" for n in sizes]
    return _table(head, rows)


def _size_section(report: dict, title: str, intro: str, keep, with_copy: bool) -> List[str]:
    names = [w for w in _run_workloads(report) if _category(report, w) == "write"]
    out = [title, "", intro, ""]
    comp = _comparison(report, "write", keep, with_copy)
    out += comp or ["No engine figure of these sizes matches a workload of this run."]
    alone = _alone(report, names, keep, with_copy)
    if alone:
        out += ["", "Every DeepSeek-family (MLA) workload of the run at these sizes (GPU us" +
                (", % of copy in parentheses" if with_copy else "") + "):", ""] + alone
    else:
        out += ["", "This run measured no DeepSeek-family (MLA) workload at these sizes."]
    return out


def _peer_table(report: dict, names: Sequence[str], versus: str) -> List[str]:
    """Per (workload, n): the fused figure and every other peer the run has for these workloads; the last
    column: the fused call's verdict against the ``versus`` peer (what runs without kvfuse's fusion)."""
    recs = {(r["workload"], r["n"], r["peer"]): r for r in report["results"] if r["workload"] in names}
    order = [p for p in ("two_launch", "calls", "stages", "compile", "reference") if any(k[2] == p for k in recs)]
    head = ["workload", "n", "fused us", "% of copy"] + [f"{p} us (x fused)" for p in order]
    if versus in order:
        head.append(f"fused vs {versus}")
    rows, footnote = [], False
    for w in names:
        for n in sorted({k[1] for k in recs if k[0] == w}):
            f = recs.get((w, n, "fused"))
            ok_f = f is not None and f["status"] == "ok" and f.get("gpu_us")
            row = [f"`{w}`", str(n), _us(f["gpu_us"]) if ok_f else "-", _pct(f) if ok_f else "-"]
            for p in order:
                r = recs.get((w, n, p))
                if r is None or r["status"] != "ok" or not r.get("gpu_us"):
                    row.append("-" if r is None else r["status"])
                    continue
                cell = _us(r["gpu_us"])
                if r.get("gpu_method") != "graph":
                    cell += " †"
                    footnote = True
                if ok_f:
                    cell += f" ({r['gpu_us'] / f['gpu_us']:.2f}x)"
                row.append(cell)
            if versus in order:
                t = recs.get((w, n, versus))
                ok_t = t is not None and t["status"] == "ok" and t.get("gpu_us")
                row.append(_mark(verdict(f["gpu_us"], t["gpu_us"])) if ok_f and ok_t else "-")
            rows.append(row)
    out = _table(head, rows)
    if footnote:
        out += ["", "† timed with CUDA events around eager calls (the peer synchronizes the host: not "
                    "graph-capturable), host time included."]
    return out


def _cast_section(report: dict) -> List[str]:
    names = [w for w in _run_workloads(report) if _category(report, w) == "cast"]
    out = ["## Cast only (no norm, no RoPE)", "",
           "The quantization and store of already-transformed rows: no norm, no RoPE (kvfuse's "
           "`main_fp8_cast`: what `kvfuse.mla.store_gathered` runs; an index cast-only workload where the "
           "bench has one).", ""]
    if not names:
        out += ["This run has no cast-only workload."]
    out += _comparison(report, "cast", lambda n: True, True)
    if names:
        out += ["", "GPU us (% of copy in parentheses):", ""] + _alone(report, names, lambda n: True, True)
    return out


def _group_section(report: dict, own_source: Optional[str] = None) -> List[str]:
    """``own_source``: the section comes from a run of its own (``report``), named in the section."""
    names = [w for w in _run_workloads(report) if _category(report, w) == "group"]
    out = ["## Grouped", "", f"Workloads whose name starts with `{GROUP_PREFIX}`: calls of one layer (its members) "
           "in one `kvfuse.fused_group` launch. Peers: `calls` runs the members one by one (a launch each), "
           "`stages` each member's stage chain. The last column says whether the one grouped launch wins against "
           f"the calls one by one. Past {GROUP_ONE_LAUNCH_MAX_N} tokens (`kvfuse.dispatch.GROUP_ONE_LAUNCH_MAX_N`) `fused_group` itself "
           "runs the calls one by one, each on its own kernel (faster there than the portable kernel the grouped "
           "launch runs), so above that size both peers time the same path.", ""]
    if names:
        descr = report.get("workloads", {})
        if own_source is not None:
            out.append(_run_line(report, own_source))
        out += [f"- `{w}`: {descr.get(w, {}).get('description', '')}" for w in names] + [""]
        out += _comparison(report, "group", lambda n: True, True)
        out += ["", "GPU us per call and the other peers of the run:", ""] + _peer_table(report, names, "calls")
        return out
    known = [w for w in WORKLOADS if w.startswith(GROUP_PREFIX)]
    if known:
        out.append(f"This run has no grouped workload. {_cmd(known, SIZES, 'fused,calls,stages')} measures them.")
        out += _comparison(report, "group", lambda n: True, True, command=False)
    else:
        out.append(f"This run has no grouped workload, and `kvfuse.bench.WORKLOADS` has none yet: once it has "
                   f"`{GROUP_PREFIX}*` workloads, `python -m kvfuse.cli bench --workloads <their names> --n {SIZES} "
                   f"--peers fused --out bench-out` measures them and this generator puts them here.")
    return out


def _run_line(report: dict, source: str) -> str:
    """How a section from a run of its own names that run: source, command, date, device, baselines."""
    meta, dev, cfg = report.get("meta", {}), report.get("device", {}), report.get("meta", {}).get("config", {})
    copy, floor = dev.get("copy_GBps"), dev.get("floor_us")
    return (f"- Source of this section: `{source}`, its own `kvfuse bench` run, later than the rest of this "
            f"document; command {_command_of_run(meta)}; {meta.get('device', 'device not recorded')}, "
            f"{_date(meta.get('date'))}; copy bandwidth "
            f"{'not measured' if copy is None else f'{copy / 1e3:.2f} TB/s'}, launch floor "
            f"{'not measured' if floor is None else f'{floor:.2f} us'}; PDL {'on' if cfg.get('pdl') else 'off'}.")


def _gqa_section(report: dict, own_source: Optional[str] = None) -> List[str]:
    """``own_source``: the section comes from a run of its own (``report``), named in the section."""
    names = [w for w in _run_workloads(report) if _category(report, w) == "gqa"]
    out = ["## GQA / MHA (`fused_qk_norm_rope_store_kv`)", "",
           "One call per layer: QK-norm (when the model has one) and RoPE of q and k, q written back, K and V "
           "scattered into paged NHD caches (bf16, or fp8 with per-tensor scales). Peers: `two_launch` is the "
           "engines' structure for these models (a QK-norm + RoPE launch over q and k, then the K/V scatter + "
           "cast launch, as vLLM runs it with `reshape_and_cache_flash`), each launch run with kvfuse's GQA "
           "kernel; `stages` is kvfuse's kernels one stage per launch (q, k, the cast, the store); `compile` is "
           "torch.compile of the reference chain. \"x fused\" is the peer's time / the fused time; the last "
           "column says whether the one fused launch wins against the two launches.", ""]
    if not names:
        gqa = [w for w, d in WORKLOADS.items() if d.kind == "gqa"]
        peers = ",".join(["fused"] + list(GQA_PEERS) + ["stages", "compile"])
        out.append(f"This run has no GQA workload. {_cmd(gqa, GQA_SIZES, peers)} measures them with these peers.")
        return out
    descr = report.get("workloads", {})
    if own_source is not None:
        out.append(_run_line(report, own_source))
    out += [f"- `{w}`: {descr.get(w, {}).get('description', '')}" for w in names]
    return out + [""] + _peer_table(report, names, "two_launch")


def _target_value(t: dict) -> str:
    """A target's value with enough decimals that a miss never prints as its threshold (1.798 vs 1.8)."""
    v, digits = t["value"], (1 if t["kind"] == "pct_copy" else 2)
    while digits < 4 and round(v, digits) == t["threshold"] and v != t["threshold"]:
        digits += 1
    return f"{v:.{digits}f}{'%' if t['kind'] == 'pct_copy' else 'x'}"


def _target_cell(t: Optional[dict]) -> str:
    if t is None:
        return ""
    if t["value"] is None:
        return "not measured" + (f" ({t['detail']})" if t["detail"] else "")
    threshold = f" (target {t['threshold']:g}%)" if t["kind"] == "pct_copy" else ""
    detail = f" {t['detail']}" if t["detail"] else ""
    return f"{_target_value(t)}{detail}{threshold}: {'met' if t['status'] == 'PASS' else '**missed**'}"


def _targets_section(report: dict) -> List[str]:
    """The project's targets (:func:`kvfuse.bench.check_targets`, as it stands) recomputed from the run's records,
    not the run's stored "targets" (those keep the thresholds of their day): a row per workload."""
    fields = {f.name for f in dataclasses.fields(Record)}
    records = [Record(**{k: v for k, v in r.items() if k in fields}) for r in report.get("results", [])]
    pdl = bool(report.get("meta", {}).get("config", {}).get("pdl", False))
    targets = check_targets(records, pdl=pdl)
    out = ["## Targets", "",
           "The project's performance targets, recomputed from this run's records with the current "
           "`kvfuse.bench.check_targets` (reporting, not asserting); the measured causes of the misses are in "
           "docs/performance.md (\"Targets\"). Columns: % of copy at "
           f"{PCT_COPY_N} tokens (cache writes; MAIN_FP8 >= 85% paged / 80% random, MAIN_FP4 >= 80%, every other "
           f"format >= 85%); the worst GPU time over the launch floor at n = "
           f"{' and '.join(map(str, FLOOR_SIZES))} with programmatic dependent launch (cache writes and Q calls, "
           f"<= {FLOOR_TARGET:g}x); the fused call against kvfuse's stage chain, the least ratio at n <= 4096 "
           "(>= 2x) and at 65536 (>= 1.8x); the worst ratio to an engine's kernel doing the same work "
           "(`kvfuse.bench.ENGINE_TIME_TARGETS`, <= 1x). Empty: no such target for the workload.", ""]
    if not targets:
        return out + ["No workload of this run has a target."]
    by = {(t["workload"], t["kind"]): t for t in targets}
    rows = [[f"`{wl}`"] + [_target_cell(by.get((wl, kind))) for kind in TARGET_KINDS]
            for wl in dict.fromkeys(t["workload"] for t in targets)]
    out += _table(["workload", f"% of copy at {PCT_COPY_N}", f"x launch floor, n = {' / '.join(map(str, FLOOR_SIZES))}",
                   "vs stage chain, n <= 4096", "vs stage chain, n = 65536", "vs the engine's kernel"], rows)
    measured = [t for t in targets if t["status"] != "N/A"]
    return out + ["", f"{sum(t['status'] == 'PASS' for t in measured)} of the {len(measured)} measured targets met."]


def _not_measured() -> List[str]:
    out = ["## Not measured here", "",
           "Engine figures with no kvfuse workload doing the same work (listed, never matched to a different "
           "call):", ""]
    groups: Dict[Tuple[str, str], List[EngineFigure]] = {}
    for fig in ENGINE_FIGURES:
        if not candidates(fig):
            groups.setdefault((fig.call, fig.engine), []).append(fig)
    for (call, engine), figs in groups.items():
        tag = {True: " (PDL)", False: " (no PDL)", None: ""}
        sizes = ", ".join(f"{u} us at n = {n}{tag[f.pdl]}" for f in figs for n, u in f.us)
        why = next((f.note for f in figs if f.note), "")
        if any(f.match is _index_cast_only for f in figs):
            why = "The bench has no 128-d fp8 index workload of the cast alone (INDEX_FP8_FP32, no norm, no RoPE)"
        out.append(f"- {call}: {engine}, {sizes}. {why or 'No kvfuse workload does this call'}.")
    return out


def full_run_workloads() -> List[str]:
    """The workloads of a run that fills every table: the engines' matches (the first of each), the
    models' DeepSeek calls, the cast-only, grouped and GQA workloads of the bench (one of each definition)."""
    names = [c[0] for c in (candidates(f) for f in ENGINE_FIGURES) if c]
    names += [w for w, d in WORKLOADS.items() if w.startswith(("dsv", GROUP_PREFIX)) or d.kind == "gqa"
              or (d.kind == "write" and cast_only(w))]
    out, seen = [], set()
    for w in names:                     # one of each definition (the models' calls repeat some presets)
        d = dataclasses.replace(WORKLOADS[w], name="", description="")
        if d not in seen:
            seen.add(d)
            out.append(w)
    return out


def _regenerate() -> List[str]:
    peers = ",".join(["fused"] + list(GQA_PEERS) + ["calls", "stages"])
    return ["## Regenerating", "",
            "One run that fills every table, with programmatic dependent launch as the engines' PDL figures "
            "(add `compile` to `--peers` for the torch.compile peer; it is slow):",
            "", "```bash",
            f"python -m kvfuse.cli bench --pdl --workloads {','.join(full_run_workloads())} --n {FULL_SIZES} "
            f"--peers {peers} --budget-s 500 --out bench-out",
            "cp bench-out/kvfuse_bench.json benchmarks/results/<date>_<device>_bench.json",
            "python benchmarks/benchmarks_md.py benchmarks/results/<date>_<device>_bench.json",
            "```"]


def render(report: dict, source: str = "the result JSON", gqa_report: Optional[dict] = None,
           gqa_source: Optional[str] = None, group_report: Optional[dict] = None,
           group_source: Optional[str] = None) -> str:
    """BENCHMARKS.md (Markdown, ending with a newline) for one bench result (the dict of its JSON);
    ``source``: how the document names that JSON. ``gqa_report`` / ``gqa_source``: a later run whose GQA
    workloads fill the GQA / MHA section instead (when that kernel changed after the run of the rest);
    ``group_report`` / ``group_source`` the same for the Grouped section."""
    later = [name for name, rep in (("Grouped", group_report), ("GQA / MHA", gqa_report)) if rep is not None]
    one = "one `kvfuse bench` run" if not later else \
        f"one `kvfuse bench` run (the {' and the '.join(later)} section{'s' if len(later) > 1 else ''}: " \
        f"a later run of {'their' if len(later) > 1 else 'its'} own, named there)"
    lines = ["# Benchmarks", "",
             f"kvfuse's GPU time per call, from {one}, beside the engines' kernels that do the same "
             "work. Generated by `python benchmarks/benchmarks_md.py` from the run's JSON: regenerate it, do not "
             "edit it.", ""]
    lines += _measured(report, source) + [""]
    lines += _size_section(report, f"## Decode (n <= {DECODE_MAX})", "One token per sequence: the launch and "
                           "its latency dominate.", lambda n: n <= DECODE_MAX, False) + [""]
    lines += _size_section(report, f"## Prefill (n >= {PREFILL_MIN})", "Whole sequences: DRAM bandwidth "
                           "dominates (% of copy: the effective bandwidth against the copy bandwidth).",
                           lambda n: n >= PREFILL_MIN, True) + [""]
    lines += _cast_section(report) + [""]
    lines += (_group_section(report) if group_report is None else
              _group_section(group_report, group_source or "the grouped result JSON")) + [""]
    lines += (_gqa_section(report) if gqa_report is None else
              _gqa_section(gqa_report, gqa_source or "the GQA result JSON")) + [""]
    lines += _targets_section(report) + [""]
    lines += _not_measured() + [""]
    lines += _regenerate()
    return "\n".join(lines).rstrip() + "\n"


DEFAULT = ROOT / "benchmarks" / "results" / "2026-12-02_h200_full_bench.json"
TARGET = ROOT / "BENCHMARKS.md"


def source_name(path: Path) -> str:
    """The JSON's path relative to the repository root when it lies inside, else as given."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("result", nargs="?", default=str(DEFAULT), help="a kvfuse_bench.json (default: %(default)s)")
    p.add_argument("--gqa", default=None, help="a later kvfuse_bench.json whose GQA workloads fill the GQA / MHA "
                                              "section (named there)")
    p.add_argument("--group", default=None, help="a later kvfuse_bench.json whose grouped workloads fill the "
                                                "Grouped section (named there)")
    p.add_argument("--out", default=str(TARGET), help="where to write (default: BENCHMARKS.md at the repository root)")
    modes = p.add_mutually_exclusive_group()
    modes.add_argument("--stdout", action="store_true", help="print the document instead of writing it")
    modes.add_argument("--check", action="store_true", help="exit 1 when --out differs from the rendering")
    args = p.parse_args(argv)
    path = Path(args.result)
    gqa = Path(args.gqa) if args.gqa else None
    group = Path(args.group) if args.group else None
    text = render(json.loads(path.read_text()), source_name(path),
                  json.loads(gqa.read_text()) if gqa else None, source_name(gqa) if gqa else None,
                  json.loads(group.read_text()) if group else None, source_name(group) if group else None)
    out = Path(args.out)
    if args.stdout:
        sys.stdout.write(text)
    elif args.check:
        if not out.exists() or out.read_text() != text:
            print(f"{out} differs from the rendering of {path}: run python benchmarks/benchmarks_md.py {path}",
                  file=sys.stderr)
            return 1
    else:
        out.write_text(text)
        print(f"wrote {os.path.relpath(out)} from {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
