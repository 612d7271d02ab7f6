"""The ``kvfuse`` command: ``kvfuse demo`` (the KV-cache format explorer; ``kvfuse demo --model NAME``
runs a model configuration's call sites, see kvfuse.models) and ``kvfuse bench``."""
from __future__ import annotations

import argparse
import sys
import textwrap

from . import __version__

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
    if command == "demo":
        from .demo import main as run
    else:
        from .bench import main as run
    try:
        return run(argv[1:]) or 0
    except SystemExit as exc:  # argparse's --help / usage errors: an exit status, not an exception
        return exc.code if isinstance(exc.code, int) else 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
