"""The ``graphrt validate`` subcommand: its arguments, its run and its printed report.

    graphrt validate FILE.py:FUNC [--sizes 1,8,64] [--device cpu|cuda] [--json -|PATH]

The analysis itself is ``graphrt.cli.validate``. Exit 0: no error findings; 1: error
findings; 2: one line on stderr (bad arguments, a target that cannot be loaded or crashes).

Graph safety: host-only.
"""
from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import replace


def add_parser(sub) -> None:
    """Add the ``validate`` subparser to ``sub`` (an argparse subparsers action)."""
    v = sub.add_parser("validate", help="check a step for graph hazards (exit 0 safe, 1 findings, "
                       "2 cannot load)", description="Analyse FUNC(device)'s StepSpec at each "
                       "size; on CUDA also capture it and compare replay with eager.")
    v.add_argument("target", metavar="TARGET", help="FILE.py:FUNC or pkg.module:FUNC, where "
                   "FUNC(device: torch.device) -> graphrt.StepSpec")
    v.add_argument("--sizes", default=None, help="comma-separated batch sizes (default: 1,8,64 "
                   "clipped to the step's max_batch_size)")
    v.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available, "
                   "else cpu; cpu flags what would sync or bake on a GPU)")
    v.add_argument("--json", default=None, metavar="-|PATH", help="also write the JSON report: "
                   "'-' prints only JSON on stdout, PATH writes a file")


def print_report(result, stream=None) -> None:
    """A ``Validation`` as a table (rich on a terminal, plain otherwise) and a verdict line."""
    from graphrt.capture.report import SafetyReport
    from graphrt.cli.validate import show_path
    stream = stream or sys.stdout
    shown = SafetyReport([replace(f, file=show_path(f.file)) for f in result.report.findings])
    if stream.isatty():
        from rich.console import Console
        shown.print_rich(Console(file=stream))
    else:
        print(shown.table(), file=stream)
    errors = len(result.report.errors)
    verdict = f"NOT graph-safe: {errors} error finding(s)" if errors else "graph-safe"
    print(f"{result.target} on {result.device}, sizes {','.join(map(str, result.sizes))}: "
          f"{verdict}", file=stream)


def run(args) -> int:
    """``graphrt validate``: exit 0 safe, 1 error findings, 2 one line on stderr."""
    from graphrt.cli.validate import ValidateError, parse_sizes, validate
    to_stdout = args.json == "-"
    quiet = contextlib.redirect_stdout(sys.stderr) if to_stdout else contextlib.nullcontext()
    try:
        with quiet:  # with --json -, stdout carries only JSON: the step's prints go to stderr
            result = validate(args.target, parse_sizes(args.sizes), args.device)
    except ValidateError as exc:
        print(f"graphrt validate: {exc}", file=sys.stderr)
        return 2
    doc = json.dumps(result.to_dict(), indent=2)
    if to_stdout:
        print(doc)
        return result.exit_code
    print_report(result)
    if args.json:
        try:
            with open(args.json, "w") as fh:
                fh.write(doc + "\n")
        except OSError as exc:
            print(f"graphrt validate: cannot write --json {args.json!r}: {exc.strerror}",
                  file=sys.stderr)
            return 2
    return result.exit_code
