"""``python -m graphrt.bench`` (e.g. under ``torchrun``): the same as ``graphrt bench``, through
the same entry point (one line and exit 2 for a bad flag or ``GRAPHRT_*`` value, 141 when the
reader of stdout goes away)."""
import sys

from graphrt.cli.main import main

raise SystemExit(main(["bench", *sys.argv[1:]]))
