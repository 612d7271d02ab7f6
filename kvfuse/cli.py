"""``kvfuse.cli``: the ``kvfuse`` command under the package's name (``python -m kvfuse.cli``,
``from kvfuse import cli``). The command lives in the top-level module :mod:`kvfuse_cli`, which the
console script runs without importing the package (its docstring says why)."""
from __future__ import annotations

import sys

from kvfuse_cli import COMMANDS, build_parser, main

__all__ = ["COMMANDS", "build_parser", "main"]

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
