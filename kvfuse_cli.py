"""The ``kvfuse`` command's entry point: the top-level parser, ``--version`` and ``--help``, then
``kvfuse demo`` / ``kvfuse bench`` handed to :mod:`kvfuse.demo` / :mod:`kvfuse.bench`.

Why a top-level module beside the package: ``import kvfuse`` imports torch and Triton and registers
the custom ops (seconds), and any ``kvfuse.*`` module runs that first. Here the console script imports
only argparse, so ``kvfuse --version`` and ``kvfuse --help`` answer at Python's start-up cost; the
package is imported when a command runs (a command's own ``--help`` included: its options come from
the package's tables). The version is a literal for the same reason (kvfuse/_version.py would import
the package; importlib.metadata reads the installed copy, stale in a checkout);
tests/test_cli.py holds it equal to pyproject's and ``kvfuse.__version__``. :mod:`kvfuse.cli`
re-exports this module for ``python -m kvfuse.cli`` and ``from kvfuse import cli``.
"""
from __future__ import annotations

import argparse
import sys
import textwrap

__version__ = "0.1.0"

COMMANDS = {
    "demo": "KV-cache format explorer: writes a synthetic (or --input) MLA batch through every cache format, "
            "reads it back and prints bytes/token, relative error and top-k recall; writes a CSV and a PNG chart. "
            "CPU by default, CUDA when present.",
    "bench": "Times the fused KV write against the eager reference, torch.compile and kvfuse stage by stage "
             "(needs a CUDA device; elsewhere it says so and exits 0).",
}


def build_parser() -> argparse.ArgumentParser:
    width = max(map(len, COMMANDS))
    listing = "\n".join(textwrap.fill(text, 100, initial_indent=f"  {name:<{width}}  ",
                                      subsequent_indent=" " * (width + 4)) for name, text in COMMANDS.items())
    parser = argparse.ArgumentParser(
        prog="kvfuse", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="kvfuse: fused RMSNorm -> RoPE -> Hadamard -> FP8/FP4 quantization -> paged KV-cache write.",
        epilog=f"commands:\n{listing}\n\n'kvfuse COMMAND --help' lists a command's options.")
    parser.add_argument("--version", action="version", version=f"kvfuse {__version__}")
    parser.add_argument("command", choices=tuple(COMMANDS), metavar="COMMAND", help="demo or bench (see below)")
    return parser


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    if not argv:
        parser.print_help()
        return 0
    try:  # the first word only: the rest belongs to the command's own parser
        command = parser.parse_args(argv[:1]).command
    except SystemExit as exc:  # --help, --version, an unknown command
        return exc.code if isinstance(exc.code, int) else 2
    if command == "demo":  # the package (torch, Triton, the custom ops) from here on
        from kvfuse.demo import main as run
    else:
        from kvfuse.bench import main as run
    try:
        return run(argv[1:]) or 0
    except SystemExit as exc:  # argparse's --help / usage errors: an exit status, not an exception
        return exc.code if isinstance(exc.code, int) else 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
