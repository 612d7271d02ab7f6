"""Render BENCHMARKS.md (repository root) from ONE ``kvfuse bench`` result JSON: kvfuse's figures from
that run beside the engines' kernels (the tables and the rules: kvfuse/bench_report.py).

    python benchmarks/benchmarks_md.py RESULT.json            # write BENCHMARKS.md
    python benchmarks/benchmarks_md.py RESULT.json --stdout   # print it instead
    python benchmarks/benchmarks_md.py RESULT.json --check    # exit 1 when BENCHMARKS.md differs
    python benchmarks/benchmarks_md.py RESULT.json --gqa GQA.json   # the GQA / MHA section from a later run
    python benchmarks/benchmarks_md.py RESULT.json --group G.json   # the Grouped section from a later run

Without RESULT.json: the latest H200 result under benchmarks/results/ (DEFAULT below).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvfuse.bench_report import render  # noqa: E402

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
