"""README.md's performance summary is exactly what benchmarks/perf_summary.py renders from the latest
benchmark JSON (regenerate with `python benchmarks/perf_summary.py --write` after a new run)."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _module():
    spec = importlib.util.spec_from_file_location("perf_summary", ROOT / "benchmarks" / "perf_summary.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_quotes_the_latest_benchmark():
    ps = _module()
    report = json.loads(ps.LATEST.read_text())
    assert ps.readme_block((ROOT / "README.md").read_text()) == ps.render(report)


def test_every_row_of_the_summary_was_measured():
    ps = _module()
    report = json.loads(ps.LATEST.read_text())
    measured = {(r["workload"], r["n"]) for r in report["results"] if r["status"] == "ok"}
    sizes = {n for _, n in measured}
    for _, wl, preset in ps.ROWS:
        for w in filter(None, (wl, preset)):
            assert {(w, n) for n in sizes} <= measured, w
