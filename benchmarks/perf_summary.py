"""Render README.md's performance summary from the latest benchmark result (a JSON written by
``kvfuse bench``; kvfuse.perf_summary renders it), so that the README quotes exactly what was measured.

    python benchmarks/perf_summary.py            # print the block
    python benchmarks/perf_summary.py --write    # replace the block in README.md

tests/test_perf_summary.py fails when README.md and the JSON disagree.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvfuse import perf_summary  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write", action="store_true", help="replace the block in README.md")
    args = p.parse_args(argv)
    block = perf_summary.render(json.loads((ROOT / perf_summary.SOURCE).read_text()))
    if args.write:
        readme = ROOT / "README.md"
        text = readme.read_text()
        readme.write_text(text.replace(perf_summary.readme_block(text), block))
    else:
        print(block)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
