"""The ``kvfuse`` command: ``kvfuse demo`` (the KV-cache format explorer; ``kvfuse demo --model NAME``
runs a model configuration's call sites, see kvfuse.models) and ``kvfuse bench``."""
from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="kvfuse", description=__doc__)
    parser.add_argument("command", choices=("demo", "bench"), help="what to run")
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    args, rest = parser.parse_known_args(argv[:1])[0], argv[1:]
    if args.command == "demo":
        from .demo import main as run
    else:
        from .bench import main as run
    try:
        return run(rest) or 0
    except SystemExit as exc:  # argparse's --help / usage errors: an exit status, not an exception
        return exc.code if isinstance(exc.code, int) else 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
