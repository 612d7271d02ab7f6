"""``python -m kvfuse.bench [options]``: the same as ``kvfuse bench [options]``."""
import sys

from .cli import main

sys.exit(main(sys.argv[1:]))
