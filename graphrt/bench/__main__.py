"""``python -m graphrt.bench`` (e.g. under ``torchrun``): the same as ``graphrt bench``."""
import sys

from graphrt.cli.main import build_parser
from graphrt.bench.run import main

raise SystemExit(main(build_parser().parse_args(["bench", *sys.argv[1:]])))
