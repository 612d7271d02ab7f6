"""README.md's performance summary is exactly what benchmarks/perf_summary.py renders from the latest
benchmark JSON (regenerate with `python benchmarks/perf_summary.py --write` after a new run)."""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import perf_summary as ps  # noqa: E402  (the generator is a script of benchmarks/)
LATEST = ROOT / ps.SOURCE


def test_readme_quotes_the_latest_benchmark():
    report = json.loads(LATEST.read_text())
    assert ps.readme_block((ROOT / "README.md").read_text()) == ps.render(report)


def test_every_row_of_the_summary_was_measured():
    report = json.loads(LATEST.read_text())
    measured = {(r["workload"], r["n"]) for r in report["results"] if r["status"] == "ok" and r["peer"] == "fused"}
    for label, names in ps.ROWS:
        wl = ps._measured(report, names)
        assert wl is not None, label
        assert {(wl, n) for n in (1, 256, 4096)} <= measured, wl     # decode and prefill, at least


def _new_style_report(slots="paged", regime="auto"):
    """A report as kvfuse bench now writes it (input regime, slots, bytes from the inputs), with
    made-up timings for every workload the summary quotes, through JSON."""
    from kvfuse import bench
    names = [names[0] for _, names in ps.ROWS]
    cfg = bench.parse_config(["--workloads", ",".join(names), "--n", "1,4096", "--peers", "fused",
                              "--slots", slots, "--regime", regime])
    recs = []
    for w in names:
        for n in cfg.sizes:
            detail = bench.moved_bytes(bench.WORKLOADS[w], n)
            recs.append(bench.finalize(bench.Record(workload=w, n=n, peer="fused", rows=n, bytes=detail["total"],
                                                    gpu_us=1.5 + n * 1e-3, gpu_method="graph", eager_us=20.0,
                                                    regime=bench.input_regime(n, regime), slots=slots,
                                                    bytes_detail=detail), 4000.0, 1.0))
    info = {"device": "NVIDIA H200", "torch": "2.11.0+cu130", "triton": "3.6.0", "date": "2027-01-01T00:00:00+00:00"}
    report = bench.build_report(cfg, info, {"copy_GBps": 4000.0, "floor_us": 0.9}, recs, [], 1.0)
    return json.loads(json.dumps(report))


def test_summary_renders_old_and_new_result_files():
    """Files written before the input regimes render as before ("random slots"); new files say which
    slots and regime they measured."""
    old_file = ROOT / "benchmarks" / "results" / "2026-12-01_h200_models_bench.json"   # before the regimes
    assert "median, random slots)" in ps.render(json.loads(old_file.read_text()))
    latest = ps.render(json.loads(LATEST.read_text()))
    assert ("median, paged slots, decode inputs for n <= 256 and prefill inputs above, programmatic dependent "
            "launch)") in latest
    new = ps.render(_new_style_report())
    assert "median, paged slots, decode inputs for n <= 256 and prefill inputs above)" in new
    assert f"| DeepSeek V4 main cache (MAIN_FP8, GPT-J) | `main_fp8_gptj` | {1.5 + 1e-3:.2f} / {1.5 + 4.096:.2f} |" in new
    assert "programmatic dependent launch" not in new and "programmatic dependent launch" in latest


def test_summary_quotes_the_older_name_of_a_call():
    """A run without the preset-named workload quotes the model's own name for the same call; a call the
    run never measured shows dashes."""
    old = json.loads((ROOT / "benchmarks" / "results" / "2026-12-01_h200_models_paged_bench.json").read_text())
    text = ps.render(old)
    assert "| DeepSeek V4 main cache (MAIN_FP8, GPT-J) | `dsv4_main_fp8` | " in text
    assert "| DeepSeek V4 Q (64 heads of 512, RMSNorm, GPT-J, bf16 out) | - | - / - / - / - | - |" in text
    assert "random slots, prefill inputs)" in ps.render(_new_style_report("random", "prefill"))
