"""BENCHMARKS.md (repository root) from the committed results of two runs: kvfuse's own tables from ONE
``kvfuse bench`` result JSON (:func:`kvfuse.bench.write_json`), and kvfuse beside the engines' kernels
from ONE run of the side-by-side harness (``../shared/peers``, its ``peers.json``).

    python benchmarks/benchmarks_md.py RESULT.json            # write BENCHMARKS.md
    python benchmarks/benchmarks_md.py RESULT.json --peers PEERS.json   # the side-by-side run to render
    python benchmarks/benchmarks_md.py RESULT.json --stdout   # print it instead
    python benchmarks/benchmarks_md.py RESULT.json --check    # exit 1 when BENCHMARKS.md differs
    python benchmarks/benchmarks_md.py RESULT.json --gqa GQA.json   # the GQA / MHA section from a later run
    python benchmarks/benchmarks_md.py RESULT.json --group G.json   # the Grouped section from a later run
    python benchmarks/benchmarks_md.py --host-time H.json   # the host-time target from this eager_host_time.py run

Without RESULT.json: the latest ``benchmarks/results/*_full_bench.json``; without --peers: the latest
``benchmarks/results/*_peers.json`` (its ``_log.txt`` beside it, when present, adds the software and the
byte checks' partners); without --formats / --host-time: the latest ``*_gqa_formats.json`` /
``*_eager_host_time.json`` there.

Every kvfuse-only figure comes from the bench JSON: its device, software, date, copy bandwidth, launch
floor and byte accounting, and the GPU time of each (workload, n, peer). Every engine figure comes from the
peers JSON, beside the kvfuse row it was measured against in that run (the row's ``vs``): both rows of a
comparison are from the same run, inputs and moment. Nothing here holds a measured figure; what the JSON
does not record (the engines' releases, layout notes) is text keyed by engine or row name. The Targets
section recomputes the project's targets (:func:`kvfuse.bench.check_targets`, as it stands) from the bench
run's records; the section after it checks the targets beside the engines and on the host from the bench
run, the peers run and the eager host-time run (``benchmarks/eager_host_time.py``), each line a verdict on
figures of those JSONs. :func:`render` does the work; tests/test_benchmarks_md.py imports this file with
benchmarks/ on its path.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvfuse.bench import (FLOOR_SIZES, FLOOR_TARGET, GQA_PEERS, PCT_COPY_N, TARGET_KINDS, WORKLOADS,  # noqa: E402
                          Record, check_targets)
from kvfuse.bench.targets import (DECODE_FLOOR_N, ENGINE_DECODE_SIZES, GQA_QK_NORM_PCT_COPY,  # noqa: E402
                                  HOST_US_TARGET, PCT_COPY_TARGET, pct_copy_target)
from kvfuse.dispatch import GROUP_ONE_LAUNCH_MAX_N  # noqa: E402

__all__ = ["ENGINE_RELEASES", "PEERS_GROUPS", "ROW_NOTES", "TIE", "render", "verdict", "cast_only",
           "engine_rows", "latest"]

TIE = 0.03                   # kvfuse / engine within 1 +- TIE: "even"
DECODE_MAX = 256             # the decode table: n <= this
PREFILL_MIN = 4096           # the prefill table: n >= this
SIZES = "1,256,4096,65536"   # the sizes the suggested commands measure
GQA_SIZES = "1,64,256,4096,65536"
FULL_SIZES = GQA_SIZES + ",262144"   # the full run: the writes' large-n targets too (larger inputs skip themselves)
GROUP_PREFIX = "group_"
# the full run's first workloads: the bench's forms of the calls the engines' kernels also make (MAIN_FP8 and
# FLASHMLA_MODEL1 writes, the V3.2 indexer K, the MAIN_FP8 cast, V4's Q + KV in one launch)
ENGINE_CALL_WORKLOADS = ("main_fp8_gptj", "flashmla_model1_gptj", "dsv32_index_k", "main_fp8_cast", "group_dsv4_q_kv")

# ------------------------------------------------------------------ the side-by-side harness (../shared/peers)
PEERS_HARNESS = "../shared/peers"
# its groups (README's table; bench_peers.GROUPS): the JSON's group name -> (the harness's key, what is written)
PEERS_GROUPS = {
    "dsv4_flashmla": ("A", "DeepSeek V4, FLASHMLA_MODEL1 cache"),
    "dsv4_main_fp8": ("B", "DeepSeek V4, MAIN_FP8 cache"),
    "dsv4_main_fp4": ("C", "DeepSeek V4, MAIN_FP4 cache"),
    "dsv3_flashmla": ("D", "DeepSeek V3, FLASHMLA_V32 cache"),
    "dsv32_index": ("E", "DeepSeek V3.2 indexer K, INDEX_FP8_FP32"),
    "gqa": ("F", "GQA / MHA: Llama 3 8B, Qwen3 8B"),
    "gqa_nvfp4": ("G", "GQA / MHA NVFP4 caches (FlashInfer's layout): Llama 3 8B"),
    "gqa_per_token_head": ("H", "GQA / MHA per-(token, head) fp8 / int8 caches (vLLM's): Llama 3 8B"),
}
SMALL_ONLY_GROUPS = ("gqa", "gqa_nvfp4", "gqa_per_token_head")   # run without the --big sizes
PEERS_SIZES = (1, 256, 4096, 65536)     # bench_peers.py's --sizes default
PEERS_BIG = 262144                      # its --big default, for every group but the GQA one
# the releases the harness builds, from its README (the JSON records none; a JSON with "releases" wins)
ENGINE_RELEASES = {"flashinfer": "FlashInfer 0.7.2.post1", "sglang": "SGLang 0.5.23", "vllm": "vLLM 0.33.0"}
# what a row's own note (the JSON's) does not say: the layout difference behind its bytes and time
ROW_NOTES = {
    "flashinfer triton ds-v4.1 quantize_cache mxfp8":
        "FlashInfer writes its own page layout, not the MAIN_FP8 record: a 64-token page holds its tokens' "
        "512-byte code rows, then their 16-byte scale rows (528 bytes a token, no reserved bytes), where a "
        "MAIN_FP8 record is 532 bytes, 4-byte aligned, its 4 reserved bytes written as zeros (docs/performance.md, "
        "\"The cast alone\")",
}


def _fused(report: dict) -> Dict[Tuple[str, int], dict]:
    return {(r["workload"], r["n"]): r for r in report["results"] if r["peer"] == "fused" and r["status"] == "ok"
            and r.get("gpu_us")}


def _run_workloads(report: dict) -> List[str]:
    """The run's workloads, in its order."""
    names = list(report.get("workloads", {}))
    return names + [w for w in dict.fromkeys(r["workload"] for r in report["results"]) if w not in names]


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


# =============================================================================== the side-by-side run
SIDE_BY_SIDE = "Beside the engines' kernels"
_MODEL_TAG = re.compile(r"^\[[^\]]*\]\s*")        # "[llama-3-8b fp8] " before a GQA row's call
_PDL_TAG = re.compile(r"\s*(\[PDL\]|\(PDL off\))$")


def latest(pattern: str) -> Optional[Path]:
    """The last file of benchmarks/results/ matching ``pattern`` by name (the names start with their date)."""
    found = sorted((ROOT / "benchmarks" / "results").glob(pattern))
    return found[-1] if found else None


def engine_of(row: str) -> str:
    """The engine of a peers row: its first word after the model tag ("flashinfer", "sglang", "vllm")."""
    return _MODEL_TAG.sub("", row).split(" ", 1)[0].lower()


def engine_rows(peers: dict) -> List[Tuple[str, str]]:
    """(group, row) of every engine row of a peers JSON, in its order: the rows that are no kvfuse call
    (``pdl`` None; kvfuse's rows record PDL on or off)."""
    return list(dict.fromkeys((r["group"], r["row"]) for r in peers.get("records", []) if r.get("pdl") is None))


def _peers_by_row(peers: dict) -> Dict[Tuple[str, str], Dict[int, dict]]:
    """The records of a peers JSON by (group, row), then by n."""
    out: Dict[Tuple[str, str], Dict[int, dict]] = {}
    for r in peers.get("records", []):
        out.setdefault((r["group"], r["row"]), {})[r["n"]] = r
    return out


def _vs(per: Dict[int, dict]) -> Optional[str]:
    """The row a row's records were measured against (their ``vs``), or None."""
    return next((r["vs"] for r in per.values() if r.get("vs")), None)


def _engine_pdl(row: str) -> str:
    tag = _PDL_TAG.search(row)
    return "as it launches" if tag is None else ("on" if tag.group(1) == "[PDL]" else "off")


def _log_facts(peers: dict, log: Optional[str]) -> dict:
    """What the run's log adds to its JSON: the software line, tvm_ffi's version, the launch floor, and each
    byte check's n and partner ({(group, row): (n, partner)})."""
    facts: dict = {"checks": {}}
    if not log:
        return facts
    m = re.search(r"^device: [^|\n]*\| (.+)$", log, re.M)
    if m:
        facts["software"] = ", ".join(p.strip().replace("triton", "Triton") for p in m.group(1).split("|"))
    m = re.search(r"^tvm_ffi (\S+)", log, re.M)
    if m:
        facts["tvm_ffi"] = m.group(1)
    m = re.search(r"^launch floor: ([0-9.]+) us", log, re.M)
    if m:
        facts["floor_us"] = float(m.group(1))
    lines = log.splitlines()
    for c in peers.get("checks", []):
        head, tail = f"[check {c['group']} n=", f": {c['result']}"
        for line in lines:
            n, sep, rest = line[len(head):].partition(f"] {c['row']} vs ")
            if line.startswith(head) and sep and line.endswith(tail) and n.isdigit():
                facts["checks"][(c["group"], c["row"])] = (int(n), rest[:-len(tail)])
                break
    return facts


def _releases(peers: dict) -> Tuple[Dict[str, str], str]:
    recorded = peers.get("releases")
    if recorded:
        return dict(recorded), "recorded in the JSON"
    return ENGINE_RELEASES, f"the harness's README, `{PEERS_HARNESS}/README.md`: the JSON does not record them"


def _groups(peers: dict) -> List[str]:
    return list(dict.fromkeys(r["group"] for r in peers.get("records", [])))


def _run_command(peers: dict) -> str:
    keys = [PEERS_GROUPS.get(g, (g, ""))[0] for g in _groups(peers)]
    sizes = sorted(peers.get("sizes", []))
    args = f" --groups {','.join(keys)}" if keys else ""
    small = [n for n in sizes if n != PEERS_BIG]
    if small and small != list(PEERS_SIZES):
        args += f" --sizes {','.join(map(str, small))}"
    if sizes and PEERS_BIG not in sizes and any(g not in SMALL_ONLY_GROUPS for g in _groups(peers)):
        args += " --big ''"
    return f"`bash .peers/run.sh{args}`"


def _peers_how(peers: dict, source: str, facts: dict) -> List[str]:
    releases, said = _releases(peers)
    date = re.match(r"\d{4}-\d{2}-\d{2}", Path(source).name)
    copy = peers.get("copy_GBps")
    software = facts.get("software", "not recorded (the JSON holds none; its log does)")
    if facts.get("tvm_ffi"):
        software += f", apache-tvm-ffi {facts['tvm_ffi']}"
    present = ", ".join(f"{PEERS_GROUPS.get(g, ('?', ''))[0]} (`{g}`)" for g in _groups(peers)) or "none"
    return [
        "### How the engines' rows were produced", "",
        f"- Side-by-side result: `{source}` (its log and summary table beside it: `_log.txt`, "
        "`_summary_table.md`), one run of the side-by-side harness (`bench_peers.py` of "
        f"`{PEERS_HARNESS}`, kept outside this repository because it holds the engines' code); groups {present}.",
        f"- Device: {peers.get('device', 'not recorded')}; {software}; date "
        f"{date.group(0) + ' (from the file name)' if date else 'not recorded'}; copy bandwidth "
        f"{'not measured' if copy is None else f'{copy / 1e3:.2f} TB/s'}"
        + (f", launch floor {facts['floor_us']:.2f} us" if "floor_us" in facts else "") + " (the harness's own).",
        "- Releases: " + ", ".join(releases[e] for e in sorted(releases)) + f" ({said}).",
        "- Builds: the engines' CUDA kernels (FlashInfer's RoPE and paged-append modules, SGLang's JIT "
        "kernels, vLLM's CUDA kernels transcribed from vllm-project/vllm) compiled with nvcc for sm_90a as "
        "TVM-FFI modules, the way each engine's JIT builds them; their Triton kernels (FlashInfer's DeepSeek "
        "`quantize_cache`, vLLM's `quantize_and_insert_k`) taken from the released wheels and compiled by the "
        "device's Triton.",
        "- Rows: every kvfuse row is one of kvfuse's real calls (`kvfuse.mla` with a `kvfuse.models` "
        "configuration, `GQAConfig.store_kv`, or an adapter of `kvfuse.engines`) doing the work of the engine "
        "rows measured against it (each engine row's `vs` in the JSON); both on the same input tensors "
        "(`kvfuse.bench.build_inputs` for the model's workload), one after the other in one process.",
        "- Time: GPU us per call, several calls captured in one CUDA graph, median per call over replays "
        "(`kvfuse.bench.CudaTimer`; † marks a row timed with CUDA events around eager calls). PDL: a "
        "\"[PDL]\" kvfuse row runs with `kvfuse.set_pdl(True)` against the engine's PDL launch, a \"(PDL "
        "off)\" row against its launch without; an engine row with neither tag runs as the engine launches it.",
        "- Byte check: at n = 256 the rows are built again on fresh inputs and called once each; an engine "
        "row's records at the written slots (and its Q output where both write one) are compared byte for "
        "byte with those of the kvfuse row it names (the log names both; the row of a PDL pair without PDL "
        "is not checked).",
        f"- Command: {_run_command(peers)} on the GPU, after `bash {PEERS_HARNESS}/build_here.sh setup` and "
        f"`bash {PEERS_HARNESS}/build_here.sh all` on a machine with nvcc (the JSON does not record its "
        "command: this is the harness's command for the groups and sizes it holds).",
        "- The kvfuse-only tables of the other sections come from the `kvfuse bench` run named in \"How it was "
        "measured\", a separate run: a kvfuse call measured in both has a figure in each. Compare an engine's "
        "figure with the kvfuse figure beside it here, from the same run, inputs and moment.",
    ]


def _cell(rec: Optional[dict]) -> str:
    if rec is None:
        return "-"
    if rec.get("status") != "ok" or not rec.get("gpu_us"):
        return rec.get("status", "-") + (f" ({rec['err']})" if rec.get("err") and rec.get("status") == "skipped"
                                         else "")
    return _us(rec["gpu_us"]) + ("" if rec.get("method", "graph") == "graph" else " †")


def _peers_group(peers: dict, group: str, facts: dict) -> List[str]:
    releases, _ = _releases(peers)
    by_row = {row: per for (g, row), per in _peers_by_row(peers).items() if g == group}
    checks = {c["row"]: c["result"] for c in peers.get("checks", []) if c["group"] == group}
    key, what = PEERS_GROUPS.get(group, ("?", "a group this generator does not know"))
    out = [f"### {key}. {what} (`{group}`)", ""]
    rows, wins, even, total = [], 0, 0, 0
    for g, label in engine_rows(peers):
        if g != group:
            continue
        mine = by_row[label]
        vs = _vs(mine)
        theirs = by_row.get(vs, {}) if vs else {}
        kv_pdl = next((r["pdl"] for r in theirs.values()), None)
        check_n, partner = facts["checks"].get((group, label), (256, None))
        for n in sorted(mine):
            e, k = mine[n], theirs.get(n)
            ok = (e.get("status") == "ok" and e.get("gpu_us") and k is not None and k.get("status") == "ok"
                  and k.get("gpu_us"))
            mark = verdict(k["gpu_us"], e["gpu_us"]) if ok else "-"
            wins, even, total = wins + (mark == "wins"), even + (mark == "even"), total + bool(ok)
            check = ""
            if n == check_n:
                check = checks.get(label, "not checked")
                if partner is not None and partner != vs:
                    check += f" (against `{partner}`)"
            pair = [releases.get(engine_of(label), "not recorded"), label, vs or "-",
                    f"{'-' if kv_pdl is None else ('on' if kv_pdl else 'off')} / {_engine_pdl(label)}"]
            first = n == min(mine)          # the pair's cells once, on its first size
            rows.append((pair if first else [""] * len(pair)) +
                        [str(n), _cell(k) if vs else "-", _cell(e), f"{k['gpu_us'] / e['gpu_us']:.2f}" if ok else "-",
                         _mark(mark), check])
    if rows:
        out += _table(["engine", "engine row", "kvfuse row (its `vs`)", "PDL: kvfuse / engine", "n", "kvfuse us",
                       "engine us", "kvfuse / engine", "kvfuse", "bytes equal (byte check)"], rows)
        out += ["", f"kvfuse wins {wins} of these {total} comparisons ({even} even, {total - wins - even} lost). "
                "A pair's engine, rows and PDL are named on its first line."]
    else:
        out.append("This group of the run has no engine row.")
    notes: Dict[str, str] = {}
    for label, per in by_row.items():
        base = _PDL_TAG.sub("", label)
        note = next((r.get("note") for r in per.values() if r.get("note")), "")
        extra = ROW_NOTES.get(label) or ROW_NOTES.get(base)
        notes.setdefault(base, "; ".join(t for t in (note, extra) if t))
    out += ["", "The rows (the harness's notes, and what differs):", ""]
    out += [f"- `{base}`: {note or 'no note'}." for base, note in notes.items()]
    own = [(label, facts["checks"].get((group, label), (None, None))[1], result) for label, result in checks.items()
           if (group, label) not in engine_rows(peers)]
    if own:
        out += ["", "Byte checks between kvfuse's own calls:", ""]
        out += [f"- `{label}`" + (f" against `{partner}`" if partner else "") + f": {result}."
                for label, partner, result in own]
    return out


def _peers_section(peers: Optional[dict], source: Optional[str], log: Optional[str]) -> List[str]:
    out = [f"## {SIDE_BY_SIDE}", "",
           "kvfuse's calls and the engines' own kernels doing the same work, measured side by side in one run "
           "of the side-by-side harness: every engine row of that run beside the kvfuse row it was measured "
           "against, both figures from the run's JSON, with the ratio, the verdict and the byte check.", ""]
    if peers is None:
        return out + [f"No side-by-side result was given: `bash .peers/run.sh` (the harness `{PEERS_HARNESS}`) "
                      "writes one; commit it as `benchmarks/results/<date>_<device>_peers.json` and pass it with "
                      "`--peers`."]
    facts = _log_facts(peers, log)
    out += _peers_how(peers, source or "the peers JSON", facts)
    for group in _groups(peers):
        out += [""] + _peers_group(peers, group, facts)
    lacking = [g for g in PEERS_GROUPS if g not in _groups(peers)]
    if lacking:
        keys = ",".join(PEERS_GROUPS[g][0] for g in lacking)
        out += ["", "Groups of the harness this run lacks: " + "; ".join(
            f"{PEERS_GROUPS[g][0]} (`{g}`: {PEERS_GROUPS[g][1]})" for g in lacking) +
            f". `bash .peers/run.sh --groups {keys}` measures them."]
    return out


# =============================================================================== sections
def _measured(report: dict, source: str, peers_source: Optional[str]) -> List[str]:
    peers_text = f"`{peers_source}`" if peers_source else "(none given here)"
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
        f"- Source of kvfuse's own tables (every section but \"{SIDE_BY_SIDE}\"): `{source}`, one `kvfuse "
        f"bench` run; command {_command_of_run(meta)}.",
        f"- Device: {hw}" + (f" ({extra})" if extra else "") + f"; {software}.",
        f"- Date: {_date(meta.get('date'))}.",
        f"- Copy bandwidth: {copy_text}. Launch floor: {floor_text}.",
        "- kvfuse's time: GPU us per call, CUDA-graph replay of several calls, median per call over replays "
        "(a figure timed otherwise is marked). " + f"PDL {pdl}; {'cold' if cfg.get('cold_l2') else 'warm'} L2.",
        f"- Inputs: {inputs_text}.",
        f"- Byte accounting (GB/s and % of copy): {report.get('accounting', 'not recorded')}; GB/s = those bytes / "
        "GPU time, % of copy = GB/s / copy bandwidth. Every peer of a point is charged the same bytes.",
        f"- Engines' figures: none in this run; they come from the side-by-side run {peers_text} "
        f"(\"{SIDE_BY_SIDE}\": each engine row beside the kvfuse row it was measured against in that run).",
        f"- Verdicts: kvfuse **wins** when its time is below the other's (an engine's, or a peer's of the "
        f"bench) by more than {TIE:.0%}, loses when above by more than {TIE:.0%}, and is even otherwise.",
    ]
    return lines


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
    out = [title, "", intro + f" kvfuse's calls alone; the engines' kernels at these sizes: \"{SIDE_BY_SIDE}\"."]
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
        casts = [w for w in WORKLOADS if _category(report, w) == "cast"]
        return out + [f"This run has no cast-only workload. {_cmd(casts, FULL_SIZES)} measures them."]
    return out + ["GPU us (% of copy in parentheses):", ""] + _alone(report, names, lambda n: True, True)


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
        out += ["GPU us per call and the other peers of the run:", ""] + _peer_table(report, names, "calls")
        return out
    known = [w for w in WORKLOADS if w.startswith(GROUP_PREFIX)]
    if known:
        out.append(f"This run has no grouped workload. {_cmd(known, SIZES, 'fused,calls,stages')} measures them.")
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


FORMATS_TARGETS = (1.2, 85.0)     # a GQA cache format's write: <= 1.2x the fp8 per-tensor write at n = 1, >= 85% of copy at 65536


def _formats_section(formats: Optional[dict], source: Optional[str], pdl: Optional[bool]) -> List[str]:
    """The GQA entry's write with each cache format of kvfuse.gqa_formats (benchmarks/gqa_formats_bench.py's
    JSON ``formats``, named ``source``; ``pdl`` from its log, None: not recorded)."""
    out = ["## GQA / MHA cache formats (`kvfuse.gqa_formats`)", ""]
    if not formats:
        return out + ["No run of `benchmarks/gqa_formats_bench.py` is committed: `python benchmarks/gqa_formats_bench.py "
                      "--n 1,256,4096,65536 --json benchmarks/results/<date>_<device>_gqa_formats.json` measures it."]
    rows = formats.get("rows", [])
    wl = rows[0].get("workload", "?") if rows else "?"
    sizes = sorted({r["n"] for r in rows})
    names = list(dict.fromkeys(r["format"] for r in rows))
    by = {(r["format"], r["n"]): r for r in rows}
    top = max(sizes) if sizes else None
    copy = formats.get("copy_GBps")
    out += [f"- Source: `{source}` (`benchmarks/gqa_formats_bench.py --workload {wl} --n {','.join(map(str, sizes))}`), "
            f"{formats.get('device', 'device not recorded')}, torch {formats.get('torch', '?')}, {formats.get('date', 'date not recorded')}; "
            f"copy bandwidth {'not measured' if copy is None else f'{copy:.0f} GB/s'}; PDL "
            f"{'not recorded' if pdl is None else ('on' if pdl else 'off')}.",
            f"- The workload's call with K and V caches of each preset: GPU us (x the fp8_e4m3 per-tensor write of the "
            f"same n), % of copy in compulsory bytes at n = {top}; targets: within {FORMATS_TARGETS[0]}x of fp8_e4m3 "
            f"at n = 1, at least {FORMATS_TARGETS[1]:.0f}% of copy at n = 65536.", ""]
    head = ["format"] + [f"n = {n}" for n in sizes] + [f"% of copy at {top}", "n = 1 target", "65536 target"]
    table = []
    for name in names:
        cells = [f"`{name}`"]
        for n in sizes:
            r = by.get((name, n))
            cells.append("-" if r is None else f"{r['gpu_us']:.2f}" + ("" if name == "fp8_e4m3" else f" ({r['x_fp8']:.2f}x)"))
        r_top = by.get((name, top))
        cells.append("-" if r_top is None else f"{r_top['pct_copy']:.1f}%")
        one, big = by.get((name, 1)), by.get((name, 65536))
        cells.append("-" if one is None or name == "fp8_e4m3" else ("met" if one["x_fp8"] <= FORMATS_TARGETS[0] else "missed"))
        cells.append("-" if big is None else ("met" if big["pct_copy"] >= FORMATS_TARGETS[1] else "missed"))
        table.append(cells)
    return out + _table(head, table)


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


# =============================================================================== targets beside the engines, host
BESIDE_TARGETS = "Targets beside the engines and on the host"
CAST_GROUP, CAST_ROW = "dsv4_main_fp8", "kvfuse write_main_cache_gathered (cast only)"   # the cast alone, side by side
MAIN_FP4_WORKLOAD = "dsv4_main_fp4"
INDEX_K_SUFFIX = "index_k"             # the indexer K writes: every workload of the run named *index_k
HOST_FLOOR_PREFIX = "floor:"           # a host-time row that is a reference launch, not a kvfuse call


@dataclasses.dataclass
class TargetLine:
    """One line of the table: a target (its number and what it asks) on the rows it covers, what was
    measured and the verdict ("met", "missed" or "not measured")."""
    target: str
    rows: str
    measured: str
    verdict: str


def _met(ok: bool) -> str:
    return "met" if ok else "missed"


def _ok_us(rec: Optional[dict]) -> Optional[float]:
    return rec["gpu_us"] if rec is not None and rec.get("status") == "ok" and rec.get("gpu_us") else None


def pdl_engine_rows(peers: dict) -> List[Tuple[str, str, List[str]]]:
    """(group, kvfuse row, engine rows) for every kvfuse "[PDL]" row of a peers JSON that engine rows were
    measured against, as the JSON pairs them: an engine row whose ``vs`` is that row (the engine's PDL launch),
    and an engine row without a PDL tag (the engine's own launch, no PDL variant) whose ``vs`` is the row's
    "(PDL off)" twin; an engine's "(PDL off)" row never."""
    by_row = _peers_by_row(peers)
    engines = engine_rows(peers)
    out = []
    for group, label in by_row:
        if not label.endswith("[PDL]") or next(iter(by_row[(group, label)].values())).get("pdl") is None:
            continue
        twin = _PDL_TAG.sub("", label) + " (PDL off)"
        paired = [e for g, e in engines if g == group and (_vs(by_row[(g, e)]) == label or (
            _vs(by_row[(g, e)]) == twin and _PDL_TAG.search(e) is None))]
        if paired:
            out.append((group, label, paired))
    return out


def _fastest(by_row: dict, group: str, rows: Sequence[str], n: int) -> Optional[Tuple[str, float]]:
    timed = [(us, row) for row in rows if (us := _ok_us(by_row[(group, row)].get(n))) is not None]
    return None if not timed else min(timed)[::-1]


def _beside(kv_us: float, engine_us: float) -> Tuple[str, str]:
    """The measured cell and verdict of kvfuse's time against an engine's; the ratio with enough decimals
    that a miss never prints as 1.00x."""
    ratio, digits = kv_us / engine_us, 2
    while digits < 4 and ratio != 1 and round(ratio, digits) == 1:
        digits += 1
    return f"{_us(kv_us)} us vs {_us(engine_us)} us ({ratio:.{digits}f}x)", _met(kv_us <= engine_us)


def engine_decode_lines(peers: Optional[dict]) -> List[TargetLine]:
    """Target 1: every kvfuse "[PDL]" row against the fastest engine row measured against it, at each n of
    ENGINE_DECODE_SIZES; a group of the run with engine rows but no such kvfuse row: not measured."""
    if peers is None:
        return [TargetLine("1. decode vs the engines", "every kvfuse [PDL] row beside an engine",
                           "no side-by-side run", "not measured")]
    by_row, out = _peers_by_row(peers), []
    pairs = pdl_engine_rows(peers)
    for group, label, engines in pairs:
        for n in ENGINE_DECODE_SIZES:
            kv_us, best = _ok_us(by_row[(group, label)].get(n)), _fastest(by_row, group, engines, n)
            rows = f"`{group}`: `{label}`"
            if kv_us is None or best is None:
                out.append(TargetLine(f"1. decode vs the engines, n = {n}", rows,
                                      f"{'kvfuse' if kv_us is None else 'no engine row'} not timed at n = {n}",
                                      "not measured"))
                continue
            measured, verdict_ = _beside(kv_us, best[1])
            of = f" (fastest of {len(engines)})" if len(engines) > 1 else ""
            out.append(TargetLine(f"1. decode vs the engines, n = {n}", f"{rows} vs `{best[0]}`{of}", measured,
                                  verdict_))
    covered = {g for g, _, _ in pairs}
    for group in dict.fromkeys(g for g, _ in engine_rows(peers)):
        if group not in covered:
            out.append(TargetLine("1. decode vs the engines", f"`{group}`",
                                  "no kvfuse [PDL] row measured against an engine row", "not measured"))
    return out


def _cache_writes(report: dict, gqa_report: Optional[dict]) -> List[Tuple[dict, str]]:
    """(run, workload) of every cache write: the MLA writes of the full run, then the GQA writes of the GQA
    run when one is given (it fills the GQA / MHA section), else of the full run."""
    gqa_run = report if gqa_report is None else gqa_report
    return ([(report, w) for w in _run_workloads(report) if not w.startswith(GROUP_PREFIX)
             and _kind(report, w) == "write"]
            + [(gqa_run, w) for w in _run_workloads(gqa_run) if _category(gqa_run, w) == "gqa"])


def floor_lines(report: dict, gqa_report: Optional[dict] = None) -> List[TargetLine]:
    """Target 2: every cache write (MLA and GQA) at n = DECODE_FLOOR_N within FLOOR_TARGET x its run's launch
    floor."""
    n, target, out = DECODE_FLOOR_N, f"2. decode <= {FLOOR_TARGET:g}x the launch floor, n = {DECODE_FLOOR_N}", []
    for run, w in _cache_writes(report, gqa_report):
        us, floor = _ok_us(_fused(run).get((w, n))), run.get("device", {}).get("floor_us")
        if us is None or not floor:
            out.append(TargetLine(target, f"`{w}`", "no launch floor in the run" if not floor else
                                  f"not timed at n = {n}", "not measured"))
        else:
            out.append(TargetLine(target, f"`{w}`", f"{_us(us)} us / {floor:.2f} us = {us / floor:.2f}x",
                                  _met(us / floor <= FLOOR_TARGET)))
    return out or [TargetLine(target, "every cache write of the run", "the run has none", "not measured")]


def _qk_norm(name: str) -> bool:
    w = WORKLOADS.get(name)
    return w is not None and w.kind == "gqa" and w.gqa is not None and w.gqa.qk_norm


def pct_copy_lines(report: dict, gqa_report: Optional[dict] = None) -> List[TargetLine]:
    """Target 3: % of copy at large n: MAIN_FP4 and every indexer K at PCT_COPY_N (the thresholds of
    :func:`kvfuse.bench.pct_copy_target`), the GQA writes whose model has a q / k norm at
    GQA_QK_NORM_PCT_COPY's n (from the GQA run when one is given)."""
    gqa_run = report if gqa_report is None else gqa_report
    names, gqa_n, gqa_pct = _run_workloads(report), *GQA_QK_NORM_PCT_COPY

    def of_format(w: str, rec: Optional[dict]) -> float:        # the cache format's threshold, as check_targets'
        d = WORKLOADS.get(w)
        slots = (rec or {}).get("slots", "")
        return PCT_COPY_TARGET if d is None or d.fmt is None else pct_copy_target(d.fmt.name, slots)

    fp4 = [MAIN_FP4_WORKLOAD] if MAIN_FP4_WORKLOAD in names else []
    asks = [(f"3. MAIN_FP4 % of copy at {PCT_COPY_N}", report, fp4, PCT_COPY_N, f"`{MAIN_FP4_WORKLOAD}`", of_format),
            (f"3. indexer K % of copy at {PCT_COPY_N}", report, [w for w in names if w.endswith(INDEX_K_SUFFIX)],
             PCT_COPY_N, f"every `*{INDEX_K_SUFFIX}` workload", of_format),
            (f"3. GQA with QK-norm % of copy at {gqa_n}", gqa_run, [w for w in _run_workloads(gqa_run) if _qk_norm(w)],
             gqa_n, "every GQA workload whose model has a q / k norm", lambda w, rec: gqa_pct)]
    out = []
    for target, run, workloads, n, what, threshold_of in asks:
        if not workloads:
            out.append(TargetLine(target, what, "not in the run", "not measured"))
        fused = _fused(run)
        for w in workloads:
            rec = fused.get((w, n))
            pct, threshold = None if rec is None else rec.get("pct_copy"), threshold_of(w, rec)
            if pct is None:
                out.append(TargetLine(target, f"`{w}` (>= {threshold:g}%)", f"not timed at n = {n}", "not measured"))
            else:
                out.append(TargetLine(target, f"`{w}` (>= {threshold:g}%)", f"{pct:.1f}% ({_us(rec['gpu_us'])} us)",
                                      _met(pct >= threshold)))
    return out


def cast_lines(peers: Optional[dict]) -> List[TargetLine]:
    """Target 4: the cast alone (CAST_ROW of CAST_GROUP) at or under FlashInfer's row measured against it,
    at every n of the run."""
    target = "4. the cast alone vs FlashInfer"
    rows = f"`{CAST_GROUP}`: `{CAST_ROW}`"
    by_row = {} if peers is None else _peers_by_row(peers)
    mine = by_row.get((CAST_GROUP, CAST_ROW))
    engines = [e for g, e in ([] if peers is None else engine_rows(peers)) if g == CAST_GROUP
               and _vs(by_row[(g, e)]) == CAST_ROW and engine_of(e) == "flashinfer"]
    if not mine or not engines:
        return [TargetLine(target, rows, "no side-by-side run" if peers is None else
                           "the run has no such pair of rows", "not measured")]
    out = []
    for n in sorted(set(mine).union(*(by_row[(CAST_GROUP, e)] for e in engines))):
        kv_us, best = _ok_us(mine.get(n)), _fastest(by_row, CAST_GROUP, engines, n)
        if kv_us is None or best is None:
            out.append(TargetLine(f"{target}, n = {n}", rows, f"not timed at n = {n}", "not measured"))
        else:
            out.append(TargetLine(f"{target}, n = {n}", f"{rows} vs `{best[0]}`", *_beside(kv_us, best[1])))
    return out


def host_lines(host: Optional[dict]) -> List[TargetLine]:
    """Target 5: every kvfuse call of an eager host-time run at n = 1 (benchmarks/eager_host_time.py's JSON;
    its "floor:" rows are references) at most HOST_US_TARGET us on the host, its launch included."""
    target = f"5. host time <= {HOST_US_TARGET:g} us, n = 1"
    calls = [r for r in (host or {}).get("rows", []) if not r["call"].startswith(HOST_FLOOR_PREFIX) and r["n"] == 1]
    if not calls:
        return [TargetLine(target, "every kvfuse call", "no host-time run" if host is None else
                           "the run has no kvfuse call at n = 1", "not measured")]
    # hosts differ by 2x from one device call to the next: each figure also as a multiple of the run's own
    # Triton launch (its "floor:" row of a Triton kernel), which compares across runs
    triton = [r["host_us_cache_on"] for r in host.get("rows", [])
              if r["call"].startswith(HOST_FLOOR_PREFIX) and "Triton" in r["call"]]

    def measured(r):
        ratio = f", {r['host_us_cache_on'] / triton[0]:.2f}x the Triton launch" if triton else ""
        return f"{r['host_us_cache_on']:.2f} us (GPU {_us(r.get('gpu_us'))} us{ratio})"
    return [TargetLine(target, f"`{r['call']}`", measured(r), _met(r["host_us_cache_on"] <= HOST_US_TARGET))
            for r in calls]


def peers_run_line(peers: Optional[dict], source: Optional[str]) -> TargetLine:
    """Target 6: the engines' figures come from a side-by-side run committed under benchmarks/results/."""
    target = "6. engine figures from a committed side-by-side run"
    if peers is None:
        return TargetLine(target, "the side-by-side JSON", "none found", "not measured")
    committed = (source or "").startswith("benchmarks/results/")
    groups = ", ".join(f"`{g}`" for g in _groups(peers)) or "none"
    return TargetLine(target, f"`{source}`", f"rendered in \"{SIDE_BY_SIDE}\": {len(engine_rows(peers))} engine "
                      f"rows, groups {groups}" + ("" if committed else "; not under benchmarks/results/"),
                      _met(committed and bool(engine_rows(peers))))


def beside_target_lines(report: dict, peers: Optional[dict], peers_source: Optional[str], host: Optional[dict],
                        gqa_report: Optional[dict] = None) -> List[TargetLine]:
    """Every line of the section's table, targets 1 to 6 in order; ``gqa_report``: the run of the GQA / MHA
    section when it is not ``report``."""
    return (engine_decode_lines(peers) + floor_lines(report, gqa_report) + pct_copy_lines(report, gqa_report)
            + cast_lines(peers) + host_lines(host) + [peers_run_line(peers, peers_source)])


def _beside_targets_section(report: dict, source: str, peers: Optional[dict], peers_source: Optional[str],
                            host: Optional[dict], host_source: Optional[str], gqa_report: Optional[dict] = None,
                            gqa_source: Optional[str] = None) -> List[str]:
    runs = f"`{source}`" + ("" if gqa_report is None else f" (the GQA workloads: `{gqa_source}`)")
    peers_name = f"`{peers_source}`" if peers is not None else "no side-by-side JSON"
    host_name = f"`{host_source}`" if host is not None else "no host-time JSON"
    floors = [r for r in (host or {}).get("rows", []) if r["call"].startswith(HOST_FLOOR_PREFIX)]
    gqa_n, gqa_pct = GQA_QK_NORM_PCT_COPY
    host_meta = (host or {}).get("meta", {})
    lines = beside_target_lines(report, peers, peers_source, host, gqa_report)
    out = [f"## {BESIDE_TARGETS}", "",
           "The targets against the engines' kernels, the launch floor, the copy bandwidth and the host, each "
           "recomputed from the run named as its source (reporting, not asserting; a target whose data the runs "
           "lack says \"not measured\"):", "",
           f"1. Decode at or under the fastest engine kernel at n = {' and '.join(map(str, ENGINE_DECODE_SIZES))}, "
           "PDL on: every kvfuse \"[PDL]\" row against the fastest engine row measured against it (the engine's "
           "\"[PDL]\" row where it has one, else its row as the engine launches it, measured against kvfuse's "
           "\"(PDL off)\" twin); met when kvfuse's GPU time <= the engine's. Source: " + peers_name + ".",
           f"2. Decode within {FLOOR_TARGET:g}x of the launch floor at n = {DECODE_FLOOR_N}: the fused GPU time "
           "over the run's launch floor, every DeepSeek cache write and GQA write workload. Source: "
           f"{runs}.",
           f"3. Large n, % of copy in compulsory bytes: MAIN_FP4 (`{MAIN_FP4_WORKLOAD}`) and every indexer K "
           f"(`*{INDEX_K_SUFFIX}`) at {PCT_COPY_N} (thresholds of `kvfuse.bench.pct_copy_target`), the GQA writes of "
           f"models with a q / k norm (`GQAConfig.qk_norm`) >= {gqa_pct:g}% at {gqa_n}. Source: {runs}.",
           f"4. The cast alone at or under FlashInfer's `quantize_cache` at every n: `{CAST_ROW}` of group "
           f"`{CAST_GROUP}` against the FlashInfer row measured against it. Source: {peers_name}.",
           f"5. Host time of an eager call at most {HOST_US_TARGET:g} us at n = 1, the launch included (median wall "
           "time of single calls, plan cache on): every kvfuse call of the run (the fused entry, the GQA entry, "
           "and kvfuse's adapters of `kvfuse.engines`, which the run names by the engine call they replace, "
           "`vllm.*` / `flashinfer.*`). Source: " + host_name + (
               f" ({host_meta.get('device', 'device not recorded')}, {host_meta.get('date', 'date not recorded')}, "
               f"PDL {'on' if host_meta.get('pdl') else 'off'})" if host is not None else "") + "; " + (
               "its reference launches: " + ", ".join(f"{r['call'][len(HOST_FLOOR_PREFIX):].strip()} "
                                                      f"{r['host_us_cache_on']:.2f} us" for r in floors)
               if floors else "no reference launch recorded") + ".",
           "6. Engine figures from a committed side-by-side run: met when its JSON under benchmarks/results/ was "
           f"found and rendered. Source: {peers_name}.", ""]
    out += _table(["target", "rows", "measured", "verdict"],
                  [[t.target, t.rows, t.measured, "**missed**" if t.verdict == "missed" else t.verdict] for t in lines])
    met = sum(t.verdict == "met" for t in lines)
    missed = sum(t.verdict == "missed" for t in lines)
    return out + ["", f"{met} of {len(lines)} met ({missed} missed, {len(lines) - met - missed} not measured)."]


def full_run_workloads() -> List[str]:
    """The workloads of a run that fills every table: the bench's forms of the engines' calls
    (:data:`ENGINE_CALL_WORKLOADS`), the models' DeepSeek calls, the cast-only, grouped and GQA workloads of
    the bench (one of each definition)."""
    names = list(ENGINE_CALL_WORKLOADS)
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
            "One `kvfuse bench` run that fills every kvfuse table, with programmatic dependent launch (add "
            "`compile` to `--peers` for the torch.compile peer; it is slow), and one run of the side-by-side "
            f"harness (`{PEERS_HARNESS}`: build it on a machine with nvcc, run it on the GPU from the repository "
            "root; its README says more), and one eager host-time run:",
            "", "```bash",
            f"python -m kvfuse.cli bench --pdl --workloads {','.join(full_run_workloads())} --n {FULL_SIZES} "
            f"--peers {peers} --budget-s 500 --out bench-out",
            "cp bench-out/kvfuse_bench.json benchmarks/results/<date>_<device>_full_bench.json",
            f"bash {PEERS_HARNESS}/build_here.sh setup && bash {PEERS_HARNESS}/build_here.sh all   # nvcc, sm_90a",
            "OUT=peers-out bash .peers/run.sh                      # on the GPU: every group",
            "cp peers-out/peers.json benchmarks/results/<date>_<device>_peers.json",
            "cp peers-out/peers_log.txt benchmarks/results/<date>_<device>_peers_log.txt",
            "cp peers-out/summary_table.md benchmarks/results/<date>_<device>_peers_summary_table.md",
            "python benchmarks/eager_host_time.py --json benchmarks/results/<date>_<device>_eager_host_time.json"
            "   # on the GPU",
            "python benchmarks/benchmarks_md.py     # the latest *_full_bench.json, *_peers.json, "
            "*_eager_host_time.json",
            "```"]


def render(report: dict, source: str = "the result JSON", gqa_report: Optional[dict] = None,
           gqa_source: Optional[str] = None, group_report: Optional[dict] = None,
           group_source: Optional[str] = None, peers: Optional[dict] = None, peers_source: Optional[str] = None,
           peers_log: Optional[str] = None, formats: Optional[dict] = None, formats_source: Optional[str] = None,
           formats_pdl: Optional[bool] = None, host: Optional[dict] = None, host_source: Optional[str] = None) -> str:
    """BENCHMARKS.md (Markdown, ending with a newline) for one bench result (the dict of its JSON);
    ``source``: how the document names that JSON. ``gqa_report`` / ``gqa_source``: a later run whose GQA
    workloads fill the GQA / MHA section instead (when that kernel changed after the run of the rest);
    ``group_report`` / ``group_source`` the same for the Grouped section. ``peers`` / ``peers_source`` /
    ``peers_log``: the side-by-side run (its JSON's dict, its name, the text of its log or None) whose rows
    fill the section beside the engines. ``formats`` / ``formats_source`` / ``formats_pdl``: a run of
    benchmarks/gqa_formats_bench.py (its JSON's dict, its name, PDL as its log says) for the cache-formats
    section. ``host`` / ``host_source``: a run of benchmarks/eager_host_time.py (its JSON's dict, its name) for
    the host-time target."""
    later = [name for name, rep in (("Grouped", group_report), ("GQA / MHA", gqa_report)) if rep is not None]
    one = "one `kvfuse bench` run" if not later else \
        f"one `kvfuse bench` run (the {' and the '.join(later)} section{'s' if len(later) > 1 else ''}: " \
        f"a later run of {'their' if len(later) > 1 else 'its'} own, named there)"
    lines = ["# Benchmarks", "",
             f"kvfuse's GPU time per call, from {one}, and kvfuse beside the engines' kernels that do the same "
             "work, from one run of the side-by-side harness (\"" + SIDE_BY_SIDE + "\"). Generated by `python "
             "benchmarks/benchmarks_md.py` from the runs' JSON: regenerate it, do not edit it.", ""]
    lines += _measured(report, source, peers_source if peers is not None else None) + [""]
    lines += _peers_section(peers, peers_source, peers_log) + [""]
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
    lines += _formats_section(formats, formats_source, formats_pdl) + [""]
    lines += _targets_section(report) + [""]
    lines += _beside_targets_section(report, source, peers, peers_source, host, host_source, gqa_report,
                                     gqa_source or "the GQA result JSON") + [""]
    lines += _regenerate()
    return "\n".join(lines).rstrip() + "\n"


TARGET = ROOT / "BENCHMARKS.md"


def source_name(path: Path) -> str:
    """The JSON's path relative to the repository root when it lies inside, else as given."""
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def read_peers(path: Path) -> Tuple[dict, str, Optional[str]]:
    """A peers JSON: its dict, its name for the document, and the text of its log (``X_log.txt`` beside
    ``X.json``) or None."""
    log = path.with_name(path.name[:-len(".json")] + "_log.txt") if path.name.endswith(".json") else None
    return (json.loads(path.read_text()), source_name(path),
            log.read_text() if log is not None and log.exists() else None)


def read_formats(path: Optional[Path]) -> Tuple[Optional[dict], Optional[str], Optional[bool]]:
    """A gqa_formats_bench.py JSON, its name, and PDL as the JSON records it, else as the log beside it
    (``.txt``) prints it (None: neither says)."""
    if path is None:
        return None, None, None
    log = path.with_suffix(".txt")
    data = json.loads(path.read_text())
    if "pdl" in data:
        return data, source_name(path), bool(data["pdl"])
    m = re.search(r"PDL (True|False)", log.read_text()) if log.exists() else None
    return data, source_name(path), (None if m is None else m.group(1) == "True")


def read_host_time(path: Optional[Path]) -> Tuple[Optional[dict], Optional[str]]:
    """An eager_host_time.py JSON and its name (None, None: no such run)."""
    return (None, None) if path is None else (json.loads(path.read_text()), source_name(path))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("result", nargs="?", default=None,
                   help="a kvfuse_bench.json (default: the latest benchmarks/results/*_full_bench.json)")
    p.add_argument("--peers", default=None, help="the side-by-side harness's peers.json (default: the latest "
                                                "benchmarks/results/*_peers.json)")
    p.add_argument("--gqa", default=None, help="a later kvfuse_bench.json whose GQA workloads fill the GQA / MHA "
                                              "section (named there)")
    p.add_argument("--group", default=None, help="a later kvfuse_bench.json whose grouped workloads fill the "
                                                "Grouped section (named there)")
    p.add_argument("--formats", default=None, help="a benchmarks/gqa_formats_bench.py JSON for the cache-formats "
                                                  "section (default: the latest benchmarks/results/*_gqa_formats.json)")
    p.add_argument("--host-time", default=None, help="a benchmarks/eager_host_time.py JSON for the host-time target "
                                                    "(default: the latest benchmarks/results/*_eager_host_time.json)")
    p.add_argument("--out", default=str(TARGET), help="where to write (default: BENCHMARKS.md at the repository root)")
    modes = p.add_mutually_exclusive_group()
    modes.add_argument("--stdout", action="store_true", help="print the document instead of writing it")
    modes.add_argument("--check", action="store_true", help="exit 1 when --out differs from the rendering")
    args = p.parse_args(argv)
    path = Path(args.result) if args.result else latest("*_full_bench.json")
    peers_path = Path(args.peers) if args.peers else latest("*_peers.json")
    if path is None:
        p.error("no RESULT.json given and no benchmarks/results/*_full_bench.json")
    gqa = Path(args.gqa) if args.gqa else None
    group = Path(args.group) if args.group else None
    peers = read_peers(peers_path) if peers_path is not None else (None, None, None)
    formats_path = Path(args.formats) if args.formats else latest("*_gqa_formats.json")
    host_path = Path(args.host_time) if args.host_time else latest("*_eager_host_time.json")
    text = render(json.loads(path.read_text()), source_name(path),
                  json.loads(gqa.read_text()) if gqa else None, source_name(gqa) if gqa else None,
                  json.loads(group.read_text()) if group else None, source_name(group) if group else None,
                  *peers, *read_formats(formats_path), *read_host_time(host_path))
    out = Path(args.out)
    what = ", ".join(str(q) for q in (path, peers_path, host_path) if q is not None)
    if args.stdout:
        sys.stdout.write(text)
    elif args.check:
        if not out.exists() or out.read_text() != text:
            print(f"{out} differs from the rendering of {what}: run python benchmarks/benchmarks_md.py {path}"
                  + (f" --peers {peers_path}" if peers_path is not None else "")
                  + (f" --host-time {host_path}" if host_path is not None else ""), file=sys.stderr)
            return 1
    else:
        out.write_text(text)
        print(f"wrote {os.path.relpath(out)} from {what}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
