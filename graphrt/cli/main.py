"""The ``graphrt`` command: ``validate``, ``demo``, ``bench``.

    graphrt validate FILE.py:FUNC [--sizes 1,8,64] [--device cpu|cuda] [--json -|PATH]
    graphrt demo  [--config dsv3-like] [--layers N] [--experts N] [--steps 300] [--max-bs 256]
    graphrt bench [--config ...] [--sizes 1,8,64] [--modes graph,eager] [--comm local|deepep|nccl]

``demo`` and ``bench`` import ``graphrt.cli.demo`` / ``graphrt.bench.run`` only when run and call
their ``main(args)``; importing this module imports no triton, deep_ep or deep_gemm.
Bad arguments print one line on stderr and exit 2.

Graph safety: host-only.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from graphrt.cli import validate_cmd


class _Parser(argparse.ArgumentParser):
    """argparse, but an argument error is one line on stderr and exit 2 (no usage block)."""

    def error(self, message):
        print(f"{self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def _ints(text: str) -> list[int]:
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated ints >= 1, got {text!r}")
    return values


def _names(text: str) -> list[str]:
    values = [s.strip() for s in text.split(",") if s.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated names, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="graphrt", description="CUDA-graph-first MoE decode runtime.")
    sub = p.add_subparsers(dest="command", metavar="{validate,demo,bench}", parser_class=_Parser)

    validate_cmd.add_parser(sub)

    d = sub.add_parser("demo", help="capture and run the reference MoE model in a decode loop")
    d.add_argument("--config", default="dsv3-like", help="model preset (default: dsv3-like)")
    d.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    d.add_argument("--experts", type=int, default=None, help="override the preset's expert count")
    d.add_argument("--steps", type=int, default=300, help="decode steps to run (default: 300)")
    d.add_argument("--max-bs", type=int, default=256, help="largest captured batch (default: 256)")
    d.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")

    b = sub.add_parser("bench", help="replay microbenchmarks")
    b.add_argument("--config", default="dsv3-like", help="model preset (default: dsv3-like)")
    b.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    b.add_argument("--experts", type=int, default=None, help="override the preset's expert count")
    b.add_argument("--sizes", type=_ints, default=None, help="comma-separated batch sizes (a list of ints)")
    b.add_argument("--modes", type=_names, default=None, help="comma-separated modes (a list of names)")
    b.add_argument("--comm", choices=("local", "deepep", "nccl"), default="local",
                   help="expert-parallel backend (default: local)")
    b.add_argument("--out", default=None, metavar="DIR", help="folder for results")
    b.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    b.add_argument("--suite", type=_names, default=None, help="comma-separated suites: runtime, "
                   "modes, moe (default: runtime,modes; modes only with --comm deepep|nccl)")
    b.add_argument("--fp8", action="store_true", help="fp8 experts (DeepGEMM); moe also runs bf16")
    return p


def _run_module(name: str, args) -> int:
    """Import the subcommand's module now (it may pull in triton/deep_ep) and call ``main(args)``."""
    path = {"demo": "graphrt.cli.demo", "bench": "graphrt.bench.run"}[name]
    try:
        module = importlib.import_module(path)
    except ImportError as exc:
        missing = getattr(exc, "name", None)
        why = ("is not available in this install" if missing == path
               else f"cannot be imported: {type(exc).__name__}: {str(exc).splitlines()[0]}")
        print(f"graphrt {name}: {path} {why}", file=sys.stderr)
        return 2
    rc = module.main(args)
    return int(rc or 0)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``graphrt`` console script and ``python -m graphrt``."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help exits 0; bad arguments exit 2 after one line
        return int(exc.code or 0)
    if args.command is None:
        print("graphrt: missing command: validate, demo or bench (see graphrt --help)",
              file=sys.stderr)
        return 2
    if args.command == "validate":
        return validate_cmd.run(args)
    return _run_module(args.command, args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
