"""BENCHMARKS.md's generator (benchmarks/benchmarks_md.py, imported with benchmarks/ on the path):
rendered from small synthetic bench results built here (through bench.build_report and JSON, as a run
writes them), its tables must hold that run's numbers beside the engines' figures, with the verdicts, and
say how to produce what the run lacks. The committed BENCHMARKS.md must be what the generator renders
from the JSON it names."""
import dataclasses
import json
import re
import sys
from pathlib import Path

import pytest

from kvfuse import bench

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import benchmarks_md  # noqa: E402  (the generator is a script of benchmarks/)
INFO = {"device": "NVIDIA H200", "sm_count": 132, "capability": "9.0", "memory_GiB": 139.8, "torch": "9.9.9+test",
        "torch_cuda": "13.0", "triton": "3.9.1", "python": "3.11.0", "kvfuse": "0.1.0",
        "date": "2027-02-03T04:05:06+00:00", "argv": ["/x/kvfuse/cli.py", "bench", "--n", "1,4096"]}
DEVICE = {"copy_GBps": 4321.0, "copy_bytes": 4 << 30, "floor_us": 0.87, "floor_kernel": "triton",
          "floor_launches_per_graph": 100}


def make_report(points, pdl=False):
    """points: (workload, n, peer, gpu_us[, gpu_method]) -> the dict of the JSON a run would write."""
    names = list(dict.fromkeys(p[0] for p in points))
    cfg = bench.Config(workloads=names, sizes=sorted({p[1] for p in points}),
                       peers=[p for p in bench.PEERS if any(q[2] == p for q in points)], pdl=pdl)
    recs = []
    for w, n, peer, us, *method in points:
        detail = bench.moved_bytes(bench.WORKLOADS[w], n)
        rec = bench.Record(workload=w, n=n, peer=peer, rows=n, bytes=detail["total"], gpu_us=us,
                           gpu_method=method[0] if method else "graph", eager_us=us + 20, bytes_detail=detail,
                           regime=bench.input_regime(n))
        recs.append(bench.finalize(rec, DEVICE["copy_GBps"], DEVICE["floor_us"]))
    bench.add_speedups(recs)
    return json.loads(json.dumps(bench.build_report(cfg, INFO, DEVICE, recs, [], 1.0)))


def section(text, title):
    start = text.index("\n## " + title)
    end = text.find("\n## ", start + 4)
    return text[start:end if end >= 0 else None]


def rows(text):
    """Table rows as lists of cells."""
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| call") and not line.startswith("| workload")]


MLA = [("dsv4_main_fp8", 1, "fused", 1.234), ("dsv4_main_fp8", 4096, "fused", 3.456),
       ("dsv4_main_fp8", 65536, "fused", 40.0), ("dsv32_index_k", 1, "fused", 1.31),
       ("dsv32_index_k", 65536, "fused", 12.5), ("main_fp4", 1, "fused", 2.5), ("main_fp4", 65536, "fused", 45.6)]


def test_how_it_was_measured_comes_from_the_json():
    report = make_report(MLA)
    text = benchmarks_md.render(report, "benchmarks/results/x.json")
    how = section(text, "How it was measured")
    for want in ("`benchmarks/results/x.json`", "`python -m kvfuse.cli bench --n 1,4096`",
                 "NVIDIA H200 (132 SMs, compute capability 9.0, 139.8 GiB)", "torch 9.9.9+test (CUDA 13.0)",
                 "Triton 3.9.1", "Python 3.11.0", "2027-02-03 04:05 UTC", "4.32 TB/s", "0.87 us", "PDL off",
                 "paged slots", "decode inputs for n <= 256", report["accounting"], benchmarks_md.ENGINE_SOURCE):
        assert want in how, want
    assert "PDL on" in benchmarks_md.render(make_report(MLA, pdl=True))
    assert "session" not in text.lower() and not re.search(r"#\d", text)


@pytest.mark.parametrize("script", ["/x/kvfuse/bench.py", "/x/kvfuse/bench/__main__.py"])
def test_a_run_of_python_m_kvfuse_bench_is_named_by_that_command(script):
    """Runs recorded as ``python -m kvfuse.bench`` (its argv[0]: the module, or the package's __main__)."""
    meta = dict(INFO, argv=[script, "--n", "1"])
    assert "command `python -m kvfuse.bench --n 1`" in benchmarks_md.render(dict(make_report(MLA), meta=meta))


def test_decode_and_prefill_tables_hold_the_runs_numbers_beside_the_engines():
    report = make_report(MLA)
    text = benchmarks_md.render(report)
    decode = rows(section(text, "Decode"))
    # MAIN_FP8 + GPT-J at n = 1: 1.234 against SGLang's 1.06 (PDL, loses) and 1.50 (no PDL, wins)
    assert ["MAIN_FP8 write, norm + GPT-J RoPE", "`dsv4_main_fp8`", "1", "1.23",
            "SGLang DeepSeek V4 JIT kernel (PDL)", "1.06", f"{1.234 / 1.06:.2f}", "loses"] in decode
    assert ["MAIN_FP8 write, norm + GPT-J RoPE", "`dsv4_main_fp8`", "1", "1.23",
            "SGLang DeepSeek V4 JIT kernel (no PDL)", "1.50", f"{1.234 / 1.50:.2f}", "**wins**"] in decode
    # the index write at n = 1: 1.31 against 1.30 is within 3%: even
    assert ["128-d fp8 index write, V3.2 style (RoPE at offset 0)", "`dsv32_index_k`", "1", "1.31",
            "SGLang V3.2 indexer kernel with LayerNorm (PDL)", "1.30", "1.01", "even"] in decode
    assert all(int(r[2]) <= 256 for r in decode if r[0].startswith(("MAIN", "128", "FLASH")))
    # prefill: GPU us, % of copy from the record, the engine's figure
    fused = {(r["workload"], r["n"]): r for r in report["results"]}
    pct = fused[("dsv4_main_fp8", 65536)]["pct_copy"]
    prefill = rows(section(text, "Prefill"))
    assert ["MAIN_FP8 write, norm + GPT-J RoPE", "`dsv4_main_fp8`", "65536", "40.00", f"{pct:.1f}%",
            "SGLang DeepSeek V4 JIT kernel (PDL)", "37.6", f"{40 / 37.6:.2f}", "loses"] in prefill
    assert ["128-d fp8 index write, V3.2 style (RoPE at offset 0)", "`dsv32_index_k`", "65536", "12.50",
            f"{fused[('dsv32_index_k', 65536)]['pct_copy']:.1f}%", "SGLang V3.2 indexer kernel with LayerNorm (no PDL)",
            "15.7", f"{12.5 / 15.7:.2f}", "**wins**"] in prefill
    # the run has n = 4096 of dsv4_main_fp8 but not of dsv32_index_k: that row says so
    assert any(r[1] == "`dsv32_index_k`" and r[2] == "4096" and "not in this run" in r[-1] for r in prefill)
    # every workload of the run, engine figure or not, at the section's sizes
    assert ["`main_fp4`", report["workloads"]["main_fp4"]["description"], "2.50"] in decode
    alone = [r for r in prefill if r[0] == "`main_fp4`"]
    assert alone and alone[0][-2:] == ["-", f"45.60 ({fused[('main_fp4', 65536)]['pct_copy']:.0f}%)"]
    # the FLASHMLA_MODEL1 figures: no workload of this run does that write -> the command that measures it
    waiting = section(text, "Decode")
    assert "Engine figures whose kvfuse workload is not in this run" in waiting
    assert "--workloads flashmla_model1_gptj" in waiting
    assert ("- `flashmla_model1_gptj` (FLASHMLA_MODEL1 write, norm + GPT-J RoPE: vLLM DeepSeek V4 kernel): "
            "2.12 us at n = 1") in waiting
    assert "kvfuse wins 1 of these 3 comparisons." in section(text, "Decode")


def test_identical_definitions_stand_in_for_each_other_and_the_first_listed_wins():
    for fig in benchmarks_md.ENGINE_FIGURES:
        defs = [dataclasses.replace(bench.WORKLOADS[w], name="", description="") for w in fig.workloads]
        assert all(d == defs[0] for d in defs), fig.workloads        # the same work under another name
    pts = [("dsv4_main_model1", 1, "fused", 1.9), ("flashmla_model1_gptj", 1, "fused", 2.2)]
    decode = rows(section(benchmarks_md.render(make_report(pts)), "Decode"))
    vllm = [r for r in decode if len(r) > 4 and r[4] == "vLLM DeepSeek V4 kernel"]
    assert vllm == [["FLASHMLA_MODEL1 write, norm + GPT-J RoPE", "`flashmla_model1_gptj`", "1", "2.20",
                     "vLLM DeepSeek V4 kernel", "2.12", f"{2.2 / 2.12:.2f}", "loses"]]


def test_cast_only_section():
    pts = [("main_fp8_cast", 1, "fused", 1.42), ("main_fp8_cast", 4096, "fused", 2.55),
           ("main_fp8_cast", 65536, "fused", 31.2)]
    report = make_report(pts)
    cast = section(benchmarks_md.render(report), "Cast only")
    got = rows(cast)
    assert ["the cast alone, MAIN_FP8 record", "`main_fp8_cast`", "65536", "31.20",
            f"{report['results'][2]['pct_copy']:.1f}%", "FlashInfer DeepSeek Triton `quantize_cache`", "26.2",
            f"{31.2 / 26.2:.2f}", "loses"] in got
    assert ["the cast alone, MAIN_FP8 record", "`main_fp8_cast`", "1", "1.42",
            f"{report['results'][0]['pct_copy']:.1f}%", "FlashInfer DeepSeek Triton `quantize_cache`", "1.52",
            f"{1.42 / 1.52:.2f}", "**wins**"] in got
    # not in the run: the command that measures it
    absent = section(benchmarks_md.render(make_report(MLA)), "Cast only")
    assert "This run has no cast-only workload" in absent and "--workloads main_fp8_cast" in absent
    assert "- `main_fp8_cast` (the cast alone, MAIN_FP8 record: FlashInfer DeepSeek Triton `quantize_cache`): " \
           "1.52 us at n = 1, 2.64 us at n = 4096, 26.2 us at n = 65536" in absent


def test_cast_note_quotes_the_runs_page_layout_figures_when_it_has_them():
    """FlashInfer's cast note: the run's own main_fp8_pagewise_cast and main_fp8_cast at 65536 when it has
    both, else the figures measured before (a constant)."""
    before = "kvfuse's portable kernel writes the same codes in 26.11 us at 65536 tokens against 31.28 us as MAIN_FP8"
    both = make_report([("main_fp8_cast", 65536, "fused", 30.2864), ("main_fp8_pagewise_cast", 65536, "fused", 25.6528),
                        ("main_fp8_pagewise_cast", 4096, "fused", 2.9)])
    cast = section(benchmarks_md.render(both), "Cast only")
    assert ("In that layout kvfuse writes the same codes in this run in 25.65 us at 65536 tokens against 30.29 us as "
            "MAIN_FP8 records (`main_fp8_pagewise_cast` against `main_fp8_cast`; docs/performance.md).") in cast
    assert "26.11" not in cast and "31.28" not in cast
    assert "FlashInfer's kernel writes its own page layout, not the MAIN_FP8 record" in cast
    for pts in ([("main_fp8_cast", 65536, "fused", 30.2864)],                                 # no page layout
                [("main_fp8_cast", 65536, "fused", 30.2864), ("main_fp8_pagewise_cast", 4096, "fused", 2.9)],
                [("main_fp8_cast", 4096, "fused", 2.5), ("main_fp8_pagewise_cast", 65536, "fused", 25.6528)]):
        cast = section(benchmarks_md.render(make_report(pts)), "Cast only")
        assert before in cast and "the same codes in this run" not in cast, pts


def _at_pct(workload, n, pct):
    """The GPU us at which ``workload`` moves its bytes at ``pct`` % of DEVICE's copy bandwidth."""
    return bench.moved_bytes(bench.WORKLOADS[workload], n)["total"] / (pct / 100 * DEVICE["copy_GBps"] * 1e9) * 1e6


def test_targets_section_recomputes_the_current_targets_from_the_runs_records():
    pts = [("main_fp8_gptj", 1, "fused", 1.0), ("main_fp8_gptj", 256, "fused", 1.1),
           ("main_fp8_gptj", 262144, "fused", _at_pct("main_fp8_gptj", 262144, 90.0)),
           ("dsv4_main_fp4", 256, "fused", 2.0),
           ("dsv4_main_fp4", 262144, "fused", _at_pct("dsv4_main_fp4", 262144, 70.0)),
           ("llama3_8b_fp8", 1, "fused", 1.5),
           ("dsv3_main_kv_c_k_pe", 1, "fused", 1.8), ("dsv3_main_kv_c_k_pe", 65536, "fused", 40.0)]
    report = make_report(pts, pdl=True)
    report["targets"] = [dict(target="main_fp8_gptj fused % copy at n=262144", status="MISS", value=90.0, op=">=",
                              threshold=95.0, detail="")]       # what an old run stored: not used
    report["results"][0]["a_field_of_another_version"] = 1
    text = benchmarks_md.render(report)
    titles = re.findall(r"^## (.+)$", text, re.M)
    assert titles.index("Targets") == titles.index("GQA / MHA (`fused_qk_norm_rope_store_kv`)") + 1
    assert titles.index("Not measured here") == titles.index("Targets") + 1
    targets = section(text, "Targets")
    assert "recomputed from this run" in targets and "reporting, not asserting" in targets
    assert 'docs/performance.md ("Targets")' in targets and "95" not in targets
    got = {r[0]: r[1:] for r in rows(targets) if r[0] != "workload"}
    # columns: % of copy at 262144, x launch floor at 1 / 256, vs stage chain n <= 4096, at 65536, vs the engine
    assert ("| workload | % of copy at 262144 | x launch floor, n = 1 / 256 | vs stage chain, n <= 4096 | "
            "vs stage chain, n = 65536 | vs the engine's kernel |") in targets
    # 1.1 us at n = 256 over the 0.87 us floor: 1.26x; 2.0 us: 2.30x
    assert got["`main_fp8_gptj`"] == ["90.0% (target 85%): met", f"{1.1 / 0.87:.2f}x at n=256: met",
                                      "not measured", "not measured", ""]
    # the engine's time (ENGINE_TIME_TARGETS: FlashInfer's MLA write, 1.95 us at 1, 36.29 at 65536): the worst ratio
    from kvfuse.bench import ENGINE_TIME_TARGETS
    times = ENGINE_TIME_TARGETS["dsv3_main_kv_c_k_pe"][1]
    assert got["`dsv3_main_kv_c_k_pe`"][4] == f"{40.0 / times[65536]:.2f}x at n=65536: **missed**"
    assert got["`dsv4_main_fp4`"][:2] == ["70.0% (target 80%): **missed**", f"{2.0 / 0.87:.2f}x at n=256: **missed**"]
    assert got["`llama3_8b_fp8`"][:2] == ["", ""]                 # GQA: no % copy or floor target
    assert "2 of the 6 measured targets met." in targets
    # a run without PDL: the launch-floor target needs one
    got = {r[0]: r[1:] for r in rows(section(benchmarks_md.render(make_report(pts)), "Targets"))}
    assert got["`main_fp8_gptj`"][:2] == ["90.0% (target 85%): met", "not measured (needs a --pdl run)"]


def test_a_target_value_never_prints_as_its_threshold_when_it_misses():
    t = dict(kind="stages_65536", value=1.7996, threshold=1.8, status="MISS", detail="")
    assert benchmarks_md._target_cell(t) == "1.7996x: **missed**"
    assert benchmarks_md._target_cell(dict(t, value=1.798)) == "1.798x: **missed**"
    assert benchmarks_md._target_cell(dict(t, value=1.8, status="PASS")) == "1.80x: met"
    assert benchmarks_md._target_cell(dict(t, kind="pct_copy", value=84.96, threshold=85.0)) == \
        "84.96% (target 85%): **missed**"


def test_gqa_section_puts_the_peers_beside_the_fused_call():
    pts = [("qwen3_8b_fp8", 1, "fused", 2.0), ("qwen3_8b_fp8", 1, "two_launch", 3.0),
           ("qwen3_8b_fp8", 1, "stages", 6.0), ("qwen3_8b_fp8", 1, "compile", 400.0, "events"),
           ("qwen3_8b_fp8", 4096, "fused", 60.0), ("qwen3_8b_fp8", 4096, "two_launch", 59.0),
           ("qwen3_8b_fp8", 4096, "stages", 150.0), ("llama3_8b_fp8", 1, "fused", 1.8)]
    report = make_report(pts)
    gqa = section(benchmarks_md.render(report), "GQA")
    table = rows(gqa)
    pct = {(r["workload"], r["n"]): r["pct_copy"] for r in report["results"] if r["peer"] == "fused"}
    assert "fused vs two_launch" in gqa
    assert ["`qwen3_8b_fp8`", "1", "2.00", f"{pct[('qwen3_8b_fp8', 1)]:.1f}%", "3.00 (1.50x)", "6.00 (3.00x)",
            "400.0 † (200.00x)", "**wins**"] in table
    assert ["`qwen3_8b_fp8`", "4096", "60.00", f"{pct[('qwen3_8b_fp8', 4096)]:.1f}%", "59.00 (0.98x)",
            "150.0 (2.50x)", "-", "even"] in table
    assert ["`llama3_8b_fp8`", "1", "1.80", f"{pct[('llama3_8b_fp8', 1)]:.1f}%", "-", "-", "-", "-"] in table
    assert "two_launch us (x fused)" in gqa and "† timed with CUDA events" in gqa
    assert report["workloads"]["qwen3_8b_fp8"]["description"] in gqa
    absent = section(benchmarks_md.render(make_report(MLA)), "GQA")
    assert "This run has no GQA workload" in absent and "--peers fused,two_launch,stages,compile" in absent
    assert "qwen3_8b_fp8" in absent


def test_gqa_section_from_a_later_run_names_that_run_and_only_its_figures():
    """--gqa: the GQA / MHA section comes from the later run (its source, command, date and baselines
    named in the section); the main run's own GQA figures do not appear anywhere."""
    main = make_report(MLA + [("llama3_8b_fp8", 1, "fused", 9.87)])
    later = make_report([("llama3_8b_fp8", 1, "fused", 1.81), ("llama3_8b_fp8", 1, "two_launch", 3.0)], pdl=True)
    text = benchmarks_md.render(main, "benchmarks/results/a.json", later, "benchmarks/results/b.json")
    gqa = section(text, "GQA")
    assert "- Source of this section: `benchmarks/results/b.json`, its own `kvfuse bench` run" in gqa
    assert "PDL on." in gqa and f"launch floor {DEVICE['floor_us']:.2f} us" in gqa
    assert ["`llama3_8b_fp8`", "1", "1.81"] == rows(gqa)[0][:3] and "9.87" not in text
    assert "(the GQA / MHA section: a later run of its own, named there)" in text.splitlines()[2]
    assert "- Source: `benchmarks/results/a.json`" in section(text, "How it was measured")
    plain = benchmarks_md.render(main, "benchmarks/results/a.json")       # control: without it, the main run's
    assert "9.87" in section(plain, "GQA") and "Source of this section" not in plain


def test_grouped_section_from_group_workloads_or_how_to_produce_them():
    absent = section(benchmarks_md.render(make_report(MLA)), "Grouped")
    assert "This run has no grouped workload" in absent and "--peers fused,calls,stages" in absent
    assert all(w in absent for w in bench.WORKLOADS if w.startswith("group_"))
    assert "- `group_dsv4_q_kv` (Q of 64 heads + the KV write, one launch (DeepSeek V4): vLLM DeepSeek V4 fused " \
           "Q + KV kernel): 2.26 us at n = 1, 149 us at n = 4096" in absent
    pts = [("group_dsv4_q_kv", 1, "fused", 2.0), ("group_dsv4_q_kv", 1, "calls", 3.1),
           ("group_dsv4_q_kv", 1, "stages", 9.0), ("group_dsv4_q_kv", 4096, "fused", 160.0),
           ("group_dsv4_q_kv", 4096, "calls", 161.0), ("group_dsv4_layer", 1, "fused", 3.21)]
    report = make_report(pts)
    grouped = section(benchmarks_md.render(report), "Grouped")
    table = rows(grouped)
    pct = {(r["workload"], r["n"]): r["pct_copy"] for r in report["results"] if r["peer"] == "fused"}
    assert ["Q of 64 heads + the KV write, one launch (DeepSeek V4)", "`group_dsv4_q_kv`", "4096", "160.0",
            f"{pct[('group_dsv4_q_kv', 4096)]:.1f}%", "vLLM DeepSeek V4 fused Q + KV kernel", "149",
            f"{160 / 149:.2f}", "loses"] in table
    assert ["Q of 64 heads + the KV write, one launch (DeepSeek V4)", "`group_dsv4_q_kv`", "1", "2.00",
            f"{pct[('group_dsv4_q_kv', 1)]:.1f}%", "vLLM DeepSeek V4 fused Q + KV kernel", "2.26",
            f"{2 / 2.26:.2f}", "**wins**"] in table
    assert ["`group_dsv4_q_kv`", "1", "2.00", f"{pct[('group_dsv4_q_kv', 1)]:.1f}%", "3.10 (1.55x)",
            "9.00 (4.50x)", "**wins**"] in table
    assert ["`group_dsv4_q_kv`", "4096", "160.0", f"{pct[('group_dsv4_q_kv', 4096)]:.1f}%", "161.0 (1.01x)", "-",
            "even"] in table
    assert ["`group_dsv4_layer`", "1", "3.21", f"{pct[('group_dsv4_layer', 1)]:.1f}%", "-", "-", "-"] in table
    assert "fused vs calls" in grouped and "MAIN_FP8 record (528 bytes)" in grouped
    assert report["workloads"]["group_dsv4_layer"]["description"] in grouped
    assert "group_dsv4_q_kv" not in section(benchmarks_md.render(report), "Decode")


def test_grouped_section_from_a_later_run_names_that_run_and_only_its_figures():
    """--group: the Grouped section comes from the later run (named in the section, its figures against
    the engine's); the main run's own grouped figures appear nowhere; with --gqa too, the first line
    names both sections."""
    main = make_report(MLA + [("group_dsv4_q_kv", 4096, "fused", 162.3), ("group_dsv4_q_kv", 4096, "calls", 161.5)])
    later = make_report([("group_dsv4_q_kv", 4096, "fused", 139.4)], pdl=True)
    text = benchmarks_md.render(main, "benchmarks/results/a.json", group_report=later,
                               group_source="benchmarks/results/c.json")
    grouped = section(text, "Grouped")
    assert "- Source of this section: `benchmarks/results/c.json`, its own `kvfuse bench` run" in grouped
    table = rows(grouped)
    engine = next(r for r in table if r[1:3] == ["`group_dsv4_q_kv`", "4096"])
    assert engine[3] == "139.4" and engine[-1] == "**wins**"
    assert ["`group_dsv4_q_kv`", "4096", "139.4"] in [r[:3] for r in table] and "calls us" not in grouped
    assert "162.3" not in text and "161.5" not in text
    assert "(the Grouped section: a later run of its own, named there)" in text.splitlines()[2]
    gqa = make_report([("llama3_8b_fp8", 1, "fused", 1.81)], pdl=True)
    both = benchmarks_md.render(main, "benchmarks/results/a.json", gqa, "benchmarks/results/b.json", later,
                               "benchmarks/results/c.json")
    assert "(the Grouped and the GQA / MHA sections: a later run of their own, named there)" in both.splitlines()[2]
    assert "`benchmarks/results/b.json`" in section(both, "GQA") and "`benchmarks/results/c.json`" in \
        section(both, "Grouped")


def test_figures_without_a_kvfuse_workload_are_listed_not_matched():
    text = benchmarks_md.render(make_report(MLA + [("flashmla_v32", 256, "fused", 2.1)]))
    missing = section(text, "Not measured here")
    unmatched = [f for f in benchmarks_md.ENGINE_FIGURES if not benchmarks_md.candidates(f)]
    assert {f.engine for f in unmatched} >= {"FlashInfer `rope_quantize_fp8_append_paged_kv_cache`"}
    for fig in unmatched:
        assert fig.engine in missing
        assert fig.engine not in text.replace(missing, "")                # in no table
        for n, us in fig.us:
            assert f"{us} us at n = {n}" in missing
    for fig in benchmarks_md.ENGINE_FIGURES:
        if benchmarks_md.candidates(fig):
            assert fig.engine not in missing


def test_verdict_thresholds():
    assert benchmarks_md.verdict(0.96, 1.0) == "wins"
    assert benchmarks_md.verdict(1.02, 1.0) == "even" and benchmarks_md.verdict(0.98, 1.0) == "even"
    assert benchmarks_md.verdict(1.04, 1.0) == "loses"


def test_committed_benchmarks_md_is_the_rendering_of_the_json_it_names():
    """BENCHMARKS.md is generated: `python benchmarks/benchmarks_md.py RESULT.json` after a new run."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    source = re.search(r"^- Source: `([^`]+)`", text, re.M).group(1)
    path = ROOT / source
    if not path.exists():
        pytest.fail(f"BENCHMARKS.md names {source}, which is not in the repository: commit the result JSON")
    later = {}                         # a section from a later run of its own: (its JSON, its name)
    for title in ("Grouped", "GQA"):
        m = re.search(r"^- Source of this section: `([^`]+)`", section(text, title), re.M)
        if m:
            if not (ROOT / m.group(1)).exists():
                pytest.fail(f"BENCHMARKS.md's {title} section names {m.group(1)}, which is not in the repository")
            later[title] = (json.loads((ROOT / m.group(1)).read_text()), m.group(1))
    gqa = later.get("GQA", (None, None))
    group = later.get("Grouped", (None, None))
    assert text == benchmarks_md.render(json.loads(path.read_text()), source, *gqa, *group)


def test_the_commands_it_suggests_are_valid_bench_options():
    """Every `python -m kvfuse.cli bench ...` the document suggests parses (known workloads and peers)."""
    import shlex
    text = benchmarks_md.render(make_report(MLA))
    commands = re.findall(r"python -m kvfuse\.cli bench ([^`\n]+)", text)
    assert len(commands) >= 4                      # the run's own, cast, GQA, the full run
    for args in commands:
        if "<" in args:                            # the placeholder of workloads the bench does not have yet
            continue
        cfg = bench.parse_config(shlex.split(args))
        assert cfg.workloads
    full = bench.parse_config(["--workloads", ",".join(benchmarks_md.full_run_workloads())])
    wanted = {c[0] for c in map(benchmarks_md.candidates, benchmarks_md.ENGINE_FIGURES) if c}
    assert wanted <= set(full.workloads) and {w for w, d in bench.WORKLOADS.items() if d.kind == "gqa"} <= \
        set(full.workloads)
