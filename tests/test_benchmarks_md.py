"""BENCHMARKS.md's generator (benchmarks/benchmarks_md.py, imported with benchmarks/ on the path):
rendered from small synthetic results built here (bench results through bench.build_report and JSON, as a
run writes them; peers results as the side-by-side harness writes them), its kvfuse tables must hold the
bench run's numbers and its side-by-side tables every engine row of the peers run beside the kvfuse row it
was measured against, with the ratio, verdict and byte check, and say how to produce what a run lacks. The
committed BENCHMARKS.md must be what the generator renders from the JSONs it names, with no engine figure
that its peers JSON does not hold."""
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
                 "paged slots", "decode inputs for n <= 256", report["accounting"]):
        assert want in how, want
    assert "PDL on" in benchmarks_md.render(make_report(MLA, pdl=True))
    assert "session" not in text.lower() and not re.search(r"#\d", text)


@pytest.mark.parametrize("script", ["/x/kvfuse/bench.py", "/x/kvfuse/bench/__main__.py"])
def test_a_run_of_python_m_kvfuse_bench_is_named_by_that_command(script):
    """Runs recorded as ``python -m kvfuse.bench`` (its argv[0]: the module, or the package's __main__)."""
    meta = dict(INFO, argv=[script, "--n", "1"])
    assert "command `python -m kvfuse.bench --n 1`" in benchmarks_md.render(dict(make_report(MLA), meta=meta))


def test_decode_and_prefill_tables_hold_the_runs_numbers_alone():
    """The kvfuse-only tables: every write workload of the run at the section's sizes, GPU us (and % of copy
    in prefill) from its records; no engine figure in them."""
    report = make_report(MLA)
    text = benchmarks_md.render(report)
    decode, prefill = section(text, "Decode"), section(text, "Prefill")
    fused = {(r["workload"], r["n"]): r for r in report["results"]}
    descr = report["workloads"]
    assert ["`dsv4_main_fp8`", descr["dsv4_main_fp8"]["description"], "1.23"] in rows(decode)
    assert ["`main_fp4`", descr["main_fp4"]["description"], "2.50"] in rows(decode)
    pct = fused[("dsv4_main_fp8", 65536)]["pct_copy"]
    assert ["`dsv4_main_fp8`", descr["dsv4_main_fp8"]["description"],
            f"3.46 ({fused[('dsv4_main_fp8', 4096)]['pct_copy']:.0f}%)", f"40.00 ({pct:.0f}%)"] in rows(prefill)
    assert ["`dsv32_index_k`", descr["dsv32_index_k"]["description"], "-",
            f"12.50 ({fused[('dsv32_index_k', 65536)]['pct_copy']:.0f}%)"] in rows(prefill)
    for part in (decode, prefill):
        assert "engine us" not in part and benchmarks_md.SIDE_BY_SIDE in part
    assert "This run measured no DeepSeek-family (MLA) workload at these sizes." in section(
        benchmarks_md.render(make_report([("main_fp4", 1, "fused", 2.5)])), "Prefill")


def test_cast_only_section():
    pts = [("main_fp8_cast", 1, "fused", 1.42), ("main_fp8_cast", 4096, "fused", 2.55),
           ("main_fp8_cast", 65536, "fused", 31.2)]
    report = make_report(pts)
    cast = section(benchmarks_md.render(report), "Cast only")
    pct = [r["pct_copy"] for r in report["results"]]
    assert ["`main_fp8_cast`", report["workloads"]["main_fp8_cast"]["description"], f"1.42 ({pct[0]:.0f}%)",
            f"2.55 ({pct[1]:.0f}%)", f"31.20 ({pct[2]:.0f}%)"] in rows(cast)
    # not in the run: the command that measures it
    absent = section(benchmarks_md.render(make_report(MLA)), "Cast only")
    assert "This run has no cast-only workload" in absent and "main_fp8_cast" in absent
    assert re.search(r"`python -m kvfuse\.cli bench --workloads [^`]*main_fp8_cast", absent)


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
    assert titles.index("GQA / MHA cache formats (`kvfuse.gqa_formats`)") == \
        titles.index("GQA / MHA (`fused_qk_norm_rope_store_kv`)") + 1
    assert titles.index("Targets") == titles.index("GQA / MHA cache formats (`kvfuse.gqa_formats`)") + 1
    assert titles.index(benchmarks_md.BESIDE_TARGETS) == titles.index("Targets") + 1
    assert titles.index("Regenerating") == titles.index(benchmarks_md.BESIDE_TARGETS) + 1
    assert titles.index(benchmarks_md.SIDE_BY_SIDE) == titles.index("How it was measured") + 1
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
    assert "`benchmarks/results/a.json`, one `kvfuse bench` run" in section(text, "How it was measured")
    plain = benchmarks_md.render(main, "benchmarks/results/a.json")       # control: without it, the main run's
    assert "9.87" in section(plain, "GQA") and "Source of this section" not in plain


def test_grouped_section_from_group_workloads_or_how_to_produce_them():
    absent = section(benchmarks_md.render(make_report(MLA)), "Grouped")
    assert "This run has no grouped workload" in absent and "--peers fused,calls,stages" in absent
    assert all(w in absent for w in bench.WORKLOADS if w.startswith("group_"))
    pts = [("group_dsv4_q_kv", 1, "fused", 2.0), ("group_dsv4_q_kv", 1, "calls", 3.1),
           ("group_dsv4_q_kv", 1, "stages", 9.0), ("group_dsv4_q_kv", 4096, "fused", 160.0),
           ("group_dsv4_q_kv", 4096, "calls", 161.0), ("group_dsv4_layer", 1, "fused", 3.21)]
    report = make_report(pts)
    grouped = section(benchmarks_md.render(report), "Grouped")
    table = rows(grouped)
    pct = {(r["workload"], r["n"]): r["pct_copy"] for r in report["results"] if r["peer"] == "fused"}
    assert ["`group_dsv4_q_kv`", "1", "2.00", f"{pct[('group_dsv4_q_kv', 1)]:.1f}%", "3.10 (1.55x)",
            "9.00 (4.50x)", "**wins**"] in table
    assert ["`group_dsv4_q_kv`", "4096", "160.0", f"{pct[('group_dsv4_q_kv', 4096)]:.1f}%", "161.0 (1.01x)", "-",
            "even"] in table
    assert ["`group_dsv4_layer`", "1", "3.21", f"{pct[('group_dsv4_layer', 1)]:.1f}%", "-", "-", "-"] in table
    assert "fused vs calls" in grouped and "engine us" not in grouped
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
    assert ["`group_dsv4_q_kv`", "4096", "139.4"] in [r[:3] for r in table] and "calls us" not in grouped
    assert "162.3" not in text and "161.5" not in text
    assert "(the Grouped section: a later run of its own, named there)" in text.splitlines()[2]
    gqa = make_report([("llama3_8b_fp8", 1, "fused", 1.81)], pdl=True)
    both = benchmarks_md.render(main, "benchmarks/results/a.json", gqa, "benchmarks/results/b.json", later,
                               "benchmarks/results/c.json")
    assert "(the Grouped and the GQA / MHA sections: a later run of their own, named there)" in both.splitlines()[2]
    assert "`benchmarks/results/b.json`" in section(both, "GQA") and "`benchmarks/results/c.json`" in \
        section(both, "Grouped")


def test_verdict_thresholds():
    assert benchmarks_md.verdict(0.96, 1.0) == "wins"
    assert benchmarks_md.verdict(1.02, 1.0) == "even" and benchmarks_md.verdict(0.98, 1.0) == "even"
    assert benchmarks_md.verdict(1.04, 1.0) == "loses"


def test_committed_benchmarks_md_is_the_rendering_of_the_json_it_names():
    """BENCHMARKS.md is generated: `python benchmarks/benchmarks_md.py RESULT.json --peers PEERS.json` after
    new runs; both JSONs it names are committed."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    source = re.search(r"^- Source of kvfuse's own tables [^`]*`([^`]+)`", text, re.M).group(1)
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
    peers_source = re.search(r"^- Side-by-side result: `([^`]+)`", text, re.M).group(1)
    if not (ROOT / peers_source).exists():
        pytest.fail(f"BENCHMARKS.md names {peers_source}, which is not in the repository: commit the peers JSON")
    peers = benchmarks_md.read_peers(ROOT / peers_source)
    assert peers[1] == peers_source and peers[2] is not None        # its log is committed beside it
    m = re.search(r"^- Source: `([^`]+_gqa_formats\.json)`", section(text, "GQA / MHA cache formats"), re.M)
    formats = benchmarks_md.read_formats(ROOT / m.group(1) if m else None)
    m = re.search(r"Source: `([^`]+_eager_host_time\.json)`", section(text, benchmarks_md.BESIDE_TARGETS))
    host = benchmarks_md.read_host_time(ROOT / m.group(1) if m else None)
    assert text == benchmarks_md.render(json.loads(path.read_text()), source, *gqa, *group, *peers, *formats,
                                        *host)
    if (source, peers_source) == (_latest_name("*_full_bench.json"), _latest_name("*_peers.json")):
        assert benchmarks_md.main(["--check"]) == 0            # the defaults: `--check` alone passes


def _latest_name(pattern):
    return str(sorted((ROOT / "benchmarks" / "results").glob(pattern))[-1].relative_to(ROOT))


def test_without_arguments_it_renders_the_latest_full_bench_and_peers_results(tmp_path):
    out = tmp_path / "B.md"
    assert benchmarks_md.main(["--out", str(out)]) == 0
    text = out.read_text()
    assert f"`{_latest_name('*_full_bench.json')}`, one `kvfuse bench` run" in text
    assert f"- Side-by-side result: `{_latest_name('*_peers.json')}`" in text
    assert benchmarks_md.main(["--out", str(out), "--check"]) == 0
    out.write_text(text.replace("| **wins** |", "| even |", 1))
    assert benchmarks_md.main(["--out", str(out), "--check"]) == 1


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
    assert set(benchmarks_md.ENGINE_CALL_WORKLOADS) <= set(full.workloads)
    assert {w for w, d in bench.WORKLOADS.items() if d.kind == "gqa"} <= set(full.workloads)


# ------------------------------------------------------------------ the side-by-side run (peers JSON)
KV_CAST, VLLM_MLA = "kvfuse write_main_cache_gathered (cast only)", "vllm concat_and_cache_mla fp8_ds_mla"
FI_CAST = "flashinfer triton ds-v4.1 quantize_cache mxfp8"
LL = "[llama-3-8b fp8] "
KV_PDL, KV_OFF = LL + "kvfuse GQAConfig.store_kv [PDL]", LL + "kvfuse GQAConfig.store_kv (PDL off)"
FI_PDL = LL + "flashinfer rope_quantize_fp8_append_paged_kv_cache [PDL]"
FI_OFF = LL + "flashinfer rope_quantize_fp8_append_paged_kv_cache (PDL off)"
ODD = LL + "someengine fused_everything"


def make_peers(rows, checks=(), **extra):
    """rows: (group, row, vs, pdl, {n: gpu_us | 'skipped'}[, method]) -> the dict of a peers.json as
    bench_peers.py writes it (a kvfuse row's pdl True / False, an engine row's None; ratio = row / vs)."""
    times = {(g, label, n): us for g, label, _, _, per, *_ in rows for n, us in per.items()}
    records = []
    for g, label, vs, pdl, per, *method in rows:
        for n, us in per.items():
            rec = dict(group=g, n=n, row=label, bytes=1000 * n, vs=vs, note=f"note of {label}", pdl=pdl,
                       check=None)
            if us == "skipped":
                rec.update(status="skipped", err="n > 4096")
            else:
                rec.update(status="ok", gpu_us=us, method=method[0] if method else "graph", eager_us=us + 9,
                           gbps=1000 * n / us / 1e3, tnote="")
                ref = times.get((g, vs, n))
                if vs:
                    rec["ratio"] = us / ref if isinstance(ref, float) else None
            records.append(rec)
    sizes = sorted({n for row in rows for n in row[4]})
    return json.loads(json.dumps(dict(copy_GBps=4187.5, device="NVIDIA H200", sizes=sizes, elapsed_s=9.0,
                                      records=records, checks=[dict(group=g, row=r, result=m) for g, r, m in checks],
                                      **extra)))


PEERS = make_peers([
    ("dsv3_flashmla", KV_CAST, None, False, {1: 1.5, 256: 1.8, 4096: 3.0}),
    ("dsv3_flashmla", VLLM_MLA, KV_CAST, None, {1: 2.0, 256: 1.82, 4096: 2.5}),
    ("gqa", KV_PDL, None, True, {1: 1.25, 256: 2.5, 4096: "skipped"}),
    ("gqa", KV_OFF, None, False, {1: 1.5, 256: 2.75, 4096: 26.0}),
    ("gqa", FI_PDL, KV_PDL, None, {1: 2.0, 256: 3.25, 4096: 30.5}),
    ("gqa", FI_OFF, KV_OFF, None, {1: 2.25, 256: 3.75, 4096: 31.0}, "events"),
    ("gqa", ODD, None, None, {1: 7.75}),
    ("dsv4_main_fp8", "kvfuse write_main_cache_gathered (cast only)", None, False, {65536: 30.5}),
    ("dsv4_main_fp8", FI_CAST, "kvfuse write_main_cache_gathered (cast only)", None, {65536: 26.25}),
], checks=[("dsv3_flashmla", VLLM_MLA, "100.00% of 1234 bytes equal (cache 100.00%)"),
           ("gqa", FI_PDL, "98.46% of 5678 bytes equal (k 96.92%, v 100.00%)")])


def side_rows(text):
    """The side-by-side tables' rows by group, a pair's named cells carried to its following lines:
    {group: [[engine, engine row, kvfuse row, PDL, n, kvfuse us, engine us, ratio, verdict, check]]}."""
    out, group, last = {}, None, None
    for line in section(text, benchmarks_md.SIDE_BY_SIDE).splitlines():
        m = re.match(r"^### .*\(`([^`]+)`\)$", line)
        if m:
            group = m.group(1)
            out[group] = []
        elif group and line.startswith("| ") and not line.startswith("| engine |"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cells[0]:
                last = cells[:4]
            out[group].append(last + cells[4:])
    return out


def test_side_by_side_puts_every_engine_row_beside_its_vs_row():
    text = benchmarks_md.render(make_report(MLA), "benchmarks/results/x.json", peers=PEERS,
                                peers_source="benchmarks/results/2027-01-02_h200_peers.json")
    got = side_rows(text)
    assert list(got) == ["dsv3_flashmla", "gqa", "dsv4_main_fp8"]          # the run's order
    d = got["dsv3_flashmla"]
    # n = 1: kvfuse 1.5 against vLLM's 2.0 wins; 256: 1.8 against 1.82 even (the check's size); 4096 loses
    assert d == [["vLLM 0.33.0", VLLM_MLA, KV_CAST, "off / as it launches", "1", "1.50", "2.00", "0.75", "**wins**", ""],
                 ["vLLM 0.33.0", VLLM_MLA, KV_CAST, "off / as it launches", "256", "1.80", "1.82", "0.99", "even",
                  "100.00% of 1234 bytes equal (cache 100.00%)"],
                 ["vLLM 0.33.0", VLLM_MLA, KV_CAST, "off / as it launches", "4096", "3.00", "2.50", "1.20", "loses", ""]]
    f = got["gqa"]
    fi_pdl = [r for r in f if r[1] == FI_PDL]
    assert fi_pdl[0][:9] == ["FlashInfer 0.7.2.post1", FI_PDL, KV_PDL, "on / on", "1", "1.25", "2.00", "0.62",
                             "**wins**"]
    assert fi_pdl[1][-1] == "98.46% of 5678 bytes equal (k 96.92%, v 100.00%)"
    assert fi_pdl[2][4:9] == ["4096", "skipped (n > 4096)", "30.50", "-", "-"]       # kvfuse's row skipped there
    fi_off = [r for r in f if r[1] == FI_OFF]
    assert fi_off[0][3:9] == ["off / off", "1", "1.50", "2.25 †", "0.67", "**wins**"]   # † : timed with events
    assert fi_off[1][-1] == "not checked"
    assert [r for r in f if r[1] == ODD] == [["not recorded", ODD, "-", "- / as it launches", "1", "-", "7.75", "-",
                                              "-", ""]]
    assert "kvfuse wins 1 of these 3 comparisons (1 even, 1 lost)." in text
    assert "kvfuse wins 5 of these 5 comparisons (0 even, 0 lost)." in text
    # the JSON's notes, and the layout note keyed by the row's name
    assert f"- `{LL}flashinfer rope_quantize_fp8_append_paged_kv_cache`: note of {FI_PDL}." in text
    assert f"- `{FI_CAST}`: note of {FI_CAST}; {benchmarks_md.ROW_NOTES[FI_CAST]}." in text
    # the groups the run lacks, and the command that measures them
    assert ("Groups of the harness this run lacks: A (`dsv4_flashmla`: DeepSeek V4, FLASHMLA_MODEL1 cache); C "
            "(`dsv4_main_fp4`") in text and "`bash .peers/run.sh --groups A,C,E,G,H` measures them." in text
    how = section(text, benchmarks_md.SIDE_BY_SIDE)
    for want in ("- Side-by-side result: `benchmarks/results/2027-01-02_h200_peers.json`", "date 2027-01-02",
                 "copy bandwidth 4.19 TB/s", "FlashInfer 0.7.2.post1, SGLang 0.5.23, vLLM 0.33.0 (the harness's README",
                 "`bash .peers/run.sh --groups D,F,B --big ''`", "nvcc for sm_90a",
                 "CUDA graph, median", "at n = 256", "groups D (`dsv3_flashmla`), F (`gqa`), B (`dsv4_main_fp8`)",
                 "not recorded (the JSON holds none; its log does)"):
        assert want in how, want
    assert "`benchmarks/results/2027-01-02_h200_peers.json`" in section(text, "How it was measured")


def test_a_peers_log_adds_the_software_and_names_a_check_partner_other_than_vs():
    log = "\n".join(["device: NVIDIA H200 | torch 9.9+test | triton 3.6.0 | kvfuse 0.1.0",
                     "tvm_ffi 0.1.11 | torch DLPack exchange API: True", "launch floor: 0.84 us (...)",
                     f"[check dsv3_flashmla n=256] {VLLM_MLA} vs kvfuse something else: "
                     "100.00% of 1234 bytes equal (cache 100.00%)",
                     f"[check gqa n=1] {FI_PDL} vs {KV_PDL}: 98.46% of 5678 bytes equal (k 96.92%, v 100.00%)"])
    text = benchmarks_md.render(make_report(MLA), peers=PEERS, peers_source="p.json", peers_log=log)
    how = section(text, benchmarks_md.SIDE_BY_SIDE)
    assert "NVIDIA H200; torch 9.9+test, Triton 3.6.0, kvfuse 0.1.0, apache-tvm-ffi 0.1.11;" in how
    assert "launch floor 0.84 us" in how and "date not recorded" in how
    got = side_rows(text)
    assert got["dsv3_flashmla"][1][-1] == \
        "100.00% of 1234 bytes equal (cache 100.00%) (against `kvfuse something else`)"
    fi_pdl = [r for r in got["gqa"] if r[1] == FI_PDL]
    assert fi_pdl[0][-1] == "98.46% of 5678 bytes equal (k 96.92%, v 100.00%)" and fi_pdl[1][-1] == ""   # n = 1


def test_releases_recorded_in_the_json_win_and_no_peers_run_says_so():
    peers = dict(PEERS, releases={"flashinfer": "FlashInfer 9.9", "vllm": "vLLM 8.8"})
    text = benchmarks_md.render(make_report(MLA), peers=peers, peers_source="p.json")
    assert "- Releases: FlashInfer 9.9, vLLM 8.8 (recorded in the JSON)." in text
    assert side_rows(text)["dsv3_flashmla"][0][0] == "vLLM 8.8"
    none = section(benchmarks_md.render(make_report(MLA)), benchmarks_md.SIDE_BY_SIDE)
    assert "No side-by-side result was given" in none and "|" not in none
    assert "(none given here)" in benchmarks_md.render(make_report(MLA))


def test_the_committed_side_by_side_tables_hold_every_engine_row_and_only_the_jsons_figures():
    """Every engine row of the committed peers JSON appears beside its vs row; every figure of the engine
    and kvfuse columns is that JSON's (formatted as rendered), every ratio and verdict follows from them."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    peers_source = re.search(r"^- Side-by-side result: `([^`]+)`", text, re.M).group(1)
    peers = json.loads((ROOT / peers_source).read_text())
    recs = {(r["group"], r["row"], r["n"]): r for r in peers["records"]}
    got = side_rows(text)
    seen = set()
    for group, table in got.items():
        for _, engine_row, vs, _, n, kv_us, engine_us, ratio, mark, _ in table:
            e = recs[(group, engine_row, int(n))]
            assert e["pdl"] is None and (e["vs"] or "-") == vs
            k = recs[(group, vs, int(n))]
            if e["status"] != "ok" or k["status"] != "ok":     # a size the harness skipped: said so, no ratio
                assert (engine_us if e["status"] != "ok" else kv_us).startswith("skipped"), (engine_row, n)
                assert ratio == mark == "-"
                seen.add((group, engine_row, int(n)))
                continue
            assert engine_us == benchmarks_md._us(e["gpu_us"]), (engine_row, n)
            assert kv_us == benchmarks_md._us(k["gpu_us"]), (vs, n)
            assert ratio == f"{k['gpu_us'] / e['gpu_us']:.2f}"
            assert mark.strip("*") == benchmarks_md.verdict(k["gpu_us"], e["gpu_us"])
            assert abs(e["ratio"] - e["gpu_us"] / k["gpu_us"]) < 1e-9         # the JSON's own ratio agrees
            seen.add((group, engine_row, int(n)))
    assert seen == {k for k, r in recs.items() if r["pdl"] is None}
    assert set(got) == {r["group"] for r in peers["records"]}
    for c in peers["checks"]:
        if c["row"] in {k[1] for k in seen}:
            assert c["result"] in section(text, benchmarks_md.SIDE_BY_SIDE)


def test_engine_time_targets_are_figures_of_a_committed_peers_run():
    """kvfuse.bench.ENGINE_TIME_TARGETS (the Targets section's engine column) quotes an engine row of a
    committed side-by-side JSON at every n."""
    held = {}
    for path in (ROOT / "benchmarks" / "results").glob("*_peers*.json"):
        for r in json.loads(path.read_text())["records"]:
            if r["pdl"] is None and r.get("gpu_us"):
                held.setdefault(r["row"], set()).add((r["n"], round(r["gpu_us"], 2)))
    for workload, (engine, times) in bench.ENGINE_TIME_TARGETS.items():
        assert any({(n, us) for n, us in times.items()} <= pairs for pairs in held.values()), (workload, engine)


def test_formats_section_from_a_gqa_formats_run():
    """The cache-formats section: every format of the run with its time, its ratio to fp8_e4m3 and % of copy,
    each target's verdict from the figures (1.2x at n = 1, 85% at 65536); without a run, the command."""
    rows = [dict(workload="qwen3_8b_fp8", n=n, format=f, gpu_us=us, pct_copy=pct, x_fp8=x)
            for f, n, us, pct, x in (("fp8_e4m3", 1, 2.0, 0.1, 1.0), ("fp8_e4m3", 65536, 400.0, 86.0, 1.0),
                                      ("nvfp4", 1, 2.6, 0.1, 1.3), ("nvfp4", 65536, 500.0, 70.0, 1.25))]
    formats = dict(copy_GBps=4000.0, device="GPU X", torch="2.x", date="2026-01-01", rows=rows)
    text = "\n".join(benchmarks_md._formats_section(formats, "benchmarks/results/f.json", False))
    assert "| `fp8_e4m3` | 2.00 | 400.00 | 86.0% | - | met |" in text
    assert "| `nvfp4` | 2.60 (1.30x) | 500.00 (1.25x) | 70.0% | missed | missed |" in text
    assert "`benchmarks/results/f.json`" in text and "PDL off" in text and "GPU X" in text
    empty = "\n".join(benchmarks_md._formats_section(None, None, None))
    assert "gqa_formats_bench.py --n 1,256,4096,65536" in empty



# ------------------------------------------------------------------ targets beside the engines and on the host
def beside(lines):
    """TargetLines as (target, rows, measured, verdict) tuples."""
    return [(t.target, t.rows, t.measured, t.verdict) for t in lines]


KV_BF16_PDL, KV_BF16_OFF = "[m] kvfuse store_kv [PDL]", "[m] kvfuse store_kv (PDL off)"


def test_decode_against_the_fastest_engine_row_paired_as_the_json_pairs_them():
    """A kvfuse [PDL] row against every engine row measured against it: the engines' [PDL] rows (its vs), an
    engine's row as it launches it (its vs: the "(PDL off)" twin), never an engine's "(PDL off)" row, however
    fast; met at equal times (no tolerance); a group without a kvfuse [PDL] row against an engine: not measured."""
    e1, e1_off = "[m] sglang one [PDL]", "[m] sglang one (PDL off)"
    e2, e3 = "[m] vllm two", "[m] flashinfer three [PDL]"
    peers = make_peers([
        ("gqa", KV_BF16_PDL, None, True, {1: 1.25, 256: 1.75, 4096: 9.0}),
        ("gqa", KV_BF16_OFF, None, False, {1: 1.5, 256: 2.0}),
        ("gqa", e1, KV_BF16_PDL, None, {1: 2.0, 256: 2.0}),
        ("gqa", e1_off, KV_BF16_OFF, None, {1: 0.5, 256: 0.5}),          # faster, but without PDL: not the target's
        ("gqa", e2, KV_BF16_OFF, None, {1: 1.1, 256: 3.0}),              # no PDL variant: as the engine launches it
        ("gqa", e3, KV_BF16_PDL, None, {1: 1.5, 256: 2.5}),
        ("gqa", "kvfuse lonely [PDL]", None, True, {1: 1.0}),            # no engine against it: no line
        ("gqa", "kvfuse even [PDL]", None, True, {1: 2.0, 256: "skipped"}),
        ("gqa", "vllm even [PDL]", "kvfuse even [PDL]", None, {1: 2.0, 256: 3.0}),
        ("dsv3_flashmla", KV_CAST, None, False, {1: 1.5}),
        ("dsv3_flashmla", VLLM_MLA, KV_CAST, None, {1: 2.0}),
    ])
    assert benchmarks_md.pdl_engine_rows(peers) == [("gqa", KV_BF16_PDL, [e1, e2, e3]),
                                                     ("gqa", "kvfuse even [PDL]", ["vllm even [PDL]"])]
    got = beside(benchmarks_md.engine_decode_lines(peers))
    assert got == [
        ("1. decode vs the engines, n = 1", f"`gqa`: `{KV_BF16_PDL}` vs `{e2}` (fastest of 3)",
         f"1.25 us vs 1.10 us ({1.25 / 1.1:.2f}x)", "missed"),
        ("1. decode vs the engines, n = 256", f"`gqa`: `{KV_BF16_PDL}` vs `{e1}` (fastest of 3)",
         "1.75 us vs 2.00 us (0.88x)", "met"),
        ("1. decode vs the engines, n = 1", "`gqa`: `kvfuse even [PDL]` vs `vllm even [PDL]`",
         "2.00 us vs 2.00 us (1.00x)", "met"),
        ("1. decode vs the engines, n = 256", "`gqa`: `kvfuse even [PDL]`", "kvfuse not timed at n = 256",
         "not measured"),
        ("1. decode vs the engines", "`dsv3_flashmla`", "no kvfuse [PDL] row measured against an engine row",
         "not measured")]
    assert beside(benchmarks_md.engine_decode_lines(None))[0][3] == "not measured"
    # a miss by less than 0.5%: the ratio never prints as 1.00x
    assert benchmarks_md._beside(1.3584, 1.3581) == ("1.36 us vs 1.36 us (1.0002x)", "missed")


def test_floor_and_large_n_targets_from_the_full_run():
    """Target 2: every cache write (MLA and GQA, not a group or a Q call) at n = 1 over the run's floor;
    target 3: MAIN_FP4 and every *index_k at 262144, the GQA writes with QK-norm (from the models) at 65536."""
    pts = [("main_fp8_gptj", 1, "fused", 1.0), ("dsv4_main_fp4", 1, "fused", 2.0), ("llama3_8b_fp8", 1, "fused", 1.5),
           ("group_dsv4_q_kv", 1, "fused", 1.0), ("dsv4_q", 1, "fused", 1.0),
           ("dsv4_main_fp4", 262144, "fused", _at_pct("dsv4_main_fp4", 262144, 70.0)),
           ("dsv32_index_k", 262144, "fused", _at_pct("dsv32_index_k", 262144, 90.0)),
           ("dsv4_index_k", 65536, "fused", 20.0),
           ("qwen3_8b_fp8", 65536, "fused", _at_pct("qwen3_8b_fp8", 65536, 86.0)),
           ("gemma3_12b_fp8", 65536, "fused", _at_pct("gemma3_12b_fp8", 65536, 80.0)),
           ("llama3_8b_fp8", 65536, "fused", _at_pct("llama3_8b_fp8", 65536, 50.0))]
    report = make_report(pts, pdl=True)
    floor = [t for t in beside(benchmarks_md.floor_lines(report))]
    target = "2. decode <= 1.3x the launch floor, n = 1"
    assert floor == [(target, "`main_fp8_gptj`", f"1.00 us / 0.87 us = {1.0 / 0.87:.2f}x", "met"),
                     (target, "`dsv4_main_fp4`", f"2.00 us / 0.87 us = {2.0 / 0.87:.2f}x", "missed"),
                     (target, "`dsv32_index_k`", "not timed at n = 1", "not measured"),
                     (target, "`dsv4_index_k`", "not timed at n = 1", "not measured"),
                     (target, "`llama3_8b_fp8`", f"1.50 us / 0.87 us = {1.5 / 0.87:.2f}x", "missed"),
                     (target, "`qwen3_8b_fp8`", "not timed at n = 1", "not measured"),
                     (target, "`gemma3_12b_fp8`", "not timed at n = 1", "not measured")]
    no_floor = dict(report, device=dict(report["device"], floor_us=None))
    assert {t.verdict for t in benchmarks_md.floor_lines(no_floor)} == {"not measured"}
    got = {t.rows: (t.target, t.measured, t.verdict) for t in benchmarks_md.pct_copy_lines(report)}
    assert got == {
        "`dsv4_main_fp4` (>= 80%)": ("3. MAIN_FP4 % of copy at 262144", "70.0% "
                                    f"({benchmarks_md._us(_at_pct('dsv4_main_fp4', 262144, 70.0))} us)", "missed"),
        "`dsv32_index_k` (>= 85%)": ("3. indexer K % of copy at 262144", "90.0% "
                                    f"({benchmarks_md._us(_at_pct('dsv32_index_k', 262144, 90.0))} us)", "met"),
        "`dsv4_index_k` (>= 85%)": ("3. indexer K % of copy at 262144", "not timed at n = 262144", "not measured"),
        "`qwen3_8b_fp8` (>= 85%)": ("3. GQA with QK-norm % of copy at 65536", "86.0% "
                                   f"({benchmarks_md._us(_at_pct('qwen3_8b_fp8', 65536, 86.0))} us)", "met"),
        "`gemma3_12b_fp8` (>= 85%)": ("3. GQA with QK-norm % of copy at 65536", "80.0% "
                                     f"({benchmarks_md._us(_at_pct('gemma3_12b_fp8', 65536, 80.0))} us)", "missed")}
    # llama3_8b_fp8 (no QK-norm) is not a target of the GQA line; a run without these workloads: not measured
    assert not bench.WORKLOADS["llama3_8b_fp8"].gqa.qk_norm and bench.WORKLOADS["qwen3_8b_fp8"].gqa.qk_norm
    lacking = beside(benchmarks_md.pct_copy_lines(make_report([("main_fp8_gptj", 1, "fused", 1.0)])))
    assert [t[2:] for t in lacking] == [("not in the run", "not measured")] * 3


def test_the_cast_alone_against_flashinfer_at_every_n():
    sg = "sglang some cast"
    peers = make_peers([
        ("dsv4_main_fp8", KV_CAST, None, False, {1: 1.0, 4096: 3.0, 65536: 30.5}),
        ("dsv4_main_fp8", FI_CAST, KV_CAST, None, {1: 1.2, 4096: "skipped", 65536: 26.25}),
        ("dsv4_main_fp8", sg, KV_CAST, None, {1: 0.5, 65536: 0.5}),              # not FlashInfer's: not the target's
    ])
    rows = f"`dsv4_main_fp8`: `{KV_CAST}`"
    assert beside(benchmarks_md.cast_lines(peers)) == [
        ("4. the cast alone vs FlashInfer, n = 1", f"{rows} vs `{FI_CAST}`", "1.00 us vs 1.20 us (0.83x)", "met"),
        ("4. the cast alone vs FlashInfer, n = 4096", rows, "not timed at n = 4096", "not measured"),
        ("4. the cast alone vs FlashInfer, n = 65536", f"{rows} vs `{FI_CAST}`",
         f"30.50 us vs 26.25 us ({30.5 / 26.25:.2f}x)", "missed")]
    for lacking in (None, make_peers([("dsv4_main_fp8", KV_CAST, None, False, {1: 1.0})])):
        assert [t.verdict for t in benchmarks_md.cast_lines(lacking)] == ["not measured"]


def test_host_time_of_every_kvfuse_call_at_n_1():
    host = dict(meta=dict(device="GPU X", date="2027-01-01", pdl=False), rows=[
        dict(call="floor: torch add_ (one element)", n=1, host_us_cache_on=5.5, gpu_us=1.0),
        dict(call="kvfuse bench a", n=1, host_us_cache_on=7.5, gpu_us=1.5),
        dict(call="kvfuse bench b", n=1, host_us_cache_on=8.0, gpu_us=1.5),
        dict(call="vllm.reshape_and_cache_flash (x)", n=1, host_us_cache_on=8.01, gpu_us=1.25),
        dict(call="kvfuse bench a", n=256, host_us_cache_on=30.0, gpu_us=3.0)])
    target = "5. host time <= 8 us, n = 1"
    assert beside(benchmarks_md.host_lines(host)) == [
        (target, "`kvfuse bench a`", "7.50 us (GPU 1.50 us)", "met"),
        (target, "`kvfuse bench b`", "8.00 us (GPU 1.50 us)", "met"),
        (target, "`vllm.reshape_and_cache_flash (x)`", "8.01 us (GPU 1.25 us)", "missed")]
    assert beside(benchmarks_md.host_lines(None)) == [(target, "every kvfuse call", "no host-time run", "not measured")]
    floors_only = dict(host, rows=host["rows"][:1])
    assert [t.verdict for t in benchmarks_md.host_lines(floors_only)] == ["not measured"]
    # with the run's own Triton launch among its references, each call also as a multiple of it
    with_triton = dict(host, rows=[dict(call="floor: a one-program Triton kernel", n=1, host_us_cache_on=5.0,
                                        gpu_us=0.9)] + host["rows"])
    assert [t.measured for t in benchmarks_md.host_lines(with_triton)] == [
        "7.50 us (GPU 1.50 us, 1.50x the Triton launch)", "8.00 us (GPU 1.50 us, 1.60x the Triton launch)",
        "8.01 us (GPU 1.25 us, 1.60x the Triton launch)"]


def test_engine_figures_from_a_committed_side_by_side_run():
    line = benchmarks_md.peers_run_line(PEERS, "benchmarks/results/2027-01-02_h200_peers.json")
    assert line.verdict == "met" and line.rows == "`benchmarks/results/2027-01-02_h200_peers.json`"
    assert "5 engine rows, groups `dsv3_flashmla`, `gqa`, `dsv4_main_fp8`" in line.measured
    assert benchmarks_md.peers_run_line(PEERS, "/tmp/peers.json").verdict == "missed"
    assert benchmarks_md.peers_run_line(None, None).verdict == "not measured"


def test_beside_targets_section_names_its_sources_and_counts_the_verdicts():
    host = dict(meta=dict(device="GPU X", date="2027-01-01", pdl=False), rows=[
        dict(call="floor: a one-program Triton kernel", n=1, host_us_cache_on=7.25, gpu_us=0.9),
        dict(call="kvfuse bench a", n=1, host_us_cache_on=7.5, gpu_us=1.5)])
    report = make_report([("main_fp8_gptj", 1, "fused", 1.0)], pdl=True)
    text = benchmarks_md.render(report, "benchmarks/results/x_full_bench.json", peers=PEERS,
                                peers_source="benchmarks/results/y_peers.json", host=host,
                                host_source="benchmarks/results/z_eager_host_time.json")
    part = section(text, benchmarks_md.BESIDE_TARGETS)
    lines = benchmarks_md.beside_target_lines(report, PEERS, "benchmarks/results/y_peers.json", host)
    assert "| target | rows | measured | verdict |" in part
    for t in lines:
        assert f"| {t.target} | {t.rows} | {t.measured} | {'**missed**' if t.verdict == 'missed' else t.verdict} |" \
            in part
    met, missed = (sum(t.verdict == v for t in lines) for v in ("met", "missed"))
    assert f"{met} of {len(lines)} met ({missed} missed, {len(lines) - met - missed} not measured)." in part
    assert met and missed and len(lines) - met - missed
    assert {t.target[:2] for t in lines} == {f"{i}." for i in range(1, 7)}
    for want in ("Source: `benchmarks/results/y_peers.json`", "Source: `benchmarks/results/x_full_bench.json`",
                 "Source: `benchmarks/results/z_eager_host_time.json` (GPU X, 2027-01-01, PDL off)",
                 "its reference launches: a one-program Triton kernel 7.25 us"):
        assert want in part, want
    assert "session" not in part.lower() and not re.search(r"#\d", part)
    none = section(benchmarks_md.render(report), benchmarks_md.BESIDE_TARGETS)
    assert "Source: no host-time JSON" in none and "Source: no side-by-side JSON" in none


def test_beside_targets_take_the_gqa_figures_from_the_gqa_run_when_one_is_given():
    """--gqa: the GQA writes' floor and % of copy targets use the later run's figures (named as their source),
    the DeepSeek writes the full run's."""
    main = make_report([("main_fp8_gptj", 1, "fused", 1.0), ("qwen3_8b_fp8", 1, "fused", 9.87),
                        ("qwen3_8b_fp8", 65536, "fused", 999.0)], pdl=True)
    later = make_report([("qwen3_8b_fp8", 1, "fused", 1.5),
                         ("qwen3_8b_fp8", 65536, "fused", _at_pct("qwen3_8b_fp8", 65536, 90.0))], pdl=True)
    floor = {t.rows: t.measured for t in benchmarks_md.floor_lines(main, later)}
    assert floor == {"`main_fp8_gptj`": f"1.00 us / 0.87 us = {1.0 / 0.87:.2f}x",
                     "`qwen3_8b_fp8`": f"1.50 us / 0.87 us = {1.5 / 0.87:.2f}x"}
    pct = {t.rows: (t.measured, t.verdict) for t in benchmarks_md.pct_copy_lines(main, later)}
    assert pct["`qwen3_8b_fp8` (>= 85%)"][0].startswith("90.0% ") and pct["`qwen3_8b_fp8` (>= 85%)"][1] == "met"
    text = benchmarks_md.render(main, "benchmarks/results/a.json", later, "benchmarks/results/b.json")
    part = section(text, benchmarks_md.BESIDE_TARGETS)
    assert "Source: `benchmarks/results/a.json` (the GQA workloads: `benchmarks/results/b.json`)." in part
    assert "9.87" not in text and "999" not in text
